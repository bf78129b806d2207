"""Convolutions of few pixels as one batched matrix product (``batch_layers/_conv_matmul.py``) against B
plain convolutions: outputs and gradients (first and second order) in float64 on the CPU for every geometry,
and through ``batch_layers.Conv2d`` on a GPU, where the kernel table chooses it."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batch_layers
from batch_layers import ForwardContext, Layout, _kernel_table, forward_context
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
]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
def test_the_product_is_b_plain_convolutions(geometry, order: str, channels_last: bool) -> None:
    cin, cout, k, stride, padding, dilation, groups, height, width = geometry
    k, stride, padding, dilation = (v if isinstance(v, tuple) else (v, v) for v in (k, stride, padding, dilation))
    torch.manual_seed(0)
    layout = Layout(BATCH, order)
    x = torch.randn(BATCH, SAMPLES, cin, height, width, dtype=torch.float64)
    weight = torch.randn(BATCH, cout, cin // groups, *k, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(BATCH, cout, dtype=torch.float64, requires_grad=True)
    merged = layout.merge(x)
    if channels_last:
        merged = merged.contiguous(memory_format=torch.channels_last)
    merged.requires_grad_()
    y = matmul_conv2d(merged, weight.flatten(0, 1), bias.flatten(), layout, stride, padding, dilation, groups)
    per_model = layout.split(y)
    ramp = torch.linspace(-1, 1, per_model[0].numel(), dtype=torch.float64).view_as(per_model[0])
    # a second-order loss: the gradient of the first enters it
    (grad_x,) = torch.autograd.grad((per_model * ramp).sum(), merged, create_graph=True)
    (per_model.square().sum() + grad_x.square().sum()).backward()
    grad_x = layout.split(grad_x)
    for b in range(BATCH):
        own_x = x[b].clone().requires_grad_()
        own_w = weight[b].detach().clone().requires_grad_()
        own_b = bias[b].detach().clone().requires_grad_()
        expected = F.conv2d(own_x, own_w, own_b, stride, padding, dilation, groups)
        (own_grad_x,) = torch.autograd.grad((expected * ramp).sum(), own_x, create_graph=True)
        (expected.square().sum() + own_grad_x.square().sum()).backward()
        torch.testing.assert_close(per_model[b], expected)
        torch.testing.assert_close(grad_x[b], own_grad_x)
        torch.testing.assert_close(weight.grad[b], own_w.grad)
        torch.testing.assert_close(bias.grad[b], own_b.grad)
    if channels_last and y.shape[2] * y.shape[3] > 1:
        assert y.is_contiguous(memory_format=torch.channels_last), "a channels-last input keeps its storage"
    else:
        assert y.is_contiguous()


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
    for (height, stride), want in {(1, 1): True, (2, 2): True, (2, 1): False, (4, 2): False, (8, 2): False}.items():
        x = torch.empty(BATCH * 2, 32, height, height)
        call = _kernel_table.ConvCall(True, 4, torch.float32, BATCH * 32, tuple(weight.shape), BATCH, False,
                                      (stride, stride), (1, 1), (height, height), (1, 1))
        assert _kernel_table.MATMUL.applies(call) is want, (height, stride)
        assert not runs_as_matmul(x, weight, BATCH, 1, (stride, stride), (1, 1), (1, 1)), "only on a GPU"
    few = _kernel_table.MATMUL.limits["min_channels"] - 1
    call = _kernel_table.ConvCall(True, 4, torch.float32, BATCH * few, (BATCH * 32, few, 3, 3), BATCH, False,
                                  (1, 1), (1, 1), (1, 1), (1, 1))
    assert "at least 16 input and output channels per group" in _kernel_table.MATMUL.unmet(call)[0]


@pytest.mark.cuda
@pytest.mark.parametrize(("order", "amp"), list(itertools.product(["models", "samples"], [False, True])))
def test_the_layer_takes_the_product_on_a_gpu_and_matches_plain(order: str, amp: bool) -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _check_layer_on_gpu(order, amp)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _check_layer_on_gpu(order: str, amp: bool) -> None:
    _check_conv_on_gpu(nn.Conv2d(32, 48, 3, 2, 1), 2, order, amp)
    # a dilated filter on a 3x3 image: its one output pixel skips the middle row and column (gathered, masked)
    _check_conv_on_gpu(nn.Conv2d(16, 24, 2, dilation=2), 3, order, amp)


def _check_conv_on_gpu(conv: nn.Conv2d, size: int, order: str, amp: bool) -> None:
    torch.manual_seed(0)
    plain = [copy.deepcopy(conv).cuda() for _ in range(BATCH)]
    for model in plain:
        model.reset_parameters()
    batched = batch_layers.Conv2d.from_module(plain[0], BATCH).cuda()
    with torch.no_grad():
        for i, model in enumerate(plain):
            batched.weight[i].copy_(model.weight)
            batched.bias[i].copy_(model.bias)
    batched.merged_order = order
    layout = Layout(BATCH, order)
    x = torch.randn(BATCH, SAMPLES, conv.in_channels, size, size, device="cuda")
    merged = layout.merge(x).requires_grad_()
    assert runs_as_matmul(merged, batched.weight.flatten(0, 1), BATCH, 1, conv.stride, conv.padding, conv.dilation)
    with forward_context(ForwardContext(BATCH, SAMPLES, order=order)), torch.autocast("cuda", enabled=amp):
        y = batched(merged)
    layout.split(y).float().square().sum().backward()
    tolerance = {"atol": 5e-2, "rtol": 5e-2} if amp else {"atol": 1e-4, "rtol": 1e-4}
    for b, model in enumerate(plain):
        own = x[b].clone().requires_grad_()
        with torch.autocast("cuda", enabled=amp):
            expected = model(own)
        expected.float().square().sum().backward()
        torch.testing.assert_close(layout.split(y)[b], expected, **tolerance)
        torch.testing.assert_close(layout.split(merged.grad)[b], own.grad, **tolerance)
        torch.testing.assert_close(batched.weight.grad[b], model.weight.grad, **tolerance)
        torch.testing.assert_close(batched.bias.grad[b], model.bias.grad, **tolerance)
