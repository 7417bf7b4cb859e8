"""Fused linear preference losses (DPO and its variants, ORPO, SimPO, CPO): against an independent
float64 reference that builds the full logits and writes each paper's loss out again; gradients of
hidden, weight and bias; chosen and rejected sequences of unequal lengths (ignore_index on the
prompt and the padding, one completion empty); every reduction; the kernel path in the Triton
interpreter; liger-kernel's module signatures; a few DPO steps of a tiny model, fused and not.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as TF

import liger_portable
from liger_portable import chunked_loss as C
from liger_portable import nn as lnn

from conftest import TOL, rel_err

IGNORE = -100
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_ids = {"dtype": lambda d: str(d).removeprefix("torch.")}


def _inputs(B=3, T=9, H=16, V=37, dtype=torch.float32, bias=True, seed=0, device="cpu", empty=True):
    """2B sequences (chosen over rejected) with a 3-token prompt, completions of different lengths
    (ignore_index after them), and (``empty``) one rejected completion that is all padding. The
    reference model differs enough from the policy that their log-probability differences (DPO's
    rewards) are not a cancellation of nearly equal numbers."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2 * B, T, H, generator=g)
    w = torch.randn(V, H, generator=g) / H**0.5 * 2
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    t = torch.randint(0, V, (2 * B, T), generator=g)
    t[:, :3] = IGNORE
    for row in range(2 * B):
        end = int(torch.randint(4, T + 1, (1,), generator=g))
        t[row, end:] = IGNORE
    if empty:
        t[2 * B - 1, 3:] = IGNORE  # an empty completion
    ref_h = h + 0.5 * torch.randn(h.shape, generator=g)
    ref_w = w + 0.5 * torch.randn(w.shape, generator=g) / H**0.5
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(h), cast(w), cast(b), t.to(device), cast(ref_h), cast(ref_w)


def _logps(h, w, b, t, average):
    """float64 per-sequence log-probabilities and per-token log-probabilities from the full logits."""
    logits = h.double() @ w.double().T + (0 if b is None else b.double())
    logp = torch.log_softmax(logits, -1)
    mask = t != IGNORE
    tok = logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    seq = tok.sum(-1)
    if average:
        seq = seq / mask.sum(-1).clamp(min=1)
    return seq, tok, mask, logits


# The papers' losses written out again (per pair), from policy (c, r) and reference (rc, rr) log-probs.
def _dpo_ref(kind, beta, ls=0.0, tau=0.05):
    def f(c, r, rc, rr):
        u = beta * ((c - rc) - (r - rr))
        sig, logsig = torch.sigmoid, TF.logsigmoid
        cr, rrw = beta * (c - rc), beta * (r - rr)
        return {
            "sigmoid": lambda: -logsig(u),
            "hinge": lambda: (1 - u).clamp(min=0),
            "exo_pair": lambda: sig(u) * (logsig(u) - math.log(1 - ls)) + sig(-u) * (logsig(-u) - math.log(ls)),
            "nca_pair": lambda: -logsig(cr) - 0.5 * logsig(-cr) - 0.5 * logsig(-rrw),
            "robust": lambda: ((1 - ls) * -logsig(u) + ls * logsig(-u)) / (1 - 2 * ls),
            "bco_pair": lambda: -logsig(cr) - logsig(-rrw),
            "sppo_hard": lambda: ((c - rc) - 1 / (2 * beta)) ** 2 + ((r - rr) + 1 / (2 * beta)) ** 2,
            "apo_zero": lambda: (1 - sig(cr)) + sig(rrw),
            "apo_down": lambda: sig(cr) + (1 - sig(u)),
            "discopop": lambda: -logsig(u) * (1 - sig(u / tau)) + torch.exp(-u) * sig(u / tau),
        }[kind]()
    return f


def _reference(kind, h, w, b, t, opts, ref=None):
    """float64 (loss, aux, grads of h, w, b) of one loss, from the full logits."""
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    n = h.shape[0] // 2
    average = {"dpo": opts.get("average_log_prob", False), "orpo": True, "simpo": True,
               "cpo": opts.get("average_log_prob", False)}[kind]
    seq, tok, mask, logits = _logps(hd, wd, bd, t, average)
    c, r = seq[:n], seq[n:]
    nll_on = opts.get("compute_nll_loss", kind != "dpo")
    nll = -tok[:n].sum() / mask[:n].sum() if nll_on else hd.new_zeros(())
    nll_pairs = -tok[:n].sum(-1) / mask[:n].sum() if nll_on else hd.new_zeros(n)
    beta, alpha = opts.get("beta", 0.1), opts.get("alpha", 1.0)
    ls = opts.get("label_smoothing", 0.0)
    if kind == "dpo":
        if ref is None:
            rc = rr = hd.new_zeros(n)
        else:
            rseq, *_ = _logps(ref[0].double(), ref[1].double(), None, t, average)
            rc, rr = rseq[:n], rseq[n:]
        pair = _dpo_ref(opts.get("loss_type", "sigmoid"), beta, ls, opts.get("discopop_tau", 0.05))(c, r, rc, rr)
        aux = [beta * (c - rc), beta * (r - rr)]
    elif kind == "orpo":
        odds = lambda x: x - torch.log(1 - torch.exp(x))  # noqa: E731  log(p / (1 - p))
        pair = -beta * TF.logsigmoid(odds(c) - odds(r))
        aux = [beta * c, beta * r, TF.logsigmoid(odds(c) - odds(r)).mean(), (odds(c) - odds(r)).mean()]
    else:
        gamma = opts.get("gamma", 0.5) if kind == "simpo" else 0.0
        u = beta * (c - r) - gamma
        pair = -(1 - ls) * TF.logsigmoid(u) - ls * TF.logsigmoid(-u)
        aux = [beta * c, beta * r]
    red = opts.get("reduction", "mean")
    if red == "none":
        loss = alpha * nll_pairs + pair
    else:
        loss = alpha * nll + (pair.sum() if red == "sum" else pair.mean())
    loss.backward(torch.ones_like(loss) if red != "none" else torch.linspace(0.5, 1.5, n, dtype=torch.float64))
    means = [logits[:n].mean(), logits[n:].mean()]
    outs = [c, r, *means, nll, *aux]
    return loss.detach(), [o.detach() for o in outs], (hd.grad, wd.grad, None if bd is None else bd.grad)


FUNCTIONS = {
    "dpo": C.fused_linear_dpo_loss, "orpo": C.fused_linear_orpo_loss,
    "simpo": C.fused_linear_simpo_loss, "cpo": C.fused_linear_cpo_loss,
}


def _ours(kind, h, w, b, t, opts, ref=None):
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    bl = None if b is None else b.clone().requires_grad_()
    kw = dict(opts)
    if kind == "dpo":
        kw.update(ref_input=ref[0], ref_weight=ref[1]) if ref is not None else kw.update(use_ref_model=False)
    loss, aux = FUNCTIONS[kind](hl, wl, t, bl, **kw)
    n = h.shape[0] // 2
    red = opts.get("reduction", "mean")
    loss.backward(torch.ones_like(loss) if red != "none" else torch.linspace(0.5, 1.5, n, dtype=loss.dtype))
    return loss, list(aux), (hl.grad, wl.grad, None if bl is None else bl.grad)


def _compare(kind, h, w, b, t, opts, dtype, ref=None):
    want_loss, want_aux, want_grads = _reference(kind, h, w, b, t, opts, ref)
    loss, aux, grads = _ours(kind, h, w, b, t, opts, ref)
    tol = TOL[dtype]
    assert rel_err(loss, want_loss) <= tol, (loss, want_loss)
    assert len(aux) == len(want_aux)
    for i, (a, e) in enumerate(zip(aux, want_aux)):
        assert rel_err(a, e) <= tol, (i, a, e)
    for name, g, e in zip("hwb", grads, want_grads):
        if e is None:
            assert g is None
        else:
            assert g.dtype == dtype and rel_err(g, e) <= tol, (name, rel_err(g, e))


CASES = [
    ("dpo", {}), ("dpo", {"compute_nll_loss": True, "average_log_prob": True, "alpha": 0.5, "beta": 0.3}),
    ("orpo", {"beta": 0.2}), ("simpo", {"beta": 2.0, "gamma": 0.3, "label_smoothing": 0.1, "alpha": 0.7}),
    ("cpo", {"beta": 0.5, "label_smoothing": 0.2}), ("cpo", {"average_log_prob": True, "compute_nll_loss": False}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind,opts", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_matches_reference(kind, opts, bias, dtype):
    h, w, b, t, rh, rw = _inputs(dtype=dtype, bias=bias, seed=len(opts), empty=kind != "orpo")
    _compare(kind, h, w, b, t, opts, dtype, ref=(rh, rw) if kind == "dpo" else None)


@pytest.mark.parametrize("loss_type", C.DPO_LOSS_TYPES)
def test_dpo_loss_types(loss_type):
    ls = {"exo_pair": 1e-3, "robust": 0.2}.get(loss_type, 0.0)
    h, w, b, t, rh, rw = _inputs(seed=3)
    opts = {"loss_type": loss_type, "label_smoothing": ls, "beta": 0.5}
    if loss_type == "discopop":
        opts["discopop_tau"] = 0.2  # not the default (0.05): a tau ignored shows
    _compare("dpo", h, w, b, t, opts, torch.float32, ref=(rh, rw))


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_reductions(kind, reduction):
    """Each reduction against float64, with an NLL term weighted by alpha != 1 (ORPO has no alpha);
    "none" sums to "sum"."""
    h, w, b, t, rh, rw = _inputs(seed=5, empty=kind != "orpo")
    alpha = {} if kind == "orpo" else {"alpha": 0.5}
    opts = {"reduction": reduction, "compute_nll_loss": True, **alpha}
    _compare(kind, h, w, b, t, opts, torch.float32, ref=(rh, rw) if kind == "dpo" else None)
    loss_none = FUNCTIONS[kind](h, w, t, b, **opts, **({"use_ref_model": False} if kind == "dpo" else {}))[0]
    loss_sum = FUNCTIONS[kind](h, w, t, b, compute_nll_loss=True, **alpha, reduction="sum",
                               **({"use_ref_model": False} if kind == "dpo" else {}))[0]
    if reduction == "none":
        assert loss_none.shape == (h.shape[0] // 2,)
        assert rel_err(loss_none.sum(), loss_sum) <= 1e-6  # one loss per pair, summing to "sum"


def test_dpo_ref_logps_equal_ref_model():
    """Precomputed reference log-probabilities give what the reference head gives."""
    h, w, b, t, rh, rw = _inputs(seed=7)
    by_model = C.fused_linear_dpo_loss(h, w, t, b, ref_input=rh, ref_weight=rw)[0]
    seq, *_ = _logps(rh, rw, None, t, False)
    n = h.shape[0] // 2
    by_logps = C.fused_linear_dpo_loss(h, w, t, b, ref_logps=(seq[:n].float(), seq[n:].float()))[0]
    assert rel_err(by_logps, by_model) <= 1e-6


def test_orpo_nll_target():
    """ORPO's NLL term on other targets than the preference term's."""
    h, w, b, t, _, _ = _inputs(seed=9, empty=False)
    n = h.shape[0] // 2
    nll_t = t.clone()
    nll_t[:n, 3] = IGNORE
    loss, aux = C.fused_linear_orpo_loss(h, w, t, b, nll_target=nll_t)
    seq, tok, mask, _ = _logps(h, w, b, nll_t, True)
    assert rel_err(aux[4], -tok[:n].sum() / mask[:n].sum()) <= 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90", "rocm-gfx942", "xpu-xe-hpc"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
def test_kernel_interpreter(simulated_device, dtype):
    """The kernel path (the fused linear cross-entropy's Triton kernels, each vendor's configs)."""
    h, w, b, t, rh, rw = _inputs(dtype=dtype, seed=11)
    _compare("dpo", h, w, b, t, {"compute_nll_loss": True}, dtype, ref=(rh, rw))
    _compare("simpo", h, w, b, t, {"reduction": "none"}, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90", "rocm-gfx942", "xpu-xe-hpc"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
@pytest.mark.parametrize("pairs", [1, 2, None], ids=["1-pair-chunks", "2-pair-chunks", "default"])
def test_kernel_interpreter_single_pass(simulated_device, dtype, pairs, monkeypatch):
    """Scalar losses on the kernels take the one-pass path (three products: each chunk of whole pairs
    gives its tokens their factors while its logits are held), in chunks of one pair, of two (the
    last chunk partial) and the default; every paired loss, both reductions, against float64."""
    calls = _spy_one_pass(monkeypatch, pairs)
    for kind, opts in [("dpo", {"compute_nll_loss": True, "average_log_prob": True}), ("orpo", {"reduction": "sum"}),
                       ("simpo", {"alpha": 0.5}), ("cpo", {"label_smoothing": 0.1})]:
        # an empty completion (all padding) except for ORPO, whose loss is infinite then
        h, w, b, t, rh, rw = _inputs(dtype=dtype, seed=23, empty=kind != "orpo")
        _compare(kind, h, w, b, t, opts, dtype, ref=(rh, rw) if kind == "dpo" else None)
    assert calls == [{1: 3, 2: 2, None: 1}[pairs]] * 4  # one pass per loss, in that many chunks


def test_modules_follow_liger_kernel():
    """liger-kernel's class names, constructor defaults and forward order (lin_weight first)."""
    h, w, b, t, rh, rw = _inputs(seed=13)
    pairs = [
        (lnn.LigerFusedLinearDPOLoss(), lambda m: m(w, h, t, b, rh, rw), lambda: C.fused_linear_dpo_loss(h, w, t, b, ref_input=rh, ref_weight=rw)),
        (lnn.LigerFusedLinearORPOLoss(), lambda m: m(w, h, t, b), lambda: C.fused_linear_orpo_loss(h, w, t, b)),
        (lnn.LigerFusedLinearSimPOLoss(), lambda m: m(w, h, t, b), lambda: C.fused_linear_simpo_loss(h, w, t, b)),
        (lnn.LigerFusedLinearCPOLoss(), lambda m: m(w, h, t, b), lambda: C.fused_linear_cpo_loss(h, w, t, b)),
    ]
    for module, call, fn in pairs:
        got, want = call(module), fn()
        assert torch.equal(got[0], want[0]) and all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
    dpo = lnn.LigerFusedLinearDPOLoss()
    assert (dpo.beta, dpo.alpha, dpo.compute_nll_loss, dpo.use_ref_model, dpo.average_log_prob) == (0.1, 1.0, False, True, False)
    assert lnn.LigerFusedLinearSimPOLoss().gamma == 0.5


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda h, w, t: C.fused_linear_dpo_loss(h[:3], w, t[:3]), "as many rejected"),
        (lambda h, w, t: C.fused_linear_dpo_loss(h, w, t[:, :4]), "target must have shape"),
        (lambda h, w, t: C.fused_linear_dpo_loss(h.reshape(-1, h.shape[-1]), w, t), r"\(2B, T, H\)"),
        (lambda h, w, t: C.fused_linear_dpo_loss(h, w, t), "ref_input and ref_weight"),
        (lambda h, w, t: C.fused_linear_dpo_loss(h, w, t, use_ref_model=False, loss_type="kto"), "loss_type"),
        (lambda h, w, t: C.fused_linear_dpo_loss(h, w, t, use_ref_model=False, loss_type="exo_pair"), "exo_pair"),
        (lambda h, w, t: C.fused_linear_cpo_loss(h, w, t, reduction="avg"), "reduction"),
        (lambda h, w, t: C.fused_linear_simpo_loss(h, w, t, label_smoothing=0.7), "label_smoothing"),
        (lambda h, w, t: C.fused_linear_orpo_loss(h, w, t, beta=float("nan")), "beta"),
        (lambda h, w, t: C.fused_linear_orpo_loss(h, w.double(), t), "dtype"),
    ],
)
def test_errors_name_the_argument(call, match):
    h, w, _, t, _, _ = _inputs(B=2)
    with pytest.raises((ValueError, TypeError), match=match):
        call(h, w, t)


def test_reference_head_and_ref_logps_errors_name_the_argument():
    """The reference head is checked against the policy's (one vocabulary) and its errors name it;
    a label smoothing that the loss type does not read warns."""
    h, w, b, t, rh, rw = _inputs(B=2)
    for kwargs, match in [
        ({"ref_weight": torch.cat([rw, rw[:5]])}, r"ref_weight must have shape \(37, 16\)"),  # a larger vocabulary
        ({"ref_weight": rw[:20]}, r"ref_weight must have shape \(37, 16\)"),
        ({"ref_input": rh[:2]}, r"ref_input must have shape \(4, 9, 'H_ref'\)"),
        ({"ref_bias": torch.zeros(36)}, "ref_bias must be None or have shape"),
        ({"ref_weight": rw.double()}, r"the reference head \(ref_input, ref_weight, ref_bias\): .*dtype"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            C.fused_linear_dpo_loss(h, w, t, **{"ref_input": rh, "ref_weight": rw, **kwargs})
    with pytest.raises(ValueError, match="ref_logps must be"):
        C.fused_linear_dpo_loss(h, w, t, ref_logps=([0.0, 0.0], [0.0, 0.0]))
    with pytest.raises(ValueError, match="^target holds 99"):  # the policy's labels: no reference-head prefix
        C.fused_linear_dpo_loss(h, w, t.masked_fill(t == t.max(), 99), ref_input=rh, ref_weight=rw)
    with pytest.warns(UserWarning, match="no effect with loss_type='sigmoid'") as rec:
        C.fused_linear_dpo_loss(h, w, t, use_ref_model=False, label_smoothing=0.1)
    assert rec[0].filename == __file__  # the caller's line, not ours
    with pytest.warns(UserWarning, match="no effect with loss_type='sigmoid'") as rec:
        line = sys._getframe().f_lineno + 1
        C.LigerFusedLinearDPOLoss(use_ref_model=False, label_smoothing=0.1)(w, h, t)
    assert (rec[0].filename, rec[0].lineno) == (__file__, line)  # through torch's Module.__call__ too


def test_kto_and_grpo_errors_name_the_argument():
    h, w, b, t, rh, rw = _inputs(B=2)
    labels = torch.tensor([True, False, True, False])
    scalar = C.fused_linear_kto_loss(h, w, t, preference_labels=labels, kl=torch.tensor(0.3))[0]
    assert torch.equal(C.fused_linear_kto_loss(h, w, t, preference_labels=labels, kl=0.3)[0], scalar)
    assert torch.equal(C.fused_linear_kto_loss(h, w, t, preference_labels=labels, kl=torch.tensor([0.3]))[0], scalar)
    for kwargs, match in [
        ({"kl": torch.zeros(4, 1)}, r"kl must be .* shape \(4,\)"),
        ({"kl": torch.zeros(3)}, r"kl must be"),
        ({"kl": "0.1"}, "kl must be a number"),
        ({"use_ref_model": True, "ref_input": rh[:2], "ref_weight": rw}, "ref_input must have shape"),
        ({"use_ref_model": True, "ref_logps": [0.0] * 4}, "ref_logps must be a tensor"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            C.fused_linear_kto_loss(h, w, t, preference_labels=labels, **kwargs)
    h, w, b, ids, mask, adv, old, ref = _grpo_inputs(torch.float32)
    for kwargs, match in [
        ({"old_per_token_logps": old[:, :1]}, r"old_per_token_logps must have shape \(5, 11\)"),
        ({"old_per_token_logps": old[0]}, "old_per_token_logps must have shape"),
        ({"ref_per_token_logps": ref[:1]}, r"ref_per_token_logps must have shape \(5, 11\)"),
        ({"ref_per_token_logps": None, "ref_input": h, "ref_weight": w[:, :8]}, "ref_weight must have shape"),
        ({"delta": 0.0}, "delta must be positive"),
        ({"delta": -1.0}, "delta must be positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            C.fused_linear_grpo_loss(h, w, ids, mask, adv, b, **{"ref_per_token_logps": ref, **kwargs})


def test_kto_reductions():
    """KTO's ``sum`` is B times its ``mean`` and ``none`` gives each sequence's loss, in float64."""
    h, w, b, t, rh, rw = _inputs(B=2, dtype=torch.float64)
    labels = torch.tensor([True, False, False, True])
    kw = dict(preference_labels=labels, kl=torch.tensor([0.3, -0.2, 0.1, 0.0], dtype=torch.float64))
    mean = C.fused_linear_kto_loss(h, w, t, b, **kw)[0]
    total = C.fused_linear_kto_loss(h, w, t, b, reduction="sum", **kw)[0]
    each = C.fused_linear_kto_loss(h, w, t, b, reduction="none", **kw)[0]
    assert each.shape == (4,) and rel_err(total, 4 * mean) <= 1e-12 and rel_err(each.sum(), total) <= 1e-12


def test_orpo_log_odds_exact_near_zero():
    """ORPO's ``log(1 - exp(x))`` of a mean log-probability near 0 (a near-certain completion) is
    exact in float32 (``log1p(-exp(x))`` rounds ``exp(x)`` first: 0.1% off at -1e-5)."""
    chosen = torch.tensor([-1e-5, -3e-3, -0.7])
    rejected = torch.tensor([-2.0, -1e-6, -0.9])
    log_odds = C.orpo_pair_losses(chosen, rejected, 0.1)[4]
    c, r = chosen.double(), rejected.double()
    want = ((c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))).mean()
    assert rel_err(log_odds, want) <= 1e-6, (log_odds, want)


class _TinyLM(torch.nn.Module):
    def __init__(self, V=41, H=24, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g) * 0.5)
        self.mix = torch.nn.Parameter(torch.randn(H, H, generator=g) / H**0.5)
        self.head = torch.nn.Parameter(torch.randn(V, H, generator=g) / H**0.5)

    def hidden(self, ids):
        return torch.tanh(self.emb[ids] @ self.mix)


def test_dpo_training_matches_unfused():
    """Ten DPO steps of a tiny model: the fused loss gives the unfused loss's curve (float32), and the
    loss falls."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 41, (8, 12), generator=g)
    target = ids.roll(-1, dims=1)
    target[:, :4] = IGNORE
    target[:, -1] = IGNORE
    ref_model = _TinyLM(seed=2)
    curves = []
    for fused in (True, False):
        model = _TinyLM(seed=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(10):
            h = model.hidden(ids)
            with torch.no_grad():
                ref_h = ref_model.hidden(ids)
            if fused:
                loss = lnn.LigerFusedLinearDPOLoss(beta=0.5)(model.head, h, target, None, ref_h, ref_model.head)[0]
            else:
                def seq_logps(hh, w):
                    logp = torch.log_softmax(hh @ w.T, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                    return (logp * (target != IGNORE)).sum(-1)
                c = seq_logps(h, model.head)
                with torch.no_grad():
                    rc = seq_logps(ref_h, ref_model.head)
                u = 0.5 * ((c[:4] - rc[:4]) - (c[4:] - rc[4:]))
                loss = -TF.logsigmoid(u).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    assert max(abs(a - b) for a, b in zip(*curves)) <= 1e-5 * abs(curves[1][0])
    assert curves[0][-1] < 0.5 * curves[0][0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_gpu(kind, dtype, monkeypatch):
    """Every paired loss on the GPU at a vocabulary above 65536: fp32 and bf16 take the one pass (in
    chunks of two pairs here), fp16 the two-pass path."""
    dev = torch.device(liger_portable.platform().torch_device_type, 0)
    calls = _spy_one_pass(monkeypatch, 2)
    h, w, b, t, rh, rw = _inputs(B=4, T=301, H=96, V=70001, dtype=dtype, seed=17, device=dev, empty=kind != "orpo")
    _compare(kind, h, w, b, t, {}, dtype, ref=(rh, rw) if kind == "dpo" else None)
    assert calls == ([] if dtype == torch.float16 else [2])


# --------------------------------------------------------------------------- KTO and GRPO


def _leaves(h, w, b):
    return (h.detach().double().requires_grad_(), w.detach().double().requires_grad_(),
            None if b is None else b.detach().double().requires_grad_())


def _on(device, *tensors):
    """The tensors on ``device`` (None stays None)."""
    return [None if x is None else x.to(device) for x in tensors]


def _leaves_on(device, *tensors):
    """Copies of the tensors on ``device``, as leaves that need gradients."""
    return [x.to(device, copy=True).requires_grad_() for x in tensors]


def _check(loss, aux, leaves, want_loss, want_aux, want_leaves, dtype, aux_scale=None):
    """``aux_scale``: per aux figure that is a sum of signed per-sequence terms, the sum of their
    magnitudes: each term is off by its own relative error (a bf16 head's log-probabilities by about
    2**-9 of the logits), so the sum is checked against that scale, not against a sum that may cancel."""
    tol = TOL[dtype]
    assert rel_err(loss, want_loss) <= tol, (loss, want_loss)
    assert len(aux) == len(want_aux)
    for i, (a, e) in enumerate(zip(aux, want_aux)):
        if aux_scale is not None:
            assert abs(float(a) - float(e)) <= tol * float(aux_scale[i]), (i, a, e, aux_scale[i])
        else:
            assert rel_err(a, e) <= tol or (e.abs() < 1e-12 and a.abs() < 1e-6), (i, a, e)
    for name, g, e in zip("hwb", [x.grad for x in leaves if x is not None], [x.grad for x in want_leaves if x is not None]):
        assert g.dtype == dtype and rel_err(g, e) <= tol, (name, rel_err(g, e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
@pytest.mark.parametrize("use_ref", [False, True], ids=["noref", "ref"])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("per_sequence_kl", [False, True], ids=["kl", "kl-per-sequence"])
def test_kto_matches_reference(use_ref, average, dtype, per_sequence_kl, device="cpu"):
    """KTO from float64 logits, ``kl`` one number or one per sequence (liger-kernel's ``(B,)``);
    ``device``: where our loss runs (the reference runs on the CPU)."""
    h, w, b, t, rh, rw = _inputs(dtype=dtype, seed=21)
    n = h.shape[0]
    labels = torch.tensor([True, False, True, True, False, False])
    kl = torch.tensor([0.2, -1.5, 0.9, 2.0, 0.1, -0.4]) if per_sequence_kl else torch.tensor(0.2)
    hd, wd, bd = _leaves(h, w, b)
    seq, tok, mask, logits = _logps(hd, wd, bd, t, average)
    ref_seq = _logps(rh.double(), rw.double(), None, t, average)[0] if use_ref else torch.zeros_like(seq)
    ratio = seq - ref_seq
    sign = labels.double() * 2 - 1
    want = (1 - torch.sigmoid(0.1 * (ratio - kl) * sign)).sum() / n
    want.backward()
    per_seq_logits = logits.sum((-1, -2))
    want_aux = [(seq * labels).sum(), (seq * ~labels).sum(), (per_seq_logits * labels).sum(),
                (per_seq_logits * ~labels).sum(), (0.1 * ratio * labels).sum(), (0.1 * ratio * ~labels).sum()]
    # a reward is a difference of the policy's and the reference's log-probabilities, each off by its own error
    terms = [seq, seq, per_seq_logits, per_seq_logits, 0.1 * (seq.abs() + ref_seq.abs()), 0.1 * (seq.abs() + ref_seq.abs())]
    scale = [(x.abs() * (labels if i % 2 == 0 else ~labels)).sum().detach() for i, x in enumerate(terms)]
    hl, wl, bl = _leaves_on(device, h, w, b)
    loss, aux = lnn.LigerFusedLinearKTOLoss(beta=0.1, use_ref_model=use_ref, average_log_prob=average)(
        hl, wl, *_on(device, t), bl, *_on(device, labels, rh, rw), None, *_on(device, kl))
    loss.backward()
    _check(loss, aux, (hl, wl, bl), want.detach(), [a.detach() for a in want_aux], (hd, wd, bd), dtype, scale)


def _spy_one_pass(monkeypatch, groups):
    """Groups per chunk of the one-pass path set to ``groups``; returns the list of each one-pass
    call's chunk count."""
    from liger_portable.ops import fused_linear_cross_entropy as flce_ops

    monkeypatch.setattr(C, "GROUPS_PER_CHUNK", groups)
    calls = []
    real = flce_ops.flce_fwd_factors
    monkeypatch.setattr(flce_ops, "flce_fwd_factors", lambda *a, **k: calls.append(len(a[5])) or real(*a, **k))
    return calls


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90", "rocm-gfx942", "xpu-xe-hpc"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
def test_kto_kernel_interpreter_one_pass(simulated_device, dtype, monkeypatch):
    """KTO on the kernels takes the one-pass path (chunks of whole sequences: 4 of 6 sequences, then 2;
    then one a chunk), a per-sequence ``kl`` taken per chunk."""
    calls = _spy_one_pass(monkeypatch, 4)
    test_kto_matches_reference(True, True, dtype, False)
    test_kto_matches_reference(False, False, dtype, False)
    test_kto_matches_reference(True, False, dtype, True)
    monkeypatch.setattr(C, "GROUPS_PER_CHUNK", 1)
    test_kto_matches_reference(False, True, dtype, True)
    assert calls == [2, 2, 2, 6]


def _grpo_inputs(dtype, B=5, T=11, H=16, V=53, seed=31):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).to(dtype)
    # Logits of standard deviation about 0.7 after the temperature. A bf16 head's logits are off by
    # about 2**-9 of their size, and GRPO's ratio exponentiates each token's log-probability error
    # into its gradient: with logits of deviation 2.9 (weights 2 / sqrt(H)) a token's log-probability
    # was 0.013 off and the gradient of hidden 1.2% off the float64 one (the fused cross-entropy's own
    # gradient of hidden: 0.3%), in any bf16 implementation.
    w = (torch.randn(V, H, generator=g) * 0.5 / H**0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    for row in range(B):
        mask[row, int(torch.randint(2, T + 1, (1,), generator=g)):] = 0
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 6  # far enough from the policy for some clipping
    ref = -torch.rand(B, T, generator=g) * 5
    return h, w, b, ids, mask, adv, old, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_matches_reference(loss_type, level, dtype, device="cpu"):
    """TRL's GRPO loss written out again from float64 logits divided by the temperature. The
    temperature divides hidden and bias in their dtype (documented): the reference starts from
    those rounded quotients, and chains their gradients back to hidden and bias."""
    h, w, b, ids, mask, adv, old, ref = _grpo_inputs(dtype)
    B, T = ids.shape
    tau, beta, lo, hi = 0.7, 0.1, 0.2, 0.28
    hd, wd, bd = _leaves(h / tau, w, b / tau)
    logp = torch.log_softmax(hd @ wd.T + bd, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    # The old policy's log-probabilities put each sequence's ratio at e**offset, away from the clip
    # bounds 0.8 and 1.28 (a token at a bound switches branch with a rounding: its gradient jumps),
    # clipped below, inside, and above; the advantages' signs make two of them count as clipped.
    offsets = torch.tensor([-0.5, -0.5, -0.05, 0.12, 0.5], dtype=torch.float64)[:, None]
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.8])
    old = (logp.detach() - offsets).float()
    lr = logp - old.double()
    m = mask.double()
    if level == "sequence":
        lr = ((lr * m).sum(-1) / m.sum(-1)).unsqueeze(-1)
    ratio = torch.exp(lr)
    a = adv.double().unsqueeze(1)
    kl = torch.exp(ref.double() - logp) - (ref.double() - logp) - 1
    per = -torch.min(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a) + beta * kl
    want = {
        "grpo": lambda: ((per * m).sum(-1) / m.sum(-1)).mean(),
        "bnpo": lambda: (per * m).sum() / m.sum(),
        "dr_grpo": lambda: (per * m).sum() / (B * 2 * T),  # max_completion_length 2T: not the padded length
        "dapo": lambda: (per * m).sum() / m.sum(),
    }[loss_type]()
    want.backward()
    clipped = (((ratio < 1 - lo) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))).expand_as(m)
    want_aux = [(kl * m).sum() / m.sum(), (clipped * m).sum() / m.sum()]
    assert 0 < want_aux[1] < 1  # the inputs exercise the clipping
    hl, wl, bl = _leaves_on(device, h, w, b)
    module = lnn.LigerFusedLinearGRPOLoss(beta=beta, epsilon_low=lo, epsilon_high=hi, loss_type=loss_type,
                                          max_completion_length=2 * T, importance_sampling_level=level, temperature=tau)
    loss, aux = module(hl, wl, *_on(device, ids, mask, adv), bl, *_on(device, ref, old))
    loss.backward()
    hd.grad, bd.grad = hd.grad / tau, bd.grad / tau  # d/dh = d/d(h / tau) / tau
    _check(loss, aux, (hl, wl, bl), want.detach(), [x.detach() for x in want_aux], (hd, wd, bd), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_grpo_other_loss_types_match_reference(loss_type, dtype, device="cpu"):
    """CISPO, SAPO, LUSPO and VESPO as TRL writes them, from float64 logits; SAPO with the sampler's
    per-token importance ratio and the bias-corrected KL, VESPO with a per-sequence one."""
    h, w, b, ids, mask, adv, old, ref = _grpo_inputs(dtype)
    B, T = ids.shape
    beta, lo, hi = 0.1, 0.2, 0.28
    hd, wd, bd = _leaves(h, w, b)
    logp = torch.log_softmax(hd @ wd.T + bd, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    offsets = torch.tensor([-0.5, -0.5, -0.05, 0.12, 0.5], dtype=torch.float64)[:, None]  # away from the bounds
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.8])
    old = (logp.detach() - offsets).float()
    ratio = torch.exp(logp - old.double())
    a, m = adv.double().unsqueeze(1), mask.double()
    kl = torch.exp(ref.double() - logp) - (ref.double() - logp) - 1
    g = torch.Generator().manual_seed(5)
    is_ratio = {"sapo": 0.5 + torch.rand(B, T, generator=g), "vespo": 0.5 + torch.rand(B, 1, generator=g)}.get(loss_type)
    clipped = torch.zeros_like(m, dtype=torch.bool)
    if loss_type == "cispo":  # MiniMax-M1: the clipped ratio, detached, weighs the log-probability
        per = -ratio.clamp(max=hi).detach() * a * logp
        clipped = (ratio > hi) & (a > 0)
    elif loss_type == "sapo":  # a soft gate instead of the clip, one temperature per advantage sign
        tau = torch.where(a > 0, 1.0, 1.05).double()
        per = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * a * is_ratio.double()
    elif loss_type == "luspo":
        per = -torch.min(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
        clipped = ((ratio < 1 - lo) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))
    else:  # vespo: the detached gamma weight of the sequence's ratio (sampler's ratio folded in)
        log_w = ((logp.detach() - old.double()).clamp(-20, 20) * m).sum(-1, keepdim=True)
        log_w = (log_w + is_ratio.double().log().clamp(math.log(1e-8), 20).sum(-1, keepdim=True)).clamp(math.log(1e-8), 20)
        k, lam = torch.where(a >= 0, 2.0, 3.0).double(), torch.where(a >= 0, 3.0, 2.0).double()
        per = -torch.exp(lam + k * log_w - lam * log_w.exp()) * a * logp
    kl_term = kl * ratio if loss_type == "sapo" else kl  # sapo: with the bias-corrected KL
    per = per + beta * kl_term
    want = {
        "cispo": lambda: (per * m).sum() / m.sum(),
        "sapo": lambda: ((per * m).sum(-1) / m.sum(-1)).mean(),
        "luspo": lambda: (per * m.sum(-1, keepdim=True)).sum() / (B * T),
        "vespo": lambda: (per * m).sum() / m.sum(),
    }[loss_type]()
    want.backward()
    want_aux = [(kl_term * m).sum() / m.sum(), (clipped * m).sum() / m.sum()]
    hl, wl, bl = _leaves_on(device, h, w, b)
    module = lnn.LigerFusedLinearGRPOLoss(beta=beta, epsilon_low=lo, epsilon_high=hi, loss_type=loss_type,
                                          use_bias_correction_kl=loss_type == "sapo")
    loss, aux = module(hl, wl, *_on(device, ids, mask, adv), bl, *_on(device, ref, old), None, None, None,
                       *_on(device, is_ratio))
    loss.backward()
    _check(loss, aux, (hl, wl, bl), want.detach(), [x.detach() for x in want_aux], (hd, wd, bd), dtype)
    with pytest.raises(ValueError, match="token-level"):
        C.fused_linear_grpo_loss(h, w, ids, mask, adv, beta=0.0, loss_type="sapo", importance_sampling_level="sequence")


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_luspo_is_trls_mean(level, beta, device="cpu"):
    """LUSPO exactly as TRL computes it, ``(per_token_loss * mask.sum(1, keepdim=True)).mean()``: per
    token the mean runs over B x T; with sequence-level ratios and no KL term the loss is one per
    sequence, (B, 1), and the mean runs over B (the case that was off by a factor of T)."""
    h, w, b, ids, mask, adv, old, ref = _grpo_inputs(torch.float32)
    lo, hi = 0.2, 0.28
    hd, wd, bd = _leaves(h, w, b)
    logp = torch.log_softmax(hd @ wd.T + bd, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    offsets = torch.tensor([-0.5, -0.5, -0.05, 0.12, 0.5], dtype=torch.float64)[:, None]  # away from the bounds
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.8])
    old = (logp.detach() - offsets).float()
    m = mask.double()
    lr = logp - old.double()
    if level == "sequence":
        lr = ((lr * m).sum(-1) / m.sum(-1)).unsqueeze(-1)
    ratio, a = torch.exp(lr), adv.double().unsqueeze(1)
    per = -torch.min(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
    if beta:
        per = per + beta * (torch.exp(ref.double() - logp) - (ref.double() - logp) - 1)
    assert per.shape[-1] == (1 if level == "sequence" and not beta else ids.shape[1])
    want = (per * m.sum(1, keepdim=True)).mean()
    want.backward()
    hl, wl, bl = _leaves_on(device, h, w, b)
    ids, mask, adv, ref, old = _on(device, ids, mask, adv, ref, old)
    loss, _ = C.fused_linear_grpo_loss(hl, wl, ids, mask, adv, bl, beta=beta, epsilon_low=lo, epsilon_high=hi,
                                       loss_type="luspo", importance_sampling_level=level,
                                       ref_per_token_logps=ref if beta else None, old_per_token_logps=old)
    loss.backward()
    assert rel_err(loss, want) <= 1e-5, (loss.item(), want.item())
    for got, ref_leaf in ((hl, hd), (wl, wd), (bl, bd)):
        assert rel_err(got.grad, ref_leaf.grad) <= 1e-5


def test_grpo_delta_clamps_the_unclipped_ratio():
    """INTELLECT-2's ``delta`` against the loss written out in float64: the unclipped ratio is
    clamped at delta, so a negative-advantage sequence whose ratio exceeds delta contributes
    ``-delta * A`` with no gradient (one below it keeps ``-ratio * A``), and a positive-advantage one
    stays clipped at 1 + epsilon_high."""
    h, w, b, ids, mask, adv, old, _ = _grpo_inputs(torch.float32)
    lo, hi, delta = 0.2, 0.28, 1.5
    hd, wd, bd = _leaves(h, w, b)
    logp = torch.log_softmax(hd @ wd.T + bd, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    # ratios 1.82 (above delta: clamped where A < 0), 1.42 (between 1 + hi and delta), 0.95, 0.61
    offsets = torch.tensor([0.6, 0.6, -0.05, 0.35, -0.5], dtype=torch.float64)[:, None]
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.8])
    old = (logp.detach() - offsets).float()
    m = mask.double()
    ratio, a = torch.exp(logp - old.double()), adv.double().unsqueeze(1)
    per = -torch.min(ratio.clamp(max=delta) * a, ratio.clamp(1 - lo, 1 + hi) * a)
    want = ((per * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / ids.shape[0]
    want.backward()
    hl, wl, bl = _leaves_on("cpu", h, w, b)
    loss, _ = C.fused_linear_grpo_loss(hl, wl, ids, mask, adv, bl, beta=0.0, epsilon_low=lo, epsilon_high=hi,
                                       loss_type="grpo", old_per_token_logps=old, delta=delta)
    loss.backward()
    assert rel_err(loss, want) <= 1e-5, (loss.item(), want.item())
    for got, ref_leaf in ((hl, hd), (wl, wd), (bl, bd)):
        assert rel_err(got.grad, ref_leaf.grad) <= 1e-5
    # delta mattered: without it the clamped sequence weighs -ratio * A (a larger loss)
    free, _ = C.fused_linear_grpo_loss(h, w, ids, mask, adv, b, beta=0.0, epsilon_low=lo, epsilon_high=hi,
                                       loss_type="grpo", old_per_token_logps=old)
    assert free.item() > loss.item() + 1e-3


def test_grpo_sampler_ratio_per_sequence_shapes():
    """The sampler's importance ratio per sequence may come as (B, 1) or (B,) (liger-kernel takes
    both): the same loss; another shape is refused, naming the argument."""
    h, w, b, ids, mask, adv, old, _ = _grpo_inputs(torch.float32)
    B, T = ids.shape
    ratio = 0.5 + torch.rand(B, generator=torch.Generator().manual_seed(3))
    kw = dict(beta=0.0, old_per_token_logps=old, loss_type="grpo")
    col = C.fused_linear_grpo_loss(h, w, ids, mask, adv, b, vllm_is_ratio=ratio[:, None], **kw)
    flat = C.fused_linear_grpo_loss(h, w, ids, mask, adv, b, vllm_is_ratio=ratio, **kw)
    none = C.fused_linear_grpo_loss(h, w, ids, mask, adv, b, **kw)
    assert torch.equal(col[0], flat[0]) and not torch.equal(col[0], none[0])
    with pytest.raises(ValueError, match=r"vllm_is_ratio must have shape"):
        C.fused_linear_grpo_loss(h, w, ids, mask, adv, b, vllm_is_ratio=ratio[:-1], **kw)


def test_grpo_reference_model_and_no_kl():
    """The reference's per-token log-probabilities from its head equal passing them; beta=0 drops
    the KL metric; delta clamps the unclipped ratio."""
    h, w, b, ids, mask, adv, old, _ = _grpo_inputs(torch.float32)
    rh, rw = h + 0.3, w * 1.1
    ref = -TF.cross_entropy((rh @ rw.T).transpose(1, 2), ids, reduction="none")
    by_model = C.fused_linear_grpo_loss(h, w, ids, mask, adv, ref_input=rh, ref_weight=rw, old_per_token_logps=old)
    by_logps = C.fused_linear_grpo_loss(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
    assert rel_err(by_model[0], by_logps[0]) <= 1e-6 and rel_err(by_model[1][0], by_logps[1][0]) <= 1e-6
    # the temperature divides the reference's logits too (its hidden, in its dtype, as the policy's)
    ref_t = -TF.cross_entropy(((rh / 0.7) @ rw.T).transpose(1, 2), ids, reduction="none")
    by_model = C.fused_linear_grpo_loss(h, w, ids, mask, adv, ref_input=rh, ref_weight=rw, old_per_token_logps=old,
                                        temperature=0.7)
    by_logps = C.fused_linear_grpo_loss(h, w, ids, mask, adv, ref_per_token_logps=ref_t, old_per_token_logps=old,
                                        temperature=0.7)
    assert rel_err(by_model[0], by_logps[0]) <= 1e-6 and rel_err(by_model[1][0], by_logps[1][0]) <= 1e-6
    no_kl = C.fused_linear_grpo_loss(h, w, ids, mask, adv, beta=0.0, old_per_token_logps=old, delta=1.05)
    assert len(no_kl[1]) == 1
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        C.fused_linear_grpo_loss(h, w, ids, mask, adv)
    with pytest.raises(ValueError, match="max_completion_length"):
        C.fused_linear_grpo_loss(h, w, ids, mask, adv, beta=0.0, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        C.fused_linear_grpo_loss(h, w, ids, mask, adv, beta=0.0, loss_type="ppo")
    with pytest.raises(ValueError, match="advantages"):
        C.fused_linear_grpo_loss(h, w, ids, mask, adv[:2], beta=0.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90", "rocm-gfx942", "xpu-xe-hpc"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
def test_grpo_kernel_interpreter(simulated_device, dtype, monkeypatch):
    """GRPO on the kernels takes the one-pass path (chunks of whole sequences: 2 of 5, 2, then 1),
    per token and per sequence (GSPO and VESPO, whose ratio and weight need the whole sequence)."""
    calls = _spy_one_pass(monkeypatch, 2)
    test_grpo_matches_reference("dapo", "token", dtype)
    test_grpo_matches_reference("grpo", "sequence", dtype)
    test_grpo_other_loss_types_match_reference("vespo", dtype)  # a weight of the whole sequence
    test_grpo_other_loss_types_match_reference("luspo", dtype)
    test_grpo_luspo_is_trls_mean("sequence", 0.0)  # a loss of one per sequence
    assert calls == [3, 3, 3, 3, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
def test_kto_grpo_gpu(dtype, monkeypatch):
    """KTO and GRPO with GPU tensors take the one pass (chunks of two sequences) and match the CPU
    float64 references above."""
    dev = torch.device(liger_portable.platform().torch_device_type, 0)
    calls = _spy_one_pass(monkeypatch, 2)
    test_kto_matches_reference(True, True, dtype, False, device=dev)
    test_kto_matches_reference(False, True, dtype, True, device=dev)
    test_grpo_matches_reference("dapo", "token", dtype, device=dev)
    test_grpo_matches_reference("grpo", "sequence", dtype, device=dev)
    test_grpo_other_loss_types_match_reference("vespo", dtype, device=dev)
    test_grpo_other_loss_types_match_reference("sapo", dtype, device=dev)
    test_grpo_luspo_is_trls_mean("sequence", 0.0, device=dev)
    assert calls == [3] * 7



# --------------------------------------------------------------------------- distillation


def _distill_inputs(dtype, N=45, H=16, Ht=24, V=53, seed=41):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5 * 1.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype)
    th = torch.randn(N, Ht, generator=g).to(dtype)
    tw = (torch.randn(V, Ht, generator=g) / Ht**0.5 * 1.5).to(dtype)
    tb = (torch.randn(V, generator=g) * 0.3).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    y[torch.rand(N, generator=g) < 0.3] = IGNORE
    return h, w, b, th, tw, tb, y


def _distill_reference(h, w, b, th, tw, tb, y, beta, tau, w_hard, w_soft):
    """The losses written out from float64 logits: KL(P || Q) = sum P (log P - log Q); beta 0 is the
    forward KL(teacher || student), 1 the reverse."""
    hd, wd, bd = _leaves(h, w, b)
    s = hd @ wd.T + bd
    t = (th.double() @ tw.double().T + tb.double())
    keep = (y != IGNORE).double()
    count = keep.sum()
    hard = ((torch.logsumexp(s, -1) - s.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)) * keep).sum() / count
    ps, pt = torch.softmax(s / tau, -1), torch.softmax(t / tau, -1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)  # noqa: E731
    m = (1 - beta) * ps + beta * pt
    # TRL's generalised JSD, whose end points are the KLs (the mixture formula would give 0 there)
    soft = {0.0: lambda: kl(pt, ps), 1.0: lambda: kl(ps, pt)}.get(beta, lambda: beta * kl(pt, m) + (1 - beta) * kl(ps, m))() * keep
    soft = soft.sum() / count
    loss = w_hard * hard + w_soft * soft
    loss.backward()
    return loss.detach(), soft.detach(), hard.detach(), (hd, wd, bd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
@pytest.mark.parametrize("beta,tau", [(0.0, 1.0), (1.0, 2.0), (0.5, 1.0), (0.3, 0.7)],
                         ids=["forward-kl", "reverse-kl-t2", "jsd", "jsd0.3-t0.7"])
def test_distillation_matches_reference(beta, tau, dtype):
    h, w, b, th, tw, tb, y = _distill_inputs(dtype)
    want_loss, want_soft, want_hard, want_leaves = _distill_reference(h, w, b, th, tw, tb, y, beta, tau, 0.3, 0.7)
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    module = lnn.LigerFusedLinearJSDLoss(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=beta, temperature=tau,
                                         chunk_size=8, return_soft_hard_loss=True)  # 45 rows: a partial chunk
    loss, soft, hard = module(hl, wl, th, tw, y, bl, tb)
    loss.backward()
    _check(loss, [soft, hard], (hl, wl, bl), want_loss, [want_soft, want_hard], want_leaves, dtype)


def test_distillation_compiled_chunk(monkeypatch):
    """The chunk compiled by torch.compile (as on GPUs; here Inductor's CPU code) against the formulas
    from float64 logits, a partial last chunk included; a compiler failure falls back to the eager
    chunk with a warning."""
    monkeypatch.setattr(C, "COMPILE_CHUNK", True)
    monkeypatch.setattr(C, "compiled_chunk", None)
    h, w, b, th, tw, tb, y = _distill_inputs(torch.float32)
    want, want_soft, want_hard, leaves = _distill_reference(h, w, b, th, tw, tb, y, 0.3, 0.7, 0.4, 0.6)
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    loss, soft, hard = C.fused_linear_distillation_loss(
        hl, wl, y, bl, teacher_input=th, teacher_weight=tw, teacher_bias=tb, beta=0.3, temperature=0.7,
        weight_hard_loss=0.4, weight_soft_loss=0.6, chunk_size=16, return_soft_hard_loss=True)
    loss.backward()
    assert callable(C.compiled_chunk)  # the compiled chunk ran
    _check(loss, [soft, hard], (hl, wl, bl), want, [want_soft, want_hard], leaves, torch.float32)

    def failing(fn, **kwargs):
        def run(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(fn, RuntimeError("no compiler here"), None)
        return run

    monkeypatch.setattr(C, "compiled_chunk", None)
    monkeypatch.setattr(torch, "compile", failing)
    hl.grad = None
    with pytest.warns(UserWarning, match="running it eagerly"):
        again = C.fused_linear_distillation_loss(
            hl, wl, y, bl, teacher_input=th, teacher_weight=tw, teacher_bias=tb, beta=0.3, temperature=0.7,
            weight_hard_loss=0.4, weight_soft_loss=0.6, chunk_size=16)
    assert C.compiled_chunk is False and rel_err(again, want) <= 1e-5


def test_distillation_teacher_logits_and_scaling():
    """Teacher logits passed in give what the teacher head gives; the gradients scale with the
    incoming gradient; without gradients nothing is computed for them; errors name the argument."""
    h, w, b, th, tw, tb, y = _distill_inputs(torch.float32)
    hl = h.clone().requires_grad_()
    by_head = C.fused_linear_distillation_loss(hl, w, y, b, teacher_input=th, teacher_weight=tw, teacher_bias=tb)
    (3.0 * by_head).backward()
    g3 = hl.grad.clone()
    hl.grad = None
    by_logits = C.fused_linear_distillation_loss(hl, w, y, b, teacher_logits=th @ tw.T + tb, chunk_size=7)
    by_logits.backward()
    assert rel_err(by_logits, by_head) <= 1e-6 and rel_err(g3, 3.0 * hl.grad) <= 1e-6
    with torch.no_grad():
        assert rel_err(C.fused_linear_distillation_loss(h, w, y, b, teacher_logits=th @ tw.T + tb), by_head) <= 1e-6
    for kwargs, match in [
        ({}, "teacher"), ({"teacher_logits": th @ tw.T, "beta": 1.5}, "beta"),
        ({"teacher_logits": (th @ tw.T)[:, :10]}, "teacher_logits"),
        ({"teacher_logits": th @ tw.T, "chunk_size": 0}, "chunk_size"),
        ({"teacher_input": th, "teacher_weight": tw[:10]}, "vocabulary"),
    ]:
        with pytest.raises(ValueError, match=match):
            C.fused_linear_distillation_loss(h, w, y, b, **kwargs)


def test_distillation_labels():
    """An ignore_index past the vocabulary (a padding id) indexes nothing; a label that is neither a
    class nor ignored is an error naming true_labels on the CPU and, in the chunk as it runs on a GPU,
    a NaN loss and gradient for that row alone."""
    h, w, b, th, tw, tb, y = _distill_inputs(torch.float32)
    V = w.shape[0]
    want = _distill_reference(h, w, b, th, tw, tb, y, 0.5, 1.0, 0.5, 0.5)[0]
    hl = h.clone().requires_grad_()
    padded = C.fused_linear_distillation_loss(hl, w, torch.where(y == IGNORE, V, y), b, teacher_input=th,
                                              teacher_weight=tw, teacher_bias=tb, ignore_index=V, chunk_size=8)
    assert rel_err(padded, want) <= 1e-5
    for bad in (-1, V):
        with pytest.raises(ValueError, match=f"true_labels holds {bad}, outside the {V} classes"):
            C.fused_linear_distillation_loss(h, w, torch.where(y == IGNORE, bad, y), b, teacher_logits=th @ tw.T)
    with pytest.raises(TypeError, match="true_labels must hold class indices"):
        C.fused_linear_distillation_loss(h, w, y.float(), b, teacher_logits=th @ tw.T)
    # the chunk itself (what a GPU runs, unchecked): row 1's label is -1, row 2 is ignored with label -100
    s, t = h[:4] @ w.T, th[:4] @ tw.T
    labels, keep = torch.tensor([3, -1, IGNORE, 7]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    args = (0.5, 1.0, 0.5, 0.5, torch.tensor(0.25), torch.float32, False)
    hard, soft, d, _ = C.chunk_terms(s, t, labels, keep, *args)
    hard0, _, d0, _ = C.chunk_terms(s, t, torch.tensor([3, 0, IGNORE, 7]), keep, *args)
    assert hard[1].isnan() and d[1].isnan().all() and not soft.isnan().any()
    rows = [0, 2, 3]
    assert torch.equal(hard[rows], hard0[rows]) and torch.equal(d[rows], d0[rows]) and d[rows].isfinite().all()


def test_distillation_no_grad_computes_no_gradients(monkeypatch):
    """Under torch.no_grad the chunks compute no gradient, even for parameters that require one."""
    h, w, b, th, tw, tb, y = _distill_inputs(torch.float32)
    wanted = []
    real = C.terms_fn
    monkeypatch.setattr(C, "terms_fn", lambda device: (lambda *a: wanted.append(a[9]) or real(device)(*a)))
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    with torch.no_grad():
        loss = C.fused_linear_distillation_loss(hl, wl, y, bl, teacher_logits=th @ tw.T, chunk_size=16)
    assert loss.grad_fn is None and wanted == [None] * 3
    C.fused_linear_distillation_loss(hl, wl, y, bl, teacher_logits=th @ tw.T, chunk_size=16)
    assert wanted[3:] == [torch.float32] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids["dtype"])
def test_distillation_gpu(dtype):
    """The distillation loss with GPU tensors at a vocabulary above 65536, against the CPU float64
    reference above."""
    dev = torch.device(liger_portable.platform().torch_device_type, 0)
    h, w, b, th, tw, tb, y = _distill_inputs(dtype, N=300, V=70001)
    want = _distill_reference(h, w, b, th, tw, tb, y, 0.5, 1.0, 0.5, 0.5)
    on = [x.to(dev) for x in (h, w, b, th, tw, tb, y)]
    hl, wl, bl = (x.clone().requires_grad_() for x in on[:3])
    loss, soft, hard = C.fused_linear_distillation_loss(
        hl, wl, on[6], bl, teacher_input=on[3], teacher_weight=on[4], teacher_bias=on[5], chunk_size=128,
        return_soft_hard_loss=True)
    loss.backward()
    tol = TOL[dtype]
    for got, exp in zip((loss, soft, hard), want[:3]):
        assert rel_err(got, exp) <= tol, (got, exp)
    for got, exp in zip((hl, wl, bl), want[3]):
        assert got.grad.dtype == dtype and rel_err(got.grad, exp.grad) <= tol


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_grpo_token_count_normaliser(loss_type, monkeypatch):
    """The losses summed over tokens divide by ``num_items_in_batch`` when given (the whole generation
    batch's count, TRL's), else by this batch's tokens summed over the processes; either divided by the
    process count (simulated here: two processes with the same batch)."""
    h, w, b, ids, mask, adv, old, ref = _grpo_inputs(torch.float32)
    count = float(mask.sum())

    def loss(**kw):
        return C.fused_linear_grpo_loss(h, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old,
                                        loss_type=loss_type, **kw)[0]

    local = loss()
    assert rel_err(loss(num_items_in_batch=100), local * count / 100) <= 1e-6
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: t.mul_(2))  # two equal batches
    assert rel_err(loss(), local) <= 1e-6  # (2 x count) / 2 processes
    assert rel_err(loss(num_items_in_batch=100), local * count / 50) <= 1e-6  # 100 / 2 processes


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_on_policy_is_old_logps_of_the_current_policy(loss_type):
    """On-policy (``old_per_token_logps`` None) is the same as passing the current policy's log-probabilities,
    detached, as the old ones: the ratio is 1 but its gradient, the policy gradient, is not zero."""
    h, w, b, ids, mask, adv, _, ref = _grpo_inputs(torch.float32)
    with torch.no_grad():
        current = torch.log_softmax((h.double() @ w.double().T + b.double()), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    out = []
    for old in (None, current.float()):
        hl, wl, bl = (t.clone().requires_grad_() for t in (h, w, b))
        loss = C.fused_linear_grpo_loss(hl, wl, ids, mask, adv, bl, ref_per_token_logps=ref, old_per_token_logps=old,
                                        loss_type=loss_type)[0]
        loss.backward()
        out.append((loss.detach(), hl.grad, wl.grad, bl.grad))
    for name, a, b_ in zip(("loss", "dh", "dw", "db"), *out):
        assert rel_err(a, b_) <= 1e-5, (name, rel_err(a, b_))
    assert out[0][1].abs().max() > 0
