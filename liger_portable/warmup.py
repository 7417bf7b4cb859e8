"""Autotune warmup: tune every kernel problem of one training step and write the autotune cache.

    liger-portable warmup llama-3-8b --tokens 8192 --seq-len 4096 --dtype bfloat16
    liger-portable warmup path/to/config.json --tokens 4096 16384 --dry-run
    torchrun --nproc-per-node 8 scripts/autotune_warmup.py llama-3-70b --tokens 8192

(``scripts/autotune_warmup.py`` and ``python -m liger_portable.warmup`` run the same code.)

``--dry-run`` lists the problems (and, on a GPU, whether the cache already holds each) without
tuning; it needs no GPU. A real run tunes each problem missing from the cache over the backend
table's search space (:func:`liger_portable.tuning.tune`, timing the kernel through its hook in
:mod:`liger_portable.tuning.hooks` on random inputs of the problem's real size) and records it in
the user cache (``$LIGER_PORTABLE_CACHE_DIR`` or ``$XDG_CACHE_HOME/liger_portable``); a re-run with
a current cache is a no-op. Under torchrun the ranks of one device model agree
(:func:`liger_portable.tuning.agree`): the lowest tunes, the others take its result and record it
in their own cache, so every node ends with the same configs. Each tuning holds the device model's
tuning lock (:func:`liger_portable.autotune_cache.tuning_lock`), so a warmup and a run with
``LIGER_PORTABLE_AUTOTUNE=1`` that share the cache folder never tune one problem twice.

A progress line (on stderr) shows the problem being tuned, the elapsed time and an estimate of the
time left. A problem whose tuning fails (e.g. its inputs do not fit in memory) is reported as
``failed`` and the others continue; the exit status is then 1.

Status: every kernel has a tuning hook, so a real run tunes every problem of the step. The
driver, the hooks and the agreement are tested on the CPU (Triton interpreter, simulated devices,
fake timers, gloo); timings on a GPU come from ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

from liger_portable import autotune_cache, configs, _warmup, tuning
from liger_portable.hardware import platform
from liger_portable.specs import SPECS
from liger_portable._arguments import WARMUP_DTYPES, run_reported, warmup_parser

DTYPES = {name: getattr(torch, attr) for name, attr in WARMUP_DTYPES.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of ``liger-portable warmup`` (declared in :mod:`liger_portable._arguments`, torch-free)."""
    return warmup_parser().parse_args(argv)


def problems_of(args: argparse.Namespace) -> list[_warmup.Problem]:
    model = _warmup.model_shape(args.model)
    out: list[_warmup.Problem] = []
    for dname in args.dtype:
        for tokens in args.tokens:
            seq = min(args.seq_len, tokens)
            if tokens % seq:
                raise ValueError(f"--tokens {tokens} is not a multiple of --seq-len {seq}; pick a seq-len dividing it")
            out += _warmup.step_problems(model, tokens, seq, DTYPES[dname], loss=args.loss,
                                         fused_add_norm=args.fused_add_norm)
    return _warmup.dedupe(out)


def target_device():
    """The device the warmup tunes for: the detected GPU backend's current device, or None without
    one (a dry run then shows no cache status). Tests replace it to simulate a vendor."""
    p = platform()
    return p.device() if p.backend != "cpu" and p.device_count else None


def cache_status(prob: _warmup.Problem, dev) -> str:
    if dev is None:
        return "-"
    entry = configs.usable_entry(SPECS[prob.kernel], dev, prob.named, prob.dtype)
    if entry is not None:
        return "cached"
    shipped = list(autotune_cache.lookup(SPECS[prob.kernel], dev, prob.named, prob.dtype))
    return "shipped" if shipped else "to tune"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))


def dry_run(args: argparse.Namespace, probs: list[_warmup.Problem]) -> int:
    dev = target_device()
    refused = dev is not None and configs.unsupported_reason(dev) is not None
    rows = [
        {"kernel": p.kernel, "problem": p.describe(), "dtype": autotune_cache.dtype_name(p.dtype), "launches/step": p.launches,
         "where": p.what, "cache": "fallback (GPU unsupported)" if refused else cache_status(p, dev)}
        for p in probs
    ]
    if args.json:
        print(json.dumps({"model": dict(_warmup.shape_dict(_warmup.model_shape(args.model))),
                          "device": dev.name if dev else None, "problems": rows}, indent=1))
    else:
        print(f"{len(rows)} kernel problems for {args.model} ({dev.name if dev else 'no GPU: cache status unknown'}):")
        print_table(rows, ["kernel", "problem", "dtype", "launches/step", "where", "cache"])
    return 0


# Beyond the tuning-lock wait: the other ranks of a device model wait in a collective while their
# leader waits for the lock (up to lock_timeout()) and then tunes a problem; NCCL's default 10 minutes
# would abort them.
COLLECTIVE_MARGIN_S = 1800.0


def _init_distributed() -> bool:
    """Join torchrun's process group (each rank on its LOCAL_RANK's GPU); False when not under torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=tuning.lock_timeout() + COLLECTIVE_MARGIN_S)
        dist.init_process_group(backend, timeout=timeout)
    return True


class _Progress:
    """``[i/n] what | elapsed, eta`` on stderr: one line rewritten in place on a terminal (the
    problem being tuned, then its result), else one line per finished problem (logs)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.width = 0

    def show(self, done: int, text: str, *, finished: bool) -> None:
        if not self.enabled or not (finished or self.tty):
            return
        elapsed = time.perf_counter() - self.t0
        eta = f"eta {_fmt_s(elapsed / done * (self.total - done))}" if done else "eta ?"
        line = f"[{done}/{self.total}] {text} | {_fmt_s(elapsed)} elapsed, {eta}"
        if self.tty:  # one terminal row: a wrapped line could not be rewritten with \r
            line = line[: shutil.get_terminal_size((120, 24)).columns - 1]
            print("\r" + line.ljust(self.width), end="", file=sys.stderr, flush=True)
            self.width = len(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr, flush=True)


def _fmt_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _choose(p: _warmup.Problem, dev) -> dict:
    """The cached entry of ``p``, else tune it under the device model's tuning lock (another
    process may record it meanwhile: then its entry is taken). Never raises: a failure is a row."""
    spec = SPECS[p.kernel]
    entry = configs.usable_entry(spec, dev, p.named, p.dtype)
    if entry is not None:  # current cache: a re-run is a no-op
        return {**entry, "status": "cached"}
    hook = tuning.hook_for(p.kernel)
    if hook is None:
        return {"status": "no hook"}

    def tune() -> dict:
        res = tuning.tune(p.kernel, dev, p.named, p.dtype, hook(dev, p.named, p.dtype), dedicated=True)
        if res.time_ms is None:
            return {"status": "failed", "error": "; ".join(err for _, err in res.skipped[:2])}
        return {"config": res.config, "time_ms": res.time_ms, "default_ms": res.default_ms, "status": "tuned",
                "compile": res.compile}

    try:
        try:
            with autotune_cache.tuning_lock(dev, tuning.lock_timeout()) as got:
                if not got:
                    return {"status": "failed", "error": f"tuning lock busy ({autotune_cache.lock_holder(dev) or 'another process'})"}
                autotune_cache.reread(dev)
                entry = configs.usable_entry(spec, dev, p.named, p.dtype)
                if entry is not None:
                    return {**entry, "status": "cached"}
                return tune()
        except autotune_cache.NoTuningLock:  # unshared cache (kept in memory): nobody to wait for
            return tune()
    except Exception as e:  # noqa: BLE001 - report it, tune the other problems
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"}


def run(args: argparse.Namespace, probs: list[_warmup.Problem]) -> int:
    distributed = _init_distributed()  # first: it sets this rank's GPU, which target_device() reads
    dev = target_device()
    if dev is None:
        print("liger-portable warmup: error: no GPU: a real warmup times kernels on the device; use --dry-run to list the work", file=sys.stderr)
        return 2
    why = configs.unsupported_reason(dev)
    refused = [f"{dev.name} ({dev.arch})"] if why is not None else []
    if distributed:  # decided together: a rank leaving alone would leave the others waiting in collectives
        import torch.distributed as dist

        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, refused)
        refused = sorted({r for rank_refused in everyone for r in rank_refused})
    if refused:
        print(f"liger-portable warmup: error: {', '.join(refused)} cannot run the Triton kernels, so there is "
              f"nothing to tune (the PyTorch fallback runs there){': ' + why if why else ''}", file=sys.stderr)
        return 2
    from liger_portable.tuning import hooks  # late: the dry run needs no kernels

    hooks.register_all()
    rank = int(os.environ.get("RANK", "0"))
    rows, problems_left, compiles, t0 = [], {}, set(), time.perf_counter()
    progress = _Progress(len(probs), enabled=rank == 0 and not args.json)
    for i, p in enumerate(probs):
        spec = SPECS[p.kernel]
        progress.show(i, f"{p.kernel} {p.describe()} {autotune_cache.dtype_name(p.dtype)}", finished=False)
        got = tuning.agree(lambda p=p: _choose(p, dev), model=dev.model_slug) if distributed else _choose(p, dev)
        if distributed and got["status"] in ("tuned", "cached"):
            autotune_cache.reread(dev)  # the leader may share this cache folder and have recorded it already
            if configs.usable_entry(spec, dev, p.named, p.dtype) is None:
                # another node's leader chose it: record its result here too, so every rank reads it later
                autotune_cache.record(spec, dev, p.named, p.dtype, got["config"], got.get("time_ms"), got.get("default_ms"))
        if got.get("compile"):
            compiles.add(got["compile"])
        if got["status"] in ("no hook", "failed"):
            problems_left[f"{p.kernel} {p.describe()}"] = got.get("error") or got["status"]
        gain = (1 - got["time_ms"] / got["default_ms"]) if got.get("time_ms") and got.get("default_ms") else None
        rows.append({"kernel": p.kernel, "problem": p.describe(), "dtype": autotune_cache.dtype_name(p.dtype),
                     "config": " ".join(f"{k}={v}" for k, v in (got.get("config") or {}).items()),
                     "ms": f"{got['time_ms']:.4f}" if got.get("time_ms") else "",
                     "default ms": f"{got['default_ms']:.4f}" if got.get("default_ms") else "",
                     "gain": f"{gain:+.1%}" if gain is not None else "", "status": got["status"]})
        progress.show(i + 1, f"{p.kernel} {p.describe()} {autotune_cache.dtype_name(p.dtype)}: {got['status']}", finished=True)
    progress.close()
    if rank == 0:
        if args.json:
            print(json.dumps({"device": dev.name, "seconds": time.perf_counter() - t0, "results": rows}, indent=1))
        else:
            how = f" ({', '.join(sorted(compiles))})" if compiles else ""
            print(f"warmup of {len(probs)} problems on {dev.name}: {time.perf_counter() - t0:.1f} s{how}")
            print_table(rows, ["kernel", "problem", "dtype", "config", "ms", "default ms", "gain", "status"])
        for what, why in problems_left.items():
            print(f"not tuned: {what}: {why}", file=sys.stderr)
    if autotune_cache.in_memory_only(dev):  # the warmup's one product is the cache file
        if rank == 0:
            print(f"liger-portable warmup: error: the tuned configs could not be written to "
                  f"{autotune_cache.user_cache_file(dev)} and are lost when this process ends; set "
                  f"LIGER_PORTABLE_CACHE_DIR to a writable folder and run it again", file=sys.stderr)
        return 1
    return 1 if problems_left else 0


def main(argv: list[str] | None = None) -> int:
    """``liger-portable warmup`` with these arguments (default: the process's), its errors reported
    as the command line reports them."""
    args = parse_args(argv)
    return run_reported(lambda: run_command(args))


def run_command(args: argparse.Namespace) -> int:
    """Run the warmup for parsed arguments; returns the exit status."""
    if not SPECS:  # no kernel registered: Triton is not installed (off Linux, only the fallback runs)
        print("liger-portable warmup: error: the kernels need Triton, which is not installed, so there is "
              "nothing to tune (the PyTorch fallback runs without tuning); install triton to use them",
              file=sys.stderr)
        return 2
    try:
        probs = problems_of(args)
    except ValueError as e:
        print(f"liger-portable warmup: error: {e}", file=sys.stderr)
        return 2
    return dry_run(args, probs) if args.dry_run else run(args, probs)


if __name__ == "__main__":
    sys.exit(main())
