"""The tuning hooks (liger_portable.tuning.hooks), on the CPU in the Triton interpreter.

For every kernel spec there is a hook; its ``run(resolved)`` launches that kernel through the op's
launch function with exactly the given config (a spy sees the very Resolved; ``resolve`` is never
called), its outputs match an independent float64 reference (the PyTorch fallback, or
``torch.nn.functional``) for the table default and searched configs, and ``tune()`` over the hook
with a fake timer records the winner. The default hooks are registered lazily (on the first
miss with ``LIGER_PORTABLE_AUTOTUNE=1``), never by ``import liger_portable``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import liger_portable
from conftest import SIMULATED_DEVICES, TOL, rel_err
from liger_portable import autotune_cache, _paths, hardware, fallback
from liger_portable.tuning import hooks as _tune_hooks
from liger_portable.tuning import runtime, search, timing
from liger_portable.configs import ENV_AUTOTUNE, Resolved, make_resolved, resolve
from liger_portable.hardware import DeviceInfo
from liger_portable.specs import SPECS
from liger_portable.ops import cross_entropy as ce_ops
from liger_portable.ops import fused_linear_cross_entropy as flce_ops
from liger_portable.ops import glu as glu_ops
from liger_portable.ops import layer_norm as ln_ops
from liger_portable.ops import rms_norm as rms_ops
from liger_portable.ops import rope as rope_ops

pytestmark = pytest.mark.interpreter

EPS = _tune_hooks.EPS
DEVICE_NAMES = sorted(SIMULATED_DEVICES)
from liger_portable.ops import launching as launch_ops  # noqa: E402
from liger_portable.ops import _problem as problem_module  # noqa: E402

OPS_MODULES = (rms_ops, ln_ops, glu_ops, rope_ops, ce_ops, flce_ops)

# Tiny problems with odd sizes (the interpreter costs about 1 ms per program).
ROWS = {"n_cols": 100, "n_rows": 19}
PROBLEMS = {
    **{k: ROWS for k in SPECS if SPECS[k].key == ("n_cols", "n_rows")},
    "cross_entropy": {"n_cols": 300, "n_rows": 13},
    "rope": {"head_dim": 16, "n_heads": 5, "seq_len": 9},
    "fused_linear_cross_entropy": {"n_cols": 300, "n_rows": 13, "hidden": 24},
}

# The op launch function each kernel's hook must call (with config=resolved).
LAUNCHERS = {
    "rms_norm_fwd": (rms_ops, "rms_norm_fwd"),
    "rms_norm_bwd": (rms_ops, "rms_norm_bwd"),
    "fused_add_rms_norm_fwd": (rms_ops, "fused_add_rms_norm_fwd"),
    "fused_add_rms_norm_bwd": (rms_ops, "fused_add_rms_norm_bwd"),
    "layer_norm_fwd": (ln_ops, "layer_norm_fwd"),
    "layer_norm_bwd": (ln_ops, "layer_norm_bwd"),
    "swiglu_fwd": (glu_ops, "glu_fwd"),
    "swiglu_bwd": (glu_ops, "glu_bwd"),
    "geglu_fwd": (glu_ops, "glu_fwd"),
    "geglu_bwd": (glu_ops, "glu_bwd"),
    "rope": (rope_ops, "rope_fwd"),
    "cross_entropy": (ce_ops, "ce_rows"),
    "fused_linear_cross_entropy": (flce_ops, "flce_fwd"),
}


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    """A private user cache, no shipped cache, no autotuning, the hook registry restored after."""
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(tmp_path / "user_cache"))
    monkeypatch.delenv(ENV_AUTOTUNE, raising=False)
    shipped = tmp_path / "shipped_cache"
    shipped.mkdir()
    monkeypatch.setattr(_paths, "shipped_cache_dir", lambda: shipped)
    runtime.reset_hooks()
    hardware.reset()
    runtime.reset_runtime()
    yield
    runtime.reset_runtime()
    runtime.reset_hooks()
    hardware.reset()


# --------------------------------------------------------------------------- references (float64)


def _d(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    return t.detach().double().requires_grad_(grad)


def _glu_ref(kernel: str):
    return fallback.swiglu if kernel.startswith("swiglu") else fallback.geglu


def _counted(rstd: torch.Tensor) -> torch.Tensor:
    """A row norm forward's rstd as it returns it: the rows' values, then the backward's arrival
    count, zero after the forward."""
    return torch.cat([rstd, rstd.new_zeros(1)])


def reference(kernel: str, inp: dict) -> tuple:
    """What the op returns, computed independently in float64 from the hook's inputs (None where
    the op returns None)."""
    if kernel == "rms_norm_fwd":
        x = _d(inp["x"])
        return fallback.rms_norm(x, _d(inp["weight"]), EPS, 0.0, "llama"), _counted(torch.rsqrt(x.pow(2).mean(-1) + EPS))
    if kernel == "rms_norm_bwd":
        x, w = _d(inp["x"], True), _d(inp["weight"], True)
        fallback.rms_norm(x, w, EPS, 0.0, "llama").backward(_d(inp["dy"]))
        return x.grad, w.grad
    if kernel == "fused_add_rms_norm_fwd":
        y, s = fallback.fused_add_rms_norm(_d(inp["x"]), _d(inp["residual"]), _d(inp["weight"]), EPS, 0.0, "llama")
        return y, s, _counted(torch.rsqrt(s.pow(2).mean(-1) + EPS))
    if kernel == "fused_add_rms_norm_bwd":
        s, w = _d(inp["s"], True), _d(inp["weight"], True)
        y = fallback.rms_norm(s, w, EPS, 0.0, "llama")
        ((y * _d(inp["dy"])).sum() + (s * _d(inp["ds"])).sum()).backward()  # s is also an output
        return s.grad, w.grad
    if kernel == "layer_norm_fwd":
        x = _d(inp["x"])
        y = fallback.layer_norm(x, _d(inp["weight"]), _d(inp["bias"]), EPS)
        return y, x.mean(-1), _counted(torch.rsqrt(x.var(-1, unbiased=False) + EPS))
    if kernel == "layer_norm_bwd":
        x, w, b = _d(inp["x"], True), _d(inp["weight"], True), _d(inp["bias"], True)
        fallback.layer_norm(x, w, b, EPS).backward(_d(inp["dy"]))
        return x.grad, w.grad, b.grad
    if kernel in ("swiglu_fwd", "geglu_fwd"):
        return (_glu_ref(kernel)(_d(inp["a"]), _d(inp["b"])),)
    if kernel in ("swiglu_bwd", "geglu_bwd"):
        a, b = _d(inp["a"], True), _d(inp["b"], True)
        _glu_ref(kernel)(a, b).backward(_d(inp["dc"]))
        return a.grad, b.grad
    if kernel == "rope":
        return fallback.rope(_d(inp["q"]), _d(inp["k"]), _d(inp["cos"]), _d(inp["sin"]))
    if kernel == "cross_entropy":
        logits = _d(inp["logits"], True)
        rows = F.cross_entropy(logits, inp["target"], reduction="none")
        rows.mean().backward()
        return rows, logits.grad
    if kernel == "fused_linear_cross_entropy":
        h, w = _d(inp["hidden"], True), _d(inp["weight"], True)
        rows = F.cross_entropy(h @ w.t(), inp["target"], reduction="none")
        rows.mean().backward()
        return rows, None, h.grad, w.grad, None
    raise AssertionError(kernel)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def assert_matches(kernel: str, out, ref: tuple, dtype: torch.dtype) -> None:
    out = _as_tuple(out)
    assert len(out) == len(ref), (kernel, len(out), len(ref))
    for i, (o, r) in enumerate(zip(out, ref)):
        if r is None:
            assert o is None, (kernel, i)
            continue
        assert o.shape == r.shape, (kernel, i, o.shape, r.shape)
        err = rel_err(o, r)
        assert err < TOL[dtype], f"{kernel} output {i}: rel err {err:.2e} (tolerance {TOL[dtype]:g})"


def _clone(out):
    return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in _as_tuple(out))


# --------------------------------------------------------------------------- registry


def test_every_spec_has_a_hook():
    assert set(SPECS) == set(_tune_hooks.HOOKS)
    assert set(SPECS) == set(LAUNCHERS) == set(PROBLEMS)


def test_register_all_is_idempotent_and_keeps_user_hooks():
    mine = lambda device, named, dtype: None  # noqa: E731
    runtime.register_hook("rope", mine)
    _tune_hooks.register_all()
    _tune_hooks.register_all()
    assert set(runtime.registered_hooks()) == set(SPECS)
    assert runtime.registered_hooks()["rope"] is mine
    assert all(runtime.registered_hooks()[k] is _tune_hooks.HOOKS[k] for k in SPECS if k != "rope")


def test_hooks_are_imported_lazily():
    """No module of the package imports tuning.hooks at import time; the tuning package (the
    loader of the default hooks it gives the runtime) and warmup import it inside the functions
    that need it (so `import liger_portable` does not load it)."""
    lazy, eager = set(), []
    pkg = Path(liger_portable.__file__).parent
    for path in pkg.rglob("*.py"):
        if path == pkg / "tuning" / "hooks.py":
            continue
        tree = ast.parse(path.read_text())
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function |= {id(n) for n in ast.walk(node) if n is not node}
        package = ["liger_portable", *path.relative_to(pkg).parts[:-1]]  # the package path is in
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # absolute names: `from . import hooks` in tuning/
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join([*base, *([node.module] if node.module else [])])
                names = [source] + [f"{source}.{a.name}" for a in node.names]
            if any(n == "liger_portable.tuning.hooks" or n.startswith("liger_portable.tuning.hooks.") for n in names):
                (lazy.add(path.relative_to(pkg).as_posix()) if id(node) in in_function else eager.append(str(path)))
    assert eager == []
    assert lazy == {"tuning/__init__.py", "warmup.py"}


def test_torch_device_of_simulated_and_real_devices(simulated_device):
    assert _tune_hooks.torch_device(simulated_device) == torch.device("cpu")
    real = DeviceInfo("rocm", 1, "AMD Instinct MI300X", "gfx942", 64, 304, 1024, 65536)
    assert _tune_hooks.torch_device(real) == torch.device("cuda", 1)


def test_bad_arguments(simulated_device):
    with pytest.raises(KeyError, match="no tuning hook for kernel 'nope'"):
        _tune_hooks.make_hook("nope")
    with pytest.raises(ValueError, match="lacks hidden"):
        _tune_hooks.build_run("fused_linear_cross_entropy", simulated_device, {"n_cols": 8, "n_rows": 4}, torch.float32)


def test_inputs_that_do_not_fit_raise_memory_error(simulated_device, monkeypatch):
    monkeypatch.setattr(problem_module, "free_bytes", lambda where: 1000)
    with pytest.raises(MemoryError, match=r"tuning swiglu_bwd for .* needs about .* GiB"):
        _tune_hooks.build_run("swiglu_bwd", simulated_device, ROWS, torch.float32)


# --------------------------------------------------------------------------- every hook


# Each kernel on one simulated device, rotating through every vendor's table (time: interpreter).
ROTATION = [(k, DEVICE_NAMES[i % len(DEVICE_NAMES)]) for i, k in enumerate(sorted(SPECS))]


@pytest.mark.parametrize("kernel,simulated_device", ROTATION, indirect=["simulated_device"])
def test_hook_launches_exactly_the_config_and_tune_records(kernel, simulated_device, monkeypatch):
    dev, named, dtype = simulated_device, PROBLEMS[kernel], torch.float32
    module, fn_name = LAUNCHERS[kernel]
    real = getattr(module, fn_name)
    seen: list[Resolved] = []

    def spy(*args, **kwargs):
        seen.append(kwargs["config"])
        return real(*args, **kwargs)

    def no_resolve(*args, **kwargs):
        raise AssertionError(f"resolve{args[:1]} called while tuning: the hook must pass its config")

    monkeypatch.setattr(module, fn_name, spy)
    for m in (*OPS_MODULES, launch_ops):  # every module that looks resolve up
        if hasattr(m, "resolve"):
            monkeypatch.setattr(m, "resolve", no_resolve)
    monkeypatch.setattr(search, "candidates", lambda k, d, n, _all=search.candidates: _all(k, d, n)[:2])
    times = iter([1.0, 0.8, 0.6])  # the table default, then the two candidates: the last wins
    outputs: list[tuple] = []

    def timer(fn):
        outputs.append(_clone(fn()))
        return next(times)

    rng = torch.get_rng_state()
    run = _tune_hooks.make_hook(kernel, timer=timer)(dev, named, dtype)
    assert torch.equal(rng, torch.get_rng_state()), "the hook drew from the global random generator"
    assert seen == []  # building runs prerequisites only (with their own explicit config)

    # tune() over the hook: three launches, each with the config tune chose, the winner recorded
    res = search.tune(kernel, dev, named, dtype, run)
    cands = search.candidates(kernel, dev, named)
    assert [r.config.to_dict() for r in seen] == [search.default_config(kernel, dev, named), *cands]
    assert res.source == "search" and res.config == cands[1] and res.time_ms == 0.6 and res.default_ms == 1.0
    entry = autotune_cache.lookup_entry(SPECS[kernel], dev, named, dtype)
    assert entry is not None and entry["config"] == cands[1] and entry["time_ms"] == 0.6

    # run(resolved) hands the op that very Resolved
    mine = make_resolved(kernel, cands[0])
    times = iter([0.5])
    assert run(mine) == 0.5 and seen[-1] is mine

    # every launch computed the right answer
    ref = reference(kernel, run.inputs)
    for out in outputs:
        assert_matches(kernel, out, ref, dtype)


@pytest.mark.parametrize("simulated_device", ["xpu-xe-hpc"], indirect=True)
@pytest.mark.parametrize("kernel", sorted(SPECS))
def test_hook_bfloat16(kernel, simulated_device):
    """The hooks in bf16 (inputs drawn in bf16, the ops' bf16 outputs) with the table default."""
    dev, named, dtype = simulated_device, PROBLEMS[kernel], torch.bfloat16
    outputs = []
    run = _tune_hooks.build_run(kernel, dev, named, dtype, timer=lambda fn: (outputs.append(_clone(fn())), 1.0)[1])
    assert all(t.dtype in (dtype, torch.float32, torch.long) for t in run.inputs.values())
    assert run(make_resolved(kernel, search.default_config(kernel, dev, named))) == 1.0
    assert_matches(kernel, outputs[0], reference(kernel, run.inputs), dtype)


# --------------------------------------------------------------------------- runtime tuning end to end


def test_autotune_miss_registers_and_uses_the_default_hooks(simulated_device, monkeypatch):
    """LIGER_PORTABLE_AUTOTUNE=1, empty cache: the first miss loads the hooks, tunes with the
    real hook (inputs on the CPU, the interpreter), records; then resolve reads the entry."""
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    monkeypatch.setattr(search, "candidates", lambda k, d, n, _all=search.candidates: _all(k, d, n)[:1])
    timed = []

    def fake_bench(fn):
        fn()
        timed.append(1)
        return 2.0 if len(timed) == 1 else 1.0  # the candidate beats the table default

    monkeypatch.setattr(timing, "do_bench_ms", fake_bench)
    assert runtime.registered_hooks() == {}
    problem = (ROWS["n_cols"], ROWS["n_rows"])
    r = resolve("rms_norm_fwd", simulated_device, problem, torch.float32)
    assert set(runtime.registered_hooks()) == set(SPECS) and len(timed) == 2
    cand = search.candidates("rms_norm_fwd", simulated_device, ROWS)[0]
    assert r.source.startswith("user cache") and r.config.to_dict() == cand
    x, w = torch.randn(ROWS["n_rows"], ROWS["n_cols"]), torch.randn(ROWS["n_cols"])
    y, _ = rms_ops.rms_norm_fwd(x, w, EPS, 0.0, False)  # the tuned config, through resolve
    assert rel_err(y, fallback.rms_norm(x.double(), w.double(), EPS, 0.0, "llama")) < TOL[torch.float32]
    assert len(timed) == 2  # the hit did not tune again


# --------------------------------------------------------------------------- parallel compile (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["rms_norm_bwd", "rope", "cross_entropy"])
def test_parallel_compile_gpu(kernel):
    """tune(dedicated=True) on the GPU: every config compiled in threads first, then timed;
    Triton's launch is restored afterwards, and launches of the timed configs compute the right
    answer (a kernel left half-compiled, or a launch still turned into a compile-only warmup, would not)."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run
    dev = liger_portable.platform().device(0)
    named, dtype = PROBLEMS[kernel], torch.float32
    run = _tune_hooks.build_run(kernel, dev, named, dtype)
    res = search.tune(kernel, dev, named, dtype, run, record=False, dedicated=True)
    assert res.compile.startswith(("parallel compile", "serial compile (this Triton has no"))
    assert JITFunction.run is original and not timing.compile_only_active()
    assert res.time_ms is not None and len(res.timings) >= 2
    outputs: list[tuple] = []
    run.timer = lambda fn: (outputs.append(_clone(fn())), 1.0)[1]
    for cfg, _ms in res.timings[:6]:
        run(make_resolved(kernel, cfg))
    ref = reference(kernel, {k: v.cpu() for k, v in run.inputs.items()})
    for out in outputs:
        assert_matches(kernel, tuple(o.cpu() if isinstance(o, torch.Tensor) else o for o in out), ref, dtype)


def test_precompile_is_serial_in_the_interpreter_and_with_a_custom_timer(monkeypatch):
    """precompile() only runs with Triton's own launches on a GPU: the interpreter and a custom timer
    (the CPU tests' fake timers) keep the serial path, and nothing is launched for it."""
    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert timing.precompile("rms_norm_fwd", [{}], calls.append).startswith("serial")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert timing.precompile("rms_norm_fwd", [{}], calls.append, timer=lambda fn: 1.0).startswith("serial")
    assert calls == []


@pytest.mark.gpu
def test_graph_timing_excludes_the_host_gpu():
    """Inside tune(dedicated=True) do_bench_ms times CUDA-graph replays: a launch whose host side
    is slow (3 ms of Python before a tiny kernel) measures the kernel, where eager timing measures
    the host. The replays really run the kernel.

    The host's 3 ms are long beside the cache-clearing fill that eager timing runs before each start
    event: with 0.5 ms, a GPU shared with the suite's other workers (``-n 8``) ran that fill late
    enough to hide the host's time."""
    import time

    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs: CUDA or ROCm")
    x = torch.zeros(1024, device="cuda")

    def slow_host_launch():
        time.sleep(3e-3)
        x.add_(1.0)

    eager_ms = timing.do_bench_ms(slow_host_launch)
    with timing.cuda_graph_timing():
        before = x[0].item()
        graph_ms = timing.do_bench_ms(slow_host_launch)
        assert x[0].item() > before + 10  # the replays added
    assert eager_ms >= 2.0, eager_ms
    assert graph_ms <= 0.1, graph_ms


def test_no_cuda_graph_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert timing.cuda_graph(lambda: None) is None


# --------------------------------------------------------------------------- equivalent configs


class _LaunchRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the grid and every
    non-tensor argument (sizes, strides, constexprs, num_warps, num_stages) and launches nothing."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            plain = lambda v: not isinstance(v, torch.Tensor)  # noqa: E731
            self.log.append((self.name, tuple(grid), tuple(a for a in args if plain(a)),
                             tuple(sorted((k, v) for k, v in kwargs.items() if plain(v)))))
        return launch


@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize(
    "kernel,param,values,named",
    [
        ("rms_norm_fwd", "BLOCK_N_MAX", [128, 256, 512, 16384], {"n_cols": 300, "n_rows": 19}),
        ("layer_norm_bwd", "BLOCK_N_MAX", [128, 256, 512, 65536], {"n_cols": 300, "n_rows": 19}),
        ("swiglu_fwd", "BLOCK_N", [16, 64, 128, 256, 4096], {"n_cols": 100, "n_rows": 19}),
    ],
)
def test_equivalent_configs_launch_the_same_kernel(kernel, param, values, named, simulated_device, monkeypatch):
    """Configs that KernelSpec.equivalent puts in one group make exactly the same launches (grid,
    sizes, constexprs, warps); configs in different groups make different ones. So the tuner, which
    times one config per group, skips only true duplicates."""
    dev, spec = simulated_device, SPECS[kernel]
    module = LAUNCHERS[kernel][0]
    log: list = []
    for name, obj in list(vars(module).items()):
        if name.endswith("_kernel"):
            monkeypatch.setattr(module, name, _LaunchRecorder(name, log))
        elif isinstance(obj, launch_ops.Launcher):  # the launchers hold their kernel
            monkeypatch.setattr(obj, "fn", _LaunchRecorder(name, log))
    run = _tune_hooks.build_run(kernel, dev, named, torch.float32, timer=lambda fn: (fn(), 1.0)[1])
    base = search.default_config(kernel, dev, named)
    launches, groups = {}, {}
    for v in values:
        cfg = {**base, param: v}
        log.clear()
        run(make_resolved(kernel, cfg))
        launches[v] = list(log)
        groups.setdefault(tuple(sorted(spec.equivalent(cfg, dict(named)).items())), []).append(v)
    assert len(groups) >= 2 and any(len(g) > 1 for g in groups.values()), groups
    for members in groups.values():
        assert all(launches[v] == launches[members[0]] for v in members), (members, launches)
    firsts = [launches[g[0]] for g in groups.values()]
    assert all(a != b for i, a in enumerate(firsts) for b in firsts[i + 1:]), groups


@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
def test_candidates_skip_equivalent_configs(simulated_device):
    """SwiGLU with 100 columns: every column block from 128 up is the same launch, so the search
    space's block sizes (256 to 4096) collapse onto the table default's."""
    named = {"n_cols": 100, "n_rows": 8192}
    spec, cands = SPECS["swiglu_fwd"], search.candidates("swiglu_fwd", simulated_device, named)
    forms = [tuple(sorted(spec.equivalent(c, named).items())) for c in cands]
    assert len(forms) == len(set(forms))
    base = search.default_config("swiglu_fwd", simulated_device, named)
    assert tuple(sorted(spec.equivalent(base, named).items())) not in forms
    wide = [(c["BLOCK_M"], c["num_warps"], c["num_stages"]) for c in cands if c["BLOCK_N"] >= 128]
    assert len(wide) == len(set(wide)), "two candidates differ only in a column block wider than the row"
    from liger_portable.configs import Limits, load_table, search_configs

    points = search_configs(load_table("cuda"), simulated_device.arch, "swiglu_fwd", Limits.of(simulated_device))
    assert any(p.get("BLOCK_N", 0) >= 256 for p in points)  # the search space has blocks to collapse


@pytest.mark.parametrize("simulated_device", DEVICE_NAMES, indirect=True)
def test_candidates_hold_at_most_max_values_a_thread(simulated_device):
    """No candidate holds more than MAX_VALUES_PER_THREAD values of a tensor per thread (such tiles
    spill and compile for seconds), every table default stays within it too, and the bound does
    prune: at 8192 columns the row-norm backward's 16-row tiles are not timed."""
    from liger_portable.compile_matrix import problems
    from liger_portable.specs import MAX_VALUES_PER_THREAD

    dev = simulated_device
    for kernel, spec in SPECS.items():
        if spec.tile_values is None:
            continue
        for p in problems(kernel):
            named = {f: p[f] for f in spec.key}
            for cfg in [search.default_config(kernel, dev, named), *search.candidates(kernel, dev, named)]:
                per_thread = spec.tile_values(cfg, named) / (cfg["num_warps"] * dev.warp_size)
                assert per_thread <= MAX_VALUES_PER_THREAD, (kernel, named, cfg)
    named = {"n_cols": 8192, "n_rows": 8192}
    assert all(c["BLOCK_M"] * 8192 <= MAX_VALUES_PER_THREAD * c["num_warps"] * dev.warp_size
               for c in search.candidates("rms_norm_bwd", dev, named))
    assert not any(c["BLOCK_M"] == 16 for c in search.candidates("rms_norm_bwd", dev, named))
