"""Pure-PyTorch implementations with the same signatures as the kernels: the CPU path and the
tests' oracle (run in float64 it is the reference every kernel is checked against)."""

from .rms_norm import rms_norm

from .layer_norm import layer_norm
from .rope import rope
from .glu import geglu, swiglu
from .rms_norm import fused_add_rms_norm
from .cross_entropy import cross_entropy, fused_linear_cross_entropy

__all__ = [
    "rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "fused_add_rms_norm",
    "cross_entropy",
    "fused_linear_cross_entropy",
]
