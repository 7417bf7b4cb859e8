"""Fused linear preference losses: DPO, ORPO, SimPO and CPO on the language-model head, without
ever holding the (tokens x vocabulary) logits.

Each loss is a function of every sequence's log-probability of its completion (the sum, or the mean,
of its tokens' log-probabilities) and, where asked, of the chosen sequences' NLL. A token's
log-probability is minus its cross-entropy, so the token log-probabilities come from
:func:`liger_portable.functional.fused_linear_cross_entropy` with ``reduction="none"``: the device's
tuned kernels on every vendor, chunk by chunk, or the PyTorch fallback on the CPU. The loss over
the per-sequence log-probabilities is a few PyTorch operations on ``(batch,)`` tensors, and autograd
hands each token its factor: the fused cross-entropy's backward recomputes the logits chunk by chunk
with those factors. That is four ``tokens x hidden x vocabulary`` products (logits, their recompute,
the two gradients) against three for a loss that computes its gradients in the forward, and no
memory beyond one chunk of logits and the gradients.

Inputs follow liger-kernel's chunked losses (``liger_kernel.chunked_loss``), so that switching is a
change of import: ``_input`` is ``(2B, T, H)``, the B chosen sequences stacked over the B rejected
ones, ``target`` ``(2B, T)`` with ``ignore_index`` on the prompt and padding; the modules' forward
takes ``(lin_weight, _input, target, bias=None, ...)`` and returns ``(loss, (chosen_logps,
rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, *aux))``. ``compiled`` and
``chunk_size`` are accepted for that compatibility and change nothing (the chunking is the fused
cross-entropy's, by tokens). The functions :func:`fused_linear_dpo_loss` and the rest take keyword
options and add ``reduction`` (``"mean"``, liger-kernel's; ``"sum"``; ``"none"``: one loss per pair,
whose sum is the ``"sum"`` loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as TF

from .functional import fused_linear_cross_entropy
from ._checks import check_choice, check_nonneg_number, check_real, is_integer

REDUCTIONS = ("mean", "sum", "none")
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop",
)

__all__ = [
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOLoss",
    "fused_linear_cpo_loss",
    "fused_linear_dpo_loss",
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


def _token_logps(hidden, weight, target, bias, ignore_index: int) -> torch.Tensor:
    """``(2B, T)`` log-probability of each target token (0 where ignored), in float32 (float64 for
    float64 inputs), differentiable in hidden, weight and bias."""
    return -fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction="none")


def _sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Each sequence's completion log-probability: the sum over its tokens, or their mean (a sequence
    with no completion token has log-probability 0)."""
    total = token_logps.sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def _logits_mean(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``hidden @ weight.T + bias`` over every position and class, from the classes' sum
    of the weight rows (no logits), in float32 (hidden converted 2048 rows at a time): liger-kernel's
    logging figure, not differentiable. The mean of logits is a small difference of large terms:
    rounding the row sums to bf16 put it 2% off."""
    with torch.no_grad():
        rows = hidden.reshape(-1, hidden.shape[-1])
        acc = torch.promote_types(hidden.dtype, torch.float32)
        column_sums = weight.sum(0, dtype=acc)
        total = sum((chunk.to(acc) @ column_sums).sum() for chunk in rows.split(2048))
        if bias is not None:
            total = total + bias.sum(dtype=acc) * rows.shape[0]
        return total / (rows.shape[0] * weight.shape[0])


def _pairs(
    hidden, weight, target, bias, *, ignore_index, average_log_prob, compute_nll_loss, nll_target=None,
):
    """The per-pair ingredients of every loss here: chosen and rejected log-probabilities ``(B,)``,
    the chosen NLL (a scalar) and its per-pair parts ``(B,)`` (summing to it), and the logits means."""
    _check_pairs("_input", hidden, target)
    if not is_integer(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
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
    means = (_logits_mean(hidden[:n], weight, bias), _logits_mean(hidden[n:], weight, bias))
    return logps[:n], logps[n:], nll, nll_pairs, means


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
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
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
    if loss_type == "sppo_hard" and beta == 0:
        raise ValueError("beta must be non-zero for loss_type='sppo_hard' (its targets are +-0.5 / beta)")
    if loss_type == "discopop":
        check_real("discopop_tau", discopop_tau)
        if not discopop_tau > 0:
            raise ValueError(f"discopop_tau must be positive, got {discopop_tau!r}")
    chosen, rejected, nll, nll_pairs, means = _pairs(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=average_log_prob,
        compute_nll_loss=compute_nll_loss,
    )
    ref_chosen, ref_rejected = _reference_logps(
        use_ref_model, ref_logps, ref_input, ref_weight, ref_bias, target, chosen, ignore_index, average_log_prob
    )
    losses, chosen_rewards, rejected_rewards = dpo_pair_losses(
        chosen, rejected, ref_chosen, ref_rejected, beta, loss_type, label_smoothing, discopop_tau
    )
    loss = _reduce(losses, nll, nll_pairs, alpha, reduction)
    return _result(loss, chosen, rejected, means, nll, (chosen_rewards, rejected_rewards))


def _reference_logps(use_ref_model, ref_logps, ref_input, ref_weight, ref_bias, target, chosen, ignore_index, average):
    if not use_ref_model:
        zero = chosen.new_zeros(chosen.shape)
        return zero, zero
    if ref_logps is not None:
        if len(ref_logps) != 2 or any(tuple(t.shape) != tuple(chosen.shape) for t in ref_logps):
            raise ValueError(f"ref_logps must be (chosen, rejected), each of shape {tuple(chosen.shape)}")
        return tuple(t.detach().to(chosen.dtype) for t in ref_logps)
    if ref_input is None or ref_weight is None:
        raise ValueError(
            "use_ref_model=True needs the reference model's log-probabilities: pass ref_input and ref_weight "
            "(its last hidden states and LM head), or ref_logps=(chosen, rejected); or use_ref_model=False"
        )
    _check_pairs("ref_input", ref_input, target)
    with torch.no_grad():
        token_logps = _token_logps(ref_input, ref_weight, target, ref_bias, int(ignore_index))
        logps = _sequence_logps(token_logps, target != ignore_index, average).to(chosen.dtype)
    n = chosen.shape[0]
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
    chosen, rejected, nll, nll_pairs, means = _pairs(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=True,
        compute_nll_loss=compute_nll_loss, nll_target=nll_target,
    )
    losses, *aux = orpo_pair_losses(chosen, rejected, beta)
    return _result(_reduce(losses, nll, nll_pairs, 1.0, reduction), chosen, rejected, means, nll, aux)


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
    chosen, rejected, nll, nll_pairs, means = _pairs(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=True, compute_nll_loss=compute_nll_loss,
    )
    losses, *aux = simpo_pair_losses(chosen, rejected, beta, gamma, label_smoothing)
    return _result(_reduce(losses, nll, nll_pairs, alpha, reduction), chosen, rejected, means, nll, aux)


def fused_linear_cpo_loss(
    _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None, *,
    ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
    compute_nll_loss: bool = True, average_log_prob: bool = False, reduction: str = "mean",
):
    """CPO on the LM head: ``alpha * NLL(chosen) - log sigmoid(beta * (logp chosen - logp rejected))``,
    label smoothing as cDPO. Returns as :func:`fused_linear_simpo_loss`."""
    beta, alpha = _check_common(beta, alpha, reduction)
    label_smoothing = _check_smoothing(label_smoothing)
    chosen, rejected, nll, nll_pairs, means = _pairs(
        _input, weight, target, bias, ignore_index=ignore_index, average_log_prob=average_log_prob,
        compute_nll_loss=compute_nll_loss,
    )
    losses, *aux = cpo_pair_losses(chosen, rejected, beta, label_smoothing)
    return _result(_reduce(losses, nll, nll_pairs, alpha, reduction), chosen, rejected, means, nll, aux)


def _check_smoothing(label_smoothing) -> float:
    value = check_nonneg_number("label_smoothing", label_smoothing)
    if not value <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] (the assumed fraction of flipped labels), got {label_smoothing!r}")
    return value


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
