"""Depthwise convolutions on the merged layout (``batch_layers/_conv_depthwise.py``) against B independently held
plain ``nn.Conv2d(C, C, k, groups=C)`` on channels-last input: the output and the input, weight and bias gradients
(both merged orders, strides 1 and 2, dilation, odd sizes, a 7x7 filter on 1x1 and 2x2 images, fp32, bf16 and
fp16), second-order gradients, the operators' registration, and the kernel table's choice.

The kernels run on a GPU (tests marked ``cuda``) and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1 PYTHONPATH=<triton>:. pytest tests/batch_layers/test_conv_depthwise.py``); without Triton
only the table's tests run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from support.conv_checks import check_against_plain_conv2d
from support.torchvision_ops import import_torchvision
from torch import nn

import batch_layers
import torchmb_config
from batch_layers import ForwardContext, Layout, _conv_depthwise, _kernel_table, forward_context
from batch_layers._conv_depthwise import depthwise_conv2d, runs_depthwise_merged
from batch_layers._kernel_table import ConvCall, explain

BATCH, SAMPLES = 3, 2
GEOMETRIES = [  # channels, height, width, kernel, stride, padding, dilation
    (5, 5, 4, 3, 1, 1, 1),
    (4, 7, 6, 3, 2, 1, 1),  # MobileNet's 3x3 with stride 2, odd sizes
    (3, 6, 5, 5, 2, 2, 1),  # EfficientNet's 5x5 with stride 2
    (6, 8, 8, 7, 1, 3, 1),  # ConvNeXt's 7x7
    (5, 2, 2, 7, 1, 3, 1),  # ConvNeXt's last stages on 32x32 images: 2x2 and 1x1
    (17, 1, 1, 7, 1, 3, 1),
    (4, 6, 5, 3, 1, 2, 2),  # dilated
    (3, 1, 1, 1, 3, 2, 1),  # no tap joins any pixel: the output is the bias
]
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.cuda), "interpreter"])
def device(request) -> str:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if request.param == "interpreter":
        if not _INTERPRETED:
            pytest.skip("the kernels run on the CPU under Triton's interpreter only (TRITON_INTERPRET=1)")
        return "cpu"
    if _INTERPRETED:
        pytest.skip("Triton's interpreter runs CPU tensors only")
    return "cuda"


def _plain_models(channels: int, kernel: int, stride: int, padding: int, dilation: int, bias: bool, device: str,
                  dtype: torch.dtype) -> tuple[list[nn.Conv2d], torch.Tensor, torch.Tensor | None]:
    """B plain depthwise convolutions (their weights rounded to ``dtype``) and their stacked weights and biases."""
    plain = [nn.Conv2d(channels, channels, kernel, stride, padding, dilation, groups=channels, bias=bias)
             for _ in range(BATCH)]
    with torch.no_grad():
        for model in plain:
            for parameter in model.parameters():
                parameter.copy_(parameter.to(dtype))
    plain = [model.to(device) for model in plain]
    weight = torch.stack([model.weight.detach() for model in plain]).to(dtype).requires_grad_()
    biases = torch.stack([model.bias.detach() for model in plain]).to(dtype).requires_grad_() if bias else None
    return plain, weight, biases


# every geometry in both orders in fp32, with and without a bias in turn; bf16 for strides, 7x7 and 1x1 images
CASES = [(geometry, order, i % 2 == 0, torch.float32) for i, geometry in enumerate(GEOMETRIES)
         for order in ("models", "samples")]
CASES += [(GEOMETRIES[i], order, True, torch.bfloat16) for i in (1, 3, 5) for order in ("models", "samples")]
CASES += [(GEOMETRIES[3], order, False, torch.float16) for order in ("models", "samples")]


@pytest.mark.parametrize(("geometry", "order", "bias", "dtype"), CASES,
                         ids=["x".join(map(str, g)) + f"-{o}-{'bias' if b else 'no-bias'}-{str(d)[6:]}"
                              for g, o, b, d in CASES])
def test_the_kernels_are_b_plain_depthwise_convolutions(device: str, geometry, order: str, bias: bool,
                                                       dtype: torch.dtype) -> None:
    _check_against_plain_models(depthwise_conv2d, "_DepthwiseConvBackward", device, geometry, order, bias, dtype)


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", [GEOMETRIES[1], GEOMETRIES[4]], ids=lambda g: "x".join(map(str, g)))
def test_the_operators_compile_traces_are_b_plain_depthwise_convolutions(device: str, geometry, order: str) -> None:
    def operator(x, weight, bias, layout, stride, padding, dilation):
        return _conv_depthwise._conv_op(x, weight, bias, layout.batch, layout.order, list(stride), list(padding),
                                        list(dilation))

    _check_against_plain_models(operator, "torchmb_depthwise_conv2d", device, geometry, order, True, torch.float32)


def _check_against_plain_models(run, backward_name: str, device: str, geometry, order: str, bias: bool,
                                dtype: torch.dtype) -> None:
    """``run(merged input, stacked weight, stacked bias, layout, stride, padding, dilation)`` against B plain
    models: outputs, input, weight and bias gradients and their layouts; ``backward_name`` says what ran."""
    channels, height, width, kernel, stride, padding, dilation = geometry
    torch.manual_seed(0)
    plain, weight, biases = _plain_models(channels, kernel, stride, padding, dilation, bias, device, dtype)
    layout = Layout(BATCH, order)
    x = torch.randn(BATCH, SAMPLES, channels, height, width, device=device).to(dtype)
    merged = layout.merge(x).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = run(merged, weight.flatten(0, 1), None if biases is None else biases.flatten(), layout, (stride, stride),
            (padding, padding), (dilation, dilation))
    assert backward_name in type(y.grad_fn).__name__, "the kernels ran"
    grad = torch.randn(y.shape, device=device).to(dtype).contiguous(memory_format=torch.channels_last)
    y.backward(grad)
    assert y.dtype == dtype and merged.grad.dtype == dtype and weight.grad.dtype == dtype
    if height * width > 1:  # (a 1x1 image's layout is both)
        assert y.is_contiguous(memory_format=torch.channels_last), "a channels-last input gives channels-last"
        assert merged.grad.is_contiguous(memory_format=torch.channels_last)
    # fp32 sums: the plain fp32 models on the same bf16 (fp16) values differ by the results' rounding only
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for b, model in enumerate(plain):
        own = x[b].float().contiguous(memory_format=torch.channels_last).requires_grad_()
        expected = model(own)
        expected.backward(layout.split(grad)[b].float())
        torch.testing.assert_close(layout.split(y)[b].float(), expected, **tolerance)
        torch.testing.assert_close(layout.split(merged.grad)[b].float(), own.grad, **tolerance)
        torch.testing.assert_close(weight.grad[b].float(), model.weight.grad, **tolerance)
        if bias:
            torch.testing.assert_close(biases.grad[b].float(), model.bias.grad, **tolerance)


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", [GEOMETRIES[1], GEOMETRIES[4]], ids=lambda g: "x".join(map(str, g)))
def test_second_order_gradients_match_plain(device: str, geometry, order: str) -> None:
    """A gradient penalty differentiates the backward: it takes ATen's differentiable formulas (float64)."""
    channels, height, width, kernel, stride, padding, dilation = geometry
    torch.manual_seed(0)
    layout = Layout(BATCH, order)
    options = {"device": device, "dtype": torch.float64}
    x = torch.randn(BATCH, SAMPLES, channels, height, width, **options)
    weight = torch.randn(BATCH, channels, 1, kernel, kernel, **options, requires_grad=True)
    biases = torch.randn(BATCH, channels, **options, requires_grad=True)

    def run(merged, stacked_weight, stacked_bias):
        return depthwise_conv2d(merged, stacked_weight, stacked_bias, layout, (stride,) * 2, (padding,) * 2,
                                (dilation,) * 2)

    check_against_plain_conv2d(run, x, weight, biases, layout, True, stride, padding, dilation, channels)


@pytest.mark.parametrize("gradient_layout", ["contiguous", "expanded"])
def test_a_gradient_in_another_layout_is_read_through_its_strides(device: str, gradient_layout: str) -> None:
    torch.manual_seed(0)
    plain, weight, biases = _plain_models(6, 7, 1, 3, 1, True, device, torch.float32)
    layout = Layout(BATCH, "samples")
    x = torch.randn(BATCH, SAMPLES, 6, 4, 3, device=device)
    merged = layout.merge(x).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = depthwise_conv2d(merged, weight.flatten(0, 1), biases.flatten(), layout, (1, 1), (3, 3), (1, 1))
    if gradient_layout == "contiguous":
        grad = torch.randn(y.shape, device=device)
    else:  # what the backward of a sum over pixels hands on: one value per (row, channel), stride 0 elsewhere
        grad = torch.randn(y.shape[0], y.shape[1], 1, 1, device=device).expand(y.shape)
    y.backward(grad)
    for b, model in enumerate(plain):
        own = x[b].clone().requires_grad_()
        model(own).backward(layout.split(grad)[b])
        torch.testing.assert_close(layout.split(merged.grad)[b], own.grad)
        torch.testing.assert_close(weight.grad[b], model.weight.grad)
        torch.testing.assert_close(biases.grad[b], model.bias.grad)


def test_the_operators_are_registered_for_autograd_and_tracing(device: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(BATCH * SAMPLES, 4, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(BATCH * 4, 1, 3, 3, device=device)
    bias = torch.randn(BATCH * 4, device=device)
    config = (BATCH, "samples", [2, 2], [1, 1], [1, 1])
    torch.library.opcheck(_conv_depthwise._conv_op, (x.requires_grad_(), weight.requires_grad_(), bias, *config))
    grad = torch.randn(BATCH * SAMPLES, 4, 3, 3, device=device).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(_conv_depthwise._input_grad_op, (grad, weight.detach(), list(x.shape), True, *config))
    torch.library.opcheck(_conv_depthwise._weight_grad_op, (grad, x.detach(), weight.detach(), True, *config))


def test_mismatched_weights_are_refused(device: str) -> None:
    x = torch.randn(BATCH * SAMPLES, 4, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(BATCH * 4, 1, 3, 3, device=device, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"expected the weight on the input's device and dtype .*float64"):
        depthwise_conv2d(x, weight, None, Layout(BATCH), (1, 1), (1, 1), (1, 1))


def _call(cuda: bool = True, channels_last: bool = True, channels: int = 40, multiplier: int = 1, kernel: int = 7,
          size: int = 8, dtype: torch.dtype = torch.float32, batch: int = 64) -> ConvCall:
    """B models' depthwise convolution as the kernel table sees it (ConvNeXt-atto's first stage by default)."""
    return ConvCall(cuda, 4, dtype, batch * channels, (batch * channels * multiplier, 1, kernel, kernel),
                    batch * channels, False, (1, 1), (1, 1), (size, size), (kernel // 2,) * 2, channels_last)


def test_the_table_takes_channels_last_depthwise_convolutions_on_triton(monkeypatch) -> None:
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    text = explain(_call())
    for op in ("forward", "input grad", "weight grad"):
        assert f"{op}: triton-depthwise-merged (" in text
    assert "layout of a channels-last input: merged, where it lies (" in text
    for call in (_call(dtype=torch.bfloat16), _call(size=1), _call(kernel=3), _call(batch=2, channels=320)):
        assert _kernel_table.choose("forward", call).name == "triton-depthwise-merged", call


@pytest.mark.parametrize(("call", "unmet"), [
    (_call(cuda=False), "a CUDA tensor"),
    (_call(channels_last=False), "a merged input lying channels-last"),
    (_call(multiplier=2), "depthwise: one input and one output channel per group"),
    (_call(kernel=9), "at most 64 filter taps"),
    (_call(size=128), "the image's size known and at most 4096 pixels"),
    (_call(dtype=torch.float64), "float32, float16 or bfloat16"),
], ids=["cpu", "nchw", "multiplier", "9x9", "large-image", "fp64"])
def test_the_table_keeps_the_grouped_path_elsewhere_and_says_why(monkeypatch, call: ConvCall, unmet: str) -> None:
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    text = explain(call)
    assert "forward: triton-depthwise-merged" not in text
    why_not = [line for line in text.splitlines() if line.startswith("    not triton-depthwise-merged: needs ")]
    assert len(why_not) == 3 and all(unmet in line for line in why_not), text  # forward and both gradients
    assert _kernel_table.choose("layout of a channels-last input", call).name != "merged, where it lies"


def test_without_triton_or_with_the_switch_off_the_grouped_path_runs(monkeypatch) -> None:
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", False)
    assert "weight grad: aten" in explain(_call())
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    with torchmb_config.use("triton", False):
        text = explain(_call())
    assert "forward: aten" in text and "needs Triton installed and the 'triton' switch on" in text
    # a contiguous input of many channels: the grouped path's weight-gradient kernel, as before
    assert explain(_call(channels_last=False, channels=320)).count("weight grad: triton-depthwise (") == 1


def test_cpu_tensors_keep_the_grouped_path() -> None:
    x = torch.empty(BATCH * SAMPLES, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    call = ConvCall.of_merged(x, torch.empty(BATCH * 4, 1, 3, 3), BATCH, BATCH * 4, (1, 1), (1, 1), (1, 1))
    assert not runs_depthwise_merged(call)


def _count_launches(monkeypatch) -> list[bool]:
    """The tap kernel's launches from now on (``input_grad`` of each: False forward, True input gradient)."""
    launches, launch = [], _conv_depthwise._taps

    def counted(*args, **kwargs):
        launches.append(kwargs["input_grad"])
        launch(*args, **kwargs)

    monkeypatch.setattr(_conv_depthwise, "_taps", counted)
    return launches


def _batched_layer(channels: int, kernel: int, stride: int):
    torch.manual_seed(0)
    plain = [nn.Conv2d(channels, channels, kernel, stride, kernel // 2, groups=channels).cuda() for _ in range(BATCH)]
    batched = batch_layers.Conv2d.from_module(plain[0], BATCH).cuda()
    with torch.no_grad():
        for i, model in enumerate(plain):
            batched.weight[i].copy_(model.weight)
            batched.bias[i].copy_(model.bias)
    return plain, batched


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("order", ["models", "samples"])
def test_the_layer_takes_the_kernels_on_a_gpu_and_matches_plain(monkeypatch, order: str, amp: bool,
                                                                 compiled: bool) -> None:
    pytest.importorskip("triton")
    launches = _count_launches(monkeypatch)
    plain, batched = _batched_layer(16, 7, 1)
    batched.merged_order = order
    layout = Layout(BATCH, order)
    x = torch.randn(BATCH, SAMPLES, 16, 5, 5, device="cuda")
    merged = layout.merge(x).contiguous(memory_format=torch.channels_last).requires_grad_()
    assert runs_depthwise_merged(
        ConvCall.of_merged(merged, batched.weight.flatten(0, 1), BATCH, BATCH * 16, (1, 1), (3, 3), (1, 1)))
    layer = torch.compile(batched, fullgraph=True) if compiled else batched
    with forward_context(ForwardContext(BATCH, SAMPLES, order=order)), torch.autocast("cuda", enabled=amp):
        y = layer(merged)
    layout.split(y).float().square().sum().backward()
    assert launches == [False, True], "the forward and input gradient kernels ran"
    assert y.is_contiguous(memory_format=torch.channels_last)
    tolerance = {"atol": 5e-2, "rtol": 5e-2} if amp else {"atol": 1e-4, "rtol": 1e-4}
    for b, model in enumerate(plain):
        own = x[b].contiguous(memory_format=torch.channels_last).requires_grad_()
        with torch.autocast("cuda", enabled=amp):
            expected = model(own)
        expected.float().square().sum().backward()
        torch.testing.assert_close(layout.split(y)[b].float(), expected.float(), **tolerance)
        torch.testing.assert_close(layout.split(merged.grad)[b], own.grad, **tolerance)
        torch.testing.assert_close(batched.weight.grad[b], model.weight.grad, **tolerance)
        torch.testing.assert_close(batched.bias.grad[b], model.bias.grad, **tolerance)


@pytest.mark.cuda
def test_timm_convnext_blocks_take_the_kernels_and_train_as_plain_models(monkeypatch) -> None:
    """timm's block permutes to channels-last around its norm and MLP: the second block's depthwise convolution
    reads that layout where it lies."""
    pytest.importorskip("triton")
    import_torchvision()  # timm imports it (see tests/support/torchvision_ops.py)
    from timm.models.convnext import ConvNeXtBlock

    from torchmb.testing import assert_equivalent

    launches = _count_launches(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(BATCH, SAMPLES, 16, 6, 6, device="cuda")
    assert_equivalent(lambda: nn.Sequential(ConvNeXtBlock(16), ConvNeXtBlock(16)).cuda(), BATCH, x, steps=2)
    assert launches.count(False) >= 2, "the kernels ran the channels-last convolution forward each step"
