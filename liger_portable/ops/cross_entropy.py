"""Cross-entropy loss and its gradient in one Triton launch (Liger-Kernel's approach), one source
for every vendor.

One program per row (token). Pass 1 walks the vocabulary in ``BLOCK_V`` steps with an online
max / sum-exp in fp32 (the log-sum-exp ``lse = m + log d``, and for label smoothing the sum of the
logits relative to the running max). Pass 2, when a gradient is wanted, walks the row again and
writes ``grad_scale * d(row loss)/d(logits)`` in the logits dtype, into a separate tensor or over
the logits themselves (same program, same elements: each element is read before it is written).

Row loss, with ``z = softcap * tanh(x / softcap)`` (or ``z = x``), ``eps`` the label smoothing,
``V`` the vocabulary and ``t`` the target::

    loss = lse - (1 - eps) z_t - eps/V sum_j z_j  +  lse_square_scale * lse**2
    dloss/dz_j = p_j (1 + 2 lse_square_scale lse) - eps/V - (1 - eps) [j == t],  p = softmax(z)
    dloss/dx_j = dloss/dz_j * (1 - (z_j / softcap)**2)          (with softcap)

``lse - z_t`` is formed as ``(m - z_t) + log d`` (``m`` the row max), which is exact to the last
bit of the log even for logits near 1e4. Rows whose target is ``ignore_index`` get loss 0 and a
zero gradient. A target outside ``[0, V)`` other than ``ignore_index`` gives a NaN loss and NaN
gradient for its row (no out-of-bounds read; no host sync to detect it). Non-finite logits give
NaN; every loop is bounded, so nothing hangs.

All arithmetic is fp32; row offsets are int64 (rows x V may pass 2**31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import Resolved
from .._dispatch import device_info
from ..specs import BLOCK_V, IGNORE_INDEX, KernelSpec, register, rows_cols_bucket
from .launching import Launcher, eager_apply, plan, split_launch

# Output allocator; the tests swap in one that fills with NaN to catch unwritten elements.
empty = torch.empty


@triton.jit
def _tanh(y):
    # Portable tanh (no libdevice): sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) in (0, 1].
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _ce_kernel(
    X, stride_x, G, stride_g, T, LOSS, ZLOSS, SCALE, stride_scale,
    n_cols, ignore_index, label_smoothing, lse_square_scale, softcap, grad_scale,
    HAS_SMOOTH: tl.constexpr, HAS_Z: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCALE: tl.constexpr, RETURN_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    g_row = G + row * stride_g
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(T + row).to(tl.int64)
    if t == ignore_index:
        if RETURN_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_V):
                c = start + cols
                tl.store(g_row + c, zeros.to(G.dtype.element_ty), mask=c < n_cols)
        tl.store(LOSS + row, 0.0)
        if HAS_Z:
            tl.store(ZLOSS + row, 0.0)
        return
    valid = (t >= 0) & (t < n_cols)
    t_safe = tl.where(valid, t, 0)
    z_t = tl.load(x_row + t_safe).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * _tanh(z_t / softcap)

    # Pass 1: running max m, running sum d of exp(z - m), running sum s of (z - m) (smoothing).
    m = float("-inf")
    d = 0.0
    s = 0.0
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        mask = c < n_cols
        z = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        if HAS_SMOOTH:
            # sum_j (z_j - m_new) over the columns so far; the first step has no earlier columns
            # (and m = -inf there), so its correction term is left out.
            shift = tl.where(start > 0, m - m_new, 0.0) * start
            s = s + shift + tl.sum(tl.where(mask, z - m_new, 0.0), axis=0)
        m = m_new
    log_d = tl.log(d)
    lse = m + log_d
    # lse - z_t = (m - z_t) + log d: m and z_t are logits, so their difference is exact.
    ce = (m - z_t) + log_d
    if HAS_SMOOTH:
        # lse - (1-eps) z_t - eps/V sum z = (1-eps)(lse - z_t) + eps (log d - s / V)
        ce = (1.0 - label_smoothing) * ce + label_smoothing * (log_d - s / n_cols)
    loss = ce
    if HAS_Z:
        z_loss = lse_square_scale * lse * lse
        loss = loss + z_loss
        tl.store(ZLOSS + row, tl.where(valid, z_loss, float("nan")))
    tl.store(LOSS + row, tl.where(valid, loss, float("nan")))

    if RETURN_GRAD:
        scale = grad_scale
        if HAS_SCALE:
            scale = scale * tl.load(SCALE + row * stride_scale).to(tl.float32)
        scale = tl.where(valid, scale, float("nan"))
        coef = 1.0
        if HAS_Z:
            coef = 1.0 + 2.0 * lse_square_scale * lse
        for start in range(0, n_cols, BLOCK_V):
            c = start + cols
            mask = c < n_cols
            z = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                th = _tanh(z / softcap)
                z = softcap * th
            p = tl.exp((z - m) - log_d)
            g = p * coef
            if HAS_SMOOTH:
                g = g - label_smoothing / n_cols
            g = tl.where(c == t, g - (1.0 - label_smoothing), g)
            if HAS_SOFTCAP:
                g = g * (1.0 - th * th)
            tl.store(g_row + c, (g * scale).to(G.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows_kernel(G, stride_g, S, stride_s, n_cols, BLOCK: tl.constexpr):
    """G[r, :] *= S[r * stride_s] (stride 0: one scalar), skipped where the factor is exactly 1,
    so the common backward (grad_output == 1) reads one scalar per program and writes nothing."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(S + row * stride_s).to(tl.float32)
    if s != 1.0:
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < n_cols
        ptr = G + row * stride_g + c
        g = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (g * s).to(G.dtype.element_ty), mask=mask)


@triton.jit
def _scale_flat_kernel(G, S, n, BLOCK: tl.constexpr):
    """G *= S[0] over a contiguous tensor of n elements, skipped if the factor is exactly 1."""
    s = tl.load(S).to(tl.float32)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(G + offs, (g * s).to(G.dtype.element_ty), mask=mask)


launch_ce = Launcher(_ce_kernel)
launch_scale_rows = Launcher(_scale_rows_kernel)
launch_scale_flat = Launcher(_scale_flat_kernel)


class _Plan:
    """What the cross-entropy launches derive from a config for one ``(n_cols, n_rows)`` problem:
    the row kernel's grid, constexprs and options (its flag constexprs added per combination, once),
    and the two scaling kernels' launches over a gradient of that shape."""

    __slots__ = ("grid", "consts", "opts", "flags", "flat", "rows")

    def __init__(self, cfg: Resolved, n_cols: int, n_rows: int):
        self.grid = (n_rows,)
        self.consts, self.opts = split_launch(cfg)
        self.flags: dict[tuple, dict] = {}
        # The scaling kernels: blocks of the config's BLOCK_V at most, warps by block size (an
        # empty problem, which launches nothing, gets blocks of 1).
        block_v, warps = cfg.meta["BLOCK_V"], cfg.launch["num_warps"]
        block = min(block_v, triton.next_power_of_2(max(1, n_rows * n_cols)))
        opts = {"num_warps": min(warps, max(1, block // 256))}
        self.flat = ((triton.cdiv(n_rows * n_cols, block),), {"BLOCK": block}, opts)
        block = min(block_v, triton.next_power_of_2(max(1, n_cols)))
        opts = {"num_warps": min(warps, max(1, block // 256))}
        self.rows = ((n_rows, triton.cdiv(n_cols, block)), {"BLOCK": block}, opts)

    def kwargs(self, flags: tuple) -> dict:
        """The row kernel's constexprs with ``(HAS_SMOOTH, HAS_Z, HAS_SOFTCAP, HAS_SCALE, RETURN_GRAD)``."""
        kw = self.flags.get(flags)
        if kw is None:
            names = ("HAS_SMOOTH", "HAS_Z", "HAS_SOFTCAP", "HAS_SCALE", "RETURN_GRAD")
            kw = self.flags[flags] = {**dict(zip(names, flags)), **self.consts}
        return kw


def _plan(cfg: Resolved, dev, n_cols: int, n_rows: int) -> _Plan:
    return _Plan(cfg, n_cols, n_rows)


def ce_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    grad_scale: float = 1.0,
    scale: torch.Tensor | None = None,
    return_grad: bool = True,
    grad: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    config: Resolved | None = None,
    dev=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the cross-entropy kernel on 2-D ``logits`` (rows, V) with a contiguous last dimension
    and 1-D integer ``target`` (rows,).

    Returns ``(loss_rows, z_rows)``, fp32 of shape ``(rows,)`` (``z_rows`` is None unless
    ``lse_square_scale`` is set); ``loss_rows`` includes the z-loss. With ``return_grad`` the
    gradient ``grad_scale * scale[r] * d(row loss)/d(logits)`` is written into ``grad`` (default:
    over ``logits`` itself, in place; pass a tensor of the logits' shape and dtype with a
    contiguous last dimension to keep the logits). ``scale`` is an optional device tensor, one
    value (numel 1) or one per row: the mean's 1/count without a host sync, or per-row factors.
    ``out``: the ``(loss_rows, z_rows)`` to write into (contiguous fp32 of shape ``(rows,)``;
    ``z_rows`` None without ``lse_square_scale``), e.g. one chunk's slice of the caller's rows.
    ``config`` overrides the launch config (the fused linear cross-entropy passes its own);
    ``dev`` is the :class:`~liger_portable.DeviceInfo` of ``logits`` where the caller knows it.
    """
    n_rows, n_cols = logits.shape
    p = plan("cross_entropy", dev or device_info(logits), (n_cols, n_rows), logits.dtype, _plan, config)
    has_z = lse_square_scale != 0.0
    if out is not None:
        loss, z = out
    else:
        loss = empty((n_rows,), dtype=torch.float32, device=logits.device)
        z = empty((n_rows,), dtype=torch.float32, device=logits.device) if has_z else None
    if grad is None:
        grad = logits
    if n_rows == 0:
        return loss, z
    launch_ce(
        p.grid,
        (
            logits, logits.stride(0), grad, grad.stride(0), target, loss, z if has_z else loss,
            scale if scale is not None else loss, 0 if scale is None or scale.numel() == 1 else scale.stride(0),
            n_cols, ignore_index, float(label_smoothing), float(lse_square_scale),
            float(softcap) if softcap is not None else 1.0, float(grad_scale),
        ),
        p.kwargs((label_smoothing != 0.0, has_z, softcap is not None, scale is not None, return_grad)),
        p.opts,
    )
    return loss, z


def scale_rows_(g: torch.Tensor, s: torch.Tensor, config: Resolved | None = None, dev=None) -> torch.Tensor:
    """In place ``g[r] *= s[r]`` (``s`` of numel 1: one factor for all rows) on a 2-D ``g`` with a
    contiguous last dimension; rows whose factor is exactly 1 are not touched. No host sync.
    ``s`` may be strided (an expanded ``grad_output`` of ``loss.sum()`` has stride 0)."""
    n_rows, n_cols = g.shape
    if g.numel() == 0:
        return g
    p = plan("cross_entropy", dev or device_info(g), (n_cols, n_rows), g.dtype, _plan, config)
    s = s.reshape(-1)
    if s.numel() == 1 and g.is_contiguous():
        grid, consts, opts = p.flat
        launch_scale_flat(grid, (g, s, g.numel()), consts, opts)
        return g
    grid, consts, opts = p.rows
    launch_scale_rows(grid, (g, g.stride(0), s, 0 if s.numel() == 1 else s.stride(0), n_cols), consts, opts)
    return g


def mean_scale(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``1 / max(1, count of non-ignored targets)`` as a 0-dim fp32 device tensor (no host sync).
    The count is summed in fp32, exact up to 2**24 targets."""
    return (target != ignore_index).sum(dtype=torch.float32).clamp_min_(1.0).reciprocal_()


# --------------------------------------------------------------------------- autograd
# Declared once, as an autograd.Function. Eager: the forward computes the loss and the (scaled)
# gradient in one launch and keeps the gradient; the backward multiplies it by the incoming
# gradient in place (skipped where that is exactly 1). Under torch.compile the launch runs inside
# a custom op, opaque to the compiler (no graph break), which returns the unscaled gradient as an
# output; the reduction and the product with the incoming gradient are traced PyTorch.

from .._autograd import backward_once, first_order_only  # noqa: E402  (here: the autograd section does not version kernels)

# The loss an autograd.Function returns is neither a no-op ``.to`` (as_dtype) nor an in-place result:
# either got a zero gradient under torch.compile with torch 2.11.
from ..fallback.cross_entropy import as_dtype  # noqa: E402  (here: the autograd section does not version kernels)


def _reduce(loss_rows, z_rows, reduction, scale, dtype):
    if reduction == "none":
        return as_dtype(loss_rows, dtype), None if z_rows is None else as_dtype(z_rows, dtype)
    if reduction == "sum":
        return as_dtype(loss_rows.sum(), dtype), None if z_rows is None else as_dtype(z_rows.sum(), dtype)
    return as_dtype(loss_rows.sum() * scale, dtype), None if z_rows is None else as_dtype(z_rows.sum() * scale, dtype)


@torch.library.custom_op("liger_portable::cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(loss, z_loss, d(row loss)/d(logits))``; ``softcap <= 0`` means none."""
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    loss, z = ce_rows(
        logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, softcap=softcap if softcap > 0 else None, grad=grad,
    )
    return loss, z if z is not None else torch.zeros_like(loss), grad


@cross_entropy_op.register_fake
def _(logits, target, ignore_index, label_smoothing, lse_square_scale, softcap):
    rows = logits.new_empty(logits.shape[:1], dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(logits, memory_format=torch.contiguous_format)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits, target, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, inplace, dev,
        loss_dtype,
    ):
        ctx.reduction = reduction
        if torch.compiler.is_compiling():
            loss_rows, z_rows, grad = cross_entropy_op(
                logits, target, ignore_index, label_smoothing, lse_square_scale,
                -1.0 if softcap is None else softcap,
            )
            scale = mean_scale(target, ignore_index) if reduction == "mean" else None
            loss, z = _reduce(
                loss_rows, z_rows if lse_square_scale != 0.0 else None, reduction, scale, loss_dtype or logits.dtype
            )
            ctx.save_for_backward(grad, scale)
        else:
            want_grad = ctx.needs_input_grad[0]
            scale = mean_scale(target, ignore_index) if reduction == "mean" else None
            grad = None
            if want_grad:
                grad = logits if inplace else empty(logits.shape, dtype=logits.dtype, device=logits.device)
            loss_rows, z_rows = ce_rows(
                logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                lse_square_scale=lse_square_scale, softcap=softcap,
                scale=scale if reduction == "mean" else None, return_grad=want_grad, grad=grad, dev=dev,
            )
            if want_grad and inplace:
                # The kernel wrote the gradient over the logits behind autograd's back: bump their
                # version, so any other node that saved them fails loudly instead of reading gradients.
                torch.autograd.graph.increment_version(logits)
            ctx.grad = grad
            ctx.done = False
            ctx.dev = dev
            loss, z = _reduce(loss_rows, z_rows, reduction, scale, loss_dtype or logits.dtype)
            if z is None:  # eager: no tensor made for an output nobody reads
                return loss, None
        if z is None:
            z = loss.new_zeros(())
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    @first_order_only("cross_entropy")
    def backward(ctx, dloss, _dz):
        if torch.compiler.is_compiling():
            # The gradient of the reduction, then the unscaled row gradients times it (out of place).
            grad, scale = ctx.saved_tensors
            dloss_rows = dloss.to(torch.float32)
            if ctx.reduction == "mean":
                dloss_rows = dloss_rows * scale
            dloss_rows = dloss_rows.reshape(-1, 1)  # one factor per row, or one for all rows
            return (grad * dloss_rows).to(grad.dtype), None, None, None, None, None, None, None, None, None
        backward_once(ctx, "cross_entropy")
        grad = ctx.grad
        ctx.grad = None
        if dloss is not None:
            scale_rows_(grad, dloss.reshape(-1).to(torch.float32), dev=ctx.dev)
        return grad, None, None, None, None, None, None, None, None, None


_apply_cross_entropy = eager_apply(_CrossEntropyFunction, 2)


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, softcap: float | None, reduction: str, inplace: bool, dev=None,
    loss_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable cross-entropy of 2-D ``logits`` (last dimension contiguous) and 1-D ``target``.

    Returns ``(loss, z_loss)`` reduced per ``reduction``, in ``loss_dtype`` (None: the logits dtype); ``z_loss`` is None
    without ``lse_square_scale``. ``inplace``: the gradient is written over ``logits`` during the
    forward (no memory beyond the logits); ignored under torch.compile. ``dev`` is the
    :class:`~liger_portable.DeviceInfo` of ``logits`` where the caller has it (None: looked up).
    """
    loss, z = _apply_cross_entropy(
        logits, target, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, inplace, dev, loss_dtype
    )
    return loss, z if lse_square_scale != 0.0 else None


# --------------------------------------------------------------------------- specs and examples
# What the config tables, the tuner and the vendor compile matrix know of these kernels, declared
# here once. An example builds one problem's inputs from the tuner's Problem ``p`` and launches
# exactly one kernel with an explicit config through the launch functions above (looked up at call
# time, so a test can spy on them); see KernelSpec.examples.


def _examples(p) -> list:
    n_rows, n_cols = p.rows_cols()
    p.need(2 * n_rows * n_cols, 8 * n_rows)  # logits, gradient; target, row losses
    logits, target = p.randn(n_rows, n_cols, scale=2.0), p.targets(n_rows, n_cols)
    grad = torch.empty_like(logits)
    scale = mean_scale(target, IGNORE_INDEX)

    def launch(r: Resolved) -> tuple[torch.Tensor, torch.Tensor]:
        loss, _ = ce_rows(logits, target, ignore_index=IGNORE_INDEX, scale=scale, grad=grad, config=r)
        return loss, grad

    def every_option(r: Resolved) -> tuple[torch.Tensor, torch.Tensor]:
        loss, _ = ce_rows(logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.1, lse_square_scale=1e-4,
                          softcap=30.0, scale=scale, grad=grad, config=r)
        return loss, grad

    inputs = {"logits": logits, "target": target, "grad": grad}
    return [("plain", inputs, launch), ("smoothing+z-loss+softcap", inputs, every_option)]


SPECS = register(
    KernelSpec(
        # One row (token) per program, looping over the vocabulary in BLOCK_V steps; loss and
        # gradient in one launch. n_cols is the vocabulary size.
        name="cross_entropy",
        key=("n_cols", "n_rows"),
        bucket=rows_cols_bucket,
        params={"BLOCK_V": BLOCK_V},
        source="ops/cross_entropy.py",
        tile_values=lambda c, p: c["BLOCK_V"],
        examples=_examples,
        shown=("vocab 128256, 8192 rows", (128256, 8192)),
    ),
)
