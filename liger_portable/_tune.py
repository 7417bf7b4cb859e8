"""Tuning launch configs: time the search space, keep the fastest, never one slower than the table.

Three parts:

* :func:`tune` times every legal point of a kernel's search space (merged onto the table default
  config) with a ``run`` callable, also times the table default, and records the winner in the user
  cache (:func:`liger_portable._cache.record`). A config only wins if it beats the default by more
  than the noise margin; otherwise the default is recorded, so a tuned entry is never slower than
  the table beyond noise. A config whose launch raises (out of resources, ...) is skipped.
* Runtime tuning: with ``LIGER_PORTABLE_AUTOTUNE=1``, a cache miss in
  :func:`liger_portable._configs.resolve` calls :func:`autotune_miss` (installed as the lookup's
  miss handler when this module is imported: the lookup never imports the tuner), which calls the
  tuning hook registered for that kernel
  (:func:`register_hook`; :mod:`liger_portable._tune_hooks` provides one per kernel, registered on
  the first miss) once per (kernel, device model, problem bucket, dtype) and process, and records
  the result. Never during CUDA-graph capture (the table default is used, one warning).
* :func:`agree`: under ``torch.distributed``, the ranks that share a device model take the choice
  of the lowest of them, so no two ranks with the same GPU model diverge (the warmup uses it).

Processes and ranks (runtime tuning). A miss takes the device model's tuning lock, a lock file in
the user cache folder (:func:`liger_portable._cache.tuning_lock`), re-reads the cache, and tunes
only if no other process recorded the entry meanwhile; otherwise it uses that entry. No
collectives are involved, so ranks that miss at different points, or not at all, cannot deadlock:
a rank waits at most for one tuning of one problem by another process. Hence:

* Every process that shares the cache folder (all ranks of one node by default) tunes each
  problem once and uses the same config.
* Ranks on other nodes agree with them only if they share the folder, e.g.
  ``LIGER_PORTABLE_CACHE_DIR`` on a shared file system whose ``flock`` works across hosts (NFS
  v4, Lustre with ``flock``). Otherwise each node tunes once and nodes may choose different
  configs: speed, and the last-bit rounding of a reduction, may then differ between nodes; results
  stay correct. To make every node agree, run ``liger-portable warmup`` under torchrun before
  training (it agrees through collectives) and train with the cache it wrote.
* A process that waits longer than ``LIGER_PORTABLE_TUNE_LOCK_TIMEOUT`` seconds (default
  :data:`LOCK_TIMEOUT_S`) uses the table default for that problem (one warning naming the holder)
  and does not wait again: its later misses only try the lock. A process that dies while tuning
  releases the lock at once (``flock``), so no lock goes stale.
* The holder's timing (:func:`do_bench_ms`) waits for its own events only, never for the whole
  device, so it does not wait for a collective in flight that a rank blocked on the lock has not
  joined yet.
* If the user cache is not writable (entries would stay in one process's memory) the lock cannot
  share results: a single process still tunes, but inside a multi-rank ``torch.distributed`` job
  the table default is used (one warning), as ranks would tune apart.

Tuning one problem takes seconds to a few minutes (a compile and a timing per config); ranks that
did not miss wait meanwhile in their next collective, so keep the collective timeout above that,
or tune before training with ``liger-portable warmup``.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import torch

from . import _cache, _configs, _paths
from ._configs import (
    ConfigError,
    Limits,
    Resolved,
    _check_config,
    _fit_to_device,
    load_table,
    make_resolved,
    search_configs,
    table_config,
)
from ._platform import DeviceInfo
from ._specs import MAX_VALUES_PER_THREAD, SPECS

NOISE = 0.02  # a config must beat the table default by more than this fraction to be chosen

Run = Callable[[Resolved], Any]
Timer = Callable[[Callable[[], Any]], float]
# hook(device, named_problem, dtype) -> run: builds inputs for the problem, returns a callable that
# launches the kernel once with the given config and returns its time in ms.
TuneHook = Callable[[DeviceInfo, dict, torch.dtype], Callable[[Resolved], float]]

T = TypeVar("T")


def _device_driver() -> Any:
    """Triton's active driver (its device interface is ``torch.cuda`` or ``torch.xpu``)."""
    from triton.runtime import driver

    return driver.active


_compile_only = threading.local()  # set by :func:`precompile`: do_bench_ms launches nothing
_graph_timing = threading.local()  # set by tune(dedicated=True): do_bench_ms times a CUDA graph of fn


def _cuda_graph(fn: Callable[[], Any]) -> Any | None:
    """A CUDA (or HIP) graph of one call of ``fn``, or None where graphs are unavailable or the
    capture fails (an op that synchronises, say): then ``fn`` is timed as it is."""
    if not torch.cuda.is_available():
        return None
    # What ``torch.cuda.graph`` does, less its device synchronize and gc.collect() (tens of ms, once
    # per config): capture on a side stream that waits for the current one.
    graph, side, current = torch.cuda.CUDAGraph(), torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
    except Exception:  # noqa: BLE001 - time the eager call instead
        return None
    finally:
        current.wait_stream(side)
    return graph


def do_bench_ms(fn: Callable[[], Any], warmup_ms: float = 5.0, rep_ms: float = 10.0, min_reps: int = 5) -> float:
    """Median time of ``fn`` in ms on the current GPU and stream.

    The method of ``triton.testing.do_bench`` (the L2 cache cleared before each timed run, event
    timing, the run count from a first estimate: ``rep_ms`` of runs, at least ``min_reps``; 10 ms
    give hundreds of runs of a memory-bound kernel), with one difference: it waits for its own events
    only, never for the whole device. A device-wide synchronize would also wait for collectives in
    flight on other streams (NCCL), which a rank waiting for the tuning lock may not have joined
    yet: the holder would wait for the waiter and the waiter for the holder.

    Inside ``tune(dedicated=True)`` (the warmup, a process that does nothing else) ``fn`` is captured
    once in a CUDA graph and the replays are timed: the GPU time without the host's launch cost.
    Eager timing counts that cost whenever the host is slower than the kernel (a RoPE launch of
    about 25 us on a host that needs more to launch it measured anywhere from 0.03 to 0.08 ms on
    the H200). Runtime tuning, inside a training process whose other streams may be busy, keeps
    eager timing.
    """
    if getattr(_compile_only, "active", False):
        fn()  # inside precompile(): the launches only submit their compiles
        return 1.0
    driver = _device_driver()
    di = driver.get_device_interface()

    def event():
        return di.Event(enable_timing=True)

    done = event()
    fn()  # compile and load first
    done.record()
    done.synchronize()
    graph = _cuda_graph(fn) if getattr(_graph_timing, "active", False) else None
    if graph is not None:
        fn = graph.replay
    cache = driver.get_empty_cache_for_benchmark()
    start, end = event(), event()
    start.record()
    for _ in range(5):
        driver.clear_cache(cache)
        fn()
    end.record()
    end.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    n_warmup, n_repeat = max(1, int(warmup_ms / estimate_ms)), max(min_reps, int(rep_ms / estimate_ms))
    starts, ends = [event() for _ in range(n_repeat)], [event() for _ in range(n_repeat)]
    for _ in range(n_warmup):
        fn()
    for s, e in zip(starts, ends):
        driver.clear_cache(cache)
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        config: the chosen full config (the table default unless a point beat it beyond noise).
        time_ms: the chosen config's time; default_ms: the table default's time (``None`` if it
            failed to run).
        source: ``"search"`` or ``"table default"``.
        key: the cache entry key written.
        timings: (config, ms) of every point that ran; skipped: (config, error) of those that raised.
        compile: how the configs were compiled (serial, or parallel threads: :func:`precompile`).
    """

    config: dict[str, Any]
    time_ms: float | None
    default_ms: float | None
    source: str
    key: str
    timings: list[tuple[dict, float]] = field(default_factory=list)
    skipped: list[tuple[dict, str]] = field(default_factory=list)
    compile: str = "serial compile"

    @property
    def gain(self) -> float | None:
        """Relative speed-up over the table default (0.0 when the default was kept)."""
        if self.time_ms is None or not self.default_ms:
            return None
        return 1.0 - self.time_ms / self.default_ms


def default_config(kernel: str, device: DeviceInfo, named: Mapping[str, int]) -> dict[str, Any]:
    """The table's config for ``named`` on ``device`` (fitted to its limits, as resolve does)."""
    cfg, _ = table_config(load_table(device.backend), device.arch, kernel, dict(named))
    cfg = dict(cfg)
    spec, limits = SPECS[kernel], Limits.of(device)
    try:
        _check_config(cfg, spec, device.backend, limits, "table default")
    except ConfigError:
        cfg = _fit_to_device(cfg, limits)
    return cfg


def candidates(kernel: str, device: DeviceInfo, named: Mapping[str, int]) -> list[dict[str, Any]]:
    """Every distinct full config of the search space (merged onto the table default) that is
    legal on ``device``; the table default itself is not included, nor a config that launches the
    same kernel as one already listed on this problem (``KernelSpec.equivalent``), nor one whose
    tile holds more than ``MAX_VALUES_PER_THREAD`` values of a tensor per thread
    (``KernelSpec.tile_values``: it spills, and compiles slowly)."""
    table = load_table(device.backend)
    spec, limits = SPECS[kernel], Limits.of(device)
    base = default_config(kernel, device, named)
    problem = dict(named)
    seen = {tuple(sorted(spec.equivalent(base, problem).items()))}
    out = []
    for point in search_configs(table, device.arch, kernel, limits):
        cfg = {**base, **point}
        k = tuple(sorted(spec.equivalent(cfg, problem).items()))
        if k in seen:
            continue
        threads = cfg["num_warps"] * device.warp_size
        if spec.tile_values is not None and spec.tile_values(cfg, problem) > MAX_VALUES_PER_THREAD * threads:
            continue
        seen.add(k)
        try:
            _check_config(cfg, spec, device.backend, limits, "search")
        except ConfigError:
            continue
        out.append(cfg)
    return out


def _measure(kernel: str, cfg: dict, run: Run, timer: Timer | None) -> float:
    resolved = make_resolved(kernel, cfg, "tuning")
    if timer is None:
        ms = float(run(resolved))
    else:
        ms = float(timer(lambda: run(resolved)))
    if not math.isfinite(ms) or ms <= 0:
        raise ValueError(f"timer returned {ms!r}")
    return ms


def _precompile_threads() -> int:
    return min(32, max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)))


def precompile(kernel: str, configs: list[dict], run: Run, timer: Timer | None = None) -> str:
    """Compile the kernels of every config in parallel threads before any is timed.

    Compiling dominates tuning (about 0.2-0.5 s a config against a few ms of timing), and Triton's
    compiler releases the GIL for most of its work. Each config's ``run`` is called once with
    Triton's launches turned into compile-only warmups submitted to a thread pool (Triton's
    ``AsyncCompileMode``); the timing that follows then finds every kernel compiled. Only for a
    dedicated tuning process (the warmup): while it runs, *every* Triton launch in this process
    only compiles. Returns what was done, for the log; without ``AsyncCompileMode`` (older Triton)
    or on the interpreter it does nothing and the timing compiles one config at a time.
    """
    if os.environ.get("TRITON_INTERPRET") == "1" or timer not in (None, do_bench_ms):
        return "serial compile (interpreter or custom timer)"
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except ImportError:
        return "serial compile (this Triton has no AsyncCompileMode)"
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    threads = _precompile_threads()
    with ThreadPoolExecutor(threads) as pool:
        try:
            mode = AsyncCompileMode(pool, ignore_errors=True)
        except TypeError:  # older signature: errors surface at the launch that times the config
            mode = AsyncCompileMode(pool)
        try:
            with mode:
                JITFunction.run = compile_only
                _compile_only.active = True
                try:
                    for cfg in configs:
                        try:
                            _measure(kernel, cfg, run, None)
                        except Exception:  # noqa: BLE001 - the timing reports this config's error
                            pass
                finally:
                    JITFunction.run = original
                    _compile_only.active = False
        except Exception:  # noqa: BLE001 - a failed compile: its timing raises it again and skips it
            pass
    return f"parallel compile on {threads} threads"


def tune(
    kernel: str,
    device: DeviceInfo,
    problem: tuple | Mapping[str, int],
    dtype: torch.dtype,
    run: Run,
    *,
    timer: Timer | None = None,
    noise: float = NOISE,
    record: bool = True,
    dedicated: bool = False,
) -> TuneResult:
    """Tune ``kernel`` for ``problem`` on ``device`` and record the result in the user cache.

    Args:
        problem: values in the order of the kernel spec's ``key``, or a dict of them.
        run: ``run(resolved)`` launches the kernel with that config. Without ``timer`` it must
            return the time in ms itself; with ``timer`` (e.g. :func:`do_bench_ms`) each config is
            timed as ``timer(lambda: run(resolved))``.
        noise: a searched config must be faster than the table default by more than this
            fraction to be chosen.
        record: write the result to the cache (the warmup's ``--dry-run`` does not).
        dedicated: for a process that does nothing else meanwhile (the warmup): compile all
            configs in parallel threads first (:func:`precompile`) and time CUDA-graph replays
            (:func:`do_bench_ms`).

    A config whose run raises is skipped (listed in ``TuneResult.skipped``). If the table default
    itself fails, the fastest config that ran wins; if nothing ran, the table default is kept
    (with ``time_ms`` ``None``) and nothing is recorded.
    """
    spec = SPECS[kernel]
    named = dict(problem) if isinstance(problem, Mapping) else dict(zip(spec.key, problem))
    default = default_config(kernel, device, named)
    result = TuneResult(default, None, None, "table default", _cache.entry_key(spec, named, dtype))
    configs = list(candidates(kernel, device, named))
    if dedicated:
        result.compile = precompile(kernel, [default, *configs], run, timer)
    _graph_timing.active = dedicated
    try:
        _search(kernel, run, timer, noise, default, configs, result)
    finally:
        _graph_timing.active = False
    if record and result.time_ms is not None:
        _cache.record(spec, device, named, dtype, result.config, result.time_ms, result.default_ms)
    return result


def _search(
    kernel: str, run: Run, timer: Timer | None, noise: float, default: dict, configs: list[dict], result: TuneResult
) -> None:
    """Time the default and every candidate; set the winner in ``result`` (see :func:`tune`)."""
    compiled_first = result.compile.startswith("parallel")
    try:
        if compiled_first:
            # The GPU idled while the CPU compiled and its clocks may have dropped: an untimed
            # first measurement wakes it.
            _measure(kernel, default, run, timer)
        result.default_ms = _measure(kernel, default, run, timer)
        result.timings.append((default, result.default_ms))
    except Exception as e:  # noqa: BLE001 - e.g. out of resources on this device
        result.skipped.append((default, f"{type(e).__name__}: {e}"))
    best: tuple[dict, float] | None = None
    for cfg in configs:
        try:
            ms = _measure(kernel, cfg, run, timer)
        except Exception as e:  # noqa: BLE001
            result.skipped.append((cfg, f"{type(e).__name__}: {e}"))
            continue
        result.timings.append((cfg, ms))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    if result.default_ms is not None:
        if compiled_first:
            try:  # the default timed again after the search: a drift of clocks cannot favour the search
                result.default_ms = min(result.default_ms, _measure(kernel, default, run, timer))
            except Exception:  # noqa: BLE001 - it ran before; keep that time
                pass
        result.time_ms = result.default_ms
        if best is not None and best[1] < result.default_ms * (1.0 - noise):
            result.config, result.time_ms, result.source = best[0], best[1], "search"
    elif best is not None:
        result.config, result.time_ms, result.source = best[0], best[1], "search"


# --------------------------------------------------------------------------- runtime tuning

ENV_LOCK_TIMEOUT = "LIGER_PORTABLE_TUNE_LOCK_TIMEOUT"
LOCK_TIMEOUT_S = 900.0  # a wait for another process's tuning of one problem; generous on purpose

_hooks: dict[str, TuneHook] = {}
_attempted: set[tuple[str, str, str]] = set()
_lock = threading.Lock()
_warned: set[str] = set()
_defaults_registered = False
_gave_up: set[str] = set()
tuned_here: list[tuple] = []  # (kernel, device model, problem, dtype) this process tuned at run time  # device models whose tuning lock timed out in this process


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def register_hook(kernel: str, hook: TuneHook) -> None:
    """Register how to tune ``kernel`` at run time: ``hook(device, named_problem, dtype)`` returns
    a ``run(resolved) -> ms`` for :func:`tune` (it allocates inputs of that problem and times the
    kernel, e.g. with :func:`do_bench_ms`). It must launch with the explicit config it is given,
    never through ``resolve`` (which holds its lock while tuning). Replaces any hook of ``kernel``,
    including the default one of :mod:`liger_portable._tune_hooks`."""
    if kernel not in SPECS:
        raise KeyError(f"register_hook: unknown kernel {kernel!r}; known kernels: {', '.join(SPECS)}")
    _hooks[kernel] = hook


def unregister_hook(kernel: str) -> None:
    _hooks.pop(kernel, None)


def reset_runtime() -> None:
    """Forget which problems were tuned in this process (tests)."""
    with _lock:
        _attempted.clear()
        _warned.clear()
        _gave_up.clear()


def _register_defaults() -> None:
    """Register the hooks of :mod:`liger_portable._tune_hooks` (once per process; late, so that
    importing liger_portable does not import them). Hooks registered before are kept."""
    global _defaults_registered
    if _defaults_registered:
        return
    _defaults_registered = True
    try:
        from . import _tune_hooks

        _tune_hooks.register_all()
    except Exception as e:  # noqa: BLE001 - tuning must never stop training
        _warn_once(f"liger_portable: cannot load the tuning hooks ({type(e).__name__}: {e}); using table defaults")


def hook_for(kernel: str) -> TuneHook | None:
    """The tuning hook of ``kernel`` (the default hooks are registered on first use), or None."""
    if kernel not in _hooks:
        _register_defaults()
    return _hooks.get(kernel)


def lock_timeout() -> float:
    """Seconds a miss waits for another process's tuning: ``$LIGER_PORTABLE_TUNE_LOCK_TIMEOUT``,
    else :data:`LOCK_TIMEOUT_S`."""
    raw = os.environ.get(ENV_LOCK_TIMEOUT)
    if raw is None:
        return LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        _warn_once(
            f"liger_portable: {ENV_LOCK_TIMEOUT}={raw!r} is not a number of seconds >= 0; "
            f"using {LOCK_TIMEOUT_S:g}"
        )
        return LOCK_TIMEOUT_S
    return value


def _capturing() -> bool:
    """True inside CUDA-graph capture on the current stream (tuning must not launch then)."""
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001
        return False


def _multi_rank() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:  # noqa: BLE001
        return False


def _tune_now(kernel: str, device: DeviceInfo, named: dict, dtype: torch.dtype, hook: TuneHook) -> bool:
    """Build the hook's inputs, tune, record; the inputs are freed when this returns."""
    tuned_here.append((kernel, device.model_slug, named, str(dtype)))
    try:
        result = tune(kernel, device, named, dtype, hook(device, named, dtype))
    except Exception as e:  # noqa: BLE001 - tuning must never stop training
        _warn_once(f"liger_portable: tuning {kernel} for {named} failed ({type(e).__name__}: {e}); using the table default")
        return False
    return result.time_ms is not None


def autotune_miss(kernel: str, device: DeviceInfo, problem: tuple, dtype: torch.dtype) -> bool:
    """Called by ``resolve`` on a cache miss with ``LIGER_PORTABLE_AUTOTUNE=1``. Tunes once per
    (kernel, device model, bucket, dtype) and process under the device model's tuning lock (see the
    module docstring), or takes the entry another process recorded meanwhile; returns True if the
    user cache now holds an entry. Never raises: any failure leaves the table default in use (one
    warning)."""
    spec = SPECS[kernel]
    named = dict(zip(spec.key, problem))
    try:
        token = (kernel, device.model_slug, _cache.entry_key(spec, named, dtype))
    except Exception:  # noqa: BLE001
        return False
    if _capturing():
        _warn_once(
            "liger_portable: LIGER_PORTABLE_AUTOTUNE=1 but a cache miss happened during CUDA-graph "
            "capture; using the table default (tuning cannot launch inside capture). Run one eager "
            "step before capturing, or `liger-portable warmup`."
        )
        return False
    hook = hook_for(kernel)
    if hook is None:
        _warn_once(f"liger_portable: LIGER_PORTABLE_AUTOTUNE=1 but no tuning hook for {kernel!r}; using the table default")
        return False
    with _lock:
        if token in _attempted:
            return False
        _attempted.add(token)
    # After one timeout for this device model, later misses only try the lock (no second long wait).
    timeout = 0.0 if device.model_slug in _gave_up else lock_timeout()
    try:
        with _cache.tuning_lock(device, timeout) as got:
            if not got:
                if device.model_slug in _gave_up:  # warned at the first timeout
                    return False
                _gave_up.add(device.model_slug)
                holder = _cache.lock_holder(device)
                _warn_once(
                    f"liger_portable: waited {timeout:g} s for the tuning lock of {device.name} "
                    f"({_cache.tuning_lock_file(device)}, held by {holder or 'another process'}); using "
                    f"the table default for {kernel} {named}, and for later misses while the lock is "
                    f"busy. Raise {ENV_LOCK_TIMEOUT}, or tune before training with `liger-portable warmup`."
                )
                return False
            _cache.reread(device)  # another process may have tuned it while this one waited
            if _cache.lookup_entry(spec, device, named, dtype) is not None:
                return True
            return _tune_now(kernel, device, named, dtype, hook)
    except _cache.NoTuningLock as e:
        if _multi_rank():
            _warn_once(
                f"liger_portable: LIGER_PORTABLE_AUTOTUNE=1 is not applied inside a multi-rank "
                f"torch.distributed job when the autotune cache cannot be shared ({e}): ranks would "
                f"tune apart. Using cached or table configs. Fix: set {_paths.ENV_CACHE_DIR} to a "
                "writable folder, or run `liger-portable warmup` under torchrun before training."
            )
            return False
        return _tune_now(kernel, device, named, dtype, hook)


# --------------------------------------------------------------------------- rank agreement


def _current_model() -> str:
    from ._platform import platform

    p = platform()
    return p.device().model_slug if p.backend != "cpu" else "cpu"


def agree(choice_fn: Callable[[], T], *, model: str | None = None, group: Any = None) -> T:
    """Make the ranks that share a device model agree on one choice.

    Without an initialised ``torch.distributed`` (or with one rank) this is ``choice_fn()``.
    Otherwise ranks are grouped by device model (``model``, default the current device's model
    slug), the lowest rank of each group calls ``choice_fn`` (tunes, or reads the cache) and every
    rank of the group returns that rank's value. Every rank must call ``agree`` at the same point
    (it runs two ``all_gather_object`` collectives over ``group``). If the leader's ``choice_fn``
    raises, every rank of its group raises ``RuntimeError`` naming the leader and the error.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return choice_fn()
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    mine = model if model is not None else _current_model()
    models: list = [None] * world
    dist.all_gather_object(models, mine, group=group)
    leader = models.index(mine)
    payload: tuple[str, Any] = ("none", None)
    if me == leader:
        try:
            payload = ("ok", choice_fn())
        except Exception as e:  # noqa: BLE001 - reported to the whole group below
            payload = ("error", f"{type(e).__name__}: {e}")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, payload, group=group)
    status, value = gathered[leader]
    if status != "ok":
        raise RuntimeError(
            f"liger_portable.agree: the choice of rank {leader} (leader of the {mine} ranks) failed: {value}"
        )
    return value


_configs.set_miss_handler(autotune_miss)  # tuning wraps the config lookup from above
