"""Config tables (``backends/<vendor>.json``), their validation, and config resolution.

Shipped tables must validate; broken copies of them must fail with a ConfigError that names the
file, the kernel and the field. Resolution is checked on ``DeviceInfo`` objects built directly:
rule boundaries, arch-section overrides, the default-section fallback, memoization, fitting to a
smaller device, and the lookup order user cache -> shipped cache -> table (a bad cache file warns
and falls through, never raises).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from liger_portable import autotune_cache, _paths, hardware
from liger_portable.configs import (
    ConfigError,
    Limits,
    check_config,
    load_table,
    parse_table,
    resolve,
    search_configs,
    search_space,
    table_config,
)
from liger_portable.hardware import ALL_BACKEND_OPTIONS, BACKEND_OPTIONS, ENV_BACKEND, DeviceInfo
from liger_portable.specs import SPECS

from conftest import problem_for

GPU_BACKENDS = ("cuda", "rocm", "xpu")


def _problem(spec, first: int) -> dict:
    """A problem for ``spec``: its first key field (the one rules bound most) set to ``first``,
    the others to 1000, in the spec's key order."""
    return {k: (first if i == 0 else 1000) for i, k in enumerate(spec.key)}


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Empty, private autotune caches and a freshly detected platform in every test."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(tmp_path / "user_cache"))
    shipped = tmp_path / "shipped_cache"
    shipped.mkdir()
    monkeypatch.setattr(_paths, "shipped_cache_dir", lambda: shipped)
    hardware.reset()
    yield
    hardware.reset()


def raw_table(backend: str) -> dict:
    """A private, decoded copy of the shipped table (mutate freely); ``"base"`` gives base.json."""
    return json.loads((_paths.backends_dir() / f"{backend}.json").read_text())


def entry_of(kernels: dict, kernel: str) -> dict:
    """The entry of ``kernel`` in a table's ``kernels`` object (a key may name several kernels)."""
    return next(e for key, e in kernels.items() if kernel in (k.strip() for k in key.split(",")))


def parse(data: dict, backend: str, base: dict | None = None, tmp: Path | None = None):
    """Parse ``data`` beside the shipped base.json, or beside ``base`` written into ``tmp``."""
    folder = _paths.backends_dir()
    if base is not None:
        folder = tmp / "backends"
        folder.mkdir(exist_ok=True)
        (folder / "base.json").write_text(json.dumps(base))
    return parse_table(data, folder / f"{backend}.json", backend)


def expect_config_error(data: dict, backend: str, *fragments: str, base: dict | None = None, tmp: Path | None = None) -> str:
    with pytest.raises(ConfigError) as ei:
        parse(data, backend, base, tmp)
    msg = str(ei.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


# Devices built directly (no detection involved).
H200 = dict(backend="cuda", index=0, name="NVIDIA H200", arch="sm90", warp_size=32, compute_units=132,
            max_threads_per_block=1024, shared_mem_per_block=232448)
DEVICES = {
    "cuda-sm90": H200,
    "cuda-sm86": dict(H200, name="NVIDIA GeForce RTX 3090", arch="sm86", compute_units=82, shared_mem_per_block=101376),
    "rocm-gfx942": dict(backend="rocm", index=0, name="AMD Instinct MI300X", arch="gfx942", warp_size=64,
                        compute_units=304, max_threads_per_block=1024, shared_mem_per_block=65536),
    "rocm-gfx1100": dict(backend="rocm", index=0, name="AMD Radeon RX 7900 XTX", arch="gfx1100", warp_size=32,
                         compute_units=48, max_threads_per_block=1024, shared_mem_per_block=65536),
    "xpu-xe-hpc": dict(backend="xpu", index=0, name="Intel(R) Data Center GPU Max 1550", arch="xe-hpc",
                       warp_size=32, compute_units=128, max_threads_per_block=1024, shared_mem_per_block=131072),
    "xpu-xe2": dict(backend="xpu", index=0, name="Intel(R) Arc(TM) B580 Graphics", arch="xe2", warp_size=32,
                    compute_units=20, max_threads_per_block=1024, shared_mem_per_block=65536),
}


def device(key: str, **overrides) -> DeviceInfo:
    return DeviceInfo(**{**DEVICES[key], **overrides})


# --------------------------------------------------------------------------- shipped tables


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_shipped_table_loads(backend):
    t = load_table(backend)
    assert t.backend == backend
    assert t.path.name == f"{backend}.json"
    assert "default" in t.sections
    default = t.sections["default"]
    for kernel in SPECS:
        entry = default.kernels[kernel]
        assert entry.rules and entry.rules[-1].upto == (), f"{kernel}: default rules need a catch-all"
        assert entry.search, f"{kernel}: default section needs a search space"
    assert load_table(backend) is t  # memoized


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_every_rule_fits_its_section_limits(backend):
    t = load_table(backend)
    foreign = ALL_BACKEND_OPTIONS - BACKEND_OPTIONS[backend]
    for sname, section in t.sections.items():
        lim = section.limits
        for kernel, entry in section.kernels.items():
            spec = SPECS[kernel]
            for i, rule in enumerate(entry.rules):
                where = f"{backend}.json [{sname}] {kernel} rule {i}"
                check_config(rule.config, spec, backend, lim, where)
                assert rule.config["num_warps"] * lim.warp_size <= lim.max_threads_per_block, where
                assert spec.smem_bytes(rule.config, rule.config["num_warps"], 4) <= lim.shared_mem_per_block, where
                assert not foreign & set(rule.config), where
                assert all(k in spec.key for k, _ in rule.upto), where


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_every_search_point_is_legal(backend):
    t = load_table(backend)
    for sname, section in t.sections.items():
        lim = section.limits
        for kernel, spec in SPECS.items():
            space = search_space(t, sname, kernel)
            points = list(search_configs(t, sname, kernel, lim))
            where = f"{backend}.json [{sname}] {kernel}"
            # The table lists no value that is illegal on its own section (nothing silently dropped).
            assert len(points) == math.prod(len(v) for v in space.values()), where
            # Every point, completed by the rule configs it would replace, is a full legal config.
            rule_cfgs = [table_config(t, sname, kernel, _problem(spec, n))[0] for n in (37, 1024, 4096, 70000)]
            for point in points:
                check_config(point, spec, backend, lim, where, partial=True)
                for base in rule_cfgs:
                    check_config({**base, **point}, spec, backend, lim, f"{where} {point}")


def test_search_configs_drops_points_over_device_limits():
    """A device with smaller limits than its table gets only the points that fit it."""
    t = load_table("rocm")
    small = Limits(warp_size=64, max_threads_per_block=256, shared_mem_per_block=65536)
    points = list(search_configs(t, "gfx942", "rms_norm_fwd", small))
    assert points
    assert max(p["num_warps"] for p in points) == 4
    full = list(search_configs(t, "gfx942", "rms_norm_fwd", t.sections["gfx942"].limits))
    assert len(points) < len(full)


# --------------------------------------------------------------------------- broken tables


def _fwd_rule(data: dict, section: str = "default", i: int = 0) -> dict:
    return entry_of(data["sections"][section]["kernels"], "rms_norm_fwd")["rules"][i]


def test_rocm_num_warps_32_is_2048_threads():
    data = raw_table("rocm")
    _fwd_rule(data, i=3)["config"]["num_warps"] = 32
    msg = expect_config_error(data, "rocm", "rocm.json", "[default]", "'rms_norm_fwd'", "rule 3", "num_warps", "2048")
    assert "num_warps <= 16" in msg


def test_rdna_section_num_warps_64_over_limit():
    data = raw_table("rocm")
    entry_of(data["sections"]["rdna"]["kernels"], "rms_norm_bwd")["rules"][0]["config"]["num_warps"] = 64
    expect_config_error(data, "rocm", "rocm.json", "[rdna]", "'rms_norm_bwd'", "num_warps", "2048")


def test_amd_option_in_cuda_rule():
    data = raw_table("cuda")
    _fwd_rule(data, section="sm90", i=0)["config"]["waves_per_eu"] = 2
    expect_config_error(data, "cuda", "cuda.json", "'rms_norm_fwd'", "rule 0", "'waves_per_eu'", "rocm")


def test_intel_option_in_rocm_base():
    data = raw_table("rocm")
    entry_of(data["sections"]["default"]["kernels"], "rms_norm_bwd").setdefault("base", {})["grf_mode"] = "large"
    expect_config_error(data, "rocm", "rocm.json", "'rms_norm_bwd'", "base", "'grf_mode'", "xpu")


def test_intel_option_in_rocm_section_base():
    data = raw_table("rocm")
    data["sections"]["default"]["base"]["grf_mode"] = "large"
    expect_config_error(data, "rocm", "rocm.json [default] base", "'rms_norm_fwd'", "'grf_mode'", "xpu")


def test_nvidia_option_in_xpu_search():
    data = raw_table("xpu")
    entry_of(data["sections"]["default"]["kernels"], "rms_norm_fwd")["search"]["space"]["maxnreg"] = [128]
    expect_config_error(data, "xpu", "xpu.json", "'rms_norm_fwd'", "search", "'maxnreg'", "cuda")


def test_illegal_search_value():
    data = raw_table("rocm")
    entry_of(data["sections"]["default"]["kernels"], "rms_norm_fwd")["search"]["space"]["num_warps"].append(32)
    expect_config_error(data, "rocm", "rocm.json", "'rms_norm_fwd'", "search", "num_warps", "2048")


@pytest.mark.parametrize("field", ["num_threads", "BLOCK_K"])
def test_unknown_field(field):
    data = raw_table("cuda")
    _fwd_rule(data, section="sm90", i=1)["config"][field] = 16
    expect_config_error(data, "cuda", "cuda.json", "'rms_norm_fwd'", "rule 1", "unknown field", repr(field))


def test_missing_block_m():
    data = raw_table("xpu")
    del _fwd_rule(data, i=2)["config"]["BLOCK_M"]
    expect_config_error(data, "xpu", "xpu.json", "'rms_norm_fwd'", "rule 2", "missing", "BLOCK_M")


@pytest.mark.parametrize("value", [3, 12, 0, 128, "4", 4.0])
def test_bad_block_m(value):
    data = raw_table("xpu")
    _fwd_rule(data, i=0)["config"]["BLOCK_M"] = value
    expect_config_error(data, "xpu", "xpu.json", "'rms_norm_fwd'", "rule 0", "'BLOCK_M'")


def test_non_power_of_two_block_m_says_so():
    data = raw_table("cuda")
    _fwd_rule(data, section="sm90", i=0)["config"]["BLOCK_M"] = 3
    expect_config_error(data, "cuda", "cuda.json", "'rms_norm_fwd'", "'BLOCK_M'", "power of two")


@pytest.mark.parametrize("how", ["drop-last", "bound-last"])
def test_default_rules_need_catch_all(how):
    data = raw_table("cuda")
    rules = data["sections"]["default"]["kernels"]["fused_linear_cross_entropy"]["rules"]
    if how == "drop-last":
        rules.pop()
    else:
        rules[-1]["upto"] = {"n_cols": 1 << 20}
    expect_config_error(data, "cuda", "cuda.json", "[default]", "'fused_linear_cross_entropy'", "'rules'", "catch-all")


def test_arch_section_rules_need_no_catch_all():
    # xe-hpc's rms_norm_fwd rules cover everything, but an arch section may stop early:
    data = raw_table("xpu")
    entry_of(data["sections"]["xe-hpc"]["kernels"], "rms_norm_fwd")["rules"].pop()
    t = parse(data, "xpu")
    cfg, where = table_config(t, "xe-hpc", "rms_norm_fwd", {"n_cols": 20000, "n_rows": 1})
    assert "[default]" in where and "grf_mode" not in cfg


def test_missing_why():
    data = raw_table("rocm")
    del entry_of(data["sections"]["default"]["kernels"], "rms_norm_bwd")["rules"][1]["why"]
    expect_config_error(data, "rocm", "rocm.json", "'rms_norm_bwd'", "rule 1", "'why'")


def test_missing_search_why():
    data = raw_table("rocm")
    del entry_of(data["sections"]["default"]["kernels"], "rms_norm_bwd")["search"]["why"]
    expect_config_error(data, "rocm", "rocm.json", "'rms_norm_bwd'", "search", "'why'")


@pytest.mark.parametrize("schema", [2, 0, None, "1"])
def test_wrong_schema(schema):
    data = raw_table("xpu")
    data["schema"] = schema
    expect_config_error(data, "xpu", "xpu.json", "'schema'")


def test_wrong_backend():
    data = raw_table("rocm")  # a ROCm table where the CUDA one belongs
    expect_config_error(data, "cuda", "cuda.json", "'backend'", "'cuda'", "'rocm'")


def test_unknown_kernel_name():
    data = raw_table("cuda")
    kernels = data["sections"]["sm90"]["kernels"]
    kernels["rms_norm_fwdd"] = copy.deepcopy(kernels["rms_norm_fwd"])
    msg = expect_config_error(data, "cuda", "cuda.json", "[sm90]", "'rms_norm_fwdd'", "unknown kernel")
    assert "rms_norm_fwd" in msg.split("known kernels:")[-1]


def test_default_section_missing_a_kernel(tmp_path):
    # After merging with base.json: the kernel is in neither.
    data, base = raw_table("xpu"), raw_table("base")
    del data["sections"]["default"]["kernels"]["rms_norm_bwd, fused_add_rms_norm_bwd, layer_norm_bwd"]
    del base["kernels"]["rms_norm_bwd, fused_add_rms_norm_bwd, layer_norm_bwd"]
    msg = expect_config_error(data, "xpu", "xpu.json", "[default]", "rms_norm_bwd", base=base, tmp=tmp_path)
    assert "fused_add_rms_norm_bwd" in msg and "layer_norm_bwd" in msg


def test_missing_default_section():
    data = raw_table("cuda")
    data["sections"]["generic"] = data["sections"].pop("default")
    expect_config_error(data, "cuda", "cuda.json", "'default'")


def test_missing_search_in_default(tmp_path):
    # Neither rocm.json's default nor base.json gives one (a default without one inherits base.json's).
    data, base = raw_table("rocm"), raw_table("base")
    del entry_of(data["sections"]["default"]["kernels"], "rms_norm_fwd")["search"]
    del entry_of(base["kernels"], "rms_norm_fwd")["search"]
    expect_config_error(data, "rocm", "rocm.json", "[default]", "'rms_norm_fwd'", "'search'", base=base, tmp=tmp_path)


def test_missing_search_in_arch_section_is_allowed():
    data = raw_table("rocm")
    data["sections"]["gfx942"]["kernels"]["rms_norm_fwd"] = {
        "rules": [{"upto": {"n_cols": 64}, "config": {"num_warps": 1, "BLOCK_M": 16, "BLOCK_N_MAX": 128}, "why": "test"}]
    }
    del data["sections"]["rdna"]["kernels"]["rms_norm_bwd"]["search"]
    t = parse(data, "rocm")
    # falls back to the default section's search space
    assert search_space(t, "gfx942", "rms_norm_fwd") == t.sections["default"].kernels["rms_norm_fwd"].search
    # rdna inherits base.json, not the default: base.json's search space
    base_space = entry_of(raw_table("base")["kernels"], "rms_norm_bwd")["search"]["space"]
    assert search_space(t, "gfx1100", "rms_norm_bwd") == base_space != t.sections["default"].kernels["rms_norm_bwd"].search


@pytest.mark.parametrize("how", ["missing", "extra", "zero"])
def test_bad_limits(how):
    data = raw_table("cuda")
    limits = data["sections"]["sm90"]["limits"]
    if how == "missing":
        del limits["warp_size"]
    elif how == "extra":
        limits["registers"] = 65536
    else:
        limits["max_threads_per_block"] = 0
    expect_config_error(data, "cuda", "cuda.json", "[sm90]", "'limits")


def test_upto_on_unknown_problem_field():
    data = raw_table("cuda")
    _fwd_rule(data, section="sm90", i=0)["upto"] = {"hidden": 256}
    expect_config_error(data, "cuda", "cuda.json", "'rms_norm_fwd'", "rule 0", "'upto.hidden'")


# Malformed shapes: errors name the file, kernel and field, never an AttributeError.


def test_kernel_entry_not_an_object():
    data = raw_table("cuda")
    data["sections"]["default"]["kernels"]["rms_norm_fwd"] = []
    expect_config_error(data, "cuda", "cuda.json", "'rms_norm_fwd'")


def test_upto_not_an_object():
    data = raw_table("cuda")
    _fwd_rule(data, section="sm90", i=0)["upto"] = 256
    expect_config_error(data, "cuda", "cuda.json", "'rms_norm_fwd'", "rule 0", "upto")


def test_match_must_be_a_list_of_patterns():
    data = raw_table("cuda")
    data["sections"]["sm100"]["match"] = "sm10*"
    expect_config_error(data, "cuda", "cuda.json", "[sm100]", "match")


# --------------------------------------------------------------------------- inheritance: base.json -> default -> arch

ROW_FWD = "rms_norm_fwd, fused_add_rms_norm_fwd, layer_norm_fwd"
GLU = "swiglu_fwd, swiglu_bwd, geglu_fwd, geglu_bwd"


def test_arch_section_overriding_one_kernel_inherits_the_others():
    data = raw_table("cuda")
    data["sections"]["sm80"]["kernels"]["rms_norm_fwd"] = {
        "rules": [{"upto": {"n_cols": 512}, "config": {"num_warps": 2, "BLOCK_M": 2, "BLOCK_N_MAX": 512}, "why": "test"}]
    }
    t, default = parse(data, "cuda"), parse(raw_table("cuda"), "cuda")
    problem = {"n_cols": 300, "n_rows": 1000}
    cfg, where = table_config(t, "sm80", "rms_norm_fwd", problem)
    assert where == "table cuda.json [sm80] rule 0"
    assert cfg == {"num_stages": 1, "num_warps": 2, "BLOCK_M": 2, "BLOCK_N_MAX": 512}  # num_stages from base.json
    # sizes the arch rules leave out, and the kernels the section does not list: the default's answer
    for kernel, n in [("rms_norm_fwd", 4096), *((k, 300) for k in SPECS if k != "rms_norm_fwd")]:
        p = _problem(SPECS[kernel], n)
        assert table_config(t, "sm80", kernel, p) == table_config(default, "sm86", kernel, p), kernel
        assert search_space(t, "sm80", kernel) == search_space(default, "sm86", kernel), kernel


def test_rule_with_two_bounds_matches_only_when_both_hold():
    """A rule's ``upto`` bounds must all hold for it to match (the format: "first rule whose upto
    bounds all hold wins"). The shipped rules bound n_cols alone, so this sm80 rule bounds n_rows
    too: a problem within one bound and over the other falls through to the default's rules."""
    data = raw_table("cuda")
    data["sections"]["sm80"]["kernels"]["rms_norm_fwd"] = {
        "rules": [{"upto": {"n_cols": 512, "n_rows": 64}, "config": {"num_warps": 2, "BLOCK_M": 2, "BLOCK_N_MAX": 512},
                   "why": "test"}]
    }
    t, shipped = parse(data, "cuda"), parse(raw_table("cuda"), "cuda")
    assert table_config(t, "sm80", "rms_norm_fwd", {"n_cols": 512, "n_rows": 64})[1] == "table cuda.json [sm80] rule 0"
    for problem in ({"n_cols": 513, "n_rows": 64}, {"n_cols": 512, "n_rows": 65}, {"n_cols": 513, "n_rows": 65}):
        want = table_config(shipped, "sm86", "rms_norm_fwd", problem)  # sm86: the cuda default
        assert table_config(t, "sm80", "rms_norm_fwd", problem) == want, problem


def test_arch_entry_fields_override_one_by_one():
    data = raw_table("xpu")
    kernels = data["sections"]["xe-hpc"]["kernels"]
    entry_of(kernels, "rms_norm_fwd")["base"] = {"num_stages": 2}  # merged over the default's base
    del kernels[next(k for k in kernels if "rms_norm_bwd" in k)]
    kernels["rms_norm_bwd"] = {"search": {"space": {"num_warps": [8]}, "why": "test"}}  # search only
    t, shipped = parse(data, "xpu"), load_table("xpu")
    cfg, where = table_config(t, "xe-hpc", "rms_norm_fwd", {"n_cols": 20000, "n_rows": 1})
    assert where == "table xpu.json [xe-hpc] rule 1" and cfg["num_stages"] == 2 and cfg["grf_mode"] == "256"
    p = {"n_cols": 2000, "n_rows": 1}
    assert table_config(t, "xe-hpc", "rms_norm_bwd", p) == table_config(shipped, "xe2", "rms_norm_bwd", p)
    assert search_space(t, "xe-hpc", "rms_norm_bwd") == {"num_warps": [8]}
    # a base without rules would change nothing: an arch section's base applies to its own rules
    kernels["rms_norm_bwd"] = {"base": {"num_stages": 2}}
    expect_config_error(data, "xpu", "xpu.json [xe-hpc] kernel 'rms_norm_bwd'", "'base' without 'rules'")


def test_vendor_default_overrides_base_field_by_field():
    data = raw_table("cuda")
    kernels = data["sections"]["default"]["kernels"]
    kernels["swiglu_fwd"] = {"base": {"num_stages": 2}}  # rules and search from base.json
    kernels["geglu_bwd"] = {"search": {"space": {"num_warps": [4, 8]}, "why": "test"}}
    t, base = parse(data, "cuda"), raw_table("base")
    glu = entry_of(base["kernels"], "swiglu_fwd")
    p = {"n_cols": 4096, "n_rows": 1}
    cfg, where = table_config(t, "sm86", "swiglu_fwd", p)
    assert where == "table base.json rule 1 (inherited by cuda.json [default])"
    assert cfg == {**glu["rules"][1]["config"], "num_stages": 2}
    assert search_space(t, "sm86", "swiglu_fwd") == glu["search"]["space"]
    assert table_config(t, "sm86", "swiglu_bwd", p)[0]["num_stages"] == 1  # the group's others untouched
    assert search_space(t, "sm86", "geglu_bwd") == {"num_warps": [4, 8]}
    assert table_config(t, "sm86", "geglu_bwd", p) == (cfg | {"num_stages": 1}, where)
    # the shipped cuda default overrides RoPE's rules and inherits its search and HEADS base
    rope = load_table("cuda").sections["default"].kernels["rope"]
    assert rope.search == entry_of(base["kernels"], "rope")["search"]["space"]
    assert [r.source for r in rope.rules] == ["", ""]  # written in cuda.json
    assert load_table("cuda").sections["default"].kernels["rope"].rules[1].config["HEADS"] == 8


def test_section_base_is_merged_under_every_entry():
    t = load_table("rocm")
    for sname in ("default", "rdna"):
        for kernel, entry in t.sections[sname].kernels.items():
            assert all(r.config["num_stages"] == 2 for r in entry.rules), (sname, kernel)
    assert t.sections["default"].kernels["rope"].rules[0].config["HEADS"] == 1  # from base.json's rope base


@pytest.mark.parametrize("backend, section, kernel, arch", [("rocm", "rdna", "rms_norm_bwd", "gfx1100"),
                                                            ("cuda", "sm90", "rms_norm_fwd", "sm90")])
def test_entry_base_wins_over_its_section_base(backend, section, kernel, arch):
    """Within one section the kernel entry's ``base`` is more specific than the section's ``base``:
    where both set a field, the entry's value is the one its rules get (rocm.json's rdna section
    sets num_stages 2 for every entry; no shipped entry overrides a section base field, so the
    order of the two is not visible in the shipped tables)."""
    data = raw_table(backend)
    sec = data["sections"][section]
    sec["base"] = {**sec.get("base", {}), "num_stages": 2}
    entry_of(sec["kernels"], kernel)["base"] = {"num_stages": 3}
    t = parse(data, backend)
    cfg, where = table_config(t, arch, kernel, {"n_cols": 256, "n_rows": 1000})
    assert where.startswith(f"table {backend}.json [{section}] rule ") and cfg["num_stages"] == 3


def test_inherits_base_skips_the_vendor_default():
    t = load_table("rocm")
    cfg, where = table_config(t, "gfx1100", "swiglu_fwd", {"n_cols": 4096, "n_rows": 1})
    assert where == "table base.json rule 1 (inherited by rocm.json [rdna])"
    assert cfg["num_warps"] == 8 and table_config(t, "gfx942", "swiglu_fwd", {"n_cols": 4096, "n_rows": 1})[0]["num_warps"] == 2


@pytest.mark.parametrize("option", sorted(ALL_BACKEND_OPTIONS))
@pytest.mark.parametrize("where", ["rule", "base", "search", "file base"])
def test_backend_option_in_base_json_is_rejected(tmp_path, option, where):
    base = raw_table("base")
    entry = entry_of(base["kernels"], "rms_norm_fwd")
    value = "256" if option == "grf_mode" else 2
    if where == "rule":
        entry["rules"][2]["config"][option] = value
        fragments = ("base.json kernel 'rms_norm_fwd' rule 2",)
    elif where == "base":
        entry["base"] = {option: value}
        fragments = ("base.json kernel 'rms_norm_fwd' base",)
    elif where == "search":
        entry["search"]["space"][option] = [value]
        fragments = ("base.json kernel 'rms_norm_fwd' search",)
    else:
        base["base"][option] = value
        fragments = ("base.json base",)
    owner = next(b for b, opts in BACKEND_OPTIONS.items() if option in opts)
    for backend in GPU_BACKENDS:  # even the vendor that owns the option: base.json is vendor-neutral
        expect_config_error(raw_table(backend), backend, *fragments, repr(option), f"a {owner} launch option",
                            base=base, tmp=tmp_path)


@pytest.mark.parametrize("backend, key, section", [
    ("cuda", ROW_FWD, "default"), ("rocm", ROW_FWD, "rdna"), ("xpu", GLU, "default"),
])
def test_error_in_inherited_rule_names_both_files(tmp_path, backend, key, section):
    base = raw_table("base")
    base["kernels"][key]["rules"][-1]["config"]["num_warps"] = 64
    kernel = key.split(",")[0]
    i = len(base["kernels"][key]["rules"]) - 1
    expect_config_error(raw_table(backend), backend,
                        f"base.json kernel '{kernel}' rule {i} (inherited by {backend}.json [{section}])",
                        "'num_warps'=64", "2048 threads", base=base, tmp=tmp_path)


def test_error_in_inherited_base_field_names_both_files(tmp_path):
    base = raw_table("base")
    base["kernels"]["rope"]["base"]["HEADS"] = 3
    expect_config_error(raw_table("cuda"), "cuda", "base.json kernel 'rope' base (inherited by cuda.json [default])",
                        "'HEADS'", base=base, tmp=tmp_path)


@pytest.mark.parametrize("how", ["base.json", "rdna"])
def test_merged_rules_need_catch_all(tmp_path, how):
    data, base = raw_table("rocm"), raw_table("base")
    if how == "base.json":
        base["kernels"][GLU]["rules"].pop()
        expect_config_error(data, "rocm", "base.json kernel 'swiglu_fwd'", "catch-all", base=base, tmp=tmp_path)
    else:  # rdna inherits base.json like a vendor default: complete lists only
        data["sections"]["rdna"]["kernels"]["rms_norm_bwd"]["rules"].pop()
        expect_config_error(data, "rocm", "rocm.json [rdna] kernel 'rms_norm_bwd'", "catch-all")


def test_inherits_base_section_missing_a_kernel(tmp_path):
    data, base = raw_table("rocm"), raw_table("base")
    del base["kernels"]["cross_entropy"]  # rocm's default has its own, rdna has none
    expect_config_error(data, "rocm", "rocm.json [rdna]", "cross_entropy", base=base, tmp=tmp_path)


@pytest.mark.parametrize("change, fragments", [
    (lambda d, b: d["sections"]["sm90"]["kernels"].update({"rms_norm_fwd, layer_norm_bwd": {"rules": []}}),
     ("cuda.json [sm90] kernel 'rms_norm_fwd'", "listed twice")),
    (lambda d, b: d["sections"]["sm90"].update(inherits="vendor"), ("cuda.json [sm90]", "'inherits'")),
    (lambda d, b: d["sections"]["default"].update(inherits="base"), ("cuda.json [default]", "'inherits'")),
    (lambda d, b: b.update(limits={}), ("base.json", "'limits'", "hardware facts")),
    (lambda d, b: b["kernels"].update({"rms_norm_fwdd": {}}), ("base.json kernel 'rms_norm_fwdd'", "unknown kernel")),
    (lambda d, b: b.update(schema=2), ("base.json", "'schema'")),
    (lambda d, b: d["sections"]["default"].update(kernels=[]), ("cuda.json [default]", "'kernels'")),
    (lambda d, b: b["kernels"][next(iter(b["kernels"]))].update(rules=None), ("base.json kernel", "'rules' is null")),
    (lambda d, b: b["kernels"][next(iter(b["kernels"]))].update(search=None), ("base.json kernel", "'search' is null")),
], ids=["twice", "inherits-value", "inherits-in-default", "base-limits", "base-unknown-kernel", "base-schema",
        "default-kernels-list", "base-rules-null", "base-search-null"])
def test_malformed_inheritance(tmp_path, change, fragments):
    data, base = raw_table("cuda"), raw_table("base")
    change(data, base)
    expect_config_error(data, "cuda", *fragments, base=base, tmp=tmp_path)


def test_every_base_json_rule_and_search_is_inherited():
    """Every base.json value is checked against some vendor's limits: something inherits it."""
    used = set()
    for backend in GPU_BACKENDS:
        t = load_table(backend)
        for section in t.sections.values():
            for kernel, entry in section.kernels.items():
                used |= {(kernel, r.source.split(" (")[0]) for r in entry.rules if r.source}
    for key, entry in raw_table("base")["kernels"].items():
        for kernel in (k.strip() for k in key.split(",")):
            for i in range(len(entry["rules"])):
                assert (kernel, f"table base.json rule {i}") in used, (kernel, i)


def test_every_amd_and_intel_rule_says_what_it_rests_on():
    """No AMD or Intel value was measured by this project: each rule and search space of
    rocm.json and xpu.json names what it rests on: a measurement, a peer's config (repository and
    file or issue), or an estimate with its reasoning."""
    for backend in ("rocm", "xpu"):
        data = raw_table(backend)
        for sname, section in data["sections"].items():
            for kname, entry in section.get("kernels", {}).items():
                whys = [r["why"] for r in entry.get("rules", [])]
                if "search" in entry:
                    whys.append(entry["search"]["why"])
                for why in whys:
                    assert re.match(r"(measured|peer|peer evidence|estimate): ", why), (backend, sname, kname, why)


# --------------------------------------------------------------------------- loading from disk


def test_missing_table_directory(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_table("cuda", directory=str(tmp_path))
    assert str(tmp_path) in str(ei.value)
    assert "cuda.json" in str(ei.value)


def test_unreadable_table_file(tmp_path):
    (tmp_path / "rocm.json").write_text('{"schema": 1, "backend": "rocm", "sect')
    with pytest.raises(ConfigError) as ei:
        load_table("rocm", directory=str(tmp_path))
    assert str(tmp_path / "rocm.json") in str(ei.value)


def test_table_from_other_directory(tmp_path):
    data = raw_table("xpu")
    (tmp_path / "xpu.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'base.json'}: base table missing")):
        load_table("xpu", directory=str(tmp_path))
    shutil.copy(_paths.backends_dir() / "base.json", tmp_path)
    t = load_table("xpu", directory=str(tmp_path))
    assert t.path == tmp_path / "xpu.json"


def test_no_table_for_cpu():
    with pytest.raises(ValueError, match="backend"):
        load_table("cpu")


# --------------------------------------------------------------------------- resolution from the tables


def expected_from_json(backend: str, section_chain: tuple[str, ...], kernel: str, problem: dict) -> tuple[dict, str]:
    """Independent oracle: walk the raw JSON as the format documents it (arch section, the
    section that inherits base.json, base.json; base fields merge, the more specific winning)."""
    data, base = raw_table(backend), raw_table("base")

    def entry(kernels: dict) -> dict:
        return next((e for key, e in kernels.items() if kernel in (k.strip() for k in key.split(","))), {})

    def own_base(sname: str) -> dict:
        return {**data["sections"][sname].get("base", {}), **entry(data["sections"][sname]["kernels"]).get("base", {})}

    *archs, root = section_chain  # root: the section that inherits base.json
    merged = {**base.get("base", {}), **entry(base["kernels"]).get("base", {}), **own_base(root)}
    levels = [(a, {**merged, **own_base(a)}, entry(data["sections"][a]["kernels"])) for a in archs]
    levels += [(root, merged, entry(data["sections"][root]["kernels"])), ("base.json", merged, entry(base["kernels"]))]
    for sname, cfg_base, e in levels:
        for i, rule in enumerate(e.get("rules", [])):
            if all(problem[k] <= v for k, v in rule.get("upto", {}).items()):
                if sname == "base.json":
                    return {**cfg_base, **rule["config"]}, f"table base.json rule {i} (inherited by {backend}.json [{root}])"
                return {**cfg_base, **rule["config"]}, f"table {backend}.json [{sname}] rule {i}"
    raise AssertionError("no rule matched")


SECTION_CHAINS = {
    "cuda-sm90": ("sm90", "default"),
    "cuda-sm86": ("default",),
    "rocm-gfx942": ("gfx942", "default"),
    "rocm-gfx1100": ("rdna",),  # "inherits": "base"
    "xpu-xe-hpc": ("xe-hpc", "default"),
    "xpu-xe2": ("xe2", "default"),
}


@pytest.mark.parametrize("dev_key", sorted(DEVICES))
@pytest.mark.parametrize("kernel", sorted(SPECS))
@pytest.mark.parametrize("n_cols", [1, 255, 256, 257, 1024, 1025, 4096, 4097, 20000, 70000])
def test_rule_selection_matches_table(dev_key, kernel, n_cols):
    dev = device(dev_key)
    problem = _problem(SPECS[kernel], n_cols)
    cfg, source = expected_from_json(dev.backend, SECTION_CHAINS[dev_key], kernel, problem)
    r = resolve(kernel, dev, tuple(problem.values()), torch.bfloat16)
    assert r.config.to_dict() == cfg
    assert r.source == source


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_default_rule_boundaries(backend):
    """n_cols 256 vs 257 and 4096 vs 4097 land on different default rules (first match wins)."""
    dev = DeviceInfo(backend, 0, "Some GPU", "unknown-arch", 64 if backend == "rocm" else 32, 8, 1024, 65536)
    # cuda's default inherits base.json's row-norm rules; rocm's and xpu's write their own
    written = backend != "cuda"
    kernels = raw_table(backend)["sections"]["default"]["kernels"] if written else raw_table("base")["kernels"]
    rules = entry_of(kernels, "rms_norm_fwd")["rules"]
    index_of = {}
    for n in (256, 257, 4096, 4097):
        r = resolve("rms_norm_fwd", dev, (n, 1), torch.float32)
        index_of[n] = int(re.search(r"rule (\d+)", r.source)[1])
        if written:
            assert r.source == f"table {backend}.json [default] rule {index_of[n]}"
        else:
            assert r.source == f"table base.json rule {index_of[n]} (inherited by {backend}.json [default])"
        want = rules[index_of[n]]
        assert all(n <= v for v in want.get("upto", {}).values())
        assert r.config["BLOCK_M"] == want["config"]["BLOCK_M"]
        assert r.config.num_warps == want["config"]["num_warps"]
    assert rules[index_of[256]]["upto"]["n_cols"] == 256
    assert index_of[257] == index_of[256] + 1
    assert rules[index_of[4096]]["upto"]["n_cols"] == 4096
    assert index_of[4097] == index_of[4096] + 1
    assert "upto" not in rules[index_of[4097]]


def test_arch_section_overrides_default():
    r = resolve("rms_norm_fwd", device("xpu-xe-hpc"), (20000, 1000), torch.bfloat16)
    assert r.config.to_dict().get("grf_mode") == "256"
    assert r.launch["grf_mode"] == "256"
    assert "[xe-hpc]" in r.source


@pytest.mark.parametrize("arch", ["xe-hpg", "xe2", "xe-future"])
def test_xpu_default_has_no_grf_mode(arch):
    r = resolve("rms_norm_fwd", device("xpu-xe-hpc", arch=arch), (20000, 1000), torch.bfloat16)
    assert "grf_mode" not in r.config.to_dict()
    assert "grf_mode" not in r.launch
    assert "[default]" in r.source


def test_arch_section_without_the_kernel_uses_default():
    # xe-hpc overrides the norms and the losses; the GLUs come from the default section.
    r = resolve("swiglu_bwd", device("xpu-xe-hpc"), (20000, 1000), torch.bfloat16)
    assert "[default]" in r.source and "grf_mode" not in r.launch


@pytest.mark.parametrize(
    "backend, arch, warp",
    [("cuda", "sm75", 32), ("cuda", "sm120", 32), ("rocm", "gfx9999", 64), ("rocm", "gfx-unknown", 64), ("xpu", "xe3", 32)],
)
def test_unknown_arch_falls_back_to_default(backend, arch, warp):
    t = load_table(backend)
    assert t.section_for(arch).name == "default"
    dev = DeviceInfo(backend, 0, "Future GPU", arch, warp, 64, 1024, 65536)
    for kernel in SPECS:
        r = resolve(kernel, dev, problem_for(kernel, 4096, 1000), torch.float16)
        assert r.source.startswith(f"table {backend}.json [default] rule ") or r.source.startswith(
            "table base.json rule "
        ) and r.source.endswith(f" (inherited by {backend}.json [default])"), r.source


@pytest.mark.parametrize("backend, arch, section", [
    ("cuda", "sm90", "sm90"), ("cuda", "sm90a", "sm90"), ("cuda", "sm100", "sm100"), ("cuda", "sm103", "sm100"),
    ("cuda", "sm80", "sm80"), ("cuda", "sm86", "default"),
    ("rocm", "gfx942", "gfx942"), ("rocm", "gfx90a", "gfx90a"), ("rocm", "gfx1250", "default"),
    ("rocm", "gfx1100", "rdna"), ("rocm", "gfx1201", "rdna"), ("rocm", "gfx940", "default"),
    ("xpu", "xe-hpc", "xe-hpc"), ("xpu", "xe-hpg", "xe-hpg"), ("xpu", "xe2", "xe2"),
])
def test_section_for(backend, arch, section):
    assert load_table(backend).section_for(arch).name == section


@pytest.mark.parametrize("backend, arch, unsupported", [
    ("cuda", "sm60", True), ("cuda", "sm61", True), ("cuda", "sm52", True), ("cuda", "sm37", True),
    ("cuda", "sm70", False), ("cuda", "sm75", False), ("cuda", "sm90", False), ("cuda", "sm120", False),
    ("rocm", "gfx1030", True), ("rocm", "gfx1010", True), ("rocm", "gfx906", False), ("rocm", "gfx908", False),
    ("rocm", "gfx942", False), ("rocm", "gfx1100", False), ("rocm", "gfx1201", False),
    ("xpu", "xe-hpc", False), ("xpu", "xe2", False),
])
def test_unsupported_archs(backend, arch, unsupported):
    """The archs Triton cannot compile these kernels for (sm60 fails in ptxas on the RMSNorm backward's
    acquire-release atomics; gfx1030 is an unsupported target) are named in the vendor table, with why."""
    why = load_table(backend).unsupported_reason(arch)
    assert (why is not None) == unsupported and (why is None or "Triton" in why)


@pytest.mark.parametrize("bad, error", [
    ({"match": "sm6*", "why": "x"}, "unsupported 0: field 'match' must be list"),
    ({"match": [], "why": "x"}, "unsupported 0: field 'match' must be a non-empty list"),
    ({"match": ["sm6*"]}, "unsupported 0: missing field 'why'"),
    ("sm6*", "unsupported 0: must be an object"),
])
def test_unsupported_entry_errors_name_the_field(tmp_path, bad, error):
    data = json.loads((_paths.backends_dir() / "cuda.json").read_text())
    data["unsupported"] = [bad]
    (tmp_path / "cuda.json").write_text(json.dumps(data))
    (tmp_path / "base.json").write_text((_paths.backends_dir() / "base.json").read_text())
    with pytest.raises(ConfigError, match=re.escape(f"cuda.json {error}")):
        load_table("cuda", str(tmp_path))


def test_memoized_identical_object():
    dev = device("cuda-sm90")
    r1 = resolve("rms_norm_fwd", dev, (4096, 1000), torch.bfloat16)
    assert resolve("rms_norm_fwd", dev, (4096, 1000), torch.bfloat16) is r1
    other_dtype = resolve("rms_norm_fwd", dev, (4096, 1000), torch.float16)
    assert other_dtype is not r1 and other_dtype.config == r1.config
    hardware.reset()
    r2 = resolve("rms_norm_fwd", dev, (4096, 1000), torch.bfloat16)
    assert r2 is not r1 and r2.config == r1.config


def test_launch_kwargs_exclude_host_params():
    r = resolve("rms_norm_bwd", device("rocm-gfx942"), (4096, 1000), torch.bfloat16)
    assert set(r.launch) == {"BLOCK_M", "num_warps", "num_stages"}
    assert set(r.meta) == {"BLOCK_M", "BLOCK_N_MAX", "PROGRAMS_PER_CU"}


def test_small_device_gets_fitted_config():
    dev = DeviceInfo("rocm", 0, "Small AMD GPU", "gfx9999", 64, 8, 256, 65536)
    with pytest.warns(RuntimeWarning) as rec:
        r = resolve("rms_norm_fwd", dev, (20000, 1000), torch.bfloat16)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert any("num_warps=4" in m and "gfx9999" in m for m in msgs), msgs
    assert r.config.num_warps == 4  # table says 8 (512 lanes); 256 lanes allowed
    assert r.launch["num_warps"] * dev.warp_size <= dev.max_threads_per_block
    assert "fitted" in r.source
    assert r.source.startswith("table rocm.json [default]")
    # the same message is not repeated for another size of the same rule
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        r2 = resolve("rms_norm_fwd", dev, (30000, 1000), torch.bfloat16)
    assert r2.config.num_warps == 4 and "fitted" in r2.source


def test_config_that_cannot_be_fitted_raises():
    # shared memory, not threads, is too small: fitting warps cannot help -> ConfigError
    dev = DeviceInfo("cuda", 0, "Tiny GPU", "sm75", 32, 8, 1024, 16)
    with pytest.raises(ConfigError, match="shared memory"):
        resolve("rms_norm_fwd", dev, (20000, 1000), torch.bfloat16)


def test_matching_device_resolves_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for key in DEVICES:
            for kernel in SPECS:
                resolve(kernel, device(key), problem_for(kernel, 4096, 1000), torch.bfloat16)


# --------------------------------------------------------------------------- autotune cache lookup order

PROBLEM = (4096, 1000)
NAMED = {"n_cols": 4096, "n_rows": 1000}
# The table's answer for rms_norm_fwd at PROBLEM on sm90: sm90's rules stop at 1024 columns, the
# CUDA default inherits base.json's row-norm rules.
TABLE_SOURCE = "table base.json rule 2 (inherited by cuda.json [default])"
TUNED = {"num_warps": 2, "num_stages": 3, "BLOCK_M": 2, "BLOCK_N_MAX": 4096}
TUNED_SHIPPED = {"num_warps": 16, "num_stages": 2, "BLOCK_M": 1, "BLOCK_N_MAX": 8192}


def write_cache(folder: Path, dev: DeviceInfo, entries: dict, fmt: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dev.model_slug}.json"
    path.write_text(json.dumps({"format": fmt, "device": dev.name, "entries": entries}))
    return path


def entry(cfg: dict) -> dict:
    return {"config": cfg, "time_ms": 0.05, "default_ms": 0.06, "measured_at": "2026-12-02T12:00:00Z"}


def key(kernel: str = "rms_norm_fwd", named: dict = NAMED, dtype=torch.bfloat16) -> str:
    return autotune_cache.entry_key(SPECS[kernel], named, dtype)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    d = tmp_path / "my_cache"
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(d))
    return d


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch):
    d = tmp_path / "shipped"
    d.mkdir()
    monkeypatch.setattr(_paths, "shipped_cache_dir", lambda: d)
    return d


def table_answer(dev: DeviceInfo, kernel="rms_norm_fwd", problem=PROBLEM):
    cfg, where = table_config(load_table(dev.backend), dev.arch, kernel, dict(zip(SPECS[kernel].key, problem)))
    return cfg, where


def test_user_cache_entry_wins(user_dir):
    dev = device("cuda-sm90")
    assert dev.model_slug == "NVIDIA_H200"
    write_cache(user_dir, dev, {key(): entry(TUNED)})
    hardware.reset()
    r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source.startswith("user cache")
    assert "NVIDIA_H200.json" in r.source
    assert r.config.to_dict() == TUNED
    assert r.launch == {"BLOCK_M": 2, "num_warps": 2, "num_stages": 3}


def test_cache_key_parts(user_dir):
    dev = device("cuda-sm90")
    write_cache(user_dir, dev, {key(): entry(TUNED)})
    hardware.reset()
    # same bucket: n_rows 600 and 1000 both round up to 1024
    assert resolve("rms_norm_fwd", dev, (4096, 600), torch.bfloat16).source.startswith("user cache")
    # other bucket, other dtype, other kernel: the table
    assert resolve("rms_norm_fwd", dev, (4096, 2000), torch.bfloat16).source.startswith("table")
    assert resolve("rms_norm_fwd", dev, (4097, 1000), torch.bfloat16).source.startswith("table")
    assert resolve("rms_norm_fwd", dev, PROBLEM, torch.float32).source.startswith("table")
    assert resolve("rms_norm_bwd", dev, PROBLEM, torch.bfloat16).source.startswith("table")
    # another device model reads another file
    a100 = DeviceInfo("cuda", 0, "NVIDIA A100-SXM4-80GB", "sm80", 32, 108, 1024, 166912)
    assert resolve("rms_norm_fwd", a100, PROBLEM, torch.bfloat16).source.startswith("table")


def test_key_has_kernel_version_triton_dtype_bucket():
    k = key()
    name, version, triton, dtype, bucket = k.split("|")
    assert name == "rms_norm_fwd"
    assert version == SPECS["rms_norm_fwd"].version and len(version) == 12
    assert triton.startswith("triton")
    assert dtype == "bfloat16"
    assert bucket == "n_cols=4096,n_rows=1024"


def test_shipped_cache_used_when_user_cache_misses(user_dir, shipped_dir):
    dev = device("cuda-sm90")
    write_cache(shipped_dir, dev, {key(): entry(TUNED_SHIPPED)})
    hardware.reset()
    r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source.startswith("shipped cache")
    assert r.config.to_dict() == TUNED_SHIPPED


def test_user_cache_before_shipped_cache(user_dir, shipped_dir):
    dev = device("cuda-sm90")
    write_cache(shipped_dir, dev, {key(): entry(TUNED_SHIPPED)})
    write_cache(user_dir, dev, {key(): entry(TUNED)})
    hardware.reset()
    r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source.startswith("user cache")
    assert r.config.to_dict() == TUNED


def test_user_file_without_the_entry_falls_through_to_shipped(user_dir, shipped_dir):
    dev = device("cuda-sm90")
    write_cache(user_dir, dev, {key(dtype=torch.float16): entry(TUNED)})
    write_cache(shipped_dir, dev, {key(): entry(TUNED_SHIPPED)})
    hardware.reset()
    assert resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16).source.startswith("shipped cache")


@pytest.mark.parametrize(
    "bad, why",
    [
        ({**TUNED, "num_warps": 64}, "num_warps"),  # 2048 threads on a warp-32 device
        ({**TUNED, "waves_per_eu": 2}, "waves_per_eu"),  # an AMD option on NVIDIA
        ({k: v for k, v in TUNED.items() if k != "BLOCK_M"}, "BLOCK_M"),
        ({**TUNED, "BLOCK_M": 3}, "BLOCK_M"),
        ({**TUNED, "maxnreg": "abc"}, "maxnreg"),  # each crashed a real H200 launch with a TypeError
        ({**TUNED, "maxnreg": 1e9}, "maxnreg"),
        ({**TUNED, "maxnreg": [1, 2]}, "maxnreg"),
        ({**TUNED, "maxnreg": 300}, "maxnreg"),
    ],
    ids=["too-many-warps", "foreign-option", "missing-param", "not-pow2", "maxnreg-str", "maxnreg-huge-float",
         "maxnreg-list", "maxnreg-over-255"],
)
def test_illegal_cached_config_skipped_with_warning(user_dir, bad, why):
    dev = device("cuda-sm90")
    write_cache(user_dir, dev, {key(): entry(bad)})
    hardware.reset()
    with pytest.warns(RuntimeWarning, match="ignoring a cached config") as rec:
        r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert any(why in str(w.message) for w in rec)
    cfg, where = table_answer(dev)
    assert r.source == where
    assert r.config.to_dict() == cfg


def test_illegal_user_entry_falls_through_to_shipped(user_dir, shipped_dir):
    dev = device("cuda-sm90")
    write_cache(user_dir, dev, {key(): entry({**TUNED, "num_warps": 64})})
    write_cache(shipped_dir, dev, {key(): entry(TUNED_SHIPPED)})
    hardware.reset()
    with pytest.warns(RuntimeWarning, match="ignoring a cached config"):
        r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source.startswith("shipped cache")


@pytest.mark.parametrize(
    "content",
    [b'{"format": 1, "device": "NVIDIA H200", "entr', b"", b"\xff\xfe\x00garbage\x80", b"not json at all"],
    ids=["truncated", "empty", "binary", "text"],
)
def test_garbage_cache_file_warns_and_uses_table(user_dir, content):
    dev = device("cuda-sm90")
    user_dir.mkdir()
    (user_dir / f"{dev.model_slug}.json").write_bytes(content)
    hardware.reset()
    with pytest.warns(RuntimeWarning, match="unreadable autotune cache"):
        r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source == TABLE_SOURCE


def test_cache_path_is_a_directory(user_dir):
    dev = device("cuda-sm90")
    (user_dir / f"{dev.model_slug}.json").mkdir(parents=True)
    hardware.reset()
    with pytest.warns(RuntimeWarning, match="unreadable autotune cache"):
        r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source == TABLE_SOURCE


@pytest.mark.parametrize("fmt", [2, 0, None])
def test_other_format_version_skipped_with_warning(user_dir, fmt):
    dev = device("cuda-sm90")
    write_cache(user_dir, dev, {key(): entry(TUNED)}, fmt=fmt)
    hardware.reset()
    newer = "written by a newer liger-portable .* the file is kept"
    with pytest.warns(RuntimeWarning, match=newer if fmt == 2 else "not format 1"):
        r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source == TABLE_SOURCE


@pytest.mark.parametrize("doc", [[1, 2, 3], {"format": 1, "entries": []}, {"format": 1}])
def test_wrong_shape_cache_file_skipped_with_warning(user_dir, doc):
    dev = device("cuda-sm90")
    user_dir.mkdir()
    (user_dir / f"{dev.model_slug}.json").write_text(json.dumps(doc))
    hardware.reset()
    with pytest.warns(RuntimeWarning):
        r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source == TABLE_SOURCE


@pytest.mark.parametrize("hit", [None, 7, "x", {"time_ms": 1.0}, {"config": [2, 1]}])
def test_malformed_entry_ignored(user_dir, hit):
    dev = device("cuda-sm90")
    write_cache(user_dir, dev, {key(): hit})
    hardware.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16)
    assert r.source == TABLE_SOURCE


def test_no_cache_directory_is_silent(user_dir):
    assert not user_dir.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = resolve("rms_norm_fwd", device("cuda-sm90"), PROBLEM, torch.bfloat16)
    assert r.source == TABLE_SOURCE


def test_cache_read_is_memoized_until_reset(user_dir):
    dev = device("cuda-sm90")
    write_cache(user_dir, dev, {key(): entry(TUNED)})
    hardware.reset()
    assert resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16).source.startswith("user cache")
    # a new file content is not seen until reset() (memo and cache read are both cleared by it)
    write_cache(user_dir, dev, {})
    assert resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16).source.startswith("user cache")
    hardware.reset()
    assert resolve("rms_norm_fwd", dev, PROBLEM, torch.bfloat16).source.startswith("table")


def test_problem_of_the_wrong_length_is_a_clear_error():
    """A problem must give every field of the kernel's key (the FLCE's key has hidden too)."""
    dev = device("cuda-sm90")
    with pytest.raises(ValueError, match=r"3 values, n_cols, n_rows, hidden; got \(4096, 1000\)"):
        resolve("fused_linear_cross_entropy", dev, (4096, 1000), torch.bfloat16)
    r = resolve("fused_linear_cross_entropy", dev, (128256, 16384, 2048), torch.bfloat16)
    assert r.meta["CHUNK_TOKENS"] == 2048


def test_every_kernel_declares_the_problem_info_shows():
    """`liger-portable info` and `check` list each registered kernel's config at its declared
    representative problem: one value per key field."""
    from liger_portable.specs import SPECS

    for name, spec in SPECS.items():
        assert spec.shown is not None, name
        label, problem = spec.shown
        assert label and len(problem) == len(spec.key), name


# --------------------------------------------------------------------------- backend option values


@pytest.mark.parametrize(
    "backend, name, good, bad",
    [
        ("cuda", "maxnreg", [16, 128, 255], ["abc", 1e9, [1, 2], 300, 8, True]),
        ("rocm", "waves_per_eu", [0, 1, 4, 8], ["abc", 9, -1, 2.0]),
        ("rocm", "matrix_instr_nonkdim", [0, 16, 32], [8, "16", 64]),
        ("rocm", "kpack", [1, 2], [0, 3, "2", True]),
        ("xpu", "grf_mode", ["default", "256"], ["large", "small", 256, "auto"]),
        ("xpu", "threads_per_warp", [16, 32], [8, 64, "32"]),
    ],
)
def test_backend_option_values_are_checked(backend, name, good, bad):
    """A launch option's value is checked by type and range, not only its name (a table or cache
    value the vendor's Triton rejects would fail the launch, or be silently ignored)."""
    spec = SPECS["rms_norm_fwd"]
    limits = Limits(32, 1024, 65536)
    for v in good:
        check_config({name: v}, spec, backend, limits, "t", partial=True)
    for v in bad:
        with pytest.raises(ConfigError, match=f"field '{name}'"):
            check_config({name: v}, spec, backend, limits, "t", partial=True)


def test_kpack_on_gfx950_is_1_only():
    spec, limits = SPECS["rms_norm_fwd"], Limits(64, 1024, 163840)
    check_config({"kpack": 2}, spec, "rocm", limits, "t", partial=True, arch="gfx942")
    with pytest.raises(ConfigError, match="kpack.*gfx950"):
        check_config({"kpack": 2}, spec, "rocm", limits, "t", partial=True, arch="gfx950")
    check_config({"kpack": 1}, spec, "rocm", limits, "t", partial=True, arch="gfx950")


def test_table_option_value_the_arch_cannot_compile_fails_resolve(tmp_path, monkeypatch):
    """resolve checks the table's config against the device's arch, not only its limits: gfx950
    compiles only kpack=1, so a rocm default giving kpack=2 (which gfx950 falls back to) makes
    resolve raise a ConfigError naming the option and the arch instead of handing the launch a
    config that fails to compile; gfx942 gets kpack=2. The shipped tables set no kpack, so the
    table is written here."""
    data = raw_table("rocm")
    data["sections"]["default"]["base"] = {**data["sections"]["default"].get("base", {}), "kpack": 2}
    folder = tmp_path / "backends"
    folder.mkdir()
    (folder / "rocm.json").write_text(json.dumps(data))
    shutil.copy(_paths.backends_dir() / "base.json", folder / "base.json")
    monkeypatch.setattr(_paths, "backends_dir", lambda: folder)
    hardware.reset()
    assert resolve("rms_norm_fwd", device("rocm-gfx942"), PROBLEM, torch.bfloat16).launch["kpack"] == 2
    mi355 = device("rocm-gfx942", name="AMD Instinct MI355X", arch="gfx950", shared_mem_per_block=163840)
    with pytest.raises(ConfigError, match=r"'kpack'.* on gfx950, got 2"):
        resolve("rms_norm_fwd", mi355, PROBLEM, torch.bfloat16)


def test_xpu_sub_group_size_counts_in_the_threads_limit():
    """num_warps counts sub-groups of the config's threads_per_warp where it sets one."""
    spec, limits = SPECS["rms_norm_fwd"], Limits(16, 1024, 65536)
    check_config({"num_warps": 64}, spec, "xpu", limits, "t", partial=True)  # 64 x 16
    with pytest.raises(ConfigError, match="2048 threads per block"):
        check_config({"num_warps": 64, "threads_per_warp": 32}, spec, "xpu", limits, "t", partial=True)


def test_shared_memory_up_to_the_limit_is_legal():
    """A config needing exactly the device's shared memory per block fits (the limit is what a
    block may use); one byte less on the device and it does not."""
    spec = SPECS["rms_norm_fwd"]
    cfg = {"num_warps": 4, "num_stages": 1, "BLOCK_M": 4, "BLOCK_N_MAX": 1024}
    smem = spec.smem_bytes(cfg, 4, 4)
    assert smem > 0
    check_config(cfg, spec, "cuda", Limits(32, 1024, smem), "t")
    with pytest.raises(ConfigError, match="shared memory"):
        check_config(cfg, spec, "cuda", Limits(32, 1024, smem - 1), "t")


@pytest.mark.parametrize(
    "triton_version, expect",
    [
        ("3.6.0", {"warp_size": 32, "grf_mode": "256", "num_warps": 8}),
        ("3.7.0+git1234", {"warp_size": 32, "grf_mode": "256", "num_warps": 8}),
        ("3.5.0", {"threads_per_warp": 32, "grf_mode": "large", "num_warps": 8}),
        (None, {"threads_per_warp": 32, "grf_mode": "large", "num_warps": 8}),
    ],
)
def test_xpu_options_spelled_as_the_installed_triton_wants(triton_version, expect):
    """The tables write threads_per_warp and grf_mode "256" once; Intel's Triton 3.6 renamed the
    first to warp_size and spells the large register file "256", releases before spell it "large"."""
    opts = {"threads_per_warp": 32, "grf_mode": "256", "num_warps": 8}
    assert hardware.launch_options("xpu", opts, triton_version) == expect
    assert hardware.launch_options("cuda", {"maxnreg": 128}, triton_version) == {"maxnreg": 128}
