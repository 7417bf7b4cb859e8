"""Patch Hugging Face ``transformers`` models with liger_portable's fused ops.

Needs ``transformers`` (the ``hf`` extra: ``pip install ".[hf]"`` in the checkout); transformers 5.x
(tested with 5.24). Supported model types: llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2,
gemma3_text (Gemma3ForCausalLM), phi3, granite.

One model instance, by its ``config.model_type``::

    from liger_portable.transformers import patch
    model = AutoModelForCausalLM.from_pretrained(...)
    patch(model)                       # rope, rms_norm, swiglu (geglu for Gemma), fused linear CE

or every model of a family built afterwards, with Liger-Kernel's function names and defaults (a
Liger-Kernel user switches by changing the import)::

    from liger_portable.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama()      # before from_pretrained; or pass model= to patch one too

With labels, in training mode, the causal-LM forward computes the loss with
:func:`liger_portable.functional.fused_linear_cross_entropy` and never builds the logits (the
output's ``logits`` is None); without labels, or in eval mode, it returns the logits as before.
The ops dispatch by device (Triton kernels on CUDA, ROCm and XPU GPUs; the PyTorch fallback on
the CPU), so the same patched model trains everywhere, also under ``torch.compile``.

Hugging Face Trainer: patch the model before building the Trainer; nothing else changes (the
fused loss honours ``num_items_in_batch``, so gradient accumulation is exact)::

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    patch(model)
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    trainer.train()

(``TrainingArguments(use_liger_kernel=True)`` would load Liger-Kernel itself; leave it off.)
A plain training loop works the same: ``loss = model(input_ids=x, labels=x).loss``.

Differences from Liger-Kernel: ``patch`` swaps module instances (keeping the same Parameter
objects) instead of rebinding methods of Hugging Face's classes; ``cross_entropy=True`` replaces
the causal-LM forward instead of ``torch.nn.functional.cross_entropy`` process-wide;
``apply_liger_kernel_to_granite`` keeps Liger's defaults (``cross_entropy=True``) but also accepts
``fused_linear_cross_entropy=True`` (the ``1 / logits_scaling`` factor is applied to the hidden
states). Mixtral's experts get the fused SwiGLU through ``_apply_gate`` (the default
``grouped_mm`` and the ``batched_mm`` experts implementations; ``eager`` keeps Hugging Face's).
"""

from __future__ import annotations

from .._checks import HF_INSTALL_HINT as _HF_INSTALL_HINT

try:
    import transformers as _transformers  # noqa: F401
except ModuleNotFoundError as e:  # only transformers itself missing; a broken install raises as is
    if e.name != "transformers":
        raise
    raise ImportError(f"liger_portable.transformers needs Hugging Face transformers: {_HF_INSTALL_HINT}") from e

from packaging.version import Version as _Version

if _Version(_transformers.__version__).major != 5:
    raise ImportError(
        f"liger_portable.transformers supports transformers 5.x (its modeling code is patched), found "
        f"{_transformers.__version__}: {_HF_INSTALL_HINT}"
    )

from ._modules import GEGLUMLP, GemmaStyleRMSNorm, Phi3SwiGLUMLP, RMSNorm, SwiGLUMLP
from ._patch import MODEL_TYPES as _MODEL_TYPES
from ._patch import apply_to_family as _apply
from ._patch import patch

#: The ``config.model_type`` values :func:`patch` supports.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_MODEL_TYPES))

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "GEGLUMLP",
    "GemmaStyleRMSNorm",
    "Phi3SwiGLUMLP",
    "RMSNorm",
    "SwiGLUMLP",
    "patch",
    "apply_liger_kernel_to_gemma",
    "apply_liger_kernel_to_gemma2",
    "apply_liger_kernel_to_gemma3_text",
    "apply_liger_kernel_to_granite",
    "apply_liger_kernel_to_llama",
    "apply_liger_kernel_to_mistral",
    "apply_liger_kernel_to_mixtral",
    "apply_liger_kernel_to_phi3",
    "apply_liger_kernel_to_qwen2",
    "apply_liger_kernel_to_qwen3",
]

_DOC = """Patch Hugging Face's {model} classes (transformers.models.{module}) with liger_portable:
    models built afterwards use it; ``model``, if given, is patched too. Names and defaults as
    Liger-Kernel's function of the same name.

    Args:
        rope: fused rotary embedding (the modeling module's ``apply_rotary_pos_emb``).
        cross_entropy: the causal-LM loss by :func:`liger_portable.functional.cross_entropy` on
            the logits. Excludes ``fused_linear_cross_entropy``.
        fused_linear_cross_entropy: the causal-LM loss from the hidden states and the LM head
            without building the logits (training mode with labels; ``logits`` is then None).
        rms_norm: fused RMSNorm.
        {glu}: fused {glu_what} MLP (raises ``ValueError`` for a ``model`` with another activation).
        model: an already built model of this family to patch as well.

    Raises:
        ValueError: both losses requested, ``model`` of another family, or an activation the
            fused MLP does not compute.
    """


def _doc(fn, model: str, module: str, glu: str = "swiglu"):
    what = "GeGLU (tanh GELU)" if glu == "geglu" else "SwiGLU"
    fn.__doc__ = _DOC.format(model=model, module=module, glu=glu, glu_what=what)
    return fn


def apply_liger_kernel_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                swiglu=True, model=None) -> None:
    _apply("llama", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=swiglu, model=model)


def apply_liger_kernel_to_mistral(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                  swiglu=True, model=None) -> None:
    _apply("mistral", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=swiglu, model=model)


def apply_liger_kernel_to_mixtral(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                  swiglu=True, model=None) -> None:
    _apply("mixtral", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=swiglu, model=model)


def apply_liger_kernel_to_qwen2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                swiglu=True, model=None) -> None:
    _apply("qwen2", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=swiglu, model=model)


def apply_liger_kernel_to_qwen3(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                swiglu=True, model=None) -> None:
    _apply("qwen3", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=swiglu, model=model)


def apply_liger_kernel_to_gemma(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                geglu=True, model=None) -> None:
    _apply("gemma", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=geglu, model=model, glu_option="geglu")


def apply_liger_kernel_to_gemma2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                 geglu=True, model=None) -> None:
    _apply("gemma2", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=geglu, model=model, glu_option="geglu")


def apply_liger_kernel_to_gemma3_text(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                                      rms_norm=True, geglu=True, model=None) -> None:
    _apply("gemma3", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=geglu, model=model, glu_option="geglu")


def apply_liger_kernel_to_phi3(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                               swiglu=True, model=None) -> None:
    _apply("phi3", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=swiglu, model=model)


def apply_liger_kernel_to_granite(rope=True, cross_entropy=True, fused_linear_cross_entropy=False, rms_norm=True,
                                  swiglu=True, model=None) -> None:
    _apply("granite", rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
           rms_norm=rms_norm, glu=swiglu, model=model)


_doc(apply_liger_kernel_to_llama, "Llama", "llama")
_doc(apply_liger_kernel_to_mistral, "Mistral", "mistral")
_doc(apply_liger_kernel_to_mixtral, "Mixtral", "mixtral")
_doc(apply_liger_kernel_to_qwen2, "Qwen2", "qwen2")
_doc(apply_liger_kernel_to_qwen3, "Qwen3", "qwen3")
_doc(apply_liger_kernel_to_gemma, "Gemma", "gemma", "geglu")
_doc(apply_liger_kernel_to_gemma2, "Gemma2", "gemma2", "geglu")
_doc(apply_liger_kernel_to_gemma3_text, "Gemma3 text (Gemma3ForCausalLM)", "gemma3", "geglu")
_doc(apply_liger_kernel_to_phi3, "Phi3", "phi3")
_doc(apply_liger_kernel_to_granite, "Granite", "granite")
apply_liger_kernel_to_granite.__doc__ += (
    "\n    Granite keeps Liger-Kernel's defaults (``cross_entropy=True``); "
    "``fused_linear_cross_entropy=True`` also works here.\n"
)
