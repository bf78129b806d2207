"""Batched :class:`torch.nn.LinearCrossEntropyLoss`: each model's logits from its own weights, each model's loss
reduced over its own samples.

The plain module holds an ``nn.Linear`` and reshapes its weight in ``forward`` before calling
``F.linear_cross_entropy``; run on all models' stacked weight that reshape would pool them, and a loss
reduced over the merged axis would be one number for all models' samples. Here every model's weight, bias,
class weights and target meet only that model's rows, and a reduced loss is one value per model, ``(B,)``.

Without ``options`` (torch's reference path: logits, then cross entropy) the models run as one call of
``F.linear_cross_entropy`` under ``torch.func.vmap``, whose linear map is one batched product. With
``options`` (torch's chunked path, which saves memory by never holding all logits) each model runs torch's
chunked operator on its own rows, one model after the other: that operator has no batching rule, and under
``vmap`` it would see weights that do not require gradients and return none for them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import AbstractBatchModule, stack_copies
from ._linear import LinearWeights

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(AbstractBatchModule):
    r"""``batch`` independent :class:`torch.nn.LinearCrossEntropyLoss` modules: each model's input times its
    own linear weight, cross entropy against its own targets, reduced per model.

    Args:
        in_features, num_classes, out_features, bias, reduction, weight, ignore_index, label_smoothing, options:
            as for :class:`torch.nn.LinearCrossEntropyLoss`; ``weight`` (the class weights, ``(C,)``) starts
            the same in every model and is kept per model.
        batch: number of models B.

    Shape:
        - Input: ``(B*n, in_features)`` with the model axis merged into dim 0, ``(B*in_features,)`` for
          inputs without a batch dim (``(B, in_features)`` at a ``BatchModule``'s boundary), or the shared
          ``(n, in_features)`` / ``(in_features,)`` input of a shared-input forward.
        - Target: each model's target as the plain module takes it, merged the same way (or shared).
        - Output: with ``reduction='none'``, ``(B*n, *out_features)``, or ``(B,)`` for inputs without a batch
          dim; otherwise ``(B,)``, each model's loss over its own samples.

    Attributes:
        linear.weight: ``(B, num_classes * prod(out_features), in_features)``, each slice initialised as
            ``nn.Linear`` does.
        linear.bias: ``(B, num_classes * prod(out_features))``.
        weight: ``(B, num_classes)`` class weights, or ``None``.

    Examples::

        >>> loss = LinearCrossEntropyLoss(5, 10, batch=4)
        >>> loss(torch.randn(4 * 8, 5), torch.randint(0, 10, (4 * 8,))).shape
        torch.Size([4])
    """

    base_class: ClassVar[type[nn.Module]] = getattr(nn, "LinearCrossEntropyLoss", nn.Module)  # torch >= 2.13
    merged_order = "models"

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        out_features: tuple[int, ...] = (),
        bias: bool = False,
        reduction: str = "mean",
        weight: Tensor | None = None,
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        options: Any = None,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        if weight is not None and weight.shape != (num_classes,):
            raise RuntimeError(f"expected weight shape to be {(num_classes,)}, got {tuple(weight.shape)}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise RuntimeError(f"expected label_smoothing to be in range [0, 1], got {label_smoothing}")
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"{reduction} is not a valid value for reduction")
        self.num_classes = num_classes
        self.out_features = tuple(out_features)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.options = options
        factory_kwargs = {"device": device, "dtype": dtype}
        outputs = math.prod(out_features, start=num_classes)
        self.linear = LinearWeights(batch, outputs, in_features, bias, factory_kwargs)
        self.register_buffer("weight", None if weight is None else stack_copies(weight, batch))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every model's slice as ``nn.Linear.reset_parameters`` does."""
        for i in range(self.batch):
            nn.init.kaiming_uniform_(self.linear.weight[i], a=math.sqrt(5))
            if self.linear.bias is not None:
                bound = 1 / math.sqrt(self.linear.in_features) if self.linear.in_features > 0 else 0
                nn.init.uniform_(self.linear.bias[i], -bound, bound)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> LinearCrossEntropyLoss:
        layer = cls(
            module.linear.in_features,
            module.num_classes,
            out_features=module.out_features,
            bias=module.linear.bias is not None,
            reduction=module.reduction,
            weight=module.weight,
            ignore_index=module.ignore_index,
            label_smoothing=module.label_smoothing,
            options=module.options,
            batch=batch,
            device=module.linear.weight.device,
            dtype=module.linear.weight.dtype,
        )
        with torch.no_grad():
            for name, target in layer.named_parameters():
                target.copy_(stack_copies(module.get_parameter(name), batch))
        return layer

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        x, labels = self._by_model(input, "input"), self._by_model(target, "target")
        weight = self.linear.weight.view(self.batch, self.num_classes, *self.out_features, self.linear.in_features)
        bias = self.linear.bias
        if bias is not None:
            bias = bias.view(self.batch, self.num_classes, *self.out_features)
        loss = functools.partial(
            F.linear_cross_entropy,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            options=self.options,
        )
        if self.options is None:
            args = (x, weight, labels, bias, self.weight)
            in_dims = tuple(None if arg is None else 0 for arg in args)
            one_model = lambda x, w, t, b, c: loss(x, w, t, linear_bias=b, weight=c)  # noqa: E731
            losses = torch.func.vmap(one_model, in_dims=in_dims)(*args)
        else:
            losses = torch.stack([
                loss(
                    x[i],
                    weight[i],
                    labels[i],
                    linear_bias=None if bias is None else bias[i],
                    weight=None if self.weight is None else self.weight[i],
                )
                for i in range(self.batch)
            ])
        return losses if losses.dim() == 1 else losses.reshape(-1, *losses.shape[2:])

    def _by_model(self, value: Tensor, what: str) -> Tensor:
        """``(B, *plain_shape)``: a merged tensor's rows by model, or the shared one as B views."""
        if self.is_shared(value):
            return value.expand(self.batch, *value.shape)
        if value.dim() == 0 or value.shape[0] % self.batch:
            raise ValueError(
                f"LinearCrossEntropyLoss(batch={self.batch}): expected the {what}'s dim 0 to hold the B = "
                f"{self.batch} models' merged rows (a multiple of B), got shape {tuple(value.shape)}"
            )
        return value.reshape(self.batch, -1, *value.shape[1:])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.linear.in_features}, num_classes={self.num_classes}, "
            f"out_features={self.out_features}, bias={self.linear.bias is not None}, reduction={self.reduction}, "
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, options={self.options}, "
            f"batch={self.batch}"
        )
