"""SwiGLU and GeGLU in plain PyTorch (autograd through PyTorch).

Written exactly as Hugging Face's LlamaMLP / GemmaMLP compute the activation product (``nn.SiLU``;
``gelu_pytorch_tanh``), so on the CPU path a bf16 model gets the numbers of the module it replaces,
and in float64 these are the exact formulas the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` with ``silu(a) = a * sigmoid(a)``, in the dtype of ``a``."""
    return F.silu(a) * b


def geglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(a) * b`` with ``gelu_tanh(a) = 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``."""
    return F.gelu(a, approximate="tanh") * b
