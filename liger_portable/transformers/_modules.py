"""The pieces a Hugging Face model is patched with: norms, MLPs and functions with the
constructor or call signature of the Hugging Face code they replace, built on
:mod:`liger_portable.nn` and :mod:`liger_portable.functional`."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .. import functional as F
from ..nn import GEGLUMLP, RMSNorm, SwiGLUMLP

__all__ = [
    "GemmaStyleRMSNorm",
    "GEGLUMLP",
    "Phi3SwiGLUMLP",
    "RMSNorm",
    "SwiGLUMLP",
    "experts_apply_gate",
    "rotary_pos_emb",
    "partial_rotary_pos_emb",
]

#: Activation names (the config's ``hidden_act`` / ``hidden_activation``) each fused product computes.
SWIGLU_ACTS = SwiGLUMLP._ACTS
GEGLU_ACTS = GEGLUMLP._ACTS


class GemmaStyleRMSNorm(RMSNorm):
    """Drop-in for Hugging Face's ``GemmaRMSNorm`` (also Gemma-2 and Gemma-3):
    ``x / rms(x) * (1 + weight)`` all in fp32, cast once; the weight is stored minus one and
    starts at zeros. Same constructor ``(dim, eps)`` and ``state_dict``; the epsilon is also
    readable as ``eps``, Hugging Face's name for it there."""

    def __init__(self, dim: int, eps: float = 1e-6, **kwargs) -> None:
        super().__init__(dim, eps, offset=1.0, casting_mode="gemma", init="zeros", **kwargs)

    @property
    def eps(self) -> float:
        return self.variance_epsilon


class Phi3SwiGLUMLP(nn.Module):
    """Drop-in for Hugging Face's ``Phi3MLP``: one fused ``gate_up_proj`` (``nn.Linear(hidden,
    2 * intermediate)``, gate rows first), split in two halves, then
    ``down_proj(silu(gate) * up)`` with the product fused. Same attributes and ``state_dict``."""

    def __init__(self, config) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", None)
        if act is not None and act not in SWIGLU_ACTS:
            raise ValueError(
                f"config.hidden_act is {act!r} but Phi3SwiGLUMLP computes 'silu'; keep the model's MLP (swiglu=False)"
            )
        self.config = config
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        # gate and up are the two halves of a tensor private to this call: the backward may
        # write their gradients over them.
        return self.down_proj(F.swiglu(gate, up, inplace_backward=True))


# The activation modules transformers builds for the names SwiGLU computes (``ACT2FN[name]``).
_SILU_TYPES = tuple({type(ACT2FN[name]) for name in SWIGLU_ACTS} | {nn.SiLU})


def experts_apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused-experts layout (transformers 5 ``MixtralExperts``: the
    gate and up halves of ``gate_up_out`` concatenated on the last dimension), fused. Bound as
    the experts module's ``_apply_gate``, which Hugging Face's grouped and batched experts
    implementations call. Experts whose activation is not SiLU (a model built with another
    ``hidden_act`` after ``apply_liger_kernel_to_mixtral()``) get their own product, unfused."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    if not isinstance(self.act_fn, _SILU_TYPES):
        return self.act_fn(gate) * up
    return F.swiglu(gate, up)


def rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, fused."""
    return F.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def partial_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
):
    """Phi-3's ``apply_rotary_pos_emb``: the rotation applies to the first ``cos.shape[-1]``
    dimensions of each head (``partial_rotary_factor`` < 1); the rest pass through."""
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return F.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    q_rot, k_rot = F.rope(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim=unsqueeze_dim)
    return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)
