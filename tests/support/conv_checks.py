"""Batched convolutions against B plain ones, for the kernel-table tests of ``batch_layers``:
:func:`check_against_plain_conv2d` (a functional form in float64, outputs and first and second order
gradients) and :func:`check_conv_on_gpu` (a batched ``Conv2d`` on a GPU with TF32 off, optionally under bf16
autocast, after asserting that the shape takes the kernel under test)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import batch_layers
from batch_layers import ForwardContext, Layout, forward_context

__all__ = ["check_against_plain_conv2d", "check_conv_on_gpu"]


def check_against_plain_conv2d(run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
                               x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: Layout,
                               channels_last: bool, stride, padding, dilation, groups: int) -> None:
    """``run(merged input, stacked weight, stacked bias)`` against ``F.conv2d`` of each model's ``x[b]``
    (``(B, n, C, H, W)``) with its ``weight[b]`` and ``bias[b]`` (leaves that require grad): the output, and
    after a loss that holds the input's gradient, that gradient and the parameters' gradients. A
    channels-last input must give a channels-last output (where it has more than one pixel)."""
    merged = layout.merge(x)
    if channels_last:
        merged = merged.contiguous(memory_format=torch.channels_last)
    merged.requires_grad_()
    y = run(merged, weight.flatten(0, 1), None if bias is None else bias.flatten())
    per_model = layout.split(y)
    ramp = torch.linspace(-1, 1, per_model[0].numel(), dtype=x.dtype).view_as(per_model[0])
    # a second-order loss: the gradient of the first enters it
    (grad_x,) = torch.autograd.grad((per_model * ramp).sum(), merged, create_graph=True)
    (per_model.square().sum() + grad_x.square().sum()).backward()
    grad_x = layout.split(grad_x)
    for b in range(layout.batch):
        own_x = x[b].clone().requires_grad_()
        own_w = weight[b].detach().clone().requires_grad_()
        own_b = None if bias is None else bias[b].detach().clone().requires_grad_()
        expected = F.conv2d(own_x, own_w, own_b, stride, padding, dilation, groups)
        (own_grad_x,) = torch.autograd.grad((expected * ramp).sum(), own_x, create_graph=True)
        (expected.square().sum() + own_grad_x.square().sum()).backward()
        torch.testing.assert_close(per_model[b], expected)
        torch.testing.assert_close(grad_x[b], own_grad_x)
        torch.testing.assert_close(weight.grad[b], own_w.grad)
        if own_b is not None:
            torch.testing.assert_close(bias.grad[b], own_b.grad)
    # as F.conv2d's: a one-channel input is stored alike either way, and its result is contiguous
    stored_channels_last = merged.is_contiguous(memory_format=torch.channels_last) and not merged.is_contiguous()
    if stored_channels_last and y.shape[2] * y.shape[3] > 1:
        assert y.is_contiguous(memory_format=torch.channels_last), "a channels-last input keeps its storage"
    else:
        assert y.is_contiguous()


def check_conv_on_gpu(conv: nn.Conv2d, batch: int, samples: int, size: int, order: str, amp: bool,
                      takes_kernel: Callable[[torch.Tensor, torch.Tensor], bool]) -> None:
    """``takes_kernel(merged input, stacked weight)`` says whether the kernel under test runs this layer."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _check(conv, batch, samples, size, order, amp, takes_kernel)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _check(conv, batch, samples, size, order, amp, takes_kernel) -> None:
    torch.manual_seed(0)
    plain = [copy.deepcopy(conv).cuda() for _ in range(batch)]
    for model in plain:
        model.reset_parameters()
    batched = batch_layers.Conv2d.from_module(plain[0], batch).cuda()
    with torch.no_grad():
        for i, model in enumerate(plain):
            batched.weight[i].copy_(model.weight)
            batched.bias[i].copy_(model.bias)
    batched.merged_order = order
    layout = Layout(batch, order)
    x = torch.randn(batch, samples, conv.in_channels, size, size, device="cuda")
    merged = layout.merge(x).requires_grad_()
    assert takes_kernel(merged, batched.weight.flatten(0, 1)), "the shape should take the kernel under test"
    with forward_context(ForwardContext(batch, samples, order=order)), torch.autocast("cuda", enabled=amp):
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
