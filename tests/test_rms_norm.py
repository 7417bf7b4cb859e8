"""RMSNorm: fallback, Triton kernels (interpreter with each vendor's configs; real GPU), API edges.

Every check compares against the fallback run in float64 on fresh random inputs (never zeros),
forward and both gradients, with the dtype's tolerance (fp32 1e-5, bf16/fp16 1e-2).
"""

from __future__ import annotations

import pytest
import torch

import liger_portable
from liger_portable import fallback
from liger_portable import functional as F
from liger_portable import nn as lnn

from conftest import TOL, beyond_int32_rows, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = [("llama", 0.0), ("gemma", 1.0)]


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x.to(device), w.to(device), dy.to(device)


def _reference(x, w, dy, eps, offset, mode):
    xd = x.detach().double().cpu().requires_grad_()
    wd = w.detach().double().cpu().requires_grad_()
    y = fallback.rms_norm(xd, wd, eps, offset, mode)
    y.backward(dy.double().cpu())
    return y, xd.grad, wd.grad


def _run_and_compare(x, w, dy, dtype, mode, offset, eps=1e-6):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = F.rms_norm(x, w, eps, offset=offset, casting_mode=mode)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    ry, rdx, rdw = _reference(x, w, dy, eps, offset, mode)
    tol = TOL[dtype]
    assert rel_err(y, ry) <= tol, ("y", rel_err(y, ry))
    assert rel_err(x.grad, rdx) <= tol, ("dx", rel_err(x.grad, rdx))
    assert rel_err(w.grad, rdw) <= tol, ("dw", rel_err(w.grad, rdw))
    assert w.grad.dtype == w.dtype


# --------------------------------------------------------------------------- fallback (CPU path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 96), (17, 4097)])
def test_fallback_matches_float64(shape, dtype, mode, offset):
    x, w, dy = _inputs(shape, dtype)
    _run_and_compare(x, w, dy, dtype, mode, offset)


def test_fallback_is_llama_rmsnorm():
    """The llama mode is Hugging Face's LlamaRMSNorm, bit for bit (written out here)."""
    x, w, _ = _inputs((4, 64), torch.bfloat16)
    h = x.float()
    hf = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(F.rms_norm(x, w, 1e-6), hf)


def test_fallback_is_gemma_rmsnorm():
    """The gemma mode with offset 1 is Hugging Face's GemmaRMSNorm, bit for bit."""
    x, w, _ = _inputs((4, 64), torch.bfloat16)
    h = x.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + w.float())
    assert torch.equal(F.rms_norm(x, w, 1e-6, offset=1.0, casting_mode="gemma"), out.to(torch.bfloat16))


def test_float64_runs_fallback():
    x, w, dy = _inputs((3, 10), torch.float64)
    _run_and_compare(x, w, dy, torch.float64, "llama", 0.0)


def test_nan_in_nan_out_only_in_that_row():
    x, w, _ = _inputs((3, 16), torch.float32)
    x[1, 4] = float("nan")
    y = F.rms_norm(x, w)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


def test_empty_input():
    x = torch.empty(0, 8)
    y = F.rms_norm(x, torch.ones(8))
    assert y.shape == (0, 8)


# --------------------------------------------------------------------------- bad input


def test_integer_input_names_x():
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor"):
        F.rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(4))


def test_integer_weight_names_weight():
    with pytest.raises(TypeError, match=r"weight must be a floating-point tensor"):
        F.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.int32))


def test_weight_size_mismatch():
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        F.rms_norm(torch.ones(2, 4), torch.ones(5))


def test_weight_of_two_dims_is_refused():
    """A (4, 4) weight has the right first dimension but is not (hidden,)."""
    with pytest.raises(ValueError, match=r"^weight must have shape \(4,\) to match the last dimension of x \(2, 4\), got \(4, 4\)"):
        F.rms_norm(torch.ones(2, 4), torch.ones(4, 4))


def test_module_rejects_bad_init():
    with pytest.raises(ValueError, match=r"^init must be 'ones' or 'zeros', got 'one'"):
        lnn.RMSNorm(4, init="one")


def test_scalar_input():
    with pytest.raises(ValueError, match=r"x must have at least one dimension"):
        F.rms_norm(torch.tensor(1.0), torch.ones(1))


def test_bad_casting_mode():
    with pytest.raises(ValueError, match=r"casting_mode must be one of 'llama', 'gemma'"):
        F.rms_norm(torch.ones(2, 4), torch.ones(4), casting_mode="none")


def test_negative_eps():
    with pytest.raises(ValueError, match=r"eps must be a non-negative number"):
        F.rms_norm(torch.ones(2, 4), torch.ones(4), eps=-1.0)


def test_devices_differ():
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        F.rms_norm(torch.ones(2, 4), torch.ones(4, device="meta"))


# --------------------------------------------------------------------------- module


def test_module_is_llama_rmsnorm_drop_in():
    m = lnn.RMSNorm(48, eps=1e-5)
    assert m.variance_epsilon == 1e-5
    assert list(m.state_dict()) == ["weight"] and torch.equal(m.weight, torch.ones(48))
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
    x, _, _ = _inputs((2, 3, 48), torch.float32)
    ref = fallback.rms_norm(x.double(), m.weight.double(), 1e-5, 0.0, "llama")
    assert rel_err(m(x), ref) <= 1e-5


def test_module_gemma_init_zeros():
    m = lnn.RMSNorm(8, offset=1.0, casting_mode="gemma", init="zeros")
    x, _, _ = _inputs((2, 8), torch.float32)
    ref = fallback.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6, 0.0, "gemma")
    assert rel_err(m(x), ref) <= 1e-5


# --------------------------------------------------------------------------- torch.compile (CPU path)


def test_compile_fullgraph_cpu():
    x, w, dy = _inputs((5, 40), torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    fn = torch.compile(F.rms_norm, fullgraph=True, backend="aot_eager")
    y = fn(x, w, 1e-6)
    y.backward(dy)
    ry, rdx, rdw = _reference(x, w, dy, 1e-6, 0.0, "llama")
    assert rel_err(y, ry) <= 1e-5 and rel_err(x.grad, rdx) <= 1e-5 and rel_err(w.grad, rdw) <= 1e-5


# --------------------------------------------------------------------------- Triton interpreter, every vendor's configs

# Odd sizes; rows that straddle BLOCK_M; one row; rows longer than every table's BLOCK_N_MAX
# (looped path) and longer than 65536.
KERNEL_SHAPES = [(1, 37), (19, 200), (6, 1000), (3, 4096), (2, 20000), (1, 70001)]


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode,offset", MODES)
def test_kernel_interpreter(simulated_device, poison, partial_sums, shape, dtype, mode, offset):
    x, w, dy = _inputs(shape, dtype, seed=hash(shape) % 1000)
    _run_and_compare(x, w, dy, dtype, mode, offset)


@pytest.mark.interpreter
def test_kernel_interpreter_strided_input(simulated_device, poison):
    """Row stride larger than the row (a column slice) and a transposed (non-unit stride) input."""
    base, w, _ = _inputs((9, 300), torch.float32)
    x = base[:, :250]
    assert x.stride() == (300, 1)
    dy = torch.randn(9, 250)
    _run_and_compare(x, w[:250].contiguous(), dy, torch.float32, "llama", 0.0)
    xt = torch.randn(64, 7).t()  # stride (1, 7)
    _run_and_compare(xt, w[:64].contiguous(), torch.randn(7, 64), torch.float32, "gemma", 1.0)


@pytest.mark.interpreter
def test_kernel_interpreter_3d_and_weight_dtype(simulated_device, poison):
    """A (batch, seq, hidden) input, and an fp32 weight with a bf16 input (mixed precision)."""
    x, _, dy = _inputs((2, 3, 130), torch.bfloat16)
    w = torch.rand(130) + 0.5
    _run_and_compare(x, w, dy, torch.bfloat16, "llama", 0.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_interpreter_frozen_weight(simulated_device, poison, partial_sums, monkeypatch, dtype):
    """A weight that needs no gradient (frozen, as in LoRA): dx as the reference, no weight
    gradient and no sum of its partials (in the launch or after it); a trainable weight gets its
    gradient in its own dtype, summed where the plan says."""
    from liger_portable.ops import rms_norm as ops

    x, w, dy = _inputs((37, 130), dtype)
    x.requires_grad_()
    calls, launches = [], []
    real, launch = ops.sum_partials, ops.launch_bwd
    monkeypatch.setattr(ops, "sum_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ops, "launch_bwd", lambda g, a, c, o: launches.append(c.get("FUSE_SUM", False)) or launch(g, a, c, o))
    y = F.rms_norm(x, w, 1e-6)
    y.backward(dy)
    _, rdx, _ = _reference(x, w, dy, 1e-6, 0.0, "llama")
    assert rel_err(x.grad, rdx) <= TOL[dtype]
    assert w.grad is None and not calls and launches == [False]
    w.requires_grad_()
    F.rms_norm(x, w, 1e-6).backward(dy)
    _, _, rdw = _reference(x, w, dy, 1e-6, 0.0, "llama")
    in_launch = partial_sums == "summed in the launch"
    assert launches == [False, in_launch] and len(calls) == (not in_launch)
    assert w.grad.dtype == dtype and rel_err(w.grad, rdw) <= TOL[dtype]


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(19, 200), (2, 20000)], ids=["registers", "looped"])
def test_kernel_interpreter_sum_in_launch_resets_its_count(simulated_device, poison, shape):
    """The backward that sums its partials in the launch leaves the arrival count in the forward's
    statistics at zero, so a second backward over the same graph (and the tuner's repeated launches)
    gives the same weight gradient, to the bit."""
    x, w, dy = _inputs(shape, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    y = F.rms_norm(x, w, 1e-6)
    grads = []
    for _ in range(3):
        x.grad = w.grad = None
        y.backward(dy, retain_graph=True)
        grads.append(w.grad)
    _, _, rdw = _reference(x, w, dy, 1e-6, 0.0, "llama")
    assert rel_err(grads[0], rdw) <= TOL[torch.float32]
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


@pytest.mark.interpreter
def test_kernel_interpreter_compile_fullgraph(simulated_device, poison, partial_sums):
    """The kernel path is a custom op: torch.compile(fullgraph=True) traces it without a break, the
    weight gradient summed in the backward launch or by the sum launch after it."""
    x, w, dy = _inputs((4, 96), torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    fn = torch.compile(F.rms_norm, fullgraph=True, backend="aot_eager")
    y = fn(x, w, 1e-6)
    y.backward(dy)
    ry, rdx, rdw = _reference(x, w, dy, 1e-6, 0.0, "llama")
    assert rel_err(y, ry) <= 1e-5 and rel_err(x.grad, rdx) <= 1e-5 and rel_err(w.grad, rdw) <= 1e-5


# --------------------------------------------------------------------------- real GPU


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 37), (333, 1000), (2048, 4096), (257, 5120), (64, 8192), (7, 20000), (3, 70001), (4, 131072)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode,offset", MODES)
def test_kernel_gpu(poison, shape, dtype, mode, offset):
    x, w, dy = _inputs(shape, dtype, device=_gpu(), seed=sum(shape))
    _run_and_compare(x, w, dy, dtype, mode, offset)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(200, 1024), (2048, 4096), (7, 20000)], ids=lambda s: "x".join(map(str, s)))
def test_kernel_gpu_partial_sums_repeated(poison, partial_sums, shape):
    """Every program of a wide grid counts in and the last sums the others' partials: twenty
    backwards over one graph give the reference's weight gradient, each equal to the first to the
    bit (a program that summed before another's partial was visible, or a count left unreset,
    would not)."""
    x, w, dy = _inputs(shape, torch.bfloat16, device=_gpu(), seed=sum(shape))
    x.requires_grad_()
    w.requires_grad_()
    y = F.rms_norm(x, w, 1e-6)
    grads = []
    for _ in range(20):
        w.grad = None
        y.backward(dy, retain_graph=True)
        grads.append(w.grad)
    _, _, rdw = _reference(x, w, dy, 1e-6, 0.0, "llama")
    assert rel_err(grads[0], rdw) <= TOL[torch.bfloat16]
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


@pytest.mark.gpu
def test_kernel_gpu_strided():
    dev = _gpu()
    base, w, _ = _inputs((513, 4096 + 64), torch.bfloat16, device=dev)
    x = base[:, :4096]
    dy = torch.randn(513, 4096, device=dev, dtype=torch.bfloat16).t().contiguous().t()  # non-unit stride grad
    _run_and_compare(x, w[:4096].contiguous(), dy, torch.bfloat16, "llama", 0.0)


@pytest.mark.gpu
@pytest.mark.big_memory
def test_kernel_gpu_beyond_int32_offsets():
    """More than 2**31 elements: the last rows must be right (int64 row offsets)."""
    dev = _gpu()
    n_cols = 4096
    n_rows = 2**31 // n_cols + 5
    x = torch.randn(n_rows, n_cols, device=dev, dtype=torch.bfloat16)
    w = (torch.rand(n_cols, device=dev) + 0.5).to(torch.bfloat16)
    y = F.rms_norm(x, w)
    tail = slice(n_rows - 7, n_rows)
    ref = fallback.rms_norm(x[tail].double(), w.double(), 1e-6, 0.0, "llama")
    assert rel_err(y[tail], ref) <= 1e-2
    del y
    x.requires_grad_()
    dy = torch.randn_like(x)
    F.rms_norm(x, w).backward(dy)
    xd = x[tail].detach().double().requires_grad_()
    fallback.rms_norm(xd, w.double(), 1e-6, 0.0, "llama").backward(dy[tail].double())
    assert rel_err(x.grad[tail], xd.grad) <= 1e-2


@pytest.mark.gpu
def test_compile_fullgraph_gpu(partial_sums):
    dev = _gpu()
    x, w, dy = _inputs((64, 512), torch.bfloat16, device=dev)
    x.requires_grad_()
    w.requires_grad_()
    fn = torch.compile(F.rms_norm, fullgraph=True)
    y = fn(x, w, 1e-6)
    y.backward(dy)
    ry, rdx, rdw = _reference(x, w, dy, 1e-6, 0.0, "llama")
    assert rel_err(y, ry) <= 1e-2 and rel_err(x.grad, rdx) <= 1e-2 and rel_err(w.grad, rdw) <= 1e-2


@pytest.mark.interpreter
@pytest.mark.parametrize("n_cols", [300, 4096])
def test_kernel_interpreter_nan_row_stays_in_its_row(poison, n_cols):
    """A NaN in row 101 of x: y and dx of that row are NaN, every other row finite and right, on a
    3-compute-unit device where each backward program walks several row blocks, loading the next
    (row 101 is some program's next while it reduces an earlier one) before reducing the current."""
    import dataclasses

    from liger_portable import simulate

    from conftest import SIMULATED_DEVICES

    x, w, dy = _inputs((150, n_cols), torch.float32, seed=n_cols)
    x[101, 7] = float("nan")
    xl = x.clone().requires_grad_()
    with simulate(dataclasses.replace(SIMULATED_DEVICES["cuda-sm90"], compute_units=3)):
        y = F.rms_norm(xl, w, 1e-6)
        y.backward(dy)
    ok = [r for r in range(150) if r != 101]
    assert torch.isnan(y[101]).all() and torch.isnan(xl.grad[101]).all()
    ry, rdx, _ = _reference(x[ok], w, dy[ok], 1e-6, 0.0, "llama")
    assert rel_err(y[ok], ry) <= 1e-5 and rel_err(xl.grad[ok], rdx) <= 1e-5


def test_module_checks_its_options_at_construction():
    """nn.RMSNorm refuses a bad casting_mode, eps or offset when built, not at its first forward."""
    with pytest.raises(ValueError, match=r"^casting_mode must be one of"):
        lnn.RMSNorm(8, casting_mode="bogus")
    with pytest.raises(ValueError, match=r"^eps must be a non-negative number"):
        lnn.RMSNorm(8, eps=-1)
    with pytest.raises(ValueError, match=r"^offset must be a number"):
        lnn.RMSNorm(8, offset=float("nan"))
    m = lnn.RMSNorm(8, eps=1e-5, offset=1.0, casting_mode="gemma", init="zeros")
    assert m.variance_epsilon == 1e-5 and m.offset == 1.0


@pytest.mark.interpreter
@pytest.mark.parametrize("single_pass", [True, False], ids=["registers", "looped"])
@pytest.mark.parametrize("mode,offset", MODES)
def test_kernel_interpreter_cast_order_and_row_blocks(poison, partial_sums, single_pass, mode, offset):
    """fp16 rows of a small magnitude (mean square ~4e-6, eps 1e-6 about a quarter of it) with an
    fp32 weight, explicit configs (BLOCK_N_MAX 512 holds the 300 columns in registers, 128 loops
    over them) on a 1-compute-unit device, so one backward program walks all four row blocks (its
    partial summed in the launch or after it).

    - rstd: the float64 ``rsqrt(mean(x^2) + eps)`` (eps counted once) within 1e-5.
    - y: given the kernel's own rstd, bit for bit the casting mode's rounding order written out in
      PyTorch: llama rounds ``x * rstd`` to fp16 before the weight product (HF's LlamaRMSNorm),
      gemma multiplies in fp32; both round the product to fp16. A swapped order is one rounding,
      under the 1e-2 of the half-precision comparisons; the interpreter rounds fp32 to fp16 as
      PyTorch does (not to bf16: it truncates), so the check is in fp16.
    - dw (fp32, summed over every row block of the program): the float64 sum of ``dy * xhat``
      with xhat rounded to fp16 in llama mode only, within 1e-5 (the rounding moves it ~1e-4).
    - dx: the float64 fallback, at fp16's 1e-2."""
    import dataclasses

    from liger_portable import simulate
    from liger_portable.configs import make_resolved
    from liger_portable.ops import rms_norm as ops

    from conftest import SIMULATED_DEVICES

    eps, gemma = 1e-6, mode == "gemma"
    x, _, dy = _inputs((7, 300), torch.float32, seed=13)
    x = (x * 1e-3).half()
    dy = dy.half()
    w = torch.rand(300, generator=torch.Generator().manual_seed(14)) + 0.5
    block = 512 if single_pass else 128
    fwd = make_resolved("rms_norm_fwd", {"num_warps": 2, "BLOCK_M": 4, "BLOCK_N_MAX": block})
    bwd = make_resolved("rms_norm_bwd", {"num_warps": 2, "BLOCK_M": 2, "BLOCK_N_MAX": block, "PROGRAMS_PER_CU": 1})
    with simulate(dataclasses.replace(SIMULATED_DEVICES["rocm-rdna"], compute_units=1)):
        y, rstd = ops.rms_norm_fwd(x, w, eps, offset, gemma, config=fwd)
        dx, dw = ops.rms_norm_bwd(dy, x, w, rstd, offset, gemma, config=bwd)
    xd = x.double()
    assert rel_err(rstd[:-1], torch.rsqrt(xd.pow(2).mean(-1) + eps)) <= 1e-5
    xhat = x.float() * rstd[:-1, None]
    if not gemma:
        xhat = xhat.half().float()
    expect = (xhat * (w + offset)).half()
    assert y.dtype == torch.float16 and torch.equal(y, expect), (y != expect).float().mean().item()
    assert dw.dtype == torch.float32 and rel_err(dw, (dy.double() * xhat.double()).sum(0)) <= 1e-5
    _, rdx, _ = _reference(x, w, dy, eps, offset, mode)
    assert rel_err(dx, rdx) <= TOL[torch.float16]


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("n", [48, 20000], ids=["registers", "looped"])
def test_kernel_interpreter_beyond_int32_offsets(simulated_device, poison, n):
    """Rows of x and dy that start beyond 2**31 elements (a large row stride; see beyond_int32_rows):
    every row of y, dx and dw right, so the kernels' row offsets are int64 (a CPU check of what
    test_kernel_gpu_beyond_int32_offsets checks on a GPU with 4 GiB)."""
    rows = 9
    x = beyond_int32_rows(rows, n, scale=2.0, shift=0.3).requires_grad_()
    dy = beyond_int32_rows(rows, n, seed=1)
    w = (torch.rand(n) + 0.5).to(torch.bfloat16).requires_grad_()
    y = F.rms_norm(x, w)
    y.backward(dy)
    ry, rdx, rdw = _reference(x, w, dy, 1e-6, 0.0, "llama")
    for name, out, ref in (("y", y, ry), ("dx", x.grad, rdx), ("dw", w.grad, rdw)):
        assert rel_err(out, ref) <= 1e-2, (name, rel_err(out, ref))
    assert rel_err(y[-2:], ry[-2:]) <= 1e-2 and rel_err(x.grad[-2:], rdx[-2:]) <= 1e-2


def _eps_case_rms(n):
    """x with a mean square of eps's size (1e-6), and the float64 formula written out (not the fallback)."""
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(5, n, generator=g) * 1e-3, torch.randn(5, n, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    y.backward(dy.double())
    return (x, w, dy), (y.detach(), xd.grad, wd.grad)


def _check_eps_case(n):
    (x, w, dy), ref = _eps_case_rms(n)
    x, w = x.requires_grad_(), w.requires_grad_()
    y = F.rms_norm(x, w, 1e-6)
    y.backward(dy)
    for name, out, r in zip(("y", "dx", "dw"), (y, x.grad, w.grad), ref):
        assert rel_err(out, r) <= 1e-5, (name, rel_err(out, r))


def test_fallback_eps_where_it_matters():
    """Where eps is the size of the mean square, y and the gradients follow x / sqrt(mean(x^2) + eps)
    (eps outside the root, or dropped, is far off; the default inputs hide it)."""
    _check_eps_case(300)


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("n", [300, 20000], ids=["registers", "looped"])
def test_kernel_interpreter_eps_where_it_matters(simulated_device, poison, n):
    _check_eps_case(n)
