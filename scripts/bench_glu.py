"""SwiGLU / GeGLU activation product (``act(a) * b``), forward+backward on the GPU, side by side
with its peers in one process.

The step timed is the activation product alone, as inside an MLP: ``c = act(a) * b`` on leaves
``a``, ``b`` (rows x n, bf16), then ``c.backward(dc)``.

Bytes counted: 8 passes over rows x n x 2 B (forward reads a, b and writes c; backward reads dc,
a, b and writes da, db). At 16384 x 14336 one pass is 470 MB, so the copy-bandwidth floor is
8 x 470 MB = 3.76 GB / 4.27 TB/s = 0.88 ms: the goal (<= 0.89 ms) is at the floor. Memory goal:
<= 450 MiB extra, and the output c alone is 448 MiB, so the backward must write da and db into
the storage of a and b (``inplace_backward=True``, what the MLP modules use).

Peers: eager PyTorch (``silu(a) * b``; ``gelu(a, approximate="tanh") * b``: Hugging Face's
LlamaMLP / GemmaMLP product), torch.compile of it, liger-kernel's ``LigerSiLUMulFunction`` /
``LigerGELUMulFunction`` (their backward always writes da, db over a, b), and ours with
``inplace_backward=True`` and ``False``.

In-place peers overwrite a and b with their gradients at every step, so from the second step on
they run on gradients of gradients; the op is memory-bound and its time does not depend on the
values (the correctness column compares the first step, on fresh inputs, with eager's gradients).

Reported per implementation: eager median ms (the step called from Python: host-bound on slow
hosts), graph-replay median ms (the step captured in a CUDA graph: GPU time, the goal is judged
here), GB/s and % of the copy ceiling measured in the same run (graph), and peak extra MiB (above
a, b, dc and with the previous step's gradients freed).

``--sweep`` times every point of the table's search space for our kernels alone (forward, and the
in-place backward) at the first shape and prints the best, to set the tables from measurements.
Points with fewer than ``--min-epp`` or more than ``--max-epp`` elements per thread are skipped
(too little work per thread for 16-byte accesses, or register pressure): ``--all-points`` keeps them.

    python scripts/bench_glu.py                      # about 60-80 s on an H200
    python scripts/bench_glu.py --sweep              # swiglu_fwd + swiglu_bwd at 16384 x 14336, under 120 s
    python scripts/bench_glu.py --sweep --kernels geglu_fwd geglu_bwd
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchlib import (
    add_dtype_argument, require_gpu, shape_type,
    fastest_first, graph_ms, markdown_table, measure_ceiling, median_ms, peak_extra_mib, save_records, sweep_records,
    timing_records,
)

import liger_portable
from liger_portable import functional as F
from liger_portable.configs import Limits, load_table, make_resolved, resolve, search_configs
from liger_portable.ops import glu as ops

DEVICE = "cuda"
PASSES = 8  # forward: a, b, c; backward: dc, a, b, da, db
ACT = {"swiglu": "silu", "geglu": "gelu_tanh"}
GOAL_SHAPE, GOAL_MS, GOAL_MIB = (16384, 14336), 0.89, 450


def eager_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(a) * b


def eager_geglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(a, approximate="tanh") * b


def peers(op: str) -> dict:
    """name -> (fn(a, b) -> c, writes the gradients over a and b)."""
    torch.compiler.reset()  # a fresh compile per shape: no automatic dynamic shapes, no recompile limit
    eager = eager_swiglu if op == "swiglu" else eager_geglu
    ours = F.swiglu if op == "swiglu" else F.geglu
    fns = {
        "eager": (eager, False),
        "torch.compile": (torch.compile(eager, dynamic=False), False),
    }
    try:
        if op == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as LigerFn
        else:
            from liger_kernel.ops.geglu import LigerGELUMulFunction as LigerFn
        fns["liger-kernel"] = (lambda a, b: LigerFn.apply(a, b), True)
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel not available: {type(e).__name__}: {e}")
    fns["liger-portable in place"] = (lambda a, b: ours(a, b, inplace_backward=True), True)
    fns["liger-portable"] = (lambda a, b: ours(a, b), False)
    return fns


def bench_compare(op: str, rows: int, n: int, dtype: torch.dtype, ceiling_gbs: float) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    a0 = torch.randn(rows, n, device=DEVICE, dtype=dtype, generator=g) * 2
    b0 = torch.randn(rows, n, device=DEVICE, dtype=dtype, generator=g)
    dc = torch.randn(rows, n, device=DEVICE, dtype=dtype, generator=g)
    nbytes = PASSES * a0.numel() * a0.element_size()
    results = []
    ref = None
    for name, (fn, inplace) in peers(op).items():
        # Ours in place refuses leaves that require grad (their values would become gradients):
        # it gets views of buffers of this function's own, as an MLP's activations are.
        a = (a0.clone()[...] if inplace else a0.clone()).requires_grad_()
        b = (b0.clone()[...] if inplace else b0.clone()).requires_grad_()

        def step():
            a.grad = None
            b.grad = None
            fn(a, b).backward(dc)

        t0 = time.perf_counter()
        step()  # first step on fresh inputs: compile, and the gradients for the comparison
        first_s = time.perf_counter() - t0
        out = (a.grad.float(), b.grad.float())  # copies: in-place peers overwrite a.grad next step
        if ref is None:
            ref = out
        err = max(((x - y).norm() / y.norm()).item() for x, y in zip(out, ref))
        del out
        gms = graph_ms(step)
        ms = median_ms(step)
        mem = peak_extra_mib(step, (a, b))
        r = {
            "op": op, "impl": name, "rows": rows, "n": n, "inplace_backward": inplace,
            "ms": ms, "graph_ms": gms, "peak_extra_mib": mem,
            "gbs_graph": nbytes / gms / 1e6, "pct_copy_graph": 100 * nbytes / gms / 1e6 / ceiling_gbs,
            "gbs": nbytes / ms / 1e6, "grad_rel_diff_vs_eager": err, "first_step_s": first_s,
        }
        results.append(r)
        print(
            f"  {name:<24} {ms:7.3f} ms (graph {gms:7.3f} ms, {r['gbs_graph']:5.0f} GB/s, "
            f"{r['pct_copy_graph']:3.0f}% of copy)  {mem:7.0f} MiB  grad diff {err:.1e}  first step {first_s:.1f} s"
        )
        del a, b, step
        torch.cuda.empty_cache()
    return results


def sweep(op_kernels: list[str], rows: int, n: int, dtype: torch.dtype, ceiling_gbs: float,
          epp: tuple[int, int] | None, budget_s: float) -> dict:
    """Time every legal search-space point of each kernel alone (backward in place, as the MLPs run
    it), nearest to 16 elements per thread first, within ``budget_s`` seconds per kernel (each new
    point costs a Triton compile, which dominates on a slow host)."""
    dev = liger_portable.platform().device(0)
    table = load_table(dev.backend)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    a = torch.randn(rows, n, device=DEVICE, dtype=dtype, generator=g)
    b = torch.randn(rows, n, device=DEVICE, dtype=dtype, generator=g)
    dc = torch.randn(rows, n, device=DEVICE, dtype=dtype, generator=g)
    out = {}
    for kernel in op_kernels:
        act = ACT[kernel.split("_")[0]]
        fwd = kernel.endswith("_fwd")
        passes = 3 if fwd else 5
        nbytes = passes * a.numel() * a.element_size()

        def launch(r=None):
            if fwd:
                return ops.glu_fwd(a, b, act, config=r)
            return ops.glu_bwd(dc, a, b, act, True, config=r)  # overwrites a, b: values do not matter here

        default = resolve(kernel, dev, (n, rows), dtype)
        base = default.config.to_dict()
        timed, skipped, over_budget = [], 0, 0
        t0 = time.perf_counter()

        def per_thread(cfg):
            return cfg["BLOCK_M"] * min(cfg["BLOCK_N"], n) / (cfg["num_warps"] * dev.warp_size)

        points = []
        for point in search_configs(table, dev.arch, kernel, Limits.of(dev)):
            cfg = {**base, **point}
            if epp is not None and not epp[0] <= per_thread(cfg) <= epp[1]:
                skipped += 1
            else:
                points.append(cfg)
        points.sort(key=lambda c: (c != base, abs(math.log2(max(per_thread(c), 1e-9)) - 4)))
        for cfg in points:
            if time.perf_counter() - t0 > budget_s:
                over_budget += 1
                continue
            r = make_resolved(kernel, cfg, "sweep")
            try:
                ms = median_ms(lambda: launch(r), warmup_ms=10, rep_ms=40)
            except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the point
                print(f"    {kernel} {cfg}: {type(e).__name__}")
                continue
            timed.append((ms, cfg))
        timed = fastest_first(timed, kernel)
        default_ms = median_ms(launch)
        best_ms, best_cfg = timed[0]
        print(
            f"  {kernel} {rows} x {n}: default {default_ms:.4f} ms ({default.config}, "
            f"{100 * nbytes / default_ms / 1e6 / ceiling_gbs:.0f}% of copy) | best {best_ms:.4f} ms "
            f"({100 * nbytes / best_ms / 1e6 / ceiling_gbs:.0f}% of copy) {best_cfg}  "
            f"[{len(timed)} points, {skipped} filtered, {over_budget} over budget, {time.perf_counter() - t0:.0f} s]"
        )
        for ms, cfg in timed[1:5]:
            print(f"      next {ms:.4f} ms {cfg}")
        out[kernel] = {
            "default_ms": default_ms, "default": str(default.config), "top": timed[:8],
            "points": len(timed), "filtered": skipped, "over_budget": over_budget,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=shape_type("ROWSxN"), nargs="+", default=[(16384, 14336), (16384, 8192), (4096, 28672)],
                    help="rows x n, e.g. 16384x14336 (--sweep uses the first)")
    ap.add_argument("--ops", nargs="+", default=["swiglu", "geglu"], choices=["swiglu", "geglu"])
    add_dtype_argument(ap)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--kernels", nargs="+", default=["swiglu_fwd", "swiglu_bwd"],
                    choices=["swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd"], help="for --sweep")
    ap.add_argument("--min-epp", type=int, default=None,
                    help="--sweep: fewest elements per thread (default: 16 bytes' worth, one full vector)")
    ap.add_argument("--max-epp", type=int, default=32, help="--sweep: most elements per thread")
    ap.add_argument("--all-points", action="store_true", help="--sweep: no elements-per-thread filter")
    ap.add_argument("--budget-s", type=float, default=85, help="--sweep: seconds for all kernels together")
    args = ap.parse_args()
    require_gpu(ap.prog)
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()
    ceiling, records = measure_ceiling("copy")
    if args.sweep:
        rows, n = args.shapes[0]
        epp = None if args.all_points else (args.min_epp or 16 // dtype.itemsize, args.max_epp)
        budget = args.budget_s / len(args.kernels)
        for kernel, res in sweep(args.kernels, rows, n, dtype, ceiling, epp, budget).items():
            records += sweep_records(kernel, f"{rows}x{n}", res, dtype=args.dtype)
        path = save_records("glu_sweep", records)
        print(f"wrote {path} in {time.perf_counter() - t_start:.0f} s")
        return
    rows_out = []
    for op in args.ops:
        for rows, n in args.shapes:
            floor_ms = PASSES * rows * n * dtype.itemsize / ceiling / 1e6
            print(f"{op} {rows} x {n} {args.dtype} forward+backward (copy floor {floor_ms:.3f} ms)")
            rows_out += bench_compare(op, rows, n, dtype, ceiling)
    for r in rows_out:
        records += timing_records(r["op"], f"{r['rows']}x{r['n']}", r["impl"], r["ms"], r["graph_ms"],
                                  pct=100 * r["gbs"] / ceiling, peak_mib=r["peak_extra_mib"],
                                  dtype=args.dtype)
    path = save_records("glu_bench", records)
    print(markdown_table(
        ["op", "shape", "impl", "eager median ms", "graph-replay ms", "GB/s (graph)", "% of copy (graph)",
         "peak extra MiB", "grad diff vs eager"],
        [[r["op"], f"{r['rows']}x{r['n']}", r["impl"], f"{r['ms']:.3f}", f"{r['graph_ms']:.3f}",
          f"{r['gbs_graph']:.0f}", f"{r['pct_copy_graph']:.0f}", f"{r['peak_extra_mib']:.0f}",
          f"{r['grad_rel_diff_vs_eager']:.1e}"] for r in rows_out],
    ))
    for r in rows_out:
        if r["impl"] == "liger-portable in place" and (r["rows"], r["n"]) == GOAL_SHAPE:
            ok = r["graph_ms"] <= GOAL_MS and r["peak_extra_mib"] <= GOAL_MIB
            print(
                f"goal {r['op']} {GOAL_SHAPE[0]}x{GOAL_SHAPE[1]} (<= {GOAL_MS} ms graph, <= {GOAL_MIB} MiB): "
                f"{r['graph_ms']:.3f} ms, {r['peak_extra_mib']:.0f} MiB -> {'met' if ok else 'NOT met'}"
            )
    print(f"wrote {path} in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
