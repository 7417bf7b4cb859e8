"""Patching Hugging Face models: one instance (:func:`patch`) or a model family's classes
(``apply_liger_kernel_to_<family>``).

What each option replaces, in every family that has it:

* ``rms_norm``: every RMSNorm module of the family (decoder norms, the final norm, Qwen-3 and
  Gemma-3 q/k norms) by :class:`liger_portable.nn.RMSNorm` (Gemma: offset 1, fp32 casting).
* ``swiglu`` / ``geglu``: the MLP by :class:`liger_portable.nn.SwiGLUMLP` /
  :class:`~liger_portable.nn.GEGLUMLP` (Phi-3: a fused gate/up variant; Mixtral: the experts'
  activation product, see below).
* ``rope``: the modeling module's ``apply_rotary_pos_emb`` by
  :func:`liger_portable.functional.rope`. This is a module-level function in Hugging Face, so it
  changes for every model of that family in the process, with either kind of patching (as with
  Liger-Kernel).
* ``fused_linear_cross_entropy`` / ``cross_entropy``: the ``XForCausalLM.forward`` (see
  :mod:`liger_portable.transformers._forward`), and the modeling module's ``create_causal_mask``,
  which under ``torch.compile`` skips the plain causal mask of such a forward called without a
  mask, position ids or cache, as Hugging Face's does in eager mode (see
  :mod:`liger_portable.transformers._mask`; it changes nothing for other calls or models).

Mixtral (transformers 5): the experts are one ``MixtralExperts`` module with 3-D parameters. With
``swiglu`` its ``_apply_gate`` (the ``silu(gate) * up`` step that Hugging Face's ``grouped_mm``
and ``batched_mm`` experts implementations call; ``grouped_mm`` is the default) becomes the fused
product. With ``experts_implementation="eager"`` Hugging Face's loop computes the product inline
and the experts stay Hugging Face's.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import torch
from torch import nn

from . import _modules as M
from .._checks import check_chunk_mib
from .._warn import warn
from ._forward import CHUNK_MIB_ATTR, make_causal_lm_forward
from ._mask import skip_plain_causal


@dataclasses.dataclass(frozen=True)
class Family:
    """How one model family is patched. Class and function names are those of its modeling module."""

    name: str  #: the family, as in ``apply_liger_kernel_to_<name>``
    model_types: tuple[str, ...]  #: ``config.model_type`` values it covers
    module: str  #: the transformers modeling module
    causal_lm: str  #: the ``XForCausalLM`` class
    norm: str  #: the RMSNorm class
    gemma_norm: bool  #: ``(1 + weight)`` in fp32 (Gemma) rather than Llama's casting
    mlp: str | None  #: the MLP class (None: Mixtral, whose MLP is its experts)
    glu: str  #: "swiglu", "geglu", "phi3" (fused gate_up_proj) or "experts" (Mixtral)
    act_key: str  #: the config attribute naming the MLP activation, as the family's MLP reads it
    head: str  #: see :func:`liger_portable.transformers._forward.make_causal_lm_forward`
    partial_rope: bool = False  #: Phi-3: rotary over the first ``cos.shape[-1]`` dimensions only

    @property
    def modeling(self) -> types.ModuleType:
        return importlib.import_module(self.module)


def _family(name, model_types, prefix, *, glu="swiglu", act_key="hidden_act", head="plain", gemma_norm=False,
            mlp=True, partial_rope=False, module=None) -> Family:
    return Family(
        name=name, model_types=model_types, module=f"transformers.models.{module or name}.modeling_{module or name}",
        causal_lm=f"{prefix}ForCausalLM", norm=f"{prefix}RMSNorm", gemma_norm=gemma_norm,
        mlp=f"{prefix}MLP" if mlp else None, glu=glu, act_key=act_key, head=head, partial_rope=partial_rope,
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family("llama", ("llama",), "Llama"),
        _family("mistral", ("mistral",), "Mistral"),
        _family("mixtral", ("mixtral",), "Mixtral", glu="experts", head="moe", mlp=False),
        _family("qwen2", ("qwen2",), "Qwen2"),
        _family("qwen3", ("qwen3",), "Qwen3"),
        _family("gemma", ("gemma",), "Gemma", glu="geglu", gemma_norm=True),
        _family("gemma2", ("gemma2",), "Gemma2", glu="geglu", act_key="hidden_activation", head="softcap",
                gemma_norm=True),
        _family("gemma3", ("gemma3_text",), "Gemma3", glu="geglu", act_key="hidden_activation", head="softcap",
                gemma_norm=True),
        _family("phi3", ("phi3",), "Phi3", glu="phi3", partial_rope=True),
        _family("granite", ("granite",), "Granite", head="scaled"),
    )
}

#: ``config.model_type`` -> family.
MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}

_UNSUPPORTED_HINTS = {
    "gemma3": "only the Gemma-3 text model is supported: load it as Gemma3ForCausalLM (model_type 'gemma3_text')",
}

# (owner, attribute) -> the value before liger_portable first replaced it, for revert().
_ORIGINALS: dict[tuple[object, str], object] = {}


def _replace(owner: object, attr: str, value: object) -> None:
    """``setattr(owner, attr, value)``, remembering the original value the first time."""
    _ORIGINALS.setdefault((owner, attr), getattr(owner, attr))
    setattr(owner, attr, value)


def _original(owner: object, attr: str):
    """``owner.attr`` as Hugging Face defined it, even if liger_portable replaced it since."""
    return _ORIGINALS.get((owner, attr), getattr(owner, attr))


def originals() -> dict[tuple[object, str], object]:
    """A copy of what this module replaced so far: (owner, attribute) -> the value before
    liger_portable first replaced it (what :func:`revert` puts back). Tests use it to run Hugging
    Face's own code for a while."""
    return dict(_ORIGINALS)


def revert() -> None:
    """Undo every class- and module-level replacement made by this module (the modeling modules'
    classes and ``apply_rotary_pos_emb``, the ``XForCausalLM.forward`` methods, Mixtral's
    ``_apply_gate``). Models patched by :func:`patch` keep their swapped modules and forward; new
    models are built with Hugging Face's classes again. Meant for tests."""
    for (owner, attr), value in _ORIGINALS.items():
        setattr(owner, attr, value)
    _ORIGINALS.clear()


# --------------------------------------------------------------------------- checks


def _check_flags(cross_entropy: bool, fused_linear_cross_entropy: bool, **flags: bool) -> None:
    for name, value in dict(flags, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy).items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError(
            "cross_entropy and fused_linear_cross_entropy are mutually exclusive (both compute the loss): "
            "pass fused_linear_cross_entropy=False to use cross_entropy=True"
        )


def _check_act(family: Family, config, glu: bool, option: str) -> None:
    """The fused product must compute the model's activation; a clear error otherwise, naming the
    caller's ``option`` (``swiglu`` or ``geglu``)."""
    if not glu:
        return
    act = getattr(config, family.act_key, None)
    allowed = M.GEGLU_ACTS if family.glu == "geglu" else M.SWIGLU_ACTS
    if act not in allowed:
        raise ValueError(
            f"{option}=True fuses {' / '.join(map(repr, allowed))}, but this {family.name} model has "
            f"config.{family.act_key}={act!r}; pass {option}=False to keep the model's MLP"
        )


def family_of(model) -> Family:
    """The family of an instantiated model, from ``model.config.model_type``; a clear error for an
    unsupported one."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise TypeError(
            f"model must be a Hugging Face PreTrainedModel with a config.model_type, got {type(model).__name__}"
        )
    if model_type not in MODEL_TYPES:
        hint = _UNSUPPORTED_HINTS.get(model_type, "")
        raise ValueError(
            f"model_type {model_type!r} is not supported by liger_portable.transformers; supported: "
            f"{', '.join(sorted(MODEL_TYPES))}" + (f" ({hint})" if hint else "")
        )
    return MODEL_TYPES[model_type]


# --------------------------------------------------------------------------- instance patching


def _swap_norm(family: Family, old: nn.Module) -> nn.Module:
    eps = old.variance_epsilon if hasattr(old, "variance_epsilon") else old.eps
    cls = M.GemmaStyleRMSNorm if family.gemma_norm else M.RMSNorm
    new = cls(old.weight.shape[0], eps, device="meta")
    new.weight = old.weight  # the same Parameter: optimizers and state_dict are unaffected
    return new


def _swap_mlp(family: Family, old: nn.Module) -> nn.Module:
    cls = {"swiglu": M.SwiGLUMLP, "geglu": M.GEGLUMLP, "phi3": M.Phi3SwiGLUMLP}[family.glu]
    with torch.device("meta"):  # the new projections are replaced by the old ones below
        new = cls(old.config)
    # The projections move over as they are (also when wrapped, e.g. by LoRA); the activation stays behind.
    # Every one of the new module's children must come from the old one (a model built on the meta
    # device has meta parameters: those are its parameters too).
    moved = set()
    for name, child in old.named_children():
        if isinstance(getattr(new, name, None), nn.Module):
            setattr(new, name, child)
            moved.add(name)
    missing = sorted(n for n, _ in new.named_children() if n not in moved)
    if missing:
        raise ValueError(
            f"cannot swap {type(old).__name__}: it lacks {', '.join(missing)} (of "
            f"{sorted(n for n, _ in new.named_children())}); pass swiglu=False to keep the model's MLP"
        )
    return new


def _set_child(root: nn.Module, qualified_name: str, module: nn.Module) -> None:
    parent_name, _, child_name = qualified_name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child_name, module)


# liger_portable's modules that patching puts in (a model already patched, or built after the
# class-level functions, has these instead of Hugging Face's).
_OURS = (M.RMSNorm, M.SwiGLUMLP, M.GEGLUMLP, M.Phi3SwiGLUMLP)


def _patch_instance(
    family: Family, model: nn.Module, *, rope, rms_norm, glu, loss_mode, set_forward: bool = True
) -> list[nn.Module]:
    """Patch ``model`` and the modules in it; returns the causal-LM heads whose forward got the
    loss: ``model`` itself, or the one a wrapper (PEFT, say) holds. ``set_forward=False``: the
    class's forward already has the loss (class-level patching), the instances are left alone."""
    modeling = family.modeling
    norm_cls = _original(modeling, family.norm)
    mlp_cls = _original(modeling, family.mlp) if family.mlp else None
    experts_cls = getattr(modeling, "MixtralExperts", None) if family.glu == "experts" else None
    causal_lm_cls = _original(modeling, family.causal_lm)
    swaps, experts, heads, ours = [], [], [], 0
    for name, module in model.named_modules():  # build everything first: an error changes nothing
        if rms_norm and type(module) is norm_cls:
            swaps.append((name, _swap_norm(family, module)))
        elif glu and mlp_cls is not None and type(module) is mlp_cls:
            swaps.append((name, _swap_mlp(family, module)))
        elif glu and experts_cls is not None and type(module) is experts_cls:
            experts.append(module)
        elif isinstance(module, _OURS):
            ours += 1
        if isinstance(module, causal_lm_cls):
            heads.append(module)
    if (rms_norm or glu or loss_mode) and not (swaps or experts or heads or ours):
        raise ValueError(
            f"found none of Hugging Face's {family.name} modules ({family.norm}, {family.mlp or 'MixtralExperts'}, "
            f"{family.causal_lm}) in this {type(model).__name__}: its classes are not those of {family.module} "
            "(remote code, trust_remote_code=True?), so nothing would be patched. Load the model with "
            "transformers' own classes (trust_remote_code=False)"
        )
    if loss_mode is not None and not heads and not type(model).__module__.startswith("transformers."):
        # A class of its own around transformers' modules (remote code reusing LlamaModel, say): its
        # modules are patched, its forward cannot be; said rather than left to look fused.
        warn(
            f"{type(model).__name__} is not transformers' {family.causal_lm} and holds none: its {family.name} "
            "norms and MLPs are patched, but its loss is not fused (its own forward builds the logits). Load "
            "the model with transformers' classes for the fused loss, or pass fused_linear_cross_entropy=False "
            "(and cross_entropy=False) to patch the modules alone",
        )
    for name, new in swaps:
        _set_child(model, name, new)
    for module in experts:
        module._apply_gate = types.MethodType(M.experts_apply_gate, module)
    if rope:
        _patch_rope(family)
    if loss_mode is None or not set_forward:
        return []
    _patch_mask(family)
    for head in heads:
        head.forward = types.MethodType(_forward_for(family, loss_mode), head)
    return heads


def _patch_rope(family: Family) -> None:
    _replace(family.modeling, "apply_rotary_pos_emb", M.partial_rotary_pos_emb if family.partial_rope else M.rotary_pos_emb)


def _patch_mask(family: Family) -> None:
    """The modeling module's ``create_causal_mask`` skips the plain causal mask under torch.compile
    when a patched forward's base model makes its own positions (see ``_mask``); the function
    every model of the family in the process calls, acting only under a patched forward."""
    modeling = family.modeling
    if hasattr(modeling, "create_causal_mask"):
        _replace(modeling, "create_causal_mask", skip_plain_causal(_original(modeling, "create_causal_mask")))


def _forward_for(family: Family, loss_mode: str):
    lb = family.modeling.load_balancing_loss_func if family.head == "moe" else None
    return make_causal_lm_forward(family.head, loss_mode, lb)


def _loss_mode(cross_entropy: bool, fused_linear_cross_entropy: bool) -> str | None:
    return "flce" if fused_linear_cross_entropy else "ce" if cross_entropy else None


def patch(
    model,
    *,
    rope: bool = True,
    rms_norm: bool = True,
    swiglu: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    chunk_mib: int | None = None,
):
    """Patch an instantiated Hugging Face model in place, by its ``config.model_type``; returns it.

    The model's RMSNorm and MLP modules are swapped for liger_portable's, holding the same
    ``Parameter`` objects (an optimizer built before or after keeps working; ``state_dict`` keys
    and values are unchanged); a causal-LM head gets the fused loss in its ``forward`` (this
    instance only; also the one inside a wrapper that proxies the config, such as PEFT's).
    ``rope`` replaces the modeling module's ``apply_rotary_pos_emb``, which every model of the
    family in the process uses. Patch before wrapping the model (Trainer, FSDP / DDP, hooks); a
    model already wrapped by ``torch.compile`` is patched inside its wrapper (the wrapper is
    returned; a graph compiled before the patch is recompiled on the next call).

    Args:
        model: a model of a supported family (:data:`MODEL_TYPES`): a ``XForCausalLM``, or its
            base model or another head (then only the norms, MLPs and RoPE are patched).
        rope: fused rotary embedding.
        rms_norm: fused RMSNorm (Gemma families: ``1 + weight`` in fp32, as theirs).
        swiglu: fused gated MLP: SwiGLU where the model's activation is SiLU, GeGLU (tanh GELU)
            for the Gemma families. A model whose activation is something else raises
            ``ValueError`` (pass ``swiglu=False``).
        cross_entropy: compute the loss with :func:`liger_portable.functional.cross_entropy` on
            the logits. Excludes ``fused_linear_cross_entropy``.
        fused_linear_cross_entropy: in training mode with labels, compute the loss from the
            last hidden states and the LM head without building the logits (``logits`` is None).
        chunk_mib: the fused loss's MiB of logits per token chunk (see
            :func:`liger_portable.functional.fused_linear_cross_entropy`); None: the default
            chunk (sized by the device's matmul rate and bandwidth, within a memory budget). Larger is faster for its size in memory. Kept as the
            model attribute ``liger_portable_chunk_mib``, which may be changed later.

    Raises:
        ValueError: an unsupported ``model_type`` (the message lists the supported ones), both
            losses requested, an activation the fused MLP does not compute, ``chunk_mib``
            that is not a positive whole number or given without the fused loss, or a model with
            none of Hugging Face's classes of its family (remote code). Nothing is changed when it
            raises.

    Warns:
        UserWarning: a loss was asked for, but ``model`` is a class of its own (not transformers')
            holding no causal-LM head of its family: its modules are patched, its loss is not fused.
    """
    _check_flags(cross_entropy, fused_linear_cross_entropy, rope=rope, rms_norm=rms_norm, swiglu=swiglu)
    chunk_mib = check_chunk_mib(chunk_mib)
    if chunk_mib is not None and not fused_linear_cross_entropy:
        raise ValueError("chunk_mib sets the fused linear cross-entropy's chunk; it needs fused_linear_cross_entropy=True")
    inner = compiled_inner(model)
    family = family_of(inner)
    _check_act(family, inner.config, swiglu, "swiglu")
    heads = _patch_instance(
        family, inner, rope=rope, rms_norm=rms_norm, glu=swiglu,
        loss_mode=_loss_mode(cross_entropy, fused_linear_cross_entropy),
    )
    if chunk_mib is not None:
        for head in heads or [inner]:
            setattr(head, CHUNK_MIB_ATTR, chunk_mib)
    return model


def compiled_inner(model):
    """The model a ``torch.compile`` wrapper (``OptimizedModule``, also nested) holds, else
    ``model``. Patching the wrapper itself would swap the norms and MLPs (they are its submodules)
    but miss the causal-LM head, whose ``forward`` belongs to the inner model."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


# --------------------------------------------------------------------------- class-level patching


def apply_to_family(
    name: str, *, rope: bool, cross_entropy: bool, fused_linear_cross_entropy: bool, rms_norm: bool, glu: bool,
    model=None, glu_option: str = "swiglu",
) -> None:
    """The body of every ``apply_liger_kernel_to_<name>``: replace the modeling module's classes
    and functions (models built afterwards use liger_portable), and patch ``model`` too if given."""
    _check_flags(cross_entropy, fused_linear_cross_entropy, rope=rope, rms_norm=rms_norm, **{glu_option: glu})
    family = FAMILIES[name]
    if model is not None:
        model = compiled_inner(model)
        if family_of(model) is not family:
            raise ValueError(
                f"model is a {model.config.model_type!r} model, not {name}; use "
                f"liger_portable.transformers.patch(model) to patch it by its own type"
            )
        _check_act(family, model.config, glu, glu_option)
    modeling = family.modeling
    loss_mode = _loss_mode(cross_entropy, fused_linear_cross_entropy)
    if rope:
        _patch_rope(family)
    if rms_norm:
        _replace(modeling, family.norm, M.GemmaStyleRMSNorm if family.gemma_norm else M.RMSNorm)
    if glu:
        if family.glu == "experts":
            _replace(modeling.MixtralExperts, "_apply_gate", M.experts_apply_gate)
        else:
            _replace(modeling, family.mlp, {"swiglu": M.SwiGLUMLP, "geglu": M.GEGLUMLP, "phi3": M.Phi3SwiGLUMLP}[family.glu])
    if loss_mode is not None:
        _patch_mask(family)
        _replace(_original(modeling, family.causal_lm), "forward", _forward_for(family, loss_mode))
    if model is not None:
        # The class-level forward already applies to the instance unless it has its own.
        _patch_instance(
            family, model, rope=False, rms_norm=rms_norm, glu=glu, loss_mode=loss_mode,
            set_forward="forward" in vars(model),
        )
