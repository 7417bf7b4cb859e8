"""Where the data folders are: inside the installed package, or at the top of a source checkout."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ._warn import warn

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
        "the installation is incomplete: reinstall it: `pip install --force-reinstall .` in the liger-portable checkout"
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
        return _temporary_cache_dir()


_temporary: dict[Path, Path] = {}  # the shared temporary folder's name -> the folder this process uses


def _temporary_cache_dir() -> Path:
    """This user's cache folder in the shared temporary folder, created private (0700). Its name is
    predictable, so a folder of that name that is not this user's own directory (made by another user,
    or a link) is not trusted: a fresh private folder serves this process instead."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    shared = Path(tempfile.gettempdir()) / f"liger_portable-{uid if uid is not None else 'user'}"
    if shared in _temporary:
        return _temporary[shared]
    try:
        shared.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(shared)
        own = stat.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid)
        if own and st.st_mode & 0o077:  # ours, but made open (an older version, a umask): private again
            os.chmod(shared, 0o700)
    except OSError:
        own = False
    if own:
        folder, note = shared, f"the autotune cache is {shared}"
    else:
        folder = Path(tempfile.mkdtemp(prefix="liger_portable-"))
        note = (f"{shared} is not a directory of this user's, so this process keeps its autotune cache in "
                f"{folder} (not shared with later processes)")
    warn(  # once a process
        f"liger_portable: no home directory (HOME unset and no user entry): {note}; set {ENV_CACHE_DIR} to choose it",
    )
    _temporary[shared] = folder
    return folder
