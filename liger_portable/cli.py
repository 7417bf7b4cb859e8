"""``liger-portable`` command line: ``info`` (what was detected, where each config comes from) and
``check`` (run every kernel on this machine against the float64 fallback): the node check an
operator runs on each machine of a cluster."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import _configs, fallback, functional as F
from ._platform import PlatformError, platform
from ._specs import SPECS

# Representative problems shown by `info` and run by `check`, per kernel family:
# (label, kernel spec names, problem key values in spec order).
_INFO_PROBLEMS = {
    "rms_norm": [("hidden 4096, 16384 rows", ("rms_norm_fwd", "rms_norm_bwd"), (4096, 16384))],
    # @info-problems
}


@dataclass
class CheckResult:
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


def _check_rms_norm(device: torch.device, dtype: torch.dtype, shape: tuple, mode: str) -> CheckResult:
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
    ok = all(e <= _TOL[dtype] for e in errs.values())
    detail = " ".join(f"{k} {v:.1e}" for k, v in errs.items())
    return CheckResult(f"rms_norm[{mode}]", dtype, shape, ok, detail)


# @checks (each kernel family adds its _check_* function above this line)


_CHECKS: list[tuple[Callable, tuple, tuple]] = [
    (_check_rms_norm, (7, 4096), ("llama", "gemma")),
    (_check_rms_norm, (3, 70001), ("llama",)),
    # @check-entries
]


def _configs_for(device_index: int) -> list[tuple[str, str, str, str]]:
    p = platform()
    dev = p.device(device_index)
    rows = []
    for family, problems in _INFO_PROBLEMS.items():
        for label, kernels, problem in problems:
            for k in kernels:
                r = _configs.resolve(k, dev, problem, torch.bfloat16)
                rows.append((k, label, str(r.config), r.source))
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    p = platform()
    if args.json:
        out = p.describe()
        if p.backend != "cpu":
            out["configs"] = {
                i: [dict(zip(("kernel", "problem", "config", "source"), r)) for r in _configs_for(i)]
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
        table = _configs.load_table(d.backend)
        section = table.section_for(d.arch).name
        print(
            f"device {i}: {d.name}  arch {d.arch}  warp {d.warp_size}  compute units {d.compute_units}  "
            f"shared mem/block {d.shared_mem_per_block} B  -> {table.path.name} [{section}]"
        )
        for kernel, label, cfg, source in _configs_for(i):
            print(f"  {kernel:<14} {label:<24} {cfg:<58} from {source}")
    print(f"kernels with tables: {', '.join(SPECS)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    p = platform()
    if p.backend == "cpu":
        device = torch.device("cpu")
        where = "cpu (PyTorch fallback)"
    else:
        device = torch.device(p.torch_device_type, args.device)
        d = p.device(args.device)
        where = f"{d.name} ({p.backend} {d.arch})"
    print(f"liger-portable check on {where}")
    failures = 0
    t0 = time.perf_counter()
    for fn, shape, modes in _CHECKS:
        for mode in modes:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                try:
                    r = fn(device, dtype, shape, mode)
                except Exception as e:  # report every failure, keep checking the rest
                    r = CheckResult(fn.__name__, dtype, shape, False, f"{type(e).__name__}: {e}")
                failures += not r.ok
                dt = str(r.dtype).removeprefix("torch.")
                print(f"  {'PASS' if r.ok else 'FAIL'}  {r.name:<18} {dt:<9} {str(r.shape):<12} {r.detail}")
    if p.backend != "cpu":
        for kernel, label, cfg, source in _configs_for(args.device):
            print(f"  config {kernel:<14} {label}: {cfg} ({source})")
    status = "all passed" if failures == 0 else f"{failures} FAILED"
    print(f"{status} in {time.perf_counter() - t0:.1f} s")
    return 0 if failures == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="liger-portable", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="platform, backend, and where each kernel's config comes from")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
    check = sub.add_parser("check", help="run every kernel on this device against the float64 fallback")
    check.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    check.set_defaults(func=cmd_check)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (PlatformError, _configs.ConfigError) as e:
        print(f"liger-portable: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
