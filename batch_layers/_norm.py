"""Per-sample normalisations: LayerNorm, RMSNorm, GroupNorm, InstanceNorm1d/2d/3d.

Their statistics are taken within one sample, so the normalisation itself runs unchanged on the merged
``(B*n, ...)`` tensor (torch's fused kernels, no copies); only the elementwise affine differs per model,
and it is applied as one broadcast product and sum with the ``(B, ...)`` weights on the ``(B, n, ...)``
view. A shared ``(n, ...)`` input is normalised once; the per-model affine broadcasts it to ``(B, n, ...)``
(without an affine the output stays shared). On a GPU with Triton, LayerNorm and RMSNorm run fused kernels
that apply each model's affine themselves (``functional/_norm.py`` and the kernel table of norms).

``nn.LocalResponseNorm`` has no parameters and normalises across the channels of one sample, so it needs
no batched class: it runs on the merged axis as it is (tested against B plain models).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import AbstractBatchModule, copy_into_every_model
from ._batchnorm import _NormBase
from .functional._norm import group_norm, instance_norm, layer_norm, rms_norm

__all__ = ["GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm", "RMSNorm"]


def _normalized_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


class _AffineNorm(AbstractBatchModule):
    """What the per-sample norms share: the check of an input whose normalised values a per-model affine (or
    per-model running statistics) will split by model."""

    merged_order = "models"

    def _shared_or_checked(self, x: Tensor, per_model: bool) -> bool:
        """Whether ``x`` is the shared input; if not and ``per_model``, refuse a dim 0 that cannot hold B models."""
        shared = self.is_shared(x)
        if not shared and per_model:
            self.check_merged(x)
        return shared


class LayerNorm(_AffineNorm):
    """``batch`` independent :class:`torch.nn.LayerNorm` layers.

    Args:
        normalized_shape: the trailing shape normalised over, as in torch.
        eps: added to the variance.
        elementwise_affine: per-model ``weight`` (and ``bias``) of ``normalized_shape``.
        bias: whether the affine has a bias (torch's ``bias`` argument).
        batch: number of models B.

    Shape:
        - Input: ``(B*n, *, *normalized_shape)`` (inside a ``BatchModule`` the model axis may sit in another
          leading dim, e.g. ``(seq, B*n, d)``), or the shared ``(n, *, *normalized_shape)``.
        - Output: same shape as the input (``(B*n, ...)`` for a shared input with an affine).

    Attributes:
        weight: ``(B, *normalized_shape)``, ones. bias: ``(B, *normalized_shape)``, zeros.

    Examples::

        >>> norm = LayerNorm(16, batch=4)
        >>> norm(torch.randn(4 * 2, 10, 16)).shape
        torch.Size([8, 10, 16])
    """

    base_class: ClassVar[type[nn.Module]] = nn.LayerNorm
    functional_forms: ClassVar[dict[Callable, str]] = {F.layer_norm: "layer_norm_form"}

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(batch, *self.normalized_shape, **factory_kwargs))
            if bias:
                self.bias = nn.Parameter(torch.empty(batch, *self.normalized_shape, **factory_kwargs))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every model's weight to ones and bias to zeros, as ``torch.nn.LayerNorm`` does."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    @classmethod
    def from_module(cls, module: nn.LayerNorm, batch: int) -> LayerNorm:
        layer = cls(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            getattr(module, "bias", None) is not None,
            batch=batch,
            device=None if module.weight is None else module.weight.device,
            dtype=None if module.weight is None else module.weight.dtype,
        )
        copy_into_every_model(layer, module)
        return layer

    def forward(self, input: Tensor) -> Tensor:
        k = len(self.normalized_shape)
        if tuple(input.shape[input.dim() - k :]) != self.normalized_shape or input.dim() <= k:
            raise ValueError(
                f"{type(self).__name__}: expected an input of shape (B*n, *, "
                f"{', '.join(map(str, self.normalized_shape))}), got {tuple(input.shape)}"
            )
        if self.weight is None:  # no parameters: per-sample, runs on any layout
            return self._normalize(input, False)
        shared = self.is_shared(input)
        if not shared:
            dim = self.merged_dim(input, feature_dims=k)
            if dim:  # sequence-first layout: bring the model axis to the front
                return self.forward(input.movedim(dim, 0)).movedim(0, dim)
        return self._normalize(input, shared)

    def layer_norm_form(
        self,
        x: Tensor,
        normalized_shape: Sequence[int],
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        eps: float = 1e-5,
    ) -> Tensor:
        """``F.layer_norm`` of a merged input (model axis in dim 0) with per-model weights."""
        shared = self._shared_or_checked(x, weight is not None or bias is not None)
        return layer_norm(x, normalized_shape, weight, bias, eps, layout=self.layout, shared=shared)

    def _normalize(self, x: Tensor, shared: bool) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, layout=self.layout, shared=shared)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, batch={self.batch}"
        )


class RMSNorm(LayerNorm):
    """``batch`` independent :class:`torch.nn.RMSNorm` layers (``nn.RMSNorm`` exists in every supported torch, >= 2.5).

    Args:
        normalized_shape: the trailing shape normalised over.
        eps: added to the mean square; ``None`` uses ``torch.finfo(x.dtype).eps`` as torch does.
        elementwise_affine: per-model ``weight`` of ``normalized_shape`` (RMSNorm has no bias).
        batch: number of models B.

    Shape: as :class:`LayerNorm`. Attributes: ``weight`` ``(B, *normalized_shape)``, ones.
    """

    base_class: ClassVar[type[nn.Module]] = nn.RMSNorm
    functional_forms: ClassVar[dict[Callable, str]] = {F.rms_norm: "rms_norm_form"}

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias=False, batch=batch, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> RMSNorm:
        layer = cls(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            batch=batch,
            device=None if module.weight is None else module.weight.device,
            dtype=None if module.weight is None else module.weight.dtype,
        )
        copy_into_every_model(layer, module)
        return layer

    def forward(self, x: Tensor) -> Tensor:  # torch's RMSNorm names its argument x (LayerNorm: input)
        return super().forward(x)

    def rms_norm_form(
        self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None
    ) -> Tensor:
        """``F.rms_norm`` of a merged input (model axis in dim 0) with per-model weights."""
        shared = self._shared_or_checked(x, weight is not None)
        return rms_norm(x, normalized_shape, weight, eps, layout=self.layout, shared=shared)

    def _normalize(self, x: Tensor, shared: bool) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, layout=self.layout, shared=shared)


class GroupNorm(_AffineNorm):
    """``batch`` independent :class:`torch.nn.GroupNorm` layers.

    Args:
        num_groups: groups the channels are split into.
        num_channels: channels C of the input.
        eps: added to the variance.
        affine: per-model ``weight`` (ones) and ``bias`` (zeros) of shape ``(B, C)``.
        batch: number of models B.
        bias: whether the affine has a bias (torch's keyword-only ``bias``).

    Shape:
        - Input: ``(B*n, C, *)`` or the shared ``(n, C, *)``. Output: ``(B*n, C, *)``.
    """

    base_class: ClassVar[type[nn.Module]] = nn.GroupNorm
    functional_forms: ClassVar[dict[Callable, str]] = {F.group_norm: "group_norm_form"}

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(batch)
        if num_groups < 1 or num_channels % num_groups:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        if affine:
            self.weight = nn.Parameter(torch.empty(batch, num_channels, **factory_kwargs))
            if bias:
                self.bias = nn.Parameter(torch.empty(batch, num_channels, **factory_kwargs))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every model's weight to ones and bias to zeros, as ``torch.nn.GroupNorm`` does."""
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    @classmethod
    def from_module(cls, module: nn.GroupNorm, batch: int) -> GroupNorm:
        layer = cls(
            module.num_groups,
            module.num_channels,
            module.eps,
            module.affine,
            batch=batch,
            device=None if module.weight is None else module.weight.device,
            dtype=None if module.weight is None else module.weight.dtype,
            bias=module.bias is not None,
        )
        copy_into_every_model(layer, module)
        return layer

    def forward(self, input: Tensor) -> Tensor:
        if input.dim() < 2 or input.shape[1] != self.num_channels:
            raise ValueError(
                f"GroupNorm: expected an input of shape (B*n, {self.num_channels}, *), got {tuple(input.shape)}"
            )
        return self.group_norm_form(input, self.num_groups, self.weight, self.bias, self.eps)

    def group_norm_form(
        self, x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
    ) -> Tensor:
        """``F.group_norm`` of a merged ``(B*n, C, *)`` input with per-model ``(B, C)`` weights."""
        shared = self._shared_or_checked(x, weight is not None or bias is not None)
        return group_norm(x, num_groups, weight, bias, eps, layout=self.layout, shared=shared)

    def extra_repr(self) -> str:
        return f"{nn.GroupNorm.extra_repr(self)}, batch={self.batch}"


class _InstanceNorm(_NormBase, _AffineNorm):
    """``batch`` independent instance norms with per-model affine weights and running statistics.

    Instance statistics belong to one sample and channel, so the merged input is normalised as it is. In
    training with ``track_running_stats``, model ``b``'s ``running_mean`` / ``running_var`` (``(B, C)``)
    move towards the mean over *its own* samples of the per-instance mean / unbiased variance, exactly as
    torch's instance norm updates a single model's. Evaluation with running statistics applies each model's
    statistics and affine as one scale-and-shift. ``momentum=None`` means ``0`` (no update), as in
    torch; ``num_batches_tracked`` (``(B,)``) is kept for state-dict compatibility and, as in torch, never
    incremented.
    """

    spatial_dims: ClassVar[int]

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            batch=batch,
            device=device,
            dtype=dtype,
            bias=bias,
        )

    def _check_input(self, x: Tensor) -> None:
        if x.dim() != self.spatial_dims + 2:
            raise ValueError(
                f"{type(self).__name__}: expected a {self.spatial_dims + 2}-D input (B*n, C, "
                f"{', '.join('*' * self.spatial_dims)}) with the model axis merged into dim 0, got shape "
                f"{tuple(x.shape)}"
            )
        if x.shape[1] != self.num_features:
            if self.affine or self.track_running_stats:
                raise ValueError(
                    f"{type(self).__name__}: expected input's size at dim=1 to match num_features "
                    f"({self.num_features}), but got: {x.shape[1]} (input shape {tuple(x.shape)})."
                )
            warnings.warn(
                "input's size at dim=1 does not match num_features. You can silence this warning by not passing "
                "in num_features, which is not used because affine=False",
                stacklevel=2,
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        per_model = self.weight is not None or self.bias is not None or self.track_running_stats
        shared = self._shared_or_checked(input, per_model)
        return instance_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            0.0 if self.momentum is None else self.momentum,
            self.eps,
            layout=self.layout,
            shared=shared,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}, batch={self.batch}"
        )


class InstanceNorm1d(_InstanceNorm):
    """``batch`` independent :class:`torch.nn.InstanceNorm1d`. Input ``(B*n, C, L)``."""

    base_class = nn.InstanceNorm1d
    spatial_dims = 1


class InstanceNorm2d(_InstanceNorm):
    """``batch`` independent :class:`torch.nn.InstanceNorm2d`. Input ``(B*n, C, H, W)`` (or shared ``(n, C, H, W)``).

    Examples::

        >>> norm = InstanceNorm2d(8, affine=True, batch=4)
        >>> norm(torch.randn(4 * 2, 8, 5, 5)).shape
        torch.Size([8, 8, 5, 5])
    """

    base_class = nn.InstanceNorm2d
    spatial_dims = 2


class InstanceNorm3d(_InstanceNorm):
    """``batch`` independent :class:`torch.nn.InstanceNorm3d`. Input ``(B*n, C, D, H, W)``."""

    base_class = nn.InstanceNorm3d
    spatial_dims = 3
