"""liger-portable: fused Triton kernels for LLM training on NVIDIA, AMD and Intel GPUs, with
per-vendor launch configs and a pure-PyTorch fallback.

    >>> import liger_portable
    >>> liger_portable.platform().backend        # 'cuda', 'rocm', 'xpu' or 'cpu'
    >>> from liger_portable import functional as F, nn
"""

from __future__ import annotations

from .configs import ConfigError, resolve
from ._dispatch import simulate
from .hardware import DeviceInfo, Platform, PlatformError, platform, reset

__version__ = "0.1.0"

# Detect the backend now (cheap: build flags only, no GPU context) so that a bad
# LIGER_PORTABLE_BACKEND fails at import with a clear message rather than at the first kernel.
platform()

from . import functional, nn  # noqa: E402  (needs the platform above)
from . import tuning  # noqa: E402,F401  tunes config misses under LIGER_PORTABLE_AUTOTUNE=1 (loads no kernel)

__all__ = [
    "ConfigError",
    "DeviceInfo",
    "Platform",
    "PlatformError",
    "functional",
    "nn",
    "platform",
    "reset",
    "resolve",
    "simulate",
    "__version__",
]
