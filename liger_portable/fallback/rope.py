"""Rotary position embedding in plain PyTorch (autograd through PyTorch)."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` for x in (q, k),
    cos/sin of shape ``(1 or batch, >= seq, head_dim)`` unsqueezed at ``unsqueeze_dim`` (1 for
    ``(batch, heads, seq, head_dim)``, 2 for ``(batch, seq, heads, head_dim)``); positions past q's
    sequence length are ignored. ``position_ids`` is ignored, as in Hugging Face.

    Computed in fp32 (float64 for float64 inputs) and rounded once to each input's dtype, as the
    kernel does (Hugging Face's eager code rounds after each product in bf16/fp16). cos and sin
    get no gradient. In float64 this is the exact formula, which is how the tests use it.
    """
    seq = q.shape[2 if unsqueeze_dim == 1 else 1]
    cos = cos.detach()[:, :seq].unsqueeze(unsqueeze_dim)
    sin = sin.detach()[:, :seq].unsqueeze(unsqueeze_dim)

    def apply(x: torch.Tensor) -> torch.Tensor:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(compute)
        return (xf * cos.to(compute) + _rotate_half(xf) * sin.to(compute)).to(x.dtype)

    return apply(q), apply(k)
