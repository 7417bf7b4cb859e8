"""Tuning hooks: for each kernel, inputs of one problem and a timed launch with an explicit config.

One hook per kernel spec (:data:`HOOKS`, the keys of :data:`liger_portable.specs.SPECS`), with
the signature :data:`liger_portable.tuning.runtime.TuneHook`::

    run = HOOKS["rms_norm_fwd"](device, {"n_cols": 4096, "n_rows": 8192}, torch.bfloat16)
    ms = run(resolved)        # launches rms_norm_fwd(..., config=resolved), returns its median time

A hook allocates random inputs of the named problem in ``dtype`` on ``device`` (from a private
generator: the caller's random state is not touched), runs what the kernel needs first once (the
forward of a backward, for its saved statistics), and returns a :class:`TuneRun`. Calling it
launches exactly that kernel with exactly the given config, through the op's launch function and
its ``config=`` override (never through ``resolve``: the resolver holds its lock while tuning), and
returns the time the timer measured (default :func:`liger_portable.tuning.timing.do_bench_ms`). The
inputs live as long as the :class:`TuneRun`: the tuner drops it when done, which frees them.

Inputs are the real problem's (the fused linear cross-entropy's too: it is chunked, so its extra
memory is one chunk of logits): about 2-5 tensors of ``n_rows x n_cols`` for the row kernels,
``BT x V`` twice for the cross-entropy, and ``hidden`` + ``weight`` with their gradients plus one
chunk for the fused linear cross-entropy. Before allocating, a hook checks that this fits in the
device memory that is free (or cached by PyTorch's allocator) and raises ``MemoryError`` if not.

Launches are those of a Hugging Face decoder's training step: RMSNorm in Llama casting mode
(``offset`` 0), LayerNorm with a bias, GLU backward not in place, RoPE on q and k laid out as
``(batch, seq, heads, head_dim)`` transposed to ``(batch, heads, seq, head_dim)`` (batch 1: the
problem key holds no batch; q and k split the heads of the key), cross-entropy with a mean
reduction and the gradient in its own buffer, fused linear cross-entropy without bias.

:func:`register_all` registers every hook with :func:`liger_portable.tuning.runtime.register_hook`;
the tuner calls it on the first miss under ``LIGER_PORTABLE_AUTOTUNE=1`` and the warmup before it
tunes.

The simulated device of the tests (:func:`liger_portable.simulate`) gets CPU tensors:
the kernels then run in the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .. import ops  # noqa: F401  (every kernel family registers its specs and examples)
from ..ops._problem import Problem, torch_device  # noqa: F401  (the examples' problem; re-exported)
from ..configs import Resolved
from ..hardware import DeviceInfo
from ..specs import EPS, IGNORE_INDEX, SPECS  # noqa: F401  (the examples' launch arguments)
from . import runtime, timing

Launch = Callable[[Resolved], Any]


@dataclass
class TuneRun:
    """``run(resolved) -> ms`` for one problem: its inputs and the launch of one kernel on them.

    Attributes:
        kernel: the kernel spec name.
        inputs: the tensors the launch reads (and buffers it writes into), by name.
        launch: ``launch(resolved)`` runs the kernel once with exactly that config and returns
            the op's outputs.
        timer: ``timer(fn) -> ms``; None: :func:`liger_portable.tuning.timing.do_bench_ms` (looked
            up at each call).
    """

    kernel: str
    inputs: dict[str, torch.Tensor]
    launch: Launch = field(repr=False)
    timer: Callable[[Callable[[], Any]], float] | None = None

    def __call__(self, resolved: Resolved) -> float:
        timer = self.timer or timing.do_bench_ms
        return float(timer(lambda: self.launch(resolved)))


def build_run(
    kernel: str,
    device: DeviceInfo,
    named: Mapping[str, int],
    dtype: torch.dtype,
    *,
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> TuneRun:
    """Allocate the inputs of ``named`` for ``kernel`` on ``device`` and return its :class:`TuneRun`.

    Raises:
        KeyError: ``kernel`` is not a kernel spec.
        ValueError: ``named`` lacks a field of the kernel's problem key.
        MemoryError: the inputs do not fit in the free device memory.
    """
    if kernel not in HOOKS:
        raise KeyError(f"no tuning hook for kernel {kernel!r}; known kernels: {', '.join(HOOKS)}")
    missing = [k for k in SPECS[kernel].key if k not in named]
    if missing:
        raise ValueError(
            f"named problem {dict(named)} of {kernel} lacks {', '.join(missing)}; "
            f"pass every field of its key {SPECS[kernel].key}"
        )
    _variant, inputs, launch = SPECS[kernel].examples(Problem(kernel, device, named, dtype))[0]
    return TuneRun(kernel, inputs, launch, timer)


def make_hook(kernel: str, timer: Callable[[Callable[[], Any]], float] | None = None) -> runtime.TuneHook:
    """The tuning hook of ``kernel``: ``hook(device, named, dtype) -> TuneRun`` timed by ``timer``
    (default :func:`liger_portable.tuning.timing.do_bench_ms`)."""
    if SPECS.get(kernel) is None or SPECS[kernel].examples is None:
        known = ", ".join(k for k, s in SPECS.items() if s.examples is not None)
        raise KeyError(f"no tuning hook for kernel {kernel!r}; known kernels: {known}")

    def hook(device: DeviceInfo, named: dict, dtype: torch.dtype) -> TuneRun:
        return build_run(kernel, device, named, dtype, timer=timer)

    hook.__name__ = hook.__qualname__ = f"tune_hook_{kernel}"
    return hook


# One hook per registered kernel with examples (every kernel family declares them).
HOOKS: dict[str, runtime.TuneHook] = {k: make_hook(k) for k, s in SPECS.items() if s.examples is not None}


def register_all() -> None:
    """Register the hook of every kernel with :func:`liger_portable.tuning.runtime.register_hook`,
    except for kernels that already have one (a hook the user registered is kept). Idempotent."""
    for kernel, hook in HOOKS.items():
        if kernel not in runtime.registered_hooks():
            runtime.register_hook(kernel, hook)
