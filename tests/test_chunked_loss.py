"""Fused linear preference losses (DPO and its variants, ORPO, SimPO, CPO): against an independent
float64 reference that builds the full logits and writes each paper's loss out again; gradients of
hidden, weight and bias; chosen and rejected sequences of unequal lengths (ignore_index on the
prompt and the padding, one completion empty); every reduction; the kernel path in the Triton
interpreter; liger-kernel's module signatures; a few DPO steps of a tiny model, fused and not.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF

import liger_portable
from liger_portable import chunked_loss as C
from liger_portable import nn as lnn

from conftest import SIMULATED_DEVICES, TOL, rel_err

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
    _compare("dpo", h, w, b, t, {"loss_type": loss_type, "label_smoothing": ls, "beta": 0.5}, torch.float32, ref=(rh, rw))


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_reductions(kind, reduction):
    h, w, b, t, rh, rw = _inputs(seed=5, empty=kind != "orpo")
    opts = {"reduction": reduction, "compute_nll_loss": True}
    _compare(kind, h, w, b, t, opts, torch.float32, ref=(rh, rw) if kind == "dpo" else None)
    loss_none = FUNCTIONS[kind](h, w, t, b, **opts, **({"use_ref_model": False} if kind == "dpo" else {}))[0]
    loss_sum = FUNCTIONS[kind](h, w, t, b, compute_nll_loss=True, reduction="sum",
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
def test_gpu(kind, dtype):
    dev = torch.device(liger_portable.platform().torch_device_type, 0)
    h, w, b, t, rh, rw = _inputs(B=4, T=301, H=96, V=70001, dtype=dtype, seed=17, device=dev, empty=kind != "orpo")
    _compare(kind, h, w, b, t, {}, dtype, ref=(rh, rw) if kind == "dpo" else None)
