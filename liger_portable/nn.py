"""Modules, drop-in replacements for their ``torch.nn`` / Hugging Face counterparts."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as F

__all__ = [
    "RMSNorm",
    # @all
]


class RMSNorm(nn.Module):
    """Drop-in for Hugging Face's ``LlamaRMSNorm``: same ``weight`` parameter, same
    ``variance_epsilon`` attribute, same ``state_dict``.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        offset: added to the weight in the product (Gemma: ``1.0`` with ``init="zeros"``).
        casting_mode: ``"llama"`` or ``"gemma"`` (see :func:`liger_portable.functional.rms_norm`).
        init: ``"ones"`` (Llama) or ``"zeros"`` (Gemma, whose weight is stored minus one).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting_mode: str = "llama",
        init: str = "ones",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if init not in ("ones", "zeros"):
            raise ValueError(f"init must be 'ones' or 'zeros', got {init!r}")
        fill = torch.ones if init == "ones" else torch.zeros
        self.weight = nn.Parameter(fill(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(
            hidden_states, self.weight, self.variance_epsilon, offset=self.offset, casting_mode=self.casting_mode
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, casting_mode={self.casting_mode!r}"


# @layer_norm


# @glu
