"""Platform detection with each vendor simulated, and the dispatch helpers built on it.

No GPU is needed: ``torch.version``, ``torch.cuda`` and ``torch.xpu`` are monkeypatched so that the
process looks like a CUDA, ROCm or XPU build with fake devices (``types.SimpleNamespace`` objects
standing in for the driver's device properties). ``liger_portable.hardware.reset()`` runs before
and after every test so that the platform is detected again from the simulated build.
"""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch

from liger_portable import _dispatch, _paths, hardware
from liger_portable.configs import load_table, resolve
from liger_portable.hardware import (
    ALL_BACKEND_OPTIONS,
    BACKEND_OPTIONS,
    BACKENDS,
    ENV_BACKEND,
    PlatformError,
    platform,
)
from liger_portable.specs import SPECS

from conftest import problem_for

# --------------------------------------------------------------------------- fake devices


def _h200() -> types.SimpleNamespace:
    # CUDA builds of PyTorch expose gcnArchName too (facts.md); it must not be read on CUDA.
    return types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, warp_size=32,
        max_threads_per_block=1024, shared_memory_per_block_optin=232448, gcnArchName="NVIDIA H200",
        total_memory=150_000_000_000,
    )


# ROCm builds of PyTorch bind neither shared_memory_per_block_optin nor max_threads_per_block
# (pytorch/pytorch#198198): the fakes carry what a ROCm build has.
def _mi300x() -> types.SimpleNamespace:
    # Capability (9, 4) looks like an NVIDIA sm94: the vendor must come from torch.version.hip.
    return types.SimpleNamespace(
        name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4,
        warp_size=64, multi_processor_count=304, shared_memory_per_block=65536, total_memory=205_000_000_000,
    )


def _mi355x() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="AMD Instinct MI355X", gcnArchName="gfx950:sramecc+:xnack-", major=9, minor=5,
        warp_size=64, multi_processor_count=256, shared_memory_per_block=65536, total_memory=288_000_000_000,
    )


def _rdna3() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="AMD Radeon RX 7900 XTX", gcnArchName="gfx1100", major=11, minor=0, warp_size=32,
        multi_processor_count=48, shared_memory_per_block=65536, total_memory=25_000_000_000,
    )


def _max1550() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="Intel(R) Data Center GPU Max 1550", sub_group_sizes=[16, 32], max_work_group_size=1024,
        local_mem_size=131072, gpu_eu_count=1024, gpu_subslice_count=128, total_memory=128_000_000_000,
    )


def _b580() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="Intel(R) Arc(TM) B580 Graphics", sub_group_sizes=[16, 32], max_work_group_size=1024,
        local_mem_size=65536, gpu_eu_count=160, gpu_subslice_count=20, total_memory=12_000_000_000,
    )


class FakeDriver:
    """``get_device_properties`` over a list of fake devices, recording every call."""

    def __init__(self, make_props, count: int = 2):
        self.props = [make_props() for _ in range(count)]
        self.calls: list[int] = []

    def get_device_properties(self, index=None):
        index = 0 if index is None else int(index)
        self.calls.append(index)
        return self.props[index]


def _no_xpu(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 0)


def simulate_cuda_build(monkeypatch, driver: FakeDriver, *, hip: str | None, cuda: str | None):
    """A CUDA build (``hip=None``) or a ROCm build (``hip`` set, ``cuda=None``) with ``driver``'s GPUs."""
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(driver.props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", driver.get_device_properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _no_xpu(monkeypatch)


def simulate_xpu_build(monkeypatch, driver: FakeDriver):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: len(driver.props))
    monkeypatch.setattr(torch.xpu, "get_device_properties", driver.get_device_properties)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 0)


def simulate_cpu_build(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    _no_xpu(monkeypatch)


# id -> how to simulate it and what detection must find
VENDORS = {
    "nvidia-h200": dict(
        props=_h200, build=dict(hip=None, cuda="12.8"), backend="cuda", arch="sm90", warp=32,
        compute_units=132, shared=232448, slug="NVIDIA_H200", section="sm90", torch_type="cuda",
    ),
    "amd-mi300x": dict(
        props=_mi300x, build=dict(hip="6.4.43482", cuda=None), backend="rocm", arch="gfx942", warp=64,
        compute_units=304, shared=65536, slug="AMD_Instinct_MI300X", section="gfx942", torch_type="cuda",
    ),
    "amd-mi355x": dict(
        props=_mi355x, build=dict(hip="7.0.51831", cuda=None), backend="rocm", arch="gfx950", warp=64,
        compute_units=256, shared=163840, slug="AMD_Instinct_MI355X", section="gfx950", torch_type="cuda",
    ),
    "amd-rdna3": dict(
        props=_rdna3, build=dict(hip="6.4.43482", cuda=None), backend="rocm", arch="gfx1100", warp=32,
        compute_units=48, shared=65536, slug="AMD_Radeon_RX_7900_XTX", section="rdna", torch_type="cuda",
    ),
    "intel-max1550": dict(
        props=_max1550, build=None, backend="xpu", arch="xe-hpc", warp=32, compute_units=128,
        shared=131072, slug="Intel_R_Data_Center_GPU_Max_1550", section="xe-hpc", torch_type="xpu",
    ),
    "intel-arc-b580": dict(
        props=_b580, build=None, backend="xpu", arch="xe2", warp=32, compute_units=20,
        shared=65536, slug="Intel_R_Arc_TM_B580_Graphics", section="xe2", torch_type="xpu",
    ),
}


def simulate(monkeypatch, vendor_id: str) -> tuple[FakeDriver, dict]:
    v = VENDORS[vendor_id]
    driver = FakeDriver(v["props"])
    if v["backend"] == "xpu":
        simulate_xpu_build(monkeypatch, driver)
    else:
        simulate_cuda_build(monkeypatch, driver, **v["build"])
    return driver, v


@pytest.fixture(autouse=True)
def fresh_platform(monkeypatch, tmp_path):
    """Detect the platform again in every test, with no backend override and empty caches."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    # Config resolution reads the autotune caches: keep them empty and private to this test.
    monkeypatch.setenv(_paths.ENV_CACHE_DIR, str(tmp_path / "user_cache"))
    shipped = tmp_path / "shipped_cache"
    shipped.mkdir()
    monkeypatch.setattr(_paths, "shipped_cache_dir", lambda: shipped)
    with _dispatch.simulate(None):  # no simulated device
        hardware.reset()
        yield
        hardware.reset()


@pytest.fixture(params=sorted(VENDORS))
def vendor(request, monkeypatch):
    """Each simulated vendor in turn: (vendor id, fake driver, expectations)."""
    driver, v = simulate(monkeypatch, request.param)
    return request.param, driver, v


# --------------------------------------------------------------------------- detection


def test_detects_backend_and_device_facts(vendor):
    _, _, v = vendor
    p = platform()
    assert (p.backend, p.detected, p.source) == (v["backend"], v["backend"], "detected")
    assert p.device_count == 2
    assert p.torch_device_type == v["torch_type"]
    dev = p.device(0)
    assert dev.backend == v["backend"]
    assert dev.index == 0
    assert dev.arch == v["arch"]
    assert dev.warp_size == v["warp"]
    assert dev.compute_units == v["compute_units"]
    assert dev.max_threads_per_block == 1024
    assert dev.shared_mem_per_block == v["shared"]
    assert dev.model_slug == v["slug"]
    assert dev.torch_device == torch.device(v["torch_type"], 0)


def test_h200_model_slug(monkeypatch):
    simulate(monkeypatch, "nvidia-h200")
    dev = platform().device(0)
    assert dev.name == "NVIDIA H200"
    assert dev.model_slug == "NVIDIA_H200"


def test_mi300x_capability_does_not_decide_vendor(monkeypatch):
    """MI300X reports capability (9, 4); torch.version.hip, not the capability, makes it AMD."""
    simulate(monkeypatch, "amd-mi300x")
    p = platform()
    assert p.backend == "rocm"
    dev = p.device(0)
    assert dev.arch == "gfx942"  # target features (:sramecc+:xnack-) stripped, not "sm94"
    assert dev.warp_size == 64
    assert dev.compute_units == 304
    assert p.torch_device_type == "cuda"  # ROCm builds use the "cuda" device type


def test_cuda_build_ignores_gcn_arch_name(monkeypatch):
    """CUDA builds expose gcnArchName too; even an AMD-looking value must not change the vendor."""
    driver = FakeDriver(_h200)
    for p in driver.props:
        p.gcnArchName = "gfx942:sramecc+:xnack-"
    simulate_cuda_build(monkeypatch, driver, hip=None, cuda="12.8")
    assert platform().backend == "cuda"
    assert platform().device(0).arch == "sm90"


@pytest.mark.parametrize(
    "make_props, arch, warp",
    [(_mi300x, "gfx942", 64), (_rdna3, "gfx1100", 32), (lambda: _gfx("gfx1300"), "gfx1300", 32),
     (lambda: _gfx("gfx90a:sramecc+:xnack-"), "gfx90a", 64), (lambda: _gfx("gfx1030"), "gfx1030", 32)],
    ids=["cdna", "rdna", "gfx13", "gfx90a", "gfx10"],
)
def test_rocm_warp_size_default_without_property(monkeypatch, make_props, arch, warp):
    """Without a warp_size property, the rule of Triton's AMD backend: gfx10 and later (RDNA and
    whatever follows) wave32, gfx9 (CDNA) wave64."""
    driver = FakeDriver(make_props)
    for p in driver.props:
        del p.warp_size
    simulate_cuda_build(monkeypatch, driver, hip="6.4.43482", cuda=None)
    dev = platform().device(0)
    assert (dev.arch, dev.warp_size) == (arch, warp)


def _gfx(gcn: str) -> types.SimpleNamespace:
    props = _rdna3()
    props.gcnArchName = gcn
    return props


def test_rocm_build_without_gpu_is_cpu(monkeypatch):
    driver = FakeDriver(_mi300x)
    simulate_cuda_build(monkeypatch, driver, hip="6.4.43482", cuda=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = platform()
    assert (p.backend, p.device_count) == ("cpu", 0)
    assert driver.calls == []


def test_cpu_build(monkeypatch):
    simulate_cpu_build(monkeypatch)
    p = platform()
    assert (p.backend, p.detected, p.source, p.device_count) == ("cpu", "cpu", "detected", 0)
    with pytest.raises(PlatformError, match="fallback"):
        p.device(0)


@pytest.mark.parametrize(
    "name, arch",
    [
        ("Intel(R) Data Center GPU Max 1550", "xe-hpc"),
        ("Intel(R) Data Center GPU Max 1100", "xe-hpc"),
        ("Intel(R) Arc(TM) B580 Graphics", "xe2"),
        ("Intel(R) Arc(TM) A770 Graphics", "xe-hpg"),
        ("Intel(R) Data Center GPU Flex 170", "xe-hpg"),
        ("Intel(R) Arc(TM) Pro B60 Graphics", "xe2"),
        ("Intel(R) Arc(TM) Pro B50 Graphics", "xe2"),
        ("Intel(R) Arc(TM) B570 Graphics", "xe2"),
        ("Intel(R) Arc(TM) 140V GPU (16GB)", "xe2"),
        # drivers that do not know the marketing name report the PCI id
        ("Intel(R) Graphics [0x64a0]", "xe2"),
        ("Intel(R) Graphics [0x0bd5]", "xe-hpc"),
        ("Intel(R) Graphics [0xe20b]", "xe2"),
        ("Intel(R) Graphics [0xe2ff]", "xe-hpg"),  # an unknown id: "xe2" in its hex digits decides nothing
    ],
)
def test_xpu_arch_from_name(name, arch):
    assert hardware.xpu_arch(name) == arch


def test_xpu_arch_from_the_device_id(monkeypatch):
    """The PCI device id decides where it is known, whatever the name says (Intel's Triton names its
    targets from the device, not the marketing name)."""
    assert hardware.xpu_arch("Intel(R) Graphics", 0xE211) == "xe2"
    assert hardware.xpu_arch("Intel(R) Graphics", 0x0BDA) == "xe-hpc"
    assert hardware.xpu_arch("Intel(R) Graphics", 0x1234) == "xe-hpg"
    # an id in the name is read only where the driver gives no device id: the device id wins
    assert hardware.xpu_arch("Intel(R) Graphics [0x0bd5]", 0xE211) == "xe2"
    assert hardware.xpu_arch("Intel(R) Graphics [0x0bd5]") == "xe-hpc"

    def b60():
        props = _b580()
        props.name, props.device_id = "Intel(R) Graphics", 0xE211
        return props

    simulate_xpu_build(monkeypatch, FakeDriver(b60))
    assert hardware.platform().device(0).arch == "xe2"


@pytest.mark.parametrize(
    "gcn, arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx90a:sramecc+:xnack-", "gfx90a"), ("gfx1100", "gfx1100")]
)
def test_rocm_arch_strips_target_features(gcn, arch):
    assert hardware.rocm_arch(gcn) == arch


# --------------------------------------------------------------------------- lazy, memoized device facts


def test_device_facts_read_lazily_and_memoized_per_index(vendor):
    _, driver, _ = vendor
    p = platform()
    assert p.device_count == 2
    assert driver.calls == [], "detecting the backend must not read device properties"
    d0 = p.device(0)
    assert driver.calls == [0]
    assert p.device(0) is d0
    assert platform().device(0) is d0
    assert driver.calls == [0], "a second device(0) must not read the properties again"
    d1 = p.device(1)
    assert driver.calls == [0, 1]
    assert d1 is not d0 and d1.index == 1
    assert p.device(1) is d1
    assert driver.calls == [0, 1]


def test_device_default_index_is_current_device(monkeypatch):
    driver, _ = simulate(monkeypatch, "nvidia-h200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert platform().device().index == 1
    assert driver.calls == [1]


@pytest.mark.parametrize("index", [2, 7, -1])
def test_device_index_out_of_range(vendor, index):
    _, driver, v = vendor
    with pytest.raises(PlatformError, match=f"device index {index} out of range") as ei:
        platform().device(index)
    assert "2" in str(ei.value) and v["backend"] in str(ei.value)
    assert driver.calls == [], "an out-of-range index must not reach the driver"


def test_describe_is_json_friendly(vendor):
    _, _, v = vendor
    out = json.loads(json.dumps(platform().describe()))
    assert out["backend"] == v["backend"] and out["source"] == "detected"
    assert [d["arch"] for d in out["devices"]] == [v["arch"], v["arch"]]
    assert [d["index"] for d in out["devices"]] == [0, 1]


def test_reset_detects_again(monkeypatch):
    simulate(monkeypatch, "nvidia-h200")
    first = platform()
    assert platform() is first
    hardware.reset()
    second = platform()
    assert second is not first and second.backend == "cuda"


# --------------------------------------------------------------------------- table section per vendor


def test_table_section_for_detected_arch(vendor):
    _, _, v = vendor
    dev = platform().device(0)
    section = load_table(dev.backend).section_for(dev.arch)
    assert section.name == v["section"]


# --------------------------------------------------------------------------- resolved launch kwargs per vendor

N_COLS = (1, 37, 256, 257, 4096, 4097, 20000, 70000)
N_ROWS = (1, 1000)


def test_resolved_launch_has_only_own_backend_options(vendor):
    _, _, v = vendor
    dev = platform().device(0)
    backend = dev.backend
    foreign = ALL_BACKEND_OPTIONS - BACKEND_OPTIONS[backend]
    with warnings.catch_warnings():
        # These devices match their tables: no config needs fitting (which would warn).
        warnings.simplefilter("error", RuntimeWarning)
        for kernel, spec in SPECS.items():
            kernel_params = {n for n, p in spec.params.items() if not p.host}
            host_params = {n for n, p in spec.params.items() if p.host}
            for n_cols in N_COLS:
                for n_rows in N_ROWS:
                    for dtype in (torch.float32, torch.bfloat16):
                        r = resolve(kernel, dev, problem_for(kernel, n_cols, n_rows), dtype)
                        what = f"{kernel} on {dev.name} n_cols={n_cols} n_rows={n_rows}: {r.launch}"
                        assert not foreign & set(r.launch), what
                        assert not foreign & set(r.config.to_dict()), what
                        assert r.launch["num_warps"] * dev.warp_size <= dev.max_threads_per_block, what
                        assert kernel_params <= set(r.launch), what
                        assert not host_params & set(r.launch), what
                        assert set(r.meta) == set(spec.params), what
                        # a rule of the vendor's table, or of base.json as that table inherits it
                        assert r.source.startswith(f"table {backend}.json [") or r.source.startswith(
                            "table base.json rule "
                        ) and f"(inherited by {backend}.json [" in r.source, what
                        if backend == "rocm":
                            # triton.Config passes num_stages=3 unless told; AMD's default is 2.
                            assert "num_stages" in r.launch, what


def test_xe_hpc_long_rows_use_large_grf(monkeypatch):
    simulate(monkeypatch, "intel-max1550")
    r = resolve("rms_norm_fwd", platform().device(0), (20000, 1000), torch.bfloat16)
    assert r.launch.get("grf_mode") == "256"
    assert "[xe-hpc]" in r.source


# --------------------------------------------------------------------------- LIGER_PORTABLE_BACKEND


def test_env_cpu_on_cuda_machine(monkeypatch):
    driver, _ = simulate(monkeypatch, "nvidia-h200")
    monkeypatch.setenv(ENV_BACKEND, "cpu")
    p = platform()
    assert p.backend == "cpu"
    assert p.detected == "cuda"
    assert p.source == "LIGER_PORTABLE_BACKEND"
    assert p.device_count == 0
    assert not _dispatch.use_kernels(torch.device("cuda", 0))
    with pytest.raises(PlatformError):
        p.device(0)
    assert driver.calls == []


def test_env_rocm_on_cuda_machine_raises(monkeypatch):
    simulate(monkeypatch, "nvidia-h200")
    monkeypatch.setenv(ENV_BACKEND, "rocm")
    with pytest.raises(PlatformError) as ei:
        platform()
    msg = str(ei.value)
    assert "LIGER_PORTABLE_BACKEND" in msg
    assert "'rocm'" in msg and "'cuda'" in msg


@pytest.mark.parametrize(
    "vendor_id, requested",
    [("nvidia-h200", "xpu"), ("amd-mi300x", "cuda"), ("intel-max1550", "cuda"), ("intel-arc-b580", "rocm")],
)
def test_env_other_vendor_raises(monkeypatch, vendor_id, requested):
    driver, v = simulate(monkeypatch, vendor_id)
    monkeypatch.setenv(ENV_BACKEND, requested)
    with pytest.raises(PlatformError, match="LIGER_PORTABLE_BACKEND") as ei:
        platform()
    assert repr(requested) in str(ei.value) and repr(v["backend"]) in str(ei.value)
    assert driver.calls == []


@pytest.mark.parametrize("build", [dict(hip=None, cuda="12.8"), dict(hip="6.4.43482", cuda=None)], ids=["cuda", "rocm"])
def test_env_backend_of_this_build_without_a_gpu(monkeypatch, build):
    """A GPU build of torch on a machine (or container) that sees no GPU: the error says no GPU is
    visible, not that another PyTorch build is needed."""
    simulate_cuda_build(monkeypatch, FakeDriver(_h200, count=0), **build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    requested = "cuda" if build["cuda"] else "rocm"
    monkeypatch.setenv(ENV_BACKEND, requested)
    with pytest.raises(PlatformError) as ei:
        platform()
    msg = str(ei.value)
    assert f"no {requested} GPU is visible" in msg and "install" not in msg
    assert ("CUDA_VISIBLE_DEVICES" if requested == "cuda" else "HIP_VISIBLE_DEVICES") in msg


def test_env_bogus_lists_choices(monkeypatch):
    simulate(monkeypatch, "nvidia-h200")
    monkeypatch.setenv(ENV_BACKEND, "bogus")
    with pytest.raises(PlatformError) as ei:
        platform()
    msg = str(ei.value)
    assert "LIGER_PORTABLE_BACKEND" in msg and "bogus" in msg
    for b in BACKENDS:
        assert b in msg


@pytest.mark.parametrize("value, meant", [("hip", "rocm"), ("AMD", "rocm"), ("nvidia", "cuda"), ("intel", "xpu")])
def test_env_vendor_name_points_to_its_backend(monkeypatch, value, meant):
    simulate(monkeypatch, "nvidia-h200")
    monkeypatch.setenv(ENV_BACKEND, value)
    with pytest.raises(PlatformError, match=rf"is not a backend; use one of .* \(for '{value.lower()}' it is '{meant}'\)"):
        platform()


@pytest.mark.parametrize("value", ["cuda", " CUDA "])
def test_env_naming_detected_backend(monkeypatch, value):
    simulate(monkeypatch, "nvidia-h200")
    monkeypatch.setenv(ENV_BACKEND, value)
    p = platform()
    assert (p.backend, p.detected, p.source) == ("cuda", "cuda", "LIGER_PORTABLE_BACKEND")


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_env_unset_gives_detection(monkeypatch, value):
    simulate(monkeypatch, "amd-mi300x")
    if value is not None:
        monkeypatch.setenv(ENV_BACKEND, value)
    p = platform()
    assert (p.backend, p.detected, p.source) == ("rocm", "rocm", "detected")


# --------------------------------------------------------------------------- dispatch helpers


def test_use_kernels_false_for_cpu_tensors():
    assert _dispatch.use_kernels(torch.ones(2).device) is False


def test_use_kernels_false_for_cpu_tensors_on_gpu_platform(monkeypatch):
    simulate(monkeypatch, "nvidia-h200")
    assert _dispatch.use_kernels(torch.device("cpu")) is False
    assert _dispatch.use_kernels(torch.device("cuda", 0)) is True
    assert _dispatch.use_kernels(torch.device("meta")) is False


def test_use_kernels_true_for_cpu_tensors_under_simulate():
    dev = hardware.DeviceInfo("cuda", 0, "NVIDIA H200", "sm90", 32, 132, 1024, 232448)
    with _dispatch.simulate(dev):
        assert _dispatch.use_kernels(torch.device("cpu")) is True
        assert _dispatch.device_info(torch.ones(1)) is dev
    assert _dispatch.use_kernels(torch.device("cpu")) is False


def _p100() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="Tesla P100-PCIE-16GB", major=6, minor=0, multi_processor_count=56, warp_size=32,
        shared_memory_per_block_optin=49152, gcnArchName="Tesla P100-PCIE-16GB", total_memory=16_000_000_000,
    )


def _rx6900() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="AMD Radeon RX 6900 XT", gcnArchName="gfx1030", major=10, minor=3, warp_size=32,
        multi_processor_count=40, total_memory=17_000_000_000,
    )


@pytest.mark.parametrize("build, unsupported, arch", [
    (dict(hip=None, cuda="12.8"), _p100, "sm60"),
    (dict(hip="6.4.43482", cuda=None), _rx6900, "gfx1030"),
])
def test_unsupported_arch_runs_the_fallback_with_one_warning(monkeypatch, build, unsupported, arch):
    """A GPU Triton cannot compile the kernels for (a P100: the backward's atomics need sm70; RDNA2:
    an unsupported target) takes the PyTorch fallback with one warning saying why, instead of a
    compiler error at the first call; on a mixed node the other GPU keeps the kernels."""
    driver = FakeDriver(_h200 if build["hip"] is None else _mi300x)
    driver.props[1] = unsupported()
    simulate_cuda_build(monkeypatch, driver, **build)
    with pytest.warns(RuntimeWarning, match=rf"\({arch}\) cannot run the Triton kernels: Triton.*PyTorch fallback") as rec:
        assert _dispatch.kernel_device(torch.device("cuda", 1)) is None
    assert len(rec) == 1 and driver.props[1].name in str(rec[0].message)
    assert rec[0].filename == __file__  # the caller's line, not ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _dispatch.kernel_device(torch.device("cuda", 1)) is None  # said once
        assert _dispatch.kernel_device(torch.device("cuda", 0)).arch in ("sm90", "gfx942")
        assert _dispatch.use_kernels(torch.device("cuda", 0)) and not _dispatch.use_kernels(torch.device("cuda", 1))


def test_info_names_an_unsupported_gpu(monkeypatch, capsys):
    """`liger-portable info` on a mixed node says which GPU runs the fallback and why."""
    from liger_portable import cli

    driver = FakeDriver(_h200)
    driver.props[1] = _p100()
    simulate_cuda_build(monkeypatch, driver, hip=None, cuda="12.8")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    device1 = out[out.index("device 1:"):]
    assert "not supported by the kernels, runs the pure-PyTorch fallback: Triton" in device1
    assert "not supported" not in out[:out.index("device 1:")]
    assert cli.main(["info", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert list(described["unsupported"]) == ["1"] and "sm_70" in described["unsupported"]["1"]
    assert list(described["configs"]) == ["0"]  # none listed for the device that runs the fallback


def test_check_on_an_unsupported_gpu_says_it_checks_the_fallback(monkeypatch, capsys):
    """`liger-portable check` on a GPU the kernels do not support would compare the fallback with
    itself: it says so (and lists no kernel configs)."""
    from liger_portable import cli, commands

    driver = FakeDriver(_h200)
    driver.props[1] = _p100()
    simulate_cuda_build(monkeypatch, driver, hip=None, cuda="12.8")
    monkeypatch.setattr(commands, "CHECK_CASES", [])  # the cases would need the real GPU
    assert cli.main(["check", "--device", "1"]) == 0
    out = capsys.readouterr().out
    assert "Tesla P100-PCIE-16GB (cuda sm60): not supported by the kernels, so this checks the PyTorch fallback" in out
    assert "config " not in out
    assert cli.main(["check", "--device", "0"]) == 0
    out = capsys.readouterr().out
    assert "not supported" not in out and "config rms_norm_fwd" in out


def test_same_device_names_both_arguments():
    with pytest.raises(ValueError) as ei:
        _dispatch.same_device(hidden=torch.ones(2), weight=torch.empty(2, device="meta"))
    msg = str(ei.value)
    assert "weight" in msg and "hidden" in msg
    assert "meta" in msg and "cpu" in msg


def test_same_device_returns_common_device():
    assert _dispatch.same_device(a=torch.ones(1), b=torch.zeros(3)) == torch.device("cpu")


def test_traced_calls_read_no_device_facts(monkeypatch):
    """Under torch.compile a kernel call carries a stand-in for its device (the custom ops look the
    device up when they run): reading the facts while tracing took a lock on first use, which broke
    the graph at a compiled model's first kernel call (seen on the H200 with TORCH_LOGS=graph_breaks)."""
    import threading

    from liger_portable import _dispatch
    from liger_portable.hardware import Platform

    p = Platform(backend="cuda", detected="cuda", source="detected", torch_version=torch.__version__,
                 triton_version=None, device_count=1)

    def unreadable(index=None):
        with threading.Lock():  # what a first read does; fails fullgraph if traced
            raise AssertionError("device facts read while tracing")

    monkeypatch.setattr(p, "device", unreadable)
    monkeypatch.setattr(_dispatch, "platform", lambda: p)
    x = torch.ones(3)

    def f(x):
        dev = _dispatch.kernel_device(torch.device("cuda", 0))
        return x + 1 if dev is _dispatch.TRACED else x - 1

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), x + 1)
    with pytest.raises(AssertionError, match="read while tracing"):  # eager: the facts are read
        f(x)
