from __future__ import annotations

import functools
import math
from typing import ClassVar

import torch
from torch import Tensor, nn

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
        device = input1.device.type
        if torch.is_autocast_enabled(device):
            # torch.bilinear is on autocast's "promote" list (computed in the widest input dtype), while the
            # bmm/matmul used here would run in the low-precision dtype: do what autocast does for bilinear.
            tensors = [t for t in (input1, input2, self.weight, self.bias) if t is not None]
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
            with torch.autocast(device, enabled=False):
                return self._forward(input1.to(dtype), input2.to(dtype))
        return self._forward(input1, input2)

    def _forward(self, input1: Tensor, input2: Tensor) -> Tensor:
        shared1, shared2 = self.is_shared(input1), self.is_shared(input2)
        if not (shared1 or shared2):
            dim = self.merged_dim(input1)
            if dim:  # sequence-first layout: bring the model axis to the front
                return self._forward(input1.movedim(dim, 0), input2.movedim(dim, 0)).movedim(0, dim)
        batch = self.batch
        shape1 = (batch * input1.shape[0], *input1.shape[1:]) if shared1 else tuple(input1.shape)
        shape2 = (batch * input2.shape[0], *input2.shape[1:]) if shared2 else tuple(input2.shape)
        if shape1[:-1] != shape2[:-1]:
            raise ValueError(
                f"Bilinear: input1 {tuple(input1.shape)} and input2 {tuple(input2.shape)} must agree in every dim "
                "but the last (per model)"
            )
        out, in1, in2 = self.out_features, self.in1_features, self.in2_features
        x1 = self.split(input1).reshape(batch, -1, in1)  # (B, m, in1); an expanded view when shared
        x2 = self.split(input2).reshape(batch, -1, in2)
        rows = x1.shape[1]
        if shared1 or (not shared2 and out * in2 <= min(out * in1, in1 * in2)):
            partial = self._contract(input1, x1, shared1, self.weight.transpose(1, 2), out * in2)
            y = torch.matmul(partial.view(batch, rows, out, in2), x2.unsqueeze(-1)).squeeze(-1)
        elif shared2 or out * in1 <= in1 * in2:
            partial = self._contract(input2, x2, shared2, self.weight.permute(0, 3, 1, 2), out * in1)
            y = torch.matmul(partial.view(batch, rows, out, in1), x1.unsqueeze(-1)).squeeze(-1)
        else:  # the outer product x1 x2^T is the smallest intermediate
            outer = (x1.unsqueeze(3) * x2.unsqueeze(2)).reshape(batch, rows, in1 * in2)
            y = torch.bmm(outer, self.weight.reshape(batch, out, in1 * in2).transpose(1, 2))
        if self.bias is not None:
            y = y + self.bias.unsqueeze(1).to(y.dtype)
        return y.reshape(*shape1[:-1], out)

    def _contract(self, given: Tensor, rows: Tensor, shared: bool, weight: Tensor, width: int) -> Tensor:
        """``rows @ weight`` per model, ``(B, m, width)``; ``weight`` is ``(B, in, ...)`` with ``in`` first.

        A shared input is multiplied once by all models' weights side by side (one dense GEMM).
        """
        batch, features = self.batch, weight.shape[1]
        if shared:
            dense = given.reshape(-1, features) @ weight.transpose(0, 1).reshape(features, batch * width)
            return dense.view(-1, batch, width).transpose(0, 1)
        return torch.bmm(rows, weight.reshape(batch, features, width))

    def extra_repr(self) -> str:
        return f"{nn.Bilinear.extra_repr(self)}, batch={self.batch}"
