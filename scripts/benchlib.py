"""Shared benchmark helpers: medians with device events, peak extra memory, measured ceilings.

Every benchmark measures its peers side by side in the same process and reports achieved
bandwidth or FLOP/s against the ceilings measured in that same run (METHOD.md's way).
"""

from __future__ import annotations

import datetime
import json
import os
import platform as _pyplatform
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median wall time of ``fn`` on the device, in milliseconds (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def precompile(kernel: str, cfgs: list[dict], launch: Callable[[object], Callable[[], object]]) -> None:
    """Compile the kernels of every config of a sweep in parallel threads before they are timed one
    by one (``liger_portable.tuning.precompile``; serially, a sweep spends most of its time
    compiling). ``launch(resolved)`` returns the zero-argument call that the sweep times."""
    from liger_portable import tuning

    how = tuning.precompile(kernel, cfgs, lambda r: tuning.do_bench_ms(launch(r)))
    print(f"    {kernel}: {len(cfgs)} configs, {how}")


def graph_ms(step) -> float:
    """Median of CUDA-graph replays of ``step``: the GPU time without host launch overhead."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            step()
    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured
        print(f"    (graph capture failed: {type(e).__name__}: {e})")
        return float("nan")
    return median_ms(g.replay)


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak device memory allocated while ``fn`` runs, above what was allocated before, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    """bf16 matrix-product rate on random data, TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def environment() -> dict:
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": _pyplatform.python_version(),
    }
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        env["liger_kernel"] = version("liger-kernel")
    except Exception:
        env["liger_kernel"] = None
    return env


def write_results(name: str, payload: dict) -> str:
    """Write ``payload`` as JSON under $OUT (the device tool) or scripts/results/."""
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
