"""What runs under torch.compile: ``functional.UNDER_COMPILE``.

By default ("inductor") the row norms, GLU products and RoPE are left to the compiler under
torch.compile (their PyTorch formulas, which Inductor fuses and launches itself); the losses keep
their kernels. With "kernels" every op launches our kernels under torch.compile too. Eagerly, both
launch our kernels. Each case compiles one public function with fullgraph (no break) on a simulated
CUDA device (kernels in the Triton interpreter), spies on our launches, and checks the output and
gradients against float64.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import SIMULATED_DEVICES, rel_err
from liger_portable import functional as F
from liger_portable import simulate

pytestmark = pytest.mark.interpreter

H = 48  # odd multiple of 16: masked columns in every kernel


def _case(name: str):
    """(function, differentiable inputs, extra arguments, float64 reference function)."""
    x = torch.randn(5, H) + 0.5
    w = torch.rand(H) + 0.5
    if name == "rms_norm":
        return F.rms_norm, (x, w), (1e-6,), lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    if name == "layer_norm":
        b = torch.randn(H)
        return F.layer_norm, (x, w, b), (1e-5,), lambda x, w, b: torch.nn.functional.layer_norm(x, (H,), w, b, 1e-5)
    if name == "fused_add_rms_norm":
        r = torch.randn(5, H)

        def ref(x, r, w):
            s = x + r
            return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w, s

        return F.fused_add_rms_norm, (x, r, w), (1e-6,), ref
    if name in ("swiglu", "geglu"):
        b = torch.randn(5, H)
        act = torch.nn.functional.silu if name == "swiglu" else (lambda a: torch.nn.functional.gelu(a, approximate="tanh"))
        return getattr(F, name), (x, b), (), lambda a, b: act(a) * b
    if name == "rope":
        q, k = torch.randn(2, 3, 7, 16), torch.randn(2, 1, 7, 16)
        cos, sin = torch.randn(1, 7, 16), torch.randn(1, 7, 16)

        def ref(q, k):
            def rot(t):
                return torch.cat((-t[..., 8:], t[..., :8]), -1)

            c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
            return q * c + rot(q) * s, k * c + rot(k) * s

        return (lambda q, k: F.rope(q, k, cos, sin)), (q, k), (), ref
    if name == "cross_entropy":
        logits, target = torch.randn(6, 70), torch.randint(0, 70, (6,))
        target[2] = -100
        return (lambda z: F.cross_entropy(z, target)), (logits,), (), (
            lambda z: torch.nn.functional.cross_entropy(z, target)
        )
    raise AssertionError(name)


GENERATED = ["rms_norm", "layer_norm", "fused_add_rms_norm", "swiglu", "geglu", "rope"]


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("choice", ["inductor", "kernels"])
@pytest.mark.parametrize("name", GENERATED + ["cross_entropy"])
def test_what_launches_under_compile(monkeypatch, launches, choice, name):
    monkeypatch.setattr(F, "UNDER_COMPILE", choice)
    fn, inputs, extra, ref = _case(name)
    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_() for t in inputs]
    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        outs = _outputs(torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves, *extra))
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
    torch._dynamo.reset()
    ours = choice == "kernels" or name not in GENERATED
    assert bool(launches) == ours, f"{name} under {choice}: launched {launches}"

    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    refs = _outputs(ref(*leaves64))
    torch.autograd.backward(refs, [g.double() for g in grads])
    for o, r in zip(outs, refs):
        assert rel_err(o, r) <= 1e-5, name
    for t, r in zip(leaves, leaves64):
        assert rel_err(t.grad, r.grad) <= 1e-5, name


@pytest.mark.parametrize("name", GENERATED)
def test_eager_calls_launch_our_kernels_under_either_choice(launches, name, inductor_under_compile):
    fn, inputs, extra, _ = _case(name)
    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        fn(*inputs, *extra)
    assert launches


def test_default_and_bad_setting():
    """The default is "inductor"; an unknown LIGER_PORTABLE_UNDER_COMPILE fails at import, naming
    the variable and its choices."""
    env = {k: v for k, v in os.environ.items() if k != "LIGER_PORTABLE_UNDER_COMPILE"}
    code = "from liger_portable import functional as F; print(F.UNDER_COMPILE)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "inductor", out.stderr
    bad = subprocess.run(
        [sys.executable, "-c", code], env={**env, "LIGER_PORTABLE_UNDER_COMPILE": "triton"},
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode != 0
    assert "LIGER_PORTABLE_UNDER_COMPILE must be one of inductor, kernels, got 'triton'" in bad.stderr
