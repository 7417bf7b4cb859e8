"""Triton kernels, one module per kernel family: its ``@triton.jit`` kernels, launch plans, specs
(registered in :data:`liger_portable.specs.SPECS`), tuning and compile examples, and its autograd op.
Importing this package needs Triton and registers every family, in this order;
:mod:`liger_portable.functional` imports it only when Triton is installed."""

from . import rms_norm, layer_norm, glu, rope, cross_entropy, fused_linear_cross_entropy, mlp  # noqa: F401

FAMILIES = (rms_norm, layer_norm, glu, rope, cross_entropy, fused_linear_cross_entropy)
