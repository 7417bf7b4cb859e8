"""Where the data folders are: inside the installed package, or at the top of a source checkout."""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent

ENV_CACHE_DIR = "LIGER_PORTABLE_CACHE_DIR"


def _data_dir(name: str) -> Path:
    # A wheel installs backends/ and autotune_cache/ inside the package (pyproject's package-dir);
    # a source checkout (or an editable install) has them beside the package.
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"liger_portable data folder {name!r} not found at {_PKG / name} or {_PKG.parent / name}; "
        "the installation is incomplete: reinstall with `pip install --force-reinstall liger-portable`"
    )


def backends_dir() -> Path:
    """The folder of per-vendor config tables (``cuda.json``, ``rocm.json``, ``xpu.json``)."""
    return _data_dir("backends")


def shipped_cache_dir() -> Path:
    """The read-only folder of tuned configs shipped with the package, one file per device model."""
    try:
        return _data_dir("autotune_cache")
    except FileNotFoundError:  # no shipped tuning is not an error: the tables still apply
        return _PKG / "autotune_cache"


def user_cache_dir() -> Path:
    """The read-write user autotune cache: ``$LIGER_PORTABLE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/liger_portable``, else ``~/.cache/liger_portable``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "liger_portable"
