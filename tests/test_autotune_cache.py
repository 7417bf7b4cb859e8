"""Autotune cache writing, the tuner (with fake timers) and rank agreement, all on the CPU.

Writes: many processes at once lose nothing and never expose half a file; corrupt, truncated and
foreign-format files warn once and are replaced by the next write; an unwritable location keeps
entries in memory (one warning). Keys: a kernel-version change drops only that kernel's entries;
problems in one bucket share an entry. The tuner picks the fastest legal config, never one slower
than the table default beyond noise, skips configs that raise. LIGER_PORTABLE_AUTOTUNE=1 tunes a
miss once through the registered hook, under the device model's tuning lock: processes that share
the cache folder tune each problem once and agree (gloo ranks, no collectives in resolve), a dead
holder releases the lock at once, a live one makes a waiter fall back to the table after the
timeout; with an unshareable (unwritable) cache a multi-rank job does not tune. ``agree`` under
gloo: ranks of one device model take their leader's choice.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import types
import time
import warnings
from pathlib import Path

import pytest
import torch

import liger_portable

from liger_portable import autotune_cache, configs, _paths, hardware, specs, tuning
from liger_portable.tuning import runtime, search, timing
from liger_portable.configs import ENV_AUTOTUNE, load_table, resolve, table_config
from liger_portable.hardware import ENV_BACKEND, DeviceInfo
from liger_portable.specs import SPECS

H200 = DeviceInfo("cuda", 0, "NVIDIA H200", "sm90", 32, 132, 1024, 232448)
MI300 = DeviceInfo("rocm", 0, "AMD Instinct MI300X", "gfx942", 64, 304, 1024, 65536)
KERNEL = "rms_norm_fwd"
SPEC = SPECS[KERNEL]
NAMED = {"n_cols": 4096, "n_rows": 1000}
PROBLEM = (4096, 1000)
CFG = {"num_warps": 2, "num_stages": 3, "BLOCK_M": 2, "BLOCK_N_MAX": 4096}


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Private user and shipped caches, no autotuning, fresh memos and hooks in every test."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_AUTOTUNE, raising=False)
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(tmp_path / "user_cache"))
    shipped = tmp_path / "shipped_cache"
    shipped.mkdir()
    monkeypatch.setattr(_paths, "shipped_cache_dir", lambda: shipped)
    hardware.reset()
    autotune_cache.clear_overlay()
    runtime.reset_runtime()
    # only the fake hooks of these tests: the real ones (tuning.hooks) would launch on a GPU
    runtime.reset_hooks(defaults=False)
    yield
    runtime.reset_hooks()
    runtime.reset_runtime()
    autotune_cache.clear_overlay()
    hardware.reset()


def user_file(dev: DeviceInfo = H200) -> Path:
    return autotune_cache.user_cache_file(dev)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def rows(i: int) -> dict:
    """A problem whose bucket is distinct for each i (n_cols is not bucketed)."""
    return {"n_cols": 128 + i, "n_rows": 64}


# --------------------------------------------------------------------------- writing


def test_record_writes_entry_with_metadata():
    key = autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    data = load(user_file())
    assert data["format"] == autotune_cache.FORMAT and data["device"] == "NVIDIA H200"
    e = data["entries"][key]
    assert e["config"] == CFG and e["time_ms"] == 0.05 and e["default_ms"] == 0.06
    assert e["measured_at"].endswith("Z") and e["versions"]["torch"] == torch.__version__
    assert set(e["versions"]) == {"torch", "triton"}
    assert not list(user_file().parent.glob("*.tmp")), "temporary file left behind"


def test_record_visible_to_lookup_and_resolve_immediately():
    assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
    assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == []  # memoized empty read
    autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    assert [c for c, _ in autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)] == [CFG]
    r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert r.source == "user cache NVIDIA_H200.json" and r.config.to_dict() == CFG


def test_record_merges_with_existing_entries():
    k1 = autotune_cache.record(SPEC, H200, rows(1), torch.bfloat16, CFG, 0.05, 0.06)
    k2 = autotune_cache.record(SPEC, H200, rows(2), torch.float16, CFG, 0.07, 0.08)
    k3 = autotune_cache.record(SPEC, H200, rows(1), torch.bfloat16, {**CFG, "num_warps": 4}, 0.04, 0.06)
    entries = load(user_file())["entries"]
    assert k1 == k3 and set(entries) == {k1, k2}
    assert entries[k1]["config"]["num_warps"] == 4  # the newer result replaces the older


def _writer(proc: int, n: int) -> None:
    for i in range(n):
        autotune_cache.record(SPEC, H200, rows(proc * 1000 + i), torch.bfloat16, CFG, 0.01 * (i + 1), 0.5)


@pytest.mark.skipif(sys.platform == "win32" or "fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_concurrent_writers_lose_nothing_and_readers_never_see_half_a_file():
    n_proc, n_each = 6, 20
    path = user_file()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(p, n_each)) for p in range(n_proc)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):  # read while they write: always a whole file
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        json.loads(text)
        reads += 1
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    entries = load(path)["entries"]
    expected = {autotune_cache.entry_key(SPEC, rows(p * 1000 + i), torch.bfloat16) for p in range(n_proc) for i in range(n_each)}
    assert set(entries) == expected and len(entries) == n_proc * n_each
    assert not list(path.parent.glob("*.tmp"))
    assert reads > 0


def test_threads_in_one_process_lose_nothing():
    import threading

    threads = [threading.Thread(target=_writer, args=(p, 10)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(load(user_file())["entries"]) == 40


BAD_FILES = {
    "truncated": b'{"format": 1, "device": "NVIDIA H200", "entries": {"rms_norm_fwd|abc',
    "garbage": b"\xff\xfe\x00garbage\x80",
    "empty": b"",
    "older-format": json.dumps({"format": 0, "device": "NVIDIA H200", "entries": {"x": {}}}).encode(),
    "foreign-shape": json.dumps([1, 2, 3]).encode(),
}


@pytest.mark.parametrize("content", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_bad_file_warns_once_then_is_repaired_by_next_write(content):
    path = user_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == []
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
        key = autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
        hits = list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16))
    msgs = [str(w.message) for w in rec if "autotune cache" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert str(path) in msgs[0] and ("replaces" in msgs[0] or "warmup" in msgs[0])
    data = load(path)
    assert data["format"] == autotune_cache.FORMAT and list(data["entries"]) == [key]  # nothing kept
    assert hits == [(CFG, "user cache NVIDIA_H200.json")]


def test_newer_format_file_is_kept_and_the_entry_stays_in_memory():
    """A file a newer version wrote (a higher format) is neither read nor replaced: another install
    sharing the folder keeps its entries; this process keeps its own in memory, with a warning."""
    path = user_file()
    path.parent.mkdir(parents=True)
    newer = json.dumps({"format": autotune_cache.FORMAT + 1, "device": "NVIDIA H200", "entries": {"x": {}}}).encode()
    path.write_bytes(newer)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == []
        autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    msgs = [str(w.message) for w in rec]
    assert any("written by a newer liger-portable" in m and "the file is kept" in m for m in msgs), msgs
    assert any("cannot write the autotune cache" in m and "use the newer liger-portable" in m for m in msgs), msgs
    assert path.read_bytes() == newer
    assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == [(CFG, "user cache NVIDIA_H200.json (in memory)")]


def test_files_of_a_shared_folder_take_the_umask(monkeypatch):
    """The cache and its lock files get the permissions the umask leaves (a team's group-writable
    folder stays writable by all its users, not only by whoever wrote first); a lock file another
    user owns and this one may not write is opened to read, which is all flock needs."""
    old = os.umask(0o002)
    try:
        autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    finally:
        os.umask(old)
    path = user_file()
    for f in (path, path.with_name(path.name + ".lock")):
        assert f.stat().st_mode & 0o777 == 0o664, (f, oct(f.stat().st_mode))
    real_open = os.open

    def not_ours(p, flags, *mode):
        if str(p).endswith(".lock") and flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *mode)

    monkeypatch.setattr(autotune_cache.os, "open", not_ours)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        key = autotune_cache.record(SPEC, H200, rows(1), torch.bfloat16, CFG, 0.05, 0.06)
    assert key in load(path)["entries"] and len(load(path)["entries"]) == 2


def test_a_refused_chmod_or_fsync_still_writes(monkeypatch):
    """File systems that refuse chmod (CIFS, gcsfuse) or fsync (some FUSE mounts) keep the cache
    on disk: both are best effort."""
    import errno

    def no_chmod(*a, **k):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def no_fsync(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(autotune_cache.os, "chmod", no_chmod)
    monkeypatch.setattr(autotune_cache.os, "fsync", no_fsync)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        key = autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    assert list(load(user_file())["entries"]) == [key] and not autotune_cache.in_memory_only(H200)


def test_a_held_write_lock_times_out_and_a_later_write_saves_what_memory_kept(monkeypatch):
    """A write lock held by a stopped process makes record() keep the entry in memory after a
    bounded wait (it waited forever), naming the lock file; once a write succeeds again, the
    entries kept in memory are written with it and the cache is shared again (tuning lock too)."""
    import fcntl

    monkeypatch.setattr(autotune_cache, "WRITE_LOCK_TIMEOUT_S", 0.2)
    path = user_file()
    path.parent.mkdir(parents=True)
    lock = path.with_name(path.name + ".lock")
    holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)  # another open file: flock excludes it too
    fcntl.flock(holder, fcntl.LOCK_EX)
    import threading

    done = []
    try:  # in a thread, so that a wait without end fails the test instead of hanging it
        writer = threading.Thread(target=lambda: done.append(
            autotune_cache.record(SPEC, H200, rows(0), torch.bfloat16, CFG, 0.05, 0.06)), daemon=True)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            writer.start()
            writer.join(10)
        assert done, "record() still waits on the held write lock"
        first = done[0]
        assert any(f"held {lock}" in str(w.message) and "cannot write the autotune cache" in str(w.message) for w in rec)
        assert autotune_cache.in_memory_only(H200)
    finally:
        os.close(holder)
    second = autotune_cache.record(SPEC, H200, rows(1), torch.bfloat16, CFG, 0.05, 0.06)
    assert set(load(path)["entries"]) == {first, second}
    assert not autotune_cache.in_memory_only(H200)
    with autotune_cache.tuning_lock(H200, 1.0) as got:
        assert got


def test_lock_holder_of_a_foreign_lock_file_is_a_string():
    """The tuning lock's holder line is for messages: bytes that are not UTF-8 never raise."""
    f = autotune_cache.tuning_lock_file(H200)
    f.parent.mkdir(parents=True)
    f.write_bytes(b"\xff\xfe host \x80 pid 7\n")
    assert "pid 7" in autotune_cache.lock_holder(H200)


def test_bad_file_repaired_by_write_without_prior_read():
    path = user_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(BAD_FILES["truncated"])
    with pytest.warns(RuntimeWarning, match="unreadable autotune cache"):
        key = autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    assert list(load(path)["entries"]) == [key]


def _assert_overlay(rec, path: Path) -> None:
    msgs = [str(w.message) for w in rec if "cannot write the autotune cache" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert str(path) in msgs[0] and _paths.ENV_CACHE_DIR in msgs[0]
    hits = list(autotune_cache.lookup(SPEC, H200, rows(0), torch.bfloat16))
    assert hits and hits[0] == (CFG, "user cache NVIDIA_H200.json (in memory)")
    assert len([1 for i in range(3) if list(autotune_cache.lookup(SPEC, H200, rows(i), torch.bfloat16))]) == 3
    r = resolve(KERNEL, H200, tuple(rows(1).values()), torch.bfloat16)
    assert r.source == "user cache NVIDIA_H200.json (in memory)" and r.config.to_dict() == CFG


def test_unwritable_location_simulated_degrades_to_memory(monkeypatch):
    def deny(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(autotune_cache.os, "replace", deny)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(3):
            autotune_cache.record(SPEC, H200, rows(i), torch.bfloat16, CFG, 0.05, 0.06)  # never raises
        _assert_overlay(rec, user_file())
    assert not user_file().exists() and not list(user_file().parent.glob("*.tmp"))


def test_entry_kept_in_memory_is_a_usable_entry(monkeypatch):
    """An entry an unwritable cache keeps in memory is this process's user-cache entry for
    usable_entry too (lookup_entry reads the in-memory entries first), with its times: the warmup
    then counts it as cached instead of tuning it again, as resolve already uses it."""
    def deny(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(autotune_cache.os, "replace", deny)
    with pytest.warns(RuntimeWarning, match="cannot write the autotune cache"):
        autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    assert autotune_cache.in_memory_only(H200) and not user_file().exists()
    entry = configs.usable_entry(SPEC, H200, NAMED, torch.bfloat16)
    assert entry is not None and entry["config"] == CFG
    assert (entry["time_ms"], entry["default_ms"]) == (0.05, 0.06)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_directory_degrades_to_memory():
    d = user_file().parent
    d.mkdir(parents=True)
    d.chmod(0o500)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for i in range(3):
                autotune_cache.record(SPEC, H200, rows(i), torch.bfloat16, CFG, 0.05, 0.06)
            _assert_overlay(rec, user_file())
    finally:
        d.chmod(0o700)


def test_cache_dir_is_a_file_degrades_to_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(blocker / "sub"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(3):
            autotune_cache.record(SPEC, H200, rows(i), torch.bfloat16, CFG, 0.05, 0.06)
        _assert_overlay(rec, user_file())


# --------------------------------------------------------------------------- keys


def test_kernel_version_change_invalidates_only_that_kernel(monkeypatch):
    autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    other = SPECS["layer_norm_fwd"]
    autotune_cache.record(other, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    real_hash = specs.source_hash  # rms_norm.py changed:
    monkeypatch.setattr(specs, "source_hash", lambda rel: "0123456789ab" if rel == SPEC.source else real_hash(rel))
    hardware.reset()
    assert SPEC.version == "0123456789ab"
    assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == []
    assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
    assert [c for c, _ in autotune_cache.lookup(other, H200, NAMED, torch.bfloat16)] == [CFG]


def test_kernel_version_covers_the_sibling_modules_it_imports(tmp_path, monkeypatch, request):
    """A kernel's version hashes its file and the ``from .x import`` siblings it uses, recursively
    (FLCE launches cross_entropy.py's kernel; the norms load through _tiles.py): a change to a
    helper module invalidates the entries of every kernel built on it."""
    files = [p.name for p in specs.source_files(specs.SOURCE_ROOT / "ops/fused_linear_cross_entropy.py", set())]
    assert files == ["fused_linear_cross_entropy.py", "cross_entropy.py"]
    assert "_tiles.py" in [p.name for p in specs.source_files(specs.SOURCE_ROOT / "ops/layer_norm.py", set())]
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops/a.py").write_text("from .b import f\n")
    (tmp_path / "ops/b.py").write_text("from .a import g\nx = 1\n")  # a cycle ends
    monkeypatch.setattr(specs, "SOURCE_ROOT", tmp_path)
    specs.forget_source_hashes()
    request.addfinalizer(specs.forget_source_hashes)  # nothing hashed under tmp_path is kept
    before = specs.source_hash("ops/a.py")
    (tmp_path / "ops/b.py").write_text("from .a import g\nx = 2\n")
    specs.forget_source_hashes()
    assert specs.source_hash("ops/a.py") != before


def test_flce_chunk_sizing_outside_ops_is_pinned():
    """The fused linear cross-entropy sizes its token chunks with ``fallback.cross_entropy.chunk_rows``,
    which its kernel version does not hash (only ``ops/`` siblings are followed): a tuned
    ``CHUNK_TOKENS`` means what it measured only while that function is unchanged. Its text is
    pinned here; whoever changes it must also change the FLCE version (any edit of
    ops/fused_linear_cross_entropy.py outside its autograd section) and re-warm the shipped files."""
    import hashlib
    import inspect

    from liger_portable.fallback.cross_entropy import chunk_rows

    assert hashlib.sha256(inspect.getsource(chunk_rows).encode()).hexdigest()[:12] == "9091fd5c90aa", (
        "chunk_rows changed: bump the fused linear cross-entropy's kernel version and re-warm "
        "autotune_cache/ (see this test's docstring), then update the pinned hash"
    )


def test_kernel_version_leaves_out_the_autograd_sections():
    """Editing a family's autograd section (how a launch is reached) keeps its tuned entries; an
    edit anywhere else (kernels, launch plans, specs and examples) does not."""
    rule = "# " + "-" * 75
    text = f"kernel = 1\n{rule} autograd\nclass F: pass\n{rule} specs and examples\nspec = 1\n"
    assert specs.versioned_text(text) == f"kernel = 1\n{rule} specs and examples\nspec = 1\n"
    assert specs.versioned_text(text.replace("class F: pass", "class G: pass")) == specs.versioned_text(text)
    assert specs.versioned_text(text.replace("spec = 1", "spec = 2")) != specs.versioned_text(text)
    assert specs.versioned_text(text.replace("kernel = 1", "kernel = 2")) != specs.versioned_text(text)
    assert specs.versioned_text("no sections\n") == "no sections\n"
    assert specs.versioned_text(f"k = 1\n{rule} fused add autograd\nx = 1\n") == "k = 1\n"


def test_triton_version_is_part_of_the_key(monkeypatch):
    autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    monkeypatch.setattr(autotune_cache, "triton_major_minor", lambda: "99.1")
    assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == []


def test_key_holds_tritons_major_minor_only(monkeypatch):
    """The key holds Triton's major.minor of the installed version: a patch release or a local
    build of the same minor (3.4.1, 3.4.0+git...) keeps the tuned entries, the next minor drops
    them. (The test above replaces triton_major_minor itself, so it cannot see how the version
    string is cut.)"""
    p = hardware.platform()
    monkeypatch.setattr(p, "triton_version", "3.4.0")
    key = autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    assert key.split("|")[2] == "triton3.4"
    for same in ("3.4.1", "3.4.0+git1234abcd"):
        monkeypatch.setattr(p, "triton_version", same)
        assert [c for c, _ in autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)] == [CFG], same
    monkeypatch.setattr(p, "triton_version", "3.5.0")
    assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == []


def test_problem_bucketing():
    autotune_cache.record(SPEC, H200, {"n_cols": 4096, "n_rows": 1000}, torch.bfloat16, CFG, 0.05, 0.06)
    assert list(autotune_cache.lookup(SPEC, H200, {"n_cols": 4096, "n_rows": 1024}, torch.bfloat16))
    assert list(autotune_cache.lookup(SPEC, H200, {"n_cols": 4096, "n_rows": 513}, torch.bfloat16))
    assert not list(autotune_cache.lookup(SPEC, H200, {"n_cols": 4096, "n_rows": 1025}, torch.bfloat16))
    assert not list(autotune_cache.lookup(SPEC, H200, {"n_cols": 4097, "n_rows": 1000}, torch.bfloat16))
    assert not list(autotune_cache.lookup(SPEC, H200, {"n_cols": 4096, "n_rows": 1000}, torch.float16))
    assert not list(autotune_cache.lookup(SPEC, MI300, {"n_cols": 4096, "n_rows": 1000}, torch.bfloat16))
    entries = load(user_file())["entries"]
    assert len(entries) == 1 and list(entries)[0].endswith("|bfloat16|n_cols=4096,n_rows=1024")


# --------------------------------------------------------------------------- tuner


def default_of(dev: DeviceInfo, named: dict = NAMED, kernel: str = KERNEL) -> dict:
    return dict(table_config(load_table(dev.backend), dev.arch, kernel, named)[0])


def fake_run(times: dict, fallback: float = 1.0, raises=lambda cfg: False):
    """``run(resolved) -> ms`` looked up by (num_warps, BLOCK_M); records the configs it saw."""
    seen: list[dict] = []

    def run(r):
        cfg = r.config.to_dict()
        seen.append(cfg)
        if raises(cfg):
            raise RuntimeError("out of resources: shared memory")
        return times.get((cfg["num_warps"], cfg["BLOCK_M"]), fallback)

    run.seen = seen
    return run


@pytest.mark.parametrize("dev", [H200, MI300], ids=["cuda", "rocm"])
def test_candidates_are_legal_distinct_and_exclude_default(dev):
    cands = search.candidates(KERNEL, dev, NAMED)
    default = default_of(dev)
    assert cands and default not in cands
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    for c in cands:
        assert set(c) >= set(default)  # the search may add backend options (waves_per_eu)
        configs.check_config(c, SPEC, dev.backend, configs.Limits.of(dev), "test")


def test_candidates_respect_device_limits():
    small = DeviceInfo("cuda", 0, "Tiny GPU", "sm90", 32, 8, 256, 232448)  # at most 8 warps
    cands = search.candidates(KERNEL, small, NAMED)
    assert cands and all(c["num_warps"] <= 8 for c in cands)


def test_tuner_picks_fastest_legal_config_and_records_it():
    cands = search.candidates(KERNEL, H200, NAMED)
    target = cands[len(cands) // 2]
    run = fake_run({(target["num_warps"], target["BLOCK_M"]): 0.1})
    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, run)
    assert res.source == "search" and res.default_ms == 1.0 and res.time_ms == 0.1
    assert (res.config["num_warps"], res.config["BLOCK_M"]) == (target["num_warps"], target["BLOCK_M"])
    assert run.seen[0] == default_of(H200) and len(run.seen) == len(cands) + 1
    assert res.gain == pytest.approx(0.9)
    e = load(user_file())["entries"][res.key]
    assert e["config"] == res.config and e["time_ms"] == 0.1 and e["default_ms"] == 1.0
    r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert r.source.startswith("user cache") and r.config.to_dict() == res.config


@pytest.mark.parametrize("best_ratio", [1.5, 1.0, 0.99, 1.0 - search.NOISE])
def test_tuner_never_picks_slower_or_within_noise(best_ratio):
    default = default_of(H200)
    # every searched config is slower, equal, only 1% faster, or exactly the noise margin (2%)
    # faster (a config must beat the default by more than the margin): the table default is kept
    run = fake_run({(default["num_warps"], default["BLOCK_M"]): 1.0}, fallback=best_ratio)
    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, run)
    assert res.source == "table default" and res.config == default and res.time_ms == res.default_ms == 1.0
    assert load(user_file())["entries"][res.key]["config"] == default


def test_tuner_beyond_noise_wins():
    default = default_of(H200)
    run = fake_run({(default["num_warps"], default["BLOCK_M"]): 1.0}, fallback=0.97)
    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, run)
    assert res.source == "search" and res.time_ms == 0.97


def test_tuner_tie_goes_to_the_earlier_candidate():
    """Two searched configs timed equal, both beyond noise: the one earlier in the search order
    wins (a later equal time does not replace it), so a tie is decided the same way in every run."""
    cands = search.candidates(KERNEL, H200, NAMED)
    first, later = cands[1], cands[-2]
    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16,
                      lambda r: 0.5 if r.config.to_dict() in (first, later) else 1.0, record=False)
    assert res.source == "search" and res.time_ms == 0.5 and res.config == first


def test_default_timed_again_after_a_parallel_compile_keeps_its_best_time(monkeypatch):
    """After a parallel compile (the warmup's dedicated tuning) the table default is timed again
    once the search is done and the better of its two times counts: a default that reads slower
    the second time (clocks drifting) cannot make a searched config slower than its first time
    look like a gain."""
    monkeypatch.setattr(search, "precompile", lambda *a, **k: "parallel compile on 2 threads")
    default = default_of(H200)
    default_times = iter([1.0, 1.0, 1.3])  # the untimed wake-up, the timing, the timing after the search

    def run(r):
        return next(default_times) if r.config.to_dict() == default else 1.1

    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, run, record=False, dedicated=True)
    assert res.compile.startswith("parallel") and next(default_times, None) is None
    assert res.source == "table default" and res.config == default and res.default_ms == res.time_ms == 1.0


def test_tuner_skips_configs_that_raise():
    cands = search.candidates(KERNEL, H200, NAMED)
    fastest = cands[0]
    run = fake_run({(fastest["num_warps"], fastest["BLOCK_M"]): 0.01, (cands[-1]["num_warps"], cands[-1]["BLOCK_M"]): 0.5},
                   raises=lambda c: (c["num_warps"], c["BLOCK_M"]) == (fastest["num_warps"], fastest["BLOCK_M"]))
    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, run)
    assert res.skipped and all("out of resources" in err for _, err in res.skipped)
    assert res.time_ms == 0.5 and (res.config["num_warps"], res.config["BLOCK_M"]) != (fastest["num_warps"], fastest["BLOCK_M"])


def test_tuner_when_default_fails_and_when_all_fail():
    default = default_of(H200)
    is_default = lambda c: c == default  # noqa: E731
    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, fake_run({}, fallback=0.3, raises=is_default))
    assert res.default_ms is None and res.time_ms == 0.3 and res.source == "search"
    assert load(user_file())["entries"][res.key]["default_ms"] is None
    res = search.tune(KERNEL, H200, (4096, 5000), torch.bfloat16, fake_run({}, raises=lambda c: True))
    assert res.time_ms is None and res.config == default
    assert res.key not in load(user_file())["entries"]  # nothing measured, nothing recorded


def test_tuner_with_injected_timer():
    calls = []

    def launch(r):
        calls.append(r.config.num_warps)

    def timer(fn):
        fn()
        return 1.0 / calls[-1]  # more warps is faster in this fake

    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, launch, timer=timer, record=False)
    assert res.config["num_warps"] == max(c["num_warps"] for c in search.candidates(KERNEL, H200, NAMED))
    assert not user_file().exists()


def test_tuner_bad_timer_value_is_skipped():
    res = search.tune(KERNEL, H200, PROBLEM, torch.bfloat16, lambda r: float("nan"), record=False)
    assert res.time_ms is None and len(res.skipped) == len(search.candidates(KERNEL, H200, NAMED)) + 1


# --------------------------------------------------------------------------- runtime tuning


def _hook(times: dict | None = None):
    calls = []

    def hook(device, named, dtype):
        calls.append((device.model_slug, dict(named), dtype))
        return fake_run(times or {}, fallback=1.0)

    hook.calls = calls
    return hook


def test_tuning_runs_on_the_devices_gpu(monkeypatch):
    """Tuning for a GPU that is not the current one (a model split over GPUs: run-time tuning, or
    tune() called for it) makes that GPU current while the configs are compiled and timed (the
    timing's events, streams and graphs are the current device's); a simulated device (CPU tensors)
    enters no device."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(("device", index))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(search, "platform", lambda: types.SimpleNamespace(backend="cuda", torch_device_type="cuda"))  # a CUDA machine
    gpu1 = DeviceInfo("cuda", 1, "NVIDIA H200", "sm90", 32, 132, 1024, 232448)
    with liger_portable.simulate(None):
        with search.on_device(gpu1):
            entered.append("inside")
    assert entered == [("device", 1), "inside"]
    with liger_portable.simulate(H200), search.on_device(H200):
        assert entered == [("device", 1), "inside"]
    # run-time tuning: the hook builds the inputs, tune() times them on the device
    entered.clear()
    hook = _hook()

    def timed(ms):
        def run(resolved):
            entered.append(("timed", ms))
            return ms
        return run

    def hooked(device, named, dtype):
        hook(device, named, dtype)
        return timed(1.0)

    runtime.register_hook(KERNEL, hooked)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    with liger_portable.simulate(None):
        resolve(KERNEL, gpu1, PROBLEM, torch.bfloat16)
    assert entered[0] == ("device", 1) and len(entered) > 1 and set(entered[1:]) == {("timed", 1.0)}
    assert len(hook.calls) == 1


def test_miss_without_env_uses_table_and_does_not_tune():
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
    assert hook.calls == [] and not user_file().exists()


@pytest.mark.parametrize("value, tunes", [("true", True), ("YES", True), ("on", True), ("0", False),
                                           ("off", False), ("", False)])
def test_autotune_env_takes_the_usual_true_and_false_values(monkeypatch, value, tunes):
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, value)
    resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert bool(hook.calls) is tunes


def test_autotune_env_other_value_warns_and_stays_off(monkeypatch):
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "please")
    with pytest.warns(RuntimeWarning, match="LIGER_PORTABLE_AUTOTUNE='please' is not a true or false value"):
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
    assert hook.calls == []


def test_autotune_env_miss_tunes_once_and_records(monkeypatch):
    cands = search.candidates(KERNEL, H200, NAMED)
    target = cands[-1]
    hook = _hook({(target["num_warps"], target["BLOCK_M"]): 0.2})
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert hook.calls == [("NVIDIA_H200", NAMED, torch.bfloat16)]
    assert r.source == "user cache NVIDIA_H200.json"
    assert (r.config.num_warps, r.config["BLOCK_M"]) == (target["num_warps"], target["BLOCK_M"])
    # same bucket, and after the resolve memo is dropped: read from the cache, no second tuning
    assert resolve(KERNEL, H200, (4096, 600), torch.bfloat16).source == "user cache NVIDIA_H200.json"
    hardware.reset()
    assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).config == r.config
    assert len(hook.calls) == 1
    # another bucket tunes once more
    resolve(KERNEL, H200, (4096, 5000), torch.bfloat16)
    assert len(hook.calls) == 2 and len(load(user_file())["entries"]) == 2


def test_autotune_once_per_process_even_if_unrecorded(monkeypatch):
    hook = _hook()
    hook_all_fail = lambda d, n, t: (hook.calls.append(1), fake_run({}, raises=lambda c: True))[1]  # noqa: E731
    runtime.register_hook(KERNEL, hook_all_fail)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    for _ in range(2):
        hardware.reset()
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
    assert len(hook.calls) == 1


def test_autotune_hook_error_never_raises(monkeypatch):
    def bad_hook(device, named, dtype):
        raise MemoryError("cannot allocate the tuning inputs")

    runtime.register_hook(KERNEL, bad_hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    with pytest.warns(RuntimeWarning, match="tuning rms_norm_fwd .* failed"):
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")


def test_autotune_without_hook_warns_and_uses_table(monkeypatch):
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    with pytest.warns(RuntimeWarning, match="no tuning hook"):
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")


def test_autotune_never_during_graph_capture(monkeypatch):
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
        assert resolve(KERNEL, H200, (4096, 5000), torch.bfloat16).source.startswith("table")
    assert hook.calls == []
    assert len([w for w in rec if "CUDA-graph capture" in str(w.message)]) == 1


def test_autotune_cache_hit_does_not_tune(monkeypatch):
    autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).config.to_dict() == CFG
    assert hook.calls == []


def test_autotune_all_configs_failing_warns(monkeypatch):
    runtime.register_hook(KERNEL, lambda d, n, t: fake_run({}, raises=lambda c: True))
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    with pytest.warns(RuntimeWarning, match=r"tuning rms_norm_fwd .*: no config ran \(RuntimeError: out of resources"):
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")


def test_unusable_cached_entry_is_a_miss_that_tuning_replaces(monkeypatch):
    """An entry resolve cannot use (here 64 warps, over the device's limit; e.g. written by another
    version of the package) is ignored with a warning and, with autotuning on, tuned again and
    replaced, instead of blocking tuning for good."""
    bad = {**CFG, "num_warps": 64}
    key = autotune_cache.entry_key(SPEC, NAMED, torch.bfloat16)
    autotune_cache.write_entries(user_file(), H200.name, {key: autotune_cache.make_entry(bad, 0.01, 0.02)})
    assert configs.usable_entry(SPEC, H200, NAMED, torch.bfloat16) is None
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    with pytest.warns(RuntimeWarning, match="ignoring a cached config"):
        r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert len(hook.calls) == 1 and r.source == "user cache NVIDIA_H200.json"
    assert load(user_file())["entries"][key]["config"]["num_warps"] != 64
    assert configs.usable_entry(SPEC, H200, NAMED, torch.bfloat16)["config"] == r.config.to_dict()


def test_cached_tile_over_tritons_limit_is_ignored():
    """Each field within its range, the tile too large for Triton (64 rows x 32768 columns = 2**21
    values): one warning and the table default, not a launch that fails to compile."""
    named = {"n_cols": 32768, "n_rows": 64}
    cfg = {"num_warps": 32, "num_stages": 1, "BLOCK_M": 64, "BLOCK_N_MAX": 32768}
    autotune_cache.record(SPEC, H200, named, torch.float32, cfg, 0.01, 0.02)
    with pytest.warns(RuntimeWarning, match=r"ignoring a cached config: .*tile of 2097152 values .* over Triton's 1048576"):
        r = resolve(KERNEL, H200, (32768, 64), torch.float32)
    assert r.source.startswith("table")
    assert configs.usable_entry(SPEC, H200, named, torch.float32) is None


def test_cached_tile_at_tritons_limit_is_used():
    """A tile of exactly Triton's limit (32 rows x 32768 columns = 2**20 values) compiles (Triton
    refuses only more): the cached config is used, without a warning."""
    named = {"n_cols": 32768, "n_rows": 64}
    cfg = {"num_warps": 32, "num_stages": 1, "BLOCK_M": 32, "BLOCK_N_MAX": 32768}
    autotune_cache.record(SPEC, H200, named, torch.float32, cfg, 0.01, 0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = resolve(KERNEL, H200, (32768, 64), torch.float32)
    assert r.source == "user cache NVIDIA_H200.json" and r.config.to_dict() == cfg
    assert configs.usable_entry(SPEC, H200, named, torch.float32)["config"] == cfg


def test_usable_entry_reads_bad_times_as_none():
    key = autotune_cache.entry_key(SPEC, NAMED, torch.bfloat16)
    autotune_cache.write_entries(user_file(), H200.name, {key: {"config": CFG, "time_ms": "0.05", "default_ms": True}})
    entry = configs.usable_entry(SPEC, H200, NAMED, torch.bfloat16)
    assert entry["config"] == CFG and entry["time_ms"] is None and entry["default_ms"] is None


@pytest.mark.parametrize("answer", ["ENOSYS", "EBADF"])
def test_file_system_without_locking_falls_back_to_memory(monkeypatch, answer):
    """flock() failing as on a file system that does not lock (Lustre without -o flock: ENOSYS), or
    as Linux NFS answers a lock of a file opened to read (another user's lock file: EBADF), neither
    stops the kernel call nor tuning: the tuned entry is kept in memory, as with an unwritable folder."""
    import errno

    def no_flock(fd, op):
        raise OSError(getattr(errno, answer), os.strerror(getattr(errno, answer)))

    monkeypatch.setattr(autotune_cache.fcntl, "flock", no_flock)
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    with pytest.warns(RuntimeWarning, match="cannot write the autotune cache"):
        r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert len(hook.calls) == 1 and r.source == "user cache NVIDIA_H200.json (in memory)"


def _no_home(monkeypatch, tmp_path):
    """No cache variables, Path.home() raising as without HOME and a user entry, and the temporary
    folder under tmp_path."""
    import tempfile
    from pathlib import Path as P

    monkeypatch.delenv(_paths.ENV_CACHE_DIR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home(cls=None):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(P, "home", classmethod(no_home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"liger_portable-{os.getuid()}"


def test_no_home_directory_uses_a_temporary_folder(monkeypatch, tmp_path):
    """Without HOME and without a user entry Path.home() raises: the cache folder is one of this
    user's in the temporary folder, created private, with a warning once, and resolving still works."""
    shared = _no_home(monkeypatch, tmp_path)
    with pytest.warns(UserWarning, match="no home directory"):
        where = _paths.user_cache_dir()
    assert where == shared and where.is_dir() and (where.stat().st_mode & 0o777) == 0o700
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _paths.user_cache_dir() == shared
    assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")


def test_no_home_directory_makes_an_open_folder_of_ours_private(monkeypatch, tmp_path):
    """This user's folder of that name, left open (0777: an older version, a umask), is made private."""
    shared = _no_home(monkeypatch, tmp_path)
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(UserWarning, match="no home directory"):
        assert _paths.user_cache_dir() == shared
    assert (shared.stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize("planted", ["link", "file", "other user"])
def test_no_home_directory_distrusts_a_planted_folder(monkeypatch, tmp_path, planted):
    """The temporary folder's name is predictable: a link, a file or another user's folder of that
    name is not used (another user could plant configs or redirect our writes); a fresh private folder
    serves the process, and the warning says so."""
    shared = _no_home(monkeypatch, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "link":
        shared.symlink_to(elsewhere)
    elif planted == "file":
        shared.write_text("{}")
    else:
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)  # the folder made below is then another user's
        shared = tmp_path / f"liger_portable-{real + 1}"
        shared.mkdir()
    with pytest.warns(UserWarning, match="is not a directory of this user's") as record:
        where = _paths.user_cache_dir()
    assert str(shared) in str(record[0].message) and str(where) in str(record[0].message)
    assert where != shared and where.parent == tmp_path and where.is_dir()
    assert (where.stat().st_mode & 0o777) == 0o700 and not any(elsewhere.iterdir())
    assert _paths.user_cache_dir() == where


def test_register_unknown_kernel():
    with pytest.raises(KeyError, match="unknown kernel 'nope'"):
        runtime.register_hook("nope", _hook())


# --------------------------------------------------------------------------- rank agreement


def test_agree_without_distributed_calls_choice_fn():
    assert tuning.agree(lambda: 42, model="A") == 42


WORKER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import torch.distributed as dist
    from liger_portable import resolve
    from liger_portable.tuning import agree, runtime, search
    from liger_portable.hardware import DeviceInfo

    rank, world, store, model, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)

    # 1. agree(): each rank's own choice differs: only agreement makes ranks of one model match
    choice = agree(lambda: {"rank": rank, "num_warps": 2 ** rank}, model=model)
    def boom():
        raise RuntimeError("tuning failed on rank %d" % rank)
    try:
        agree(boom if model == "A" else (lambda: "fine"), model=model)
        err = None
    except RuntimeError as e:
        err = str(e)

    # 2. run-time tuning (LIGER_PORTABLE_AUTOTUNE=1, one cache folder): no collective in resolve;
    # the tuning lock makes the ranks tune each problem once and take the recorded entry.
    runtime.reset_hooks(defaults=False)
    DEV = DeviceInfo("cuda", 0, "Test GPU 9000", "sm90", 32, 132, 1024, 232448)
    all_candidates = search.candidates
    search.candidates = lambda k, d, n: all_candidates(k, d, n)[:3]

    def hook(device, named, dtype):
        with open(log, "a") as f:
            f.write(json.dumps({"rank": rank, "problem": named}) + "\\n")
        time.sleep(0.3)  # a slow tuning: the other ranks reach the lock meanwhile
        cands = search.candidates("rms_norm_fwd", device, named)

        def run(r):
            cfg = r.config.to_dict()
            if cfg not in cands:
                return 1.0  # the table default
            # each rank's timings favour another candidate: only sharing makes the ranks agree
            return 0.5 + 0.1 * ((cands.index(cfg) - rank) % len(cands))
        return run

    runtime.register_hook("rms_norm_fwd", hook)
    problems = [(4096 + i, 1000) for i in range(4)]
    order = problems[rank:] + problems[:rank]  # ranks miss in different orders
    dist.barrier()
    tuned = {str(p): resolve("rms_norm_fwd", DEV, p, torch.bfloat16).config.to_dict() for p in order}
    dist.barrier()  # a collective after uneven misses: every rank gets here
    print(json.dumps({"rank": rank, "choice": choice, "err": err, "tuned": tuned}))
    dist.destroy_process_group()
    """
)
GLOO_DEV = DeviceInfo("cuda", 0, "Test GPU 9000", "sm90", 32, 132, 1024, 232448)


def test_ranks_under_gloo_agree_and_tune_once(tmp_path, monkeypatch):
    """Three gloo ranks in one job (one process start for both checks, to keep CI fast).

    1. ``agree`` groups ranks by device model: the leader's choice (or its error) reaches its group.
    2. ``LIGER_PORTABLE_AUTOTUNE=1`` with an empty shared cache: every rank resolves the same config
       for every problem, exactly one rank tuned each problem (the others waited for the lock and
       read its entry), and nothing hangs although ranks miss in different orders.
    """
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store, log = tmp_path / "store", tmp_path / "tuned.log"
    models = ["B", "A", "A"]  # the leader of "A" is rank 1; "B" is alone
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("TRITON_INTERPRET", None)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), "3", str(store), m, str(log)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r, m in enumerate(models)
    ]
    out = {}
    deadline = time.monotonic() + 90
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("gloo workers hung")
        assert p.returncode == 0, stderr[-2000:]
        res = json.loads(stdout.strip().splitlines()[-1])
        out[res["rank"]] = res
    # 1. agree
    assert out[0]["choice"] == {"rank": 0, "num_warps": 1}  # "B" keeps its own
    assert out[1]["choice"] == out[2]["choice"] == {"rank": 1, "num_warps": 2}  # "A" takes its leader's
    assert out[0]["err"] is None
    assert "rank 1" in out[1]["err"] and "tuning failed on rank 1" in out[2]["err"]
    # 2. run-time tuning: one tuning per problem, every rank the same config
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    problems = [{"n_cols": 4096 + i, "n_rows": 1000} for i in range(4)]
    assert sorted((ln["problem"]["n_cols"] for ln in lines)) == [p["n_cols"] for p in problems], lines
    assert out[0]["tuned"] == out[1]["tuned"] == out[2]["tuned"]
    entries = load(autotune_cache.user_cache_file(GLOO_DEV))["entries"]
    assert len(entries) == 4
    for ln in lines:
        named, tuner = ln["problem"], ln["rank"]
        # the config is the one the tuning rank's timings favour (another rank's would differ)
        expected = search.candidates(KERNEL, GLOO_DEV, named)[:3][tuner % 3]
        assert out[0]["tuned"][str((named["n_cols"], named["n_rows"]))] == expected
        assert entries[autotune_cache.entry_key(SPEC, named, torch.bfloat16)]["config"] == expected


# --------------------------------------------------------------------------- tuning lock


def test_waiter_takes_the_entry_recorded_while_it_waited(monkeypatch):
    """Another holder of the tuning lock records the entry; the waiting miss uses it, no tuning."""
    import threading

    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    assert list(autotune_cache.lookup(SPEC, H200, NAMED, torch.bfloat16)) == []  # memoized: empty
    held, release = threading.Event(), threading.Event()

    def other_process():  # a separate open file: flock treats it as another process
        with autotune_cache.tuning_lock(H200, None) as got:
            assert got
            held.set()
            release.wait(10)
            autotune_cache.write_entries(user_file(), H200.name, {autotune_cache.entry_key(SPEC, NAMED, torch.bfloat16):
                                                          autotune_cache.make_entry(CFG, 0.05, 0.06)})

    t = threading.Thread(target=other_process)
    t.start()
    assert held.wait(10)
    threading.Timer(0.2, release.set).start()
    r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)  # waits for the lock, re-reads the cache
    t.join(10)
    assert r.config.to_dict() == CFG and r.source == "user cache NVIDIA_H200.json"
    assert hook.calls == []


def test_lock_timeout_falls_back_to_table_once(monkeypatch):
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    monkeypatch.setenv(runtime.ENV_LOCK_TIMEOUT, "0.2")
    with autotune_cache.tuning_lock(H200, None) as got, warnings.catch_warnings(record=True) as rec:
        assert got
        warnings.simplefilter("always")
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
        t0 = time.monotonic()
        assert resolve(KERNEL, H200, (4096, 5000), torch.bfloat16).source.startswith("table")
        assert time.monotonic() - t0 < 0.15  # no second long wait after one timeout
    msgs = [str(w.message) for w in rec if "tuning lock" in str(w.message)]
    assert len(msgs) == 1 and f"pid {os.getpid()}" in msgs[0] and runtime.ENV_LOCK_TIMEOUT in msgs[0]
    assert hook.calls == []
    # lock free again: the next miss tunes
    resolve(KERNEL, H200, (4096, 20000), torch.bfloat16)
    assert len(hook.calls) == 1


HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(300)
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks")
def test_lock_of_a_dead_process_is_released_at_once(tmp_path, monkeypatch):
    lock = autotune_cache.tuning_lock_file(H200)
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with autotune_cache.tuning_lock(H200, 0.05) as got:
            assert not got  # held by a live process
    finally:
        holder.kill()  # dies holding the lock; the lock file stays on disk
        holder.wait(10)
    assert lock.exists()
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    t0 = time.monotonic()
    r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert time.monotonic() - t0 < 5 and len(hook.calls) == 1
    assert r.source == "user cache NVIDIA_H200.json"


@pytest.fixture
def unwritable_autotune(tmp_path, monkeypatch):
    """LIGER_PORTABLE_AUTOTUNE=1 with a cache folder that cannot be created (a file is in the way)
    and a recording hook for KERNEL; returns the hook."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(blocker / "sub"))
    hook = _hook()
    runtime.register_hook(KERNEL, hook)
    monkeypatch.setenv(ENV_AUTOTUNE, "1")
    return hook


def test_unwritable_cache_multi_rank_does_not_tune(unwritable_autotune, monkeypatch):
    hook = unwritable_autotune
    monkeypatch.setattr(runtime, "multi_rank", lambda: True)
    with pytest.warns(RuntimeWarning, match="multi-rank .* cannot be shared"):
        assert resolve(KERNEL, H200, PROBLEM, torch.bfloat16).source.startswith("table")
    assert hook.calls == []


def test_unwritable_cache_single_process_tunes_in_memory(unwritable_autotune):
    hook = unwritable_autotune
    with pytest.warns(RuntimeWarning, match="cannot write the autotune cache"):
        r = resolve(KERNEL, H200, PROBLEM, torch.bfloat16)
    assert len(hook.calls) == 1 and r.source == "user cache NVIDIA_H200.json (in memory)"


@pytest.mark.parametrize("which", ["tuning lock", "write lock"])
def test_lock_files_refuse_symbolic_links(tmp_path, which):
    """A lock-file name planted as a symbolic link in the cache folder is refused: its target is
    neither truncated nor written (the lock used to write "host pid N" into it)."""
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    cache = user_file()
    cache.parent.mkdir(parents=True, exist_ok=True)
    link = autotune_cache.tuning_lock_file(H200) if which == "tuning lock" else cache.with_name(cache.name + ".lock")
    link.symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        if which == "tuning lock":
            with autotune_cache.tuning_lock(H200, 1.0):
                pass
        else:
            autotune_cache.write_entries(cache, "NVIDIA H200", {"k": {"config": CFG}})
    assert target.read_text() == "precious" and link.is_symlink()


def test_stale_temporary_files_are_removed_when_writing():
    """Temporary files that killed writers left beside the cache file go at the next write; a
    fresh one (a writer at work) stays."""
    cache = user_file()
    cache.parent.mkdir(parents=True, exist_ok=True)
    stale, fresh = cache.with_name(f".{cache.name}.dead.tmp"), cache.with_name(f".{cache.name}.busy.tmp")
    for f in (stale, fresh):
        f.write_text("{")
    old = time.time() - 2 * autotune_cache.STALE_TMP_S
    os.utime(stale, (old, old))
    autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    assert not stale.exists() and fresh.exists()


def test_lock_timeout_setting(monkeypatch):
    monkeypatch.delenv(runtime.ENV_LOCK_TIMEOUT, raising=False)
    assert runtime.lock_timeout() == runtime.LOCK_TIMEOUT_S
    monkeypatch.setenv(runtime.ENV_LOCK_TIMEOUT, "12.5")
    assert runtime.lock_timeout() == 12.5
    monkeypatch.setenv(runtime.ENV_LOCK_TIMEOUT, "soon")
    with pytest.warns(RuntimeWarning, match="LIGER_PORTABLE_TUNE_LOCK_TIMEOUT='soon' is not a number"):
        assert runtime.lock_timeout() == runtime.LOCK_TIMEOUT_S


def test_do_bench_waits_for_its_own_events_only(monkeypatch):
    """The timer never synchronizes the whole device (that would also wait for collectives in
    flight, which a rank blocked on the tuning lock may not have joined): a fake driver whose
    device-wide synchronize fails, a fake clock advanced by each run."""
    clock = [0.0]
    cleared = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            assert self.t is not None, "waited for an event never recorded"

        def elapsed_time(self, end):
            return end.t - self.t

    class DeviceInterface:
        Event = FakeEvent

        @staticmethod
        def synchronize():
            raise AssertionError("device-wide synchronize")

    class Driver:
        def get_device_interface(self):
            return DeviceInterface

        def get_empty_cache_for_benchmark(self):
            return "l2 buffer"

        def clear_cache(self, cache):
            cleared.append(cache)

    runs = []

    def fn():
        runs.append(1)
        clock[0] += 100.0 if len(runs) == 1 else 0.25  # the first run compiles

    monkeypatch.setattr(timing, "device_driver", lambda: Driver())
    assert timing.do_bench_ms(fn, warmup_ms=1.0, rep_ms=6.0) == 0.25  # the compile run is not timed
    n_warmup, n_timed = int(1.0 / 0.25), int(6.0 / 0.25)
    assert len(runs) == 1 + 5 + n_warmup + n_timed
    assert len(cleared) == 5 + n_timed  # the L2 cache cleared before each estimated and timed run


def test_info_counts_the_entries_this_installation_can_use(monkeypatch):
    """`info` tells tuned entries of another Triton (or of older kernel code) from current ones: the
    shipped H200 file listed 4 tuned entries under Triton 3.9, none of which applied."""
    from liger_portable import commands

    autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    autotune_cache.record(SPEC, H200, rows(1), torch.bfloat16, CFG, 0.05, 0.06)
    assert commands.current_entries(user_file()) == 2
    assert commands.entries_text(user_file(), 2) == "2 tuned entries"
    monkeypatch.setattr(autotune_cache, "triton_major_minor", lambda: "99.1")
    assert commands.current_entries(user_file()) == 0
    assert commands.entries_text(user_file(), 2) == "2 tuned entries, 0 current for this Triton and kernel code"


def test_info_cache_summary_counts_user_and_shipped_entries(tmp_path):
    from liger_portable import commands

    assert [(label, n) for label, _, n in commands.cache_summary(H200)] == [("user cache", 0), ("shipped cache", 0)]
    autotune_cache.record(SPEC, H200, NAMED, torch.bfloat16, CFG, 0.05, 0.06)
    autotune_cache.record(SPEC, H200, rows(1), torch.bfloat16, CFG, 0.05, 0.06)
    shipped = _paths.shipped_cache_dir() / user_file().name
    shipped.write_text(user_file().read_text())
    autotune_cache.invalidate(str(shipped))  # the shipped file is read once per process; it was missing
    summary = commands.cache_summary(H200)
    assert [(label, n) for label, _, n in summary] == [("user cache", 2), ("shipped cache", 2)]
    assert summary[1][1] == shipped
    assert commands.cache_summary(MI300)[0][2] == 0  # another model's file is another file
