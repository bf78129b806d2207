"""Pointwise convolutions as one batched matrix product (``batch_layers/_conv_pointwise.py``) against B plain
1x1 convolutions: outputs and gradients (first and second order) in float64 on the CPU, and through
``batch_layers.Conv2d`` on a GPU, where the kernel table chooses it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batch_layers
from batch_layers import ForwardContext, Layout, _kernel_table, forward_context
from batch_layers._conv_pointwise import pointwise_conv2d, runs_pointwise

BATCH, SAMPLES = 3, 2
GEOMETRIES = [  # in, out, stride, groups, height, width
    (4, 6, 1, 1, 5, 3),
    (4, 6, 2, 1, 5, 4),  # a ResNet's downsampling: odd size, stride 2
    (6, 4, (1, 3), 2, 4, 7),  # two groups per model (ShuffleNet), an uneven stride
    (3, 5, 1, 1, 1, 1),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
def test_the_product_is_b_plain_convolutions(geometry, order: str, channels_last: bool, bias: bool) -> None:
    cin, cout, stride, groups, height, width = geometry
    stride = stride if isinstance(stride, tuple) else (stride, stride)
    torch.manual_seed(0)
    layout = Layout(BATCH, order)
    x = torch.randn(BATCH, SAMPLES, cin, height, width, dtype=torch.float64)
    weight = torch.randn(BATCH, cout, cin // groups, 1, 1, dtype=torch.float64, requires_grad=True)
    biases = torch.randn(BATCH, cout, dtype=torch.float64, requires_grad=True) if bias else None
    merged = layout.merge(x)
    if channels_last:
        merged = merged.contiguous(memory_format=torch.channels_last)
    merged.requires_grad_()
    y = pointwise_conv2d(merged, weight.flatten(0, 1), None if biases is None else biases.flatten(), layout, stride,
                         groups)
    per_model = layout.split(y)
    ramp = torch.linspace(-1, 1, per_model[0].numel(), dtype=torch.float64).view_as(per_model[0])
    (grad_x,) = torch.autograd.grad((per_model * ramp).sum(), merged, create_graph=True)
    (per_model.square().sum() + grad_x.square().sum()).backward()
    grad_x = layout.split(grad_x)
    for b in range(BATCH):
        own_x = x[b].clone().requires_grad_()
        own_w = weight[b].detach().clone().requires_grad_()
        own_b = None if biases is None else biases[b].detach().clone().requires_grad_()
        expected = F.conv2d(own_x, own_w, own_b, stride, 0, 1, groups)
        (own_grad_x,) = torch.autograd.grad((expected * ramp).sum(), own_x, create_graph=True)
        (expected.square().sum() + own_grad_x.square().sum()).backward()
        torch.testing.assert_close(per_model[b], expected)
        torch.testing.assert_close(grad_x[b], own_grad_x)
        torch.testing.assert_close(weight.grad[b], own_w.grad)
        if own_b is not None:
            torch.testing.assert_close(biases.grad[b], own_b.grad)
    if channels_last and y.shape[2] * y.shape[3] > 1:
        assert y.is_contiguous(memory_format=torch.channels_last), "a channels-last input keeps its storage"
    else:
        assert y.is_contiguous()


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
    x = torch.empty(BATCH * 2, 32, 8, 8)
    assert not runs_pointwise(x, torch.empty(BATCH * 32, 32, 1, 1), BATCH, 1, (1, 1), (0, 0), (1, 1)), "GPU only"


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("amp", [False, True])
def test_the_layer_takes_the_product_on_a_gpu_and_matches_plain(order: str, amp: bool) -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        conv = nn.Conv2d(32, 48, 1, stride=2)
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
        x = torch.randn(BATCH, SAMPLES, 32, 7, 7, device="cuda")
        merged = layout.merge(x).requires_grad_()
        assert runs_pointwise(merged, batched.weight.flatten(0, 1), BATCH, 1, (2, 2), (0, 0), (1, 1))
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
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
