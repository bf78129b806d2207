from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _ntuple, _reverse_repeat_tuple

from . import _kernel_table
from ._base import AbstractBatchModule, autocast_dtype, copy_into_every_model
from ._checks import check_conv_input, check_input_dtype
from ._conv_triton import grouped_conv2d, input_grad, runs_on_triton
from ._depthwise_triton import depthwise_weight_grad, runs_depthwise_grad
from ._kernel_table import CHANNELS_LAST, TRITON_GROUPED_INPUT_GRAD
from ._layout import from_grouped, is_channels_last, to_grouped

__all__ = ["Conv1d", "Conv2d", "Conv3d"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _check_input(layer: _ConvNd, x: Tensor, weight: Tensor) -> None:
    owner = f"{type(layer).__name__}({layer.in_channels}, {layer.out_channels}, batch={layer.batch})"
    check_conv_input(owner, x, layer.dims, layer.in_channels, layer.batch)
    check_input_dtype(owner, x, weight)


def keeps_channels_last(weight: Tensor, groups: int, transposed: bool) -> bool:
    """Whether a grouped (transposed) convolution with this stacked weight runs on a channels-last layout
    (the kernel table's :data:`~batch_layers._kernel_table.CHANNELS_LAST` says when, and why: thousands of
    launches per step otherwise where a layer norm's permute leaves a timm ConvNeXt's activations
    channels-last)."""
    return CHANNELS_LAST.applies(False, 0, weight.dtype, 0, weight.shape, groups, transposed, (), ())


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


class _GroupedConv(torch.autograd.Function):
    """The models-as-groups convolution (or transposed convolution), saving the merged input instead of
    its grouped copy.

    Autograd through the plain formulation keeps the ``(n, B*C, *S)`` copy of every conv input alive
    until backward, beside the merged tensor the previous layer (usually a ReLU) saves anyway: one extra
    activation per convolution. This function saves the merged input and redoes the layout change in
    backward. The backward is ``aten.convolution_backward``, itself differentiable. In the samples-major
    order (``order="samples"``) every layout change of a contiguous tensor here is a view.

    It returns the grouped ``(n, B*C, *S)`` result; :func:`grouped_conv` takes the merged view of it
    outside, so that autograd knows that view and in-place ops on a layer's output (``ReLU(inplace=True)``)
    stay legal: a custom Function may not return a view of a tensor it created.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, batch, stride, padding, dilation, groups, transposed, output_padding, order):
        dtype = autocast_dtype(x.device.type)
        config = (stride, padding, dilation, groups, transposed, output_padding)
        layout = keeps_channels_last(weight, groups, transposed)
        if dtype is None:
            y = _grouped(to_grouped(x, batch, order, layout), weight, bias, *config)
        else:  # autocast does not reach a custom backward: cast here, once
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                y = _grouped(to_grouped(x, batch, order, layout), weight, bias, *config)
        ctx.save_for_backward(x, weight)
        ctx.config = (batch, *config, bias is not None, order)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        batch, stride, padding, dilation, groups, transposed, output_padding, has_bias, order = ctx.config
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
        out_channels = weight.shape[1] * groups if transposed else weight.shape[0]
        grouped = to_grouped(x, batch, order, keeps_channels_last(weight, groups, transposed))
        grad = grad.to(x.dtype)
        config = (stride, padding, dilation, groups, transposed)
        own = _kernel_grads(grad, grouped, weight, *config, mask) if not torch.is_grad_enabled() else {}
        grads = list(
            torch.ops.aten.convolution_backward(
                grad,
                grouped,
                weight,
                [out_channels] if has_bias else None,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                groups,
                [wanted and i not in own for i, wanted in enumerate(mask)],
            )
        )
        for i, value in own.items():
            grads[i] = value
        grad_x, grad_weight, grad_bias = grads
        grad_x = from_grouped(grad_x, batch, order) if mask[0] else None
        grads = (grad_x, grad_weight if mask[1] else None, grad_bias if mask[2] else None)
        return (*grads, None, None, None, None, None, None, None, None)


def _kernel_grads(grad, grouped, weight, stride, padding, dilation, groups, transposed, mask) -> dict[int, Tensor]:
    """The gradients (0: input, 1: weight) the Triton kernels compute for this convolution, where they beat
    cuDNN's and ATen's; the rest come from ``aten.convolution_backward``. Only where the backward is not
    itself differentiated: the kernels have no derivatives of their own."""
    own = {}
    if transposed:
        return own
    if mask[0] and TRITON_GROUPED_INPUT_GRAD.applies(grouped.is_cuda, grouped.dim(), grouped.dtype, grouped.shape[1],
                                                     weight.shape, groups, False, stride, dilation):
        grad_x = input_grad(grad, weight, grouped.shape, padding, groups)
        if grad_x is not None:
            own[0] = grad_x
    if mask[1] and runs_depthwise_grad(grouped, weight, groups):
        own[1] = depthwise_weight_grad(grad, grouped, list(weight.shape), list(stride), list(padding), list(dilation))
    return own


def grouped_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    batch: int,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
    transposed: bool,
    output_padding: tuple[int, ...],
    order: str,
) -> Tensor:
    """The models-as-groups (transposed) convolution of a merged ``(B*n, C, *S)`` input: ``weight`` is the
    stacked ``(B*O, C/g, *k)`` (``(B*C, O/g, *k)`` transposed) and ``groups`` counts ``B * g``."""
    config = (stride, padding, dilation, groups, transposed, output_padding, order)
    # a channels-last input gives a channels-last output, as a plain layer's would, whichever layout ran
    return from_grouped(_GroupedConv.apply(x, weight, bias, batch, *config), batch, order, is_channels_last(x))


def _grouped(grouped, weight, bias, stride, padding, dilation, groups, transposed, output_padding) -> Tensor:
    if runs_on_triton(grouped, weight, groups, transposed):
        return grouped_conv2d(grouped, weight, bias, list(stride), list(padding), list(dilation), groups)
    return torch.convolution(grouped, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


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
        self._explicit_padding = self._padding_for_mode()
        self._numeric_padding = self._symmetric_padding()
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

    def _symmetric_padding(self) -> tuple[int, ...] | None:
        """The padding as numbers per side, or None where torch pads unevenly ('same', even kernel)."""
        if self.padding_mode != "zeros":
            return (0,) * self.dims  # padded beforehand with F.pad
        if self.padding == "valid":
            return (0,) * self.dims
        if self.padding == "same":
            totals = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
            return None if any(t % 2 for t in totals) else tuple(t // 2 for t in totals)
        return self.padding

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

    def _conv(self, x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> Tensor:
        conv = _CONV[self.dims]
        if self.padding_mode != "zeros":
            x = F.pad(x, self._explicit_padding, mode=self.padding_mode)
            return conv(x, weight, bias, self.stride, 0, self.dilation, groups)
        return conv(x, weight, bias, self.stride, self.padding, self.dilation, groups)

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.weight, self.bias)

    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The layer's convolution of a merged input with per-model ``(B, out, in/groups, *k)`` weights and
        ``(B, out)`` biases (the parameters themselves, or weights derived from them, as in ``StdConv2d``)."""
        batch = self.batch
        _check_input(self, x, weight)
        weight = weight.reshape(batch * self.out_channels, *weight.shape[2:])
        bias = None if bias is None else bias.reshape(-1)
        if self.is_shared(x):
            if self.groups == 1:  # every model reads the same input: one dense conv against all filters
                return from_grouped(self._conv(x, weight, bias, 1), batch, self.merged_order)
            x = self.expand_shared(x)
        self.check_merged(x)
        per_call = self._models_per_call(x, batch)
        if per_call >= batch:
            return self._grouped_forward(x, weight, bias, batch, self.merged_order)
        # Too many models for one kernel's 32-bit indexing: convolve them a slice of models at a time
        # (slices of rows only models-major).
        n, out = x.shape[0] // batch, self.out_channels
        samples_major = self.merged_order == "samples"
        if samples_major:
            x = x.view(n, batch, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
        chunks = []
        for start in range(0, batch, per_call):
            stop = min(start + per_call, batch)
            chunk_bias = None if bias is None else bias[start * out : stop * out]
            chunks.append(
                self._grouped_forward(
                    x[start * n : stop * n], weight[start * out : stop * out], chunk_bias, stop - start, "models"
                )
            )
        y = torch.cat(chunks)
        return y.view(batch, n, *y.shape[1:]).transpose(0, 1).reshape(y.shape) if samples_major else y

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
        """``F.conv{1,2,3}d`` of a merged input with per-model ``(B, out, in/groups, *k)`` weights: one grouped
        convolution through torch's autograd (the layer's own forward also keeps its input, not a copy)."""
        batch = self.batch
        layout = keeps_channels_last(weight.flatten(0, 1), groups, False)
        grouped = to_grouped(self.expand_shared(x) if self.is_shared(x) else x, batch, self.merged_order, layout)
        y = _CONV[self.dims](
            grouped,
            weight.reshape(-1, *weight.shape[2:]),
            None if bias is None else bias.reshape(-1),
            stride,
            padding,
            dilation,
            batch * groups,
        )
        return from_grouped(y, batch, self.merged_order, is_channels_last(x))

    def _models_per_call(self, x: Tensor, batch: int) -> int:
        """How many models one grouped convolution may take: cuDNN's kernels index with 32 bits."""
        n = x.shape[0] // batch
        padding = self.padding if isinstance(self.padding, tuple) else (0,) * self.dims
        reach = [max(p, d * (k - 1)) for p, d, k in zip(padding, self.dilation, self.kernel_size)]
        spatial = math.prod([size + 2 * r for size, r in zip(x.shape[2:], reach)])  # a list: dynamo traces it
        per_model = n * max(self.in_channels, self.out_channels) * spatial
        return max(1, _kernel_table.INDEX_LIMIT // max(per_model, 1))

    def _grouped_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None, batch: int, order: str) -> Tensor:
        if self._numeric_padding is None:  # uneven 'same' padding: torch's own conv pads it
            grouped = to_grouped(x, batch, order, keeps_channels_last(weight, batch * self.groups, False))
            y = self._conv(grouped, weight, bias, batch * self.groups)
            return from_grouped(y, batch, order, is_channels_last(x))
        if self.padding_mode != "zeros":
            x = F.pad(x, self._explicit_padding, mode=self.padding_mode)
        return grouped_conv(
            x,
            weight,
            bias,
            batch,
            self.stride,
            self._numeric_padding,
            self.dilation,
            batch * self.groups,
            False,
            self.output_padding,
            order,
        )

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
