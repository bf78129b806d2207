"""Batched weight-standardised convolutions (timm's ``StdConv2d`` and ``ScaledStdConv2d``): each model's weight
standardised per output channel, then the batched :func:`~batch_layers.functional.conv2d`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .._layout import Layout
from ._conv import conv2d

__all__ = ["standardize_weight", "std_conv2d"]


def standardize_weight(weight: Tensor, eps: float = 1e-6, gain: Tensor | None = None) -> Tensor:
    """timm's weight standardisation for B models: ``F.batch_norm`` of the ``(B, out, in/groups, kh, kw)``
    ``weight`` viewed ``(1, B*out, -1)``, every (model, output channel) a channel of its own (mean 0, biased
    variance 1, ``eps`` added), scaled by ``gain`` (``(B, out, 1, 1, 1)``, ``ScaledStdConv2d``'s
    ``gain * scale``) where given."""
    channels = weight.reshape(1, weight.shape[0] * weight.shape[1], -1)
    factors = None if gain is None else gain.reshape(-1)
    standardized = F.batch_norm(channels, None, None, weight=factors, training=True, momentum=0.0, eps=eps)
    return standardized.reshape_as(weight)


def std_conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: str | int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
    eps: float = 1e-6,
    gain: Tensor | None = None,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """timm's ``StdConv2d`` (``ScaledStdConv2d`` with ``gain``) for B models: :func:`conv2d` with the weight
    of :func:`standardize_weight`. Arguments as :func:`conv2d`'s, plus ``eps`` and ``gain``."""
    standardized = standardize_weight(weight, eps, gain)
    return conv2d(input, standardized, bias, stride, padding, dilation, groups, layout=layout, shared=shared)
