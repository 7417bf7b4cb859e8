"""The cached launcher (``liger_portable.ops.launching``): a kernel compiled for one specialisation is
reused only for arguments Triton would compile the same kernel for, and gives the bits Triton's
own launch gives."""

from __future__ import annotations

import pytest
import torch

import liger_portable
from conftest import rel_err
from liger_portable import fallback
from liger_portable import functional as F
from liger_portable.ops import launching
from liger_portable.ops import rms_norm as rms_ops


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


@pytest.mark.interpreter
def test_interpreter_launches_take_tritons_path(simulated_device):
    """In the interpreter no compiled kernel comes back: nothing is cached, the result is right."""
    rms_ops.launch_fwd._cache.clear()
    x = torch.randn(5, 40)
    w = torch.rand(40)
    y = F.rms_norm(x, w)
    assert rel_err(y, fallback.rms_norm(x.double(), w.double(), 1e-6, 0.0, "llama")) <= 1e-5
    assert rms_ops.launch_fwd._cache == {}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_cached_launch_equals_tritons_launch(dtype):
    """Forward and backward through the cached launcher are bitwise those of kernel[grid](...),
    for aligned rows and for rows whose pointer and stride are not multiples of 16 (a different
    specialisation, which must not reuse the aligned kernel)."""
    dev = _gpu()
    base = torch.randn(333 * 1001 + 1, device=dev, dtype=dtype)
    w = torch.rand(1000, device=dev, dtype=dtype)
    dy = torch.randn(333, 1000, device=dev, dtype=dtype)
    cases = {
        "aligned": base[: 333 * 1000].view(333, 1000),
        "odd pointer and stride": base[1:].as_strided((333, 1000), (1001, 1)),
    }
    for name, x in cases.items():
        results = []
        for enabled in (False, True, True):  # Triton's path, then the cached one (filled, then hit)
            launching.enabled = enabled
            try:
                xg = x.detach().requires_grad_()
                wg = w.detach().clone().requires_grad_()
                y = F.rms_norm(xg, wg)
                y.backward(dy)
                torch.cuda.synchronize()
                results.append((y.detach().clone(), xg.grad.clone(), wg.grad.clone()))
            finally:
                launching.enabled = True
        for got in results[1:]:
            for a, b in zip(results[0], got):
                assert torch.equal(a, b), name
        ref = fallback.rms_norm(x.double(), w.double(), 1e-6, 0.0, "llama")
        assert rel_err(results[-1][0], ref) <= (1e-5 if dtype == torch.float32 else 1e-2), name
    keys = [k for k in rms_ops.launch_fwd._cache]
    aligned = {tuple(v for v in k[2:6]) for k in keys}  # X, Y, W, RSTD specialisations
    assert len(aligned) >= 2, "the unaligned rows reused the aligned kernel"


# --------------------------------------------------------------------------- the cached path on the CPU
# A fake driver and a fake compiled kernel stand in for the GPU: Triton's own launch (the slow path)
# is counted as a compile, and the cached launches record what they pass to the compiled kernel.


class _Recorder:
    """A compiled kernel's launcher that records its calls (wrapper form unknown: called as is)."""

    global_scratch_size = 0
    profile_scratch_size = 0

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(("wrapper", args))


class _KnownWrapper(_Recorder):
    """Shaped like Triton's CUDA launcher wrapper: the launcher calls its C function directly."""

    launch_cooperative_grid = False
    launch_pdl = True

    def __init__(self, calls):
        super().__init__(calls)
        self.launch = lambda *args: calls.append(("direct", args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


def _params(fn):
    """The parameters of a ``@triton.jit`` function as JITFunction lists them (name, default,
    is_constexpr), read from its Python signature (the interpreter's function has no ``params``)."""
    import inspect
    from types import SimpleNamespace

    import triton.language as tl

    py = getattr(fn, "fn", fn)
    return [
        SimpleNamespace(name=p.name, default=p.default, is_constexpr=p.annotation in (tl.constexpr, "tl.constexpr"))
        for p in inspect.signature(py).parameters.values()
    ]


@pytest.fixture
def fake_gpu(monkeypatch):
    """(launcher over the RMSNorm forward's signature, compiles made, launches recorded, set_run)."""

    class Driver:
        class active:
            get_current_device = staticmethod(lambda: 0)
            get_current_stream = staticmethod(lambda device: "stream")

    compiles, calls = [], []
    run = {"cls": _Recorder}

    class Compiled:
        function = "function"
        packed_metadata = "metadata"

        def __init__(self):
            self.run = run["cls"](calls)

    class Fn:
        params = _params(rms_ops.launch_fwd.fn)
        pre_run_hooks: list = []
        __name__ = "fake"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                compiles.append((grid, args, kwargs))
                return Compiled()

            return launch

    monkeypatch.setattr(launching, "driver", Driver)
    monkeypatch.setattr(launching, "KNOWN_TRITON", True)
    monkeypatch.setattr(launching, "hooks_installed", lambda: False)
    return launching.Launcher(Fn()), compiles, calls, run


def _rms_args(x, n_rows=16, n_cols=64):
    y, w, rstd = torch.empty(n_rows, n_cols), torch.rand(n_cols), torch.empty(n_rows)
    return (x, y, w, rstd, x.stride(0), y.stride(0), n_rows, n_cols, 1e-6, 0.0)


CONSTS = {"GEMMA": False, "BLOCK_M": 1, "BLOCK_N": 64, "SINGLE_PASS": True}


def test_cached_launch_passes_every_argument_in_order(fake_gpu):
    """The first call takes Triton's path (one compile); the next calls the compiled kernel with the
    leading arguments, the constexprs and the defaults of the arguments left out, in order."""
    launcher, compiles, calls, _ = fake_gpu
    opts = {"num_warps": 4}
    args = _rms_args(torch.randn(16, 64))
    launcher((3,), args, CONSTS, opts)
    launcher((3,), args, CONSTS, opts)
    assert len(compiles) == 1 and len(calls) == 1
    kind, passed = calls[0]
    assert kind == "wrapper"
    assert passed[:9] == (3, 1, 1, "stream", "function", "metadata", None, None, None)
    values = passed[9:]
    assert values[:10] == args
    assert values[10:] == (False, 1, 64, True, None, None, None, False)  # GEMMA..SINGLE_PASS, R, stride_r, S, HAS_RESIDUAL


def test_cached_launch_recompiles_for_what_triton_specialises_on(fake_gpu):
    """A cached kernel is reused only for the same dtypes, 16-byte alignments, integer classes
    (1, multiple of 16, 32-bit), constexpr values and launch options."""
    launcher, compiles, calls, _ = fake_gpu
    opts = {"num_warps": 4}
    x = torch.randn(16 * 64 + 1)
    aligned = x[:1024].view(16, 64)
    launcher((1,), _rms_args(aligned), CONSTS, opts)
    launcher((1,), _rms_args(x[1:].view(16, 64)), CONSTS, opts)  # pointer 4 bytes past 16
    assert len(compiles) == 2
    launcher((1,), _rms_args(aligned.double()), CONSTS, opts)  # dtype
    assert len(compiles) == 3
    launcher((1,), _rms_args(aligned, n_rows=17), CONSTS, opts)  # 17: not a multiple of 16
    assert len(compiles) == 4
    launcher((1,), _rms_args(aligned[:1].expand(32, 64), n_rows=32), CONSTS, opts)  # 32: as 16
    launcher((1,), _rms_args(aligned), {**CONSTS, "BLOCK_M": 2}, opts)  # a constexpr
    assert len(compiles) == 5
    launcher((1,), _rms_args(aligned), CONSTS, {"num_warps": 4})  # another options dict
    assert len(compiles) == 6
    launcher((1,), _rms_args(aligned, n_rows=1), CONSTS, opts)  # 1: Triton's constant 1
    assert len(compiles) == 7
    launcher((1,), _rms_args(aligned), {**CONSTS, "R": aligned}, opts)  # a trailing tensor given, None before
    assert len(compiles) == 8
    launcher((1,), _rms_args(aligned)[:8] + (True, 0.0), CONSTS, opts)  # a bool where a float was
    assert len(compiles) == 9
    assert len(calls) == 1  # only the 32-row call found its kernel (the 16-row one's)


def test_known_wrapper_is_skipped(fake_gpu):
    """With Triton's CUDA wrapper form and no scratch memory, the C launch function is called
    directly, with the cooperative-grid and PDL flags and no scratch inserted as the wrapper does."""
    launcher, compiles, calls, run = fake_gpu
    run["cls"] = _KnownWrapper
    args = _rms_args(torch.randn(16, 64))
    opts = {"num_warps": 4}
    launcher((2, 3), args, CONSTS, opts)
    launcher((2, 3), args, CONSTS, opts)
    kind, passed = calls[0]
    assert kind == "direct"
    assert passed[:13] == (2, 3, 1, "stream", "function", False, True, None, None, "metadata", None, None, None)
    # tensors go to the C launch function as their data pointers (ints: no data_ptr() call and no
    # driver check per argument there), the other arguments as they are
    assert passed[13:23] == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    assert all(type(v) is int for v in passed[13:17])
    # the wrapper itself forwards the same call
    direct = list(passed)
    calls.clear()
    _KnownWrapper(calls)(2, 3, 1, "stream", "function", "metadata", None, None, None, *passed[13:])
    assert list(calls[0][1]) == direct
    # a parameter (a module's weight) is passed as its pointer too, and keyed as a tensor
    calls.clear()
    w = torch.nn.Parameter(args[2].clone())
    launcher((2, 3), args[:2] + (w,) + args[3:], CONSTS, opts)
    assert len(compiles) == 1 and calls[0][1][15] == w.data_ptr()


def test_hooks_or_capture_take_tritons_path(fake_gpu, monkeypatch):
    """With launch hooks installed (a profiler) every launch goes through Triton's own path."""
    launcher, compiles, calls, _ = fake_gpu
    monkeypatch.setattr(launching, "hooks_installed", lambda: True)
    args = _rms_args(torch.randn(16, 64))
    for _ in range(3):
        launcher((1,), args, CONSTS, {"num_warps": 4})
    assert len(compiles) == 3 and calls == []


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it lives on GPU ``index`` (as a CUDA tensor's get_device() does)."""

    index = 1

    def get_device(self):
        return self.index


@pytest.mark.parametrize("known", [True, False], ids=["cached path", "tritons path"])
def test_tensors_on_another_gpu_launch_on_theirs(fake_gpu, monkeypatch, known):
    """Triton launches on the current device: tensors on another GPU of the process (a model split
    over GPUs) are launched with their device made current (its stream, its compile target), and the
    current device is restored after; tensors on the current device enter no guard."""
    launcher, compiles, calls, _ = fake_gpu
    current, entered = [0], []

    class Guard:  # torch.<device type>.device(index): here the fake driver's current device
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)
            self.saved, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.saved

    monkeypatch.setattr(torch.cpu, "device", Guard, raising=False)
    monkeypatch.setattr(launching.driver.active, "get_current_device", staticmethod(lambda: current[0]))
    monkeypatch.setattr(launching.driver.active, "get_current_stream", staticmethod(lambda device: f"stream {device}"))
    monkeypatch.setattr(launching, "KNOWN_TRITON", known)
    seen_at_compile = []
    fn_getitem = type(launcher.fn).__getitem__
    monkeypatch.setattr(type(launcher.fn), "__getitem__",
                        lambda self, grid: (seen_at_compile.append(current[0]), fn_getitem(self, grid))[1])
    x = torch.Tensor._make_subclass(_OnGpu, torch.randn(16, 64))
    args, opts = _rms_args(x), {"num_warps": 4}
    for _ in range(2):
        launcher((1,), args, CONSTS, opts)
    assert entered == [1, 1] and current == [0]
    assert seen_at_compile == [1] * len(seen_at_compile) and len(compiles) == (1 if known else 2)
    if known:
        assert len(calls) == 1 and calls[0][1][3] == "stream 1"
    _OnGpu.index = 0  # on the current device: the cached path enters no guard (Triton's path always does)
    try:
        launcher((1,), args, CONSTS, opts)
    finally:
        _OnGpu.index = 1
    assert entered == [1, 1] + ([] if known else [0]) and current == [0]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs of one process"
)
def test_gpu_ops_on_a_gpu_that_is_not_the_current_one():
    """Every kernel family on the second GPU while the first is current (a model split over GPUs):
    forward and backward right against float64 (the fallback), the current device unchanged."""
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    g = torch.Generator(device="cpu").manual_seed(7)

    def rand(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * 0.5).to(dev, dtype).requires_grad_()

    def check(name, fn, *inputs):
        for _ in range(2):  # the second call takes the cached launch path
            for t in inputs:
                t.grad = None
            _check_once(name, fn, *inputs)

    def _check_once(name, fn, *inputs):
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
        refs = fn(*ref_inputs)
        refs = refs if isinstance(refs, tuple) else (refs,)
        torch.autograd.backward(refs, [torch.ones_like(r) for r in refs])
        for o, r in zip(outs, refs):
            assert o.device == dev and rel_err(o, r) <= 1e-2, name
        for t, r in zip(inputs, ref_inputs):
            if t.requires_grad:
                assert t.grad is not None and rel_err(t.grad, r.grad) <= 1e-2, f"{name}: gradient"
        assert torch.cuda.current_device() == 0, name

    rows, hidden, vocab = 257, 1000, 3001
    check("rms_norm", lambda x, w: F.rms_norm(x, w), rand(rows, hidden), rand(hidden))
    check("layer_norm", lambda x, w, b: F.layer_norm(x, w, b), rand(rows, hidden), rand(hidden), rand(hidden))
    check("fused_add_rms_norm", lambda x, r, w: F.fused_add_rms_norm(x, r, w), rand(rows, hidden), rand(rows, hidden),
          rand(hidden))
    check("swiglu", F.swiglu, rand(rows, hidden), rand(rows, hidden))
    check("rope", lambda q, k, c, s_: F.rope(q, k, c, s_), rand(2, 8, 33, 64), rand(2, 2, 33, 64),
          rand(1, 33, 64).detach(), rand(1, 33, 64).detach())
    target = torch.randint(0, vocab, (rows,), generator=g).to(dev)
    check("cross_entropy", lambda z, t: F.cross_entropy(z, t), rand(rows, vocab, dtype=torch.float32), target)
    check("fused_linear_cross_entropy", lambda h, w, t: F.fused_linear_cross_entropy(h, w, t),
          rand(rows, 256), rand(vocab, 256), target)
    torch.cuda.synchronize(dev)
    # the kernels ran (not the fallback, which is also the reference), keyed and launched on GPU 1
    assert any(key[1] == 1 for key in rms_ops.launch_fwd._cache), "RMSNorm did not launch on GPU 1"


# --------------------------------------------------------------------------- eager_apply


class _Scale(torch.autograd.Function):
    """x * w * k, differentiable in x only; records what its forward received."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, w, k):
        if not torch.compiler.is_compiling():
            _Scale.seen.append((x, w, k))
        ctx.save_for_backward(w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w * ctx.k, None, None


def test_eager_apply_matches_function_apply():
    from liger_portable.ops.launching import eager_apply

    apply = eager_apply(_Scale, 2)
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3)
    g = torch.randn(5, 3)
    _Scale.seen.clear()
    y = apply(x, w, 2.5)
    assert _Scale.seen == [(x, w, 2.5)]  # the arguments reach forward as they were passed
    (dx,) = torch.autograd.grad(y, x, g)
    y_ref = _Scale.apply(x, w, 2.5)
    (dx_ref,) = torch.autograd.grad(y_ref, x, g)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert type(y.grad_fn) is type(y_ref.grad_fn)


def test_eager_apply_unwraps_dead_functorch_wrappers():
    # A tensor leaked out of torch.func.grad is a dead wrapper: Function.apply unwraps it (the
    # result does not require grad); the C++ apply alone would record a graph through it.
    from liger_portable.ops.launching import eager_apply

    leaked = []

    def f(x):
        leaked.append(x * 1)
        return x.sum()

    torch.func.grad(f)(torch.randn(3))
    w = torch.randn(3)
    y = eager_apply(_Scale, 2)(leaked[0], w, 2.0)
    ref = _Scale.apply(leaked[0], w, 2.0)
    assert torch.equal(y, ref)
    assert y.grad_fn is None and ref.grad_fn is None


def test_eager_apply_takes_function_apply_inside_transforms_and_compile():
    from liger_portable.ops.launching import eager_apply

    apply = eager_apply(_Scale, 2)
    w = torch.randn(3)
    # functorch transforms need setup_context: the same error as Function.apply gives
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: apply(x, w, 2.0).sum())(torch.randn(3))
    # torch.compile traces Function.apply: one graph, no break
    x = torch.randn(4, 3, requires_grad=True)
    compiled = torch.compile(lambda x: apply(x, w, 2.0), backend="eager", fullgraph=True)
    y = compiled(x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, x * w * 2.0) and torch.equal(dx, (w * 2.0).expand(4, 3))


def test_eager_apply_keeps_function_apply_for_setup_context():
    from liger_portable.ops.launching import eager_apply

    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2

    assert eager_apply(WithSetup, 1) == WithSetup.apply


# --------------------------------------------------------------------------- kernel ops


def _kernel_op_examples(t):
    """Arguments of every kernel op at small odd sizes, built by ``t(*shape, dtype=bf16)``."""
    f32 = torch.float32
    rows, hidden, inter = 7, 96, 40
    x, w, dy = t(rows, hidden), t(hidden), t(rows, hidden)
    a, b, dc = t(rows, inter), t(rows, inter), t(rows, inter)
    q = t(2, 5, 3, 64).transpose(1, 2)  # Hugging Face's (batch, heads, seq, head_dim) view
    k = t(2, 5, 2, 64).transpose(1, 2)
    cos, sin = t(1, 5, 64), t(1, 5, 64)
    return {
        "liger_portable::rms_norm": (x, w, 1e-6, 0.0, False),
        "liger_portable::rms_norm_backward": (dy, x, w, t(rows + 1, dtype=f32), 0.0, False),
        "liger_portable::fused_add_rms_norm": (x, t(rows, hidden), w, 1e-6, 1.0, True),
        "liger_portable::fused_add_rms_norm_backward": (dy, t(rows, hidden), x, w, t(rows + 1, dtype=f32), 0.0, False),
        "liger_portable::layer_norm": (x, w, t(hidden), 1e-5),
        "liger_portable::layer_norm_backward": (dy, x, w, t(hidden), t(rows, dtype=f32), t(rows + 1, dtype=f32)),
        "liger_portable::glu": (a, b, "silu"),
        "liger_portable::glu_product": (a, b, "gelu_tanh"),
        "liger_portable::glu_backward": (dc, a, b, "gelu_tanh"),
        "liger_portable::rope": (q, k, cos, sin),
        "liger_portable::rope_backward": (q, k, cos, sin),
    }


def test_kernel_op_bodies_run_on_fake_tensors_as_their_fakes_say(partial_sums):
    """torch.compile traces a triton_op's body with fake tensors (no data, no data pointer): every
    kernel op's body runs on them, launches through the launcher (recorded here), and returns
    outputs of the shapes, dtypes and strides its fake function declares (what the custom-op form
    tells the compiler). A data-pointer read in a body (the LayerNorm backward's, once) fails here.
    The norms' backwards run with their weight-gradient partials summed in the launch and by the
    sum launch after it."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from conftest import SIMULATED_DEVICES
    from liger_portable import simulate
    from liger_portable.ops import launching

    ops = launching.kernel_ops()
    with warnings.catch_warnings(), simulate(SIMULATED_DEVICES["cuda-sm90"]), FakeTensorMode(), \
            launching.capture() as launches:
        # This torch warns (a later one raises) where a fake tensor's data pointer is read.
        warnings.filterwarnings("error", message=".*data pointer of FakeTensor")
        examples = _kernel_op_examples(lambda *shape, dtype=torch.bfloat16: torch.empty(shape, dtype=dtype))
        assert set(ops) == set(examples), "every kernel op needs an example here"
        for name, (body, fake) in ops.items():
            n = len(launches)
            got, want = body(*examples[name]), fake(*examples[name])
            got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
            assert len(launches) > n, f"{name} launched nothing"
            assert [(o.shape, o.dtype, o.stride()) for o in got] == [(o.shape, o.dtype, o.stride()) for o in want], name
            if name.endswith("norm_backward"):
                sums = [c.fn.__name__ == "_sum_partials_kernel" for c in launches[n:]]
                assert any(sums) == (partial_sums == "summed after it"), name
