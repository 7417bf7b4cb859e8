"""The scripts in scripts/ mostly need a GPU to run; on the CPU each is at least imported (with
everything it imports from the package) and answers ``--help`` with its usage, measuring and writing
nothing: a script broken by a change to the package fails here, not on the next GPU machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
RUNNABLE = sorted(p.name for p in SCRIPTS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def test_every_runnable_script_is_covered():
    assert len(RUNNABLE) >= 14 and "bench_host_overhead.py" in RUNNABLE and "benchlib.py" not in RUNNABLE


@pytest.mark.parametrize("name", RUNNABLE)
def test_script_answers_help_without_running(name, tmp_path):
    log = SCRIPTS / "results" / "log.jsonl"
    before = log.stat().st_size
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, str(SCRIPTS / name), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={**os.environ, "OUT": str(out)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage: "), r.stdout[:500]
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert log.stat().st_size == before


def test_measure_ceiling_prints_and_records_the_ceiling(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import benchlib

    monkeypatch.setattr(benchlib, "copy_bandwidth_gbs", lambda: 4321.0)
    monkeypatch.setattr(benchlib, "matmul_tflops", lambda: 765.0)
    value, records = benchlib.measure_ceiling("copy")
    assert value == 4321.0 and [(r["metric"], r["value"]) for r in records] == [("gbs", 4321.0)]
    assert "'copy_gbs': 4321.0" in capsys.readouterr().out
    value, records = benchlib.measure_ceiling("matmul")
    assert value == 765.0 and [(r["metric"], r["value"]) for r in records] == [("tflops", 765.0)]
    assert "bf16 matmul ceiling 765 TFLOP/s" in capsys.readouterr().out
    with pytest.raises(ValueError, match="kind must be 'copy' or 'matmul'"):
        benchlib.measure_ceiling("flops")


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
def test_host_overhead_breakdown_layers_run(simulated_device, monkeypatch):
    """bench_host_overhead --breakdown's layers run against the package as it is (a changed launch
    function would otherwise fail on the next GPU machine): every layer runs, the autograd op gives the
    public call's gradients to the bit, and stubbing the launches out leaves the launcher as it was."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_host_overhead

    import torch

    import liger_portable
    from liger_portable import functional as F
    from liger_portable.ops import launching

    class OneDevice:
        def device(self, index):
            return simulated_device

    monkeypatch.setattr(liger_portable, "platform", lambda: OneDevice())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.rand(40, generator=gen) + 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(3, 40, generator=gen, dtype=torch.bfloat16)
    F.rms_norm(x, w, 1e-6).backward(dy)
    want = x.grad.clone(), w.grad.clone()
    launcher_call = launching.Launcher.__call__
    layers = bench_host_overhead.rms_norm_breakdown(x, w, dy)
    assert len(layers) == 12
    for name, step in layers.items():
        x.grad = w.grad = None
        step()
        if name == "liger-portable autograd op, no argument checks":
            assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])
    assert launching.Launcher.__call__ is launcher_call


GPU_SESSION = SCRIPTS / "gpu_session.sh"


def _gpu_session(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run gpu_session.sh in ``tmp_path`` with ``python3`` this interpreter, OUT under ``tmp_path`` and
    nothing that a step could measure (CHECK=0 TESTS=0); the repository's log must stay as it was."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python3 = bin_dir / "python3"  # a wrapper: a link would lose a virtual environment's packages
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("ALLOW_CPU", "OUT", "LIGER_PORTABLE_BACKEND")}
    base.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", CHECK="0", TESTS="0",
                OUT=str(tmp_path / "out"))
    log = SCRIPTS / "results" / "log.jsonl"
    before = log.stat().st_size
    r = subprocess.run(["bash", str(GPU_SESSION), *args], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**base, **env})
    assert log.stat().st_size == before
    return r


def test_gpu_session_answers_help(tmp_path):
    r = _gpu_session(tmp_path, "--help")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert r.stdout.startswith("One GPU session on any machine with a GPU") and "Exit status:" in r.stdout
    assert "ALLOW_CPU=1" in r.stdout and "#" not in r.stdout.splitlines()[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["nosuch"], "unknown bench 'nosuch' (no scripts/bench_nosuch.py): choose from "),
    (["rms_norm", "glu:--x,1", "typo:--sweep"], "unknown bench 'typo'"),
    (["rms_norm", "--bogus"], "unknown option --bogus"),
    (["none", "rms_norm"], "'none' means no benchmarks: give it alone"),
])
def test_gpu_session_refuses_bad_arguments_before_running(tmp_path, args, message):
    r = _gpu_session(tmp_path, *args)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.startswith(f"gpu_session.sh: error: {message}") and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_session_refuses_to_run_without_a_gpu(tmp_path):
    """Without a GPU (forced here: the cpu backend) the session stops before its first step, saying it
    needs one; ALLOW_CPU=1 runs it only with OUT set, so that CPU figures never reach the committed log."""
    r = _gpu_session(tmp_path, "none", LIGER_PORTABLE_BACKEND="cpu")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.startswith("gpu_session.sh: error: no GPU in use") and "needs a GPU" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    r = _gpu_session(tmp_path, "none", LIGER_PORTABLE_BACKEND="cpu", ALLOW_CPU="1", OUT="")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == "gpu_session.sh: error: ALLOW_CPU=1 needs OUT: a CPU run's records must not go to " \
                       "scripts/results/log.jsonl\n"


def _script(tmp_path, name: str, *args: str, out: bool = True) -> subprocess.CompletedProcess:
    """Run scripts/``name`` in ``tmp_path`` (OUT there when ``out``); the repository's log must stay as it was."""
    log = SCRIPTS / "results" / "log.jsonl"
    before = log.stat().st_size
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    if out:
        (tmp_path / "out").mkdir(exist_ok=True)
        env["OUT"] = str(tmp_path / "out")
    r = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
    assert log.stat().st_size == before
    return r


GPU_BENCHES = ["bench_rms_norm.py", "bench_layer_norm.py", "bench_fused_add_rms_norm.py", "bench_glu.py",
               "bench_rope.py", "bench_cross_entropy.py", "bench_fused_linear_cross_entropy.py",
               "bench_host_overhead.py", "bench_preference_loss.py", "probe_compiled_mlp.py"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the run without a GPU")
@pytest.mark.parametrize("name", GPU_BENCHES)
def test_gpu_bench_without_a_gpu_is_one_line(name, tmp_path):
    """A GPU benchmark started without a GPU says so in one line (exit 2), not a traceback from the
    first CUDA call, and writes nothing."""
    r = _script(tmp_path, name)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.startswith(f"{name}: error: needs a GPU") and r.stderr.count("\n") == 1, r.stderr
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("name, args, message", [
    ("bench_rms_norm.py", ["--dtype", "bfloat8"], "argument --dtype: invalid choice: 'bfloat8'"),
    ("bench_cross_entropy.py", ["--shapes", "8192x"], "argument --shapes: '8192x' is not ROWSxV"),
    ("bench_glu.py", ["--shapes", "0x4096"], "argument --shapes: '0x4096' is not ROWSxN"),
    ("bench_fused_linear_cross_entropy.py", ["--shapes", "big"], "'big' is not BTxHxV"),
    ("bench_fused_linear_cross_entropy.py", ["--chunk-mib", "512,-1"], "'512,-1' is not a comma-separated list"),
    ("bench_train_step.py", ["--loss-steps", "0"], "--batch, --seq and --loss-steps must be >= 1, got --loss-steps 0"),
    ("bench_train_step.py", ["--seq", "-4"], "got --seq -4"),
    ("distributed_check.py", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("distributed_check.py", [], "run it under torchrun (RANK/WORLD_SIZE not set)"),
])
def test_bad_arguments_are_usage_errors_before_running(name, args, message, tmp_path):
    """Arguments are checked before anything runs: an argparse usage error (exit 2) naming them, not a
    traceback or a measurement of something else (bf16 spelt wrongly used to be getattr's AttributeError)."""
    r = _script(tmp_path, name, *args)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_dtype_names_and_shapes_parse(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import argparse

    import benchlib

    ap = argparse.ArgumentParser()
    benchlib.add_dtype_argument(ap)
    assert [ap.parse_args(["--dtype", s]).dtype for s in ("bf16", "FP16", "fp32", "float32")] == \
        ["bfloat16", "float16", "float32", "float32"]
    assert ap.parse_args([]).dtype == "bfloat16"
    assert benchlib.shape_type("BTxHxV")("8192X4096x128256") == (8192, 4096, 128256)
    for bad in ("8192x4096", "8192x4096x", "axbxc", "1x0x1"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not BTxHxV"):
            benchlib.shape_type("BTxHxV")(bad)


def test_distributed_check_refuses_an_unwritable_json_before_running(tmp_path):
    """Under torchrun's variables, rank 0 checks that --json can be written before the checks run (their
    results were lost at the end of the run)."""
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "RANK": "0", "WORLD_SIZE": "1"}
    for target, why in ((tmp_path / "no" / "r.json", "no folder"), (tmp_path, "it is a folder")):
        r = subprocess.run([sys.executable, str(SCRIPTS / "distributed_check.py"), "--json", str(target)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert r.returncode == 2 and f"--json: cannot write {target} ({why}" in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("name, args", [("bench_resolve.py", []), ("bench_train_step.py", ["--steps", "1"])])
def test_cpu_runs_write_no_records_to_the_committed_log(name, args, tmp_path):
    """Benchmarks that also run on the CPU refuse, before measuring, to put CPU figures into the committed
    log (OUT unset), naming the fix; with OUT set their records go there, marked device "cpu"."""
    if __import__("torch").cuda.is_available():
        pytest.skip("checks a machine without a GPU")
    r = _script(tmp_path, name, *args, out=False)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert "records of a CPU run must not go to scripts/results/log.jsonl: set OUT" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    if name == "bench_resolve.py":
        r = _script(tmp_path, name, *args)
        assert r.returncode == 0, r.stderr[-2000:]
        recs = [json.loads(line) for line in (tmp_path / "out" / "resolve.jsonl").read_text().splitlines()]
        assert recs and {x["device"] for x in recs} == {"cpu"}
