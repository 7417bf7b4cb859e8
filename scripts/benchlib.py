"""Shared benchmark helpers: medians with device events, peak extra memory, measured ceilings, and
the records a benchmark leaves in the results log (``scripts/results_log.py``).

Every benchmark measures its peers side by side in the same process and reports achieved
bandwidth or FLOP/s against ceilings measured in that same run (the device-to-device copy
bandwidth for memory-bound ops, the bf16 matmul rate for matmul-bound ones), so that a figure says
how close it came to what that GPU did at that moment, and runs on different machines compare.

Results: ``save_records(name, records)`` appends them to ``$OUT/<name>.jsonl`` if OUT is set (bring
the file back and ``python scripts/results_log.py add`` it), else to ``scripts/results/log.jsonl``
(records of a CPU run only to ``$OUT``: see :func:`results_log.save`).

Command lines: :func:`require_gpu` (after parsing the arguments: a one-line error without a GPU),
``--dtype`` through :func:`add_dtype_argument`, shapes such as ``16384x4096`` through :func:`shape_type`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

import results_log


# --------------------------------------------------------------------------- command lines

DTYPE_NAMES = ("bfloat16", "float16", "float32")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def dtype_name(s: str) -> str:
    """``--dtype``'s value as a torch dtype's name (``bf16`` -> ``bfloat16``, ``fp16``, ``fp32`` likewise);
    any other name is left as it is, for argparse's ``choices`` to refuse."""
    low = s.strip().lower()
    return _DTYPE_ALIASES.get(low, low)


def add_dtype_argument(ap: argparse.ArgumentParser, default: str = "bfloat16", what: str = "the inputs' dtype") -> None:
    """``--dtype`` with the names a benchmark accepts: ``args.dtype`` is the name (``"bfloat16"``, as the
    records say), ``getattr(torch, args.dtype)`` the dtype."""
    ap.add_argument("--dtype", type=dtype_name, choices=DTYPE_NAMES, default=default,
                    help=f"{what} (default {default}; bf16, fp16, fp32 also accepted)")


def shape_type(form: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type=`` for a shape written ``form`` (``"ROWSxN"``: as many positive integers as it has
    parts, joined by ``x``): ``"16384x4096"`` -> ``(16384, 4096)``; anything else an ArgumentTypeError."""
    n = len(form.split("x"))

    def parse(s: str) -> tuple[int, ...]:
        try:
            dims = tuple(int(v) for v in s.strip().lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) != n or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"{s!r} is not {form} ({n} positive integers joined by 'x', "
                                             f"e.g. {'x'.join(['4096'] * n)})")
        return dims

    parse.__name__ = form  # argparse names the type in some errors
    return parse


def require_gpu(prog: str | None = None) -> None:
    """Return if a GPU is in use (torch.cuda: NVIDIA or AMD), else exit with status 2 and a one-line error
    naming the script: the benchmarks time device kernels and have nothing to measure on the CPU."""
    if torch.cuda.is_available():
        return
    prog = prog or Path(sys.argv[0]).name
    print(f"{prog}: error: needs a GPU (torch.cuda.is_available() is False): run it on a machine with an "
          "NVIDIA or AMD GPU and a CUDA or ROCm build of torch (e.g. through scripts/gpu_session.sh)", file=sys.stderr)
    raise SystemExit(2)


def require_destination(prog: str | None = None, device: str | None = None) -> None:
    """Exit with status 2 and a one-line error if the records of a run on ``device`` (default: this
    machine's) would go to the committed results log but must not (a CPU run without OUT): checked before
    measuring, so that nothing is measured for records that :func:`save_records` would refuse."""
    try:
        results_log.check_destination(device or env()["device"])
    except results_log.CPURecordsError as e:
        print(f"{prog or Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# --------------------------------------------------------------------------- measurements


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


def fastest_first(timed: list[tuple], what: str) -> list[tuple]:
    """A sweep's ``(ms, ...)`` points, fastest first; a clear error when none ran (every config
    failed to compile or launch: the errors were printed as they came)."""
    if not timed:
        raise SystemExit(f"{what}: no config of the sweep ran (see the errors above)")
    return sorted(timed, key=lambda p: p[0])


def peak_extra_mib(fn: Callable[[], object], leaves: Sequence[torch.Tensor] = ()) -> float:
    """Peak device memory allocated while ``fn`` runs, above what was allocated before, in MiB.

    ``leaves``: the tensors whose ``.grad`` a step replaces. Their gradients are dropped before the
    baseline is taken, so the gradients the step allocates count for every implementation alike (a
    step that frees the last step's gradients at its start would otherwise show only what it holds
    beyond them: nothing, for an out-of-place cross-entropy's 2 GiB gradient)."""
    for t in leaves:
        t.grad = None
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


_ENV: dict | None = None


def env() -> dict:
    """Date, device and versions of this run, for its records (taken once per process)."""
    global _ENV
    if _ENV is None:
        _ENV = results_log.environment()
    return _ENV


def environment() -> dict:
    """The same, flat, for the line a benchmark prints first."""
    e = env()
    return {"date": e["date"], "device": e["device"], **e["versions"]}


def _sig(v: float, digits: int = 6) -> float:
    return float(f"{v:.{digits}g}")


def record(op: str, shape, impl: str, metric: str, value: float, *, device: str | None = None, **extra) -> dict:
    """One results-log record of this run (see ``scripts/results_log.py``); floats kept to 6 digits.
    ``device``: the device measured, where it is not this machine's GPU (a run on the CPU: "cpu")."""
    extra = {k: (_sig(v) if isinstance(v, float) else v) for k, v in extra.items()}
    e = env() if device is None else {**env(), "device": device}
    return results_log.record(op, shape, impl, metric, _sig(value), env=e, **extra)


def timing_records(op: str, shape, impl: str, ms: float, graph_ms: float = math.nan, *, pct: float | None = None,
                   pct_key: str = "pct_copy", peak_mib: float | None = None, **extra) -> list[dict]:
    """The records of one forward+backward timing: ``fwd_bwd_graph_ms`` (when the step could be
    captured in a CUDA graph) and ``fwd_bwd_eager_ms``. ``pct`` is the eager time's share of the
    ceiling in percent (``pct_key``: "pct_copy" or "pct_matmul"); the graph replay's is scaled by the
    ratio of the times. The eager record carries ``extra["note"]`` only when there is no graph record.
    ``peak_mib`` is :func:`peak_extra_mib`'s, from no gradients (the records say so: ``peak_from``)."""
    out = []
    if peak_mib is not None:
        extra = {**extra, "peak_from": "no gradients"}
    r1 = (lambda v: None if v is None else round(v, 1))
    graph = graph_ms is not None and math.isfinite(graph_ms)
    if pct is not None and not math.isfinite(pct):
        pct = None
    if graph:
        out.append(record(op, shape, impl, "fwd_bwd_graph_ms", graph_ms, peak_mib=r1(peak_mib), **extra,
                          **({pct_key: r1(pct * ms / graph_ms)} if pct is not None else {})))
    eager_extra = extra if not graph else {k: v for k, v in extra.items() if k != "note"}
    out.append(record(op, shape, impl, "fwd_bwd_eager_ms", ms, peak_mib=r1(peak_mib), **eager_extra,
                      **({pct_key: r1(pct)} if pct is not None else {})))
    return out


def ceiling_records(copy_gbs: float | None = None, tflops: float | None = None) -> list[dict]:
    """The ceilings measured in this run, as records (metrics ``gbs`` and ``tflops``)."""
    out = []
    if copy_gbs:
        out.append(record("copy", "2 GiB bf16, device to device", "torch", "gbs", copy_gbs))
    if tflops:
        out.append(record("matmul", "8192x8192x8192 bf16", "torch", "tflops", tflops))
    return out


def measure_ceiling(kind: str = "copy") -> tuple[float, list[dict]]:
    """Print this run's environment, measure its ceiling and return it with its records: ``"copy"``
    the device copy bandwidth (GB/s, for the memory-bound kernels), ``"matmul"`` the bf16 matrix-product
    rate (TFLOP/s, for the fused linear cross-entropy)."""
    e = environment()
    if kind == "copy":
        value = e["copy_gbs"] = copy_bandwidth_gbs()
        print(f"{e}\ncopy ceiling {value:.0f} GB/s")
        return value, ceiling_records(copy_gbs=value)
    if kind == "matmul":
        value = e["matmul_tflops"] = matmul_tflops()
        print(f"{e}\nbf16 matmul ceiling {value:.0f} TFLOP/s")
        return value, ceiling_records(tflops=value)
    raise ValueError(f"kind must be 'copy' or 'matmul', got {kind!r}")


def sweep_records(kernel: str, shape, result: dict, **extra) -> list[dict]:
    """A sweep's outcome for one kernel and shape (``{"default_ms", "default", "top": [(ms, ..., cfg)]}``):
    the table default's time and the best point's, metric ``kernel_ms``, each with its config."""
    best = result["top"][0]
    return [record(kernel, shape, "liger-portable table default", "kernel_ms", result["default_ms"],
                   config=str(result["default"]), **extra),
            record(kernel, shape, "liger-portable best of sweep", "kernel_ms", best[0], config=str(best[-1]), **extra)]


def save_records(name: str, records: list[dict]) -> str:
    """Append ``records`` to ``$OUT/<name>.jsonl`` if OUT is set, else to the results log; returns the path.
    CPU records without OUT are refused (exit status 2, one line; :func:`require_destination` says so
    before anything is measured)."""
    try:
        return results_log.save(records, name)
    except results_log.CPURecordsError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
