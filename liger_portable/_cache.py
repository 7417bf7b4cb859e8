"""Tuned-config lookup: the user autotune cache, then the cache files shipped with the package.

File format (one JSON file per device model, named by :attr:`DeviceInfo.model_slug`, e.g.
``NVIDIA_H200.json``)::

    {
      "format": 1,
      "device": "NVIDIA H200",
      "entries": {
        "<kernel>|<kernel version>|triton<major.minor>|<dtype>|<problem bucket>": {
          "config": {"num_warps": 8, "BLOCK_M": 1, ...},
          "time_ms": 0.081, "default_ms": 0.090,
          "measured_at": "2026-12-02T12:00:00Z", "versions": {"torch": "...", "triton": "..."}
        }
      }
    }

The key holds everything that invalidates a tuned result: the kernel's source version (a change of
one kernel drops only its entries), Triton's major.minor, the dtype and the problem bucket the
kernel declares (:class:`~liger_portable._specs.KernelSpec.bucket`). Writing, locking and the
tuner come with the autotune issue; this module only reads, and never lets a bad file stop a run.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Iterator

import torch

from . import _paths
from ._platform import DeviceInfo, platform
from ._specs import KernelSpec

FORMAT = 1


def triton_major_minor() -> str:
    v = platform().triton_version or "0.0"
    return ".".join(v.split(".")[:2])


def entry_key(spec: KernelSpec, named_problem: dict, dtype: torch.dtype) -> str:
    """The cache key of one tuned result (see the module docstring)."""
    bucket = ",".join(f"{k}={v}" for k, v in spec.bucket(named_problem))
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{spec.name}|{spec.version}|triton{triton_major_minor()}|{dtype_name}|{bucket}"


@functools.lru_cache(maxsize=None)
def _read(path: str) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"liger_portable: skipping unreadable autotune cache {p}: {e}", RuntimeWarning)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        warnings.warn(
            f"liger_portable: skipping autotune cache {p}: not format {FORMAT} (written by another "
            "version); it is rebuilt by `liger-portable warmup`",
            RuntimeWarning,
        )
        return {}
    return data["entries"]


def cache_files(device: DeviceInfo) -> list[tuple[str, Path]]:
    """(label, path) of the cache files consulted for ``device``, in lookup order."""
    name = f"{device.model_slug}.json"
    return [("user cache", _paths.user_cache_dir() / name), ("shipped cache", _paths.shipped_cache_dir() / name)]


def lookup(spec: KernelSpec, device: DeviceInfo, named_problem: dict, dtype: torch.dtype) -> Iterator[tuple[dict, str]]:
    """Yield ``(config, where)`` for each cache file holding a tuned entry, in lookup order."""
    key = None
    for label, path in cache_files(device):
        entries = _read(str(path))
        if not entries:
            continue
        key = key or entry_key(spec, named_problem, dtype)
        hit = entries.get(key)
        if isinstance(hit, dict) and isinstance(hit.get("config"), dict):
            yield hit["config"], f"{label} {path.name}"


def clear() -> None:
    _read.cache_clear()
