"""Host-side cost of each layer of an eager RMSNorm call, on tiny tensors (GPU time ~0).

Shows where the microseconds go: raw Triton launch, launch function, autograd, public API; and a
whole forward+backward step for us and the peers. Reference points: an empty torch op launch.

    python scripts/profile_overhead.py
"""

from __future__ import annotations

import timeit

import torch
import triton

from liger_portable import functional as F
from liger_portable.ops import rms_norm as ops


def per_call_us(fn, n=3000) -> float:
    fn()
    torch.cuda.synchronize()
    best = min(timeit.repeat(fn, number=n, repeat=3))
    torch.cuda.synchronize()
    return best / n * 1e6


def main() -> None:
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty(16, device="cuda")
    rows = {}
    rows["torch.empty (16x4096)"] = per_call_us(lambda: torch.empty((16, 4096), device="cuda", dtype=torch.bfloat16))
    rows["x.add_(0) (one aten launch)"] = per_call_us(lambda: x.add_(0))
    rows["raw triton launch, fwd kernel"] = per_call_us(
        lambda: ops._rms_norm_fwd_kernel[(16,)](
            x, y, w, rstd, x.stride(0), y.stride(0), 16, 4096, 1e-6, 0.0,
            GEMMA=False, BLOCK_N=4096, SINGLE_PASS=True, BLOCK_M=1, num_warps=8, num_stages=1,
        )
    )
    rows["ops.rms_norm_fwd (resolve+alloc+launch)"] = per_call_us(lambda: ops.rms_norm_fwd(x, w, 1e-6, 0.0, False))
    rows["ops.rms_norm_op (custom op, no grad)"] = per_call_us(lambda: ops.rms_norm_op(x, w, 1e-6, 0.0, False))
    rows["ops.rms_norm (autograd.Function, no grad)"] = per_call_us(lambda: ops.rms_norm(x, w, 1e-6, 0.0, False))
    rows["functional.rms_norm (no grad)"] = per_call_us(lambda: F.rms_norm(x, w))
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    dy = torch.randn_like(x)
    rows["functional.rms_norm (grad graph)"] = per_call_us(lambda: F.rms_norm(xg, wg))
    _, r = ops.rms_norm_fwd(x, w, 1e-6, 0.0, False)
    rows["ops.rms_norm_bwd"] = per_call_us(lambda: ops.rms_norm_bwd(dy, x, w, r, 0.0, False))

    def step(fn):
        def run():
            xg.grad = None
            wg.grad = None
            fn(xg, wg).backward(dy)
        return run

    rows["step fwd+bwd: liger-portable"] = per_call_us(step(lambda a, b: F.rms_norm(a, b)), n=1000)
    rows["step fwd+bwd: F.rms_norm"] = per_call_us(step(lambda a, b: torch.nn.functional.rms_norm(a, (4096,), b, 1e-6)), n=1000)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        rows["step fwd+bwd: liger-kernel"] = per_call_us(
            step(lambda a, b: LigerRMSNormFunction.apply(a, b, 1e-6, 0.0, "llama", False)), n=1000
        )
    except ImportError:
        pass
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    for k, v in rows.items():
        print(f"  {k:<45} {v:8.1f} us")


if __name__ == "__main__":
    main()
