from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _ntuple

from ._base import AbstractBatchModule, copy_into_every_model
from ._checks import check_conv_input, check_input_dtype
from .functional._conv import conv1d, conv2d, conv3d, models_per_call
from .functional._conv import grouped_conv as grouped_conv  # the functional core's, still importable from here

__all__ = ["Conv1d", "Conv2d", "Conv3d"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_BATCHED_CONV = {1: conv1d, 2: conv2d, 3: conv3d}


def _check_input(layer: _ConvNd, x: Tensor, weight: Tensor) -> None:
    if x.dim() == layer.dims + 2 and x.shape[1] == layer.in_channels and x.dtype == weight.dtype:
        return  # what the checks below accept, without naming the layer for a message (every forward)
    owner = f"{type(layer).__name__}({layer.in_channels}, {layer.out_channels}, batch={layer.batch})"
    check_conv_input(owner, x, layer.dims, layer.in_channels, layer.batch)
    check_input_dtype(owner, x, weight)


def reset_conv_slices(weight: Tensor, bias: Tensor | None, kernel_size: tuple[int, ...]) -> None:
    """torch's ``_ConvNd.reset_parameters`` on each model's slice; the bias bound uses the fan-in of the
    weight's dim 1 (in/groups for convolutions, out/groups for transposed ones, as torch computes it)."""
    for i in range(weight.shape[0]):
        nn.init.kaiming_uniform_(weight[i], a=math.sqrt(5))
        if bias is not None:
            fan_in = weight[i].shape[1] * math.prod(kernel_size)
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                nn.init.uniform_(bias[i], -bound, bound)


class _ConvNd(AbstractBatchModule):
    """``batch`` independent N-d convolutions as one grouped convolution.

    The models become groups: the merged ``(B*n, C, *spatial)`` input is laid out as
    ``(n, B*C, *spatial)`` and convolved with the stacked ``(B*O, C/groups, *k)`` weight and
    ``B * groups`` groups, so model ``b`` only ever sees its own channels.
    """

    merged_order = "models"
    merged_orders = ("models", "samples")
    grouped_layout = True
    functional_forms: ClassVar[dict[Callable, str]] = {conv: "conv_form" for conv in _CONV.values()}
    dims: ClassVar[int]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: str | int | tuple[int, ...] = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible by groups ({groups})"
            )
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"padding_mode must be zeros, reflect, replicate or circular, got {padding_mode!r}")
        ntuple = _ntuple(self.dims)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = ntuple(kernel_size)
        self.stride = ntuple(stride)
        self.dilation = ntuple(dilation)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"padding must be 'same', 'valid' or numbers, got {padding!r}")
            if padding == "same" and any(s != 1 for s in self.stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
            self.padding: str | tuple[int, ...] = padding
        else:
            self.padding = ntuple(padding)
        self.groups = groups
        self.padding_mode = padding_mode
        self.output_padding = ntuple(0)
        self.transposed = False
        factory_kwargs = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(
            torch.empty(batch, out_channels, in_channels // groups, *self.kernel_size, **factory_kwargs)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(batch, out_channels, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every model's slice as torch's ``_ConvNd.reset_parameters`` does."""
        reset_conv_slices(self.weight, self.bias, self.kernel_size)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> _ConvNd:
        layer = cls(
            module.in_channels,
            module.out_channels,
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.groups,
            module.bias is not None,
            module.padding_mode,
            batch=batch,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        copy_into_every_model(layer, module)
        return layer

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self._own_state("weight"), self._own_state("bias"))

    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The layer's convolution of a merged input with per-model ``(B, out, in/groups, *k)`` weights and
        ``(B, out)`` biases (the parameters themselves, or weights derived from them, as in ``StdConv2d``)."""
        _check_input(self, x, weight)
        shared = self.is_shared(x)
        if not shared:
            self.check_merged(x)
        return _BATCHED_CONV[self.dims](
            x,
            weight,
            bias,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            layout=self.layout,
            shared=shared,
            padding_mode=self.padding_mode,
        )

    def conv_form(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None = None,
        stride: int | tuple[int, ...] = 1,
        padding: str | int | tuple[int, ...] = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
    ) -> Tensor:
        """``F.conv{1,2,3}d`` of a merged input with per-model ``(B, out, in/groups, *k)`` weights (a plain
        subclass's own ``forward`` calling it, see ``batch_layers._subclass``)."""
        shared = self.is_shared(x)
        batched = _BATCHED_CONV[self.dims]
        return batched(x, weight, bias, stride, padding, dilation, groups, layout=self.layout, shared=shared)

    def _models_per_call(self, x: Tensor, batch: int) -> int:
        """How many models one grouped convolution may take (see :func:`functional._conv.models_per_call`)."""
        return models_per_call(x, batch, self.in_channels, self.out_channels, self.padding, self.dilation,
                               self.kernel_size)

    def extra_repr(self) -> str:
        return nn.modules.conv._ConvNd.extra_repr(self) + f", batch={self.batch}"


class Conv1d(_ConvNd):
    """``batch`` independent :class:`torch.nn.Conv1d`; weight ``(B, out, in/groups, k)``.

    Shape:
        - Input: ``(B*n, C_in, L)``; output ``(B*n, C_out, L_out)`` as in torch.
    """

    base_class = nn.Conv1d
    dims = 1


class Conv2d(_ConvNd):
    """``batch`` independent :class:`torch.nn.Conv2d`; weight ``(B, out, in/groups, kh, kw)``.

    Shape:
        - Input: ``(B*n, C_in, H, W)`` (or the shared ``(n, C_in, H, W)``); output ``(B*n, C_out, H_out, W_out)``.

    Examples::

        >>> conv = Conv2d(3, 8, 3, padding=1, batch=4)
        >>> conv(torch.randn(4 * 2, 3, 16, 16)).shape
        torch.Size([8, 8, 16, 16])
    """

    base_class = nn.Conv2d
    dims = 2


class Conv3d(_ConvNd):
    """``batch`` independent :class:`torch.nn.Conv3d`; weight ``(B, out, in/groups, kd, kh, kw)``."""

    base_class = nn.Conv3d
    dims = 3
