from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _ntuple

from ._base import UNBATCHED, AbstractBatchModule, copy_into_every_model
from ._conv import reset_conv_slices
from .functional._conv import conv_transpose1d, conv_transpose2d, conv_transpose3d

__all__ = ["ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]

_BATCHED_CONV_TRANSPOSE = {1: conv_transpose1d, 2: conv_transpose2d, 3: conv_transpose3d}


class _ConvTransposeNd(AbstractBatchModule):
    """``batch`` independent N-d transposed convolutions as one grouped transposed convolution.

    As for :class:`Conv2d`, the models become groups: the merged ``(B*n, C_in, *spatial)`` input is laid
    out as ``(n, B*C_in, *spatial)`` and convolved with the stacked ``(B*C_in, C_out/groups, *k)`` weight
    and ``B * groups`` groups. A shared ``(n, C_in, *spatial)`` input (``groups=1``) is convolved once
    against all models' filters side by side, ``(C_in, B*C_out, *k)``, without copying the input.
    Only ``padding_mode="zeros"`` exists for transposed convolutions, as in torch.
    """

    merged_order = "models"
    merged_orders = ("models", "samples")
    grouped_layout = True
    dims: ClassVar[int]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int, ...] = 1,
        padding_mode: str = "zeros",
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible by groups ({groups})"
            )
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for {type(self).__name__}, got {padding_mode!r}')
        if isinstance(padding, str):
            raise ValueError(
                f"{type(self).__name__} takes numeric padding (as torch's transposed convolutions do), got {padding!r}"
            )
        ntuple = _ntuple(self.dims)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = ntuple(kernel_size)
        self.stride = ntuple(stride)
        self.padding = ntuple(padding)
        self.dilation = ntuple(dilation)
        self.output_padding = ntuple(output_padding)
        for op, s, d in zip(self.output_padding, self.stride, self.dilation):
            if not (0 <= op < max(s, d)):
                raise ValueError(
                    f"output_padding {self.output_padding} must be smaller than either stride {self.stride} "
                    f"or dilation {self.dilation} in every dim"
                )
        self.groups = groups
        self.padding_mode = padding_mode
        self.transposed = True
        factory_kwargs = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(
            torch.empty(batch, in_channels, out_channels // groups, *self.kernel_size, **factory_kwargs)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(batch, out_channels, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every model's slice as torch's ``_ConvNd.reset_parameters`` does for transposed convs."""
        reset_conv_slices(self.weight, self.bias, self.kernel_size)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> _ConvTransposeNd:
        layer = cls(
            module.in_channels,
            module.out_channels,
            module.kernel_size,
            module.stride,
            module.padding,
            module.output_padding,
            module.groups,
            module.bias is not None,
            module.dilation,
            module.padding_mode,
            batch=batch,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        copy_into_every_model(layer, module)
        return layer

    def _check_input(self, x: Tensor) -> None:
        if x.dim() != self.dims + 2 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__}: expected a {self.dims + 2}-D input (B*n, {self.in_channels}, "
                f"{', '.join('*' * self.dims)}) with the model axis merged into dim 0, got shape {tuple(x.shape)}"
                + (f"; {UNBATCHED}" if x.dim() == self.dims + 1 else "")
            )

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        self._check_input(input)
        output_padding = nn.modules.conv._ConvTransposeNd._output_padding(
            self,
            input,
            output_size,
            list(self.stride),
            list(self.padding),
            list(self.kernel_size),
            self.dims,
            list(self.dilation),
        )
        shared = self.is_shared(input)
        if not shared:
            self.check_merged(input)
        return _BATCHED_CONV_TRANSPOSE[self.dims](
            input,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            tuple(output_padding),
            self.groups,
            self.dilation,
            layout=self.layout,
            shared=shared,
        )

    def extra_repr(self) -> str:
        return nn.modules.conv._ConvNd.extra_repr(self) + f", batch={self.batch}"


class ConvTranspose1d(_ConvTransposeNd):
    """``batch`` independent :class:`torch.nn.ConvTranspose1d`; weight ``(B, in, out/groups, k)``.

    Shape:
        - Input: ``(B*n, C_in, L)`` (or the shared ``(n, C_in, L)``); output ``(B*n, C_out, L_out)`` as in torch.
    """

    base_class = nn.ConvTranspose1d
    dims = 1


class ConvTranspose2d(_ConvTransposeNd):
    """``batch`` independent :class:`torch.nn.ConvTranspose2d`; weight ``(B, in, out/groups, kh, kw)``.

    Shape:
        - Input: ``(B*n, C_in, H, W)`` (or the shared ``(n, C_in, H, W)``); output ``(B*n, C_out, H_out, W_out)``.
        - ``forward(x, output_size)`` accepts ``output_size`` as torch does.

    Examples::

        >>> up = ConvTranspose2d(8, 4, 2, stride=2, batch=4)
        >>> up(torch.randn(4 * 2, 8, 5, 5)).shape
        torch.Size([8, 4, 10, 10])
    """

    base_class = nn.ConvTranspose2d
    dims = 2


class ConvTranspose3d(_ConvTransposeNd):
    """``batch`` independent :class:`torch.nn.ConvTranspose3d`; weight ``(B, in, out/groups, kd, kh, kw)``."""

    base_class = nn.ConvTranspose3d
    dims = 3
