"""Fused linear cross-entropy: fallback (chunked), Triton path (interpreter with each vendor's
configs; real GPU), gradients of hidden, weight and bias, every option, chunking, API edges.

The reference is independent: ``hidden @ weight.T + bias`` in float64, then
``torch.nn.functional.cross_entropy`` and the explicit z-loss / softcap formulas (the reference of
tests/test_cross_entropy.py), autograd for every gradient.
"""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch

import liger_portable
from liger_portable import functional as F
from liger_portable import nn as lnn

from conftest import TOL, rel_err
from test_cross_entropy import OPTIONS, REDUCTIONS, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_ids = {"dtype": lambda d: str(d).removeprefix("torch.")}

fl_ops = importlib.import_module("liger_portable.ops.fused_linear_cross_entropy")
fl_fb = importlib.import_module("liger_portable.fallback.cross_entropy")


def _inputs(BT, H, V, dtype, bias=True, device="cpu", seed=0, ignore_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(BT, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    t = torch.randint(0, V, (BT,), generator=g)
    t[torch.rand(BT, generator=g) < ignore_frac] = -100
    return h.to(device), w.to(device), None if b is None else b.to(device), t.to(device)


def flce_reference(h, w, b, t, *, reduction="mean", opts=OPTIONS["plain"], grad_out=None):
    """float64 loss, z-loss and gradients, on the inputs' device (a GPU's float64 is fast; the
    largest GPU shapes took over a minute each on the host)."""
    dev = h.device
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().to(dev).requires_grad_()
    bd = None if b is None else b.detach().double().to(dev).requires_grad_()
    logits = hd @ wd.T + (bd if bd is not None else 0)
    ls, zs, sc = opts
    # reference() differentiates a leaf copy of the logits: chain to hidden / weight / bias here.
    loss, zl, dlogits = reference(logits, t, reduction=reduction, label_smoothing=ls, lse_square_scale=zs,
                                  softcap=sc, grad_out=grad_out, device=dev)
    logits.backward(dlogits)
    return loss, zl, hd.grad, wd.grad, None if bd is None else bd.grad


def _kernel_opts(dtype, opts):
    """``opts`` with, in float16 without a softcap, the z-loss scale lowered to the largest the float16
    kernels take (1e-4; larger ones run the fallback: test_kernel_interpreter_fp16_large_zloss), so
    that the kernels, not the fallback, are what these cases test."""
    ls, zs, sc = opts
    if dtype == torch.float16 and zs > 1e-4 and sc is None:
        return ls, 1e-4, sc
    return opts


def _run_and_compare(h, w, b, t, dtype, reduction="mean", opts=OPTIONS["plain"], grad_out=None, tol=None):
    opts = _kernel_opts(dtype, opts)
    ref = flce_reference(h, w, b, t, reduction=reduction, opts=opts, grad_out=grad_out)
    ls, zs, sc = opts
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    bl = None if b is None else b.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could overflow the kernels")  # no silent fallback
        loss, z = F.fused_linear_cross_entropy(hl, wl, t, bl, reduction=reduction, label_smoothing=ls,
                                               lse_square_scale=zs, softcap=sc, return_z_loss=True)
    loss_dtype = torch.promote_types(dtype, torch.float32)  # the loss is fp32 for half inputs
    assert loss.dtype == loss_dtype and loss.shape == ref[0].shape
    go = torch.ones_like(loss) if grad_out is None else grad_out.to(loss.dtype).to(loss.device)
    (loss * go).sum().backward()
    tol = tol or TOL[dtype]
    outs = {"loss": (loss, ref[0]), "dhidden": (hl.grad, ref[2]), "dweight": (wl.grad, ref[3])}
    if b is not None:
        outs["dbias"] = (bl.grad, ref[4])
    if zs:
        outs["z_loss"] = (z, ref[1])
    for name, (out, r) in outs.items():
        if r.abs().max() == 0:
            assert torch.all(out == 0), name
        else:
            assert rel_err(out, r) <= tol, (name, rel_err(out, r))
        if name != "z_loss":
            assert out.dtype == (loss_dtype if name == "loss" else dtype), name


@pytest.fixture
def small_chunks(monkeypatch):
    """Several chunks out of a tiny problem: chunk_mib counts 2 KiB units, the fallback 4 KiB."""
    monkeypatch.setattr(fl_ops, "CHUNK_UNIT", 2048)
    monkeypatch.setattr(fl_fb, "CHUNK_BYTES", 4096)


# --------------------------------------------------------------------------- fallback (CPU path)


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
def test_fallback(small_chunks, dtype, reduction, opts):
    h, w, b, t = _inputs(21, 16, 300, dtype, bias=reduction != "sum")
    go = torch.randn(21) if reduction == "none" else torch.tensor(1.7)
    _run_and_compare(h, w, b, t, dtype, reduction, OPTIONS[opts], grad_out=go)


def test_fallback_is_chunked(monkeypatch):
    calls = []
    real = fl_fb.ce_rows_torch
    monkeypatch.setattr(fl_fb, "ce_rows_torch", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(fl_fb, "CHUNK_BYTES", 8 * 4 * 100)
    h, w, b, t = _inputs(20, 8, 100, torch.float32)
    _run_and_compare(h, w, b, t, torch.float32, "mean", OPTIONS["all"])
    assert calls == [8, 8, 4]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fallback_chunk_mib(monkeypatch, reduction):
    """``chunk_mib`` sets the fallback's chunk (MiB of fp32 logits; the unit lowered to 4 KiB
    here): 4 KiB / (100 x 4 B) = 10 rows, rounded down to 8; the results stay the reference's."""
    calls = []
    real = fl_fb.ce_rows_torch
    monkeypatch.setattr(fl_fb, "ce_rows_torch", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(fl_fb, "CHUNK_UNIT", 4096)
    h, w, b, t = _inputs(20, 8, 100, torch.float32)
    go = torch.randn(20) if reduction == "none" else torch.tensor(0.7)
    ref = flce_reference(h, w, b, t, reduction=reduction, opts=OPTIONS["all"], grad_out=go)
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    loss = F.fused_linear_cross_entropy(hl, wl, t, bl, reduction=reduction, label_smoothing=0.2,
                                        lse_square_scale=1e-3, softcap=5.0, chunk_mib=1)
    (loss * go).sum().backward()
    # "none" recomputes the chunks in the backward, with the same chunk
    assert calls == [8, 8, 4] * (2 if reduction == "none" else 1)
    for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3]), (bl.grad, ref[4])):
        assert rel_err(out, r) <= 1e-5


def test_chunk_mib_takes_any_integral():
    np = pytest.importorskip("numpy")

    h, w, b, t = _inputs(6, 8, 10, torch.float32)
    ref = F.fused_linear_cross_entropy(h, w, t, chunk_mib=3)
    assert torch.equal(F.fused_linear_cross_entropy(h, w, t, chunk_mib=np.int64(3)), ref)
    assert type(lnn.FusedLinearCrossEntropyLoss(chunk_mib=np.int32(3)).chunk_mib) is int


@pytest.mark.parametrize("bad", [0, -8, 1.5, True, "256"])
def test_chunk_mib_must_be_a_positive_whole_number(bad):
    h, w, b, t = _inputs(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match=r"^chunk_mib must be None \(the device table's chunk\) or a whole number"):
        F.fused_linear_cross_entropy(h, w, t, chunk_mib=bad)
    with pytest.raises(ValueError, match=r"^chunk_mib must be"):
        lnn.FusedLinearCrossEntropyLoss(chunk_mib=bad)


def test_all_ignored_and_frozen_weight():
    h, w, b, t = _inputs(6, 8, 50, torch.float32)
    t[:] = -100
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.fused_linear_cross_entropy(hl, wl, t, b, label_smoothing=0.1)
    loss.backward()
    assert loss.item() == 0 and torch.all(hl.grad == 0) and torch.all(wl.grad == 0)
    # a frozen LM head: only hidden gets a gradient
    h, w, b, t = _inputs(6, 8, 50, torch.float32)
    hl = h.clone().requires_grad_()
    F.fused_linear_cross_entropy(hl, w, t).backward()
    assert rel_err(hl.grad, flce_reference(h, w, None, t)[2]) <= 1e-5


def test_fallback_fp16_weight_and_bias_gradients_do_not_overflow():
    """float16: one frequent token and one large hidden feature make the token-summed weight
    gradient pass fp16's 65504 before the mean divides it (and 70000 tokens of a class the bias's);
    the mean gradients (about -20 and -1) must come out right, not -inf. The same code runs on a GPU
    for float16 with a large z-loss (the kernels refuse it)."""
    torch.manual_seed(0)
    # (each hidden row's gradient at 70000 tokens lies among fp16's subnormals: checked at 4096)
    for n, H, V, feature, checked in ((4096, 8, 64, 20.0, (2, 3, 4)), (70000, 4, 8, 1.0, (3, 4))):
        h = torch.randn(n, H) * 0.1
        h[:, 0] = feature
        w, b = torch.randn(V, H) * 0.1, torch.randn(V) * 0.1
        t = torch.zeros(n, dtype=torch.long)  # every token the same class
        ref = flce_reference(h.double(), w.double(), b.double(), t)
        hh, ww, bb = (x.half().requires_grad_() for x in (h, w, b))
        loss = F.fused_linear_cross_entropy(hh, ww, t, bb)
        loss.backward()
        assert rel_err(loss, ref[0]) <= 1e-2
        for i in checked:
            got, want = (None, None, hh.grad, ww.grad, bb.grad)[i], ref[i]
            assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-2, (n, i, rel_err(got, want))


def _check_no_grad_computes_no_gradient(monkeypatch, device="cpu"):
    """Under torch.no_grad() (an evaluation loop, where the LM head's weight is a Parameter that
    requires grad) no gradient is computed or stored: the Function saw requires_grad alone and
    built the weight's gradient (two more products a chunk and a V x H tensor) to throw it away."""
    fallback_ce = importlib.import_module("liger_portable.fallback.cross_entropy")
    from liger_portable.ops import fused_linear_cross_entropy as ops_flce

    asked = []
    real_rows, real_fwd = fallback_ce.ce_rows_torch, ops_flce.flce_fwd
    monkeypatch.setattr(fallback_ce, "ce_rows_torch", lambda *a: asked.append(a[-1]) or real_rows(*a))
    monkeypatch.setattr(ops_flce, "flce_fwd", lambda *a, **k: asked.append(any(a[9])) or real_fwd(*a, **k))
    h, w, b, t = _inputs(9, 8, 50, torch.float32, device=device)
    w, b = torch.nn.Parameter(w), torch.nn.Parameter(b)
    with torch.no_grad():
        loss = F.fused_linear_cross_entropy(h, w, t, b)
    assert asked and not any(asked) and not loss.requires_grad
    assert rel_err(loss, flce_reference(h, w.detach(), b.detach(), t)[0]) <= 1e-5
    F.fused_linear_cross_entropy(h, w, t, b)
    assert asked[-1]  # with grad enabled they are computed


def test_no_grad_computes_no_gradient(monkeypatch):
    _check_no_grad_computes_no_gradient(monkeypatch)


@pytest.mark.interpreter
def test_kernel_interpreter_no_grad_computes_no_gradient(simulated_device, monkeypatch):
    _check_no_grad_computes_no_gradient(monkeypatch)


def test_bad_input_names_the_argument():
    h, w, b, t = _inputs(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match=r"^weight must have shape \(V, 8\)"):
        F.fused_linear_cross_entropy(h, w[:, :7], t)
    with pytest.raises(TypeError, match=r"^weight has dtype torch.float16 but hidden has torch.float32"):
        F.fused_linear_cross_entropy(h, w.half(), t)
    with pytest.raises(ValueError, match=r"^bias must have shape \(10,\)"):
        F.fused_linear_cross_entropy(h, w, t, b[:5])
    with pytest.raises(TypeError, match=r"^target must hold class indices as torch.int64"):
        F.fused_linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match=r"^target must have shape \(4,\)"):
        F.fused_linear_cross_entropy(h, w, t[:2])
    with pytest.raises(ValueError, match=r"^target holds 10, outside the 10 classes"):
        F.fused_linear_cross_entropy(h, w, torch.tensor([0, 10, 1, 2]))
    with pytest.raises(TypeError, match=r"^hidden must be a floating-point tensor"):
        F.fused_linear_cross_entropy(h.long(), w, t)
    with pytest.raises(ValueError, match=r"^weight is on meta but hidden is on cpu"):
        F.fused_linear_cross_entropy(h, w.to("meta"), t)
    with pytest.raises(ValueError, match=r"^softcap must be a positive number"):
        F.fused_linear_cross_entropy(h, w, t, softcap=-1.0)


def test_bad_bias_dtype_target_device_and_options_name_the_argument():
    h, w, b, t = _inputs(4, 8, 10, torch.float32)
    t = t.clamp(min=0)
    with pytest.raises(TypeError, match=r"^bias has dtype torch.float16 but hidden has torch.float32"):
        F.fused_linear_cross_entropy(h, w, t, b.half())
    with pytest.raises(ValueError, match=r"^target is on meta but hidden is on cpu"):
        F.fused_linear_cross_entropy(h, w, t.to("meta"))
    with pytest.raises(TypeError, match=r"^target must hold class indices as torch.int64 \(or torch.int32\), got torch.int16"):
        F.fused_linear_cross_entropy(h, w, t.to(torch.int16))
    with pytest.raises(TypeError, match=r"^return_z_loss must be True or False"):
        F.fused_linear_cross_entropy(h, w, t, return_z_loss=1)


def test_weight_without_classes_is_refused():
    with pytest.raises(ValueError, match=r"^weight must have at least one class \(its first dimension is 0\)"):
        F.fused_linear_cross_entropy(torch.randn(4, 8), torch.randn(0, 8), torch.full((4,), -100))


def test_module_and_nd():
    h, w, b, t = _inputs(12, 8, 40, torch.float32)
    m = lnn.FusedLinearCrossEntropyLoss(reduction="none", lse_square_scale=1e-3, return_z_loss=True)
    loss, z = m(w, h.view(3, 4, 8), t.view(3, 4), b)
    ref = flce_reference(h, w, b, t, reduction="none", opts=OPTIONS["zloss"])
    assert loss.shape == (3, 4) and rel_err(loss.view(-1), ref[0]) <= 1e-5 and rel_err(z.view(-1), ref[1]) <= 1e-5


def test_compile_fullgraph_cpu():
    h, w, b, t = _inputs(10, 8, 60, torch.float32)
    ref = flce_reference(h, w, b, t, opts=OPTIONS["all"])
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    fn = torch.compile(F.fused_linear_cross_entropy, fullgraph=True, backend="aot_eager")
    loss = fn(hl, wl, t, bl, label_smoothing=0.2, lse_square_scale=1e-3, softcap=5.0)
    loss.backward()
    for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3]), (bl.grad, ref[4])):
        assert rel_err(out, r) <= 1e-5


# --------------------------------------------------------------------------- Triton interpreter, every vendor's configs


def test_chunk_rows_rule():
    assert fl_fb.chunk_rows(128256, 2, 128 * 2**20) == 520  # 523 rounded down to a multiple of 8
    assert fl_fb.chunk_rows(256000, 2, 8 * 2**20) == 16
    assert fl_fb.chunk_rows(10**9, 2, 8 * 2**20) == 1
    assert fl_fb.chunk_rows(1000, 4, 5 * 4000) == 5


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kernel_interpreter(simulated_device, poison, small_chunks, dtype, reduction):
    """V=1000 (odd), one option set per (dtype, reduction). The 19 tokens are one chunk (the
    default chunk holds at least FLOOR_MIB units of logits, 512 KiB here); several chunks:
    test_kernel_interpreter_half_mean_chunks and test_kernel_interpreter_chunk_mib."""
    i = DTYPES.index(dtype) * 3 + REDUCTIONS.index(reduction)
    opts = list(OPTIONS.values())[i % len(OPTIONS)]
    h, w, b, t = _inputs(19, 16, 1000, dtype, bias=i % 2 == 0, seed=i)
    go = torch.randn(19) if reduction == "none" else torch.tensor(0.6)
    _run_and_compare(h, w, b, t, dtype, reduction, opts, grad_out=go)


@pytest.mark.interpreter
def test_kernel_interpreter_chunks_and_edges(simulated_device, poison, small_chunks):
    """One token; all ignored; a vocabulary above 65536 (one chunk row at a time)."""
    h, w, b, t = _inputs(1, 8, 37, torch.float32, ignore_frac=0)
    _run_and_compare(h, w, b, t, torch.float32, "mean", OPTIONS["all"])
    h, w, b, t = _inputs(5, 8, 300, torch.float32)
    t[:] = -100
    _run_and_compare(h, w, b, t, torch.float32, "mean", OPTIONS["smooth"])
    if simulated_device.arch in ("sm90", "xe-hpg"):
        h, w, b, t = _inputs(3, 8, 70001, torch.bfloat16, ignore_frac=0)
        _run_and_compare(h, w, b, t, torch.bfloat16, "sum", OPTIONS["softcap"])


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_kernel_interpreter_fp16_small_gradients(simulated_device, poison, reduction):
    """fp16 with the mean over many tokens (``none``: the same mean taken by hand, per-token
    factors of 1.3 / count): each token's logit gradient p / count (p ~ 1/V) lies below fp16's
    subnormals. The gradients must still be within 4x of the error of rounding the exact float64
    result to fp16 (dividing by the count before the matmuls gave 16x for grad_hidden here, and
    1.4% at 1024 tokens x V 128256 on an H200)."""
    if simulated_device.arch != "sm90":
        pytest.skip("the scaling is dtype logic, not a config: one table is enough (15 s in the interpreter)")
    dtype = torch.float16
    g = torch.Generator().manual_seed(0)
    BT, H, V = 512, 16, 16384
    h = torch.randn(BT, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype)
    t = torch.randint(0, V, (BT,), generator=g)
    t[::7] = -100  # the count is not BT: the n_rows / count factor is applied too
    go = torch.tensor(1.3) if reduction == "mean" else torch.full((BT,), 1.3 / int((t != -100).sum()))
    ref = flce_reference(h, w, b, t, reduction=reduction, grad_out=go)
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    (F.fused_linear_cross_entropy(hl, wl, t, bl, reduction=reduction) * go).sum().backward()
    for name, out, r in (("dhidden", hl.grad, ref[2]), ("dweight", wl.grad, ref[3]), ("dbias", bl.grad, ref[4])):
        assert out.dtype == dtype
        assert rel_err(out, r) <= 4 * rel_err(r.to(dtype), r), (name, rel_err(out, r), rel_err(r.to(dtype), r))


def _check_fp16_large_zloss(device, launches, reduction, zloss):
    dtype = torch.float16
    g = torch.Generator().manual_seed(0)
    h = torch.cat([torch.tensor([[100.0, 0.0]]), torch.randn(5, 2, generator=g)]).to(dtype)
    w = torch.cat([torch.eye(2), torch.randn(7, 2, generator=g)]).to(dtype)
    t = torch.tensor([1, 0, 3, 8, -100, 2])
    go = torch.tensor(1.3) if reduction == "mean" else torch.randn(6, generator=g)
    ref = flce_reference(h, w, None, t, reduction=reduction, opts=(0.0, zloss, None), grad_out=go)
    hl, wl = h.to(device).requires_grad_(), w.to(device).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = F.fused_linear_cross_entropy(hl, wl, t.to(device), reduction=reduction, lse_square_scale=zloss)
        (loss * go.to(device)).sum().backward()
    fell_back = zloss == 0.1
    assert any("lse_square_scale=0.1" in str(c.message) for c in caught) == fell_back
    assert bool(launches) != fell_back
    for name, out, r in (("dhidden", hl.grad, ref[2]), ("dweight", wl.grad, ref[3])):
        assert torch.isfinite(out).all(), name
        assert rel_err(out.cpu(), r) <= TOL[dtype], (name, rel_err(out.cpu(), r))


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("zloss", [0.1, 1e-4])
def test_kernel_interpreter_fp16_large_zloss(simulated_device, poison, launches, reduction, zloss):
    """fp16 with a z-loss large enough that a row's logit gradient, 1 + 2 * lse_square_scale * lse,
    times the kernels' fp16 gradient scale would overflow (lse 100 here: 21): such options run the
    fallback, with a warning, and the gradients are finite and right (the kernels gave inf and NaN).
    PaLM's 1e-4 keeps the kernels."""
    if simulated_device.arch != "sm90":
        pytest.skip("dtype logic, not a config: one table is enough")
    _check_fp16_large_zloss(torch.device("cpu"), launches, reduction, zloss)


@pytest.mark.interpreter
def test_kernel_interpreter_fp16_large_zloss_without_grads_and_compiled(simulated_device, launches):
    """Without gradients the kernels cannot overflow: they run, without a warning. Under
    torch.compile(fullgraph=True) the fallback is taken without the warning (one breaks the graph)."""
    if simulated_device.arch != "sm90":
        pytest.skip("dtype logic, not a config: one table is enough")
    h, w, _, t = _inputs(6, 8, 11, torch.float16, bias=False)
    ref = flce_reference(h, w, None, t, opts=(0.0, 0.1, None))
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = F.fused_linear_cross_entropy(hl, wl, t, lse_square_scale=0.1)
    assert launches and rel_err(loss, ref[0]) <= TOL[torch.float16]
    fn = torch.compile(F.fused_linear_cross_entropy, fullgraph=True, backend="aot_eager")
    loss = fn(hl, wl, t, lse_square_scale=0.1)
    loss.backward()
    assert rel_err(loss, ref[0]) <= TOL[torch.float16] and rel_err(hl.grad, ref[2]) <= TOL[torch.float16]


def test_half_grads_fit_bound():
    """The largest z-loss the fp16 kernels take: 1e-4 at V 128256 without a softcap; with a softcap
    of 30, up to 0.1."""
    fits = fl_ops.half_grads_fit
    assert fits(0.0, None, 128256) and fits(1e-4, None, 128256) and fits(0.1, 30.0, 128256)
    assert not fits(1.2e-4, None, 128256) and not fits(0.1, None, 2) and not fits(0.2, 30.0, 128256)
    # at the bound: 4096 * (1 + 2 * s * lse) is fp16's largest value
    lse = 30.0 + math.log(128256)
    s = (65504.0 / 4096 - 1) / (2 * lse)
    assert fits(s * (1 - 1e-9), 30.0, 128256) and not fits(s * (1 + 1e-9), 30.0, 128256)


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_kernel_interpreter_chunk_mib(simulated_device, poison, small_chunks, monkeypatch, reduction):
    """``chunk_mib`` overrides the default chunk, forward and (``none``) the recomputing
    backward, eager and under torch.compile (the custom ops carry it): 3 units of 2 KiB over
    V=100 fp32 rows of 400 B = 15 rows, rounded down to 8; the module passes it on too."""
    if simulated_device.arch != "sm90":
        pytest.skip("host-side chunking, vendor-independent: one table is enough")
    calls = []
    real = fl_ops.ce_rows
    monkeypatch.setattr(fl_ops, "ce_rows", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    h, w, b, t = _inputs(20, 8, 100, torch.float32)
    go = torch.randn(20) if reduction == "none" else torch.tensor(1.1)
    ref = flce_reference(h, w, b, t, reduction=reduction, grad_out=go)
    m = lnn.FusedLinearCrossEntropyLoss(reduction=reduction, chunk_mib=3)
    assert "chunk_mib=3" in repr(m)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for fn in (m, compiled):
        calls.clear()
        hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
        loss = fn(wl, hl, t, bl)
        (loss * go).sum().backward()
        assert calls == [8, 8, 4] * (2 if reduction == "none" else 1)
        for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3]), (bl.grad, ref[4])):
            assert rel_err(out, r) <= 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_ids["dtype"])
def test_kernel_interpreter_half_mean_chunks(simulated_device, poison, small_chunks, monkeypatch, dtype):
    """The mean over three chunks (chunk_mib 3 of 2 KiB units over V=301 half rows of 602 B: 10
    rows, rounded down to 8) in the half dtypes, with a bias, label smoothing and ignored tokens
    (the count is not the rows): the weight and bias gradients add up over the chunks, grad_hidden
    gets each chunk's rows, and the mean's 1/count is applied once, by the kernel (bf16) or after
    the last chunk (fp16, whose kernel writes 4096 x the gradient of the sum)."""
    if simulated_device.arch not in ("sm90", "gfx942"):
        pytest.skip("host-side chunking: two tables (warp sizes 32 and 64) are enough")
    calls = []
    real = fl_ops.ce_rows
    monkeypatch.setattr(fl_ops, "ce_rows", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    h, w, b, t = _inputs(21, 16, 301, dtype, seed=5)
    assert (t == -100).any() and (t != -100).any()
    ref = flce_reference(h, w, b, t, reduction="mean", opts=OPTIONS["smooth"], grad_out=torch.tensor(1.0))
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    loss = F.fused_linear_cross_entropy(hl, wl, t, bl, label_smoothing=0.1, chunk_mib=3)
    loss.backward()
    assert calls == [8, 8, 5]
    assert loss.dtype == torch.float32 and hl.grad.dtype == wl.grad.dtype == bl.grad.dtype == dtype
    for name, out, r in (("loss", loss, ref[0]), ("dhidden", hl.grad, ref[2]), ("dweight", wl.grad, ref[3]),
                         ("dbias", bl.grad, ref[4])):
        assert rel_err(out, r) <= TOL[dtype], (name, rel_err(out, r))


def test_default_chunk_rows():
    """The default chunk: the config's tokens, more where they take under 256 MiB of logits, fewer
    where the logits would take more than the weight gradient; a multiple of 8, at least 1."""
    rows = fl_ops.default_chunk_rows
    assert rows(128256, 4096, 2, 2048) == 2048  # Llama-3 8B: the weight gradient allows 4096
    assert rows(256000, 2304, 2, 2048) == 2048  # Gemma-2 2B: 2304
    assert rows(256000, 1536, 2, 2048) == 1536  # the weight gradient's size
    assert rows(50257, 768, 2, 2048) == 2664  # GPT-2: 256 MiB of logits
    assert rows(32000, 768, 2, 2048) == 4192
    assert rows(10**8, 1, 4, 1024) == 1  # one token's logits pass every budget: still one
    for V, H, e, tokens in [(131071, 1000, 2, 777), (99, 5, 4, 3), (300001, 8191, 2, 4096), (1000, 7, 4, 50)]:
        r = rows(V, H, e, tokens)
        floor = 256 * 2**20 // (V * e)
        assert 1 <= r <= max(tokens, floor) and (r < 8 or r % 8 == 0), (V, H, e, tokens, r)
        assert r == 1 or r * V * e <= max(V * H * e, 256 * 2**20), (V, H, e, tokens, r)


@pytest.mark.interpreter
def test_kernel_interpreter_default_chunk_budget(simulated_device, poison, monkeypatch):
    """Without ``chunk_mib`` the launch takes default_chunk_rows: here (the MiB lowered to 8 B) the
    weight gradient's 3200 B cap the chunk at 8 rows of 400 B."""
    if simulated_device.arch != "sm90":
        pytest.skip("host-side chunking, vendor-independent: one table is enough")
    monkeypatch.setattr(fl_ops, "CHUNK_UNIT", 8)
    calls = []
    real = fl_ops.ce_rows
    monkeypatch.setattr(fl_ops, "ce_rows", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    h, w, b, t = _inputs(18, 8, 100, torch.float32)
    ref = flce_reference(h, w, b, t, reduction="mean", grad_out=torch.tensor(1.0))
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.fused_linear_cross_entropy(hl, wl, t, b)
    loss.backward()
    assert calls == [8, 8, 2]
    for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3])):
        assert rel_err(out, r) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_logit_rows_aligned(simulated_device, poison, monkeypatch):
    """The products run on the vocabulary padded to a multiple of 64 (cuBLAS's aligned kernels):
    the loss kernel sees the first V columns of a chunk whose rows are 320 wide at V 301, and the
    padding changes no result (bias included)."""
    if simulated_device.arch != "sm90":
        pytest.skip("host-side buffer, vendor-independent: one table is enough")
    strides = []
    real = fl_ops.ce_rows
    monkeypatch.setattr(fl_ops, "ce_rows", lambda x, *a, **k: strides.append(x.stride()) or real(x, *a, **k))
    h, w, b, t = _inputs(13, 8, 301, torch.float32)
    ref = flce_reference(h, w, b, t, reduction="sum", grad_out=torch.tensor(1.0))
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    loss = F.fused_linear_cross_entropy(hl, wl, t, bl, reduction="sum")
    loss.backward()
    assert strides == [(320, 1)]
    assert wl.grad.shape == w.shape and bl.grad.shape == b.shape
    for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3]), (bl.grad, ref[4])):
        assert rel_err(out, r) <= 1e-5


def _check_backward_once():
    """mean and sum: one backward (the kernels scale the gradients in place); "none" recomputes
    them, so a second backward is fine and doubles the gradient."""
    h, w, b, t = _inputs(4, 8, 40, torch.float32)
    for reduction in ("mean", "sum"):
        hl = h.clone().requires_grad_()
        loss = F.fused_linear_cross_entropy(hl, w, t, reduction=reduction)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"fused_linear_cross_entropy can run backward only once"):
            loss.backward()
    hl = h.clone().requires_grad_()
    loss = F.fused_linear_cross_entropy(hl, w, t, reduction="none")
    loss.sum().backward(retain_graph=True)
    once = hl.grad.clone()
    loss.sum().backward()
    assert rel_err(hl.grad, 2 * once) <= 1e-6


def test_backward_once_on_the_fallback():
    """The fallback keeps the kernels' rule: code that backpropagates twice fails on the CPU too."""
    _check_backward_once()


@pytest.mark.interpreter
def test_kernel_interpreter_backward_once(simulated_device):
    _check_backward_once()


@pytest.mark.interpreter
def test_kernel_interpreter_compile_fullgraph(simulated_device, small_chunks):
    if simulated_device.arch != "sm90":
        pytest.skip("one table is enough: the custom-op plumbing is vendor-independent")
    fn = torch.compile(F.fused_linear_cross_entropy, fullgraph=True, backend="aot_eager")
    for reduction in ("mean", "none"):
        h, w, b, t = _inputs(10, 8, 100, torch.float32)
        go = torch.randn(10) if reduction == "none" else torch.tensor(1.0)
        ref = flce_reference(h, w, b, t, reduction=reduction, opts=OPTIONS["zloss"], grad_out=go)
        hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
        loss = fn(hl, wl, t, bl, reduction=reduction, lse_square_scale=1e-3)
        (loss * go).sum().backward()
        for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3]), (bl.grad, ref[4])):
            assert rel_err(out, r) <= 1e-5, reduction


def _check_inductor_transposed_weight(device):
    fn = torch.compile(F.fused_linear_cross_entropy, fullgraph=True, backend="inductor")
    for reduction in ("mean", "none"):
        h, w, _, t = _inputs(6, 16, 37, torch.float32, bias=False)
        go = torch.randn(6) if reduction == "none" else torch.tensor(1.0)
        ref = flce_reference(h, w, None, t, reduction=reduction, grad_out=go)
        hl = h.to(device).requires_grad_()
        wt = w.t().contiguous().to(device).requires_grad_()  # (H, V)
        loss = fn(hl, wt.t(), t.to(device), reduction=reduction)
        (loss * go.to(device)).sum().backward()
        for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wt.grad.t(), ref[3])):
            assert rel_err(out.cpu(), r) <= 1e-5, reduction


@pytest.mark.interpreter
@pytest.mark.slow
def test_kernel_interpreter_inductor_transposed_weight(simulated_device, small_chunks):
    """Under Inductor, with the LM head's weight a transposed view (a (H, V) parameter used as
    ``w.t()``): the ops' fake gradients are row-major as the real ones (a fake that kept the
    weight's strides failed Inductor's stride assertions), and the values match float64."""
    if simulated_device.arch != "sm90":
        pytest.skip("one table is enough: the custom-op plumbing is vendor-independent")
    _check_inductor_transposed_weight(torch.device("cpu"))


# --------------------------------------------------------------------------- real GPU


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


# (BT, H, V): the shapes at reduced token counts; odd V; Gemma's vocabulary.
GPU_SHAPES = [(1, 64, 37), (333, 256, 1000), (1024, 4096, 128256), (512, 2304, 256000), (257, 512, 32001)]
HEAVY = pytest.mark.heavy_memory  # float64 weight, its gradient and the logits: 15-25 GiB


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [pytest.param(s, marks=HEAVY) if s[1] * s[2] > 2**28 else s for s in GPU_SHAPES],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kernel_gpu(poison, shape, dtype, reduction):
    i = GPU_SHAPES.index(shape) + DTYPES.index(dtype) + REDUCTIONS.index(reduction)
    opts = list(OPTIONS.values())[i % len(OPTIONS)]
    h, w, b, t = _inputs(*shape, dtype, bias=i % 2 == 0, device=_gpu(), seed=i)
    go = torch.randn(shape[0]) if reduction == "none" else torch.tensor(1.3)
    _run_and_compare(h, w, b, t, dtype, reduction, opts, grad_out=go)


@pytest.mark.gpu
def test_kernel_gpu_memory():
    """Peak extra memory = the gradients + one chunk of logits, independent of BT."""
    dev = _gpu()
    BT, H, V = 4096, 1024, 128256
    h, w, _, t = _inputs(BT, H, V, torch.bfloat16, bias=False, device=dev)
    h.requires_grad_()
    w.requires_grad_()
    cfg = fl_ops.config_for(h, w, None)
    chunk = fl_ops.default_chunk_rows(V, H, 2, cfg.meta["CHUNK_TOKENS"]) * V * 2
    # cuBLAS allocates its workspace (32 MiB on Hopper) through PyTorch's allocator on a stream's
    # first matmul, and keeps it: allocated here, it is not counted as the op's memory whichever
    # test ran first in this process.
    torch.mm(h[:8], w[:8].t())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    F.fused_linear_cross_entropy(h, w, t).backward()
    torch.cuda.synchronize()
    grads = (h.numel() + w.numel()) * 2
    assert torch.cuda.max_memory_allocated() - base <= grads + chunk + 32 * 2**20


@pytest.mark.gpu
def test_kernel_gpu_beyond_int32_elements():
    """BT x V = 16400 x 131072 (2.15e9 > 2**31 logits, never materialised), fp32: the per-token losses
    and the gradients of the last tokens against float64. Only the last 5 tokens get a nonzero
    upstream gradient, so grad_weight is theirs alone and its float64 reference is exact."""
    dev = _gpu()
    BT, H, V = 16400, 64, 131072
    g = torch.Generator(device=dev).manual_seed(3)
    h = torch.randn(BT, H, device=dev, generator=g).requires_grad_()
    w = (torch.randn(V, H, device=dev, generator=g) / H**0.5).requires_grad_()
    t = torch.randint(0, V, (BT,), device=dev, generator=g)
    tail = slice(BT - 5, BT)
    go = torch.zeros(BT, device=dev)
    go[tail] = torch.randn(5, device=dev, generator=g)
    loss = F.fused_linear_cross_entropy(h, w, t, reduction="none")
    (loss * go).sum().backward()

    logits = h[tail].double() @ w.double().T
    lse = torch.logsumexp(logits, dim=-1)
    ref_loss = lse - logits.gather(1, t[tail, None]).squeeze(1)
    d = torch.softmax(logits, dim=-1)
    d[torch.arange(5), t[tail]] -= 1.0
    d *= go[tail, None].double()
    assert rel_err(loss[tail], ref_loss) <= 1e-5
    assert rel_err(h.grad[tail], d @ w.double()) <= 1e-5
    assert rel_err(w.grad, d.T @ h[tail].double()) <= 1e-5
    assert torch.count_nonzero(h.grad[: BT - 5]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("zloss", [0.1, 1e-4])
def test_kernel_gpu_fp16_large_zloss(launches, reduction, zloss):
    """As test_kernel_interpreter_fp16_large_zloss, on the GPU."""
    _check_fp16_large_zloss(_gpu(), launches, reduction, zloss)


@pytest.mark.gpu
def test_inductor_transposed_weight_gpu():
    """As test_kernel_interpreter_inductor_transposed_weight, on the GPU."""
    _check_inductor_transposed_weight(_gpu())


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    h, w, b, t = _inputs(256, 512, 32000, torch.bfloat16, device=_gpu())
    ref = flce_reference(h, w, b, t, opts=OPTIONS["all"])
    hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
    fn = torch.compile(F.fused_linear_cross_entropy, fullgraph=True)
    loss = fn(hl, wl, t, bl, label_smoothing=0.2, lse_square_scale=1e-3, softcap=5.0)
    loss.backward()
    for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3]), (bl.grad, ref[4])):
        assert rel_err(out, r) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_kernel_gpu_chunk_mib(poison, monkeypatch, reduction):
    """``chunk_mib=8`` at V 50257: 80 tokens a chunk, 10 chunks of 777 tokens (the last one
    short), eager and under torch.compile, against float64; the chunk sizes are checked too."""
    sizes = []
    real = fl_ops.ce_rows
    monkeypatch.setattr(fl_ops, "ce_rows", lambda x, *a, **k: sizes.append(x.shape[0]) or real(x, *a, **k))
    h, w, b, t = _inputs(777, 1024, 50257, torch.bfloat16, device=_gpu(), seed=11)
    go = torch.randn(777, device=h.device) if reduction == "none" else torch.tensor(0.9, device=h.device)
    ref = flce_reference(h, w, b, t, reduction=reduction, grad_out=go)
    eager = lambda *a, **k: F.fused_linear_cross_entropy(*a, **k)  # noqa: E731
    for fn in (eager, torch.compile(F.fused_linear_cross_entropy, fullgraph=True)):
        sizes.clear()
        hl, wl, bl = (x.clone().requires_grad_() for x in (h, w, b))
        loss = fn(hl, wl, t, bl, reduction=reduction, chunk_mib=8)
        (loss * go).sum().backward()
        assert sizes == ([80] * 9 + [57]) * (2 if reduction == "none" else 1)
        for out, r in ((loss, ref[0]), (hl.grad, ref[2]), (wl.grad, ref[3]), (bl.grad, ref[4])):
            assert rel_err(out, r) <= TOL[torch.bfloat16]


def test_hidden_size_0_and_non_finite_options_are_argument_errors():
    """Hidden size 0 gets an argument error (it failed in a reshape); a softcap of inf, or past
    float32's range, made every loss NaN: refused, as are non-finite z-loss scales."""
    h, w, b, t = _inputs(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match=r"^hidden must have a non-empty last dimension \(the hidden size\), got shape \(4, 0\)"):
        F.fused_linear_cross_entropy(h[:, :0], w[:, :0], t)
    for bad in (float("inf"), float("nan"), 1e39):
        with pytest.raises(ValueError, match=r"^softcap must be a positive number \(finite"):
            F.fused_linear_cross_entropy(h, w, t, softcap=bad)
        with pytest.raises(ValueError, match=r"^softcap must be a positive number \(finite"):
            F.cross_entropy(h @ w.t(), t, softcap=bad)
    with pytest.raises(ValueError, match=r"^lse_square_scale must be a non-negative number"):
        F.fused_linear_cross_entropy(h, w, t, lse_square_scale=float("inf"))


def test_integers_past_float_and_int64_are_argument_errors():
    """Python ints too large for a float (10**400), or an ignore_index outside int64, are errors naming
    the argument (they were OverflowErrors from deep inside: "int too large to convert to float")."""
    h, w, b, t = _inputs(4, 8, 10, torch.float32)
    x = h @ w.t()
    with pytest.raises(ValueError, match=r"^softcap must be a positive number \(finite"):
        F.fused_linear_cross_entropy(h, w, t, softcap=10**400)
    with pytest.raises(ValueError, match=r"^lse_square_scale must be a non-negative number \(finite"):
        F.cross_entropy(x, t, lse_square_scale=10**400)
    with pytest.raises(ValueError, match=r"^eps must be a non-negative number \(finite"):
        F.rms_norm(h, w[0], 10**400)
    with pytest.raises(ValueError, match=r"^offset must be a number \(finite"):
        F.rms_norm(h, w[0], offset=-(10**400))
    for bad in (2**63, -(2**63) - 1, 2**70):
        with pytest.raises(ValueError, match=r"^ignore_index must fit in int64 \(the targets' dtype\)"):
            F.cross_entropy(x, t, ignore_index=bad)
        with pytest.raises(ValueError, match=r"^ignore_index must fit in int64"):
            F.fused_linear_cross_entropy(h, w, t, ignore_index=bad)
    assert torch.isfinite(F.cross_entropy(x, t, ignore_index=2**63 - 1))  # int64's largest: fine


def test_numpy_scalars_are_numbers():
    """Options given as NumPy scalars are taken as the Python numbers they stand for."""
    np = pytest.importorskip("numpy")
    h, w, b, t = _inputs(6, 8, 10, torch.float32)
    t[1] = -100
    ref = F.fused_linear_cross_entropy(h, w, t, softcap=5.0, label_smoothing=0.1, lse_square_scale=1e-3)
    got = F.fused_linear_cross_entropy(
        h, w, t, ignore_index=np.int64(-100), softcap=np.float32(5.0), label_smoothing=np.float64(0.1),
        lse_square_scale=np.float32(1e-3), chunk_mib=np.int32(8),
    )
    assert rel_err(got, ref) <= 1e-6
    x, wn = torch.randn(3, 8), torch.rand(8)
    assert torch.equal(F.rms_norm(x, wn, np.float32(1e-6), offset=np.float64(0.0)), F.rms_norm(x, wn, 1e-6))
    with pytest.raises(TypeError, match=r"^ignore_index must be an int"):
        F.fused_linear_cross_entropy(h, w, t, ignore_index=np.float32(-100))
    with pytest.raises(TypeError, match=r"^ignore_index must be an int"):
        F.fused_linear_cross_entropy(h, w, t, ignore_index=np.bool_(True))
