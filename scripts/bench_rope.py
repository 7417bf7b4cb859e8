"""RoPE forward+backward on the GPU, side by side with its peers in one process.

Inputs as a Hugging Face attention layer makes them: ``q = q_proj(x).view(B, S, H, D).transpose(1, 2)``
(a non-contiguous (B, H, S, D) view of a (B, S, H*D) leaf), k likewise with fewer heads (GQA),
cos/sin of shape (1, S, D) from the rotary embedding, and the gradients of q_embed/k_embed in the
same transposed layout (what SDPA / flash attention's backward hands back).

Peers: eager PyTorch (Hugging Face's ``apply_rotary_pos_emb`` written out, no transformers
import), torch.compile of it, liger-kernel's ``LigerRopeFunction`` (when importable; it takes the
Hugging Face layout as is: inside it transposes to (B, S, H, D), calls ``.contiguous()`` (a no-op
for this layout) and rotates q, k and, in the backward, dq, dk *in place*, so its numbers carry no
output allocation), and liger-portable's ``functional.rope``.

Bytes counted: 4 x (q + k) bytes: the forward reads q and k and writes q_embed and k_embed, the
backward reads their gradients and writes those of q and k. cos/sin (small, L2-resident) are not
counted. Reports graph-replay and eager medians, GB/s and % of the copy ceiling measured in the
same run, and peak extra memory. ``--sweep`` times every point of the table's search space for
our kernel alone (one forward and one backward launch) and prints the best.

    python scripts/bench_rope.py [--sweep] [--shapes llama 8b hd64]
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
from liger_portable.ops import rope as ops

# name: (batch, q heads, k heads, seq, head_dim)
SHAPES = {
    "llama": (4, 32, 8, 4096, 128),  # goal: <= 0.25 ms forward+backward (graph replay)
    "8b": (2, 32, 8, 8192, 128),  # Llama-3-8B-like GQA at 8K tokens
    "hd64": (4, 32, 8, 4096, 64),
}
IMPL = {"eager (HF)": "eager"}  # peer name -> the results log's impl name


def shape_name(shape: tuple) -> str:
    """The results log's shape: "q 4x32x4096x128, k 4x8x4096x128" (batch x heads x seq x head_dim)."""
    b, hq, hk, s, d = shape
    return f"q {b}x{hq}x{s}x{d}, k {b}x{hk}x{s}x{d}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def peers() -> dict:
    torch.compiler.reset()  # a fresh compile per shape: no automatic dynamic shapes, no recompile limit
    fns = {
        "eager (HF)": hf_apply_rotary_pos_emb,
        "torch.compile": torch.compile(hf_apply_rotary_pos_emb, dynamic=False),
        "liger-portable": F.rope,
    }
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        fns["liger-kernel"] = lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel not available: {e}")
    return fns


def rotary_cos_sin(seq: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary embedding (base 500000): cos/sin of shape (1, seq, head_dim) in ``dtype``."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_inputs(shape: tuple, dtype: torch.dtype):
    b, hq, hk, s, d = shape
    q_lin = torch.randn(b, s, hq * d, device="cuda", dtype=dtype)
    k_lin = torch.randn(b, s, hk * d, device="cuda", dtype=dtype)
    cos, sin = rotary_cos_sin(s, d, dtype)
    dq = torch.randn(b, s, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
    dk = torch.randn(b, s, hk, d, device="cuda", dtype=dtype).transpose(1, 2)
    return q_lin, k_lin, cos, sin, dq, dk


def nbytes_of(shape: tuple, esize: int) -> int:
    b, hq, hk, s, d = shape
    return 4 * b * s * (hq + hk) * d * esize


def bench_compare(name: str, shape: tuple, dtype: torch.dtype, ceiling_gbs: float) -> list[dict]:
    b, hq, hk, s, d = shape
    q_lin0, k_lin0, cos, sin, dq0, dk0 = make_inputs(shape, dtype)
    nbytes = nbytes_of(shape, q_lin0.element_size())
    results = []
    ref = None
    for impl, fn in peers().items():
        # Fresh copies per peer: liger-kernel rotates its inputs and gradients in place.
        q_lin = q_lin0.clone().requires_grad_()
        k_lin = k_lin0.clone().requires_grad_()
        dq = dq0.clone(memory_format=torch.preserve_format)
        dk = dk0.clone(memory_format=torch.preserve_format)
        dq_first, dk_first = dq.clone(memory_format=torch.preserve_format), dk.clone(memory_format=torch.preserve_format)

        def step(dq=dq, dk=dk):
            q_lin.grad = None
            k_lin.grad = None
            q = q_lin.view(b, s, hq, d).transpose(1, 2)
            k = k_lin.view(b, s, hk, d).transpose(1, 2)
            qe, ke = fn(q, k, cos, sin)
            torch.autograd.backward([qe, ke], [dq, dk])

        step(dq_first, dk_first)
        out = (q_lin.grad.float(), k_lin.grad.float())
        if ref is None:
            ref = out
        err = max(((x - y).norm() / y.norm()).item() for x, y in zip(out, ref))
        gms = graph_ms(step)
        ms = median_ms(step)
        mem = peak_extra_mib(step, (q_lin, k_lin))
        results.append(
            {
                "shape": name, "batch": b, "q_heads": hq, "k_heads": hk, "seq": s, "head_dim": d,
                "impl": impl, "ms": ms, "graph_ms": gms, "peak_extra_mib": mem,
                "gbs_graph": nbytes / gms / 1e6, "pct_copy_graph": 100 * nbytes / gms / 1e6 / ceiling_gbs,
                "gbs_eager": nbytes / ms / 1e6, "grad_rel_diff_vs_eager": err,
            }
        )
        print(
            f"  {impl:<15} eager {ms:7.3f} ms | graph {gms:7.3f} ms {nbytes / gms / 1e6:6.0f} GB/s "
            f"({100 * nbytes / gms / 1e6 / ceiling_gbs:3.0f}% of copy) | {mem:6.0f} MiB | grad diff {err:.1e}"
        )
        del q_lin, k_lin, dq, dk, dq_first, dk_first, step
    return results


def sweep(name: str, shape: tuple, dtype: torch.dtype, ceiling_gbs: float) -> dict:
    """Time every legal search-space point: one forward and one backward launch of our kernel."""
    b, hq, hk, s, d = shape
    dev = liger_portable.platform().device(0)
    table = load_table(dev.backend)
    q_lin, k_lin, cos, sin, dq, dk = make_inputs(shape, dtype)
    q = q_lin.view(b, s, hq, d).transpose(1, 2)
    k = k_lin.view(b, s, hk, d).transpose(1, 2)
    nbytes = nbytes_of(shape, q.element_size())
    default = resolve("rope", dev, (d, hq + hk, s), dtype)
    base = default.config.to_dict()

    def run(r=None):
        ops.rope_fwd(q, k, cos, sin, config=r)
        ops.rope_bwd(dq, dk, cos, sin, config=r)

    timed = []
    cfgs = [{**base, **point} for point in search_configs(table, dev.arch, "rope", Limits.of(dev))]
    precompile("rope", cfgs, lambda r: (lambda: run(r)))
    for cfg in cfgs:
        r = make_resolved("rope", cfg, "sweep")
        try:
            ms = median_ms(lambda: run(r), warmup_ms=10, rep_ms=60)
        except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the point
            print(f"    rope {cfg}: {type(e).__name__}")
            continue
        timed.append((ms, cfg))
    timed = fastest_first(timed, "rope")
    default_ms = median_ms(run)
    best_ms, best_cfg = timed[0]
    print(
        f"  rope {name} {shape}: default {default_ms:.4f} ms ({default.config}, "
        f"{100 * nbytes / default_ms / 1e6 / ceiling_gbs:.0f}% of copy) | best {best_ms:.4f} ms "
        f"({100 * nbytes / best_ms / 1e6 / ceiling_gbs:.0f}% of copy) {best_cfg}"
    )
    for ms, cfg in timed[1:4]:
        print(f"      next {ms:.4f} ms {cfg}")
    return {"shape": shape, "default_ms": default_ms, "default": str(default.config), "top": timed[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true")
    add_dtype_argument(ap)
    args = ap.parse_args()
    require_gpu(ap.prog)
    dtype = getattr(torch, args.dtype)
    ceiling, records = measure_ceiling("copy")
    if args.sweep:
        for n in args.shapes:
            records += sweep_records("rope", shape_name(SHAPES[n]), sweep(n, SHAPES[n], dtype, ceiling), dtype=args.dtype)
        print(f"results: {save_records('rope_sweep', records)}")
        return
    rows = []
    for n in args.shapes:
        b, hq, hk, s, d = SHAPES[n]
        print(f"RoPE {n}: q {b}x{hq}x{s}x{d}, k {b}x{hk}x{s}x{d} {args.dtype} (HF layout) forward+backward")
        rows += bench_compare(n, SHAPES[n], dtype, ceiling)
    for r in rows:
        shape = (r["batch"], r["q_heads"], r["k_heads"], r["seq"], r["head_dim"])
        records += timing_records("rope", shape_name(shape), IMPL.get(r["impl"], r["impl"]), r["ms"], r["graph_ms"],
                                  pct=100 * r["gbs_eager"] / ceiling, peak_mib=r["peak_extra_mib"],
                                  dtype=args.dtype,
                                  note="rotates q, k and their gradients in place" if r["impl"] == "liger-kernel" else None)
    path = save_records("rope_bench", records)
    print(markdown_table(
        ["shape", "impl", "eager median ms", "graph-replay ms", "GB/s (graph)", "% of copy (graph)", "peak extra MiB"],
        [[f"q {r['batch']}x{r['q_heads']}x{r['seq']}x{r['head_dim']}, k {r['k_heads']} heads", r["impl"],
          f"{r['ms']:.3f}", f"{r['graph_ms']:.3f}", f"{r['gbs_graph']:.0f}", f"{r['pct_copy_graph']:.0f}",
          f"{r['peak_extra_mib']:.0f}"] for r in rows],
    ))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
