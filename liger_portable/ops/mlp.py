"""The MLP's activation product and down projection in one autograd function (used by
:class:`liger_portable.nn.SwiGLUMLP` / :class:`~liger_portable.nn.GEGLUMLP`), over the GLU kernels of
:mod:`liger_portable.ops.glu`. Kept apart from that module: a tuned cache entry is keyed by the hash
of its kernel's source file, and nothing here changes the kernels."""

from __future__ import annotations

import torch

from .glu import can_write_in_place, glu_bwd, glu_fwd
from .._autograd import first_order_only
from .launching import eager_apply


class _GLUDownFunction(torch.autograd.Function):
    """``linear(act(a) * b, weight, bias)`` for an MLP's down projection, saving ``a``, ``b`` and
    the weight but not the product: the backward recomputes it (one more pass over ``a`` and ``b``)
    for the weight gradient. A Llama MLP otherwise keeps the product for the backward, a
    (tokens x intermediate) tensor per layer. The recomputed product is bitwise the forward's (same
    kernel, same config), so the gradients are those of the unfused modules. The backward writes
    ``da``, ``db`` over ``a`` and ``b`` when they do not overlap (they are the MLP's private
    activations), hence runs once."""

    @staticmethod
    def forward(ctx, a, b, weight, bias, act, dev):
        out = torch.nn.functional.linear(glu_fwd(a, b, act, dev=dev), weight, bias)
        ctx.save_for_backward(a, b, weight)
        ctx.act, ctx.has_bias, ctx.done, ctx.dev = act, bias is not None, False, dev
        return out

    @staticmethod
    @first_order_only("swiglu/geglu (fused with the down projection)")
    def backward(ctx, dy):
        if ctx.done:
            raise RuntimeError(
                "liger_portable's fused MLP can run backward only once: the first backward overwrote "
                "its gate and up activations with their gradients (as inplace_backward=True does)."
            )
        a, b, weight = ctx.saved_tensors
        c = glu_fwd(a, b, ctx.act, dev=ctx.dev)
        dweight = dy.t().mm(c) if ctx.needs_input_grad[2] else None
        dbias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        dc = dy.mm(weight)
        del c
        inplace = can_write_in_place(a, b)
        da, db = glu_bwd(dc, a, b, ctx.act, inplace, dev=ctx.dev)
        if inplace:
            ctx.done = True
            torch.autograd.graph.increment_version(a)
            torch.autograd.graph.increment_version(b)
        return da, db, dweight, dbias, None, None


_apply_glu_down = eager_apply(_GLUDownFunction, 4)


def glu_down(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str, dev=None
) -> torch.Tensor:
    """Differentiable ``linear(act(a) * b, weight, bias)`` of 2-D ``a``, ``b`` (last dimension
    contiguous) that does not keep ``act(a) * b`` for the backward (see :class:`_GLUDownFunction`).
    Eager autograd only: the caller takes the unfused path under torch.compile. ``dev`` is the
    :class:`~liger_portable.DeviceInfo` of ``a`` where the caller has it (None: looked up)."""
    return _apply_glu_down(a, b, weight, bias, act, dev)
