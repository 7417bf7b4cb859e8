"""Tile loads and stores shared by the row kernels (RMSNorm, LayerNorm), their column block, and
the sums of their backwards' weight- (and bias-) gradient partials."""

import torch
import triton
import triton.language as tl

from ..specs import next_pow2
from .launching import Launcher


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


# --------------------------------------------------------------------------- partial sums
# A row kernel's backward has each of its programs write one fp32 partial row of the weight (and
# bias) gradient. Where the partials are few (small problems, whose calls are host-bound), the last
# program to finish sums them in the same launch: it learns that it is last from an arrival count
# (fp32, exact to 2**24 programs) kept in the element after the forward's per-row statistics, which
# the forward zeroes and the last program resets. Larger problems sum them in a launch of their own,
# many programs wide, rather than keep one program reading megabytes.

# The partials (programs x columns) the last program sums by itself: 1 MiB of fp32.
FUSED_SUM_MAX = 1 << 18
# The tail's tile: SUM_P partial rows x SUM_C_PER_WARP * num_warps columns (32 fp32 a lane at 32 lanes a warp).
SUM_P = 8
SUM_C_PER_WARP = 128


def fuse_sum(n_programs: int, width: int) -> bool:
    """True if the last of ``n_programs`` programs sums the ``width``-wide partials itself."""
    return n_programs * width <= FUSED_SUM_MAX


@triton.jit
def column_sums(P, stride_p, n_parts, cols, width, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """The fp32 sums over the ``n_parts`` rows of ``P`` of its columns ``cols`` (``BLOCK_C`` of them,
    those below ``width`` read), added in a fixed order: deterministic."""
    parts = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        r = (start + parts).to(tl.int64)
        mask = (r < n_parts)[:, None] & (cols < width)[None, :]
        acc += tl.load(P + r[:, None] * stride_p + cols[None, :], mask=mask, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def store_sums(s, cols, n_cols, DW, DB, HAS_BIAS: tl.constexpr):
    """Store the column sums ``s`` of ``[dW | dB]`` partials: columns below ``n_cols`` into ``DW``,
    with a bias the next ``n_cols`` into ``DB``, each rounded once to its dtype."""
    tl.store(DW + cols, s.to(DW.dtype.element_ty), mask=cols < n_cols)
    if HAS_BIAS:
        tl.store(DB + (cols - n_cols), s.to(DB.dtype.element_ty), mask=(cols >= n_cols) & (cols < 2 * n_cols))


@triton.jit
def sum_if_last(
    P, stride_p, n_parts, COUNT, n_cols, DW, DB,
    HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Called by each of the ``n_parts`` programs once its partial row of ``P`` is written: the last
    to arrive sums every partial into ``DW`` (and ``DB``) and sets the arrival count ``COUNT`` (fp32,
    zero when the launch began) back to zero for the next launch on the same statistics."""
    tl.debug_barrier()  # every lane's part of the partial row is written before the program counts in
    arrived = tl.atomic_add(COUNT, 1.0, sem="acq_rel")  # releases this program's row, acquires the others'
    if arrived == n_parts - 1:
        tl.debug_barrier()
        width = 2 * n_cols if HAS_BIAS else n_cols
        for start in range(0, width, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            store_sums(column_sums(P, stride_p, n_parts, cols, width, BLOCK_P, BLOCK_C), cols, n_cols, DW, DB, HAS_BIAS)
        tl.store(COUNT, 0.0)


@triton.jit
def _sum_partials_kernel(
    P, stride_p, n_parts, n_cols, DW, DB,
    HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Column sums of the backward's fp32 partials ``P`` (``n_parts`` rows ``[dW | dB]``), each
    rounded once to its output's dtype: ``DW`` from the first ``n_cols`` columns and, with a bias,
    ``DB`` from the next ``n_cols``. A program sums ``BLOCK_C`` columns over every part, in a fixed
    order (deterministic)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    width = 2 * n_cols if HAS_BIAS else n_cols
    store_sums(column_sums(P, stride_p, n_parts, cols, width, BLOCK_P, BLOCK_C), cols, n_cols, DW, DB, HAS_BIAS)


launch_sum = Launcher(_sum_partials_kernel)

# The sum's launch: one small fixed tile on every vendor (the partials are a few MB at most; 4 warps
# of 32 or 64 lanes hold the 64 x 128 fp32 accumulator in 32-64 registers a lane).
_SUM_BLOCK_C = 128
_SUM_CONSTS = tuple({"HAS_BIAS": has_bias, "BLOCK_P": 64, "BLOCK_C": _SUM_BLOCK_C} for has_bias in (False, True))
_SUM_OPTIONS = {"num_warps": 4}


def sum_partials(partial: torch.Tensor, n_cols: int, dw: torch.Tensor, db: torch.Tensor | None) -> None:
    """Write the column sums of a backward's fp32 ``partial`` (programs x ``[dW | dB]``) into ``dw``
    and ``db`` (None: no bias columns) in their dtypes: one launch, where aten's sum and a cast per
    gradient (and, with a bias, two slices) took two to five, each costing host time."""
    width = n_cols if db is None else 2 * n_cols
    launch_sum(
        (-(-width // _SUM_BLOCK_C),),  # integer ceil (newer Tritons' triton.cdiv costs microseconds a call)
        (partial, partial.stride(0), partial.shape[0], n_cols, dw, dw if db is None else db),
        _SUM_CONSTS[db is not None], _SUM_OPTIONS,
    )
