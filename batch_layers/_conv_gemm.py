"""The batched convolution as batched matrix products, and the rule that picks it over cuDNN's grouped one.

``_ConvNd`` runs B models as one convolution with ``B * groups`` groups. For few channels per group cuDNN
has no kernel that takes all groups at once and runs one per group: LeNet's 6->16 convolution at B=256
launched about 1,000 kernels a training step on an H100, and its 1-channel first layer fell to PyTorch's
depthwise kernel, whose weight gradient took 3.9 ms. The GEMM path lays each model's (and group's)
input out as an im2col matrix ``(C_in/g * prod(k), n * L)`` (L output positions) and runs all of them as
ONE ``torch.bmm`` against the stacked ``(B*g, C_out/g, C_in/g * prod(k))`` weights: three batched GEMMs
a step (forward, input and weight gradients) however many models there are.

Which path runs:

- :func:`set_conv_algorithm` / :func:`use_conv_algorithm` (or the environment variable
  ``TORCHMB_CONV_ALGORITHM``) force ``"gemm"`` or ``"grouped"`` for every batched ``Conv1d/2d/3d``;
- ``None`` (the default) asks :func:`prefers_gemm`, whose thresholds are :data:`GEMM_RULES`, one
  :class:`GemmRule` per device type (retune them there from ``tests/benchmarks/bench_grouped_conv.py``).

Memory: the function saves the layer's input and weight, as the grouped path does, and rebuilds the
im2col matrix in backward for the weight gradient, so no ``prod(k)``-times larger matrix lives from
forward to backward; the price is one more unfold in backward.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ._base import autocast_dtype

__all__ = [
    "CONV_ALGORITHMS",
    "GEMM_RULES",
    "ConvAlgorithm",
    "GemmRule",
    "gemm_conv",
    "get_conv_algorithm",
    "prefers_gemm",
    "set_conv_algorithm",
    "use_conv_algorithm",
]

ConvAlgorithm = Literal["gemm", "grouped"]
CONV_ALGORITHMS: tuple[str, ...] = ("gemm", "grouped")
ENV_VAR = "TORCHMB_CONV_ALGORITHM"


def _validate(name: object) -> ConvAlgorithm | None:
    if name is None:
        return None
    if not isinstance(name, str) or name.lower() not in CONV_ALGORITHMS:
        raise ValueError(f"conv algorithm must be one of {CONV_ALGORITHMS} or None, got {name!r}")
    return name.lower()  # type: ignore[return-value]


def _from_env() -> ConvAlgorithm | None:
    value = os.environ.get(ENV_VAR)
    if value is None or value == "" or value.lower() == "auto":
        return None
    try:
        return _validate(value)
    except ValueError as err:
        raise ValueError(f"environment variable {ENV_VAR}={value!r} is not one of {CONV_ALGORITHMS} or auto") from err


_CONV_ALGORITHM: ConvAlgorithm | None = _from_env()


def get_conv_algorithm() -> ConvAlgorithm | None:
    """The convolution algorithm in force: ``"gemm"``, ``"grouped"`` or ``None`` (chosen per call by
    :func:`prefers_gemm`)."""
    return _CONV_ALGORITHM


def set_conv_algorithm(name: str | None) -> ConvAlgorithm | None:
    """Set the algorithm of every batched ``Conv1d/2d/3d`` for the whole process; returns the previous value.

    Args:
        name: ``"gemm"`` (im2col and one batched GEMM), ``"grouped"`` (one grouped cuDNN/ATen convolution)
            or ``None`` (the rule :func:`prefers_gemm` decides per call).
    """
    global _CONV_ALGORITHM
    old = _CONV_ALGORITHM
    _CONV_ALGORITHM = _validate(name)
    return old


@contextlib.contextmanager
def use_conv_algorithm(name: str | None) -> Iterator[ConvAlgorithm | None]:
    """Use ``name`` inside a ``with`` block, restoring the previous algorithm afterwards."""
    old = set_conv_algorithm(name)
    try:
        yield get_conv_algorithm()
    finally:
        set_conv_algorithm(old)


@dataclass(frozen=True)
class GemmRule:
    """When the GEMM path is taken on one device type (all bounds inclusive).

    The GEMM path wins where cuDNN's grouped kernels fall back to one launch per group: many groups, each
    a small matrix product. With many channels per group cuDNN's grouped kernels keep up with dense ones
    (docs/performance.md), and im2col's ``prod(k)``-fold copy of the input costs more than it saves.
    """

    enabled: bool
    min_groups: int = 8  # B * groups: below this cuDNN's per-group launches are few
    max_columns_per_group: int = 256  # C_in/g * prod(k): rows of each group's im2col matrix
    max_out_per_group: int = 64  # C_out/g
    # With one output channel per group (depthwise) each GEMM is a matrix-vector product that reads the
    # prod(k)-fold im2col copy for one multiply-add per element; the depthwise kernel reads the input once.
    min_out_per_group: int = 2
    max_columns_elements: int = 2**31 - 1  # the whole im2col matrix (memory, and 32-bit indexing of unfold/fold)


# Measured, not guessed, per device type: tests/benchmarks/bench_grouped_conv.py on the GPU. On a CPU the
# grouped convolution (oneDNN) was as fast or faster for LeNet's shapes (2-core timeit, B=16, n=32).
GEMM_RULES: dict[str, GemmRule] = {
    "cuda": GemmRule(enabled=True),
    "cpu": GemmRule(enabled=False),
}
_GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def prefers_gemm(
    *,
    groups: int,
    in_per_group: int,
    out_per_group: int,
    kernel_size: tuple[int, ...],
    output_positions: int,
    dtype: torch.dtype,
    device_type: str,
) -> bool:
    """Whether the GEMM path should run a batched convolution rather than cuDNN's grouped one.

    Args:
        groups: ``B * groups``, the groups of the grouped convolution (one GEMM each).
        in_per_group: input channels per group, ``C_in / groups``.
        out_per_group: output channels per group, ``C_out / groups``.
        kernel_size: the kernel's size per spatial dim.
        output_positions: ``n * prod(S_out)``, columns of each group's im2col matrix.
        dtype: the dtype the convolution computes in.
        device_type: ``"cuda"``, ``"cpu"``, ...; types without a rule take the grouped convolution.
    """
    rule = GEMM_RULES.get(device_type)
    if rule is None or not rule.enabled or dtype not in _GEMM_DTYPES:
        return False
    columns_per_group = in_per_group * math.prod(kernel_size)
    return (
        groups >= rule.min_groups
        and columns_per_group <= rule.max_columns_per_group
        and rule.min_out_per_group <= out_per_group <= rule.max_out_per_group
        and groups * columns_per_group * output_positions <= rule.max_columns_elements
    )


def _models_view(x: Tensor, batch: int, order: str) -> Tensor:
    """The merged ``(B*n, C, *S)`` as ``(B, n, C, *S)`` (a view when the merged tensor allows one)."""
    if order == "samples":
        return x.reshape(-1, batch, *x.shape[1:]).transpose(0, 1)
    return x.reshape(batch, -1, *x.shape[1:])


def output_sizes(
    spatial: tuple[int, ...],
    kernel_size: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    pads: tuple[int, ...],
) -> list[int]:
    """The convolution's output size per spatial dim; ``pads`` as :func:`torch.nn.functional.pad` takes them."""
    dims = len(spatial)
    sizes = []
    for d in range(dims):
        before, after = pads[2 * (dims - 1 - d)], pads[2 * (dims - 1 - d) + 1]
        reach = dilation[d] * (kernel_size[d] - 1) + 1
        sizes.append((spatial[d] + before + after - reach) // stride[d] + 1)
    return sizes


def _columns(x: Tensor, batch: int, groups: int, kernel_size, stride, dilation, pads, order: str) -> Tensor:
    """The im2col matrices of every model and group: ``(B*g, C/g * prod(k), n * prod(S_out))``.

    Windows are strided views of the padded input (``Tensor.unfold`` per spatial dim); the one copy is
    the final reshape, which writes them straight into the layout the batched GEMM reads.
    """
    dims = len(kernel_size)
    windows = _models_view(F.pad(x, pads) if any(pads) else x, batch, order)  # (B, n, C, *S_padded)
    for d in range(dims):
        windows = windows.unfold(3 + d, dilation[d] * (kernel_size[d] - 1) + 1, stride[d])
    if any(step > 1 for step in dilation):
        windows = windows[(..., *(slice(None, None, step) for step in dilation))]
    # (B, n, C, *S_out, *k) -> (B, g, C/g, *k, n, *S_out)
    windows = windows.unflatten(2, (groups, -1))
    spatial_dims = list(range(4, 4 + dims))
    kernel_dims = list(range(4 + dims, 4 + 2 * dims))
    windows = windows.permute(0, 2, 3, *kernel_dims, 1, *spatial_dims)
    rows = windows.shape[2] * math.prod(kernel_size)
    return windows.reshape(batch * groups, rows, -1)


def _fold(grad_columns: Tensor, x_shape, batch: int, groups: int, kernel_size, stride, dilation, pads, order) -> Tensor:
    """The adjoint of :func:`_columns`: sums each window's gradient back onto the merged ``(B*n, C, *S)``."""
    dims = len(kernel_size)
    channels, spatial = x_shape[1], x_shape[2:]
    n = x_shape[0] // batch
    padded = [size + pads[2 * (dims - 1 - d)] + pads[2 * (dims - 1 - d) + 1] for d, size in enumerate(spatial)]
    out = output_sizes(tuple(spatial), kernel_size, stride, dilation, pads)
    per_window = grad_columns.view(batch, groups, channels // groups, *kernel_size, n, *out)
    if dims <= 2:  # F.fold: one kernel, in its (N, C * prod(k), L) layout with N in the merged order
        leading = (dims + 3, 0) if order == "samples" else (0, dims + 3)
        blocks = per_window.permute(*leading, *range(1, dims + 3), *range(dims + 4, 2 * dims + 4))
        blocks = blocks.reshape(batch * n, channels * math.prod(kernel_size), math.prod(out))
        lift = (1,) * (2 - dims)  # a 1-d convolution folds as a 2-d one of height 1
        grad = F.fold(
            blocks,
            (*lift, *padded),
            (*lift, *kernel_size),
            dilation=(*lift, *dilation),
            stride=(*lift, *stride),
        ).view(batch * n, channels, *padded)
    else:  # no fold for 3-d: one strided addition per kernel offset
        grad = grad_columns.new_zeros(batch * n, channels, *padded)
        target = _models_view(grad, batch, order).unflatten(2, (groups, -1))  # (B, n, g, C/g, *S_padded)
        for offset in itertools.product(*(range(k) for k in kernel_size)):
            window = tuple(
                slice(o * dil, o * dil + s * (size - 1) + 1, s)
                for o, dil, s, size in zip(offset, dilation, stride, out)
            )
            source = per_window[(slice(None),) * 3 + offset]  # (B, g, C/g, n, *S_out)
            target[(..., *window)].add_(source.transpose(1, 3).transpose(2, 3))
    return F.pad(grad, [-p for p in pads]) if any(pads) else grad


def _forward(x, weight, bias, batch, groups, kernel_size, stride, dilation, pads, order) -> Tensor:
    columns = _columns(x, batch, groups, kernel_size, stride, dilation, pads, order)
    per_group = weight.reshape(batch * groups, -1, columns.shape[1])
    if bias is None:
        return torch.bmm(per_group, columns)
    per_group_bias = bias.view(batch * groups, -1, 1)
    if torch.compiler.is_compiling():  # a separate addition Inductor fuses into the next element-wise kernel
        return torch.bmm(per_group, columns) + per_group_bias
    return torch.baddbmm(per_group_bias, per_group, columns)


class _GemmConv(torch.autograd.Function):
    """The batched convolution as one ``bmm`` of im2col matrices: ``(B*g, C_out/g, n * prod(S_out))``.

    Saves the input and weight, not the im2col matrix (rebuilt in backward), so memory is what the grouped
    path keeps. Backward: ``grad_W = grad_y @ cols^T`` and ``grad_x = fold(W^T @ grad_y)``, differentiable
    ops, so double backward works. The result is the GEMM's own tensor, not a view: :func:`gemm_conv` takes
    the merged layout of it outside, so in-place ops on the layer's output stay legal.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, batch, groups, kernel_size, stride, dilation, pads, order):
        dtype = autocast_dtype(x.device.type)
        config = (kernel_size, stride, dilation, pads)
        if dtype is None:
            y = _forward(x, weight, bias, batch, groups, *config, order)
        else:  # autocast does not reach a custom backward: cast here, once
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                y = _forward(x, weight, bias, batch, groups, *config, order)
        ctx.save_for_backward(x, weight)
        ctx.config = (batch, groups, *config, order, bias is not None)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        batch, groups, kernel_size, stride, dilation, pads, order, has_bias = ctx.config
        grad = grad.to(x.dtype).contiguous()  # BLAS runs a slow generic loop on odd strides (a sum's expanded grad)
        per_group = weight.reshape(batch * groups, grad.shape[1], -1)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # the im2col-sized gradient is freed by the fold, before the weight gradient rebuilds the matrix
            grad_columns = torch.bmm(per_group.transpose(1, 2), grad)
            grad_x = _fold(grad_columns, x.shape, batch, groups, kernel_size, stride, dilation, pads, order)
            del grad_columns
        if ctx.needs_input_grad[1]:
            columns = _columns(x, batch, groups, kernel_size, stride, dilation, pads, order)
            grad_weight = torch.bmm(grad, columns.transpose(1, 2)).view(weight.shape)
        if has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(2).reshape(-1)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None, None


def gemm_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    batch: int,
    groups: int,
    kernel_size: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    pads: tuple[int, ...],
    order: str,
) -> Tensor:
    """The batched convolution of a merged ``(B*n, C_in, *S)`` input by im2col and one batched GEMM.

    ``weight`` is the stacked ``(B*C_out, C_in/groups, *k)``, ``bias`` ``(B*C_out,)`` or None, ``groups``
    the groups within one model and ``pads`` zero padding as :func:`torch.nn.functional.pad` takes it
    (last dim first; uneven amounts allowed). Returns the merged ``(B*n, C_out, *S_out)`` in ``order``.
    """
    out = output_sizes(tuple(x.shape[2:]), kernel_size, stride, dilation, pads)
    y = _GemmConv.apply(x, weight, bias, batch, groups, kernel_size, stride, dilation, pads, order)
    per_model = y.view(batch, weight.shape[0] // batch, -1, *out)  # (B, C_out, n, *S_out)
    leading = (2, 0) if order == "samples" else (0, 2)
    return per_model.permute(*leading, 1, *range(3, 3 + len(out))).reshape(-1, weight.shape[0] // batch, *out)
