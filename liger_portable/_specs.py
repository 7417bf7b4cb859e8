"""What each kernel's launch config is made of, and which problem sizes matter to it.

One :class:`KernelSpec` per Triton kernel. The ``backends/`` tables are validated against these
specs on load, the resolver builds cache keys from them, and the tuner (later) enumerates their
search spaces. Nothing here imports Triton.
"""

from __future__ import annotations

import hashlib
import re
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
        equivalent: ``equivalent(config, named_problem)``: the representative of the configs that
            launch the very same kernel on that problem (the launch code clamps block sizes to the
            problem: a column block wider than the row is the row). The tuner times one config of
            each such group. Default: every config is its own.
        tile_values: ``tile_values(config, named_problem)``: values of one tensor a program holds in
            registers at once (its tile). The tuner skips search points with more than
            ``MAX_VALUES_PER_THREAD`` a thread: they spill and their unrolled bodies take
            seconds to compile. None: no such bound.
    """

    name: str
    key: tuple[str, ...]
    bucket: Callable[[dict], tuple]
    params: dict[str, Param]
    source: str
    smem_bytes: Callable[[dict, int, int], int] = field(default=lambda params, num_warps, esize: 0)
    equivalent: Callable[[dict, dict], dict] = field(default=lambda config, problem: config)
    tile_values: Callable[[dict, dict], int] | None = None

    @property
    def version(self) -> str:
        """Short hash of the kernel's source file: a change invalidates only its tuned entries."""
        return _source_hash(self.source)


_HERE = Path(__file__).resolve().parent


def _source_hash(rel: str) -> str:
    """Hash of the file and of the sibling modules it imports (``from .cross_entropy import ...``),
    recursively: the fused linear cross-entropy launches cross_entropy.py's kernel, LayerNorm uses
    _tiles.py's loads, and a change there must invalidate their tuned entries too."""
    cached = _HASHES.get(rel)
    if cached is None:
        digest = hashlib.sha256()
        for path in _source_files(_HERE / rel, set()):
            digest.update(path.read_bytes())
        cached = digest.hexdigest()[:12]
        _HASHES[rel] = cached
    return cached


# Sibling modules of the host's launch machinery (argument-binding cache, plan memo): they change how
# fast a launch is made, never which kernel a config launches, so they do not version tuned entries.
_UNVERSIONED = frozenset({"_launch"})


def _source_files(path: Path, seen: set) -> list[Path]:
    if path in seen:
        return []
    seen.add(path)
    files = [path]
    for name in re.findall(r"^from \.(\w+) import", path.read_text(), flags=re.MULTILINE):
        if name not in _UNVERSIONED:
            files += _source_files(path.parent / f"{name}.py", seen)
    return files


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


_PROGRAMS_PER_CU = Param(1, 16, pow2=False, doc="persistent programs per compute unit", host=True)


# fp32 values of one tensor per thread above which the tuner does not time a tile: beyond it they
# spill and compile slowly. The H200 sweeps' best points hold 4-32, and 64 for the fused add+RMSNorm
# backward at 5120 and 8192 columns (2 rows of 8192 on 256 threads).
MAX_VALUES_PER_THREAD = 64


def _row_tile(block: str, lo: int) -> Callable[[dict, dict], int]:
    """``tile_values`` of a kernel whose tile is BLOCK_M rows x the clamped column block."""

    def tile_values(config: dict, problem: dict) -> int:
        return config["BLOCK_M"] * min(config[block], max(lo, next_pow2(problem["n_cols"])))

    return tile_values


def _clamped(name: str, lo: int) -> Callable[[dict, dict], dict]:
    """``equivalent`` of a kernel whose launch uses ``min(config[name], next_pow2(n_cols))``
    (at least ``lo``) as its column block: every value from there up launches the same kernel."""

    def equivalent(config: dict, problem: dict) -> dict:
        return {**config, name: min(config[name], max(lo, next_pow2(problem["n_cols"])))}

    return equivalent



def _row_norm_specs(family: str, source: str) -> tuple[KernelSpec, KernelSpec]:
    """Forward and backward specs of a row-normalisation kernel (RMSNorm, LayerNorm, ...)."""
    fwd = KernelSpec(
        name=f"{family}_fwd",
        key=("n_cols", "n_rows"),
        bucket=_rows_cols_bucket,
        params={"BLOCK_M": _BLOCK_M, "BLOCK_N_MAX": _BLOCK_N_MAX},
        source=source,
        smem_bytes=_row_reduce_smem,
        equivalent=_clamped("BLOCK_N_MAX", 1),  # ops: a row that fits BLOCK_N_MAX is one next_pow2 block
        tile_values=_row_tile("BLOCK_N_MAX", 1),
    )
    bwd = KernelSpec(
        name=f"{family}_bwd",
        key=("n_cols", "n_rows"),
        bucket=_rows_cols_bucket,
        params={"BLOCK_M": _BLOCK_M, "BLOCK_N_MAX": _BLOCK_N_MAX, "PROGRAMS_PER_CU": _PROGRAMS_PER_CU},
        source=source,
        smem_bytes=_row_reduce_smem,
        equivalent=_clamped("BLOCK_N_MAX", 1),
        tile_values=_row_tile("BLOCK_N_MAX", 1),
    )
    return fwd, bwd


def _elementwise_spec(name: str, source: str) -> KernelSpec:
    """A 2-D tiled elementwise kernel over (rows, columns) (SwiGLU, GeGLU)."""
    return KernelSpec(
        name=name,
        key=("n_cols", "n_rows"),
        bucket=_rows_cols_bucket,
        params={"BLOCK_M": _BLOCK_M, "BLOCK_N": Param(16, 16384, doc="columns per program tile")},
        source=source,
        equivalent=_clamped("BLOCK_N", 16),  # ops/glu.py: min(BLOCK_N, max(16, next_pow2(n_cols)))
        tile_values=_row_tile("BLOCK_N", 16),
    )


def _rope_bucket(k: dict) -> tuple:
    return (("head_dim", k["head_dim"]), ("n_heads", k["n_heads"]), ("seq_len", next_pow2(k["seq_len"])))


def _flce_bucket(k: dict) -> tuple:
    return (("n_cols", k["n_cols"]), ("n_rows", next_pow2(k["n_rows"])), ("hidden", k["hidden"]))


_BLOCK_V = Param(128, 65536, doc="vocabulary columns per loop step")

SPECS: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        *_row_norm_specs("rms_norm", "ops/rms_norm.py"),
        *_row_norm_specs("fused_add_rms_norm", "ops/rms_norm.py"),
        *_row_norm_specs("layer_norm", "ops/layer_norm.py"),
        _elementwise_spec("swiglu_fwd", "ops/glu.py"),
        _elementwise_spec("swiglu_bwd", "ops/glu.py"),
        _elementwise_spec("geglu_fwd", "ops/glu.py"),
        _elementwise_spec("geglu_bwd", "ops/glu.py"),
        KernelSpec(
            # One kernel for forward and backward (the backward rotates by -theta).
            name="rope",
            key=("head_dim", "n_heads", "seq_len"),
            bucket=_rope_bucket,
            params={
                "BLOCK_S": Param(1, 256, doc="sequence positions per program"),
                "HEADS": Param(1, 64, doc="neighbouring heads per program, sharing one cos/sin tile"),
            },
            tile_values=lambda c, p: c["BLOCK_S"] * next_pow2(p["head_dim"] // 2),
            source="ops/rope.py",
        ),
        KernelSpec(
            # One row (token) per program, looping over the vocabulary in BLOCK_V steps; loss and
            # gradient in one launch. n_cols is the vocabulary size.
            name="cross_entropy",
            key=("n_cols", "n_rows"),
            bucket=_rows_cols_bucket,
            params={"BLOCK_V": _BLOCK_V},
            source="ops/cross_entropy.py",
            tile_values=lambda c, p: c["BLOCK_V"],
        ),
        KernelSpec(
            # The cross-entropy launch inside the fused linear cross-entropy, plus the host-side
            # token-chunk size (logits memory of one chunk, in MiB).
            name="fused_linear_cross_entropy",
            key=("n_cols", "n_rows", "hidden"),
            bucket=_flce_bucket,
            params={
                "BLOCK_V": _BLOCK_V,
                "CHUNK_MIB": Param(8, 8192, pow2=False, doc="logits memory of one token chunk, MiB", host=True),
            },
            source="ops/fused_linear_cross_entropy.py",
            tile_values=lambda c, p: c["BLOCK_V"],
        ),
    )
}
