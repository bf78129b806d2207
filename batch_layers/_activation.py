"""Activations with parameters: PReLU. (Parameter-free activations run on the merged axis unchanged.)"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._base import AbstractBatchModule, autocast_dtype, copy_into_every_model

__all__ = ["PReLU"]

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
        if channels == 1 and not self.is_shared(input):
            dim = self.merged_dim(input, feature_dims=max(input.dim() - 2, 0))
            if dim:  # sequence-first layout
                return self.forward(input.movedim(dim, 0)).movedim(0, dim)
        models = self.split(input)  # (B, m, ...); an expanded view of a shared input
        trailing = max(input.dim() - 2, 0)
        if channels > 1:
            weight = self.weight.view(self.batch, 1, channels, *([1] * trailing))
        else:
            weight = self.weight.view(self.batch, *([1] * (models.dim() - 1)))
        y = _prelu(models, weight)
        return y.reshape(-1, *y.shape[2:])

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}, batch={self.batch}"
