"""The warmup's problem listing (``scripts/autotune_warmup.py --dry-run``), on the CPU."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from liger_portable import _warmup
from liger_portable.specs import SPECS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "autotune_warmup.py"


@pytest.fixture(scope="module")
def warmup():
    spec = importlib.util.spec_from_file_location("autotune_warmup", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llama3_8b_step_problems():
    probs = _warmup.step_problems(_warmup.PRESETS["llama-3-8b"], 8192, 4096, torch.bfloat16)
    got = {(p.kernel, p.problem, p.launches) for p in probs}
    assert got == {
        ("rms_norm_fwd", (4096, 8192), 65),
        ("rms_norm_bwd", (4096, 8192), 65),
        ("rope", (128, 40, 4096), 64),
        ("swiglu_fwd", (14336, 8192), 32),
        ("swiglu_bwd", (14336, 8192), 32),
        ("fused_linear_cross_entropy", (128256, 8192, 4096), 1),
    }
    for p in probs:  # every problem fits its kernel's spec key
        assert len(p.problem) == len(SPECS[p.kernel].key) and p.dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(_warmup.PRESETS))
def test_every_preset_is_consistent(name):
    m = _warmup.PRESETS[name]
    assert m.heads % m.kv_heads == 0 and m.head_dim % 2 == 0
    kernels = {p.kernel for p in _warmup.step_problems(m, 4096, 4096, torch.float16)}
    assert f"{m.glu}_fwd" in kernels and "rope" in kernels


def test_gemma2_uses_geglu_and_four_norms():
    probs = _warmup.step_problems(_warmup.PRESETS["gemma-2-9b"], 4096, 2048, torch.bfloat16, loss="cross_entropy",
                                  fused_add_norm=True)
    kernels = {p.kernel: p for p in probs}
    assert "geglu_fwd" in kernels and "swiglu_fwd" not in kernels
    assert kernels["fused_add_rms_norm_fwd"].launches == 4 * 42
    assert kernels["cross_entropy"].problem == (256000, 4096)
    assert kernels["rope"].problem == (256, 24, 2048)


def test_hf_config(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
           "num_key_value_heads": 2, "vocab_size": 151936, "num_hidden_layers": 24, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = _warmup.model_shape(str(tmp_path))
    assert (m.hidden, m.head_dim, m.kv_heads, m.glu, m.layers) == (896, 64, 2, "swiglu", 24)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="config.json: missing field"):
        _warmup.model_shape(str(tmp_path / "config.json"))


@pytest.mark.parametrize("content, message", [
    ({**{"hidden_size": 64, "intermediate_size": 128, "vocab_size": 300, "num_hidden_layers": 2},
      "num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"hidden_size": "64", "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300,
      "num_hidden_layers": 2}, "hidden_size must be a positive integer, got '64'"),
    ({"hidden_size": -64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300,
      "num_hidden_layers": 2}, "hidden_size must be a positive integer, got -64"),
    ({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300,
      "num_hidden_layers": 2, "head_dim": 0}, "head_dim must be a positive integer, got 0"),
    (5, "a model config is a JSON object"),
    (None, "a model config is a JSON object"),
])
def test_bad_hf_config_values(tmp_path, capsys, content, message):
    """Values a model cannot have are errors naming the file and field (zero heads was a
    ZeroDivisionError, a string size a TypeError, a negative one listed n_cols=-64), exit status 2."""
    from liger_portable import cli

    (tmp_path / "config.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=re.escape(message)):
        _warmup.model_shape(str(tmp_path))
    assert cli.main(["warmup", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("liger-portable warmup: error: ") and message in err and err.count("\n") == 1


def test_multimodal_config_reads_its_language_model(tmp_path):
    cfg = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 300, "num_hidden_layers": 2, "hidden_activation": "gelu_pytorch_tanh"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = _warmup.model_shape(str(tmp_path))
    assert (m.hidden, m.glu, m.norms_per_layer, m.vocab) == (64, "geglu", 4, 300)


def test_dedupe_keeps_the_largest_launch_count():
    """Problems sharing a cache entry (same kernel, bucket and dtype) are listed once, as the first
    of them, with the largest launch count among them, whichever came first; another dtype or
    bucket stays a problem of its own."""
    P = _warmup.Problem
    few = P("rms_norm_fwd", (4096, 1000), torch.bfloat16, 3, "a")
    many = P("rms_norm_fwd", (4096, 1024), torch.bfloat16, 65, "b")  # n_rows 1000 and 1024: one bucket
    other = P("rms_norm_fwd", (4096, 1000), torch.float16, 1, "c")
    assert _warmup.dedupe([few, other, many]) == [P("rms_norm_fwd", (4096, 1000), torch.bfloat16, 65, "a"), other]
    assert _warmup.dedupe([many, few]) == [many]


def test_missing_model_paths_say_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        _warmup.model_shape(str(tmp_path))
    with pytest.raises(ValueError, match="no such file: .*nope/config.json"):
        _warmup.model_shape(str(tmp_path / "nope" / "config.json"))


def test_tokens_not_a_multiple_of_seq_len_is_a_usage_error(capsys):
    from liger_portable import cli

    assert cli.main(["warmup", "llama-3-8b", "--tokens", "5000", "--seq-len", "4096", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == "liger-portable warmup: error: --tokens 5000 is not a multiple of --seq-len 4096; pick a seq-len dividing it\n"


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown model 'llama-9'"):
        _warmup.model_shape("llama-9")
    with pytest.raises(ValueError, match="multiple of seq_len"):
        _warmup.step_problems(_warmup.PRESETS["llama-3-8b"], 1000, 4096, torch.bfloat16)


def test_dry_run_lists_and_dedupes(warmup, capsys):
    assert warmup.main(["llama-3-8b", "--tokens", "8192", "16384", "--dtype", "bf16", "fp16", "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["problems"]
    # per dtype: rms fwd/bwd, swiglu fwd/bwd, flce for each token count (10), one shared rope problem
    assert len(rows) == 2 * 11 and out["model"]["hidden"] == 4096
    assert sum(r["kernel"] == "rope" for r in rows) == 2
    assert {r["dtype"] for r in rows} == {"bfloat16", "float16"}
    assert warmup.main(["mistral-7b", "--tokens", "2048", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "n_cols=32768 n_rows=2048 hidden=4096" in text and "launches/step" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_real_run_without_gpu_says_use_dry_run(warmup, capsys):
    assert warmup.main(["llama-3.2-1b", "--tokens", "2048"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_cli_warmup_dry_run(capsys):
    """`liger-portable warmup` runs the same code as the script (shipped in the wheel)."""
    from liger_portable import cli

    assert cli.main(["warmup", "mistral-7b", "--tokens", "2048", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "kernel problems for mistral-7b" in out and "rms_norm_fwd" in out


def test_warmup_without_triton_is_one_line_error():
    """Without Triton (off Linux, the fallback only) no kernel is registered: the warmup, dry run
    included, says so in one line (it died on an assertion)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` fails, find_spec finds nothing
        "from liger_portable import cli\n"
        "sys.exit(cli.main(['warmup', 'llama-3-8b', '--dry-run']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.startswith("liger-portable warmup: error: the kernels need Triton, which is not installed")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_cli_rejects_unknown_arguments():
    from liger_portable import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--bogus"])
    assert e.value.code == 2


# --------------------------------------------------------------------------- a real run (simulated device)

TINY_LLAMA = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 300, "num_hidden_layers": 2, "hidden_act": "silu"}


@pytest.mark.interpreter
def test_real_run_tunes_every_problem_then_is_a_no_op(warmup, tmp_path, monkeypatch, capsys, request):
    """A real run with the default hooks on a simulated H200 (kernels in the Triton interpreter,
    a fake timer): every problem of the step is tuned and recorded; a re-run tunes nothing."""
    from conftest import SIMULATED_DEVICES
    from liger_portable import autotune_cache, _paths, hardware
    from liger_portable import warmup as warmup_mod
    from liger_portable import simulate
    from liger_portable.tuning import runtime, search, timing

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(_paths, "shipped_cache_dir", lambda: shipped)
    runtime.reset_hooks()  # the default hooks, registered by the run
    request.addfinalizer(runtime.reset_hooks)
    monkeypatch.setattr(search, "candidates", lambda k, d, n, _all=search.candidates: _all(k, d, n)[:1])
    timed = []
    monkeypatch.setattr(timing, "do_bench_ms", lambda fn: (fn(), timed.append(1), 1.0)[2])
    dev = SIMULATED_DEVICES["cuda-sm90"]
    monkeypatch.setattr(warmup_mod, "target_device", lambda: dev)
    hardware.reset()
    args = [str(tmp_path), "--tokens", "32", "--seq-len", "16", "--dtype", "fp32"]
    with simulate(dev):
        assert warmup.main(args) == 0
        first = capsys.readouterr()
        n_timed = len(timed)
        assert warmup.main([*args, "--json"]) == 0
        second = json.loads(capsys.readouterr().out)
    probs = warmup_mod.problems_of(warmup_mod.parse_args(args))
    assert {p.kernel for p in probs} == {"rms_norm_fwd", "rms_norm_bwd", "rope", "swiglu_fwd", "swiglu_bwd",
                                         "fused_linear_cross_entropy"}
    assert n_timed == 2 * len(probs)  # the table default and one candidate each
    for p in probs:
        assert autotune_cache.lookup_entry(SPECS[p.kernel], dev, p.named, p.dtype) is not None, p
    assert first.out.count(" tuned") == len(probs) and "not tuned" not in first.err
    assert f"[{len(probs)}/{len(probs)}]" in first.err and "elapsed" in first.err and "eta" in first.err
    assert [r["status"] for r in second["results"]] == ["cached"] * len(probs)
    assert len(timed) == n_timed  # the re-run timed nothing


def test_real_run_on_an_unsupported_gpu_is_an_error(warmup, tmp_path, monkeypatch, capsys):
    """A GPU Triton cannot compile the kernels for (a P100) has nothing to tune: one line saying why,
    status 2, instead of compiler errors from the first tuned kernel."""
    from liger_portable import warmup as warmup_mod
    from liger_portable.hardware import DeviceInfo

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    p100 = DeviceInfo("cuda", 0, "Tesla P100-PCIE-16GB", "sm60", 32, 56, 1024, 49152)
    monkeypatch.setattr(warmup_mod, "target_device", lambda: p100)
    assert warmup.main([str(tmp_path), "--tokens", "32", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Tesla P100-PCIE-16GB (sm60) cannot run the Triton kernels" in err and "sm_70" in err
    # the dry run lists the step's problems as running the fallback there, not as work to tune
    assert warmup.main([str(tmp_path), "--tokens", "32", "--seq-len", "16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "fallback (GPU unsupported)" in out and "to tune" not in out


@pytest.mark.interpreter
def test_real_run_that_cannot_save_fails(warmup, tmp_path, monkeypatch, capsys, request):
    """A warmup whose cache folder cannot be written (here a file stands where it should be) tunes
    in memory only, and says so with exit status 1: its one product is the cache file (it exited 0
    with one warning and the tuning was lost at exit)."""
    from conftest import SIMULATED_DEVICES
    from liger_portable import autotune_cache, _paths, hardware
    from liger_portable import warmup as warmup_mod
    from liger_portable import simulate
    from liger_portable.tuning import runtime, search, timing

    cfg = {**TINY_LLAMA, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "cache").write_text("a file, not a folder")
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(_paths, "shipped_cache_dir", lambda: shipped)
    runtime.reset_hooks()
    request.addfinalizer(runtime.reset_hooks)
    request.addfinalizer(autotune_cache.clear_overlay)
    monkeypatch.setattr(search, "candidates", lambda k, d, n, _all=search.candidates: _all(k, d, n)[:1])
    monkeypatch.setattr(timing, "do_bench_ms", lambda fn: (fn(), 1.0)[1])
    dev = SIMULATED_DEVICES["cuda-sm90"]
    monkeypatch.setattr(warmup_mod, "target_device", lambda: dev)
    hardware.reset()
    with simulate(dev), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warmup.main([str(tmp_path), "--tokens", "16", "--seq-len", "16", "--dtype", "fp32"]) == 1
    assert any("cannot write the autotune cache" in str(w.message) for w in caught)
    assert autotune_cache.in_memory_only(dev)
    err = capsys.readouterr().err
    assert "liger-portable warmup: error: the tuned configs could not be written to" in err
    assert "LIGER_PORTABLE_CACHE_DIR" in err


@pytest.mark.parametrize("args", [["--tokens", "0"], ["--tokens", "-5"], ["--seq-len", "0"], ["--tokens", "many"]])
def test_cli_warmup_rejects_sizes_below_one(args, capsys):
    """A token count or sequence length below 1 is an argument error (one line, exit status 2);
    --tokens 0 ended in a ZeroDivisionError traceback."""
    from liger_portable import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["warmup", "llama-3-8b", "--dry-run", *args])
    assert e.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_under_torchrun_an_unsupported_gpu_stops_every_rank(monkeypatch, capsys):
    """On a mixed node under torchrun, the ranks decide together: a rank whose GPU is supported stops
    too (status 2, naming the other rank's GPU) when another rank's is refused, instead of waiting in
    the tuning collectives for a rank that left."""
    import torch.distributed as dist

    from liger_portable import warmup as warmup_mod
    from liger_portable.hardware import DeviceInfo

    gathered = []

    def all_gather_object(out, mine):
        gathered.append(mine)
        out[:] = [mine, ["Tesla P100-PCIE-16GB (sm60)"]]  # this rank, then the other rank's answer

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    h200 = DeviceInfo("cuda", 0, "NVIDIA H200", "sm90", 32, 132, 1024, 232448)
    monkeypatch.setattr(warmup_mod, "target_device", lambda: h200)
    assert warmup_mod.run(warmup_mod.parse_args(["llama-3-8b"]), []) == 2
    assert gathered == [[]]  # this rank's GPU is supported
    err = capsys.readouterr().err
    assert "Tesla P100-PCIE-16GB (sm60) cannot run the Triton kernels" in err and err.count("\n") == 1


def test_under_torchrun_the_group_outwaits_the_tuning_lock_and_comes_before_the_device(monkeypatch):
    """Under torchrun the warmup joins the process group first (it sets the rank's GPU, which the
    device lookup then reads) with a collective timeout beyond the tuning-lock wait (other ranks wait
    in a collective while their leader waits for the lock; NCCL's default 10 minutes aborted them)."""
    import datetime

    import torch.distributed as dist

    from liger_portable import tuning
    from liger_portable import warmup as warmup_mod

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("group", kw)))
    monkeypatch.setattr(warmup_mod, "target_device", lambda: calls.append(("device", None)))
    assert warmup_mod.run(warmup_mod.parse_args(["llama-3-8b"]), []) == 2  # no device: stops there
    assert [c[0] for c in calls] == ["group", "device"]
    timeout = calls[0][1]["timeout"]
    assert timeout >= datetime.timedelta(seconds=tuning.lock_timeout() + 600)
