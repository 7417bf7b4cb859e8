"""The wheel: it ships the vendor tables and the autotune cache folder inside the package, and an
installed copy (unzipped, away from the source tree) finds and loads them.

The wheel is built from a copy of the repository in a temporary folder: pip builds local
projects in place, and setuptools writes ``build/`` and ``*.egg-info`` into the source folder,
which would be shared between xdist workers and with anyone editing the checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TABLES = ("cuda", "rocm", "xpu")

def _cannot_build_reason() -> str | None:
    if importlib.util.find_spec("setuptools") is None:
        return f"setuptools is not installed in {sys.executable}'s environment; the wheel cannot be built"
    # setuptools >= 70.1 builds wheels itself (setuptools.command.bdist_wheel); older ones need `wheel`.
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
        return "neither the `wheel` package nor setuptools >= 70.1 (built-in bdist_wheel) is installed"
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    reason = _cannot_build_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("wheel_build")
    src = root / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".venv", ".whl", ".ci-env"
        ),
    )
    out = root / "dist"
    cmd = [
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "--disable-pip-version-check", "-w", str(out), str(src),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PIP_NO_INPUT": "1"})
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    wheels = list(out.glob("liger_portable-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}, got {wheels}\n{proc.stdout}"
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel unzipped into a folder of its own (what pip install puts in site-packages)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def run_installed(site: Path, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``python -c code`` with only ``site`` on PYTHONPATH, outside the source tree."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_PORTABLE_")}
    env["PYTHONPATH"] = str(site)
    env["LIGER_PORTABLE_CACHE_DIR"] = str(tmp_path / "user_cache")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_wheel_contains_backend_tables(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for b in (*TABLES, "base"):  # base.json: every vendor table inherits it
            member = f"liger_portable/backends/{b}.json"
            assert member in names, f"{member} missing from {wheel.name}: {sorted(names)}"
            assert json.loads(zf.read(member)) == json.loads((REPO / "backends" / f"{b}.json").read_text())
    assert "liger_portable/__init__.py" in names
    assert not any(n.startswith(("backends/", "autotune_cache/", "tests/")) for n in names), sorted(names)


def test_wheel_metadata_license_authors_and_extras(wheel):
    """The license as an SPDX expression with its text shipped, the authors, and the hf extra bounded
    by the newest transformers the tests were run with."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        licence = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert licence, sorted(names)
        assert zf.read(licence[0]).decode() == (REPO / "LICENSE").read_text()
    assert "License-Expression: BSD-2-Clause" in meta
    assert "BSD 2-Clause License" in (REPO / "LICENSE").read_text()
    assert "Author: the liger-portable developers" in meta
    hf = [line for line in meta.splitlines() if line.startswith("Requires-Dist: transformers")]
    assert hf and "<5.25" in hf[0] and 'extra == "hf"' in hf[0], hf


def test_install_hint_names_the_hf_extra_range():
    """The errors that say how to install transformers give the range pyproject's hf extra declares."""
    import tomllib

    from liger_portable._checks import HF_REQUIREMENT

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    assert HF_REQUIREMENT in extra, (HF_REQUIREMENT, extra)


def test_wheel_contains_autotune_cache_folder(wheel):
    # A zip has no entry for an empty folder: the folder ships only if it holds a file
    # (autotune_cache/README.md until tuned files exist).
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert any(n.startswith("liger_portable/autotune_cache/") for n in names), sorted(names)
    shipped = sorted(p.name for p in (REPO / "autotune_cache").iterdir() if p.suffix in (".json", ".md"))
    for name in shipped:
        assert f"liger_portable/autotune_cache/{name}" in names


def test_installed_wheel_loads_its_tables(installed, tmp_path):
    proc = run_installed(
        installed,
        f"""
        from pathlib import Path
        import liger_portable
        from liger_portable import configs, _paths
        site = Path({str(installed)!r}).resolve()
        here = Path(liger_portable.__file__).resolve()
        assert here.is_relative_to(site), f"imported {{here}}, not from {{site}}"
        for b in {TABLES!r}:
            t = configs.load_table(b)
            assert t.backend == b and Path(t.path).resolve().is_relative_to(site), t.path
        print(_paths.backends_dir())
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    printed = Path(proc.stdout.strip().splitlines()[-1])
    assert printed == installed / "liger_portable" / "backends"


def test_installed_wheel_resolves_a_config(installed, tmp_path):
    proc = run_installed(
        installed,
        """
        import torch
        from liger_portable import configs, _paths
        from liger_portable.hardware import DeviceInfo
        dev = DeviceInfo("cuda", 0, "NVIDIA H200", "sm90", 32, 132, 1024, 232448)
        r = configs.resolve("rms_norm_fwd", dev, (4096, 1000), torch.bfloat16)
        print(r.source)
        print(_paths.shipped_cache_dir())
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    source, shipped = proc.stdout.splitlines()[-2:]
    # sm90's rules stop at 1024 columns; the CUDA default inherits base.json's (shipped too)
    assert source == "table base.json rule 2 (inherited by cuda.json [default])"
    assert Path(shipped) == installed / "liger_portable" / "autotune_cache"


def test_installed_without_shipped_cache_folder_still_resolves(installed, tmp_path):
    """No shipped tuning is not an error: the tables still apply (a fresh clone has no empty folder)."""
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    shutil.rmtree(site / "liger_portable" / "autotune_cache")
    proc = run_installed(
        site,
        """
        import warnings
        import torch
        from liger_portable import configs
        from liger_portable.hardware import DeviceInfo
        warnings.simplefilter("error")
        dev = DeviceInfo("rocm", 0, "AMD Instinct MI300X", "gfx942", 64, 304, 1024, 65536)
        print(configs.resolve("rms_norm_bwd", dev, (4096, 1000), torch.bfloat16).source)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("table rocm.json")


@pytest.mark.big_memory
def test_big_memory_tests_hold_the_exclusive_lock():
    """The conftest fixture behind ``big_memory``: while such a test runs, no other process (xdist
    worker) can take the lock, so two never run at once."""
    import fcntl

    from conftest import big_memory_lock_path

    with open(big_memory_lock_path(), "a") as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.heavy_memory
def test_heavy_memory_tests_hold_a_slot(request):
    """The conftest fixture behind ``heavy_memory``: such a test holds one of the slots (no other
    process can take it), so no more than ``heavy_memory_slots()`` run at once, and still holds the
    shared GPU lock."""
    import fcntl

    from conftest import big_memory_lock_path, heavy_memory_slot_path, heavy_memory_slots

    slot = request.node.heavy_memory_slot
    assert 0 <= slot < heavy_memory_slots()
    with open(heavy_memory_slot_path(slot), "a") as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(big_memory_lock_path(), "a") as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.gpu
def test_gpu_tests_hold_a_shared_lock():
    """Every other GPU test holds the same lock shared: other GPU tests run beside it, a big_memory
    test waits until none runs."""
    import fcntl

    from conftest import big_memory_lock_path

    with open(big_memory_lock_path(), "a") as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)
