"""What each kernel's launch config is made of, and which problem sizes matter to it.

One :class:`KernelSpec` per Triton kernel. The ``backends/`` tables are validated against these
specs on load, the resolver builds cache keys from them, and the tuner (later) enumerates their
search spaces. Nothing here imports Triton.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class Param:
    """A ``tl.constexpr`` launch parameter that a table may set.

    Attributes:
        lo, hi: inclusive bounds.
        pow2: the value must be a power of two (block shapes in Triton must be).
        doc: what it means, shown in validation errors.
        host: read by the launch code (grid size, block choice), not passed to the kernel.
    """

    lo: int
    hi: int
    pow2: bool = True
    doc: str = ""
    host: bool = False

    def check(self, value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {value!r}"
        if not self.lo <= value <= self.hi:
            return f"must be in [{self.lo}, {self.hi}], got {value}"
        if self.pow2 and value & (value - 1):
            return f"must be a power of two, got {value}"
        return None


@dataclass(frozen=True)
class KernelSpec:
    """Declaration of one kernel for config tables, resolution and tuning.

    Attributes:
        name: table key, e.g. ``rms_norm_fwd``.
        key: problem-size fields the rules and the cache key read, e.g. ``("n_cols", "n_rows")``.
        bucket: maps the exact problem to the cache key's problem part (sizes that share a
            tuned config share a bucket).
        params: constexpr parameters a config must set.
        source: file under ``liger_portable/`` whose content versions tuned entries.
        smem_bytes: estimate of shared memory per block for (params, num_warps, element size),
            checked against the device limit before launch.
    """

    name: str
    key: tuple[str, ...]
    bucket: Callable[[dict], tuple]
    params: dict[str, Param]
    source: str
    smem_bytes: Callable[[dict, int, int], int] = field(default=lambda params, num_warps, esize: 0)

    @property
    def version(self) -> str:
        """Short hash of the kernel's source file: a change invalidates only its tuned entries."""
        return _source_hash(self.source)


_HERE = Path(__file__).resolve().parent


def _source_hash(rel: str) -> str:
    cached = _HASHES.get(rel)
    if cached is None:
        cached = hashlib.sha256((_HERE / rel).read_bytes()).hexdigest()[:12]
        _HASHES[rel] = cached
    return cached


_HASHES: dict[str, str] = {}


def _rows_cols_bucket(k: dict) -> tuple:
    # The row length decides the block shape exactly; the row count only matters for how full the
    # GPU is, so it is bucketed to the next power of two.
    return (("n_cols", k["n_cols"]), ("n_rows", next_pow2(k["n_rows"])))


_BLOCK_M = Param(1, 64, doc="rows per program tile")
_BLOCK_N_MAX = Param(
    128, 65536, doc="widest column block held in registers; longer rows are processed in a loop", host=True
)


def _row_reduce_smem(params: dict, num_warps: int, esize: int) -> int:
    # tl.sum across warps stages one fp32 partial per warp and row through shared memory.
    return 4 * num_warps * params["BLOCK_M"]


SPECS: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        KernelSpec(
            name="rms_norm_fwd",
            key=("n_cols", "n_rows"),
            bucket=_rows_cols_bucket,
            params={"BLOCK_M": _BLOCK_M, "BLOCK_N_MAX": _BLOCK_N_MAX},
            source="ops/rms_norm.py",
            smem_bytes=_row_reduce_smem,
        ),
        KernelSpec(
            name="rms_norm_bwd",
            key=("n_cols", "n_rows"),
            bucket=_rows_cols_bucket,
            params={
                "BLOCK_M": _BLOCK_M,
                "BLOCK_N_MAX": _BLOCK_N_MAX,
                "PROGRAMS_PER_CU": Param(1, 16, pow2=False, doc="persistent programs per compute unit", host=True),
            },
            source="ops/rms_norm.py",
            smem_bytes=_row_reduce_smem,
        ),
    )
}
