"""liger-portable: fused Triton kernels for LLM training on NVIDIA, AMD and Intel GPUs, with
per-vendor launch configs and a pure-PyTorch fallback.

    >>> import liger_portable
    >>> liger_portable.platform().backend        # 'cuda', 'rocm', 'xpu' or 'cpu'
    >>> from liger_portable import functional as F, nn
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public names load on first use: ``import liger_portable`` imports no torch, so the command
# line parses its arguments (and answers --help) at once. The first use detects the backend, so a
# bad LIGER_PORTABLE_BACKEND fails there, with a clear message, before any kernel runs.
_EXPORTS = {
    "ConfigError": "configs",
    "resolve": "configs",
    "simulate": "_dispatch",
    "DeviceInfo": "hardware",
    "Platform": "hardware",
    "PlatformError": "hardware",
    "platform": "hardware",
    "reset": "hardware",
}
_MODULES = ("functional", "nn")

__all__ = [*sorted(_EXPORTS), *_MODULES, "__version__"]

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from . import functional, nn  # noqa: F401
    from ._dispatch import simulate  # noqa: F401
    from .configs import ConfigError, resolve  # noqa: F401
    from .hardware import DeviceInfo, Platform, PlatformError, platform, reset  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS and name not in _MODULES:
        raise AttributeError(f"module 'liger_portable' has no attribute {name!r}")
    import importlib

    from .hardware import platform

    platform()  # detect the backend (build flags only, no GPU context); raises PlatformError
    for module in _MODULES:  # (not ``from . import``: that would ask this function again)
        globals()[module] = importlib.import_module(f".{module}", __name__)  # the kernels and tuner load
    for export, module in _EXPORTS.items():
        globals()[export] = getattr(importlib.import_module(f".{module}", __name__), export)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
