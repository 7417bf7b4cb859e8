"""The cached launcher (``liger_portable.ops.launching``): a kernel compiled for one specialisation is
reused only for arguments Triton would compile the same kernel for, and gives the bits Triton's
own launch gives."""

from __future__ import annotations

import pytest
import torch

import liger_portable
from conftest import rel_err
from liger_portable import fallback
from liger_portable import functional as F
from liger_portable.ops import launching
from liger_portable.ops import rms_norm as rms_ops


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


@pytest.mark.interpreter
def test_interpreter_launches_take_tritons_path(simulated_device):
    """In the interpreter no compiled kernel comes back: nothing is cached, the result is right."""
    rms_ops.launch_fwd._cache.clear()
    x = torch.randn(5, 40)
    w = torch.rand(40)
    y = F.rms_norm(x, w)
    assert rel_err(y, fallback.rms_norm(x.double(), w.double(), 1e-6, 0.0, "llama")) <= 1e-5
    assert rms_ops.launch_fwd._cache == {}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_cached_launch_equals_tritons_launch(dtype):
    """Forward and backward through the cached launcher are bitwise those of kernel[grid](...),
    for aligned rows and for rows whose pointer and stride are not multiples of 16 (a different
    specialisation, which must not reuse the aligned kernel)."""
    dev = _gpu()
    base = torch.randn(333 * 1001 + 1, device=dev, dtype=dtype)
    w = torch.rand(1000, device=dev, dtype=dtype)
    dy = torch.randn(333, 1000, device=dev, dtype=dtype)
    cases = {
        "aligned": base[: 333 * 1000].view(333, 1000),
        "odd pointer and stride": base[1:].as_strided((333, 1000), (1001, 1)),
    }
    for name, x in cases.items():
        results = []
        for enabled in (False, True, True):  # Triton's path, then the cached one (filled, then hit)
            launching.enabled = enabled
            try:
                xg = x.detach().requires_grad_()
                wg = w.detach().clone().requires_grad_()
                y = F.rms_norm(xg, wg)
                y.backward(dy)
                torch.cuda.synchronize()
                results.append((y.detach().clone(), xg.grad.clone(), wg.grad.clone()))
            finally:
                launching.enabled = True
        for got in results[1:]:
            for a, b in zip(results[0], got):
                assert torch.equal(a, b), name
        ref = fallback.rms_norm(x.double(), w.double(), 1e-6, 0.0, "llama")
        assert rel_err(results[-1][0], ref) <= (1e-5 if dtype == torch.float32 else 1e-2), name
    keys = [k for k in rms_ops.launch_fwd._cache]
    aligned = {tuple(v for v in k[2:6]) for k in keys}  # X, Y, W, RSTD specialisations
    assert len(aligned) >= 2, "the unaligned rows reused the aligned kernel"
