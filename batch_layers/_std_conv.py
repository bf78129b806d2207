"""Batched weight-standardised convolutions: timm's ``StdConv2d``, ``StdConv2dSame``, ``ScaledStdConv2d`` and
``ScaledStdConv2dSame`` (BiT ResNet-V2s, NFNets, NF-RegNets, ViT hybrids).

Each of timm's classes is an ``nn.Conv2d`` whose ``forward`` standardises its weight per output channel
(``F.batch_norm`` over the weight viewed ``(1, out, -1)``: mean 0, biased variance 1, ``eps`` added; the
scaled ones multiply by ``gain * scale``) and then convolves. Run through ``batched_subclass`` that
``forward`` would reshape and normalise the stacked ``(B, ...)`` weight across models, so these classes do
the same per model: one ``F.batch_norm`` over the weight viewed ``(1, B*out, -1)``, every (model, output
channel) a channel of its own, then the grouped convolution of :class:`Conv2d`. The ``Same`` classes pad
their input as timm's ``pad_same`` does (TensorFlow's ``'SAME'``, sized by the input) where timm decides the
padding is dynamic, as timm's ``Conv2dSame`` does through ``batched_subclass``.

batch_layers does not import timm: torchmb registers these classes for timm's by qualified name, so a
subclass of timm's that overrides ``forward`` keeps the ``torch.func`` path and its own computation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from ._base import copy_into_every_model
from ._conv import Conv2d
from .functional._std_conv import standardize_weight

__all__ = ["ScaledStdConv2d", "ScaledStdConv2dSame", "StdConv2d", "StdConv2dSame"]

_Size = int | tuple[int, int]


def _symmetric_padding(kernel_size: _Size, stride: _Size, dilation: _Size) -> tuple[int, int]:
    """timm's ``get_padding``: ``((stride - 1) + dilation * (kernel - 1)) // 2`` per dim."""
    return tuple(((s - 1) + d * (k - 1)) // 2 for k, s, d in zip(_pair(kernel_size), _pair(stride), _pair(dilation)))


def _same_padding(padding: str | _Size, kernel_size: _Size, stride: _Size, dilation: _Size) -> tuple[_Size, bool]:
    """timm's ``get_padding_value``: the padding and whether it is dynamic (computed from each input's size).

    ``'same'`` is static where stride 1 and an even ``dilation * (kernel - 1)`` make it symmetric, else
    dynamic (padding 0 here, ``pad_same`` in ``forward``); ``'valid'`` is 0; another string, timm's
    symmetric padding; numbers pass through.
    """
    if not isinstance(padding, str):
        return padding, False
    padding = padding.lower()
    if padding == "valid":
        return 0, False
    if padding == "same":
        sizes = zip(_pair(kernel_size), _pair(stride), _pair(dilation))
        if not all(s == 1 and d * (k - 1) % 2 == 0 for k, s, d in sizes):
            return 0, True
    return _symmetric_padding(kernel_size, stride, dilation), False


def pad_same(x: Tensor, kernel_size: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """timm's ``pad_same``: zero-pad the last two dims of ``x`` so that the convolution's output has
    ``ceil(size / stride)`` positions, the odd pixel after (TensorFlow's ``'SAME'``). Per sample, so it runs
    on the merged model axis as it is."""
    pads = []
    for size, k, s, d in zip(reversed(x.shape[-2:]), reversed(kernel_size), reversed(stride), reversed(dilation)):
        total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


class StdConv2d(Conv2d):
    """``batch`` independent ``timm.layers.StdConv2d``: each model's weight standardised per output channel,
    then one grouped convolution; weight ``(B, out, in/groups, kh, kw)``.

    Args:
        in_channels, out_channels, kernel_size, stride, dilation, groups: as ``nn.Conv2d``.
        padding: as ``nn.Conv2d``; ``None`` (timm's default) is ``((stride - 1) + dilation * (kernel - 1)) // 2``.
        bias: whether to add a bias (timm's default: no).
        eps: added to each channel's weight variance.
        batch: number of models B.

    Shape:
        - Input: ``(B*n, C_in, H, W)`` (or the shared ``(n, C_in, H, W)``); output ``(B*n, C_out, H_out, W_out)``.

    Examples::

        >>> conv = StdConv2d(3, 8, 3, batch=4)
        >>> conv(torch.randn(4 * 2, 3, 16, 16)).shape
        torch.Size([8, 8, 16, 16])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _Size,
        stride: _Size = 1,
        padding: str | _Size | None = None,
        dilation: _Size = 1,
        groups: int = 1,
        bias: bool = False,
        eps: float = 1e-6,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if padding is None:
            padding = _symmetric_padding(kernel_size, stride, dilation)
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            batch=batch,
            device=device,
            dtype=dtype,
        )
        self.eps = eps
        self.same_pad = False  # the Same classes pad each input dynamically where timm's would

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> StdConv2d:
        layer = cls(
            module.in_channels,
            module.out_channels,
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.groups,
            module.bias is not None,
            eps=module.eps,
            batch=batch,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        layer.same_pad = getattr(module, "same_pad", False)
        copy_into_every_model(layer, module)
        return layer

    def _channel_gain(self) -> Tensor | None:
        """The ``(B, out, 1, 1, 1)`` factors of the standardised weight's channels, or None (1)."""
        return None

    def standardized_weight(self) -> Tensor:
        """The ``(B, out, in/groups, kh, kw)`` weight the convolution applies: timm's ``F.batch_norm`` of the
        weight with each (model, output channel) a channel of its own."""
        return standardize_weight(self.weight, self.eps, self._channel_gain())

    def forward(self, x: Tensor) -> Tensor:
        if self.same_pad:
            x = pad_same(x, self.kernel_size, self.stride, self.dilation)
        return self._conv_forward(x, self.standardized_weight(), self.bias)


class StdConv2dSame(StdConv2d):
    """``batch`` independent ``timm.layers.StdConv2dSame``: :class:`StdConv2d` with TensorFlow's ``'SAME'``
    padding (``padding="SAME"``), applied to each input by :func:`pad_same` where it is not static."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _Size,
        stride: _Size = 1,
        padding: str | _Size = "SAME",
        dilation: _Size = 1,
        groups: int = 1,
        bias: bool = False,
        eps: float = 1e-6,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        padding, dynamic = _same_padding(padding, kernel_size, stride, dilation)
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            eps,
            batch=batch,
            device=device,
            dtype=dtype,
        )
        self.same_pad = dynamic


class ScaledStdConv2d(StdConv2d):
    """``batch`` independent ``timm.layers.ScaledStdConv2d``: :class:`StdConv2d` whose standardised weight
    each model scales per output channel by its ``gain`` times ``scale = gamma / sqrt(fan_in)``.

    The other arguments are :class:`StdConv2d`'s, but ``bias`` defaults to True (as in timm).

    Args:
        gamma: the activation's gain folded into ``scale``.
        gain_init: every model's initial ``gain``.

    Attributes:
        gain: ``(B, out, 1, 1, 1)``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _Size,
        stride: _Size = 1,
        padding: str | _Size | None = None,
        dilation: _Size = 1,
        groups: int = 1,
        bias: bool = True,
        gamma: float = 1.0,
        eps: float = 1e-6,
        gain_init: float = 1.0,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            eps,
            batch=batch,
            device=device,
            dtype=dtype,
        )
        self.scale = gamma * math.prod(self.weight.shape[2:]) ** -0.5
        self.gain_init = gain_init
        self.gain = nn.Parameter(torch.empty(batch, out_channels, 1, 1, 1, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every model's gain to ``gain_init``, its weight and bias as torch's conv does; as in timm, nothing
        while ``Conv2d.__init__`` runs, before the gain exists (``__init__`` calls it again)."""
        if "gain" in self._parameters:
            nn.init.constant_(self.gain, self.gain_init)
            super().reset_parameters()

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> ScaledStdConv2d:
        layer = super().from_module(module, batch)
        layer.scale = module.scale  # timm keeps scale, not gamma
        layer.gain_init = module.gain_init
        return layer

    def _channel_gain(self) -> Tensor:
        return self.gain * self.scale


class ScaledStdConv2dSame(ScaledStdConv2d):
    """``batch`` independent ``timm.layers.ScaledStdConv2dSame``: :class:`ScaledStdConv2d` with TensorFlow's
    ``'SAME'`` padding, as :class:`StdConv2dSame`."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _Size,
        stride: _Size = 1,
        padding: str | _Size = "SAME",
        dilation: _Size = 1,
        groups: int = 1,
        bias: bool = True,
        gamma: float = 1.0,
        eps: float = 1e-6,
        gain_init: float = 1.0,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        padding, dynamic = _same_padding(padding, kernel_size, stride, dilation)
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            gamma,
            eps,
            gain_init,
            batch=batch,
            device=device,
            dtype=dtype,
        )
        self.same_pad = dynamic
