"""The ``info`` and ``check`` commands of the ``liger-portable`` command line (:mod:`liger_portable.cli`
parses the arguments before this module, and torch, are imported): what was detected and where
each kernel's config comes from, and every kernel run on this machine against the float64
fallback, the node check an operator runs on each machine of a cluster."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import configs, fallback, functional as F
from .hardware import PlatformError, platform
from .specs import SPECS


@dataclass
class CheckResult:
    """One case of the node check in one dtype: passed or not, and the relative errors (or the
    exception) as text."""

    name: str
    dtype: torch.dtype
    shape: tuple
    ok: bool
    detail: str


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _check_rms_norm(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    offset = 1.0 if mode == "gemma" else 0.0
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = fallback.rms_norm(xd, wd, 1e-6, offset, mode)
    ref.backward(dy.double())
    xg, wg = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    out = F.rms_norm(xg, wg, 1e-6, offset=offset, casting_mode=mode)
    out.backward(dy.to(device))
    errs = {"y": _rel(out, ref), "dx": _rel(xg.grad, xd.grad), "dw": _rel(wg.grad, wd.grad)}
    return errs


def _check_layer_norm(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 2 + 0.3).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    b = torch.randn(shape[-1], generator=gen).to(dtype) if mode == "bias" else None
    dy = torch.randn(shape, generator=gen).to(dtype)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    bd = None if b is None else b.double().requires_grad_()
    ref = fallback.layer_norm(xd, wd, bd, 1e-5)
    ref.backward(dy.double())
    xg, wg = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    bg = None if b is None else b.to(device).requires_grad_()
    out = F.layer_norm(xg, wg, bg, 1e-5)
    out.backward(dy.to(device))
    errs = {"y": _rel(out, ref), "dx": _rel(xg.grad, xd.grad), "dw": _rel(wg.grad, wd.grad)}
    if b is not None:
        errs["db"] = _rel(bg.grad, bd.grad)
    return errs


def _check_rope(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> dict[str, float]:
    # shape (batch, q heads, k heads, seq, head_dim); mode "hf": Hugging Face's transposed view with
    # unsqueeze_dim=1, "bshd": (batch, seq, heads, head_dim) with unsqueeze_dim=2.
    b, hq, hk, s, d = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, hq, d, generator=gen).to(dtype)
    k = torch.randn(b, s, hk, d, generator=gen).to(dtype)
    cos = torch.randn(b, s, d, generator=gen).to(dtype)
    sin = torch.randn(b, s, d, generator=gen).to(dtype)
    dq, dk = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    dim = 1 if mode == "hf" else 2

    def view(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if mode == "hf" else t

    qd, kd = q.double().requires_grad_(), k.double().requires_grad_()
    rq, rk = fallback.rope(view(qd), view(kd), cos.double(), sin.double(), None, dim)
    torch.autograd.backward([rq, rk], [view(dq.double()), view(dk.double())])
    qg, kg = q.to(device).requires_grad_(), k.to(device).requires_grad_()
    oq, ok_ = F.rope(view(qg), view(kg), cos.to(device), sin.to(device), unsqueeze_dim=dim)
    torch.autograd.backward([oq, ok_], [view(dq.to(device)), view(dk.to(device))])
    errs = {"q": _rel(oq, rq), "k": _rel(ok_, rk), "dq": _rel(qg.grad, qd.grad), "dk": _rel(kg.grad, kd.grad)}
    return errs


def _check_glu(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> dict[str, float]:
    # mode "swiglu" or "geglu"; both backward modes: out of place (a, b kept), then in place (as the MLPs).
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(shape, generator=gen) * 2).to(dtype)
    b = torch.randn(shape, generator=gen).to(dtype)
    dc = torch.randn(shape, generator=gen).to(dtype)
    ad, bd = a.double().requires_grad_(), b.double().requires_grad_()
    ref = getattr(fallback, mode)(ad, bd)
    ref.backward(dc.double())
    errs = {}
    for inplace in (False, True):
        leaf_a, leaf_b = a.to(device, copy=True).requires_grad_(), b.to(device, copy=True).requires_grad_()
        # In place, the backward writes the gradients over a and b, so they must be activations the
        # call owns (as in the MLPs): copies of the leaves, through which the gradients reach them.
        ag, bg = (leaf_a.clone(), leaf_b.clone()) if inplace else (leaf_a, leaf_b)
        out = getattr(F, mode)(ag, bg, inplace_backward=inplace)
        out.backward(dc.to(device))
        tag = "(in place)" if inplace else ""
        errs |= {f"c{tag}": _rel(out, ref), f"da{tag}": _rel(leaf_a.grad, ad.grad), f"db{tag}": _rel(leaf_b.grad, bd.grad)}
        if not inplace and not (torch.equal(ag.detach().cpu(), a) and torch.equal(bg.detach().cpu(), b)):
            errs["a,b kept"] = float("inf")
    return errs


def _check_fused_add_rms_norm(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> dict[str, float]:
    # Gradients reach both outputs (the normed one and the sum), as in a decoder layer.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    r = (torch.randn(shape, generator=gen) * 2).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    ds = torch.randn(shape, generator=gen).to(dtype)
    offset = 1.0 if mode == "gemma" else 0.0
    xd, rd, wd = x.double().requires_grad_(), r.double().requires_grad_(), w.double().requires_grad_()
    ref_y, ref_s = fallback.fused_add_rms_norm(xd, rd, wd, 1e-6, offset, mode)
    torch.autograd.backward([ref_y, ref_s], [dy.double(), ds.double()])
    xg, rg, wg = (t.to(device).requires_grad_() for t in (x, r, w))
    y, s = F.fused_add_rms_norm(xg, rg, wg, 1e-6, offset=offset, casting_mode=mode)
    torch.autograd.backward([y, s], [dy.to(device), ds.to(device)])
    errs = {
        "y": _rel(y, ref_y), "s": _rel(s, ref_s),
        "dx": _rel(xg.grad, xd.grad), "dr": _rel(rg.grad, rd.grad), "dw": _rel(wg.grad, wd.grad),
    }
    return errs


def _check_cross_entropy(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> dict[str, float]:
    # mode "plain" or "all" (label smoothing + z-loss + softcap, a quarter of the rows ignored).
    n_rows, V = shape
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    t = torch.randint(0, V, (n_rows,), generator=gen)
    opts = {} if mode == "plain" else {"label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 30.0}
    if mode == "all":
        t[::4] = -100
    xd = x.double().requires_grad_()
    ref = fallback.cross_entropy(xd, t, -100, "mean", opts.get("label_smoothing", 0.0),
                                 opts.get("lse_square_scale", 0.0), opts.get("softcap"), False)
    ref.backward()
    xg = x.to(device).requires_grad_()
    out = F.cross_entropy(xg, t.to(device), **opts)
    out.backward()
    errs = {"loss": _rel(out, ref), "dx": _rel(xg.grad, xd.grad)}
    return errs


def _check_fused_linear_cross_entropy(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> dict[str, float]:
    # shape (BT, H, V); mode "plain" or "bias_all" (bias, label smoothing, z-loss, softcap).
    BT, H, V = shape
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(BT, H, generator=gen).to(dtype)
    w = (torch.randn(V, H, generator=gen) / H**0.5 * 3).to(dtype)
    b = torch.randn(V, generator=gen).to(dtype) if mode != "plain" else None
    t = torch.randint(0, V, (BT,), generator=gen)
    t[::5] = -100
    opts = {} if mode == "plain" else {"label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 30.0}
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    bd = None if b is None else b.double().requires_grad_()
    ref = fallback.fused_linear_cross_entropy(hd, wd, t, bd, -100, "mean", opts.get("label_smoothing", 0.0),
                                              opts.get("lse_square_scale", 0.0), opts.get("softcap"), False)
    ref.backward()
    hg, wg = h.to(device).requires_grad_(), w.to(device).requires_grad_()
    bg = None if b is None else b.to(device).requires_grad_()
    out = F.fused_linear_cross_entropy(hg, wg, t.to(device), bg, **opts)
    out.backward()
    errs = {"loss": _rel(out, ref), "dh": _rel(hg.grad, hd.grad), "dw": _rel(wg.grad, wd.grad)}
    if b is not None:
        errs["db"] = _rel(bg.grad, bd.grad)
    return errs


# (check, case name, shape, modes): a check returns its outputs' and gradients' relative errors
# against float64; "{mode}" in the name is the mode.
_CHECKS: list[tuple[Callable[..., dict[str, float]], str, tuple, tuple]] = [
    (_check_rms_norm, "rms_norm[{mode}]", (7, 4096), ("llama", "gemma")),
    (_check_rms_norm, "rms_norm[{mode}]", (3, 70001), ("llama",)),
    (_check_fused_add_rms_norm, "fused_add_rms_norm[{mode}]", (7, 4096), ("llama", "gemma")),
    (_check_fused_add_rms_norm, "fused_add_rms_norm[{mode}]", (3, 70001), ("llama",)),
    (_check_layer_norm, "layer_norm[{mode}]", (7, 4096), ("bias", "no_bias")),
    (_check_layer_norm, "layer_norm[{mode}]", (3, 70001), ("bias",)),
    (_check_glu, "{mode}", (5, 14336), ("swiglu", "geglu")),
    (_check_glu, "{mode}", (3, 1001), ("swiglu", "geglu")),
    (_check_rope, "rope[{mode}]", (2, 8, 2, 300, 128), ("hf", "bshd")),
    (_check_rope, "rope[{mode}]", (1, 5, 1, 77, 80), ("hf",)),
    (_check_cross_entropy, "cross_entropy[{mode}]", (64, 128256), ("plain", "all")),
    (_check_cross_entropy, "cross_entropy[{mode}]", (5, 4097), ("all",)),
    (_check_fused_linear_cross_entropy, "flce[{mode}]", (300, 256, 32001), ("plain", "bias_all")),
]


@dataclass(frozen=True)
class CheckCase:
    """One case of the node check: an op in one mode at one shape, run in each dtype by
    :func:`run_check`."""

    name: str
    shape: tuple
    check: Callable[..., dict[str, float]]
    mode: str


CHECK_CASES: list[CheckCase] = [
    CheckCase(name.format(mode=mode), shape, fn, mode) for fn, name, shape, modes in _CHECKS for mode in modes
]
"""Every case ``liger-portable check`` runs, in order: every public op of :mod:`liger_portable.functional`."""

CHECK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def run_check(case: CheckCase, device: torch.device, dtype: torch.dtype) -> CheckResult:
    """Run ``case`` on ``device`` in ``dtype`` (forward and backward, fixed random inputs) against
    the float64 fallback on the CPU. Passes when every output's and gradient's relative error is
    within the dtype's tolerance (1e-5 for float32, 1e-2 for bfloat16 and float16); an exception
    is a failed result naming it, never raised."""
    try:
        errs = case.check(device, dtype, case.shape, case.mode)
        ok = all(e <= _TOL[dtype] for e in errs.values())
        detail = " ".join(f"{k} {v:.1e}" for k, v in errs.items())
    except Exception as e:  # report every failure, keep checking the rest
        ok, detail = False, f"{type(e).__name__}: {e}"
    return CheckResult(case.name, dtype, case.shape, ok, detail)


def _configs_for(device_index: int) -> list[tuple[str, str, str, str]]:
    p = platform()
    dev = p.device(device_index)
    rows = []
    for spec in SPECS.values():  # each kernel's representative problem, declared with its spec
        if spec.shown is not None:
            label, problem = spec.shown
            r = configs.resolve(spec.name, dev, problem, torch.bfloat16)
            rows.append((spec.name, label, str(r.config), r.source))
    return rows


def cache_summary(device) -> list[tuple[str, Path, int]]:
    """(label, path, number of entries) of the user and shipped autotune cache files of ``device``'s
    model, in lookup order (0 entries: missing, empty or unreadable)."""
    from . import autotune_cache

    return [(label, path, len(autotune_cache.read(str(path)))) for label, path in autotune_cache.cache_files(device)]


def current_entries(path: Path) -> int:
    """How many entries of the cache file at ``path`` this installation can use: those of a
    kernel's current code version and of the installed Triton's major.minor (a Triton upgrade or
    a kernel change leaves the others unused)."""
    from . import autotune_cache

    prefixes = tuple(f"{s.name}|{s.version}|triton{autotune_cache.triton_major_minor()}|" for s in SPECS.values())
    return sum(key.startswith(prefixes) for key in autotune_cache.read(str(path)))


def entries_text(path: Path, n: int) -> str:
    """What `info` says of a cache file holding ``n`` entries."""
    if not n:
        return "none for this model"
    current = current_entries(path)
    return f"{n} tuned entries" + ("" if current == n else f", {current} current for this Triton and kernel code")


def cmd_info(args: argparse.Namespace) -> int:
    p = platform()
    if args.json:
        out = p.describe()
        if p.backend != "cpu":
            refused = {i: configs.unsupported_reason(p.device(i)) for i in range(p.device_count)}
            out["unsupported"] = {i: why for i, why in refused.items() if why is not None}
            out["configs"] = {  # none for a device that runs the fallback
                i: [dict(zip(("kernel", "problem", "config", "source"), r)) for r in _configs_for(i)]
                for i in range(p.device_count) if refused[i] is None
            }
            out["autotune_cache"] = {
                i: [{"cache": label, "path": str(path), "entries": n, "current": current_entries(path)}
                    for label, path, n in cache_summary(p.device(i))]
                for i in range(p.device_count)
            }
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(f"liger-portable: backend {p.backend} ({p.source}; hardware offers {p.detected})")
    print(f"torch {p.torch_version}, triton {p.triton_version or 'not installed'}")
    if p.backend == "cpu":
        print("no GPU backend in use: every kernel runs the pure-PyTorch fallback")
        return 0
    for i in range(p.device_count):
        d = p.device(i)
        table = configs.load_table(d.backend)
        section = table.section_for(d.arch).name
        print(
            f"device {i}: {d.name}  arch {d.arch}  warp {d.warp_size}  compute units {d.compute_units}  "
            f"shared mem/block {d.shared_mem_per_block} B  -> {table.path.name} [{section}]"
        )
        why = table.unsupported_reason(d.arch)
        if why is not None:
            print(f"  not supported by the kernels, runs the pure-PyTorch fallback: {why}")
            continue
        for label, path, n in cache_summary(d):
            print(f"  {label}: {path} ({entries_text(path, n)})")
        for kernel, label, cfg, source in _configs_for(i):
            print(f"  {kernel:<14} {label:<24} {cfg:<58} from {source}")
    print(f"kernels with tables: {', '.join(SPECS)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    p = platform()
    why = None  # why the device cannot run the kernels
    if p.backend == "cpu":
        device = torch.device("cpu")
        where = "cpu (PyTorch fallback)"
    else:
        if args.device >= p.device_count:
            raise PlatformError(f"--device {args.device}: this machine has {p.device_count} {p.backend} device(s), "
                             f"indices 0 to {p.device_count - 1}")
        device = torch.device(p.torch_device_type, args.device)
        d = p.device(args.device)
        where = f"{d.name} ({p.backend} {d.arch})"
        why = configs.unsupported_reason(d)
        if why is not None:  # the check would compare the fallback with itself
            where += f": not supported by the kernels, so this checks the PyTorch fallback ({why})"
    print(f"liger-portable check on {where}")
    failures = 0
    t0 = time.perf_counter()
    for case in CHECK_CASES:
        for dtype in CHECK_DTYPES:
            r = run_check(case, device, dtype)
            failures += not r.ok
            dt = str(r.dtype).removeprefix("torch.")
            print(f"  {'PASS' if r.ok else 'FAIL'}  {r.name:<18} {dt:<9} {str(r.shape):<12} {r.detail}")
    if p.backend != "cpu" and why is None:
        for kernel, label, cfg, source in _configs_for(args.device):
            print(f"  config {kernel:<14} {label}: {cfg} ({source})")
    status = "all passed" if failures == 0 else f"{failures} FAILED"
    print(f"{status} in {time.perf_counter() - t0:.1f} s")
    return 0 if failures == 0 else 1
