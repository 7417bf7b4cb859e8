"""RoPE: fallback, Triton kernel (interpreter with each vendor's configs; real GPU), API edges.

Every check compares against Hugging Face's ``apply_rotary_pos_emb`` written out here and run in
float64 on fresh random inputs (never zeros; cos/sin random too, so the two halves differ and a
kernel that assumed ``cos[..., :d/2] == cos[..., d/2:]`` would fail), forward and the gradients of
q and k, with the dtype's tolerance (fp32 1e-5, bf16/fp16 1e-2).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import liger_portable
from liger_portable import fallback
from liger_portable import functional as F

from conftest import TOL, beyond_int32_rows, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb``, verbatim."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


# Memory layouts: (shape of the stored tensor, view passed to rope, unsqueeze_dim).
# "hf" is Hugging Face's q: view(B, S, H, D).transpose(1, 2), non-contiguous.
LAYOUTS = {
    "hf": (lambda b, s, h, d: (b, s, h, d), lambda t: t.transpose(1, 2), 1),
    "bhsd": (lambda b, s, h, d: (b, h, s, d), lambda t: t, 1),
    "bshd": (lambda b, s, h, d: (b, s, h, d), lambda t: t, 2),
}


@dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    q_heads: int
    k_heads: int
    head_dim: int
    layout: str = "hf"
    cos_batch: int = 1  # 1 or batch
    extra_cos: int = 0  # cos/sin longer than seq by this much

    def __str__(self):
        return (f"{self.layout}-b{self.batch}s{self.seq}q{self.q_heads}k{self.k_heads}d{self.head_dim}"
                f"-cos{self.cos_batch}{'+' + str(self.extra_cos) if self.extra_cos else ''}")


def _inputs(c: Case, dtype, device="cpu", seed=0, cos_dtype=None):
    g = torch.Generator().manual_seed(seed)
    shape, view, _ = LAYOUTS[c.layout]
    qb = (torch.randn(shape(c.batch, c.seq, c.q_heads, c.head_dim), generator=g) + 0.1).to(dtype)
    kb = (torch.randn(shape(c.batch, c.seq, c.k_heads, c.head_dim), generator=g) - 0.1).to(dtype)
    cs = (c.cos_batch, c.seq + c.extra_cos, c.head_dim)
    cos = torch.randn(cs, generator=g).to(cos_dtype or dtype)
    sin = torch.randn(cs, generator=g).to(cos_dtype or dtype)
    dq = torch.randn(view(qb).shape, generator=g).to(dtype)
    dk = torch.randn(view(kb).shape, generator=g).to(dtype)
    return [t.to(device) for t in (qb, kb, cos, sin, dq, dk)]


def _reference(c: Case, qb, kb, cos, sin, dq, dk):
    """The formula in float64 with autograd: (q_embed, k_embed, grad of qb, grad of kb)."""
    _, view, dim = LAYOUTS[c.layout]
    qd = qb.detach().double().requires_grad_()
    kd = kb.detach().double().requires_grad_()
    s = dq.shape[2 if dim == 1 else 1]
    rq, rk = hf_apply_rotary_pos_emb(view(qd), view(kd), cos[:, :s].double(), sin[:, :s].double(), None, dim)
    torch.autograd.backward([rq, rk], [dq.double(), dk.double()])
    return rq, rk, qd.grad, kd.grad


def _run_and_compare(c: Case, dtype, device="cpu", seed=0, cos_dtype=None):
    qb, kb, cos, sin, dq, dk = _inputs(c, dtype, device, seed, cos_dtype)
    q0, k0 = qb.clone(), kb.clone()
    _, view, dim = LAYOUTS[c.layout]
    qb.requires_grad_()
    kb.requires_grad_()
    oq, ok = F.rope(view(qb), view(kb), cos, sin, unsqueeze_dim=dim)
    assert oq.shape == view(qb).shape and ok.shape == view(kb).shape
    assert oq.dtype == dtype and ok.dtype == dtype
    torch.autograd.backward([oq, ok], [dq, dk])
    assert torch.equal(qb.detach(), q0) and torch.equal(kb.detach(), k0), "inputs were modified"
    rq, rk, rdq, rdk = _reference(c, q0, k0, cos, sin, dq, dk)
    tol = TOL[dtype]
    errs = {"q": rel_err(oq, rq), "k": rel_err(ok, rk), "dq": rel_err(qb.grad, rdq), "dk": rel_err(kb.grad, rdk)}
    assert all(e <= tol for e in errs.values()), errs
    return oq, ok, qb, kb


# --------------------------------------------------------------------------- fallback (CPU path)

FALLBACK_CASES = [
    Case(2, 7, 8, 2, 80, "hf", cos_batch=2),
    Case(1, 5, 3, 3, 64, "bhsd", cos_batch=1, extra_cos=4),
    Case(3, 6, 4, 1, 128, "bshd", cos_batch=3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", FALLBACK_CASES, ids=str)
def test_fallback_matches_float64(case, dtype):
    _run_and_compare(case, dtype)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fallback_float64_is_hf_formula(layout):
    """In float64 the fallback is Hugging Face's formula (written out), to the last bits."""
    c = Case(2, 9, 4, 2, 96, layout, cos_batch=2)
    qb, kb, cos, sin, _, _ = _inputs(c, torch.float64)
    _, view, dim = LAYOUTS[layout]
    out = fallback.rope(view(qb), view(kb), cos, sin, None, dim)
    ref = hf_apply_rotary_pos_emb(view(qb), view(kb), cos, sin, None, dim)
    for a, b in zip(out, ref):
        assert rel_err(a, b) <= 1e-15


def test_fallback_bf16_near_hf_eager():
    """HF's bf16 eager code rounds after each product; we round once (fp32 inside). One rounding step apart."""
    c = Case(1, 16, 4, 2, 64)
    qb, kb, cos, sin, _, _ = _inputs(c, torch.bfloat16)
    ours = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    hf = hf_apply_rotary_pos_emb(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    exact = hf_apply_rotary_pos_emb(qb.double().transpose(1, 2), kb.double().transpose(1, 2), cos.double(), sin.double())
    for o, h, e in zip(ours, hf, exact):
        assert rel_err(o, e) <= rel_err(h, e) <= 1e-2


def test_float64_runs_fallback():
    _run_and_compare(Case(2, 5, 2, 1, 16, "bhsd", cos_batch=2), torch.float64)


def test_position_ids_ignored():
    c = Case(1, 6, 2, 2, 32)
    qb, kb, cos, sin, _, _ = _inputs(c, torch.float32)
    a = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    b = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin, torch.arange(6)[None].flip(-1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_longer_cos_uses_first_positions():
    c = Case(2, 5, 2, 1, 32, extra_cos=3)
    qb, kb, cos, sin, _, _ = _inputs(c, torch.float32)
    a = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    b = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos[:, :5].contiguous(), sin[:, :5].contiguous())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_cos_sin_get_no_gradient():
    c = Case(1, 4, 2, 2, 16, "bhsd")
    qb, kb, cos, sin, dq, dk = _inputs(c, torch.float32)
    qb.requires_grad_()
    cos.requires_grad_()
    sin.requires_grad_()
    oq, ok = F.rope(qb, kb, cos, sin)
    assert not ok.requires_grad
    (oq * dq).sum().backward()
    assert cos.grad is None and sin.grad is None and qb.grad is not None


def test_empty_input():
    q = torch.empty(2, 3, 0, 8)
    oq, ok = F.rope(q, torch.empty(2, 1, 0, 8), torch.ones(1, 0, 8), torch.ones(1, 0, 8))
    assert oq.shape == (2, 3, 0, 8) and ok.shape == (2, 1, 0, 8)


# --------------------------------------------------------------------------- bad input


def _ok_args():
    return torch.ones(2, 4, 3, 8), torch.ones(2, 2, 3, 8), torch.ones(1, 3, 8), torch.ones(1, 3, 8)


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_integer_tensors_named(which):
    args = list(_ok_args())
    args[which] = args[which].to(torch.int64)
    name = ("q", "k", "cos", "sin")[which]
    with pytest.raises(TypeError, match=rf"{name} must be a floating-point tensor"):
        F.rope(*args)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: (torch.ones(2, 4, 3, 7), torch.ones(2, 2, 3, 7), torch.ones(1, 3, 7), torch.ones(1, 3, 7)),
         r"q must have an even head_dim .* got 7"),
        (lambda a: (a[0], torch.ones(2, 2, 3, 6), a[2], a[3]), r"k must have the head_dim of q \(8\), got 6"),
        (lambda a: (a[0], torch.ones(3, 2, 3, 8), a[2], a[3]), r"k must have the batch size of q \(2\), got 3"),
        (lambda a: (a[0], torch.ones(2, 2, 4, 8), a[2], a[3]), r"k must have the sequence length of q \(3"),
        (lambda a: (a[0], a[1], torch.ones(3, 8), torch.ones(3, 8)), r"cos must have shape \(1 or 2, >= 3, 8\)"),
        (lambda a: (a[0], a[1], torch.ones(3, 3, 8), torch.ones(3, 3, 8)), r"cos must have shape \(1 or 2, >= 3, 8\)"),
        (lambda a: (a[0], a[1], torch.ones(1, 3, 4), torch.ones(1, 3, 4)), r"cos must have shape"),
        (lambda a: (torch.ones(1, 4, 3, 8), torch.ones(1, 2, 3, 8), torch.ones(1, 3, 6), torch.ones(1, 3, 6)),
         r"cos must have shape \(1, >= 3, 8\) \(batch, seq, head_dim\), got \(1, 3, 6\)"),
        (lambda a: (a[0], a[1], torch.ones(1, 2, 8), torch.ones(1, 2, 8)), r"cos must cover at least the 3 positions of q, got 2"),
        (lambda a: (a[0], a[1], a[2], torch.ones(2, 3, 8)), r"sin must have the shape of cos \(1, 3, 8\)"),
        (lambda a: (torch.ones(4, 3, 8), a[1], a[2], a[3]), r"q must be 4-D \(batch, heads, seq, head_dim\)"),
    ],
)
def test_bad_shapes_named(change, match):
    with pytest.raises(ValueError, match=match):
        F.rope(*change(_ok_args()))


@pytest.mark.parametrize("dim", [0, 3, -1, "1"])
def test_bad_unsqueeze_dim(dim):
    with pytest.raises(ValueError, match=r"unsqueeze_dim must be one of 1, 2"):
        F.rope(*_ok_args(), unsqueeze_dim=dim)


def test_unsqueeze_dim_2_checks_seq_on_dim_1():
    q, k = torch.ones(2, 3, 4, 8), torch.ones(2, 3, 2, 8)
    F.rope(q, k, torch.ones(1, 3, 8), torch.ones(1, 3, 8), unsqueeze_dim=2)
    with pytest.raises(ValueError, match=r"cos must cover at least the 3 positions"):
        F.rope(q, k, torch.ones(1, 2, 8), torch.ones(1, 2, 8), unsqueeze_dim=2)


@pytest.mark.parametrize("which", [1, 2, 3])
def test_devices_differ(which):
    args = list(_ok_args())
    args[which] = args[which].to("meta")
    name = ("q", "k", "cos", "sin")[which]
    with pytest.raises(ValueError, match=rf"{name} is on meta but q is on cpu"):
        F.rope(*args)


# --------------------------------------------------------------------------- torch.compile (CPU path)


def _compiled_run(c: Case, dtype=torch.float32):
    qb, kb, cos, sin, dq, dk = _inputs(c, dtype)
    _, view, dim = LAYOUTS[c.layout]
    q0, k0 = qb.clone(), kb.clone()
    qb.requires_grad_()
    kb.requires_grad_()
    fn = torch.compile(F.rope, fullgraph=True, backend="aot_eager")
    oq, ok = fn(view(qb), view(kb), cos, sin, None, dim)
    torch.autograd.backward([oq, ok], [dq, dk])
    rq, rk, rdq, rdk = _reference(c, q0, k0, cos, sin, dq, dk)
    for a, b in ((oq, rq), (ok, rk), (qb.grad, rdq), (kb.grad, rdk)):
        assert rel_err(a, b) <= TOL[dtype]


def test_compile_fullgraph_cpu():
    _compiled_run(Case(2, 5, 4, 2, 32, "hf", cos_batch=2))


# --------------------------------------------------------------------------- Triton interpreter, every vendor's configs

# The interpreter runs about 6 ms per program (B x (q heads + k heads) x seq blocks), so shapes are
# small. GQA (8 q heads, 2 k heads) in Hugging Face's layout with head_dim 80 (half 40, padded to
# 64); contiguous (B, H, S, D) with head_dim 64 and a sequence straddling BLOCK_S; head_dim 128 with
# per-batch cos/sin; one position; (B, S, H, D) with unsqueeze_dim=2, head_dim 96 and longer cos/sin.
KERNEL_CASES = [
    Case(1, 9, 8, 2, 80, "hf"),
    Case(1, 11, 2, 1, 64, "bhsd"),
    Case(2, 9, 2, 1, 128, "hf", cos_batch=2),
    Case(2, 1, 1, 1, 64, "hf", cos_batch=2),
    Case(2, 5, 2, 1, 96, "bshd", cos_batch=2, extra_cos=3),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_kernel_interpreter(simulated_device, poison, case, dtype):
    _run_and_compare(case, dtype, seed=case.seq * 31 + case.head_dim)


@pytest.mark.interpreter
def test_kernel_interpreter_head_dim_256_fp32_cos_bf16(simulated_device, poison):
    """head_dim 256, and cos/sin in fp32 with bf16 q and k (a mixed-precision caller)."""
    _run_and_compare(Case(1, 3, 2, 1, 256, "hf"), torch.bfloat16, cos_dtype=torch.float32)


class _Recorder:
    """Wraps a Triton kernel to record the tensors of each launch."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append(args)
            return launch(*args, **kwargs)

        return run


def _check_no_copy_and_layout(monkeypatch, device):
    from liger_portable.ops import launching as launch_ops
    from liger_portable.ops import rope as rope_ops

    # The launcher holds the kernel; its cached direct path (GPU) would bypass the recorder.
    rec = _Recorder(rope_ops.launch_rope.fn)
    monkeypatch.setattr(rope_ops.launch_rope, "fn", rec)
    monkeypatch.setattr(launch_ops, "enabled", False)
    c = Case(2, 10, 4, 2, 64, "hf", cos_batch=2)
    qb, kb, cos, sin, _, _ = _inputs(c, torch.bfloat16, device)
    qb.requires_grad_()
    kb.requires_grad_()
    q, k = qb.transpose(1, 2), kb.transpose(1, 2)
    oq, ok = F.rope(q, k, cos, sin)
    # Outputs keep the inputs' layout, as HF's eager code gives.
    assert oq.stride() == q.stride() and ok.stride() == k.stride()
    # Gradients arriving in that layout too (what attention's backward gives).
    dq = torch.randn_like(qb).transpose(1, 2)
    dk = torch.randn_like(kb).transpose(1, 2)
    torch.autograd.backward([oq, ok], [dq, dk])
    assert len(rec.calls) == 2, "q and k go in one launch, forward and backward"
    fwd, bwd = rec.calls
    assert fwd[0].data_ptr() == qb.data_ptr() and fwd[1].data_ptr() == kb.data_ptr(), "q/k were copied"
    assert bwd[0].data_ptr() == dq.data_ptr() and bwd[1].data_ptr() == dk.data_ptr(), "dq/dk were copied"
    assert qb.grad.is_contiguous() and kb.grad.is_contiguous()
    _, _, rdq, rdk = _reference(c, qb.detach(), kb.detach(), cos, sin, dq, dk)
    assert rel_err(qb.grad, rdq) <= 1e-2 and rel_err(kb.grad, rdk) <= 1e-2


@pytest.mark.interpreter
def test_kernel_interpreter_reads_strides_without_copy(monkeypatch, poison):
    from conftest import SIMULATED_DEVICES
    from liger_portable import simulate

    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        _check_no_copy_and_layout(monkeypatch, "cpu")


@pytest.mark.interpreter
def test_kernel_interpreter_unit_stride_last_dim_missing(simulated_device, poison):
    """q whose last dimension has stride 2 (every other element of a wider buffer) is copied, still right."""
    c = Case(1, 6, 2, 2, 32, "bhsd")
    qb, kb, cos, sin, dq, dk = _inputs(c, torch.float32, seed=3)
    wide = torch.randn(1, 2, 6, 64)
    wide[..., ::2] = qb
    q = wide[..., ::2]
    assert q.stride(-1) == 2
    oq, ok = F.rope(q, kb, cos, sin)
    rq, rk, _, _ = _reference(c, qb, kb, cos, sin, dq, dk)
    assert rel_err(oq, rq) <= 1e-5 and rel_err(ok, rk) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_only_one_gradient(simulated_device, poison):
    """Only q_embed used (k's gradient unset) and k not requiring grad: one-tensor launches."""
    c = Case(2, 7, 3, 1, 48, "hf")
    qb, kb, cos, sin, dq, dk = _inputs(c, torch.float32, seed=5)
    qb.requires_grad_()
    kb.requires_grad_()
    oq, _ = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    oq.backward(dq)
    assert kb.grad is None
    _, _, rdq, _ = _reference(c, qb.detach(), kb, cos, sin, dq, torch.zeros_like(dk))
    assert rel_err(qb.grad, rdq) <= 1e-5
    qb.grad = None
    kb.requires_grad_(False)
    oq, ok = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    torch.autograd.backward([oq, ok], [dq, dk])
    assert rel_err(qb.grad, rdq) <= 1e-5


def _rope_of_views(views, shape, cos, sin, seed):
    """F.rope of ``(q, k) = views(leaf)`` for a random leaf of ``shape``, with output gradients
    ``views(another)``: the outputs and the leaf's gradient against float64."""
    g = torch.Generator().manual_seed(seed)
    leaf = torch.randn(shape, generator=g).requires_grad_()
    dq, dk = views(torch.randn(shape, generator=g))
    oq, ok = F.rope(*views(leaf), cos, sin)
    torch.autograd.backward([oq, ok], [dq, dk])
    leaf64 = leaf.detach().double().requires_grad_()
    rq, rk = hf_apply_rotary_pos_emb(*views(leaf64), cos.double(), sin.double())
    torch.autograd.backward([rq, rk], [dq.double(), dk.double()])
    errs = {"q": rel_err(oq, rq), "k": rel_err(ok, rk), "grad": rel_err(leaf.grad, leaf64.grad)}
    assert all(e <= 1e-5 for e in errs.values()), errs
    return leaf


@pytest.mark.interpreter
def test_kernel_interpreter_non_dense_views_and_cos_sin_strides(simulated_device, poison):
    """q and k (and the gradients of their outputs) that are not dense, with sin a column slice of
    a wider buffer (row stride 2D, cos's is D). The outputs are new dense tensors, which the kernel
    must write through their own strides, not the inputs' (the two agree for a dense input; every
    other test's q and k are dense or copied), and cos and sin must each be read at their own row
    stride (every other test builds them alike). First q and k broadcast over the batch (batch
    stride 0: outputs written with the inputs' strides would leave the second batch element
    unwritten, NaN), then, as Hugging Face gets them, views of one fused qkv projection
    ``(B, S, Hq + 2 Hk, D)`` in the transposed layout, each skipping the other heads. cos is the
    first S rows of a longer cache, so that cos and sin read at each other's stride stay inside
    their buffers (wrong values, not a crash)."""
    b, s, hq, hk, d = 2, 5, 3, 1, 64
    g = torch.Generator().manual_seed(8)
    cos = torch.randn(1, 2 * s, d, generator=g)[:, :s]
    sin = torch.randn(1, s, 2 * d, generator=g)[..., :d]
    assert sin.stride(1) == 2 * cos.stride(1)

    def broadcast(t):
        return t[:, :hq].expand(b, -1, -1, -1), t[:, hq:].expand(b, -1, -1, -1)

    _rope_of_views(broadcast, (1, hq + hk, s, d), cos, sin, seed=9)

    def fused_qkv(t):
        return t[:, :, :hq].transpose(1, 2), t[:, :, hq : hq + hk].transpose(1, 2)

    assert not fused_qkv(torch.empty(b, s, hq + 2 * hk, d))[0].is_contiguous()
    qkv = _rope_of_views(fused_qkv, (b, s, hq + 2 * hk, d), cos, sin, seed=10)
    assert not qkv.grad[:, :, hq + hk :].any()


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "block_s,num_warps,heads,n_q,n_k",
    [(1, 1, 1, 1, 1), (2, 8, 1, 1, 1), (32, 2, 1, 1, 1), (4, 4, 2, 5, 3), (8, 2, 4, 7, 2), (16, 4, 8, 3, 1)],
)
def test_kernel_interpreter_search_space_points(poison, block_s, num_warps, heads, n_q, n_k):
    """Configs the sweep may pick (BLOCK_S from 1 to 32, 1 to 8 heads a program) give the same result
    (the config is explicit, so one simulated device is enough). The head counts put the q/k boundary
    inside a group of heads (5 + 3 in pairs) and leave the last group part-empty (7 + 2 in fours)."""
    from conftest import SIMULATED_DEVICES
    from liger_portable.configs import make_resolved
    from liger_portable import simulate
    from liger_portable.ops import rope as rope_ops

    c = Case(2, 19, n_q, n_k, 80, "hf", cos_batch=2)
    qb, kb, cos, sin, dq, dk = _inputs(c, torch.float32, seed=7)
    r = make_resolved("rope", {"num_warps": num_warps, "BLOCK_S": block_s, "HEADS": heads}, "test")
    q, k = qb.transpose(1, 2), kb.transpose(1, 2)
    with simulate(SIMULATED_DEVICES["rocm-gfx942"]):
        oq, ok = rope_ops.rope_fwd(q, k, cos, sin, config=r)
        gq, gk = rope_ops.rope_bwd(dq, dk, cos, sin, config=r)
    rq, rk, rdq, rdk = _reference(c, qb, kb, cos, sin, dq, dk)
    for a, b in ((oq, rq), (ok, rk), (gq, rdq.transpose(1, 2)), (gk, rdk.transpose(1, 2))):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.interpreter
def test_kernel_interpreter_compile_fullgraph():
    """The kernel path is a custom op: torch.compile(fullgraph=True) traces it without a break."""
    from conftest import SIMULATED_DEVICES
    from liger_portable import simulate

    with simulate(SIMULATED_DEVICES["cuda-sm90"]):
        _compiled_run(Case(2, 5, 2, 1, 32, "hf", cos_batch=2))


# --------------------------------------------------------------------------- real GPU


def _gpu():
    return torch.device(liger_portable.platform().torch_device_type, 0)


GPU_CASES = [
    Case(2, 1024, 32, 8, 128, "hf"),
    Case(1, 777, 28, 4, 128, "hf", cos_batch=1, extra_cos=100),
    Case(3, 513, 12, 12, 64, "bhsd", cos_batch=3),
    Case(2, 300, 16, 2, 80, "bshd", cos_batch=2),
    Case(1, 1000, 8, 1, 96, "hf"),
    Case(2, 257, 8, 2, 256, "hf", cos_batch=2),
    Case(5, 1, 4, 4, 64, "hf"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_kernel_gpu(poison, case, dtype):
    _run_and_compare(case, dtype, device=_gpu(), seed=case.seq)


@pytest.mark.gpu
def test_kernel_gpu_reads_strides_without_copy(monkeypatch, poison):
    _check_no_copy_and_layout(monkeypatch, _gpu())


@pytest.mark.gpu
@pytest.mark.big_memory
def test_kernel_gpu_beyond_int32_offsets():
    """q with more than 2**31 elements in HF's layout: the last positions must be right (int64 offsets)."""
    dev = _gpu()
    heads, d = 2, 128
    seq = 2**31 // (heads * d) + 9
    qb = torch.randn(1, seq, heads, d, device=dev, dtype=torch.bfloat16)
    kb = torch.randn(1, seq, 1, d, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(seq, device=dev, dtype=torch.float32)[:, None] * (1e-4 ** (torch.arange(d // 2, device=dev) / (d // 2)))
    emb = torch.cat((pos, pos), -1)[None]
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    del pos, emb
    qb.requires_grad_()
    oq, ok = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    tail = slice(seq - 7, seq)
    rq, rk = fallback.rope(
        qb.detach()[:, tail].double().transpose(1, 2), kb[:, tail].double().transpose(1, 2),
        cos[:, tail].double(), sin[:, tail].double(),
    )
    assert rel_err(oq[:, :, tail], rq) <= 1e-2 and rel_err(ok[:, :, tail], rk) <= 1e-2
    dq = torch.randn_like(qb).transpose(1, 2)
    del ok
    oq.backward(dq)
    qd = qb.detach()[:, tail].double().requires_grad_()
    rq, _ = fallback.rope(qd.transpose(1, 2), kb[:, tail].double().transpose(1, 2), cos[:, tail].double(), sin[:, tail].double())
    rq.backward(dq[:, :, tail].double())
    assert rel_err(qb.grad[:, tail], qd.grad) <= 1e-2


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    """Under Inductor, the custom op's declared output strides must be the real ones."""
    dev = _gpu()
    c = Case(2, 256, 8, 2, 128, "hf", cos_batch=2)
    qb, kb, cos, sin, dq, dk = _inputs(c, torch.bfloat16, dev)
    q0, k0 = qb.clone(), kb.clone()
    qb.requires_grad_()
    kb.requires_grad_()

    def f(qb, kb, cos, sin):
        oq, ok = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
        return oq * 2.0, ok + 1.0  # something for Inductor to fuse after the op

    oq, ok = torch.compile(f, fullgraph=True)(qb, kb, cos, sin)
    torch.autograd.backward([oq, ok], [dq, dk])
    rq, rk, rdq, rdk = _reference(c, q0, k0, cos, sin, dq * 2.0, dk)
    assert rel_err(oq, rq * 2.0) <= 1e-2 and rel_err(ok, rk + 1.0) <= 1e-2
    assert rel_err(qb.grad, rdq) <= 1e-2 and rel_err(kb.grad, rdk) <= 1e-2


def test_out_like_keeps_memory_order_with_a_unit_last_stride():
    """Outputs are dense, in the input's memory order, last dimension contiguous: the strides of a
    dense input (HF's transposed q), the order of the strides for a sliced or expanded one (where
    empty_like would give contiguous strides), contiguous without a unit last stride."""
    from liger_portable.ops.rope import out_like

    def dense_in_order(out, x):
        n = x.dim()
        order = sorted(range(n - 1), key=lambda i: (-x.stride(i), i)) + [n - 1]
        expect, step = [0] * n, 1
        for i in reversed(order):
            expect[i], step = step, step * x.shape[i]
        return list(out.stride()) == expect

    hf = torch.randn(2, 7, 4, 8).transpose(1, 2)  # (batch, heads, seq, head_dim) view of (b, s, h, d)
    assert out_like(hf).stride() == hf.stride()
    sliced = torch.randn(2, 7, 6, 8).transpose(1, 2)[:, :4]  # not dense: every head but the last two
    expanded = torch.randn(1, 4, 7, 8).expand(3, 4, 7, 8)
    for x in (sliced, expanded):
        out = out_like(x)
        assert out.shape == x.shape and out.stride(-1) == 1 and dense_in_order(out, x), (x.stride(), out.stride())
    strided_last = torch.randn(2, 4, 7, 16)[..., ::2]
    assert out_like(strided_last).is_contiguous()


@pytest.mark.interpreter
@pytest.mark.parametrize("simulated_device", ["cuda-sm90"], indirect=True)
@pytest.mark.parametrize("far", ["positions", "batches"])
def test_kernel_interpreter_beyond_int32_offsets(simulated_device, poison, far):
    """q and k in Hugging Face's layout whose last positions (or batches) start beyond 2**31 elements
    (a large sequence or batch stride; see beyond_int32_rows): every position of the outputs and of
    q's and k's gradients right (int64 offsets)."""
    heads, kv_heads, d = 2, 1, 64
    batch, seq = (1, 9) if far == "positions" else (4, 3)

    def hf_layout(h, seed):  # (batch, seq, h, d), far apart along seq or batch
        rows, n = (seq, h * d) if far == "positions" else (batch, seq * h * d)
        return beyond_int32_rows(rows, n, seed=seed).view(batch, seq, h, d)

    qb, kb = hf_layout(heads, 0).requires_grad_(), hf_layout(kv_heads, 1).requires_grad_()
    g = torch.Generator().manual_seed(2)
    cos, sin = ((torch.rand(1, seq, d, generator=g) * 2 - 1).to(torch.bfloat16) for _ in range(2))
    dq, dk = hf_layout(heads, 3).transpose(1, 2), hf_layout(kv_heads, 4).transpose(1, 2)
    oq, ok = F.rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    torch.autograd.backward([oq, ok], [dq, dk])
    qd, kd = (t.detach().double().requires_grad_() for t in (qb, kb))
    rq, rk = fallback.rope(qd.transpose(1, 2), kd.transpose(1, 2), cos.double(), sin.double())
    torch.autograd.backward([rq, rk], [dq.double(), dk.double()])
    for name, out, ref in (("q", oq, rq), ("k", ok, rk), ("dq", qb.grad, qd.grad), ("dk", kb.grad, kd.grad)):
        assert rel_err(out, ref) <= 1e-2, (name, rel_err(out, ref))
    last = (slice(None), slice(None), slice(-2, None)) if far == "positions" else (slice(-2, None),)
    assert rel_err(oq[last], rq[last]) <= 1e-2 and rel_err(ok[last], rk[last]) <= 1e-2
