"""Tuning launch configs: time the search space, keep the fastest, never one slower than the table.

The tuning layer sits above the config lookup (:mod:`liger_portable.configs`) and the kernels
(:mod:`liger_portable.ops`); the lookup never imports it. Split by job:

* :mod:`~liger_portable.tuning.timing`: :func:`do_bench_ms` (eager or CUDA-graph timing) and
  :func:`precompile` (every config compiled in parallel threads before any is timed).
* :mod:`~liger_portable.tuning.search`: :func:`tune` times every legal point of a kernel's search
  space (:func:`candidates`) against the table default (:func:`default_config`) and records the
  winner in the user cache; a config wins only if it beats the default beyond the noise margin.
* :mod:`~liger_portable.tuning.runtime`: with ``LIGER_PORTABLE_AUTOTUNE=1``, a cache miss of
  ``resolve`` is tuned once per process under the device model's tuning lock
  (:func:`autotune_miss`, installed as the lookup's miss handler when this package is imported),
  through the hook registered for the kernel (:func:`register_hook`).
* :mod:`~liger_portable.tuning.agree`: :func:`agree`, one choice for the ranks of one device model.
* :mod:`~liger_portable.tuning.hooks`: the default hook of every kernel (it imports the kernels,
  so it is loaded late: on the first miss that needs a hook, or by the warmup).

This package re-exports the public names. To replace one in a test, patch the module that defines
it (``search.candidates``, ``timing.do_bench_ms``): the others look it up there.
"""

from __future__ import annotations

from . import runtime
from .agree import agree
from .runtime import (
    ENV_LOCK_TIMEOUT,
    LOCK_TIMEOUT_S,
    TuneHook,
    autotune_miss,
    hook_for,
    lock_timeout,
    register_hook,
    registered_hooks,
    reset_hooks,
    reset_runtime,
    tuned_here,
    unregister_hook,
)
from .search import NOISE, TuneResult, candidates, default_config, tune
from .timing import do_bench_ms, precompile


def _register_default_hooks() -> None:
    from . import hooks  # late: the hooks import every kernel (Triton)

    hooks.register_all()


# The runtime cannot import the hooks (they register with it): the loader is installed from here.
runtime.set_default_hooks(_register_default_hooks)

__all__ = [
    "ENV_LOCK_TIMEOUT",
    "LOCK_TIMEOUT_S",
    "NOISE",
    "TuneHook",
    "TuneResult",
    "agree",
    "autotune_miss",
    "candidates",
    "default_config",
    "do_bench_ms",
    "hook_for",
    "lock_timeout",
    "precompile",
    "register_hook",
    "registered_hooks",
    "reset_hooks",
    "reset_runtime",
    "tune",
    "tuned_here",
    "unregister_hook",
]
