"""Tiny Hugging Face causal language models, built from code (no download), one per model
family that :mod:`liger_portable.transformers` patches.

    >>> from hf_tiny import FAMILIES, tiny_model
    >>> model = tiny_model("llama", dtype=torch.bfloat16, seed=0)   # a LlamaForCausalLM, 2 layers

Every model has 2 decoder layers, hidden size 64, 4 attention heads of 16 dimensions with 2
key/value heads (grouped-query attention), a vocabulary of ``VOCAB`` (an odd size, so no kernel
gets a power of two by luck) and eager attention (deterministic on the CPU). Each family keeps
what makes it differ from Llama, sized down: Gemma's ``1 + weight`` norms and GeGLU with tied
embeddings, Gemma-2/3's final-logit softcap (lowered to 3.0 so that it bends these logits) and
sliding-window layers (8 tokens), Gemma-3's and Qwen-3's q/k norms, Qwen-2's attention biases,
Mistral's sliding window (16 tokens), Phi-3's fused gate/up projection with rotary over half of
each head, Granite's multipliers and logit scaling (2.5), Mixtral's 4 experts (top 2). Weights are
drawn with ``initializer_range=0.1`` instead of 0.02, so that activations and logits are far from
zero (logits have a standard deviation of about 0.8). The configs set ``use_cache=False``; pass
``use_cache=True`` to ``generate``.

Used by the patch and convergence tests; needs
``transformers`` (import it after ``pytest.importorskip("transformers")``).
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["FAMILIES", "VOCAB", "isolated_patching", "tiny_config", "tiny_model"]


@pytest.fixture
def isolated_patching():
    """For test modules that patch models (``pytestmark = pytest.mark.usefixtures(...)``): one torch
    thread (tiny models; more threads oversubscribe 2 cores under xdist and ran these tests 4-20x
    slower), and the class- and module-level replacements (``apply_rotary_pos_emb``,
    ``apply_liger_kernel_to_*``) undone before and after each test."""
    from liger_portable.transformers import _patch

    _patch.revert()  # also what an earlier test in this process may have left
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    _patch.revert()

#: The model families liger_portable.transformers supports (``apply_liger_kernel_to_<family>``;
#: ``gemma3`` is the text model, Gemma3ForCausalLM, patched by ``apply_liger_kernel_to_gemma3_text``).
FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "granite")

#: Vocabulary size of every tiny model.
VOCAB = 331

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    use_cache=False,
)


def tiny_config(family: str):
    """The ``transformers`` config of the tiny model of ``family`` (one of :data:`FAMILIES`)."""
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {family!r}")
    c = dict(_COMMON)
    if family == "llama":
        return tf.LlamaConfig(**c)
    if family == "mistral":
        return tf.MistralConfig(**c, sliding_window=16)
    if family == "mixtral":
        return tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    if family == "qwen2":
        return tf.Qwen2Config(**c)
    if family == "qwen3":
        return tf.Qwen3Config(**c)
    if family == "gemma":
        c["tie_word_embeddings"] = True
        return tf.GemmaConfig(**c, hidden_act="gelu_pytorch_tanh")
    if family == "gemma2":
        c["tie_word_embeddings"] = True
        return tf.Gemma2Config(
            **c, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=8,
            final_logit_softcapping=3.0, attn_logit_softcapping=50.0,
        )
    if family == "gemma3":
        c["tie_word_embeddings"] = True
        return tf.Gemma3TextConfig(
            **c, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
        )
    if family == "phi3":
        c.pop("head_dim")
        return tf.Phi3Config(
            **c, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    # granite
    return tf.GraniteConfig(
        **c, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
    )


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A freshly initialised ``<Family>ForCausalLM`` of ``family`` (one of :data:`FAMILIES`), in
    ``dtype``, on the CPU, in training mode. The same ``seed`` gives the same weights (the global
    RNG is left as it was)."""
    import transformers as tf

    config = tiny_config(family)
    config._attn_implementation = "eager"
    cls = {
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "mixtral": tf.MixtralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "gemma": tf.GemmaForCausalLM,
        "gemma2": tf.Gemma2ForCausalLM,
        "gemma3": tf.Gemma3ForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
        "granite": tf.GraniteForCausalLM,
    }[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(dtype).train()
