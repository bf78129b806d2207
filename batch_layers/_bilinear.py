from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from . import functional
from ._base import UNBATCHED, AbstractBatchModule, copy_into_every_model

__all__ = ["Bilinear"]


class Bilinear(AbstractBatchModule):
    r"""``batch`` independent :class:`torch.nn.Bilinear` layers: ``y = x1^T W_o x2 + b_o`` per model.

    Computed as one batched matrix product that contracts one input with every model's weight, followed
    by a broadcast multiply-and-sum with the other input. Which input is contracted first (or whether the
    outer product ``x1 x2^T`` is contracted with the weight instead) is chosen to keep the intermediate
    smallest; a shared input is contracted first as one dense product against all models' weights, so it
    is never copied B times.

    Args:
        in1_features: size of each first input sample.
        in2_features: size of each second input sample.
        out_features: size of each output sample.
        bias: if ``False``, no model has an additive bias.
        batch: number of models B.

    Shape:
        - Input1: ``(B*n, *, in1_features)``, Input2: ``(B*n, *, in2_features)`` with the same leading dims
          (the model axis may also sit in another leading dim inside a ``BatchModule``, e.g.
          ``(seq, B*n, in)``); either may be the shared ``(n, *, in)`` input of a shared-input forward.
        - Output: ``(B*n, *, out_features)``.

    Attributes:
        weight: ``(B, out_features, in1_features, in2_features)``, each slice initialised as torch does.
        bias: ``(B, out_features)``.

    Examples::

        >>> layer = Bilinear(5, 4, 3, batch=2)
        >>> layer(torch.randn(2 * 6, 5), torch.randn(2 * 6, 4)).shape
        torch.Size([12, 3])
    """

    base_class: ClassVar[type[nn.Module]] = nn.Bilinear
    merged_order = "models"

    def __init__(
        self,
        in1_features: int,
        in2_features: int,
        out_features: int,
        bias: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.in1_features = in1_features
        self.in2_features = in2_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(batch, out_features, in1_features, in2_features, **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(batch, out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every model's slice as :meth:`torch.nn.Bilinear.reset_parameters` does."""
        bound = 1 / math.sqrt(self.in1_features) if self.in1_features > 0 else 0
        for i in range(self.batch):
            nn.init.uniform_(self.weight[i], -bound, bound)
            if self.bias is not None:
                nn.init.uniform_(self.bias[i], -bound, bound)

    @classmethod
    def from_module(cls, module: nn.Bilinear, batch: int) -> Bilinear:
        layer = cls(
            module.in1_features,
            module.in2_features,
            module.out_features,
            module.bias is not None,
            batch=batch,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        copy_into_every_model(layer, module)
        return layer

    def _check_inputs(self, x1: Tensor, x2: Tensor) -> None:
        if x1.dim() < 2 or x2.dim() < 2:
            raise ValueError(
                f"Bilinear: expected inputs (B*n, *, features) with the model axis merged into dim 0, got shapes "
                f"{tuple(x1.shape)} and {tuple(x2.shape)}; {UNBATCHED}"
            )
        if x1.dim() == 0 or x1.shape[-1] != self.in1_features:
            raise ValueError(f"Bilinear: expected input1 of shape (B*n, *, {self.in1_features}), got {tuple(x1.shape)}")
        if x2.dim() == 0 or x2.shape[-1] != self.in2_features:
            raise ValueError(f"Bilinear: expected input2 of shape (B*n, *, {self.in2_features}), got {tuple(x2.shape)}")

    def forward(self, input1: Tensor, input2: Tensor) -> Tensor:
        self._check_inputs(input1, input2)
        shared = (self.is_shared(input1), self.is_shared(input2))
        if not any(shared):
            dim = self.merged_dim(input1)
            if dim:  # sequence-first layout: bring the model axis to the front
                return self.forward(input1.movedim(dim, 0), input2.movedim(dim, 0)).movedim(0, dim)
        return functional.bilinear(input1, input2, self.weight, self.bias, layout=self.layout, shared=shared)

    def extra_repr(self) -> str:
        return f"{nn.Bilinear.extra_repr(self)}, batch={self.batch}"
