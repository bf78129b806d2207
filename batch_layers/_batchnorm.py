from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import AbstractBatchModule, copy_into_every_model
from .functional._norm import batch_norm

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]  # and _NormBase, shared with instance norm


class _NormBase(AbstractBatchModule):
    """What batch and instance norms share (torch's ``_NormBase``): per-model affine weights ``(B, C)``,
    running statistics ``(B, C)`` and ``num_batches_tracked`` ``(B,)``, their reset and ``from_module``."""

    merged_order = "models"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        if affine:
            self.weight = nn.Parameter(torch.empty(batch, num_features, **factory_kwargs))
            if bias:
                self.bias = nn.Parameter(torch.empty(batch, num_features, **factory_kwargs))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(batch, num_features, **factory_kwargs))
            self.register_buffer("running_var", torch.ones(batch, num_features, **factory_kwargs))
            self.register_buffer(
                "num_batches_tracked", torch.zeros(batch, dtype=torch.long, device=factory_kwargs["device"])
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> _NormBase:
        reference = module.weight if module.affine else module.running_mean
        layer = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            batch=batch,
            device=None if reference is None else reference.device,
            dtype=None if reference is None else reference.dtype,
            bias=getattr(module, "bias", None) is not None,
        )
        copy_into_every_model(layer, module)
        return layer


class _BatchNorm(_NormBase):
    """``batch`` independent batch norms, each with its own statistics, affine weights and running stats.

    Model ``b``'s channels become channels ``b*C .. b*C + C-1`` of one batch norm over ``(n, B*C, ...)``,
    so the statistics of a model only ever mix that model's samples. Running statistics are per model:
    ``running_mean`` / ``running_var`` are ``(B, C)`` and ``num_batches_tracked`` is ``(B,)``.
    """

    expected_dims: ClassVar[tuple[int, ...]]
    merged_orders = ("models", "samples")
    grouped_layout = True
    functional_forms: ClassVar[dict[Callable, str]] = {F.batch_norm: "batch_norm_form"}

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() not in self.expected_dims:
            raise ValueError(
                f"{type(self).__name__}: expected a {' or '.join(map(str, self.expected_dims))}-D input, "
                f"got shape {tuple(x.shape)}"
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        shared = self.is_shared(input)
        if not shared:
            self.check_merged(input)
        num_batches_tracked = self._own_state("num_batches_tracked")
        if self.training and self.track_running_stats:
            num_batches_tracked.add_(1)
        return batch_norm(
            input,
            self._own_state("running_mean"),
            self._own_state("running_var"),
            self._own_state("weight"),
            self._own_state("bias"),
            self.training or not self.track_running_stats,
            self.momentum,
            self.eps,
            layout=self.layout,
            shared=shared,
            num_batches_tracked=num_batches_tracked,
        )

    def batch_norm_form(
        self,
        x: Tensor,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        training: bool = False,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> Tensor:
        """``F.batch_norm`` of a merged input with per-model ``(B, C)`` statistics and weights, each model's
        channels a group of one batch norm (running statistics updated in place, per model)."""
        shared = self.is_shared(x)
        return batch_norm(
            x, running_mean, running_var, weight, bias, training, momentum, eps, layout=self.layout, shared=shared
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}, batch={self.batch}"
        )


class BatchNorm1d(_BatchNorm):
    """``batch`` independent :class:`torch.nn.BatchNorm1d`. Input ``(B*n, C)`` or ``(B*n, C, L)``."""

    base_class = nn.BatchNorm1d
    expected_dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """``batch`` independent :class:`torch.nn.BatchNorm2d`. Input ``(B*n, C, H, W)``.

    Examples::

        >>> norm = BatchNorm2d(8, batch=4)
        >>> norm(torch.randn(4 * 2, 8, 5, 5)).shape
        torch.Size([8, 8, 5, 5])
    """

    base_class = nn.BatchNorm2d
    expected_dims = (4,)


class BatchNorm3d(_BatchNorm):
    """``batch`` independent :class:`torch.nn.BatchNorm3d`. Input ``(B*n, C, D, H, W)``."""

    base_class = nn.BatchNorm3d
    expected_dims = (5,)
