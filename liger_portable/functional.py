"""Public functional API, shaped like ``torch.nn.functional``.

Each function checks its arguments, then dispatches by the tensors' device: tensors on the
detected GPU backend run the Triton kernels with the launch config resolved for that device;
CPU tensors (and the ``cpu`` backend) run the pure-PyTorch fallback with the same semantics.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch.nn.modules import module as _nn_module
from torch.utils.checkpoint import checkpoint as _checkpoint

from . import _dtensor, fallback
from ._checks import KERNEL_DTYPES, check_ce_options, check_choice, check_class_range, check_chunk_mib, check_float, check_nonneg_number, check_real
from ._checks import REDUCTIONS  # noqa: F401  (the reductions the losses accept, kept here too)
from ._checks import SettingError
from ._dispatch import kernel_device, same_device
from ._warn import warn
from . import tuning  # noqa: F401  (tunes config misses under LIGER_PORTABLE_AUTOTUNE=1; loads no kernel)

# Triton has Linux wheels only; without it every call takes the fallback.
if importlib.util.find_spec("triton") is not None:
    from .ops import rms_norm as _rms_norm_ops
    from .ops import layer_norm as _layer_norm_ops
    from .ops import rope as _rope_ops
    from .ops import glu as _glu_ops
    from .ops import mlp as _mlp_ops
    from .ops import cross_entropy as _ce_ops
    from .ops import fused_linear_cross_entropy as _flce_ops
else:  # pragma: no cover - exercised only on machines without Triton
    _rms_norm_ops = None
    _layer_norm_ops = None
    _rope_ops = None
    _glu_ops = None
    _mlp_ops = None
    _ce_ops = None
    _flce_ops = None

__all__ = [
    "rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "fused_add_rms_norm",
    "cross_entropy",
    "fused_linear_cross_entropy",
]

CASTING_MODES = ("llama", "gemma")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D tensor (as it is when it already is one: no view op)."""
    return t if t.dim() == 1 and t.stride(0) == 1 else t.reshape(-1).contiguous()


# Under torch.compile the row norms, GLU products and RoPE are left to the compiler by default
# ("inductor"): Inductor fuses them with their neighbours and launches its kernels from compiled code
# at less host time than a user Triton kernel costs it (the compiled step of a small model is
# host-bound), at the same memory. The losses keep their kernels: they never build the logits. So
# does the fused MLP's product (``glu_down``): recomputed by our kernel in the backward, it leaves
# Inductor's gradient kernel free to write over a saved input (see ``ops.glu.glu_product_op``).
# "kernels" keeps every kernel of ours under torch.compile too. Read per call (tests set it).
UNDER_COMPILE_CHOICES = ("inductor", "kernels")
_under_compile = os.environ.get("LIGER_PORTABLE_UNDER_COMPILE", "")
UNDER_COMPILE = _under_compile.strip().lower() or "inductor"  # empty: unset, as the other variables
if UNDER_COMPILE not in UNDER_COMPILE_CHOICES:
    raise SettingError(
        f"LIGER_PORTABLE_UNDER_COMPILE must be one of {', '.join(UNDER_COMPILE_CHOICES)}, got {_under_compile!r}"
    )


def _kernel_device(ops, device: torch.device, x: torch.Tensor, generated: bool = False):
    """The :class:`~liger_portable.DeviceInfo` a call on ``x`` launches the Triton kernels of ``ops``
    with, or None for the fallback: Triton is present, ``device`` is the detected GPU backend's (or
    simulated), the dtype has kernels and there is work to do; ``generated``: an op that Inductor
    generates under torch.compile (see :data:`UNDER_COMPILE`). (Under torch.compile the ops ignore
    it: their kernel ops look the device up themselves.)"""
    if ops is None or x.dtype not in KERNEL_DTYPES or x.numel() == 0:
        return None
    if generated and UNDER_COMPILE == "inductor" and torch.compiler.is_compiling():
        return None
    return kernel_device(device)


def _dtensor_fallback(op: str, *tensors: torch.Tensor | None) -> bool:
    """True if any of ``tensors`` is a DTensor: ``op`` then runs its PyTorch fallback, whose
    operations DTensor's own rules shard and reduce correctly (the kernels take local tensors; only
    the row norms have DTensor rules of their own), with a warning (Python's default filter shows it
    once per op; none under torch.compile, where it would break the graph)."""
    if not _dtensor.any_dtensor(*tensors):
        return False
    if not torch.compiler.is_compiling():
        warn(
            f"liger_portable.{op}: DTensor inputs run the PyTorch fallback (correct under any placement, "
            "not fused); for the kernels, call it on the local shards (.to_local()) where the op allows",
        )
    return True


def _rows(x: torch.Tensor, alias: bool = True) -> torch.Tensor:
    """``x`` as a 2-D (rows, last dim) tensor whose last dimension is contiguous (no copy if possible).

    ``alias=False``: a 2-D ``x`` is passed as it is (a view op costs host time). Ops whose backward
    hands a gradient back in the storage of their input keep the default: autograd copies a
    gradient that is the leaf tensor itself, but steals one that is a view of it."""
    if not alias and x.dim() == 2 and x.stride(1) == 1:
        return x
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def _check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, eps, offset, casting_mode: str) -> float:
    """Checks shared by the RMSNorm entry points; returns ``eps`` as a float."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match the last dimension of x "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    check_choice("casting_mode", casting_mode, CASTING_MODES)
    check_real("offset", offset)
    return check_nonneg_number("eps", eps)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, times ``offset + weight``.

    ``y = x / sqrt(mean(x**2, -1) + eps) * (offset + weight)``

    Args:
        x: input of shape ``(..., hidden)``; float32, bfloat16 or float16 (float64 runs the
            fallback on any device). Any strides.
        weight: shape ``(hidden,)``, floating point, on the device of ``x``.
        eps: added to the mean square before the square root.
        offset: added to the weight (``1.0`` for Gemma, whose weights are stored as ``w - 1``).
        casting_mode: ``"llama"`` normalises in fp32, casts to ``x.dtype``, then multiplies by the
            weight (Hugging Face LlamaRMSNorm); ``"gemma"`` multiplies in fp32 and casts once.

    Returns:
        A tensor of the shape and dtype of ``x``.
    """
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the one normalised), got a scalar")
    eps = _check_rms_norm_args(x, weight, eps, offset, casting_mode)
    if _dtensor.any_dtensor(x, weight):
        return _dtensor.rowwise(
            lambda x, w: rms_norm(x, w, eps, offset=offset, casting_mode=casting_mode), [("x", x)], [("weight", weight)]
        )
    dev = _kernel_device(_rms_norm_ops, same_device(x=x, weight=weight), x, True)
    if dev is None:
        return fallback.rms_norm(x, weight, eps, float(offset), casting_mode)
    y = _rms_norm_ops.rms_norm(_rows(x, alias=False), weight.contiguous(), eps, float(offset), casting_mode == "gemma", dev)
    return y if x.dim() == 2 else y.view(x.shape)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Layer normalisation over the last dimension, with a weight and an optional bias.

    ``y = (x - mean(x, -1)) / sqrt(var(x, -1) + eps) * weight + bias`` (biased variance), the
    same as ``torch.nn.functional.layer_norm(x, (hidden,), weight, bias, eps)``.

    Args:
        x: input of shape ``(..., hidden)``; float32, bfloat16 or float16 (float64 runs the
            fallback on any device). Any strides.
        weight: shape ``(hidden,)``, floating point, on the device of ``x``. Required (for no
            affine transform use ``torch.nn.functional.layer_norm``).
        bias: None, or shape ``(hidden,)``, floating point, on the device of ``x``.
        eps: added to the variance before the square root.

    Returns:
        A tensor of the shape and dtype of ``x``.
    """
    check_float("x", x)
    if weight is None:
        raise TypeError(
            "weight is required (shape (hidden,)); for a layer norm without affine parameters use "
            "torch.nn.functional.layer_norm(x, (hidden,), None, None, eps)"
        )
    check_float("weight", weight)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the one normalised), got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match the last dimension of x "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if bias is not None:
        check_float("bias", bias)
        if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
            raise ValueError(
                f"bias must have shape ({x.shape[-1]},) to match the last dimension of x "
                f"{tuple(x.shape)}, got {tuple(bias.shape)}; or pass bias=None"
            )
    eps = check_nonneg_number("eps", eps)
    if _dtensor.any_dtensor(x, weight, bias):
        return _dtensor.rowwise(
            lambda x, w, b: layer_norm(x, w, b, eps), [("x", x)], [("weight", weight), ("bias", bias)]
        )
    if bias is not None:
        device = same_device(x=x, weight=weight, bias=bias)
    else:
        device = same_device(x=x, weight=weight)
    dev = _kernel_device(_layer_norm_ops, device, x, True)
    if dev is None:
        return fallback.layer_norm(x, weight, bias, eps)
    y = _layer_norm_ops.layer_norm(
        _rows(x, alias=False), weight.contiguous(), None if bias is None else bias.contiguous(), eps, dev
    )
    return y if x.dim() == 2 else y.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and its RMSNorm in one pass: the pre-norm residual step of a decoder layer
    (Hugging Face: ``residual = residual + hidden; hidden = norm(residual)``).

    The sum is added in fp32 and rounded to ``x.dtype``, and the normalisation reads that rounded
    sum, so the result is that of ``s = x + residual; rms_norm(s, weight, eps, ...)``.

    Args:
        x, residual: inputs of one shape ``(..., hidden)`` and one floating dtype (float32,
            bfloat16 or float16 run the kernels; float64 runs the fallback on any device). Any strides.
        weight, eps, offset, casting_mode: as in :func:`rms_norm`.

    Returns:
        ``(normed, s)``, both of the shape and dtype of ``x``. Gradients may reach both; ``x`` and
        ``residual`` receive the same gradient.
    """
    check_float("x", x)
    check_float("residual", residual)
    check_float("weight", weight)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the one normalised), got a scalar")
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}; "
            "expand or reshape it first"
        )
    if residual.dtype != x.dtype:
        raise TypeError(
            f"residual must have the dtype of x ({x.dtype}), got {residual.dtype}; "
            "convert it, e.g. residual.to(x.dtype)"
        )
    eps = _check_rms_norm_args(x, weight, eps, offset, casting_mode)
    if _dtensor.any_dtensor(x, residual, weight):
        return _dtensor.rowwise(
            lambda x, r, w: fused_add_rms_norm(x, r, w, eps, offset=offset, casting_mode=casting_mode),
            [("x", x), ("residual", residual)], [("weight", weight)],
        )
    dev = _kernel_device(_rms_norm_ops, same_device(x=x, residual=residual, weight=weight), x, True)
    if dev is None:
        return fallback.fused_add_rms_norm(x, residual, weight, eps, float(offset), casting_mode)
    y, s = _rms_norm_ops.fused_add_rms_norm(
        _rows(x, alias=False), _rows(residual, alias=False), weight.contiguous(), eps, float(offset),
        casting_mode == "gemma", dev,
    )
    return (y, s) if x.dim() == 2 else (y.view(x.shape), s.view(x.shape))


def _glu(act: str, a: torch.Tensor, b: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
    check_float("a", a)
    check_float("b", b)
    if b.shape != a.shape:
        raise ValueError(
            f"b must have the shape of a {tuple(a.shape)} (the product is elementwise, without "
            f"broadcasting), got {tuple(b.shape)}"
        )
    if b.dtype != a.dtype:
        raise TypeError(f"b has dtype {b.dtype} but a has {a.dtype}; cast one of them, e.g. b.to(a.dtype)")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be True or False, got {inplace_backward!r}")
    if inplace_backward and a.dim() > 0 and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        _check_private(a, b)  # wherever it runs (the fallback too): the mistake shows on the CPU, not first on a GPU
    dev = None if a.dim() == 0 or _dtensor_fallback("swiglu" if act == "silu" else "geglu", a, b) else _kernel_device(
        _glu_ops, same_device(a=a, b=b), a, True)
    if dev is None:
        return (fallback.swiglu if act == "silu" else fallback.geglu)(a, b)
    # In place, the backward hands the gradients back in the storage of a and b: pass them as views.
    c = _glu_ops.glu(_rows(a, inplace_backward), _rows(b, inplace_backward), act, inplace_backward, dev)
    return c if c.shape == a.shape else c.view(a.shape)


def _check_private(a: torch.Tensor, b: torch.Tensor) -> None:
    """The in-place backward writes the gradients over ``a`` and ``b``: refuse storage that belongs
    to a leaf tensor that requires grad (a parameter, or an input the caller made), or a view of
    one, whose values would silently become gradients. (Where ``a`` and ``b`` overlap, the
    backward is not in place and nothing is written over them; judged on the rows the kernel
    gets, where the kernels are installed.)"""
    for name, t in (("a", a), ("b", b)):
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad and _glu_ops is not None and _glu_ops.can_write_in_place(_rows(a), _rows(b)):
            what = "a leaf tensor that requires grad" if base is t else "a view of a leaf tensor that requires grad"
            raise ValueError(
                f"inplace_backward=True writes the gradients into the storage of a and b, but {name} is "
                f"{what} (a parameter or an input you created): its values would be overwritten. Pass "
                "inplace_backward=False, or activations the call owns (e.g. a = gate_proj(x))."
            )


def glu_down(
    act: str, a: torch.Tensor, b: torch.Tensor, down: torch.nn.Module
) -> torch.Tensor | None:
    """``down(act(a) * b)`` without keeping ``act(a) * b`` for the backward, or None where that
    fusion does not apply and the caller runs the modules as they are: no gradient to compute, not
    the Triton kernels' device or dtype, under autocast, a ``down`` that is not a plain
    ``nn.Linear`` (a LoRA wrapper, a subclass) or has hooks, DTensor weights, or weights of another
    dtype than ``a``. Used by the MLP modules, whose ``a`` and ``b`` are private.

    Under torch.compile the product is put inside an activation-checkpoint region
    (``torch.utils.checkpoint``): the compiler's partitioner then recomputes it in the backward, as
    the eager path does, instead of saving a (tokens x intermediate) tensor per layer (it would not
    recompute a custom op of its own accord). Where our kernels run, the product is our kernel op
    ``ops.glu.glu_product_op`` and its gradients Inductor's (so the compiled backward peaks at the
    eager path's memory: see that op), or with ``UNDER_COMPILE = "kernels"`` ``ops.glu.glu_op``
    (our backward kernel too); elsewhere it is the PyTorch formula."""
    weight, bias = getattr(down, "weight", None), getattr(down, "bias", None)
    if (
        type(down) is not torch.nn.Linear
        or not torch.is_grad_enabled()
        or down._forward_hooks or down._forward_pre_hooks or down._backward_hooks or down._backward_pre_hooks
        or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
        or a.shape != b.shape or a.dtype != b.dtype or weight.dtype != a.dtype
        or (bias is not None and bias.dtype != a.dtype)
        or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in (a, b, weight) + ((bias,) if bias is not None else ()))
        or not (a.requires_grad or b.requires_grad or weight.requires_grad)
        or a.device != weight.device
        or torch.is_autocast_enabled(a.device.type)
    ):
        return None
    dev = _kernel_device(_glu_ops, a.device, a)
    if torch.compiler.is_compiling():
        if dev is None:
            product = fallback.swiglu if act == "silu" else fallback.geglu
        else:
            op = _glu_ops.glu_op if UNDER_COMPILE == "kernels" else _glu_ops.glu_product_op

            def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return op(_rows(a), _rows(b), act).view(a.shape)
        return torch.nn.functional.linear(_checkpoint(product, a, b, use_reentrant=False), weight, bias)
    if dev is None:
        return None
    out = _mlp_ops.glu_down(_rows(a), _rows(b), weight, bias, act, dev)
    return out.view(*a.shape[:-1], weight.shape[0])


def swiglu(a: torch.Tensor, b: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """SwiGLU activation product: ``silu(a) * b`` with ``silu(a) = a * sigmoid(a)``.

    In an MLP, ``a = gate_proj(x)`` and ``b = up_proj(x)`` (Hugging Face's LlamaMLP computes
    ``act_fn(gate_proj(x)) * up_proj(x)``; this is that product fused, with the same rounding of
    the intermediates in the input dtype). The backward recomputes ``silu(a)`` instead of storing it.

    Args:
        a: gate input, shape ``(..., n)``; float32, bfloat16 or float16 (float64 runs the
            fallback on any device). Any strides; a last-dim-contiguous view is not copied.
        b: up input, the shape, dtype and device of ``a``.
        inplace_backward: if True, the backward writes the gradients into the storage of ``a`` and
            ``b`` (``a`` becomes ``da``, ``b`` becomes ``db``) instead of allocating them: two
            fewer tensors of this size at the peak. Only for a caller that owns ``a`` and ``b``:
            they must not be used after the backward, and only one backward is allowed (no
            ``retain_graph``). Ignored where it cannot apply: on the CPU fallback, under
            torch.compile, and when ``a`` and ``b`` overlap in memory. Refused (``ValueError``)
            when ``a`` or ``b`` is a leaf tensor that requires grad, or a view of one (``x.unbind(0)``
            of a parameter or an input): the gradients would overwrite its values.

    Returns:
        A tensor of the shape and dtype of ``a``.
    """
    return _glu("silu", a, b, inplace_backward)


def geglu(a: torch.Tensor, b: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """GeGLU activation product with the tanh-approximate GELU: ``gelu_tanh(a) * b`` with
    ``gelu_tanh(a) = 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``, which is Hugging Face's
    ``gelu_pytorch_tanh`` (GemmaMLP) and ``torch.nn.functional.gelu(a, approximate="tanh")``.

    Arguments and return value as :func:`swiglu`, including ``inplace_backward`` (when True,
    ``a`` and ``b`` are overwritten by their gradients during the backward and must not be used
    afterwards).
    """
    return _glu("gelu_tanh", a, b, inplace_backward)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding, Hugging Face's ``apply_rotary_pos_emb`` (rotate-half convention).

    ``q_embed = q * cos + rotate_half(q) * sin`` (and the same for k), where
    ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])`` and cos/sin are unsqueezed at
    ``unsqueeze_dim`` to broadcast over the heads.

    Args:
        q: queries, ``(batch, heads, seq, head_dim)`` for ``unsqueeze_dim=1`` or
            ``(batch, seq, heads, head_dim)`` for ``unsqueeze_dim=2``; float32, bfloat16 or float16
            (float64 runs the fallback). Any strides: Hugging Face's
            ``view(B, S, H, D).transpose(1, 2)`` is read through its strides without a copy (only a
            last dimension with a stride other than 1 is copied). head_dim must be even.
        k: keys, laid out like q with the same batch, seq and head_dim; it may have fewer heads
            (grouped-query attention).
        cos, sin: ``(1 or batch, seq_cos, head_dim)`` with ``seq_cos >= seq``; only the first
            ``seq`` positions are used (Hugging Face needs ``seq_cos == seq``). They get no gradient.
        position_ids: accepted for compatibility with Hugging Face's signature and ignored, as
            there (cos/sin already hold the positions).
        unsqueeze_dim: 1 or 2, the heads dimension of q and k.

    Returns:
        ``(q_embed, k_embed)``: new tensors of the shapes and dtypes of q and k (the inputs are not
        modified), laid out in the memory order of q and k (same strides when q and k are dense,
        as eager PyTorch gives). Computed in fp32 and rounded once; Hugging Face's bf16/fp16 eager
        code rounds after each product, so results differ from it by about one rounding step.
        Each output has its input's dtype even when cos/sin are wider (Hugging Face would promote).
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    check_choice("unsqueeze_dim", unsqueeze_dim, (1, 2))
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            layout = "(batch, heads, seq, head_dim)" if unsqueeze_dim == 1 else "(batch, seq, heads, head_dim)"
            raise ValueError(f"{name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}, got shape {tuple(t.shape)}")
    head_dim = q.shape[-1]
    if head_dim % 2:
        raise ValueError(f"q must have an even head_dim (its last dimension), got {head_dim}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have the head_dim of q ({head_dim}), got {k.shape[-1]} (shape {tuple(k.shape)})")
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    batch, seq = q.shape[0], q.shape[seq_dim]
    if k.shape[0] != batch:
        raise ValueError(f"k must have the batch size of q ({batch}), got {k.shape[0]} (shape {tuple(k.shape)})")
    if k.shape[seq_dim] != seq:
        raise ValueError(
            f"k must have the sequence length of q ({seq}, dimension {seq_dim} for unsqueeze_dim={unsqueeze_dim}), "
            f"got {k.shape[seq_dim]} (shape {tuple(k.shape)})"
        )
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[2] != head_dim:
        batches = "1" if batch == 1 else f"1 or {batch}"
        raise ValueError(
            f"cos must have shape ({batches}, >= {seq}, {head_dim}) (batch, seq, head_dim), got {tuple(cos.shape)}"
        )
    if cos.shape[1] < seq:
        raise ValueError(f"cos must cover at least the {seq} positions of q, got {cos.shape[1]} (shape {tuple(cos.shape)})")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    device = same_device(q=q, k=k, cos=cos, sin=sin)
    dev = None if _dtensor_fallback("rope", q, k, cos, sin, position_ids) else _kernel_device(_rope_ops, device, q, True)
    if dev is None or _kernel_device(_rope_ops, device, k) is None:
        return fallback.rope(q, k, cos, sin, position_ids, unsqueeze_dim)
    if cos.shape[1] != seq:
        cos, sin = cos[:, :seq], sin[:, :seq]
    if unsqueeze_dim == 1:
        return _rope_ops.rope(q, k, cos, sin, dev)
    q_embed, k_embed = _rope_ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, dev)
    return q_embed.transpose(1, 2), k_embed.transpose(1, 2)


def _check_target(target: torch.Tensor, shape: torch.Size, what: str) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold class indices as torch.int64 (or torch.int32), got {target.dtype}; "
            "convert it, e.g. target.long() (probabilities as targets are not supported)"
        )
    if target.shape != shape:
        raise ValueError(f"target must have shape {tuple(shape)} ({what}), got {tuple(target.shape)}")


def _check_ignore_index_fits(target: torch.Tensor, ignore_index: int) -> None:
    """An int32 target compares with an ``ignore_index`` beyond int32 after wrapping it (2**32
    equals class 0): refused rather than ignoring the wrong rows."""
    if target.dtype == torch.int32 and not -(2**31) <= ignore_index < 2**31:
        raise ValueError(
            f"ignore_index={ignore_index} is outside the range of target's dtype torch.int32; pass int64 "
            "targets (target.long()) or an ignore_index within int32"
        )


def _loss_result(loss: torch.Tensor, z: torch.Tensor | None, target: torch.Tensor, reduction: str, return_z_loss: bool):
    """Shape the kernels' (loss, z-loss) as the public functions return them."""
    if reduction == "none":
        loss = loss.view(target.shape)
        z = None if z is None else z.view(target.shape)
    if not return_z_loss:
        return loss
    return loss, z if z is not None else torch.zeros_like(loss)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    loss_dtype: torch.dtype | None = None,
):
    """Cross-entropy of class scores against class indices, with Liger-Kernel's options; loss and
    gradient are computed in one pass over the logits (the gradient is kept for the backward).

    Row loss (``V`` classes, ``eps = label_smoothing``, ``z = softcap * tanh(logits / softcap)``
    with ``softcap``, else the logits)::

        lse = logsumexp(z);  loss = lse - (1 - eps) z[target] - eps/V sum(z) + lse_square_scale * lse**2

    which is ``torch.nn.functional.cross_entropy(z, target, label_smoothing=eps)`` per row plus the
    z-loss.

    Args:
        logits: ``(..., V)`` (the class dimension is the last one, as a language model's logits;
            unlike torch's ``(N, C, d1, ...)``); float32, bfloat16 or float16 run the kernel,
            float64 runs the fallback. Any strides.
        target: class indices of shape ``logits.shape[:-1]``, int64 or int32. A value outside
            ``[0, V)`` other than ``ignore_index`` raises on the CPU; on a GPU it gives a NaN loss
            (and gradient) for its row, checked without a host sync.
        ignore_index: rows with this target contribute 0 to the loss and get a zero gradient, and
            ``mean`` does not count them.
        reduction: ``"mean"`` (over non-ignored rows; if every row is ignored the loss is 0.0 with
            zero gradients, where torch gives NaN), ``"sum"`` or ``"none"`` (per-row losses of
            ``target``'s shape).
        label_smoothing: ``eps`` in [0, 1], as torch defines it (``eps/V`` to every class).
        lse_square_scale: the z-loss weight (PaLM): ``lse_square_scale * lse**2`` is added to each
            row's loss.
        softcap: Gemma-2's logit cap (e.g. 30.0): the logits pass through
            ``softcap * tanh(logits / softcap)`` first; None for none.
        return_z_loss: also return the z-loss part (already included in the loss), reduced like
            the loss; not differentiable (it is for logging).
        inplace_backward: write the gradient over ``logits`` during the forward instead of a new
            tensor: no memory beyond the logits themselves (Liger-Kernel always does this). Only
            for a caller that owns the logits: after the call they hold the gradient, not the
            logits, and backward can run once. Ignored under torch.compile, on the CPU path and
            where rows of ``logits`` share memory (an expanded tensor).
        loss_dtype: the dtype of the returned loss (and z-loss): None for the logits dtype, as
            torch's; ``torch.float32`` keeps the float32 sums the loss is computed in (Hugging
            Face's loss of bf16 logits, which it upcasts first, without a float32 copy of them).

    Returns:
        The loss in ``loss_dtype`` (a scalar, or per-row for ``"none"``); ``(loss, z_loss)`` with
        ``return_z_loss``. Only one backward is allowed (the gradient computed in the forward is
        scaled in place; the fallback keeps the rule): use ``torch.nn.functional.cross_entropy``
        for ``retain_graph=True``.
    """
    check_float("logits", logits)
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dimension (the classes, last), got a scalar")
    _check_target(target, logits.shape[:-1], "logits.shape[:-1]: one class index per row of logits")
    label_smoothing, lse_square_scale, softcap, ignore_index = check_ce_options(
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss
    )
    _check_ignore_index_fits(target, ignore_index)
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be True or False, got {inplace_backward!r}")
    if loss_dtype is not None and loss_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"loss_dtype must be None (the logits dtype) or a floating-point torch.dtype, got {loss_dtype!r}")
    device = same_device(logits=logits, target=target)
    n_classes = logits.shape[-1]
    if n_classes == 0:
        raise ValueError("logits must have at least one class (its last dimension is 0)")
    check_class_range("target", target, n_classes, ignore_index)
    if not torch.is_grad_enabled():
        logits = logits.detach()  # no gradient wanted: none computed (a Function sees requires_grad only)
    dev = None if _dtensor_fallback("cross_entropy", logits, target) else _kernel_device(_ce_ops, device, logits)
    if dev is None:
        return fallback.cross_entropy(
            logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss,
            loss_dtype,
        )
    rows = _rows(logits, inplace_backward)
    if inplace_backward and rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:
        inplace_backward = False  # rows that share memory (an expanded tensor): one row's gradient would overwrite another's logits
    loss, z = _ce_ops.cross_entropy(
        rows, _flat(target), ignore_index, label_smoothing, lse_square_scale, softcap, reduction, inplace_backward, dev,
        loss_dtype,
    )
    return _loss_result(loss, z, target, reduction, return_z_loss)


def check_flce_args(
    hidden, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss,
    chunk_mib,
):
    """The argument checks of :func:`fused_linear_cross_entropy` (also run by the losses built on its
    kernels): an error naming the argument, or ``(label_smoothing, lse_square_scale, softcap,
    ignore_index, chunk_mib, device)`` as Python numbers and the tensors' common device."""
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() == 0:
        raise ValueError("hidden must have at least one dimension (the hidden size, last), got a scalar")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, {hidden.shape[-1]}) (nn.Linear's (out, in) layout; its second "
            f"dimension is hidden's last {hidden.shape[-1]}), got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; cast one, e.g. weight.to(hidden.dtype)")
    tensors = {"hidden": hidden, "weight": weight, "target": target}
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (one per class), got {tuple(bias.shape)}; or pass bias=None")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias has dtype {bias.dtype} but hidden has {hidden.dtype}; cast it, e.g. bias.to(hidden.dtype)")
        tensors["bias"] = bias
    _check_target(target, hidden.shape[:-1], "hidden.shape[:-1]: one class index per token")
    label_smoothing, lse_square_scale, softcap, ignore_index = check_ce_options(
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss
    )
    _check_ignore_index_fits(target, ignore_index)
    device = same_device(**tensors)
    chunk_mib = check_chunk_mib(chunk_mib)
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one class (its first dimension is 0)")
    if hidden.shape[-1] == 0:
        raise ValueError(
            f"hidden must have a non-empty last dimension (the hidden size), got shape {tuple(hidden.shape)}"
        )
    check_class_range("target", target, weight.shape[0], ignore_index)
    return label_smoothing, lse_square_scale, softcap, ignore_index, chunk_mib, device


def flce_kernel_device(hidden: torch.Tensor, device: torch.device):
    """The :class:`~liger_portable.DeviceInfo` the fused linear cross-entropy's kernels run ``hidden``
    with (on ``device``), or None: the fallback (a DTensor ``hidden`` too)."""
    if _dtensor.any_dtensor(hidden):
        return None
    return _kernel_device(_flce_ops, device, hidden)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    chunk_mib: int | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without materialising the logits:
    the tokens are processed in chunks (by default about the device table's ``CHUNK_TOKENS``,
    within a memory budget of the weight gradient's size; or ``chunk_mib``), and the gradients of
    hidden, weight and bias are computed chunk by chunk in the forward.

    Args:
        hidden: ``(..., H)`` last hidden states; float32, bfloat16 or float16 (float64 runs the
            fallback).
        weight: ``(V, H)``, as ``nn.Linear(H, V).weight`` (the LM head); same dtype and device.
        target: class indices of shape ``hidden.shape[:-1]``, int64 or int32.
        bias: None or ``(V,)``, same dtype and device.
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss: as
            :func:`cross_entropy`. ``reduction="none"`` recomputes the logits in the backward (one
            more ``BT x H x V`` product; the same memory). In float16 with gradients, an
            ``lse_square_scale`` above about 1.1e-4 (with a softcap, above about
            ``7.5 / (softcap + log V)``) runs the PyTorch fallback, with a warning: the kernels'
            scaled float16 logit gradients could overflow.
        chunk_mib: MiB of logits per token chunk, the memory the op needs beyond the gradients
            (None: the device table's ``CHUNK_TOKENS`` tokens, set where reading and writing
            grad_weight once per chunk costs a small part of the chunk's matmuls; more where they
            take under 256 MiB of logits, fewer where they would take more than the weight
            gradient: see ``ops.fused_linear_cross_entropy.default_chunk_rows``). Each chunk reads and writes all of
            grad_weight once, so a larger chunk is faster for the memory it takes (the measured
            trade-off is in the results log). On the CPU fallback it is the MiB of float32 logits
            per chunk.

    Returns:
        The loss in float32 (float64 for float64 inputs; as Hugging Face's loss from upcast
        logits); ``(loss, z_loss)`` with ``return_z_loss``. Only one backward
        is allowed for ``mean`` / ``sum`` (the stored gradients are scaled in place; the
        fallback keeps the rule).
    """
    label_smoothing, lse_square_scale, softcap, ignore_index, chunk_mib, device = check_flce_args(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        return_z_loss, chunk_mib,
    )
    if not torch.is_grad_enabled():  # no gradient wanted (an evaluation loop): none computed or stored
        hidden, weight, bias = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
    dev = None if _dtensor_fallback("fused_linear_cross_entropy", hidden, weight, target, bias) else _kernel_device(
        _flce_ops, device, hidden)
    if (
        dev is not None and hidden.dtype == torch.float16 and lse_square_scale != 0.0
        and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        and not _flce_ops.half_grads_fit(lse_square_scale, softcap, weight.shape[0])
    ):
        if not torch.compiler.is_compiling():  # (a warning would break the graph)
            warn(
                f"fused_linear_cross_entropy: float16 with lse_square_scale={lse_square_scale} could overflow "
                "the kernels' float16 logit gradients; running the PyTorch fallback (slower, exact). bfloat16 "
                "inputs, lse_square_scale <= 1e-4, or a softcap below 7.5 / lse_square_scale - log(V) keep the kernels.",
            )
        dev = None
    if dev is None:
        return fallback.fused_linear_cross_entropy(
            hidden, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale,
            softcap, return_z_loss, chunk_mib,
        )
    loss, z = _flce_ops.fused_linear_cross_entropy(
        _rows(hidden, alias=False), weight, _flat(target), bias, ignore_index, label_smoothing,
        lse_square_scale, softcap, reduction, chunk_mib, dev,
    )
    return _loss_result(loss, z, target, reduction, return_z_loss)
