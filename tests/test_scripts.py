"""The scripts in scripts/ mostly need a GPU to run; on the CPU each is at least imported (with
everything it imports from the package) and answers ``--help`` with its usage, measuring and writing
nothing: a script broken by a change to the package fails here, not on the next GPU machine."""

from __future__ import annotations

import os
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
