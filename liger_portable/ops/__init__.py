"""Triton kernels and their autograd ops, one module per kernel family. Importing this package
needs Triton; :mod:`liger_portable.functional` imports it only when a GPU path exists."""
