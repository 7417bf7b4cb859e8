"""LayerNorm forward and backward in Triton: one source for every vendor.

``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (biased variance,
as ``torch.nn.functional.layer_norm``); the bias is optional (a constexpr drops it).

Forward: each program normalises ``BLOCK_M`` rows. Rows up to ``BLOCK_N_MAX`` columns are held in
registers (one read of x, one write of y; the variance is taken of the centred values, exact two
passes over registers). Longer rows take a looped path: one pass over column blocks merges the
per-block mean and sum of squared deviations (Chan et al.'s pairwise update, stable where
``E[x**2] - mean**2`` would cancel), a second pass writes y. The per-row mean and ``rstd`` (fp32)
are saved for the backward.

Backward: a persistent grid of ``PROGRAMS_PER_CU`` programs per compute unit; each walks its share
of the rows, writes dx and accumulates the weight (and bias) gradient of its rows in fp32, then
writes one partial row ``[dW | dB]``. The partials (``num_programs`` rows) are summed into the
weight and bias gradients in their dtypes by the last program to finish where they are few (a
small problem, whose call is host-bound: one launch in all), else by a second small kernel. Each step issues the loads of the program's next row block before it
reduces the current one (a register double buffer: without it a program's loads and its reductions
took turns, 67% of the copy bandwidth at 4096 columns on an H200 against 80% with it). A row that a
power-of-two tile would leave mostly masked is held as two tiles (5120 = 4096 + 1024), which keeps
the double buffer in registers. Long rows accumulate their partials in global memory instead.

All arithmetic is fp32; loads are in the input dtype, stores in the output dtype; row offsets are
int64 so ``n_rows * stride`` may pass 2**31.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..configs import Resolved
from .._dispatch import device_info
from ..specs import EPS, next_pow2, register, row_norm_specs
from .launching import Launcher, eager_apply, kernel_op, plan, split_launch
from ._tiles import SUM_C_PER_WARP, SUM_P, block_n, fuse_sum, load_tile, store_tile, sum_if_last, sum_partials

# Output allocator; the tests swap in one that fills with NaN to catch unwritten elements.
empty = torch.empty


@triton.jit
def _layer_norm_fwd_kernel(
    X, Y, W, B, MEAN, RSTD,
    stride_x, stride_y, n_rows, n_cols, eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x_row = X + rows64[:, None] * stride_x
    y_row = Y + rows64[:, None] * stride_y
    if SINGLE_PASS:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Running (count = start, mean, m2) per row, merged block by block.
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            n_blk = tl.minimum(n_cols - start, BLOCK_N).to(tl.float32)
            n_tot = start + n_blk  # fp32; n_tot - n_blk = start, the columns merged so far
            blk_mean = tl.sum(x, axis=1) / n_blk
            d = tl.where(mask, x - blk_mean[:, None], 0.0)
            delta = blk_mean - mean
            frac = n_blk / n_tot
            mean = mean + delta * frac
            m2 = m2 + tl.sum(d * d, axis=1) + delta * delta * ((n_tot - n_blk) * frac)
        rstd = tl.rsqrt(m2 / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            col_mask = c < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                y += tl.load(B + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_row + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    tl.store(RSTD + n_rows, 0.0, mask=tl.program_id(0) == 0)  # the backward's arrival count


@triton.jit
def _dx_tile(x, dy, w, mean, rstd, c1, c2):
    """dx of one tile given the row sums ``c1 = mean(g * xhat)`` and ``c2 = mean(g)``, g = dy * w."""
    xhat = (x - mean[:, None]) * rstd[:, None]
    return (dy * w[None, :] - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, PARTIAL,
    stride_dy, stride_x, stride_dx, stride_partial, n_rows, n_cols,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    # The partials summed in this launch by its last program (see _tiles.sum_if_last) into DW and
    # DB; unset, these arguments are compiled out and a second launch sums them.
    DW=None, DB=None, FUSE_SUM: tl.constexpr = False, SUM_P: tl.constexpr = 8, SUM_C: tl.constexpr = 128,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    # This program's partial row: dW in columns [0, n_cols), dB in [n_cols, 2 n_cols).
    dw_row = PARTIAL + pid.to(tl.int64) * stride_partial
    db_row = dw_row + n_cols
    if SINGLE_PASS:
        # Persistent loop over this program's row blocks. The next block's x, dy, mean and rstd are
        # loaded before the current block is reduced, so a load is always in flight.
        col_mask = cols < n_cols
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        x = load_tile(X, stride_x, rows, cols, n_rows, n_cols)
        dy = load_tile(DY, stride_dy, rows, cols, n_rows, n_cols)
        if TAIL_N > 0:
            tcols = BLOCK_N + tl.arange(0, TAIL_N)
            wt = tl.load(W + tcols, mask=tcols < n_cols, other=0.0).to(tl.float32)
            dwt = tl.zeros([BLOCK_M, TAIL_N], dtype=tl.float32)
            dbt = tl.zeros([BLOCK_M, TAIL_N], dtype=tl.float32)
            xt = load_tile(X, stride_x, rows, tcols, n_rows, n_cols)
            dyt = load_tile(DY, stride_dy, rows, tcols, n_rows, n_cols)
        mean = tl.load(MEAN + rows, mask=rows < n_rows, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        for block in range(pid, n_blocks, n_programs):
            nxt = rows + n_programs * BLOCK_M  # beyond n_rows after the last block: loads nothing
            x_n = load_tile(X, stride_x, nxt, cols, n_rows, n_cols)
            dy_n = load_tile(DY, stride_dy, nxt, cols, n_rows, n_cols)
            if TAIL_N > 0:
                xt_n = load_tile(X, stride_x, nxt, tcols, n_rows, n_cols)
                dyt_n = load_tile(DY, stride_dy, nxt, tcols, n_rows, n_cols)
            mean_n = tl.load(MEAN + nxt, mask=nxt < n_rows, other=0.0)
            rstd_n = tl.load(RSTD + nxt, mask=nxt < n_rows, other=0.0)

            xf = x.to(tl.float32)
            dyf = dy.to(tl.float32)
            xhat = (xf - mean[:, None]) * rstd[:, None]
            g = dyf * w[None, :]  # zero outside the row (dy and w load 0 there)
            c1 = tl.sum(g * xhat, axis=1)
            c2 = tl.sum(g, axis=1)
            dw += dyf * xhat
            if HAS_BIAS:
                db += dyf
            if TAIL_N > 0:
                xtf = xt.to(tl.float32)
                dytf = dyt.to(tl.float32)
                xthat = (xtf - mean[:, None]) * rstd[:, None]
                gt = dytf * wt[None, :]
                c1 += tl.sum(gt * xthat, axis=1)
                c2 += tl.sum(gt, axis=1)
                dwt += dytf * xthat
                if HAS_BIAS:
                    dbt += dytf
            c1 = c1 / n_cols
            c2 = c2 / n_cols
            store_tile(DX, stride_dx, rows, cols, n_rows, n_cols, _dx_tile(xf, dyf, w, mean, rstd, c1, c2))
            if TAIL_N > 0:
                store_tile(DX, stride_dx, rows, tcols, n_rows, n_cols, _dx_tile(xtf, dytf, wt, mean, rstd, c1, c2))
                xt = xt_n
                dyt = dyt_n
            rows = nxt
            x = x_n
            dy = dy_n
            mean = mean_n
            rstd = rstd_n
        tl.store(dw_row + cols, tl.sum(dw, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(db_row + cols, tl.sum(db, axis=0), mask=col_mask)
        if TAIL_N > 0:
            tl.store(dw_row + tcols, tl.sum(dwt, axis=0), mask=tcols < n_cols)
            if HAS_BIAS:
                tl.store(db_row + tcols, tl.sum(dbt, axis=0), mask=tcols < n_cols)
    else:
        # PARTIAL arrives zeroed; each program owns its row of it.
        for block in range(pid, n_blocks, n_programs):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                cc = start + cols
                x = load_tile(X, stride_x, rows, cc, n_rows, n_cols).to(tl.float32)
                dy = load_tile(DY, stride_dy, rows, cc, n_rows, n_cols).to(tl.float32)
                g = dy * tl.load(W + cc, mask=cc < n_cols, other=0.0).to(tl.float32)[None, :]
                acc1 += g * ((x - mean[:, None]) * rstd[:, None])
                acc2 += g
            c1 = tl.sum(acc1, axis=1) / n_cols
            c2 = tl.sum(acc2, axis=1) / n_cols
            for start in range(0, n_cols, BLOCK_N):
                cc = start + cols
                col_mask = cc < n_cols
                x = load_tile(X, stride_x, rows, cc, n_rows, n_cols).to(tl.float32)
                dy = load_tile(DY, stride_dy, rows, cc, n_rows, n_cols).to(tl.float32)
                w = tl.load(W + cc, mask=col_mask, other=0.0).to(tl.float32)
                store_tile(DX, stride_dx, rows, cc, n_rows, n_cols, _dx_tile(x, dy, w, mean, rstd, c1, c2))
                xhat = (x - mean[:, None]) * rstd[:, None]
                part = tl.load(dw_row + cc, mask=col_mask, other=0.0)
                tl.store(dw_row + cc, part + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if HAS_BIAS:
                    part_b = tl.load(db_row + cc, mask=col_mask, other=0.0)
                    tl.store(db_row + cc, part_b + tl.sum(dy, axis=0), mask=col_mask)
    if FUSE_SUM:
        sum_if_last(PARTIAL, stride_partial, n_programs, RSTD + n_rows, n_cols, DW, DB, HAS_BIAS, SUM_P, SUM_C)


def split_row(n_cols: int, block_n_max: int) -> tuple[int, int, bool]:
    """``(BLOCK_N, TAIL_N, SINGLE_PASS)`` for a row of ``n_cols``.

    A row up to ``block_n_max`` is held in registers as one power-of-two tile, or, when that would
    be mostly masked, as the largest power of two below ``n_cols`` plus a power-of-two tail tile
    (5120 = 4096 + 1024; 2880 = 2048 + 1024 instead of 4096). Longer rows loop over
    ``block_n_max``-wide blocks."""
    if n_cols > block_n_max:
        return block_n_max, 0, False
    block = next_pow2(n_cols)
    lo = block // 2
    tail = max(16, next_pow2(n_cols - lo))
    if block != n_cols and lo >= 256 and lo + tail < block:
        return lo, tail, True
    return block, 0, True


launch_fwd = Launcher(_layer_norm_fwd_kernel)
launch_bwd = Launcher(_layer_norm_bwd_kernel)
def _fwd_plan(cfg: Resolved, dev, n_cols: int, n_rows: int) -> tuple:
    """(grid, constexprs without and with a bias, launch options) of the forward for one problem."""
    block, single = block_n(n_cols, cfg.meta["BLOCK_N_MAX"])
    consts, opts = split_launch(cfg)
    consts.update(BLOCK_N=block, SINGLE_PASS=single)
    by_bias = ({**consts, "HAS_BIAS": False}, {**consts, "HAS_BIAS": True})
    return (triton.cdiv(n_rows, cfg.meta["BLOCK_M"]),), by_bias, opts


def _bwd_plan(cfg: Resolved, dev, n_cols: int, n_rows: int) -> tuple:
    """(grid, constexprs by [summed in the launch][bias], launch options, single pass) of the
    backward; the first index is None where the partials are too many to be summed in the launch."""
    block_n, tail_n, single = split_row(n_cols, cfg.meta["BLOCK_N_MAX"])
    block_m = cfg.meta["BLOCK_M"]
    n_programs = max(1, min(triton.cdiv(n_rows, block_m), dev.compute_units * cfg.meta["PROGRAMS_PER_CU"]))
    consts, opts = split_launch(cfg)
    consts.update(BLOCK_N=block_n, TAIL_N=tail_n, SINGLE_PASS=single)
    apart = ({**consts, "HAS_BIAS": False}, {**consts, "HAS_BIAS": True})
    fused = {"FUSE_SUM": True, "SUM_P": SUM_P, "SUM_C": SUM_C_PER_WARP * opts["num_warps"]}
    together = tuple(
        {**c, **fused} if fuse_sum(n_programs, (1 + c["HAS_BIAS"]) * n_cols) else None for c in apart
    )
    return (n_programs,), (apart, together), opts, single


def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on a 2-D ``x`` whose last dimension is contiguous; ``weight`` and
    ``bias`` (or None) contiguous of shape ``(n_cols,)``.

    ``config`` overrides the resolved launch config (the tuner and benchmarks use it); ``dev`` is
    the :class:`~liger_portable.DeviceInfo` of ``x`` where the caller knows it.
    Returns ``(y, mean, rstd)``: y contiguous in ``x.dtype``, mean fp32 of shape ``(n_rows,)``, rstd
    fp32 of shape ``(n_rows + 1,)``: the rows' values, then a count the backward uses (zero between
    launches; see ``_tiles.sum_if_last``).
    """
    n_rows, n_cols = x.shape
    grid, by_bias, opts = plan("layer_norm_fwd", dev or device_info(x), (n_cols, n_rows), x.dtype, _fwd_plan, config)
    y = empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    mean = empty((n_rows,), dtype=torch.float32, device=x.device)
    rstd = empty((n_rows + 1,), dtype=torch.float32, device=x.device)
    launch_fwd(
        grid,
        (x, y, weight, weight if bias is None else bias, mean, rstd, x.stride(0), y.stride(0), n_rows, n_cols, eps),
        by_bias[bias is not None], opts,
    )
    return y, mean, rstd


def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    mean: torch.Tensor, rstd: torch.Tensor, config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the backward; ``dy`` and ``x`` 2-D with a contiguous last dimension; ``mean`` and
    ``rstd`` as :func:`layer_norm_fwd` returned them.

    ``config`` overrides the resolved launch config. Returns ``(dx, dweight, dbias)`` in the
    dtypes of ``x``, ``weight`` and ``bias``; ``dbias`` is None when ``bias`` is None.
    """
    if rstd.shape != (x.shape[0] + 1,):
        raise ValueError(
            f"rstd must be as layer_norm_fwd returns it, of shape ({x.shape[0] + 1},) for {x.shape[0]} rows "
            f"(the last element is the backward's count), got {tuple(rstd.shape)}"
        )
    return _bwd(dy, x, weight, bias, mean, rstd, config, dev)


def _bwd(dy, x, weight, bias, mean, rstd, config, dev, need_sums: bool = True):
    """The backward launches: ``(dx, dweight, dbias)`` (``dbias`` None without a bias; both None
    with ``need_sums=False``: the partials are not summed)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    n_rows, n_cols = x.shape
    grid, (apart, together), opts, single = plan(
        "layer_norm_bwd", dev or device_info(x), (n_cols, n_rows), x.dtype, _bwd_plan, config
    )
    has_bias = bias is not None
    width = 2 * n_cols if has_bias else n_cols
    dx = empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    alloc = empty if single else torch.zeros
    partial = alloc((grid[0], width), dtype=torch.float32, device=x.device)
    args = (
        dy, x, weight, mean, rstd, dx, partial,
        dy.stride(0), x.stride(0), dx.stride(0), partial.stride(0), n_rows, n_cols,
    )
    if not need_sums:
        launch_bwd(grid, args, apart[has_bias], opts)
        return dx, None, None
    dw = empty((n_cols,), dtype=weight.dtype, device=x.device)
    db = None if bias is None else empty((n_cols,), dtype=bias.dtype, device=x.device)
    consts = together[has_bias]
    if consts is not None:
        launch_bwd(grid, args, {**consts, "DW": dw, "DB": dw if db is None else db}, opts)
    else:
        launch_bwd(grid, args, apart[has_bias], opts)
        sum_partials(partial, n_cols, dw, db)
    return dx, dw, db


# --------------------------------------------------------------------------- autograd
# Declared once: an autograd.Function whose forward and backward launch directly in eager mode
# (the cheapest path on the host) and, under torch.compile, call the same launches through kernel
# ops (launching.kernel_op: on CUDA the compiled code launches the kernels itself; no graph break).

from .._autograd import first_order_only  # noqa: E402  (here: the autograd section does not version kernels)

def _layer_norm_op_fake(x, weight, bias, eps):
    mean = x.new_empty(x.shape[:1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), mean, x.new_empty((x.shape[0] + 1,), dtype=torch.float32)


@kernel_op("liger_portable::layer_norm", fake=_layer_norm_op_fake)
def layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm forward of a 2-D ``x`` (rows x hidden, last dimension contiguous): ``(y, mean, rstd)``."""
    return layer_norm_fwd(x, weight, bias, eps)


def _layer_norm_backward_op_fake(dy, x, weight, bias, mean, rstd):
    db = weight.new_empty((0,)) if bias is None else torch.empty_like(bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), db


@kernel_op("liger_portable::layer_norm_backward", fake=_layer_norm_backward_op_fake)
def layer_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    mean: torch.Tensor, rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``; ``dbias`` has no elements when ``bias`` is None (an op's outputs
    cannot be None)."""
    dx, dw, db = layer_norm_bwd(dy, x, weight, bias, mean, rstd)
    return dx, dw, weight.new_empty((0,)) if db is None else db


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, dev):
        if torch.compiler.is_compiling():
            y, mean, rstd = layer_norm_op(x, weight, bias, eps)
        else:
            y, mean, rstd = layer_norm_fwd(x, weight, bias, eps, dev=dev)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.dev = dev
        return y

    @staticmethod
    @first_order_only("layer_norm")
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dx, dw, db = layer_norm_backward_op(dy, x, weight, bias, mean, rstd)
            if bias is None:
                db = None
        else:
            # No sums where neither weight nor bias needs a gradient (frozen, as in LoRA).
            need_w, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
            dx, dw, db = _bwd(dy, x, weight, bias, mean, rstd, None, ctx.dev, need_w or need_b)
            dw, db = dw if need_w else None, db if need_b else None
        return dx, dw, db, None, None


_apply_layer_norm = eager_apply(_LayerNormFunction, 3)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, dev=None
) -> torch.Tensor:
    """Differentiable LayerNorm of a 2-D ``x`` with a contiguous last dimension; ``dev`` is the
    :class:`~liger_portable.DeviceInfo` of ``x`` where the caller has it (None: looked up)."""
    return _apply_layer_norm(x, weight, bias, eps, dev)


# --------------------------------------------------------------------------- specs and examples
# What the config tables, the tuner and the vendor compile matrix know of these kernels, declared
# here once. An example builds one problem's inputs from the tuner's Problem ``p`` and launches
# exactly one kernel with an explicit config through the launch functions above (looked up at call
# time, so a test can spy on them); see KernelSpec.examples.


def _fwd_examples(p) -> list:
    n_rows, n_cols = p.rows_cols()
    p.need(2 * n_rows * n_cols)  # x, y
    x, w, b = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0), p.randn(n_cols, scale=0.1)
    return [
        ("bias", {"x": x, "weight": w, "bias": b}, lambda r: layer_norm_fwd(x, w, b, EPS, config=r)),
        ("no bias", {"x": x, "weight": w}, lambda r: layer_norm_fwd(x, w, None, EPS, config=r)),
    ]


def _bwd_examples(p) -> list:
    n_rows, n_cols = p.rows_cols()
    p.need(3 * n_rows * n_cols)  # x, dy, dx
    x, w, b = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0), p.randn(n_cols, scale=0.1)
    _, mean, rstd = layer_norm_fwd(x, w, b, EPS, config=p.table_default("layer_norm_fwd"))
    dy = p.randn(n_rows, n_cols)
    inputs = {"dy": dy, "x": x, "weight": w, "bias": b, "mean": mean, "rstd": rstd}
    return [
        ("bias", inputs, lambda r: layer_norm_bwd(dy, x, w, b, mean, rstd, config=r)),
        ("no bias", inputs, lambda r: layer_norm_bwd(dy, x, w, None, mean, rstd, config=r)),
    ]


SPECS = register(*row_norm_specs("layer_norm", "ops/layer_norm.py", (_fwd_examples, _bwd_examples)))
