"""Modules, drop-in replacements for their ``torch.nn`` / Hugging Face counterparts."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as F
from .chunked_loss import (  # the fused linear preference losses, under liger-kernel's names
    LigerFusedLinearCPOLoss,
    LigerFusedLinearDPOLoss,
    LigerFusedLinearGRPOLoss,
    LigerFusedLinearJSDLoss,
    LigerFusedLinearKTOLoss,
    LigerFusedLinearORPOLoss,
    LigerFusedLinearSimPOLoss,
)
from ._checks import check_ce_options, check_choice, check_chunk_mib, check_nonneg_number, check_real

__all__ = [
    "RMSNorm",
    "LayerNorm",
    "SwiGLUMLP",
    "GEGLUMLP",
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOLoss",
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearKTOLoss",
    "LigerFusedLinearGRPOLoss",
    "LigerFusedLinearJSDLoss",
]


class RMSNorm(nn.Module):
    """Drop-in for Hugging Face's ``LlamaRMSNorm``: same ``weight`` parameter, same
    ``variance_epsilon`` attribute, same ``state_dict``. The output has the input's dtype (as
    Liger-Kernel's), also where the weight's differs: Hugging Face's promotes a bf16 input times an
    fp32 weight to fp32.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        offset: added to the weight in the product (Gemma: ``1.0`` with ``init="zeros"``).
        casting_mode: ``"llama"`` or ``"gemma"`` (see :func:`liger_portable.functional.rms_norm`).
        init: ``"ones"`` (Llama) or ``"zeros"`` (Gemma, whose weight is stored minus one).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting_mode: str = "llama",
        init: str = "ones",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if init not in ("ones", "zeros"):
            raise ValueError(f"init must be 'ones' or 'zeros', got {init!r}")
        # checked here, not first at the first forward
        check_choice("casting_mode", casting_mode, F.CASTING_MODES)
        eps = check_nonneg_number("eps", eps)
        offset = check_real("offset", offset)
        fill = torch.ones if init == "ones" else torch.zeros
        self.weight = nn.Parameter(fill(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(
            hidden_states, self.weight, self.variance_epsilon, offset=self.offset, casting_mode=self.casting_mode
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, casting_mode={self.casting_mode!r}"


class LayerNorm(nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dimension: a subclass with the same
    arguments, attributes (``normalized_shape``, ``eps``, ``elementwise_affine``, ``weight``,
    ``bias``), initialisation and ``state_dict``, so ``isinstance(m, torch.nn.LayerNorm)`` holds.

    Args:
        normalized_shape: the hidden size, an int or a 1-tuple (one normalised dimension only).
        eps: added to the variance.
        elementwise_affine: learnable ``weight`` (and ``bias``); without them the module runs
            ``torch.nn.functional.layer_norm``.
        bias: learnable bias (when ``elementwise_affine``).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        shape = (normalized_shape,) if hasattr(normalized_shape, "__index__") else normalized_shape
        if (
            not isinstance(shape, (tuple, list, torch.Size))
            or len(shape) != 1
            or isinstance(shape[0], bool)
            or not hasattr(shape[0], "__index__")
        ):
            raise ValueError(
                f"normalized_shape must be an int or a 1-tuple (the last dimension only), got "
                f"{normalized_shape!r}; to normalise over several trailing dimensions use torch.nn.LayerNorm"
            )
        super().__init__((shape[0].__index__(),), eps, elementwise_affine, bias, device=device, dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return nn.functional.layer_norm(input, self.normalized_shape, None, None, self.eps)
        return F.layer_norm(input, self.weight, self.bias, self.eps)


class _GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the activation product fused."""

    _ACTS: tuple[str, ...] = ()

    def __init__(self, config) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act is not None and act not in self._ACTS:
            raise ValueError(
                f"config.hidden_act is {act!r} but {type(self).__name__} computes "
                f"{' / '.join(map(repr, self._ACTS))}; use the module of that activation"
            )
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"


class SwiGLUMLP(_GatedMLP):
    """Drop-in for Hugging Face's ``LlamaMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Same attributes (``gate_proj``, ``up_proj``, ``down_proj`` as ``nn.Linear`` with
    ``bias=config.mlp_bias`` (default False), ``hidden_size``, ``intermediate_size``) and the same
    ``state_dict`` keys. ``config`` is any object with ``hidden_size`` and ``intermediate_size``
    (a transformers config works; ``hidden_act``, if present, must be ``"silu"``).

    The gate and up activations are private to the module, so the backward writes their gradients
    into their storage (``inplace_backward=True``). With the Triton kernels, in eager training, the
    product is not kept for the backward either: ``down_proj`` runs inside one autograd function
    whose backward recomputes it (one tokens x intermediate tensor less per layer); under
    torch.compile the product sits in an activation-checkpoint region, which the compiler
    recomputes in the backward. Where that does not apply (``down_proj`` wrapped or hooked,
    autocast, the CPU fallback in eager mode) the modules run as written above, with the same results.
    """

    _ACTS = ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.gate_proj(x), self.up_proj(x)
        out = F.glu_down("silu", a, b, self.down_proj)
        return out if out is not None else self.down_proj(F.swiglu(a, b, inplace_backward=True))


class GEGLUMLP(_GatedMLP):
    """Drop-in for Hugging Face's ``GemmaMLP``: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``
    with the tanh-approximate GELU (``gelu_pytorch_tanh``).

    Attributes, ``state_dict`` and the in-place backward as :class:`SwiGLUMLP`. ``config``'s
    ``hidden_activation`` (else ``hidden_act``), if present, must name the tanh approximation
    (``"gelu_pytorch_tanh"``, ``"gelu_tanh"``, ``"gelu_new"`` or ``"gelu_fast"``, which are one formula).
    """

    _ACTS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.gate_proj(x), self.up_proj(x)
        out = F.glu_down("gelu_tanh", a, b, self.down_proj)
        return out if out is not None else self.down_proj(F.geglu(a, b, inplace_backward=True))


class _LossOptions(nn.Module):
    """The cross-entropy options shared by the two loss modules, checked at construction."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        return_z_loss: bool = False,
    ) -> None:
        super().__init__()
        check_ce_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.return_z_loss = return_z_loss

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}"
            + (", return_z_loss=True" if self.return_z_loss else "")
        )


class CrossEntropyLoss(_LossOptions):
    """Cross-entropy over the last dimension of the logits with Liger-Kernel's options; see
    :func:`liger_portable.functional.cross_entropy`. ``forward(logits, target)`` returns the loss,
    or ``(loss, z_loss)`` with ``return_z_loss``. The attributes ``ignore_index``, ``reduction`` and
    ``label_smoothing`` are named as in ``torch.nn.CrossEntropyLoss``."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        return_z_loss: bool = False,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
        self.inplace_backward = inplace_backward

    def extra_repr(self) -> str:
        return super().extra_repr() + (", inplace_backward=True" if self.inplace_backward else "")

    def forward(self, logits: torch.Tensor, target: torch.Tensor):
        return F.cross_entropy(
            logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale, softcap=self.softcap,
            return_z_loss=self.return_z_loss, inplace_backward=self.inplace_backward,
        )


class FusedLinearCrossEntropyLoss(_LossOptions):
    """Fused LM head + cross-entropy without materialising the logits; see
    :func:`liger_portable.functional.fused_linear_cross_entropy`. No parameters of its own:
    ``forward(lm_head_weight, hidden, target, bias=None)`` in Liger-Kernel's argument order
    returns the loss, or ``(loss, z_loss)`` with ``return_z_loss``. ``chunk_mib`` trades memory for
    speed (None: the default chunk, see there)."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        return_z_loss: bool = False,
        chunk_mib: int | None = None,
    ) -> None:
        super().__init__(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
        self.chunk_mib = check_chunk_mib(chunk_mib)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.chunk_mib is None else f", chunk_mib={self.chunk_mib}")

    def forward(self, lin_weight: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None):
        return F.fused_linear_cross_entropy(
            hidden, lin_weight, target, bias, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale, softcap=self.softcap,
            return_z_loss=self.return_z_loss, chunk_mib=self.chunk_mib,
        )
