"""Triton implicit-GEMM kernels for grouped 2-D convolutions with few channels per group.

B models' convolutions run as one convolution with B groups (``_conv.py``). Where each group is small
(LeNet's 6 to 16 channels, 5x5), cuDNN runs its grouped kernels one group after another: at B=256 the
second LeNet convolution's forward is 256 launches of a per-group GEMM, 11.8 of a step's 25 GPU ms on an
H100, where the plain model's whole step takes 8. This kernel computes every group in one launch: each
program takes a tile of output positions (image, row, column) of one group and multiplies its im2col
patch, gathered straight from the input, with the group's filters.

The input gradient of a convolution with stride 1 is the same kernel run on the output gradient, with
the filters flipped and their in/out channels swapped. The weight gradient stays with cuDNN, which does
not loop over groups for it, except for a network's stem: there cuDNN runs a grouped convolution of three
input channels per group once per group, forward and weight gradient (ResNet-18's 7x7 stem at B=64: 64
kernels each way and 64 memsets a step). The stem's weight gradient kernel takes, for one group and one
block of patch elements, a share of the output positions and multiplies the gathered patches (transposed)
with the output gradient; the shares' sums are added after it, in a fixed order.
``torch.backends.cudnn.allow_tf32`` decides, as for cuDNN's convolutions, whether the products run in TF32.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from ._kernel_table import TRITON_GROUPED, TRITON_STEM, ConvCall
from ._triton_op import launchable, multiprocessors, position_shares, triton_custom_op

__all__ = ["forward_on_triton", "grouped_conv2d", "grouped_weight_grad", "input_grad", "runs_on_triton"]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def conv2d_groups(
        x, w, b, y,
        N, H, W, OH, OW,
        sxn, sxc, sxh, sxw,
        syn, syc, syh, syw,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        CI: tl.constexpr, CO: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_CO: tl.constexpr,
    ):  # fmt: skip
        group = tl.program_id(1)
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        in_range = p < N * OH * OW
        n = (p // (OH * OW)).to(tl.int64)
        oh = (p // OW) % OH
        ow = p % OW
        co = tl.arange(0, BLOCK_CO)
        x_rows = x + n * sxn + group * CI * sxc
        acc = tl.zeros((BLOCK_P, BLOCK_CO), dtype=tl.float32)
        for k0 in tl.static_range(0, CI * KH * KW, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ci = k // (KH * KW)
            kh = (k // KW) % KH
            kw = k % KW
            ih = oh[:, None] * stride_h - pad_h + kh[None, :] * dil_h
            iw = ow[:, None] * stride_w - pad_w + kw[None, :] * dil_w
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & in_range[:, None] & (k < CI * KH * KW)[None, :]
            patch = tl.load(x_rows[:, None] + ci[None, :] * sxc + ih * sxh + iw * sxw, mask=inside, other=0.0)
            filters = tl.load(
                w + (group * CO + co[None, :]) * (CI * KH * KW) + k[:, None],
                mask=(co[None, :] < CO) & (k[:, None] < CI * KH * KW),
                other=0.0,
            )
            acc = tl.dot(patch, filters, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b + group * CO + co, mask=co < CO, other=0.0).to(tl.float32)[None, :]
        out = y + n[:, None] * syn + (group * CO + co[None, :]) * syc + oh[:, None] * syh + ow[:, None] * syw
        tl.store(out, acc.to(y.dtype.element_ty), mask=in_range[:, None] & (co[None, :] < CO))

    return conv2d_groups


@functools.cache
def _weight_grad_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def conv2d_groups_weight_grad(
        x, gy, partial,
        P, OH, OW, H, W,
        sxn, sxc, sxh, sxw,
        sgn, sgc, sgh, sgw,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        GROUPS, CHUNK,
        CI: tl.constexpr, CO: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_CO: tl.constexpr,
    ):  # fmt: skip
        # the patch blocks of one share are neighbouring programs: they read its output gradient from L2
        k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        group = tl.program_id(1)
        split = tl.program_id(2)
        ci = k // (KH * KW)
        kh = (k // KW) % KH
        kw = k % KW
        co = tl.arange(0, BLOCK_CO)
        x_channels = x + (group * CI + ci) * sxc
        gy_channels = gy + (group * CO + co) * sgc
        stop = tl.minimum(split * CHUNK + CHUNK, P)
        acc = tl.zeros((BLOCK_K, BLOCK_CO), dtype=tl.float32)
        for start in range(split * CHUNK, stop, BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            in_range = p < stop
            n = (p // (OH * OW)).to(tl.int64)
            oh = (p // OW) % OH
            ow = p % OW
            ih = oh[None, :] * stride_h - pad_h + kh[:, None] * dil_h
            iw = ow[None, :] * stride_w - pad_w + kw[:, None] * dil_w
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & in_range[None, :] & (k < CI * KH * KW)[:, None]
            patches = tl.load(x_channels[:, None] + n[None, :] * sxn + ih * sxh + iw * sxw, mask=inside, other=0.0)
            grads = tl.load(
                gy_channels[None, :] + n[:, None] * sgn + oh[:, None] * sgh + ow[:, None] * sgw,
                mask=in_range[:, None] & (co < CO)[None, :],
                other=0.0,
            )
            acc = tl.dot(patches, grads, acc, input_precision=PRECISION)
        out = partial + ((split * GROUPS + group) * CO + co[None, :]) * (CI * KH * KW) + k[:, None]
        tl.store(out, acc, mask=(k < CI * KH * KW)[:, None] & (co < CO)[None, :])

    return conv2d_groups_weight_grad


def runs_on_triton(x: Tensor, weight: Tensor, groups: int, transposed: bool, stride: Sequence[int] = (1, 1)) -> bool:
    """Whether a grouped convolution of this shape runs forward on the Triton kernel (:func:`forward_on_triton`)."""
    return forward_on_triton(ConvCall.of(x, weight, groups, transposed, stride))


def forward_on_triton(call: ConvCall) -> bool:
    """Whether the grouped convolution ``call`` runs forward on the Triton kernel (the kernel table's
    :data:`~batch_layers._kernel_table.TRITON_GROUPED` and :data:`~batch_layers._kernel_table.TRITON_STEM`
    say when, and why)."""
    return TRITON_GROUPED.applies(call) or TRITON_STEM.applies(call)


def _precision(x: Tensor) -> str:
    return "tf32" if torch.backends.cudnn.allow_tf32 and x.dtype == torch.float32 else "ieee"


def _output_size(x: Tensor, weight: Tensor, stride, padding, dilation) -> tuple[int, int]:
    """The output's height and width, as torch's convolution computes them."""
    return tuple(
        (size + 2 * pad - dil * (k - 1) - 1) // step + 1
        for size, k, step, pad, dil in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    )


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, groups: int) -> Tensor:
    n, _, height, width = x.shape
    out_channels, in_per_group, kh, kw = weight.shape
    out_h, out_w = _output_size(x, weight, stride, padding, dilation)
    y = x.new_empty(n, out_channels, out_h, out_w)
    if y.numel() == 0:
        return y
    import triton

    per_group = out_channels // groups
    block_p = 128
    grid = (triton.cdiv(n * out_h * out_w, block_p), groups)
    weight = weight.contiguous()
    precision = _precision(x)
    with torch.cuda.device(x.device):
        launchable(_kernel())[grid](
            x, weight, weight if bias is None else bias, y,
            n, height, width, out_h, out_w,
            *x.stride(), *y.stride(),
            stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
            CI=in_per_group, CO=per_group, KH=kh, KW=kw, HAS_BIAS=bias is not None, PRECISION=precision,
            BLOCK_P=block_p, BLOCK_K=16 if in_per_group * kh * kw <= 16 else 32,
            BLOCK_CO=max(16, triton.next_power_of_2(per_group)),
        )  # fmt: skip
    return y


def _output_shaped(x, weight, bias, stride, padding, dilation, groups):
    return x.new_empty(x.shape[0], weight.shape[0], *_output_size(x, weight, stride, padding, dilation))


@triton_custom_op("torchmb::grouped_conv2d", fake=_output_shaped)
def grouped_conv2d(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int], dilation: list[int],
    groups: int,
) -> Tensor:  # fmt: skip
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` on the Triton kernel (no autograd:
    ``_conv._GroupedConv`` differentiates it)."""
    return _launch(x, weight, bias, stride, padding, dilation, groups)


def input_grad(grad: Tensor, weight: Tensor, input_shape: torch.Size, padding, groups: int) -> Tensor | None:
    """The input gradient of a stride-1, undilated grouped convolution as a convolution of ``grad`` with
    the flipped, channel-swapped filters; None where that convolution would not run on the kernel."""
    out_channels, in_per_group, kh, kw = weight.shape
    flipped = weight.view(groups, out_channels // groups, in_per_group, kh, kw).transpose(1, 2).flip(3, 4)
    flipped = flipped.reshape(groups * in_per_group, out_channels // groups, kh, kw)
    if not runs_on_triton(grad, flipped, groups, False):
        return None
    full = [kh - 1 - padding[0], kw - 1 - padding[1]]
    if min(full) < 0:
        return None
    grad_x = grouped_conv2d(grad, flipped, None, [1, 1], full, [1, 1], groups)
    return grad_x if tuple(grad_x.shape) == tuple(input_shape) else None


def _weight_shaped(grad, x, weight_shape, stride, padding, dilation, groups):
    return x.new_empty(weight_shape)


@triton_custom_op("torchmb::grouped_weight_grad", fake=_weight_shaped)
def grouped_weight_grad(
    grad: Tensor, x: Tensor, weight_shape: list[int], stride: list[int], padding: list[int], dilation: list[int],
    groups: int,
) -> Tensor:  # fmt: skip
    """The gradient of a grouped convolution's stacked ``(B*O, C/g, KH, KW)`` weight, in the input's dtype, from
    the output gradient ``grad`` and the input ``x`` (the kernel table's
    :data:`~batch_layers._kernel_table.TRITON_STEM` says for which convolutions)."""
    out_channels, in_per_group, kh, kw = weight_shape
    n, _, out_h, out_w = grad.shape
    positions, patch, per_group = n * out_h * out_w, in_per_group * kh * kw, out_channels // groups
    if positions == 0:  # no samples: nothing to sum
        return x.new_zeros(weight_shape)
    import triton

    # the blocks and the programs a multiprocessor gets that were fastest for ResNet's stem at 16 and 64 models
    fp32 = x.dtype == torch.float32
    block_p, block_k = 64, 32 if fp32 or patch <= 32 else 64
    patch_blocks = triton.cdiv(patch, block_k)
    programs = (4 if fp32 else 8) * multiprocessors(grad.device)
    splits, chunk = position_shares(positions, block_p, programs, patch_blocks * groups)
    partial = grad.new_empty(splits, out_channels, patch, dtype=torch.float32)
    with torch.cuda.device(grad.device):
        launchable(_weight_grad_kernel())[(patch_blocks, groups, splits)](
            x, grad, partial,
            positions, out_h, out_w, x.shape[2], x.shape[3],
            *x.stride(), *grad.stride(),
            stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
            groups, chunk,
            CI=in_per_group, CO=per_group, KH=kh, KW=kw, PRECISION=_precision(x),
            BLOCK_P=block_p, BLOCK_K=block_k, BLOCK_CO=max(16, triton.next_power_of_2(per_group)),
        )  # fmt: skip
    return partial.sum(0).view(weight_shape).to(x.dtype)
