"""Where the data folders are: inside the installed package, or at the top of a source checkout."""

from __future__ import annotations

import os
import tempfile
import warnings
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
    ``$XDG_CACHE_HOME/liger_portable``, else ``~/.cache/liger_portable``; without a home directory
    (no ``HOME``, no user entry) a folder of this user's in the temporary folder, with a warning."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "liger_portable"
    try:
        return Path.home() / ".cache" / "liger_portable"
    except RuntimeError:  # no HOME and no passwd entry (a bare service or container environment)
        fallback = Path(tempfile.gettempdir()) / f"liger_portable-{getattr(os, 'getuid', lambda: 'user')()}"
        warnings.warn(  # shown once (Python's default warning filter)
            f"liger_portable: no home directory (HOME unset and no user entry): the autotune cache is "
            f"{fallback}; set {ENV_CACHE_DIR} to choose it",
            stacklevel=2,
        )
        return fallback
