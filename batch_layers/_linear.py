from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import AbstractBatchModule, stack_copies

__all__ = ["Linear"]


class Linear(AbstractBatchModule):
    r"""``batch`` independent :class:`torch.nn.Linear` layers as one batched matrix product.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: if ``False``, no model has an additive bias.
        batch: number of models B.

    Shape:
        - Input: ``(B*n, *, in_features)`` with the model axis merged into dim 0 (or, inside a
          ``BatchModule``, into another leading dim, e.g. ``(seq, B*n, in_features)``), or the shared
          ``(n, *, in_features)`` input of a shared-input forward.
        - Output: ``(B*n, *, out_features)``.

    Attributes:
        weight: ``(B, out_features, in_features)``, each slice initialised as ``nn.Linear`` does.
        bias: ``(B, out_features)``.

    Examples::

        >>> layer = Linear(20, 30, batch=4)
        >>> layer(torch.randn(4 * 8, 20)).shape
        torch.Size([32, 30])
    """

    base_class: ClassVar[type[nn.Module]] = nn.Linear
    merged_order = "models"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(batch, out_features, in_features, **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(batch, out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every model's slice as :meth:`torch.nn.Linear.reset_parameters` does."""
        for i in range(self.batch):
            nn.init.kaiming_uniform_(self.weight[i], a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                nn.init.uniform_(self.bias[i], -bound, bound)

    @classmethod
    def from_module(cls, module: nn.Linear, batch: int) -> Linear:
        layer = cls(
            module.in_features,
            module.out_features,
            module.bias is not None,
            batch=batch,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(stack_copies(module.weight, batch))
            if module.bias is not None:
                layer.bias.copy_(stack_copies(module.bias, batch))
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if self.is_shared(x):
            return self._shared_forward(x)
        dim = self.merged_dim(x)
        if dim:  # sequence-first layout: bring the model axis to the front for the batched product
            return self.forward(x.movedim(dim, 0)).movedim(0, dim)
        rows = x.reshape(self.batch, -1, self.in_features)
        weight_t = self.weight.transpose(1, 2)
        if self.bias is None:
            y = torch.bmm(rows, weight_t)
        else:
            y = torch.baddbmm(self.bias.unsqueeze(1), rows, weight_t)
        return y.view(*x.shape[:-1], self.out_features)

    def _shared_forward(self, x: Tensor) -> Tensor:
        # One GEMM against all models' weights side by side: (m, in) @ (in, B*out), no B-fold input copy.
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.reshape(-1)
        y = F.linear(rows, self.weight.reshape(-1, self.in_features), bias)
        y = y.view(-1, self.batch, self.out_features).transpose(0, 1)
        return y.reshape(self.batch * x.shape[0], *x.shape[1:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, batch={self.batch}"
