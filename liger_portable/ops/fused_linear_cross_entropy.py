"""Fused linear cross-entropy: ``cross_entropy(hidden @ weight.T + bias, target)`` without ever
holding the full (tokens x vocabulary) logits.

The tokens are processed in chunks (:func:`default_chunk_rows`: the config's ``CHUNK_TOKENS``, fewer
where a chunk's logits would pass the memory budget; or ``chunk_mib`` MiB of logits where the caller
sets it; a multiple of 8 where possible). For each chunk, in the forward:

1. ``logits = hidden_chunk @ weight.T (+ bias)`` with ``torch.addmm`` / ``torch.mm`` in the input
   dtype, into one reused chunk buffer;
2. the cross-entropy kernel (:func:`~liger_portable.ops.cross_entropy.ce_rows`) writes the row
   losses and, over the logits in place, ``d(loss)/d(logits)`` (already divided by the count of
   non-ignored tokens for ``mean``, read from a device tensor: no host sync);
3. ``grad_hidden[chunk] = dlogits @ weight``, ``grad_weight += dlogits.T @ hidden_chunk``
   (``addmm`` into one preallocated tensor), ``grad_bias += dlogits.sum(0)`` (in fp32).

fp16 differs in one point: divided by the token count, most of a row's logit gradients (p ~ 1/V)
fall below fp16's subnormals and flush to zero. There the kernel writes ``_HALF_GRAD_SCALE`` times
the gradient of the sum, the matmuls scale their fp32 products back (``alpha``), and the mean's
``rows / count`` is applied at the end (a device tensor; skipped in the kernel where it is 1).
For ``reduction="none"`` the per-token factors are divided by their largest magnitude first, which
is multiplied back at the end.

grad_weight accumulates in the weight's dtype (bf16 for a bf16 model): an fp32 accumulator for
V=128256, H=4096 is 2 GiB, twice the bf16 gradient and more than a default chunk; each chunk's product is
accumulated in fp32 inside the matmul and rounded once per chunk (Liger-Kernel does the same).
Peak extra memory = grad_weight + grad_hidden (+ grad_bias) + one chunk of logits (+ a zero-padded
copy of the weight where V is not a multiple of ``LD_ALIGN``, see :func:`padded_vocab`).

The backward multiplies the stored gradients by the incoming scalar in place (skipped without
a host sync when it is exactly 1). ``reduction="none"`` needs per-token factors that are known
only in the backward, and weight's gradient cannot be rescaled per token after the sum: the
forward then computes only the losses and the backward recomputes each chunk's logits with the
factors (one more ``BT x H x V`` product, the same memory).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..configs import Resolved
from .._dispatch import device_info
from ..fallback.cross_entropy import chunk_rows
from ..specs import BLOCK_V, IGNORE_INDEX, KernelSpec, Param, flce_bucket, register
from .launching import eager_apply, plan
from .cross_entropy import ce_rows, mean_scale, scale_rows_

# Output allocator; the tests swap in one that fills with NaN to catch unwritten elements.
empty = torch.empty

# Bytes in one MiB of a caller's ``chunk_mib`` and of the budget floor; the tests lower it to get
# several chunks out of a tiny problem.
CHUNK_UNIT = 2**20

# Below this much memory a chunk's logits count for little: the default chunk takes at least this
# much of them (fewer chunks, less per-chunk overhead on small heads) where the problem has it.
FLOOR_MIB = 256


def default_chunk_rows(n_cols: int, hidden: int, element_size: int, tokens: int) -> int:
    """Tokens per chunk when the caller sets no ``chunk_mib``.

    ``tokens`` is the config's ``CHUNK_TOKENS``: the count at which reading and writing the weight
    gradient once per chunk costs a small part of the chunk's three products on the device (that
    traffic over the products' time is ``element size x R / (3 x B x tokens)`` for a matmul
    rate ``R`` and a copy bandwidth ``B``, whatever ``hidden`` and ``n_cols``). The chunk takes
    more tokens where their logits stay within ``FLOOR_MIB``, and fewer where the logits would
    take more memory than the weight gradient the step already holds (``n_cols x hidden``), so
    the op's peak beyond its gradients is at most the weight gradient's size, or ``FLOOR_MIB``.
    At least 1, a multiple of 8 where possible."""
    floor = chunk_rows(n_cols, element_size, FLOOR_MIB * CHUNK_UNIT)
    budget = chunk_rows(n_cols, element_size, max(n_cols * hidden * element_size, FLOOR_MIB * CHUNK_UNIT))
    rows = min(max(tokens, floor), budget)
    return rows - rows % 8 if rows >= 8 else max(1, rows)


def _resolved(cfg: Resolved, dev, *problem) -> Resolved:
    return cfg


def config_for(hidden, weight, config, dev=None):
    """The resolved config (``config`` where given), memoized per problem like a launch plan: the
    chunk loop's launches take it as their explicit config."""
    if config is not None:
        return config
    return plan(
        "fused_linear_cross_entropy", dev or device_info(hidden), (weight.shape[0], hidden.shape[0], hidden.shape[1]),
        hidden.dtype, _resolved,
    )


def _chunks(hidden, weight, cfg, chunk_mib=None):
    """Rows per chunk and the ``(start, end)`` of each: ``chunk_mib`` MiB of logits per chunk, else
    :func:`default_chunk_rows`."""
    n_rows, n_cols = hidden.shape[0], weight.shape[0]
    if chunk_mib:
        step = chunk_rows(n_cols, hidden.element_size(), chunk_mib * CHUNK_UNIT)
    else:
        step = default_chunk_rows(n_cols, hidden.shape[1], hidden.element_size(), cfg.meta["CHUNK_TOKENS"])
    step = max(1, min(step, n_rows))
    return step, [(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]


def _chunk(hidden, target, rows, s: int, e: int):
    """Rows ``s:e`` of ``hidden``, ``target`` and each tensor of ``rows`` (None stays None); the
    tensors themselves when the chunk is all of them (a slice costs host time)."""
    if s == 0 and e == hidden.shape[0]:
        return hidden, target, rows
    return hidden[s:e], target[s:e], None if rows is None else tuple(None if r is None else r[s:e] for r in rows)


# The products run on a vocabulary padded with zero rows of the weight to a multiple of LD_ALIGN:
# a product with a dimension or row stride that is not a multiple of 8 elements (GPT-2's V = 50257)
# takes cuBLAS's unaligned kernels. On the H200 the logits and grad_hidden products of a GPT-2 chunk
# ran at 94 and 125 TFLOP/s, against 638 and 685 at V = 50304. The padded weight is a copy (one
# weight's memory more, only for such vocabularies); its zero rows give logits of exactly 0 in
# columns the loss kernel never reads (it sees the first V), which add nothing to the gradients.
LD_ALIGN = 64


def padded_vocab(n_cols: int) -> int:
    """The vocabulary the products run on: ``n_cols`` rounded up to a multiple of ``LD_ALIGN``."""
    return -(-n_cols // LD_ALIGN) * LD_ALIGN


def _pad_rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t`` (V, ...) with zero rows appended up to ``rows`` (``t`` itself when it has them)."""
    if t is None or t.shape[0] == rows:
        return t
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0]))


def _logits(buf, hc, weight, bias):
    out = buf if buf.shape[0] == hc.shape[0] else buf[: hc.shape[0]]
    if bias is None:
        torch.mm(hc, weight.t(), out=out)
    else:
        torch.addmm(bias, hc, weight.t(), out=out)
    return out


def _accumulate(g, hc, weight, gh, gw, gb32, s, e, first, alpha=1.0):
    """Chunk ``s:e``'s share of the gradients from its logit gradient ``g``: ``grad_hidden[s:e] =
    alpha * g @ weight``, ``grad_weight (+)= alpha * g.T @ hidden[s:e]`` (``alpha`` applied in fp32
    inside the matmul, before the one rounding), and the fp32 bias sum ``gb32 += g.sum(0)``
    (unscaled: the caller applies ``alpha`` once at the end). beta=0 (what ``torch.mm`` does): the
    old contents are not read."""
    if gh is not None:
        (gh if s == 0 and e == gh.shape[0] else gh[s:e]).addmm_(g, weight, beta=0, alpha=alpha)
    if gw is not None:
        gw.addmm_(g.t(), hc, beta=0 if first else 1, alpha=alpha)
    if gb32 is not None:
        if first:
            torch.sum(g, 0, dtype=torch.float32, out=gb32)
        else:
            gb32 += g.sum(0, dtype=torch.float32)


def _finish_(gh, gw, gb, gb32, alpha: float, factor: torch.Tensor | None, dev) -> None:
    """After the last chunk: the bias gradient from its fp32 sum (times ``alpha``), then every
    gradient times the device tensor ``factor`` (None: none; rows where it is exactly 1 are skipped)."""
    if gb is not None:
        gb32 = gb32[: gb.shape[0]]  # the padded vocabulary's sums: the first V are the bias's
        gb.copy_(gb32.mul_(alpha) if alpha != 1.0 else gb32)
    if factor is not None:
        _scale_grads_((gh, gw, gb), factor, dev)


def _scale_grads_(grads, factor: torch.Tensor, dev) -> None:
    """In place ``g *= factor`` (a 1-element device tensor: no host sync) for each gradient not None."""
    for g in grads:
        if g is not None:
            scale_rows_(g.view(-1, g.shape[-1]), factor, dev=dev)


# fp16 logit gradients are written multiplied by this power of two and the matmuls scale their
# fp32 products back (alpha). Unscaled, a probability of 1e-7 (common at V = 128K) is below fp16's
# smallest subnormal once divided by the token count for the mean, and flushing every such term
# to zero made grad_hidden 1.4% wrong at 1024 tokens x V 128256 on an H200. 4096 keeps |p - y| <= 1
# (and a z-loss or soft-capped gradient of a few units) far from fp16's maximum of 65504.
_HALF_GRAD_SCALE = 4096.0


def flce_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float | None,
    reduction: str, want: tuple[bool, bool, bool] = (True, True, True), config: Resolved | None = None,
    chunk_mib: int | None = None, dev=None,
):
    """Forward of the fused linear cross-entropy on 2-D ``hidden`` (BT, H), ``weight`` (V, H),
    1-D ``target`` (BT,), optional ``bias`` (V,).

    Returns ``(loss_rows, z_rows, grad_hidden, grad_weight, grad_bias)``: fp32 row losses
    (z-loss included) and z-losses (None without ``lse_square_scale``), and the gradients of the
    reduced loss (``mean`` / ``sum``) for the inputs flagged in ``want`` (else None; always None for
    ``reduction="none"``). ``config`` overrides the resolved config (BLOCK_V, warps, CHUNK_TOKENS);
    ``chunk_mib`` (None: :func:`default_chunk_rows`) the MiB of logits per chunk; ``dev`` the
    :class:`~liger_portable.DeviceInfo` of ``hidden`` where the caller knows it.
    """
    dev = dev or device_info(hidden)
    cfg = config_for(hidden, weight, config, dev)
    n_rows, n_cols = hidden.shape[0], weight.shape[0]
    want_h, want_w, want_b = want
    want_b = want_b and bias is not None
    grads = reduction != "none" and (want_h or want_w or want_b)
    scale = mean_scale(target, ignore_index) if reduction == "mean" else None
    n_pad = padded_vocab(n_cols)
    gh = empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if grads and want_h else None
    gw_pad = empty((n_pad, weight.shape[1]), dtype=weight.dtype, device=weight.device) if grads and want_w else None
    gw = None if gw_pad is None else gw_pad[:n_cols]
    gb = empty(bias.shape, dtype=bias.dtype, device=bias.device) if grads and want_b else None
    gb32 = empty((n_pad,), dtype=torch.float32, device=bias.device) if gb is not None else None
    loss_rows = empty((n_rows,), dtype=torch.float32, device=hidden.device)
    z_rows = empty((n_rows,), dtype=torch.float32, device=hidden.device) if lse_square_scale != 0.0 else None
    if n_rows == 0:
        return loss_rows, z_rows, gh, gw, gb
    # bf16 / fp32: the kernel writes the finished gradient (1/count for the mean included).
    # fp16: it writes _HALF_GRAD_SCALE x the gradient of the sum, the matmuls multiply by
    # alpha = 1 / (_HALF_GRAD_SCALE x rows), and for the mean n_rows / count (>= 1, a device
    # tensor: no host sync) is applied at the end.
    half = hidden.dtype == torch.float16 and grads
    grad_scale, kernel_scale, alpha = 1.0, scale, 1.0
    if half:
        grad_scale, kernel_scale = _HALF_GRAD_SCALE, None
        alpha = 1.0 / (_HALF_GRAD_SCALE * (n_rows if reduction == "mean" else 1))
    step, chunks = _chunks(hidden, weight, cfg, chunk_mib)
    buf = empty((step, n_pad), dtype=hidden.dtype, device=hidden.device)
    w_pad, b_pad = _pad_rows(weight, n_pad), _pad_rows(bias, n_pad)
    for i, (s, e) in enumerate(chunks):
        hc, tc, out = _chunk(hidden, target, (loss_rows, z_rows), s, e)
        logits = _logits(buf, hc, w_pad, b_pad)
        ce_rows(
            logits if n_pad == n_cols else logits[:, :n_cols], tc, ignore_index=ignore_index, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, softcap=softcap, grad_scale=grad_scale, scale=kernel_scale,
            return_grad=grads, out=out, config=cfg, dev=dev,
        )
        if grads:
            _accumulate(logits, hc, w_pad, gh, gw_pad, gb32, s, e, i == 0, alpha)
    # fp16 mean: the n_rows / count that alpha left out
    _finish_(gh, gw, gb, gb32, alpha, scale * n_rows if half and scale is not None else None, dev)
    return loss_rows, z_rows, gh, gw, gb


def flce_bwd_recompute(
    dloss_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, lse_square_scale: float,
    softcap: float | None, want: tuple[bool, bool, bool] = (True, True, True), config: Resolved | None = None,
    chunk_mib: int | None = None, dev=None,
):
    """Backward of ``reduction="none"``: recompute each chunk's logits and write the gradients of
    ``sum(dloss_rows * loss_rows)``. Returns ``(grad_hidden, grad_weight, grad_bias)``."""
    dev = dev or device_info(hidden)
    cfg = config_for(hidden, weight, config, dev)
    n_cols = weight.shape[0]
    want_h, want_w, want_b = want
    want_b = want_b and bias is not None
    n_pad = padded_vocab(n_cols)
    gh = empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
    gw_pad = empty((n_pad, weight.shape[1]), dtype=weight.dtype, device=weight.device) if want_w else None
    gw = None if gw_pad is None else gw_pad[:n_cols]
    gb = empty(bias.shape, dtype=bias.dtype, device=bias.device) if want_b else None
    if hidden.shape[0] == 0:
        return gh, None if gw is None else gw.zero_(), None if gb is None else gb.zero_()
    dloss_rows = dloss_rows.reshape(-1).to(torch.float32).contiguous()
    gb32 = empty((n_pad,), dtype=torch.float32, device=bias.device) if gb is not None else None
    # fp16: the per-token factors (e.g. 1/count from a hand-written mean) are divided by their
    # largest magnitude m and the kernel writes _HALF_GRAD_SCALE x the gradient with those; the
    # matmuls scale back by alpha, and m (a device tensor: no host sync) is applied at the end.
    alpha, peak = 1.0, None
    if hidden.dtype == torch.float16:
        peak = dloss_rows.abs().amax().reshape(1)
        peak = torch.where(peak > 0, peak, torch.ones_like(peak))  # all zero: nothing to rescale
        dloss_rows = dloss_rows * (_HALF_GRAD_SCALE / peak)
        alpha = 1.0 / _HALF_GRAD_SCALE
    step, chunks = _chunks(hidden, weight, cfg, chunk_mib)
    buf = empty((step, n_pad), dtype=hidden.dtype, device=hidden.device)
    w_pad, b_pad = _pad_rows(weight, n_pad), _pad_rows(bias, n_pad)
    for i, (s, e) in enumerate(chunks):
        hc, tc, _ = _chunk(hidden, target, None, s, e)
        logits = _logits(buf, hc, w_pad, b_pad)
        ce_rows(
            logits if n_pad == n_cols else logits[:, :n_cols], tc, ignore_index=ignore_index, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, softcap=softcap, scale=dloss_rows[s:e], return_grad=True,
            config=cfg, dev=dev,
        )
        _accumulate(logits, hc, w_pad, gh, gw_pad, gb32, s, e, i == 0, alpha)
    _finish_(gh, gw, gb, gb32, alpha, peak, dev)
    return gh, gw, gb


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss is returned in float32 (float64 for float64 inputs), as Hugging Face computes it
    from upcast logits: a bf16 loss would round the reported value by up to ~0.4%."""
    return torch.promote_types(dtype, torch.float32)


def _reduce(loss_rows, z_rows, reduction, target, ignore_index, dtype):
    if reduction == "none":
        return loss_rows.to(dtype), None if z_rows is None else z_rows.to(dtype)
    if reduction == "sum":
        return loss_rows.sum().to(dtype), None if z_rows is None else z_rows.sum().to(dtype)
    scale = mean_scale(target, ignore_index)
    return loss_rows.sum().mul_(scale).to(dtype), None if z_rows is None else z_rows.sum().mul_(scale).to(dtype)


# --------------------------------------------------------------------------- autograd
# Declared once: an autograd.Function whose forward and backward run the chunk loops directly in
# eager mode (the cheapest path on the host) and, under torch.compile, call them as custom ops,
# opaque to the compiler (no graph break). There the forward op returns the reduced loss and (mean /
# sum) the gradients as extra outputs, and the backward multiplies them (out of place).

from .._autograd import backward_once, first_order_only  # noqa: E402  (here: the autograd section does not version kernels)

_FP16_MAX = 65504.0


def half_grads_fit(lse_square_scale: float, softcap: float | None, n_classes: int) -> bool:
    """Whether float16 logit gradients, written ``_HALF_GRAD_SCALE`` times too large, cannot overflow
    with these options: a row's gradient is at most ``1 + 2 * lse_square_scale * |lse|`` in size, and
    ``|lse|`` at most the largest float16 logit (or ``softcap``) plus ``log(n_classes)``. True for
    every ``lse_square_scale`` up to about 1.1e-4 (PaLM's z-loss is 1e-4); the caller runs larger
    ones in float16 on the fallback."""
    import math

    if lse_square_scale == 0.0:
        return True
    lse = (_FP16_MAX if softcap is None else min(softcap, _FP16_MAX)) + math.log(n_classes)
    return _HALF_GRAD_SCALE * (1.0 + 2.0 * abs(lse_square_scale) * lse) <= _FP16_MAX


def _dense_like(t: torch.Tensor) -> torch.Tensor:
    """A fake's gradient of ``t``: row-major, as the launch code allocates them whatever the layout of
    ``t`` (``empty_like`` keeps a transposed weight's strides, and the compiled graph then asserts
    strides the real op does not return)."""
    return t.new_empty(t.shape)


@torch.library.custom_op("liger_portable::fused_linear_cross_entropy", mutates_args=())
def flce_op(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float, reduction: str,
    chunk_mib: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # softcap <= 0 and chunk_mib 0 stand for None (custom op schemas have no Optional scalars here)
    loss_rows, z_rows, gh, gw, gb = flce_fwd(
        hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale,
        softcap if softcap > 0 else None, reduction, chunk_mib=chunk_mib or None,
    )
    loss, z = _reduce(loss_rows, z_rows, reduction, target, ignore_index, loss_dtype(hidden.dtype))
    if z is None:
        z = torch.zeros_like(loss)
    if reduction == "none":
        gh, gw = hidden.new_empty(0), weight.new_empty(0)
    if gb is None:
        gb = weight.new_empty(0)
    return loss, z, gh, gw, gb


@flce_op.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_mib):
    loss = hidden.new_empty(target.shape if reduction == "none" else (), dtype=loss_dtype(hidden.dtype))
    if reduction == "none":
        gh, gw = hidden.new_empty(0), weight.new_empty(0)
    else:
        gh, gw = _dense_like(hidden), _dense_like(weight)
    gb = _dense_like(bias) if bias is not None and reduction != "none" else weight.new_empty(0)
    return loss, torch.empty_like(loss), gh, gw, gb


@torch.library.custom_op("liger_portable::fused_linear_cross_entropy_backward", mutates_args=())
def flce_backward_op(
    dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, lse_square_scale: float,
    softcap: float, chunk_mib: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gh, gw, gb = flce_bwd_recompute(
        dloss, hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale,
        softcap if softcap > 0 else None, chunk_mib=chunk_mib or None,
    )
    return gh, gw, gb if gb is not None else weight.new_empty(0)


@flce_backward_op.register_fake
def _(dloss, hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap, chunk_mib):
    gb = _dense_like(bias) if bias is not None else weight.new_empty(0)
    return _dense_like(hidden), _dense_like(weight), gb


class _FLCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
                chunk_mib, dev):
        ctx.reduction = reduction
        if torch.compiler.is_compiling():
            # softcap <= 0 and chunk_mib 0 stand for None in the ops' schemas
            options = (
                ignore_index, label_smoothing, lse_square_scale, -1.0 if softcap is None else softcap, chunk_mib or 0
            )
            loss, z, gh, gw, gb = flce_op(hidden, weight, target, bias, *options[:4], reduction, options[4])
            ctx.options, ctx.has_bias = options, bias is not None
            if reduction == "none":
                ctx.save_for_backward(hidden, weight, target, bias)
            else:
                ctx.save_for_backward(gh, gw, gb)
            ctx.mark_non_differentiable(z)
            return loss, z
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        loss_rows, z_rows, gh, gw, gb = flce_fwd(
            hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, want,
            chunk_mib=chunk_mib, dev=dev,
        )
        ctx.want, ctx.done, ctx.chunk_mib, ctx.dev = want, False, chunk_mib, dev
        ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap)
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target, bias)
        else:
            ctx.grads = (gh, gw, gb)
        loss, z = _reduce(loss_rows, z_rows, reduction, target, ignore_index, loss_dtype(hidden.dtype))
        if z is None:  # no tensor made for an output nobody reads
            return loss, None
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    @first_order_only("fused_linear_cross_entropy")
    def backward(ctx, dloss, _dz):
        if torch.compiler.is_compiling():
            if ctx.reduction == "none":
                hidden, weight, target, bias = ctx.saved_tensors
                gh, gw, gb = flce_backward_op(dloss, hidden, weight, target, bias, *ctx.options)
            else:
                gh, gw, gb = ((g * dloss).to(g.dtype) for g in ctx.saved_tensors)
            return gh, gw, None, gb if ctx.has_bias else None, None, None, None, None, None, None, None
        if ctx.reduction == "none":
            hidden, weight, target, bias = ctx.saved_tensors
            gh, gw, gb = flce_bwd_recompute(
                dloss, hidden, weight, target, bias, *ctx.options, want=ctx.want, chunk_mib=ctx.chunk_mib, dev=ctx.dev
            )
            return gh, gw, None, gb, None, None, None, None, None, None, None
        backward_once(ctx, "fused_linear_cross_entropy")
        gh, gw, gb = ctx.grads
        ctx.grads = None
        f = dloss.reshape(1).to(torch.float32)
        _scale_grads_((gh, gw, gb), f, ctx.dev)
        return gh, gw, None, gb, None, None, None, None, None, None, None


_apply_flce = eager_apply(_FLCEFunction, 4)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float | None, reduction: str,
    chunk_mib: int | None = None, dev=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable fused linear cross-entropy of 2-D ``hidden``, ``weight``, 1-D ``target``.
    Returns ``(loss, z_loss)`` (``z_loss`` None without ``lse_square_scale``). ``chunk_mib``: MiB
    of logits per token chunk (None: :func:`default_chunk_rows`); ``dev`` the
    :class:`~liger_portable.DeviceInfo` of ``hidden`` where the caller has it (None: looked up)."""
    loss, z = _apply_flce(
        hidden, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_mib,
        dev,
    )
    return loss, z if lse_square_scale != 0.0 else None


# --------------------------------------------------------------------------- autograd: losses of whole sequences in one pass
# The chunk loop of the preference and RL losses (liger_portable.chunked_loss): the launches above
# (the logits product, the cross-entropy kernel, the gradient products) reached in another order, with
# per-token factors that each chunk's own losses decide; no kernel, plan or tuned quantity of its own.


def flce_fwd_factors(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, chunks: list[tuple[int, int]], row_factors, want: tuple[bool, bool, bool] = (True, True, True),
    config: Resolved | None = None, dev=None,
):
    """The gradients of ``sum(factors * loss_rows)`` where each chunk's factors depend on its own row
    losses (plain cross-entropy rows: no smoothing, z-loss or soft cap): three ``BT x H x V``
    products, where ``reduction="none"`` and a backward take four. For losses of whole sequences
    (preference pairs), with ``chunks`` holding whole sequences.

    ``chunks``: the ``(start, end)`` rows of each chunk, in order, covering ``hidden``;
    ``row_factors(start, end, loss_rows)`` returns the chunk's fp32 factors ``(end - start,)`` from its
    fp32 row losses. Per chunk: the logits, the losses (a loss-only pass of the kernel), the factors,
    the kernel again writing the gradient of the logits times the factors, and the two gradient
    products. bf16 and fp32 (fp16 needs the factors' magnitude before the first chunk: use
    :func:`flce_bwd_recompute`). Returns ``(loss_rows, grad_hidden, grad_weight, grad_bias)``."""
    if hidden.dtype == torch.float16:
        raise TypeError("flce_fwd_factors runs bf16 and fp32; fp16 takes flce_fwd and flce_bwd_recompute")
    dev = dev or device_info(hidden)
    cfg = config_for(hidden, weight, config, dev)
    n_rows, n_cols = hidden.shape[0], weight.shape[0]
    want_h, want_w, want_b = want
    want_b = want_b and bias is not None
    n_pad = padded_vocab(n_cols)
    gh = empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
    gw_pad = empty((n_pad, weight.shape[1]), dtype=weight.dtype, device=weight.device) if want_w else None
    gw = None if gw_pad is None else gw_pad[:n_cols]
    gb = empty(bias.shape, dtype=bias.dtype, device=bias.device) if want_b else None
    gb32 = empty((n_pad,), dtype=torch.float32, device=bias.device) if want_b else None
    loss_rows = empty((n_rows,), dtype=torch.float32, device=hidden.device)
    if n_rows == 0:
        return loss_rows, gh, None if gw is None else gw.zero_(), None if gb is None else gb.zero_()
    buf = empty((max(e - s for s, e in chunks), n_pad), dtype=hidden.dtype, device=hidden.device)
    w_pad, b_pad = _pad_rows(weight, n_pad), _pad_rows(bias, n_pad)
    for i, (s, e) in enumerate(chunks):
        hc, tc, (lc,) = _chunk(hidden, target, (loss_rows,), s, e)
        logits = _logits(buf, hc, w_pad, b_pad)
        view = logits if n_pad == n_cols else logits[:, :n_cols]
        ce_rows(view, tc, ignore_index=ignore_index, return_grad=False, out=(lc, None), config=cfg, dev=dev)
        factors = row_factors(s, e, lc).to(torch.float32).contiguous()
        ce_rows(view, tc, ignore_index=ignore_index, scale=factors, return_grad=True, out=(lc, None), config=cfg, dev=dev)
        _accumulate(logits, hc, w_pad, gh, gw_pad, gb32, s, e, i == 0)
    _finish_(gh, gw, gb, gb32, 1.0, None, dev)
    return loss_rows, gh, gw, gb


# --------------------------------------------------------------------------- specs and examples
# What the config tables, the tuner and the vendor compile matrix know of these kernels, declared
# here once. An example builds one problem's inputs from the tuner's Problem ``p`` and launches
# exactly one kernel with an explicit config through the launch functions above (looked up at call
# time, so a test can spy on them); see KernelSpec.examples.


_CHUNK_TOKENS = Param(
    8, 65536, pow2=False, host=True,
    doc="tokens per chunk (more within 256 MiB of logits; fewer where the logits pass the weight gradient's size)",
)


def _examples(p) -> list:
    n_rows, n_cols, hidden = p.named["n_rows"], p.named["n_cols"], p.named["hidden"]
    esize = torch.empty((), dtype=p.dtype).element_size()
    chunk = min(n_rows, default_chunk_rows(n_cols, hidden, esize, _CHUNK_TOKENS.hi)) * n_cols * esize
    # hidden and weight with their gradients, and the largest chunk of logits a config may ask for
    p.need(2 * n_rows * hidden + 2 * n_cols * hidden, chunk + 8 * n_rows)
    h = p.randn(n_rows, hidden)
    w = p.randn(n_cols, hidden, scale=hidden**-0.5)
    target = p.targets(n_rows, n_cols)

    def launch(r: Resolved):
        return flce_fwd(h, w, target, None, IGNORE_INDEX, 0.0, 0.0, None, "mean", (True, True, False), config=r)

    return [("", {"hidden": h, "weight": w, "target": target}, launch)]


SPECS = register(
    KernelSpec(
        # The cross-entropy launch inside the fused linear cross-entropy, plus the host-side
        # token-chunk size (tokens per chunk, within the memory budget of default_chunk_rows).
        name="fused_linear_cross_entropy",
        key=("n_cols", "n_rows", "hidden"),
        bucket=flce_bucket,
        params={"BLOCK_V": BLOCK_V, "CHUNK_TOKENS": _CHUNK_TOKENS},
        source="ops/fused_linear_cross_entropy.py",
        tile_values=lambda c, p: c["BLOCK_V"],
        examples=_examples,
        shown=("BT 8192, H 4096, vocab 128256", (128256, 8192, 4096)),
    ),
)
