"""LayerNorm (weight and bias) forward+backward on the GPU, side by side with its peers in one process.

Peers: ``torch.nn.functional.layer_norm`` eager, torch.compile of it, liger-kernel's
LigerLayerNormFunction (when importable), and ours. Reports graph-replay and eager medians,
achieved bandwidth against the copy ceiling measured in the same run (bytes: forward reads x and
writes y, backward reads x and dy and writes dx: 5 passes), and peak extra memory. ``--sweep``
times every point of the table's search space for our kernels alone (forward and backward
separately) and prints the best, to set the tables from measurements.

    python scripts/bench_layer_norm.py [--hidden 4096 2880 ...] [--rows 16384]
    python scripts/bench_layer_norm.py --sweep [--hidden 4096] [--kernels layer_norm_bwd]
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
from liger_portable.configs import Limits, load_table, make_resolved, resolve, search_configs
from liger_portable.specs import MAX_VALUES_PER_THREAD, next_pow2
from liger_portable.ops import layer_norm as ops

EPS = 1e-5
GOAL_MS = {4096: 0.26}  # forward+backward, bf16, 16384 rows, graph replay
IMPL = {"torch eager": "F.layer_norm"}  # peer name -> the results log's impl name


def torch_layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, EPS)


def peers() -> dict:
    torch.compiler.reset()  # a fresh compile per shape: no automatic dynamic shapes, no recompile limit
    fns = {
        "torch eager": torch_layer_norm,
        "torch.compile": torch.compile(torch_layer_norm, dynamic=False),
        "liger-portable": lambda x, w, b: F.layer_norm(x, w, b, EPS),
    }
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        fns["liger-kernel"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel not available: {e}")
    return fns


def bench_compare(hidden: int, rows: int, dtype: torch.dtype, ceiling_gbs: float) -> list[dict]:
    x0 = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w0 = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    b0 = torch.randn(hidden, device="cuda").to(dtype)
    dy = torch.randn_like(x0)
    nbytes = 5 * x0.numel() * x0.element_size()  # fwd: read x, write y; bwd: read x, dy, write dx
    results = []
    ref = None
    for name, fn in peers().items():
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        b = b0.clone().requires_grad_()

        def step():
            x.grad = None
            w.grad = None
            b.grad = None
            fn(x, w, b).backward(dy)

        step()
        out = (x.grad.float(), w.grad.float(), b.grad.float())
        gms = graph_ms(step)
        if ref is None:
            ref = out
        err = max(((a - r).norm() / r.norm()).item() for a, r in zip(out, ref))
        ms = median_ms(step)
        mem = peak_extra_mib(step, (x, w, b))
        results.append(
            {
                "impl": name, "hidden": hidden, "rows": rows, "ms": ms, "graph_ms": gms, "peak_extra_mib": mem,
                "gbs": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / ceiling_gbs,
                "graph_gbs": nbytes / gms / 1e6, "graph_pct_copy": 100 * nbytes / gms / 1e6 / ceiling_gbs,
                "grad_rel_diff_vs_torch": err,
            }
        )
        print(
            f"  {name:<15} {ms:7.3f} ms (graph {gms:7.3f} ms, {nbytes / gms / 1e6:5.0f} GB/s, "
            f"{100 * nbytes / gms / 1e6 / ceiling_gbs:3.0f}% of copy)  {mem:7.0f} MiB  grad diff {err:.1e}"
        )
        del x, w, b
    return results


def sweep(
    hidden: int, rows: int, dtype: torch.dtype, ceiling_gbs: float, kernels: list[str], max_per_thread: int
) -> dict:
    """Time every legal search-space point for the forward and backward kernels alone (with bias).

    Points whose register tile holds more than ``max_per_thread`` fp32 values a thread per tensor
    are skipped: they spill, and their huge unrolled bodies cost seconds to compile.
    """
    dev = liger_portable.platform().device(0)
    table = load_table(dev.backend)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    b = torch.randn(hidden, device="cuda").to(dtype)
    dy = torch.randn_like(x)
    _, mean, rstd = ops.layer_norm_fwd(x, w, b, EPS)

    def call(kernel, r=None):
        if kernel == "layer_norm_fwd":
            return lambda: ops.layer_norm_fwd(x, w, b, EPS, config=r)
        return lambda: ops.layer_norm_bwd(dy, x, w, b, mean, rstd, config=r)

    out = {}
    for kernel, nbytes_mult in (("layer_norm_fwd", 2), ("layer_norm_bwd", 3)):
        if kernel not in kernels:
            continue
        default = resolve(kernel, dev, (hidden, rows), dtype)
        base = default.config.to_dict()
        points = [{**base, **p} for p in search_configs(table, dev.arch, kernel, Limits.of(dev))]
        cfgs = [c for c in points  # a tile over max_per_thread values a thread spills for certain
                if c["BLOCK_M"] * min(next_pow2(hidden), c["BLOCK_N_MAX"]) <= max_per_thread * c["num_warps"] * dev.warp_size]
        timed, skipped = [], len(points) - len(cfgs)
        precompile(kernel, cfgs, lambda r, kernel=kernel: call(kernel, r))
        for cfg in cfgs:
            try:
                ms = median_ms(call(kernel, make_resolved(kernel, cfg, "sweep")), warmup_ms=10, rep_ms=60)
            except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the point
                print(f"    {kernel} {cfg}: {type(e).__name__}")
                continue
            timed.append((ms, cfg))
        timed = fastest_first(timed, kernel)
        default_ms = median_ms(call(kernel))
        nbytes = nbytes_mult * x.numel() * x.element_size()
        best_ms, best_cfg = timed[0]
        print(
            f"  {kernel} hidden {hidden}: default {default_ms:.4f} ms "
            f"({100 * nbytes / default_ms / 1e6 / ceiling_gbs:.0f}% of copy, {default.config}) | best {best_ms:.4f} ms "
            f"({100 * nbytes / best_ms / 1e6 / ceiling_gbs:.0f}% of copy) {best_cfg}"
        )
        for ms, cfg in timed[1:4]:
            print(f"      next {ms:.4f} ms {cfg}")
        print(f"      {len(timed)} points timed, {skipped} skipped (over {max_per_thread} values a thread)")
        out[kernel] = {"default_ms": default_ms, "default": str(default.config), "top": timed[:5], "skipped": skipped}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=None,
                    help="default: 4096 2880 5120 8192 (with --sweep: 4096, to stay within two minutes)")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--sweep", action="store_true")
    add_dtype_argument(ap)
    ap.add_argument("--kernels", nargs="+", default=["layer_norm_fwd", "layer_norm_bwd"], help="for --sweep")
    ap.add_argument("--max-per-thread", type=int, default=MAX_VALUES_PER_THREAD,
                    help="--sweep skips tiles holding more fp32 values a thread than this (spills; the tuner's bound)")
    args = ap.parse_args()
    require_gpu(ap.prog)
    if args.hidden is None:
        args.hidden = [4096] if args.sweep else [4096, 2880, 5120, 8192]
    dtype = getattr(torch, args.dtype)
    ceiling, records = measure_ceiling("copy")
    if args.sweep:
        for h in args.hidden:
            for kernel, res in sweep(h, args.rows, dtype, ceiling, args.kernels, args.max_per_thread).items():
                records += sweep_records(kernel, f"{args.rows}x{h}", res, dtype=args.dtype)
        print(f"results: {save_records('layer_norm_sweep', records)}")
        return
    rows = []
    for h in args.hidden:
        print(f"LayerNorm {args.rows} x {h} {args.dtype} forward+backward (weight and bias)")
        rows += bench_compare(h, args.rows, dtype, ceiling)
    for h, goal in GOAL_MS.items():
        ours = [r for r in rows if r["impl"] == "liger-portable" and r["hidden"] == h and r["rows"] == 16384]
        if ours and dtype == torch.bfloat16:
            met = ours[0]["graph_ms"] <= goal
            print(f"goal at 16384 x {h}: <= {goal} ms graph replay: {ours[0]['graph_ms']:.3f} ms, {'met' if met else 'NOT met'}")
    for r in rows:
        records += timing_records("layer_norm", f"{r['rows']}x{r['hidden']}", IMPL.get(r["impl"], r["impl"]), r["ms"],
                                  r["graph_ms"], pct=r["pct_copy"], peak_mib=r["peak_extra_mib"], dtype=args.dtype)
    print(f"results: {save_records('layer_norm_bench', records)}")
    table = markdown_table(
        ["shape", "impl", "eager median ms", "graph-replay ms", "GB/s (graph)", "% of copy (graph)",
         "GB/s (eager)", "% of copy (eager)", "peak extra MiB"],
        [[f"{r['rows']}x{r['hidden']}", r["impl"], f"{r['ms']:.3f}", f"{r['graph_ms']:.3f}",
          f"{r['graph_gbs']:.0f}", f"{r['graph_pct_copy']:.0f}", f"{r['gbs']:.0f}", f"{r['pct_copy']:.0f}",
          f"{r['peak_extra_mib']:.0f}"] for r in rows],
    )
    print(table)


if __name__ == "__main__":
    main()
