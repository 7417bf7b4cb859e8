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


def test_old_peak_marks_only_the_benchmarks_that_measured_beside_old_gradients():
    def r(op, date, **extra):
        return {"op": op, "metric": "fwd_bwd_graph_ms", "date": date, "peak_mib": 1.0, **extra}

    assert rl.old_peak(r("rms_norm", "2026-12-03")) and rl.old_peak(r("dpo_loss", "2026-12-05"))
    assert not rl.old_peak(r("rms_norm", "2026-12-06", peak_from="no gradients"))
    assert not rl.old_peak(r("swiglu", "2026-12-02")) and not rl.old_peak(r("fused_add_rms_norm", "2026-12-03"))
    assert rl.old_peak(r("fused_linear_cross_entropy", "2026-12-03"))
    assert not rl.old_peak(r("fused_linear_cross_entropy", "2026-12-04"))
    assert not rl.old_peak({"op": "train_step", "metric": "tokens_per_s", "date": "2026-12-03", "peak_gib": 3.0})


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


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = rl.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


DEMO = {"config": {"hidden_size": 64, "num_hidden_layers": 2, "batch": 2, "seq": 16, "dtype": "float32"},
        "tokens_per_s": {"hf": 1000.0, "patched": 1500.0}, "peak_memory_bytes": {"hf": 2**30, "patched": 2**29},
        "compared_steps": 10, "max_rel_loss_diff": 1e-6, "rel_tolerance": 1e-3, "ok": True, "kernels": True}


def test_cli_named_input_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    """A missing file named on the command line is one line and exit 2, and nothing is written (a typo
    in summary --log used to rewrite RESULTS.md as an empty summary; add used to add 0 records)."""
    log, out = tmp_path / "log.jsonl", tmp_path / "RESULTS.md"
    cases = [(["add", tmp_path / "nope.jsonl", "--log", log], "nope.jsonl: no such file (add takes JSONL files"),
             (["summary", "--log", tmp_path / "typo.jsonl", "--out", out], "typo.jsonl: no such file (--log names"),
             (["summary", "--check", "--log", tmp_path / "typo.jsonl", "--out", out], "typo.jsonl: no such file"),
             (["record", "check", tmp_path / "nope.txt", "--out", log],
              "nope.txt: no such file (record check takes the output of `liger-portable check`)"),
             (["add", tmp_path, "--log", log], "is a folder (add takes JSONL files")]
    for argv, message in cases:
        code, stdout, err = _cli(capsys, *argv)
        assert code == 2 and stdout == "", argv
        assert err.startswith("results_log.py: error: ") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    rl.append([rec(0.2)], log)
    before = log.read_text()
    (tmp_path / "check.out").write_text("  PASS  rms_norm float32 (7, 4096) y 4.9e-08\n")
    (tmp_path / "x.json").write_text('{"x": 1}\n')
    (tmp_path / "list.json").write_text('{"config": [1, 2]}\n')
    (tmp_path / "bad.jsonl").write_text(json.dumps(rec(0.3)) + '\n{"date": "2026-12-03"}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    cases = [(["record", "demo", "check.out"], "check.out is not `liger-portable demo --json` output (no JSON object"),
             (["record", "demo", "x.json"], "x.json is not `liger-portable demo --json` output (no field 'config')"),
             (["record", "demo", "list.json"], "list.json is not `liger-portable demo --json` output (TypeError"),
             (["record", "distributed", "x.json"],
              "x.json is not the JSON file of `scripts/distributed_check.py --json` (no field 'results')"),
             (["record", "pytest", "check.out"], "no pytest result found in"),
             (["add", "bad.jsonl"], "bad.jsonl:2: record lacks device"),
             (["add", "binary.jsonl"], "binary.jsonl:1: not UTF-8 text"),
             (["summary", "--out", tmp_path / "no" / "RESULTS.md"], "cannot write --out"),
             (["record", "check", "check.out", "--out", tmp_path / "check.out" / "x.jsonl"], "cannot write --out")]
    for argv, message in cases:
        argv = [tmp_path / a if a in ("check.out", "x.json", "list.json", "bad.jsonl", "binary.jsonl") else a
                for a in argv]
        code, stdout, err = _cli(capsys, *argv, "--log", log)
        assert code == 1 and stdout == "", (argv, err)
        assert err.startswith("results_log.py: error: ") and message in err and err.count("\n") == 1, err
    assert log.read_text() == before
    # the script itself: the same line on stderr, no traceback
    r = subprocess.run([sys.executable, str(SCRIPT), "record", "demo", str(tmp_path / "x.json"), "--out",
                        str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr == f"results_log.py: error: {tmp_path / 'x.json'} is not `liger-portable demo --json` output " \
                       "(no field 'config')\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_record_appends_to_out_and_summary_writes_out(tmp_path, capsys):
    (tmp_path / "demo.json").write_text("progress line\n" + json.dumps(DEMO))
    out = tmp_path / "new" / "records.jsonl"  # created, folder and all
    code, stdout, err = _cli(capsys, "record", "demo", tmp_path / "demo.json", "--out", out)
    assert (code, err) == (0, "") and stdout == f"{out}: 2 records\n"
    code, stdout, err = _cli(capsys, "summary", "--log", out, "--out", tmp_path / "RESULTS.md")
    assert (code, err, stdout) == (0, "", f"wrote {tmp_path / 'RESULTS.md'}\n")
    assert "1,500 x1.50, 0.5 GiB" in (tmp_path / "RESULTS.md").read_text()


def test_record_demo_without_kernels_keeps_no_ratio():
    """On the PyTorch fallback both runs are PyTorch: their tokens/s ratio is the machine's load, so the
    records leave it out (as the demo's own output does)."""
    hf, ours = rl.from_output("demo", json.dumps(DEMO), ENV)
    assert "vs_hf" in hf and ours["vs_hf"] == 1.5
    for r in rl.from_output("demo", json.dumps({**DEMO, "kernels": False}), ENV):
        assert "vs_hf" not in r and r["value"] in (1000.0, 1500.0)


def test_summary_help_explains_out(capsys):
    with pytest.raises(SystemExit) as e:
        rl.main(["summary", "--help"])
    assert e.value.code == 0
    assert "the Markdown file to write" in capsys.readouterr().out


def test_save_refuses_cpu_records_without_out(tmp_path, monkeypatch):
    """The committed log holds GPU figures: records of a CPU run go to $OUT only; without it save writes
    nothing and says how to fix it."""
    log = tmp_path / "log.jsonl"
    monkeypatch.setattr(rl, "LOG", log)
    monkeypatch.delenv("OUT", raising=False)
    cpu = rl.record("rms_norm", "16x64", "liger-portable", "host_us", 100.0, env={**ENV, "device": "cpu"})
    with pytest.raises(rl.CPURecordsError, match="records of a CPU run must not go to .*set OUT"):
        rl.save([rec(0.2), cpu], "x")
    assert not log.exists()
    assert rl.save([rec(0.2)], "x") == str(log) and len(rl.read(log)) == 1
    monkeypatch.setenv("OUT", str(tmp_path))
    assert rl.save([cpu], "x") == str(tmp_path / "x.jsonl")


def test_records_take_the_device_from_the_output():
    """A record made from a tool's output names the device the output names, not the machine running
    ``record`` (ENV's device here is an H200)."""
    out = "liger-portable check on NVIDIA H100 80GB HBM3 (cuda sm90)\n  PASS  rope bfloat16 (2,) x\n1 passed in 3 s\n"
    assert rl.from_output("check", out, ENV)[0]["device"] == "NVIDIA H100 80GB HBM3"
    out = "liger-portable check on cpu (PyTorch fallback)\n  PASS  rope float32 (2,) x\n"
    assert rl.from_output("check", out, ENV)[0]["device"] == "cpu"
    (r,) = rl.from_output("warmup", "warmup of 6 problems on AMD Instinct MI300X: 36.5 s (x)\n", ENV)
    assert r["device"] == "AMD Instinct MI300X"
    demo = {**DEMO, "device": "cuda:0", "device_name": "NVIDIA A100-SXM4-80GB",
            "platform": {"torch": "2.9.1", "triton": "3.5.1"}}
    for r in rl.from_output("demo", json.dumps(demo), ENV):
        assert r["device"] == "NVIDIA A100-SXM4-80GB" and r["versions"]["torch"] == "2.9.1"
        assert r["versions"]["triton"] == "3.5.1" and r["versions"]["liger_portable"] == "abc1234"
    for r in rl.from_output("demo", json.dumps({**DEMO, "device": "cpu", "device_name": "cpu"}), ENV):
        assert r["device"] == "cpu"
    assert rl.from_output("demo", json.dumps(DEMO), ENV)[0]["device"] == "NVIDIA H200"  # names none: ENV's


def test_versions_name_the_commit_given_over_the_checkouts(monkeypatch):
    # A working tree copied to a GPU machine can carry an older .git: the sender names the commit.
    monkeypatch.setenv("LIGER_PORTABLE_COMMIT", "feed123")
    assert rl.versions()["liger_portable"] == "feed123"
    monkeypatch.setenv("LIGER_PORTABLE_COMMIT", "")
    monkeypatch.setattr(rl, "_git_commit", lambda: "abc1234+dirty")
    assert rl.versions()["liger_portable"] == "abc1234+dirty"
