"""The convolution kernel table chooses, for every shape, the kernel that the predicates it replaced chose
(copied here from batch_layers/_conv.py, _conv_triton.py and _depthwise_triton.py as they were) or, for many
channels per group on images of a few pixels, the batched matrix product added after it, and says why."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import torchmb_config
from batch_layers import _kernel_table
from batch_layers._kernel_table import OPS, ConvCall, choose, explain

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def old_runs_on_triton(c: ConvCall, triton: bool) -> bool:
    w, groups = c.weight_shape, c.groups
    return (c.cuda and c.dims == 4 and not c.transposed and c.dtype in FLOATS and groups >= 128
            and w[0] // groups <= 32 and max(w[1], w[0] // groups) >= 2 and math.prod(w[1:]) <= 512 and triton)


def old_input_grad_on_triton(c: ConvCall, triton: bool) -> bool:
    return (not c.transposed and set(c.stride) == {1} and set(c.dilation) == {1}
            and old_runs_on_triton(ConvCall(c.cuda, c.dims, c.dtype, c.channels, c.weight_shape, c.groups), triton))


def old_runs_depthwise_grad(c: ConvCall, triton: bool) -> bool:
    w = c.weight_shape
    return (not c.transposed and c.cuda and c.dims == 4 and w[1] == 1 and c.groups == c.channels and w[0] >= 128
            and w[2] * w[3] <= 64 and c.dtype in FLOATS and triton)


def runs_on_stem(c: ConvCall, triton: bool) -> bool:
    """The stem's kernels (added after the table), eagerly, forward and weight gradient: strided 2-D layers of at
    most 3 input and 8 to 64 output channels per group, patches of at most 256 elements, from 16 groups."""
    w = c.weight_shape
    return (triton and c.cuda and c.dims == 4 and not c.transposed and c.dtype in FLOATS and max(c.stride) > 1
            and c.groups >= 16 and w[1] <= 3 and 8 <= w[0] // c.groups <= 64 and math.prod(w[1:]) <= 256)


def runs_as_matmul(c: ConvCall) -> bool:
    """The batched matrix product (added after the table): every op, from 16 channels per group in and out (from 1
    for a 1x1 kernel of one output pixel in bfloat16 or float16), where output pixels times input pixels read are at
    most 16, but a 1x1 kernel of several output pixels."""
    w = c.weight_shape
    if not (c.cuda and c.dims == 4 and not c.transposed and c.dtype in FLOATS and len(c.size) == 2):
        return False
    out_pixels, read = 1, 1
    for size, k, stride, pad, dilation in zip(c.size, w[2:], c.stride, c.padding, c.dilation):
        out = (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1
        first, last = max(0, -pad), min(size - 1, (out - 1) * stride - pad + (k - 1) * dilation)
        out_pixels, read = out_pixels * out, read * max(last - first + 1, 0)
    # a 1x1 kernel of one output pixel (squeeze-excitation) from one channel, added after the table
    one_pixel = math.prod(w[2:]) == 1 and out_pixels == 1 and c.dtype in (torch.bfloat16, torch.float16)
    enough = min(w[1], w[0] // c.groups) >= (1 if one_pixel else 16)
    return enough and out_pixels * read <= 16 and (math.prod(w[2:]) > 1 or out_pixels == 1)  # 1x1: pointwise


def runs_pointwise(c: ConvCall) -> bool:
    """The pointwise product (added after the table): unpadded 1x1 kernels, from 16 channels per group."""
    w = c.weight_shape
    return (c.cuda and c.dims == 4 and not c.transposed and c.dtype in FLOATS and min(w[1], w[0] // c.groups) >= 16
            and tuple(w[2:]) == (1, 1) and set(c.padding) == {0} and len(c.size) == 2 and math.prod(c.size) <= 64)


def runs_as_patches(c: ConvCall) -> bool:
    """The product of patches (added after the table), eagerly: 2-D strided layers of at least 64 input channels
    per group and 64 groups; from 16 groups, strided stems (at most 3 input channels per group, patches of at most
    twice a group's output channels) and layers whose kernel is their stride, unpadded."""
    if not (c.cuda and c.dims == 4 and not c.transposed and c.dtype in FLOATS and len(c.size) == 2
            and max(c.stride) > 1):
        return False
    in_g, out_g, kernel = c.weight_shape[1], c.weight_shape[0] // c.groups, c.weight_shape[2:]
    stem = in_g <= 3 and in_g * math.prod(kernel) <= 2 * out_g
    patchify = kernel == c.stride and set(c.padding) == {0} and set(c.dilation) == {1}
    return (c.groups >= 64 and in_g >= 64) or (c.groups >= 16 and (stem or patchify))


def old_keeps_channels_last(c: ConvCall) -> bool:
    in_per_group = c.weight_shape[0] // c.groups if c.transposed else c.weight_shape[1]
    return in_per_group >= 64


def calls():
    for cuda, dims, dtype, groups, out_g, in_g, k, transposed, stride, dilation, size in itertools.product(
            (True, False), (3, 4), (torch.float32, torch.bfloat16, torch.float16, torch.float64), (16, 127, 128, 512),
            (1, 2, 32, 33), (1, 2, 6, 64), (1, 3, 7, 9), (False, True), (1, 2), (1, 2), (1, 2, 8)):
        spatial = dims - 2
        if transposed:  # (B*C, O/g, *k)
            weight = (groups * in_g, out_g, *(k,) * spatial)
        else:  # (B*O, C/g, *k)
            weight = (groups * out_g, in_g, *(k,) * spatial)
        yield ConvCall(cuda, dims, dtype, groups * in_g, weight, groups, transposed, (stride,) * spatial,
                       (dilation,) * spatial, (size,) * spatial, (k // 2,) * spatial)


@pytest.mark.parametrize("triton", [True, False])
def test_the_table_chooses_what_the_old_predicates_chose(monkeypatch, triton):
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", triton)
    seen = set()
    for call in calls():
        got = tuple(choose(op, call, OPS).name for op in OPS)
        stem = "triton-stem" if runs_on_stem(call, triton) else "aten"
        want = ("triton-grouped" if old_runs_on_triton(call, triton) else stem,
                "triton-grouped" if old_input_grad_on_triton(call, triton) else "aten",
                "triton-depthwise" if old_runs_depthwise_grad(call, triton) else stem,
                "channels-last" if old_keeps_channels_last(call) else "contiguous",
                "contiguous")  # eager: the compiled depthwise layout does not apply
        if runs_as_matmul(call):
            want = ("matmul",) * 3 + want[3:]
        elif runs_pointwise(call):
            want = ("pointwise-matmul",) * 3 + want[3:]
        elif runs_as_patches(call):  # eagerly: wide strided layers, strided stems
            want = ("patches-matmul",) * 3 + want[3:]
        assert got == want, call
        seen.add(got)
    if triton:  # the grid reaches every kernel, alone and together
        assert {s[0] for s in seen} == {"matmul", "pointwise-matmul", "patches-matmul", "triton-grouped",
                                        "triton-stem", "aten"}
        assert {s[2] for s in seen} == {"matmul", "pointwise-matmul", "patches-matmul", "triton-depthwise",
                                        "triton-stem", "aten"}
        assert ("triton-stem", "aten", "triton-stem", "contiguous", "contiguous") in seen
        assert ("triton-grouped", "triton-grouped", "aten", "contiguous", "contiguous") in seen
        assert ("matmul", "matmul", "matmul", "channels-last", "contiguous") in seen
        assert ("patches-matmul", "patches-matmul", "patches-matmul", "channels-last", "contiguous") in seen


def test_the_triton_switch_and_the_limits_are_read_at_each_choice(monkeypatch):
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    lenet2 = ConvCall(True, 4, torch.float32, 256 * 6, (256 * 16, 6, 5, 5), 256)
    assert choose("forward", lenet2, OPS).name == "triton-grouped"
    with torchmb_config.use("triton", False):
        assert choose("forward", lenet2, OPS).name == "aten"
    monkeypatch.setitem(_kernel_table.TRITON_GROUPED.limits, "min_groups", 512)
    assert choose("forward", lenet2, OPS).name == "aten"


def test_compiled_convolutions_take_the_triton_kernel_from_fewer_groups(monkeypatch):
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    limits = _kernel_table.TRITON_GROUPED.limits
    at_least = ConvCall(True, 4, torch.float32, 0, (limits["min_groups_compiled"] * 16, 6, 5, 5),
                        limits["min_groups_compiled"])
    fewer = at_least._replace(groups=at_least.groups // 2, weight_shape=(at_least.weight_shape[0] // 2, 6, 5, 5))
    assert choose("forward", at_least, OPS).name == "aten"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choose("forward", at_least, OPS).name == "triton-grouped"
    assert choose("input grad", at_least, OPS).name == "triton-grouped"
    assert choose("forward", fewer, OPS).name == "aten"


def test_compiled_depthwise_convolutions_of_16_pixels_or_more_run_channels_last(monkeypatch):
    op = "layout of a compiled convolution's contiguous input"
    depthwise = ConvCall(True, 4, torch.float32, 64 * 32, (64 * 32, 1, 3, 3), 64 * 32, size=(4, 4), padding=(1, 1))
    assert choose(op, depthwise, OPS).name == "contiguous"  # eager: its copies would cost more than they save
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choose(op, depthwise, OPS).name == "channels-last"
    assert choose(op, depthwise._replace(size=(2, 2)), OPS).name == "contiguous"
    assert choose(op, depthwise._replace(cuda=False), OPS).name == "contiguous"
    multiplier = depthwise._replace(weight_shape=(64 * 32 * 2, 1, 3, 3))  # two outputs per channel
    assert choose(op, multiplier, OPS).name == "contiguous"
    grouped = depthwise._replace(weight_shape=(64 * 32, 2, 3, 3), groups=64 * 16)
    assert choose(op, grouped, OPS).name == "contiguous"


def test_compiled_wide_stride_1_convolutions_of_16_pixels_or_more_run_channels_last(monkeypatch):
    """ResNet-18's 3x3 layers of 64 and 128 channels per model (cuDNN converts each group's slice of a contiguous
    input); not its strided layers, its 2x2 images, narrower groups or eager calls."""
    op = "layout of a compiled convolution's contiguous input"
    layer1 = ConvCall(True, 4, torch.float32, 64 * 64, (64 * 64, 64, 3, 3), 64, size=(8, 8), padding=(1, 1))
    assert choose(op, layer1, OPS).name == "contiguous"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choose(op, layer1, OPS).name == "channels-last (wide groups)"
    assert choose(op, layer1._replace(size=(4, 4), weight_shape=(64 * 128, 128, 3, 3)), OPS).name != "contiguous"
    assert "stride 1" in _kernel_table.WIDE_CHANNELS_LAST.unmet(layer1._replace(stride=(2, 2)))[0]
    assert choose(op, layer1._replace(size=(2, 2)), OPS).name == "contiguous"
    regnet = layer1._replace(weight_shape=(64 * 64, 16, 3, 3), groups=64 * 4)  # 16 channels per group
    assert choose(op, regnet, OPS).name == "contiguous"
    assert choose(op, layer1._replace(cuda=False), OPS).name == "contiguous"
    assert choose(op, layer1._replace(dtype=torch.float64), OPS).name == "contiguous"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_products_take_16_pixel_pairs(monkeypatch, compiled: bool):
    """A 3x3 convolution of a 2x2 image with stride 1 (ResNet-18's third stage on 32x32 inputs): 16 pairs, eagerly
    and compiled; a 3x3 image (81 pairs) stays grouped."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiled)
    two_by_two = ConvCall(True, 4, torch.float32, 64 * 256, (64 * 256, 256, 3, 3), 64, size=(2, 2), padding=(1, 1))
    assert _kernel_table.MATMUL.applies(two_by_two)
    assert "pixel pairs" in _kernel_table.MATMUL.unmet(two_by_two._replace(size=(3, 3)))[0]


def test_compiled_1x1_kernels_of_several_pixels_take_the_pointwise_product(monkeypatch):
    """ConvNeXt-atto's MLP on 2x2 images (160 -> 640 channels per model) has 16 pixel pairs, but as the Toeplitz
    product its filters would hold a block per pair, 12 of 16 zeros (16x the models' weights, kept for the
    backward). The pointwise product multiplies the filters themselves. On a 1x1 image (one pair) the Toeplitz
    product stays first."""
    mlp = ConvCall(True, 4, torch.float32, 16 * 160, (16 * 640, 160, 1, 1), 16, size=(2, 2), padding=(0, 0))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert [choose(op, mlp, OPS).name for op in ("forward", "input grad", "weight grad")] == ["pointwise-matmul"] * 3
    assert _kernel_table.MATMUL.unmet(mlp) == [
        "a kernel of several taps, or one output pixel (POINTWISE multiplies 1x1 kernels without a block per pair)"]
    assert choose("forward", mlp._replace(size=(1, 1)), OPS).name == "matmul"
    assert choose("forward", mlp._replace(weight_shape=(16 * 640, 160, 3, 3), padding=(1, 1)), OPS).name == "matmul"


def test_explain_names_the_kernel_and_every_unmet_condition(monkeypatch):
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    few_models = ConvCall(True, 4, torch.float32, 16 * 6, (16 * 16, 6, 5, 5), 16)
    text = explain(few_models, OPS)
    assert "forward: aten" in text and "not triton-grouped: needs at least 128 groups" in text
    assert "weight grad: aten" in text and "one input channel per group" in text
    assert "layout of a channels-last input: contiguous" in text
    lenet2 = ConvCall(True, 4, torch.float32, 256 * 6, (256 * 16, 6, 5, 5), 256, stride=(2, 2))
    text = explain(lenet2, OPS)
    assert "forward: triton-grouped (H100" in text and "not triton-grouped: needs stride 1" in text


def test_a_call_of_b_models_weights_is_the_call_of_their_stack():
    x, weight = torch.empty(4 * 2, 6, 3, 3), torch.empty(4, 16, 6, 3, 3)
    per_model = ConvCall.of_merged(x, weight, 4, 4, (1, 1), (1, 1), (1, 1))
    assert per_model == ConvCall.of_merged(x, weight.flatten(0, 1), 4, 4, (1, 1), (1, 1), (1, 1))
    assert per_model.weight_shape == (64, 6, 3, 3)


def test_eager_stems_the_product_leaves_take_the_stem_kernels_from_16_models(monkeypatch):
    """ResNet's 7x7 stem (patches 2.3x its 64 outputs: PATCHES leaves it eagerly) runs forward and weight gradient
    on the stem's kernels from 16 models, eagerly; compiled, the product of patches takes it."""
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)

    def resnet_stem(models: int) -> ConvCall:
        return ConvCall(True, 4, torch.float32, 3 * models, (64 * models, 3, 7, 7), models, stride=(2, 2),
                        size=(32, 32), padding=(3, 3))

    efficientnet_stem = resnet_stem(16)._replace(weight_shape=(32 * 16, 3, 3, 3), padding=(1, 1))
    for op in ("forward", "weight grad"):
        assert choose(op, resnet_stem(16), OPS).name == "triton-stem"
        assert choose(op, resnet_stem(15), OPS).name == "aten", "cuDNN below 16 models"
        assert choose(op, resnet_stem(16)._replace(stride=(1, 1)), OPS).name == "aten", "stride 1: not a stem"
        assert choose(op, efficientnet_stem, OPS).name == "patches-matmul", "small patches: the product first"
    assert choose("input grad", resnet_stem(16), OPS).name == "aten"
    assert "at least 16 groups" in explain(resnet_stem(15), OPS)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choose("forward", resnet_stem(64), OPS).name == "patches-matmul"
    assert "eager" in _kernel_table.TRITON_STEM.unmet(resnet_stem(64))[0]
