"""SwiGLU / GeGLU: fallback, Triton kernels (interpreter with each vendor's configs; real GPU),
both backward modes (out of place; in place over a and b), the MLP modules, API edges.

Kernel checks compare against the fallback run in float64 on fresh random inputs (never zeros):
the output and both gradients, with the dtype's tolerance (fp32 1e-5, bf16/fp16 1e-2). The
fallback itself is checked against explicit float64 formulas and against torch's silu / gelu.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import liger_portable
from liger_portable import fallback
from liger_portable import functional as F
from liger_portable import nn as lnn

from conftest import SIMULATED_DEVICES, TOL, beyond_int32_rows, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACTS = ["swiglu", "geglu"]
_ids = {"dtype": lambda d: str(d).removeprefix("torch.")}


def _inputs(shape, dtype, device="cpu", seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(shape, generator=g) * scale + 0.1).to(dtype)
    b = (torch.randn(shape, generator=g) + 0.1).to(dtype)
    dc = torch.randn(shape, generator=g).to(dtype)
    return a.to(device), b.to(device), dc.to(device)


def _reference(act, a, b, dc):
    ad = a.detach().double().cpu().requires_grad_()
    bd = b.detach().double().cpu().requires_grad_()
    c = getattr(fallback, act)(ad, bd)
    c.backward(dc.double().cpu())
    return c.detach(), ad.grad, bd.grad


def _run_and_compare(act, a, b, dc, inplace=False, copy=True):
    """Forward + backward through the public API on leaf copies of a and b (``copy=False``: on a
    and b themselves, which must require grad); checks against float64. Returns the tensors the
    gradients were taken of, for further checks. In place, the copies are passed as activations
    (times one: in place refuses a leaf's storage), whose gradients are the leaves' exactly."""
    ref = _reference(act, a, b, dc)  # before the call: an in-place backward overwrites a and b
    if copy:
        a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    args = (a * 1, b * 1) if inplace and copy else (a, b)
    c = getattr(F, act)(*args, inplace_backward=inplace)
    assert c.dtype == a.dtype and c.shape == a.shape
    c.backward(dc)
    _assert_close(act, (c, a.grad, b.grad), ref, a.dtype)
    return a, b


def _assert_close(act, outs, refs, dtype):
    tol = TOL[dtype]
    for name, out, ref in zip(("c", "da", "db"), outs, refs):
        assert out.dtype == dtype, (act, name, out.dtype)
        err = rel_err(out, ref)
        assert err <= tol, (act, name, err)


# --------------------------------------------------------------------------- fallback (CPU path)


def _silu64(a):
    return a / (1 + torch.exp(-a))


def _gelu_tanh64(a):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


def _dsilu64(a):
    s = 1 / (1 + torch.exp(-a))
    return s + a * s * (1 - s)


def _dgelu_tanh64(a):
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (a + 0.044715 * a**3))
    return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k * (1 + 3 * 0.044715 * a * a)


FORMULAS = {"swiglu": (_silu64, _dsilu64), "geglu": (_gelu_tanh64, _dgelu_tanh64)}


@pytest.mark.parametrize("act", ACTS)
def test_fallback_float64_is_the_formula(act):
    """Forward and both gradients against the activation and its derivative written out."""
    a, b, dc = _inputs((7, 33), torch.float64, scale=3.0)
    f, df = FORMULAS[act]
    c, da, db = _reference(act, a, b, dc)
    assert rel_err(c, f(a) * b) <= 1e-13
    assert rel_err(da, dc * b * df(a)) <= 1e-13
    assert rel_err(db, dc * f(a)) <= 1e-13


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
def test_fallback_is_torch_activation(dtype):
    """In every dtype the CPU path is ``silu(a) * b`` / ``gelu(a, approximate="tanh") * b`` bit for
    bit (Hugging Face's LlamaMLP / GemmaMLP product), with the same gradients."""
    a, b, dc = _inputs((5, 64), dtype)
    torch_fns = {
        "swiglu": lambda a, b: torch.nn.functional.silu(a) * b,
        "geglu": lambda a, b: torch.nn.functional.gelu(a, approximate="tanh") * b,
    }
    for act, fn in torch_fns.items():
        outs = []
        for f in (getattr(F, act), fn):
            a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
            c = f(a1, b1)
            c.backward(dc)
            outs.append((c, a1.grad, b1.grad))
        for x, y in zip(*outs):
            assert torch.equal(x, y), act


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 96), (17, 4097)])
def test_fallback_matches_float64(shape, dtype, act):
    a, b, dc = _inputs(shape, dtype)
    _run_and_compare(act, a, b, dc)
    _run_and_compare(act, a, b, dc, inplace=True)  # the fallback keeps a and b; the result is the same


def test_float64_runs_fallback():
    a, b, dc = _inputs((3, 10), torch.float64)
    for act in ACTS:
        c = getattr(F, act)(a, b)
        assert c.dtype == torch.float64 and rel_err(c, _reference(act, a, b, dc)[0]) <= 1e-15


def test_empty_and_scalar():
    for act in ACTS:
        assert getattr(F, act)(torch.empty(0, 8), torch.empty(0, 8)).shape == (0, 8)
        a, b = torch.tensor(0.7), torch.tensor(-1.3)
        assert rel_err(getattr(F, act)(a, b), getattr(fallback, act)(a.double(), b.double())) <= 1e-6


def test_nan_stays_in_its_element():
    a, b, _ = _inputs((3, 16), torch.float32)
    a[1, 4] = float("nan")
    for act in ACTS:
        c = getattr(F, act)(a, b)
        assert torch.isnan(c[1, 4]) and torch.isfinite(c).sum() == c.numel() - 1


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("act", ACTS)
def test_integer_inputs_name_the_argument(act):
    fn = getattr(F, act)
    with pytest.raises(TypeError, match=r"^a must be a floating-point tensor"):
        fn(torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4))
    with pytest.raises(TypeError, match=r"^b must be a floating-point tensor"):
        fn(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"^b must be a torch.Tensor"):
        fn(torch.ones(2, 4), [1.0])


@pytest.mark.parametrize("act", ACTS)
def test_mismatches_name_the_argument(act):
    fn = getattr(F, act)
    with pytest.raises(ValueError, match=r"^b must have the shape of a \(2, 4\).*got \(4,\)"):
        fn(torch.ones(2, 4), torch.ones(4))
    with pytest.raises(TypeError, match=r"^b has dtype torch.float16 but a has torch.float32"):
        fn(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^b is on meta but a is on cpu"):
        fn(torch.ones(2, 4), torch.ones(2, 4, device="meta"))
    with pytest.raises(TypeError, match=r"^inplace_backward must be True or False"):
        fn(torch.ones(2, 4), torch.ones(2, 4), inplace_backward=1)


# --------------------------------------------------------------------------- in-place safety (host logic)


def test_can_write_in_place():
    from liger_portable.ops.glu import can_write_in_place

    y = torch.empty(6, 20)
    assert can_write_in_place(y[:, :10], y[:, 10:])  # fused gate/up halves
    assert can_write_in_place(y[:3], y[3:])
    assert can_write_in_place(torch.empty(4, 5), torch.empty(4, 5))
    assert not can_write_in_place(y, y)
    assert not can_write_in_place(y[:, :10], y[:, 5:15])  # shifted slices share elements
    assert not can_write_in_place(y[:, 1:11], y[:, 10:20])
    assert not can_write_in_place(torch.empty(1, 8).expand(4, 8), torch.empty(4, 8))  # a row read 4 times
    z = torch.empty(40)
    assert not can_write_in_place(z[:30].view(3, 10), z[5:35].view(3, 10))


# --------------------------------------------------------------------------- modules


def _config(hidden=24, inter=40, **kw):
    return SimpleNamespace(hidden_size=hidden, intermediate_size=inter, **kw)


class HandLlamaMLP(torch.nn.Module):
    """Hugging Face's LlamaMLP (GemmaMLP with gelu_pytorch_tanh), written out."""

    def __init__(self, hidden, inter, bias, act):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=bias)
        self.act_fn = torch.nn.SiLU() if act == "swiglu" else torch.nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


MODULES = {"swiglu": lnn.SwiGLUMLP, "geglu": lnn.GEGLUMLP}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ACTS)
def test_module_is_hf_mlp_drop_in(act, bias):
    cfg = _config(mlp_bias=bias) if bias else _config()
    m = MODULES[act](cfg)
    assert (m.hidden_size, m.intermediate_size) == (24, 40)
    for name, (i, o) in {"gate_proj": (24, 40), "up_proj": (24, 40), "down_proj": (40, 24)}.items():
        lin = getattr(m, name)
        assert type(lin) is torch.nn.Linear and (lin.in_features, lin.out_features) == (i, o)
        assert (lin.bias is not None) == bias
    hand = HandLlamaMLP(24, 40, bias, act)
    assert list(m.state_dict()) == list(hand.state_dict())
    hand.load_state_dict(m.state_dict())
    _compare_modules(m, hand, torch.float32, tol=1e-6)


def _compare_modules(m, hand, dtype, tol):
    """Forward and backward (input and every parameter) of ``m`` against ``hand``, same weights."""
    g = torch.Generator().manual_seed(3)
    dev = next(m.parameters()).device
    x = (torch.randn(2, 5, m.hidden_size, generator=g) * 2).to(dtype).to(dev)
    dy = torch.randn(2, 5, m.hidden_size, generator=g).to(dtype).to(dev)
    outs = []
    for mod in (m, hand):
        xi = x.clone().requires_grad_()
        y = mod(xi)
        y.backward(dy)
        outs.append((y, xi.grad, *(p.grad for p in mod.parameters())))
    for name, got, want in zip(("y", "dx", *dict(m.named_parameters())), *outs):
        assert rel_err(got, want) <= tol, (name, rel_err(got, want))


def test_module_checks_the_activation():
    lnn.SwiGLUMLP(_config(hidden_act="silu"))
    lnn.GEGLUMLP(_config(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"))
    with pytest.raises(ValueError, match=r"config.hidden_act is 'gelu_pytorch_tanh' but SwiGLUMLP computes 'silu'"):
        lnn.SwiGLUMLP(_config(hidden_act="gelu_pytorch_tanh"))
    with pytest.raises(ValueError, match=r"config.hidden_act is 'gelu' but GEGLUMLP computes 'gelu_pytorch_tanh'"):
        lnn.GEGLUMLP(_config(hidden_act="gelu"))


# --------------------------------------------------------------------------- torch.compile (CPU path)


@pytest.mark.parametrize("act", ACTS)
def test_compile_fullgraph_cpu(act):
    a, b, dc = _inputs((5, 40), torch.float32)
    ref = _reference(act, a, b, dc)
    a.requires_grad_()
    b.requires_grad_()
    fn = torch.compile(getattr(F, act), fullgraph=True, backend="aot_eager")
    c = fn(a, b, inplace_backward=True)
    c.backward(dc)
    _assert_close(act, (c, a.grad, b.grad), ref, torch.float32)


# --------------------------------------------------------------------------- Triton interpreter, every vendor's configs

# Odd sizes; one row; rows that straddle BLOCK_M; columns that straddle every table's BLOCK_N
# (1024 and 2048) and need the column clamp (37); a 3-D input.
KERNEL_SHAPES = [(1, 37), (19, 200), (6, 1025), (3, 2049), (2, 3, 130)]


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter(simulated_device, poison, shape, dtype, act):
    a, b, dc = _inputs(shape, dtype, seed=sum(shape))
    # Each shape runs both backward modes across the dtypes (one per test, to keep CI time short).
    inplace = (KERNEL_SHAPES.index(shape) + DTYPES.index(dtype)) % 2 == 1
    _run_and_compare(act, a, b, dc, inplace=inplace)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_rounds_where_eager_does(simulated_device, poison, act):
    """fp16 output and gradients round where eager ``act(a) * b`` and its autograd do: ``act(a)``
    to fp16 before the product (c and db), ``dc * b`` to fp16 before the product with ``act'(a)``
    (da). Against float64 with those roundings, at most 1% of the elements may differ (by one ulp:
    act and act' evaluated in fp32 land on the other side of an fp16 rounding boundary for ~0.1%
    of them, and GeLU's tanh is computed through a sigmoid); leaving out one of the roundings
    changes about a quarter of them, by one ulp, under fp16's 1e-2. (fp16: the interpreter
    truncates fp32 to bf16, so bf16 is compared bit for bit only on the GPU.)"""
    a, b, dc = _inputs((19, 200), torch.float16, seed=4)
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    c = getattr(F, act)(al, bl)
    c.backward(dc)
    f, df = FORMULAS[act]
    a64, b64, dc64 = a.double(), b.double(), dc.double()
    act16 = f(a64).half().double()
    refs = {
        "c": (act16 * b64).half(),
        "da": ((dc64 * b64).half().double() * df(a64)).half(),
        "db": (dc64 * act16).half(),
    }
    for name, out in (("c", c), ("da", al.grad), ("db", bl.grad)):
        assert out.dtype == torch.float16 and rel_err(out, refs[name]) <= TOL[torch.float16], name
        differ = (out != refs[name]).float().mean().item()
        assert differ <= 0.01, (name, differ)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_backward_modes(simulated_device, poison, act):
    """Default: a and b are intact after the backward. In place: they hold da and db (no copy);
    here a and b are views of a buffer of the caller's that needs no gradient (a leaf that does
    is refused: test_kernel_interpreter_inplace_refuses_leaf_storage)."""
    a0, b0, dc = _inputs((9, 300), torch.bfloat16)
    a, b = _run_and_compare(act, a0, b0, dc, inplace=False)
    assert torch.equal(a.detach(), a0) and torch.equal(b.detach(), b0)
    pair = torch.stack([a0, b0])
    a, b = _run_and_compare(act, pair[0].requires_grad_(), pair[1].requires_grad_(), dc, inplace=True, copy=False)
    assert torch.equal(a.detach(), a.grad) and torch.equal(b.detach(), b.grad)
    assert a.grad.data_ptr() == a.data_ptr() and b.grad.data_ptr() == b.data_ptr()


@pytest.mark.interpreter
def test_kernel_interpreter_inplace_backward_once(simulated_device):
    a, b, dc = _inputs((4, 64), torch.float32)
    a = a.requires_grad_() * 1.0  # an activation (in place refuses a leaf: see the next test)
    c = F.swiglu(a, b, inplace_backward=True)
    c.backward(dc, retain_graph=True)
    with pytest.raises(RuntimeError, match=r"inplace_backward=True can run backward only once"):
        c.backward(dc)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("which", ["leaf", "views of a leaf", "b a leaf"])
def test_kernel_interpreter_inplace_refuses_leaf_storage(simulated_device, act, which):
    """In place on a leaf that requires grad (or views of one, as x.unbind(0) gives) would write the
    gradients over the leaf's values: refused, with the leaf's values untouched. Activations (not
    leaves), and leaves that need no gradient, are taken."""
    _check_inplace_refuses_leaf_storage(act, which)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("which", ["leaf", "views of a leaf", "b a leaf"])
def test_inplace_refuses_leaf_storage_on_the_fallback(act, which):
    """The same refusal on the CPU fallback (which never writes in place): the mistake shows in a
    CPU run, not first on a GPU."""
    _check_inplace_refuses_leaf_storage(act, which)


def _check_inplace_refuses_leaf_storage(act, which):
    a, b, dc = _inputs((4, 64), torch.float32)
    if which == "views of a leaf":
        x = torch.stack([a, b]).requires_grad_()
        a, b = x.unbind(0)
        kept = x.detach().clone()
    elif which == "leaf":
        a.requires_grad_()
        kept = a.detach().clone()
    else:
        a = a.requires_grad_() * 1.0
        b.requires_grad_()
        kept = b.detach().clone()
    with pytest.raises(ValueError, match=r"inplace_backward=True .* leaf tensor that requires grad"):
        getattr(F, act)(a, b, inplace_backward=True)
    leaf = x if which == "views of a leaf" else (a if which == "leaf" else b)
    assert torch.equal(leaf.detach(), kept)
    c = getattr(F, act)(a, b)  # out of place: fine
    c.backward(dc)
    with torch.no_grad():  # no backward can follow: nothing to refuse
        getattr(F, act)(a, b, inplace_backward=True)


@pytest.mark.interpreter
def test_kernel_interpreter_inplace_bumps_version(simulated_device):
    """Another node that saved a fails loudly instead of reading the gradient written over it."""
    a, b, dc = _inputs((4, 64), torch.float32)
    w = torch.randn(4, 64, requires_grad=True)
    a = a.requires_grad_() * 1.0  # non-leaf
    p = a * w  # saves a for w's gradient; created first, so its backward runs after swiglu's
    c = F.swiglu(a, b, inplace_backward=True) + p
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        c.backward(dc)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_fused_halves_no_copy(simulated_device, poison, act):
    """a and b as the two halves of one (rows, 2n) gate/up buffer: read with their row stride, no
    copy. In place, the gradients land in that buffer, which proves nothing was copied."""
    n = 150
    y0, _, _ = _inputs((7, 2 * n), torch.float32, scale=1.5)
    dc = torch.randn(7, n)
    for inplace in (False, True):
        y = y0.clone()
        a, b = y[:, :n].requires_grad_(), y[:, n:].requires_grad_()
        assert a.stride() == (2 * n, 1)
        a, b = _run_and_compare(act, a, b, dc, inplace=inplace, copy=False)
        if inplace:
            assert torch.equal(y[:, :n], a.grad) and torch.equal(y[:, n:], b.grad)
        else:
            assert torch.equal(y, y0)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_aliased_inputs(simulated_device, poison, act):
    """swiglu(x, x): in place is dropped (a and b share every element); the gradient is da + db."""
    x, _, dc = _inputs((5, 70), torch.float32)
    ref_c, ref_da, ref_db = _reference(act, x, x, dc)
    x = x.clone().requires_grad_()
    x0 = x.detach().clone()
    c = getattr(F, act)(x, x, inplace_backward=True)
    c.backward(dc)
    assert rel_err(c, ref_c) <= 1e-5 and rel_err(x.grad, ref_da + ref_db) <= 1e-5
    assert torch.equal(x.detach(), x0)


@pytest.mark.interpreter
def test_kernel_interpreter_non_contiguous(simulated_device, poison):
    """A transposed a (last dim not contiguous: copied) and a non-contiguous upstream gradient."""
    a = torch.randn(40, 9).t()
    b = torch.randn(9, 40)
    dc = torch.randn(40, 9).t()
    for act in ACTS:
        _run_and_compare(act, a, b, dc)
        _run_and_compare(act, a, b, dc, inplace=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("pads", [(7, 0, 0), (0, 7, 0), (0, 0, 5), (3, 11, 5)], ids=lambda p: "pad%d-%d-%d" % p)
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_row_strides_differ(simulated_device, poison, act, pads, inplace):
    """a, b and the upstream gradient each with its own row stride (slices of wider tensors, as a gate
    and an up projection taken from different buffers): every stride reaches its own tensor, forward and
    backward, and the gradients land in the slices alone."""
    rows, n = 6, 70
    g = torch.Generator().manual_seed(3)
    wide = [torch.randn(rows, n + p, generator=g) for p in pads]
    A, B = (wide[0] * 2 + 0.1).requires_grad_(), (wide[1] + 0.1).requires_grad_()
    dc = wide[2][:, :n]
    ref = _reference(act, A[:, :n], B[:, :n], dc)
    # in place refuses a leaf's storage: then a and b are slices of activations (times one)
    a, b = ((A * 1)[:, :n], (B * 1)[:, :n]) if inplace else (A[:, :n], B[:, :n])
    assert (a.stride(0), b.stride(0), dc.stride(0)) == tuple(n + p for p in pads)
    c = getattr(F, act)(a, b, inplace_backward=inplace)
    c.backward(dc)
    _assert_close(act, (c, A.grad[:, :n], B.grad[:, :n]), ref, torch.float32)
    assert not A.grad[:, n:].any() and not B.grad[:, n:].any()


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_large_inputs(simulated_device, poison, act):
    """Saturated activations (|a| up to 200: exp overflows to inf in fp32) stay finite and exact."""
    a = torch.linspace(-200, 200, 7 * 64).view(7, 64)
    b, dc = torch.randn(7, 64), torch.randn(7, 64)
    with warnings.catch_warnings():
        # The interpreter runs exp in numpy, which warns on the overflow to inf (the intended value).
        warnings.simplefilter("ignore", RuntimeWarning)
        _run_and_compare(act, a, b, dc)
        _run_and_compare(act, a, b, dc, inplace=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_module(simulated_device, poison, act):
    m = MODULES[act](_config(hidden=32, inter=72, mlp_bias=True))
    hand = HandLlamaMLP(32, 72, True, act)
    hand.load_state_dict(m.state_dict())
    _compare_modules(m, hand, torch.float32, tol=1e-5)


def _saved_bytes(m, x) -> tuple[torch.Tensor, int]:
    """``m(x)`` and the bytes of the distinct tensors autograd saved for its backward."""
    saved = {}

    def pack(t):
        saved[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    return y, sum(saved.values())


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_module_does_not_keep_the_product(simulated_device, poison, act, dtype):
    """With the kernels, the MLP keeps x, the gate and up activations and the weights for the
    backward, not act(a) * b: one (tokens x intermediate) tensor less than the modules as written,
    with the same results (the backward recomputes the product bitwise)."""
    m = MODULES[act](_config(hidden=32, inter=72, mlp_bias=True)).to(dtype)
    hand = HandLlamaMLP(32, 72, True, act).to(dtype)
    hand.load_state_dict(m.state_dict())
    x = torch.randn(3, 5, 32, dtype=dtype, requires_grad=True)
    _, fused = _saved_bytes(m, x)
    _, written = _saved_bytes(hand, x)
    product = 3 * 5 * 72 * x.element_size()
    assert fused <= written - product, (fused, written, product)
    _compare_modules(m, hand, dtype, tol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_module_unfused_where_it_must(simulated_device, act, monkeypatch):
    """The fusion is taken in plain eager training only. A hooked or replaced down_proj, autocast,
    weights of another dtype, or no gradient: the MLP runs its modules as written (a hook applies;
    results as Hugging Face's)."""
    from liger_portable.ops import mlp as mlp_ops

    calls = []
    real = mlp_ops.glu_down
    monkeypatch.setattr(mlp_ops, "glu_down", lambda *a: (calls.append(1), real(*a))[1])
    m = MODULES[act](_config(hidden=32, inter=72))
    hand = HandLlamaMLP(32, 72, False, act)
    hand.load_state_dict(m.state_dict())
    x = torch.randn(4, 32, requires_grad=True)

    assert rel_err(m(x), hand(x)) <= 1e-5 and len(calls) == 1  # plain: fused
    handle = m.down_proj.register_forward_hook(lambda mod, inp, out: out * 2)
    assert rel_err(m(x), 2 * hand(x)) <= 1e-5 and len(calls) == 1  # the hook applied
    handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rel_err(m(x), hand(x)) <= 1e-2 and len(calls) == 1
    with torch.no_grad():
        assert rel_err(m(x), hand(x)) <= 1e-5 and len(calls) == 1
    wrapped = MODULES[act](_config(hidden=32, inter=72))
    wrapped.load_state_dict(m.state_dict())
    wrapped.down_proj = torch.nn.Sequential(wrapped.down_proj)  # as a LoRA wrapper would
    assert rel_err(wrapped(x), hand(x)) <= 1e-5 and len(calls) == 1
    other = MODULES[act](_config(hidden=32, inter=72))
    other.load_state_dict(m.state_dict())
    other.double()
    assert rel_err(other(x.double()), hand(x)) <= 1e-5 and len(calls) == 1  # float64: no kernels
    assert F.glu_down("silu", torch.randn(4, 72, requires_grad=True), torch.randn(4, 72),
                       torch.nn.Linear(72, 32).double()) is None  # weight dtype differs from a


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
def test_kernel_interpreter_module_compile_fullgraph(simulated_device):
    """Under torch.compile the MLP takes the unfused custom-op path: no graph break, and the same
    output and input gradient as the fused eager path."""
    m = MODULES["swiglu"](_config(hidden=32, inter=72))
    x = torch.randn(4, 32, requires_grad=True)
    y = m(x)
    y.backward(torch.ones_like(y))
    dx = x.grad.clone()
    x.grad = None
    y2 = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    y2.backward(torch.ones_like(y2))
    assert rel_err(y2, y) <= 1e-6 and rel_err(x.grad, dx) <= 1e-6


@pytest.mark.interpreter
@pytest.mark.parametrize("choice", ["inductor", "kernels"])
@pytest.mark.parametrize("sim", [None, "cuda-sm90"], ids=["fallback", "cuda-sm90"])
@pytest.mark.parametrize("act", ACTS)
def test_module_compile_does_not_keep_the_product(monkeypatch, sim, act, choice):
    """Under torch.compile (AOTAutograd's min-cut partitioner, as Inductor's) the MLP saves one
    (tokens x intermediate) tensor less than the modules as written, compiled alike: the product is
    recomputed in the backward, as in eager mode. Results and gradients as the eager module's, under
    either UNDER_COMPILE choice (they differ in the op the product and its gradients come from)."""
    monkeypatch.setattr(F, "UNDER_COMPILE", choice)
    with liger_portable.simulate(SIMULATED_DEVICES[sim] if sim else None):
        _check_compiled_mlp_memory(act, torch.device("cpu"), "aot_eager")


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("choice", ["inductor", "kernels"])
def test_module_compile_backward_ops(simulated_device, monkeypatch, choice):
    """What the compiled MLP's backward graph runs. By default the product is recomputed by our
    ``glu_product`` op and the gradients are the compiler's own aten ops, so that Inductor can write
    one of them over a saved activation (test_module_compile_backward_peak_gpu measures it); with
    "kernels" our backward kernel op computes them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    monkeypatch.setattr(F, "UNDER_COMPILE", choice)
    backward_ops = []

    def record(gm, example_inputs):
        backward_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    m = MODULES["swiglu"](_config(hidden=32, inter=72))
    x = torch.randn(3, 5, 32, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(m, fullgraph=True, backend=aot_autograd(  # partitioned as Inductor does
        fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=record, partition_fn=min_cut_rematerialization_partition))(x)
    y.sum().backward()
    ours = sorted(op for op in backward_ops if "liger_portable" in op)
    if choice == "inductor":
        assert ours == ["liger_portable.glu_product.default"], backward_ops
        assert "aten.silu_backward.default" in backward_ops
    else:
        assert ours == ["liger_portable.glu.default", "liger_portable.glu_backward.default"], backward_ops


def _check_compiled_mlp_memory(act: str, device: torch.device, backend: str) -> None:
    m = MODULES[act](_config(hidden=32, inter=72)).to(device)
    hand = HandLlamaMLP(32, 72, False, act).to(device)
    hand.load_state_dict(m.state_dict())
    x = torch.randn(3, 5, 32, device=device, requires_grad=True)
    dy = torch.randn(3, 5, 32, device=device)
    y_ref = m(x)
    y_ref.backward(dy)
    ref = (y_ref.detach(), x.grad, m.down_proj.weight.grad, m.gate_proj.weight.grad)
    x.grad = None
    m.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    y, fused = _saved_bytes(torch.compile(m, fullgraph=True, backend=backend), x)
    y.backward(dy)
    _, written = _saved_bytes(torch.compile(hand, fullgraph=True, backend=backend), x)
    assert fused <= written - 3 * 5 * 72 * x.element_size(), (fused, written)
    got = (y.detach(), x.grad, m.down_proj.weight.grad, m.gate_proj.weight.grad)
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_module_backward_runs_once(simulated_device):
    m = MODULES["swiglu"](_config(hidden=32, inter=72))
    x = torch.randn(4, 32, requires_grad=True)
    y = m(x).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward only once"):
        y.backward()


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_compile_fullgraph(simulated_device, act):
    """The kernel path is a pair of custom ops: torch.compile(fullgraph=True) traces it without a break."""
    a, b, dc = _inputs((4, 96), torch.float32)
    ref = _reference(act, a, b, dc)
    a.requires_grad_()
    b.requires_grad_()
    fn = torch.compile(getattr(F, act), fullgraph=True, backend="aot_eager")
    c = fn(a, b, inplace_backward=True)
    c.backward(dc)
    _assert_close(act, (c, a.grad, b.grad), ref, torch.float32)


# --------------------------------------------------------------------------- real GPU


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


GPU_SHAPES = [(1, 37), (333, 1000), (2048, 4096), (257, 14336), (64, 28672), (7, 70001)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
@pytest.mark.parametrize("act", ACTS)
def test_kernel_gpu(poison, shape, dtype, act):
    a, b, dc = _inputs(shape, dtype, device=_gpu(), seed=sum(shape))
    inplace = (GPU_SHAPES.index(shape) + DTYPES.index(dtype)) % 2 == 1  # both modes per shape
    a1, b1 = _run_and_compare(act, a, b, dc, inplace=inplace)
    if not inplace:
        assert torch.equal(a1.detach(), a) and torch.equal(b1.detach(), b)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_kernel_gpu_fused_halves_and_3d(act):
    dev = _gpu()
    y, _, _ = _inputs((4, 513, 2 * 4096), torch.bfloat16, device=dev)
    dc = torch.randn(4, 513, 4096, device=dev, dtype=torch.bfloat16)
    a, b = y[..., :4096].requires_grad_(), y[..., 4096:].requires_grad_()
    _run_and_compare(act, a, b, dc, inplace=True, copy=False)
    assert torch.equal(y[..., :4096], a.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_kernel_gpu_inplace_memory(act):
    """In place, forward + backward needs the output and nothing more (the 450 MiB goal at
    16384 x 14336, scaled down); out of place it also allocates da and db."""
    dev = _gpu()
    a0, b0, dc = _inputs((4096, 14336), torch.bfloat16, device=dev)
    size = a0.numel() * a0.element_size()
    for inplace, budget in ((True, 1.02 * size), (False, 3.02 * size)):
        pair = torch.stack([a0, b0])  # a buffer of ours (in place refuses a leaf that requires grad)
        a, b = pair[0].requires_grad_(), pair[1].requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        getattr(F, act)(a, b, inplace_backward=inplace).backward(dc)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= budget, (inplace, torch.cuda.max_memory_allocated() - base)
        del a, b, pair


@pytest.mark.gpu
@pytest.mark.big_memory
def test_kernel_gpu_beyond_int32_offsets():
    """More than 2**31 elements: the last rows must be right (int64 row offsets)."""
    dev = _gpu()
    n_cols = 14336
    n_rows = 2**31 // n_cols + 5
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n_rows, n_cols, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n_rows, n_cols, device=dev, dtype=torch.bfloat16, generator=g)
    dc = torch.randn(n_rows, n_cols, device=dev, dtype=torch.bfloat16, generator=g)
    tail = slice(n_rows - 7, n_rows)
    for act in ACTS:
        ref = _reference(act, a[tail], b[tail], dc[tail])
        pair = torch.stack([a, b])  # a buffer of ours (in place refuses a leaf that requires grad)
        a1, b1 = pair[0].requires_grad_(), pair[1].requires_grad_()
        c = getattr(F, act)(a1, b1, inplace_backward=True)
        c.backward(dc)
        _assert_close(act, (c[tail], a1.grad[tail], b1.grad[tail]), ref, torch.bfloat16)
        del a1, b1, c


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_module_gpu(act):
    dev = _gpu()
    m = MODULES[act](_config(hidden=256, inter=704)).to(dev)
    hand = HandLlamaMLP(256, 704, False, act).to(dev)
    hand.load_state_dict(m.state_dict())
    _compare_modules(m, hand, torch.float32, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_module_compile_does_not_keep_the_product_gpu(act):
    """As the CPU test, under Inductor with the kernel ops (triton_ops on CUDA)."""
    _check_compiled_mlp_memory(act, _gpu(), "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_module_compile_backward_peak_gpu(inductor_under_compile, act):
    """Under Inductor (the default UNDER_COMPILE) the compiled MLP's backward peaks no higher than
    the eager fused MLP's, which writes the gate and up gradients over the saved activations: the
    product is recomputed by our kernel, so Inductor's gradient kernel may write over the saved up
    activation. (With the product in Inductor's formula, one fused kernel wrote the product and both
    gradients while the activations were alive: two (tokens x intermediate) tensors more.) Same
    results as eager."""
    dev = _gpu()
    tokens, hidden, inter = 4096, 512, 4096
    unit = tokens * inter * 2  # one (tokens x intermediate) bf16 tensor
    m = MODULES[act](_config(hidden=hidden, inter=inter)).to(dev, torch.bfloat16)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)

    def backward_peak(module):
        y = module(x)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        y.backward(dy)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - start
        grads = (y.detach(), x.grad, m.gate_proj.weight.grad, m.up_proj.weight.grad, m.down_proj.weight.grad)
        x.grad = None
        m.zero_grad(set_to_none=True)
        return peak, grads

    backward_peak(m)  # first use: cuBLAS's workspace is allocated, not counted again
    eager_peak, ref = backward_peak(m)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    backward_peak(compiled)  # compiles forward and backward
    compiled_peak, got = backward_peak(compiled)
    assert compiled_peak <= eager_peak + unit // 2, (compiled_peak / unit, eager_peak / unit)
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_compile_fullgraph_gpu(act):
    a, b, dc = _inputs((64, 512), torch.bfloat16, device=_gpu())
    ref = _reference(act, a, b, dc)
    a.requires_grad_()
    b.requires_grad_()
    fn = torch.compile(getattr(F, act), fullgraph=True)
    c = fn(a, b, inplace_backward=True)
    c.backward(dc)
    _assert_close(act, (c, a.grad, b.grad), ref, torch.bfloat16)


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("act", ACTS)
def test_kernel_interpreter_beyond_int32_offsets(simulated_device, poison, act):
    """Rows of a, b and the upstream gradient that start beyond 2**31 elements (see beyond_int32_rows):
    c, da and db right in every row (int64 row offsets)."""
    rows, n = 9, 40
    a = beyond_int32_rows(rows, n, scale=2.0, shift=0.1).requires_grad_()
    b = beyond_int32_rows(rows, n, seed=1, shift=0.1).requires_grad_()
    dc = beyond_int32_rows(rows, n, seed=2)
    c = getattr(F, act)(a, b)
    c.backward(dc)
    ref = _reference(act, a, b, dc)
    _assert_close(act, (c, a.grad, b.grad), ref, torch.bfloat16)
    _assert_close(act, (c[-2:], a.grad[-2:], b.grad[-2:]), [t[-2:] for t in ref], torch.bfloat16)
