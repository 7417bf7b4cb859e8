"""DTensor inputs to the ops without DTensor rules of their own (GLUs, RoPE, the cross-entropies):
on the kernel path they run the PyTorch fallback, with one warning per op, and give the plain
tensors' results (they crashed inside the kernels' launch code). A one-process gloo group on the
CPU, the kernel path simulated in the Triton interpreter. (Multi-process runs,
scripts/distributed_check.py under tests/test_distributed.py, cover the norms' DTensor rules.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from liger_portable import functional as F

from conftest import rel_err

pytestmark = pytest.mark.interpreter


@pytest.fixture
def mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _cases():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 6, 40, generator=g), torch.randn(2, 6, 40, generator=g)
    q, k = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    cos, sin = torch.randn(2, 7, 16, generator=g), torch.randn(2, 7, 16, generator=g)
    logits, target = torch.randn(12, 300, generator=g), torch.randint(0, 300, (12,), generator=g)
    hidden, weight = torch.randn(12, 32, generator=g), torch.randn(300, 32, generator=g) / 6
    return {
        "swiglu": (F.swiglu, (a, b)),
        "geglu": (F.geglu, (a, b)),
        "rope": (lambda *t: torch.cat([x.flatten() for x in F.rope(*t)]), (q, k, cos, sin)),
        "cross_entropy": (F.cross_entropy, (logits, target)),
        "fused_linear_cross_entropy": (F.fused_linear_cross_entropy, (hidden, weight, target)),
    }


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_dtensor_inputs_run_the_fallback(simulated_device, mesh, name, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    fn, plain = _cases()[name]
    want = fn(*plain)
    places = [Shard(0) if placement == "shard" else Replicate()]
    inputs = [distribute_tensor(t, mesh, places) for t in plain]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = fn(*inputs)
    assert any(f"liger_portable.{name}: DTensor inputs run the PyTorch fallback" in str(w.message) for w in rec)
    assert rel_err(got.full_tensor(), want) <= 1e-5
