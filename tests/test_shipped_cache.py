"""The tuned files shipped in ``autotune_cache/``: well formed, legal on their device, and current.

A shipped entry whose kernel source changed since it was measured is ignored at run time (its key
holds the source's hash), so the file silently stops helping; these tests fail instead, naming the
entries, so that a kernel change comes with a re-run of the warmup on that GPU (or the removal of
its stale entries).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SIMULATED_DEVICES
from liger_portable import autotune_cache, _paths
from liger_portable.configs import Limits, check_config, load_table
from liger_portable.hardware import DeviceInfo
from liger_portable.specs import SPECS

FILES = sorted(Path(_paths.shipped_cache_dir()).glob("*.json"))
# Device model of each shipped file -> the device with its limits: the simulated ones
# (tests/conftest.py) and the H100 SXM (132 SMs, 227 KiB of shared memory a block, as the H200).
DEVICES = {d.name: d for d in SIMULATED_DEVICES.values()}
DEVICES["NVIDIA H100 80GB HBM3"] = DeviceInfo("cuda", 0, "NVIDIA H100 80GB HBM3", "sm90", 32, 132, 1024, 232448)


def test_files_are_shipped():
    assert [f.name for f in FILES] == ["NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_shipped_file_is_well_formed_legal_and_current(path):
    data = json.loads(path.read_text())
    assert data["format"] == autotune_cache.FORMAT
    device = DEVICES[data["device"]]
    assert path.stem == device.model_slug, "the file name must be the device model's slug"
    entries = autotune_cache.parse(path)
    assert entries, "a shipped file with no entries"
    table, limits = load_table(device.backend), Limits.of(device)
    stale = []
    for key, entry in entries.items():
        kernel, version, triton_mm, dtype, problem = key.split("|")
        spec = SPECS[kernel]
        assert triton_mm.startswith("triton") and dtype in ("float32", "bfloat16", "float16"), key
        named = dict((k, int(v)) for k, v in (kv.split("=") for kv in problem.split(",")))
        assert tuple(named) == spec.key, key
        assert problem == ",".join(f"{k}={v}" for k, v in spec.bucket(named)), f"{key}: not a bucket"
        check_config(entry["config"], spec, table.backend, limits, key)
        assert entry["time_ms"] > 0 and entry["default_ms"] > 0 and entry["time_ms"] <= entry["default_ms"], key
        assert set(entry["versions"]) >= {"torch", "triton"} and entry["measured_at"], key
        if version != spec.version:
            stale.append(f"{kernel} (measured on source {version}, now {spec.version})")
    assert not stale, (
        f"{path.name}: entries of changed kernels, ignored at run time: {'; '.join(stale)}. Re-run "
        "`liger-portable warmup` on that GPU and ship its cache file, or delete these entries."
    )
