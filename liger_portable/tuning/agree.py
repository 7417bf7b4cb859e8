"""Rank agreement: under ``torch.distributed``, the ranks that share a device model take the choice
of the lowest of them, so no two ranks with the same GPU model diverge (the warmup uses it)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


def _current_model() -> str:
    from ..hardware import platform

    p = platform()
    return p.device().model_slug if p.backend != "cpu" else "cpu"


def agree(choice_fn: Callable[[], T], *, model: str | None = None, group: Any = None) -> T:
    """Make the ranks that share a device model agree on one choice.

    Without an initialised ``torch.distributed`` (or with one rank) this is ``choice_fn()``.
    Otherwise ranks are grouped by device model (``model``, default the current device's model
    slug), the lowest rank of each group calls ``choice_fn`` (tunes, or reads the cache) and every
    rank of the group returns that rank's value. Every rank must call ``agree`` at the same point
    (it runs two ``all_gather_object`` collectives over ``group``). If the leader's ``choice_fn``
    raises, every rank of its group raises ``RuntimeError`` naming the leader and the error.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return choice_fn()
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    mine = model if model is not None else _current_model()
    models: list = [None] * world
    dist.all_gather_object(models, mine, group=group)
    leader = models.index(mine)
    payload: tuple[str, Any] = ("none", None)
    if me == leader:
        try:
            payload = ("ok", choice_fn())
        except Exception as e:  # noqa: BLE001 - reported to the whole group below
            payload = ("error", f"{type(e).__name__}: {e}")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, payload, group=group)
    status, value = gathered[leader]
    if status != "ok":
        raise RuntimeError(
            f"liger_portable.agree: the choice of rank {leader} (leader of the {mine} ranks) failed: {value}"
        )
    return value
