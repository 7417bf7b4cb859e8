"""Per-call dispatch: tensors on the backend's GPU go to Triton, everything else to the fallback.

The decision reads only the tensors' device and the platform detected at import, so it is cheap
and traces cleanly under ``torch.compile``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import configs
from .hardware import DeviceInfo, on_reset, platform
from ._warn import warn

# A simulated GPU for CPU tensors: set by :func:`simulate` so that the Triton kernels run in the
# Triton interpreter (TRITON_INTERPRET=1) with that device's launch configs. None in normal use.
_SIMULATED: DeviceInfo | None = None


def same_device(**tensors: torch.Tensor) -> torch.device:
    """The common device of the named tensors; a clear error naming them if they differ."""
    items = iter(tensors.items())
    name0, t0 = next(items)
    device = t0.device
    for name, t in items:
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but {name0} is on {device}; move them to one device "
                f"(e.g. {name}.to({name0}.device))"
            )
    return device


def simulated() -> DeviceInfo | None:
    """The device :func:`simulate` stands in for now (CPU tensors run the Triton kernels with its
    launch configs), or None in normal use."""
    return _SIMULATED


# What a call traced by torch.compile carries instead of its device's facts: the ops' kernel ops look
# their device up when they run, and reading the facts while tracing (a lock on first use) broke
# the graph at the first kernel call of a compiled model.
TRACED = DeviceInfo("traced", -1, "traced by torch.compile: looked up by the kernel op", "", 0, 0, 0, 0)


def kernel_device(device: torch.device) -> DeviceInfo | None:
    """The :class:`DeviceInfo` whose launch configs apply to tensors on ``device`` if they run the
    Triton kernels (the simulated one for CPU tensors under :func:`simulate`; :data:`TRACED` while
    torch.compile traces), else None: the PyTorch fallback. One call per public function: the
    device is worked out once."""
    if device.type == "cpu":
        return _SIMULATED
    p = platform()
    if p.backend == "cpu" or device.type != p.torch_device_type:
        return None
    if torch.compiler.is_compiling():
        return TRACED
    info = p.device(device.index)
    runs = _runs_kernels.get((info.backend, info.arch))
    if runs is None:
        runs = _judge(info)
    return info if runs else None


# (backend, arch) -> whether its devices run the Triton kernels (the vendor table's "unsupported")
_runs_kernels: dict[tuple[str, str], bool] = {}
on_reset(_runs_kernels.clear)


def _judge(info: DeviceInfo) -> bool:
    why = configs.unsupported_reason(info)
    if why is not None:
        warn(  # once per arch: the verdict is kept
            f"liger_portable: {info.name} ({info.arch}) cannot run the Triton kernels: {why}. The PyTorch "
            "fallback runs instead (the same results, without the kernels' fusion and memory savings)",
            RuntimeWarning,
        )
    runs = _runs_kernels[(info.backend, info.arch)] = why is None
    return runs


def use_kernels(device: torch.device) -> bool:
    """True if tensors on ``device`` run the Triton kernels, False for the PyTorch fallback (a CPU
    tensor outside :func:`simulate`, another backend's device, or a GPU the kernels do not support)."""
    if device.type == "cpu":
        return _SIMULATED is not None
    p = platform()
    return p.backend != "cpu" and device.type == p.torch_device_type and kernel_device(device) is not None


def device_info(t: torch.Tensor) -> DeviceInfo:
    """The :class:`DeviceInfo` whose launch configs apply to ``t`` (the simulated one for CPU tensors)."""
    if t.device.type in ("cpu", "meta"):  # meta: the compile matrix's examples, under simulate()
        assert _SIMULATED is not None, "CPU (or meta) tensors reach the kernels only under simulate()"
        return _SIMULATED
    return platform().device(t.device.index)


@contextlib.contextmanager
def simulate(device: DeviceInfo | None) -> Iterator[DeviceInfo | None]:
    """Run kernels on CPU tensors as if on ``device``: its vendor table and limits decide the
    launch configs, and the Triton interpreter executes them. Needs ``TRITON_INTERPRET=1`` set
    before ``liger_portable`` is imported. For tests and the vendor matrix. ``None``: no simulated
    device inside the block (CPU tensors take the fallback), whatever an outer block set."""
    global _SIMULATED
    previous, _SIMULATED = _SIMULATED, device
    try:
        yield device
    finally:
        _SIMULATED = previous
