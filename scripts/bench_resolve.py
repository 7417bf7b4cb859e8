"""Per-call overhead of config resolution (goal: under 5 microseconds on a memo hit).

Runs anywhere: on a GPU machine it resolves for device 0; elsewhere for a simulated H200.
Also reports the host-side cost of one eager ``functional.rms_norm`` call when a GPU is present.
The figures go to the results log as metric ``host_us`` (``$OUT/resolve.jsonl`` if OUT is set; on a
machine without a GPU only there: set OUT).

    python scripts/bench_resolve.py
"""

from __future__ import annotations

import argparse
import timeit

import torch

from benchlib import record, require_destination, save_records

import liger_portable
from liger_portable.configs import resolve
from liger_portable.hardware import DeviceInfo


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    require_destination(ap.prog)  # a CPU run's records: to $OUT only
    p = liger_portable.platform()
    dev = p.device(0) if p.backend != "cpu" else DeviceInfo("cuda", 0, "NVIDIA H200", "sm90", 32, 132, 1024, 232448)
    problems = [(h, r) for h in (1024, 2880, 4096, 5120, 8192) for r in (2048, 16384)]
    for prob in problems:  # first calls: resolution proper, then memoized
        resolve("rms_norm_fwd", dev, prob, torch.bfloat16)
    n = 200_000
    per_call = []
    for _ in range(5):
        t = timeit.timeit(lambda: resolve("rms_norm_fwd", dev, (4096, 16384), torch.bfloat16), number=n)
        per_call.append(t / n * 1e6)
    per_call.sort()
    print(f"device: {dev.name} ({dev.arch}); backend {p.backend}")
    print(f"resolve() memo hit: median {per_call[2]:.3f} us/call (best {per_call[0]:.3f}, worst {per_call[-1]:.3f}); goal < 5 us")
    liger_portable.reset()
    t = timeit.timeit(
        lambda: (liger_portable.reset(), resolve("rms_norm_fwd", dev, (4096, 16384), torch.bfloat16)), number=200
    )
    print(f"resolve() cold (table lookup, cache files, validation): {t / 200 * 1e6:.1f} us/call")
    shape = "rms_norm_fwd, 16384x4096"
    note = None if p.backend != "cpu" else f"resolved for a simulated {dev.name}"
    records = [record("resolve", f"{shape}, memo hit", "liger-portable", "host_us", per_call[2], note=note),
               record("resolve", f"{shape}, cold", "liger-portable", "host_us", t / 200 * 1e6, note=note)]
    if p.backend != "cpu":
        from liger_portable import functional as F

        x = torch.randn(16, 4096, device=p.torch_device_type, dtype=torch.bfloat16)
        w = torch.ones(4096, device=x.device, dtype=x.dtype)
        F.rms_norm(x, w)
        torch.cuda.synchronize()
        n = 2000
        t = timeit.timeit(lambda: F.rms_norm(x, w), number=n)
        torch.cuda.synchronize()
        print(f"functional.rms_norm eager host overhead (16x4096, no grad): {t / n * 1e6:.1f} us/call")
        records.append(record("rms_norm", "16x4096, forward without grad", "liger-portable", "host_us", t / n * 1e6,
                              dtype="bfloat16"))
        xg = x.clone().requires_grad_()
        t = timeit.timeit(lambda: F.rms_norm(xg, w), number=n)
        torch.cuda.synchronize()
        print(f"functional.rms_norm eager host overhead (with autograd graph): {t / n * 1e6:.1f} us/call")
        records.append(record("rms_norm", "16x4096, forward with autograd graph", "liger-portable", "host_us",
                              t / n * 1e6, dtype="bfloat16"))
    print(f"results: {save_records('resolve', records)}")


if __name__ == "__main__":
    main()
