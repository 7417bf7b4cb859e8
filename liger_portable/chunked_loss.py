"""Fused linear preference, RL and distillation losses on the language-model head: DPO, ORPO, SimPO,
CPO, KTO, GRPO and the JSD / KL distillation, without ever holding the (tokens x vocabulary) logits.

Each loss is a function of its tokens' log-probabilities: of every sequence's log-probability of its
completion (the sum, or the mean, of its tokens'), of the chosen sequences' NLL where asked, and for
GRPO of each token's ratio to the sampling policy and its KL estimate to the reference. A token's
log-probability is minus its cross-entropy, so these losses run on the fused linear cross-entropy's
kernels (every vendor's tuned configs) or its PyTorch fallback, and never hold the logits:

* **one pass** (:func:`_one_pass`), on the kernels for a scalar loss that needs gradients: chunks of
  whole pairs or sequences; each chunk's token cross-entropies give its share of the loss, autograd
  on those few numbers gives each token's factor, and the kernel writes the logits' gradient times
  the factors while the chunk's logits are held
  (:func:`~liger_portable.ops.fused_linear_cross_entropy.flce_fwd_factors`): three
  ``tokens x hidden x vocabulary`` products, the gradients computed in the forward;
* otherwise (``reduction="none"``, the CPU, fp16, torch.compile, a pair too long for one chunk):
  :func:`liger_portable.functional.fused_linear_cross_entropy` with ``reduction="none"``, the loss in
  PyTorch on its output, and autograd: the backward recomputes the logits chunk by chunk with each
  token's factor, four products.

Inputs follow liger-kernel's chunked losses (``liger_kernel.chunked_loss``), so that switching is a
change of import: ``_input`` is ``(2B, T, H)``, the B chosen sequences stacked over the B rejected
ones, ``target`` ``(2B, T)`` with ``ignore_index`` on the prompt and padding; the modules' forward
takes ``(lin_weight, _input, target, bias=None, ...)`` and returns ``(loss, (chosen_logps,
rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, *aux))``. ``compiled`` and
``chunk_size`` are accepted for that compatibility and change nothing (the chunking is the fused
cross-entropy's, by tokens). The functions :func:`fused_linear_dpo_loss` and the rest take keyword
options and add ``reduction`` (``"mean"``, liger-kernel's; ``"sum"``; ``"none"``: one loss per pair,
whose sum is the ``"sum"`` loss).

The distillation loss needs the student's and teacher's whole distributions, not one token's
log-probability: it runs chunks of tokens through the two heads in PyTorch and computes the
student's gradients in the forward (:class:`_FusedLinearDistillation`).
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as TF

from .functional import check_flce_args, flce_kernel_device, fused_linear_cross_entropy
from ._checks import check_choice, check_class_range, check_nonneg_number, check_real, is_integer
from ._autograd import first_order_only
from ._warn import warn

if importlib.util.find_spec("triton") is not None:
    from .ops import fused_linear_cross_entropy as _flce_ops
else:  # pragma: no cover - without Triton every loss runs the fallback
    _flce_ops = None

REDUCTIONS = ("mean", "sum", "none")
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop",
)

__all__ = [
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearGRPOLoss",
    "LigerFusedLinearJSDLoss",
    "LigerFusedLinearKTOLoss",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOLoss",
    "fused_linear_cpo_loss",
    "fused_linear_distillation_loss",
    "fused_linear_dpo_loss",
    "fused_linear_grpo_loss",
    "fused_linear_kto_loss",
    "fused_linear_orpo_loss",
    "fused_linear_simpo_loss",
]


# --------------------------------------------------------------------------- sequence log-probabilities


def _check_pairs(name: str, hidden: torch.Tensor, target: torch.Tensor) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(
            f"{name} must be a (2B, T, H) tensor: B chosen sequences stacked over B rejected ones, got "
            f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}"
        )
    if hidden.shape[0] == 0 or hidden.shape[0] % 2:
        raise ValueError(
            f"{name} must stack as many rejected sequences as chosen ones (an even, non-zero first "
            f"dimension), got {hidden.shape[0]}"
        )
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(hidden.shape[:2]):
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"target must have shape {tuple(hidden.shape[:2])} ({name}'s first two dimensions), got {got}")


def _check_sequences(hidden: torch.Tensor, **per_token: torch.Tensor) -> None:
    """``_input`` is ``(B, T, H)`` with B >= 1, and each named tensor ``(B, T)`` (unpaired losses)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] == 0:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"_input must be a (B, T, H) tensor with B >= 1, got {got}")
    shape = tuple(hidden.shape[:2])
    for name, t in per_token.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (_input's first two dimensions)")


def _check_reference_head(ref_input, ref_weight, ref_bias, weight: torch.Tensor, leading: tuple[int, ...]) -> None:
    """The reference model's last hidden states ``ref_input`` ``(*leading, H_ref)`` and LM head
    ``ref_weight`` ``(V, H_ref)``, V the policy head's (both log-probabilities over one vocabulary), and
    ``ref_bias`` None or ``(V,)``: an error naming the argument otherwise."""
    for name, t in (("ref_input", ref_input), ("ref_weight", ref_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ref_input.dim() != len(leading) + 1 or tuple(ref_input.shape[:-1]) != leading:
        raise ValueError(f"ref_input must have shape {leading + ('H_ref',)} (the reference model's last hidden "
                         f"states for the target's positions), got {tuple(ref_input.shape)}")
    vocab, hidden = weight.shape[0], ref_input.shape[-1]
    if tuple(ref_weight.shape) != (vocab, hidden):
        raise ValueError(f"ref_weight must have shape ({vocab}, {hidden}) (the policy head's vocabulary, ref_input's "
                         f"hidden size), got {tuple(ref_weight.shape)}")
    if ref_bias is not None and (not isinstance(ref_bias, torch.Tensor) or tuple(ref_bias.shape) != (vocab,)):
        got = tuple(ref_bias.shape) if isinstance(ref_bias, torch.Tensor) else type(ref_bias).__name__
        raise ValueError(f"ref_bias must be None or have shape ({vocab},), got {got}")


def _reference_token_logps(ref_input, ref_weight, target, ref_bias, ignore_index: int) -> torch.Tensor:
    """:func:`_token_logps` of the reference head (no gradient), its argument errors naming it."""
    try:
        with torch.no_grad():
            return _token_logps(ref_input, ref_weight, target, ref_bias, ignore_index)
    except (TypeError, ValueError) as e:
        if str(e).startswith("target"):  # the policy's labels, shared: their own error
            raise
        raise type(e)(f"the reference head (ref_input, ref_weight, ref_bias): {e}") from e


def _token_logps(hidden, weight, target, bias, ignore_index: int) -> torch.Tensor:
    """``(2B, T)`` log-probability of each target token (0 where ignored), in float32 (float64 for
    float64 inputs), differentiable in hidden, weight and bias."""
    return -fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction="none")


def _sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Each sequence's completion log-probability: the sum over its tokens, or their mean (a sequence
    with no completion token has log-probability 0)."""
    total = token_logps.sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def _logit_sums(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per sequence, the sum of ``hidden @ weight.T + bias`` over its positions and the classes, from
    the classes' sum of the weight rows (no logits), in float32 (hidden converted 2048 rows at a
    time): liger-kernel's logging figures, not differentiable. They are small differences of large
    terms: rounding the row sums to bf16 put them 2% off."""
    with torch.no_grad():
        rows = hidden.reshape(-1, hidden.shape[-1])
        acc = torch.promote_types(hidden.dtype, torch.float32)
        column_sums = weight.sum(0, dtype=acc)
        row_sums = torch.cat([chunk.to(acc) @ column_sums for chunk in rows.split(2048)]) if rows.shape[0] else rows.new_zeros(0, dtype=acc)
        if bias is not None:
            row_sums = row_sums + bias.sum(dtype=acc)
        return row_sums.view(hidden.shape[:-1]).sum(-1)


def _pairs(
    hidden, weight, target, bias, *, ignore_index, average_log_prob, compute_nll_loss, nll_target=None,
):
    """The per-pair ingredients of every loss here: chosen and rejected log-probabilities ``(B,)``,
    the chosen NLL (a scalar) and its per-pair parts ``(B,)`` (summing to it), and the logits means
    (the arguments checked by :func:`_paired_loss`)."""
    n = hidden.shape[0] // 2
    token_logps = _token_logps(hidden, weight, target, bias, int(ignore_index))
    mask = target != ignore_index
    logps = _sequence_logps(token_logps, mask, average_log_prob)
    zero = token_logps.new_zeros(())
    nll, nll_pairs = zero, token_logps.new_zeros(n)
    if compute_nll_loss:
        if nll_target is None:
            per_pair, count = -token_logps[:n].sum(-1), mask[:n].sum()
        else:
            if tuple(nll_target.shape) != tuple(target.shape) and tuple(nll_target.shape) != (n, target.shape[1]):
                raise ValueError(
                    f"nll_target must have the shape of target {tuple(target.shape)} (or of its chosen half "
                    f"{(n, target.shape[1])}), got {tuple(nll_target.shape)}"
                )
            chosen_target = nll_target[:n]
            per_pair = fused_linear_cross_entropy(
                hidden[:n], weight, chosen_target, bias, ignore_index=int(ignore_index), reduction="none"
            ).sum(-1)
            count = (chosen_target != ignore_index).sum()
        nll_pairs = per_pair / count.clamp(min=1)
        nll = nll_pairs.sum()
    return logps[:n], logps[n:], nll, nll_pairs, _means(hidden, weight, bias)


def _means(hidden, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected logits' means (liger-kernel's logging figures)."""
    n = hidden.shape[0] // 2
    sums = _logit_sums(hidden, weight, bias)
    per_half = n * hidden.shape[1] * weight.shape[0]
    return sums[:n].sum() / per_half, sums[n:].sum() / per_half


def _paired_loss(
    hidden, weight, target, bias, *, ignore_index, average_log_prob, compute_nll_loss, alpha, reduction, pair_fn,
    nll_target=None,
):
    """``alpha * NLL(chosen) + reduce(pair losses)`` and its ingredients ``(loss, chosen, rejected,
    means, nll, aux)``; ``pair_fn(chosen, rejected, pairs)`` gives ``(losses, *aux)`` of the pairs
    ``pairs`` (a slice) from their sequence log-probabilities.

    On the kernels, for a scalar loss that needs gradients, one pass computes them with three
    ``tokens x hidden x vocabulary`` products (:func:`_paired_one_pass`); otherwise the log-probabilities
    come from the fused cross-entropy with ``reduction="none"`` and autograd (four products)."""
    _check_pairs("_input", hidden, target)
    if not is_integer(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    plan = _one_pass_plan(hidden, weight, target, bias, int(ignore_index), reduction, 2 * hidden.shape[1], nll_target)
    if plan is not None:
        return _paired_one_pass(hidden, weight, target, bias, int(ignore_index), average_log_prob, compute_nll_loss,
                            alpha, reduction, pair_fn, *plan)
    chosen, rejected, nll, nll_pairs, means = _pairs(
        hidden, weight, target, bias, ignore_index=ignore_index, average_log_prob=average_log_prob,
        compute_nll_loss=compute_nll_loss, nll_target=nll_target,
    )
    losses, *aux = pair_fn(chosen, rejected, slice(None))
    return _reduce(losses, nll, nll_pairs, alpha, reduction), chosen, rejected, means, nll, aux


def _one_pass_plan(hidden, weight, target, bias, ignore_index, reduction, group_rows: int, nll_target=None):
    """``(device info, groups per chunk)`` where the one-pass path (:func:`_one_pass`) applies, else
    None: the kernels run these tensors (bf16 or fp32), the loss is a scalar that needs gradients,
    not under torch.compile (whose graph takes the fused cross-entropy's ops), no separate NLL
    targets, and one group's logits (``group_rows`` tokens: a pair, or a sequence) fit in the memory
    the weight gradient takes (at least 1 GiB)."""
    if reduction == "none" or nll_target is not None or torch.compiler.is_compiling():
        return None
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))):
        return None
    if hidden.dtype not in (torch.bfloat16, torch.float32) or hidden.numel() == 0:
        return None
    if flce_kernel_device(hidden, hidden.device) is None:
        return None  # the fallback path checks the arguments itself
    _, _, _, _, _, device = check_flce_args(hidden, weight, target, bias, ignore_index, "mean", 0.0, 0.0, None, False, None)
    dev = flce_kernel_device(hidden, device)
    n_pad, elt = _flce_ops.padded_vocab(weight.shape[0]), hidden.element_size()
    budget = max(weight.numel() * elt, 2**30)
    if group_rows * n_pad * elt > budget:
        return None
    if GROUPS_PER_CHUNK:
        return dev, GROUPS_PER_CHUNK
    cfg = _flce_ops.config_for(hidden.reshape(-1, hidden.shape[-1]), weight, None, dev)
    rows = _flce_ops.default_chunk_rows(weight.shape[0], hidden.shape[-1], elt, cfg.meta["CHUNK_TOKENS"])
    return dev, max(1, min(rows // group_rows, budget // (group_rows * n_pad * elt)))


# Groups (pairs, or sequences) per chunk of the one-pass path; None: the most whose tokens fit in the
# fused cross-entropy's default chunk (at least one). The tests set it to get several chunks out of
# a tiny problem.
GROUPS_PER_CHUNK: int | None = None


class _Collect:
    """The per-chunk loss of a one-pass loss (:func:`_paired_one_pass`) over groups of sequences (a pair
    is a group of two): gives each chunk's tokens their factor, the gradient of ``loss_fn`` in their
    cross-entropy, and keeps every token's log-probability and the summed loss.

    ``mask``: ``(groups, group size, T)``, True on the tokens the loss reads; ``loss_fn(tokens,
    groups)``: the chunk's share of the loss from its tokens' log-probabilities ``(k, group size, T)``
    (0 where masked) and the slice of the groups they are."""

    def __init__(self, mask: torch.Tensor, loss_fn):
        self.mask, self.loss_fn = mask, loss_fn
        self.tokens = torch.empty(mask.shape, dtype=torch.float32, device=mask.device)
        self.loss = torch.zeros((), dtype=torch.float32, device=mask.device)

    def __call__(self, start: int, end: int, loss_rows: torch.Tensor) -> torch.Tensor:
        per = self.mask.shape[1] * self.mask.shape[2]
        g0, g1 = start // per, end // per
        with torch.enable_grad():
            ce = loss_rows.detach().view(g1 - g0, *self.mask.shape[1:]).requires_grad_()
            tokens = -ce * self.mask[g0:g1]
            total = self.loss_fn(tokens, slice(g0, g1))
            (factors,) = torch.autograd.grad(total, ce)
        self.tokens[g0:g1] = tokens.detach()
        self.loss += total.detach()
        return factors.reshape(-1)


class _OnePass(torch.autograd.Function):
    """The loss of :class:`_Collect` over chunks of whole pairs, its gradients computed in the forward
    (:func:`~liger_portable.ops.fused_linear_cross_entropy.flce_fwd_factors`); the backward scales them."""

    @staticmethod
    def forward(ctx, hp, weight, bias, tp, ignore_index, chunks, collect, dev):
        want = tuple(ctx.needs_input_grad[:3])
        _, gh, gw, gb = _flce_ops.flce_fwd_factors(hp, weight, tp, bias, ignore_index, chunks, collect, want, dev=dev)
        ctx.save_for_backward(gh, gw, gb)
        return collect.loss.clone()

    @staticmethod
    @first_order_only("chunked loss (one pass)")
    def backward(ctx, grad):
        # grad is a 0-dim factor: each product stays in its gradient's dtype, rounded once
        gh, gw, gb = (None if g is None else g * grad for g in ctx.saved_tensors)
        return gh, gw, gb, None, None, None, None, None


def _one_pass(rows, weight, bias, target, ignore_index, mask, loss_fn, dev, groups_per_chunk):
    """The loss ``sum over chunks of loss_fn`` (see :class:`_Collect`) of the 2-D ``rows`` (hidden
    states, ordered group by group as ``mask`` is) and 1-D ``target``, with its gradients computed in
    the one pass; returns ``(loss, token log-probabilities (groups, group size, T))``."""
    collect = _Collect(mask, loss_fn)
    step = mask.shape[1] * mask.shape[2] * groups_per_chunk
    chunks = [(s, min(s + step, target.shape[0])) for s in range(0, target.shape[0], step)]
    return _OnePass.apply(rows, weight, bias, target, ignore_index, chunks, collect, dev), collect.tokens


def _paired_one_pass(hidden, weight, target, bias, ignore_index, average, compute_nll, alpha, reduction, pair_fn, dev, pairs):
    """:func:`_paired_loss` in one pass over chunks of ``pairs`` whole pairs: the rows are reordered
    pair by pair (chosen 0, rejected 0, chosen 1, ...; a copy of the hidden states), each chunk's
    token losses give its pairs' losses, and their gradient gives each token's factor for the
    chunk's gradient products, while its logits are still held."""
    n2, seq_rows, h = hidden.shape
    n = n2 // 2
    hp = hidden.view(2, n, seq_rows, h).transpose(0, 1).reshape(n2 * seq_rows, h)
    tp = target.view(2, n, seq_rows).transpose(0, 1).reshape(-1)
    mask = (tp != ignore_index).view(n, 2, seq_rows)
    count = mask[:, 0].sum().clamp(min=1).to(torch.float32)  # the chosen tokens, for the NLL
    pair_scale = 1.0 / n if reduction == "mean" else 1.0

    def loss_fn(tokens, pairs):
        seq = _sequence_logps(tokens, mask[pairs], average)
        total = pair_fn(seq[:, 0], seq[:, 1], pairs)[0].sum() * pair_scale
        return total - alpha * tokens[:, 0].sum() / count if compute_nll else total

    loss, tokens = _one_pass(hp, weight, bias, tp, ignore_index, mask, loss_fn, dev, pairs)
    with torch.no_grad():
        seq = _sequence_logps(tokens, mask, average)
        chosen, rejected = seq[:, 0], seq[:, 1]
        _, *aux = pair_fn(chosen, rejected, slice(None))
        nll = -tokens[:, 0].sum() / count if compute_nll else torch.zeros((), device=hidden.device)
    return loss, chosen, rejected, _means(hidden, weight, bias), nll, aux


def _reduce(pair_losses: torch.Tensor, nll: torch.Tensor, nll_pairs: torch.Tensor, alpha: float, reduction: str):
    if reduction == "none":
        return alpha * nll_pairs + pair_losses
    total = pair_losses.sum() if reduction == "sum" else pair_losses.sum() / pair_losses.shape[0]
    return alpha * nll + total


def _result(loss, chosen, rejected, means, nll, aux):
    detached = [t.detach() for t in (chosen, rejected, *means, nll, *aux)]
    return loss, tuple(detached)


def _check_common(beta, alpha, reduction) -> tuple[float, float]:
    check_choice("reduction", reduction, REDUCTIONS)
    return check_real("beta", beta), check_real("alpha", alpha)


# --------------------------------------------------------------------------- the losses (paper formulas)


def _sigmoid_pair(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-log sigmoid(logits)`` with conservative label smoothing (cDPO's form, as CPO and SimPO use)."""
    return -TF.logsigmoid(logits) * (1 - label_smoothing) - TF.logsigmoid(-logits) * label_smoothing


def dpo_pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
    beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0, discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (arXiv 2305.18290) and its variants as TRL names them, per pair: ``(losses, chosen_rewards,
    rejected_rewards)`` from the policy's and the reference's sequence log-probabilities."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    margin = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        losses = -TF.logsigmoid(margin)
    elif loss_type == "hinge":
        losses = torch.relu(1 - margin)
    elif loss_type == "exo_pair":  # EXO (arXiv 2402.00856), eq. 16, K = 2
        eps = torch.tensor(label_smoothing, dtype=margin.dtype, device=margin.device)
        losses = torch.sigmoid(margin) * (TF.logsigmoid(margin) - torch.log1p(-eps)) + torch.sigmoid(-margin) * (
            TF.logsigmoid(-margin) - torch.log(eps)
        )
    elif loss_type == "nca_pair":  # NCA (arXiv 2402.05369)
        losses = -TF.logsigmoid(chosen_rewards) - 0.5 * TF.logsigmoid(-chosen_rewards) - 0.5 * TF.logsigmoid(-rejected_rewards)
    elif loss_type == "robust":  # robust DPO (arXiv 2403.00409)
        losses = (-(1 - label_smoothing) * TF.logsigmoid(margin) + label_smoothing * TF.logsigmoid(-margin)) / (
            1 - 2 * label_smoothing
        )
    elif loss_type == "bco_pair":
        losses = -TF.logsigmoid(chosen_rewards) - TF.logsigmoid(-rejected_rewards)
    elif loss_type == "sppo_hard":  # SPPO (arXiv 2405.00675), hard probabilities
        losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":  # APO (arXiv 2408.06266), eq. 7
        losses = 1 - torch.sigmoid(chosen_rewards) + torch.sigmoid(rejected_rewards)
    elif loss_type == "apo_down":  # APO, eq. 8
        losses = torch.sigmoid(chosen_rewards) + 1 - torch.sigmoid(margin)
    else:  # discopop (arXiv 2406.08414), eq. 5
        modulation = torch.sigmoid(margin / discopop_tau)
        losses = -TF.logsigmoid(margin) * (1 - modulation) + torch.exp(-margin) * modulation
    return losses, chosen_rewards, rejected_rewards


def orpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float):
    """ORPO (arXiv 2403.07691) per pair from mean token log-probabilities: ``(losses, chosen_rewards,
    rejected_rewards, log_odds_ratio (mean), log_odds (mean))``; the loss is ``-beta log sigmoid`` of
    the log odds ratio."""
    log_odds = (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))
    ratio = TF.logsigmoid(log_odds)
    return -beta * ratio, beta * chosen, beta * rejected, ratio.mean(), log_odds.mean()


def simpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float, label_smoothing: float):
    """SimPO (arXiv 2405.14734) per pair from mean token log-probabilities, with margin ``gamma``."""
    return _sigmoid_pair(beta * (chosen - rejected) - gamma, label_smoothing), beta * chosen, beta * rejected


def cpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, label_smoothing: float):
    """CPO (arXiv 2401.08417) per pair: the preference term (its NLL term is added by the caller)."""
    return _sigmoid_pair(beta * (chosen - rejected), label_smoothing), beta * chosen, beta * rejected


# --------------------------------------------------------------------------- functions


def fused_linear_dpo_loss(
    _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, *,
    ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
    ref_logps: tuple[torch.Tensor, torch.Tensor] | None = None, use_ref_model: bool = True,
    ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, compute_nll_loss: bool = False,
    average_log_prob: bool = False, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
    discopop_tau: float = 0.05, reduction: str = "mean",
):
    """DPO on the LM head: ``alpha * NLL(chosen) + DPO(policy, reference)``.

    The reference's sequence log-probabilities come from ``ref_logps`` (``(chosen, rejected)``, each
    ``(B,)``, computed before), or from ``ref_input`` / ``ref_weight`` / ``ref_bias`` (the reference
    model's last hidden states and head, without gradient); ``use_ref_model=False`` takes them as 0.
    Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
    chosen_rewards, rejected_rewards))``.
    """
    beta, alpha = _check_common(beta, alpha, reduction)
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    label_smoothing = check_nonneg_number("label_smoothing", label_smoothing)
    if loss_type == "exo_pair" and not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in (0, 1) for loss_type='exo_pair' (EXO suggests 1e-3), got {label_smoothing}")
    if loss_type == "robust" and not label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for loss_type='robust', got {label_smoothing}")
    if label_smoothing != 0.0 and loss_type not in ("exo_pair", "robust"):
        warn(
            f"label_smoothing={label_smoothing} has no effect with loss_type={loss_type!r} (as in liger-kernel): "
            "only 'exo_pair' and 'robust' read it (TRL's conservative DPO, sigmoid with label smoothing, is not implemented)",
        )
    if loss_type == "sppo_hard" and beta == 0:
        raise ValueError("beta must be non-zero for loss_type='sppo_hard' (its targets are +-0.5 / beta)")
    if loss_type == "discopop":
        check_real("discopop_tau", discopop_tau)
        if not discopop_tau > 0:
            raise ValueError(f"discopop_tau must be positive, got {discopop_tau!r}")
    _check_pairs("_input", _input, target)
    ref_chosen, ref_rejected = _reference_logps(
        use_ref_model, ref_logps, ref_input, ref_weight, ref_bias, target, _input, weight, ignore_index, average_log_prob
    )

    def pair_fn(chosen, rejected, pairs):
        return dpo_pair_losses(
            chosen, rejected, ref_chosen[pairs], ref_rejected[pairs], beta, loss_type, label_smoothing, discopop_tau
        )

    loss, chosen, rejected, means, nll, aux = _paired_loss(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=average_log_prob,
        compute_nll_loss=compute_nll_loss, alpha=alpha, reduction=reduction, pair_fn=pair_fn,
    )
    return _result(loss, chosen, rejected, means, nll, aux)


def _reference_logps(use_ref_model, ref_logps, ref_input, ref_weight, ref_bias, target, hidden, weight, ignore_index, average):
    """The reference's chosen and rejected sequence log-probabilities, ``(B,)`` each in the loss's dtype."""
    n, dtype = hidden.shape[0] // 2, torch.promote_types(hidden.dtype, torch.float32)
    if not use_ref_model:
        zero = torch.zeros(n, dtype=dtype, device=hidden.device)
        return zero, zero
    if ref_logps is not None:
        if (not isinstance(ref_logps, (tuple, list, torch.Tensor)) or len(ref_logps) != 2
                or any(not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) for t in ref_logps)):
            raise ValueError(f"ref_logps must be (chosen, rejected), each of shape {(n,)}")
        return tuple(t.detach().to(dtype) for t in ref_logps)
    if ref_input is None or ref_weight is None:
        raise ValueError(
            "use_ref_model=True needs the reference model's log-probabilities: pass ref_input and ref_weight "
            "(its last hidden states and LM head), or ref_logps=(chosen, rejected); or use_ref_model=False"
        )
    _check_reference_head(ref_input, ref_weight, ref_bias, weight, tuple(target.shape))
    token_logps = _reference_token_logps(ref_input, ref_weight, target, ref_bias, int(ignore_index))
    logps = _sequence_logps(token_logps, target != ignore_index, average).to(dtype)
    return logps[:n], logps[n:]


def fused_linear_orpo_loss(
    _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, *,
    nll_target: torch.Tensor | None = None, ignore_index: int = -100, beta: float = 0.1,
    compute_nll_loss: bool = True, reduction: str = "mean",
):
    """ORPO on the LM head: ``NLL(chosen) - beta * mean(log sigmoid(log odds ratio))`` on the mean
    token log-probabilities (``nll_target``: other targets for the NLL term). Returns ``(loss,
    (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
    chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen))``. A completion with no
    token (all ``ignore_index``) has probability 1 and infinite odds: the loss is then infinite."""
    beta, _ = _check_common(beta, 1.0, reduction)
    loss, chosen, rejected, means, nll, aux = _paired_loss(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=True,
        compute_nll_loss=compute_nll_loss, alpha=1.0, reduction=reduction, nll_target=nll_target,
        pair_fn=lambda chosen, rejected, pairs: orpo_pair_losses(chosen, rejected, beta),
    )
    return _result(loss, chosen, rejected, means, nll, aux)


def fused_linear_simpo_loss(
    _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, *,
    ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
    compute_nll_loss: bool = True, gamma: float = 0.5, reduction: str = "mean",
):
    """SimPO on the LM head: ``alpha * NLL(chosen) - log sigmoid(beta * (mean logp chosen - mean logp
    rejected) - gamma)``, label smoothing as cDPO. Returns ``(loss, (chosen_logps, rejected_logps,
    chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_rewards, rejected_rewards))``."""
    beta, alpha = _check_common(beta, alpha, reduction)
    gamma = check_real("gamma", gamma)
    label_smoothing = _check_smoothing(label_smoothing)
    loss, chosen, rejected, means, nll, aux = _paired_loss(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=True,
        compute_nll_loss=compute_nll_loss, alpha=alpha, reduction=reduction,
        pair_fn=lambda chosen, rejected, pairs: simpo_pair_losses(chosen, rejected, beta, gamma, label_smoothing),
    )
    return _result(loss, chosen, rejected, means, nll, aux)


def fused_linear_cpo_loss(
    _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, *,
    ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
    compute_nll_loss: bool = True, average_log_prob: bool = False, reduction: str = "mean",
):
    """CPO on the LM head: ``alpha * NLL(chosen) - log sigmoid(beta * (logp chosen - logp rejected))``,
    label smoothing as cDPO. Returns as :func:`fused_linear_simpo_loss`."""
    beta, alpha = _check_common(beta, alpha, reduction)
    label_smoothing = _check_smoothing(label_smoothing)
    loss, chosen, rejected, means, nll, aux = _paired_loss(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=average_log_prob,
        compute_nll_loss=compute_nll_loss, alpha=alpha, reduction=reduction,
        pair_fn=lambda chosen, rejected, pairs: cpo_pair_losses(chosen, rejected, beta, label_smoothing),
    )
    return _result(loss, chosen, rejected, means, nll, aux)


def _check_kl(kl, b: int, device: torch.device) -> torch.Tensor:
    """KTO's ``kl``: a number, a 0-dim tensor or one value per sequence ``(B,)``; detached."""
    if not isinstance(kl, torch.Tensor):
        kl = torch.tensor(check_real("kl", kl), device=device)
    if not kl.is_floating_point() or (kl.numel() != 1 and tuple(kl.shape) != (b,)):
        raise ValueError(f"kl must be a number, a one-element floating-point tensor or one per sequence, shape "
                         f"({b},); got {kl.dtype} of shape {tuple(kl.shape)}")
    return kl.detach().reshape(()) if kl.numel() == 1 else kl.detach()


def _check_smoothing(label_smoothing) -> float:
    value = check_nonneg_number("label_smoothing", label_smoothing)
    if not value <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] (the assumed fraction of flipped labels), got {label_smoothing!r}")
    return value


# --------------------------------------------------------------------------- KTO (unpaired)


def fused_linear_kto_loss(
    _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, *,
    preference_labels: torch.Tensor, ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None, kl: torch.Tensor | None = None,
    use_ref_model: bool = False, ignore_index: int = -100, beta: float = 0.1, average_log_prob: bool = False,
    reduction: str = "mean",
):
    """KTO (arXiv 2402.01306) on the LM head, unpaired: ``_input`` ``(B, T, H)``, ``target`` ``(B, T)``,
    ``preference_labels`` ``(B,)`` bool (True: desirable). Per sequence ``1 - sigmoid(beta * (r - kl))``
    for a desirable completion and ``1 - sigmoid(beta * (kl - r))`` otherwise, ``r`` the log-ratio to
    the reference (``ref_logps``, or ``ref_input`` / ``ref_weight``; the log-probability itself with
    ``use_ref_model=False``) and ``kl`` TRL's KL estimate (None: 0). ``mean`` divides by B. Returns
    ``(loss, (chosen_logps_sum, rejected_logps_sum, chosen_logits_sum, rejected_logits_sum,
    chosen_rewards_sum, rejected_rewards_sum))``."""
    beta, _ = _check_common(beta, 1.0, reduction)
    _check_sequences(_input, target=target)
    b = _input.shape[0]
    if not isinstance(preference_labels, torch.Tensor) or preference_labels.dtype != torch.bool or tuple(preference_labels.shape) != (b,):
        raise ValueError(f"preference_labels must be a bool tensor of shape ({b},) (True: a desirable completion)")
    if not is_integer(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    ignore_index = int(ignore_index)
    mask = target != ignore_index
    dtype = torch.promote_types(_input.dtype, torch.float32)  # the log-probabilities' and the loss's
    ref = None
    if use_ref_model:
        if ref_logps is not None:
            if not isinstance(ref_logps, torch.Tensor) or tuple(ref_logps.shape) != (b,):
                got = tuple(ref_logps.shape) if isinstance(ref_logps, torch.Tensor) else type(ref_logps).__name__
                raise ValueError(f"ref_logps must be a tensor of shape ({b},), got {got}")
            ref = ref_logps.detach().to(dtype)
        elif ref_input is None or ref_weight is None:
            raise ValueError("use_ref_model=True needs ref_logps, or ref_input and ref_weight; or use_ref_model=False")
        else:
            _check_reference_head(ref_input, ref_weight, ref_bias, weight, tuple(target.shape))
            with torch.no_grad():
                ref = _sequence_logps(_reference_token_logps(ref_input, ref_weight, target, ref_bias, ignore_index),
                                      mask, average_log_prob).to(dtype)
    sign = torch.where(preference_labels, 1.0, -1.0).to(dtype)
    shift = None if kl is None else _check_kl(kl, b, _input.device).to(dtype)

    def sequence_losses(logps, seqs):
        ratios = logps if ref is None else logps - ref[seqs]
        shifted = ratios if shift is None else ratios - (shift if shift.dim() == 0 else shift[seqs])
        return 1 - torch.sigmoid(beta * shifted * sign[seqs]), ratios

    plan = _one_pass_plan(_input, weight, target, bias, ignore_index, reduction, _input.shape[1])
    if plan is None:
        logps = _sequence_logps(_token_logps(_input, weight, target, bias, ignore_index), mask, average_log_prob)
        losses, ratios = sequence_losses(logps, slice(None))
        loss = losses if reduction == "none" else losses.sum() / (b if reduction == "mean" else 1)
    else:  # one pass (three products): each chunk of whole sequences gives its tokens their factors
        def loss_fn(tokens, seqs):
            logps = _sequence_logps(tokens[:, 0], mask[seqs], average_log_prob)
            return sequence_losses(logps, seqs)[0].sum() / (b if reduction == "mean" else 1)

        loss, tokens = _one_pass(_input.reshape(-1, _input.shape[-1]), weight, bias, target.reshape(-1), ignore_index,
                                 mask.unsqueeze(1), loss_fn, *plan)
        with torch.no_grad():
            logps = _sequence_logps(tokens[:, 0], mask, average_log_prob)
            ratios = sequence_losses(logps, slice(None))[1]
    rewards = beta * ratios
    sums = _logit_sums(_input, weight, bias)
    chosen, rejected = preference_labels, ~preference_labels
    aux = [(logps * chosen).sum(), (logps * rejected).sum(), (sums * chosen).sum(), (sums * rejected).sum(),
           (rewards * chosen).sum(), (rewards * rejected).sum()]
    return loss, tuple(t.detach() for t in aux)


# --------------------------------------------------------------------------- GRPO

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _k3(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL[q, p] per token (Schulman): ``exp(log_p - log_q) - (log_p - log_q) - 1``."""
    return torch.exp(log_p - log_q) - (log_p - log_q) - 1.0


def _dapo_normalizer(mask: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """DAPO's token count: ``num_items_in_batch`` (the whole generation batch's, TRL's) or this
    batch's completion tokens summed over the processes, divided by the process count."""
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    if num_items_in_batch is not None:
        total = torch.as_tensor(num_items_in_batch, device=mask.device, dtype=torch.float32)
    else:
        total = mask.to(torch.float32).sum()
        if world > 1:
            total = total.clone()
            torch.distributed.all_reduce(total)
    return (total / world).clamp(min=1.0)


def _sapo_gate(ratio: torch.Tensor, tau: float) -> torch.Tensor:
    """SAPO's soft gate (arXiv 2511.20347, as TRL computes it): ``4 / tau * sigmoid(tau * (ratio - 1))``."""
    return torch.sigmoid(tau * (ratio - 1)) * (4 / tau)


def _vespo_weight(log_ratio, mask, adv, is_ratio, k_pos, lambda_pos, k_neg, lambda_neg) -> torch.Tensor:
    """VESPO's detached gamma weight per sequence ``(k, 1)``, as TRL's ``get_gamma_weights``: ``w`` the
    sequence's ratio (its masked per-token log-ratios clamped to [-20, 20] and summed, plus the logs of
    the sampler's ``is_ratio``, clamped to [log 1e-8, 20]), ``phi = exp(lambda + k log w - lambda w)``
    (1 at ``w = 1``), non-finite values taken as 0."""
    floor = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        seq = seq + torch.log(is_ratio).clamp(floor, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(floor, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def fused_linear_grpo_loss(
    _input: torch.Tensor, weight: torch.Tensor, selected_token_ids: torch.Tensor, attention_mask: torch.Tensor,
    advantages: torch.Tensor, bias: torch.Tensor | None = None, *, ref_per_token_logps: torch.Tensor | None = None,
    old_per_token_logps: torch.Tensor | None = None, ref_input: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None, num_items_in_batch=None,
    beta: float = 0.04, epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
    max_completion_length: int | None = None, importance_sampling_level: str = "token", temperature: float = 1.0,
    use_ref_model: bool = True, delta: float | None = None, sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05, vllm_is_ratio: torch.Tensor | None = None, use_bias_correction_kl: bool = False,
    vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
):
    """GRPO's clipped policy loss with its KL term on the LM head, as TRL's GRPOTrainer computes it.

    ``_input`` ``(B, T, H)`` (the completions' last hidden states), ``selected_token_ids`` ``(B, T)``
    (the sampled tokens), ``attention_mask`` ``(B, T)`` (1 on completion tokens), ``advantages``
    ``(B,)``. Per token, with ``ratio = exp(logp - old_logp)`` (``old_per_token_logps`` None: the
    current log-probabilities, detached) taken per token or, with ``importance_sampling_level=
    "sequence"`` (GSPO), as the exponential of the sequence's mean log-ratio:
    ``-min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * k3(ref, logp)``
    (``delta``: INTELLECT-2's upper clamp of the unclipped ratio; the KL term needs the reference's
    log-probabilities, ``ref_per_token_logps`` or ``ref_input`` / ``ref_weight``, unless ``beta`` is 0
    or ``use_ref_model`` False). The logits are divided by ``temperature`` (the reference's too), by
    dividing hidden and bias in their dtype: in bf16 that rounds the quotients (2**-9 relative), which
    moved the gradients by about 1% at temperature 0.7 against dividing exact logits.
    ``loss_type``: ``grpo`` (each sequence's token mean, averaged over B), ``bnpo`` (the batch's token
    mean), ``dr_grpo`` (the sum over B x ``max_completion_length``), ``dapo`` (the sum over the
    generation batch's tokens, ``num_items_in_batch``, else this batch's summed over processes).

    The other policy terms, as TRL writes them (token-level ratios only):

    * ``cispo`` (MiniMax-M1): ``-min(ratio, epsilon_high).detach() * A * logp``, normalised as dapo;
    * ``sapo`` (arXiv 2511.20347): the clip replaced by the gate ``4 / tau * sigmoid(tau * (ratio - 1))``,
      ``tau`` = ``sapo_temperature_pos`` for ``A > 0`` else ``sapo_temperature_neg``: ``-gate * A``,
      normalised as grpo;
    * ``luspo``: the clipped term of grpo, each token weighted by its sequence's length and the sum
      divided by ``B x T`` (TRL's ``(loss * mask.sum(1, keepdim=True)).mean()``, padding included; a
      sequence-level loss without the KL term, one per sequence, counts at each of the T positions,
      as TRL's mean over its B values does);
    * ``vespo``: ``-phi * A * logp`` with the detached gamma weight ``phi(w) = exp(lambda + k log w -
      lambda w)`` of the sequence's ratio ``w`` (its summed, clamped log-ratios, with ``vllm_is_ratio``'s
      logs added), ``k, lambda`` = ``vespo_k_pos, vespo_lambda_pos`` for ``A >= 0`` else the ``_neg``
      pair; normalised as dapo.

    ``vllm_is_ratio`` (``(B, T)``, or ``(B, 1)`` or ``(B,)`` per sequence, the sampler's importance ratio) multiplies the policy
    term (vespo folds it into ``phi``); ``use_bias_correction_kl`` multiplies the KL term by the
    unclipped ratio (DeepSeek-V3.2). Returns ``(loss, metrics)``: metrics is ``(mean KL, clipped
    fraction)``, the KL left out when ``beta`` is 0 (liger-kernel's order; sapo and vespo clip nothing)."""
    check_choice("loss_type", loss_type, GRPO_LOSS_TYPES)
    check_choice("importance_sampling_level", importance_sampling_level, ("token", "sequence"))
    beta = check_real("beta", beta)
    epsilon_low, epsilon_high = check_nonneg_number("epsilon_low", epsilon_low), check_nonneg_number("epsilon_high", epsilon_high)
    temperature = check_real("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if loss_type == "dr_grpo" and (not is_integer(max_completion_length) or max_completion_length < 1):
        raise ValueError(f"loss_type='dr_grpo' needs max_completion_length (a positive int), got {max_completion_length!r}")
    if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(f"loss_type={loss_type!r} takes token-level ratios: use importance_sampling_level='token'")
    sapo_pos, sapo_neg = check_real("sapo_temperature_pos", sapo_temperature_pos), check_real("sapo_temperature_neg", sapo_temperature_neg)
    if not (sapo_pos > 0 and sapo_neg > 0):
        raise ValueError(f"sapo_temperature_pos and sapo_temperature_neg must be positive, got {sapo_pos!r}, {sapo_neg!r}")
    vespo = tuple(check_real(name, v) for name, v in (("vespo_k_pos", vespo_k_pos), ("vespo_lambda_pos", vespo_lambda_pos),
                                                       ("vespo_k_neg", vespo_k_neg), ("vespo_lambda_neg", vespo_lambda_neg)))
    delta = None if delta is None else check_real("delta", delta)
    if delta is not None and not delta > 0:
        raise ValueError(f"delta must be positive (the upper clamp of the unclipped ratio; INTELLECT-2 takes it "
                         f"above 1 + epsilon_high), got {delta!r}")
    given = {name: t for name, t in (("old_per_token_logps", old_per_token_logps),
                                     ("ref_per_token_logps", ref_per_token_logps)) if t is not None}
    _check_sequences(_input, selected_token_ids=selected_token_ids, attention_mask=attention_mask, **given)
    shape = tuple(_input.shape[:2])
    if isinstance(vllm_is_ratio, torch.Tensor) and tuple(vllm_is_ratio.shape) == shape[:1]:
        vllm_is_ratio = vllm_is_ratio.unsqueeze(-1)  # one per sequence, as liger-kernel takes it too
    if vllm_is_ratio is not None and (not isinstance(vllm_is_ratio, torch.Tensor) or tuple(vllm_is_ratio.shape) not in (shape, (shape[0], 1))):
        raise ValueError(f"vllm_is_ratio must have shape {shape}, {(shape[0], 1)} or {shape[:1]} (per token or per sequence)")
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages must have shape {shape[:1]} (one per sequence)")

    def over_temperature(h, b):
        """The logits over the temperature, by dividing hidden and bias in their dtype."""
        if temperature == 1.0:
            return h, b
        return h / temperature, None if b is None else b / temperature

    def token_logps(h, w, b):
        return _token_logps(h, w, selected_token_ids, b, -100)

    h, b = over_temperature(_input, bias)

    dtype = torch.promote_types(_input.dtype, torch.float32)  # the log-probabilities' and the loss's
    mask = attention_mask.to(dtype)
    adv = advantages.to(dtype).unsqueeze(1)
    ref = None
    if beta != 0.0 and use_ref_model:
        if ref_per_token_logps is not None:
            ref = ref_per_token_logps.detach().to(dtype)
        elif ref_input is not None and ref_weight is not None:
            _check_reference_head(ref_input, ref_weight, ref_bias, weight, shape)
            ref_h, ref_b = over_temperature(ref_input, ref_bias)
            ref = _reference_token_logps(ref_h, ref_weight, selected_token_ids, ref_b, -100)
        else:
            raise ValueError("beta != 0 with use_ref_model=True needs ref_per_token_logps, or ref_input and "
                             "ref_weight; or beta=0 / use_ref_model=False")
    old_given = None if old_per_token_logps is None else old_per_token_logps.detach().to(dtype)
    is_ratio = None if vllm_is_ratio is None else vllm_is_ratio.detach().to(dtype)
    if loss_type in ("grpo", "sapo"):
        lengths = mask.sum(-1).clamp(min=1.0)
    elif loss_type == "luspo":
        seq_weight = mask.sum(-1, keepdim=True)
        normaliser = shape[0] * shape[1]
    elif loss_type == "bnpo":
        normaliser = mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        normaliser = shape[0] * max_completion_length
    else:
        normaliser = _dapo_normalizer(attention_mask, num_items_in_batch)

    def per_token(logp, rows):
        """(per-token loss, clipped-token flags, k3 KL or None) of the sequences ``rows``."""
        m, a = mask[rows], adv[rows]
        old = logp.detach() if old_given is None else old_given[rows]
        token_log_ratio = logp - old
        log_ratio = token_log_ratio
        if importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(log_ratio)
        low = high = torch.zeros_like(ratio, dtype=torch.bool)
        if loss_type == "cispo":
            loss = -torch.clamp(ratio, max=epsilon_high).detach() * a * logp
            high = ratio > epsilon_high
        elif loss_type == "sapo":
            gate = torch.where(a > 0, _sapo_gate(ratio, sapo_pos), _sapo_gate(ratio, sapo_neg))
            loss = -gate * a
        elif loss_type == "vespo":
            loss = -_vespo_weight(token_log_ratio.detach(), m, a, None if is_ratio is None else is_ratio[rows], *vespo) * a * logp
        else:
            clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
            unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
            loss = -torch.min(unclipped * a, clipped * a)
            low, high = ratio < 1 - epsilon_low, ratio > 1 + epsilon_high
        if is_ratio is not None and loss_type != "vespo":
            loss = loss * is_ratio[rows]
        kl = None
        if ref is not None:
            kl = _k3(ref[rows], logp)
            if use_bias_correction_kl:
                kl = kl * ratio
            loss = loss + beta * kl
        return loss, (low & (a < 0)) | (high & (a > 0)), kl

    def total(logp, rows):
        loss = per_token(logp, rows)[0]
        if loss_type == "luspo":  # TRL's: every position, weighted by its sequence's length
            # (a loss of one per sequence, sequence-level ratios without the KL, counts at each of
            # its T positions: TRL's mean then runs over B where it runs over B x T per token)
            return (loss.expand(-1, shape[1]) * seq_weight[rows]).sum() / normaliser
        masked = loss * mask[rows]
        if loss_type in ("grpo", "sapo"):
            return (masked.sum(-1) / lengths[rows]).sum() / shape[0]
        return masked.sum() / normaliser

    # Every token is kept (the attention mask weighs them in the loss): no target is ignore_index.
    plan = _one_pass_plan(h, weight, selected_token_ids, b, -100, "mean", shape[1])
    if plan is None:
        logp = token_logps(h, weight, b)
        loss = total(logp, slice(None))
    else:  # one pass (three products): each chunk of whole sequences gives its tokens their factors
        keep = torch.ones((shape[0], 1, shape[1]), dtype=torch.bool, device=_input.device)
        loss, tokens = _one_pass(h.reshape(-1, h.shape[-1]), weight, b, selected_token_ids.reshape(-1), -100, keep,
                                 lambda tokens, rows: total(tokens[:, 0], rows), *plan)
        logp = tokens[:, 0]
    with torch.no_grad():
        _, is_clipped, kl = per_token(logp.detach(), slice(None))
    count = mask.sum().clamp(min=1.0)
    metrics = [] if beta == 0.0 else [(kl * mask).sum() / count if kl is not None else logp.new_zeros(())]
    metrics.append((is_clipped.expand_as(mask) * mask).sum() / count)
    return loss, tuple(m.detach() for m in metrics)


# --------------------------------------------------------------------------- distillation (JSD, forward and reverse KL)


def chunk_terms(s, t, labels, keep, beta: float, temperature: float, w_hard: float, w_soft: float, scale,
                 grad_dtype, need_bias: bool):
    """One chunk of the distillation loss from its student logits ``s`` and teacher logits ``t`` (rows,
    taken in float32, or float64 for float64 inputs): ``(hard, soft, dlogits, dbias)``.

    ``hard`` is each row's cross-entropy of ``labels``; ``soft`` each row's generalised Jensen-Shannon
    divergence of ``softmax(s / temperature)`` from ``softmax(t / temperature)``: ``beta * KL(T || M) +
    (1 - beta) * KL(S || M)`` with ``M = (1 - beta) S + beta T``; ``beta = 0`` is the forward KL(T || S),
    ``beta = 1`` the reverse KL(S || T). With ``grad_dtype`` (else None for both), ``dlogits`` is the
    gradient in ``s`` of ``scale * sum(keep * (w_hard * hard + w_soft * soft))`` (``scale`` a 0-dim
    tensor) in ``grad_dtype``, and with ``need_bias`` ``dbias`` its column sums before that rounding.
    The gradient is written out (no autograd graph, a few row-sized passes):

    * the divergence's gradient in the student's log-probabilities ``ls`` is ``g = (1 - beta) (ls - lm)``
      (``lm`` the mixture's log-probabilities) for ``0 < beta < 1``, ``ls - lt + 1`` for the reverse
      KL and ``-exp(lt - ls)`` for the forward KL; through the softmax, the logits get
      ``p * (g - sum(p * g))`` over ``temperature``, which for the forward KL is ``(p - q) / temperature``;
    * the cross-entropy's is ``softmax(s) - onehot(label)``.

    A row whose label is neither a class nor ignored (``keep`` 1) gets a NaN loss and gradient, as the
    fused linear cross-entropy gives on a GPU; an ignored row's label indexes nothing.
    """
    acc = torch.promote_types(s.dtype, torch.float32)
    in_range = (labels >= 0) & (labels < s.shape[-1])
    labels = torch.where(in_range, labels, 0)
    nan_if_bad = torch.where(in_range | (keep == 0), 0.0, math.nan).to(acc)  # added to the row's hard loss and keep
    s, t = s.to(acc), t.to(acc)
    ls = torch.log_softmax(s / temperature if temperature != 1.0 else s, -1)
    lt = torch.log_softmax(t / temperature if temperature != 1.0 else t, -1)
    if beta == 0.0:  # forward KL(T || S)
        q = lt.exp()
        soft = (q * (lt - ls)).sum(-1)
        g = None
    elif beta == 1.0:  # reverse KL(S || T)
        d = ls - lt
        soft = (ls.exp() * d).sum(-1)
        g = d
    else:
        a, b = ls + math.log(1 - beta), lt + math.log(beta)
        lm = torch.maximum(a, b) + torch.log1p(torch.exp(-(a - b).abs()))  # log((1-beta) S + beta T)
        soft = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
        g = (1 - beta) * (ls - lm)
    lse = torch.logsumexp(s, -1)
    hard = lse - s.gather(-1, labels.unsqueeze(-1)).squeeze(-1) + nan_if_bad
    if grad_dtype is None:
        return hard, soft, None, None
    p = ls.exp()
    dsoft = p - q if g is None else p * (g - (p * g).sum(-1, keepdim=True))
    keep = (keep + nan_if_bad) * scale
    dlogits = dsoft * (keep * (w_soft / temperature)).unsqueeze(-1)
    if w_hard != 0.0:
        p_hard = p if temperature == 1.0 else torch.exp(s - lse.unsqueeze(-1))
        onehot = torch.zeros_like(s).scatter_(-1, labels.unsqueeze(-1), 1.0)
        dlogits = dlogits + (p_hard - onehot) * (keep * w_hard).unsqueeze(-1)
    return hard, soft, dlogits.to(grad_dtype), dlogits.sum(0) if need_bias else None


# Whether the distillation chunk (:func:`chunk_terms`) runs compiled by torch.compile: None, on GPUs
# only (the CPU would pay seconds of compilation per new option set for little); True or False, always
# or never (the tests compile it on the CPU).
COMPILE_CHUNK: bool | None = None

# The compiled chunk once made (None before); False after a compiler failure (the eager chunk from then on).
compiled_chunk = None


def terms_fn(device: torch.device):
    """:func:`chunk_terms` for tensors on ``device``: compiled by torch.compile (its row-sized passes
    fused into a few kernels, without the chunk-sized float32 intermediates) where
    :data:`COMPILE_CHUNK` says so, else as it is; eager, with a warning, once the compiler failed."""
    global compiled_chunk
    compile_here = COMPILE_CHUNK if COMPILE_CHUNK is not None else device.type != "cpu"
    if not compile_here or compiled_chunk is False:
        return chunk_terms
    if compiled_chunk is None:
        compiled = torch.compile(chunk_terms, dynamic=False)

        def terms(*args):
            global compiled_chunk
            try:
                return compiled(*args)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                warn(f"torch.compile failed on the distillation loss's chunk ({type(e).__name__}: "
                 f"{str(e).splitlines()[0]}); running it eagerly, with more memory")
                compiled_chunk = False
                return chunk_terms(*args)

        compiled_chunk = terms
    return compiled_chunk


class _FusedLinearDistillation(torch.autograd.Function):
    """Chunks of ``chunk_size`` tokens: the student's and teacher's logits of a chunk, its loss and the
    gradient of its student logits (:func:`chunk_terms`), then the gradients of the student's hidden
    states, weight and bias by matrix products, in the forward (as the fused linear cross-entropy
    does); the backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, h, w, b, labels, teacher, beta, w_hard, w_soft, ignore_index, temperature, chunk_size):
        n = h.shape[0]
        acc = torch.promote_types(h.dtype, torch.float32)  # the loss's dtype, and the gradients' sums
        valid = (labels != ignore_index).sum().clamp(min=1).to(acc)
        inv_valid = 1.0 / valid
        need = ctx.needs_input_grad
        need_grad = any(need[:3])
        # The weight's gradient accumulates in its dtype, each chunk's product summed in fp32 inside the
        # matmul and rounded once (as the fused linear cross-entropy does); the bias's in fp32.
        gh = torch.empty_like(h) if need[0] else None
        gw = torch.empty_like(w) if need[1] else None
        gb = torch.zeros(b.shape, dtype=acc, device=b.device) if b is not None and need[2] else None
        soft_total = h.new_zeros((), dtype=acc)
        hard_total = h.new_zeros((), dtype=acc)
        terms = terms_fn(h.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            hc, yc = h[rows], labels[rows]
            logits = hc @ w.T
            if b is not None:
                logits = logits + b
            keep = (yc != ignore_index).to(acc)
            # the chunk's share of the loss, (w_hard * hard + w_soft * soft) / valid, and its gradient
            hard, soft, d, db = terms(
                logits, teacher(rows), yc, keep, beta, temperature, w_hard, w_soft, inv_valid,
                h.dtype if need_grad else None, gb is not None,
            )
            del logits
            hard_total += (hard * keep).sum()
            soft_total += (soft * keep).sum()
            if d is None:
                continue
            if gh is not None:
                gh[rows].addmm_(d, w, beta=0)
            if gw is not None:
                gw.addmm_(d.T, hc, beta=0 if start == 0 else 1)
            if gb is not None:
                gb += db
            del d
        if gw is not None and n == 0:
            gw.zero_()  # no chunk accumulated into it
        soft, hard = soft_total / valid, hard_total / valid
        ctx.save_for_backward(gh, gw, gb)
        ctx.bias_dtype = None if b is None else b.dtype
        ctx.mark_non_differentiable(soft, hard)
        return w_hard * hard + w_soft * soft, soft, hard

    @staticmethod
    @first_order_only("distillation loss")
    def backward(ctx, grad, _soft, _hard):
        gh, gw, gb = ctx.saved_tensors
        # grad is a 0-dim factor: each product stays in its gradient's dtype, rounded once
        gh = None if gh is None else gh * grad
        gw = None if gw is None else gw * grad
        gb = None if gb is None else (gb * grad).to(ctx.bias_dtype)
        return gh, gw, gb, None, None, None, None, None, None, None, None


def fused_linear_distillation_loss(
    student_input: torch.Tensor, student_weight: torch.Tensor, true_labels: torch.Tensor,
    student_bias: torch.Tensor | None = None, *, teacher_input: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None, beta: float = 0.5, weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5, ignore_index: int = -100, temperature: float = 1.0, chunk_size: int = 1024,
    return_soft_hard_loss: bool = False,
):
    """Distillation on the student's LM head: ``weight_hard_loss * CE(student, true_labels) +
    weight_soft_loss * JSD_beta(student / temperature, teacher / temperature)``, both summed over the
    tokens that are not ``ignore_index`` and divided by their count (liger-kernel's definition).

    ``beta`` 0 gives the forward KL(teacher || student), 1 the reverse KL(student || teacher), between
    them the generalised JSD. The teacher is a head (``teacher_input`` ``(N, H_t)``, ``teacher_weight``
    ``(V, H_t)``, ``teacher_bias``) or its logits (``teacher_logits`` ``(N, V)``); it gets no gradient.
    The student's and teacher's logits exist ``chunk_size`` tokens at a time (float32 inside the
    loss). Returns the loss, or ``(loss, soft_loss, hard_loss)``."""
    beta = check_real("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")
    w_hard, w_soft = check_real("weight_hard_loss", weight_hard_loss), check_real("weight_soft_loss", weight_soft_loss)
    temperature = check_real("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if not is_integer(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
    if not is_integer(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    for name, t in (("student_input", student_input), ("student_weight", student_weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a 2-D floating-point tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    n, hidden = student_input.shape
    vocab = student_weight.shape[0]
    if student_weight.shape[1] != hidden:
        raise ValueError(f"student_weight must have shape (V, {hidden}) (its second dimension is student_input's last), got {tuple(student_weight.shape)}")
    if student_weight.dtype != student_input.dtype or (student_bias is not None and student_bias.dtype != student_input.dtype):
        raise TypeError("student_weight (and student_bias) must have student_input's dtype "
                        f"{student_input.dtype}; cast them, e.g. student_weight.to(student_input.dtype)")
    if student_bias is not None and tuple(student_bias.shape) != (vocab,):
        raise ValueError(f"student_bias must have shape ({vocab},), got {tuple(student_bias.shape)}")
    if not isinstance(true_labels, torch.Tensor) or tuple(true_labels.shape) != (n,):
        raise ValueError(f"true_labels must have shape ({n},) (one per row of student_input)")
    if true_labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"true_labels must hold class indices as torch.int64 (or torch.int32), got {true_labels.dtype}")
    check_class_range("true_labels", true_labels, vocab, ignore_index)  # (a GPU gets NaN rows: chunk_terms)
    if teacher_logits is not None:
        if tuple(teacher_logits.shape) != (n, vocab):
            raise ValueError(f"teacher_logits must have shape ({n}, {vocab}) (tokens x the student's vocabulary), got {tuple(teacher_logits.shape)}")

        def teacher(rows):
            return teacher_logits[rows].detach()
    elif teacher_input is None or teacher_weight is None:
        raise ValueError("pass the teacher's head (teacher_input and teacher_weight) or its logits (teacher_logits)")
    else:
        if tuple(teacher_weight.shape[:1]) != (vocab,):
            raise ValueError(f"teacher_weight must have the student's vocabulary ({vocab} rows), got {tuple(teacher_weight.shape)}")
        if teacher_input.dim() != 2 or teacher_input.shape[0] != n or teacher_input.shape[1] != teacher_weight.shape[1]:
            raise ValueError(f"teacher_input must have shape ({n}, {teacher_weight.shape[1]}), got {tuple(teacher_input.shape)}")

        def teacher(rows):
            with torch.no_grad():
                logits = teacher_input[rows] @ teacher_weight.T
                return logits if teacher_bias is None else logits + teacher_bias
    if not torch.is_grad_enabled():  # (the Function's forward would still see the inputs' requires_grad)
        student_input, student_weight = student_input.detach(), student_weight.detach()
        student_bias = None if student_bias is None else student_bias.detach()
    loss, soft, hard = _FusedLinearDistillation.apply(
        student_input, student_weight, student_bias, true_labels.long(), teacher, beta, w_hard, w_soft, int(ignore_index),
        temperature, int(chunk_size),
    )
    return (loss, soft, hard) if return_soft_hard_loss else loss


# --------------------------------------------------------------------------- modules (liger-kernel's names and arguments)


class _PreferenceLoss(torch.nn.Module):
    """Keeps the options; ``compiled`` and ``chunk_size`` are liger-kernel's and change nothing here."""

    def _options(self, names: tuple[str, ...]) -> dict:
        return {name: getattr(self, name) for name in names}


class LigerFusedLinearDPOLoss(_PreferenceLoss):
    """DPO on the LM head (see :func:`fused_linear_dpo_loss`), with liger-kernel's arguments.

    ``forward(lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None)``.
    """

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, compute_nll_loss: bool = False,
        compiled: bool = True, use_ref_model: bool = True, average_log_prob: bool = False, chunk_size: int = 1,
        loss_type: str = "sigmoid", label_smoothing: float = 0.0, discopop_tau: float = 0.05, reduction: str = "mean",
    ):
        super().__init__()
        check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
        self.ignore_index, self.beta, self.alpha, self.compute_nll_loss = ignore_index, beta, alpha, compute_nll_loss
        self.compiled, self.use_ref_model, self.average_log_prob, self.chunk_size = compiled, use_ref_model, average_log_prob, chunk_size
        self.loss_type, self.label_smoothing, self.discopop_tau, self.reduction = loss_type, label_smoothing, discopop_tau, reduction

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None):
        return fused_linear_dpo_loss(
            _input, lin_weight, target, bias, ref_input=ref_input, ref_weight=ref_weight, ref_bias=ref_bias,
            **self._options(("use_ref_model", "ignore_index", "beta", "alpha", "compute_nll_loss", "average_log_prob",
                             "loss_type", "label_smoothing", "discopop_tau", "reduction")),
        )


class LigerFusedLinearORPOLoss(_PreferenceLoss):
    """ORPO on the LM head (see :func:`fused_linear_orpo_loss`), with liger-kernel's arguments.

    ``forward(lin_weight, _input, target, bias=None, nll_target=None)``.
    """

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, compute_nll_loss: bool = True, compiled: bool = True,
        chunk_size: int = 1, reduction: str = "mean",
    ):
        super().__init__()
        self.ignore_index, self.beta, self.compute_nll_loss = ignore_index, beta, compute_nll_loss
        self.compiled, self.chunk_size, self.reduction = compiled, chunk_size, reduction

    def forward(self, lin_weight, _input, target, bias=None, nll_target=None):
        return fused_linear_orpo_loss(
            _input, lin_weight, target, bias, nll_target=nll_target,
            **self._options(("ignore_index", "beta", "compute_nll_loss", "reduction")),
        )


class LigerFusedLinearSimPOLoss(_PreferenceLoss):
    """SimPO on the LM head (see :func:`fused_linear_simpo_loss`), with liger-kernel's arguments.

    ``forward(lin_weight, _input, target, bias=None)``.
    """

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
        compute_nll_loss: bool = True, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1,
        reduction: str = "mean",
    ):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled, self.gamma, self.chunk_size = compute_nll_loss, compiled, gamma, chunk_size
        self.reduction = reduction

    def forward(self, lin_weight, _input, target, bias=None):
        return fused_linear_simpo_loss(
            _input, lin_weight, target, bias,
            **self._options(("ignore_index", "beta", "alpha", "label_smoothing", "compute_nll_loss", "gamma", "reduction")),
        )


class LigerFusedLinearCPOLoss(_PreferenceLoss):
    """CPO on the LM head (see :func:`fused_linear_cpo_loss`), with liger-kernel's arguments.

    ``forward(lin_weight, _input, target, bias=None)``.
    """

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
        compute_nll_loss: bool = True, compiled: bool = True, average_log_prob: bool = False, chunk_size: int = 1,
        reduction: str = "mean",
    ):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled, self.average_log_prob = compute_nll_loss, compiled, average_log_prob
        self.chunk_size, self.reduction = chunk_size, reduction

    def forward(self, lin_weight, _input, target, bias=None):
        return fused_linear_cpo_loss(
            _input, lin_weight, target, bias,
            **self._options(("ignore_index", "beta", "alpha", "label_smoothing", "compute_nll_loss",
                             "average_log_prob", "reduction")),
        )


class LigerFusedLinearKTOLoss(_PreferenceLoss):
    """KTO on the LM head (see :func:`fused_linear_kto_loss`), with liger-kernel's arguments.

    ``forward(_input, lin_weight, target, bias=None, preference_labels=None, ref_input=None,
    ref_weight=None, ref_bias=None, kl=None)`` (the input first, as liger-kernel's KTO has it).
    """

    def __init__(
        self, ignore_index: int = -100, beta: float = 0.1, compiled: bool = True, use_ref_model: bool = False,
        average_log_prob: bool = False, chunk_size: int = 1, reduction: str = "mean",
    ):
        super().__init__()
        self.ignore_index, self.beta, self.compiled, self.use_ref_model = ignore_index, beta, compiled, use_ref_model
        self.average_log_prob, self.chunk_size, self.reduction = average_log_prob, chunk_size, reduction

    def forward(self, _input, lin_weight, target, bias=None, preference_labels=None, ref_input=None, ref_weight=None,
                ref_bias=None, kl=None):
        return fused_linear_kto_loss(
            _input, lin_weight, target, bias, preference_labels=preference_labels, ref_input=ref_input,
            ref_weight=ref_weight, ref_bias=ref_bias, kl=kl,
            **self._options(("use_ref_model", "ignore_index", "beta", "average_log_prob", "reduction")),
        )


class LigerFusedLinearGRPOLoss(_PreferenceLoss):
    """GRPO on the LM head (see :func:`fused_linear_grpo_loss`), with liger-kernel's arguments, in its
    order, for every loss type it has (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``, ``sapo``,
    ``luspo``, ``vespo``).

    ``forward(_input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
    ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
    vllm_is_ratio=None, num_items_in_batch=None)``.
    """

    def __init__(
        self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
        epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
        max_completion_length: int | None = None, importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
        delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
    ):
        super().__init__()
        check_choice("loss_type", loss_type, GRPO_LOSS_TYPES)
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size
        self.epsilon_low, self.epsilon_high, self.loss_type = epsilon_low, epsilon_high, loss_type
        self.max_completion_length, self.importance_sampling_level = max_completion_length, importance_sampling_level
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.temperature, self.delta, self.use_bias_correction_kl = temperature, delta, use_bias_correction_kl
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        return fused_linear_grpo_loss(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias,
            ref_per_token_logps=ref_per_token_logps, old_per_token_logps=old_per_token_logps, ref_input=ref_input,
            ref_weight=ref_weight, ref_bias=ref_bias, vllm_is_ratio=vllm_is_ratio, num_items_in_batch=num_items_in_batch,
            **self._options(("beta", "epsilon_low", "epsilon_high", "loss_type", "max_completion_length",
                             "importance_sampling_level", "temperature", "use_ref_model", "delta",
                             "sapo_temperature_pos", "sapo_temperature_neg", "use_bias_correction_kl",
                             "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")),
        )


class LigerFusedLinearJSDLoss(_PreferenceLoss):
    """Distillation with the generalised JSD on the student's LM head (see
    :func:`fused_linear_distillation_loss`), with liger-kernel's arguments (``chunk_size`` is used).

    ``forward(student_input, student_weight, teacher_input, teacher_weight, true_labels,
    student_bias=None, teacher_bias=None)``.
    """

    def __init__(
        self, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
        ignore_index: int = -100, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
        return_soft_hard_loss: bool = False,
    ):
        super().__init__()
        self.weight_hard_loss, self.weight_soft_loss, self.beta = weight_hard_loss, weight_soft_loss, beta
        self.ignore_index, self.temperature, self.compiled = ignore_index, temperature, compiled
        self.chunk_size, self.return_soft_hard_loss = chunk_size, return_soft_hard_loss

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                teacher_bias=None):
        return fused_linear_distillation_loss(
            student_input, student_weight, true_labels, student_bias, teacher_input=teacher_input,
            teacher_weight=teacher_weight, teacher_bias=teacher_bias,
            **self._options(("beta", "weight_hard_loss", "weight_soft_loss", "ignore_index", "temperature",
                             "chunk_size", "return_soft_hard_loss")),
        )
