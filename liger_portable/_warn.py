"""Warnings attributed to the user's line, not to ours.

A fixed ``stacklevel`` points into this package whenever a warning is raised a few calls deeper than
its author counted (through an ``nn.Module`` call, a patched Hugging Face forward, the config lookup).
:func:`warn` walks out of this package and the frameworks it is called through (torch, transformers)
to the first frame of the caller's code, as pandas' ``find_stack_level`` does.
"""

from __future__ import annotations

import os
import sys
import warnings

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FRAMEWORKS = ("torch", "transformers")  # called through, never the line a user should look at


def _library_prefixes() -> tuple[str, ...]:
    prefixes = [_OURS]
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            prefixes.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(prefixes)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes :func:`warnings.warn`, called by the caller of this function,
    name the first frame outside this package, torch and transformers (2, the caller's caller,
    where every frame is library code: a warning raised on a library thread)."""
    prefixes = _library_prefixes()
    frame = sys._getframe(1)  # the function that will call warnings.warn: stacklevel 1
    level = 1
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(prefixes):
            return level
        frame = frame.f_back
        level += 1
    return 2


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """:func:`warnings.warn` at the first frame of the user's code (see :func:`user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
