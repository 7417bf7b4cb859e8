#!/usr/bin/env python
"""Vendor compile matrix: every config of every vendor table, compiled for every target, checked.

For each kernel spec (``liger_portable.specs.SPECS``) with examples (its launches, read from the
kernel family's own launch code by ``liger_portable/compile_matrix.py``) and each target, the configs its backend table produces are enumerated — the default rules over
representative problem sizes and, with ``--full``, the tuner's search space merged over each rule's
config — and cross-compiled with the public Triton wheel (no GPU needed). Each compile is checked
against the target's limits, which Triton does not check when cross-compiling:

* threads per block: num_warps x warp size <= 1024 (wave64 on CDNA, wave32 on RDNA);
* shared memory / LDS per block: ``kernel.metadata.shared`` against the target's limit;
* register spills: NVIDIA ``LOCAL`` bytes from the wheel's ``cuobjdump -res-usage`` on the cubin,
  AMD ``.vgpr_spill_count`` (scratch memory; ``.sgpr_spill_count`` is shown, it spills to VGPR lanes)
  in the amdgcn text; reported as warnings (slow, not a launch failure) unless ``--fail-on-spills``;
* backend options: none of another vendor's (Triton raises KeyError at launch), and this
  vendor's options must reach the compiled kernel's metadata (a misspelt one is dropped silently);
* the table's own limits for the target must not exceed the real ones.

Intel (no backend in the public wheel) is checked statically in its own column: sub-groups x 32
(or ``threads_per_warp``) <= the work-group limit, sub-group count and size, ``grf_mode`` in the
set Intel's Triton accepts (large GRF with num_warps <= 32), and SLM per work-group, estimated by
compiling the same config for a 32-wide NVIDIA target (the shared-memory allocation is Triton's
common layout code; an estimate, marked "~").

Compiles run in a process pool and their results are cached by content (kernel source and its
dependencies, Triton version, target, options, constexprs, signature), so a re-run compiles only
what changed. Exit status 1 on any failure; every failure names kernel, target and limit; 2 for
bad arguments; 130 on Ctrl-C (the pool stops at once, finished compiles stay cached).

Usage::

    python scripts/vendor_matrix.py                  # default configs, every kernel and target
    python scripts/vendor_matrix.py --ci             # fewer problem sizes (CI), same coverage of rules
    python scripts/vendor_matrix.py --full --kernels rms_norm_fwd --targets gfx942,sm90
    python scripts/vendor_matrix.py --limit gfx942.shared=32768   # check against a smaller part
"""

from __future__ import annotations

import argparse
import contextlib
import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from liger_portable._arguments import at_least_one  # noqa: E402  (torch-free)
from liger_portable import compile_matrix as cm  # noqa: E402  (does not import Triton kernels)
from liger_portable import configs  # noqa: E402
from liger_portable.hardware import (  # noqa: E402
    ALL_BACKEND_OPTIONS, ARCH_OPTION_VALUES, BACKEND_OPTIONS, OPTION_RULES, launch_options,
)
from liger_portable.specs import SPECS  # noqa: E402


# --------------------------------------------------------------------------- targets and limits


@dataclass(frozen=True)
class Target:
    """A compile target and the limits a launch config must respect on it, as the vendors document them
    (the CUDA C++ Programming Guide's table of compute capabilities, AMD's CDNA and RDNA ISA references,
    Intel's oneAPI GPU Optimization Guide)."""

    name: str  # the arch name the table sections match (sm90, gfx942, gfx1100, xe-hpc)
    backend: str  # table: cuda, rocm, xpu
    triton: tuple  # GPUTarget(backend, arch, warp_size); None for static-only targets
    warp_size: int
    max_threads: int
    shared: int  # bytes of shared memory / LDS / SLM per block
    what: str
    sub_group_sizes: tuple = ()  # Intel only
    max_sub_groups: int = 0  # Intel only
    units: int = 0  # compute units as the driver reports them (a persistent grid's PROGRAMS_PER_CU unit)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm80", "cuda", ("cuda", 80, 32), 32, 1024, 166_912, "A100: 166,912 B shared (opt-in)"),
        Target("sm90", "cuda", ("cuda", 90, 32), 32, 1024, 232_448, "H100/H200: 232,448 B shared (read on an H200)"),
        Target("sm100", "cuda", ("cuda", 100, 32), 32, 1024, 232_448, "B200: about 227 KB shared"),
        Target("gfx90a", "rocm", ("hip", "gfx90a", 64), 64, 1024, 65_536, "MI200: wave64, 64 KiB LDS", units=110),
        Target("gfx942", "rocm", ("hip", "gfx942", 64), 64, 1024, 65_536, "MI300: wave64, 64 KiB LDS", units=304),
        Target("gfx950", "rocm", ("hip", "gfx950", 64), 64, 1024, 163_840, "MI350: wave64, 160 KiB LDS", units=256),
        # RDNA3: the driver reports 48 work-group processors of two CUs each (ROCm/hip #3198)
        Target("gfx1100", "rocm", ("hip", "gfx1100", 32), 32, 1024, 65_536, "RDNA3: wave32, 64 KiB LDS", units=48),
    )
}
# Intel: static checks only (the public Triton wheel has no XPU backend).
XPU_TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("xe-hpc", "xpu", None, 32, 1024, 131_072, "Max 1550: 1024 work-items, 128 KB SLM", (16, 32), 64),
        Target("xe-hpg", "xpu", None, 32, 1024, 65_536, "Arc A / Flex: 1024 work-items, 64 KiB SLM", (8, 16, 32), 64),
        Target("xe2", "xpu", None, 32, 1024, 65_536, "Arc B: 1024 work-items, 64 KiB SLM (assumed)", (16, 32), 64),
    )
}
# grf_mode values Intel's Triton accepts: 'default', 'auto' and the register counts ('128', '256',
# '512') in current releases; 'small' / 'large' in releases before that. Large modes double the
# registers per thread and halve the threads, so they refuse num_warps > 32.
GRF_MODES = {"default", "auto", "small", "large", "128", "256", "512"}
LARGE_GRF = {"large", "256", "512"}
# What Intel's Triton accepts per release (intel-xpu-backend-for-triton #5122: threads_per_warp
# renamed warp_size in 3.6.0; #5430: grf_mode '256' from 3.6.0, 'large'/'small' before): the
# options the package hands each release (hardware.launch_options) must be spelled its way.
INTEL_TRITON = {
    "3.5.0": {"options": {"grf_mode", "threads_per_warp"}, "grf_mode": {"default", "auto", "small", "large"}},
    "3.6.0": {"options": {"grf_mode", "warp_size"}, "grf_mode": {"default", "auto", "128", "256", "512"}},
}
# The 32-wide target whose compile stands in for Intel's SLM use.
XPU_SMEM_PROXY = ("cuda", 90, 32)
DTYPE = "bfloat16"


# --------------------------------------------------------------------------- tables


def load_tables(directory: Path) -> tuple[dict[str, configs.Table], list[str]]:
    """Each backend's table parsed without the resolver's limit checks (the matrix reports those
    itself, per target), and the strict validation's errors."""
    tables, errors = {}, []
    for backend in ("cuda", "rocm", "xpu"):
        path = directory / f"{backend}.json"
        try:
            data = json.loads(path.read_text())
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError: not UTF-8
            raise configs.ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            configs.parse_table(data, path, backend)
        except configs.ConfigError as e:
            errors.append(f"table validation: {e}")
        with mock.patch.object(configs, "check_config", lambda *a, **k: None):
            tables[backend] = configs.parse_table(data, path, backend)
    return tables, errors


@dataclass
class Item:
    """One config of one kernel for one target, and where it came from."""

    kernel: str
    target: Target
    cfg: dict
    problem: dict
    where: str


def enumerate_configs(table: configs.Table, target: Target, kernel: str, full: bool, ci: bool) -> list[Item]:
    items, by_rule = [], {}
    representative = cm.problems(kernel, ci=ci)
    for p in representative:
        cfg, where = configs.table_config(table, target.name, kernel, p)
        items.append(Item(kernel, target, dict(cfg), p, where))
        # The largest problem of each rule: the one its search points are compiled with.
        by_rule[where] = (cfg, p)
    # A rule no representative size reached (CI's few row lengths miss e.g. a rule for 4097-5120
    # columns) is compiled at its own bound.
    for s in (table.section_for(target.name), table.sections["default"]):
        entry = s.kernels.get(kernel)
        for rule in entry.rules if entry else ():
            if not rule.upto:
                continue
            p = {**representative[0], **dict(rule.upto)}
            cfg, where = configs.table_config(table, target.name, kernel, p)
            if where not in by_rule:
                items.append(Item(kernel, target, dict(cfg), p, where))
                by_rule[where] = (cfg, p)
    if full:
        space = configs.search_space(table, target.name, kernel)
        import itertools

        names = list(space)
        for where, (cfg, p) in by_rule.items():
            for values in itertools.product(*(space[n] for n in names)):
                point = dict(zip(names, values))
                items.append(Item(kernel, target, {**cfg, **point}, p, f"{where} + search {point}"))
    return items


def static_failures(item: Item) -> list[str]:
    """Limit and option checks that need no compile."""
    t, cfg, out = item.target, item.cfg, []
    head = f"{item.kernel} on {t.name} ({item.where}, {_show(cfg)})"
    nw = cfg["num_warps"]
    lanes = cfg.get("threads_per_warp", t.warp_size) if t.backend == "xpu" else t.warp_size
    if nw * lanes > t.max_threads:
        unit = "sub-group" if t.backend == "xpu" else ("wave" if t.backend == "rocm" else "warp")
        out.append(
            f"{head}: num_warps={nw} x {unit} size {lanes} = {nw * lanes} threads per block, over the "
            f"limit of {t.max_threads} ({t.what}); use num_warps <= {t.max_threads // lanes}"
        )
    foreign = sorted(k for k in cfg if k in ALL_BACKEND_OPTIONS and k not in BACKEND_OPTIONS[t.backend])
    for k in foreign:
        owner = next(b for b, opts in BACKEND_OPTIONS.items() if k in opts)
        out.append(
            f"{head}: option {k!r} is a {owner} launch option; the {t.backend} Triton backend raises "
            f"KeyError for it at launch (limit: only {sorted(BACKEND_OPTIONS[t.backend])} allowed)"
        )
    for k in sorted(k for k in cfg if k in OPTION_RULES and k in BACKEND_OPTIONS[t.backend]):
        err = OPTION_RULES[k].check(cfg[k])
        narrower = ARCH_OPTION_VALUES.get(t.name, {}).get(k)
        if err is None and narrower is not None and cfg[k] not in narrower:
            err = f"must be one of {list(narrower)} on {t.name}, got {cfg[k]!r}"
        if err:
            out.append(f"{head}: option {k} ({OPTION_RULES[k].doc}) {err}")
    if t.backend == "xpu":
        opts = {k: v for k, v in cfg.items() if k in BACKEND_OPTIONS["xpu"]}
        for version, accepts in INTEL_TRITON.items():
            spelled = launch_options("xpu", opts, version)
            unknown = sorted(set(spelled) - accepts["options"])
            if unknown:
                out.append(f"{head}: Intel Triton {version} raises KeyError for option(s) {unknown} "
                           f"(the package passes {spelled})")
            if "grf_mode" in spelled and spelled["grf_mode"] not in accepts["grf_mode"]:
                out.append(f"{head}: Intel Triton {version} does not accept grf_mode={spelled['grf_mode']!r} "
                           f"(limit: {sorted(accepts['grf_mode'])})")
        if "threads_per_warp" in cfg and cfg["threads_per_warp"] not in t.sub_group_sizes:
            out.append(f"{head}: threads_per_warp={cfg['threads_per_warp']} is not a sub-group size of "
                       f"{t.name} (limit: {list(t.sub_group_sizes)})")
        if nw > t.max_sub_groups:
            out.append(f"{head}: num_warps={nw} sub-groups, over the limit of {t.max_sub_groups} per work-group")
        grf = cfg.get("grf_mode", "default")
        if grf not in GRF_MODES:
            out.append(f"{head}: grf_mode={grf!r} is not one Intel's Triton accepts (limit: {sorted(GRF_MODES)})")
        elif grf in LARGE_GRF and nw > 32:
            out.append(f"{head}: grf_mode={grf!r} with num_warps={nw}: large GRF halves the threads "
                       "(limit: num_warps <= 32)")
    return out


# AMD's MI300X Triton tuning guide asks for about this many work-groups to fill the GPU.
AMD_WORK_GROUPS = 1024


def grid_notes(item: Item) -> list[str]:
    """Notes (not failures) on a persistent kernel's grid on an AMD target: the work-groups it
    launches at training sizes (units x PROGRAMS_PER_CU) against AMD's recommendation, and on RDNA,
    where a unit is a work-group processor of two CUs, fewer programs than CUs."""
    t, cfg = item.target, item.cfg
    ppc = cfg.get("PROGRAMS_PER_CU")
    if t.backend != "rocm" or not ppc or not t.units:
        return []
    out = []
    groups = t.units * ppc
    if groups < AMD_WORK_GROUPS and t.name.startswith("gfx9"):  # the guide is for CDNA
        out.append(f"{t.name}: persistent grids of {groups} work-groups ({t.units} x PROGRAMS_PER_CU {ppc}); "
                   f"AMD's MI300X guide asks for about {AMD_WORK_GROUPS}")
    if t.name.startswith("gfx1") and ppc < 2:
        out.append(f"{t.name}: PROGRAMS_PER_CU {ppc} per work-group processor (two CUs): fewer programs than CUs")
    return out


def table_limit_failures(tables: dict, targets: list[Target]) -> list[str]:
    out = []
    for t in targets:
        table = tables[t.backend]
        s = table.section_for(t.name)
        lim = s.limits
        where = f"table {table.path.name} [{s.name}] used for {t.name}"
        if lim.warp_size != t.warp_size:
            out.append(f"{where}: limits.warp_size={lim.warp_size}, but {t.name} runs {t.warp_size}-wide ({t.what})")
        if lim.max_threads_per_block > t.max_threads:
            out.append(f"{where}: limits.max_threads_per_block={lim.max_threads_per_block} over the "
                       f"target's {t.max_threads}")
        if lim.shared_mem_per_block > t.shared:
            out.append(f"{where}: limits.shared_mem_per_block={lim.shared_mem_per_block} over the "
                       f"target's {t.shared} ({t.what}); the resolver would accept configs that do not launch")
    return out


def _show(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


# --------------------------------------------------------------------------- compiling


@dataclass
class Job:
    key: str
    module: str
    fn_name: str
    signature: dict
    constexprs: dict
    attrs: dict
    target: tuple
    options: dict


def make_jobs(item: Item, describe, triton_target: tuple | None = None) -> list[tuple[Job, str]]:
    import triton

    tgt = triton_target or item.target.triton
    backend = "cuda" if tgt[0] == "cuda" else "rocm"
    out = []
    for launch in describe(item.cfg, item.problem, DTYPE):
        # The launch's own options (a helper kernel a launch makes has its own warps), else the config's.
        src = launch.options if launch.options is not None else item.cfg
        options = {"num_warps": src["num_warps"]}
        if "num_stages" in src:
            options["num_stages"] = src["num_stages"]
        for k in BACKEND_OPTIONS[backend]:
            if k in src:
                options[k] = src[k]
        fn = launch.fn
        payload = json.dumps(
            [triton.__version__, fn.cache_key, list(tgt), sorted(options.items()),
             sorted((k, repr(v)) for k, v in launch.constexprs.items()), sorted(launch.signature.items()),
             sorted(launch.aligned)],
            default=str,
        )
        key = hashlib.sha256(payload.encode()).hexdigest()
        job = Job(key, fn.fn.__module__, fn.fn.__name__, launch.signature, launch.constexprs,
                  launch.attrs(), tgt, options)
        out.append((job, launch.variant))
    return out


def _cuobjdump() -> str | None:
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return None
    path = Path(nv.__file__).parent / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def compiler_errors(text: str) -> list[str]:
    """The error lines a compiler printed (LLVM: ``error:``, and its "can't parse" attribute notes)."""
    return [line.strip() for line in text.splitlines()
            if re.search(r"\berror\b|can't parse|cannot parse", line, re.IGNORECASE)]


@contextlib.contextmanager
def _stderr_text():
    """What is written to file descriptor 2 inside the block (the C++ compilers print there), as
    the first item of the yielded list once the block ends; it is also passed on to stderr."""
    got = [""]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield got
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            got[0] = tmp.read().decode(errors="replace")
            if got[0]:
                sys.stderr.write(got[0])


def compile_job(job: Job) -> dict:
    """Compile one job (in a worker) and read what the checks need."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(job.module), job.fn_name)
    t0 = time.perf_counter()
    try:
        src = ASTSource(fn, job.signature, job.constexprs, job.attrs)
        with _stderr_text() as printed:
            k = triton.compile(src, target=GPUTarget(*job.target), options=dict(job.options))
    except Exception as e:  # the compiler's message is the report
        msg = str(e).strip().splitlines()
        return {"error": f"{type(e).__name__}: {msg[-1] if msg else ''}"[:400], "seconds": time.perf_counter() - t0}
    errors = compiler_errors(printed[0])
    if errors:  # LLVM reports some bad attributes ("can't parse ...") on stderr and carries on
        return {"error": f"the compiler printed: {errors[0]}"[:400], "seconds": time.perf_counter() - t0}
    md = k.metadata
    res: dict[str, Any] = {"shared": int(md.shared), "num_warps": int(md.num_warps), "seconds": 0.0}
    res["options"] = {o: getattr(md, o, None) for o in job.options if o not in ("num_warps", "num_stages")}
    if job.target[0] == "hip":
        text = k.asm.get("amdgcn", "")
        res["vgpr_spills"] = sum(int(x) for x in re.findall(r"\.vgpr_spill_count:\s*(\d+)", text))
        res["sgpr_spills"] = sum(int(x) for x in re.findall(r"\.sgpr_spill_count:\s*(\d+)", text))
        vg = re.findall(r"\.vgpr_count:\s*(\d+)", text)
        res["regs"] = max((int(x) for x in vg), default=None)
    else:
        tool = _cuobjdump()
        if tool and "cubin" in k.asm:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
            if m:
                res["regs"], res["stack"], res["static_shared"], res["local"] = map(int, m.groups())
    res["seconds"] = time.perf_counter() - t0
    return res


def _use_triton_cache(triton_cache: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = triton_cache


def _worker_init(triton_cache: str, parent: int) -> None:
    """A pool worker's setup. Ctrl-C is the parent's to handle: the worker ignores SIGINT (its
    compilers, e.g. ptxas, inherit that) and leads its own process group, so the parent can stop it
    and its compilers together (``_stop_workers``); on Linux it also dies with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in TERM_SIGNALS:  # not the parent's handlers, which a fork copies
        signal.signal(s, signal.SIG_DFL)
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl
            os._exit(1)
    _use_triton_cache(triton_cache)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a run (``main`` sets the handler): stops it as Ctrl-C does;
    ``args[0]`` is the signal number."""


# Signals that stop a run: Ctrl-C's SIGINT (KeyboardInterrupt), and those raising Terminated.
TERM_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
STOP_SIGNALS = (signal.SIGINT, *TERM_SIGNALS)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _signals(handler: Any, signals: tuple = STOP_SIGNALS):
    """``handler`` for ``signals`` inside the block (signal.SIG_IGN holds them off), the previous
    handlers after it; a no-op outside the main thread, where Python cannot set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _stop_workers(processes: list) -> None:
    """Kill pool workers and whatever they started (ptxas, ld.lld): each worker leads its own
    process group (``_worker_init``), so the group is killed; then the workers are reaped."""
    for p in processes:
        # Before the join: an unreaped worker's pid cannot name another process group.
        with contextlib.suppress(OSError, AttributeError):  # no group yet (just forked), or no killpg
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            p.kill()
    for p in processes:
        p.join(timeout=5)


def _store(cache_dir: Path | None, key: str, res: dict) -> Path | None:
    """Write one result to the cache (atomically: a reader never sees half a file); returns the
    folder where writing failed (a warning is printed once by the caller), else None."""
    if cache_dir is None:
        return None
    f = cache_dir / key[:2] / f"{key}.json"
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(res))
        tmp.replace(f)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            return f.parent
        raise
    return None


def run_jobs(jobs: dict[str, Job], cache_dir: Path | None, n_jobs: int) -> tuple[dict[str, dict], int]:
    """Results by job key: from the cache, else compiled in a pool and stored (``cache_dir`` None:
    no cache). Returns (results, hits).

    Ctrl-C (KeyboardInterrupt) or SIGTERM (``Terminated``, with ``main``'s handler) stops the pool
    at once: its workers and their compilers are killed, the results that finished are kept in the
    cache, the Triton scratch folder is removed once the workers are gone, and the exception is
    raised on."""
    results, todo = {}, []
    for key, job in jobs.items():
        f = cache_dir / key[:2] / f"{key}.json" if cache_dir is not None else None
        if f is not None and f.exists():
            try:
                results[key] = json.loads(f.read_text())
                continue
            except (OSError, json.JSONDecodeError):
                pass
        todo.append(job)
    hits = len(results)
    if not todo:
        return results, hits
    failed_write: list[Path] = []

    def keep(job: Job, res: dict) -> None:
        results[job.key] = res
        if failed_write:
            return
        where = _store(cache_dir, job.key, res)
        if where is not None:
            failed_write.append(where)
            print(f"warning: cannot write the result cache in {where}; results of this run are not cached",
                  file=sys.stderr)

    triton_cache = tempfile.mkdtemp(prefix="vendor_matrix_triton_")
    pool, futs = None, {}
    try:
        if n_jobs <= 1 or len(todo) == 1:
            _use_triton_cache(triton_cache)
            for job in todo:
                keep(job, compile_job(job))
        else:
            ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            pool = cf.ProcessPoolExecutor(n_jobs, mp_context=ctx, initializer=_worker_init,
                                          initargs=(triton_cache, os.getpid()))
            # Longest first (wide tiles, looped paths) so the pool ends together.
            todo.sort(key=lambda j: -sum(v for v in j.constexprs.values() if isinstance(v, int) and not isinstance(v, bool)))
            futs = {pool.submit(compile_job, j): j for j in todo}
            for f in cf.as_completed(futs):
                keep(futs[f], f.result())
            pool.shutdown()
            pool = None
    finally:
        # Interrupted (or failed): stop the pool now, then keep what finished. A second Ctrl-C
        # waits until this is done (well under a second).
        with _signals(signal.SIG_IGN):
            if pool is not None:
                processes = list((pool._processes or {}).values())  # shutdown() forgets them
                pool.shutdown(wait=False, cancel_futures=True)
                _stop_workers(processes)
                for f, job in futs.items():
                    if job.key not in results and f.done() and not f.cancelled() and f.exception() is None:
                        keep(job, f.result())
            shutil.rmtree(triton_cache, ignore_errors=True)
    return results, hits


# --------------------------------------------------------------------------- checks on results


@dataclass
class Cell:
    configs: int = 0
    compiles: int = 0
    worst_shared: int = 0
    limit: int = 0
    spills: int = 0
    failures: int = 0
    estimated: bool = False

    def text(self) -> str:
        if not self.configs:
            return "-"
        s = f"{self.configs} {'~' if self.estimated else ''}{_kib(self.worst_shared)}/{_kib(self.limit)}"
        if self.spills:
            s += f" sp{self.spills}"
        if self.failures:
            s += f" F{self.failures}"
        return s


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}K" if n >= 1024 or n == 0 else f"{n / 1024:.1f}K"


def result_failures(item: Item, variant: str, job: Job, res: dict, cell: Cell) -> tuple[list[str], list[str]]:
    """(failures, spill warnings) of one compile."""
    t = item.target
    head = (f"{item.kernel}{' (' + variant + ')' if variant else ''} on {t.name} "
            f"({_show(item.problem)}; {item.where}: {_show(item.cfg)})")
    if "error" in res:
        return [f"{head}: compile failed: {res['error']}"], []
    out, warn = [], []
    cell.compiles += 1
    cell.worst_shared = max(cell.worst_shared, res["shared"])
    if t.backend == "xpu":
        cell.estimated = True
        if res["shared"] > t.shared:
            out.append(f"{head}: about {res['shared']} B of SLM per work-group (compiled for a 32-wide "
                       f"target), over the limit of {t.shared} B ({t.what})")
        return out, warn
    if res["shared"] > t.shared:
        kind = "LDS" if t.backend == "rocm" else "shared memory"
        out.append(f"{head}: {res['shared']} B of {kind} per block, over the limit of {t.shared} B ({t.what})")
    # Spills to memory: AMD VGPR spills (scratch), NVIDIA local memory. SGPR spills go to VGPR
    # lanes, not memory: shown in the details, not counted.
    spills = res.get("vgpr_spills", 0) + res.get("local", 0)
    if spills:
        cell.spills += 1
        what = (f"{res.get('vgpr_spills', 0)} VGPR spills to scratch, {res.get('sgpr_spills', 0)} SGPR spills"
                if t.backend == "rocm" else f"{res.get('local', 0)} B of local memory per thread")
        warn.append(f"{head}: register spills ({what}; {res.get('regs')} registers), limit: no spills")
    for opt, want in job.options.items():
        if opt in ("num_warps", "num_stages"):
            continue
        got = res.get("options", {}).get(opt)
        if got != want:
            out.append(f"{head}: option {opt}={want!r} did not reach the {t.backend} compiler (metadata has "
                       f"{got!r}); Triton drops options it does not know (limit: {sorted(BACKEND_OPTIONS[t.backend])})")
    return out, warn


# --------------------------------------------------------------------------- main


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "liger_portable" / "vendor_matrix"


def cache_problem(path: Path) -> str | None:
    """Why results cannot be stored under ``path``, or None if they can: the folder is created if
    missing, and a file is written in it and removed."""
    if path.exists() and not path.is_dir():
        return "it is a file, not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def choose_cache_dir(flag: Path | None) -> tuple[Path | None, str | None]:
    """(the result cache, or None for none; an error line, or None). A folder the user named
    (``--cache-dir``, env LIGER_PORTABLE_MATRIX_CACHE) that cannot be written is an error, found
    before anything compiles; an unwritable default folder turns the cache off with a warning."""
    env = os.environ.get("LIGER_PORTABLE_MATRIX_CACHE")
    if flag is not None:
        why = cache_problem(flag)
        return flag, why and f"--cache-dir {flag}: cannot store results there ({why}); pass a writable folder"
    if env:
        why = cache_problem(Path(env))
        return Path(env), why and (f"LIGER_PORTABLE_MATRIX_CACHE={env}: cannot store results there ({why}); "
                                   "point it at a writable folder or unset it")
    path = default_cache_dir()
    why = cache_problem(path)
    if why:
        print(f"warning: cannot store results in the default cache {path} ({why}); compiling without a "
              "cache (pass --cache-dir or set LIGER_PORTABLE_MATRIX_CACHE to a writable folder)", file=sys.stderr)
        return None, None
    return path, None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=",".join([*TARGETS, "xpu"]),
                   help=f"comma-separated: {', '.join(TARGETS)}, xpu (all Intel families, static) or "
                        f"{', '.join(XPU_TARGETS)} (default: all)")
    p.add_argument("--kernels", default=None, help="comma-separated spec names (default: every spec)")
    p.add_argument("--full", action="store_true", help="also the tuner's search space over every rule's config")
    p.add_argument("--ci", action="store_true", help="fewer problem sizes (every rule still hit); for CI")
    p.add_argument("--jobs", type=at_least_one("--jobs"), default=os.cpu_count() or 1, help="compile processes (default: CPUs)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help=f"result cache (default: {default_cache_dir()}; env LIGER_PORTABLE_MATRIX_CACHE)")
    p.add_argument("--tables-dir", type=Path, default=None, help="backends/ directory to check (default: the package's)")
    p.add_argument("--fail-on-spills", action="store_true", help="register spills are failures, not warnings")
    p.add_argument("--limit", action="append", default=[], metavar="TARGET.FIELD=N",
                   help="override a limit, e.g. gfx942.shared=32768 or sm80.shared=101376 (a smaller part)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the matrix; exit status 0 (all fit), 1 (failures), 2 (bad arguments), or 128 + the
    signal (130 for Ctrl-C) when a signal stops it: one line, finished compiles kept in the cache."""
    # The kernels must be real jit functions, not the interpreter's: drop TRITON_INTERPRET before
    # anything imports liger_portable.ops (the test suite sets it).
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    args = parse_args(argv)
    try:
        with _signals(_raise_terminated, TERM_SIGNALS):
            return run(args)
    except KeyboardInterrupt as e:
        signum = e.args[0] if isinstance(e, Terminated) else signal.SIGINT
        print("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}",
              file=sys.stderr)
        return 128 + signum


def run(args: argparse.Namespace) -> int:
    """``main`` after parsing the arguments."""
    t_start = time.perf_counter()
    from liger_portable import _paths

    tables_dir = args.tables_dir or _paths.backends_dir()
    if not tables_dir.is_dir():
        print(f"--tables-dir {tables_dir}: no such folder; pass the backends/ folder holding cuda.json, rocm.json "
              "and xpu.json", file=sys.stderr)
        return 2
    try:
        tables, failures = load_tables(tables_dir)
    except OSError as e:
        print(f"--tables-dir {tables_dir}: cannot read {e.filename} ({e.strerror}); pass the backends/ folder "
              "holding cuda.json, rocm.json and xpu.json", file=sys.stderr)
        return 2
    except configs.ConfigError as e:  # JSON syntax, or a table the matrix cannot read at all
        print(f"--tables-dir {tables_dir}: {e}; fix the table or pass another backends/ folder", file=sys.stderr)
        return 2

    all_targets = {**TARGETS, **XPU_TARGETS}
    names = []
    for n in filter(None, (s.strip() for s in args.targets.split(","))):
        names += list(XPU_TARGETS) if n == "xpu" else [n]
    if not names:
        print(f"--targets {args.targets!r} names no target; pass some of: {', '.join(all_targets)}, xpu "
              "(or leave --targets out for all)", file=sys.stderr)
        return 2
    unknown = [n for n in names if n not in all_targets]
    if unknown:
        print(f"unknown target(s) {unknown}; known: {', '.join(all_targets)}, xpu", file=sys.stderr)
        return 2
    for spec in args.limit:
        m = re.fullmatch(r"([\w-]+)\.(shared|max_threads)=(\d+)", spec)
        if not m or m.group(1) not in all_targets:
            print(f"--limit {spec!r}: expected TARGET.shared=N or TARGET.max_threads=N", file=sys.stderr)
            return 2
        tgt = all_targets[m.group(1)]
        all_targets[tgt.name] = replace(tgt, **{m.group(2): int(m.group(3))},
                                        what=f"{tgt.what}; {m.group(2)} overridden to {m.group(3)} by --limit")
    targets = [all_targets[n] for n in names]
    kernels = list(SPECS) if args.kernels is None else [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels:
        print(f"--kernels {args.kernels!r} names no kernel; pass some of: {', '.join(SPECS)} "
              "(or leave --kernels out for all)", file=sys.stderr)
        return 2
    bad = [k for k in kernels if k not in SPECS]
    if bad:
        print(f"unknown kernel(s) {bad}; known: {', '.join(SPECS)}", file=sys.stderr)
        return 2
    # Before anything compiles (a cache that cannot be written used to fail only at the end).
    cache_dir, error = choose_cache_dir(args.cache_dir)
    if error:
        print(error, file=sys.stderr)
        return 2

    failures += table_limit_failures(tables, [t for t in targets if t.backend != "xpu"])
    notes: list[str] = []
    cells: dict[tuple[str, str], Cell] = {}
    planned: list[tuple[Item, str, Job, Cell]] = []
    jobs: dict[str, Job] = {}
    for kernel in kernels:
        look = cm.lookup(kernel)
        if look.describe is None:
            notes.append(f"{kernel}: skipped, {look.note}")
            continue
        for t in targets:
            col = "xpu" if t.backend == "xpu" else t.name
            cell = cells.setdefault((kernel, col), Cell(limit=t.shared))
            cell.limit = min(cell.limit, t.shared)
            seen, seen_cfg = set(), set()
            for item in enumerate_configs(tables[t.backend], t, kernel, args.full, args.ci):
                sig = json.dumps([item.cfg, item.problem], sort_keys=True)
                if sig in seen:
                    continue
                seen.add(sig)
                cfg_sig = json.dumps(item.cfg, sort_keys=True)
                if cfg_sig not in seen_cfg:
                    seen_cfg.add(cfg_sig)
                    cell.configs += 1
                notes += [n for n in grid_notes(item) if n not in notes]
                fails = static_failures(item)
                if fails:
                    cell.failures += len(fails)
                    failures += fails
                    if any("threads per block" in f for f in fails):
                        continue  # would not launch; nothing more to learn from compiling it
                try:
                    made = make_jobs(item, look.describe, XPU_SMEM_PROXY if t.backend == "xpu" else None)
                except Exception as e:
                    cell.failures += 1
                    failures.append(f"{kernel} on {t.name} ({item.where}): launch description failed: "
                                    f"{type(e).__name__}: {e}")
                    continue
                for job, variant in made:
                    jobs[job.key] = job
                    planned.append((item, variant, job, cell))

    if not any(c.configs for c in cells.values()):
        print(f"nothing to check: {'; '.join(n for n in notes if 'skipped' in n) or 'no configs'}; pass "
              f"--kernels from: {', '.join(cm.DESCRIPTIONS)}", file=sys.stderr)
        return 2
    results, hits = run_jobs(jobs, cache_dir, args.jobs)
    warnings = []
    for item, variant, job, cell in planned:
        fails, warns = result_failures(item, variant, job, results[job.key], cell)
        if args.fail_on_spills:
            fails, warns = fails + warns, []
        cell.failures += len(fails)
        failures += fails
        warnings += warns

    # ---- report
    cols = [t.name for t in targets if t.backend != "xpu"]
    if any(t.backend == "xpu" for t in targets):
        cols.append("xpu")
    width = max(14, *(len(c.text()) for c in cells.values())) if cells else 14
    kw = max([len("kernel"), *(len(k) for k in kernels)])
    print("Vendor compile matrix: configs checked, worst shared memory / limit (KiB), sp<n>: configs that spill, "
          "F<n>: failures")
    print("(xpu: static checks of xe-hpc, xe-hpg, xe2; SLM ~ estimated from a 32-wide compile)")
    print(f"{'kernel':<{kw}}  " + "  ".join(f"{c:<{width}}" for c in cols))
    for k in kernels:
        if not any((k, c) in cells for c in cols):
            continue
        print(f"{k:<{kw}}  " + "  ".join(f"{cells[(k, c)].text() if (k, c) in cells else '-':<{width}}" for c in cols))
    for n in notes:
        print(f"note: {n}")
    elapsed = time.perf_counter() - t_start
    cached = f"the cache {cache_dir}" if cache_dir is not None else "no cache"
    print(f"{len(jobs)} compiles ({hits} from {cached}, {len(jobs) - hits} compiled with "
          f"{args.jobs} jobs), {elapsed:.1f} s")
    if warnings:
        print(f"\n{len(warnings)} SPILL WARNING(S) (slow, not a launch failure; --fail-on-spills makes them failures):")
        for w in warnings:
            print(f"SPILL {w}")
    if failures:
        print(f"\n{len(failures)} FAILURE(S):")
        for f in failures:
            print(f"FAIL {f}")
        return 1
    print("OK: every config fits its target's limits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
