"""Triton implicit-GEMM kernels for B models' 2-D convolutions with many channels per model, reading and
writing the merged ``(B*n, C, H, W)`` layout directly.

The grouped convolution (``functional/_conv.py``) hands cuDNN the ``(n, B*C, H, W)`` layout with B groups.
For ResNet-sized groups (64-512 channels) cuDNN's grouped engines convert every group's slice between
NCHW and NHWC and back, about 5,000 launches and 40 of 150 GPU ms of torchvision's ResNet-18 step at B=64
on an H100, and its strided and small-image layers run at 2-14x the time of one dense convolution over
all B*n images (``docs/performance.md``). These kernels take each model's rows where they lie (models- or
samples-major, contiguous or channels-last: a model stride and a sample stride instead of one batch stride),
so no layout copy is made in either direction:

- forward: each program multiplies a tile of one model's output pixels by a tile of its output channels,
  gathering the input patches tap by tap (and skipping the taps that fall outside every pixel of the tile,
  most of them on 2x2 and 1x1 images);
- input gradient: the same product with the output gradient and the transposed filters, run once per
  stride phase (the input pixels ``(h % stride, w % stride)`` alike), which only the taps of that phase reach;
- weight gradient: per model and filter tap, the output gradient's channels times the input's, summed over
  samples and pixels, split over several programs where that sum is long.

``torch.backends.cudnn.allow_tf32`` decides, as for cuDNN's convolutions, whether fp32 products run in TF32.
The kernel table's :data:`~batch_layers._kernel_table.TRITON_MERGED` says which convolutions take them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._kernel_table import TRITON_MERGED, ConvCall
from ._layout import is_channels_last

__all__ = ["merged_conv2d", "merged_conv2d_input_grad", "merged_conv2d_weight_grad", "runs_merged"]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(
        x, w, b, y,
        n, H, W, OH, OW,
        x_model, x_sample, x_c, x_h, x_w,
        y_model, y_sample, y_c, y_h, y_w,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        GROUPS: tl.constexpr, CI: tl.constexpr, CO: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        group = tl.program_id(2)  # model * GROUPS + the group within the model
        model = (group // GROUPS).to(tl.int64)
        within = group % GROUPS
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        in_range = p < n * OH * OW
        sample = (p // (OH * OW)).to(tl.int64)
        oh = (p // OW) % OH
        ow = p % OW
        rows = x + model * x_model + sample * x_sample + within * CI * x_c
        filters = w + (group * CO + o).to(tl.int64) * (CI * KH * KW)
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_P, BLOCK_O), dtype=tl.float32)
        # channels outer, taps inner: one channel block's filters (all taps) are one stretch of memory per
        # output channel, read from the cache for every tap after the first
        for c0 in range(0, CI, BLOCK_K):
            c = c0 + k
            for tap in tl.static_range(KH * KW):
                ih = oh * stride_h - pad_h + (tap // KW) * dil_h
                iw = ow * stride_w - pad_w + (tap % KW) * dil_w
                inside = in_range & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                if tl.max(inside.to(tl.int32), axis=0) > 0:
                    patch = tl.load((rows + ih * x_h + iw * x_w)[:, None] + c[None, :] * x_c,
                                    mask=inside[:, None] & (c < CI)[None, :], other=0.0)
                    taps = tl.load(filters[None, :] + c[:, None] * (KH * KW) + tap,
                                   mask=(c < CI)[:, None] & (o < CO)[None, :], other=0.0)
                    acc = tl.dot(patch, taps, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b + group * CO + o, mask=o < CO, other=0.0).to(tl.float32)[None, :]
        out = y + model * y_model + sample[:, None] * y_sample + (within * CO + o)[None, :] * y_c
        out += (oh * y_h + ow * y_w)[:, None]
        tl.store(out, acc.to(y.dtype.element_ty), mask=in_range[:, None] & (o < CO)[None, :])

    @triton.jit
    def input_grad(
        g, w, gx,
        n, H, W, OH, OW, QH, QW,
        g_model, g_sample, g_c, g_h, g_w,
        x_model, x_sample, x_c, x_h, x_w,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        GROUPS: tl.constexpr, CI: tl.constexpr, CO: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        phases = stride_h * stride_w
        group = tl.program_id(2) // phases
        phase = tl.program_id(2) % phases
        phase_h = phase // stride_w
        phase_w = phase % stride_w
        model = (group // GROUPS).to(tl.int64)
        within = group % GROUPS
        q = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        sample = (q // (QH * QW)).to(tl.int64)
        ih = phase_h + stride_h * ((q // QW) % QH)
        iw = phase_w + stride_w * (q % QW)
        in_range = (q < n * QH * QW) & (ih < H) & (iw < W)
        rows = g + model * g_model + sample * g_sample + within * CO * g_c
        filters = w + (group * CO).to(tl.int64) * (CI * KH * KW) + c * (KH * KW)
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for o0 in range(0, CO, BLOCK_K):
            o = o0 + k
            for tap in tl.static_range(KH * KW):
                # the output pixel reaching (ih, iw) through this tap: oh * stride = ih + pad - kh * dil, which
                # divides for every pixel of the phase or for none
                reach_h = ih + pad_h - (tap // KW) * dil_h
                reach_w = iw + pad_w - (tap % KW) * dil_w
                oh = reach_h // stride_h
                ow = reach_w // stride_w
                aligned = (reach_h % stride_h == 0) & (reach_w % stride_w == 0)
                inside = in_range & aligned & (reach_h >= 0) & (reach_w >= 0) & (oh < OH) & (ow < OW)
                if tl.max(inside.to(tl.int32), axis=0) > 0:
                    grad = tl.load((rows + oh * g_h + ow * g_w)[:, None] + o[None, :] * g_c,
                                   mask=inside[:, None] & (o < CO)[None, :], other=0.0)
                    taps = tl.load(filters[None, :] + o[:, None] * (CI * KH * KW) + tap,
                                   mask=(o < CO)[:, None] & (c < CI)[None, :], other=0.0)
                    acc = tl.dot(grad, taps, acc, input_precision=PRECISION)
        out = gx + model * x_model + sample[:, None] * x_sample + (within * CI + c)[None, :] * x_c
        out += (ih * x_h + iw * x_w)[:, None]
        tl.store(out, acc.to(gx.dtype.element_ty), mask=in_range[:, None] & (c < CI)[None, :])

    @triton.jit
    def weight_grad(
        g, x, gw,
        n, H, W, OH, OW, CHUNK,
        g_model, g_sample, g_c, g_h, g_w,
        x_model, x_sample, x_c, x_h, x_w,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        GROUPS: tl.constexpr, CI: tl.constexpr, CO: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    ):  # fmt: skip
        group = tl.program_id(2)
        model = (group // GROUPS).to(tl.int64)
        within = group % GROUPS
        tiles_c = tl.cdiv(CI, BLOCK_C)
        o = (tl.program_id(0) // tiles_c) * BLOCK_O + tl.arange(0, BLOCK_O)
        c = (tl.program_id(0) % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        tap = tl.program_id(1) // SPLITS
        first = (tl.program_id(1) % SPLITS) * CHUNK
        last = tl.minimum(first + CHUNK, n * OH * OW)
        kh = tap // KW
        kw = tap % KW
        grad_rows = g + model * g_model + (within * CO + o).to(tl.int64) * g_c
        x_rows = x + model * x_model + (within * CI + c).to(tl.int64) * x_c
        acc = tl.zeros((BLOCK_O, BLOCK_C), dtype=tl.float32)
        for p0 in range(first, last, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            in_range = p < last
            sample = (p // (OH * OW)).to(tl.int64)
            oh = (p // OW) % OH
            ow = p % OW
            ih = oh * stride_h - pad_h + kh * dil_h
            iw = ow * stride_w - pad_w + kw * dil_w
            inside = in_range & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                grad = tl.load(grad_rows[:, None] + (sample * g_sample + oh * g_h + ow * g_w)[None, :],
                               mask=(o < CO)[:, None] & inside[None, :], other=0.0)
                patch = tl.load(x_rows[None, :] + (sample * x_sample + ih * x_h + iw * x_w)[:, None],
                                mask=inside[:, None] & (c < CI)[None, :], other=0.0)
                acc = tl.dot(grad, patch, acc, input_precision=PRECISION)
        out = gw + (group * CO + o).to(tl.int64)[:, None] * (CI * KH * KW) + c[None, :] * (KH * KW) + tap
        mask = (o < CO)[:, None] & (c < CI)[None, :]
        if SPLITS == 1:
            tl.store(out, acc.to(gw.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out, acc, mask=mask)

    return forward, input_grad, weight_grad


def runs_merged(x: Tensor, weight: Tensor, batch: int, groups: int) -> bool:
    """Whether B models' convolution of the merged ``x`` with the stacked ``weight`` (``groups`` per model)
    runs on these kernels (the kernel table's :data:`~batch_layers._kernel_table.TRITON_MERGED` says when,
    and why)."""
    return TRITON_MERGED.applies(ConvCall(x.is_cuda, x.dim(), x.dtype, batch * x.shape[1], tuple(weight.shape),
                                          batch * groups))


def _row_strides(t: Tensor, batch: int, samples_major: bool) -> tuple[int, int]:
    """The distance between two models' and between two samples' rows of a merged tensor."""
    step = t.stride(0)
    return (step, batch * step) if samples_major else (t.shape[0] // batch * step, step)


def _output_size(size, kernel, stride, padding, dilation) -> tuple[int, int]:
    """The output's height and width, as torch's convolution computes them."""
    return tuple((s + 2 * p - d * (k - 1) - 1) // step + 1
                 for s, k, step, p, d in zip(size, kernel, stride, padding, dilation))


def _empty_like_layout(like: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A new merged tensor stored as ``like`` is (channels-last or contiguous)."""
    memory_format = torch.channels_last if is_channels_last(like) else torch.contiguous_format
    return torch.empty(shape, dtype=dtype, device=like.device, memory_format=memory_format)


def _precision(dtype: torch.dtype) -> str:
    return "tf32" if dtype == torch.float32 and torch.backends.cudnn.allow_tf32 else "ieee"


def _block(channels: int, largest: int = 64) -> int:
    """A tile edge for ``channels``: a power of two from 16 (``tl.dot``'s least) to ``largest``."""
    return max(16, min(largest, 1 << (channels - 1).bit_length()))


@torch.library.custom_op("torchmb::merged_conv2d", mutates_args=())
def merged_conv2d(
    x: Tensor, weight: Tensor, bias: Tensor | None, batch: int, samples_major: bool, stride: list[int],
    padding: list[int], dilation: list[int], groups: int,
) -> Tensor:  # fmt: skip
    """B models' ``F.conv2d`` on the merged ``x`` (``(B*n, C, H, W)``, samples-major or not), with the
    stacked ``(B*O, C/groups, kh, kw)`` ``weight`` and ``(B*O,)`` ``bias``; ``groups`` per model. The result
    is merged in the same order and stored as ``x`` is."""
    out_channels, in_per_group, kh, kw = weight.shape
    out_h, out_w = _output_size(x.shape[2:], (kh, kw), stride, padding, dilation)
    y = _empty_like_layout(x, (x.shape[0], out_channels // batch, out_h, out_w), x.dtype)
    if y.numel() == 0:
        return y
    import triton

    n = x.shape[0] // batch
    per_group = out_channels // (batch * groups)
    block_o = _block(per_group)
    block_p = 128 if block_o <= 32 else 64
    weight = weight.contiguous()
    grid = (triton.cdiv(n * out_h * out_w, block_p), triton.cdiv(per_group, block_o), batch * groups)
    with torch.cuda.device(x.device):
        _kernels()[0][grid](
            x, weight, weight if bias is None else bias, y,
            n, x.shape[2], x.shape[3], out_h, out_w,
            *_row_strides(x, batch, samples_major), *x.stride()[1:],
            *_row_strides(y, batch, samples_major), *y.stride()[1:],
            *stride, *padding, *dilation,
            GROUPS=groups, CI=in_per_group, CO=per_group, KH=kh, KW=kw, HAS_BIAS=bias is not None,
            PRECISION=_precision(x.dtype), BLOCK_P=block_p, BLOCK_O=block_o, BLOCK_K=_block(in_per_group, 32),
            num_warps=4, num_stages=3,
        )  # fmt: skip
    return y


@merged_conv2d.register_fake
def _(x, weight, bias, batch, samples_major, stride, padding, dilation, groups):
    out_h, out_w = _output_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    return _empty_like_layout(x, (x.shape[0], weight.shape[0] // batch, out_h, out_w), x.dtype)


@torch.library.custom_op("torchmb::merged_conv2d_input_grad", mutates_args=())
def merged_conv2d_input_grad(
    grad: Tensor, x: Tensor, weight: Tensor, batch: int, samples_major: bool, stride: list[int],
    padding: list[int], dilation: list[int], groups: int,
) -> Tensor:  # fmt: skip
    """The gradient of :func:`merged_conv2d` with respect to ``x`` (whose shape and storage it takes), from
    the merged output gradient ``grad``."""
    gx = _empty_like_layout(x, tuple(x.shape), x.dtype)
    if gx.numel() == 0:
        return gx
    import triton

    out_channels, in_per_group, kh, kw = weight.shape
    n, _, height, width = x.shape
    n //= batch
    per_group = out_channels // (batch * groups)
    phase_h, phase_w = triton.cdiv(height, stride[0]), triton.cdiv(width, stride[1])
    block_c = _block(in_per_group)
    block_p = 128 if block_c <= 32 else 64
    weight = weight.contiguous()
    grid = (triton.cdiv(n * phase_h * phase_w, block_p), triton.cdiv(in_per_group, block_c),
            batch * groups * stride[0] * stride[1])  # fmt: skip
    with torch.cuda.device(x.device):
        _kernels()[1][grid](
            grad, weight, gx,
            n, height, width, grad.shape[2], grad.shape[3], phase_h, phase_w,
            *_row_strides(grad, batch, samples_major), *grad.stride()[1:],
            *_row_strides(gx, batch, samples_major), *gx.stride()[1:],
            *stride, *padding, *dilation,
            GROUPS=groups, CI=in_per_group, CO=per_group, KH=kh, KW=kw, PRECISION=_precision(x.dtype),
            BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_K=_block(per_group, 32), num_warps=4, num_stages=3,
        )  # fmt: skip
    return gx


@merged_conv2d_input_grad.register_fake
def _(grad, x, weight, batch, samples_major, stride, padding, dilation, groups):
    return _empty_like_layout(x, tuple(x.shape), x.dtype)


@torch.library.custom_op("torchmb::merged_conv2d_weight_grad", mutates_args=())
def merged_conv2d_weight_grad(
    grad: Tensor, x: Tensor, weight_shape: list[int], batch: int, samples_major: bool, stride: list[int],
    padding: list[int], dilation: list[int], groups: int,
) -> Tensor:  # fmt: skip
    """The gradient of :func:`merged_conv2d` with respect to its stacked ``(B*O, C/groups, kh, kw)`` weight,
    in ``x``'s dtype."""
    import triton

    out_channels, in_per_group, kh, kw = weight_shape
    n = x.shape[0] // batch
    positions = n * grad.shape[2] * grad.shape[3]
    if positions == 0:
        return x.new_zeros(weight_shape)
    per_group = out_channels // (batch * groups)
    block_o, block_c, block_p = _block(per_group), _block(in_per_group), 64
    tiles = triton.cdiv(per_group, block_o) * triton.cdiv(in_per_group, block_c)
    programs = tiles * kh * kw * batch * groups
    wanted = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    # split the sum over positions where the tiles alone leave the GPU idle, keeping each part long
    splits = max(1, min(triton.cdiv(wanted, programs), triton.cdiv(positions, 16 * block_p)))
    chunk = triton.cdiv(triton.cdiv(positions, splits), block_p) * block_p
    splits = triton.cdiv(positions, chunk)
    gw = x.new_zeros(weight_shape, dtype=torch.float32) if splits > 1 else x.new_empty(weight_shape)
    with torch.cuda.device(x.device):
        _kernels()[2][(tiles, kh * kw * splits, batch * groups)](
            grad, x, gw,
            n, x.shape[2], x.shape[3], grad.shape[2], grad.shape[3], chunk,
            *_row_strides(grad, batch, samples_major), *grad.stride()[1:],
            *_row_strides(x, batch, samples_major), *x.stride()[1:],
            *stride, *padding, *dilation,
            GROUPS=groups, CI=in_per_group, CO=per_group, KH=kh, KW=kw, SPLITS=splits,
            PRECISION=_precision(x.dtype), BLOCK_O=block_o, BLOCK_C=block_c, BLOCK_P=block_p,
            num_warps=4, num_stages=3,
        )  # fmt: skip
    return gw.to(x.dtype)


@merged_conv2d_weight_grad.register_fake
def _(grad, x, weight_shape, batch, samples_major, stride, padding, dilation, groups):
    return x.new_empty(weight_shape)
