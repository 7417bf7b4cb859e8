"""The results log (scripts/results_log.py): append validates, add skips duplicates, summary regenerates
RESULTS.md, and the committed RESULTS.md is what the committed log gives."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "results_log.py"


def _load():
    spec = importlib.util.spec_from_file_location("results_log", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rl = _load()
ENV = {"date": "2026-12-03", "device": "NVIDIA H200", "versions": {"torch": "2.11.0", "liger_portable": "abc1234"}}


def rec(value, date="2026-12-03", impl="liger-portable", **extra):
    return rl.record("rms_norm", "16384x4096", impl, "fwd_bwd_graph_ms", value, env={**ENV, "date": date}, **extra)


def test_append_validates_and_appends(tmp_path):
    log = tmp_path / "log.jsonl"
    assert rl.append([rec(0.2, pct_copy=80.0), rec(0.3, impl="torch.compile")], log) == 2
    assert rl.append([rec(0.19)], log) == 1
    lines = log.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["pct_copy"] == 80.0
    good = rec(0.2)
    for bad in ({k: v for k, v in good.items() if k != "device"}, {**good, "date": "2026-12-3"},
                {**good, "value": math.nan}, {**good, "value": "0.2"}, {**good, "versions": {"torch": 2}},
                {**good, "shape": ""}):
        with pytest.raises(ValueError):
            rl.append([good, bad], log)
    assert len(log.read_text().splitlines()) == 3  # a bad record writes nothing


def test_add_skips_exact_duplicates(tmp_path):
    log, new = tmp_path / "log.jsonl", tmp_path / "out.jsonl"
    rl.append([rec(0.2)], log)
    rl.append([rec(0.2), rec(0.21), rec(0.21)], new)
    assert rl.add([new], log) == (1, 2)
    assert rl.add([new], log) == (0, 3)
    assert [r["value"] for r in rl.read(log)] == [0.2, 0.21]
    out = subprocess.run([sys.executable, str(SCRIPT), "add", str(new), "--log", str(log)],
                         capture_output=True, text=True, check=True)
    assert "0 records added, 3 duplicates skipped" in out.stdout


def test_save_writes_under_out_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    path = rl.save([rec(0.2)], "rms_norm_bench")
    assert Path(path) == tmp_path / "rms_norm_bench.jsonl" and len(rl.read(path)) == 1


def test_summary_shows_the_latest_figure(tmp_path):
    log, out = tmp_path / "log.jsonl", tmp_path / "RESULTS.md"
    rl.append([rec(0.182, date="2026-12-03", pct_copy=87.1, peak_mib=132.0), rec(0.199, date="2026-12-02"),
               rec(0.216, impl="torch.compile", note="dynamic=False")], log)
    text = rl.summary(log, out)
    assert out.read_text() == text
    assert "do not edit; regenerate with `python scripts/results_log.py summary`" in text
    row = next(line for line in text.splitlines() if line.startswith("| 16384x4096 |"))
    assert "0.182 (87%), 132 MiB" in row and "0.199" not in row and "0.216" in row and "2026-12-03" in row
    assert "NVIDIA H200; torch 2.11.0, liger_portable abc1234" in text
    assert rl.summary(log, out) == text  # idempotent


def test_summary_keeps_dtypes_methods_and_memory_conventions_apart(tmp_path):
    """A float32 figure, or an eager figure of bench_host_overhead.py (back-to-back calls: its records
    carry ``rounds``), gets its own row instead of replacing the op benchmark's bf16 figure; a peak
    memory taken before the benchmarks cleared the gradients (no ``peak_from``) is marked."""
    log, out = tmp_path / "log.jsonl", tmp_path / "RESULTS.md"
    eager = dict(metric="fwd_bwd_eager_ms", dtype="bfloat16")
    rl.append([rl.record("rms_norm", "16384x4096", "liger-portable", value=0.30, env=ENV, **eager),
               rl.record("rms_norm", "16384x4096", "liger-kernel", value=0.40, env=ENV, **eager),
               rl.record("rms_norm", "16384x4096", "liger-portable", value=0.31, env=ENV, rounds=9, **eager),
               rl.record("rms_norm", "16384x4096", "liger-portable", value=0.50, env=ENV,
                         metric="fwd_bwd_eager_ms", dtype="float32"),
               rec(0.18, peak_mib=100.0), rec(0.25, impl="liger-kernel", peak_mib=300.0, peak_from="no gradients")], log)
    text = rl.summary(log, out)
    rows = [line for line in text.splitlines() if line.startswith("| 16384x4096")]
    assert any(r.startswith("| 16384x4096 | 0.3 | 0.4 |") for r in rows), rows
    assert any(r.startswith("| 16384x4096 (back-to-back calls) | 0.31 |") for r in rows), rows
    assert any(r.startswith("| 16384x4096 float32 | 0.5 |") for r in rows), rows
    graph = next(r for r in rows if "0.18," in r)
    assert f"100 MiB{rl.OLD_PEAK}" in graph and "300 MiB |" in graph
    assert rl.OLD_PEAK_NOTE in text


def test_summary_puts_probes_after_the_headline_tables(tmp_path):
    log, out = tmp_path / "log.jsonl", tmp_path / "RESULTS.md"
    rl.append([rec(0.182), rec(0.25, impl="liger-kernel"), rec(0.31, impl="liger-portable (old launch)", note="A/B"),
               rl.record("rms_norm", "16x4096", "liger-portable / F.rms_norm", "host_ratio", 1.9, env=ENV)], log)
    text = rl.summary(log, out)
    head, probes = text.split("\n## Probes\n")
    assert "| shape | liger-portable | liger-kernel | date | env |" in head and "old launch" not in head
    assert "| shape | liger-portable / F.rms_norm | date | env |" not in head  # one impl: the single table
    assert "| rms_norm | 16x4096 | liger-portable / F.rms_norm | 1.9 |" in head  # a ratio of headline impls
    assert "| fwd_bwd_graph_ms | rms_norm | 16384x4096 | liger-portable (old launch) | 0.31 | 2026-12-03 | E1 | 1 |" in probes
    assert "\n1. A/B" in probes
    assert rl.is_probe("liger-portable (sums in the launch) / F.rms_norm") and not rl.is_probe("liger-kernel / eager")


def test_records_from_tool_output():
    pytest_out = "...\n================= 398 passed, 56 warnings in 172.41s (0:02:52) =================\n"
    (r,) = rl.from_output("pytest", pytest_out, ENV)
    assert (r["metric"], r["value"], r["failed"]) == ("gpu_tests", 398, 0)
    check_out = "  PASS  rms_norm[llama] float32 (7, 4096) y 4.9e-08\n  FAIL  rope bfloat16 (2,) x\n1 FAILED in 3 s\n"
    (r,) = rl.from_output("check", check_out, ENV)
    assert (r["value"], r["failed"]) == (1, 1)
    (r,) = rl.from_output("warmup", "warmup of 6 problems on NVIDIA H200: 36.5 s (x)\n", ENV, label="llama-3-8b")
    assert (r["shape"], r["value"]) == ("llama-3-8b: 6 problems", 36.5)


def test_committed_results_md_is_up_to_date():
    assert rl.RESULTS.read_text(encoding="utf-8") == rl.summary_text(rl.read(rl.LOG)), (
        "scripts/results/RESULTS.md differs from what scripts/results/log.jsonl gives: "
        "run python scripts/results_log.py summary")
