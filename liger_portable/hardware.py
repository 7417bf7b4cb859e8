"""Which hardware is this: the only module that knows vendors apart.

Detection is two-staged so that ``import liger_portable`` stays cheap and never creates a GPU
context:

* :func:`platform` decides the backend (``cuda``, ``rocm``, ``xpu`` or ``cpu``) from how PyTorch
  was built (``torch.version.hip`` / ``torch.version.cuda``) and ``torch.xpu``; the environment
  variable ``LIGER_PORTABLE_BACKEND`` overrides it.
* :meth:`Platform.device` reads the facts of one device (arch, name, warp size, compute units,
  shared memory per block) on first use, once per device index.

Everything else in the package asks these objects; no other module looks at ``torch.version.hip``
or at device-type strings.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field

import torch

BACKENDS = ("cuda", "rocm", "xpu", "cpu")
ENV_BACKEND = "LIGER_PORTABLE_BACKEND"

# The torch device type each backend's tensors live on (ROCm builds of PyTorch use "cuda").
TORCH_DEVICE_TYPE = {"cuda": "cuda", "rocm": "cuda", "xpu": "xpu", "cpu": "cpu"}

# Launch options only one vendor's Triton backend understands. Another vendor's Triton raises
# ``KeyError`` at launch for them, so they must never cross over.
BACKEND_OPTIONS: dict[str, frozenset[str]] = {
    "cuda": frozenset({"maxnreg"}),
    "rocm": frozenset({"waves_per_eu", "matrix_instr_nonkdim", "kpack"}),
    "xpu": frozenset({"grf_mode", "threads_per_warp"}),
    "cpu": frozenset(),
}
ALL_BACKEND_OPTIONS = frozenset().union(*BACKEND_OPTIONS.values())


@dataclass(frozen=True)
class OptionRule:
    """The values a table or cache may give one backend launch option (as the tables spell it;
    :func:`launch_options` spells it as the installed Triton wants). ``values``: the allowed ones,
    or None for any integer in ``[lo, hi]``."""

    doc: str
    values: tuple | None = None
    lo: int = 0
    hi: int = 0

    def check(self, value) -> str | None:
        if self.values is not None:
            if any(type(value) is type(v) and value == v for v in self.values):
                return None
            return f"must be one of {list(self.values)}, got {value!r}"
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            return f"must be an integer in [{self.lo}, {self.hi}], got {value!r}"
        return None


OPTION_RULES: dict[str, OptionRule] = {
    # NVIDIA: ptxas's .maxnreg; a thread has at most 255 registers.
    "maxnreg": OptionRule("registers per thread", lo=16, hi=255),
    # AMD: an occupancy hint, waves per SIMD (a CDNA SIMD holds at most 8); 0: none.
    "waves_per_eu": OptionRule("waves per SIMD occupancy hint (0: none)", lo=0, hi=8),
    "matrix_instr_nonkdim": OptionRule("MFMA instruction size (0: the compiler picks)", values=(0, 16, 32)),
    "kpack": OptionRule("MFMA k-packing", values=(1, 2)),
    # Intel: "256" is the large register file (256 registers a thread at half the threads per EU).
    "grf_mode": OptionRule("register file mode", values=("default", "256")),
    "threads_per_warp": OptionRule("work-items per sub-group", values=(16, 32)),
}

# Per arch, options narrower than OPTION_RULES: gfx950 compiles only kpack=1 (triton #6412, #7518).
ARCH_OPTION_VALUES: dict[str, dict[str, tuple]] = {"gfx950": {"kpack": (1,)}}


def _version_at_least(version: str | None, major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (major, minor)


def launch_options(backend: str, options: dict, triton_version: str | None) -> dict:
    """Backend options as the installed Triton spells them. Intel's Triton renamed
    ``threads_per_warp`` to ``warp_size`` in 3.6 (intel-xpu-backend-for-triton #5122: the old name
    raises KeyError there) and spells the large register file ``"256"`` from 3.6 (#5430; before,
    ``"large"``, and ``"256"`` was ignored). The tables use ``threads_per_warp`` and ``"256"``."""
    if backend != "xpu" or not options:
        return options
    out = dict(options)
    if _version_at_least(triton_version, 3, 6):
        if "threads_per_warp" in out:
            out["warp_size"] = out.pop("threads_per_warp")
    elif out.get("grf_mode") == "256":
        out["grf_mode"] = "large"
    return out


class PlatformError(RuntimeError):
    """The requested backend is unknown or not present on this machine."""


@dataclass(frozen=True, eq=False)
class DeviceInfo:
    """Facts of one GPU that decide which launch configs are legal and good.

    Attributes:
        backend: ``cuda``, ``rocm`` or ``xpu``.
        index: device index within the backend.
        name: marketing name as the driver reports it, e.g. ``NVIDIA H200``.
        arch: ``sm90``, ``gfx942``, ``xe-hpc`` ... (the key of a table's arch section).
        warp_size: threads per warp / wavefront / sub-group that ``num_warps`` counts in.
        compute_units: streaming multiprocessors, compute units or Xe cores, as the driver counts
            them; on RDNA (gfx10-gfx12) the driver counts work-group processors, two CUs each
            (ROCm/hip #3198), and the tables' rdna rules are written per such unit.
        max_threads_per_block: largest work-group the device launches.
        shared_mem_per_block: bytes of shared memory / LDS / SLM one block may use.

    Instances compare and hash by identity (one per device per process), which keeps the config
    memo's lookup cheap.
    """

    backend: str
    index: int
    name: str
    arch: str
    warp_size: int
    compute_units: int
    max_threads_per_block: int
    shared_mem_per_block: int

    @property
    def model_slug(self) -> str:
        """File-name form of the device model, e.g. ``NVIDIA_H200`` (autotune cache file names)."""
        return re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_") or "unknown"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(TORCH_DEVICE_TYPE[self.backend], self.index)


@dataclass
class Platform:
    """What :func:`liger_portable.platform` found.

    Attributes:
        backend: the backend in use: ``cuda``, ``rocm``, ``xpu`` or ``cpu`` (fallback only).
        detected: the backend the hardware offers, before ``LIGER_PORTABLE_BACKEND``.
        source: ``"detected"`` or ``"LIGER_PORTABLE_BACKEND"``.
        torch_version, triton_version: versions in this process (triton ``None`` if absent).
        device_count: GPUs of that backend visible to this process (0 for ``cpu``).
    """

    backend: str
    detected: str
    source: str
    torch_version: str
    triton_version: str | None
    device_count: int
    _devices: dict[int, DeviceInfo] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def torch_device_type(self) -> str:
        """The ``tensor.device.type`` this backend's GPU tensors have (``cuda`` on ROCm too)."""
        return TORCH_DEVICE_TYPE[self.backend]

    def device(self, index: int | None = None) -> DeviceInfo:
        """Facts of GPU ``index`` (default: the current device), read once and memoized."""
        if self.backend == "cpu":
            raise PlatformError("the cpu backend has no GPU devices; kernels run the PyTorch fallback")
        if index is None:
            index = _current_index(self.backend)
        info = self._devices.get(index)
        if info is None:
            with self._lock:
                info = self._devices.get(index)
                if info is None:
                    if not 0 <= index < self.device_count:
                        raise PlatformError(
                            f"device index {index} out of range: {self.device_count} {self.backend} "
                            "device(s) visible (check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / "
                            "ZE_AFFINITY_MASK)"
                        )
                    info = _READERS[self.backend](index)
                    self._devices[index] = info
        return info

    def describe(self) -> dict:
        """A JSON-friendly summary (used by ``liger-portable info``)."""
        out = {
            "backend": self.backend,
            "detected": self.detected,
            "source": self.source,
            "torch": self.torch_version,
            "triton": self.triton_version,
            "device_count": self.device_count,
        }
        if self.backend != "cpu":
            out["devices"] = [self.device(i).__dict__ for i in range(self.device_count)]
        return out


# --------------------------------------------------------------------------- detection


def _detect_backend() -> str:
    """The backend this PyTorch build offers, without touching a device."""
    if getattr(torch.version, "hip", None):
        return "rocm" if torch.cuda.is_available() else "cpu"
    if getattr(torch.version, "cuda", None) and torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    return "cpu"


# The variable that hides a backend's GPUs from a process.
_VISIBLE_VAR = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK"}


def _build_offers(backend: str) -> bool:
    """True if this PyTorch build is made for ``backend`` (whether or not a device is visible)."""
    if backend == "rocm":
        return bool(getattr(torch.version, "hip", None))
    if backend == "cuda":
        return bool(getattr(torch.version, "cuda", None)) and not getattr(torch.version, "hip", None)
    if backend == "xpu":
        return getattr(torch, "xpu", None) is not None and bool(getattr(torch.version, "xpu", None))
    return False


def _device_count(backend: str) -> int:
    if backend in ("cuda", "rocm"):
        return torch.cuda.device_count()
    if backend == "xpu":
        return torch.xpu.device_count()
    return 0


def _current_index(backend: str) -> int:
    if backend in ("cuda", "rocm"):
        return torch.cuda.current_device()
    return torch.xpu.current_device()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# Names users reach for that are not the backends' own.
_VENDOR_NAMES = {"nvidia": "cuda", "hip": "rocm", "amd": "rocm", "intel": "xpu"}


def _build_platform() -> Platform:
    detected = _detect_backend()
    requested = os.environ.get(ENV_BACKEND, "").strip().lower()
    if not requested:
        backend, source = detected, "detected"
    else:
        if requested not in BACKENDS:
            meant = _VENDOR_NAMES.get(requested)
            hint = f" (for {requested!r} it is {meant!r})" if meant else ""
            raise PlatformError(
                f"{ENV_BACKEND}={requested!r} is not a backend; use one of {', '.join(BACKENDS)}{hint} "
                "or unset it to detect the hardware"
            )
        if requested not in ("cpu", detected) and _build_offers(requested):
            raise PlatformError(
                f"{ENV_BACKEND}={requested!r} but no {requested} GPU is visible to this process "
                f"(torch {torch.__version__} supports it, but finds no device): check the driver, "
                f"{_VISIBLE_VAR[requested]} and the container's GPU access, set {ENV_BACKEND}=cpu to "
                "force the fallback, or unset it"
            )
        if requested not in ("cpu", detected):
            raise PlatformError(
                f"{ENV_BACKEND}={requested!r} but this machine offers {detected!r} "
                f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
                f"torch.version.hip={getattr(torch.version, 'hip', None)}); install the matching "
                f"PyTorch build, set {ENV_BACKEND}=cpu to force the fallback, or unset it"
            )
        backend, source = requested, ENV_BACKEND
    if backend != "cpu" and _triton_version() is None:
        raise PlatformError(
            f"backend {backend!r} needs Triton, which is not installed: pip install triton "
            f"(or set {ENV_BACKEND}=cpu to use the PyTorch fallback)"
        )
    return Platform(
        backend=backend,
        detected=detected,
        source=source,
        torch_version=torch.__version__,
        triton_version=_triton_version(),
        device_count=_device_count(backend),
    )


_PLATFORM: Platform | None = None


def platform() -> Platform:
    """The platform of this process: backend, versions and (lazily) per-device facts.

    Detected once per process (at ``import liger_portable``); :func:`reset` forgets it (tests, or
    after changing ``LIGER_PORTABLE_BACKEND``).

    Raises:
        PlatformError: ``LIGER_PORTABLE_BACKEND`` names an unknown backend or one not present.
    """
    global _PLATFORM
    if _PLATFORM is None:
        _PLATFORM = _build_platform()
    return _PLATFORM


def reset() -> None:
    """Forget the detected platform and everything derived from it (configs, memos)."""
    global _PLATFORM
    _PLATFORM = None
    for hook in _RESET_HOOKS:
        hook()


_RESET_HOOKS: list = []


def on_reset(hook) -> None:
    """Register a callable run by :func:`reset` (used by the config memo)."""
    _RESET_HOOKS.append(hook)


# --------------------------------------------------------------------------- per-device facts


def _cuda_device(index: int) -> DeviceInfo:
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        backend="cuda",
        index=index,
        name=p.name,
        arch=f"sm{p.major}{p.minor}",
        warp_size=int(getattr(p, "warp_size", 32)),
        compute_units=p.multi_processor_count,
        max_threads_per_block=int(getattr(p, "max_threads_per_block", 1024)),
        shared_mem_per_block=int(getattr(p, "shared_memory_per_block_optin", 49152)),
    )


def rocm_arch(gcn_arch_name: str) -> str:
    """``gfx942:sramecc+:xnack-`` -> ``gfx942`` (the target features do not change configs)."""
    return gcn_arch_name.split(":", 1)[0].strip()


# LDS a work-group may use where PyTorch's ROCm build does not say (it binds no
# shared_memory_per_block_optin): 160 KiB on CDNA4 (ROCm's GPU specifications: MI350X/MI355X), else 64 KiB.
ROCM_LDS_BYTES = {"gfx950": 163840}


def _rocm_device(index: int) -> DeviceInfo:
    p = torch.cuda.get_device_properties(index)
    arch = rocm_arch(getattr(p, "gcnArchName", "") or "")
    # As Triton's AMD backend: gfx10 and later (RDNA) run wave32, gfx9 (CDNA, Vega) wave64.
    major = arch[3:-2]
    default_warp = 32 if major.isdigit() and int(major) >= 10 else 64
    shared = getattr(p, "shared_memory_per_block_optin", 0) or max(
        int(getattr(p, "shared_memory_per_block", 0) or 0), ROCM_LDS_BYTES.get(arch, 65536)
    )
    return DeviceInfo(
        backend="rocm",
        index=index,
        name=p.name,
        arch=arch or "gfx-unknown",
        warp_size=int(getattr(p, "warp_size", default_warp)),
        compute_units=p.multi_processor_count,
        max_threads_per_block=int(getattr(p, "max_threads_per_block", 1024)),
        shared_mem_per_block=int(shared),
    )


# PCI device ids of Intel GPUs whose driver may report no marketing name ("Intel(R) Graphics [0x64a0]"):
# Max 1550 and 1100 (Intel's Triton, device_specs.py), Arc B580 and B570 (the same file), Arc Pro B60
# (torch-xpu-ops issue 2990) and Lunar Lake (intel-extension-for-pytorch issue 780).
XPU_DEVICE_IDS = {0x0BD5: "xe-hpc", 0x0BDA: "xe-hpc", 0xE20B: "xe2", 0xE20C: "xe2", 0xE211: "xe2", 0x64A0: "xe2"}


def xpu_arch(name: str, device_id: int | None = None) -> str:
    """Intel GPU family from the PCI device id where known (:data:`XPU_DEVICE_IDS`; also read from a
    name such as ``Intel(R) Graphics [0x64a0]``), else from the device name: ``xe-hpc`` (Max / Ponte
    Vecchio, data centre), ``xe2`` (Arc B-series and Pro B-series, Lunar Lake's Arc 130V/140V),
    ``xe-hpg`` (Arc A-series, Flex, other client GPUs)."""
    n = name.lower()
    if device_id is None and (m := re.search(r"\[0x([0-9a-f]{4})\]", n)):
        device_id = int(m.group(1), 16)
    if device_id in XPU_DEVICE_IDS:
        return XPU_DEVICE_IDS[device_id]
    if re.search(r"\bmax\b", n) or "ponte vecchio" in n or "pvc" in n:
        return "xe-hpc"
    if re.search(r"\bb\d{2,3}\b|\b1[34]0v\b|\bxe2\b", n) or "battlemage" in n or "lunar lake" in n:
        return "xe2"
    return "xe-hpg"


def _xpu_device(index: int) -> DeviceInfo:
    p = torch.xpu.get_device_properties(index)
    sub_groups = list(getattr(p, "sub_group_sizes", []) or [32])
    return DeviceInfo(
        backend="xpu",
        index=index,
        name=p.name,
        arch=xpu_arch(p.name, getattr(p, "device_id", None)),
        # Triton's Intel backend launches 32 work-items per "warp" unless threads_per_warp says otherwise.
        warp_size=32 if 32 in sub_groups else max(sub_groups),
        compute_units=int(getattr(p, "gpu_subslice_count", 0) or getattr(p, "gpu_eu_count", 0) or 1),
        max_threads_per_block=int(getattr(p, "max_work_group_size", 1024)),
        shared_mem_per_block=int(getattr(p, "local_mem_size", 0) or 65536),
    )


_READERS = {"cuda": _cuda_device, "rocm": _rocm_device, "xpu": _xpu_device}
