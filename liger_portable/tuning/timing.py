"""Timing a kernel launch: :func:`do_bench_ms` (eager, or CUDA-graph replays inside
:func:`cuda_graph_timing`), and :func:`precompile`, which compiles many configs in parallel threads
before any is timed. Triton is imported only when something is timed or compiled."""

from __future__ import annotations

import math
import os
import statistics
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..configs import Resolved, make_resolved

Run = Callable[[Resolved], Any]
Timer = Callable[[Callable[[], Any]], float]


def device_driver() -> Any:
    """Triton's active driver (its device interface is ``torch.cuda`` or ``torch.xpu``)."""
    from triton.runtime import driver

    return driver.active


_compile_only = threading.local()  # set by :func:`precompile`: do_bench_ms launches nothing
_graph_timing = threading.local()  # set by cuda_graph_timing(): do_bench_ms times a CUDA graph of fn


def compile_only_active() -> bool:
    """True inside :func:`precompile` on this thread: launches only submit their compiles."""
    return getattr(_compile_only, "active", False)


@contextmanager
def cuda_graph_timing(active: bool = True) -> Iterator[None]:
    """Inside, :func:`do_bench_ms` on this thread times CUDA-graph replays of ``fn`` (``active``)
    or eager calls (not ``active``). ``tune(dedicated=True)`` times this way."""
    _graph_timing.active = active
    try:
        yield
    finally:
        _graph_timing.active = False


def cuda_graph(fn: Callable[[], Any]) -> Any | None:
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
    if compile_only_active():
        fn()  # inside precompile(): the launches only submit their compiles
        return 1.0
    driver = device_driver()
    di = driver.get_device_interface()

    def event():
        return di.Event(enable_timing=True)

    done = event()
    fn()  # compile and load first
    done.record()
    done.synchronize()
    graph = cuda_graph(fn) if getattr(_graph_timing, "active", False) else None
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


def measure(kernel: str, cfg: dict, run: Run, timer: Timer | None) -> float:
    """The time of one launch config of ``kernel``: ``run(resolved)`` itself, or
    ``timer(lambda: run(resolved))``. Raises ``ValueError`` for a time that is not finite and > 0."""
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
                            measure(kernel, cfg, run, None)
                        except Exception:  # noqa: BLE001 - the timing reports this config's error
                            pass
                finally:
                    JITFunction.run = original
                    _compile_only.active = False
        except Exception:  # noqa: BLE001 - a failed compile: its timing raises it again and skips it
            pass
    return f"parallel compile on {threads} threads"
