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

import torch
from torch import Tensor

from ._kernel_table import MATMUL, ConvCall, read_window
from ._layout import Layout, is_channels_last

__all__ = ["matmul_conv2d", "runs_as_matmul"]


def runs_as_matmul(x: Tensor, weight: Tensor, batch: int, groups: int, stride: Sequence[int],
                   padding: Sequence[int], dilation: Sequence[int]) -> bool:
    """Whether B models' convolution of the merged ``x`` with the stacked ``weight`` (``groups`` per model)
    runs as a batched matrix product (the kernel table's :data:`~batch_layers._kernel_table.MATMUL` says when,
    and why)."""
    call = ConvCall(x.is_cuda, x.dim(), x.dtype, batch * x.shape[1], tuple(weight.shape), batch * groups, False,
                    tuple(stride), tuple(dilation), tuple(x.shape[2:]), tuple(padding))
    return MATMUL.applies(call)


def _taps(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int, device) -> tuple[Tensor, int]:
    """Along one spatial dim: the ``(rows read, out)`` index of the tap that joins each input row some output
    reads to each output row (-1 where none does), and the first of those input rows."""
    first, stop = read_window(size, out, kernel, stride, pad, dilation)
    reach = torch.arange(first, stop, device=device)[:, None] - torch.arange(out, device=device)[None, :] * stride
    reach = reach + pad  # tap * dilation
    tap = torch.div(reach, dilation, rounding_mode="floor")
    return torch.where((reach >= 0) & (reach % dilation == 0) & (tap < kernel), tap, -1), first


def _every_pair_joined(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> bool:
    """Whether a tap joins every input row some output reads to every output row (plain Python: no sync)."""
    first, stop = read_window(size, out, kernel, stride, pad, dilation)
    for row in range(first, stop):
        for o in range(out):
            reach = row - o * stride + pad
            if reach < 0 or reach % dilation or reach // dilation >= kernel:
                return False
    return True


def matmul_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Layout, stride: Sequence[int],
                  padding: Sequence[int], dilation: Sequence[int], groups: int) -> Tensor:
    """B models' ``F.conv2d`` of the merged ``x`` (``(B*n, C, H, W)`` in ``layout``) with the stacked
    ``(B*O, C/groups, kh, kw)`` ``weight`` and ``(B*O,)`` ``bias`` (``groups`` per model), as a batched matrix
    product; the merged result keeps ``x``'s order and, where it has more than one pixel, its storage."""
    batch, (height, width), (kh, kw) = layout.batch, x.shape[2:], weight.shape[2:]
    n, in_per_group = x.shape[0] // batch, weight.shape[1]
    per_group = weight.shape[0] // (batch * groups)
    out_h, out_w = ((size + 2 * p - d * (k - 1) - 1) // s + 1
                    for size, k, s, p, d in zip((height, width), (kh, kw), stride, padding, dilation))
    geometry_h = (height, out_h, kh, stride[0], padding[0], dilation[0])
    geometry_w = (width, out_w, kw, stride[1], padding[1], dilation[1])
    taps_h, top = _taps(*geometry_h, x.device)
    taps_w, left = _taps(*geometry_w, x.device)
    read_h, read_w = taps_h.shape[0], taps_w.shape[0]
    # the tap joining each (row read, column read, output row, output column), gathered from every filter
    taps = (taps_h[:, None, :, None] * kw + taps_w[None, :, None, :]).flatten()
    toeplitz = weight.reshape(batch * groups, per_group, in_per_group, kh * kw).index_select(3, taps.clamp(min=0))
    if not (_every_pair_joined(*geometry_h) and _every_pair_joined(*geometry_w)):
        toeplitz = toeplitz * ((taps_h[:, None, :, None] >= 0) & (taps_w[None, :, None, :] >= 0)).flatten()
    toeplitz = toeplitz.view(batch * groups, per_group, in_per_group * read_h * read_w, out_h * out_w)
    toeplitz = toeplitz.transpose(1, 2).reshape(batch * groups, in_per_group * read_h * read_w, -1)
    crop = x[:, :, top : top + read_h, left : left + read_w]
    rows = layout.split(crop).unflatten(2, (groups, in_per_group)).transpose(1, 2)
    rows = rows.reshape(batch * groups, n, in_per_group * read_h * read_w)
    if bias is None:
        y = torch.bmm(rows, toeplitz)
    else:
        start = bias.view(batch * groups, 1, per_group, 1).expand(-1, -1, -1, out_h * out_w)
        y = torch.baddbmm(start.reshape(batch * groups, 1, -1), rows, toeplitz)
    y = y.view(batch, groups, n, per_group, out_h, out_w).transpose(1, 2)
    y = layout.merge(y.reshape(batch, n, groups * per_group, out_h, out_w))
    return y.contiguous(memory_format=torch.channels_last) if is_channels_last(x) else y
