"""RMSNorm forward and backward in Triton: one source for every vendor.

Forward: each program normalises ``BLOCK_M`` rows. Rows up to ``BLOCK_N_MAX`` columns are held in
registers (one read of x, one write of y); longer rows take two passes over column blocks.
The per-row ``rstd`` (fp32) is saved for the backward.

Backward: a persistent grid of ``PROGRAMS_PER_CU`` programs per compute unit; each walks its share
of the rows, writes dx and accumulates the weight gradient of its rows in fp32, then writes one
partial row. Where the partials are few (a small problem, whose call is host-bound), the last
program to finish sums them into the weight gradient in the same launch; otherwise a second small
kernel sums them (``num_programs x n_cols`` floats) and writes the gradient in the weight's dtype. Long rows accumulate their partial in global memory
instead of registers.

Fused add + RMSNorm (the pre-norm residual of a decoder layer) runs the same two kernels with a
constexpr flag set: the forward (``HAS_RESIDUAL``) also loads the residual ``r`` and stores the sum
``s = x + r`` (added in fp32, rounded once to the input dtype), which it then normalises; the
backward (``HAS_DSUM``) reads ``s`` as its ``x`` and adds the incoming gradient of ``s`` to dx, which
is the gradient of both ``x`` and ``r``. With the flags off (their defaults) the kernels are RMSNorm's.

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
from ..specs import EPS, register, row_norm_specs
from .launching import Launcher, eager_apply, kernel_op, plan, split_launch
from ._tiles import SUM_C_PER_WARP, SUM_P, block_n, fuse_sum, load_tile, store_tile, sum_if_last, sum_partials

# Output allocator; the tests swap in one that fills with NaN to catch unwritten elements.
empty = torch.empty


@triton.jit
def _rms_norm_fwd_kernel(
    X, Y, W, RSTD,
    stride_x, stride_y, n_rows, n_cols, eps, offset,
    GEMMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    # Fused add: also read R, store the sum S = X + R (row stride of Y: both are allocated alike)
    # and normalise it. Unset (RMSNorm), these arguments are compiled out.
    R=None, stride_r=None, S=None, HAS_RESIDUAL: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x_row = X + rows64[:, None] * stride_x
    y_row = Y + rows64[:, None] * stride_y
    if HAS_RESIDUAL:
        r_row = R + rows64[:, None] * stride_r
        s_row = S + rows64[:, None] * stride_y
    if SINGLE_PASS:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # The sum as the unfused code has it: added in fp32, rounded once to the input dtype;
            # the normalisation reads the rounded value.
            r = tl.load(r_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(S.dtype.element_ty)
            tl.store(s_row + cols[None, :], s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        xhat = x * rstd[:, None]
        if not GEMMA:
            xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
        tl.store(y_row + cols[None, :], (xhat * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(S.dtype.element_ty)
                tl.store(s_row + c[None, :], s, mask=mask)
                x = s.to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            col_mask = c < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                # Recomputed from X and R (the same bits as the stored S) rather than read back from
                # S: a thread may not see another thread's store of this program without a fence.
                r = tl.load(r_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                x = (x + r).to(S.dtype.element_ty).to(tl.float32)
            w = tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32) + offset
            xhat = x * rstd[:, None]
            if not GEMMA:
                xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
            tl.store(y_row + c[None, :], (xhat * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    tl.store(RSTD + n_rows, 0.0, mask=tl.program_id(0) == 0)  # the backward's arrival count


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, offset,
    GEMMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    # Fused add: X is the saved sum, and DS (the gradient that reached the sum output) is added to
    # dx. Unset (RMSNorm), these arguments are compiled out.
    DS=None, stride_ds=None, HAS_DSUM: tl.constexpr = False,
    # The partials summed in this launch by its last program (see _tiles.sum_if_last) into DW;
    # unset, these arguments are compiled out and the partials are summed after the launch.
    DW=None, FUSE_SUM: tl.constexpr = False, SUM_P: tl.constexpr = 8, SUM_C: tl.constexpr = 128,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * n_cols
    if SINGLE_PASS:
        # The next row block's loads are issued before the current block is reduced (a register
        # double buffer), so a program always has loads in flight.
        col_mask = cols < n_cols
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        x = load_tile(X, stride_x, rows, cols, n_rows, n_cols)
        dy = load_tile(DY, stride_dy, rows, cols, n_rows, n_cols)
        if HAS_DSUM:
            ds = load_tile(DS, stride_ds, rows, cols, n_rows, n_cols)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        for block in range(pid, n_blocks, n_programs):
            nxt = rows + n_programs * BLOCK_M  # beyond n_rows after the last block: loads nothing
            x_n = load_tile(X, stride_x, nxt, cols, n_rows, n_cols)
            dy_n = load_tile(DY, stride_dy, nxt, cols, n_rows, n_cols)
            if HAS_DSUM:
                ds_n = load_tile(DS, stride_ds, nxt, cols, n_rows, n_cols)
            rstd_n = tl.load(RSTD + nxt, mask=nxt < n_rows, other=0.0)
            dyf = dy.to(tl.float32)
            xhat = x.to(tl.float32) * rstd[:, None]
            g = dyf * w[None, :]
            c = tl.sum(g * xhat, axis=1) / n_cols
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            if HAS_DSUM:
                dx += ds.to(tl.float32)
                ds = ds_n
            store_tile(DX, stride_dx, rows, cols, n_rows, n_cols, dx)
            if not GEMMA:
                xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
            dw += dyf * xhat
            rows = nxt
            x = x_n
            dy = dy_n
            rstd = rstd_n
        tl.store(dw_row + cols, tl.sum(dw, axis=0), mask=col_mask)
    else:
        # DW_PARTIAL arrives zeroed; each program owns its row of it.
        for block in range(pid, n_blocks, n_programs):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            x_row = X + rows64[:, None] * stride_x
            dy_row = DY + rows64[:, None] * stride_dy
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                cc = start + cols
                col_mask = cc < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_row + cc[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + cc[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cc, mask=col_mask, other=0.0).to(tl.float32) + offset
                acc += dy * w[None, :] * x
            c = tl.sum(acc, axis=1) * rstd / n_cols
            for start in range(0, n_cols, BLOCK_N):
                cc = start + cols
                col_mask = cc < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_row + cc[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + cc[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cc, mask=col_mask, other=0.0).to(tl.float32) + offset
                xhat = x * rstd[:, None]
                dx = (dy * w[None, :] - xhat * c[:, None]) * rstd[:, None]
                if HAS_DSUM:
                    ds = tl.load(DS + rows64[:, None] * stride_ds + cc[None, :], mask=mask, other=0.0)
                    dx += ds.to(tl.float32)
                tl.store(DX + rows64[:, None] * stride_dx + cc[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                if not GEMMA:
                    xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
                part = tl.load(dw_row + cc, mask=col_mask, other=0.0)
                tl.store(dw_row + cc, part + tl.sum(dy * xhat, axis=0), mask=col_mask)
    if FUSE_SUM:
        sum_if_last(DW_PARTIAL, n_cols, n_programs, RSTD + n_rows, n_cols, DW, DW, False, SUM_P, SUM_C)


launch_fwd = Launcher(_rms_norm_fwd_kernel)
launch_bwd = Launcher(_rms_norm_bwd_kernel)


def _fwd_plan(cfg: Resolved, dev, n_cols: int, n_rows: int) -> tuple:
    """(grid, constexprs, launch options) of the forward for one problem."""
    block, single = block_n(n_cols, cfg.meta["BLOCK_N_MAX"])
    consts, opts = split_launch(cfg)
    consts.update(BLOCK_N=block, SINGLE_PASS=single)
    return (triton.cdiv(n_rows, cfg.meta["BLOCK_M"]),), consts, opts


def _bwd_plan(cfg: Resolved, dev, n_cols: int, n_rows: int) -> tuple:
    """(grid, constexprs, launch options, single pass, the constexprs with the partials summed in the
    launch or None where they are too many) of the backward for one problem."""
    block, single = block_n(n_cols, cfg.meta["BLOCK_N_MAX"])
    block_m = cfg.meta["BLOCK_M"]
    n_programs = max(1, min(triton.cdiv(n_rows, block_m), dev.compute_units * cfg.meta["PROGRAMS_PER_CU"]))
    consts, opts = split_launch(cfg)
    consts.update(BLOCK_N=block, SINGLE_PASS=single)
    together = None
    if fuse_sum(n_programs, n_cols):
        together = {**consts, "FUSE_SUM": True, "SUM_P": SUM_P, "SUM_C": SUM_C_PER_WARP * opts["num_warps"]}
    return (n_programs,), consts, opts, single, together


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool,
    config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on a 2-D ``x`` whose last dimension is contiguous.

    ``config`` overrides the resolved launch config (the tuner and benchmarks use it); ``dev`` is
    the :class:`~liger_portable.DeviceInfo` of ``x`` where the caller knows it.
    Returns ``(y, rstd)``: y contiguous in ``x.dtype``, rstd fp32 of shape ``(n_rows + 1,)``: the
    rows' values, then a count the backward uses (zero between launches; see ``_tiles.sum_if_last``).
    """
    y, _, rstd = _fwd("rms_norm_fwd", x, None, weight, eps, offset, gemma, config, dev)
    return y, rstd


def fused_add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool,
    config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of ``s = x + residual; y = rms_norm(s)`` in one pass; ``x`` and ``residual`` 2-D of one
    shape and dtype, each with a contiguous last dimension (row strides may differ).

    Returns ``(y, s, rstd)``: y and s contiguous in ``x.dtype``, rstd as :func:`rms_norm_fwd` returns it.
    """
    return _fwd("fused_add_rms_norm_fwd", x, residual, weight, eps, offset, gemma, config, dev)


def _fwd(kernel, x, residual, weight, eps, offset, gemma, config, dev):
    n_rows, n_cols = x.shape
    grid, consts, opts = plan(kernel, dev or device_info(x), (n_cols, n_rows), x.dtype, _fwd_plan, config)
    y = empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = empty((n_rows + 1,), dtype=torch.float32, device=x.device)
    if residual is None:
        s = None
        kwargs = {**consts, "GEMMA": gemma}
    else:
        s = empty((n_rows, n_cols), dtype=x.dtype, device=x.device)  # the row stride of y
        kwargs = {**consts, "GEMMA": gemma, "R": residual, "stride_r": residual.stride(0), "S": s, "HAS_RESIDUAL": True}
    launch_fwd(grid, (x, y, weight, rstd, x.stride(0), y.stride(0), n_rows, n_cols, eps, offset), kwargs, opts)
    return y, s, rstd


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, gemma: bool,
    config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward; ``dy`` and ``x`` 2-D with a contiguous last dimension, ``rstd`` as
    :func:`rms_norm_fwd` returned it.

    ``config`` overrides the resolved launch config. Returns ``(dx, dweight)`` in the dtypes of
    ``x`` and ``weight``.
    """
    _check_rstd(rstd, x)
    return _bwd("rms_norm_bwd", dy, None, x, weight, rstd, offset, gemma, config, dev)


def fused_add_rms_norm_bwd(
    dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    offset: float, gemma: bool, config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of the fused add + RMSNorm: ``dy`` the gradient of y, ``ds`` that of the sum output
    (None if the sum was not used), ``s`` and ``rstd`` saved by the forward.

    Returns ``(dsum, dweight)``: ``dsum = rms_norm's dx + ds`` (added in fp32, rounded once) is the
    gradient of both ``x`` and ``residual``.
    """
    _check_rstd(rstd, s)
    return _bwd("fused_add_rms_norm_bwd", dy, ds, s, weight, rstd, offset, gemma, config, dev)


def _check_rstd(rstd: torch.Tensor, x: torch.Tensor) -> None:
    if rstd.shape != (x.shape[0] + 1,):
        raise ValueError(
            f"rstd must be as the forward returns it, of shape ({x.shape[0] + 1},) for {x.shape[0]} rows "
            f"(the last element is the backward's count), got {tuple(rstd.shape)}"
        )


def _bwd(kernel, dy, ds, x, weight, rstd, offset, gemma, config, dev, need_dw: bool = True):
    """The backward launches: ``(dx, dweight)``, the weight gradient in the weight's dtype (None with
    ``need_dw=False``: the partials are not summed)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    n_rows, n_cols = x.shape
    grid, consts, opts, single, together = plan(kernel, dev or device_info(x), (n_cols, n_rows), x.dtype, _bwd_plan, config)
    dx = empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    alloc = empty if single else torch.zeros
    dw_partial = alloc((grid[0], n_cols), dtype=torch.float32, device=x.device)
    dw = empty((n_cols,), dtype=weight.dtype, device=x.device) if need_dw else None
    if dw is not None and together is not None:
        kwargs = {**together, "GEMMA": gemma, "DW": dw}
    else:
        kwargs = {**consts, "GEMMA": gemma}
    if ds is not None:
        if ds.stride(-1) != 1:
            ds = ds.contiguous()
        kwargs.update(DS=ds, stride_ds=ds.stride(0), HAS_DSUM=True)
    launch_bwd(
        grid, (dy, x, weight, rstd, dx, dw_partial, dy.stride(0), x.stride(0), dx.stride(0), n_rows, n_cols, offset),
        kwargs, opts,
    )
    if dw is not None and together is None:
        sum_partials(dw_partial, n_cols, dw, None)
    return dx, dw


# --------------------------------------------------------------------------- autograd
# Declared once: an autograd.Function whose forward and backward launch directly in eager mode
# (the cheapest path on the host) and, under torch.compile, call the same launches through kernel
# ops (launching.kernel_op: on CUDA the compiled code launches the kernels itself; no graph break).

from .._autograd import first_order_only  # noqa: E402  (here: the autograd section does not version kernels)

def _rms_norm_op_fake(x, weight, eps, offset, gemma):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((x.shape[0] + 1,), dtype=torch.float32)


@kernel_op("liger_portable::rms_norm", fake=_rms_norm_op_fake)
def rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm forward of a 2-D ``x`` (rows x hidden, last dimension contiguous): ``(y, rstd)``."""
    return rms_norm_fwd(x, weight, eps, offset, gemma)


def _rms_norm_backward_op_fake(dy, x, weight, rstd, offset, gemma):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


@kernel_op("liger_portable::rms_norm_backward", fake=_rms_norm_backward_op_fake)
def rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_bwd(dy, x, weight, rstd, offset, gemma)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, gemma, dev):
        if torch.compiler.is_compiling():
            y, rstd = rms_norm_op(x, weight, eps, offset, gemma)
        else:
            y, rstd = rms_norm_fwd(x, weight, eps, offset, gemma, dev=dev)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.gemma, ctx.dev = offset, gemma, dev
        return y

    @staticmethod
    @first_order_only("rms_norm")
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dx, dw = rms_norm_backward_op(dy, x, weight, rstd, ctx.offset, ctx.gemma)
        else:
            dx, dw = _bwd("rms_norm_bwd", dy, None, x, weight, rstd, ctx.offset, ctx.gemma, None, ctx.dev,
                          ctx.needs_input_grad[1])
        return dx, dw, None, None, None, None


_apply_rms_norm = eager_apply(_RMSNormFunction, 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool, dev=None) -> torch.Tensor:
    """Differentiable RMSNorm of a 2-D ``x`` with a contiguous last dimension; ``dev`` is the
    :class:`~liger_portable.DeviceInfo` of ``x`` where the caller has it (None: looked up)."""
    return _apply_rms_norm(x, weight, eps, offset, gemma, dev)


# --------------------------------------------------------------------------- fused add + RMSNorm autograd
# The gradient of the sum s = x + residual (rms_norm's dx plus the gradient that reached s as an
# output) is the gradient of both x and residual: one tensor, returned for both inputs (autograd
# never writes into a gradient it hands on; AccumulateGrad copies one it cannot own).


def _fused_add_rms_norm_op_fake(x, residual, weight, eps, offset, gemma):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, s, x.new_empty((x.shape[0] + 1,), dtype=torch.float32)


@kernel_op("liger_portable::fused_add_rms_norm", fake=_fused_add_rms_norm_op_fake)
def fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused add + RMSNorm forward of 2-D ``x`` and ``residual``: ``(y, s, rstd)``."""
    return fused_add_rms_norm_fwd(x, residual, weight, eps, offset, gemma)


def _fused_add_rms_norm_backward_op_fake(dy, ds, s, weight, rstd, offset, gemma):
    return torch.empty_like(s, memory_format=torch.contiguous_format), torch.empty_like(weight)


@kernel_op("liger_portable::fused_add_rms_norm_backward", fake=_fused_add_rms_norm_backward_op_fake)
def fused_add_rms_norm_backward_op(
    dy: torch.Tensor, ds: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    offset: float, gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_bwd(dy, ds, s, weight, rstd, offset, gemma)


class _FusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, gemma, dev):
        if torch.compiler.is_compiling():
            y, s, rstd = fused_add_rms_norm_op(x, residual, weight, eps, offset, gemma)
        else:
            y, s, rstd = fused_add_rms_norm_fwd(x, residual, weight, eps, offset, gemma, dev=dev)
        ctx.save_for_backward(s, weight, rstd)
        ctx.offset, ctx.gemma, ctx.dev = offset, gemma, dev
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros read
        return y, s

    @staticmethod
    @first_order_only("fused_add_rms_norm")
    def backward(ctx, dy, ds):
        if dy is None:  # only the sum was used: its gradient passes through, the weight gets none
            return ds, ds, None, None, None, None, None
        s, weight, rstd = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dsum, dw = fused_add_rms_norm_backward_op(dy, ds, s, weight, rstd, ctx.offset, ctx.gemma)
        else:
            dsum, dw = _bwd("fused_add_rms_norm_bwd", dy, ds, s, weight, rstd, ctx.offset, ctx.gemma, None, ctx.dev,
                            ctx.needs_input_grad[2])
        return dsum, dsum, dw, None, None, None, None


_apply_fused_add_rms_norm = eager_apply(_FusedAddRMSNormFunction, 3)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool,
    dev=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(rms_norm(x + residual), x + residual)`` of 2-D inputs with a contiguous
    last dimension."""
    return _apply_fused_add_rms_norm(x, residual, weight, eps, offset, gemma, dev)


# --------------------------------------------------------------------------- specs and examples
# What the config tables, the tuner and the vendor compile matrix know of these kernels, declared
# here once. An example builds one problem's inputs from the tuner's Problem ``p`` and launches
# exactly one kernel with an explicit config through the launch functions above (looked up at call
# time, so a test can spy on them); see KernelSpec.examples.


def _fwd_examples(p) -> list:
    n_rows, n_cols = p.rows_cols()
    p.need(2 * n_rows * n_cols)  # x, y
    x, w = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    return [("", {"x": x, "weight": w}, lambda r: rms_norm_fwd(x, w, EPS, 0.0, False, config=r))]


def _bwd_examples(p) -> list:
    n_rows, n_cols = p.rows_cols()
    p.need(3 * n_rows * n_cols)  # x, dy, dx (the forward's y is freed before dx)
    x, w = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    _, rstd = rms_norm_fwd(x, w, EPS, 0.0, False, config=p.table_default("rms_norm_fwd"))
    dy = p.randn(n_rows, n_cols)
    inputs = {"dy": dy, "x": x, "weight": w, "rstd": rstd}
    return [("", inputs, lambda r: rms_norm_bwd(dy, x, w, rstd, 0.0, False, config=r))]


def _fused_fwd_examples(p) -> list:
    n_rows, n_cols = p.rows_cols()
    p.need(4 * n_rows * n_cols)  # x, residual, y, s
    x, res, w = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    inputs = {"x": x, "residual": res, "weight": w}
    return [("", inputs, lambda r: fused_add_rms_norm_fwd(x, res, w, EPS, 0.0, False, config=r))]


def _fused_bwd_examples(p) -> list:
    n_rows, n_cols = p.rows_cols()
    p.need(4 * n_rows * n_cols)  # x, residual, y, s for the forward; then s, dy, ds, dsum
    x, res, w = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    cfg = p.table_default("fused_add_rms_norm_fwd")
    y, s, rstd = fused_add_rms_norm_fwd(x, res, w, EPS, 0.0, False, config=cfg)
    del x, res, y  # only s and rstd are kept: the memory goes to dy and ds
    dy, ds = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols)
    inputs = {"dy": dy, "ds": ds, "s": s, "weight": w, "rstd": rstd}
    return [("", inputs, lambda r: fused_add_rms_norm_bwd(dy, ds, s, w, rstd, 0.0, False, config=r))]


SPECS = register(
    *row_norm_specs("rms_norm", "ops/rms_norm.py", (_fwd_examples, _bwd_examples)),
    *row_norm_specs("fused_add_rms_norm", "ops/rms_norm.py", (_fused_fwd_examples, _fused_bwd_examples)),
)
