"""SwiGLU and GeGLU (``act(a) * b``) forward and backward in Triton: one source for every vendor.

One forward and one backward kernel serve both activations through the ``ACT`` constexpr
(``"silu"`` or ``"gelu_tanh"``). Both activations are ``act(a) = a * sigmoid(z(a))``:

- SiLU: ``z = a``;
- tanh-GELU: ``0.5 a (1 + tanh(u)) = a * sigmoid(2u)`` with ``u = sqrt(2/pi) (a + 0.044715 a^3)``,

so tanh is never needed (no libdevice): ``tl.sigmoid`` is ``1 / (1 + exp(-x))`` on every backend
and in the interpreter. The derivative is ``act'(a) = s + act(a) (1 - s) z'(a)`` with ``s = sigmoid(z)``.

Each program owns a 2-D tile of ``BLOCK_M`` rows x ``BLOCK_N`` columns of the (rows, last dim)
problem, on a 1-D grid in row-major tile order (consecutive programs read consecutive memory; a
1-D grid has no 65535 limit on the row count). Row strides are arguments, so a last-dim-contiguous
view (e.g. the two halves of a fused gate/up projection) is read in place, without a copy. Row
offsets are int64.

Numerics follow eager PyTorch on ``act(a) * b`` in the input dtype (Hugging Face's LlamaMLP /
GemmaMLP): everything is computed in fp32, and the intermediates eager rounds are rounded here too
(``act(a)`` before the product; ``dc * b`` before the activation's derivative), so a bf16 model
gets the same numbers as the module it replaces, up to the last bit of exp.

The backward recomputes ``act(a)`` from ``a`` (nothing but ``a`` and ``b`` is saved). With
``inplace`` it writes ``da`` over ``a`` and ``db`` over ``b``: each program loads its tile of ``a``
and ``b`` before storing the gradients of that same tile, and tiles are disjoint, so this is safe
whenever ``a`` and ``b`` do not overlap in memory (the caller checks: :func:`can_write_in_place`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import Resolved
from .._dispatch import device_info
from ..specs import elementwise_spec, next_pow2, register
from .launching import Launcher, eager_apply, kernel_op, plan, split_launch

# Output allocator; the tests swap in one that fills with NaN to catch unwritten elements.
empty = torch.empty

ACTIVATIONS = ("silu", "gelu_tanh")
# Kernel spec (table entry) names per activation: the two share the source, not the tuned configs.
_SPEC = {"silu": ("swiglu_fwd", "swiglu_bwd"), "gelu_tanh": ("geglu_fwd", "geglu_bwd")}


@triton.jit
def _z_and_dz(a, ACT: tl.constexpr):
    """``z(a)`` with ``act(a) = a * sigmoid(z)``, and ``dz/da``; fp32 in, fp32 out."""
    if ACT == "silu":
        z = a
        dz = tl.full(a.shape, 1.0, tl.float32)
    else:
        # 2 * sqrt(2/pi) * (a + 0.044715 a^3) and its derivative.
        a2 = a * a
        z = a * (1.5957691216057308 + 0.07135481627260025 * a2)
        dz = 1.5957691216057308 + 0.21406444881780076 * a2
    return z, dz


@triton.jit
def _glu_fwd_kernel(
    A, B, C,
    stride_a, stride_b, stride_c, n_rows, n_cols,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    a = tl.load(A + rows64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows64 * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z, _dz = _z_and_dz(a, ACT)
    act = (a * tl.sigmoid(z)).to(C.dtype.element_ty).to(tl.float32)  # eager rounds act(a) first
    tl.store(C + rows64 * stride_c + cols[None, :], (act * b).to(C.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    DC, A, B, DA, DB,
    stride_dc, stride_a, stride_b, stride_da, stride_db, n_rows, n_cols,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # DA may be A and DB may be B (in-place backward): every load of the tile precedes its stores.
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    dc = tl.load(DC + rows64 * stride_dc + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + rows64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows64 * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z, dz = _z_and_dz(a, ACT)
    s = tl.sigmoid(z)
    act = a * s
    dact = s + act * (1.0 - s) * dz
    # As eager: db = dc * round(act(a)), da = act'(a) * round(dc * b).
    act_r = act.to(A.dtype.element_ty).to(tl.float32)
    g = (dc * b).to(A.dtype.element_ty).to(tl.float32)
    tl.store(DA + rows64 * stride_da + cols[None, :], (g * dact).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + rows64 * stride_db + cols[None, :], (dc * act_r).to(DB.dtype.element_ty), mask=mask)


launch_fwd = Launcher(_glu_fwd_kernel)
launch_bwd = Launcher(_glu_bwd_kernel)


def _planner(act: str):
    """The plan builder of both GLU kernels for ``act`` (the spec names differ per activation)."""

    def build(cfg: Resolved, dev, n_cols: int, n_rows: int) -> tuple:
        """(grid, constexprs, launch options) for one problem: the table's tile, its columns
        clamped to the row length."""
        block_n = min(cfg.meta["BLOCK_N"], max(16, next_pow2(n_cols)))
        consts, opts = split_launch(cfg)
        consts.update(ACT=act, BLOCK_N=block_n)
        grid = (triton.cdiv(n_rows, cfg.meta["BLOCK_M"]) * triton.cdiv(n_cols, block_n),)
        return grid, consts, opts

    return build


# Per activation: (forward spec, its plan builder), (backward spec, its plan builder).
_PLANS = {act: ((fwd, _planner(act)), (bwd, _planner(act))) for act, (fwd, bwd) in _SPEC.items()}


def glu_fwd(
    a: torch.Tensor, b: torch.Tensor, act: str, config: Resolved | None = None, dev=None,
) -> torch.Tensor:
    """Launch the forward on 2-D ``a`` and ``b`` of one shape and dtype, last dimension contiguous.

    ``act`` is ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU); ``config`` overrides the resolved
    launch config (the tuner and benchmarks use it); ``dev`` is the
    :class:`~liger_portable.DeviceInfo` of ``a`` where the caller knows it. Returns ``act(a) * b``,
    contiguous.
    """
    n_rows, n_cols = a.shape
    kernel, build = _PLANS[act][0]
    grid, consts, opts = plan(kernel, dev or device_info(a), (n_cols, n_rows), a.dtype, build, config)
    c = empty((n_rows, n_cols), dtype=a.dtype, device=a.device)
    launch_fwd(grid, (a, b, c, a.stride(0), b.stride(0), c.stride(0), n_rows, n_cols), consts, opts)
    return c


def glu_bwd(
    dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, act: str, inplace: bool,
    config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward: ``(da, db)`` for 2-D ``a``, ``b`` and ``dc`` of one shape.

    With ``inplace`` the gradients are written over ``a`` and ``b`` and returned as those tensors
    (only legal if :func:`can_write_in_place` holds); otherwise they are new contiguous tensors.
    ``config`` overrides the resolved launch config.
    """
    if dc.stride(-1) != 1:
        dc = dc.contiguous()
    n_rows, n_cols = a.shape
    kernel, build = _PLANS[act][1]
    grid, consts, opts = plan(kernel, dev or device_info(a), (n_cols, n_rows), a.dtype, build, config)
    if inplace:
        da, db = a, b
    else:
        da = empty((n_rows, n_cols), dtype=a.dtype, device=a.device)
        db = empty((n_rows, n_cols), dtype=b.dtype, device=b.device)
    launch_bwd(
        grid, (dc, a, b, da, db, dc.stride(0), a.stride(0), b.stride(0), da.stride(0), db.stride(0), n_rows, n_cols),
        consts, opts,
    )
    return da, db


def _no_self_overlap(t: torch.Tensor) -> bool:
    return t.shape[0] <= 1 or t.stride(0) >= t.shape[1]


def can_write_in_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the backward may write ``da`` over ``a`` and ``db`` over ``b`` (2-D, last dim
    contiguous): no element of either is stored twice, and ``a`` and ``b`` share no element.
    Disjoint halves of one buffer (a fused gate/up projection, ``y[:, :n]`` and ``y[:, n:]``)
    qualify; ``swiglu(x, x)`` does not."""
    if not (_no_self_overlap(a) and _no_self_overlap(b)):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    es = a.element_size()
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + ((a.shape[0] - 1) * a.stride(0) + a.shape[1]) * es
    b1 = b0 + ((b.shape[0] - 1) * b.stride(0) + b.shape[1]) * es
    if a1 <= b0 or b1 <= a0:
        return True
    # Interleaved rows of one buffer with the same row stride s and row length n: disjoint iff
    # the element offset between them, modulo s, leaves n columns on either side.
    if a.stride(0) != b.stride(0) or (b0 - a0) % es:
        return False
    s, n = a.stride(0), a.shape[1]
    d = ((b0 - a0) // es) % s
    return n <= d <= s - n


# --------------------------------------------------------------------------- autograd
# Declared once: an autograd.Function whose forward and backward launch directly in eager mode
# (the cheapest path on the host) and, under torch.compile, call the same launches through kernel
# ops (launching.kernel_op: on CUDA the compiled code launches the kernels itself; no graph break); that path computes the backward out of
# place (the kernel ops do not mutate their inputs).

from .._autograd import first_order_only  # noqa: E402  (here: the autograd section does not version kernels)

def _glu_op_fake(a, b, act):
    return a.new_empty(a.shape)


@kernel_op("liger_portable::glu", fake=_glu_op_fake)
def glu_op(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """``act(a) * b`` of 2-D ``a``, ``b`` (last dimension contiguous); act ``silu`` / ``gelu_tanh``."""
    return glu_fwd(a, b, act)


def _glu_backward_op_fake(dc, a, b, act):
    return a.new_empty(a.shape), b.new_empty(b.shape)


@kernel_op("liger_portable::glu_backward", fake=_glu_backward_op_fake)
def glu_backward_op(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    return glu_bwd(dc, a, b, act, False)


def _glu_op_setup_context(ctx, inputs, output):
    a, b, act = inputs
    ctx.save_for_backward(a, b)
    ctx.act = act


def _glu_op_backward(ctx, dc):
    a, b = ctx.saved_tensors
    da, db = glu_backward_op(dc, a, b, ctx.act)
    return da, db, None


# The kernel op is differentiable on its own, for callers that put it inside an activation-checkpoint
# region under torch.compile (the fused MLP: functional.glu_down). There it must be called directly:
# with torch 2.11 the compiler did not tag the ops of an autograd.Function inside such a region, and
# the partitioner then saved the product instead of recomputing it.
glu_op.register_autograd(_glu_op_backward, setup_context=_glu_op_setup_context)


@kernel_op("liger_portable::glu_product", fake=_glu_op_fake)
def glu_product_op(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """``act(a) * b`` by our kernel, as :func:`glu_op`, whose gradients the compiler generates from
    the PyTorch formula (:func:`_glu_product_backward`) instead of launching our backward kernel."""
    return glu_fwd(a, b, act)


def _glu_product_backward(ctx, dc):
    """The gradients of ``act(a) * b`` as eager PyTorch's autograd computes them for the fallback's
    formula (``dc * b`` and ``act(a)`` rounded to the input dtype). Under torch.compile, inside the
    fused MLP's checkpoint region (``functional.glu_down``): with the product recomputed by a kernel
    of ours (which Inductor does not fuse), Inductor computes these in a kernel of their own that may
    write ``da`` over the saved ``b`` (a donated buffer) once the product's recomputation has read
    it, so the backward peaks at the eager path's memory; with the product in Inductor's formula too,
    its one fused kernel read ``a`` and ``b`` while writing the product, ``da`` and ``db``, two
    (tokens x intermediate) tensors more at the peak of every layer's backward."""
    a, b = ctx.saved_tensors
    if ctx.act == "silu":
        return torch.ops.aten.silu_backward(dc * b, a), dc * torch.nn.functional.silu(a), None
    da = torch.ops.aten.gelu_backward(dc * b, a, approximate="tanh")
    return da, dc * torch.nn.functional.gelu(a, approximate="tanh"), None


glu_product_op.register_autograd(_glu_product_backward, setup_context=_glu_op_setup_context)


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, act, inplace, dev):
        if torch.compiler.is_compiling():
            c = glu_op(a, b, act)
            inplace = False
        else:
            c = glu_fwd(a, b, act, dev=dev)
            inplace = inplace and can_write_in_place(a, b)
        ctx.save_for_backward(a, b)
        ctx.act, ctx.inplace, ctx.done, ctx.dev = act, inplace, False, dev
        return c

    @staticmethod
    @first_order_only("swiglu/geglu")
    def backward(ctx, dc):
        if torch.compiler.is_compiling():
            a, b = ctx.saved_tensors
            da, db = glu_backward_op(dc, a, b, ctx.act)
            return da, db, None, None, None
        if ctx.inplace and ctx.done:
            raise RuntimeError(
                "liger_portable swiglu/geglu with inplace_backward=True can run backward only once: "
                "the first backward overwrote a and b with their gradients. Use "
                "inplace_backward=False with retain_graph=True or double backward."
            )
        a, b = ctx.saved_tensors
        da, db = glu_bwd(dc, a, b, ctx.act, ctx.inplace, dev=ctx.dev)
        if ctx.inplace:
            ctx.done = True
            # The kernel wrote a and b behind autograd's back: bump their version counters, so
            # that any other node that saved them fails loudly instead of reading gradients.
            torch.autograd.graph.increment_version(a)
            torch.autograd.graph.increment_version(b)
        return da, db, None, None, None


_apply_glu = eager_apply(_GLUFunction, 2)


def glu(a: torch.Tensor, b: torch.Tensor, act: str, inplace: bool, dev=None) -> torch.Tensor:
    """Differentiable ``act(a) * b`` of 2-D ``a``, ``b`` (last dimension contiguous).

    ``inplace``: the backward writes the gradients over ``a`` and ``b``; it is dropped when they
    overlap in memory, and under torch.compile (the kernel ops do not mutate their inputs).
    ``dev`` is the :class:`~liger_portable.DeviceInfo` of ``a`` where the caller has it (None:
    looked up).
    """
    return _apply_glu(a, b, act, inplace, dev)


# --------------------------------------------------------------------------- specs and examples
# What the config tables, the tuner and the vendor compile matrix know of these kernels, declared
# here once. An example builds one problem's inputs from the tuner's Problem ``p`` and launches
# exactly one kernel with an explicit config through the launch functions above (looked up at call
# time, so a test can spy on them); see KernelSpec.examples.


def _fwd_examples(act: str):
    def examples(p) -> list:
        n_rows, n_cols = p.rows_cols()
        p.need(3 * n_rows * n_cols)  # a, b, c
        a, b = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols)
        return [("", {"a": a, "b": b}, lambda r: glu_fwd(a, b, act, config=r))]

    return examples


def _bwd_examples(act: str):
    def examples(p) -> list:
        n_rows, n_cols = p.rows_cols()
        p.need(5 * n_rows * n_cols)  # dc, a, b, da, db
        dc, a, b = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols), p.randn(n_rows, n_cols)
        return [("", {"dc": dc, "a": a, "b": b}, lambda r: glu_bwd(dc, a, b, act, False, config=r))]

    return examples


SPECS = register(
    elementwise_spec("swiglu_fwd", "ops/glu.py", _fwd_examples("silu")),
    elementwise_spec("swiglu_bwd", "ops/glu.py", _bwd_examples("silu")),
    elementwise_spec("geglu_fwd", "ops/glu.py", _fwd_examples("gelu_tanh")),
    elementwise_spec("geglu_bwd", "ops/glu.py", _bwd_examples("gelu_tanh")),
)
