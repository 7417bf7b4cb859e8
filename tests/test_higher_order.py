"""Higher-order gradients (``create_graph=True``, then a gradient of the gradients: a gradient
penalty) through the public ops: right, or an error naming the op; never silently wrong.

The Triton kernels compute gradients without an autograd graph, so their backward refuses
``create_graph=True``. The CPU fallbacks written as PyTorch expressions (norms, RoPE, GLUs) are
differentiated by autograd and must give the second derivative exactly; the fallback losses
write their gradients out by hand and refuse, as the kernels do."""

from __future__ import annotations

import pytest
import torch

from conftest import SIMULATED_DEVICES, rel_err
from liger_portable import functional as F, simulate

R, H, V = 4, 16, 11
ERROR = r"liger_portable .*higher-order gradients \(create_graph=True\) are not supported"


def _inputs(dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    w = torch.randn(H, generator=g, dtype=torch.float64) * 0.3 + 1
    r = torch.randn(R, H, generator=g, dtype=torch.float64)
    cos, sin = torch.randn(1, R, H, generator=g, dtype=torch.float64), torch.randn(1, R, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (R,), generator=g)
    head = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    return [z.to(device, dtype) if z.is_floating_point() else z.to(device) for z in (x, w, r, cos, sin, t, head)]


def _rope_ref(q, k, cos, sin):
    def rot(u):
        a, b = u.chunk(2, -1)
        return torch.cat((-b, a), -1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


# op -> (ours, reference in PyTorch ops), each f(x, w, r, cos, sin, t, head) -> a tensor of x and w
OPS = {
    "rms_norm": (lambda x, w, *_: F.rms_norm(x, w), lambda x, w, *_: torch.nn.functional.rms_norm(x, (H,), w, 1e-6)),
    "layer_norm": (lambda x, w, *_: F.layer_norm(x, w), lambda x, w, *_: torch.nn.functional.layer_norm(x, (H,), w, None, 1e-5)),
    "fused_add_rms_norm": (
        lambda x, w, r, *_: F.fused_add_rms_norm(x, r, w)[0],
        lambda x, w, r, *_: torch.nn.functional.rms_norm(x + r, (H,), w, 1e-6),
    ),
    "rope": (
        lambda x, w, r, cos, sin, *_: F.rope((x * w)[None, None], x[None, None], cos, sin)[0][0, 0],
        lambda x, w, r, cos, sin, *_: _rope_ref((x * w)[None, None], x[None, None], cos[:, None], sin[:, None])[0][0, 0],
    ),
    "swiglu": (lambda x, w, *_: F.swiglu(x * w, x.flip(0)), lambda x, w, *_: torch.nn.functional.silu(x * w) * x.flip(0)),
    "cross_entropy": (
        lambda x, w, r, cos, sin, t, head: F.cross_entropy(x * w, t % H),
        lambda x, w, r, cos, sin, t, head: torch.nn.functional.cross_entropy(x * w, t % H),
    ),
    "fused_linear_cross_entropy": (
        lambda x, w, r, cos, sin, t, head: F.fused_linear_cross_entropy(x * w, head, t),
        lambda x, w, r, cos, sin, t, head: torch.nn.functional.cross_entropy((x * w) @ head.T, t),
    ),
}
# The fallbacks that autograd differentiates (the others write their gradients out).
AUTOGRAD_FALLBACK = {"rms_norm", "layer_norm", "fused_add_rms_norm", "rope", "swiglu"}


def _penalty_grad(fn, inputs):
    """d/dw of |d(sum y^2)/dx|^2 + sum y: the second derivative through the op, and its first."""
    x, w, *rest = inputs
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, *rest)
    gx, = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    gw, = torch.autograd.grad(gx.pow(2).sum() + y.sum(), w)
    return gw


@pytest.mark.parametrize("op", sorted(OPS))
def test_fallback_second_derivative_is_right_or_refused(op):
    ours, ref = OPS[op]
    want = _penalty_grad(ref, _inputs(torch.float64))
    if op in AUTOGRAD_FALLBACK:
        assert rel_err(_penalty_grad(ours, _inputs(torch.float32)), want) <= 1e-5
    else:
        with pytest.raises(RuntimeError, match=ERROR):
            _penalty_grad(ours, _inputs(torch.float32))


@pytest.mark.interpreter
@pytest.mark.parametrize("op", sorted(OPS))
def test_kernels_refuse_a_second_derivative(op, launches):
    """Every op's kernel path (interpreter, H200 configs): create_graph=True is refused, naming the
    op; its first-order gradients are unaffected (the same call without create_graph works)."""
    ours, _ = OPS[op]
    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        with pytest.raises(RuntimeError, match=ERROR):
            _penalty_grad(ours, _inputs(torch.float32))
        assert launches, "the kernels did not run"
        x, w, *rest = _inputs(torch.float32)
        x.requires_grad_()
        gx, = torch.autograd.grad(ours(x, w, *rest).sum(), x)
        assert torch.isfinite(gx).all()


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(OPS))
def test_kernels_refuse_a_second_derivative_gpu(op):
    import liger_portable

    ours, _ = OPS[op]
    device = torch.device(liger_portable.platform().torch_device_type, 0)
    with pytest.raises(RuntimeError, match=ERROR):
        _penalty_grad(ours, _inputs(torch.float32, device))


@pytest.mark.interpreter
def test_mlp_product_refuses_a_second_derivative(launches):
    """The MLP's fused product with the down projection (``glu_down``, its own Function) too."""
    down = torch.nn.Linear(H, 5)
    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        fn = lambda x, w, *_: F.glu_down("silu", x * w, x.flip(0), down)  # noqa: E731
        with pytest.raises(RuntimeError, match=ERROR):
            _penalty_grad(fn, _inputs(torch.float32))
    assert any("glu" in name for name in launches), launches
