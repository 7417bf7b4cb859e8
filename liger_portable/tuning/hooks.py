"""Tuning hooks: for each kernel, inputs of one problem and a timed launch with an explicit config.

One hook per kernel spec (:data:`HOOKS`, the keys of :data:`liger_portable._specs.SPECS`), with
the signature :data:`liger_portable.tuning.runtime.TuneHook`::

    run = HOOKS["rms_norm_fwd"](device, {"n_cols": 4096, "n_rows": 8192}, torch.bfloat16)
    ms = run(resolved)        # launches rms_norm_fwd(..., config=resolved), returns its median time

A hook allocates random inputs of the named problem in ``dtype`` on ``device`` (from a private
generator: the caller's random state is not touched), runs what the kernel needs first once (the
forward of a backward, for its saved statistics), and returns a :class:`TuneRun`. Calling it
launches exactly that kernel with exactly the given config, through the op's launch function and
its ``config=`` override (never through ``resolve``: the resolver holds its lock while tuning), and
returns the time the timer measured (default :func:`liger_portable.tuning.timing.do_bench_ms`). The
inputs live as long as the :class:`TuneRun`: the tuner drops it when done, which frees them.

Inputs are the real problem's (the fused linear cross-entropy's too: it is chunked, so its extra
memory is one chunk of logits): about 2-5 tensors of ``n_rows x n_cols`` for the row kernels,
``BT x V`` twice for the cross-entropy, and ``hidden`` + ``weight`` with their gradients plus one
chunk for the fused linear cross-entropy. Before allocating, a hook checks that this fits in the
device memory that is free (or cached by PyTorch's allocator) and raises ``MemoryError`` if not.

Launches are those of a Hugging Face decoder's training step: RMSNorm in Llama casting mode
(``offset`` 0), LayerNorm with a bias, GLU backward not in place, RoPE on q and k laid out as
``(batch, seq, heads, head_dim)`` transposed to ``(batch, heads, seq, head_dim)`` (batch 1: the
problem key holds no batch; q and k split the heads of the key), cross-entropy with a mean
reduction and the gradient in its own buffer, fused linear cross-entropy without bias.

:func:`register_all` registers every hook with :func:`liger_portable.tuning.runtime.register_hook`;
the tuner calls it on the first miss under ``LIGER_PORTABLE_AUTOTUNE=1`` and the warmup before it
tunes.

The simulated device of the tests (:func:`liger_portable._dispatch.simulate`) gets CPU tensors:
the kernels then run in the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .. import _dispatch
from .._configs import Resolved, make_resolved
from .._platform import DeviceInfo
from .._specs import SPECS
from ..ops import cross_entropy as _ce_ops
from ..ops import fused_linear_cross_entropy as _flce_ops
from ..ops import glu as _glu_ops
from ..ops import layer_norm as _ln_ops
from ..ops import rms_norm as _rms_ops
from ..ops import rope as _rope_ops
from . import runtime, search, timing

EPS = 1e-6  # normalisation epsilon of the timed launches (it does not change the speed)
IGNORE_INDEX = -100

Launch = Callable[[Resolved], Any]


@dataclass
class TuneRun:
    """``run(resolved) -> ms`` for one problem: its inputs and the launch of one kernel on them.

    Attributes:
        kernel: the kernel spec name.
        inputs: the tensors the launch reads (and buffers it writes into), by name.
        launch: ``launch(resolved)`` runs the kernel once with exactly that config and returns
            the op's outputs.
        timer: ``timer(fn) -> ms``; None: :func:`liger_portable.tuning.timing.do_bench_ms` (looked
            up at each call).
    """

    kernel: str
    inputs: dict[str, torch.Tensor]
    launch: Launch = field(repr=False)
    timer: Callable[[Callable[[], Any]], float] | None = None

    def __call__(self, resolved: Resolved) -> float:
        timer = self.timer or timing.do_bench_ms
        return float(timer(lambda: self.launch(resolved)))


def torch_device(device: DeviceInfo) -> torch.device:
    """Where the tuning inputs of ``device`` live: the device itself, or the CPU for the simulated
    device of the tests (its kernels run in the Triton interpreter)."""
    if _dispatch._SIMULATED is device:
        return torch.device("cpu")
    return device.torch_device


def _free_bytes(where: torch.device) -> int | None:
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


class _Problem:
    """The device, named problem and dtype of one hook call, with a private random generator."""

    def __init__(self, kernel: str, device: DeviceInfo, named: Mapping[str, int], dtype: torch.dtype):
        self.kernel, self.device, self.named, self.dtype = kernel, device, dict(named), dtype
        self.where = torch_device(device)
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
        free = _free_bytes(self.where)
        if free is not None and nbytes > free:
            gib = 2.0**30
            raise MemoryError(
                f"tuning {self.kernel} for {self.named} ({self.dtype}) needs about {nbytes / gib:.1f} GiB "
                f"on {self.device.name}, {free / gib:.1f} GiB are free; tune with less memory in use "
                "(`liger-portable warmup` before training) or for fewer tokens per step"
            )

    def randn(self, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        """Normal values times ``scale`` plus ``shift``, drawn in the dtype (no fp32 copy)."""
        t = torch.randn(shape, generator=self.gen, device=self.gen.device, dtype=self.dtype)
        if scale != 1.0:
            t.mul_(scale)
        if shift != 0.0:
            t.add_(shift)
        return t.to(self.where)

    def targets(self, n: int, n_classes: int) -> torch.Tensor:
        t = torch.randint(0, n_classes, (n,), generator=self.gen, device=self.gen.device, dtype=torch.long)
        return t.to(self.where)

    def table_default(self, kernel: str) -> Resolved:
        """The table's config of ``kernel`` for this problem, for a prerequisite launch."""
        return make_resolved(kernel, search.default_config(kernel, self.device, self.named), "tuning prerequisite")


# --------------------------------------------------------------------------- one builder per kernel
# Each returns (inputs, launch). Launches look the op up in its module at call time (so a test can
# spy on it) and always pass config=resolved.


def _rms_norm_fwd(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols = p.rows_cols()
    p.need(2 * n_rows * n_cols)  # x, y
    x, w = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    return {"x": x, "weight": w}, lambda r: _rms_ops.rms_norm_fwd(x, w, EPS, 0.0, False, config=r)


def _rms_norm_bwd(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols = p.rows_cols()
    p.need(3 * n_rows * n_cols)  # x, dy, dx (the forward's y is freed before dx)
    x, w = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    _, rstd = _rms_ops.rms_norm_fwd(x, w, EPS, 0.0, False, config=p.table_default("rms_norm_fwd"))
    dy = p.randn(n_rows, n_cols)
    inputs = {"dy": dy, "x": x, "weight": w, "rstd": rstd}
    return inputs, lambda r: _rms_ops.rms_norm_bwd(dy, x, w, rstd, 0.0, False, config=r)


def _fused_add_rms_norm_fwd(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols = p.rows_cols()
    p.need(4 * n_rows * n_cols)  # x, residual, y, s
    x, res, w = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    inputs = {"x": x, "residual": res, "weight": w}
    return inputs, lambda r: _rms_ops.fused_add_rms_norm_fwd(x, res, w, EPS, 0.0, False, config=r)


def _fused_add_rms_norm_bwd(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols = p.rows_cols()
    p.need(4 * n_rows * n_cols)  # x, residual, y, s for the forward; then s, dy, ds, dsum
    x, res, w = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0)
    cfg = p.table_default("fused_add_rms_norm_fwd")
    y, s, rstd = _rms_ops.fused_add_rms_norm_fwd(x, res, w, EPS, 0.0, False, config=cfg)
    del x, res, y  # only s and rstd are kept: the memory goes to dy and ds
    dy, ds = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols)
    inputs = {"dy": dy, "ds": ds, "s": s, "weight": w, "rstd": rstd}
    return inputs, lambda r: _rms_ops.fused_add_rms_norm_bwd(dy, ds, s, w, rstd, 0.0, False, config=r)


def _layer_norm_fwd(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols = p.rows_cols()
    p.need(2 * n_rows * n_cols)  # x, y
    x, w, b = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0), p.randn(n_cols, scale=0.1)
    return {"x": x, "weight": w, "bias": b}, lambda r: _ln_ops.layer_norm_fwd(x, w, b, EPS, config=r)


def _layer_norm_bwd(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols = p.rows_cols()
    p.need(3 * n_rows * n_cols)  # x, dy, dx
    x, w, b = p.randn(n_rows, n_cols), p.randn(n_cols, scale=0.1, shift=1.0), p.randn(n_cols, scale=0.1)
    _, mean, rstd = _ln_ops.layer_norm_fwd(x, w, b, EPS, config=p.table_default("layer_norm_fwd"))
    dy = p.randn(n_rows, n_cols)
    inputs = {"dy": dy, "x": x, "weight": w, "bias": b, "mean": mean, "rstd": rstd}
    return inputs, lambda r: _ln_ops.layer_norm_bwd(dy, x, w, b, mean, rstd, config=r)


def _glu_fwd(act: str) -> Callable[[_Problem], tuple[dict, Launch]]:
    def build(p: _Problem) -> tuple[dict, Launch]:
        n_rows, n_cols = p.rows_cols()
        p.need(3 * n_rows * n_cols)  # a, b, c
        a, b = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols)
        return {"a": a, "b": b}, lambda r: _glu_ops.glu_fwd(a, b, act, config=r)

    return build


def _glu_bwd(act: str) -> Callable[[_Problem], tuple[dict, Launch]]:
    def build(p: _Problem) -> tuple[dict, Launch]:
        n_rows, n_cols = p.rows_cols()
        p.need(5 * n_rows * n_cols)  # dc, a, b, da, db
        dc, a, b = p.randn(n_rows, n_cols), p.randn(n_rows, n_cols), p.randn(n_rows, n_cols)
        return {"dc": dc, "a": a, "b": b}, lambda r: _glu_ops.glu_bwd(dc, a, b, act, False, config=r)

    return build


def _rope(p: _Problem) -> tuple[dict, Launch]:
    head_dim, n_heads, seq = p.named["head_dim"], p.named["n_heads"], p.named["seq_len"]
    n_k = n_heads // 2
    n_q = n_heads - n_k
    p.need(2 * n_heads * seq * head_dim + 2 * seq * head_dim)  # q, k, their outputs; cos, sin
    # Hugging Face's layout: projections viewed as (batch, seq, heads, head_dim), then transposed.
    q = p.randn(1, seq, n_q, head_dim).transpose(1, 2)
    k = p.randn(1, seq, n_k, head_dim).transpose(1, 2) if n_k else None
    cos, sin = p.randn(1, seq, head_dim), p.randn(1, seq, head_dim)
    inputs = {"q": q, "cos": cos, "sin": sin, **({"k": k} if k is not None else {})}
    return inputs, lambda r: _rope_ops.rope_fwd(q, k, cos, sin, config=r)


def _cross_entropy(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols = p.rows_cols()
    p.need(2 * n_rows * n_cols, 8 * n_rows)  # logits, gradient; target, row losses
    logits, target = p.randn(n_rows, n_cols, scale=2.0), p.targets(n_rows, n_cols)
    grad = torch.empty_like(logits)
    scale = _ce_ops.mean_scale(target, IGNORE_INDEX)

    def launch(r: Resolved) -> tuple[torch.Tensor, torch.Tensor]:
        loss, _ = _ce_ops.ce_rows(logits, target, ignore_index=IGNORE_INDEX, scale=scale, grad=grad, config=r)
        return loss, grad

    return {"logits": logits, "target": target, "grad": grad}, launch


def _fused_linear_cross_entropy(p: _Problem) -> tuple[dict, Launch]:
    n_rows, n_cols, hidden = p.named["n_rows"], p.named["n_cols"], p.named["hidden"]
    max_chunk = SPECS["fused_linear_cross_entropy"].params["CHUNK_MIB"].hi * 2**20
    esize = torch.empty((), dtype=p.dtype).element_size()
    # hidden and weight with their gradients, and the largest chunk of logits the search may try
    p.need(2 * n_rows * hidden + 2 * n_cols * hidden, min(n_rows * n_cols * esize, max_chunk) + 8 * n_rows)
    h = p.randn(n_rows, hidden)
    w = p.randn(n_cols, hidden, scale=hidden**-0.5)
    target = p.targets(n_rows, n_cols)

    def launch(r: Resolved):
        return _flce_ops.flce_fwd(h, w, target, None, IGNORE_INDEX, 0.0, 0.0, None, "mean", (True, True, False), config=r)

    return {"hidden": h, "weight": w, "target": target}, launch


_BUILDERS: dict[str, Callable[[_Problem], tuple[dict, Launch]]] = {
    "rms_norm_fwd": _rms_norm_fwd,
    "rms_norm_bwd": _rms_norm_bwd,
    "fused_add_rms_norm_fwd": _fused_add_rms_norm_fwd,
    "fused_add_rms_norm_bwd": _fused_add_rms_norm_bwd,
    "layer_norm_fwd": _layer_norm_fwd,
    "layer_norm_bwd": _layer_norm_bwd,
    "swiglu_fwd": _glu_fwd("silu"),
    "swiglu_bwd": _glu_bwd("silu"),
    "geglu_fwd": _glu_fwd("gelu_tanh"),
    "geglu_bwd": _glu_bwd("gelu_tanh"),
    "rope": _rope,
    "cross_entropy": _cross_entropy,
    "fused_linear_cross_entropy": _fused_linear_cross_entropy,
}


def build_run(
    kernel: str,
    device: DeviceInfo,
    named: Mapping[str, int],
    dtype: torch.dtype,
    *,
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> TuneRun:
    """Allocate the inputs of ``named`` for ``kernel`` on ``device`` and return its :class:`TuneRun`.

    Raises:
        KeyError: ``kernel`` is not a kernel spec.
        ValueError: ``named`` lacks a field of the kernel's problem key.
        MemoryError: the inputs do not fit in the free device memory.
    """
    if kernel not in _BUILDERS:
        raise KeyError(f"no tuning hook for kernel {kernel!r}; known kernels: {', '.join(_BUILDERS)}")
    missing = [k for k in SPECS[kernel].key if k not in named]
    if missing:
        raise ValueError(
            f"named problem {dict(named)} of {kernel} lacks {', '.join(missing)}; "
            f"pass every field of its key {SPECS[kernel].key}"
        )
    inputs, launch = _BUILDERS[kernel](_Problem(kernel, device, named, dtype))
    return TuneRun(kernel, inputs, launch, timer)


def make_hook(kernel: str, timer: Callable[[Callable[[], Any]], float] | None = None) -> runtime.TuneHook:
    """The tuning hook of ``kernel``: ``hook(device, named, dtype) -> TuneRun`` timed by ``timer``
    (default :func:`liger_portable.tuning.timing.do_bench_ms`)."""
    if kernel not in _BUILDERS:
        raise KeyError(f"no tuning hook for kernel {kernel!r}; known kernels: {', '.join(_BUILDERS)}")

    def hook(device: DeviceInfo, named: dict, dtype: torch.dtype) -> TuneRun:
        return build_run(kernel, device, named, dtype, timer=timer)

    hook.__name__ = hook.__qualname__ = f"tune_hook_{kernel}"
    return hook


HOOKS: dict[str, runtime.TuneHook] = {k: make_hook(k) for k in _BUILDERS}


def register_all() -> None:
    """Register the hook of every kernel with :func:`liger_portable.tuning.runtime.register_hook`,
    except for kernels that already have one (a hook the user registered is kept). Idempotent."""
    for kernel, hook in HOOKS.items():
        if kernel not in runtime.registered_hooks():
            runtime.register_hook(kernel, hook)
