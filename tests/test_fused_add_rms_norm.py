"""Fused add + RMSNorm: fallback, Triton kernels (interpreter with each vendor's configs; real GPU),
API edges.

``y, s = fused_add_rms_norm(x, r, w)`` is ``s = x + r; y = rms_norm(s, w)``. Every check compares
against the fallback run in float64 on fresh random inputs (never zeros), both outputs and the
gradients of x, r and w with a gradient flowing into both outputs, at the dtype's tolerance
(fp32 1e-5, bf16/fp16 1e-2). The fallback must equal the unfused composition bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import liger_portable
from liger_portable import fallback
from liger_portable import functional as F

from conftest import TOL, beyond_int32_rows, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = [("llama", 0.0), ("gemma", 1.0)]


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype)
    r = (torch.randn(shape, generator=g) * 3 - 0.2).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    ds = torch.randn(shape, generator=g).to(dtype)
    return tuple(t.to(device) for t in (x, r, w, dy, ds))


def _reference(x, r, w, dy, ds, eps, offset, mode):
    """float64 fallback: (y, s, dx, dr, dw) with gradients dy into y and ds into s."""
    xd, rd, wd = (t.detach().double().cpu().requires_grad_() for t in (x, r, w))
    y, s = fallback.fused_add_rms_norm(xd, rd, wd, eps, offset, mode)
    torch.autograd.backward([y, s], [dy.double().cpu(), ds.double().cpu()])
    return y, s, xd.grad, rd.grad, wd.grad


def _check(got: dict, ref: dict, tol: float) -> None:
    for name in ref:
        err = rel_err(got[name], ref[name])
        assert err <= tol, (name, err)


def _run_and_compare(x, r, w, dy, ds, dtype, mode, offset, eps=1e-6):
    x, r, w = (t.clone().requires_grad_() for t in (x, r, w))
    y, s = F.fused_add_rms_norm(x, r, w, eps, offset=offset, casting_mode=mode)
    assert y.dtype == s.dtype == dtype and y.shape == s.shape == x.shape
    torch.autograd.backward([y, s], [dy, ds])
    ry, rs, rdx, rdr, rdw = _reference(x, r, w, dy, ds, eps, offset, mode)
    _check(
        {"y": y, "s": s, "dx": x.grad, "dr": r.grad, "dw": w.grad},
        {"y": ry, "s": rs, "dx": rdx, "dr": rdr, "dw": rdw},
        TOL[dtype],
    )
    assert torch.equal(x.grad, r.grad), "x and residual must get the same gradient"
    assert w.grad.dtype == w.dtype


# --------------------------------------------------------------------------- fallback (CPU path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 96), (17, 4097)])
def test_fallback_matches_float64(shape, dtype, mode, offset):
    _run_and_compare(*_inputs(shape, dtype), dtype, mode, offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
def test_fallback_is_unfused_composition(dtype, mode, offset):
    """Bit for bit: outputs and all three gradients of ``s = x + r; rms_norm(s)``."""
    x, r, w, dy, ds = _inputs((5, 3, 72), dtype)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, s = F.fused_add_rms_norm(*leaves, 1e-6, offset=offset, casting_mode=mode)
    torch.autograd.backward([y, s], [dy, ds])
    uleaves = [t.clone().requires_grad_() for t in (x, r, w)]
    us = uleaves[0] + uleaves[1]
    uy = F.rms_norm(us, uleaves[2], 1e-6, offset=offset, casting_mode=mode)
    torch.autograd.backward([uy, us], [dy, ds])
    assert torch.equal(s, us) and torch.equal(y, uy)
    for a, b in zip(leaves, uleaves):
        assert torch.equal(a.grad, b.grad)


def test_fallback_is_hf_decoder_step():
    """Hugging Face's decoder pattern written out (``residual = residual + hidden``, then
    LlamaRMSNorm of it), bit for bit in bf16; the sum is the fp32 sum rounded once."""
    x, r, w, _, _ = _inputs((4, 64), torch.bfloat16)
    residual = r + x
    h = residual.float()
    hf = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    y, s = F.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, residual) and torch.equal(y, hf)
    assert torch.equal(s, (x.float() + r.float()).to(torch.bfloat16))


def test_float64_runs_fallback():
    _run_and_compare(*_inputs((3, 10), torch.float64), torch.float64, "llama", 0.0)


def test_empty_input():
    y, s = F.fused_add_rms_norm(torch.empty(0, 8), torch.empty(0, 8), torch.ones(8))
    assert y.shape == s.shape == (0, 8)


def _one_output_gradients(x, r, w):
    """Only y, only s, and s.sum() (an expanded, stride-0 gradient) next to y: each matches float64."""
    tol = TOL[x.dtype]
    dy = torch.randn_like(x)
    for which in ("y", "s", "y+sum(s)"):
        xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
        y, s = F.fused_add_rms_norm(xg, rg, wg)
        xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
        ry, rs = fallback.fused_add_rms_norm(xd, rd, wd, 1e-6, 0.0, "llama")
        if which == "y":
            y.backward(dy)
            ry.backward(dy.double())
        elif which == "s":
            s.backward(dy)
            rs.backward(dy.double())
        else:
            ((y * dy).sum() + s.sum()).backward()
            ((ry * dy.double()).sum() + rs.sum()).backward()
        _check({"dx": xg.grad, "dr": rg.grad}, {"dx": xd.grad, "dr": rd.grad}, tol)
        if which == "s":
            assert wg.grad is None or not wg.grad.any()
        else:
            _check({"dw": wg.grad}, {"dw": wd.grad}, tol)


def test_fallback_one_output_gradients():
    _one_output_gradients(*_inputs((6, 40), torch.float32)[:3])


def test_same_tensor_as_x_and_residual_fallback():
    x, _, w, dy, ds = _inputs((3, 33), torch.float32)
    x = x.requires_grad_()
    y, s = F.fused_add_rms_norm(x, x, w)
    torch.autograd.backward([y, s], [dy, ds])
    xd = x.detach().double().requires_grad_()
    ry, rs = fallback.rms_norm(2 * xd, w.double(), 1e-6, 0.0, "llama"), 2 * xd
    torch.autograd.backward([ry, rs], [dy.double(), ds.double()])
    assert rel_err(x.grad, xd.grad) <= 1e-5


# --------------------------------------------------------------------------- bad input


def test_integer_input_names_x():
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor"):
        F.fused_add_rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4), torch.ones(4))


def test_integer_residual_names_residual():
    with pytest.raises(TypeError, match=r"residual must be a floating-point tensor"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.int32), torch.ones(4))


def test_integer_weight_names_weight():
    with pytest.raises(TypeError, match=r"weight must be a floating-point tensor"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4, dtype=torch.int32))


def test_residual_shape_mismatch():
    with pytest.raises(ValueError, match=r"residual must have the shape of x \(2, 4\), got \(1, 4\)"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(1, 4), torch.ones(4))


def test_residual_dtype_mismatch():
    with pytest.raises(TypeError, match=r"residual must have the dtype of x \(torch.bfloat16\), got torch.float32"):
        F.fused_add_rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(2, 4), torch.ones(4))


def test_weight_size_mismatch():
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(5))


def test_weight_of_two_dims_is_refused():
    with pytest.raises(ValueError, match=r"^weight must have shape \(4,\) to match the last dimension of x \(2, 4\), got \(4, 4\)"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4, 4))


def test_scalar_input():
    with pytest.raises(ValueError, match=r"x must have at least one dimension"):
        F.fused_add_rms_norm(torch.tensor(1.0), torch.tensor(1.0), torch.ones(1))


def test_bad_casting_mode_and_eps():
    with pytest.raises(ValueError, match=r"casting_mode must be one of 'llama', 'gemma'"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), casting_mode="none")
    with pytest.raises(ValueError, match=r"eps must be a non-negative number"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), eps=-1.0)


def test_devices_differ():
    with pytest.raises(ValueError, match=r"residual is on meta but x is on cpu"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4, device="meta"), torch.ones(4))
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        F.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4, device="meta"))


# --------------------------------------------------------------------------- torch.compile


def _compile_check():
    x, r, w, dy, ds = _inputs((5, 40), torch.float32)
    x, r, w = (t.requires_grad_() for t in (x, r, w))
    fn = torch.compile(F.fused_add_rms_norm, fullgraph=True, backend="aot_eager")
    y, s = fn(x, r, w, 1e-6)
    torch.autograd.backward([y, s], [dy, ds])
    ry, rs, rdx, rdr, rdw = _reference(x, r, w, dy, ds, 1e-6, 0.0, "llama")
    _check(
        {"y": y, "s": s, "dx": x.grad, "dr": r.grad, "dw": w.grad},
        {"y": ry, "s": rs, "dx": rdx, "dr": rdr, "dw": rdw},
        1e-5,
    )


def test_compile_fullgraph_cpu():
    _compile_check()


# --------------------------------------------------------------------------- Triton interpreter, every vendor's configs

# Odd sizes; rows that straddle BLOCK_M (16 and 4 in the tables); one row.
KERNEL_SHAPES = [(1, 37), (19, 200), (6, 1000)]


@pytest.mark.interpreter
def test_kernel_interpreter_frozen_weight(simulated_device, poison, partial_sums, monkeypatch):
    """A frozen weight (as in LoRA): both inputs' gradient as the reference, no weight gradient and
    no sum of its partials (in the launch or after it)."""
    from liger_portable.ops import rms_norm as ops

    x, r, w, dy, ds = _inputs((37, 130), torch.bfloat16)
    x.requires_grad_()
    r.requires_grad_()
    calls, launches = [], []
    real, launch = ops.sum_partials, ops.launch_bwd
    monkeypatch.setattr(ops, "sum_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ops, "launch_bwd", lambda g, a, c, o: launches.append(c.get("FUSE_SUM", False)) or launch(g, a, c, o))
    y, s = F.fused_add_rms_norm(x, r, w, 1e-6)
    torch.autograd.backward([y, s], [dy, ds])
    _, _, rdx, rdr, _ = _reference(x, r, w, dy, ds, 1e-6, 0.0, "llama")
    assert rel_err(x.grad, rdx) <= TOL[torch.bfloat16] and rel_err(r.grad, rdr) <= TOL[torch.bfloat16]
    assert w.grad is None and not calls and launches == [False]


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode,offset", MODES)
def test_kernel_interpreter(simulated_device, poison, partial_sums, shape, dtype, mode, offset):
    _run_and_compare(*_inputs(shape, dtype, seed=sum(shape)), dtype, mode, offset)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "dtype,mode,offset",
    [(torch.bfloat16, "llama", 0.0), (torch.float16, "gemma", 1.0), (torch.float32, "llama", 0.0)],
    ids=["bfloat16-llama", "float16-gemma", "float32-llama"],
)
def test_kernel_interpreter_looped(simulated_device, poison, dtype, mode, offset):
    """Rows longer than every table's BLOCK_N_MAX (8192 or 16384): the two-pass path, whose second
    pass recomputes the sum. (The interpreter costs about 1 s per 16384-column block and row over
    forward and backward, hence three dtype/mode pairs rather than all six.)"""
    shape = (2, 16500)
    _run_and_compare(*_inputs(shape, dtype, seed=11), dtype, mode, offset)


def _fused_vs_unfused(x, r, w, dy, ds, bitwise_s: bool):
    """The kernels against ``s = x + r; F.rms_norm(s)`` on the same device: the sum bit for bit
    where asked, y and the gradients within the tolerance (RMSNorm's table may pick another launch
    config, so another reduction order; the fused backward adds dy's and ds's contributions in fp32
    and rounds once, the unfused one rounds dx first)."""
    tol = TOL[x.dtype]
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, s = F.fused_add_rms_norm(*leaves)
    torch.autograd.backward([y, s], [dy, ds])
    uleaves = [t.clone().requires_grad_() for t in (x, r, w)]
    us = uleaves[0] + uleaves[1]
    uy = F.rms_norm(us, uleaves[2])
    torch.autograd.backward([uy, us], [dy, ds])
    assert torch.equal(s, us) if bitwise_s else rel_err(s, us) <= tol
    assert rel_err(y, uy) <= tol
    for name, a, b in zip(("dx", "dr", "dw"), leaves, uleaves):
        assert rel_err(a.grad, b.grad) <= tol, name


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_kernel_interpreter_equals_unfused(simulated_device, poison, dtype):
    # The interpreter truncates fp32 -> bf16 (GPUs round to nearest even, as PyTorch does), so
    # its bf16 sum may differ from x + r in the last bit: bit for bit in fp32 and fp16 here, and in
    # every dtype in the GPU test.
    _fused_vs_unfused(*_inputs((7, 130), dtype, seed=3), bitwise_s=dtype != torch.bfloat16)


@pytest.mark.interpreter
def test_kernel_interpreter_one_source(simulated_device, poison):
    """With one launch config, the fused forward is RMSNorm's kernel on the rounded sum bit for
    bit, and the fused backward with no sum gradient is RMSNorm's backward bit for bit."""
    from liger_portable.configs import make_resolved, resolve
    from liger_portable.ops import rms_norm as ops

    dtype = torch.float32
    for shape in ((7, 130), (2, 20000)):  # one pass, and the looped path (recomputes the sum)
        x, r, w, dy, _ = _inputs(shape, dtype, seed=6)
        key = (shape[1], shape[0])
        fwd = resolve("fused_add_rms_norm_fwd", simulated_device, key, dtype)
        bwd = resolve("fused_add_rms_norm_bwd", simulated_device, key, dtype)
        y, s, rstd = ops.fused_add_rms_norm_fwd(x, r, w, 1e-6, 0.0, False, config=fwd)
        same_fwd = make_resolved("rms_norm_fwd", fwd.config.to_dict())
        uy, urstd = ops.rms_norm_fwd(x + r, w, 1e-6, 0.0, False, config=same_fwd)
        assert torch.equal(s, x + r) and torch.equal(y, uy) and torch.equal(rstd, urstd)
        dsum, dw = ops.fused_add_rms_norm_bwd(dy, None, s, w, rstd, 0.0, False, config=bwd)
        same_bwd = make_resolved("rms_norm_bwd", bwd.config.to_dict())
        udx, udw = ops.rms_norm_bwd(dy, s, w, rstd, 0.0, False, config=same_bwd)
        assert torch.equal(dsum, udx) and torch.equal(dw, udw)


@pytest.mark.interpreter
def test_kernel_interpreter_strided_inputs(simulated_device, poison):
    """x a column slice (row stride > row), residual transposed (copied), a non-contiguous dy."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(9, 300, generator=g).requires_grad_()
    rt = torch.randn(250, 9, generator=g).requires_grad_()
    w = torch.rand(250, generator=g) + 0.5
    dy = torch.randn(250, 9, generator=g).t()
    ds = torch.randn(9, 250, generator=g)
    x, r = base[:, :250], rt.t()
    assert x.stride() == (300, 1) and r.stride() == (1, 9)
    y, s = F.fused_add_rms_norm(x, r, w)
    torch.autograd.backward([y, s], [dy, ds])
    ry, rs, rdx, rdr, _ = _reference(x, r, w, dy, ds, 1e-6, 0.0, "llama")
    _check(
        {"y": y, "s": s, "dx": base.grad[:, :250], "dr": rt.grad.t()}, {"y": ry, "s": rs, "dx": rdx, "dr": rdr}, 1e-5
    )
    assert not base.grad[:, 250:].any()


@pytest.mark.interpreter
def test_kernel_interpreter_3d_and_weight_dtype(simulated_device, poison):
    """A (batch, seq, hidden) input, and an fp32 weight with bf16 inputs (mixed precision)."""
    x, r, _, dy, ds = _inputs((2, 3, 130), torch.bfloat16)
    w = torch.rand(130) + 0.5
    _run_and_compare(x, r, w, dy, ds, torch.bfloat16, "gemma", 1.0)


@pytest.mark.interpreter
def test_kernel_interpreter_one_output_gradients(simulated_device, poison):
    _one_output_gradients(*_inputs((5, 72), torch.float32, seed=4)[:3])


@pytest.mark.interpreter
def test_kernel_interpreter_same_tensor_as_x_and_residual(simulated_device, poison):
    x, _, w, dy, ds = _inputs((3, 33), torch.float32, seed=5)
    x = x.requires_grad_()
    y, s = F.fused_add_rms_norm(x, x, w)
    torch.autograd.backward([y, s], [dy, ds])
    xd = x.detach().double().requires_grad_()
    torch.autograd.backward(
        [fallback.rms_norm(2 * xd, w.double(), 1e-6, 0.0, "llama"), 2 * xd], [dy.double(), ds.double()]
    )
    assert rel_err(x.grad, xd.grad) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_compile_fullgraph(simulated_device, poison, partial_sums):
    """The kernel path is a custom op: torch.compile(fullgraph=True) traces it without a break, the
    weight gradient summed in the backward launch or by the sum launch after it."""
    _compile_check()


# --------------------------------------------------------------------------- real GPU


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 37), (333, 1000), (2048, 4096), (257, 5120), (64, 8192), (7, 20000), (3, 70001)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode,offset", MODES)
def test_kernel_gpu(poison, shape, dtype, mode, offset):
    _run_and_compare(*_inputs(shape, dtype, device=_gpu(), seed=sum(shape)), dtype, mode, offset)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(1000, 4096), (5, 20000)])
def test_kernel_gpu_equals_unfused(poison, dtype, shape):
    _fused_vs_unfused(*_inputs(shape, dtype, device=_gpu(), seed=7), bitwise_s=True)


@pytest.mark.gpu
def test_kernel_gpu_strided_and_one_output(poison):
    dev = _gpu()
    base = torch.randn(513, 4096 + 64, device=dev, dtype=torch.bfloat16).requires_grad_()
    x = base[:, :4096]
    _, r, w, _, ds = _inputs((513, 4096), torch.bfloat16, device=dev)
    dy = torch.randn(4096, 513, device=dev, dtype=torch.bfloat16).t()
    r = r.requires_grad_()
    y, s = F.fused_add_rms_norm(x, r, w)
    torch.autograd.backward([y, s], [dy, ds])
    ry, rs, rdx, rdr, _ = _reference(x, r, w, dy, ds, 1e-6, 0.0, "llama")
    _check({"y": y, "s": s, "dx": base.grad[:, :4096], "dr": r.grad}, {"y": ry, "s": rs, "dx": rdx, "dr": rdr}, 1e-2)
    _one_output_gradients(*_inputs((300, 2048), torch.bfloat16, device=dev, seed=8)[:3])


@pytest.mark.gpu
@pytest.mark.big_memory
def test_kernel_gpu_beyond_int32_offsets():
    """More than 2**31 elements: the last rows of y, s and the gradient must be right (int64 offsets)."""
    dev = _gpu()
    n_cols = 4096
    n_rows = 2**31 // n_cols + 5
    x = torch.randn(n_rows, n_cols, device=dev, dtype=torch.bfloat16).requires_grad_()
    r = torch.randn(n_rows, n_cols, device=dev, dtype=torch.bfloat16)
    w = (torch.rand(n_cols, device=dev) + 0.5).to(torch.bfloat16)
    y, s = F.fused_add_rms_norm(x, r, w)
    tail = slice(n_rows - 7, n_rows)
    dy = torch.randn_like(y)
    ds = torch.randn_like(s)
    ry, rs, rdx, _, _ = _reference(x[tail], r[tail], w, dy[tail], ds[tail], 1e-6, 0.0, "llama")
    assert rel_err(y[tail], ry) <= 1e-2 and rel_err(s[tail], rs) <= 1e-2
    torch.autograd.backward([y, s], [dy, ds])
    assert rel_err(x.grad[tail], rdx) <= 1e-2


@pytest.mark.gpu
def test_compile_fullgraph_gpu(partial_sums):
    dev = _gpu()
    x, r, w, dy, ds = _inputs((64, 512), torch.bfloat16, device=dev)
    x, r, w = (t.requires_grad_() for t in (x, r, w))
    fn = torch.compile(F.fused_add_rms_norm, fullgraph=True)
    y, s = fn(x, r, w, 1e-6)
    torch.autograd.backward([y, s], [dy, ds])
    ry, rs, rdx, rdr, rdw = _reference(x, r, w, dy, ds, 1e-6, 0.0, "llama")
    _check(
        {"y": y, "s": s, "dx": x.grad, "dr": r.grad, "dw": w.grad},
        {"y": ry, "s": rs, "dx": rdx, "dr": rdr, "dw": rdw},
        1e-2,
    )


@pytest.mark.interpreter
@pytest.mark.parametrize("n_cols", [300, 4096])
@pytest.mark.parametrize("mode,offset", MODES)
def test_kernel_interpreter_persistent_loop(poison, n_cols, mode, offset):
    """150 rows on a 3-compute-unit device: each backward program walks several row blocks with the
    next block's s, dy and ds loads in flight while it reduces the current one."""
    import dataclasses

    from liger_portable import simulate

    from conftest import SIMULATED_DEVICES

    with simulate(dataclasses.replace(SIMULATED_DEVICES["cuda-sm90"], compute_units=3)):
        _run_and_compare(*_inputs((150, n_cols), torch.float32, seed=n_cols), torch.float32, mode, offset)


@pytest.mark.interpreter
@pytest.mark.parametrize("single_pass", [True, False], ids=["registers", "looped"])
def test_kernel_interpreter_one_source_fp16_and_strided_ds(poison, single_pass):
    """fp16, explicit configs (BLOCK_N_MAX 512 holds the 300 columns in registers, 128 loops over
    them, the second pass recomputing the sum from x and r). The forward normalises the sum rounded
    to fp16, as the unfused code does: y and rstd are RMSNorm's kernel on the fused kernel's own s,
    bit for bit (normalising the unrounded fp32 sum is one rounding off, under fp16's 1e-2; fp32
    cannot tell the two apart, and bf16 cannot be bitwise here: the interpreter truncates to bf16).
    The backward reads ds, a column slice of a wider buffer (its row stride is not dx's), as it
    reads ds.contiguous(), bit for bit, and matches float64."""
    from liger_portable import simulate
    from liger_portable.configs import make_resolved
    from liger_portable.ops import rms_norm as ops

    from conftest import SIMULATED_DEVICES

    x, r, w, dy, _ = _inputs((7, 300), torch.float16, seed=9)
    ds = torch.randn(7, 364, generator=torch.Generator().manual_seed(10)).half()[:, :300]
    assert ds.stride() == (364, 1)
    block = 512 if single_pass else 128
    cfg = {"num_warps": 2, "BLOCK_M": 4, "BLOCK_N_MAX": block}
    fwd, same_fwd = (make_resolved(k, cfg) for k in ("fused_add_rms_norm_fwd", "rms_norm_fwd"))
    bwd = make_resolved("fused_add_rms_norm_bwd", {**cfg, "BLOCK_M": 2, "PROGRAMS_PER_CU": 1})
    with simulate(SIMULATED_DEVICES["cuda-sm80"]):
        y, s, rstd = ops.fused_add_rms_norm_fwd(x, r, w, 1e-6, 0.0, False, config=fwd)
        uy, urstd = ops.rms_norm_fwd(s, w, 1e-6, 0.0, False, config=same_fwd)
        dsum, dw = ops.fused_add_rms_norm_bwd(dy, ds, s, w, rstd, 0.0, False, config=bwd)
        dsum_c, dw_c = ops.fused_add_rms_norm_bwd(dy, ds.contiguous(), s, w, rstd, 0.0, False, config=bwd)
    assert torch.equal(s, x + r)
    assert torch.equal(rstd, urstd) and torch.equal(y, uy), (y != uy).float().mean().item()
    assert torch.equal(dsum, dsum_c) and torch.equal(dw, dw_c)
    _, _, rdx, _, rdw = _reference(x, r, w, dy, ds, 1e-6, 0.0, "llama")
    assert rel_err(dsum, rdx) <= TOL[torch.float16] and rel_err(dw, rdw) <= TOL[torch.float16]


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("n", [48, 20000], ids=["registers", "looped"])
def test_kernel_interpreter_beyond_int32_offsets(simulated_device, poison, n):
    """Rows of x, the residual and both upstream gradients that start beyond 2**31 elements (see
    beyond_int32_rows): y, s and every gradient right in every row (int64 row offsets)."""
    rows = 9
    x = beyond_int32_rows(rows, n, scale=2.0, shift=0.3).requires_grad_()
    r = beyond_int32_rows(rows, n, seed=1, scale=3.0, shift=-0.2).requires_grad_()
    dy, ds = beyond_int32_rows(rows, n, seed=2), beyond_int32_rows(rows, n, seed=3)
    w = (torch.rand(n) + 0.5).to(torch.bfloat16).requires_grad_()
    y, s = F.fused_add_rms_norm(x, r, w)
    torch.autograd.backward([y, s], [dy, ds])
    ry, rs, rdx, rdr, rdw = _reference(x, r, w, dy, ds, 1e-6, 0.0, "llama")
    _check({"y": y, "s": s, "dx": x.grad, "dr": r.grad, "dw": w.grad, "y tail": y[-2:], "dx tail": x.grad[-2:]},
           {"y": ry, "s": rs, "dx": rdx, "dr": rdr, "dw": rdw, "y tail": ry[-2:], "dx tail": rdx[-2:]}, 1e-2)
