"""RMSNorm in plain PyTorch (autograd through PyTorch)."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> torch.Tensor:
    """``y = x / sqrt(mean(x**2) + eps) * (offset + weight)`` over the last dimension.

    ``llama``: normalise in fp32, cast to ``x.dtype``, then multiply by the weight (Hugging Face's
    LlamaRMSNorm). ``gemma``: everything in fp32, one cast at the end. The result has ``x.dtype``.
    In float64 both modes are the exact formula, which is how the tests use it as a reference.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(compute) + offset
    if casting_mode == "llama":
        xhat = xhat.to(x.dtype).to(compute)
    return (xhat * w).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual; (rms_norm(s, ...), s)``: the pre-norm residual step of a decoder layer.

    Exactly the unfused code (Hugging Face: ``residual = residual + hidden; hidden = norm(residual)``):
    the sum is added in fp32 and rounded to ``x.dtype`` (what PyTorch's half-precision add does), and
    the normalisation reads that rounded sum. Autograd gives ``x`` and ``residual`` the same
    gradient: rms_norm's dx plus the gradient that reached ``s``.
    """
    s = x + residual
    return rms_norm(s, weight, eps, offset, casting_mode), s
