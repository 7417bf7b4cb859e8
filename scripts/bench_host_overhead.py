"""What one eager call costs a user: host time at tiny shapes, and eager time at the main shapes.

Two measurements per op, for torch (its fused native op where one exists, else eager PyTorch),
liger-kernel and liger-portable, side by side in one process, interleaved and repeated:

* **host us**: microseconds of one forward + backward from Python at a tiny shape (16 rows), where
  the GPU work is a few microseconds: the time is the host's (argument checks, dispatch, autograd,
  allocations, kernel launches). The median over ``--repeats`` interleaved rounds, with the spread.
* **eager ms** at the main shape (RMSNorm and LayerNorm 16384 x 4096, ...): forward + backward as a
  training step calls it, host and GPU overlapping, beside the **graph ms** of the same step
  replayed as one CUDA graph (GPU time alone, no host cost). Where eager is far above graph, the
  call is host-bound at that shape.

``--launch-ab`` adds liger-portable with the cached launcher switched off (every launch through
Triton's own ``kernel[grid](...)``), to show what the launcher saves. ``--breakdown`` adds, to the
RMSNorm rounds, the layers of our call one by one: the forward alone; the autograd op without the
public function's argument checks and dispatch, with its launches and with them stubbed out; the
two launch functions without autograd (plan lookup, allocations, launches); five bare allocations;
two floors (a Python ``autograd.Function`` that launches nothing; one native op through the
autograd engine); the backward's launch function alone and inside an empty Function's backward
(where CUDA backwards run: the autograd engine's device thread); and torch's call, ours and the
empty Function with the backward run on the calling thread (``set_multithreading_enabled(False)``).

    python scripts/bench_host_overhead.py [--ops rms_norm,layer_norm] [--repeats 7] [--launch-ab] [--breakdown]

Figures are printed as tables and kept as results-log records (metrics ``host_us``,
``host_ratio`` (ours and liger-kernel's host cost over torch's, taken within each round, where
they ran back to back, so that the host's drift between rounds cancels), ``fwd_bwd_eager_ms``,
``fwd_bwd_graph_ms``, each with the spread of its rounds):
``$OUT/host_overhead.jsonl`` if ``OUT`` is set, else appended to the log.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as TF

from benchlib import environment, graph_ms, record, require_gpu, save_records

from liger_portable import functional as F
from liger_portable.ops import launching

DT = torch.bfloat16


def _liger(path: str, name: str):
    try:
        module = __import__(path, fromlist=[name])
        return getattr(module, name)
    except Exception:  # noqa: BLE001 - the peer is optional
        return None


# --------------------------------------------------------------------------- ops
# Each op: make(rows, dev) -> (inputs needing grad, extra tensors, impls: name -> step function).
# A step runs forward + backward once; gradients are reset by the harness.


def _rms_norm(rows: int, hidden: int, dev):
    x = torch.randn(rows, hidden, device=dev, dtype=DT, requires_grad=True)
    w = torch.rand(hidden, device=dev, dtype=DT, requires_grad=True)
    dy = torch.randn_like(x)
    impls = {
        "F.rms_norm": lambda: TF.rms_norm(x, (hidden,), w, 1e-6).backward(dy),
        "liger-portable": lambda: F.rms_norm(x, w, 1e-6).backward(dy),
    }
    fn = _liger("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
    if fn is not None:
        impls["liger-kernel"] = lambda: fn.apply(x, w, 1e-6, 0.0, "llama", False).backward(dy)
    return (x, w), impls


class _EmptyFunction(torch.autograd.Function):
    """The floor of a Python autograd op: an output allocated, nothing launched, the gradient passed on."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _BackwardLaunches(torch.autograd.Function):
    """An empty Function whose backward also makes our RMSNorm backward's launch and allocations
    (the result unused): their cost on the autograd engine's device thread, where CUDA backwards run."""

    @staticmethod
    def forward(ctx, x, w, bwd):
        ctx.save_for_backward(x, w)
        ctx.bwd = bwd
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        ctx.bwd()
        return dy, None, None


def _calling_thread(step: Callable) -> Callable:
    """``step`` with its backward run on the calling thread instead of the engine's device thread."""

    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()

    return run


def rms_norm_breakdown(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, Callable]:
    """Host-cost layers of our RMSNorm call (``--breakdown``); each runs forward + backward, but for
    the rows that name one half (``rms_norm_bwd``: the launch function of the backward alone)."""
    from liger_portable import platform
    from liger_portable.ops import rms_norm as ops

    dev = platform().device(x.device.index)
    xd, wd, n_rows, n_cols = x.detach(), w.detach(), *x.shape
    partial_rows = dev.compute_units  # a partials buffer: its size does not change an allocation's host cost

    _, rstd0 = ops.rms_norm_fwd(xd, wd, 1e-6, 0.0, False, dev=dev)

    def launches():
        _, rstd = ops.rms_norm_fwd(xd, wd, 1e-6, 0.0, False, dev=dev)
        ops.rms_norm_bwd(dy, xd, wd, rstd, 0.0, False, dev=dev)

    def backward_launch():
        ops.rms_norm_bwd(dy, xd, wd, rstd0, 0.0, False, dev=dev)

    def allocations():
        for shape, dtype in (((n_rows, n_cols), x.dtype), ((n_rows + 1,), torch.float32), ((n_rows, n_cols), x.dtype),
                             ((partial_rows, n_cols), torch.float32), ((n_cols,), w.dtype)):
            torch.empty(shape, dtype=dtype, device=x.device)

    def autograd_op():
        ops.rms_norm(x, w, 1e-6, 0.0, False, dev).backward(dy)

    def stubbed():
        launcher_call = launching.Launcher.__call__
        launching.Launcher.__call__ = lambda self, grid, args, consts, launch: None
        try:
            autograd_op()
        finally:
            launching.Launcher.__call__ = launcher_call

    def public():
        F.rms_norm(x, w, 1e-6).backward(dy)

    def empty():
        _EmptyFunction.apply(x, w).backward(dy)

    def torch_native():
        TF.rms_norm(x, (x.shape[-1],), w, 1e-6).backward(dy)

    return {
        "liger-portable forward only (the graph built, no backward)": lambda: F.rms_norm(x, w, 1e-6),
        "liger-portable autograd op, no argument checks": autograd_op,
        "liger-portable autograd op, launches stubbed out": stubbed,
        "liger-portable launch functions, no autograd": launches,
        "five allocations (our call's)": allocations,
        "Python autograd.Function, empty_like forward, identity backward": empty,
        "x * 1.0 (aten op, autograd engine)": lambda: (x * 1.0).backward(dy),
        "rms_norm_bwd alone, calling thread": backward_launch,
        "empty Function + rms_norm_bwd in its backward (engine thread)":
            lambda: _BackwardLaunches.apply(x, w, backward_launch).backward(dy),
        "F.rms_norm, backward on the calling thread": _calling_thread(torch_native),
        "liger-portable, backward on the calling thread": _calling_thread(public),
        "empty Function, backward on the calling thread": _calling_thread(empty),
    }


def _layer_norm(rows: int, hidden: int, dev):
    x = torch.randn(rows, hidden, device=dev, dtype=DT, requires_grad=True)
    w = torch.rand(hidden, device=dev, dtype=DT, requires_grad=True)
    b = torch.rand(hidden, device=dev, dtype=DT, requires_grad=True)
    dy = torch.randn_like(x)
    impls = {
        "F.layer_norm": lambda: TF.layer_norm(x, (hidden,), w, b, 1e-5).backward(dy),
        "liger-portable": lambda: F.layer_norm(x, w, b, 1e-5).backward(dy),
    }
    fn = _liger("liger_kernel.ops.layer_norm", "LigerLayerNormFunction")
    if fn is not None:
        impls["liger-kernel"] = lambda: fn.apply(x, w, b, 1e-5).backward(dy)
    return (x, w, b), impls


def _fused_add_rms_norm(rows: int, hidden: int, dev):
    x = torch.randn(rows, hidden, device=dev, dtype=DT, requires_grad=True)
    r = torch.randn(rows, hidden, device=dev, dtype=DT, requires_grad=True)
    w = torch.rand(hidden, device=dev, dtype=DT, requires_grad=True)
    dy = torch.randn_like(x)

    def torch_step():
        s = x + r
        TF.rms_norm(s, (hidden,), w, 1e-6).backward(dy)

    def ours():
        y, _s = F.fused_add_rms_norm(x, r, w, 1e-6)
        y.backward(dy)

    impls = {"add + F.rms_norm": torch_step, "liger-portable": ours}
    fn = _liger("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
    if fn is not None:
        impls["liger-kernel"] = lambda: fn.apply(x, r, w, 1e-6, 0.0, "llama", False)[0].backward(dy)
    return (x, r, w), impls


def _glu(act: str):
    def make(rows: int, hidden: int, dev):
        a = torch.randn(rows, hidden, device=dev, dtype=DT, requires_grad=True)
        b = torch.randn(rows, hidden, device=dev, dtype=DT, requires_grad=True)
        dc = torch.randn_like(a)
        if act == "swiglu":
            eager = lambda: (TF.silu(a) * b).backward(dc)  # noqa: E731
            ours = lambda: F.swiglu(a, b).backward(dc)  # noqa: E731
            fn = _liger("liger_kernel.ops.swiglu", "LigerSiLUMulFunction")
        else:
            eager = lambda: (TF.gelu(a, approximate="tanh") * b).backward(dc)  # noqa: E731
            ours = lambda: F.geglu(a, b).backward(dc)  # noqa: E731
            fn = _liger("liger_kernel.ops.geglu", "LigerGELUMulFunction")
        impls = {"eager": eager, "liger-portable": ours}
        if fn is not None:
            impls["liger-kernel"] = lambda: fn.apply(a, b).backward(dc)
        return (a, b), impls

    return make


def _rope(rows: int, hidden: int, dev):
    # rows = sequence length; 32 q heads, 8 k heads, head_dim 128, batch 1 (Llama-3-8B). q and k in
    # Hugging Face's layout, views (batch, heads, seq, head_dim) of the projections' (batch, seq,
    # heads * head_dim) outputs, as every peer gets them in a model (liger-kernel copies any other).
    q_lin = torch.randn(1, rows, 32 * 128, device=dev, dtype=DT, requires_grad=True)
    k_lin = torch.randn(1, rows, 8 * 128, device=dev, dtype=DT, requires_grad=True)
    cos, sin = torch.randn(2, 1, rows, 128, device=dev, dtype=DT).unbind(0)
    dq = torch.randn(1, rows, 32, 128, device=dev, dtype=DT).transpose(1, 2)
    dk = torch.randn(1, rows, 8, 128, device=dev, dtype=DT).transpose(1, 2)

    def heads():
        return q_lin.view(1, rows, 32, 128).transpose(1, 2), k_lin.view(1, rows, 8, 128).transpose(1, 2)

    def rot(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat((-t2, t1), dim=-1)

    def eager():
        q, k = heads()
        oq, ok = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        torch.autograd.backward((oq, ok), (dq, dk))

    def ours():
        torch.autograd.backward(F.rope(*heads(), cos, sin), (dq, dk))

    impls = {"eager": eager, "liger-portable": ours}
    fn = _liger("liger_kernel.ops.rope", "LigerRopeFunction")
    if fn is not None:  # rotates dq and dk in place: they stay unit rotations of random values
        impls["liger-kernel"] = lambda: torch.autograd.backward(fn.apply(*heads(), cos, sin), (dq, dk))
    return (q_lin, k_lin), impls


def _cross_entropy(rows: int, vocab: int, dev):
    x = torch.randn(rows, vocab, device=dev, dtype=DT, requires_grad=True)
    t = torch.randint(0, vocab, (rows,), device=dev)
    impls = {
        "eager": lambda: TF.cross_entropy(x.float(), t).backward(),
        "liger-portable": lambda: F.cross_entropy(x, t).backward(),
    }
    fn = _liger("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction")
    if fn is not None:
        impls["liger-kernel"] = lambda: fn.apply(x, t, None, -100, 0.0, 0.0, "mean", None, False)[0].backward()
    return (x,), impls


def _flce(rows: int, vocab: int, dev, hidden: int = 4096):
    h = torch.randn(rows, hidden, device=dev, dtype=DT, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=dev, dtype=DT) / hidden**0.5).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device=dev)
    impls = {
        "eager": lambda: TF.cross_entropy((h @ w.T).float(), t).backward(),
        "liger-portable": lambda: F.fused_linear_cross_entropy(h, w, t).backward(),
    }
    fn = _liger("liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction")
    if fn is not None:
        def liger():
            out = fn.apply(h, w, t)
            (out[0] if isinstance(out, tuple) else out).backward()

        impls["liger-kernel"] = liger
    return (h, w), impls


# op -> (make, tiny (rows, cols), main (rows, cols), what the shape means)
OPS: dict[str, tuple[Callable, tuple, tuple, str]] = {
    "rms_norm": (_rms_norm, (16, 4096), (16384, 4096), "rows x hidden"),
    "layer_norm": (_layer_norm, (16, 4096), (16384, 4096), "rows x hidden"),
    "fused_add_rms_norm": (_fused_add_rms_norm, (16, 4096), (16384, 4096), "rows x hidden"),
    "swiglu": (_glu("swiglu"), (16, 4096), (16384, 14336), "rows x intermediate"),
    "geglu": (_glu("geglu"), (16, 4096), (16384, 14336), "rows x intermediate"),
    "rope": (_rope, (16, 128), (4096, 128), "seq x head_dim, 32 q + 8 k heads"),
    "cross_entropy": (_cross_entropy, (16, 4096), (8192, 128256), "rows x vocab"),
    "fused_linear_cross_entropy": (_flce, (16, 4096), (8192, 128256), "tokens x vocab, hidden 4096"),
}


def _zero(tensors) -> None:
    for t in tensors:
        t.grad = None


def host_us(step: Callable, tensors, n: int) -> float:
    """Microseconds per call of ``step`` (gradients reset each time), host-bound at tiny shapes."""

    def run():
        _zero(tensors)
        step()

    for _ in range(20):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def eager_ms(step: Callable, tensors, n: int) -> float:
    """Milliseconds per forward + backward from Python, host and device overlapping."""
    return host_us(step, tensors, n) / 1e3


def _profile(op: str, step: Callable, tensors, n: int, folder: str) -> None:
    """Where the host time of ``n`` calls of ``step`` goes: a cProfile by Python function (the
    calling thread only) and a ``torch.profiler`` table by operator and driver call on every thread
    (the backward runs on the autograd engine's device thread, which cProfile does not see)."""
    import cProfile
    import os
    import pstats

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        _zero(tensors)
        step()
    torch.cuda.synchronize()
    prof.disable()
    path = os.path.join(folder, f"profile_{op}.txt")
    with open(path, "w") as f:
        f.write(f"{op}: {n} calls of liger-portable forward + backward\n")
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        for _ in range(n):
            _zero(tensors)
            step()
        torch.cuda.synchronize()
    by_thread: dict[int, dict[str, float]] = {}
    for e in trace.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            names = by_thread.setdefault(e.thread, {})
            names[e.name] = names.get(e.name, 0.0) + e.self_cpu_time_total
    torch_path = os.path.join(folder, f"profile_{op}_torch.txt")
    with open(torch_path, "w") as f:
        f.write(f"{op}: {n} calls of liger-portable forward + backward under torch.profiler\n")
        f.write(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        for thread, names in by_thread.items():
            top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
            f.write(f"\nthread {thread}: self CPU us per call\n")
            f.writelines(f"  {us / n:9.1f}  {name}\n" for name, us in top)
    print(f"  profile -> {path}, {torch_path}")


def _main_shape(op: str, make: Callable, main_shape: tuple, dev, args, keep: Callable) -> None:
    """Eager and graph-replay forward + backward ms of every implementation at the op's main shape."""
    torch.cuda.empty_cache()
    tensors, impls = make(*main_shape, dev)
    shape = f"{main_shape[0]}x{main_shape[1]}"
    eager: dict[str, list[float]] = {k: [] for k in impls}
    for _ in range(max(3, args.repeats // 2)):
        for name, step in impls.items():
            eager[name].append(eager_ms(step, tensors, args.main_calls))
    print(f"{op}  forward+backward ms at {shape}: eager (host included) | graph replay (GPU only)")
    for name, step in impls.items():
        if name == "liger-kernel" and op in ("cross_entropy", "fused_linear_cross_entropy"):
            # it reads a value back to the host: a capture fails and leaves the RNG in capture mode
            med = keep(op, shape, name, "fwd_bwd_eager_ms", eager[name])
            print(f"  {name:<32} {med:8.3f} |      n/a")
            continue

        def graph_step(step=step, tensors=tensors):
            _zero(tensors)
            step()

        g = graph_ms(graph_step)
        med = keep(op, shape, name, "fwd_bwd_eager_ms", eager[name])
        if g == g:  # not nan
            keep(op, shape, name, "fwd_bwd_graph_ms", [g])
        print(f"  {name:<32} {med:8.3f} | {g:8.3f}")
    del tensors, impls
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated, from: " + ", ".join(OPS))
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median and spread over them)")
    ap.add_argument("--calls", type=int, default=300, help="calls per host-cost measurement")
    ap.add_argument("--main-calls", type=int, default=50, help="calls per eager measurement at the main shape")
    ap.add_argument("--no-main", action="store_true", help="host cost only")
    ap.add_argument("--launch-ab", action="store_true", help="also ours with the cached launcher off")
    ap.add_argument("--breakdown", action="store_true",
                    help="RMSNorm: also the layers of our call one by one, and the autograd floors")
    ap.add_argument("--profile", metavar="DIR",
                    help="also profile ours per op: a cProfile (DIR/profile_<op>.txt) and a torch.profiler "
                         "table by thread (DIR/profile_<op>_torch.txt)")
    args = ap.parse_args(argv)
    require_gpu(ap.prog)
    dev = torch.device("cuda")
    env = environment()
    print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  liger-kernel {env.get('liger_kernel')}  "
          f"liger-portable {env.get('liger_portable')}  cached launcher: {launching.supported()}")
    records: list[dict] = []
    saved, path = 0, None

    def keep(op, shape, impl, metric, values):
        med = statistics.median(values)
        spread = {"spread": [min(values), max(values)]} if len(values) > 1 else {}
        records.append(record(op, shape, impl, metric, med, **spread, rounds=len(values), dtype="bfloat16"))
        return med

    for op in args.ops.split(","):
        make, tiny, main_shape, meaning = OPS[op]
        # ---- host cost at the tiny shape, interleaved rounds
        tensors, impls = make(*tiny, dev)
        if args.launch_ab:
            ours = impls["liger-portable"]

            def slow(ours=ours):
                launching.enabled = False
                try:
                    ours()
                finally:
                    launching.enabled = True

            impls["liger-portable (Triton launch)"] = slow
        if args.breakdown and op == "rms_norm":
            x, w = tensors
            impls.update(rms_norm_breakdown(x, w, torch.randn_like(x)))
        samples: dict[str, list[float]] = {k: [] for k in impls}
        for _ in range(args.repeats):
            for name, step in impls.items():
                samples[name].append(host_us(step, tensors, args.calls))
        shape = f"{tiny[0]}x{tiny[1]}"
        print(f"\n{op}  host us per forward+backward at {shape} ({meaning}), median [min, max] of {args.repeats}")
        for name, vals in samples.items():
            med = keep(op, shape, name, "host_us", vals)
            print(f"  {name:<32} {med:8.1f}  [{min(vals):.1f}, {max(vals):.1f}]")
        # The goal is a ratio to torch; the host's speed drifts between rounds (and machines), so
        # the ratio is taken within each round, where the implementations ran back to back.
        torch_name = next(iter(impls))
        for name in ("liger-portable", "liger-kernel"):
            if name in samples:
                ratios = [a / b for a, b in zip(samples[name], samples[torch_name])]
                med = keep(op, shape, f"{name} / {torch_name}", "host_ratio", ratios)
                print(f"  {name + ' / ' + torch_name:<32} {med:8.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] (per round)")
        if args.profile:
            _profile(op, impls["liger-portable"], tensors, args.calls, args.profile)
        del tensors, impls
        if not args.no_main:
            _main_shape(op, make, main_shape, dev, args, keep)
        saved += len(records)  # each op's records as soon as it is done: a run cut short keeps them
        path = save_records("host_overhead", records)
        records.clear()

    print(f"\n{saved} records -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
