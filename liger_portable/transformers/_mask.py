"""The plain causal mask of a patched model under ``torch.compile``.

With SDPA attention, and a forward given no attention mask, no position ids and no past cache (a
training step on unpadded batches), a causal LM's mask is the plain causal one: Hugging Face then
builds no mask and SDPA runs with ``is_causal=True``, on its flash or cuDNN kernels. While
``torch.compile`` traces the same forward, transformers 5.x cannot see that: the base model makes
position ids (``arange``) and hands them to ``create_causal_mask``, which looks in them for packed
sequences; that check reads their values, which tracing cannot, so it takes them as packed and
builds the full ``(batch, 1, T, T)`` mask (transformers 5.17 also never skips a mask while
tracing). SDPA then runs its masked kernels, about three times slower at 4 x 4096 tokens.

The patched causal-LM forward knows when the positions are the base model's own: its caller passed
none. It says so for the base model's call (:func:`default_positions`), and the family's
``create_causal_mask`` (:func:`skip_plain_causal`) returns None while tracing, exactly where Hugging
Face's returns None in eager mode. In eager mode Hugging Face's function always runs (its own checks
see the data), so eager results are Hugging Face's to the bit; only the traced graph changes, and a
caller's mask, position ids (packed sequences) or cache still get Hugging Face's mask.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

# True while a patched causal-LM forward calls its base model with the base model's own positions:
# no attention mask, position ids or past cache from the caller. Read only while torch.compile
# traces (the traced graph keeps the decision), so threads running eagerly never depend on it.
_DEFAULT_POSITIONS = False


def default_positions_flag() -> bool:
    """The flag :func:`set_default_positions` sets: True inside a patched forward's base-model call
    on the base model's own positions."""
    return _DEFAULT_POSITIONS


def set_default_positions(value: bool) -> bool:
    """Set the flag for the base model's call; returns the previous value, to be set back after."""
    global _DEFAULT_POSITIONS
    previous = _DEFAULT_POSITIONS
    _DEFAULT_POSITIONS = value
    return previous


def default_positions(attention_mask, position_ids, cache, kwargs: dict) -> bool:
    """True if a causal-LM forward given these arguments lets its base model make the positions
    from zero and the mask from nothing: no attention mask, position ids, cache (``cache`` or
    ``past_key_values``) or ``cache_position``."""
    return attention_mask is None and position_ids is None and cache is None and (
        kwargs.get("past_key_values") is None and kwargs.get("cache_position") is None
    )


def plain_causal(kwargs: dict) -> bool:
    """True if ``create_causal_mask(**kwargs)``, called by a base model on its own positions (so
    with no attention mask and no cache but the empty one it made), may be None: SDPA's
    ``is_causal=True`` computes the plain causal mask."""
    config = kwargs.get("config")
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False  # eager attention needs the mask; flash and flex build their own forms
    # (With config.is_causal False, Hugging Face's bidirectional mode, no mask is no mask either:
    # SDPA then runs with is_causal=False, read from the attention module.)
    return all(kwargs.get(k) is None for k in ("or_mask_function", "and_mask_function", "block_sequence_ids"))


def compiling_not_exporting() -> bool:
    """True while torch.compile traces; False in eager mode and under ``torch.export`` (an exported
    graph may be run with other inputs, so it keeps Hugging Face's mask, as transformers does).
    ``torch.compiler.is_exporting()`` cannot tell: torch releases without pytorch#176499 replace it
    by a constant True while tracing, so the flag it returns is read instead."""
    return torch.compiler.is_compiling() and not getattr(torch.compiler, "_is_exporting_flag", False)


def skip_plain_causal(create_causal_mask: Callable) -> Callable:
    """Hugging Face's ``create_causal_mask`` that returns None (no mask: SDPA's ``is_causal``)
    while ``torch.compile`` traces a patched forward's base model on its own positions; otherwise
    Hugging Face's function as it is."""

    @functools.wraps(create_causal_mask)
    def wrapper(*args, **kwargs):
        if _DEFAULT_POSITIONS and not args and compiling_not_exporting() and plain_causal(kwargs):
            return None
        return create_causal_mask(*args, **kwargs)

    return wrapper
