"""Multi-process checks on CPU processes (gloo), through the same script the 2-GPU run uses:
``scripts/distributed_check.py`` under torchrun. DTensor norms (tensor / sequence parallel layouts
and FSDP2's DTensor parameters) always; a patched Hugging Face model under DDP and FSDP2 when
transformers is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "distributed_check.py"), *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())["results"]


def test_dtensor_norms_and_fsdp2_norm_grads(tmp_path):
    results = _torchrun(tmp_path, "--checks", "dtensor", "--dtype", "float32", "bfloat16")
    names = [r["check"] for r in results]
    assert sum("fsdp2" in n for n in names) == 2 and sum("error" in n for n in names) == 8
    assert sum("non-contiguous" in n for n in names) == 2
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (the hf extra)")
def test_patched_model_under_ddp_and_fsdp2(tmp_path):
    results = _torchrun(tmp_path, "--checks", "ddp", "fsdp2", "--steps", "5", "--dtype", "float32", "bfloat16")
    assert [(r["check"], r["dtype"]) for r in results] == [
        ("ddp", "float32"), ("fsdp2", "float32"), ("ddp", "bfloat16"), ("fsdp2", "bfloat16")]
    for r in results:
        assert r["ok"], r
        assert r["losses"][-1] < r["losses"][0]  # it trains
