"""RMSNorm forward+backward on the GPU, side by side with its peers in one process.

Peers: eager PyTorch (Hugging Face LlamaRMSNorm written out), torch.compile of it,
``torch.nn.functional.rms_norm``, and liger-kernel's LigerRMSNorm (when importable).
Reports median ms, achieved bandwidth against the copy ceiling measured in the same run, and peak
extra memory. ``--sweep`` times the tuner's candidates (the table default and its search space) for our kernels alone
(forward and backward separately) and prints the best, to set the tables from measurements.

    python scripts/bench_rms_norm.py [--sweep] [--hidden 4096 2880 ...] [--rows 16384]
"""

from __future__ import annotations

import argparse

import torch

from benchlib import (
    add_dtype_argument, fastest_first, require_gpu,
    graph_ms, markdown_table, measure_ceiling, median_ms, peak_extra_mib, precompile, save_records, sweep_records,
    timing_records,
)

import liger_portable
from liger_portable import functional as F
from liger_portable.configs import make_resolved, resolve
from liger_portable.tuning import candidates
from liger_portable.ops import rms_norm as ops

EPS = 1e-6
IMPL = {"eager (HF)": "eager"}  # peer name -> the results log's impl name


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def peers(hidden: int, dtype: torch.dtype) -> dict:
    torch.compiler.reset()  # a fresh compile per shape: no automatic dynamic shapes, no recompile limit
    fns = {
        "eager (HF)": hf_rms_norm,
        "torch.compile": torch.compile(hf_rms_norm, dynamic=False),
        "F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (hidden,), w, EPS),
        "liger-portable": lambda x, w: F.rms_norm(x, w, EPS),
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        fns["liger-kernel"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)  # in_place=False: dy is reused
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel not available: {e}")
    return fns


def bench_compare(hidden: int, rows: int, dtype: torch.dtype, ceiling_gbs: float) -> list[dict]:
    x0 = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w0 = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    dy = torch.randn_like(x0)
    nbytes = 5 * x0.numel() * x0.element_size()  # fwd: read x, write y; bwd: read x, dy, write dx
    results = []
    ref = None
    for name, fn in peers(hidden, dtype).items():
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()

        def step():
            x.grad = None
            w.grad = None
            fn(x, w).backward(dy)

        step()
        out = (x.grad.float(), w.grad.float())
        gms = graph_ms(step)
        if ref is None:
            ref = out
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(out, ref))
        ms = median_ms(step)
        mem = peak_extra_mib(step, (x, w))
        results.append(
            {
                "impl": name, "hidden": hidden, "rows": rows, "ms": ms, "graph_ms": gms, "peak_extra_mib": mem,
                "gbs": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / ceiling_gbs,
                "grad_rel_diff_vs_eager": err,
            }
        )
        print(
            f"  {name:<15} {ms:7.3f} ms (graph {gms:7.3f} ms, {nbytes / gms / 1e6:5.0f} GB/s)  {mem:7.0f} MiB  "
            f"grad diff {err:.1e}"
        )
    return results


def sweep(hidden: int, rows: int, dtype: torch.dtype, ceiling_gbs: float, kernels: list[str]) -> dict:
    """Time every legal search-space point for the forward and backward kernels alone."""
    dev = liger_portable.platform().device(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    dy = torch.randn_like(x)
    _, rstd = ops.rms_norm_fwd(x, w, EPS, 0.0, False)
    out = {}
    for kernel, nbytes_mult in (("rms_norm_fwd", 2), ("rms_norm_bwd", 3)):
        if kernel not in kernels:
            continue
        default = resolve(kernel, dev, (hidden, rows), dtype)
        base = default.config.to_dict()
        timed = []

        def launch(r, kernel=kernel):
            if kernel == "rms_norm_fwd":
                return lambda: ops.rms_norm_fwd(x, w, EPS, 0.0, False, config=r)
            return lambda: ops.rms_norm_bwd(dy, x, w, rstd, 0.0, False, config=r)

        # the tuner's candidates: distinct kernels, tiles within MAX_VALUES_PER_THREAD; compiled in parallel
        cfgs = [base, *candidates(kernel, dev, {"n_cols": hidden, "n_rows": rows})]
        precompile(kernel, cfgs, launch)
        for cfg in cfgs:
            fn = launch(make_resolved(kernel, cfg, "sweep"))
            try:
                ms = median_ms(fn, warmup_ms=10, rep_ms=30)
            except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the point
                print(f"    {kernel} {cfg}: {type(e).__name__}")
                continue
            timed.append((ms, cfg))
        timed = fastest_first(timed, kernel)
        default_ms = median_ms(
            (lambda: ops.rms_norm_fwd(x, w, EPS, 0.0, False)) if kernel == "rms_norm_fwd"
            else (lambda: ops.rms_norm_bwd(dy, x, w, rstd, 0.0, False))
        )
        nbytes = nbytes_mult * x.numel() * x.element_size()
        best_ms, best_cfg = timed[0]
        print(
            f"  {kernel} hidden {hidden}: default {default_ms:.4f} ms ({default.config}) | best {best_ms:.4f} ms "
            f"({100 * nbytes / best_ms / 1e6 / ceiling_gbs:.0f}% of copy) {best_cfg}"
        )
        for ms, cfg in timed[1:4]:
            print(f"      next {ms:.4f} ms {cfg}")
        out[kernel] = {"default_ms": default_ms, "default": str(default.config), "top": timed[:5]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 2880, 5120, 8192])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--sweep", action="store_true")
    add_dtype_argument(ap)
    ap.add_argument("--kernels", nargs="+", default=["rms_norm_fwd", "rms_norm_bwd"], help="for --sweep")
    args = ap.parse_args()
    require_gpu(ap.prog)
    dtype = getattr(torch, args.dtype)
    ceiling, records = measure_ceiling("copy")
    if args.sweep:
        for h in args.hidden:
            for kernel, res in sweep(h, args.rows, dtype, ceiling, args.kernels).items():
                records += sweep_records(kernel, f"{args.rows}x{h}", res, dtype=args.dtype)
        print(f"results: {save_records('rms_norm_sweep', records)}")
        return
    rows = []
    for h in args.hidden:
        print(f"RMSNorm {args.rows} x {h} {args.dtype} forward+backward")
        rows += bench_compare(h, args.rows, dtype, ceiling)
    for r in rows:
        records += timing_records("rms_norm", f"{r['rows']}x{r['hidden']}", IMPL.get(r["impl"], r["impl"]), r["ms"],
                                  r["graph_ms"], pct=r["pct_copy"], peak_mib=r["peak_extra_mib"], dtype=args.dtype)
    print(f"results: {save_records('rms_norm_bench', records)}")
    table = markdown_table(
        ["shape", "impl", "eager median ms", "graph-replay ms", "GB/s (graph)", "% of copy (graph)", "peak extra MiB"],
        [[f"{r['rows']}x{r['hidden']}", r["impl"], f"{r['ms']:.3f}", f"{r['graph_ms']:.3f}",
          f"{nb / r['graph_ms'] / 1e6:.0f}", f"{100 * nb / r['graph_ms'] / 1e6 / ceiling:.0f}",
          f"{r['peak_extra_mib']:.0f}"] for r in rows for nb in [5 * r['rows'] * r['hidden'] * dtype.itemsize]],
    )
    print(table)


if __name__ == "__main__":
    main()
