"""Depthwise convolutions of B models read from the merged layout where it lies: Triton kernels.

timm's ConvNeXt permutes to channels-last around its norm and MLP, so each depthwise convolution gets a merged
``(B*n, C, H, W)`` input that lies in memory as ``(rows, H, W, C)``. As one grouped convolution it would need
``(n, B*C, H, W)``: a copy of the input forward, another in backward, and a third of the output and of its
gradient (199 ``clone``\\ s of a ConvNeXt-atto step, ``docs/performance.md``). Here each program takes a tile of
one model's output positions (sample, row, column) by a block of its channels, finds each row of the merged
tensor from the model and the sample (row ``i * B + b`` samples-major, ``b * n + i`` models-major) and applies
that model's filters, so input, output and gradients stay merged and nothing is copied:

- forward and input gradient: one kernel, each output (input) position gathering the filter taps that reach it;
- weight and bias gradients: one kernel, each program summing a share of one model's positions for every tap
  at once (the output gradient is read once, as in ``_depthwise_triton.py``, whose one-channel programs would
  read channels-last memory with a stride of C), the shares then summed in fp32.

Only the taps that join some input pixel to some output pixel are visited (a 7x7 filter on a 1x1 image is its
centre tap). Every kernel reads its tensors through their strides, so any layout is correct; the kernel table
sends it channels-last ones (:data:`~batch_layers._kernel_table.DEPTHWISE_MERGED`), whose channel tiles are
contiguous. Products accumulate in fp32 (fp64 for fp64 tensors); results are in the input's dtype.

Eager code launches them from an autograd Function; under ``torch.compile`` they are ``torch.library`` custom
operators (``torchmb::depthwise_conv2d`` differentiable by its registered backward), which dynamo traces as
opaque nodes. A backward that is itself differentiated
(``create_graph=True``: a gradient penalty) computes its gradients with ATen's differentiable
``convolution_backward`` on the grouped layout instead, so second derivatives stay exact.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from ._base import autocast_dtype
from ._kernel_table import DEPTHWISE_MERGED, ConvCall
from ._layout import Layout, from_grouped, is_channels_last, to_grouped

__all__ = ["depthwise_conv2d", "runs_depthwise_merged"]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def depthwise_taps(
        src, w, b, dst,
        C, SRC_H, SRC_W, DST_H, DST_W, POSITIONS, ROW_STEP, MODEL_STEP,
        ssn, ssc, ssh, ssw, sdn, sdc, sdh, sdw, swc, swh, sww, sb,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        KH0, KW0, TAPS_H, TAPS_W, C_BLOCKS, P_BLOCKS,
        INPUT_GRAD: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr, BLOCK_P: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """dst[p, c] = sum over taps of src[the position the tap joins to p, c] * w[model, c, tap] (+ bias):
        the forward (src the input, dst the output) or the input gradient (src the output gradient, dst the
        input's, each tap joining p to the output pixel that read it through that tap)."""
        pid = tl.program_id(0)
        c_block = pid % C_BLOCKS
        p_block = (pid // C_BLOCKS) % P_BLOCKS
        model = pid // (C_BLOCKS * P_BLOCKS)
        p = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
        c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
        p_in = p < POSITIONS
        c_in = c < C
        sample = p // (DST_H * DST_W)
        ph = (p // DST_W) % DST_H
        pw = p % DST_W
        row = (sample * ROW_STEP + model * MODEL_STEP).to(tl.int64)
        src_rows = src + row * ssn
        filters = w + (model * C + c).to(tl.int64) * swc
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=ACC)
        for t in range(TAPS_H * TAPS_W):
            kh = KH0 + t // TAPS_W
            kw = KW0 + t % TAPS_W
            if INPUT_GRAD:  # the output pixel oh with oh * stride - pad + kh * dil == ph, where there is one
                th = ph + pad_h - kh * dil_h
                tw = pw + pad_w - kw * dil_w
                sh = th // stride_h
                sw = tw // stride_w
                joined = (th >= 0) & (tw >= 0) & (th % stride_h == 0) & (tw % stride_w == 0)
            else:
                sh = ph * stride_h - pad_h + kh * dil_h
                sw = pw * stride_w - pad_w + kw * dil_w
                joined = (sh >= 0) & (sw >= 0)
            joined = joined & (sh < SRC_H) & (sw < SRC_W) & p_in
            values = tl.load(src_rows[:, None] + (sh * ssh + sw * ssw)[:, None] + c[None, :] * ssc,
                             mask=joined[:, None] & c_in[None, :], other=0.0)
            tap = tl.load(filters + kh * swh + kw * sww, mask=c_in, other=0.0)
            acc += values.to(ACC) * tap.to(ACC)[None, :]
        if HAS_BIAS:
            acc += tl.load(b + (model * C + c) * sb, mask=c_in, other=0.0).to(ACC)[None, :]
        out = dst + row[:, None] * sdn + (ph * sdh + pw * sdw)[:, None] + c[None, :] * sdc
        tl.store(out, acc.to(dst.dtype.element_ty), mask=p_in[:, None] & c_in[None, :])

    @triton.jit
    def depthwise_weight_grad(
        x, gy, partial_w, partial_b,
        MODELS, C, H, W, OH, OW, POSITIONS, ROW_STEP, MODEL_STEP,
        sxn, sxc, sxh, sxw, sgn, sgc, sgh, sgw,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        KH0, KW0, TAPS_W, TAPS, C_BLOCKS, SPLITS, CHUNK,
        HAS_BIAS: tl.constexpr, ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """partial_w[split, model, c, tap] = sum over the split's positions p of one model of
        gy[p, c] * x[the input pixel the tap joins to p, c]; partial_b[split, model, c] = sum of gy[p, c]."""
        pid = tl.program_id(0)
        split = pid % SPLITS
        c_block = (pid // SPLITS) % C_BLOCKS
        model = pid // (SPLITS * C_BLOCKS)
        c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
        c_in = c < C
        t = tl.arange(0, BLOCK_T)
        kh = KH0 + t // TAPS_W
        kw = KW0 + t % TAPS_W
        acc = tl.zeros((BLOCK_P, BLOCK_T, BLOCK_C), dtype=ACC)  # summed across positions once, at the end
        bias_acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=ACC)
        stop = tl.minimum(split * CHUNK + CHUNK, POSITIONS)
        for start in range(split * CHUNK, stop, BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            p_in = p < stop
            sample = p // (OH * OW)
            oh = (p // OW) % OH
            ow = p % OW
            row = (sample * ROW_STEP + model * MODEL_STEP).to(tl.int64)
            g = tl.load(gy + row[:, None] * sgn + (oh * sgh + ow * sgw)[:, None] + c[None, :] * sgc,
                        mask=p_in[:, None] & c_in[None, :], other=0.0).to(ACC)
            if HAS_BIAS:
                bias_acc += g
            ih = oh[:, None] * stride_h - pad_h + kh[None, :] * dil_h
            iw = ow[:, None] * stride_w - pad_w + kw[None, :] * dil_w
            inside = p_in[:, None] & (t < TAPS)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            pixels = x + row[:, None] * sxn + ih * sxh + iw * sxw
            xs = tl.load(pixels[:, :, None] + c[None, None, :] * sxc, mask=inside[:, :, None] & c_in[None, None, :],
                         other=0.0)
            acc += g[:, None, :] * xs.to(ACC)
        channel = (split * MODELS + model) * C + c
        tl.store(partial_w + channel[None, :].to(tl.int64) * TAPS + t[:, None], tl.sum(acc, axis=0),
                 mask=(t < TAPS)[:, None] & c_in[None, :])
        if HAS_BIAS:
            tl.store(partial_b + channel, tl.sum(bias_acc, axis=0), mask=c_in)

    return depthwise_taps, depthwise_weight_grad


def runs_depthwise_merged(call: ConvCall) -> bool:
    """Whether B models' convolution ``call`` (:meth:`ConvCall.of_merged`) runs on the merged-layout depthwise
    kernels (the kernel table's :data:`~batch_layers._kernel_table.DEPTHWISE_MERGED` says when, and why)."""
    return DEPTHWISE_MERGED.applies(call)


def _output_size(size: Sequence[int], kernel: Sequence[int], stride, padding, dilation) -> list[int]:
    return [(s + 2 * p - d * (k - 1) - 1) // step + 1
            for s, k, step, p, d in zip(size, kernel, stride, padding, dilation)]


def _used_taps(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> tuple[int, int]:
    """Along one spatial dim: the first filter tap that joins some input pixel to some output pixel, and how many
    taps from it up to the last that does (0 where none does)."""
    used = []
    for tap in range(kernel):  # output pixels o with 0 <= o * stride - pad + tap * dilation < size
        first = max(0, -((tap * dilation - pad) // stride))
        last = min(out - 1, (size - 1 + pad - tap * dilation) // stride)
        if first <= last:
            used.append(tap)
    return (used[0], used[-1] - used[0] + 1) if used else (0, 0)


def _channel_block(channels: int) -> int:
    """The widest channel tile (64, 32 or 16) that pads ``channels`` by at most a quarter; fewer channels: their
    power of two."""
    for block in (64, 32, 16):
        if -(-channels // block) * block * 3 <= channels * 4:
            return block
    return min(16, 1 << max(channels - 1, 0).bit_length())


def _steps(batch: int, order: str, rows: int) -> tuple[int, int]:
    """(row step between a model's samples, row step between models) of the merged order."""
    return (batch, 1) if order == "samples" else (1, rows // batch)


def _accumulator(dtype: torch.dtype):
    """Triton's dtype of the sums: float32, float64 for float64 tensors."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _on_device(t: Tensor):
    # Triton launches on the current device; Triton's interpreter (TRITON_INTERPRET=1) runs CPU tensors
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _taps(src: Tensor, weight: Tensor, bias: Tensor | None, dst: Tensor, batch: int, order: str,
          stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], input_grad: bool) -> None:
    """Launch the tap kernel writing ``dst`` (the output from the input, or the input gradient from the output
    gradient ``src``)."""
    import triton

    rows, channels = dst.shape[:2]
    x_size, out_size = (dst.shape[2:], src.shape[2:]) if input_grad else (src.shape[2:], dst.shape[2:])
    (kh0, taps_h), (kw0, taps_w) = (_used_taps(s, o, k, *geometry) for s, o, k, *geometry in
                                    zip(x_size, out_size, weight.shape[2:], stride, padding, dilation))
    positions = rows // batch * dst.shape[2] * dst.shape[3]
    block_c = _channel_block(channels)
    block_p = max(16, min(1024 // block_c, triton.next_power_of_2(positions)))
    c_blocks, p_blocks = triton.cdiv(channels, block_c), triton.cdiv(positions, block_p)
    with _on_device(dst):
        _kernels()[0][(batch * c_blocks * p_blocks,)](
            src, weight, weight if bias is None else bias, dst,
            channels, *src.shape[2:], *dst.shape[2:], positions, *_steps(batch, order, rows),
            *src.stride(), *dst.stride(), weight.stride(0), weight.stride(2), weight.stride(3),
            0 if bias is None else bias.stride(0),
            *stride, *padding, *dilation, kh0, kw0, taps_h, taps_w, c_blocks, p_blocks,
            INPUT_GRAD=input_grad, HAS_BIAS=bias is not None, ACC=_accumulator(dst.dtype), BLOCK_P=block_p,
            BLOCK_C=block_c,
        )  # fmt: skip


def _new_merged(shape: Sequence[int], channels_last: bool, like: Tensor) -> Tensor:
    """An empty merged tensor on ``like``'s device and dtype, channels-last or contiguous."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=memory_format)


def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, batch: int, order: str, stride: list[int],
          padding: list[int], dilation: list[int]) -> Tensor:
    """B models' depthwise ``F.conv2d`` of the merged ``x`` in ``order`` with the stacked ``(B*C, 1, kh, kw)``
    ``weight`` and ``(B*C,)`` ``bias``; the merged output keeps ``x``'s layout (channels-last or contiguous)."""
    out = _output_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    y = _new_merged((x.shape[0], x.shape[1], *out), is_channels_last(x), x)
    if y.numel():
        _taps(x, weight, bias, y, batch, order, stride, padding, dilation, input_grad=False)
    return y


def _input_grad(grad: Tensor, weight: Tensor, input_shape: list[int], channels_last: bool, batch: int, order: str,
                stride: list[int], padding: list[int], dilation: list[int]) -> Tensor:
    """The gradient of :func:`_conv`'s input from its output's ``grad``, laid out as the input was."""
    grad_x = _new_merged(input_shape, channels_last, grad)
    if grad_x.numel():
        _taps(grad, weight, None, grad_x, batch, order, stride, padding, dilation, input_grad=True)
    return grad_x


def _weight_grad(grad: Tensor, x: Tensor, weight: Tensor, with_bias: bool, batch: int, order: str,
                 stride: list[int], padding: list[int], dilation: list[int]) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`_conv`'s weight and (``with_bias``; else an empty tensor) bias, in their dtype."""
    import triton

    rows, channels, out_h, out_w = grad.shape
    kh, kw = weight.shape[2:]
    (kh0, taps_h), (kw0, taps_w) = (_used_taps(s, o, k, *geometry) for s, o, k, *geometry in
                                    zip(x.shape[2:], grad.shape[2:], weight.shape[2:], stride, padding, dilation))
    taps = taps_h * taps_w
    positions = rows // batch * out_h * out_w
    if not (positions and taps):  # no position, or no tap joining any pixels: the weights get no gradient
        grad_b = Layout(batch, order).split(grad).sum((1, 3, 4)).flatten() if with_bias else grad.new_empty(0)
        return weight.new_zeros(weight.shape), grad_b.to(weight.dtype)
    block_c = min(32, _channel_block(channels))
    block_t = triton.next_power_of_2(taps)
    block_p = max(1, min(2048 // (block_t * block_c), triton.next_power_of_2(positions)))
    c_blocks = triton.cdiv(channels, block_c)
    # a share of each model's positions per program, enough programs to fill the GPU (4 per multiprocessor)
    programs = 4 * torch.cuda.get_device_properties(grad.device).multi_processor_count if grad.is_cuda else positions
    splits = max(1, min(triton.cdiv(positions, 8 * block_p), triton.cdiv(programs, batch * c_blocks)))
    chunk = triton.cdiv(triton.cdiv(positions, splits), block_p) * block_p
    splits = max(1, triton.cdiv(positions, chunk))
    sums = torch.float64 if x.dtype == torch.float64 else torch.float32
    partial_w = grad.new_empty(splits, batch * channels, taps, dtype=sums)
    partial_b = grad.new_empty(splits, batch * channels if with_bias else 0, dtype=sums)
    with _on_device(grad):
        _kernels()[1][(batch * c_blocks * splits,)](
            x, grad, partial_w, partial_b if with_bias else partial_w,
            batch, channels, *x.shape[2:], out_h, out_w, positions, *_steps(batch, order, rows),
            *x.stride(), *grad.stride(), *stride, *padding, *dilation,
            kh0, kw0, taps_w, taps, c_blocks, splits, chunk,
            HAS_BIAS=with_bias, ACC=_accumulator(x.dtype), BLOCK_P=block_p, BLOCK_T=block_t, BLOCK_C=block_c,
        )  # fmt: skip
    grad_w = (partial_w[0] if splits == 1 else partial_w.sum(0)).view(batch * channels, 1, taps_h, taps_w)
    if (taps_h, taps_w) != (kh, kw):  # the taps no pixel pair uses get no gradient
        grad_w = torch.nn.functional.pad(grad_w, (kw0, kw - kw0 - taps_w, kh0, kh - kh0 - taps_h))
    grad_b = partial_b[0] if splits == 1 else partial_b.sum(0)
    return grad_w.to(weight.dtype), grad_b.to(weight.dtype)


# The operators, for code that torch.compile traces (an opaque node each: dynamo cannot trace the launches'
# host-side choices). Eager code calls the launches directly through _DepthwiseConv: an operator's dispatch
# costs several times an autograd Function's host time.
@torch.library.custom_op("torchmb::depthwise_conv2d", mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, bias: Tensor | None, batch: int, order: str, stride: list[int],
             padding: list[int], dilation: list[int]) -> Tensor:
    """:func:`_conv`, differentiable (its registered backward)."""
    return _conv(x, weight, bias, batch, order, stride, padding, dilation)


@_conv_op.register_fake
def _(x, weight, bias, batch, order, stride, padding, dilation):
    out = _output_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    return _new_merged((x.shape[0], x.shape[1], *out), is_channels_last(x), x)


@torch.library.custom_op("torchmb::depthwise_conv2d_input_grad", mutates_args=())
def _input_grad_op(grad: Tensor, weight: Tensor, input_shape: list[int], channels_last: bool, batch: int, order: str,
                   stride: list[int], padding: list[int], dilation: list[int]) -> Tensor:
    """:func:`_input_grad`."""
    return _input_grad(grad, weight, input_shape, channels_last, batch, order, stride, padding, dilation)


@_input_grad_op.register_fake
def _(grad, weight, input_shape, channels_last, batch, order, stride, padding, dilation):
    return _new_merged(input_shape, channels_last, grad)


@torch.library.custom_op("torchmb::depthwise_conv2d_weight_grad", mutates_args=())
def _weight_grad_op(grad: Tensor, x: Tensor, weight: Tensor, with_bias: bool, batch: int, order: str,
                    stride: list[int], padding: list[int], dilation: list[int]) -> tuple[Tensor, Tensor]:
    """:func:`_weight_grad`."""
    return _weight_grad(grad, x, weight, with_bias, batch, order, stride, padding, dilation)


@_weight_grad_op.register_fake
def _(grad, x, weight, with_bias, batch, order, stride, padding, dilation):
    return weight.new_empty(weight.shape), weight.new_empty(weight.shape[0] if with_bias else 0)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, *config = inputs
    ctx.save_for_backward(x, weight)
    ctx.config = (bias is not None, *config)


def _backward(ctx, grad: Tensor, input_grad=_input_grad_op, weight_grad=_weight_grad_op):
    """The gradients of x, weight and bias (None where not needed) and of the five settings (None)."""
    x, weight = ctx.saved_tensors
    has_bias, batch, order, stride, padding, dilation = ctx.config
    needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
    config = (batch, order, stride, padding, dilation)
    if torch.is_grad_enabled():  # the backward is differentiated itself: ATen's differentiable formulas
        grad_x, grad_w, grad_b = _differentiable_grads(grad, x, weight, has_bias, (needs_x, needs_w, needs_b), *config)
    else:
        grad_x = input_grad(grad, weight, list(x.shape), is_channels_last(x), *config) if needs_x else None
        grad_w = grad_b = None
        if needs_w or (has_bias and needs_b):
            grad_w, grad_b = weight_grad(grad, x, weight, has_bias and needs_b, *config)
    return (grad_x, grad_w if needs_w else None, grad_b if has_bias and needs_b else None,
            None, None, None, None, None)


def _differentiable_grads(grad, x, weight, has_bias, mask, batch, order, stride, padding, dilation):
    """The gradients as the grouped convolution's ``aten.convolution_backward`` (differentiable) computes them."""
    channels_last = is_channels_last(x)
    grouped_x = to_grouped(x, batch, order, channels_last)
    grouped_grad = to_grouped(grad, batch, order, channels_last)
    grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grouped_grad, grouped_x, weight, [weight.shape[0]] if has_bias else None, stride, padding, dilation, False,
        [0, 0], weight.shape[0], [mask[0], mask[1], has_bias and mask[2]])
    grad_x = from_grouped(grad_x, batch, order, channels_last) if mask[0] else None
    return grad_x, grad_w, grad_b


_conv_op.register_autograd(_backward, setup_context=_setup_context)


class _DepthwiseConv(torch.autograd.Function):
    """:func:`_conv` with its backward, launching the kernels directly (eager code)."""

    @staticmethod
    def forward(x, weight, bias, batch, order, stride, padding, dilation):
        return _conv(x, weight, bias, batch, order, stride, padding, dilation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad, _input_grad, _weight_grad)


def depthwise_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Layout, stride: Sequence[int],
                     padding: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """B models' depthwise ``F.conv2d`` (one input and one output channel per group) of the merged ``x``
    (``(B*n, C, H, W)`` in ``layout``) with the stacked ``(B*C, 1, kh, kw)`` ``weight`` and ``(B*C,)`` ``bias``,
    numeric ``padding``; the merged result keeps ``x``'s order and layout (channels-last or contiguous). Under
    autocast it computes in autocast's dtype, as ``F.conv2d`` does."""
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and (tensor.dtype != x.dtype or tensor.device != x.device):
            raise RuntimeError(f"expected the {name} on the input's device and dtype ({x.device}, {x.dtype}), got "
                               f"{tensor.device}, {tensor.dtype}")
    args = (x, weight, bias, layout.batch, layout.order, list(stride), list(padding), list(dilation))
    if torch.compiler.is_compiling():  # dynamo traces the operators, not the launches
        return _conv_op(*args)
    return _DepthwiseConv.apply(*args)
