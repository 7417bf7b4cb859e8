"""Runtime tuning: with ``LIGER_PORTABLE_AUTOTUNE=1``, a cache miss in
:func:`liger_portable.configs.resolve` is tuned once per (kernel, device model, problem bucket,
dtype) and process, and recorded.

The config lookup never imports the tuner: importing this module installs :func:`autotune_miss` as
the lookup's miss handler (:func:`liger_portable.configs.set_miss_handler`), which ``resolve``
calls on a miss when ``LIGER_PORTABLE_AUTOTUNE=1`` is set at that moment (``import liger_portable``
imports this module; it imports neither Triton nor the kernels). A miss calls the tuning hook
registered for that kernel (:func:`register_hook`); the default hooks
(:mod:`liger_portable.tuning.hooks`, one per kernel, which import the kernels) are registered on
the first miss that needs one, through the loader :mod:`liger_portable.tuning` installs with
:func:`set_default_hooks`. Never during CUDA-graph capture (the table default is used, one warning).

Processes and ranks. A miss takes the device model's tuning lock, a lock file in the user cache
folder (:func:`liger_portable.autotune_cache.tuning_lock`), re-reads the cache, and tunes only if no other
process recorded the entry meanwhile; otherwise it uses that entry. No collectives are involved, so
ranks that miss at different points, or not at all, cannot deadlock: a rank waits at most for one
tuning of one problem by another process. Hence:

* Every process that shares the cache folder (all ranks of one node by default) tunes each
  problem once and uses the same config.
* Ranks on other nodes agree with them only if they share the folder, e.g.
  ``LIGER_PORTABLE_CACHE_DIR`` on a shared file system whose ``flock`` works across hosts (NFS
  v4, Lustre with ``flock``). Otherwise each node tunes once and nodes may choose different
  configs: speed, and the last-bit rounding of a reduction, may then differ between nodes; results
  stay correct. To make every node agree, run ``liger-portable warmup`` under torchrun before
  training (it agrees through collectives, :func:`liger_portable.tuning.agree`) and train with the
  cache it wrote.
* A process that waits longer than ``LIGER_PORTABLE_TUNE_LOCK_TIMEOUT`` seconds (default
  :data:`LOCK_TIMEOUT_S`) uses the table default for that problem (one warning naming the holder)
  and does not wait again: its later misses only try the lock. A process that dies while tuning
  releases the lock at once (``flock``), so no lock goes stale.
* The holder's timing (:func:`liger_portable.tuning.timing.do_bench_ms`) waits for its own events
  only, never for the whole device, so it does not wait for a collective in flight that a rank
  blocked on the lock has not joined yet.
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
import threading
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import autotune_cache, configs, _paths
from ..configs import Resolved
from ..hardware import DeviceInfo
from ..specs import SPECS
from .._warn import warn
from .search import tune

# hook(device, named_problem, dtype) -> run: builds inputs for the problem, returns a callable that
# launches the kernel once with the given config and returns its time in ms.
TuneHook = Callable[[DeviceInfo, dict, torch.dtype], Callable[[Resolved], float]]

ENV_LOCK_TIMEOUT = "LIGER_PORTABLE_TUNE_LOCK_TIMEOUT"
LOCK_TIMEOUT_S = 900.0  # a wait for another process's tuning of one problem; generous on purpose

_hooks: dict[str, TuneHook] = {}
_attempted: set[tuple[str, str, str]] = set()
_lock = threading.Lock()
_warned: set[str] = set()
_default_hooks: Callable[[], None] | None = None  # registers the default hooks (set_default_hooks)
_defaults_registered = False
_gave_up: set[str] = set()  # device models whose tuning lock timed out in this process
tuned_here: list[tuple] = []  # (kernel, device model, problem, dtype) this process tuned at run time


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warn(msg, RuntimeWarning)


def register_hook(kernel: str, hook: TuneHook) -> None:
    """Register how to tune ``kernel`` at run time: ``hook(device, named_problem, dtype)`` returns
    a ``run(resolved) -> ms`` for :func:`~liger_portable.tuning.search.tune` (it allocates inputs
    of that problem and times the kernel, e.g. with :func:`~liger_portable.tuning.timing.do_bench_ms`).
    It must launch with the explicit config it is given, never through ``resolve`` (which holds its
    lock while tuning). Replaces any hook of ``kernel``, including the default one of
    :mod:`liger_portable.tuning.hooks`."""
    if kernel not in SPECS:
        raise KeyError(f"register_hook: unknown kernel {kernel!r}; known kernels: {', '.join(SPECS)}")
    _hooks[kernel] = hook


def unregister_hook(kernel: str) -> None:
    _hooks.pop(kernel, None)


def registered_hooks() -> dict[str, TuneHook]:
    """The hooks registered now, by kernel (a copy)."""
    return dict(_hooks)


def reset_hooks(*, defaults: bool = True) -> None:
    """Forget every registered hook (tests). With ``defaults`` the default hooks are registered
    again on the next miss that needs one; without, they are not (until the next ``reset_hooks()``):
    only hooks registered from now on are used."""
    global _defaults_registered
    _hooks.clear()
    _defaults_registered = not defaults


def set_default_hooks(loader: Callable[[], None] | None) -> None:
    """Install ``loader()``, which registers the default hooks (:mod:`liger_portable.tuning`
    installs one that imports :mod:`liger_portable.tuning.hooks`; this module cannot import it, as
    the hooks register here). It runs once per process, on the first miss that finds no hook."""
    global _default_hooks
    _default_hooks = loader


def reset_runtime() -> None:
    """Forget which problems were tuned in this process (tests)."""
    with _lock:
        _attempted.clear()
        _warned.clear()
        _gave_up.clear()


def _register_defaults() -> None:
    """Register the default hooks (once per process; late, so that importing liger_portable does
    not import them). Hooks registered before are kept."""
    global _defaults_registered
    if _defaults_registered:
        return
    _defaults_registered = True
    if _default_hooks is None:
        return
    try:
        _default_hooks()
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


def capturing() -> bool:
    """True inside CUDA-graph capture on the current stream (tuning must not launch then)."""
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001
        return False


def multi_rank() -> bool:
    """True inside an initialised ``torch.distributed`` job of more than one rank."""
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:  # noqa: BLE001
        return False


def _tune_now(kernel: str, device: DeviceInfo, named: dict, dtype: torch.dtype, hook: TuneHook) -> bool:
    """Build the hook's inputs, tune, record; the inputs are freed when this returns."""
    tuned_here.append((kernel, device.model_slug, named, str(dtype)))
    try:
        # A miss while torch.compile traces a kernel op (fake tensors): tune on real ones (tune()
        # makes the device's GPU current, for a model split over GPUs).
        with _disable_current_modes():
            result = tune(kernel, device, named, dtype, hook(device, named, dtype))
    except Exception as e:  # noqa: BLE001 - tuning must never stop training
        _warn_once(f"liger_portable: tuning {kernel} for {named} failed ({type(e).__name__}: {e}); using the table default")
        return False
    if result.time_ms is None:
        reasons = "; ".join(err for _, err in result.skipped[:2])
        _warn_once(f"liger_portable: tuning {kernel} for {named}: no config ran ({reasons}); using the table default")
        return False
    return True


def autotune_miss(kernel: str, device: DeviceInfo, problem: tuple, dtype: torch.dtype) -> bool:
    """Called by ``resolve`` on a cache miss with ``LIGER_PORTABLE_AUTOTUNE=1``. Tunes once per
    (kernel, device model, bucket, dtype) and process under the device model's tuning lock (see the
    module docstring), or takes the entry another process recorded meanwhile; returns True if the
    user cache now holds an entry. Never raises: any failure leaves the table default in use (one
    warning)."""
    spec = SPECS[kernel]
    named = dict(zip(spec.key, problem))
    try:
        token = (kernel, device.model_slug, autotune_cache.entry_key(spec, named, dtype))
    except Exception:  # noqa: BLE001
        return False
    if capturing():
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
        with autotune_cache.tuning_lock(device, timeout) as got:
            if not got:
                if device.model_slug in _gave_up:  # warned at the first timeout
                    return False
                _gave_up.add(device.model_slug)
                holder = autotune_cache.lock_holder(device)
                _warn_once(
                    f"liger_portable: waited {timeout:g} s for the tuning lock of {device.name} "
                    f"({autotune_cache.tuning_lock_file(device)}, held by {holder or 'another process'}); using "
                    f"the table default for {kernel} {named}, and for later misses while the lock is "
                    f"busy. Raise {ENV_LOCK_TIMEOUT}, or tune before training with `liger-portable warmup`."
                )
                return False
            autotune_cache.reread(device)  # another process may have tuned it while this one waited
            if configs.usable_entry(spec, device, named, dtype) is not None:
                return True
            return _tune_now(kernel, device, named, dtype, hook)
    except autotune_cache.NoTuningLock as e:
        if multi_rank():
            _warn_once(
                f"liger_portable: LIGER_PORTABLE_AUTOTUNE=1 is not applied inside a multi-rank "
                f"torch.distributed job when the autotune cache cannot be shared ({e}): ranks would "
                f"tune apart. Using cached or table configs. Fix: set {_paths.ENV_CACHE_DIR} to a "
                "writable folder, or run `liger-portable warmup` under torchrun before training."
            )
            return False
        return _tune_now(kernel, device, named, dtype, hook)
    except OSError as e:  # the lock file itself failed: never stop training over it
        _warn_once(f"liger_portable: tuning {kernel} for {named} could not take the tuning lock ({e}); using the table default")
        return False


configs.set_miss_handler(autotune_miss)  # tuning wraps the lookup from above
