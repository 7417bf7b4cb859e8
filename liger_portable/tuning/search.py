"""The search: time every legal point of a kernel's search space, keep the fastest, never one
slower than the table default.

:func:`tune` times every legal point of a kernel's search space (:func:`candidates`, merged onto
the table default config, :func:`default_config`) with a ``run`` callable, also times the table
default, and records the winner in the user cache (:func:`liger_portable.autotune_cache.record`). A config
only wins if it beats the default by more than the noise margin; otherwise the default is recorded,
so a tuned entry is never slower than the table beyond noise. A config whose launch raises (out of
resources, ...) is skipped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .. import _dispatch, autotune_cache
from ..configs import ConfigError, Limits, check_config, load_table, search_configs, table_default
from ..hardware import DeviceInfo, platform
from ..specs import MAX_VALUES_PER_THREAD, SPECS
from .timing import Run, Timer, cuda_graph_timing, measure, precompile

NOISE = 0.02  # a config must beat the table default by more than this fraction to be chosen


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
        compile: how the configs were compiled (serial, or parallel threads:
            :func:`liger_portable.tuning.timing.precompile`).
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
    return table_default(kernel, device, named)


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
            check_config(cfg, spec, device.backend, limits, "search", arch=device.arch)
        except ConfigError:
            continue
        out.append(cfg)
    return out


def on_device(device: DeviceInfo) -> contextlib.AbstractContextManager:
    """A context in which ``device`` is the current GPU (``torch.cuda.device`` / ``torch.xpu.device``);
    nothing for a device this process does not drive (a simulated one: CPU tensors in the Triton
    interpreter)."""
    p = platform()
    if _dispatch.simulated() is not None or device.index < 0 or p.backend != device.backend:
        return contextlib.nullcontext()
    return getattr(torch, p.torch_device_type).device(device.index)


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
            return the time in ms itself; with ``timer`` (e.g.
            :func:`liger_portable.tuning.timing.do_bench_ms`) each config is timed as
            ``timer(lambda: run(resolved))``.
        noise: a searched config must be faster than the table default by more than this
            fraction to be chosen.
        record: write the result to the cache (the warmup's ``--dry-run`` does not).
        dedicated: for a process that does nothing else meanwhile (the warmup): compile all
            configs in parallel threads first (:func:`~liger_portable.tuning.timing.precompile`)
            and time CUDA-graph replays (:func:`~liger_portable.tuning.timing.do_bench_ms`).

    A config whose run raises is skipped (listed in ``TuneResult.skipped``). If the table default
    itself fails, the fastest config that ran wins; if nothing ran, the table default is kept
    (with ``time_ms`` ``None``) and nothing is recorded.
    """
    spec = SPECS[kernel]
    named = dict(problem) if isinstance(problem, Mapping) else dict(zip(spec.key, problem))
    default = default_config(kernel, device, named)
    result = TuneResult(default, None, None, "table default", autotune_cache.entry_key(spec, named, dtype))
    configs = list(candidates(kernel, device, named))
    # On the device's GPU made current: the timing's events, streams and graphs are the current
    # device's (a model split over GPUs tunes for a GPU that need not be current).
    with on_device(device):
        if dedicated:
            result.compile = precompile(kernel, [default, *configs], run, timer)
        with cuda_graph_timing(dedicated):
            _search(kernel, run, timer, noise, default, configs, result)
    if record and result.time_ms is not None:
        autotune_cache.record(spec, device, named, dtype, result.config, result.time_ms, result.default_ms)
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
            measure(kernel, default, run, timer)
        result.default_ms = measure(kernel, default, run, timer)
        result.timings.append((default, result.default_ms))
    except Exception as e:  # noqa: BLE001 - e.g. out of resources on this device
        result.skipped.append((default, f"{type(e).__name__}: {e}"))
    best: tuple[dict, float] | None = None
    for cfg in configs:
        try:
            ms = measure(kernel, cfg, run, timer)
        except Exception as e:  # noqa: BLE001
            result.skipped.append((cfg, f"{type(e).__name__}: {e}"))
            continue
        result.timings.append((cfg, ms))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    if result.default_ms is not None:
        if compiled_first:
            try:  # the default timed again after the search: a drift of clocks cannot favour the search
                result.default_ms = min(result.default_ms, measure(kernel, default, run, timer))
            except Exception:  # noqa: BLE001 - it ran before; keep that time
                pass
        result.time_ms = result.default_ms
        if best is not None and best[1] < result.default_ms * (1.0 - noise):
            result.config, result.time_ms, result.source = best[0], best[1], "search"
    elif best is not None:
        result.config, result.time_ms, result.source = best[0], best[1], "search"
