"""``XForCausalLM.forward`` with the loss computed by liger_portable.

The semantics are those of Hugging Face's causal-LM forward (transformers 5.x): every keyword
argument reaches the base model (as there), the labels are shifted by one with ``ignore_index``
padding (or ``shift_labels`` is used as given), and with ``num_items_in_batch`` (passed by the
Trainer under gradient accumulation) the loss is the sum over tokens divided by it, as
``ForCausalLMLoss`` does. The head-specific transforms of the logits are kept: Gemma-2/3's
``final_logit_softcapping``, Granite's division by ``logits_scaling``, Mixtral's router auxiliary
loss.

Two loss modes:

* ``"flce"`` (``fused_linear_cross_entropy=True``): in training mode with labels, the loss is
  :func:`liger_portable.functional.fused_linear_cross_entropy` of the last hidden states and the
  LM head; the logits are never built and the output's ``logits`` is None (as with
  Liger-Kernel). In eval mode, or without labels, the logits are built as usual (evaluation and
  generation need them) and a loss, if labels are given, is the fused cross-entropy of those logits.
  So is the loss of an LM head that is not a plain ``nn.Linear`` (a LoRA wrapper, a subclass), that
  has hooks or whose instance ``forward`` was replaced (accelerate's hooks): the fused loss reads
  the head's weight and would leave them out. Under autocast, a head whose dtype differs from the
  hidden states' (a float32 head in a bf16 model) enters the fused loss in autocast's dtype, as
  autocast hands it to ``nn.Linear``.
* ``"ce"`` (``cross_entropy=True``): the logits are built as usual and the loss is
  :func:`liger_portable.functional.cross_entropy` of them.

A loss the user set on the model (``model.loss_function = fn``, Hugging Face's way to replace it)
is honoured in both modes: the logits are built and ``fn`` computes the loss, as there.

The loss is returned in float32 like Hugging Face's: the kernels sum it in float32 and hand it
back so (the logits, where built, are not copied to float32 for it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from torch.nn.modules import module as _nn_module

from .. import functional as F
from . import _mask

try:  # transformers >= 4.50
    from transformers.utils import can_return_tuple
except ImportError:  # pragma: no cover - older transformers
    def can_return_tuple(fn):
        return fn

from transformers import modeling_utils as _hf_modeling_utils
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

LOSS_MODES = ("flce", "ce")
HEADS = ("plain", "softcap", "scaled", "moe")
# The model attribute the fused loss reads its chunk_mib from (None or absent: the device table's).
CHUNK_MIB_ATTR = "liger_portable_chunk_mib"


def fusable_head(head: torch.nn.Module) -> bool:
    """True if the fused loss may stand in for ``head(hidden)``: a plain ``nn.Linear`` without
    hooks (module or global) and with its class's ``forward``. A LoRA wrapper, a subclass, a hook or
    a ``forward`` set on the instance (accelerate's device-map and offload hooks replace it, the
    weight then may be a placeholder on the meta device) changes what the head computes, which
    reading its ``weight`` and ``bias`` would silently leave out."""
    return type(head) is torch.nn.Linear and "forward" not in vars(head) and not (
        head._forward_hooks or head._forward_pre_hooks or head._backward_hooks or head._backward_pre_hooks
        or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
        or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks
    )


def _autocast(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The LM head's inputs as autocast would hand them to its ``nn.Linear``: where autocast is on
    and hidden and weight differ in dtype (a float32 head in a bf16 model), all in autocast's dtype
    (the fused loss takes one dtype); otherwise as they are."""
    device_type = hidden.device.type
    if weight.dtype == hidden.dtype or not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


# transformers releases with ``slice_logits_to_keep`` (after 5.17) read 2-D ``logits_to_keep`` tensors as
# per-row positions or a mask; earlier ones index the positions dimension with any tensor.
PER_ROW_KEEP = hasattr(_hf_modeling_utils, "slice_logits_to_keep")


def _keep(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions Hugging Face's causal-LM forward keeps (``slice_logits_to_keep`` where the
    installed transformers has it): 0 keeps every position, an int ``n`` the last ``n``, a 1-D
    tensor the positions it lists, a 2-D integer tensor per-row positions, a 2-D bool mask the
    positions it marks (flattened). Before ``slice_logits_to_keep``, a 2-D tensor indexes the
    positions dimension as a 1-D one does, as those releases do."""
    if PER_ROW_KEEP and isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    return hidden[:, logits_to_keep, :]


def _targets(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None, device,
             shape: torch.Size) -> torch.Tensor:
    """The next-token targets: ``shift_labels`` if given (of ``shape``, the positions' shape, or as
    many elements), else ``labels`` shifted left by one with ``ignore_index`` at the end (Hugging
    Face's ``ForCausalLMLoss``)."""
    if shift_labels is None:
        padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    elif shift_labels.shape != shape and shift_labels.numel() == math.prod(shape):
        shift_labels = shift_labels.reshape(shape)  # flattened, say: Hugging Face's loss flattens both sides
    return shift_labels.to(device)


def _finish(loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    loss = loss.float()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _flce_loss(hidden, weight, bias, labels, softcap, chunk_mib=None, *, num_items_in_batch=None, ignore_index=-100,
               shift_labels=None, **_):
    target = _targets(labels, ignore_index, shift_labels, hidden.device, hidden.shape[:-1])
    loss = F.fused_linear_cross_entropy(
        hidden, weight, target, bias, ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean", softcap=softcap, chunk_mib=chunk_mib,
    )
    return _finish(loss, num_items_in_batch)


def _ce_loss(logits, labels, *, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
    target = _targets(labels, ignore_index, shift_labels, logits.device, logits.shape[:-1])
    loss = F.cross_entropy(  # a float32 loss, as Hugging Face's of upcast logits (no float32 copy of them)
        logits, target, ignore_index=ignore_index, reduction="sum" if num_items_in_batch is not None else "mean",
        loss_dtype=torch.float32,
    )
    return _finish(loss, num_items_in_batch)


def make_causal_lm_forward(head: str, loss_mode: str, load_balancing_loss_func: Callable | None = None):
    """A ``forward`` for an ``XForCausalLM`` class (or, bound, for one instance).

    Args:
        head: how the family turns the last hidden states into logits: ``"plain"``
            (``lm_head(h)``), ``"softcap"`` (Gemma-2/3: ``c * tanh(lm_head(h) / c)`` with
            ``c = config.final_logit_softcapping`` when it is set), ``"scaled"`` (Granite:
            ``lm_head(h) / config.logits_scaling``), ``"moe"`` (Mixtral: plain logits, plus the
            router auxiliary loss with ``output_router_logits``).
        loss_mode: ``"flce"`` or ``"ce"`` (see the module docstring).
        load_balancing_loss_func: the family's auxiliary-loss function, for ``head="moe"``.
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {loss_mode!r}")
    if (head == "moe") != (load_balancing_loss_func is not None):
        raise ValueError("load_balancing_loss_func is required for head='moe' and only for it")
    moe = head == "moe"
    output_cls = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
    output_fields = {f.name for f in dataclasses.fields(output_cls)} - {"loss", "logits", "aux_loss"}

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        config = self.config
        if cache is not None:
            kwargs["cache"] = cache
        if moe:
            output_router_logits = kwargs.pop("output_router_logits", None)
            if output_router_logits is None:
                output_router_logits = config.output_router_logits
            model_kwargs = dict(kwargs, output_router_logits=output_router_logits)
        else:
            model_kwargs = kwargs
        # The base model's own positions: its plain causal mask is skipped under torch.compile too (_mask).
        previous = _mask.set_default_positions(_mask.default_positions(attention_mask, position_ids, cache, kwargs))
        try:
            outputs = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, use_cache=use_cache, **model_kwargs,
            )
        finally:
            _mask.set_default_positions(previous)
        hidden = _keep(outputs.last_hidden_state, logits_to_keep)
        softcap = getattr(config, "final_logit_softcapping", None) if head == "softcap" else None

        loss = logits = None
        custom = vars(self).get("_loss_function")  # a loss the user set (model.loss_function = fn): honoured
        if labels is not None and loss_mode == "flce" and self.training and custom is None and fusable_head(self.lm_head):
            if head == "scaled":
                hidden = hidden / config.logits_scaling
            chunk_mib = getattr(self, CHUNK_MIB_ATTR, None)  # set by patch(model, chunk_mib=...)
            hidden, weight, bias = _autocast(hidden, self.lm_head.weight, self.lm_head.bias)
            loss = _flce_loss(hidden, weight, bias, labels, softcap, chunk_mib, **kwargs)
        else:
            logits = self.lm_head(hidden)
            if head == "scaled":
                logits = logits / config.logits_scaling
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            if labels is not None and custom is not None:
                # as Hugging Face passes them: the cache (either name) is the base model's argument
                loss_kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
                loss = custom(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)
            elif labels is not None:
                loss = _ce_loss(logits, labels, **kwargs)

        extra = {k: v for k, v in outputs.items() if k in output_fields}
        if moe:
            aux_loss = None
            if output_router_logits:
                aux_loss = load_balancing_loss_func(
                    outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
                )
                if loss is not None:
                    loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            extra["aux_loss"] = aux_loss
        return output_cls(loss=loss, logits=logits, **extra)

    forward.__doc__ = (
        f"Causal-LM forward patched by liger_portable.transformers (loss: {loss_mode}, head: {head}); "
        "arguments and outputs as Hugging Face's. See liger_portable.transformers._forward."
    )
    forward.liger_portable = (head, loss_mode)
    return can_return_tuple(forward)
