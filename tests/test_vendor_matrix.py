"""The vendor compile matrix (scripts/vendor_matrix.py) catches configs another vendor cannot run.

The matrix cross-compiles the real kernels, which needs them undecorated by the interpreter; this
suite's process has TRITON_INTERPRET=1 (conftest), so the compiling cases run the script in a
subprocess without it. Broken tables are copies of backends/*.json with one entry changed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "vendor_matrix.py"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # Shared by the cases of this file: unchanged configs compile once.
    return tmp_path_factory.mktemp("matrix_cache")


def run_matrix(*args, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--ci", "--jobs", "2", "--cache-dir", str(cache), *args],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )


def broken_tables(tmp_path: Path, backend: str, kernel: str, change: dict) -> Path:
    """A copy of backends/ whose ``backend`` table has ``change`` merged into rule 0 of ``kernel``
    in its default section (which first takes base.json's entry if it inherits the kernel)."""
    d = tmp_path / "backends"
    shutil.copytree(ROOT / "backends", d)
    path = d / f"{backend}.json"
    data = json.loads(path.read_text())

    def entry(kernels: dict) -> dict | None:
        return next((e for k, e in kernels.items() if kernel in (n.strip() for n in k.split(","))), None)

    kernels = data["sections"]["default"]["kernels"]
    if entry(kernels) is None:
        kernels[kernel] = {"rules": entry(json.loads((d / "base.json").read_text())["kernels"])["rules"]}
    entry(kernels)["rules"][0]["config"].update(change)
    path.write_text(json.dumps(data))
    return d


def test_too_many_warps_for_wave64(tmp_path, cache_dir):
    tables = broken_tables(tmp_path, "rocm", "rms_norm_fwd", {"num_warps": 32})
    r = run_matrix("--tables-dir", str(tables), "--kernels", "rms_norm_fwd", "--targets", "gfx942", cache=cache_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("FAIL rms_norm_fwd on gfx942"))
    assert "num_warps=32 x wave size 64 = 2048 threads per block, over the limit of 1024" in line
    # The resolver's own table validation rejects it as well, and says so.
    assert "table validation: rocm.json" in r.stdout


def test_lds_over_the_gfx942_limit(cache_dir):
    # No table config of these kernels needs more than 64 KiB of LDS (the matrix shows 16 KiB for
    # rms_norm_bwd), so the limit is lowered to prove the check reads kernel.metadata.shared.
    r = run_matrix("--kernels", "rms_norm_bwd", "--targets", "gfx942", "--limit", "gfx942.shared=4096", cache=cache_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL rms_norm_bwd on gfx942")]
    assert fails and all("B of LDS per block, over the limit of 4096 B" in ln for ln in fails)
    assert "shared overridden to 4096" in fails[0]


def test_amd_option_in_the_cuda_table(tmp_path, cache_dir):
    tables = broken_tables(tmp_path, "cuda", "swiglu_fwd", {"waves_per_eu": 2})
    r = run_matrix("--tables-dir", str(tables), "--kernels", "swiglu_fwd", "--targets", "sm90", cache=cache_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("FAIL swiglu_fwd on sm90"))
    assert "'waves_per_eu' is a rocm launch option" in line and "only ['maxnreg'] allowed" in line


def test_real_compile_passes_and_is_cached(cache_dir):
    args = ("--kernels", "swiglu_fwd,rope", "--targets", "sm90,gfx942")
    r = run_matrix(*args, cache=cache_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: every config fits" in r.stdout
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith(("swiglu_fwd", "rope"))}
    assert set(rows) == {"swiglu_fwd", "rope"} and "F" not in rows["rope"].split(None, 1)[1]
    again = run_matrix(*args, cache=cache_dir)
    assert again.returncode == 0 and " 0 compiled with" in again.stdout, again.stdout


# --------------------------------------------------------------------------- static checks, in process


def _load_script():
    spec = importlib.util.spec_from_file_location("vendor_matrix", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("vendor_matrix", mod)
    spec.loader.exec_module(mod)  # importing it leaves TRITON_INTERPRET alone (main() drops it)
    return mod


def test_xpu_static_checks():
    vm = _load_script()
    pvc = vm.XPU_TARGETS["xe-hpc"]

    def fails(cfg):
        return vm.static_failures(vm.Item("rms_norm_fwd", pvc, cfg, {"n_cols": 4096}, "test"))

    assert fails({"num_warps": 32, "BLOCK_M": 1, "BLOCK_N_MAX": 8192, "grf_mode": "256"}) == []
    # the tables spell the large register file "256" (the package hands older Intel Tritons "large")
    f = fails({"num_warps": 32, "BLOCK_M": 1, "BLOCK_N_MAX": 8192, "grf_mode": "large"})
    assert any("option grf_mode" in x for x in f) and any("Intel Triton 3.6.0 does not accept" in x for x in f)
    assert any("2048 threads per block, over the limit of 1024" in f for f in fails({"num_warps": 64}))
    assert any("grf_mode='huge'" in f for f in fails({"num_warps": 8, "grf_mode": "huge"}))
    f = fails({"num_warps": 64, "threads_per_warp": 16, "grf_mode": "large"})
    assert any("large GRF halves the threads (limit: num_warps <= 32)" in x for x in f)
    assert any("is a cuda launch option" in x for x in fails({"num_warps": 8, "maxnreg": 128}))
    assert any("threads_per_warp=8 is not a sub-group size" in x for x in fails({"num_warps": 8, "threads_per_warp": 8}))


def test_option_values_per_target_and_intel_release(monkeypatch):
    """Option values are checked per target arch (kpack=2 does not compile for gfx950), and the
    options handed to each Intel Triton release are spelled its way; without the translation the
    check fails (3.6 renamed threads_per_warp, 3.5 does not know grf_mode '256')."""
    vm = _load_script()

    def fails(target, cfg):
        t = vm.TARGETS.get(target) or vm.XPU_TARGETS[target]
        return vm.static_failures(vm.Item("rms_norm_fwd", t, cfg, {"n_cols": 4096}, "test"))

    assert fails("gfx942", {"num_warps": 4, "kpack": 2}) == []
    assert any("kpack" in x and "gfx950" in x for x in fails("gfx950", {"num_warps": 4, "kpack": 2}))
    assert any("waves_per_eu" in x for x in fails("gfx942", {"num_warps": 4, "waves_per_eu": "abc"}))
    xpu = {"num_warps": 8, "threads_per_warp": 32, "grf_mode": "256"}
    assert fails("xe-hpc", xpu) == []
    monkeypatch.setattr(vm, "launch_options", lambda backend, options, version: options)
    f = fails("xe-hpc", xpu)
    assert any("Intel Triton 3.6.0 raises KeyError for option(s) ['threads_per_warp']" in x for x in f)
    assert any("Intel Triton 3.5.0 does not accept grf_mode='256'" in x for x in f)


def test_grid_notes_on_amd_targets():
    """Persistent grids are compared with AMD's work-group recommendation (a note, not a failure:
    aiter measured one program per CU), and on RDNA, whose driver counts two-CU work-group
    processors, fewer programs than CUs are noted."""
    vm = _load_script()

    def notes(target, ppc):
        cfg = {"num_warps": 8, "BLOCK_M": 1, "BLOCK_N_MAX": 16384, "PROGRAMS_PER_CU": ppc}
        return vm.grid_notes(vm.Item("rms_norm_bwd", vm.TARGETS[target], cfg, {"n_cols": 4096}, "test"))

    assert any("304 work-groups" in n and "1024" in n for n in notes("gfx942", 1))
    assert notes("gfx942", 4) == []  # 1216 work-groups
    assert any("fewer programs than CUs" in n for n in notes("gfx1100", 1))
    assert not any("fewer programs than CUs" in n for n in notes("gfx1100", 2))
    assert vm.grid_notes(vm.Item("rms_norm_bwd", vm.TARGETS["sm90"], {"num_warps": 8, "PROGRAMS_PER_CU": 1},
                                 {"n_cols": 4096}, "test")) == []


def test_errors_a_compiler_prints_are_caught():
    """A compile that returns but printed an error on file descriptor 2 (LLVM's "can't parse" for a
    bad attribute) is a failure: the stderr of the C++ compilers is read around each compile."""
    vm = _load_script()
    with vm._stderr_text() as printed:
        os.write(2, b"LLVM ERROR: nothing\n'amdgpu-waves-per-eu': can't parse first integer attribute abc\n")
    assert len(vm.compiler_errors(printed[0])) == 2
    assert vm.compiler_errors("remark: all good\nwarning: unused\n") == []


def test_descriptions_cover_every_kernel_argument():
    """Each description names every argument of its jit function, with the config's constexprs."""
    import inspect

    from liger_portable import compile_matrix as cm
    from liger_portable.configs import load_table, table_config
    from liger_portable.specs import SPECS

    assert set(cm.DESCRIPTIONS) <= set(SPECS)
    for name in cm.DESCRIPTIONS:
        for p in cm.problems(name):
            cfg, _ = table_config(load_table("rocm"), "gfx942", name, p)
            for launch in cm.DESCRIPTIONS[name](cfg, p, "bfloat16"):
                params = inspect.signature(launch.fn.fn).parameters
                assert list(launch.signature) == [a for a in params if a in launch.signature], name
                assert set(launch.signature) == set(params), (name, set(params) ^ set(launch.signature))
                for k, v in cfg.items():
                    if k in params:  # GLU's launch clamps BLOCK_N to short rows
                        got = launch.constexprs[k]
                        assert got == v or (k == "BLOCK_N" and got == max(16, 1 << (p["n_cols"] - 1).bit_length())), (name, k)


def test_ci_matrix_reaches_every_rule_a_row_length_can():
    """CI compiles a few row lengths, plus each rule's own bound: every rule that some row length
    (probed from 16 to 131072 columns) selects is among CI's compiles, for every target."""
    from liger_portable import compile_matrix as cm
    from liger_portable.configs import load_table, table_config
    from liger_portable.specs import SPECS

    vm = _load_script()
    probe = [16, 128, 256, 300, 512, 1000, 1024, 1536, 2048, 2880, 3072, 4096, 5000, 5120, 6144, 8192,
             10000, 16384, 20000, 32768, 70001, 131072]
    for target in vm.TARGETS.values():
        table = load_table(target.backend)
        for kernel in cm.DESCRIPTIONS:
            if tuple(SPECS[kernel].key) != ("n_cols", "n_rows"):
                continue
            compiled = {i.where for i in vm.enumerate_configs(table, target, kernel, full=False, ci=True)}
            reachable = {table_config(table, target.name, kernel, {"n_cols": n, "n_rows": 16384})[1] for n in probe}
            assert reachable <= compiled, (target.name, kernel, reachable - compiled)


# --------------------------------------------------------------------------- Ctrl-C and bad input

# Runs the matrix with compile_job replaced by a fake: the first two calls return at once, the
# others start a child process that sleeps (as ptxas would) and wait for it. argv[1]: a folder for
# the fake's marks (call<n>, child<pid>, worker<pid>); the rest: the matrix's arguments.
_SLOW_MATRIX = r"""
import importlib.util, os, subprocess, sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("vendor_matrix", sys.argv[1])
vm = importlib.util.module_from_spec(spec)
sys.modules["vendor_matrix"] = vm
spec.loader.exec_module(vm)
state = Path(sys.argv[2])


def fake_compile(job):
    n = 0
    while True:
        try:
            (state / f"call{n}").mkdir()
            break
        except FileExistsError:
            n += 1
    Path(os.environ["TRITON_CACHE_DIR"], "x").mkdir(parents=True, exist_ok=True)
    if n >= 2:
        child = subprocess.Popen(["sleep", "120"])
        (state / f"child{child.pid}").touch()
        (state / f"worker{os.getpid()}").touch()
        child.wait()
        Path(os.environ["TRITON_CACHE_DIR"], "late").mkdir(parents=True, exist_ok=True)
    return {"shared": 0, "num_warps": 4, "seconds": 0.0, "options": {}}


vm.compile_job = fake_compile
sys.exit(vm.main(sys.argv[3:]))
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; process groups")
@pytest.mark.parametrize("sig, status, line", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "stopped by SIGTERM")])
def test_a_signal_stops_the_pool_and_its_compilers(tmp_path, sig, status, line):
    """Ctrl-C (SIGINT to the process group) or SIGTERM while the pool compiles: the run stops within
    seconds with one line and exit status 128 + the signal, the workers and the processes they
    started are gone, the results that finished are cached, and the Triton scratch folder is removed
    (workers used to keep compiling the queue, and to recreate it after the removal)."""
    import signal
    import time

    state, cache, tmp = tmp_path / "state", tmp_path / "cache", tmp_path / "tmp"
    for d in (state, tmp):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TMPDIR"] = str(tmp)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_MATRIX, str(SCRIPT), str(state), "--kernels", "swiglu_fwd",
         "--targets", "sm90,gfx942", "--ci", "--jobs", "2", "--cache-dir", str(cache)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (len(list(state.glob("child*"))) == 2 and len(list(cache.glob("*/*.json"))) == 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        t0 = time.monotonic()
        os.killpg(proc.pid, getattr(signal, sig))
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == status, out + err
    assert err.strip() == line and took < 5, (took, err)
    time.sleep(0.2)
    started = [int(p.name[len(kind):]) for kind in ("child", "worker") for p in state.glob(f"{kind}*")]
    assert len(started) == 4 and not [pid for pid in started if _alive(pid)]
    assert len(list(cache.glob("*/*.json"))) == 2 and not list(cache.glob("*/*.tmp"))
    assert list(tmp.iterdir()) == []  # no vendor_matrix_triton_* folder


@pytest.fixture
def matrix_main(monkeypatch):
    """The script's main, run in this process: its environment changes are undone afterwards."""
    vm = _load_script()
    for var in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION", "LIGER_PORTABLE_MATRIX_CACHE"):
        monkeypatch.setenv(var, "")  # records the value (or its absence) to restore
        monkeypatch.delenv(var)
    return vm


@pytest.mark.parametrize("value", ["0", "-4", "two"])
def test_jobs_must_be_at_least_one(matrix_main, capsys, value):
    with pytest.raises(SystemExit) as e:
        matrix_main.parse_args(["--jobs", value])
    assert e.value.code == 2
    assert "argument --jobs:" in capsys.readouterr().err
    assert matrix_main.parse_args(["--jobs", "3"]).jobs == 3


@pytest.mark.parametrize("argv, says", [
    (["--targets", ""], "--targets '' names no target"),
    (["--targets", " , "], "--targets ' , ' names no target"),
    (["--kernels", ""], "--kernels '' names no kernel"),
    (["--kernels", ","], "--kernels ',' names no kernel"),
    (["--tables-dir", "/nonexistent"], "--tables-dir /nonexistent: no such folder"),
])
def test_empty_selection_and_missing_tables_are_errors(matrix_main, capsys, argv, says):
    assert matrix_main.main([*argv, "--cache-dir", "/nonexistent/never-reached"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err


def test_tables_dir_without_a_table(matrix_main, capsys, tmp_path):
    (tmp_path / "cuda.json").write_text("{")
    assert matrix_main.main(["--tables-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"--tables-dir {tmp_path}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("where", ["flag", "env"])
@pytest.mark.parametrize("bad", ["file", "/proc/vm", "under-a-file"])
def test_unwritable_cache_is_an_error_before_compiling(matrix_main, monkeypatch, capsys, tmp_path, where, bad):
    """A cache folder the user named that cannot be written is one error line (status 2) before
    anything compiles (it used to be a traceback after all the compiles)."""
    (tmp_path / "file").write_text("")
    path = {"file": str(tmp_path / "file"), "under-a-file": str(tmp_path / "file" / "sub")}.get(bad, bad)
    monkeypatch.setattr(matrix_main, "make_jobs", lambda *a, **k: pytest.fail("compiled before checking the cache"))
    argv = ["--kernels", "swiglu_fwd", "--targets", "sm90", "--ci"]
    if where == "flag":
        argv += ["--cache-dir", path]
    else:
        monkeypatch.setenv("LIGER_PORTABLE_MATRIX_CACHE", path)
    assert matrix_main.main(argv) == 2
    err = capsys.readouterr().err
    head = f"--cache-dir {path}: " if where == "flag" else f"LIGER_PORTABLE_MATRIX_CACHE={path}: "
    assert err.startswith(head + "cannot store results there (") and err.count("\n") == 1, err


def test_unwritable_default_cache_turns_the_cache_off(matrix_main, monkeypatch, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert matrix_main.choose_cache_dir(None) == (None, None)
    err = capsys.readouterr().err
    assert err.startswith("warning: cannot store results in the default cache") and err.count("\n") == 1, err
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ok"))
    assert matrix_main.choose_cache_dir(None) == (tmp_path / "ok" / "liger_portable" / "vendor_matrix", None)
    assert matrix_main.choose_cache_dir(tmp_path / "mine") == (tmp_path / "mine", None)
