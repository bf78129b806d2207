"""The batched dropout family: torch's own dropout on the merged axis, masks independent across models.

On the merged ``(B*n, ...)`` tensor every model already gets its own mask from one kernel launch. A
*shared* ``(n, ...)`` input would get one mask for all B models (plain models fed the same data each draw
their own), so it is expanded to ``(B*n, ...)`` first, when dropout is active (in eval mode, or with
``p = 0``, dropout is the identity and the input stays shared).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from .._layout import Layout, expand_shared

__all__ = [
    "alpha_dropout",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "feature_alpha_dropout",
]




def _batched(
    drop: Callable[[Tensor, float, bool, bool], Tensor], input: Tensor, p: float, training: bool, inplace: bool,
    layout: Layout, shared: bool,
) -> Tensor:  # fmt: skip
    if shared and training and p > 0:
        input = expand_shared(input, layout)  # one mask per model
    return drop(input, p, training, inplace)


_ARGS = """

    Args:
        input: ``(B*n, ...)`` merged in ``layout``'s order, or, with ``shared``, the ``(n, ...)`` input every
            model sees (expanded to ``(B*n, ...)`` when dropout is active, so each model draws its own mask).
        p, training, inplace: as in ``torch.nn.functional``.
        layout: the number of models and the order of the merged dim 0.
        shared: whether ``input`` is one ``(n, ...)`` tensor shared by all models.
"""


def dropout(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, layout: Layout,
    shared: bool = False,
) -> Tensor:  # fmt: skip
    """``F.dropout`` of B models: one Bernoulli mask per element and model."""
    return _batched(F.dropout, input, p, training, inplace, layout, shared)


def dropout1d(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, layout: Layout,
    shared: bool = False,
) -> Tensor:  # fmt: skip
    """``F.dropout1d`` of B models: whole channels of ``(B*n, C, L)`` per sample and model."""
    return _batched(F.dropout1d, input, p, training, inplace, layout, shared)


def dropout2d(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, layout: Layout,
    shared: bool = False,
) -> Tensor:  # fmt: skip
    """``F.dropout2d`` of B models: whole channels of ``(B*n, C, H, W)`` per sample and model."""
    return _batched(F.dropout2d, input, p, training, inplace, layout, shared)


def dropout3d(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, layout: Layout,
    shared: bool = False,
) -> Tensor:  # fmt: skip
    """``F.dropout3d`` of B models: whole channels of ``(B*n, C, D, H, W)`` per sample and model."""
    return _batched(F.dropout3d, input, p, training, inplace, layout, shared)


def alpha_dropout(
    input: Tensor, p: float = 0.5, training: bool = False, inplace: bool = False, *, layout: Layout,
    shared: bool = False,
) -> Tensor:  # fmt: skip
    """``F.alpha_dropout`` of B models (keeps SELU's mean and variance per model)."""
    return _batched(F.alpha_dropout, input, p, training, inplace, layout, shared)


def feature_alpha_dropout(
    input: Tensor, p: float = 0.5, training: bool = False, inplace: bool = False, *, layout: Layout,
    shared: bool = False,
) -> Tensor:  # fmt: skip
    """``F.feature_alpha_dropout`` of B models: alpha dropout of whole channels per sample and model."""
    return _batched(F.feature_alpha_dropout, input, p, training, inplace, layout, shared)


for _function in (dropout, dropout1d, dropout2d, dropout3d, alpha_dropout, feature_alpha_dropout):
    _function.__doc__ += _ARGS
