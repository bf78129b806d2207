from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _ntuple, _reverse_repeat_tuple

from ._base import AbstractBatchModule, stack_copies

__all__ = ["Conv1d", "Conv2d", "Conv3d"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class _ConvNd(AbstractBatchModule):
    """``batch`` independent N-d convolutions as one grouped convolution.

    The models become groups: the merged ``(B*n, C, *spatial)`` input is laid out as
    ``(n, B*C, *spatial)`` and convolved with the stacked ``(B*O, C/groups, *k)`` weight and
    ``B * groups`` groups, so model ``b`` only ever sees its own channels.
    """

    merged_order = "models"
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
        self._explicit_padding = self._padding_for_mode()
        factory_kwargs = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(
            torch.empty(batch, out_channels, in_channels // groups, *self.kernel_size, **factory_kwargs)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(batch, out_channels, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _padding_for_mode(self) -> tuple[int, ...]:
        """The F.pad amounts torch's conv uses for non-zero padding modes (last dim first)."""
        if self.padding == "valid":
            return (0,) * (2 * self.dims)
        if self.padding == "same":
            amounts = []
            for d, k in zip(reversed(self.dilation), reversed(self.kernel_size)):
                total = d * (k - 1)
                amounts += [total // 2, total - total // 2]
            return tuple(amounts)
        return _reverse_repeat_tuple(self.padding, 2)

    def reset_parameters(self) -> None:
        """Initialise every model's slice as torch's ``_ConvNd.reset_parameters`` does."""
        for i in range(self.batch):
            nn.init.kaiming_uniform_(self.weight[i], a=math.sqrt(5))
            if self.bias is not None:
                fan_in = self.weight[i].shape[1] * math.prod(self.kernel_size)
                if fan_in != 0:
                    bound = 1 / math.sqrt(fan_in)
                    nn.init.uniform_(self.bias[i], -bound, bound)

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
        with torch.no_grad():
            layer.weight.copy_(stack_copies(module.weight, batch))
            if module.bias is not None:
                layer.bias.copy_(stack_copies(module.bias, batch))
        return layer

    def _conv(self, x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> Tensor:
        conv = _CONV[self.dims]
        if self.padding_mode != "zeros":
            x = F.pad(x, self._explicit_padding, mode=self.padding_mode)
            return conv(x, weight, bias, self.stride, 0, self.dilation, groups)
        return conv(x, weight, bias, self.stride, self.padding, self.dilation, groups)

    def forward(self, x: Tensor) -> Tensor:
        batch = self.batch
        weight = self.weight.reshape(batch * self.out_channels, *self.weight.shape[2:])
        bias = None if self.bias is None else self.bias.reshape(-1)
        if self.is_shared(x) and self.groups == 1:
            # Every model reads the same input: one dense conv against all models' filters.
            y = self._conv(x, weight, bias, 1)
            n = x.shape[0]
        else:
            x = self.split(x)
            n = x.shape[1]
            grouped = x.transpose(0, 1).reshape(n, batch * self.in_channels, *x.shape[3:])
            y = self._conv(grouped, weight, bias, batch * self.groups)
        y = y.view(n, batch, self.out_channels, *y.shape[2:]).transpose(0, 1)
        return y.reshape(batch * n, self.out_channels, *y.shape[3:])

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
