"""Argument checks shared by the public functions: each error names the argument and the fix."""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float32, bfloat16 or float16), got {t.dtype}; "
            f"convert it, e.g. {name}.float()"
        )


def check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_nonneg_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)
