"""Argument checks shared by the public functions: each error names the argument and the fix."""

from __future__ import annotations

import numbers

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


REDUCTIONS = ("mean", "sum", "none")


def check_ce_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss):
    """Checks shared by the cross-entropy entry points; returns the options as Python numbers."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    check_choice("reduction", reduction, REDUCTIONS)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    lse_square_scale = check_nonneg_number("lse_square_scale", lse_square_scale)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
            raise ValueError(f"softcap must be a positive number (Gemma-2 uses 30.0) or None, got {softcap!r}")
        softcap = float(softcap)
    if not isinstance(return_z_loss, bool):
        raise TypeError(f"return_z_loss must be True or False, got {return_z_loss!r}")
    return float(label_smoothing), lse_square_scale, softcap


def check_chunk_mib(chunk_mib) -> int | None:
    """``chunk_mib`` as a Python int (None stays None), or a ValueError naming it."""
    if chunk_mib is None:
        return None
    if isinstance(chunk_mib, bool) or not isinstance(chunk_mib, numbers.Integral) or chunk_mib < 1:
        raise ValueError(
            f"chunk_mib must be None (the device table's chunk) or a whole number of MiB >= 1, got {chunk_mib!r}"
        )
    return int(chunk_mib)
