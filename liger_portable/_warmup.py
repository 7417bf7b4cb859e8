"""The kernel problems of one training step of a model, for the autotune warmup.

:func:`step_problems` lists, for a model shape (a preset or a Hugging Face ``config.json``), the
tokens per step and the sequence length, every distinct (kernel, problem) one training step runs
with liger_portable's modules: RMSNorm before attention and MLP (Gemma-2 also after them) and at
the end, RoPE on q and k (forward and backward use the same kernel), SwiGLU or GeGLU, and the fused
linear cross-entropy (or plain cross-entropy) loss. ``scripts/autotune_warmup.py`` tunes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from .specs import SPECS

if TYPE_CHECKING:  # annotations only: the command line reads the presets without importing torch
    import torch


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its kernel problems."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    glu: str = "swiglu"  # "swiglu" (SiLU gate) or "geglu" (GELU-tanh gate)
    norms_per_layer: int = 2  # Gemma-2 normalises before and after attention and MLP: 4


PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 4096, 14336, 32, 8, 128, 128256, 32),
        ModelShape("llama-3-70b", 8192, 28672, 64, 8, 128, 128256, 80),
        ModelShape("llama-3.2-1b", 2048, 8192, 32, 8, 64, 128256, 16),
        ModelShape("qwen2.5-7b", 3584, 18944, 28, 4, 128, 152064, 28),
        ModelShape("mistral-7b", 4096, 14336, 32, 8, 128, 32768, 32),  # v0.3 vocabulary
        ModelShape("gemma-2-9b", 3584, 14336, 16, 8, 256, 256000, 42, glu="geglu", norms_per_layer=4),
    )
}


def from_hf_config(path: str | Path) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Gemma-2 ...).

    A multimodal config's language model (its ``text_config``, e.g. Gemma-3's) is read.

    Raises:
        ValueError: a required field is missing or not a positive integer (the message names the
            file and the field).
    """
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: cannot read the model config ({e}); pass a Hugging Face config.json or a preset") from None
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: a model config is a JSON object (a Hugging Face config.json), got {type(cfg).__name__}")
    need = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{p}: missing field(s) {', '.join(missing)}; is this a decoder-only model's config.json?")
    for key in (*need, "num_key_value_heads", "head_dim"):
        value = cfg.get(key)
        if key in need or value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{p}: {key} must be a positive integer, got {value!r}")
    heads = cfg["num_attention_heads"]
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    gemma2 = cfg.get("model_type") in ("gemma2", "gemma3_text")
    return ModelShape(
        name=cfg.get("_name_or_path") or cfg.get("model_type") or p.parent.name,
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
        layers=cfg["num_hidden_layers"],
        glu="geglu" if act.startswith("gelu") else "swiglu",
        norms_per_layer=4 if gemma2 else 2,
    )


def model_shape(name_or_path: str) -> ModelShape:
    """A preset by name (case-insensitive) or a ``config.json`` path."""
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    p = Path(name_or_path)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{p} has no config.json: pass a model folder holding one, its path, or a preset")
        p = p / "config.json"
    if p.exists():
        return from_hf_config(p)
    if p.suffix == ".json" or len(p.parts) > 1:
        raise ValueError(f"no such file: {name_or_path}; pass a Hugging Face config.json, or a preset ({', '.join(PRESETS)})")
    raise ValueError(
        f"unknown model {name_or_path!r}: use a preset ({', '.join(PRESETS)}) or a path to a Hugging Face config.json"
    )


@dataclass(frozen=True)
class Problem:
    """One kernel problem of a training step.

    Attributes:
        kernel: the kernel spec name; problem: values in the spec's key order; dtype: input dtype;
        launches: how many times one step launches it; what: where in the model it runs.
    """

    kernel: str
    problem: tuple[int, ...]
    dtype: torch.dtype
    launches: int
    what: str

    @property
    def named(self) -> dict[str, int]:
        return dict(zip(SPECS[self.kernel].key, self.problem))

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.named.items())


def step_problems(
    model: ModelShape,
    tokens: int,
    seq_len: int,
    dtype: torch.dtype,
    *,
    loss: str = "fused_linear_cross_entropy",
    fused_add_norm: bool = False,
) -> list[Problem]:
    """Every distinct kernel problem of one training step on one rank, in model order.

    Args:
        tokens: tokens per step on this rank (micro-batch size times sequence length).
        seq_len: sequence length (RoPE's problem); must divide ``tokens``.
        loss: ``fused_linear_cross_entropy`` or ``cross_entropy``.
        fused_add_norm: the model uses the fused residual-add RMSNorm inside the layers.
    """
    if tokens <= 0 or seq_len <= 0 or tokens % seq_len:
        raise ValueError(f"tokens ({tokens}) must be a positive multiple of seq_len ({seq_len})")
    if loss not in ("fused_linear_cross_entropy", "cross_entropy"):
        raise ValueError(f"loss must be 'fused_linear_cross_entropy' or 'cross_entropy', got {loss!r}")
    L = model.layers
    norm = "fused_add_rms_norm" if fused_add_norm else "rms_norm"
    out = []
    layer_norms = model.norms_per_layer * L
    if fused_add_norm:
        out += [Problem(f"{norm}_{d}", (model.hidden, tokens), dtype, layer_norms, "layer norms") for d in ("fwd", "bwd")]
        out += [Problem(f"rms_norm_{d}", (model.hidden, tokens), dtype, 1, "final norm") for d in ("fwd", "bwd")]
    else:
        out += [Problem(f"rms_norm_{d}", (model.hidden, tokens), dtype, layer_norms + 1, "layer and final norms")
                for d in ("fwd", "bwd")]
    out.append(Problem("rope", (model.head_dim, model.heads + model.kv_heads, seq_len), dtype, 2 * L, "q and k rotary (fwd+bwd)"))
    out += [Problem(f"{model.glu}_{d}", (model.intermediate, tokens), dtype, L, "MLP gate") for d in ("fwd", "bwd")]
    if loss == "fused_linear_cross_entropy":
        out.append(Problem(loss, (model.vocab, tokens, model.hidden), dtype, 1, "lm head + loss"))
    else:
        out.append(Problem(loss, (model.vocab, tokens), dtype, 1, "loss"))
    for p in out:
        assert p.kernel in SPECS, p.kernel
    return out


def dedupe(problems: list[Problem]) -> list[Problem]:
    """Problems whose cache entries coincide (same kernel, bucket, dtype) listed once, in first
    order, with the largest launch count among them (they come from different step shapes)."""
    seen: dict[tuple, Problem] = {}
    for p in problems:
        k = (p.kernel, SPECS[p.kernel].bucket(p.named), p.dtype)
        q = seen.get(k)
        if q is None or p.launches > q.launches:
            seen[k] = p if q is None else Problem(q.kernel, q.problem, q.dtype, p.launches, q.what)
    return list(seen.values())


def shape_dict(model: ModelShape) -> Mapping[str, object]:
    return {f.name: getattr(model, f.name) for f in fields(model)}
