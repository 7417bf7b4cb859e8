"""The results log: every figure measured on a GPU, one JSON object a line, in scripts/results/log.jsonl.

A record::

    {"date": "2026-12-03", "device": "NVIDIA H200",
     "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0", "liger_kernel": "0.8.5", "liger_portable": "f65aadc"},
     "op": "rms_norm", "shape": "16384x4096", "impl": "liger-portable",
     "metric": "fwd_bwd_graph_ms", "value": 0.182,
     "dtype": "bfloat16", "pct_copy": 87.1, "peak_mib": 132.0}

Required: ``date`` (YYYY-MM-DD, UTC), ``device`` (the device name torch reports, or "cpu"), ``versions``
(package -> version string; ``liger_portable`` is the git commit of the checkout, with ``+dirty`` when
the package's files differ from it, or the installed version), ``op``, ``shape`` (a string such as
"16384x4096", or a dict), ``impl`` ("liger-portable", "torch.compile", "liger-kernel", "eager",
...), ``metric`` (the kind of figure: "fwd_bwd_graph_ms", "fwd_bwd_eager_ms", "kernel_ms",
"host_us", "tokens_per_s", "warmup_s", "gpu_tests", ...) and ``value`` (a finite number). Any other
key is an extra figure or remark: ``dtype``, ``peak_mib``, ``peak_gib``, ``pct_copy``, ``pct_matmul``,
``note``, ``config``, ``source`` ...

In Python (a benchmark script in scripts/ imports this module directly)::

    import results_log
    env = results_log.environment()            # date, device, versions of this machine, once
    recs = [results_log.record("rms_norm", "16384x4096", "liger-portable", "fwd_bwd_graph_ms", 0.182,
                               env=env, dtype="bfloat16", pct_copy=87.1)]
    results_log.save(recs, "rms_norm_bench")   # $OUT/rms_norm_bench.jsonl if OUT is set, else the log
                                               # (CPU records: only with OUT set, else CPURecordsError)
    results_log.append(recs, path)             # validate, then append to any JSONL file (default: the log)

From the shell::

    python scripts/results_log.py add FILE.jsonl ...    # append records written elsewhere (e.g. under $OUT
                                                         # on a GPU machine); exact duplicates are skipped
    python scripts/results_log.py summary [--check]     # regenerate scripts/results/RESULTS.md (--check:
                                                         # exit 1 if it is not up to date)
    python scripts/results_log.py record pytest|check|warmup|demo|distributed FILE [--label L] [--shape S] [--out F]
                                                         # records from the output of pytest -m gpu,
                                                         # liger-portable check / warmup / demo --json,
                                                         # distributed_check.py --json: the device (and
                                                         # the demo's torch / triton versions) from the
                                                         # output where it names them; the date, the other
                                                         # versions (and a pytest run's device) from the
                                                         # machine running record

Exit status: 0 done; 1 a failure (an input that is not what its kind expects, a file that cannot be
written, ``summary --check`` finding RESULTS.md out of date); 2 a usage error (a bad argument, a named
input file that does not exist). Errors are one line: ``results_log.py: error: ...``.

RESULTS.md shows the latest figure (latest date; on the same date, the later line of the log) for
each op, shape, implementation and metric; the log keeps the history. The headline tables show the
implementations users compare (ours, its peers, torch); any other implementation (an A/B probe of a change,
a host-cost breakdown, a prototype) is listed in the closing "Probes" table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable

HERE = Path(__file__).resolve().parent
LOG = HERE / "results" / "log.jsonl"
RESULTS = HERE / "results" / "RESULTS.md"
REQUIRED = ("date", "device", "versions", "op", "shape", "impl", "metric", "value")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")

# Package distributions whose versions a record carries when they are installed.
_DISTS = {"torch": "torch", "triton": "triton", "liger_kernel": "liger-kernel", "transformers": "transformers",
          "cut_cross_entropy": "cut-cross-entropy"}


# --------------------------------------------------------------------------- records


def _git_commit() -> str | None:
    """The checkout's commit (short), ``+dirty`` when the package's own files differ from it."""
    root = HERE.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "liger_portable", "backends", "autotune_cache"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    """Versions of the packages a measurement depends on, those installed here."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for key, dist in _DISTS.items():
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            continue
    if "torch" in sys.modules:  # the running build's own string (a local build has no metadata)
        out["torch"] = sys.modules["torch"].__version__
    out["python"] = ".".join(map(str, sys.version_info[:3]))
    # LIGER_PORTABLE_COMMIT names the code measured where the checkout's git metadata is not its own
    # (a copy of a working tree sent to a GPU machine, whose .git may be older than the files).
    commit = os.environ.get("LIGER_PORTABLE_COMMIT") or _git_commit()
    if commit is None:
        try:
            commit = version("liger-portable")
        except PackageNotFoundError:
            commit = None
    if commit:
        out["liger_portable"] = commit
    return out


def device_name() -> str:
    """The name of GPU 0 as torch reports it (CUDA and ROCm builds: torch.cuda; Intel: torch.xpu), else "cpu"."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return xpu.get_device_name(0)
    return "cpu"


def environment(device: str | None = None) -> dict:
    """``{"date", "device", "versions"}`` of this machine now (UTC date)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "device": device or device_name(), "versions": versions()}


def record(op: str, shape, impl: str, metric: str, value: float, *, env: dict | None = None, **extra) -> dict:
    """One record; ``env`` from :func:`environment` (taken now if None); extras that are None are left out."""
    env = env or environment()
    rec = {"date": env["date"], "device": env["device"], "versions": dict(env["versions"]),
           "op": op, "shape": shape, "impl": impl, "metric": metric, "value": value}
    rec.update({k: v for k, v in extra.items() if v is not None})
    return validate(rec)


def validate(rec: dict) -> dict:
    """``rec`` if it is a valid record, else ValueError naming the field."""
    if not isinstance(rec, dict):
        raise ValueError(f"a record is a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"record lacks {', '.join(missing)}: {rec}")
    if not isinstance(rec["date"], str) or not _DATE.match(rec["date"]):
        raise ValueError(f"date must be YYYY-MM-DD, got {rec['date']!r}")
    for key in ("device", "op", "impl", "metric"):
        if not isinstance(rec[key], str) or not rec[key].strip():
            raise ValueError(f"{key} must be a non-empty string, got {rec[key]!r}")
    if not isinstance(rec["shape"], (str, dict)) or not rec["shape"]:
        raise ValueError(f"shape must be a non-empty string or dict, got {rec['shape']!r}")
    if not isinstance(rec["versions"], dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in rec["versions"].items()):
        raise ValueError(f"versions must map package names to version strings, got {rec['versions']!r}")
    v = rec["value"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"value must be a finite number, got {v!r} ({rec['op']}, {rec['impl']}, {rec['metric']})")
    try:
        json.dumps(rec, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"record is not plain JSON ({e}): {rec}") from None
    return rec


def _line(rec: dict) -> str:
    return json.dumps(rec, sort_keys=False, allow_nan=False, ensure_ascii=False)


def _key(rec: dict) -> str:
    """What makes two records the same: every field, whatever their order."""
    return json.dumps(rec, sort_keys=True, allow_nan=False)


def read(path: str | os.PathLike = LOG, missing_ok: bool = True) -> list[dict]:
    """The records of a JSONL file, each validated (errors name the file and line). A file that does
    not exist holds no records when ``missing_ok`` (a log not started yet), else FileNotFoundError."""
    out = []
    path = Path(path)
    if missing_ok and not path.exists():
        return out
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{n}: not UTF-8 text: a JSONL file of records was expected") from None
            if not line.strip():
                continue
            try:
                out.append(validate(json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out


def append(records: Iterable[dict], path: str | os.PathLike = LOG) -> int:
    """Validate every record, then append them to ``path`` (created if missing). Returns how many."""
    records = [validate(r) for r in records]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(_line(r) + "\n")
    return len(records)


class CPURecordsError(ValueError):
    """Records of a CPU run that would go to the committed log (OUT unset): they must not."""


def check_destination(device: str) -> None:
    """CPURecordsError if records of ``device`` would go to the committed log (OUT unset) but must not:
    the log holds figures measured on GPUs, so a CPU run's records go to ``$OUT`` only."""
    if not os.environ.get("OUT") and device == "cpu":
        log = LOG.relative_to(HERE.parent) if LOG.is_relative_to(HERE.parent) else LOG
        raise CPURecordsError(f"records of a CPU run must not go to {log}: set OUT "
                              "to a folder for them (e.g. OUT=/tmp/out), or run on a GPU")


def save(records: Iterable[dict], name: str) -> str:
    """Where a benchmark puts its records: appended to ``$OUT/<name>.jsonl`` when OUT is set (a run on
    another machine: bring the file back and ``add`` it), else to the log; records of a CPU run (device
    "cpu") only with OUT set, else CPURecordsError and nothing written. Returns the path."""
    records = list(records)
    out = os.environ.get("OUT")
    for r in records:
        check_destination(r.get("device") if isinstance(r, dict) else None)
    path = Path(out) / f"{name}.jsonl" if out else LOG
    append(records, path)
    return str(path)


def add(sources: Iterable[str | os.PathLike], path: str | os.PathLike = LOG) -> tuple[int, int]:
    """Append the records of ``sources`` to ``path`` (created if missing), skipping exact duplicates (of
    the log or of each other). Every source is read and validated before anything is written; a source
    that does not exist is a FileNotFoundError. Returns (added, skipped)."""
    seen = {_key(r) for r in read(path)}
    new, skipped = [], 0
    for src in sources:
        for r in read(src, missing_ok=False):
            k = _key(r)
            if k in seen:
                skipped += 1
                continue
            seen.add(k)
            new.append(r)
    append(new, path)
    return len(new), skipped


# --------------------------------------------------------------------------- records from tool output


# What each kind of ``record`` reads (for its help and its errors).
SOURCES = {"pytest": "the output of `pytest -m gpu`", "check": "the output of `liger-portable check`",
           "warmup": "the output of `liger-portable warmup MODEL`", "demo": "`liger-portable demo --json` output",
           "distributed": "the JSON file of `scripts/distributed_check.py --json`"}


def _json_object(text: str, kind: str, source: str) -> dict:
    """The JSON object ``text`` holds (from its first ``{``, so a line printed before it is skipped),
    else ValueError saying ``source`` is not the output ``kind`` expects."""
    start = text.find("{")
    try:
        if start < 0:
            raise ValueError("no JSON object in it")
        return json.loads(text[start:])
    except ValueError as e:
        raise ValueError(f"{source} is not {SOURCES[kind]} ({e})") from None


def from_output(kind: str, text: str, env: dict, label: str | None = None, shape: str | None = None,
                source: str = "the text") -> list[dict]:
    """Records from the output of ``pytest -m gpu`` (kind "pytest"), ``liger-portable check``
    ("check"), ``liger-portable warmup MODEL`` ("warmup"), ``liger-portable demo --json`` ("demo")
    or the JSON file of ``scripts/distributed_check.py --json`` ("distributed"). ``label`` is put
    before the shape (for a warmup: the model); ``shape`` replaces it. The records carry ``env``'s date
    and versions, and the device the output names (check, warmup, demo, distributed; with the demo's
    torch and triton versions, the distributed check's torch), else ``env``'s. No result in a text
    output gives []; JSON that is not the expected output gives a ValueError naming ``source`` (the file)."""
    if kind not in SOURCES:
        raise ValueError(f"unknown kind {kind!r}: pytest, check, warmup, distributed or demo")

    def where(default: str) -> str:  # the records' shape
        s = shape or default
        return f"{label}: {s}" if label else s

    if kind in ("distributed", "demo"):
        d = _json_object(text, kind, source)
        try:
            return _from_json(kind, d, _json_env(kind, d, env), where)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, ZeroDivisionError) as e:
            what = f"no field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ValueError(f"{source} is not {SOURCES[kind]} ({what})") from None
    if kind == "pytest":
        # the summary line, with -q or without (then framed by "=")
        m = re.findall(r"^=* ?(\d+ (?:passed|failed|errors?)\b.*?) in ([\d.]+)s", text, re.M)
        if not m:
            return []
        summary, secs = m[-1]
        counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
        return [record("gpu_tests", where("pytest -m gpu tests/"), "liger-portable", "gpu_tests",
                       counts.get("passed", 0), env=env, duration_s=float(secs),
                       failed=counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0))]
    if kind == "check":
        passed, failed = len(re.findall(r"^\s+PASS\s", text, re.M)), len(re.findall(r"^\s+FAIL\s", text, re.M))
        if not passed + failed:
            return []
        return [record("check", where("every kernel against float64"), "liger-portable", "check_passed", passed,
                       env=_with_device(env, _check_device(text)), failed=failed)]
    if kind == "warmup":
        m = re.search(r"warmup of (\d+) problems on (.+?): ([\d.]+) s", text)
        if not m:
            return []
        return [record("autotune_warmup", where(f"{m.group(1)} problems"), "liger-portable", "warmup_s",
                       float(m.group(3)), env=_with_device(env, m.group(2).strip()))]
    return []


def _with_device(env: dict, device: str | None, versions: dict | None = None) -> dict:
    """``env`` with the device (and ``versions``: package -> version, None for one not installed there)
    that a tool's output names, where it names them: the records then say where the figures were
    measured, not where ``record`` ran."""
    if not device and not versions:
        return env
    out = {**env, "versions": dict(env["versions"])}
    if device:
        out["device"] = device
    for k, v in (versions or {}).items():
        if isinstance(v, str) and v:
            out["versions"][k] = v
        elif v is None:
            out["versions"].pop(k, None)
    return out


# liger-portable check's first line: "liger-portable check on NVIDIA H200 (cuda sm90)", "... on cpu (PyTorch
# fallback)", or "... on NAME (BACKEND ARCH): not supported by the kernels, ..."
_CHECK_ON = re.compile(r"^liger-portable check on (.+)$", re.M)
_NAME_BACKEND = re.compile(r"^(.+?) \((?:cuda|rocm|xpu) [^()]*\)(?::|$)")


def _check_device(text: str) -> str | None:
    """The device ``liger-portable check``'s output names ("cpu" for the fallback), else None."""
    m = _CHECK_ON.search(text)
    if not m:
        return None
    where = m.group(1).strip()
    if where == "cpu" or where.startswith("cpu "):
        return "cpu"
    named = _NAME_BACKEND.match(where)
    return named.group(1) if named else None


def _json_env(kind: str, d: dict, env: dict) -> dict:
    """``env`` with the device and versions that a demo / distributed_check JSON object names (the demo:
    ``device_name`` and ``platform``'s torch and triton; distributed_check: ``meta``'s ``device_name``,
    or "cpu" for a CPU run, and its torch). A device given only as a type ("cuda") keeps ``env``'s."""
    if not isinstance(d, dict):
        return env
    if kind == "demo":
        name, dev = d.get("device_name"), str(d.get("device") or "")
        plat = d.get("platform") if isinstance(d.get("platform"), dict) else {}
        versions = {k: plat[k] for k in ("torch", "triton") if k in plat}
    else:
        meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
        name, dev = meta.get("device_name"), str(meta.get("device") or "")
        versions = {"torch": meta["torch"]} if isinstance(meta.get("torch"), str) else {}
    if dev == "cpu" or name == "cpu":
        device = "cpu"
    elif isinstance(name, str) and name.strip() and name != dev.split(":")[0]:
        device = name.strip()
    else:
        device = None
    return _with_device(env, device, versions)


def _from_json(kind: str, d: dict, env: dict, where: Callable[[str], str]) -> list[dict]:
    """The records of a ``distributed_check.py --json`` (kind "distributed") or ``demo --json`` object (see
    :func:`from_output`; ``where`` gives their shape); KeyError, TypeError ... when ``d`` lacks a field."""
    if kind == "distributed":
        ok = sum(1 for r in d["results"] if r["ok"])
        return [record("distributed_check", where(f"{d['meta']['world']} processes, {d['meta']['backend']}"),
                       "liger-portable", "checks_passed", ok, env=env, failed=len(d["results"]) - ok)]
    c = d["config"]
    # without kernels (the PyTorch fallback) both runs are PyTorch: their ratio shows only the machine's load
    ratio = d.get("kernels", True)
    model = where(f"Llama-style, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['batch']}x{c['seq']}")
    out = []
    for key, impl in (("hf", "hugging-face"), ("patched", "liger-portable")):
        peak = d["peak_memory_bytes"].get(key)
        note = None
        if key == "patched":
            note = (f"loss check over the first {d['compared_steps']} steps: {d['max_rel_loss_diff']:.1e} of the "
                    f"loss (tolerance {d['rel_tolerance']:g}): {'OK' if d['ok'] else 'FAILED'}")
        out.append(record("demo", model, impl, "tokens_per_s", round(d["tokens_per_s"][key], 1), env=env,
                          dtype=c["dtype"], peak_gib=round(peak / 2**30, 3) if peak else None,
                          vs_hf=round(d["tokens_per_s"][key] / d["tokens_per_s"]["hf"], 3) if ratio else None,
                          note=note))
    return out


# --------------------------------------------------------------------------- summary

METRICS = {  # metric: what it means (the order of the sections in RESULTS.md)
    "fwd_bwd_graph_ms": "Forward + backward, the whole step captured in one CUDA graph and replayed (GPU time, "
                        "without the host's launch cost), median ms. In brackets: % of the copy bandwidth "
                        "(memory-bound ops) or of the bf16 matmul rate (fused linear cross-entropy) measured "
                        "in the same run; then the peak memory beyond the inputs, from no gradients (the "
                        "gradients the step makes are counted).",
    "fwd_bwd_eager_ms": "The same step called from Python, median ms. Small steps are host-bound on a slow host "
                        "(a Triton launch costs more host time than an aten one), so these move between runs; "
                        "peers that cannot be captured in a CUDA graph appear only here.",
    "tokens_per_s": "Training throughput: tokens a step over the median step time after warm-up steps; peak "
                    "memory is max_memory_allocated over the run; vs Hugging Face's tokens/s.",
    "device_ms_per_step": "Device time of one training step by kind of kernel (torch.profiler).",
    "kernel_graph_ms": "One kernel alone, CUDA-graph replays, median ms.",
    "kernel_ms": "One kernel alone, called from Python (triton.testing.do_bench), median ms.",
    "gemm_ms": "The fused linear cross-entropy's matrix products, each timed alone and summed over the "
               "chunks of one step, ms.",
    "warmup_s": "`liger-portable warmup`: wall time to tune every kernel problem of one training step from an "
                "empty cache, s.",
    "gpu_tests": "`pytest -m gpu`: tests passed (failed).",
    "checks_passed": "`scripts/distributed_check.py` under torchrun: checks passed (failed).",
    "check_passed": "`liger-portable check`: cases passed (failed).",
    "host_us": "Host time a call, microseconds.",
    "host_ratio": "Host time a call over torch's (its fused native op, else eager PyTorch), taken within each "
                  "interleaved round, median over the rounds.",
    "gbs": "Measured ceiling: device-to-device copy bandwidth, GB/s (bytes read plus bytes written).",
    "tflops": "Measured ceiling: bf16 matrix-product rate, TFLOP/s.",
}
# The implementations of the headline tables, in their column order. A record of any other
# implementation (an A/B probe, a cost breakdown, a prototype) goes to the "Probes" section at the end;
# a ratio "A / B" is a headline figure when A and B both are.
_IMPLS = ["liger-portable", "liger-portable in place", "liger-portable chunk_mib=512",
          "liger-portable chunk_mib=1024", "liger-portable unfused", "liger-portable single-buffered",
          "liger-portable tuned", "liger-portable table default", "liger-portable + compile",
          "liger-portable + compile per layer", "torch.compile", "liger-kernel", "liger-kernel + compile",
          "cut-cross-entropy", "F.rms_norm", "F.layer_norm", "add + F.rms_norm", "torch", "torch (cuBLAS)",
          "hugging-face", "hugging-face + compile", "hugging-face + compile per layer", "eager"]
_OPS = ["rms_norm", "layer_norm", "fused_add_rms_norm", "swiglu", "geglu", "rope", "cross_entropy",
        "fused_linear_cross_entropy", "train_step", "demo"]


def is_probe(impl: str) -> bool:
    """Whether ``impl`` is outside the headline implementations (its figures go to the Probes section)."""
    return not all(part in _IMPLS for part in impl.split(" / "))


def _shape_str(shape) -> str:
    return shape if isinstance(shape, str) else ", ".join(f"{k}={v}" for k, v in shape.items())


def _natural(s: str) -> list:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s) if t]


def _order(name: str, known: list[str]) -> tuple:
    return (known.index(name), "") if name in known else (len(known), name)


def _num(v: float) -> str:
    """Digits by magnitude (0.0645, 0.182, 1.587, 46.60, 184.6, 63,443), fewer when the value has fewer."""
    a = abs(v)
    if isinstance(v, int) or a >= 1000:
        return f"{v:,.0f}"
    s = f"{v:.{1 if a >= 100 else 2 if a >= 10 else 3 if a >= 0.1 else 4}f}"
    short = repr(float(v)).removesuffix(".0")
    return short if "e" not in short and len(short) < len(s) else s


# Peak memory of a forward + backward measured before the benchmarks cleared the gradients of the
# last step first (records without ``peak_from``): the gradients the step allocates may be missing.
# The GLU and fused add benchmarks always measured from no gradients, the fused linear
# cross-entropy's since 2026-12-04.
OLD_PEAK = "\u2021"
OLD_PEAK_NOTE = (f"{OLD_PEAK}: peak memory taken beside the last step's gradients (records before 2026-12-06 "
                 "that do not say `peak_from`): the step's own gradients may be missing from the figure.")
_PEAK_FROM_NO_GRADS = {"swiglu": "", "geglu": "", "fused_add_rms_norm": "", "fused_linear_cross_entropy": "2026-12-04"}


def old_peak(r: dict) -> bool:
    """Whether ``r``'s peak memory may leave out the gradients its step allocates (see OLD_PEAK)."""
    if not r["metric"].startswith("fwd_bwd_") or "peak_mib" not in r or "peak_from" in r:
        return False
    since = _PEAK_FROM_NO_GRADS.get(r["op"])
    return since is None or r["date"] < since


def _row_label(r: dict) -> str:
    """A table row's label: the shape, the dtype where it is not bf16, and the method where it is not
    the op's benchmark's (eager figures of bench_host_overhead.py: back-to-back calls, no cache flush)."""
    label = _shape_str(r["shape"])
    if r.get("dtype") not in (None, "bfloat16"):
        label += f" {r['dtype']}"
    if r["metric"] == "fwd_bwd_eager_ms" and "rounds" in r:
        label += " (back-to-back calls)"
    return label


def _cell(r: dict, memory: bool = True) -> str:
    s = _num(r["value"])
    for key in ("pct_copy", "pct_matmul"):
        if key in r:
            s += f" ({r[key]:.0f}%)"
    if "failed" in r:
        s += f" ({r['failed']} failed)"
    if "vs_hf" in r and r["impl"] != "hugging-face":
        s += f" x{r['vs_hf']:.2f}"
    if "peak_mib" in r and memory:
        s += f", {r['peak_mib']:,.0f} MiB{OLD_PEAK if old_peak(r) else ''}"
    if "peak_gib" in r and memory:
        s += f", {r['peak_gib']:.1f} GiB"
    return s


def _env_str(device: str, versions: dict) -> str:
    first = ["torch", "triton", "python", "liger_kernel", "transformers", "cut_cross_entropy", "liger_portable"]
    keys = sorted(versions, key=lambda k: _order(k, first))
    return f"{device}; " + ", ".join(f"{k} {versions[k]}" for k in keys if versions[k] is not None)


def latest(records: list[dict]) -> dict:
    """(device, op, shape, impl, metric) -> the latest record: latest date; on the same date, the later line."""
    out = {}
    for r in records:
        k = (r["device"], r["op"], _row_label(r), r["impl"], r["metric"])
        if k not in out or r["date"] >= out[k]["date"]:
            out[k] = r
    return out


def _notes(notes: list[tuple[str, str, str]], cells: list[tuple[str, str]]) -> list[str]:
    """Lines for the notes of a table's cells ((row, column, note)), each note once: for the whole
    table, a column, a row, or the cells it belongs to."""
    out = []
    for note in dict.fromkeys(n for _, _, n in notes):
        mine = [(a, b) for a, b, n in notes if n == note]
        cols, rows = {b for _, b in mine}, {a for a, _ in mine}
        if cells and set(mine) == set(cells):
            out.append(f"- {note}")
        elif cells and len(cols) == 1 and len(mine) == sum(1 for c in cells if c[1] in cols) and len(mine) > 1:
            out.append(f"- {mine[0][1]}: {note}")
        elif cells and len(rows) == 1 and len(mine) == sum(1 for c in cells if c[0] in rows) and len(mine) > 1:
            out.append(f"- {mine[0][0]}: {note}")
        else:
            out.append(f"- {'; '.join(f'{a}, {b}' for a, b in mine)}: {note}")
    return [""] + out if out else []


def summary_text(records: list[dict]) -> str:
    lines = ["# Measured results", "",
             "<!-- Generated from log.jsonl by scripts/results_log.py: do not edit; regenerate with "
             "`python scripts/results_log.py summary`. -->", ""]
    if not records:
        return "\n".join(lines + ["The log holds no records yet.", ""])
    dates = sorted(r["date"] for r in records)
    best = list(latest(records).values())
    envs: dict[str, str] = {}
    for r in sorted(best, key=lambda r: (r["date"], _env_str(r["device"], r["versions"]))):
        envs.setdefault(_env_str(r["device"], r["versions"]), f"E{len(envs) + 1}")

    def env(r: dict) -> str:
        return envs[_env_str(r["device"], r["versions"])]

    lines += [f"Generated from [`log.jsonl`](log.jsonl), {len(records)} records from {dates[0]} to {dates[-1]}: "
              "the latest figure for each device, op, shape (with the dtype where it is not bf16, and the method where "
              "it is not the op's benchmark's), implementation and metric (latest date; on the same "
              "date, the later line of the log). The log keeps every earlier figure. Add records with "
              "`python scripts/results_log.py add FILE.jsonl`; regenerate this file with "
              "`python scripts/results_log.py summary`.", "",
              "Environments (device; versions; `liger_portable` is the commit measured, where known):", ""]
    lines += [f"- **{label}**: {e}" for e, label in envs.items()]
    probes = [r for r in best if is_probe(r["impl"])]
    best = [r for r in best if not is_probe(r["impl"])]
    for metric in sorted({r["metric"] for r in best}, key=lambda m: _order(m, list(METRICS))):
        lines += ["", f"## {metric}"]
        if metric in METRICS:
            lines += ["", METRICS[metric]]
        # eager figures leave the memory to the graph-replay table, where the op has one
        graphed = {r["op"] for r in best if r["metric"] == "fwd_bwd_graph_ms"}

        def shows_memory(op: str) -> bool:
            return metric != "fwd_bwd_eager_ms" or op not in graphed

        recs = [r for r in best if r["metric"] == metric]
        ops = sorted({r["op"] for r in recs}, key=lambda o: _order(o, _OPS))
        single = []  # ops measured for one implementation only: one table for all of them
        for op in ops:
            memory = shows_memory(op)
            mine = [r for r in recs if r["op"] == op]
            impls = sorted({r["impl"] for r in mine}, key=lambda i: _order(i, _IMPLS))
            if len(impls) == 1:
                single += mine
                continue
            rows = sorted({(_row_label(r), r["device"]) for r in mine}, key=lambda t: (_natural(t[0]), t[1]))
            by = {(_row_label(r), r["device"], r["impl"]): r for r in mine}
            lines += ["", f"### {op}", "", "| shape | " + " | ".join(impls) + " | date | env |",
                      "|" + "---|" * (len(impls) + 3)]
            notes = []  # (shape, impl, note)
            for shape, device in rows:
                row = [by.get((shape, device, i)) for i in impls]
                present = [r for r in row if r]
                first = max(r["date"] for r in present)
                date = first + "".join(f"; {i}: {r['date']}" for i, r in zip(impls, row) if r and r["date"] != first)
                es = sorted({env(r) for r in present}, key=_natural)
                lines.append(f"| {shape} | " + " | ".join(_cell(r, memory) if r else "" for r in row)
                             + f" | {date} | {', '.join(es)} |")
                notes += [(shape, r["impl"], r["note"]) for r in present if r.get("note")]
            lines += _notes(notes, [(_row_label(r), r["impl"]) for r in mine])
        if single:
            single.sort(key=lambda r: (_order(r["op"], _OPS), r["op"], _natural(_row_label(r)), r["device"]))
            lines += ["", "| op | shape | impl | value | date | env |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['op']} | {_row_label(r)} | {r['impl']} | "
                      f"{_cell(r, shows_memory(r['op']))} | {r['date']} | "
                      f"{env(r)} |" for r in single]
            lines += _notes([(r["op"], _shape_str(r["shape"]), r["note"]) for r in single if r.get("note")], [])
    if OLD_PEAK in "\n".join(lines):
        lines += ["", OLD_PEAK_NOTE]
    if probes:
        probes.sort(key=lambda r: (_order(r["metric"], list(METRICS)), _order(r["op"], _OPS), r["op"],
                                   _natural(_shape_str(r["shape"])), r["impl"], r["device"]))
        lines += ["", "## Probes", "",
                  "One-off figures beside the headline ones: A/B probes of a change, host-cost breakdowns, "
                  "prototypes (the metrics as above).", "",
                  "| metric | op | shape | impl | value | date | env | note |", "|---|---|---|---|---|---|---|---|"]
        numbers = {n: i for i, n in enumerate(dict.fromkeys(r["note"] for r in probes if r.get("note")), 1)}
        lines += [f"| {r['metric']} | {r['op']} | {_shape_str(r['shape'])} | {r['impl']} | {_cell(r)} | "
                  f"{r['date']} | {env(r)} | {numbers[r['note']] if r.get('note') else ''} |" for r in probes]
        lines += [""] + [f"{i}. {n}" for n, i in numbers.items()]
    return "\n".join(lines) + "\n"


def summary(path: str | os.PathLike = LOG, out: str | os.PathLike = RESULTS) -> str:
    """Regenerate ``out`` from the log at ``path``; returns the text."""
    text = summary_text(read(path))
    Path(out).write_text(text, encoding="utf-8")
    return text


# --------------------------------------------------------------------------- command line


class CommandError(Exception):
    """An error :func:`main` reports in one line; ``code`` is the exit status (2: a usage error, 1: a failure)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _input_file(path: str, what: str) -> Path:
    """``path`` as a Path if it is an existing file, else a usage error naming it and ``what`` it should be."""
    p = Path(path)
    if not p.exists():
        raise CommandError(f"{path}: no such file ({what})", 2)
    if p.is_dir():
        raise CommandError(f"{path} is a folder ({what})", 2)
    return p


def _write(what: str, write: Callable[[], object], fix: str = "name a file in a writable folder"):
    """``write()``, which writes the file ``what`` names (e.g. "--out PATH"); an OSError becomes one line."""
    try:
        return write()
    except OSError as e:
        raise CommandError(f"cannot write {what}: {e.strerror or e} ({fix})") from None


def _run(args: argparse.Namespace) -> int:
    """The command ``args`` asks for; errors raise :class:`CommandError`, OSError or ValueError."""
    if args.cmd == "add":
        sources = [_input_file(f, "add takes JSONL files of records, e.g. an $OUT/records.jsonl") for f in args.files]
        log = args.log or str(LOG)
        for src in sources:  # readable, before the log is touched
            read(src, missing_ok=False)
        added, skipped = _write(f"--log {log}", lambda: add(sources, log))
        print(f"{log}: {added} records added, {skipped} duplicates skipped")
    elif args.cmd == "summary":
        if args.log is None:
            records = read(LOG)  # the default log: none yet is no records
        else:
            records = read(_input_file(args.log, "--log names the log to summarize; leave it out for "
                                                 "scripts/results/log.jsonl"), missing_ok=False)
        text = summary_text(records)
        if args.check:
            current = Path(args.out).read_text(encoding="utf-8") if Path(args.out).exists() else ""
            if current != text:
                print(f"{args.out} is not up to date: run python scripts/results_log.py summary")
                return 1
            print(f"{args.out} is up to date")
        else:
            _write(f"--out {args.out}", lambda: Path(args.out).write_text(text, encoding="utf-8"))
            print(f"wrote {args.out}")
    else:
        what = SOURCES[args.kind]
        src = _input_file(args.file, f"record {args.kind} takes {what}")
        recs = from_output(args.kind, src.read_text(encoding="utf-8", errors="replace"), environment(),
                           args.label, args.shape, source=args.file)
        if not recs:
            raise CommandError(f"no {args.kind} result found in {args.file} (record {args.kind} takes {what})")
        where = args.out or args.log
        if where:
            _write(f"{'--out' if args.out else '--log'} {where}", lambda: append(recs, where))
        else:
            out = os.environ.get("OUT")
            try:
                where = _write(f"{out}/{args.kind}.jsonl (OUT is set)" if out else f"the log {LOG}",
                               lambda: save(recs, args.kind), "set OUT to a writable folder, or name a file with --out")
            except CPURecordsError as e:
                raise CommandError(f"{e}, or name a file with --out", 2) from None
        print(f"{where}: {len(recs)} records")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log", help="the log (default scripts/results/log.jsonl); add and record append to it, "
                                      "creating it if missing; summary reads it (a --log named must exist)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", parents=[common], help="append the records of JSONL files, skipping exact duplicates")
    a.add_argument("files", nargs="+", help="JSONL files of records (each must exist)")
    s = sub.add_parser("summary", parents=[common], help="regenerate RESULTS.md from the log")
    s.add_argument("--out", default=str(RESULTS),
                   help="the Markdown file to write, or with --check to compare (default scripts/results/RESULTS.md)")
    s.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is not up to date")
    r = sub.add_parser("record", parents=[common], help="records from a tool's output: pytest, check, warmup, demo (--json), "
                                      "distributed (--json)")
    r.add_argument("kind", choices=list(SOURCES), help="what FILE holds: "
                   + "; ".join(f"{k}: {v}" for k, v in SOURCES.items()))
    r.add_argument("file", help="the saved output of that tool. The records take the device from it where it "
                   "names one (check, warmup, demo, distributed), and the demo's torch and triton versions (the "
                   "distributed check's torch); every other field (date, other versions, and the device of a "
                   "pytest output) comes from the machine running record: run it there, or right after the run")
    r.add_argument("--label", help="put before the shape (a warmup: the model)")
    r.add_argument("--shape", help="the records' shape instead of the default (e.g. the tests run)")
    r.add_argument("--out", help="append them here (default: $OUT/<kind>.jsonl if OUT is set, else the log; "
                                       "records of a CPU run need OUT or --out)")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except CommandError as e:
        message, code = str(e), e.code
    except OSError as e:
        message, code = (f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)), 1
    except ValueError as e:
        message, code = str(e), 1
    print(f"{ap.prog}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
