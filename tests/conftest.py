"""Shared test setup.

Without a GPU, the Triton kernels run in the Triton interpreter: TRITON_INTERPRET must be set
before liger_portable's kernels are decorated, so it is set here, before anything imports them.
With a GPU, the real kernels run and the interpreter tests are skipped.
"""

from __future__ import annotations

import os

import torch


def _has_gpu() -> bool:
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or (xpu is not None and xpu.is_available())


HAS_GPU = _has_gpu()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: workers x default threads oversubscribe the cores
    # (CPU tests ran 4-20x slower that way).
    torch.set_num_threads(1)
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402

from liger_portable.hardware import DeviceInfo  # noqa: E402

# One simulated device per vendor table section family, for the interpreter tests.
SIMULATED_DEVICES = {
    "cuda-sm90": DeviceInfo("cuda", 0, "NVIDIA H200", "sm90", 32, 132, 1024, 232448),
    "cuda-sm80": DeviceInfo("cuda", 0, "NVIDIA A100-SXM4-80GB", "sm80", 32, 108, 1024, 166912),
    "rocm-gfx942": DeviceInfo("rocm", 0, "AMD Instinct MI300X", "gfx942", 64, 304, 1024, 65536),
    "rocm-rdna": DeviceInfo("rocm", 0, "AMD Radeon RX 7900 XTX", "gfx1100", 32, 96, 1024, 65536),
    "xpu-xe-hpc": DeviceInfo("xpu", 0, "Intel(R) Data Center GPU Max 1550", "xe-hpc", 32, 64, 1024, 131072),
    "xpu-xe-hpg": DeviceInfo("xpu", 0, "Intel(R) Arc(TM) A770 Graphics", "xe-hpg", 32, 32, 1024, 65536),
}


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a GPU (CUDA, ROCm or XPU)")
    skip_interp = pytest.mark.skip(reason="interpreter tests run only without a GPU (TRITON_INTERPRET=1)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and "gpu" not in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)
    # big_memory tests last: each waits for every other GPU test to end (the lock below), so one
    # handed to an xdist worker early would hold back the tests queued behind it on that worker.
    items.sort(key=lambda item: item.get_closest_marker("big_memory") is not None)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Every test draws its own random inputs from a seed derived from its id: different tests get
    different inputs, and a failure reproduces whatever the order or the xdist worker."""
    import zlib

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _our_kernels_under_compile(monkeypatch):
    """The kernel tests trace our kernel ops under torch.compile: every test runs with
    ``UNDER_COMPILE = "kernels"``; the tests of the default ("inductor") take the ``inductor_under_compile``
    fixture."""
    from liger_portable import functional

    monkeypatch.setattr(functional, "UNDER_COMPILE", "kernels")


@pytest.fixture
def inductor_under_compile(monkeypatch):
    """The default: under torch.compile the norms, GLU products and RoPE are left to Inductor."""
    from liger_portable import functional

    monkeypatch.setattr(functional, "UNDER_COMPILE", "inductor")


@pytest.fixture
def launches(monkeypatch) -> list:
    """The names of the kernels launched through liger_portable's Python launcher during the test,
    in order (the launches still run)."""
    from liger_portable.ops import launching

    names: list[str] = []
    real = launching.Launcher.__call__

    def spy(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(launching.Launcher, "__call__", spy)
    return names


def big_memory_lock_path() -> str:
    """The lock file of the big_memory tests: per user (a shared fixed path in the temp folder could
    be planted as a link or collide with another user's run), opened without following links."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"liger_portable_big_memory_test.{os.getuid()}.lock")


HEAVY_MEMORY_SLOT_GIB = 32


def heavy_memory_slots() -> int:
    """How many ``heavy_memory`` tests may run at once: one per 32 GiB of device memory (2 on an
    80 GiB card, 4 on a 141 GiB one), at least one."""
    xpu = getattr(torch, "xpu", None)
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
    elif xpu is not None and xpu.is_available():
        total = xpu.get_device_properties(0).total_memory
    else:
        return 1
    return max(1, total // (HEAVY_MEMORY_SLOT_GIB * 2**30))


def heavy_memory_slot_path(slot: int) -> str:
    """The lock file of one ``heavy_memory`` slot (per user, as the big_memory lock)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"liger_portable_heavy_memory_test.{os.getuid()}.{slot}.lock")


def _take_heavy_memory_slot():
    """(slot, its open lock file, locked exclusively) of a free heavy_memory slot; waits until one
    is free."""
    import fcntl
    import time

    slots = heavy_memory_slots()
    while True:
        for slot in range(slots):
            fd = os.open(heavy_memory_slot_path(slot), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            f = os.fdopen(fd, "r+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot, f
            except BlockingIOError:
                f.close()
        time.sleep(0.05)


def _free_device_memory():
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _one_big_memory_test_at_a_time(request):
    """Tests marked ``big_memory`` (tens of GiB of device memory: more than 2**31 elements) run alone
    on the device: they take an exclusive lock on a lock file, every other ``gpu`` test a shared
    one. Each GPU test hands the memory its worker's caching allocator keeps back to the device when
    it ends, so a big test that gets the lock finds the device free. With ``pytest -n 8`` on one
    H200, the 2**31-element tests ran out of memory while six float64 FLCE references were cached.
    Tests marked ``heavy_memory`` (float64 references of 15-25 GiB) also take one of
    ``heavy_memory_slots()`` slots: with 8 workers on an 80 GiB card, three ran out of memory while
    several such references were held at once."""
    big = request.node.get_closest_marker("big_memory") is not None
    heavy = request.node.get_closest_marker("heavy_memory") is not None
    if not big and not heavy and request.node.get_closest_marker("gpu") is None:
        yield
        return
    import fcntl

    fd = os.open(big_memory_lock_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if big else fcntl.LOCK_SH)
        slot = None
        if heavy and not big:
            request.node.heavy_memory_slot, slot = _take_heavy_memory_slot()
        try:
            yield
        finally:
            _free_device_memory()
            if slot is not None:
                slot.close()  # closing the file releases its lock
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(params=sorted(SIMULATED_DEVICES))
def simulated_device(request):
    """Each vendor's simulated device in turn; kernels on CPU tensors run with its configs."""
    from liger_portable import simulate

    with simulate(SIMULATED_DEVICES[request.param]) as dev:
        yield dev


@pytest.fixture(params=["summed in the launch", "summed after it"])
def partial_sums(request, monkeypatch):
    """The row norms' backward with the weight-gradient partials summed by the launch's last program,
    then by a step after the launch, at any size (normally the plan picks one by the partials' size)."""
    from liger_portable import hardware
    from liger_portable.ops import _tiles

    monkeypatch.setattr(_tiles, "FUSED_SUM_MAX", 1 << 62 if request.param == "summed in the launch" else -1)
    hardware.reset()  # the memoized launch plans
    yield request.param
    monkeypatch.undo()
    hardware.reset()


@pytest.fixture
def poison(monkeypatch):
    """Outputs the kernels allocate start as NaN, so any element a kernel fails to write shows.

    Every module of ``liger_portable.ops`` allocates its outputs through a module-level ``empty``
    (``torch.empty`` in normal use), and some also through ``empty_like``; this swaps them for
    NaN-filled allocations."""
    import importlib
    import pkgutil

    import liger_portable.ops

    def nan_empty(*shape, dtype=None, device=None):
        return torch.full(*shape, float("nan"), dtype=dtype, device=device)

    for info in pkgutil.iter_modules(liger_portable.ops.__path__):
        module = importlib.import_module(f"liger_portable.ops.{info.name}")
        if hasattr(module, "empty"):
            monkeypatch.setattr(module, "empty", nan_empty)
        if hasattr(module, "empty_like"):
            monkeypatch.setattr(module, "empty_like", lambda t: torch.full_like(t, float("nan")))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf if out has a non-finite value where ref has none."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def problem_for(kernel: str, n_cols: int, n_rows: int) -> tuple:
    """A resolvable problem for any kernel: its key's first two fields take ``n_cols`` and
    ``n_rows`` (row length and row count; RoPE: head_dim and heads), later fields a typical value
    (hidden 4096, seq_len 4096)."""
    from liger_portable.specs import SPECS

    extra = {"hidden": 4096, "seq_len": 4096}
    key = SPECS[kernel].key
    return (n_cols, n_rows, *(extra[f] for f in key[2:]))


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def beyond_int32_rows(rows: int, n: int, dtype=torch.bfloat16, seed: int = 0, scale: float = 1.0,
                      shift: float = 0.0) -> torch.Tensor:
    """A (rows, n) tensor of random values whose last two rows start beyond 2**31 elements (where an
    int32 row offset wraps): rows far apart (a row stride of about 2**31 / (rows - 2) elements, a
    multiple of 64) in a buffer that is allocated but written only at the rows, so its untouched pages
    take no memory and the Triton interpreter checks a kernel's int64 offsets on the CPU with a few
    MiB. The buffer maps a sparse temporary file (shared): unlike an anonymous allocation of 4 GiB or
    more, it counts against no overcommit limit, so the test runs on a machine with less memory than
    that. A leaf (it can require grad; its gradient is then contiguous)."""
    import tempfile

    stride = max(n, -(-(2**31) // ((rows - 2) * 64)) * 64)
    folder = tempfile.mkdtemp(prefix="liger_portable_beyond_int32_")
    path = os.path.join(folder, "buffer")
    try:
        base = torch.from_file(path, shared=True, size=(rows - 1) * stride + n, dtype=dtype)
    finally:  # the mapping outlives the file's name
        try:
            os.unlink(path)
            os.rmdir(folder)
        except OSError:
            pass
    x = base.as_strided((rows, n), (stride, 1))
    g = torch.Generator().manual_seed(seed)
    x.copy_(torch.randn(rows, n, generator=g) * scale + shift)
    assert x.stride(0) * (rows - 2) >= 2**31
    return x
