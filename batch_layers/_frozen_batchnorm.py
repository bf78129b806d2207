"""Batched ``torchvision.ops.misc.FrozenBatchNorm2d``: a batch norm whose statistics and affine are fixed.

torchvision's class is a plain ``nn.Module`` (not an ``nn.BatchNorm2d``) holding four buffers and no
parameter. Run unbatched on the merged model axis, every model would share one set of those buffers; here
each model has its own (``(B, C)`` each, as a pretrained backbone per model has), applied as one fused
scale-and-shift. batch_layers does not import torchvision: torchmb registers this class for torchvision's
by name, when a model holding one is converted.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._base import AbstractBatchModule, copy_into_every_model
from .functional._norm import frozen_batch_norm

__all__ = ["FrozenBatchNorm2d"]


class FrozenBatchNorm2d(AbstractBatchModule):
    """``batch`` independent ``torchvision.ops.misc.FrozenBatchNorm2d``:
    ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias`` with each model's own buffers.

    Args:
        num_features: channels C.
        eps: added to the variance.
        batch: number of models B.

    Shape:
        - Input: ``(B*n, C, H, W)`` (or the shared ``(n, C, H, W)``). Output: ``(B*n, C, H, W)``.

    Attributes:
        weight, bias, running_mean, running_var: buffers ``(B, C)``: ones, zeros, zeros, ones.
    """

    merged_order = "models"
    merged_orders = ("models", "samples")

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.register_buffer("weight", torch.ones(batch, num_features, **factory_kwargs))
        self.register_buffer("bias", torch.zeros(batch, num_features, **factory_kwargs))
        self.register_buffer("running_mean", torch.zeros(batch, num_features, **factory_kwargs))
        self.register_buffer("running_var", torch.ones(batch, num_features, **factory_kwargs))

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> FrozenBatchNorm2d:
        layer = cls(
            module.weight.shape[0], module.eps, batch=batch, device=module.weight.device, dtype=module.weight.dtype
        )
        copy_into_every_model(layer, module)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}: expected an input (B*n, {self.num_features}, H, W), got {tuple(x.shape)}"
            )
        shared = self.is_shared(x)
        if not shared:
            self.check_merged(x)
        return frozen_batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.eps, layout=self.layout, shared=shared
        )

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, batch={self.batch}"
