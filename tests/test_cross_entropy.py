"""Cross-entropy: fallback (chunked), Triton kernel (interpreter with each vendor's configs; real
GPU), every option alone and combined, API edges.

References are independent of our code: ``torch.nn.functional.cross_entropy`` in float64 for the
plain options and label smoothing, explicit float64 formulas for the z-loss and the softcap.
Loss and gradient are checked with the dtype's tolerance (fp32 1e-5, bf16/fp16 1e-2).
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import liger_portable
from liger_portable import functional as F
from liger_portable import nn as lnn

from conftest import TOL, beyond_int32_rows, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
_ids = {"dtype": lambda d: str(d).removeprefix("torch.")}

# (label_smoothing, lse_square_scale, softcap): each alone, and combined.
OPTIONS = {
    "plain": (0.0, 0.0, None),
    "smooth": (0.1, 0.0, None),
    "zloss": (0.0, 1e-3, None),
    "softcap": (0.0, 0.0, 5.0),
    "all": (0.2, 1e-3, 5.0),
}


def _inputs(n_rows, V, dtype, device="cpu", seed=0, scale=3.0, ignore_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n_rows, V, generator=g) * scale).to(dtype)
    t = torch.randint(0, V, (n_rows,), generator=g)
    t[torch.rand(n_rows, generator=g) < ignore_frac] = -100
    return x.to(device), t.to(device)


def reference(x, t, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
              softcap=None, grad_out=None, device="cpu"):
    """(loss, z_loss, dlogits) in float64 on ``device``; ``grad_out`` defaults to 1 (or ones for ``none``)."""
    xd = x.detach().double().to(device).requires_grad_()
    td = t.to(device).long()
    z = softcap * torch.tanh(xd / softcap) if softcap else xd
    keep = td != ignore_index
    rows = torch.nn.functional.cross_entropy(
        z, td, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    # torch's label smoothing puts eps/V on the ignored rows too; they must contribute nothing.
    rows = torch.where(keep, rows, 0.0)
    lse = torch.logsumexp(z, -1)
    zrows = torch.where(keep, lse_square_scale * lse * lse, 0.0)
    rows = rows + zrows
    n = keep.sum().clamp_min(1)
    if reduction == "mean":
        loss, zl = rows.sum() / n, zrows.sum() / n
    elif reduction == "sum":
        loss, zl = rows.sum(), zrows.sum()
    else:
        loss, zl = rows, zrows
    go = torch.ones_like(loss) if grad_out is None else grad_out.double().to(device)
    (loss * go).sum().backward()
    return loss.detach(), zl.detach(), xd.grad


def _run_and_compare(x, t, dtype, reduction="mean", opts=OPTIONS["plain"], inplace=False, grad_out=None, tol=None):
    ls, zs, sc = opts
    ref_loss, ref_z, ref_dx = reference(x, t, reduction=reduction, label_smoothing=ls, lse_square_scale=zs,
                                        softcap=sc, grad_out=grad_out)
    x0 = x.clone()
    leaf = x.clone().requires_grad_()
    inp = leaf * 1 if inplace else leaf  # in place: the logits are an intermediate the caller owns
    loss, z = F.cross_entropy(inp, t, reduction=reduction, label_smoothing=ls, lse_square_scale=zs, softcap=sc,
                              return_z_loss=True, inplace_backward=inplace)
    assert loss.dtype == dtype and loss.shape == ref_loss.shape
    go = torch.ones_like(loss) if grad_out is None else grad_out.to(loss.dtype).to(loss.device)
    (loss * go).sum().backward()
    tol = tol or TOL[dtype]
    for name, out, ref in (("loss", loss, ref_loss), ("dlogits", leaf.grad, ref_dx)):
        if ref.abs().max() == 0:
            assert torch.equal(out.detach().cpu().double(), ref), name
        else:
            assert rel_err(out, ref) <= tol, (name, rel_err(out, ref))
    if zs:
        assert rel_err(z, ref_z) <= tol if ref_z.abs().max() > 0 else torch.all(z == 0)
    assert torch.equal(leaf.detach(), x0)  # the caller's logits are untouched
    return leaf


# --------------------------------------------------------------------------- fallback (CPU path)


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
def test_fallback(dtype, reduction, opts):
    x, t = _inputs(13, 1000, dtype)
    go = torch.randn(13) if reduction == "none" else torch.tensor(1.7)
    _run_and_compare(x, t, dtype, reduction, OPTIONS[opts], grad_out=go)


def test_fallback_is_chunked(monkeypatch):
    """The CPU path runs several row chunks (a tiny chunk here) and gives the same result."""
    fb = importlib.import_module("liger_portable.fallback.cross_entropy")  # the package's name is the function

    calls = []
    real = fb.ce_rows_torch
    monkeypatch.setattr(fb, "ce_rows_torch", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(fb, "CHUNK_BYTES", 8 * 4 * 300)
    x, t = _inputs(29, 300, torch.float32)
    _run_and_compare(x, t, torch.float32, "mean", OPTIONS["all"])
    assert calls == [8, 8, 8, 5]
    assert fb.chunk_rows(300, 4, 7 * 4 * 300) == 7 and fb.chunk_rows(10**6, 4, 1) == 1


def test_fallback_float64_and_nd():
    x, t = _inputs(12, 50, torch.float64)
    loss = F.cross_entropy(x.view(3, 4, 50), t.view(3, 4), reduction="none")
    assert loss.shape == (3, 4) and loss.dtype == torch.float64
    assert rel_err(loss.view(-1), reference(x, t, reduction="none")[0]) <= 1e-12


def test_all_ignored_gives_zero_not_nan():
    """torch gives NaN for a mean over zero tokens; we give 0.0 and zero gradients."""
    x, t = _inputs(5, 64, torch.float32)
    t[:] = -100
    assert torch.isnan(torch.nn.functional.cross_entropy(x, t))
    for red in REDUCTIONS:
        leaf = x.clone().requires_grad_()
        loss = F.cross_entropy(leaf, t, reduction=red, label_smoothing=0.1, lse_square_scale=1e-3)
        loss.sum().backward()
        assert torch.all(loss == 0) and torch.all(leaf.grad == 0)


def test_large_magnitude_no_overflow():
    g = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(6, 300, generator=g) * 30
    x[1] = -1e4 + torch.randn(300, generator=g) * 30
    t = torch.randint(0, 300, (6,), generator=g)
    _run_and_compare(x, t, torch.float32, "sum", OPTIONS["zloss"])


def test_nan_logits_propagate():
    x, t = _inputs(4, 40, torch.float32, ignore_frac=0)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    loss = F.cross_entropy(x, t, reduction="none")
    assert torch.isnan(loss[1]) and torch.isnan(loss[2]) and torch.isfinite(loss[[0, 3]]).all()


# --------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument():
    x, t = _inputs(4, 10, torch.float32)
    with pytest.raises(TypeError, match=r"^target must hold class indices as torch.int64"):
        F.cross_entropy(x, t.float())
    with pytest.raises(TypeError, match=r"^logits must be a floating-point tensor"):
        F.cross_entropy(x.long(), t)
    with pytest.raises(ValueError, match=r"^target must have shape \(4,\)"):
        F.cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match=r"^target holds 10, outside the 10 classes"):
        F.cross_entropy(x, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match=r"^target holds -1"):
        F.cross_entropy(x, torch.tensor([0, -1, 3, 2]))
    with pytest.raises(ValueError, match=r"^reduction must be one of"):
        F.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match=r"^softcap must be a positive number"):
        F.cross_entropy(x, t, softcap=0.0)
    with pytest.raises(ValueError, match=r"^label_smoothing must be a number in \[0, 1\]"):
        F.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"^lse_square_scale must be a non-negative number"):
        F.cross_entropy(x, t, lse_square_scale=-1.0)
    with pytest.raises(ValueError, match=r"^target is on meta but logits is on cpu"):
        F.cross_entropy(x, t.to("meta"))
    with pytest.raises(ValueError, match=r"^reduction must be one of"):
        lnn.CrossEntropyLoss(reduction="avg")
    # int32 targets and ignore_index outside the range are fine
    F.cross_entropy(x, t.int(), ignore_index=-100)
    # ...but an ignore_index beyond int32 would compare with int32 targets after wrapping (2**32 equals 0)
    t32 = t.clamp(min=0).int()
    for fn in (lambda i: F.cross_entropy(x, t32, ignore_index=i),
               lambda i: F.fused_linear_cross_entropy(x, torch.randn(10, 10), t32, ignore_index=i)):
        with pytest.raises(ValueError, match=r"^ignore_index=4294967296 is outside the range of target's dtype torch.int32"):
            fn(2**32)
        fn(2**31 - 1)  # within range: fine
    F.cross_entropy(x, t32.long(), ignore_index=2**32)  # int64 targets: fine


def test_narrow_integer_target_and_non_bool_z_loss_are_refused():
    """Only int64 and int32 targets are class indices; return_z_loss takes True or False only."""
    x, t = _inputs(4, 10, torch.float32)
    t = t.clamp(min=0)
    for dtype in (torch.int16, torch.uint8):
        with pytest.raises(TypeError, match=r"^target must hold class indices as torch.int64 \(or torch.int32\), got torch\."):
            F.cross_entropy(x, t.to(dtype))
    for flag in (1, 0, None):
        with pytest.raises(TypeError, match=r"^return_z_loss must be True or False"):
            F.cross_entropy(x, t, return_z_loss=flag)
    with pytest.raises(TypeError, match=r"^return_z_loss must be True or False"):
        lnn.CrossEntropyLoss(return_z_loss=1)


def test_int32_ignore_index_boundary():
    """2**31 is the first ignore_index outside int32: refused with int32 targets (2**31 - 1 is fine)."""
    x, t = _inputs(4, 10, torch.float32)
    t32 = t.clamp(min=0).int()
    for fn in (lambda i: F.cross_entropy(x, t32, ignore_index=i),
               lambda i: F.fused_linear_cross_entropy(x, torch.randn(10, 10), t32, ignore_index=i)):
        with pytest.raises(ValueError, match=r"^ignore_index=2147483648 is outside the range of target's dtype torch.int32"):
            fn(2**31)
        with pytest.raises(ValueError, match=r"^ignore_index=-2147483649 is outside the range"):
            fn(-(2**31) - 1)
        fn(-(2**31))  # within range: fine


def test_zero_classes_one_row_and_inplace_flag_are_checked():
    """No classes (even with every row ignored), an out-of-range label in a one-element target,
    and a non-bool inplace_backward each name the argument."""
    with pytest.raises(ValueError, match=r"^logits must have at least one class \(its last dimension is 0\)"):
        F.cross_entropy(torch.randn(4, 0), torch.full((4,), -100))
    with pytest.raises(ValueError, match=r"^target holds 10, outside the 10 classes"):
        F.cross_entropy(torch.randn(1, 10), torch.tensor([10]))
    x, t = _inputs(4, 10, torch.float32)
    with pytest.raises(TypeError, match=r"^inplace_backward must be True or False"):
        F.cross_entropy(x, t, inplace_backward=1)


def test_module():
    x, t = _inputs(9, 77, torch.float32)
    m = lnn.CrossEntropyLoss(label_smoothing=0.1, lse_square_scale=1e-3, softcap=4.0, return_z_loss=True)
    # printed as built: a module returning (loss, z_loss), or writing over its logits, says so
    assert repr(m).endswith("softcap=4.0, return_z_loss=True)") and "inplace" not in repr(m)
    assert repr(lnn.CrossEntropyLoss(inplace_backward=True)).endswith("softcap=None, inplace_backward=True)")
    assert repr(lnn.CrossEntropyLoss()).endswith("softcap=None)")
    loss, z = m(x, t)
    ref = reference(x, t, label_smoothing=0.1, lse_square_scale=1e-3, softcap=4.0)
    assert rel_err(loss, ref[0]) <= 1e-5 and rel_err(z, ref[1]) <= 1e-5
    plain = lnn.CrossEntropyLoss(reduction="sum")(x, t)
    assert rel_err(plain, torch.nn.CrossEntropyLoss(reduction="sum")(x.double(), t)) <= 1e-5


def test_compile_fullgraph_cpu():
    x, t = _inputs(8, 100, torch.float32)
    ref_loss, _, ref_dx = reference(x, t, label_smoothing=0.1, softcap=5.0)
    leaf = x.clone().requires_grad_()
    fn = torch.compile(F.cross_entropy, fullgraph=True, backend="aot_eager")
    loss = fn(leaf, t, label_smoothing=0.1, softcap=5.0)
    loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-5 and rel_err(leaf.grad, ref_dx) <= 1e-5


# --------------------------------------------------------------------------- Triton interpreter, every vendor's configs

# Odd vocabularies straddling the tables' BLOCK_V (4096 for small V, 8192/16384 above).
KERNEL_SHAPES = [(1, 37), (9, 1000), (5, 4097)]


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
def test_kernel_interpreter(simulated_device, poison, shape, dtype):
    # One option set and reduction per (shape, dtype) across the matrix, to keep CI short.
    i = KERNEL_SHAPES.index(shape) * 3 + DTYPES.index(dtype)
    opts = list(OPTIONS.values())[i % len(OPTIONS)]
    reduction = REDUCTIONS[i % 3]
    x, t = _inputs(*shape, dtype, seed=i)
    go = torch.randn(shape[0]) if reduction == "none" else torch.tensor(0.7)
    _run_and_compare(x, t, dtype, reduction, opts, inplace=i % 2 == 1, grad_out=go)


@pytest.mark.interpreter
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kernel_interpreter_options(poison, simulated_device, opts, reduction):
    if simulated_device.arch not in ("sm90", "gfx942"):
        pytest.skip("the option matrix runs on one table per warp size; the shape matrix covers every vendor")
    x, t = _inputs(6, 515, torch.float32, seed=len(opts))
    go = torch.randn(6) if reduction == "none" else None
    _run_and_compare(x, t, torch.float32, reduction, OPTIONS[opts], grad_out=go)


@pytest.mark.interpreter
def test_kernel_interpreter_inplace(simulated_device, poison):
    """In place: the logits' storage holds the gradient (no extra tensor); the default keeps them."""
    x, t = _inputs(4, 300, torch.bfloat16)
    ref = reference(x, t, label_smoothing=0.1)
    logits = x.clone().requires_grad_()
    work = logits * 1
    loss = F.cross_entropy(work, t, label_smoothing=0.1, inplace_backward=True)
    loss.backward()
    assert rel_err(logits.grad, ref[2]) <= 1e-2
    assert torch.equal(work.detach(), logits.grad)
    with pytest.raises(RuntimeError, match=r"can run backward only once"):
        loss2 = F.cross_entropy(x.clone().requires_grad_(), t)
        loss2.backward(retain_graph=True)
        loss2.backward()


def _check_no_grad_computes_no_gradient():
    """Under torch.no_grad() (an evaluation loop) no gradient is computed: in place, the caller's
    logits that require grad are left as they are (the Function saw their requires_grad alone and
    wrote the gradient over them); the loss is the same."""
    x, t = _inputs(4, 300, torch.float32)
    logits = x.clone().requires_grad_()
    with torch.no_grad():
        loss = F.cross_entropy(logits, t, label_smoothing=0.1, inplace_backward=True)
    assert torch.equal(logits.detach(), x) and not loss.requires_grad
    assert rel_err(loss, reference(x, t, label_smoothing=0.1)[0]) <= 1e-5


def test_no_grad_computes_no_gradient():
    _check_no_grad_computes_no_gradient()


@pytest.mark.interpreter
def test_kernel_interpreter_no_grad_computes_no_gradient(simulated_device, poison):
    _check_no_grad_computes_no_gradient()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_backward_once_on_the_fallback(reduction):
    """The fallback keeps the kernels' rule (they scale the gradient in place): a second backward
    fails on the CPU as on a GPU."""
    x, t = _inputs(4, 30, torch.float32)
    loss = F.cross_entropy(x.clone().requires_grad_(), t, reduction=reduction).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"cross_entropy can run backward only once"):
        loss.backward()


@pytest.mark.interpreter
def test_kernel_interpreter_inplace_on_rows_that_share_memory(simulated_device, poison):
    """In place on logits whose rows share memory (an expanded tensor the caller owns) would write
    one row's gradient over the logits the next row reads: the gradient goes to a tensor of its own."""
    x, t = _inputs(1, 300, torch.float32)
    t = torch.tensor([3, 7, 11])
    ref = reference(x.expand(3, 300), t)
    base = x.clone().requires_grad_()
    work = (base * 1).expand(3, 300)
    loss = F.cross_entropy(work, t, inplace_backward=True)
    assert rel_err(loss, ref[0]) <= 1e-5
    loss.backward()
    assert rel_err(base.grad, ref[2].sum(0, keepdim=True)) <= 1e-5


def _check_loss_dtype(device="cpu"):
    """``loss_dtype=torch.float32`` returns the float32 sums of bf16 and fp16 logits (rounding them to
    the logits dtype put a mean loss 2**-9 off); the gradient stays right."""
    for dtype in (torch.bfloat16, torch.float16):
        x, t = _inputs(64, 1000, dtype, seed=3, device=device)
        for reduction in REDUCTIONS:
            ref, _, ref_dx = reference(x, t, reduction=reduction)
            leaf = x.clone().requires_grad_()
            loss = F.cross_entropy(leaf, t, reduction=reduction, loss_dtype=torch.float32)
            assert loss.dtype == torch.float32 and rel_err(loss, ref) <= 1e-6, (dtype, reduction, rel_err(loss, ref))
            loss.sum().backward()
            assert rel_err(leaf.grad.cpu(), ref_dx) <= TOL[dtype]
        # with a z-loss (both float32) and in place (the logits an intermediate the caller owns)
        ref, ref_z, ref_dx = reference(x, t, lse_square_scale=1e-3)
        leaf = x.clone().requires_grad_()
        loss, z = F.cross_entropy(leaf * 1, t, lse_square_scale=1e-3, return_z_loss=True, inplace_backward=True,
                                  loss_dtype=torch.float32)
        assert loss.dtype == z.dtype == torch.float32 and rel_err(loss, ref) <= 1e-6 and rel_err(z, ref_z) <= 1e-5
        loss.backward()
        assert rel_err(leaf.grad.cpu(), ref_dx) <= TOL[dtype]
    with pytest.raises(TypeError, match="loss_dtype must be None"):
        F.cross_entropy(x, t, loss_dtype=torch.int32)


def test_loss_dtype_float32():
    _check_loss_dtype()


@pytest.mark.interpreter
def test_kernel_interpreter_loss_dtype_float32(simulated_device, poison):
    _check_loss_dtype()


@pytest.mark.gpu
def test_kernel_gpu_loss_dtype_float32(poison):
    _check_loss_dtype(torch.device(liger_portable.platform().torch_device_type, 0))


@pytest.mark.interpreter
def test_kernel_interpreter_ignore_and_edges(simulated_device, poison):
    x, t = _inputs(6, 200, torch.float32)
    t[:] = -100
    for red in REDUCTIONS:
        leaf = x.clone().requires_grad_()
        loss = F.cross_entropy(leaf, t, reduction=red, label_smoothing=0.1, lse_square_scale=1e-3)
        loss.sum().backward()
        assert torch.all(loss == 0) and torch.all(leaf.grad == 0), red
    # custom ignore_index inside the class range
    x, t = _inputs(8, 200, torch.float32, ignore_frac=0)
    t[::3] = 7
    ref = reference(x, t, ignore_index=7, label_smoothing=0.1)
    leaf = x.clone().requires_grad_()
    loss = F.cross_entropy(leaf, t, ignore_index=7, label_smoothing=0.1)
    loss.backward()
    assert rel_err(loss, ref[0]) <= 1e-5 and rel_err(leaf.grad, ref[2]) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_strided_grad_output(simulated_device, poison):
    """reduction="none" under ``loss.sum()`` (grad_output expanded: stride 0, one element of
    storage) and under a strided grad_output: the backward must read each row's factor at its
    real stride, never past the storage."""
    x, t = _inputs(7, 300, torch.float32)
    ref = reference(x, t, reduction="none", label_smoothing=0.1)
    leaf = x.clone().requires_grad_()
    F.cross_entropy(leaf, t, reduction="none", label_smoothing=0.1).sum().backward()
    assert rel_err(leaf.grad, ref[2]) <= 1e-5
    go = torch.randn(14)[::2]
    ref = reference(x, t, reduction="none", grad_out=go)
    leaf = x.clone().requires_grad_()
    F.cross_entropy(leaf, t, reduction="none").backward(go)
    assert rel_err(leaf.grad, ref[2]) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_large_magnitude(simulated_device, poison):
    g = torch.Generator().manual_seed(1)
    x = 1e4 + torch.randn(5, 700, generator=g) * 30
    x[2] = -1e4 + torch.randn(700, generator=g) * 30
    t = torch.randint(0, 700, (5,), generator=g)
    with warnings.catch_warnings():
        # Masked lanes past the row end load 0.0; exp(0 - m) of a row near -1e4 overflows there
        # (numpy warns; the lanes are never stored).
        warnings.simplefilter("ignore", RuntimeWarning)
        _run_and_compare(x, t, torch.float32, "sum", OPTIONS["zloss"])
        _run_and_compare(x.bfloat16(), t, torch.bfloat16, "mean", OPTIONS["all"])


@pytest.mark.interpreter
def test_kernel_interpreter_nonfinite_and_bad_target(simulated_device, poison):
    """NaN / inf logits give NaN for their row; the others are right. (A bad target raises on the
    CPU before the kernel; the kernel itself turns one into NaN, which ce_rows shows.)"""
    from liger_portable.ops.cross_entropy import ce_rows

    x, t = _inputs(4, 90, torch.float32, ignore_frac=0)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loss = F.cross_entropy(x, t, reduction="none")
        assert torch.isnan(loss[1]) and torch.isnan(loss[2])
        assert rel_err(loss[[0, 3]], reference(x[[0, 3]], t[[0, 3]], reduction="none")[0]) <= 1e-5
        x, t = _inputs(3, 90, torch.float32, ignore_frac=0)
        t[1] = 90
        g = torch.empty_like(x)
        loss, _ = ce_rows(x, t, grad=g)
        assert torch.isnan(loss[1]) and torch.isnan(g[1]).all() and torch.isfinite(loss[[0, 2]]).all()


@pytest.mark.interpreter
def test_kernel_interpreter_big_vocab(simulated_device, poison):
    """A vocabulary above 65536 (several BLOCK_V steps on every table), two rows."""
    if simulated_device.arch not in ("sm90", "xe-hpc"):
        pytest.skip("two tables (different BLOCK_V) are enough for the long loop")
    x, t = _inputs(2, 70001, torch.bfloat16, ignore_frac=0)
    _run_and_compare(x, t, torch.bfloat16, "mean", OPTIONS["all"])


@pytest.mark.interpreter
def test_kernel_interpreter_vocab_blocks_smoothing_and_row_scales(poison):
    """An explicit BLOCK_V of 2048 over V=5000: three column blocks, the last one partial (no table
    is needed to get several: the tables' BLOCK_V depends on the vendor and may grow). fp32, so
    an error of one part in 1e4 shows.

    - Label smoothing with the row maximum rising in the second and third blocks (those columns
      lifted by 3 and 6): the running sum of ``z - max`` kept over the earlier blocks must be
      shifted to each new max, or the loss is off by ~3%. Across a table's blocks the max
      of random logits rarely rises by much, so the other tests cannot see it.
    - The per-row factors of ``reduction="none"`` (scale_rows_, as the backward applies the
      incoming gradient) must reach every column block, the partial last one included."""
    from liger_portable import simulate
    from liger_portable.configs import make_resolved
    from liger_portable.ops.cross_entropy import ce_rows, scale_rows_

    from conftest import SIMULATED_DEVICES

    x, t = _inputs(3, 5000, torch.float32, seed=21, ignore_frac=0)
    x[:, 2048:] += 3.0
    x[:, 4096:] += 6.0
    go = torch.randn(3, generator=torch.Generator().manual_seed(22))
    ref_loss, _, ref_dx = reference(x, t, reduction="none", label_smoothing=0.1, grad_out=go)
    cfg = make_resolved("cross_entropy", {"num_warps": 4, "BLOCK_V": 2048})
    g = torch.empty_like(x)
    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        loss, _ = ce_rows(x, t, label_smoothing=0.1, grad=g, config=cfg)
        scale_rows_(g, go, config=cfg)
    assert rel_err(loss, ref_loss) <= 1e-5 and rel_err(g, ref_dx) <= 1e-5, (rel_err(loss, ref_loss), rel_err(g, ref_dx))


@pytest.mark.interpreter
def test_kernel_interpreter_compile_fullgraph(simulated_device):
    x, t = _inputs(5, 300, torch.float32)
    go = torch.randn(5)
    ref_loss, ref_z, ref_dx = reference(x, t, reduction="none", lse_square_scale=1e-3, softcap=4.0, grad_out=go)
    leaf = x.clone().requires_grad_()
    fn = torch.compile(F.cross_entropy, fullgraph=True, backend="aot_eager")
    loss, z = fn(leaf, t, reduction="none", lse_square_scale=1e-3, softcap=4.0, return_z_loss=True)
    (loss * go).sum().backward()
    assert rel_err(loss, ref_loss) <= 1e-5 and rel_err(z, ref_z) <= 1e-5 and rel_err(leaf.grad, ref_dx) <= 1e-5
    leaf.grad = None
    loss = fn(leaf, t, reduction="mean", label_smoothing=0.1)
    loss.backward()
    ref = reference(x, t, label_smoothing=0.1)
    assert rel_err(loss, ref[0]) <= 1e-5 and rel_err(leaf.grad, ref[2]) <= 1e-5


# --------------------------------------------------------------------------- real GPU


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


GPU_SHAPES = [(1, 37), (333, 1000), (257, 32000), (64, 128256), (16, 256000), (7, 4097)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids["dtype"])
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_kernel_gpu(poison, shape, dtype, opts):
    x, t = _inputs(*shape, dtype, device=_gpu(), seed=sum(shape))
    i = GPU_SHAPES.index(shape) + DTYPES.index(dtype)
    reduction = REDUCTIONS[i % 3]
    go = torch.randn(shape[0]) if reduction == "none" else torch.tensor(1.3)
    _run_and_compare(x, t, dtype, reduction, OPTIONS[opts], inplace=i % 2 == 1, grad_out=go)


@pytest.mark.gpu
def test_kernel_gpu_all_ignored_and_large():
    dev = _gpu()
    x, t = _inputs(64, 32000, torch.bfloat16, device=dev)
    t[:] = -100
    leaf = x.clone().requires_grad_()
    loss = F.cross_entropy(leaf, t)
    loss.backward()
    assert loss.item() == 0 and torch.all(leaf.grad == 0)
    g = torch.Generator().manual_seed(0)
    x = (1e4 + torch.randn(32, 32000, generator=g) * 30).to(dev)
    t = torch.randint(0, 32000, (32,), generator=g).to(dev)
    _run_and_compare(x, t, torch.float32, "mean", OPTIONS["all"])


@pytest.mark.gpu
@pytest.mark.big_memory
def test_kernel_gpu_beyond_int32_offsets():
    """16384 x 131072 bf16 logits (2**31 elements, 4 GiB): the last rows must be right."""
    dev = _gpu()
    n_rows, V = 16384, 131072
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n_rows, V, device=dev, dtype=torch.bfloat16, generator=g)
    t = torch.randint(0, V, (n_rows,), device=dev, generator=g)
    x.requires_grad_()
    loss = F.cross_entropy(x, t, reduction="none", label_smoothing=0.1)
    loss.sum().backward()
    tail = slice(n_rows - 5, n_rows)
    ref_loss, _, ref_dx = reference(x[tail], t[tail], reduction="none", label_smoothing=0.1)
    assert rel_err(loss[tail], ref_loss) <= 1e-2 and rel_err(x.grad[tail], ref_dx) <= 1e-2


@pytest.mark.gpu
def test_kernel_gpu_inplace_memory():
    """In place, forward + backward allocates next to nothing beyond the logits (the <= 64 MiB goal)."""
    dev = _gpu()
    x, t = _inputs(2048, 128256, torch.bfloat16, device=dev)
    logits = x.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    F.cross_entropy(logits, t, inplace_backward=True).backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 8 * 2**20


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    x, t = _inputs(64, 32000, torch.bfloat16, device=_gpu())
    ref = reference(x, t, label_smoothing=0.1, softcap=30.0)
    leaf = x.clone().requires_grad_()
    loss = torch.compile(F.cross_entropy, fullgraph=True)(leaf, t, label_smoothing=0.1, softcap=30.0)
    loss.backward()
    assert rel_err(loss, ref[0]) <= 1e-2 and rel_err(leaf.grad, ref[2]) <= 1e-2


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_kernel_interpreter_beyond_int32_offsets(simulated_device, poison, inplace):
    """Logit rows that start beyond 2**31 elements (see beyond_int32_rows; in place, the gradient is
    written there too): the loss and gradient of every row right (int64 row offsets)."""
    rows, V = 9, 100
    x = beyond_int32_rows(rows, V, scale=3.0)
    t = torch.randint(0, V, (rows,), generator=torch.Generator().manual_seed(1))
    t[3] = -100
    logits = x.requires_grad_()
    go = torch.rand(rows, generator=torch.Generator().manual_seed(2)) + 0.5  # a factor per row: the scaling launch
    ref_loss, _, ref_dx = reference(x, t, reduction="none", label_smoothing=0.1, grad_out=go)  # before: in place overwrites x
    loss = F.cross_entropy(logits, t, reduction="none", label_smoothing=0.1, inplace_backward=inplace)
    loss.backward(go)
    assert rel_err(loss, ref_loss) <= 1e-2 and rel_err(x.grad, ref_dx) <= 1e-2
    assert rel_err(loss[-2:], ref_loss[-2:]) <= 1e-2 and rel_err(x.grad[-2:], ref_dx[-2:]) <= 1e-2
