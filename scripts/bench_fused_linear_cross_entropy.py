"""Fused linear cross-entropy forward+backward on the GPU, side by side with its peers in one process.

Peers: eager PyTorch (``F.cross_entropy(h @ W.T)``), torch.compile of it (dynamic=False),
liger-kernel's LigerFusedLinearCrossEntropyFunction (when importable), cut-cross-entropy's
``linear_cross_entropy`` (when importable; skipped cleanly otherwise) and ours. Reports median ms
(eager and CUDA-graph replay; a peer that syncs the host cannot be captured and shows nan), the
achieved TFLOP/s (3 x 2 x BT x H x V FLOP) against the bf16 matmul rate measured in the same run,
and peak extra memory (the gradients of hidden and weight included: every peer allocates them).
``--sweep`` times the table's search space (BLOCK_V, warps; CHUNK_TOKENS from the rule) for ours alone;
``--chunk-mib 512,1024`` adds ours with those ``chunk_mib`` values (memory traded for speed).

    python scripts/bench_fused_linear_cross_entropy.py [--sweep] [--chunk-mib 512,1024] [--shapes 8192x4096x128256 ...]
    python scripts/bench_fused_linear_cross_entropy.py --shapes grid      # the models' heads, below

Shapes are BT x H x V, or the name of a set: ``headline`` (the default: Llama-3 8B, Gemma-2 2B and
Gemma-2 9B at 8 x 4096 tokens, which needs tens of GB unfused) or ``grid`` (hidden sizes 768-8192,
vocabularies 32k-256k, 2k-32k tokens: the heads of the models in SHAPE_SETS). Goal (H200, bf16):
8192 x 4096 x 128256 in <= 38 ms with <= 1.2 GiB extra.
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
from liger_portable.ops import fused_linear_cross_entropy as ops


# Named shape sets (BT, H, V): a model's language-model head at a typical token count per step.
SHAPE_SETS = {
    "headline": [(8192, 4096, 128256), (8192, 2304, 256000), (32768, 3584, 256000)],
    "grid": [
        (2048, 768, 32000),     # a ~150M Llama-style model
        (8192, 768, 50257),     # GPT-2 small
        (8192, 2048, 128256),   # Llama-3.2-1B
        (8192, 2304, 256000),   # Gemma-2 2B
        (4096, 4096, 32000),    # Llama-2 7B
        (8192, 4096, 128256),   # Llama-3 8B
        (32768, 3584, 256000),  # Gemma-2 9B, 8 x 4096 tokens
        (16384, 5120, 152064),  # Qwen2.5-14B
        (4096, 8192, 128256),   # Llama-3 70B
    ],
}


def shapes_arg(item: str) -> list[tuple[int, int, int]]:
    """One ``--shapes`` value (argparse ``type=``): a set's shapes (SHAPE_SETS), or one ``BTxHxV``."""
    if item in SHAPE_SETS:
        return list(SHAPE_SETS[item])
    try:
        return [shape_type("BTxHxV")(item)]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; or a set: {', '.join(SHAPE_SETS)}") from None


def parse_shapes(groups: list[list[tuple[int, int, int]]]) -> list[tuple[int, int, int]]:
    """The shapes of ``--shapes`` values (each :func:`shapes_arg`'s list), in order, each once."""
    out: list[tuple[int, int, int]] = []
    for group in groups:
        for shape in group:
            if shape not in out:
                out.append(shape)
    return out


def chunk_mibs_arg(s: str) -> tuple[int, ...]:
    """``--chunk-mib``: comma-separated positive integers ("" for none)."""
    try:
        out = tuple(int(m) for m in s.split(",") if m.strip())
    except ValueError:
        out = (0,)
    if any(m < 1 for m in out):
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of positive integers, e.g. 512,1024")
    return out


def torch_flce(h, w, t):
    return torch.nn.functional.cross_entropy((h @ w.t()).float(), t)


def peers(chunk_mibs: tuple[int, ...] = ()) -> dict:
    torch.compiler.reset()  # a fresh compile per shape: no automatic dynamic shapes, no recompile limit
    fns = {
        "eager": torch_flce,
        "torch.compile": torch.compile(torch_flce, dynamic=False),
        "liger-portable": lambda h, w, t: F.fused_linear_cross_entropy(h, w, t),
    }
    for mib in chunk_mibs:  # ours with more memory for speed (the user's chunk_mib)
        fns[f"liger-portable chunk_mib={mib}"] = lambda h, w, t, mib=mib: F.fused_linear_cross_entropy(h, w, t, chunk_mib=mib)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def liger(h, w, t):
            out = LigerFusedLinearCrossEntropyFunction.apply(h, w, t)  # (input, weight, target, bias=None, ...)
            return out[0] if isinstance(out, tuple) else out

        fns["liger-kernel"] = liger
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel not available: {e}")
    try:
        from cut_cross_entropy import linear_cross_entropy

        fns["cut-cross-entropy"] = lambda h, w, t: linear_cross_entropy(h, w, t)
    except Exception as e:  # noqa: BLE001
        print(f"cut-cross-entropy not available: {e}")
    return fns


def bench_compare(BT: int, H: int, V: int, dtype: torch.dtype, ceiling: float, skip_over_gib: dict[str, float],
                  chunk_mibs: tuple[int, ...] = ()) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    h0 = torch.randn(BT, H, device="cuda", dtype=dtype, generator=g)
    w0 = (torch.randn(V, H, device="cuda", dtype=dtype, generator=g) / H**0.5)
    t = torch.randint(0, V, (BT,), device="cuda", generator=g)
    t[::7] = -100
    flop = 3 * 2 * BT * H * V
    logits_gib = BT * V * 4 / 2**30
    results, ref = [], None
    for name, fn in peers(chunk_mibs).items():
        if logits_gib > skip_over_gib.get(name, float("inf")):
            print(f"  {name:<18} skipped: fp32 logits {logits_gib:.1f} GiB")
            continue
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

        def step():
            h.grad = None
            w.grad = None
            fn(h, w, t).backward()

        try:
            step()
        except Exception as e:  # noqa: BLE001 - e.g. out of memory
            print(f"  {name:<18} failed: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
            continue
        out = (h.grad.float(), w.grad.float())
        if ref is None:
            ref = out
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(out, ref))
        del out
        try:
            mem = peak_extra_mib(step, (h, w))  # first: from no gradients
            ms = median_ms(step, warmup_ms=100, rep_ms=500)
            gms = graph_ms(step)
        except torch.OutOfMemoryError as e:  # e.g. eager's logits at the largest shapes: skip the peer
            print(f"  {name:<18} out of memory while timing: {str(e)[:120]}")
            del h, w
            torch.cuda.empty_cache()
            continue
        results.append({"impl": name, "BT": BT, "H": H, "V": V, "ms": ms, "graph_ms": gms, "peak_extra_mib": mem,
                        "tflops": flop / ms / 1e9, "pct_matmul": 100 * flop / ms / 1e9 / ceiling,
                        "grad_rel_diff_vs_first": err})
        print(f"  {name:<18} {ms:8.2f} ms (graph {gms:8.2f} ms)  {flop / ms / 1e9:5.0f} TFLOP/s "
              f"({100 * flop / ms / 1e9 / ceiling:3.0f}% of matmul)  {mem:8.0f} MiB  grad diff {err:.1e}")
        del h, w
        torch.cuda.empty_cache()
    return results


def sweep(BT: int, H: int, V: int, dtype: torch.dtype, ceiling: float) -> dict:
    dev = liger_portable.platform().device(0)
    table = load_table(dev.backend)
    h = torch.randn(BT, H, device="cuda", dtype=dtype)
    w = torch.randn(V, H, device="cuda", dtype=dtype) / H**0.5
    t = torch.randint(0, V, (BT,), device="cuda")
    default = resolve("fused_linear_cross_entropy", dev, (V, BT, H), dtype)
    base = default.config.to_dict()
    flop = 3 * 2 * BT * H * V
    timed = []
    for point in search_configs(table, dev.arch, "fused_linear_cross_entropy", Limits.of(dev)):
        cfg = {**base, **point}
        r = make_resolved("fused_linear_cross_entropy", cfg, "sweep")
        fn = lambda: ops.flce_fwd(h, w, t, None, -100, 0.0, 0.0, None, "mean", config=r)  # noqa: E731
        try:
            ms = median_ms(fn, warmup_ms=50, rep_ms=200)
            mem = peak_extra_mib(fn)
        except Exception as e:  # noqa: BLE001
            print(f"    {cfg}: {type(e).__name__}")
            continue
        timed.append((ms, mem, cfg))
    timed = fastest_first(timed, f"fused_linear_cross_entropy {BT}x{H}x{V}")
    default_ms = median_ms(lambda: ops.flce_fwd(h, w, t, None, -100, 0.0, 0.0, None, "mean"))
    best = timed[0]
    print(f"  flce {BT}x{H}x{V}: default {default_ms:.2f} ms ({default.config}) | best {best[0]:.2f} ms "
          f"({100 * flop / best[0] / 1e9 / ceiling:.0f}% of matmul, {best[1]:.0f} MiB) {best[2]}")
    for ms, mem, cfg in timed[1:6]:
        print(f"      next {ms:.2f} ms {mem:.0f} MiB {cfg}")
    return {"default_ms": default_ms, "default": str(default.config), "top": timed[:8]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", type=shapes_arg, nargs="+", default=[SHAPE_SETS["headline"]],
                    help=f"BTxHxV, or a set: {', '.join(SHAPE_SETS)} (default headline)")
    ap.add_argument("--sweep", action="store_true")
    add_dtype_argument(ap)
    ap.add_argument("--chunk-mib", type=chunk_mibs_arg, default="", help="also time ours with these chunk_mib values, e.g. 512,1024")
    ap.add_argument("--skip-eager-over-gib", type=float, default=8.0, help="skip the eager peer above this fp32 logits size")
    ap.add_argument("--skip-compile-over-gib", type=float, default=40.0,
                    help="skip torch.compile above this fp32 logits size (it holds chunks of them: 18 GiB at 32768 x 256000)")
    args = ap.parse_args()
    require_gpu(ap.prog)
    dtype = getattr(torch, args.dtype)
    shapes = parse_shapes(args.shapes)
    ceiling, records = measure_ceiling("matmul")
    if args.sweep:
        for s in shapes[:1]:
            records += sweep_records("fused_linear_cross_entropy", "x".join(map(str, s)), sweep(*s, dtype, ceiling),
                                     dtype=args.dtype)
        print(f"results: {save_records('fused_linear_cross_entropy_sweep', records)}")
        return
    rows = []
    for BT, H, V in shapes:
        print(f"fused linear cross-entropy BT {BT} H {H} V {V} {args.dtype} forward+backward "
              f"(matmul floor {3 * 2 * BT * H * V / ceiling / 1e9:.1f} ms)")
        skip = {"eager": args.skip_eager_over_gib, "torch.compile": args.skip_compile_over_gib}
        rows += bench_compare(BT, H, V, dtype, ceiling, skip, args.chunk_mib)
    for r in rows:
        records += timing_records("fused_linear_cross_entropy", f"{r['BT']}x{r['H']}x{r['V']}", r["impl"], r["ms"],
                                  r["graph_ms"], pct=r["pct_matmul"], pct_key="pct_matmul",
                                  peak_mib=r["peak_extra_mib"], dtype=args.dtype)
    print(f"results: {save_records('fused_linear_cross_entropy_bench', records)}")
    print(markdown_table(
        ["BT x H x V", "impl", "eager median ms", "graph-replay ms", "TFLOP/s", "% of matmul", "peak extra MiB"],
        [[f"{r['BT']}x{r['H']}x{r['V']}", r["impl"], f"{r['ms']:.2f}", f"{r['graph_ms']:.2f}", f"{r['tflops']:.0f}",
          f"{r['pct_matmul']:.0f}", f"{r['peak_extra_mib']:.0f}"] for r in rows],
    ))


if __name__ == "__main__":
    main()
