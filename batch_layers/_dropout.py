"""The dropout family on the merged model axis, with masks independent across models.

Dropout has no parameters and draws its mask element by element (or channel by channel for the
``Dropout1d/2d/3d`` and ``FeatureAlphaDropout`` variants), so on the merged ``(B*n, ...)`` tensor every
model already gets its own mask from one kernel launch. These classes exist for the one case where that
is not so: a *shared* ``(n, ...)`` input that every model reads. Run as it is, one mask would be drawn for
all B models (plain models fed the same data each draw their own); here the shared input is expanded to
``(B*n, ...)`` before dropping, in training mode only (in eval mode dropout is the identity and the input
stays shared).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from torch import Tensor, nn

from . import functional
from ._base import AbstractBatchModule

__all__ = ["AlphaDropout", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "FeatureAlphaDropout"]


class _Dropout(AbstractBatchModule):
    """``batch`` independent copies of a dropout layer: torch's own forward on the merged axis.

    Args:
        p: probability of an element (or channel) to be zeroed, as in torch.
        inplace: do the operation in place, as in torch.
        batch: number of models B.
    """

    merged_order = "models"
    merged_orders = ("models", "samples")
    base_class: ClassVar[type[nn.Module]]
    # The batched functional of the class: torch's dropout on the merged axis, a shared input expanded first.
    dropout_function: ClassVar[Callable[..., Tensor]]

    def __init__(self, p: float = 0.5, inplace: bool = False, *, batch: int) -> None:
        super().__init__(batch)
        if p < 0 or p > 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = inplace

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> _Dropout:
        return cls(module.p, module.inplace, batch=batch)

    def forward(self, input: Tensor) -> Tensor:
        shared = self.training and self.p > 0 and self.is_shared(input)
        return self.dropout_function(input, self.p, self.training, self.inplace, layout=self.layout, shared=shared)


class Dropout(_Dropout):
    """``batch`` independent :class:`torch.nn.Dropout`: one Bernoulli mask per element and model.

    Examples::

        >>> drop = Dropout(0.5, batch=4)
        >>> drop(torch.ones(4 * 2, 3)).shape
        torch.Size([8, 3])
    """

    base_class = nn.Dropout
    dropout_function = staticmethod(functional.dropout)


class Dropout1d(_Dropout):
    """``batch`` independent :class:`torch.nn.Dropout1d`: whole channels of ``(B*n, C, L)`` per sample."""

    base_class = nn.Dropout1d
    dropout_function = staticmethod(functional.dropout1d)


class Dropout2d(_Dropout):
    """``batch`` independent :class:`torch.nn.Dropout2d`: whole channels of ``(B*n, C, H, W)`` per sample."""

    base_class = nn.Dropout2d
    dropout_function = staticmethod(functional.dropout2d)


class Dropout3d(_Dropout):
    """``batch`` independent :class:`torch.nn.Dropout3d`: whole channels of ``(B*n, C, D, H, W)`` per sample."""

    base_class = nn.Dropout3d
    dropout_function = staticmethod(functional.dropout3d)


class AlphaDropout(_Dropout):
    """``batch`` independent :class:`torch.nn.AlphaDropout` (keeps SELU's mean and variance per model)."""

    base_class = nn.AlphaDropout
    dropout_function = staticmethod(functional.alpha_dropout)


class FeatureAlphaDropout(_Dropout):
    """``batch`` independent :class:`torch.nn.FeatureAlphaDropout`: alpha dropout of whole channels."""

    base_class = nn.FeatureAlphaDropout
    dropout_function = staticmethod(functional.feature_alpha_dropout)
