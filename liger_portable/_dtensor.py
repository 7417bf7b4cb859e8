"""DTensor inputs for the row-wise norms (RMSNorm, fused add+RMSNorm, LayerNorm).

Under FSDP2 (``fully_shard``) the norms see plain tensors: FSDP unshards the parameters before
the forward and hands DTensor gradients back itself. Tensor and sequence parallelism instead call
the norm with DTensors: ``x`` sharded over rows (batch or sequence) or replicated, and the weight
replicated. A Triton kernel cannot take a DTensor, so these ops run on the local shards:

* ``x`` (and ``residual``) go to their local shard and the outputs come back as DTensors with
  the placements of ``x``: normalising over the last dimension is row-wise, so every row's result
  depends on that row alone.
* the weight and bias (Replicate on every mesh dimension) go to their local copy; their gradient
  is declared ``Partial`` (summed over ranks) on the mesh dimensions where ``x`` is sharded,
  since each rank only saw its own rows, and ``Replicate`` where ``x`` is replicated.

Unsupported layouts are errors naming the argument and the fix: ``x`` sharded over its last
dimension or Partial (the norm needs whole rows), a sharded weight or bias (every rank needs all of
it), and a mix of DTensors and plain tensors.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

try:  # torch >= 2.4 has the public module; without torch.distributed there are no DTensors
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except Exception:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


def any_dtensor(*tensors: torch.Tensor | None) -> bool:
    """True if any of ``tensors`` is a DTensor (cheap; False without torch.distributed)."""
    if DTensor is not None:
        for t in tensors:
            if isinstance(t, DTensor):
                return True
    return False


def rowwise(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    rows: Sequence[tuple[str, torch.Tensor]],
    params: Sequence[tuple[str, torch.Tensor | None]],
):
    """Run ``fn(*row_locals, *param_locals)`` on the local shards and wrap its output(s) as DTensors.

    Args:
        fn: the op on plain tensors; returns a tensor or a tuple of tensors shaped like the rows.
        rows: ``(name, tensor)`` of the row inputs (``x``, ``residual``): DTensors of one layout.
        params: ``(name, tensor or None)`` of the per-column parameters (``weight``, ``bias``).
    """
    name0, x = rows[0]
    if not isinstance(x, DTensor):
        raise TypeError(
            f"{name0} is a plain tensor but {_first_dtensor(rows, params)} is a DTensor; pass all of them as "
            f"DTensors on one mesh (torch.distributed.tensor.distribute_tensor) or all as plain tensors"
        )
    mesh, placements = x.device_mesh, x.placements
    last = x.dim() - 1
    for i, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim in (last, -1):
            raise ValueError(
                f"{name0} is sharded over its last dimension (mesh dim {i}: {p}); the norm needs whole "
                f"rows on each rank: shard it over batch or sequence, or redistribute to Replicate"
            )
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(
                f"{name0} has placement {p} on mesh dim {i}; reduce it first "
                f"({name0}.redistribute(placements=[Replicate()] ...))"
            )
    locals_ = []
    for name, t in rows:
        if not isinstance(t, DTensor) or t.device_mesh != mesh or t.placements != placements:
            raise ValueError(
                f"{name} must be a DTensor on the mesh and with the placements of {name0} "
                f"({tuple(placements)}); redistribute it to match"
            )
        locals_.append(t.to_local())
    grad_placements = [Partial() if isinstance(p, Shard) else Replicate() for p in placements]
    for name, t in params:
        if t is None:
            locals_.append(None)
            continue
        if not isinstance(t, DTensor) or t.device_mesh != mesh:
            raise TypeError(
                f"{name} must be a DTensor on the mesh of {name0} (replicated), got "
                f"{'a plain tensor' if not isinstance(t, DTensor) else 'another mesh'}; use "
                f"distribute_tensor({name}, mesh, [Replicate()]) or the tensor-parallel plan's Replicate"
            )
        if not all(isinstance(p, Replicate) for p in t.placements):
            raise ValueError(
                f"{name} has placements {tuple(t.placements)}; every rank needs all of it: "
                f"redistribute it to Replicate (e.g. {name}.redistribute(placements=[Replicate()]))"
            )
        locals_.append(t.to_local(grad_placements=grad_placements))
    out = fn(*locals_)

    stride = torch.empty(x.shape, device="meta").stride()  # the outputs are made contiguous

    def wrap(y: torch.Tensor) -> torch.Tensor:
        # The kernels' outputs are contiguous; the fallback's keep a strided input's layout.
        return DTensor.from_local(y.contiguous(), mesh, placements, run_check=False, shape=x.shape, stride=stride)

    return tuple(wrap(y) for y in out) if isinstance(out, tuple) else wrap(out)


def _first_dtensor(rows, params) -> str:
    for name, t in (*rows, *params):
        if isinstance(t, DTensor):
            return name
    return "?"
