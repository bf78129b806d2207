"""Pointwise convolutions as one batched matrix product (``batch_layers/_conv_pointwise.py``) against B plain
1x1 convolutions: outputs and gradients (first and second order) in float64 on the CPU, and through
``batch_layers.Conv2d`` on a GPU, where the kernel table chooses it."""

from __future__ import annotations

import pytest
import torch
from support.conv_checks import check_conv_on_gpu, check_product_against_plain_conv2d
from support.graph import autograd_nodes
from support.launches import CopySizes
from torch import nn

from batch_layers import Layout, _kernel_table
from batch_layers._conv_pointwise import pointwise_conv2d, runs_pointwise

BATCH, SAMPLES = 3, 2
GEOMETRIES = [  # in, out, stride, groups, height, width
    (4, 6, 1, 1, 5, 3),
    (4, 6, 2, 1, 5, 4),  # a ResNet's downsampling: odd size, stride 2
    (6, 4, (1, 3), 2, 4, 7),  # two groups per model (ShuffleNet), an uneven stride
    (3, 5, 1, 1, 1, 1),
]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-model"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
def test_the_product_is_b_plain_convolutions(geometry, order: str, channels_last: bool, bias: bool,
                                             stacked: bool) -> None:
    cin, cout, stride, groups, height, width = geometry

    def product(x, weight, bias, layout, stride, padding, dilation, groups):
        return pointwise_conv2d(x, weight, bias, layout, stride, groups)

    check_product_against_plain_conv2d(product, (cin, cout, 1, stride, 0, 1, groups, height, width), order,
                                       channels_last, bias, stacked, BATCH, SAMPLES)


def test_the_table_takes_unpadded_1x1_kernels_only() -> None:
    def call(kernel: int, padding: int, channels: int = 32):
        return _kernel_table.ConvCall(True, 4, torch.float32, BATCH * channels, (BATCH * 32, channels, kernel, kernel),
                                      BATCH, False, (2, 2), (1, 1), (8, 8), (padding, padding))

    assert _kernel_table.POINTWISE.applies(call(1, 0))
    assert not _kernel_table.POINTWISE.applies(call(1, 1)), "padded"
    assert not _kernel_table.POINTWISE.applies(call(3, 1))
    large = _kernel_table.ConvCall(True, 4, torch.float32, BATCH * 32, (BATCH * 32, 32, 1, 1), BATCH, size=(16, 16),
                                   padding=(0, 0))
    assert "at most 64 pixels per image" in _kernel_table.POINTWISE.unmet(large)[0]
    few = _kernel_table.POINTWISE.limits["min_channels"] - 1
    assert "input and output channels per group" in _kernel_table.POINTWISE.unmet(call(1, 0, few))[0]
    x, weight = torch.empty(BATCH * 2, 32, 8, 8), torch.empty(BATCH * 32, 32, 1, 1)
    merged = _kernel_table.ConvCall.of_merged(x, weight, BATCH, BATCH, (1, 1), (0, 0), (1, 1))
    assert not runs_pointwise(merged), "GPU only"


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("amp", [False, True])
def test_the_layer_takes_the_product_on_a_gpu_and_matches_plain(order: str, amp: bool) -> None:
    def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return runs_pointwise(_kernel_table.ConvCall.of_merged(x, weight, BATCH, BATCH, (2, 2), (0, 0), (1, 1)))

    check_conv_on_gpu(nn.Conv2d(32, 48, 1, stride=2), BATCH, SAMPLES, 7, order, amp, takes_kernel)


@pytest.mark.parametrize("order", ["models", "samples"])
def test_a_contiguous_input_copies_nothing_of_the_filters(order: str) -> None:
    """Filters first, autograd hands the weight's gradient back in the weight's own layout: forward and
    backward copy the input's pixels and the output and their gradients, never B models' filters."""
    layout = Layout(BATCH, order)
    x = torch.randn(BATCH * SAMPLES, 8, 3, 3, requires_grad=True)  # no activation the filters' size
    weight = torch.randn(BATCH * 16, 8, 1, 1, requires_grad=True)
    bias = torch.randn(BATCH * 16, requires_grad=True)

    def step():
        x.grad = weight.grad = bias.grad = None
        pointwise_conv2d(x, weight, bias, layout, (1, 1), 1).sum().backward()

    with CopySizes() as copies:
        step()
    assert weight.grad.is_contiguous() and weight.grad.shape == weight.shape
    assert weight.numel() not in copies.sizes, f"a copy of the filters ({weight.numel()} elements): {copies.sizes}"
    assert copies.sizes, "the pixels are copied (the check sees copies)"


@pytest.mark.parametrize(("batch", "samples"), [(1, 2), (3, 1)], ids=["one-model", "one-sample"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize(("stride", "groups"), [(1, 1), (1, 2), (2, 1)], ids=["plain", "grouped", "strided"])
def test_one_model_or_one_sample_is_b_plain_convolutions(stride: int, groups: int, order: str, batch: int,
                                                         samples: int) -> None:
    """A single model or sample makes views of the merged layout contiguous that are not otherwise: the result
    is still laid out merged and contiguous."""

    def product(x, weight, bias, layout, stride, padding, dilation, groups):
        return pointwise_conv2d(x, weight, bias, layout, stride, groups)

    check_product_against_plain_conv2d(product, (4, 6, 1, stride, 0, 1, groups, 3, 3), order, False, True, True,
                                       batch, samples)


def test_a_channels_last_models_major_input_makes_few_autograd_nodes() -> None:
    """ConvNeXt's 1x1 layers (channels-last after its LayerNorm2d, models-major): each node is host time in a
    host-bound step, and its pixels already lie as the rows of each model's matrix, so the product takes eight
    nodes (the general path's views made thirteen)."""
    layout = Layout(BATCH, "models")
    x = torch.randn(BATCH * SAMPLES, 8, 3, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight = torch.randn(BATCH, 16, 8, 1, 1, requires_grad=True)
    bias = torch.randn(BATCH, 16, requires_grad=True)
    y = pointwise_conv2d(x, weight, bias, layout, (1, 1), 1)
    nodes = [name for name in autograd_nodes(y) if name != "AccumulateGrad"]
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert len(nodes) <= 8, nodes
