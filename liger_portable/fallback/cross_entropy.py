"""Cross-entropy and fused linear cross-entropy in plain PyTorch, chunked over rows.

The CPU path never holds more than one chunk of fp32 (float64 for float64 inputs) logits and
intermediates: each chunk's loss and gradient are computed in the forward, the gradient is kept
in the input dtype (the size of the gradient autograd would hand back anyway; for the fused
linear cross-entropy only the gradients of hidden, weight and bias are kept, float16's in float32
and the bias's sum in float32: see :func:`_working`) and the backward multiplies it by the
incoming gradient. Semantics as the Triton kernels (see
:mod:`liger_portable.ops.cross_entropy`).
"""

from __future__ import annotations

import torch

from .._autograd import backward_once, first_order_only

# Memory of one chunk of compute-dtype logits, in bytes (a module constant the tests lower).
CHUNK_BYTES = 32 * 2**20
# Bytes in one MiB of a caller's ``chunk_mib`` (the tests lower it, as CHUNK_BYTES).
CHUNK_UNIT = 2**20


def chunk_rows(n_cols: int, element_size: int, chunk_bytes: int) -> int:
    """Rows per chunk: ``chunk_bytes`` of logits, at least 1, a multiple of 8 where possible."""
    rows = max(1, chunk_bytes // max(1, n_cols * element_size))
    return rows - rows % 8 if rows >= 8 else rows


def ce_rows_torch(
    x: torch.Tensor, t: torch.Tensor, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, softcap: float | None, want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row ``(loss, z_loss, d(loss)/dx)`` of one chunk ``x`` (rows, V); fp32 (float64 for
    float64 ``x``). The loss includes the z-loss; ignored rows get 0 and a zero gradient."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = x.to(cd)
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = softcap * th
    n_cols = z.shape[1]
    ignored = t == ignore_index
    t_safe = torch.where(ignored, torch.zeros_like(t), t).long()[:, None]
    m = z.amax(1, keepdim=True)
    shifted = z - m
    e = shifted.exp()
    d = e.sum(1, keepdim=True)
    log_d = d.log()
    ce = log_d - shifted.gather(1, t_safe)
    if label_smoothing != 0.0:
        ce = (1.0 - label_smoothing) * ce + label_smoothing * (log_d - shifted.mean(1, keepdim=True))
    lse = m + log_d
    z_loss = lse_square_scale * lse * lse
    keep = ~ignored[:, None]
    loss = torch.where(keep, ce + z_loss, 0.0).squeeze(1)
    z_loss = torch.where(keep, z_loss, 0.0).squeeze(1)
    if not want_grad:
        return loss, z_loss, None
    g = e / d
    if lse_square_scale != 0.0:
        g = g * (1.0 + 2.0 * lse_square_scale * lse)
    if label_smoothing != 0.0:
        g = g - label_smoothing / n_cols
    g = g.scatter_add(1, t_safe, torch.full_like(shifted[:, :1], -(1.0 - label_smoothing)))
    if softcap is not None:
        g = g * (1.0 - th * th)
    return loss, z_loss, torch.where(keep, g, 0.0)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, as ``t`` itself when it already is: an autograd.Function that returned
    ``t.to(t.dtype)`` (an alias of ``t`` when traced) got a zero gradient under torch.compile with
    torch 2.11 (fixed by 2.13), so the compiled patched models trained on zero gradients."""
    return t if t.dtype == dtype else t.to(dtype)


def _reduce(loss_rows, z_rows, reduction, count, dtype):
    if reduction == "none":
        return as_dtype(loss_rows, dtype), as_dtype(z_rows, dtype)
    if reduction == "sum":
        return as_dtype(loss_rows.sum(), dtype), as_dtype(z_rows.sum(), dtype)
    return as_dtype(loss_rows.sum() / count, dtype), as_dtype(z_rows.sum() / count, dtype)


def _count(target, ignore_index):
    return (target != ignore_index).sum().clamp_min(1)


def _scale_for(dloss, reduction, count, n_rows):
    """The per-row factor (column vector) of the stored per-row gradients."""
    if reduction == "none":
        return dloss.reshape(n_rows, 1)
    f = dloss.reshape(1, 1)
    return f / count if reduction == "mean" else f


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, loss_dtype):
        want = ctx.needs_input_grad[0]
        n_rows, n_cols = logits.shape
        cd = torch.float64 if logits.dtype == torch.float64 else torch.float32
        loss_rows = logits.new_empty((n_rows,), dtype=cd)
        z_rows = logits.new_empty((n_rows,), dtype=cd)
        grad = torch.empty_like(logits) if want else None
        step = chunk_rows(n_cols, cd.itemsize, CHUNK_BYTES)
        for s in range(0, n_rows, step):
            loss, zl, g = ce_rows_torch(
                logits[s:s + step], target[s:s + step], ignore_index, label_smoothing, lse_square_scale,
                softcap, want,
            )
            loss_rows[s:s + step] = loss
            z_rows[s:s + step] = zl
            if want:
                grad[s:s + step] = g.to(logits.dtype)
        count = _count(target, ignore_index)
        if want:
            ctx.save_for_backward(grad, count)
        ctx.reduction = reduction
        loss, z = _reduce(loss_rows, z_rows, reduction, count, loss_dtype or logits.dtype)
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    @first_order_only("cross_entropy")
    def backward(ctx, dloss, _dz):
        backward_once(ctx, "cross_entropy")  # as the kernels (which scale the gradient in place)
        grad, count = ctx.saved_tensors
        f = _scale_for(dloss, ctx.reduction, count, grad.shape[0])
        return as_dtype(grad * f, grad.dtype), None, None, None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
    lse_square_scale: float, softcap: float | None, return_z_loss: bool, loss_dtype: torch.dtype | None = None,
):
    """Cross-entropy of ``logits`` (..., V) against integer ``target`` (...); see
    :func:`liger_portable.functional.cross_entropy` for the options. Returns the loss, or
    ``(loss, z_loss)`` with ``return_z_loss``, in ``loss_dtype`` (None: the logits dtype)."""
    x = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1)
    loss, z = _CrossEntropy.apply(x, t, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, loss_dtype)
    if reduction == "none":
        loss, z = loss.view(target.shape), z.view(target.shape)
    return (loss, z) if return_z_loss else loss


def _working(hidden, weight, bias):
    """The inputs in the dtype the products and gradient sums use: their own, except float16,
    whose range (65504) a token-summed weight or bias gradient passes before the mean divides it
    (one frequent token and one large hidden feature are enough): float16 works in float32."""
    if hidden.dtype != torch.float16:
        return hidden, weight, bias
    return hidden.float(), weight.float(), None if bias is None else bias.float()


def _logit_chunks(hidden, weight, bias, chunk_bytes):
    """``(rows, hidden[rows], logits of those rows)`` chunk by chunk: ``chunk_bytes`` of
    compute-dtype logits per chunk, the logits in the inputs' dtype (upcast by ``ce_rows_torch``)."""
    cd = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    step = chunk_rows(weight.shape[0], cd.itemsize, chunk_bytes)
    for s in range(0, hidden.shape[0], step):
        rows = slice(s, s + step)
        hc = hidden[rows]
        logits = hc @ weight.t()
        yield rows, hc, logits if bias is None else logits + bias


def _add_chunk_grads(g, hc, weight, rows, gh, gw, gb) -> None:
    """A chunk's share of the gradients from its logit gradient ``g`` (in the working dtype; the
    bias's sum in float32 or float64)."""
    if gh is not None:
        gh[rows] = g @ weight
    if gw is not None:
        gw += g.t() @ hc
    if gb is not None:
        gb += g.sum(0, dtype=gb.dtype)


def _grad_buffers(hidden, weight, bias, want_h, want_w, want_b):
    """Zeroed gradients of the working ``hidden`` and ``weight`` and the bias's wider sum."""
    cd = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return (
        torch.zeros_like(hidden) if want_h else None,
        torch.zeros_like(weight) if want_w else None,
        torch.zeros_like(bias, dtype=cd) if want_b else None,
    )


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
                chunk_bytes):
        want_h, want_w, _, want_b = ctx.needs_input_grad[:4]
        want = want_h or want_w or want_b
        n_rows = hidden.shape[0]
        cd = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        loss_rows = hidden.new_empty((n_rows,), dtype=cd)
        z_rows = hidden.new_empty((n_rows,), dtype=cd)
        count = _count(target, ignore_index)
        # reduction "none" cannot fold the per-row factors into weight's gradient before they are
        # known: its backward recomputes the chunks with them (one more logits product).
        per_row = reduction == "none"
        store = want and not per_row
        hw, ww, bw = _working(hidden, weight, bias)
        gh, gw, gb = _grad_buffers(hw, ww, bw, store and want_h, store and want_w, store and want_b)
        for rows, hc, logits in _logit_chunks(hw, ww, bw, chunk_bytes):
            loss, zl, g = ce_rows_torch(
                logits, target[rows], ignore_index, label_smoothing, lse_square_scale, softcap, store
            )
            loss_rows[rows] = loss
            z_rows[rows] = zl
            if store:
                _add_chunk_grads(g.to(hw.dtype), hc, ww, rows, gh, gw, gb)
        ctx.save_for_backward(hidden, weight, target, bias, count, gh, gw, gb)
        ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
        ctx.chunk_bytes = chunk_bytes
        loss, z = _reduce(loss_rows, z_rows, reduction, count, torch.promote_types(hidden.dtype, torch.float32))
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    @first_order_only("fused_linear_cross_entropy")
    def backward(ctx, dloss, _dz):
        hidden, weight, target, bias, count, gh, gw, gb = ctx.saved_tensors
        ignore_index, label_smoothing, lse_square_scale, softcap, reduction = ctx.options
        want_h, want_w, _, want_b = ctx.needs_input_grad[:4]
        if reduction != "none":
            backward_once(ctx, "fused_linear_cross_entropy")  # as the kernels (which scale in place)
            f = _scale_for(dloss, reduction, count, 1).reshape(())
        else:
            f = None
            hw, ww, bw = _working(hidden, weight, bias)
            gh, gw, gb = _grad_buffers(hw, ww, bw, want_h, want_w, want_b)
            for rows, hc, logits in _logit_chunks(hw, ww, bw, ctx.chunk_bytes):
                _, _, g = ce_rows_torch(
                    logits, target[rows], ignore_index, label_smoothing, lse_square_scale, softcap, True
                )
                _add_chunk_grads((g * dloss[rows, None].to(g.dtype)).to(hw.dtype), hc, ww, rows, gh, gw, gb)

        def finish(g, like):
            if g is None:
                return None
            return as_dtype(g if f is None else g * f, like.dtype)

        return finish(gh, hidden), finish(gw, weight), None, finish(gb, bias), None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, reduction: str, label_smoothing: float, lse_square_scale: float,
    softcap: float | None, return_z_loss: bool, chunk_mib: int | None = None,
):
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target``, chunked over tokens so the
    logits never exist in full; see :func:`liger_portable.functional.fused_linear_cross_entropy`.
    ``chunk_mib``: MiB of fp32 (float64) logits per chunk; None: ``CHUNK_BYTES``."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    chunk_bytes = chunk_mib * CHUNK_UNIT if chunk_mib else CHUNK_BYTES
    loss, z = _FusedLinearCrossEntropy.apply(
        h, weight, t, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_bytes
    )
    if reduction == "none":
        loss, z = loss.view(target.shape), z.view(target.shape)
    return (loss, z) if return_z_loss else loss
