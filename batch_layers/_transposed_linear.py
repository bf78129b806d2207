"""A linear layer whose weight is stored ``(in_features, out_features)``: transformers' ``Conv1D`` (GPT-2)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._base import copy_into_every_model
from ._linear import Linear

__all__ = ["TransposedLinear"]


class TransposedLinear(Linear):
    r"""``batch`` independent linear layers storing their weights transposed, ``y = x @ W + b`` with ``W`` of
    shape ``(in_features, out_features)``: transformers' ``Conv1D`` (GPT-2, GPT, CTRL), so that a batched
    model's state dict keeps the plain one's keys and shapes.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        batch: number of models B.

    Shape:
        - Input: ``(B*n, *, in_features)`` with the model axis merged into dim 0, or the shared
          ``(n, *, in_features)`` input of a shared-input forward.
        - Output: ``(B*n, *, out_features)``.

    Attributes:
        weight: ``(B, in_features, out_features)``, each slice initialised as ``Conv1D`` does (normal, std 0.02).
        bias: ``(B, out_features)``, zeros.

    Examples::

        >>> layer = TransposedLinear(20, 30, batch=4)
        >>> layer.weight.shape
        torch.Size([4, 20, 30])
        >>> layer(torch.randn(4 * 8, 20)).shape
        torch.Size([32, 30])
    """

    base_class: ClassVar[type[nn.Module]] = nn.Module  # transformers' Conv1D, registered by name

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, batch=batch, device=device, dtype=dtype)
        self.weight = nn.Parameter(self.weight.detach().transpose(1, 2).contiguous())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every model's slice as transformers' ``Conv1D`` does."""
        nn.init.normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> TransposedLinear:
        """From a ``Conv1D`` (``weight (nx, nf)``, ``bias (nf,)``)."""
        in_features, out_features = module.weight.shape
        layer = cls(in_features, out_features, batch=batch, device=module.weight.device, dtype=module.weight.dtype)
        copy_into_every_model(layer, module)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_form(x, self.weight.transpose(1, 2), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch={self.batch}"
