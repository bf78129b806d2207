"""Convolutions of few pixels as one batched matrix product (``batch_layers/_conv_matmul.py``) against B
plain convolutions: outputs and gradients (first and second order) in float64 on the CPU for every geometry,
and through ``batch_layers.Conv2d`` on a GPU, where the kernel table chooses it."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from support.conv_checks import check_conv_on_gpu, check_product_against_plain_conv2d
from support.launches import CopySizes
from torch import nn

from batch_layers import Layout, _kernel_table
from batch_layers._conv_matmul import matmul_conv2d, runs_as_matmul

BATCH, SAMPLES = 3, 2
GEOMETRIES = [  # in, out, kernel, stride, padding, dilation, groups, height, width
    (4, 5, 3, 1, 1, 1, 1, 1, 1),  # a ResNet's last stage on 32x32 images: the centre taps
    (4, 5, 3, 1, 1, 1, 1, 2, 2),  # every output pixel reads every input pixel
    (4, 6, 3, 2, 1, 1, 1, 2, 2),  # strided down to one pixel
    (4, 6, 1, 2, 0, 1, 1, 2, 2),  # the 1x1 downsampling: one pixel read
    (4, 6, 3, 2, 1, 1, 1, 4, 4),  # a 4x4 image strided to 2x2
    (6, 4, 3, 1, 2, 2, 2, 2, 3),  # dilated, two groups per model, a 2x3 image
    (3, 4, (1, 3), (1, 2), (0, 1), 1, 1, 1, 3),
    (2, 4, 3, 1, 0, 1, 1, 3, 3),  # no padding: one output pixel reading nine
    (6, 4, 3, 1, 1, 1, 2, 1, 1),  # a 1x1 image, two groups per model
    (6, 9, 1, 1, 0, 1, 3, 1, 1),  # squeeze-and-excitation's 1x1 convolutions of pooled images, three groups
]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-model"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
def test_the_product_is_b_plain_convolutions(geometry, order: str, channels_last: bool, stacked: bool) -> None:
    check_product_against_plain_conv2d(matmul_conv2d, geometry, order, channels_last, True, stacked, BATCH, SAMPLES)


def test_without_bias_and_under_bf16_autocast_as_plain_autocast() -> None:
    torch.manual_seed(0)
    layout = Layout(BATCH, "samples")
    x = torch.randn(BATCH, SAMPLES, 8, 2, 2)
    weight = torch.randn(BATCH, 8, 8, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = matmul_conv2d(layout.merge(x), weight.flatten(0, 1), None, layout, (1, 1), (1, 1), (1, 1), 1)
        expected = [F.conv2d(x[b], weight[b], None, 1, 1) for b in range(BATCH)]
    assert y.dtype == expected[0].dtype == torch.bfloat16
    for b in range(BATCH):
        torch.testing.assert_close(layout.split(y)[b], expected[b], atol=0.1, rtol=0.05)


def test_the_table_takes_few_pixels_and_leaves_larger_images() -> None:
    weight = torch.empty(BATCH * 32, 32, 3, 3)
    pairs_allowed = {(1, 1): True, (2, 2): True, (2, 1): True, (3, 1): False, (4, 2): False, (8, 2): False}
    for (height, stride), want in pairs_allowed.items():
        x = torch.empty(BATCH * 2, 32, height, height)
        call = _kernel_table.ConvCall(True, 4, torch.float32, BATCH * 32, tuple(weight.shape), BATCH, False,
                                      (stride, stride), (1, 1), (height, height), (1, 1))
        assert _kernel_table.MATMUL.applies(call) is want, (height, stride)
        merged = _kernel_table.ConvCall.of_merged(x, weight, BATCH, BATCH, (stride, stride), (1, 1), (1, 1))
        assert not runs_as_matmul(merged), "only on a GPU"
    few = _kernel_table.MATMUL.limits["min_channels"] - 1
    call = _kernel_table.ConvCall(True, 4, torch.float32, BATCH * few, (BATCH * 32, few, 3, 3), BATCH, False,
                                  (1, 1), (1, 1), (1, 1), (1, 1))
    assert "at least 16 input and output channels per group" in _kernel_table.MATMUL.unmet(call)[0]
    squeeze = call._replace(weight_shape=(BATCH * 6, 144, 1, 1), channels=BATCH * 144, padding=(0, 0),
                            dtype=torch.bfloat16)
    assert _kernel_table.MATMUL.applies(squeeze), "a squeeze-excitation layer of 6 channels: 1x1, one output pixel"
    assert _kernel_table.MATMUL.applies(squeeze._replace(weight_shape=(BATCH * 144, 6, 1, 1), channels=BATCH * 6))
    assert not _kernel_table.MATMUL.applies(squeeze._replace(dtype=torch.float32)), "cuDNN's one fp32 kernel"
    assert _kernel_table.MATMUL.applies(squeeze._replace(dtype=torch.float16)), "cuDNN's float16 kernels loop too"
    assert not _kernel_table.MATMUL.applies(squeeze._replace(size=(2, 2))), "several output pixels: POINTWISE's"


def test_a_call_under_autocast_names_the_dtype_it_computes_in() -> None:
    x, weight = torch.empty(BATCH * 2, 8, 1, 1), torch.empty(BATCH * 4, 8, 1, 1)
    assert _kernel_table.ConvCall.of_merged(x, weight, BATCH, BATCH, (1, 1), (0, 0), (1, 1)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        call = _kernel_table.ConvCall.of_merged(x, weight, BATCH, BATCH, (1, 1), (0, 0), (1, 1))
        assert call.dtype == torch.bfloat16
        assert _kernel_table.ConvCall.of_merged(x.double(), weight.double(), BATCH, BATCH, (1, 1), (0, 0),
                                                (1, 1)).dtype == torch.float64, "autocast leaves float64 alone"


@pytest.mark.cuda
@pytest.mark.parametrize(("order", "amp"), list(itertools.product(["models", "samples"], [False, True])))
def test_the_layer_takes_the_product_on_a_gpu_and_matches_plain(order: str, amp: bool) -> None:
    def takes_kernel(conv: nn.Conv2d, dtype: torch.dtype = torch.float32):
        return lambda x, weight: runs_as_matmul(
            _kernel_table.ConvCall.of_merged(x, weight, BATCH, BATCH, conv.stride, conv.padding, conv.dilation)
            ._replace(dtype=dtype))

    strided = nn.Conv2d(32, 48, 3, 2, 1)
    check_conv_on_gpu(strided, BATCH, SAMPLES, 2, order, amp, takes_kernel(strided))
    # a dilated filter on a 3x3 image: its one output pixel skips the middle row and column (gathered, masked)
    dilated = nn.Conv2d(16, 24, 2, dilation=2)
    check_conv_on_gpu(dilated, BATCH, SAMPLES, 3, order, amp, takes_kernel(dilated))
    # a 2x2 image of stride 1 (16 pixel pairs, ResNet-18's third stage on 32x32 inputs): taps gathered by an index
    two_by_two = nn.Conv2d(16, 24, 3, 1, 1)
    check_conv_on_gpu(two_by_two, BATCH, SAMPLES, 2, order, amp, takes_kernel(two_by_two))
    if amp:  # squeeze-excitation's 1x1 layers of pooled images, of fewer channels, in 16-bit floats
        for squeeze, dtype in itertools.product((nn.Conv2d(24, 6, 1), nn.Conv2d(6, 24, 1)),
                                                (torch.bfloat16, torch.float16)):
            check_conv_on_gpu(squeeze, BATCH, SAMPLES, 1, order, amp, takes_kernel(squeeze, dtype), amp_dtype=dtype)


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize(("kernel", "padding", "size"), [(1, 0, 1), (3, 0, 3)], ids=["1x1-image", "3x3-unpadded"])
def test_one_pixel_copies_nothing_of_the_filters(order: str, kernel: int, padding: int, size: int) -> None:
    """One output pixel reading every tap in order multiplies filters first: autograd hands the weight's
    gradient back in the weight's own layout, and forward and backward copy no filter."""
    layout = Layout(BATCH, order)
    x = torch.randn(BATCH * SAMPLES, 8, size, size, requires_grad=True)
    weight = torch.randn(BATCH * 16, 8, kernel, kernel, requires_grad=True)
    bias = torch.randn(BATCH * 16, requires_grad=True)
    with CopySizes() as copies:
        y = matmul_conv2d(x, weight, bias, layout, (1, 1), (padding, padding), (1, 1), 1)
        y.sum().backward()
    assert weight.grad.is_contiguous() and weight.grad.shape == weight.shape
    assert weight.numel() not in copies.sizes, f"a copy of the filters ({weight.numel()} elements): {copies.sizes}"
    assert copies.sizes, "the output is laid out merged (the check sees copies)"


@pytest.mark.parametrize(("batch", "samples"), [(1, 2), (3, 1)], ids=["one-model", "one-sample"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", [GEOMETRIES[i] for i in (0, 1, 3, 8)], ids=lambda g: "x".join(map(str, g)))
def test_one_model_or_one_sample_is_b_plain_convolutions(geometry, order: str, batch: int, samples: int) -> None:
    """A single model or sample makes views of the merged layout contiguous that are not otherwise: the result
    is still laid out merged and contiguous."""
    check_product_against_plain_conv2d(matmul_conv2d, geometry, order, False, True, True, batch, samples)
