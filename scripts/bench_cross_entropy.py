"""Cross-entropy forward+backward on the GPU, side by side with its peers in one process.

Peers: eager PyTorch (``F.cross_entropy`` on the logits), torch.compile of it (dynamic=False),
liger-kernel's LigerCrossEntropyFunction (when importable; it writes the gradient over the
logits), and ours twice: ``inplace_backward=True`` (the gradient over the logits, as Liger: the
memory goal) and the default (a new gradient tensor). Reports median ms (eager and CUDA-graph
replay), achieved bandwidth against the copy ceiling measured in the same run (bytes: read the
logits twice, write the gradient once), and peak extra memory. ``--sweep`` times every point of
the table's search space for the kernel alone.

    python scripts/bench_cross_entropy.py [--sweep] [--shapes 8192x128256 4096x256000 ...]

Goal (H200, bf16): 8192 x 128256 in <= 1.6 ms with <= 64 MiB extra.
"""

from __future__ import annotations

import argparse

import torch

from benchlib import (
    add_dtype_argument, require_gpu, shape_type,
    fastest_first, graph_ms, markdown_table, measure_ceiling, median_ms, peak_extra_mib, save_records, sweep_records,
    timing_records,
)

import liger_portable
from liger_portable import functional as F
from liger_portable.configs import Limits, load_table, make_resolved, resolve, search_configs
from liger_portable.ops import cross_entropy as ops


IMPL = {"liger-portable (in place)": "liger-portable in place"}  # peer name -> the results log's impl name


def torch_ce(x, t):
    return torch.nn.functional.cross_entropy(x.float(), t)


def peers() -> dict:
    torch.compiler.reset()  # a fresh compile per shape: no automatic dynamic shapes, no recompile limit
    fns = {
        "eager": torch_ce,
        "torch.compile": torch.compile(torch_ce, dynamic=False),
        "liger-portable (in place)": lambda x, t: F.cross_entropy(x, t, inplace_backward=True),
        "liger-portable": lambda x, t: F.cross_entropy(x, t),
    }
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss)
        fns["liger-kernel"] = lambda x, t: LigerCrossEntropyFunction.apply(x, t, None, -100, 0.0, 0.0, "mean", None, False)[0]
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel not available: {e}")
    return fns


def bench_compare(rows: int, V: int, dtype: torch.dtype, ceiling_gbs: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(rows, V, device="cuda", dtype=dtype, generator=g)
    t = torch.randint(0, V, (rows,), device="cuda", generator=g)
    t[::7] = -100
    # 3 passes over the logits: read for the row's max and sum, read again for the gradient, the gradient
    # written. A row of a large vocabulary does not fit on chip, so no kernel reads it only once.
    nbytes = 3 * x0.numel() * x0.element_size()
    results, ref = [], None
    for name, fn in peers().items():
        # First call on a fresh copy: the gradient for the cross-check (in-place peers overwrite x).
        x = x0.clone().requires_grad_()
        fn(x, t).backward()
        out = x.grad.float()
        if ref is None:
            ref = out
        err = ((out - ref).norm() / ref.norm()).item()
        del out
        x = x0.clone().requires_grad_()

        def step():
            x.grad = None
            fn(x, t).backward()

        ms = median_ms(step)
        gms = graph_ms(step)
        mem = peak_extra_mib(step, (x,))
        results.append({"impl": name, "rows": rows, "V": V, "ms": ms, "graph_ms": gms, "peak_extra_mib": mem,
                        "gbs": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / ceiling_gbs,
                        "grad_rel_diff_vs_eager": err})
        print(f"  {name:<26} {ms:7.3f} ms (graph {gms:7.3f} ms, {nbytes / ms / 1e6:5.0f} GB/s)  {mem:8.1f} MiB  grad diff {err:.1e}")
        del x
        torch.cuda.empty_cache()
    return results


def sweep(rows: int, V: int, dtype: torch.dtype, ceiling_gbs: float) -> dict:
    dev = liger_portable.platform().device(0)
    table = load_table(dev.backend)
    x = torch.randn(rows, V, device="cuda", dtype=dtype)
    t = torch.randint(0, V, (rows,), device="cuda")
    gbuf = torch.empty_like(x)
    default = resolve("cross_entropy", dev, (V, rows), dtype)
    base = default.config.to_dict()
    timed = []
    for point in search_configs(table, dev.arch, "cross_entropy", Limits.of(dev)):
        cfg = {**base, **point}
        r = make_resolved("cross_entropy", cfg, "sweep")
        try:
            ms = median_ms(lambda: ops.ce_rows(x, t, grad=gbuf, config=r), warmup_ms=10, rep_ms=60)
        except Exception as e:  # noqa: BLE001 - out of resources etc.
            print(f"    {cfg}: {type(e).__name__}")
            continue
        timed.append((ms, cfg))
    timed = fastest_first(timed, f"cross_entropy {rows}x{V}")
    default_ms = median_ms(lambda: ops.ce_rows(x, t, grad=gbuf))
    nbytes = 3 * x.numel() * x.element_size()
    print(f"  cross_entropy {rows}x{V}: default {default_ms:.4f} ms ({default.config}) | best {timed[0][0]:.4f} ms "
          f"({100 * nbytes / timed[0][0] / 1e6 / ceiling_gbs:.0f}% of copy) {timed[0][1]}")
    for ms, cfg in timed[1:4]:
        print(f"      next {ms:.4f} ms {cfg}")
    return {"default_ms": default_ms, "default": str(default.config), "top": timed[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", type=shape_type("ROWSxV"), nargs="+",
                    default=[(8192, 128256), (4096, 256000), (8192, 32000)], help="rows x vocabulary, e.g. 8192x128256")
    ap.add_argument("--sweep", action="store_true")
    add_dtype_argument(ap)
    args = ap.parse_args()
    require_gpu(ap.prog)
    dtype = getattr(torch, args.dtype)
    shapes = args.shapes
    ceiling, records = measure_ceiling("copy")
    if args.sweep:
        for r, v in shapes:
            records += sweep_records("cross_entropy", f"{r}x{v}", sweep(r, v, dtype, ceiling), dtype=args.dtype)
        print(f"results: {save_records('cross_entropy_sweep', records)}")
        return
    rows = []
    for r, v in shapes:
        print(f"cross-entropy {r} x {v} {args.dtype} forward+backward")
        rows += bench_compare(r, v, dtype, ceiling)
    for r in rows:
        records += timing_records("cross_entropy", f"{r['rows']}x{r['V']}", IMPL.get(r["impl"], r["impl"]), r["ms"],
                                  r["graph_ms"], pct=r["pct_copy"], peak_mib=r["peak_extra_mib"], dtype=args.dtype)
    print(f"results: {save_records('cross_entropy_bench', records)}")
    print(markdown_table(
        ["shape", "impl", "eager median ms", "graph-replay ms", "% of copy (eager)", "peak extra MiB"],
        [[f"{r['rows']}x{r['V']}", r["impl"], f"{r['ms']:.3f}", f"{r['graph_ms']:.3f}", f"{r['pct_copy']:.0f}",
          f"{r['peak_extra_mib']:.1f}"] for r in rows],
    ))


if __name__ == "__main__":
    main()
