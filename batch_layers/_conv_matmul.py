"""Convolutions of images with few pixels, for B models, as one batched matrix product.

On the last stages of a ResNet on small images (2x2 and 1x1 pixels for 32x32 inputs) cuDNN's grouped
convolution takes 5-14x the time of one dense convolution over all B*n images (``docs/performance.md``).
Where the input pixels a convolution reads and its output pixels are few, the convolution is a linear map
from each sample's ``(C, pixels read)`` values to its ``(O, OH, OW)`` values. Its matrix places every filter
tap where its input pixel meets its output pixel (a Toeplitz matrix, zero where no tap joins them); it is
gathered per call from the filters (one ``index_select``, whose backward adds the matrix's gradient back
into the taps), and every model's samples are multiplied by their own matrix in one ``torch.baddbmm`` on
cuBLAS's tensor-core GEMMs.

The kernel table sends it the convolutions with one output pixel (a 3x3 convolution of a 1x1 image is its
filters' centre taps; of a 2x2 image with stride 2, its lower right 2x2 taps): the product then does the
convolution's work and no more. With several output pixels the gathered matrix repeats each tap once per
output pixel, which measured slower than cuDNN's grouped convolution on 2x2 images. Autograd
differentiates it (double backward included), autocast casts it as it casts matrix products, and fp32
products run in TF32 where ``torch.backends.cuda.matmul.allow_tf32`` allows (cuBLAS's switch, not cuDNN's).
The kernel table's :data:`~batch_layers._kernel_table.MATMUL` says which convolutions take it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._kernel_table import MATMUL, ConvCall, read_window
from ._layout import Layout, is_channels_last, reshape_unread, split_dim

__all__ = [
    "batched_product", "matmul_conv2d", "merged_from_columns", "merged_from_rows", "pixel_rows", "runs_as_matmul",
]


def runs_as_matmul(call: ConvCall) -> bool:
    """Whether B models' convolution ``call`` (:meth:`~batch_layers._kernel_table.ConvCall.of_merged`)
    runs as a batched matrix product (the kernel table's :data:`~batch_layers._kernel_table.MATMUL` says when,
    and why)."""
    return MATMUL.applies(call)


class _DimPlan(NamedTuple):
    """Along one spatial dim: the input rows read (``first``, ``count``), the output rows, the filter taps any
    of them uses (``tap_first``, ``tap_count``) and, for each (output row, row read), the tap joining them
    counted from ``tap_first`` (-1 where none does)."""

    first: int
    count: int
    out: int
    tap_first: int
    tap_count: int
    joining: tuple[tuple[int, ...], ...]

    @property
    def every_pair_joined(self) -> bool:
        return all(tap >= 0 for row in self.joining for tap in row)

    @property
    def in_tap_order(self) -> bool:
        """One output row, whose rows read use the taps in order, one each: the gather would be a copy."""
        return self.out == 1 and self.joining[0] == tuple(range(self.tap_count))


def _plan(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> _DimPlan:
    """The :class:`_DimPlan` of one spatial dim (plain Python on a few numbers: no tensors, no sync)."""
    first, stop = read_window(size, out, kernel, stride, pad, dilation)
    taps = [[(row - o * stride + pad) // dilation
             if (row - o * stride + pad) >= 0 and (row - o * stride + pad) % dilation == 0
             and (row - o * stride + pad) // dilation < kernel else -1
             for row in range(first, stop)] for o in range(out)]
    used = [tap for row in taps for tap in row if tap >= 0] or [0]
    low = min(used)
    joining = tuple(tuple(tap - low if tap >= 0 else -1 for tap in row) for row in taps)
    return _DimPlan(first, stop - first, out, low, max(used) - low + 1, joining)


def _to_device(values: Tensor, device: torch.device) -> Tensor:
    """A small index made on the host, on ``device`` without waiting for the GPU's queue (pinned, asynchronous);
    under ``torch.compile`` a constant of the graph (its fake tensors cannot be pinned)."""
    if device.type != "cuda":
        return values
    return values.to(device) if torch.compiler.is_compiling() else values.pin_memory().to(device, non_blocking=True)


def batched_product(start: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for every matrix of the batch, plus ``start`` where given (``torch.baddbmm``, else ``torch.bmm``)."""
    return torch.bmm(a, b) if start is None else torch.baddbmm(start, a, b)


def pixel_rows(x: Tensor, layout: Layout, groups: int, in_per_group: int) -> Tensor:
    """The merged ``(B*n, C, h, w, *patch)`` ``x`` as each model's (and group's) pixels in rows,
    ``(B*g, n*h*w, C/g * patch)``, each row in the filters' order: a strided view where the storage allows it
    (channels-last pixels), else one copy."""
    if groups == 1 and layout.order == "models":
        # each model's pixels are consecutive merged rows: one permute and one reshape (the general path's views
        # are two autograd nodes more, host time in a host-bound step)
        pixels = x.shape[0] // layout.batch * x.shape[2] * x.shape[3]
        return x.permute(0, 2, 3, 1, *range(4, x.dim())).reshape(layout.batch, pixels, -1)
    rows = split_dim(layout.split(x), 2, (groups, in_per_group))
    rows = rows.permute(0, 2, 1, 4, 5, 3, *range(6, rows.dim()))  # (B, g, n, h, w, C/g, *patch)
    return rows.reshape(rows.shape[0] * groups, rows.shape[2] * rows.shape[3] * rows.shape[4], -1)


def merged_from_rows(y: Tensor, layout: Layout, groups: int, height: int, width: int) -> Tensor:
    """A product's ``(B*g, n*h*w, O/g)`` rows (of :func:`pixel_rows`) as the merged ``(B*n, O, h, w)``, stored
    channels-last, in at most one copy (the merged order's)."""
    if groups == 1 and layout.order == "models":
        # the rows already lie as the merged channels-last pixels (three autograd nodes fewer than the general path)
        return reshape_unread(y, (-1, height, width, y.shape[-1])).permute(0, 3, 1, 2)  # bmm reads no output
    # (B, n, h, w, O): each model's pixels with all its groups' channels
    y = y.view(layout.batch, groups, -1, height, width, y.shape[-1]).permute(0, 2, 3, 4, 1, 5).flatten(4)
    return layout.merge(y, unread=True).permute(0, 3, 1, 2)  # bmm reads no output


def merged_from_columns(y: Tensor, layout: Layout, height: int, width: int) -> Tensor:
    """A filters-first product's ``(B*g, O/g, n*h*w)`` result as the merged, contiguous ``(B*n, O, h, w)``, in one
    copy (a permute of the models', samples' and channels' dims, then the merged layout's rows)."""
    batch = layout.batch
    y = y.view(batch, y.shape[0] // batch * y.shape[1], -1, height, width)  # (B, O, n, h, w)
    y = y.permute(2, 0, 1, 3, 4) if layout.order == "samples" else y.transpose(1, 2)
    # bmm reads no output; where the permute leaves it contiguous (one model or sample), still a tensor of its own
    return reshape_unread(y, (-1, y.shape[2], height, width)).contiguous()


def _one_pixel(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Layout, rows_plan: _DimPlan,
               cols_plan: _DimPlan, groups: int) -> Tensor:
    """:func:`matmul_conv2d` of one output pixel whose pixels read meet the filter taps in order, one each (a
    1x1 image's centre taps): filters first, ``(B*g, O/g, C/g * taps) @ (B*g, C/g * taps, n)``, each filter's
    taps in its own layout (so autograd hands the weight's gradient back in it, where the pixels-first product
    handed it back transposed, a copy of B models' filters per backward) and each sample's pixels read where
    they lie (a strided view where the pixels read are the whole contiguous image). ``weight`` is the stacked
    ``(B*O, C/g, kh, kw)`` or per-model ``(B, O, C/g, kh, kw)`` weight."""
    models, (kh, kw) = layout.batch * groups, weight.shape[-2:]
    per_group = weight.numel() // (models * weight.shape[-3] * kh * kw)
    if (rows_plan.tap_count, cols_plan.tap_count) == (kh, kw):
        filters = weight.reshape(models, per_group, -1)
    else:
        filters = weight.reshape(models, per_group, -1, kh, kw)[
            ..., rows_plan.tap_first : rows_plan.tap_first + rows_plan.tap_count,
            cols_plan.tap_first : cols_plan.tap_first + cols_plan.tap_count].reshape(models, per_group, -1)
    if (rows_plan.count, cols_plan.count) != tuple(x.shape[2:]):
        x = x[:, :, rows_plan.first : rows_plan.first + rows_plan.count,
              cols_plan.first : cols_plan.first + cols_plan.count]
    y = batched_product(None if bias is None else bias.reshape(models, per_group, 1), filters,
                        _sample_columns(x, layout, groups))
    return merged_from_columns(y, layout, 1, 1)


def _sample_columns(x: Tensor, layout: Layout, groups: int) -> Tensor:
    """The merged ``x``'s pixels read as each model's (and group's) samples in columns, ``(B*g, C/g * pixels, n)``:
    a single view where ``x`` is contiguous and the order puts the models' groups side by side (samples-major,
    or one group a model), which saves the autograd nodes of the general path's views."""
    batch, n = layout.batch, x.shape[0] // layout.batch
    contiguous = x.is_contiguous()
    if contiguous and layout.order == "samples":
        return x.view(n, batch * groups, -1).permute(1, 2, 0)
    if contiguous and groups == 1:
        return x.view(batch, n, -1).transpose(1, 2)
    return layout.split(x).reshape(batch, n, groups, -1).permute(0, 2, 3, 1).reshape(batch * groups, -1, n)


def matmul_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Layout, stride: Sequence[int],
                  padding: Sequence[int], dilation: Sequence[int], groups: int) -> Tensor:
    """B models' ``F.conv2d`` of the merged ``x`` (``(B*n, C, H, W)`` in ``layout``) with the stacked
    ``(B*O, C/groups, kh, kw)`` ``weight`` and ``(B*O,)`` ``bias`` (or the per-model ``(B, O, C/groups, kh, kw)``
    and ``(B, O)``, read without stacking them first; ``groups`` per model), as a batched matrix
    product; the merged result keeps ``x``'s order and, where it has more than one pixel, its storage."""
    batch, (height, width), (kh, kw) = layout.batch, x.shape[2:], weight.shape[-2:]
    n, in_per_group = x.shape[0] // batch, weight.shape[-3]
    models = batch * groups
    per_group = weight.numel() // (models * in_per_group * kh * kw)
    out_h, out_w = ((size + 2 * p - d * (k - 1) - 1) // s + 1
                    for size, k, s, p, d in zip((height, width), (kh, kw), stride, padding, dilation))
    rows_plan = _plan(height, out_h, kh, stride[0], padding[0], dilation[0])
    cols_plan = _plan(width, out_w, kw, stride[1], padding[1], dilation[1])
    if rows_plan.in_tap_order and cols_plan.in_tap_order:
        return _one_pixel(x, weight, bias, layout, rows_plan, cols_plan, groups)
    filters = weight.reshape(models, per_group, in_per_group, kh, kw)
    pixels_read, pixels_out = rows_plan.count * cols_plan.count, out_h * out_w
    # only the taps some pixel uses (a 1x1 image's centre), each filter's taps outside its input channels
    filters = filters[
        ..., rows_plan.tap_first : rows_plan.tap_first + rows_plan.tap_count,
        cols_plan.tap_first : cols_plan.tap_first + cols_plan.tap_count]
    filters = filters.permute(0, 1, 3, 4, 2).reshape(models, per_group, -1, in_per_group)
    # the tap joining each (output row, output column, row read, column read), gathered
    joining_h = torch.tensor(rows_plan.joining)[:, None, :, None]
    joining_w = torch.tensor(cols_plan.joining)[None, :, None, :]
    taps = (joining_h * cols_plan.tap_count + joining_w).clamp(min=0).flatten()
    filters = filters.index_select(2, _to_device(taps, x.device))
    if not (rows_plan.every_pair_joined and cols_plan.every_pair_joined):
        joined = ((joining_h >= 0) & (joining_w >= 0)).flatten()
        filters = filters * _to_device(joined, x.device)[:, None]
    # rows (output channel, output pixel), columns (pixel read, input channel)
    toeplitz = filters.reshape(models, per_group * pixels_out, pixels_read * in_per_group).transpose(1, 2)
    crop = x[:, :, rows_plan.first : rows_plan.first + rows_plan.count,
             cols_plan.first : cols_plan.first + cols_plan.count]
    rows = split_dim(layout.split(crop), 2, (groups, in_per_group)).permute(0, 2, 1, 4, 5, 3)
    rows = rows.reshape(models, n, pixels_read * in_per_group)
    # each output channel's bias at each of its output pixels, the columns' order
    start = None if bias is None else bias.reshape(models, 1, per_group, 1).expand(-1, -1, -1, pixels_out).flatten(2)
    y = batched_product(start, rows, toeplitz)
    y = y.view(batch, groups, n, per_group, out_h, out_w).transpose(1, 2)
    y = layout.merge(y.reshape(batch, n, groups * per_group, out_h, out_w), unread=True)  # bmm reads no output
    return y.contiguous(memory_format=torch.channels_last) if is_channels_last(x) else y
