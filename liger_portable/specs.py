"""What each kernel's launch config is made of, and which problem sizes matter to it.

One :class:`KernelSpec` per Triton kernel. The ``backends/`` tables are validated against these
specs on load, the resolver builds cache keys from them, and the tuner (later) enumerates their
search spaces. Nothing here imports Triton.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping


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
        examples: ``examples(problem) -> [(variant, inputs, launch)]``, declared by the kernel's
            family beside its launch code: inputs of one problem (``problem`` is the tuner's
            :class:`~liger_portable.tuning.hooks.Problem`: device, named sizes, dtype, random
            draws) and ``launch(resolved)``, which launches exactly this kernel with that config
            through the family's own launch code. The tuner times the first (the form a training
            step runs); the vendor compile matrix compiles every variant, reading each launch's
            arguments on meta tensors, so no launch signature is written twice.
        shown: ``(label, problem)``: the representative problem (values in ``key`` order) whose
            resolved config ``liger-portable info`` and ``check`` print for this kernel.
    """

    name: str
    key: tuple[str, ...]
    bucket: Callable[[dict], tuple]
    params: dict[str, Param]
    source: str
    smem_bytes: Callable[[dict, int, int], int] = field(default=lambda params, num_warps, esize: 0)
    equivalent: Callable[[dict, dict], dict] = field(default=lambda config, problem: config)
    tile_values: Callable[[dict, dict], int] | None = None
    examples: Callable[[Any], list] | None = None
    shown: tuple[str, tuple[int, ...]] | None = None

    @property
    def version(self) -> str:
        """Short hash of the kernel's source file: a change invalidates only its tuned entries."""
        return source_hash(self.source)


# The folder kernel sources (``KernelSpec.source``) are named relative to: the package.
SOURCE_ROOT = Path(__file__).resolve().parent


def source_hash(rel: str) -> str:
    """Hash of the file and of the sibling modules it imports (``from .cross_entropy import ...``),
    recursively: the fused linear cross-entropy launches cross_entropy.py's kernel, LayerNorm uses
    _tiles.py's loads, and a change there must invalidate their tuned entries too. A family's
    autograd sections are left out (see :func:`versioned_text`)."""
    cached = _HASHES.get(rel)
    if cached is None:
        digest = hashlib.sha256()
        for path in source_files(SOURCE_ROOT / rel, set()):
            digest.update(versioned_text(path.read_text()).encode())
        cached = digest.hexdigest()[:12]
        _HASHES[rel] = cached
    return cached


# A section of a family's module starts at a line "# ----...---- <title>"; those whose title names
# "autograd" (the autograd.Function and the torch.library ops that call the launch functions) decide
# how a launch is reached, never which kernel a config launches or what the tuner measures.
_SECTION = re.compile(r"^# -{20,} (.*)$", flags=re.MULTILINE)


def versioned_text(text: str) -> str:
    """``text`` without its autograd sections: what versions a kernel's tuned entries."""
    kept, start, skipping = [], 0, False
    for m in _SECTION.finditer(text):
        if not skipping:
            kept.append(text[start:m.start()])
        start, skipping = m.start(), "autograd" in m.group(1)
    if not skipping:
        kept.append(text[start:])
    return "".join(kept)


# Sibling modules of the host's launch machinery (argument-binding cache, plan memo): they change how
# fast a launch is made, never which kernel a config launches, so they do not version tuned entries.
_UNVERSIONED = frozenset({"launching"})


def source_files(path: Path, seen: set) -> list[Path]:
    """``path`` and the sibling modules it imports (``from .x import``), recursively, each once
    (``seen``: the files already listed): what :func:`source_hash` hashes."""
    if path in seen:
        return []
    seen.add(path)
    files = [path]
    for name in re.findall(r"^from \.(\w+) import", path.read_text(), flags=re.MULTILINE):
        if name not in _UNVERSIONED:
            files += source_files(path.parent / f"{name}.py", seen)
    return files


_HASHES: dict[str, str] = {}


def forget_source_hashes() -> None:
    """Forget the memoized hashes: the next :func:`source_hash` reads the files again."""
    _HASHES.clear()


def rows_cols_bucket(k: dict) -> tuple:
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



# The problem `liger-portable info` shows for row kernels: a Llama-3-8B layer at 16384 tokens.
_SHOWN_ROWS = ("hidden 4096, 16384 rows", (4096, 16384))


def row_norm_specs(
    family: str, source: str, examples: tuple[Callable | None, Callable | None] = (None, None)
) -> tuple[KernelSpec, KernelSpec]:
    """Forward and backward specs of a row-normalisation kernel (RMSNorm, LayerNorm, ...)."""
    fwd = KernelSpec(
        name=f"{family}_fwd",
        key=("n_cols", "n_rows"),
        bucket=rows_cols_bucket,
        params={"BLOCK_M": _BLOCK_M, "BLOCK_N_MAX": _BLOCK_N_MAX},
        source=source,
        smem_bytes=_row_reduce_smem,
        equivalent=_clamped("BLOCK_N_MAX", 1),  # ops: a row that fits BLOCK_N_MAX is one next_pow2 block
        tile_values=_row_tile("BLOCK_N_MAX", 1),
        examples=examples[0],
        shown=_SHOWN_ROWS,
    )
    bwd = KernelSpec(
        name=f"{family}_bwd",
        key=("n_cols", "n_rows"),
        bucket=rows_cols_bucket,
        params={"BLOCK_M": _BLOCK_M, "BLOCK_N_MAX": _BLOCK_N_MAX, "PROGRAMS_PER_CU": _PROGRAMS_PER_CU},
        source=source,
        smem_bytes=_row_reduce_smem,
        equivalent=_clamped("BLOCK_N_MAX", 1),
        tile_values=_row_tile("BLOCK_N_MAX", 1),
        examples=examples[1],
        shown=_SHOWN_ROWS,
    )
    return fwd, bwd


def elementwise_spec(name: str, source: str, examples: Callable | None = None) -> KernelSpec:
    """A 2-D tiled elementwise kernel over (rows, columns) (SwiGLU, GeGLU)."""
    return KernelSpec(
        name=name,
        key=("n_cols", "n_rows"),
        bucket=rows_cols_bucket,
        params={"BLOCK_M": _BLOCK_M, "BLOCK_N": Param(16, 16384, doc="columns per program tile")},
        source=source,
        equivalent=_clamped("BLOCK_N", 16),  # ops/glu.py: min(BLOCK_N, max(16, next_pow2(n_cols)))
        tile_values=_row_tile("BLOCK_N", 16),
        examples=examples,
        shown=("intermediate 14336, 16384 rows", (14336, 16384)),
    )


def rope_bucket(k: dict) -> tuple:
    return (("head_dim", k["head_dim"]), ("n_heads", k["n_heads"]), ("seq_len", next_pow2(k["seq_len"])))


def flce_bucket(k: dict) -> tuple:
    return (("n_cols", k["n_cols"]), ("n_rows", next_pow2(k["n_rows"])), ("hidden", k["hidden"]))


BLOCK_V = Param(128, 65536, doc="vocabulary columns per loop step")

# Launch arguments of the tuning and compile examples (they do not change the speed).
EPS = 1e-6  # normalisation epsilon
IGNORE_INDEX = -100

# The registry: every kernel family declares its specs beside its kernels and registers them when
# liger_portable.ops imports it. Tables are validated, configs resolved and kernels tuned and
# compiled for what is registered here; no other list of kernels is kept.
class _Registry(Mapping):
    """Kernel name -> :class:`KernelSpec`, read-only (:func:`register` adds). The kernel families
    register their specs when ``liger_portable.ops`` is imported; the first read of the registry
    imports it (once, where Triton is installed), so that a program which imports
    ``liger_portable.configs`` alone finds every kernel, as one which imports
    ``liger_portable.functional`` does. (The import is by name: the families sit a layer above this
    module, which they import.)"""

    def __init__(self) -> None:
        self._specs: dict[str, KernelSpec] = {}
        self._loaded = False

    def _load(self) -> dict[str, KernelSpec]:
        if not self._loaded:
            self._loaded = True  # first: reads during the import itself see what is registered
            if importlib.util.find_spec("triton") is not None:
                importlib.import_module(f"{__package__}.ops")
        return self._specs

    def __getitem__(self, name: str) -> KernelSpec:
        return self._load()[name]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


SPECS = _Registry()


def register(*specs: KernelSpec) -> tuple[KernelSpec, ...]:
    """Add ``specs`` to :data:`SPECS` (a name registered twice is an error) and return them."""
    for spec in specs:
        known = SPECS._specs.get(spec.name)  # (a plain read: registering loads nothing)
        if known is not None and known is not spec:
            raise ValueError(f"kernel spec {spec.name!r} is registered twice")
        SPECS._specs[spec.name] = spec
    return specs
