"""Batched convolutions and transposed convolutions: the models become groups of one grouped convolution.

The merged ``(B*n, C, *spatial)`` input is laid out as ``(n, B*C, *spatial)`` (a free view samples-major)
and convolved with the stacked ``(B*O, C/groups, *k)`` weight (``(B*C, O/groups, *k)`` transposed) and
``B * groups`` groups, so model ``b`` only ever sees its own channels. A shared ``(n, C, *spatial)`` input
(``groups=1``) is convolved once against all models' filters. Which kernel runs each op (Triton, cuDNN or
ATen; channels-last or not) is the kernel table's choice, :mod:`batch_layers._kernel_table`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.utils import _ntuple, _reverse_repeat_tuple

from .. import _kernel_table
from .._base import autocast_dtype
from .._conv_matmul import matmul_conv2d, runs_as_matmul
from .._conv_patches import patches_conv2d, runs_as_patches
from .._conv_pointwise import pointwise_conv2d, runs_pointwise
from .._conv_triton import forward_on_triton, grouped_conv2d, grouped_weight_grad, input_grad, runs_on_triton
from .._depthwise_triton import depthwise_weight_grad
from .._kernel_table import (
    CHANNELS_LAST,
    CONTIGUOUS,
    TRITON_DEPTHWISE_GRAD,
    TRITON_GROUPED_INPUT_GRAD,
    TRITON_STEM,
    Candidate,
    ConvCall,
)
from .._layout import Layout, expand_shared, from_grouped, is_channels_last, to_grouped

__all__ = [
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "grouped_conv",
    "keeps_channels_last",
    "models_per_call",
]

_Size = int | Sequence[int]
_COMPILED_LAYOUT = "layout of a compiled convolution's contiguous input"
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def keeps_channels_last(weight: Tensor, groups: int, transposed: bool) -> bool:
    """Whether a grouped (transposed) convolution with this stacked weight runs on a channels-last layout
    (the kernel table's :data:`~batch_layers._kernel_table.CHANNELS_LAST` says when, and why: thousands of
    launches per step otherwise where a layer norm's permute leaves a timm ConvNeXt's activations
    channels-last)."""
    return CHANNELS_LAST.applies(ConvCall(False, 0, weight.dtype, 0, tuple(weight.shape), groups, transposed))


class _GroupedConv(torch.autograd.Function):
    """The models-as-groups convolution (or transposed convolution), saving the merged input instead of
    its grouped copy.

    Autograd through the plain formulation keeps the ``(n, B*C, *S)`` copy of every conv input alive
    until backward, beside the merged tensor the previous layer (usually a ReLU) saves anyway: one extra
    activation per convolution. This function saves the merged input and redoes the layout change in
    backward. The backward is ``aten.convolution_backward``, itself differentiable. In the samples-major
    order (``order="samples"``) every layout change of a contiguous tensor here is a view.

    It returns the grouped ``(n, B*C, *S)`` result; :func:`grouped_conv` lays it out merged outside (a
    custom Function may not return a view of a tensor it created), as a tensor of its own where that is a
    reshape (``from_grouped(..., unread=True)``: the backward reads the input and the weight, never the
    output), so an in-place op on the layer's output (``ReLU(inplace=True)``) costs backward no copies.
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
    takes_input, weight_kernel = _triton_grads(ConvCall.of(grouped, weight, groups, transposed, stride, dilation))
    if mask[0] and takes_input:
        grad_x = input_grad(grad, weight, grouped.shape, padding, groups)
        if grad_x is not None:
            own[0] = grad_x
    config = (list(weight.shape), list(stride), list(padding), list(dilation))
    if mask[1] and weight_kernel is TRITON_DEPTHWISE_GRAD:
        own[1] = depthwise_weight_grad(grad, grouped, *config)
    elif mask[1] and weight_kernel is TRITON_STEM:
        own[1] = grouped_weight_grad(grad, grouped, *config, groups)
    return own


def _triton_grads(call: ConvCall) -> tuple[bool, Candidate[ConvCall] | None]:
    """Whether the Triton kernel takes the input gradient of the grouped convolution ``call``, and the kernel
    table's candidate that takes its weight gradient (None: ATen's)."""
    if call.transposed:
        return False, None
    weight_kernel = next((c for c in (TRITON_DEPTHWISE_GRAD, TRITON_STEM) if c.applies(call)), None)
    return TRITON_GROUPED_INPUT_GRAD.applies(call), weight_kernel


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
    """The models-as-groups (transposed) convolution of a merged ``(B*n, C, *S)`` input in the merged ``order``:
    ``weight`` is the stacked ``(B*O, C/g, *k)`` (``(B*C, O/g, *k)`` transposed) and ``groups`` counts ``B * g``.
    A convolution may pass B models' ``(B, O, C/g, *k)`` weight and ``(B, O)`` bias instead: the matrix products
    read them as they are, and only the grouped convolution stacks them (two views and their two autograd
    nodes fewer per layer where a product runs it)."""
    if not transposed:
        call = ConvCall.of_merged(x, weight, batch, groups, stride, padding, dilation)
        if runs_as_matmul(call):
            return matmul_conv2d(x, weight, bias, Layout(batch, order), stride, padding, dilation, groups // batch)
        if runs_pointwise(call):
            return pointwise_conv2d(x, weight, bias, Layout(batch, order), stride, groups // batch)
        if runs_as_patches(call):
            return patches_conv2d(x, weight, bias, Layout(batch, order), stride, padding, dilation, groups // batch)
        compiled_layout = _kernel_table.choose(_COMPILED_LAYOUT, call, _kernel_table.OPS)
        if compiled_layout is not CONTIGUOUS and not is_channels_last(x):
            # cuDNN's NHWC kernels (depthwise, or grouped of wide groups), forward and both gradients (autograd's),
            # as the plain model's compiled convolutions run; the result is laid out as the input was
            weight, bias = _stacked(x, weight, bias)
            grouped = to_grouped(x, batch, order).contiguous(memory_format=torch.channels_last)
            y = F.conv2d(grouped, weight, bias, stride, padding, dilation, groups)
            return from_grouped(y.contiguous(), batch, order, unread=True)
    weight, bias = _stacked(x, weight, bias)
    config = (stride, padding, dilation, groups, transposed, output_padding, order)
    if order == "samples" and x.is_contiguous() and autocast_dtype(x.device.type) is None:
        grouped = to_grouped(x, batch, order)  # a view: autograd saves x itself, as _GroupedConv does
        if _aten_differentiates(grouped, weight, groups, transposed, stride, dilation):
            # autograd's own ConvolutionBackward0: the same kernels without a Python function per layer
            y = torch.convolution(grouped, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
            return from_grouped(y, batch, order, unread=True)
    # a channels-last input gives a channels-last output, as a plain layer's would, whichever layout ran
    y = _GroupedConv.apply(x, weight, bias, batch, *config)
    return from_grouped(y, batch, order, is_channels_last(x), unread=True)


def _stacked(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """B models' ``(B, O, C/g, *k)`` weight and ``(B, O)`` bias as the grouped convolution's stacked
    ``(B*O, C/g, *k)`` and ``(B*O,)``; an already stacked weight and its bias as they are."""
    if weight.dim() != x.dim() + 1:
        return weight, bias
    return weight.flatten(0, 1), None if bias is None else bias.reshape(-1)


def _aten_differentiates(grouped, weight, groups, transposed, stride, dilation) -> bool:
    """Whether ``torch.convolution`` runs this grouped convolution forward (``runs_on_triton``'s candidate) and
    no kernel of :func:`_kernel_grads` would take a gradient: autograd then differentiates it as well as
    :class:`_GroupedConv` does."""
    call = ConvCall.of(grouped, weight, groups, transposed, stride, dilation)  # one call for every check
    if forward_on_triton(call):
        return False
    takes_input, weight_kernel = _triton_grads(call)
    return not takes_input and weight_kernel is None


def _grouped(grouped, weight, bias, stride, padding, dilation, groups, transposed, output_padding) -> Tensor:
    if runs_on_triton(grouped, weight, groups, transposed, stride):
        return grouped_conv2d(grouped, weight, bias, list(stride), list(padding), list(dilation), groups)
    return torch.convolution(grouped, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


def models_per_call(
    x: Tensor,
    batch: int,
    in_channels: int,
    out_channels: int,
    padding: str | tuple[int, ...],
    dilation: tuple[int, ...],
    kernel_size: tuple[int, ...],
) -> int:
    """How many models one grouped convolution of the merged ``x`` may take: cuDNN's kernels index with 32 bits
    (:data:`~batch_layers._kernel_table.INDEX_LIMIT`)."""
    n = x.shape[0] // batch
    padding = padding if isinstance(padding, tuple) else (0,) * len(kernel_size)
    reach = [max(p, d * (k - 1)) for p, d, k in zip(padding, dilation, kernel_size)]
    spatial = math.prod([size + 2 * r for size, r in zip(x.shape[2:], reach)])  # a list: dynamo traces it
    per_model = n * max(in_channels, out_channels) * spatial
    return max(1, _kernel_table.INDEX_LIMIT // max(per_model, 1))


def _mode_padding(padding: str | tuple[int, ...], dilation: tuple[int, ...], kernel_size: tuple[int, ...]):
    """The ``F.pad`` amounts torch's conv uses for non-zero padding modes (last dim first)."""
    if padding == "valid":
        return (0,) * (2 * len(kernel_size))
    if padding == "same":
        amounts = []
        for d, k in zip(reversed(dilation), reversed(kernel_size)):
            total = d * (k - 1)
            amounts += [total // 2, total - total // 2]
        return tuple(amounts)
    return _reverse_repeat_tuple(padding, 2)


def _numeric_padding(padding: str | tuple[int, ...], dilation: tuple[int, ...], kernel_size: tuple[int, ...]):
    """Zero padding as numbers per side, or None where torch pads unevenly (``'same'``, an even kernel)."""
    if padding == "valid":
        return (0,) * len(kernel_size)
    if padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        return None if any(t % 2 for t in totals) else tuple(t // 2 for t in totals)
    return padding


def _sizes(value: _Size, dims: int) -> tuple[int, ...]:
    """``value`` as one size per spatial dim (a layer's own tuples pass through: this runs every forward)."""
    return value if type(value) is tuple and len(value) == dims else _ntuple(dims)(value)


def _conv_nd(dims, x, weight, bias, stride, padding, dilation, groups, layout, shared, padding_mode) -> Tensor:
    batch, out_channels = layout.batch, weight.shape[1]
    stride, dilation = _sizes(stride, dims), _sizes(dilation, dims)
    padding = padding if isinstance(padding, str) else _sizes(padding, dims)
    if isinstance(padding, str) and (padding not in ("same", "valid") or (padding == "same" and set(stride) != {1})):
        raise ValueError(f"padding must be 'same' (at stride 1), 'valid' or numbers, got {padding!r} (stride {stride})")
    kernel_size = weight.shape[3:]
    if shared and groups == 1:  # every model reads the same input: one dense conv against all filters
        if padding_mode != "zeros":
            x, padding = F.pad(x, _mode_padding(padding, dilation, kernel_size), mode=padding_mode), 0
        y = _CONV[dims](x, *_stacked(x, weight, bias), stride, padding, dilation, 1)
        return from_grouped(y, batch, layout.order, unread=True)
    if shared:
        x = expand_shared(x, layout)
    elif x.shape[0] % batch:
        raise ValueError(f"expected a merged input of B = {batch} models' samples in dim 0, got {tuple(x.shape)}")
    per_call = models_per_call(x, batch, x.shape[1], out_channels, padding, dilation, kernel_size)
    if padding_mode != "zeros":
        x = F.pad(x, _mode_padding(padding, dilation, kernel_size), mode=padding_mode)
        padding = numeric = (0,) * dims
    else:
        numeric = _numeric_padding(padding, dilation, kernel_size)
    config = (stride, padding, numeric, dilation, groups, dims)
    if per_call >= batch:  # B models' weight and bias as they are: grouped_conv stacks them where it must
        return _grouped_forward(x, weight, bias, batch, layout.order, *config)
    # Too many models for one kernel's 32-bit indexing: convolve them a slice of models at a time
    # (slices of rows only models-major).
    weight, bias = _stacked(x, weight, bias)
    n = x.shape[0] // batch
    samples_major = layout.order == "samples"
    if samples_major:
        x = x.view(n, batch, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
    chunks = []
    for start in range(0, batch, per_call):
        stop = min(start + per_call, batch)
        chunk_weight = weight[start * out_channels : stop * out_channels]
        chunk_bias = None if bias is None else bias[start * out_channels : stop * out_channels]
        chunks.append(
            _grouped_forward(x[start * n : stop * n], chunk_weight, chunk_bias, stop - start, "models", *config)
        )
    y = torch.cat(chunks)
    return y.view(batch, n, *y.shape[1:]).transpose(0, 1).reshape(y.shape) if samples_major else y


def _grouped_forward(x, weight, bias, batch, order, stride, padding, numeric, dilation, groups, dims) -> Tensor:
    """``weight`` the stacked ``(B*O, C/g, *k)`` or B models' ``(B, O, C/g, *k)`` (``bias`` likewise)."""
    if numeric is None:  # uneven 'same' padding: torch's own conv pads it
        weight, bias = _stacked(x, weight, bias)
        grouped = to_grouped(x, batch, order, keeps_channels_last(weight, batch * groups, False))
        y = _CONV[dims](grouped, weight, bias, stride, padding, dilation, batch * groups)
        return from_grouped(y, batch, order, is_channels_last(x), unread=True)
    return grouped_conv(x, weight, bias, batch, stride, numeric, dilation, batch * groups, False, (0,) * dims, order)


def conv1d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _Size = 1,
    padding: str | _Size = 0,
    dilation: _Size = 1,
    groups: int = 1,
    *,
    layout: Layout,
    shared: bool = False,
    padding_mode: str = "zeros",
) -> Tensor:
    """:func:`torch.nn.functional.conv1d` for B models: ``input`` the merged ``(B*n, C_in, L)`` (with
    ``shared``, one ``(n, C_in, L)`` every model reads), ``weight`` ``(B, C_out, C_in/groups, k)``, ``bias``
    ``(B, C_out)``. ``padding_mode`` is ``nn.Conv1d``'s (``"zeros"``, ``"reflect"``, ``"replicate"``,
    ``"circular"``). Returns the merged ``(B*n, C_out, L_out)`` in ``layout``."""
    return _conv_nd(1, input, weight, bias, stride, padding, dilation, groups, layout, shared, padding_mode)


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _Size = 1,
    padding: str | _Size = 0,
    dilation: _Size = 1,
    groups: int = 1,
    *,
    layout: Layout,
    shared: bool = False,
    padding_mode: str = "zeros",
) -> Tensor:
    """:func:`torch.nn.functional.conv2d` for B models: ``input`` the merged ``(B*n, C_in, H, W)`` (with
    ``shared``, one ``(n, C_in, H, W)`` every model reads), ``weight`` ``(B, C_out, C_in/groups, kh, kw)``,
    ``bias`` ``(B, C_out)``. A channels-last input gives a channels-last output. ``padding_mode`` is
    ``nn.Conv2d``'s. Returns the merged ``(B*n, C_out, H_out, W_out)`` in ``layout``.

    Examples::

        >>> layout = Layout(batch=4)
        >>> weight = torch.randn(4, 8, 3, 3, 3)
        >>> conv2d(torch.randn(4 * 2, 3, 16, 16), weight, padding=1, layout=layout).shape
        torch.Size([8, 8, 16, 16])
    """
    return _conv_nd(2, input, weight, bias, stride, padding, dilation, groups, layout, shared, padding_mode)


def conv3d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _Size = 1,
    padding: str | _Size = 0,
    dilation: _Size = 1,
    groups: int = 1,
    *,
    layout: Layout,
    shared: bool = False,
    padding_mode: str = "zeros",
) -> Tensor:
    """:func:`torch.nn.functional.conv3d` for B models, as :func:`conv2d` with a depth dim: ``weight``
    ``(B, C_out, C_in/groups, kd, kh, kw)``."""
    return _conv_nd(3, input, weight, bias, stride, padding, dilation, groups, layout, shared, padding_mode)


def _conv_transpose_nd(dims, x, weight, bias, stride, padding, output_padding, groups, dilation, layout, shared):
    batch, in_channels = layout.batch, weight.shape[1]
    stride, padding, dilation = _sizes(stride, dims), _sizes(padding, dims), _sizes(dilation, dims)
    output_padding = _sizes(output_padding, dims)
    flat_bias = None if bias is None else bias.reshape(-1)
    if shared:
        if groups == 1:
            # (B, C_in, C_out, *k) -> (C_in, B*C_out, *k): every model's filters side by side, one dense conv.
            side_by_side = weight.transpose(0, 1).reshape(in_channels, -1, *weight.shape[3:])
            conv = _CONV_TRANSPOSE[dims]
            y = conv(x, side_by_side, flat_bias, stride, padding, output_padding, 1, dilation)
            return from_grouped(y, batch, layout.order, unread=True)
        x = expand_shared(x, layout)
    elif x.shape[0] % batch:
        raise ValueError(f"expected a merged input of B = {batch} models' samples in dim 0, got {tuple(x.shape)}")
    stacked = weight.reshape(batch * in_channels, *weight.shape[2:])
    return grouped_conv(
        x, stacked, flat_bias, batch, stride, padding, dilation, batch * groups, True, output_padding, layout.order
    )


def conv_transpose1d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _Size = 1,
    padding: _Size = 0,
    output_padding: _Size = 0,
    groups: int = 1,
    dilation: _Size = 1,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.conv_transpose1d` for B models: ``input`` the merged ``(B*n, C_in, L)``
    (with ``shared``, one ``(n, C_in, L)``), ``weight`` ``(B, C_in, C_out/groups, k)``, ``bias`` ``(B, C_out)``."""
    return _conv_transpose_nd(1, input, weight, bias, stride, padding, output_padding, groups, dilation, layout, shared)


def conv_transpose2d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _Size = 1,
    padding: _Size = 0,
    output_padding: _Size = 0,
    groups: int = 1,
    dilation: _Size = 1,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.conv_transpose2d` for B models: ``input`` the merged ``(B*n, C_in, H, W)``
    (with ``shared``, one ``(n, C_in, H, W)``), ``weight`` ``(B, C_in, C_out/groups, kh, kw)``, ``bias``
    ``(B, C_out)``."""
    return _conv_transpose_nd(2, input, weight, bias, stride, padding, output_padding, groups, dilation, layout, shared)


def conv_transpose3d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _Size = 1,
    padding: _Size = 0,
    output_padding: _Size = 0,
    groups: int = 1,
    dilation: _Size = 1,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.conv_transpose3d` for B models, as :func:`conv_transpose2d` with a depth dim."""
    return _conv_transpose_nd(3, input, weight, bias, stride, padding, output_padding, groups, dilation, layout, shared)
