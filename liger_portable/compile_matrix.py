"""What the vendor compile matrix (``scripts/vendor_matrix.py``) compiles for each kernel spec.

Nothing here is written per kernel. For a launch config (the table's, host-side parameters
included), a problem (the spec's key fields) and a dtype, :func:`describe` runs the kernel family's
own examples (``KernelSpec.examples``: the launch code a training step runs) on meta tensors with
the launches captured instead of made (:func:`liger_portable.ops.launching.capture`), and turns each
captured launch into a :class:`Launch`: the ``@triton.jit`` function, the Triton type of every
argument as the launch passed it, its constexpr values and launch options, and the arguments Triton
would specialise as 16-byte aligned (tensors from the allocator; integers that are multiples of 16).
A spec's variants (LayerNorm with and without bias, RoPE forward and backward, ...) and the helper
kernels a launch makes (the cross-entropy's gradient scaling) are compiled too.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .hardware import DeviceInfo
from .specs import SPECS

# Element type names of Triton signatures, by torch dtype name.
PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
        torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1"}


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
        options: the launch's ``num_warps``, ``num_stages`` and backend options (None: the config's).
    """

    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    aligned: tuple[str, ...] = ()
    variant: str = ""
    options: dict[str, Any] | None = None

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

# The device the examples are built for: its table gives the prerequisite launches' configs (a
# backward's forward), which are not compiled; the kernel's own config is the one given.
_DEVICE = DeviceInfo("cuda", 0, "compile matrix", "sm90", 32, 132, 1024, 232448)


def _params(fn: Any) -> list[tuple[str, bool, Any]]:
    """``(name, is_constexpr, default)`` of each argument of a jit function (or of the interpreter's)."""
    params = getattr(fn, "params", None)
    if params is not None:
        return [(p.name, bool(p.is_constexpr), p.default) for p in params]
    return [(p.name, "constexpr" in str(p.annotation), p.default) for p in inspect.signature(fn.fn).parameters.values()]


def to_launch(captured: Any, variant: str = "") -> Launch:
    """The :class:`Launch` of one captured launch: each argument typed as Triton types it."""
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    aligned: list[str] = []
    for i, (name, is_const, default) in enumerate(_params(captured.fn)):
        if i < len(captured.args):
            v = captured.args[i]
        else:
            v = captured.kwargs.get(name, None if default is inspect.Parameter.empty else default)
        if is_const or v is None:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = _PTR[v.dtype]
            aligned.append(name)  # allocations are 16-byte aligned (meta tensors stand for them)
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                aligned.append(name)
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{captured.fn.__name__}: argument {name} of type {type(v).__name__} has no Triton type here")
    return Launch(captured.fn, sig, consts, tuple(aligned), variant, dict(captured.options))


def describe(spec_name: str) -> Describe | None:
    """``describe(cfg, problem, dtype_name) -> [Launch]`` of a spec, from its family's examples
    (None if the spec declares none)."""
    spec = SPECS[spec_name]
    if spec.examples is None:
        return None

    def run(cfg: dict, problem: dict, dtype: str) -> list[Launch]:
        from .configs import make_resolved
        from ._dispatch import simulate
        from .ops import launching
        from .ops._problem import Problem

        p = Problem(spec_name, _DEVICE, problem, getattr(torch, dtype), where=torch.device("meta"))
        resolved = make_resolved(spec_name, cfg, "compile matrix")
        out: list[Launch] = []
        seen: set = set()
        with simulate(_DEVICE), launching.capture() as made:
            examples = spec.examples(p)  # a prerequisite launch (a backward's forward) is not kept
            for variant, _inputs, launch in examples:
                made.clear()
                launch(resolved)
                for c in made:
                    one = to_launch(c, variant)
                    key = (one.fn, tuple(one.signature.items()), repr(sorted(one.constexprs.items())),
                           one.aligned, repr(sorted(one.options.items())))
                    if key not in seen:
                        seen.add(key)
                        out.append(one)
        return out

    return run


# Representative problems per key, for the default configs: row lengths that straddle every rule
# bound of the tables, Llama-like hidden and MLP sizes, and odd ones.
ROW_LENGTHS = (128, 1000, 2880, 4096, 5120, 8192, 20000, 70001)
REPRESENTATIVE: dict[tuple[str, ...], list[dict]] = {
    # A few rows too (the norms' backward then sums its partials in the launch: another variant).
    ("n_cols", "n_rows"): [{"n_cols": n, "n_rows": 16384} for n in ROW_LENGTHS]
    + [{"n_cols": n, "n_rows": 16} for n in (4096, 20000)],
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
    """The description of ``spec_name`` (from its family's examples), or a note why there is none."""
    d = DESCRIPTIONS.get(spec_name)
    if d is None:
        return Lookup(None, f"{spec_name} declares no examples (KernelSpec.examples) to compile")
    return Lookup(d)


# Every registered kernel with examples (the kernel families register them when liger_portable.ops
# is imported, which importing liger_portable does where Triton is installed).
DESCRIPTIONS: dict[str, Describe] = {name: d for name in SPECS if (d := describe(name)) is not None}
