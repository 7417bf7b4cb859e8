"""Fused add + RMSNorm forward+backward on the GPU, side by side with its peers in one process.

The op: ``s = x + r; y = rms_norm(s, w)``, returning ``(y, s)`` (a decoder layer's pre-norm
residual step); the backward gets a gradient for both outputs (dy, ds) and gives x, r and w theirs.

Peers: eager PyTorch (Hugging Face's ``residual = residual + hidden`` and LlamaRMSNorm written
out), torch.compile of it (static shapes: one compile per shape, as a model sees), ours unfused
(``s = x + r; liger_portable.functional.rms_norm(s, w)``; the goal is that fused beats it), ours
fused, and liger-kernel's LigerFusedAddRMSNormFunction (when importable).

Bytes counted, 8 passes of rows x hidden x element size: forward reads x and r and writes s and y
(4); backward reads dy, ds and s and writes dx (4; the residual's gradient is the same tensor).
rstd and the weight-gradient partials are under 0.1% and not counted. The unfused peers move more
(add 3 passes, norm forward 2, norm backward 3, the autograd sum of the two gradients of s 3: 11);
GB/s is the useful 8-pass traffic over the time, for every peer alike.

Gradients are taken with ``torch.autograd.grad`` so that x and r both get theirs without
AccumulateGrad copying the shared tensor into a leaf's ``.grad`` (which it does for one of two
leaves that receive the same tensor, for every peer alike: a copy a model does not make).

Reports graph-replay and eager medians, GB/s and % of the copy ceiling measured in the same run
(graph replay), peak extra memory, and our two kernels alone. ``--sweep`` times the table's search
space for our fused kernels alone (forward and backward separately) and prints the best.

    python scripts/bench_fused_add_rms_norm.py [--hidden 4096 2880 5120 8192] [--rows 16384]
    python scripts/bench_fused_add_rms_norm.py --sweep [--hidden 4096] [--kernels fused_add_rms_norm_bwd]
"""

from __future__ import annotations

import argparse

import torch

from benchlib import (
    add_dtype_argument, fastest_first, require_gpu,
    graph_ms, markdown_table, measure_ceiling, median_ms, peak_extra_mib, precompile, record, save_records,
    sweep_records, timing_records,
)

import liger_portable
from liger_portable import functional as F
from liger_portable.configs import Limits, load_table, make_resolved, resolve, search_configs
from liger_portable.specs import next_pow2
from liger_portable.ops import rms_norm as ops

EPS = 1e-6
PASSES = 8  # fwd: read x, r; write s, y. bwd: read dy, ds, s; write dx (= dr)
KERNEL_PASSES = {"fused_add_rms_norm_fwd": 4, "fused_add_rms_norm_bwd": 4}
# Sweep points whose row tile puts more than this many elements in each thread are skipped: they
# spill registers on every GPU (the backward holds three such tiles), and compiles are what would
# make a full sweep take minutes. So are num_stages variants of a single-pass forward, which has no
# loop to pipeline. --all-points times them all.
MAX_ELEMS_PER_THREAD = 64
# peer name -> the results log's impl name
IMPL = {"eager (HF)": "eager", "ours add + rms_norm": "liger-portable unfused", "ours fused": "liger-portable",
        "liger-kernel fused": "liger-kernel"}


def hf_add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = r + x  # Hugging Face: residual = residual + hidden_states
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(s.dtype), s


def ours_unfused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + r
    return F.rms_norm(s, w, EPS), s


def peers() -> dict:
    torch.compiler.reset()  # a fresh compile per shape: no automatic dynamic shapes, no recompile limit
    fns = {
        "eager (HF)": hf_add_rms_norm,
        "torch.compile": torch.compile(hf_add_rms_norm, dynamic=False),
        "ours add + rms_norm": ours_unfused,
        "ours fused": lambda x, r, w: F.fused_add_rms_norm(x, r, w, EPS),
    }
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        # (X, R, W, eps, offset, casting_mode, in_place): in_place=False, dy is reused across steps.
        fns["liger-kernel fused"] = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(
            x, r, w, EPS, 0.0, "llama", False
        )
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel not available: {e}")
    return fns


def kernels_alone(x, r, w, dy, ds, ceiling_gbs: float) -> dict:
    """Our fused forward and backward launches alone (eager medians; each a single Triton launch,
    the backward plus its small weight-gradient sum)."""
    _, s, rstd = ops.fused_add_rms_norm_fwd(x, r, w, EPS, 0.0, False)
    nb = 4 * x.numel() * x.element_size()
    fwd = median_ms(lambda: ops.fused_add_rms_norm_fwd(x, r, w, EPS, 0.0, False))
    bwd = median_ms(lambda: ops.fused_add_rms_norm_bwd(dy, ds, s, w, rstd, 0.0, False))
    out = {
        "fwd_ms": fwd, "bwd_ms": bwd,
        "fwd_pct_copy": 100 * nb / fwd / 1e6 / ceiling_gbs, "bwd_pct_copy": 100 * nb / bwd / 1e6 / ceiling_gbs,
    }
    print(
        f"  kernels alone: fwd {fwd:.4f} ms ({out['fwd_pct_copy']:.0f}% of copy), "
        f"bwd {bwd:.4f} ms ({out['bwd_pct_copy']:.0f}% of copy)"
    )
    return out


def bench_compare(hidden: int, rows: int, dtype: torch.dtype, ceiling_gbs: float) -> tuple[list[dict], dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=g)
    r0 = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=g)
    w0 = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(dtype)
    dy = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=g)
    ds = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=g)
    nbytes = PASSES * x0.numel() * x0.element_size()
    results = []
    ref = None
    for name, fn in peers().items():
        x = x0.clone().requires_grad_()
        r = r0.clone().requires_grad_()
        w = w0.clone().requires_grad_()

        def step():
            y, s = fn(x, r, w)
            return torch.autograd.grad((y, s), (x, r, w), (dy, ds))

        out = [t.float() for t in step()]
        gms = graph_ms(step)
        if ref is None:
            ref = out
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(out, ref))
        ms = median_ms(step)
        mem = peak_extra_mib(step)
        results.append(
            {
                "impl": name, "hidden": hidden, "rows": rows, "ms": ms, "graph_ms": gms, "peak_extra_mib": mem,
                "gbs": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / ceiling_gbs,
                "graph_gbs": nbytes / gms / 1e6, "graph_pct_copy": 100 * nbytes / gms / 1e6 / ceiling_gbs,
                "grad_rel_diff_vs_eager": err,
            }
        )
        print(
            f"  {name:<19} {ms:7.3f} ms (graph {gms:7.3f} ms, {nbytes / gms / 1e6:5.0f} GB/s)  {mem:7.0f} MiB  "
            f"grad diff {err:.1e}"
        )
        del x, r, w
    alone = kernels_alone(x0, r0, w0, dy, ds, ceiling_gbs)
    return results, alone


def _pruned(kernel: str, cfg: dict, default: dict, n_cols: int, warp_size: int) -> bool:
    """True for a point the sweep skips unless --all-points (see MAX_ELEMS_PER_THREAD)."""
    single_pass = next_pow2(n_cols) <= cfg["BLOCK_N_MAX"]
    block_n = min(next_pow2(n_cols), cfg["BLOCK_N_MAX"])
    if cfg["BLOCK_M"] * block_n / (cfg["num_warps"] * warp_size) > MAX_ELEMS_PER_THREAD:
        return True
    return kernel.endswith("_fwd") and single_pass and cfg.get("num_stages") != default.get("num_stages")


def _without_stages(cfg: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in cfg.items() if k != "num_stages"))


def sweep(hidden: int, rows: int, dtype: torch.dtype, ceiling_gbs: float, kernels: list[str], all_points: bool) -> dict:
    """Time the search space of the fused forward and backward kernels alone.

    By default: every point that can be fast (see MAX_ELEMS_PER_THREAD) at the table's num_stages,
    then the other num_stages values for the three fastest (stages change the program, so each costs
    a compile; a full search of the backward at 4096 columns is 42 compiles where this is about 20).
    ``all_points``: every legal point.
    """
    dev = liger_portable.platform().device(0)
    table = load_table(dev.backend)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    r = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    dy = torch.randn_like(x)
    ds = torch.randn_like(x)
    _, s, rstd = ops.fused_add_rms_norm_fwd(x, r, w, EPS, 0.0, False)

    def launch(kernel: str, config=None):
        if kernel == "fused_add_rms_norm_fwd":
            return lambda: ops.fused_add_rms_norm_fwd(x, r, w, EPS, 0.0, False, config=config)
        return lambda: ops.fused_add_rms_norm_bwd(dy, ds, s, w, rstd, 0.0, False, config=config)

    def time_points(kernel: str, cfgs: list[dict]) -> list[tuple[float, dict]]:
        timed = []
        precompile(kernel, cfgs, lambda r: launch(kernel, r))
        for cfg in cfgs:
            try:
                ms = median_ms(launch(kernel, make_resolved(kernel, cfg, "sweep")), warmup_ms=10, rep_ms=60)
            except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the point
                print(f"    {kernel} {cfg}: {type(e).__name__}")
                continue
            timed.append((ms, cfg))
        return timed

    out = {}
    for kernel in ("fused_add_rms_norm_fwd", "fused_add_rms_norm_bwd"):
        if kernel not in kernels:
            continue
        default = resolve(kernel, dev, (hidden, rows), dtype)
        base = default.config.to_dict()
        points = [{**base, **p} for p in search_configs(table, dev.arch, kernel, Limits.of(dev))]
        if all_points:
            timed = time_points(kernel, points)
        else:
            kept = [c for c in points if not _pruned(kernel, c, base, hidden, dev.warp_size)]
            first = [c for c in kept if c.get("num_stages") == base.get("num_stages")]
            timed = time_points(kernel, first)
            top = {_without_stages(c) for _, c in sorted(timed, key=lambda t: t[0])[:3]}
            timed += time_points(kernel, [c for c in kept if c not in first and _without_stages(c) in top])
        timed = fastest_first(timed, kernel)
        default_ms = median_ms(launch(kernel))
        nbytes = KERNEL_PASSES[kernel] * x.numel() * x.element_size()
        best_ms, best_cfg = timed[0]
        print(
            f"  {kernel} hidden {hidden}: default {default_ms:.4f} ms "
            f"({100 * nbytes / default_ms / 1e6 / ceiling_gbs:.0f}% of copy; {default.config}) | best {best_ms:.4f} ms "
            f"({100 * nbytes / best_ms / 1e6 / ceiling_gbs:.0f}% of copy) {best_cfg}  "
            f"[{len(timed)} of {len(points)} points timed]"
        )
        for ms, cfg in timed[1:4]:
            print(f"      next {ms:.4f} ms {cfg}")
        out[kernel] = {
            "default_ms": default_ms, "default": str(default.config), "top": timed[:5],
            "timed": len(timed), "legal_points": len(points),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", help="default: 4096 2880 5120 8192 (with --sweep: 4096)")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--all-points", action="store_true", help="--sweep: keep points that must spill")
    add_dtype_argument(ap)
    ap.add_argument(
        "--kernels", nargs="+", default=["fused_add_rms_norm_fwd", "fused_add_rms_norm_bwd"], help="for --sweep"
    )
    args = ap.parse_args()
    require_gpu(ap.prog)
    if args.hidden is None:
        args.hidden = [4096] if args.sweep else [4096, 2880, 5120, 8192]
    dtype = getattr(torch, args.dtype)
    ceiling, records = measure_ceiling("copy")
    if args.sweep:
        for h in args.hidden:
            for kernel, res in sweep(h, args.rows, dtype, ceiling, args.kernels, args.all_points).items():
                records += sweep_records(kernel, f"{args.rows}x{h}", res, dtype=args.dtype)
        print(f"results: {save_records('fused_add_rms_norm_sweep', records)}")
        return
    rows, alone = [], {}
    for h in args.hidden:
        print(f"fused add + RMSNorm {args.rows} x {h} {args.dtype} forward+backward ({PASSES} passes counted)")
        res, alone[h] = bench_compare(h, args.rows, dtype, ceiling)
        rows += res
    for r in rows:
        records += timing_records("fused_add_rms_norm", f"{r['rows']}x{r['hidden']}", IMPL.get(r["impl"], r["impl"]),
                                  r["ms"], r["graph_ms"], pct=r["pct_copy"], peak_mib=r["peak_extra_mib"],
                                  dtype=args.dtype)
    for h, a in alone.items():  # our two kernels alone, eager medians
        for kernel in ("fwd", "bwd"):
            records.append(record(f"fused_add_rms_norm_{kernel}", f"{args.rows}x{h}", "liger-portable", "kernel_ms",
                                  a[f"{kernel}_ms"], pct_copy=round(a[f"{kernel}_pct_copy"], 1), dtype=args.dtype))
    print(f"results: {save_records('fused_add_rms_norm_bench', records)}")
    table = markdown_table(
        ["shape", "impl", "eager median ms", "graph-replay ms", "GB/s (graph)", "% of copy (graph)", "peak extra MiB"],
        [[f"{r['rows']}x{r['hidden']}", r["impl"], f"{r['ms']:.3f}", f"{r['graph_ms']:.3f}",
          f"{r['graph_gbs']:.0f}", f"{r['graph_pct_copy']:.0f}", f"{r['peak_extra_mib']:.0f}"] for r in rows],
    )
    print(table)
    for h in args.hidden:
        by = {r["impl"]: r for r in rows if r["hidden"] == h}
        fused, unfused = by["ours fused"]["graph_ms"], by["ours add + rms_norm"]["graph_ms"]
        print(f"hidden {h}: fused {fused:.3f} ms vs add + rms_norm {unfused:.3f} ms (graph): {unfused / fused:.2f}x")


if __name__ == "__main__":
    main()
