"""Where the fused linear cross-entropy's time goes: each of its three matrix products per chunk,
timed alone on the GPU at several chunk sizes (issue 4).

Per chunk of ``C`` tokens the FLCE runs (``ops/fused_linear_cross_entropy.py``):
  fwd:  logits = hidden_c @ weight.T          (C x V, K = H)
  gh:   grad_hidden_c = dlogits @ weight       (C x H, K = V)
  gw:   grad_weight += dlogits.T @ hidden_c    (V x H, K = C; beta=1 reads and writes grad_weight)
This script times each with cuBLAS (torch) and, for ``gw``, a Triton persistent kernel that loads
its grad_weight tile before the product loop so the read overlaps the arithmetic (a prototype: the
question is whether the accumulation's 2 x |grad_weight| of traffic per chunk can be hidden).

    python scripts/profile_flce_gemms.py [--shape 8192x4096x128256] [--chunk-mib 128,160,256,1024]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import benchlib  # noqa: E402


@triton.jit
def _gw_accumulate_kernel(g_ptr, h_ptr, w_ptr, C, V, H, stride_g, stride_h, stride_w, alpha,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                          PREFETCH: tl.constexpr):
    """w[v, n] += alpha * sum_c g[c, v] * h[c, n]; persistent over (vocab, hidden) tiles."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(V, BLOCK_M)
    n_n = tl.cdiv(H, BLOCK_N)
    for tile in tl.range(pid, n_m * n_n, NUM_PROGRAMS):
        group = tile // (GROUP_M * n_n)
        first_m = group * GROUP_M
        size_m = min(n_m - first_m, GROUP_M)
        pm = first_m + (tile % size_m)
        pn = (tile % (GROUP_M * n_n)) // size_m
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        w_ptrs = w_ptr + offs_m[:, None].to(tl.int64) * stride_w + offs_n[None, :]
        w_mask = (offs_m[:, None] < V) & (offs_n[None, :] < H)
        if PREFETCH:
            old = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, C, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            a = tl.load(g_ptr + offs_k[None, :].to(tl.int64) * stride_g + offs_m[:, None],
                        mask=(offs_k[None, :] < C) & (offs_m[:, None] < V), other=0.0)
            b = tl.load(h_ptr + offs_k[:, None].to(tl.int64) * stride_h + offs_n[None, :],
                        mask=(offs_k[:, None] < C) & (offs_n[None, :] < H), other=0.0)
            acc = tl.dot(a, b, acc)
        if not PREFETCH:
            old = tl.load(w_ptrs, mask=w_mask, other=0.0)
        tl.store(w_ptrs, (old.to(tl.float32) + acc * alpha).to(w_ptr.dtype.element_ty), mask=w_mask)


_SIDE = {}


def _accumulate_two_streams(g, hc, weight, gh, gw, gb32, s, e, first, alpha=1.0):
    """ops._accumulate with the weight-gradient product on a side stream beside grad_hidden's
    (both read dlogits; they write different outputs). No bias here."""
    assert gb32 is None and gh is not None and gw is not None
    main = torch.cuda.current_stream()
    side = _SIDE.setdefault(g.device, torch.cuda.Stream(g.device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        gw.addmm_(g.t(), hc, beta=0 if first else 1, alpha=alpha)
    gh[s:e].addmm_(g, weight, beta=0, alpha=alpha)
    main.wait_stream(side)


def gw_triton(g, hc, gw, alpha, bm, bn, bk, warps, stages, prefetch, n_sm):
    C, V = g.shape
    H = hc.shape[1]
    grid = (n_sm,)
    _gw_accumulate_kernel[grid](g, hc, gw, C, V, H, g.stride(0), hc.stride(0), gw.stride(0), alpha,
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=n_sm,
                                PREFETCH=prefetch, num_warps=warps, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8192x4096x128256")
    p.add_argument("--chunk-mib", default="128,160,256,512,1024")
    p.add_argument("--skip-triton", action="store_true", help="cuBLAS products only (no Triton prototype)")
    p.add_argument("--triton-configs", default="128,256,64,8,3,1;128,128,64,8,4,1;128,128,64,4,4,1;"
                   "128,256,64,8,3,0;128,128,64,8,4,0;256,128,64,8,3,1")
    a = p.parse_args()
    bt, h, v = (int(x) for x in a.shape.split("x"))
    dev = "cuda"
    torch.manual_seed(0)
    tflops_ceiling = benchlib.matmul_tflops()
    copy_gbs = benchlib.copy_bandwidth_gbs()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"ceilings: matmul {tflops_ceiling:.0f} TFLOP/s, copy {copy_gbs:.0f} GB/s, {n_sm} SMs")
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02
    hid = torch.randn(bt, h, device=dev, dtype=torch.bfloat16)
    gw = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 1e-3
    rows = []
    for mib in (int(x) for x in a.chunk_mib.split(",")):
        c = max(8, (mib * 2**20 // (v * 2)) // 8 * 8)
        c = min(c, bt)
        n_chunks = -(-bt // c)
        hc = hid[:c]
        g = torch.randn(c, v, device=dev, dtype=torch.bfloat16) * 1e-4
        logits = torch.empty(c, v, device=dev, dtype=torch.bfloat16)
        gh = torch.empty(c, h, device=dev, dtype=torch.bfloat16)
        flop = 2 * c * h * v
        timings = {
            "fwd": benchlib.median_ms(lambda: torch.mm(hc, w.t(), out=logits)),
            "gh": benchlib.median_ms(lambda: gh.addmm_(g, w, beta=0)),
            "gw_beta0": benchlib.median_ms(lambda: gw.addmm_(g.t(), hc, beta=0)),
            "gw_beta1": benchlib.median_ms(lambda: gw.addmm_(g.t(), hc, beta=1)),
        }
        # The two backward products read the same dlogits and write different outputs: on two
        # streams the weight-gradient product's grad_weight traffic could overlap the other's math.
        def both_serial():
            gh.addmm_(g, w, beta=0)
            gw.addmm_(g.t(), hc, beta=1)

        def both_streams():
            _accumulate_two_streams(g, hc, w, gh, gw, None, 0, c, first=False)

        timings["gh+gw_serial"] = benchlib.median_ms(both_serial)
        timings["gh+gw_two_streams"] = benchlib.median_ms(both_streams)
        timings["gh+gw_serial_graph"] = benchlib.graph_ms(both_serial)
        timings["gh+gw_two_streams_graph"] = benchlib.graph_ms(both_streams)
        if not a.skip_triton:  # Triton prototype: check it against cuBLAS once, then time it.
            ref = gw.float() + (g.t().float() @ hc.float())
            for spec in a.triton_configs.split(";"):
                bm, bn, bk, warps, stages, pre = (int(x) for x in spec.split(","))
                name = f"gw_triton_{bm}x{bn}x{bk}_w{warps}_s{stages}_{'pre' if pre else 'post'}"
                try:
                    out = gw.clone()
                    gw_triton(g, hc, out, 1.0, bm, bn, bk, warps, stages, pre, n_sm)
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    timings[name] = benchlib.median_ms(
                        lambda: gw_triton(g, hc, out, 1.0, bm, bn, bk, warps, stages, pre, n_sm))
                    timings[name + "_relerr"] = err
                    del out
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
            del ref
        row = {"chunk_mib": mib, "tokens": c, "chunks": n_chunks, **timings}
        per_bt = {k: t * n_chunks for k, t in timings.items() if not k.endswith("relerr")}
        row["per_bt_ms"] = per_bt
        rows.append(row)
        print(f"chunk {mib} MiB = {c} tokens, {n_chunks} chunks:")
        for k, t in timings.items():
            if k.endswith("relerr"):
                print(f"    {k:40s} {t:.2e}")
                continue
            extra = ""
            if (k.startswith("gw") or k in ("fwd", "gh")) and "+" not in k:
                extra = f"{flop / t / 1e9:6.0f} TFLOP/s ({100 * flop / t / 1e9 / tflops_ceiling:3.0f}%)"
            print(f"    {k:40s} {t:7.3f} ms  x{n_chunks} = {t * n_chunks:7.2f} ms  {extra}")
        del g, logits, gh
        torch.cuda.empty_cache()
    # The whole op, as shipped and with its weight-gradient product on a side stream (the module's
    # _accumulate swapped for the duration), at the table's chunk.
    from liger_portable.ops import fused_linear_cross_entropy as ops
    t = torch.randint(0, v, (bt,), device=dev)
    t[::7] = -100
    shipped = ops._accumulate
    variants = {"serial": shipped, "two_streams": _accumulate_two_streams}
    whole, outs = {}, {}
    for key in ("serial", "two_streams", "serial", "two_streams"):
        ops._accumulate = variants[key]
        fn = lambda: ops.flce_fwd(hid, w, t, None, -100, 0.0, 0.0, None, "mean")  # noqa: E731
        whole.setdefault(key, []).append(benchlib.graph_ms(fn))
        outs[key] = fn()
        print(f"  whole FLCE, {key:12s}: {whole[key][-1]:.2f} ms (graph replay)")
    ops._accumulate = shipped
    same = all(torch.equal(x, y) for x, y in zip(outs["serial"][:4], outs["two_streams"][:4]) if x is not None)
    print(f"  two streams give bitwise the same losses and gradients: {same}")
    whole["bitwise_equal"] = same
    del outs
    benchlib.write_results("flce_gemm_profile", {"whole_flce_graph_ms": whole,
        "env": benchlib.environment(), "shape": a.shape, "matmul_tflops": tflops_ceiling,
        "copy_gbs": copy_gbs, "rows": rows})


if __name__ == "__main__":
    main()
