"""LayerNorm: fallback, Triton kernels (interpreter with each vendor's configs; real GPU), API edges.

Every check compares against the fallback run in float64 on fresh random inputs (never zeros),
forward and all gradients (x, weight, bias), with the dtype's tolerance (fp32 1e-5, bf16/fp16
1e-2); the fallback itself is checked against ``torch.nn.functional.layer_norm``.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import liger_portable
from liger_portable import fallback
from liger_portable import functional as F
from liger_portable import nn as lnn

from conftest import TOL, beyond_int32_rows, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def _inputs(shape, dtype, device="cpu", seed=0, bias=True, loc=0.3):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + loc).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    b = torch.randn(shape[-1], generator=g).to(dtype) if bias else None
    dy = torch.randn(shape, generator=g).to(dtype)
    return x.to(device), w.to(device), (None if b is None else b.to(device)), dy.to(device)


def _leaf(t):
    return None if t is None else t.detach().double().cpu().requires_grad_()


def _reference(x, w, b, dy, eps):
    xd, wd, bd = _leaf(x), _leaf(w), _leaf(b)
    y = fallback.layer_norm(xd, wd, bd, eps)
    y.backward(dy.double().cpu())
    return y, xd.grad, wd.grad, (None if bd is None else bd.grad)


def _check(y, x, w, b, dy, eps, tol):
    ry, rdx, rdw, rdb = _reference(x, w, b, dy, eps)
    assert rel_err(y, ry) <= tol, ("y", rel_err(y, ry))
    assert rel_err(x.grad, rdx) <= tol, ("dx", rel_err(x.grad, rdx))
    assert rel_err(w.grad, rdw) <= tol, ("dw", rel_err(w.grad, rdw))
    if b is not None:
        assert rel_err(b.grad, rdb) <= tol, ("db", rel_err(b.grad, rdb))


def _run_and_compare(x, w, b, dy, dtype, eps=EPS):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    y = F.layer_norm(x, w, b, eps)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    _check(y, x, w, b, dy, eps, TOL[dtype])
    assert w.grad.dtype == w.dtype and w.grad.shape == w.shape
    if b is not None:
        assert b.grad.dtype == b.dtype and b.grad.shape == b.shape


# --------------------------------------------------------------------------- fallback (CPU path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 96), (17, 4097)])
def test_fallback_matches_float64(shape, dtype, bias):
    x, w, b, dy = _inputs(shape, dtype, bias=bias)
    _run_and_compare(x, w, b, dy, dtype)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fallback_float64_is_torch_layer_norm(bias):
    """In float64 the fallback and torch.nn.functional.layer_norm agree to rounding, gradients too."""
    x, w, b, dy = _inputs((6, 3, 77), torch.float64, bias=bias)
    ours = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    fallback.layer_norm(ours[0], ours[1], ours[2] if bias else None, EPS).backward(dy)
    ref = torch.nn.functional.layer_norm(theirs[0], (77,), theirs[1], theirs[2] if bias else None, EPS)
    ref.backward(dy)
    assert rel_err(fallback.layer_norm(x, w, b, EPS), ref) <= 1e-13
    for a, t in zip(ours, theirs):
        assert rel_err(a.grad, t.grad) <= 1e-13


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_low_precision_close_to_torch(dtype):
    """In fp32 / bf16 / fp16 both compute in fp32 and cast once: within the dtype's tolerance."""
    x, w, b, _ = _inputs((5, 300), dtype)
    ref = torch.nn.functional.layer_norm(x, (300,), w, b, EPS)
    assert rel_err(fallback.layer_norm(x, w, b, EPS), ref) <= TOL[dtype]


def test_float64_runs_fallback():
    x, w, b, dy = _inputs((3, 10), torch.float64)
    _run_and_compare(x, w, b, dy, torch.float64)


def test_nan_in_nan_out_only_in_that_row():
    x, w, b, _ = _inputs((3, 16), torch.float32)
    x[1, 4] = float("nan")
    y = F.layer_norm(x, w, b)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


def test_empty_input():
    y = F.layer_norm(torch.empty(0, 8), torch.ones(8), torch.zeros(8))
    assert y.shape == (0, 8)


# --------------------------------------------------------------------------- bad input


def test_integer_input_names_x():
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor"):
        F.layer_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(4))


def test_integer_weight_names_weight():
    with pytest.raises(TypeError, match=r"weight must be a floating-point tensor"):
        F.layer_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.int32))


def test_integer_bias_names_bias():
    with pytest.raises(TypeError, match=r"bias must be a floating-point tensor"):
        F.layer_norm(torch.ones(2, 4), torch.ones(4), torch.zeros(4, dtype=torch.int64))


def test_missing_weight():
    with pytest.raises(TypeError, match=r"weight is required"):
        F.layer_norm(torch.ones(2, 4), None)


def test_weight_size_mismatch():
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        F.layer_norm(torch.ones(2, 4), torch.ones(5))


def test_bias_size_mismatch():
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        F.layer_norm(torch.ones(2, 4), torch.ones(4), torch.zeros(2, 4))


def test_bias_of_two_dims_is_refused():
    """A (4, 4) bias has the right first dimension but is not (hidden,)."""
    with pytest.raises(ValueError, match=r"^bias must have shape \(4,\) to match the last dimension of x \(2, 4\), got \(4, 4\)"):
        F.layer_norm(torch.ones(2, 4), torch.ones(4), torch.zeros(4, 4))


def test_scalar_input():
    with pytest.raises(ValueError, match=r"x must have at least one dimension"):
        F.layer_norm(torch.tensor(1.0), torch.ones(1))


def test_negative_eps():
    with pytest.raises(ValueError, match=r"eps must be a non-negative number"):
        F.layer_norm(torch.ones(2, 4), torch.ones(4), eps=-1.0)


def test_devices_differ():
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        F.layer_norm(torch.ones(2, 4), torch.ones(4, device="meta"))
    with pytest.raises(ValueError, match=r"bias is on meta but x is on cpu"):
        F.layer_norm(torch.ones(2, 4), torch.ones(4), torch.zeros(4, device="meta"))


# --------------------------------------------------------------------------- module


def test_module_is_torch_layer_norm_drop_in():
    torch.manual_seed(0)
    ours, theirs = lnn.LayerNorm(48, eps=1e-6), torch.nn.LayerNorm(48, eps=1e-6)
    assert isinstance(ours, torch.nn.LayerNorm)
    assert ours.normalized_shape == theirs.normalized_shape == (48,)
    assert (ours.eps, ours.elementwise_affine) == (theirs.eps, theirs.elementwise_affine)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight", "bias"]
    assert torch.equal(ours.weight, torch.ones(48)) and torch.equal(ours.bias, torch.zeros(48))
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x, _, _, _ = _inputs((2, 3, 48), torch.float32)
    assert rel_err(ours(x), theirs(x)) <= 1e-5
    assert repr(ours) == repr(theirs)


def test_module_variants():
    x, _, _, _ = _inputs((4, 16), torch.float32)
    nobias = lnn.LayerNorm((16,), bias=False)
    assert nobias.bias is None and list(nobias.state_dict()) == ["weight"]
    ref = torch.nn.functional.layer_norm(x, (16,), nobias.weight)
    assert rel_err(nobias(x), ref) <= 1e-5
    plain = lnn.LayerNorm(16, elementwise_affine=False)
    assert plain.weight is None and list(plain.state_dict()) == []
    assert rel_err(plain(x), torch.nn.functional.layer_norm(x, (16,))) <= 1e-5
    half = lnn.LayerNorm(16, dtype=torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and half(x.bfloat16()).dtype == torch.bfloat16


def test_module_rejects_several_dims():
    with pytest.raises(ValueError, match=r"normalized_shape must be an int or a 1-tuple"):
        lnn.LayerNorm((4, 8))


def test_module_rejects_bool_normalized_shape():
    """True has __index__ (it would be a hidden size of 1): refused as a mistake, bare or in a tuple."""
    for shape in (True, (True,)):
        with pytest.raises(ValueError, match=r"^normalized_shape must be an int or a 1-tuple"):
            lnn.LayerNorm(shape)


# --------------------------------------------------------------------------- torch.compile (CPU path)


def test_compile_fullgraph_cpu():
    x, w, b, dy = _inputs((5, 40), torch.float32)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    fn = torch.compile(F.layer_norm, fullgraph=True, backend="aot_eager")
    y = fn(x, w, b, EPS)
    y.backward(dy)
    _check(y, x, w, b, dy, EPS, 1e-5)


# --------------------------------------------------------------------------- Triton interpreter, every vendor's configs

# Odd sizes; rows that straddle BLOCK_M; one row; rows longer than every table's BLOCK_N_MAX
# (looped path) and longer than 65536.
KERNEL_SHAPES = [(1, 37), (19, 200), (6, 1000), (3, 4096), (2, 20000), (1, 70001)]


# Every shape and dtype with a bias; without one (the other constexpr branch) in bf16 over every
# shape but the longest (kept to the CI budget).
KERNEL_CASES = [(s, d, True) for s in KERNEL_SHAPES for d in DTYPES] + [
    (s, torch.bfloat16, False) for s in KERNEL_SHAPES[:-1]
]


@pytest.mark.interpreter
@pytest.mark.parametrize("trainable", ["none", "weight", "bias", "both"])
def test_kernel_interpreter_frozen_parameters(simulated_device, poison, partial_sums, monkeypatch, trainable):
    """Weight and bias each trainable or frozen (as in LoRA): dx as the reference, a gradient in
    its own dtype for each trainable parameter only, and no sum of the partials (in the launch or
    after it) when neither is."""
    x, w, b, dy = _inputs((37, 130), torch.bfloat16)
    b = b.float()  # a bias of another dtype than the weight
    w.requires_grad_(trainable in ("weight", "both"))
    b.requires_grad_(trainable in ("bias", "both"))
    x.requires_grad_()
    calls, launches = [], []
    ops = importlib.import_module("liger_portable.ops.layer_norm")  # the sums of the partials, spied on
    real, launch = ops.sum_partials, ops.launch_bwd
    monkeypatch.setattr(ops, "sum_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ops, "launch_bwd", lambda g, a, c, o: launches.append(c.get("FUSE_SUM", False)) or launch(g, a, c, o))
    F.layer_norm(x, w, b, EPS).backward(dy)
    ry, rdx, rdw, rdb = _reference(x, w, b, dy, EPS)
    assert rel_err(x.grad, rdx) <= TOL[torch.bfloat16]
    summed = trainable != "none"
    in_launch = partial_sums == "summed in the launch"
    assert launches == [summed and in_launch] and len(calls) == (summed and not in_launch)
    for t, ref, on in ((w, rdw, trainable in ("weight", "both")), (b, rdb, trainable in ("bias", "both"))):
        if on:
            assert t.grad.dtype == t.dtype and rel_err(t.grad, ref) <= TOL[torch.bfloat16]
        else:
            assert t.grad is None


@pytest.mark.interpreter
@pytest.mark.parametrize("parts,n_cols", [(1, 5), (64, 128), (150, 301)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d).removeprefix("torch."))
def test_kernel_interpreter_sum_partials(simulated_device, poison, parts, n_cols, dtype):
    """The backward's partial sums (one part per backward program, over several of the sum's row
    blocks and column blocks): each column summed in fp32 and rounded once to its output's dtype;
    with a bias the columns split into the weight's and the bias's gradient, each in its dtype."""
    ops = importlib.import_module("liger_portable.ops.layer_norm")
    partial = torch.randn(parts, 2 * n_cols, dtype=torch.float32) * 3 + 1
    ref = partial.double().sum(0)
    dw = ops.empty((n_cols,), dtype=dtype)  # NaN under the poison fixture
    ops.sum_partials(partial[:, :n_cols].contiguous(), n_cols, dw, None)
    # fp32: the sum's own rounding only; bf16/fp16: one rounding of it (within half an ulp, 2**-9
    # or 2**-12 of each element, so within the dtype's tolerance in norm)
    tol = 1e-6 if dtype == torch.float32 else TOL[dtype]
    assert rel_err(dw, ref[:n_cols]) <= tol
    slack = 1e-6 * partial[:, :n_cols].double().abs().sum(0)  # the fp32 sum's own error
    assert ((dw.double() - ref[:n_cols]).abs() <= ref[:n_cols].abs() * torch.finfo(dtype).eps + slack).all()
    dw, db = ops.empty((n_cols,), dtype=dtype), ops.empty((n_cols,), dtype=torch.float32)
    ops.sum_partials(partial, n_cols, dw, db)
    assert dw.dtype == dtype and db.dtype == torch.float32
    assert rel_err(dw, ref[:n_cols]) <= tol
    assert rel_err(db, ref[n_cols:]) <= 1e-6


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "shape,dtype,bias", KERNEL_CASES,
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else (
        str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else ("bias" if v else "nobias")),
)
def test_kernel_interpreter(simulated_device, poison, partial_sums, shape, dtype, bias):
    x, w, b, dy = _inputs(shape, dtype, seed=sum(shape), bias=bias)
    _run_and_compare(x, w, b, dy, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(19, 200), (2, 20000)], ids=["registers", "looped"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_kernel_interpreter_sum_in_launch_resets_its_count(simulated_device, poison, shape, bias):
    """The backward that sums its partials in the launch leaves the arrival count in the forward's
    statistics at zero, so a second backward over the same graph (and the tuner's repeated launches)
    gives the same gradients, to the bit."""
    x, w, b, dy = _inputs(shape, torch.float32, bias=bias)
    params = [x, w] + ([b] if bias else [])
    for t in params:
        t.requires_grad_()
    y = F.layer_norm(x, w, b, EPS)
    grads = []
    for _ in range(3):
        for t in params:
            t.grad = None
        y.backward(dy, retain_graph=True)
        grads.append([t.grad for t in params])
    ry, rdx, rdw, rdb = _reference(x, w, b, dy, EPS)
    assert rel_err(grads[0][1], rdw) <= TOL[torch.float32]
    assert not bias or rel_err(grads[0][2], rdb) <= TOL[torch.float32]
    assert all(torch.equal(g, h) for later in grads[1:] for g, h in zip(later, grads[0]))


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(5, 300), (2, 20000)], ids=["registers", "looped"])
def test_kernel_interpreter_large_mean(simulated_device, poison, shape):
    """Mean 50 x the spread: a variance taken as E[x**2] - mean**2 loses about 1e-4 to cancellation
    in fp32; the centred variance keeps the fp32 tolerance. (Far larger offsets exceed 1e-5 for any
    fp32 implementation, torch's included: the fp32 mean itself rounds at that scale.)"""
    x, w, b, dy = _inputs(shape, torch.float32, loc=100.0)
    _run_and_compare(x, w, b, dy, torch.float32)


@pytest.mark.interpreter
def test_kernel_interpreter_strided_input(simulated_device, poison):
    """Row stride larger than the row (a column slice) and a transposed (non-unit stride) input."""
    base, w, b, _ = _inputs((9, 300), torch.float32)
    x = base[:, :250]
    assert x.stride() == (300, 1)
    _run_and_compare(x, w[:250].contiguous(), b[:250].contiguous(), torch.randn(9, 250), torch.float32)
    xt = torch.randn(64, 7).t()  # stride (1, 7)
    _run_and_compare(xt, w[:64].contiguous(), None, torch.randn(7, 64).t().contiguous().t(), torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("compute_units", [96, 1], ids=["96 CUs", "1 CU"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_kernel_interpreter_looped_multirow_config(poison, bias, compute_units):
    """Explicit configs (as the tuner passes them): several rows per program on the looped path,
    rows and columns that straddle the blocks. With 96 compute units each of the four backward
    row blocks has a program of its own; with one, a single program walks all four and its weight
    and bias gradient partials must add up over them (the 96-unit case cannot tell a partial
    overwritten by each row block from one accumulated)."""
    import dataclasses

    from liger_portable.configs import make_resolved
    from liger_portable import simulate
    from liger_portable.ops import layer_norm as ops

    from conftest import SIMULATED_DEVICES

    x, w, b, dy = _inputs((7, 300), torch.float16, bias=bias)
    fwd = make_resolved("layer_norm_fwd", {"num_warps": 2, "BLOCK_M": 4, "BLOCK_N_MAX": 128})
    bwd = make_resolved("layer_norm_bwd", {"num_warps": 2, "BLOCK_M": 2, "BLOCK_N_MAX": 128, "PROGRAMS_PER_CU": 1})
    with simulate(dataclasses.replace(SIMULATED_DEVICES["rocm-rdna"], compute_units=compute_units)):
        y, mean, rstd = ops.layer_norm_fwd(x, w, b, EPS, config=fwd)
        dx, dw, db = ops.layer_norm_bwd(dy, x, w, b, mean, rstd, config=bwd)
    ry, rdx, rdw, rdb = _reference(x, w, b, dy, EPS)
    assert rel_err(y, ry) <= 1e-2 and rel_err(dx, rdx) <= 1e-2 and rel_err(dw, rdw) <= 1e-2
    assert db is None if b is None else rel_err(db, rdb) <= 1e-2
    xd = x.double()
    assert rel_err(mean, xd.mean(-1)) <= 1e-6
    assert rel_err(rstd[:-1], torch.rsqrt(xd.var(-1, unbiased=False) + EPS)) <= 1e-6
    assert rstd.shape == (8,) and rstd[-1].item() == 0.0  # the backward's count, zero between launches


@pytest.mark.interpreter
@pytest.mark.parametrize("n_cols,split", [(1100, (1024, 128)), (2880, (2048, 1024)), (600, (512, 128)), (4096, (4096, 0))])
@pytest.mark.parametrize("block_m", [1, 2])
def test_kernel_interpreter_tail_tile_and_persistent_loop(poison, n_cols, split, block_m):
    """Rows held as a power-of-two tile plus a tail tile (the split is checked), on a device of 3
    compute units: each backward program walks several row blocks (the next block's loads are issued
    before the current one is reduced), the last program fewer than the others."""
    import dataclasses

    from liger_portable.configs import make_resolved
    from liger_portable import simulate
    from liger_portable.ops import layer_norm as ops

    from conftest import SIMULATED_DEVICES

    assert ops.split_row(n_cols, 16384) == (*split, True)
    x, w, b, dy = _inputs((23, n_cols), torch.float32, seed=n_cols)
    fwd = make_resolved("layer_norm_fwd", {"num_warps": 4, "BLOCK_M": block_m, "BLOCK_N_MAX": 16384})
    bwd = make_resolved("layer_norm_bwd", {"num_warps": 4, "BLOCK_M": block_m, "BLOCK_N_MAX": 16384, "PROGRAMS_PER_CU": 1})
    with simulate(dataclasses.replace(SIMULATED_DEVICES["cuda-sm90"], compute_units=3)):
        y, mean, rstd = ops.layer_norm_fwd(x, w, b, EPS, config=fwd)
        dx, dw, db = ops.layer_norm_bwd(dy, x, w, b, mean, rstd, config=bwd)
    ry, rdx, rdw, rdb = _reference(x, w, b, dy, EPS)
    for out, ref in ((y, ry), (dx, rdx), (dw, rdw), (db, rdb)):
        assert rel_err(out, ref) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_expanded_grad(simulated_device, poison):
    """``y.sum().backward()`` hands the backward a stride-0 gradient."""
    x, w, b, _ = _inputs((5, 70), torch.float32)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = F.layer_norm(x, w, b)
    y.sum().backward()
    _check(y, x, w, b, torch.ones(5, 70), EPS, 1e-5)


@pytest.mark.interpreter
def test_kernel_interpreter_3d_and_param_dtype(simulated_device, poison):
    """A (batch, seq, hidden) input, and fp32 weight and bias with a bf16 input (mixed precision)."""
    x, _, _, dy = _inputs((2, 3, 130), torch.bfloat16)
    w, b = torch.rand(130) + 0.5, torch.randn(130)
    _run_and_compare(x, w, b, dy, torch.bfloat16)


@pytest.mark.interpreter
def test_kernel_interpreter_matches_torch(simulated_device, poison):
    """The kernels against torch.nn.functional.layer_norm (fp32, autograd on both)."""
    x, w, b, dy = _inputs((7, 333), torch.float32, seed=3)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(*ours, 1e-6)
    y.backward(dy)
    ref = torch.nn.functional.layer_norm(theirs[0], (333,), theirs[1], theirs[2], 1e-6)
    ref.backward(dy)
    assert rel_err(y, ref) <= 1e-5
    for a, t in zip(ours, theirs):
        assert rel_err(a.grad, t.grad) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_module(simulated_device, poison):
    m = lnn.LayerNorm(96)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.normal_()
    x, _, _, dy = _inputs((4, 96), torch.float32, seed=5)
    x.requires_grad_()
    m(x).backward(dy)
    _check(m(x), x, m.weight, m.bias, dy, m.eps, 1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_kernel_interpreter_compile_fullgraph(simulated_device, bias):
    """The kernel path is a custom op: torch.compile(fullgraph=True) traces it without a break."""
    x, w, b, dy = _inputs((4, 96), torch.float32, bias=bias)
    x, w = x.requires_grad_(), w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    fn = torch.compile(F.layer_norm, fullgraph=True, backend="aot_eager")
    y = fn(x, w, b, EPS)
    y.backward(dy)
    _check(y, x, w, b, dy, EPS, 1e-5)


# --------------------------------------------------------------------------- real GPU


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 37), (333, 1000), (1000, 2880), (2048, 4096), (257, 5120), (64, 8192), (7, 20000), (3, 70001), (4, 131072)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_kernel_gpu(poison, shape, dtype, bias):
    x, w, b, dy = _inputs(shape, dtype, device=_gpu(), seed=sum(shape), bias=bias)
    _run_and_compare(x, w, b, dy, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(200, 1024), (2048, 4096), (7, 20000)], ids=lambda s: "x".join(map(str, s)))
def test_kernel_gpu_partial_sums_repeated(poison, partial_sums, shape):
    """As RMSNorm's: twenty backwards over one graph give the reference's weight and bias
    gradients, each equal to the first to the bit."""
    x, w, b, dy = _inputs(shape, torch.bfloat16, device=_gpu(), seed=sum(shape))
    for t in (x, w, b):
        t.requires_grad_()
    y = F.layer_norm(x, w, b, EPS)
    grads = []
    for _ in range(20):
        w.grad = b.grad = None
        y.backward(dy, retain_graph=True)
        grads.append((w.grad, b.grad))
    _, _, rdw, rdb = _reference(x, w, b, dy, EPS)
    assert rel_err(grads[0][0], rdw) <= TOL[torch.bfloat16] and rel_err(grads[0][1], rdb) <= TOL[torch.bfloat16]
    assert all(torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1]) for g in grads[1:])


@pytest.mark.gpu
def test_kernel_gpu_large_mean(poison):
    x, w, b, dy = _inputs((64, 70001), torch.float32, device=_gpu(), loc=100.0)
    _run_and_compare(x, w, b, dy, torch.float32)
    x, w, b, dy = _inputs((300, 4096), torch.float32, device=_gpu(), loc=100.0)
    _run_and_compare(x, w, b, dy, torch.float32)


@pytest.mark.gpu
def test_kernel_gpu_strided_and_mixed():
    dev = _gpu()
    base, w, b, _ = _inputs((513, 4096 + 64), torch.bfloat16, device=dev)
    x = base[:, :4096]
    dy = torch.randn(513, 4096, device=dev, dtype=torch.bfloat16).t().contiguous().t()  # non-unit stride grad
    _run_and_compare(x, w[:4096].contiguous(), b[:4096].contiguous(), dy, torch.bfloat16)
    _run_and_compare(x, w[:4096].float(), b[:4096].float(), dy, torch.bfloat16)


@pytest.mark.gpu
def test_kernel_gpu_matches_torch():
    x, w, b, dy = _inputs((1024, 2880), torch.bfloat16, device=_gpu())
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    F.layer_norm(*ours).backward(dy)
    torch.nn.functional.layer_norm(theirs[0], (2880,), theirs[1], theirs[2]).backward(dy)
    for a, t in zip(ours, theirs):
        assert rel_err(a.grad, t.grad) <= 1e-2


@pytest.mark.gpu
@pytest.mark.big_memory
def test_kernel_gpu_beyond_int32_offsets():
    """More than 2**31 elements: the last rows must be right (int64 row offsets)."""
    dev = _gpu()
    n_cols = 4096
    n_rows = 2**31 // n_cols + 5
    x = torch.randn(n_rows, n_cols, device=dev, dtype=torch.bfloat16)
    w = (torch.rand(n_cols, device=dev) + 0.5).to(torch.bfloat16)
    b = torch.randn(n_cols, device=dev).to(torch.bfloat16)
    y = F.layer_norm(x, w, b)
    tail = slice(n_rows - 7, n_rows)
    ref = fallback.layer_norm(x[tail].double(), w.double(), b.double(), EPS)
    assert rel_err(y[tail], ref) <= 1e-2
    del y
    x.requires_grad_()
    dy = torch.randn_like(x)
    F.layer_norm(x, w, b).backward(dy)
    xd = x[tail].detach().double().requires_grad_()
    fallback.layer_norm(xd, w.double(), b.double(), EPS).backward(dy[tail].double())
    assert rel_err(x.grad[tail], xd.grad) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_compile_fullgraph_gpu(bias):
    dev = _gpu()
    x, w, b, dy = _inputs((64, 512), torch.bfloat16, device=dev, bias=bias)
    x, w = x.requires_grad_(), w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    fn = torch.compile(F.layer_norm, fullgraph=True)
    y = fn(x, w, b, EPS)
    y.backward(dy)
    _check(y, x, w, b, dy, EPS, 1e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("n_cols", [300, 2880])
def test_kernel_interpreter_nan_row_stays_in_its_row(poison, n_cols):
    """A NaN in row 101 of x: y and dx of that row are NaN, every other row finite and right, on a
    3-compute-unit device where each backward program walks several row blocks, loading the next
    (row 101 is some program's next while it reduces an earlier one) before reducing the current."""
    import dataclasses

    from liger_portable import simulate

    from conftest import SIMULATED_DEVICES

    x, w, b, dy = _inputs((150, n_cols), torch.float32, seed=n_cols)
    x[101, 7] = float("nan")
    xl = x.clone().requires_grad_()
    with simulate(dataclasses.replace(SIMULATED_DEVICES["cuda-sm90"], compute_units=3)):
        y = F.layer_norm(xl, w, b, EPS)
        y.backward(dy)
    ok = [r for r in range(150) if r != 101]
    assert torch.isnan(y[101]).all() and torch.isnan(xl.grad[101]).all()
    ry, rdx, _, _ = _reference(x[ok], w, b, dy[ok], EPS)
    assert rel_err(y[ok], ry) <= 1e-5 and rel_err(xl.grad[ok], rdx) <= 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("n", [48, 20000], ids=["registers", "looped"])
def test_kernel_interpreter_beyond_int32_offsets(simulated_device, poison, n):
    """Rows of x and dy that start beyond 2**31 elements (see beyond_int32_rows): y, dx, dw and db right
    in every row, so the kernels' row offsets are int64."""
    rows = 9
    x = beyond_int32_rows(rows, n, scale=2.0, shift=0.3).requires_grad_()
    dy = beyond_int32_rows(rows, n, seed=1)
    w = (torch.rand(n) + 0.5).to(torch.bfloat16).requires_grad_()
    b = torch.randn(n).to(torch.bfloat16).requires_grad_()
    y = F.layer_norm(x, w, b, EPS)
    y.backward(dy)
    _check(y, x, w, b, dy, EPS, 1e-2)
    ry, rdx, _, _ = _reference(x, w, b, dy, EPS)
    assert rel_err(y[-2:], ry[-2:]) <= 1e-2 and rel_err(x.grad[-2:], rdx[-2:]) <= 1e-2


def _check_eps_case(n):
    """x with a variance smaller than eps (1e-6 against 1e-5) against the float64 formula written out
    (not the fallback): eps dropped, or outside the root, is far off (the default inputs hide it)."""
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(5, n, generator=g) * 1e-3 + 0.01, torch.randn(5, n, generator=g)
    w, b = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    xc = xd - xd.mean(-1, keepdim=True)
    ref = xc / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + EPS) * wd + bd
    ref.backward(dy.double())
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    y = F.layer_norm(x, w, b, EPS)
    y.backward(dy)
    for name, out, r in zip(("y", "dx", "dw", "db"), (y, x.grad, w.grad, b.grad), (ref, xd.grad, wd.grad, bd.grad)):
        assert rel_err(out, r) <= 1e-5, (name, rel_err(out, r))


def test_fallback_eps_where_it_matters():
    _check_eps_case(300)


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("n", [300, 20000], ids=["registers", "looped"])
def test_kernel_interpreter_eps_where_it_matters(simulated_device, poison, n):
    _check_eps_case(n)
