"""Pointwise (1x1) convolutions of B models as one batched matrix product.

A 1x1 convolution multiplies every pixel's channels by one ``(O, C)`` matrix. cuDNN's grouped convolution,
with B models as groups, converts every group's slice between NCHW and NHWC and back (``docs/performance.md``);
here each model's filters multiply its pixels in one ``torch.baddbmm``: the filters first, the pixels as the
columns of one matrix (one copy), where the input is contiguous, so that autograd hands the weight's gradient
back in the weight's layout; the pixels first, as the rows of one matrix (a strided view where the merged
layout allows it), where the input is channels-last, whose output then keeps that storage. The result is laid
out merged again in at most one copy. A stride subsamples the pixels first (a view). Autograd differentiates
it (double backward included), autocast casts it as it casts matrix products, and fp32 products run in TF32
where ``torch.backends.cuda.matmul.allow_tf32`` allows. The kernel table's
:data:`~batch_layers._kernel_table.POINTWISE` says which convolutions take it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ._conv_matmul import batched_product, merged_from_columns, merged_from_rows, pixel_rows
from ._kernel_table import POINTWISE, ConvCall
from ._layout import Layout, is_channels_last, split_dim

__all__ = ["pointwise_conv2d", "runs_pointwise"]


def runs_pointwise(call: ConvCall) -> bool:
    """Whether B models' convolution ``call`` (:meth:`~batch_layers._kernel_table.ConvCall.of_merged`)
    runs as a batched matrix product of pixels (the kernel table's :data:`~batch_layers._kernel_table.POINTWISE`
    says when, and why)."""
    return POINTWISE.applies(call)


def pointwise_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Layout, stride: Sequence[int],
                     groups: int) -> Tensor:
    """B models' unpadded 1x1 ``F.conv2d`` of the merged ``x`` (``(B*n, C, H, W)`` in ``layout``) with the stacked
    ``(B*O, C/groups, 1, 1)`` ``weight`` and ``(B*O,)`` ``bias`` (or the per-model ``(B, O, C/groups, 1, 1)`` and
    ``(B, O)``, which it reads without stacking them first; ``groups`` per model); the merged result keeps
    ``x``'s order and storage (channels-last or contiguous)."""
    models, in_per_group = layout.batch * groups, weight.shape[-3]
    per_group = weight.numel() // (models * in_per_group)
    # (a stride of 1 takes no view: each view is an autograd node, host time in a host-bound step)
    pixels = x if tuple(stride) == (1, 1) else x[:, :, :: stride[0], :: stride[1]]
    height, width = pixels.shape[2:]
    filters = weight.reshape(models, per_group, in_per_group)
    if not is_channels_last(x):
        # filters first, (B*g, O/g, C/g) @ (B*g, C/g, n*h*w): the weight's gradient then comes back in the
        # weight's own layout (pixels first, it came back transposed: a copy of B models' filters per backward)
        y = batched_product(None if bias is None else bias.reshape(models, per_group, 1), filters,
                            _pixel_columns(pixels, layout, groups, in_per_group))
        return merged_from_columns(y, layout, height, width)
    # (B*g, n*h*w, C/g): each model's (and group's) pixels as rows, read where they lie (channels-last)
    rows = pixel_rows(pixels, layout, groups, in_per_group)
    y = batched_product(None if bias is None else bias.reshape(models, 1, per_group), rows, filters.transpose(1, 2))
    return merged_from_rows(y, layout, groups, height, width)


def _pixel_columns(pixels: Tensor, layout: Layout, groups: int, in_per_group: int) -> Tensor:
    """The merged NCHW ``pixels`` as each model's (and group's) channels by its samples' pixels,
    ``(B*g, C/g, n*h*w)``, in one copy: from one view of a contiguous input (the general path's views of a
    strided one are autograd nodes, host time in a host-bound step)."""
    batch, n = layout.batch, pixels.shape[0] // layout.batch
    area = pixels.shape[2] * pixels.shape[3]
    if not pixels.is_contiguous():
        columns = split_dim(layout.split(pixels), 2, (groups, in_per_group)).permute(0, 2, 3, 1, 4, 5)
    elif layout.order == "samples":
        columns = pixels.view(n, batch * groups, in_per_group, area).permute(1, 2, 0, 3)
    else:
        columns = pixels.view(batch, n, groups, in_per_group, area).permute(0, 2, 3, 1, 4)
    return columns.reshape(batch * groups, in_per_group, -1)
