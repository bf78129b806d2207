"""Batched ``F.prelu``: every model's slopes in one elementwise kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from .._base import autocast_dtype
from .._layout import Layout

__all__ = ["prelu"]

# torch.prelu reshapes its weight to (1, C, 1, ...) and calls this broadcasting elementwise kernel (with its
# own fused backward); calling it directly with a (B, 1, C, 1, ...) weight gives every model its slopes in
# one kernel. It exists in every supported torch (>= 2.5); the fallback keeps the maths if it goes away.
_prelu_kernel = getattr(torch, "_prelu_kernel", None)


def _prelu(x: Tensor, weight: Tensor) -> Tensor:
    dtype = autocast_dtype(x.device.type)
    if dtype is not None and x.is_floating_point():
        # torch.prelu is on autocast's lower-precision list; the kernel it calls is not, so cast as it would.
        x, weight = x.to(dtype), weight.to(dtype)
    if _prelu_kernel is not None:
        return _prelu_kernel(x, weight)
    return torch.where(x > 0, x, weight * x)


def prelu(input: Tensor, weight: Tensor, *, layout: Layout, shared: bool = False) -> Tensor:
    """``F.prelu`` of B models: model ``b``'s rows scaled below zero by its own slopes ``weight[b]``.

    Args:
        input: ``(B*n, *)`` merged in ``layout``'s order, ``(B*n, C, *)`` with one slope per channel, or,
            with ``shared``, the ``(n, ...)`` input every model sees.
        weight: ``(B, 1)`` (one slope per model) or ``(B, C)`` (one per channel, dim 1 of the input).
        layout: the number of models and the order of the merged dim 0.
        shared: whether ``input`` is one ``(n, ...)`` tensor shared by all models.

    Returns:
        the input's shape (``(B*n, ...)`` for a shared input), in ``layout``'s order.
    """
    batch, channels = layout.batch, weight.shape[-1]
    if input.dim() == 0 or (channels > 1 and (input.dim() < 2 or input.shape[1] != channels)):
        raise ValueError(
            f"prelu: expected an input of shape (B*n, {channels}, *) for {channels} slopes per model, got "
            f"{tuple(input.shape)}"
        )
    if shared:
        models = input.expand(batch, *input.shape)
    elif input.shape[0] % batch:
        raise ValueError(
            f"prelu: expected dim 0 of the merged input to be a multiple of B = {batch} (the merged model axis), "
            f"got shape {tuple(input.shape)}"
        )
    else:
        models = layout.split(input)  # (B, m, ...)
    if channels > 1:
        slopes = weight.view(batch, 1, channels, *([1] * (input.dim() - 2)))
    else:
        slopes = weight.view(batch, *([1] * (models.dim() - 1)))
    return layout.merge(_prelu(models, slopes))
