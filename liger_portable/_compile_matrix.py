"""What the vendor compile matrix (``scripts/vendor_matrix.py``) compiles for each kernel spec.

Each Triton kernel family is described declaratively: for a launch config (the table's config,
host-side parameters included), a problem (the spec's key fields) and a dtype, the ``@triton.jit``
function, the argument types (``signature``) and the ``tl.constexpr`` values **its launch code
passes** (read from ``liger_portable/ops/*.py``; keep the two in step when a launch changes).
Some specs launch one kernel in several forms (LayerNorm with and without bias, RoPE forward and
backward): each form is a :class:`Launch` of its own.

Where descriptions come from, in order:

1. ``COMPILE_DESCRIPTIONS`` in the kernel's ops module (``liger_portable/ops/<file>.py`` of the
   spec's ``source``), a dict ``spec name -> describe(cfg, problem, dtype) -> list[Launch]``, so a
   new kernel can ship its own;
2. :data:`DESCRIPTIONS` below.

A spec with neither, or whose ops module does not import, is skipped by the matrix with a note.
Importing this module does not import Triton; :func:`launches` does (the ops modules need it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ._specs import SPECS, next_pow2

# Element type names of Triton signatures, by torch dtype name.
PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


@dataclass(frozen=True)
class Launch:
    """One compile of a kernel: the jit function, its argument types and constexpr values.

    Attributes:
        fn: the ``@triton.jit`` function.
        signature: argument name -> Triton type (``"*bf16"``, ``"i32"``, ``"fp32"``; ``"constexpr"``
            for every constexpr argument, None-valued pointer arguments included).
        constexprs: constexpr argument name -> value.
        aligned: arguments the launch passes 16-byte aligned / divisible by 16 (Triton specialises
            on that at run time: pointers from PyTorch, strides and sizes that are multiples of 16).
        variant: a short name of the form (``"bias"``, ``"backward"``), shown in failures.
    """

    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    aligned: tuple[str, ...] = ()
    variant: str = ""

    def __post_init__(self):
        # Triton reads the signature in the function's argument order.
        order = list(self.fn.arg_names)
        sig = {a: self.signature[a] for a in order if a in self.signature}
        sig.update((a, t) for a, t in self.signature.items() if a not in sig)
        object.__setattr__(self, "signature", sig)

    def attrs(self) -> dict:
        names = list(self.fn.arg_names)
        return {(names.index(a),): [["tt.divisibility", 16]] for a in self.aligned}


Describe = Callable[[dict, dict, str], list]


def _sig(args: list[tuple[str, str]], constexprs: dict[str, Any]) -> dict[str, str]:
    sig = dict(args)
    for name in constexprs:
        sig[name] = "constexpr"
    return sig


def _aligned(ptrs: list[str], ints: list[str], n_cols: int) -> tuple[str, ...]:
    # Pointers from torch allocations are 16-byte aligned; row strides of contiguous rows equal
    # n_cols, so they are multiples of 16 exactly when n_cols is.
    return tuple(ptrs) + (tuple(ints) if n_cols % 16 == 0 else ())


def _block_n(n_cols: int, block_n_max: int) -> tuple[int, bool]:
    # ops/rms_norm.py and ops/layer_norm.py: _block_n
    block = next_pow2(n_cols)
    return (block, True) if block <= block_n_max else (block_n_max, False)


# --------------------------------------------------------------------------- RMSNorm (ops/rms_norm.py)


def _rms_norm_fwd(residual: bool) -> Describe:
    def describe(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
        from .ops.rms_norm import _rms_norm_fwd_kernel

        n_cols = problem["n_cols"]
        block_n, single = _block_n(n_cols, cfg["BLOCK_N_MAX"])
        t = PTR[dtype]
        c = {"GEMMA": False, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": block_n, "SINGLE_PASS": single}
        args = [("X", t), ("Y", t), ("W", t), ("RSTD", "*fp32"), ("stride_x", "i32"), ("stride_y", "i32"),
                ("n_rows", "i32"), ("n_cols", "i32"), ("eps", "fp32"), ("offset", "fp32")]
        ptrs, ints = ["X", "Y", "W", "RSTD"], ["stride_x", "stride_y", "n_cols"]
        if residual:
            args += [("R", t), ("stride_r", "i32"), ("S", t)]
            c["HAS_RESIDUAL"] = True
            ptrs += ["R", "S"]
            ints += ["stride_r"]
        else:
            c.update(R=None, stride_r=None, S=None, HAS_RESIDUAL=False)
        return [Launch(_rms_norm_fwd_kernel, _sig(args, c), c, _aligned(ptrs, ints, n_cols))]

    return describe


def _rms_norm_bwd(dsum: bool) -> Describe:
    def describe(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
        from .ops.rms_norm import _rms_norm_bwd_kernel

        n_cols = problem["n_cols"]
        block_n, single = _block_n(n_cols, cfg["BLOCK_N_MAX"])
        t = PTR[dtype]
        c = {"GEMMA": False, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": block_n, "SINGLE_PASS": single}
        args = [("DY", t), ("X", t), ("W", t), ("RSTD", "*fp32"), ("DX", t), ("DW_PARTIAL", "*fp32"),
                ("stride_dy", "i32"), ("stride_x", "i32"), ("stride_dx", "i32"), ("n_rows", "i32"),
                ("n_cols", "i32"), ("offset", "fp32")]
        ptrs = ["DY", "X", "W", "RSTD", "DX", "DW_PARTIAL"]
        ints = ["stride_dy", "stride_x", "stride_dx", "n_cols"]
        if dsum:
            args += [("DS", t), ("stride_ds", "i32")]
            c["HAS_DSUM"] = True
            ptrs += ["DS"]
            ints += ["stride_ds"]
        else:
            c.update(DS=None, stride_ds=None, HAS_DSUM=False)
        return [Launch(_rms_norm_bwd_kernel, _sig(args, c), c, _aligned(ptrs, ints, n_cols))]

    return describe


# --------------------------------------------------------------------------- LayerNorm (ops/layer_norm.py)


def _layer_norm_fwd(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
    from .ops.layer_norm import _layer_norm_fwd_kernel

    n_cols = problem["n_cols"]
    block_n, single = _block_n(n_cols, cfg["BLOCK_N_MAX"])
    t = PTR[dtype]
    args = [("X", t), ("Y", t), ("W", t), ("B", t), ("MEAN", "*fp32"), ("RSTD", "*fp32"),
            ("stride_x", "i32"), ("stride_y", "i32"), ("n_rows", "i32"), ("n_cols", "i32"), ("eps", "fp32")]
    aligned = _aligned(["X", "Y", "W", "B", "MEAN", "RSTD"], ["stride_x", "stride_y", "n_cols"], n_cols)
    out = []
    for bias in (True, False):
        c = {"HAS_BIAS": bias, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": block_n, "SINGLE_PASS": single}
        out.append(Launch(_layer_norm_fwd_kernel, _sig(args, c), c, aligned, "bias" if bias else "no bias"))
    return out


def _layer_norm_bwd(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
    from .ops.layer_norm import _layer_norm_bwd_kernel, _split_row

    n_cols = problem["n_cols"]
    block_n, tail_n, single = _split_row(n_cols, cfg["BLOCK_N_MAX"])
    t = PTR[dtype]
    args = [("DY", t), ("X", t), ("W", t), ("MEAN", "*fp32"), ("RSTD", "*fp32"), ("DX", t),
            ("PARTIAL", "*fp32"), ("stride_dy", "i32"), ("stride_x", "i32"), ("stride_dx", "i32"),
            ("stride_partial", "i32"), ("n_rows", "i32"), ("n_cols", "i32")]
    ptrs = ["DY", "X", "W", "MEAN", "RSTD", "DX", "PARTIAL"]
    out = []
    for bias in (True, False):
        c = {"HAS_BIAS": bias, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": block_n, "TAIL_N": tail_n, "SINGLE_PASS": single}
        # The partial buffer's row stride is 2 n_cols with a bias, n_cols without.
        aligned = _aligned(ptrs, ["stride_dy", "stride_x", "stride_dx", "n_cols"], n_cols)
        if (2 * n_cols if bias else n_cols) % 16 == 0:
            aligned += ("stride_partial",)
        out.append(Launch(_layer_norm_bwd_kernel, _sig(args, c), c, aligned, "bias" if bias else "no bias"))
    return out


# --------------------------------------------------------------------------- SwiGLU / GeGLU (ops/glu.py)


def _glu(act: str, backward: bool) -> Describe:
    def describe(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
        from .ops import glu

        n_cols = problem["n_cols"]
        # glu._tile: the table's BLOCK_N clamped to the row length.
        block_n = min(cfg["BLOCK_N"], max(16, next_pow2(n_cols)))
        t = PTR[dtype]
        c = {"ACT": act, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": block_n}
        if backward:
            fn = glu._glu_bwd_kernel
            ptrs = ["DC", "A", "B", "DA", "DB"]
            ints = ["stride_dc", "stride_a", "stride_b", "stride_da", "stride_db"]
        else:
            fn = glu._glu_fwd_kernel
            ptrs = ["A", "B", "C"]
            ints = ["stride_a", "stride_b", "stride_c"]
        args = [(p, t) for p in ptrs] + [(s, "i32") for s in ints] + [("n_rows", "i32"), ("n_cols", "i32")]
        return [Launch(fn, _sig(args, c), c, _aligned(ptrs, ints + ["n_cols"], n_cols))]

    return describe


# --------------------------------------------------------------------------- RoPE (ops/rope.py)


def _rope(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
    from .ops.rope import _rope_kernel

    head_dim = problem["head_dim"]
    t = PTR[dtype]
    ptrs = ["Q", "K", "QO", "KO", "COS", "SIN"]
    strides = ["sqb", "sqh", "sqs", "skb", "skh", "sks", "sqob", "sqoh", "sqos", "skob", "skoh", "skos",
               "scb", "scs", "ssb", "sss"]
    args = [(p, t) for p in ptrs] + [(s, "i32") for s in strides]
    args += [("n_qh", "i32"), ("n_heads", "i32"), ("seq_len", "i32"), ("n_sblocks", "i32"), ("n_hgroups", "i32")]
    out = []
    for backward in (False, True):
        c = {"BACKWARD": backward, "HALF": head_dim // 2, "BLOCK_H": next_pow2(head_dim // 2),
             "BLOCK_S": cfg["BLOCK_S"], "HEADS": cfg["HEADS"]}
        # Every stride is a multiple of head_dim (Hugging Face layouts), so of 16 when head_dim is.
        out.append(Launch(_rope_kernel, _sig(args, c), c, _aligned(ptrs, strides, head_dim),
                          "backward" if backward else "forward"))
    return out


# --------------------------------------------------------------------------- cross-entropy (ops/cross_entropy.py)


def _cross_entropy(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
    """ce_rows: the plain loss (mean scale as a device tensor) and every option switched on."""
    from .ops.cross_entropy import _ce_kernel

    t = PTR[dtype]
    ptrs = ["X", "G", "T", "LOSS", "ZLOSS", "SCALE"]
    args = [("X", t), ("stride_x", "i32"), ("G", t), ("stride_g", "i32"), ("T", "*i64"), ("LOSS", "*fp32"),
            ("ZLOSS", "*fp32"), ("SCALE", "*fp32"), ("stride_scale", "i32"), ("n_cols", "i32"),
            ("ignore_index", "i32"), ("label_smoothing", "fp32"), ("lse_square_scale", "fp32"),
            ("softcap", "fp32"), ("grad_scale", "fp32")]
    out = []
    for variant, on in (("plain", False), ("smoothing+z-loss+softcap", True)):
        c = {"HAS_SMOOTH": on, "HAS_Z": on, "HAS_SOFTCAP": on, "HAS_SCALE": True, "RETURN_GRAD": True,
             "BLOCK_V": cfg["BLOCK_V"]}
        out.append(Launch(_ce_kernel, _sig(args, c), c, _aligned(ptrs, ["stride_x", "stride_g"], problem["n_cols"]),
                          variant))
    return out


DESCRIPTIONS: dict[str, Describe] = {
    "rms_norm_fwd": _rms_norm_fwd(residual=False),
    "rms_norm_bwd": _rms_norm_bwd(dsum=False),
    "fused_add_rms_norm_fwd": _rms_norm_fwd(residual=True),
    "fused_add_rms_norm_bwd": _rms_norm_bwd(dsum=True),
    "layer_norm_fwd": _layer_norm_fwd,
    "layer_norm_bwd": _layer_norm_bwd,
    "swiglu_fwd": _glu("silu", backward=False),
    "swiglu_bwd": _glu("silu", backward=True),
    "geglu_fwd": _glu("gelu_tanh", backward=False),
    "geglu_bwd": _glu("gelu_tanh", backward=True),
    "rope": _rope,
    # The fused linear cross-entropy launches the same kernel on each chunk's logits.
    "cross_entropy": _cross_entropy,
    "fused_linear_cross_entropy": _cross_entropy,
}

# Representative problems per key, for the default configs: row lengths that straddle every rule
# bound of the tables, Llama-like hidden and MLP sizes, and odd ones.
ROW_LENGTHS = (128, 1000, 2880, 4096, 5120, 8192, 20000, 70001)
REPRESENTATIVE: dict[tuple[str, ...], list[dict]] = {
    ("n_cols", "n_rows"): [{"n_cols": n, "n_rows": 16384} for n in ROW_LENGTHS],
    # head_dim (64: Llama-2-7B-like small heads; 128: Llama-3; 80: odd, not a power of two; 256:
    # Gemma), q + k heads, sequence length.
    ("head_dim", "n_heads", "seq_len"): [
        {"head_dim": d, "n_heads": 40, "seq_len": 4096} for d in (64, 80, 128, 256)
    ],
    # Vocabulary sizes (Llama-2, Llama-3, Gemma) for the cross-entropy kernels.
    ("n_cols", "n_rows", "hidden"): [
        {"n_cols": v, "n_rows": 8192, "hidden": 4096} for v in (32000, 128256, 262144)
    ],
}
# The smaller set CI compiles; scripts/vendor_matrix.py adds each rule's own bound, so every rule is hit.
CI_ROW_LENGTHS = (128, 1000, 2880, 4096, 20000)  # 2880: two-tile rows (LayerNorm backward)


def problems(spec_name: str, ci: bool = False) -> list[dict]:
    spec = SPECS[spec_name]
    probs = REPRESENTATIVE.get(tuple(spec.key))
    if probs is None:
        # A key nobody described: each field at a few sizes, others at a mid value.
        probs = [{k: n for k in spec.key} for n in (128, 4096, 70001)]
    if ci and "n_cols" in spec.key and tuple(spec.key) == ("n_cols", "n_rows"):
        probs = [p for p in probs if p["n_cols"] in CI_ROW_LENGTHS]
    return probs


@dataclass
class Lookup:
    """Where a spec's description came from, or why there is none."""

    describe: Describe | None
    note: str = ""
    extra: dict = field(default_factory=dict)


def lookup(spec_name: str) -> Lookup:
    """The description of ``spec_name``: the ops module's own ``COMPILE_DESCRIPTIONS`` first, then
    :data:`DESCRIPTIONS`; a note when there is none or the ops module does not import."""
    spec = SPECS[spec_name]
    module = "liger_portable." + spec.source.removesuffix(".py").replace("/", ".")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # a missing or half-written kernel module must not stop the matrix
        return Lookup(None, f"{module} does not import ({type(e).__name__}: {e})")
    own = getattr(mod, "COMPILE_DESCRIPTIONS", {}) or {}
    if spec_name in own:
        return Lookup(own[spec_name])
    if spec_name in DESCRIPTIONS:
        return Lookup(DESCRIPTIONS[spec_name])
    return Lookup(
        None,
        f"no launch description (add COMPILE_DESCRIPTIONS[{spec_name!r}] to {module} "
        "or an entry to liger_portable/_compile_matrix.py)",
    )
