"""Convolutions of few input channels (a network's stem), and strided ones of many, for B models, as one batched
matrix product of patches.

A stem reads the image's 1-3 channels. cuDNN runs B models' stems as a grouped convolution whose weight
gradient launches one kernel per model (``docs/performance.md``: 64 launches a layer at B=64, compiled or
not), and a compiled graph holding a grouped convolution of more than one input channel per group keeps
Inductor from laying the whole graph out channels-last. Here every output pixel's patch (its input channels
times the kernel's taps, a few dozen values) becomes a row, and each model's rows are multiplied by its
filters in one ``torch.baddbmm``. The patches are views of the (padded) input (``Tensor.unfold``), gathered in
one copy: under ``torch.compile`` Inductor generates that copy as one kernel fused with the merged layout's
transpose, where ATen's ``im2col`` launches one kernel per image. A strided 3x3 layer of many channels per
model (a ResNet's downsampling) gathers 2.25x its input this way, and cuDNN's grouped kernels run it 2-5x slower
than the plain model's dense layer, in either layout, and launch once per model: eagerly too, from 64 models on,
such a layer is a product. Eager steps take stems of stride 2 or more whose patches are at most twice their output,
and layers whose kernel is their stride (a ConvNeXt's stem and downsampling, a ViT's patch embedding: their patches
are their input, rearranged), from 16 models on. Autograd differentiates it (double backward
included), autocast casts it as it casts matrix products, and fp32 products run in TF32 where
``torch.backends.cuda.matmul.allow_tf32`` allows. The kernel table's
:data:`~batch_layers._kernel_table.PATCHES` says which convolutions take it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

from ._conv_matmul import batched_product, merged_from_rows, pixel_rows
from ._kernel_table import PATCHES, ConvCall
from ._layout import Layout, is_channels_last

__all__ = ["patches_conv2d", "runs_as_patches"]


def runs_as_patches(call: ConvCall) -> bool:
    """Whether B models' convolution ``call`` (:meth:`~batch_layers._kernel_table.ConvCall.of_merged`)
    runs as a batched matrix product of patches (the kernel table's :data:`~batch_layers._kernel_table.PATCHES`
    says when, and why)."""
    return PATCHES.applies(call)


def patches_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Layout, stride: Sequence[int],
                   padding: Sequence[int], dilation: Sequence[int], groups: int) -> Tensor:
    """B models' ``F.conv2d`` of the merged ``x`` (``(B*n, C, H, W)`` in ``layout``) with the stacked
    ``(B*O, C/groups, kh, kw)`` ``weight`` and ``(B*O,)`` ``bias`` (or the per-model ``(B, O, C/groups, kh, kw)``
    and ``(B, O)``, read without stacking them first; ``groups`` per model), zero ``padding`` on each side; the
    merged result keeps ``x``'s order and storage (channels-last or contiguous)."""
    in_per_group, (kh, kw) = weight.shape[-3], weight.shape[-2:]
    models = layout.batch * groups
    per_group = weight.numel() // (models * in_per_group * kh * kw)
    channels_last = is_channels_last(x)
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    # (B*n, C, OH, OW, kh, kw): each output pixel's window, a view; a dilated window keeps every d-th tap
    windows = x.unfold(2, dilation[0] * (kh - 1) + 1, stride[0]).unfold(3, dilation[1] * (kw - 1) + 1, stride[1])
    windows = windows[..., :: dilation[0], :: dilation[1]]
    out_h, out_w = windows.shape[2:4]
    # (B*g, n*OH*OW, C/g * kh * kw): each model's (and group's) patches as rows, in the filters' order
    rows = pixel_rows(windows, layout, groups, in_per_group)
    filters = weight.reshape(models, per_group, in_per_group * kh * kw)
    y = batched_product(None if bias is None else bias.reshape(models, 1, per_group), rows, filters.transpose(1, 2))
    y = merged_from_rows(y, layout, groups, out_h, out_w)
    return y if channels_last else y.contiguous()
