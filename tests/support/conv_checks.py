"""Batched convolutions against B plain ones, for the kernel-table tests of ``batch_layers``:
:func:`check_against_plain_conv2d` (a functional form in float64, outputs and first and second order
gradients), :func:`check_product_against_plain_conv2d` (the same for a product of the kernel table, on inputs
it makes), :func:`compiled_conv2d_against_plain` (the functional convolution compiled whole) and
:func:`check_conv_on_gpu` (a batched ``Conv2d`` on a GPU with TF32 off, optionally under bf16 autocast, after
asserting that the shape takes the kernel under test)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from support.functional_reference import assert_matches_plain
from torch import fx, nn

import batch_layers
from batch_layers import ForwardContext, Layout, forward_context
from batch_layers import functional as BF

__all__ = [
    "check_against_plain_conv2d",
    "check_conv_on_gpu",
    "check_product_against_plain_conv2d",
    "compiled_conv2d_against_plain",
]

Product = Callable[..., torch.Tensor]
"""A batched convolution of the kernel table, ``product(merged input, weight, bias, layout, stride, padding,
dilation, groups)``."""


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


def check_product_against_plain_conv2d(product: Product, geometry: tuple, order: str, channels_last: bool,
                                      bias: bool, stacked: bool, batch: int = 3, samples: int = 2) -> None:
    """:func:`check_against_plain_conv2d` of ``product`` on float64 inputs of ``geometry`` (input and output
    channels, kernel, stride, padding, dilation, groups per model, height, width; an int for a square size) in the
    merged ``order``: with the stacked ``(B*O, ...)`` weight and ``(B*O,)`` bias, or, not ``stacked``, B models'
    ``(B, O, ...)`` and ``(B, O)`` (a batched Conv2d hands its own)."""
    cin, cout, kernel, stride, padding, dilation, groups, height, width = geometry
    kernel, stride, padding, dilation = (v if isinstance(v, tuple) else (v, v)
                                         for v in (kernel, stride, padding, dilation))
    torch.manual_seed(0)
    layout = Layout(batch, order)
    x = torch.randn(batch, samples, cin, height, width, dtype=torch.float64)
    weight = torch.randn(batch, cout, cin // groups, *kernel, dtype=torch.float64, requires_grad=True)
    biases = torch.randn(batch, cout, dtype=torch.float64, requires_grad=True) if bias else None

    def run(merged, stacked_weight, stacked_bias):
        if not stacked:
            stacked_weight, stacked_bias = weight, biases
        return product(merged, stacked_weight, stacked_bias, layout, stride, padding, dilation, groups)

    check_against_plain_conv2d(run, x, weight, biases, layout, channels_last, stride, padding, dilation, groups)


def compiled_conv2d_against_plain(inputs: list[torch.Tensor], params: list[torch.Tensor], layout: Layout, *,
                                  atol: float, rtol: float, **conv: int) -> list[fx.Node]:
    """``batch_layers.functional.conv2d`` with the keywords ``conv`` (stride, padding, groups) compiled whole
    (``fullgraph``), by a backend that records its graph and then by Inductor, each against B plain ``F.conv2d``
    calls (:func:`~support.functional_reference.assert_matches_plain`), its result contiguous. Returns the
    recorded graph's nodes: what the kernel table chose."""
    traced = []

    def recording_backend(graph_module, example_inputs):
        traced.extend(graph_module.graph.nodes)
        return graph_module.forward

    for backend in (recording_backend, "inductor"):
        torch._dynamo.reset()
        batched = torch.compile(lambda x, w, b: BF.conv2d(x, w, b, layout=layout, **conv), backend=backend,
                                fullgraph=True)
        y = assert_matches_plain(batched, lambda x, w, b: F.conv2d(x, w, b, **conv), inputs, params, layout,
                                 atol=atol, rtol=rtol)
        assert y.is_contiguous()
    return traced


def check_conv_on_gpu(conv: nn.Conv2d, batch: int, samples: int, size: int, order: str, amp: bool,
                      takes_kernel: Callable[[torch.Tensor, torch.Tensor], bool],
                      amp_dtype: torch.dtype | None = None) -> None:
    """``takes_kernel(merged input, stacked weight)`` says whether the kernel under test runs this layer; ``amp``
    runs it under autocast, in ``amp_dtype`` (autocast's default where None)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _check(conv, batch, samples, size, order, amp, takes_kernel, amp_dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _check(conv, batch, samples, size, order, amp, takes_kernel, amp_dtype) -> None:
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
    autocast = torch.autocast("cuda", dtype=amp_dtype, enabled=amp)
    with forward_context(ForwardContext(batch, samples, order=order)), autocast:
        y = batched(merged)
    layout.split(y).float().square().sum().backward()
    tolerance = {"atol": 5e-2, "rtol": 5e-2} if amp else {"atol": 1e-4, "rtol": 1e-4}
    for b, model in enumerate(plain):
        own = x[b].clone().requires_grad_()
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp):
            expected = model(own)
        expected.float().square().sum().backward()
        torch.testing.assert_close(layout.split(y)[b], expected, **tolerance)
        torch.testing.assert_close(layout.split(merged.grad)[b], own.grad, **tolerance)
        torch.testing.assert_close(batched.weight.grad[b], model.weight.grad, **tolerance)
        torch.testing.assert_close(batched.bias.grad[b], model.bias.grad, **tolerance)
