"""Rotary position embedding (Hugging Face's ``apply_rotary_pos_emb``) in Triton: one source for
every vendor, one kernel for forward and backward.

Layout. The launch code takes ``q`` and ``k`` as 4-D *logical* ``(batch, heads, seq, head_dim)``
tensors with any strides except a contiguous last dimension (the public function passes the
transposed view for ``unsqueeze_dim=2``), and ``cos``/``sin`` as ``(1 or batch, >= seq, head_dim)``
with a contiguous last dimension. Nothing is copied: Hugging Face's ``q`` (a
``view(B, S, H, D).transpose(1, 2)``) is read through its strides.

Grid. One launch covers q and k: a 1-D grid over ``batch x seq blocks x head groups`` (q heads
then k heads, ``HEADS`` neighbouring heads a group), heads fastest, so that programs running side
by side share one block of cos/sin (read per program, it stays in L2) and, in the Hugging Face
layout, touch neighbouring memory. Each program loads ``BLOCK_S`` positions of cos/sin once and
rotates them for each head of its group; the two halves of the head dimension are loaded as
two ``BLOCK_S x next_pow2(head_dim / 2)`` tiles (masked when head_dim / 2 is not a power of two).

Maths (rotate-half convention, with ``x = [x1, x2]``, ``cos = [c1, c2]``, ``sin = [s1, s2]``)::

    forward   y1 = x1 c1 - x2 s1            y2 = x2 c2 + x1 s2
    backward  dx1 = dy1 c1 + dy2 s2         dx2 = dy2 c2 - dy1 s1

The backward is the forward with ``sin`` replaced by ``-[s2, s1]``: for Hugging Face's cos/sin
(``s1 == s2``) that is the rotation by -theta; swapping the halves keeps it the exact gradient for
any cos/sin. All halves of cos and sin are read (not only the first), so arbitrary cos/sin give
Hugging Face's result. cos and sin get no gradient.

Outputs are new tensors (the inputs are left untouched) laid out in the memory order of the
tensor they are computed from (same strides when that tensor is dense: Hugging Face's transposed q
gives a ``q_embed`` with q's strides, as eager PyTorch's elementwise ops do); a tensor whose last
dimension is not contiguous is copied first, and its result is contiguous.

Loads are in the input dtype, arithmetic in fp32, stores in the output dtype (that of the input);
all offsets are int64.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ..configs import Resolved
from .._dispatch import device_info
from ..specs import KernelSpec, Param, next_pow2, register, rope_bucket
from .launching import Launcher, eager_apply, kernel_op, plan, split_launch

# Output allocators; the tests swap in ones that fill with NaN to catch unwritten elements.
empty = torch.empty
empty_like = torch.empty_like


@triton.jit
def _rope_tile(
    X, Y, b, h, rows64, cols, mask, sxb, sxh, sxs, s_yb, s_yh, s_ys, c1, c2, s1, s2,
    HALF: tl.constexpr,
):
    x_ptr = X + b * sxb + h * sxh + rows64[:, None] * sxs + cols[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    y_ptr = Y + b * s_yb + h * s_yh + rows64[:, None] * s_ys + cols[None, :]
    tl.store(y_ptr, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HALF, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN,
    sqb, sqh, sqs, skb, skh, sks,
    sqob, sqoh, sqos, skob, skoh, skos,
    scb, scs, ssb, sss,
    n_qh, n_heads, seq_len, n_sblocks, n_hgroups,
    BACKWARD: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    HEADS: tl.constexpr,
):
    pid = tl.program_id(0)
    hg = pid % n_hgroups
    t = pid // n_hgroups
    sblk = t % n_sblocks
    b = (t // n_sblocks).to(tl.int64)
    rows = sblk * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < seq_len)[:, None] & (cols < HALF)[None, :]
    rows64 = rows.to(tl.int64)

    c_ptr = COS + b * scb + rows64[:, None] * scs + cols[None, :]
    s_ptr = SIN + b * ssb + rows64[:, None] * sss + cols[None, :]
    c1 = tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # The transpose of the forward: sin -> -[s2, s1] (rotation by -theta when s1 == s2).
        neg_s2 = -s2
        s2 = -s1
        s1 = neg_s2

    # HEADS neighbouring heads share the cos/sin tile loaded above.
    for i in tl.static_range(HEADS):
        h = hg * HEADS + i
        if h < n_qh:
            _rope_tile(Q, QO, b, h.to(tl.int64), rows64, cols, mask, sqb, sqh, sqs, sqob, sqoh, sqos,
                       c1, c2, s1, s2, HALF=HALF)
        elif h < n_heads:
            _rope_tile(K, KO, b, (h - n_qh).to(tl.int64), rows64, cols, mask, skb, skh, sks, skob, skoh, skos,
                       c1, c2, s1, s2, HALF=HALF)


# --------------------------------------------------------------------------- launch


def out_like(x: torch.Tensor, alloc: Callable = torch.empty, alloc_like: Callable = torch.empty_like) -> torch.Tensor:
    """A new tensor of ``x``'s shape and dtype, dense, in ``x``'s memory order (the strides of
    ``x`` when ``x`` is dense, like ``torch.empty_like``); contiguous if the last dimension of ``x``
    is not (the launch copies such an input). The last dimension always has stride 1."""
    if x.stride(-1) != 1:
        return alloc(tuple(x.shape), dtype=x.dtype, device=x.device)
    out = alloc_like(x)  # x's own strides if x is dense (HF's transposed q): one allocation, no permute
    if out.stride() == x.stride():
        return out
    n = x.dim()
    strides = x.stride()
    order = sorted(range(n - 1), key=lambda i: (-strides[i], i)) + [n - 1]  # outermost first
    buf = alloc(tuple(x.shape[i] for i in order), dtype=x.dtype, device=x.device)
    return buf.permute([order.index(i) for i in range(n)])


def _last_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


launch_rope = Launcher(_rope_kernel)


def _plan(cfg: Resolved, dev, head_dim: int, n_heads: int, seq_len: int) -> tuple:
    """(programs per batch element, seq blocks, head groups, constexprs of the forward and of the
    backward, launch options) for one problem."""
    consts, opts = split_launch(cfg)
    consts.update(HALF=head_dim // 2, BLOCK_H=next_pow2(head_dim // 2))
    n_sblocks = triton.cdiv(seq_len, cfg.meta["BLOCK_S"])
    n_hgroups = triton.cdiv(n_heads, cfg.meta["HEADS"])
    by_direction = ({**consts, "BACKWARD": False}, {**consts, "BACKWARD": True})
    return n_sblocks * n_hgroups, n_sblocks, n_hgroups, by_direction, opts


def _launch(
    a: torch.Tensor | None, b: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    backward: bool, config: Resolved | None, dev=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    a, b = _last_contiguous(a), _last_contiguous(b)
    cos, sin = _last_contiguous(cos), _last_contiguous(sin)
    ref = a if a is not None else b
    batch, _, seq_len, head_dim = ref.shape
    n_a = a.shape[1] if a is not None else 0
    n_b = b.shape[1] if b is not None else 0
    ao = out_like(a, empty, empty_like) if a is not None else None
    bo = out_like(b, empty, empty_like) if b is not None else None
    n_heads = n_a + n_b
    if n_heads == 0 or seq_len == 0 or batch == 0:
        return ao, bo
    per_batch, n_sblocks, n_hgroups, by_direction, opts = plan(
        "rope", dev or device_info(ref), (head_dim, n_heads, seq_len), ref.dtype, _plan, config
    )
    # A missing tensor (its gradient not needed) is replaced by the other; its heads are not visited.
    qa, qao = (a, ao) if a is not None else (b, bo)
    kb, kbo = (b, bo) if b is not None else (a, ao)
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    sb = sin.stride(0) if sin.shape[0] > 1 else 0
    launch_rope(
        (batch * per_batch,),
        (
            qa, kb, qao, kbo, cos, sin,
            *qa.stride()[:3], *kb.stride()[:3], *qao.stride()[:3], *kbo.stride()[:3],
            cb, cos.stride(1), sb, sin.stride(1),
            n_a, n_heads, seq_len, n_sblocks, n_hgroups,
        ),
        by_direction[backward], opts,
    )
    return ao, bo


def rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config: Resolved | None = None,
    dev=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (logical ``(batch, heads, seq, head_dim)``, same batch, seq and even
    head_dim) by cos/sin ``(1 or batch, >= seq, head_dim)`` in one launch.

    The problem key is ``(head_dim, q heads + k heads, seq)``; ``config`` overrides the resolved
    launch config (the tuner and benchmarks use it); ``dev`` is the
    :class:`~liger_portable.DeviceInfo` of the tensors where the caller knows it. Returns new
    ``(q_embed, k_embed)``.
    """
    return _launch(q, k, cos, sin, False, config, dev)


def rope_bwd(
    dq: torch.Tensor | None, dk: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    config: Resolved | None = None, dev=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of q and k from those of q_embed and k_embed (either may be None: not computed)."""
    return _launch(dq, dk, cos, sin, True, config, dev)


# --------------------------------------------------------------------------- autograd
# Declared once: an autograd.Function whose forward and backward launch directly in eager mode
# (the cheapest path on the host) and, under torch.compile, call the same launches through kernel
# ops (launching.kernel_op: on CUDA the compiled code launches the kernels itself; no graph break).

from .._autograd import first_order_only  # noqa: E402  (here: the autograd section does not version kernels)

def _rope_op_fake(q, k, cos, sin):
    return out_like(q), out_like(k)


@kernel_op("liger_portable::rope", fake=_rope_op_fake)
def rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of logical ``(batch, heads, seq, head_dim)`` q and k: ``(q_embed, k_embed)``."""
    return rope_fwd(q, k, cos, sin)


def _rope_backward_op_fake(dq, dk, cos, sin):
    return out_like(dq), out_like(dk)


@kernel_op("liger_portable::rope_backward", fake=_rope_backward_op_fake)
def rope_backward_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_bwd(dq, dk, cos, sin)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, dev):
        if torch.compiler.is_compiling():
            qo, ko = rope_op(q, k, cos, sin)
            ctx.out_meta = [(o.shape, o.dtype, o.device) for o in (qo, ko)]
        else:
            qo, ko = rope_fwd(q, k, cos, sin, dev=dev)
        ctx.save_for_backward(cos, sin)
        ctx.dev = dev
        ctx.set_materialize_grads(False)
        return qo, ko

    @staticmethod
    @first_order_only("rope")
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        if torch.compiler.is_compiling():
            # Gradients of unused outputs may arrive as None; the op takes tensors.
            grads = [
                g if g is not None else torch.zeros(s, dtype=d, device=where)
                for g, (s, d, where) in zip((dq, dk), ctx.out_meta)
            ]
            dq, dk = rope_backward_op(grads[0], grads[1], cos, sin)
            return dq, dk, None, None, None
        dq = dq if ctx.needs_input_grad[0] else None
        dk = dk if ctx.needs_input_grad[1] else None
        dq, dk = rope_bwd(dq, dk, cos, sin, dev=ctx.dev)
        return dq, dk, None, None, None


_apply_rope = eager_apply(_RopeFunction, 4)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dev=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable RoPE of logical ``(batch, heads, seq, head_dim)`` q and k (see the module doc);
    ``dev`` is the :class:`~liger_portable.DeviceInfo` of q and k where the caller has it (None:
    looked up)."""
    return _apply_rope(q, k, cos, sin, dev)


# --------------------------------------------------------------------------- specs and examples
# What the config tables, the tuner and the vendor compile matrix know of these kernels, declared
# here once. An example builds one problem's inputs from the tuner's Problem ``p`` and launches
# exactly one kernel with an explicit config through the launch functions above (looked up at call
# time, so a test can spy on them); see KernelSpec.examples.


def _examples(p) -> list:
    head_dim, n_heads, seq = p.named["head_dim"], p.named["n_heads"], p.named["seq_len"]
    n_k = n_heads // 2
    n_q = n_heads - n_k
    p.need(2 * n_heads * seq * head_dim + 2 * seq * head_dim)  # q, k, their outputs; cos, sin
    # Hugging Face's layout: projections viewed as (batch, seq, heads, head_dim), then transposed.
    q = p.randn(1, seq, n_q, head_dim).transpose(1, 2)
    k = p.randn(1, seq, n_k, head_dim).transpose(1, 2) if n_k else None
    cos, sin = p.randn(1, seq, head_dim), p.randn(1, seq, head_dim)
    inputs = {"q": q, "cos": cos, "sin": sin, **({"k": k} if k is not None else {})}
    return [
        ("forward", inputs, lambda r: rope_fwd(q, k, cos, sin, config=r)),
        ("backward", inputs, lambda r: rope_bwd(q, k, cos, sin, config=r)),
    ]


SPECS = register(
    KernelSpec(
        # One kernel for forward and backward (the backward rotates by -theta).
        name="rope",
        key=("head_dim", "n_heads", "seq_len"),
        bucket=rope_bucket,
        params={
            "BLOCK_S": Param(1, 256, doc="sequence positions per program"),
            "HEADS": Param(1, 64, doc="neighbouring heads per program, sharing one cos/sin tile"),
        },
        tile_values=lambda c, p: c["BLOCK_S"] * next_pow2(p["head_dim"] // 2),
        source="ops/rope.py",
        examples=_examples,
        shown=("q 32 + k 8 heads, seq 4096, head_dim 128", (128, 40, 4096)),
    ),
)
