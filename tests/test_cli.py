"""The ``liger-portable`` command line as a user runs it: the installed entry point (where the
environment has one: ``pip install`` puts it beside the interpreter) and ``python -m``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SIMULATED_DEVICES
from liger_portable import commands, simulate

ENTRY = Path(sys.executable).parent / "liger-portable"


def run(args: list[str], env_extra: dict | None = None, entry: bool = True) -> subprocess.CompletedProcess:
    if entry and not ENTRY.exists():
        pytest.skip(f"no installed entry point beside {sys.executable} (pip install the package)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_PORTABLE_")}
    env.update(env_extra or {})
    cmd = [str(ENTRY), *args] if entry else [sys.executable, "-m", "liger_portable", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def imports_torch(code: str) -> bool:
    """Whether running ``code`` in a fresh interpreter imported torch."""
    probe = f"import sys\ntry:\n    {code}\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_help_lists_every_command_in_plain_text():
    r = run(["--help"])
    assert r.returncode == 0, r.stderr
    for command in ("info", "check", "warmup", "demo"):
        assert f"  {command} " in r.stdout, r.stdout
        listed = [line for line in r.stdout.splitlines() if line.split()[:1] == [command]]
        assert len(listed) == 1, f"{command} listed {len(listed)} times:\n{r.stdout}"
    assert "``" not in r.stdout and ":mod:" not in r.stdout


@pytest.mark.parametrize(
    "args",
    [["--help"], ["info", "--bogus"], ["bogus"], [], ["warmup", "-h"], ["demo", "-h"],
     ["warmup", "llama-3-8b", "--tokens", "0"], ["demo", "--steps", "0"], ["warmup"]],
    ids=["help", "bad-option", "bad-command", "none", "warmup-help", "demo-help", "warmup-bad-tokens", "demo-bad-steps",
         "warmup-no-model"],
)
def test_help_and_argument_errors_do_not_import_torch(args):
    """Parsing comes first: --help and argument errors answer without importing torch (which alone
    takes seconds)."""
    assert not imports_torch(f"from liger_portable.cli import main; main({args!r})")
    assert not imports_torch("import liger_portable")


@pytest.mark.parametrize("entry", [True, False], ids=["entry-point", "python-m"])
@pytest.mark.parametrize("value", ["bogus", "rocm"])
def test_bad_backend_is_one_line_and_status_2(entry, value):
    """An unknown backend, or one this machine does not offer (no test machine offers both CUDA and
    ROCm), is one error line naming the variable, no traceback."""
    r = run(["info"], {"LIGER_PORTABLE_BACKEND": value}, entry=entry)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert "Traceback" not in r.stderr
    assert lines[-1].startswith("liger-portable: error: LIGER_PORTABLE_BACKEND=") and value in lines[-1]
    assert r.stdout == ""


def test_bad_under_compile_setting_is_one_line_and_status_2():
    """A bad LIGER_PORTABLE_UNDER_COMPILE is one error line naming the variable (it was a traceback);
    an empty value is unset, as for the other variables, and case does not matter."""
    r = run(["check", "--help"], {"LIGER_PORTABLE_UNDER_COMPILE": "bogus"}, entry=False)
    assert r.returncode == 0  # help parses before anything is imported
    r = run(["info"], {"LIGER_PORTABLE_UNDER_COMPILE": "bogus"}, entry=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "liger-portable: error: LIGER_PORTABLE_UNDER_COMPILE must be one of inductor, kernels, got 'bogus'"
    )
    code = "from liger_portable import functional as F; print(F.UNDER_COMPILE)"
    for value, want in (("", "inductor"), (" Kernels ", "kernels")):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LIGER_PORTABLE_")},
               "LIGER_PORTABLE_UNDER_COMPILE": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == want, out.stderr


@pytest.mark.parametrize("module", ["liger_portable.warmup", "liger_portable.demo", "scripts/autotune_warmup.py"])
def test_other_entry_points_report_errors_as_the_cli(module):
    """``python -m liger_portable.warmup`` / ``.demo`` and the warmup script (what the README runs
    under torchrun) report a platform error in one line with status 2, as ``liger-portable`` does
    (they printed a traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_PORTABLE_")}
    env["LIGER_PORTABLE_BACKEND"] = "bogus"
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / module)] if module.endswith(".py") else [sys.executable, "-m", module]
    args = ["llama-3-8b", "--dry-run"] if "warmup" in module else ["--steps", "1"]
    r = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("liger-portable: error: LIGER_PORTABLE_BACKEND=")


def test_check_device_index_errors_are_one_line(monkeypatch, capsys):
    """``check --device`` takes an index >= 0 (argparse: status 2), and one this machine has (one
    line, status 2; a negative or missing index was a torch traceback)."""
    from liger_portable import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--device", "-3"])
    assert e.value.code == 2 and "expected a GPU index (a whole number >= 0), got '-3'" in capsys.readouterr().err
    import types

    one_gpu = types.SimpleNamespace(backend="cuda", device_count=1, torch_device_type="cuda")
    monkeypatch.setattr(commands, "platform", lambda: one_gpu)
    assert cli.main(["check", "--device", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("liger-portable: error: --device 7: this machine has 1 cuda device(s), indices 0 to 0")


def test_interrupt_is_one_line_and_status_130(monkeypatch, capsys):
    from liger_portable import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_info", interrupted)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err == "liger-portable: interrupted\n"


def test_warmup_argument_error_is_one_line_and_status_2():
    r = run(["warmup", "llama-3-8b", "--tokens", "0", "--dry-run"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--tokens" in r.stderr


def test_no_numpy_warning_without_numpy(tmp_path):
    """NumPy is not a dependency: without it, torch warns at import that it cannot initialise it;
    the command line does not pass that on. (NumPy is hidden by a sitecustomize that blocks it.)"""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['numpy'] = None\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_PORTABLE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["LIGER_PORTABLE_BACKEND"] = "cpu"
    env.pop("TRITON_INTERPRET", None)  # the Triton interpreter (CPU test path) does need NumPy
    r = subprocess.run([sys.executable, "-m", "liger_portable", "info"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "NumPy" not in r.stderr and "backend cpu" in r.stdout


@pytest.mark.parametrize("command", ["warmup", "demo"])
def test_subcommand_help_lists_its_arguments_in_plain_text(command):
    r = run([command, "-h"])
    assert r.returncode == 0, r.stderr
    assert f"usage: liger-portable {command}" in r.stdout
    for option in {"warmup": ("--tokens", "--seq-len", "--dry-run", "llama-3-8b"), "demo": ("--steps", "--device", "--json")}[command]:
        assert option in r.stdout, r.stdout
    assert "``" not in r.stdout and ":func:" not in r.stdout


def test_check_covers_every_public_op_and_reports_wrong_or_failing_kernels(monkeypatch, capsys):
    """`liger-portable check` on the CPU: a case for every public op of ``functional``, each in the
    three dtypes; a kernel off by 1e-3 (within bf16's and fp16's tolerance, 100x fp32's) fails its
    fp32 cases, and one that raises fails all of its own, while the others are still checked and pass."""
    from liger_portable import cli, functional

    real_rms_norm = functional.rms_norm

    def off_by_a_little(*args, **kwargs):
        return real_rms_norm(*args, **kwargs) * (1 + 1e-3)

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel that fails to launch")

    monkeypatch.setattr(functional, "rms_norm", off_by_a_little)
    monkeypatch.setattr(functional, "rope", broken)
    monkeypatch.setattr(functional, "geglu", broken)
    assert cli.main(["check"]) == 1
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    results = {}  # (case name, dtype) -> ["PASS" | "FAIL", ...]
    for status, name, dtype, *_ in lines:
        results.setdefault((name, dtype), []).append(status)
    ops = {name.split("[")[0].replace("flce", "fused_linear_cross_entropy") for name, _ in results}
    assert ops >= set(functional.__all__), ops
    assert {dtype for _, dtype in results} == {"float32", "bfloat16", "float16"}
    for (name, dtype), statuses in results.items():
        failing = (name.startswith("rms_norm[") and dtype == "float32") or name.startswith("rope[") or name == "geglu"
        assert statuses == ["FAIL" if failing else "PASS"] * len(statuses), (name, dtype, statuses)
    # a case is named alike whether it passed or raised
    assert {"rope[hf]", "rms_norm[llama]", "geglu", "swiglu", "flce[plain]"} <= {name for name, _ in results}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", commands.CHECK_CASES, ids=lambda c: f"{c.name}-{'x'.join(map(str, c.shape))}")
def test_check_case_passes_through_the_kernels(case, launches):
    """Each case of `liger-portable check` as a GPU runs it: the Triton kernels (here in the
    interpreter, on CPU tensors, with the H200's configs) against float64, within float32's 1e-5.
    The CPU test above runs the fallback, which takes no kernel path (such as the GLUs' in-place
    backward, which refuses leaf tensors)."""
    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        r = commands.run_check(case, torch.device("cpu"), torch.float32)
    assert r.ok, r.detail
    assert launches, "the case ran no kernel"


@pytest.mark.gpu
def test_check_passes_on_the_gpu(capsys):
    """`liger-portable check` on this machine's first GPU: every case in every dtype."""
    from liger_portable import cli

    assert cli.main(["check"]) == 0, capsys.readouterr().out
