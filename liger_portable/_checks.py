"""Argument checks shared by the public functions: each error names the argument and the fix."""

from __future__ import annotations

import numbers

import torch

#: The transformers versions ``liger_portable.transformers`` is written and tested for (pyproject's ``hf`` extra).
HF_REQUIREMENT = "transformers>=5.0,<5.25"
#: How to install them; the package installs from its checkout (it is not on a package index).
HF_INSTALL_HINT = f'pip install "{HF_REQUIREMENT}" (or pip install ".[hf]" in the liger-portable checkout)'

# The largest float32: a larger option overflows inside the kernels (and their fp32 fallback).
_FP32_MAX = float(torch.finfo(torch.float32).max)


def _finite32(x: float) -> bool:
    """Finite and within float32's range (plain comparisons: they trace under torch.compile, where
    math.isfinite breaks the graph). NaN fails the first, the infinities the second."""
    return x == x and -_FP32_MAX <= x <= _FP32_MAX


def is_real(value: object) -> bool:
    """A real number that is not a bool: Python's int and float, and NumPy's scalars alike (NumPy's
    bool is not a numbers.Real)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    """A whole number that is not a bool: Python's int and NumPy's integer scalars alike."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_float(value: numbers.Real) -> float:
    """``float(value)``, or inf for an int too large for a float (10**400): out of range either way."""
    try:
        return float(value)
    except OverflowError:
        return float("inf")


def check_real(name: str, value: object, what: str = "a number") -> float:
    """``value`` as a finite Python float within float32's range, or a ValueError naming ``name``."""
    if type(value) is float and value == value and -_FP32_MAX <= value <= _FP32_MAX:
        return value  # the usual case, without the abstract-class isinstance of is_real
    if not is_real(value) or not _finite32(_as_float(value)):
        raise ValueError(f"{name} must be {what} (finite, within float32's range), got {value!r}")
    return float(value)

class SettingError(ValueError):
    """An environment variable of the package holds a value it does not take; the message names the
    variable and its choices (the command line reports it in one line)."""


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
    if type(value) is float and 0.0 <= value <= _FP32_MAX:
        return value  # the usual case (NaN fails the comparison)
    value_f = check_real(name, value, "a non-negative number")
    if not value_f >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return value_f


REDUCTIONS = ("mean", "sum", "none")


def check_ce_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss):
    """Checks shared by the cross-entropy entry points; returns the options as Python numbers."""
    if not is_integer(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (the targets' dtype), got {ignore_index!r}")
    check_choice("reduction", reduction, REDUCTIONS)
    if not is_real(label_smoothing) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    lse_square_scale = check_nonneg_number("lse_square_scale", lse_square_scale)
    if softcap is not None:
        # inf (or a value past float32's range) would make every logit 0 * inf: a NaN loss
        if not is_real(softcap) or not _finite32(_as_float(softcap)) or not softcap > 0:
            raise ValueError(
                f"softcap must be a positive number (finite and within float32's range; Gemma-2 uses 30.0) "
                f"or None for no cap, got {softcap!r}"
            )
        softcap = float(softcap)
    if not isinstance(return_z_loss, bool):
        raise TypeError(f"return_z_loss must be True or False, got {return_z_loss!r}")
    return float(label_smoothing), lse_square_scale, softcap, int(ignore_index)


def check_chunk_mib(chunk_mib) -> int | None:
    """``chunk_mib`` as a Python int (None stays None), or a ValueError naming it."""
    if chunk_mib is None:
        return None
    if not is_integer(chunk_mib) or chunk_mib < 1:
        raise ValueError(
            f"chunk_mib must be None (the device table's chunk) or a whole number of MiB >= 1, got {chunk_mib!r}"
        )
    return int(chunk_mib)


def check_class_range(name: str, target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Every class index of ``target`` in ``[0, n_classes)`` or ``ignore_index``, else a ValueError
    naming ``name``. On the CPU (free there; skipped under torch.compile, where it would break the
    graph). On a GPU there is no check, to avoid a host sync: a row whose index is out of range gets
    a NaN loss and a NaN gradient (PyTorch's own kernel stops the process with a device assert)."""
    if target.device.type != "cpu" or torch.compiler.is_compiling() or target.numel() == 0:
        return
    bad = ((target < 0) | (target >= n_classes)) & (target != ignore_index)
    if bad.any():
        value = target[bad][0].item()
        raise ValueError(
            f"{name} holds {value}, outside the {n_classes} classes [0, {n_classes - 1}] and not "
            f"ignore_index ({ignore_index}); fix the labels or pass ignore_index={value}"
        )
