"""Activations with parameters: PReLU. (Parameter-free activations run on the merged axis unchanged.)"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from . import functional
from ._base import AbstractBatchModule, copy_into_every_model

__all__ = ["PReLU"]

class PReLU(AbstractBatchModule):
    """``batch`` independent :class:`torch.nn.PReLU` layers.

    Args:
        num_parameters: 1 (one slope per model) or the number of channels C (one slope per channel, dim 1
            of the input as in torch).
        init: initial slope.
        batch: number of models B.

    Shape:
        - Input: ``(B*n, *)``, or ``(B*n, C, *)`` when ``num_parameters = C``; the shared ``(n, ...)`` input of
          a shared-input forward. With one slope per model the model axis may also sit in dim 1 inside a
          ``BatchModule`` (sequence-first ``(seq, B*n, d)``).
        - Output: same shape as the input (``(B*n, ...)`` for a shared input).

    Attributes:
        weight: ``(B, num_parameters)``, filled with ``init``.

    Examples::

        >>> act = PReLU(8, batch=4)
        >>> act(torch.randn(4 * 2, 8, 5)).shape
        torch.Size([8, 8, 5])
    """

    base_class: ClassVar[type[nn.Module]] = nn.PReLU
    merged_order = "models"

    def __init__(
        self,
        num_parameters: int = 1,
        init: float = 0.25,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        if num_parameters < 1:
            raise ValueError(f"num_parameters must be at least 1, got {num_parameters}")
        self.num_parameters = num_parameters
        self.init = init
        self.weight = nn.Parameter(torch.empty(batch, num_parameters, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every model's slopes to ``init``, as ``torch.nn.PReLU`` does."""
        nn.init.constant_(self.weight, self.init)

    @classmethod
    def from_module(cls, module: nn.PReLU, batch: int) -> PReLU:
        layer = cls(
            module.num_parameters,
            module.init,
            batch=batch,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        copy_into_every_model(layer, module)
        return layer

    def forward(self, input: Tensor) -> Tensor:
        channels = self.num_parameters
        if channels > 1 and (input.dim() < 2 or input.shape[1] != channels):
            raise ValueError(
                f"PReLU: expected an input of shape (B*n, {channels}, *) for num_parameters={channels}, "
                f"got {tuple(input.shape)}"
            )
        if input.dim() == 0:
            raise ValueError("PReLU: expected an input of shape (B*n, *) with the merged model axis, got a scalar")
        shared = self.is_shared(input)
        if channels == 1 and not shared:
            dim = self.merged_dim(input, feature_dims=max(input.dim() - 2, 0))
            if dim:  # sequence-first layout
                return self.forward(input.movedim(dim, 0)).movedim(0, dim)
        elif not shared:
            self.check_merged(input)
        return functional.prelu(input, self.weight, layout=self.layout, shared=shared)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}, batch={self.batch}"
