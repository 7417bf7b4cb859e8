"""Tile loads and stores shared by the row kernels (RMSNorm, LayerNorm), and their column block."""

import triton
import triton.language as tl

from ..specs import next_pow2


def block_n(n_cols: int, block_n_max: int) -> tuple[int, bool]:
    """A row kernel's column block and whether the row fits in it (one pass): the row's next power
    of two up to ``block_n_max`` (the config's ``BLOCK_N_MAX``), else ``block_n_max`` in a loop."""
    block = next_pow2(n_cols)
    return (block, True) if block <= block_n_max else (block_n_max, False)


@triton.jit
def load_tile(P, stride, rows, cols, n_rows, n_cols):
    """The ``rows x cols`` tile of a row-major tensor (int64 row offsets), 0 outside the tensor."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(P + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def store_tile(P, stride, rows, cols, n_rows, n_cols, value):
    """Store ``value`` (cast to P's dtype) into the ``rows x cols`` tile, inside the tensor only."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(P + rows.to(tl.int64)[:, None] * stride + cols[None, :], value.to(P.dtype.element_ty), mask=mask)
