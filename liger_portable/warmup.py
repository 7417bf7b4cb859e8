"""Autotune warmup: tune every kernel problem of one training step and write the autotune cache.

    liger-portable warmup llama-3-8b --tokens 8192 --seq-len 4096 --dtype bfloat16
    liger-portable warmup path/to/config.json --tokens 4096 16384 --dry-run
    torchrun --nproc-per-node 8 scripts/autotune_warmup.py llama-3-70b --tokens 8192

(``scripts/autotune_warmup.py`` and ``python -m liger_portable.warmup`` run the same code.)

``--dry-run`` lists the problems (and, on a GPU, whether the cache already holds each) without
tuning; it needs no GPU. A real run tunes each problem missing from the cache over the backend
table's search space (:func:`liger_portable._tune.tune`) and records it in the user cache
(``$LIGER_PORTABLE_CACHE_DIR`` or ``$XDG_CACHE_HOME/liger_portable``); a re-run with a current
cache is a no-op. Under torchrun the ranks of one device model agree (:func:`_tune.agree`): the
lowest tunes, the others take its result.

Status: the problem listing and the driver are done; the kernel launch hooks that the real run
times (``_tune.register_hook``) come with the GPU session, so a real run reports the kernels
without a hook and tunes none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from liger_portable import _cache, _tune, _warmup
from liger_portable._platform import platform
from liger_portable._specs import SPECS

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="liger-portable warmup", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("model", help=f"a preset ({', '.join(_warmup.PRESETS)}) or a Hugging Face config.json (or its folder)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens per step on one rank (default 8192)")
    ap.add_argument("--seq-len", type=int, default=4096, help="sequence length; capped at --tokens (default 4096)")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=sorted(DTYPES), help="input dtypes")
    ap.add_argument("--loss", default="fused_linear_cross_entropy", choices=["fused_linear_cross_entropy", "cross_entropy"])
    ap.add_argument("--fused-add-norm", action="store_true", help="the layers use the fused residual-add RMSNorm")
    ap.add_argument("--dry-run", action="store_true", help="list the problems, tune nothing (no GPU needed)")
    ap.add_argument("--json", action="store_true", help="print the list / results as JSON")
    return ap.parse_args(argv)


def problems_of(args: argparse.Namespace) -> list[_warmup.Problem]:
    model = _warmup.model_shape(args.model)
    out: list[_warmup.Problem] = []
    for dname in args.dtype:
        for tokens in args.tokens:
            seq = min(args.seq_len, tokens)
            if tokens % seq:
                raise SystemExit(f"error: --tokens {tokens} is not a multiple of --seq-len {seq}; pick a seq-len dividing it")
            out += _warmup.step_problems(model, tokens, seq, DTYPES[dname], loss=args.loss,
                                         fused_add_norm=args.fused_add_norm)
    return _warmup.dedupe(out)


def _device():
    p = platform()
    return p.device() if p.backend != "cpu" and p.device_count else None


def cache_status(prob: _warmup.Problem, dev) -> str:
    if dev is None:
        return "-"
    entry = _cache.lookup_entry(SPECS[prob.kernel], dev, prob.named, prob.dtype)
    if entry is not None:
        return "cached"
    shipped = list(_cache.lookup(SPECS[prob.kernel], dev, prob.named, prob.dtype))
    return "shipped" if shipped else "to tune"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))


def dry_run(args: argparse.Namespace, probs: list[_warmup.Problem]) -> int:
    dev = _device()
    rows = [
        {"kernel": p.kernel, "problem": p.describe(), "dtype": _cache.dtype_name(p.dtype), "launches/step": p.launches,
         "where": p.what, "cache": cache_status(p, dev)}
        for p in probs
    ]
    if args.json:
        print(json.dumps({"model": dict(_warmup.shape_dict(_warmup.model_shape(args.model))),
                          "device": dev.name if dev else None, "problems": rows}, indent=1))
    else:
        print(f"{len(rows)} kernel problems for {args.model} ({dev.name if dev else 'no GPU: cache status unknown'}):")
        print_table(rows, ["kernel", "problem", "dtype", "launches/step", "where", "cache"])
    return 0


def _init_distributed() -> bool:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return True


def run(args: argparse.Namespace, probs: list[_warmup.Problem]) -> int:
    dev = _device()
    if dev is None:
        print("error: no GPU: a real warmup times kernels on the device; use --dry-run to list the work", file=sys.stderr)
        return 2
    distributed = _init_distributed()
    rank = int(os.environ.get("RANK", "0"))
    rows, missing_hooks, t0 = [], set(), time.perf_counter()
    for i, p in enumerate(probs, 1):
        spec = SPECS[p.kernel]

        def choose(p=p, spec=spec) -> dict | None:
            entry = _cache.lookup_entry(spec, dev, p.named, p.dtype)
            if entry is not None:  # current cache: a re-run is a no-op
                return {**entry, "status": "cached"}
            hook = _tune._hooks.get(p.kernel)
            if hook is None:
                return None
            res = _tune.tune(p.kernel, dev, p.named, p.dtype, hook(dev, p.named, p.dtype))
            return {"config": res.config, "time_ms": res.time_ms, "default_ms": res.default_ms, "status": "tuned"}

        got = _tune.agree(choose, model=dev.model_slug) if distributed else choose()
        if got is None:
            missing_hooks.add(p.kernel)
            got = {"status": "no hook"}
        elif distributed and got["status"] == "tuned" and _cache.lookup_entry(spec, dev, p.named, p.dtype) is None:
            # another node's leader tuned it: record its result here too, so every rank reads it later
            _cache.record(spec, dev, p.named, p.dtype, got["config"], got["time_ms"], got["default_ms"])
        gain = (1 - got["time_ms"] / got["default_ms"]) if got.get("time_ms") and got.get("default_ms") else None
        rows.append({"kernel": p.kernel, "problem": p.describe(), "dtype": _cache.dtype_name(p.dtype),
                     "config": " ".join(f"{k}={v}" for k, v in (got.get("config") or {}).items()),
                     "ms": f"{got['time_ms']:.4f}" if got.get("time_ms") else "",
                     "default ms": f"{got['default_ms']:.4f}" if got.get("default_ms") else "",
                     "gain": f"{gain:+.1%}" if gain is not None else "", "status": got["status"]})
        if rank == 0 and not args.json:
            print(f"\r[{i}/{len(probs)}] {p.kernel} {p.describe()} {got['status']}".ljust(100), end="", flush=True)
    if rank == 0:
        if args.json:
            print(json.dumps({"device": dev.name, "seconds": time.perf_counter() - t0, "results": rows}, indent=1))
        else:
            print(f"\nwarmup of {len(probs)} problems on {dev.name}: {time.perf_counter() - t0:.1f} s")
            print_table(rows, ["kernel", "problem", "dtype", "config", "ms", "default ms", "gain", "status"])
        if missing_hooks:
            print(f"not tuned (no tuning hook registered yet): {', '.join(sorted(missing_hooks))}", file=sys.stderr)
    return 1 if missing_hooks else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        probs = problems_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return dry_run(args, probs) if args.dry_run else run(args, probs)


if __name__ == "__main__":
    sys.exit(main())
