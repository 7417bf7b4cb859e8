"""What the package's ``autograd.Function`` classes share."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def first_order_only(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate the ``backward`` of a Function whose gradients are computed without an autograd
    graph (by kernels, or written out by hand). Differentiating them again (``create_graph=True``,
    then a gradient of those gradients: a gradient penalty, a Hessian-vector product) would
    silently lack this op's second-order terms, so a backward run with grad mode on, which is what
    ``create_graph=True`` does, raises an error naming ``op``. The usual backward runs with grad
    mode off and pays one check.

    (``torch.autograd.function.once_differentiable`` is not enough: its error is raised only where
    the second derivative is taken through the gradients themselves, and
    ``torch.autograd.grad(penalty, weight)`` never reaches it.)"""

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        is_grad_enabled = torch.is_grad_enabled

        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if is_grad_enabled():
                raise RuntimeError(
                    f"liger_portable {op}: higher-order gradients (create_graph=True) are not supported: its "
                    "backward computes the gradients without an autograd graph, so their derivative would "
                    "be wrong. Compute this op with PyTorch where a second derivative is needed"
                )
            return backward(ctx, *grads)

        return wrapper

    return decorate


# Why a loss refuses a second backward (retain_graph=True): its gradients are computed in the
# forward and the first backward scales them in place. The PyTorch fallback keeps the same rule,
# so code that backpropagates twice fails in a CPU run as it would on a GPU.
_ONCE = {
    "cross_entropy": (
        "liger_portable cross_entropy can run backward only once: the gradient computed in the "
        "forward was scaled in place by the first backward. For retain_graph=True or double "
        "backward use torch.nn.functional.cross_entropy."
    ),
    "fused_linear_cross_entropy": (
        "liger_portable fused_linear_cross_entropy can run backward only once: its gradients are "
        "computed in the forward and scaled in place by the first backward. For retain_graph=True "
        "or double backward use reduction='none' and reduce it yourself."
    ),
}


def backward_once(ctx: Any, op: str) -> None:
    """Mark ``ctx``'s backward as run; raise the error of ``op`` (a key of ``_ONCE``) if it had run."""
    if getattr(ctx, "done", False):
        raise RuntimeError(_ONCE[op])
    ctx.done = True
