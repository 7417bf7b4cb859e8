"""Public functional API, shaped like ``torch.nn.functional``.

Each function checks its arguments, then dispatches by the tensors' device: tensors on the
detected GPU backend run the Triton kernels with the launch config resolved for that device;
CPU tensors (and the ``cpu`` backend) run the pure-PyTorch fallback with the same semantics.
"""

from __future__ import annotations

import importlib.util

import torch

from . import fallback
from ._checks import KERNEL_DTYPES, check_choice, check_float, check_nonneg_number
from ._dispatch import same_device, use_kernels

# Triton has Linux wheels only; without it every call takes the fallback.
if importlib.util.find_spec("triton") is not None:
    from .ops import rms_norm as _rms_norm_ops
    # @ops-imports (one line per kernel family, e.g. `from .ops import glu as _glu_ops`)
else:  # pragma: no cover - exercised only on machines without Triton
    _rms_norm_ops = None
    # @ops-none (the same names set to None)

__all__ = [
    "rms_norm",
    # @all
]

CASTING_MODES = ("llama", "gemma")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D (rows, last dim) tensor whose last dimension is contiguous (no copy if possible)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, times ``offset + weight``.

    ``y = x / sqrt(mean(x**2, -1) + eps) * (offset + weight)``

    Args:
        x: input of shape ``(..., hidden)``; float32, bfloat16 or float16 (float64 runs the
            fallback on any device). Any strides.
        weight: shape ``(hidden,)``, floating point, on the device of ``x``.
        eps: added to the mean square before the square root.
        offset: added to the weight (``1.0`` for Gemma, whose weights are stored as ``w - 1``).
        casting_mode: ``"llama"`` normalises in fp32, casts to ``x.dtype``, then multiplies by the
            weight (Hugging Face LlamaRMSNorm); ``"gemma"`` multiplies in fp32 and casts once.

    Returns:
        A tensor of the shape and dtype of ``x``.
    """
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the one normalised), got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match the last dimension of x "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    check_choice("casting_mode", casting_mode, CASTING_MODES)
    eps = check_nonneg_number("eps", eps)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise ValueError(f"offset must be a number, got {offset!r}")
    device = same_device(x=x, weight=weight)
    if (
        _rms_norm_ops is None
        or not use_kernels(device)
        or x.dtype not in KERNEL_DTYPES
        or x.numel() == 0
    ):
        return fallback.rms_norm(x, weight, eps, float(offset), casting_mode)
    y = _rms_norm_ops.rms_norm(_rows(x), weight.contiguous(), eps, float(offset), casting_mode == "gemma")
    return y.view(x.shape)


# @layer_norm


# @fused_add_rms_norm


# @glu


# @rope
