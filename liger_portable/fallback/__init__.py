"""Pure-PyTorch implementations with the same signatures as the kernels: the CPU path and the
tests' oracle (run in float64 it is the reference every kernel is checked against)."""

from .rms_norm import rms_norm

# @imports

__all__ = [
    "rms_norm",
    # @all
]
