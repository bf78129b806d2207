"""The implicit-GEMM kernels on the merged layout (``batch_layers/_conv_merged.py``) against B plain
``nn.Conv2d``: outputs, input and parameter gradients, in both merged orders, contiguous and channels-last,
strided, dilated, grouped, on 1x1 and 2x2 images, under bf16 autocast, ``torch.compile`` and a double
backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batch_layers
from batch_layers import ForwardContext, _kernel_table, forward_context
from batch_layers._conv_merged import runs_merged

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

BATCH, SAMPLES = 5, 3
SHAPES = [  # in, out, kernel, stride, padding, dilation, groups, image height, width
    (16, 16, 3, 1, 1, 1, 1, 8, 8),  # a ResNet basic block's convolution
    (16, 32, 3, 2, 1, 1, 1, 8, 8),  # its strided first convolution
    (16, 32, 1, 2, 0, 1, 1, 8, 8),  # and its 1x1 downsampling
    (32, 32, 3, 1, 1, 1, 1, 1, 1),  # the last stage on 32x32 images: 1x1 and 2x2
    (32, 48, 3, 2, 1, 1, 1, 2, 2),
    (24, 40, 3, 1, 2, 2, 1, 7, 9),  # dilated, odd sizes and channel counts
    (32, 32, 3, 1, 1, 1, 2, 6, 6),  # two groups per model (ResNeXt, RegNet)
    (16, 16, (1, 5), (3, 1), (0, 2), 1, 1, 10, 7),
    (17, 20, 4, 3, 2, 1, 1, 11, 11),  # a stride that leaves input pixels no tap reaches
]


@pytest.fixture(autouse=True)
def _exact_fp32():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def _models(shape):
    cin, cout, k, stride, padding, dilation, groups, _, _ = shape
    torch.manual_seed(0)
    plain = [nn.Conv2d(cin, cout, k, stride, padding, dilation, groups).cuda() for _ in range(BATCH)]
    batched = batch_layers.Conv2d.from_module(plain[0], BATCH)
    with torch.no_grad():
        for i, model in enumerate(plain):
            batched.weight[i].copy_(model.weight)
            batched.bias[i].copy_(model.bias)
    return plain, batched


def _inputs(shape) -> torch.Tensor:
    return torch.randn(BATCH, SAMPLES, shape[0], shape[7], shape[8], device="cuda")


def _check(plain, batched, x, order, atol=1e-4, rtol=1e-4, amp=False, run=None, channels_last=False):
    batched.merged_order = order
    rows = x if order == "models" else x.transpose(0, 1)
    merged = rows.reshape(-1, *x.shape[2:]).clone()
    if channels_last:
        merged = merged.contiguous(memory_format=torch.channels_last)
    merged.requires_grad_()
    with forward_context(ForwardContext(BATCH, SAMPLES, order=order)), torch.autocast("cuda", enabled=amp):
        y = (batched if run is None else run)(merged)
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    per_model = y.view(BATCH, SAMPLES, *y.shape[1:]) if order == "models" else y.view(SAMPLES, BATCH, *y.shape[1:])
    per_model = per_model if order == "models" else per_model.transpose(0, 1)
    ramp = torch.linspace(-1, 1, per_model[0].numel(), device="cuda").view_as(per_model[0])
    (per_model.float() * ramp).sum().backward()
    grad_x = merged.grad.view(*rows.shape)
    grad_x = grad_x if order == "models" else grad_x.transpose(0, 1)
    for i, model in enumerate(plain):
        own = x[i].clone().requires_grad_()
        with torch.autocast("cuda", enabled=amp):
            expected = model(own)
        (expected.float() * ramp).sum().backward()
        torch.testing.assert_close(per_model[i], expected, atol=atol, rtol=rtol)
        torch.testing.assert_close(grad_x[i], own.grad, atol=atol, rtol=rtol)
        torch.testing.assert_close(batched.weight.grad[i], model.weight.grad, atol=atol * 10, rtol=rtol)
        torch.testing.assert_close(batched.bias.grad[i], model.bias.grad, atol=atol * 10, rtol=rtol)


def test_many_channels_per_model_take_the_kernels_and_few_do_not() -> None:
    x = torch.empty(BATCH * 2, 64, 8, 8, device="cuda")
    assert runs_merged(x, torch.empty(BATCH * 64, 64, 3, 3, device="cuda"), BATCH, 1)
    few = _kernel_table.TRITON_MERGED.limits["min_channels"] - 1
    assert not runs_merged(x[:, :few], torch.empty(BATCH * 64, few, 3, 3, device="cuda"), BATCH, 1)
    assert not runs_merged(x.cpu(), torch.empty(BATCH * 64, 64, 3, 3), BATCH, 1)
    assert not runs_merged(x, torch.empty(BATCH * 64, 1, 3, 3, device="cuda"), BATCH, 64), "depthwise"


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_match_plain_convolutions(shape, order: str, channels_last: bool) -> None:
    plain, batched = _models(shape)
    weight = batched.weight.reshape(-1, *batched.weight.shape[2:])
    assert runs_merged(_inputs(shape)[0], weight, BATCH, shape[6]), "the shape should take the kernels"
    _check(plain, batched, _inputs(shape), order, channels_last=channels_last)


def test_a_long_sum_over_positions_is_split_and_still_matches() -> None:
    """Few models and channels but many pixels: the weight gradient's sum runs in several programs."""
    shape = (16, 16, 3, 1, 1, 1, 1, 64, 64)
    plain, batched = _models(shape)
    _check(plain, batched, _inputs(shape), "samples", atol=1e-3)


def test_kernels_under_bf16_autocast_match_plain_autocast() -> None:
    plain, batched = _models(SHAPES[1])
    _check(plain, batched, _inputs(SHAPES[1]), "samples", atol=5e-2, rtol=5e-2, amp=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_kernels_trace_under_compile_without_graph_breaks(backend: str) -> None:
    plain, batched = _models(SHAPES[0])
    torch._dynamo.reset()
    run = torch.compile(batched, backend=backend, fullgraph=True)
    _check(plain, batched, _inputs(SHAPES[0]), "models", run=run)


def test_double_backward_through_the_layer_matches_plain() -> None:
    """A gradient penalty differentiates the backward: that path runs ATen's differentiable one."""
    plain, batched = _models(SHAPES[1])
    x = _inputs(SHAPES[1]).reshape(BATCH * SAMPLES, *SHAPES[1][:1], 8, 8).requires_grad_()
    with forward_context(ForwardContext(BATCH, SAMPLES, order="models")):
        (grad,) = torch.autograd.grad(batched(x).square().sum(), x, create_graph=True)
    grad.square().sum().backward()
    for i, model in enumerate(plain):
        own = x[i * SAMPLES : (i + 1) * SAMPLES].detach().requires_grad_()
        (own_grad,) = torch.autograd.grad(model(own).square().sum(), own, create_graph=True)
        own_grad.square().sum().backward()
        torch.testing.assert_close(grad[i * SAMPLES : (i + 1) * SAMPLES], own_grad, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(batched.weight.grad[i], model.weight.grad, atol=1e-2, rtol=1e-4)
