"""The reference check of a ``batch_layers.functional`` function: B plain ``torch.nn.functional`` calls, one per
model with its own slice of every per-model tensor, compared in outputs and gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from batch_layers.functional import Layout

__all__ = ["assert_matches_plain", "merged"]


def merged(parts: Sequence[Tensor], layout: Layout) -> Tensor:
    """B models' ``(n, ...)`` tensors as one merged ``(B*n, ...)`` tensor in ``layout``'s order."""
    return layout.merge(torch.stack(list(parts)))


def assert_matches_plain(
    batched: Callable[..., Tensor],
    plain: Callable[..., Tensor],
    inputs: Sequence[Tensor] | Tensor,
    params: Sequence[Tensor | None],
    layout: Layout,
    *,
    channels_last: bool = False,
    atol: float = 1e-10,
    rtol: float = 1e-7,
) -> Tensor:
    """``batched(x, *params)`` on the merged ``inputs`` (a list of B per-model tensors; one tensor: the shared
    input) against ``plain(x_i, *[p[i] for p in params])`` for each model ``i``: outputs, the input's gradient
    and every parameter's gradient (those that require it), for one random output gradient. Returns the
    batched output."""
    shared = isinstance(inputs, Tensor)
    x = inputs if shared else merged(inputs, layout)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x = x.detach().requires_grad_()
    own = [None if p is None else p.detach().clone().requires_grad_(p.requires_grad) for p in params]
    y = batched(x, *own)
    grad = torch.randn_like(y)
    y.backward(grad)
    outputs, grads = layout.split(y), layout.split(grad)
    shared_grad = torch.zeros_like(x)
    for i in range(layout.batch):
        x_i = (x if shared else inputs[i]).detach().clone().requires_grad_()
        params_i = [None if p is None else p[i].detach().clone().requires_grad_(p.requires_grad) for p in params]
        y_i = plain(x_i, *params_i)
        y_i.backward(grads[i])
        torch.testing.assert_close(outputs[i], y_i, atol=atol, rtol=rtol, msg=lambda m, i=i: f"model {i} output: {m}")
        for j, (p, p_i) in enumerate(zip(own, params_i)):
            if p is not None and p.requires_grad:
                torch.testing.assert_close(p.grad[i], p_i.grad, atol=atol, rtol=rtol,
                                           msg=lambda m, i=i, j=j: f"model {i} grad of parameter {j}: {m}")
        if shared:
            shared_grad += x_i.grad
        else:
            torch.testing.assert_close(layout.split(x.grad)[i], x_i.grad, atol=atol, rtol=rtol,
                                       msg=lambda m, i=i: f"model {i} input grad: {m}")
    if shared:
        torch.testing.assert_close(x.grad, shared_grad, atol=atol, rtol=rtol)
    return y
