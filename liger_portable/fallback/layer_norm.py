"""LayerNorm in plain PyTorch (autograd through PyTorch)."""

from __future__ import annotations

import torch


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension.

    ``var`` is the biased variance (divided by the row length), as ``torch.nn.functional.layer_norm``.
    Computed in fp32 (float64 for float64 inputs) from the centred values, one cast to ``x.dtype``
    at the end; in float64 it is the exact formula, which is how the tests use it as a reference.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    xc = xf - xf.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)
