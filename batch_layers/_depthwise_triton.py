"""A Triton kernel for the weight gradient of depthwise convolutions (one input channel per group).

B models' depthwise convolutions (MobileNet, EfficientNet, ConvNeXt; LeNet's first convolution, whose
models are groups of one input channel) run as one depthwise convolution over ``B*C`` channels, where
ATen computes the weight gradient with one thread block per filter tap, each reading the whole output
gradient again: 29% of a timm ConvNeXt-atto step's GPU time at B=16 on an H100. Here each program
reads its channel's output gradient once and accumulates every tap of the filter from it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._kernel_table import TRITON_DEPTHWISE_GRAD, ConvCall
from ._triton_op import launchable, multiprocessors, position_shares, triton_custom_op

__all__ = ["depthwise_weight_grad", "runs_depthwise_grad"]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def depthwise_grad_weight(
        x, gy, partial,
        P, OH, OW, H, W,
        sxn, sxc, sxh, sxw,
        sgn, sgc, sgh, sgw,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        CHANNELS, MULTIPLIER: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, CHUNK,
        BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        channel = tl.program_id(0)
        split = tl.program_id(1)
        source = channel // MULTIPLIER
        tap = tl.arange(0, BLOCK_T)
        kh = tap // KW
        kw = tap % KW
        acc = tl.zeros((BLOCK_P, BLOCK_T), dtype=tl.float32)  # summed across positions once, at the end
        for start in range(split * CHUNK, tl.minimum(split * CHUNK + CHUNK, P), BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            in_range = p < tl.minimum(split * CHUNK + CHUNK, P)
            n = (p // (OH * OW)).to(tl.int64)
            oh = (p // OW) % OH
            ow = p % OW
            g = tl.load(gy + n * sgn + channel * sgc + oh * sgh + ow * sgw, mask=in_range, other=0.0).to(tl.float32)
            ih = oh[:, None] * stride_h - pad_h + kh[None, :] * dil_h
            iw = ow[:, None] * stride_w - pad_w + kw[None, :] * dil_w
            inside = in_range[:, None] & (tap < KH * KW)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            xs = tl.load(x + n[:, None] * sxn + source * sxc + ih * sxh + iw * sxw, mask=inside, other=0.0)
            acc += g[:, None] * xs.to(tl.float32)
        total = tl.sum(acc, axis=0)
        tl.store(partial + (split * CHANNELS + channel) * (KH * KW) + tap, total, mask=tap < KH * KW)

    return depthwise_grad_weight


def runs_depthwise_grad(x: Tensor, weight: Tensor, groups: int) -> bool:
    """Whether the weight gradient of this grouped convolution runs on the kernel (the kernel table's
    :data:`~batch_layers._kernel_table.TRITON_DEPTHWISE_GRAD` says when, and why)."""
    return TRITON_DEPTHWISE_GRAD.applies(ConvCall.of(x, weight, groups))


def _weight_shaped(grad, x, weight_shape, stride, padding, dilation):
    return x.new_empty(weight_shape)


@triton_custom_op("torchmb::depthwise_weight_grad", fake=_weight_shaped)
def depthwise_weight_grad(
    grad: Tensor, x: Tensor, weight_shape: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> Tensor:
    """The gradient of a depthwise (channel-multiplier) convolution's ``(C_out, 1, KH, KW)`` weight, in
    the weight's dtype, from the output gradient ``grad`` and the input ``x``."""
    channels, _, kh, kw = weight_shape
    n, _, out_h, out_w = grad.shape
    positions = n * out_h * out_w
    if positions == 0:  # no samples: nothing to sum
        return x.new_zeros(weight_shape)
    import triton

    block_p = 64 if kh * kw > 16 else 128
    splits, chunk = position_shares(positions, block_p, 4 * multiprocessors(grad.device), channels)
    partial = grad.new_empty(splits, channels, kh * kw, dtype=torch.float32)
    with torch.cuda.device(grad.device):
        launchable(_kernel())[(channels, splits)](
            x, grad, partial,
            positions, out_h, out_w, x.shape[2], x.shape[3],
            *x.stride(), *grad.stride(),
            stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
            channels, MULTIPLIER=channels // x.shape[1], KH=kh, KW=kw, CHUNK=chunk,
            BLOCK_P=block_p, BLOCK_T=triton.next_power_of_2(kh * kw),
        )  # fmt: skip
    return partial.sum(0).view(channels, 1, kh, kw).to(x.dtype)
