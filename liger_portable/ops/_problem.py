"""The problem a kernel family's examples are built for (see ``KernelSpec.examples``)."""

from __future__ import annotations

from typing import Mapping

import torch

from .. import _dispatch
from ..configs import Resolved, make_resolved, table_default
from ..hardware import DeviceInfo


def torch_device(device: DeviceInfo) -> torch.device:
    """Where the tuning inputs of ``device`` live: the device itself, or the CPU for the simulated
    device of the tests (its kernels run in the Triton interpreter)."""
    if _dispatch.simulated() is device:
        return torch.device("cpu")
    return device.torch_device


def free_bytes(where: torch.device) -> int | None:
    """Device memory a new allocation may use: free memory plus what PyTorch's caching allocator
    holds unused; None where unknown (the CPU, a backend without these queries)."""
    if where.type == "cpu":
        return None
    backend = getattr(torch, where.type, None)
    try:
        free, _total = backend.mem_get_info(where)
        return int(free + backend.memory_reserved(where) - backend.memory_allocated(where))
    except Exception:  # noqa: BLE001 - unknown: let the allocation decide
        return None


class Problem:
    """One problem of a kernel's examples (``KernelSpec.examples``): the device, named sizes and
    dtype, a private random generator (the caller's random state is not touched), and a check that
    the inputs fit in the free device memory. The tuner builds it on the device; the vendor compile
    matrix on meta tensors."""

    def __init__(
        self, kernel: str, device: DeviceInfo, named: Mapping[str, int], dtype: torch.dtype,
        where: torch.device | None = None,
    ):
        """``where``: where the inputs live (default: the device's, or the CPU when simulated);
        ``torch.device("meta")`` gives shapes without data (the vendor compile matrix)."""
        self.kernel, self.device, self.named, self.dtype = kernel, device, dict(named), dtype
        self.where = where if where is not None else torch_device(device)
        self.meta = self.where.type == "meta"
        try:
            self.gen = torch.Generator(device=self.where)
        except Exception:  # noqa: BLE001 - no generator on this device type: draw on the CPU, copy
            self.gen = torch.Generator()
        self.gen.manual_seed(0)

    def rows_cols(self) -> tuple[int, int]:
        return self.named["n_rows"], self.named["n_cols"]

    def need(self, elements: int, extra_bytes: int = 0) -> None:
        """Raise ``MemoryError`` unless ``elements`` values of the dtype (plus ``extra_bytes``) fit."""
        nbytes = elements * torch.empty((), dtype=self.dtype).element_size() + extra_bytes
        free = free_bytes(self.where)
        if free is not None and nbytes > free:
            gib = 2.0**30
            raise MemoryError(
                f"tuning {self.kernel} for {self.named} ({self.dtype}) needs about {nbytes / gib:.1f} GiB "
                f"on {self.device.name}, {free / gib:.1f} GiB are free; tune with less memory in use "
                "(`liger-portable warmup` before training) or for fewer tokens per step"
            )

    def randn(self, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        """Normal values times ``scale`` plus ``shift``, drawn in the dtype (no fp32 copy)."""
        if self.meta:
            return torch.empty(shape, dtype=self.dtype, device=self.where)
        t = torch.randn(shape, generator=self.gen, device=self.gen.device, dtype=self.dtype)
        if scale != 1.0:
            t.mul_(scale)
        if shift != 0.0:
            t.add_(shift)
        return t.to(self.where)

    def targets(self, n: int, n_classes: int) -> torch.Tensor:
        if self.meta:
            return torch.empty((n,), dtype=torch.long, device=self.where)
        t = torch.randint(0, n_classes, (n,), generator=self.gen, device=self.gen.device, dtype=torch.long)
        return t.to(self.where)

    def table_default(self, kernel: str) -> Resolved:
        """The table's config of ``kernel`` for this problem, for a prerequisite launch."""
        return make_resolved(kernel, table_default(kernel, self.device, self.named), "tuning prerequisite")
