"""The Triton kernel for grouped convolutions with few channels per group (``batch_layers/_conv_triton.py``)
against B plain ``nn.Conv2d``: outputs, input and parameter gradients, in fp32 (TF32 off), under bf16
autocast and under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batch_layers
from batch_layers import ForwardContext, _kernel_table, forward_context
from batch_layers import functional as BF
from batch_layers._conv_triton import runs_on_triton
from batch_layers._depthwise_triton import runs_depthwise_grad
from batch_layers._triton_op import DECOMPOSED
from torchmb.testing import assert_equivalent

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning"),
    # dynamo instantiates autograd Functions while tracing them (torch 2.11)
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),  # Inductor's
]

BATCH, SAMPLES = 12, 3
MIN_GROUPS = _kernel_table.TRITON_GROUPED.limits["min_groups"]  # the tests below lower it (12 models take the kernel)
STEM_MIN_GROUPS = _kernel_table.TRITON_STEM.limits["min_groups"]


def test_many_models_take_the_kernel_and_few_do_not(monkeypatch) -> None:
    monkeypatch.setitem(_kernel_table.TRITON_GROUPED.limits, "min_groups", MIN_GROUPS)
    weight = torch.empty(256 * 16, 6, 5, 5, device="cuda")
    x = torch.empty(2, 256 * 6, 12, 12, device="cuda")
    assert runs_on_triton(x, weight, 256, False)
    assert not runs_on_triton(x[:, : 16 * 6], weight[: 16 * 16], 16, False)  # cuDNN is faster for 16 models
    assert not runs_on_triton(x.cpu(), weight.cpu(), 256, False)
    depthwise = torch.empty(256 * 6, 1, 3, 3, device="cuda")
    assert not runs_on_triton(x, depthwise, 256 * 6, False), "pure depthwise stays with ATen's kernels"

SHAPES = [  # in, out, kernel, stride, padding, dilation, groups, image size
    (6, 16, 5, 1, 0, 1, 1, 12),  # LeNet's second convolution
    (1, 6, 5, 1, 2, 1, 1, 13),  # LeNet's first convolution
    (2, 6, 5, 1, 2, 1, 1, 13),
    (3, 8, 3, 2, 1, 1, 1, 11),
    (4, 12, 3, 1, 2, 2, 1, 9),
    (8, 8, 3, 1, 1, 1, 2, 7),
    (5, 32, (1, 3), (2, 1), (0, 1), 1, 1, 10),
]


@pytest.fixture(autouse=True)
def _exact_fp32(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    # the kernels for these few models too (speed decides it)
    monkeypatch.setitem(_kernel_table.TRITON_GROUPED.limits, "min_groups", 8)
    monkeypatch.setitem(_kernel_table.TRITON_DEPTHWISE_GRAD.limits, "min_channels", 8)
    monkeypatch.setitem(_kernel_table.TRITON_STEM.limits, "min_groups", 8)
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def _models(shape, dtype=torch.float32):
    cin, cout, k, stride, padding, dilation, groups, _ = shape
    torch.manual_seed(0)
    plain = [nn.Conv2d(cin, cout, k, stride, padding, dilation, groups).to("cuda", dtype) for _ in range(BATCH)]
    batched = batch_layers.Conv2d.from_module(plain[0], BATCH)
    with torch.no_grad():
        for i, model in enumerate(plain):
            batched.weight[i].copy_(model.weight)
            batched.bias[i].copy_(model.bias)
    return plain, batched


def _weighted_sum(per_model: torch.Tensor) -> torch.Tensor:
    """Each model's output weighted by the same ramp, so every output element gets its own gradient."""
    ramp = torch.linspace(-1, 1, per_model[0].numel(), device="cuda").view_as(per_model[0])
    return (per_model.float() * ramp).sum()


def _check(plain, batched, x, order, atol, rtol, amp=False, run=None):
    batched.merged_order = order
    rows = x if order == "models" else x.transpose(0, 1)
    merged = rows.reshape(-1, *x.shape[2:]).clone().requires_grad_()
    with forward_context(ForwardContext(BATCH, SAMPLES, order=order)), torch.autocast("cuda", enabled=amp):
        y = (batched if run is None else run)(merged)
    per_model = y.view(BATCH, SAMPLES, *y.shape[1:]) if order == "models" else y.view(SAMPLES, BATCH, *y.shape[1:])
    per_model = per_model if order == "models" else per_model.transpose(0, 1)
    _weighted_sum(per_model).backward()
    grad_x = merged.grad.view(*rows.shape)
    grad_x = grad_x if order == "models" else grad_x.transpose(0, 1)
    for i, model in enumerate(plain):
        own = x[i].clone().requires_grad_()
        with torch.autocast("cuda", enabled=amp):
            expected = model(own)
        _weighted_sum(expected.unsqueeze(0)).backward()
        torch.testing.assert_close(per_model[i], expected, atol=atol, rtol=rtol)
        torch.testing.assert_close(grad_x[i], own.grad, atol=atol, rtol=rtol)
        torch.testing.assert_close(batched.weight.grad[i], model.weight.grad, atol=atol * 10, rtol=rtol)
        torch.testing.assert_close(batched.bias.grad[i], model.bias.grad, atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_plain_convolutions(shape, order: str) -> None:
    plain, batched = _models(shape)
    size = shape[-1]
    x = torch.randn(BATCH, SAMPLES, shape[0], size, size, device="cuda")
    weight = batched.weight.reshape(-1, *batched.weight.shape[2:])
    assert runs_on_triton(x[0], weight, BATCH * shape[6], False), "the shape should take the Triton kernel"
    _check(plain, batched, x, order, atol=1e-4, rtol=1e-4)


DEPTHWISE_SHAPES = [  # one input channel per group: the weight gradient's kernel
    (8, 8, 3, 2, 1, 1, 8, 9),
    (4, 4, 7, 1, 3, 1, 4, 8),  # ConvNeXt's 7x7
    (1, 6, 5, 1, 0, 1, 1, 12),  # LeNet's first convolution: a channel multiplier of 6
    (6, 12, 3, 1, 2, 2, 6, 9),
]


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("shape", DEPTHWISE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_depthwise_weight_gradient_kernel_matches_plain_convolutions(shape, order: str) -> None:
    plain, batched = _models(shape)
    size = shape[-1]
    x = torch.randn(BATCH, SAMPLES, shape[0], size, size, device="cuda")
    grouped = x[0].reshape(SAMPLES, shape[0], size, size).repeat(1, BATCH, 1, 1)
    weight = batched.weight.reshape(-1, *batched.weight.shape[2:])
    assert runs_depthwise_grad(grouped, weight, BATCH * shape[6]), "the shape should take the kernel"
    _check(plain, batched, x, order, atol=1e-4, rtol=1e-4)


STEM_SHAPES = [  # strided, at most three input channels per model: both directions on the kernels
    (3, 64, 7, 2, 3, 1, 1, 15),  # ResNet's 7x7 stem, an odd image
    (3, 24, 5, 2, 2, 1, 1, 12),  # 5x5, a block of output channels partly masked
    (2, 12, 3, (2, 3), 1, 2, 1, 11),  # dilated, uneven strides
]


def _recording_stem_kernels(monkeypatch) -> list[str]:
    """The Triton operators the batched convolutions call, by name, in order."""
    calls = []
    for name in ("grouped_conv2d", "grouped_weight_grad"):
        op = getattr(BF._conv, name)
        monkeypatch.setattr(BF._conv, name, lambda *args, name=name, op=op: calls.append(name) or op(*args))
    return calls


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("shape", STEM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_stem_forward_and_weight_gradient_kernels_match_plain_convolutions(monkeypatch, shape, order: str) -> None:
    """A stem's forward and weight gradient run on the kernels (cuDNN launches per model for both); the input
    and bias gradients are ATen's. Every one matches the B plain convolutions'."""
    monkeypatch.setitem(_kernel_table.TRITON_GROUPED.limits, "min_groups", MIN_GROUPS)  # its forward's kernel too
    calls = _recording_stem_kernels(monkeypatch)
    plain, batched = _models(shape)
    size = shape[-1]
    x = torch.randn(BATCH, SAMPLES, shape[0], size, size, device="cuda")
    call = _kernel_table.ConvCall.of(x[0].repeat(1, BATCH, 1, 1), batched.weight.flatten(0, 1), BATCH,
                                     stride=batched.stride)
    assert [_kernel_table.choose(op, call, _kernel_table.OPS).name for op in ("forward", "weight grad")] == [
        "triton-stem", "triton-stem"]
    _check(plain, batched, x, order, atol=1e-4, rtol=1e-4)
    assert calls == ["grouped_conv2d", "grouped_weight_grad"]


def test_stem_kernels_under_bf16_autocast_match_plain_autocast(monkeypatch) -> None:
    calls = _recording_stem_kernels(monkeypatch)
    plain, batched = _models(STEM_SHAPES[0])
    x = torch.randn(BATCH, SAMPLES, 3, 15, 15, device="cuda")
    _check(plain, batched, x, "samples", atol=5e-2, rtol=5e-2, amp=True)
    assert calls == ["grouped_conv2d", "grouped_weight_grad"]


def test_a_torchvision_resnet_of_16_models_runs_its_stem_on_the_kernels_and_trains_as_plain_copies(
        monkeypatch) -> None:
    """torchvision's ResNet-18 for as few models as the stem's kernels take at the GPU's limits (16; TF32 off): its
    7x7 stem runs on both kernels in each of two SGD steps, and outputs, gradients and the trained parameters match
    16 plain models. Its batch norms use their running statistics: in training mode, a norm over the 1x1 images of
    the last stage of two samples per model turns the order of a sum into differences of 10% in the stem's
    gradient, on cuDNN's kernels as on these."""
    from support.torchvision_ops import import_torchvision

    torchvision = import_torchvision()
    batch = STEM_MIN_GROUPS
    monkeypatch.setitem(_kernel_table.TRITON_STEM.limits, "min_groups", batch)
    calls = _recording_stem_kernels(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(batch, 2, 3, 32, 32, device="cuda")
    assert_equivalent(lambda: torchvision.models.resnet18(num_classes=10).cuda(), batch, x, steps=2, train=False,
                      atol=1e-4)
    assert calls == ["grouped_conv2d", "grouped_weight_grad"] * 2


def test_kernel_under_bf16_autocast_matches_plain_autocast() -> None:
    plain, batched = _models(SHAPES[0])
    x = torch.randn(BATCH, SAMPLES, 6, 12, 12, device="cuda")
    _check(plain, batched, x, "samples", atol=5e-2, rtol=5e-2, amp=True)


def test_kernel_traces_under_compile_without_graph_breaks() -> None:
    plain, batched = _models(SHAPES[0])
    x = torch.randn(BATCH, SAMPLES, 6, 12, 12, device="cuda")
    _check(plain, batched, x, "models", atol=1e-4, rtol=1e-4, run=torch.compile(batched, fullgraph=True))


@pytest.mark.parametrize(
    "shape, kernel",
    [(SHAPES[0], "conv2d_groups"), (DEPTHWISE_SHAPES[1], "depthwise_grad_weight")],
    ids=["grouped", "depthwise-weight-grad"],
)
def test_compiled_step_launches_the_kernels_from_inductors_code(shape, kernel: str) -> None:
    """Inductor sees into the kernels' operators (``batch_layers/_triton_op.py``): its generated code launches
    the Triton kernel itself, with no call back into the operator's Python body, and the step trains as the
    plain convolutions do. The input is channels-last, as in timm's ConvNeXt (a contiguous one takes cuDNN's
    NHWC depthwise kernels under torch.compile)."""
    if not DECOMPOSED:
        pytest.skip("this torch lacks wrap_triton or is_exporting: the kernels' operators stay opaque")
    from torch._inductor.utils import run_and_get_code

    plain, batched = _models(shape)
    size = shape[-1]
    x = torch.randn(BATCH, SAMPLES, shape[0], size, size, device="cuda")
    channels_last = torch.channels_last
    compiled = torch.compile(lambda merged: batched(merged.contiguous(memory_format=channels_last)), fullgraph=True)
    _, code = run_and_get_code(_check, plain, batched, x, "models", 1e-4, 1e-4, run=compiled)
    code = "\n".join(code)
    assert f"def {kernel}(" in code, f"the step should launch {kernel} from Inductor's code"
    assert "torchmb.grouped_conv2d" not in code and "torchmb.depthwise_weight_grad" not in code


def test_compiled_layer_takes_the_kernel_from_fewer_models_than_an_eager_one(monkeypatch) -> None:
    """Under torch.compile a launch costs no Python, so the kernel runs from ``min_groups_compiled`` groups;
    eager, the same layer stays on cuDNN. Both train as the plain convolutions do."""
    monkeypatch.setitem(_kernel_table.TRITON_GROUPED.limits, "min_groups", MIN_GROUPS)
    monkeypatch.setitem(_kernel_table.TRITON_GROUPED.limits, "min_groups_compiled", BATCH)
    plain, batched = _models(SHAPES[0])
    x = torch.randn(BATCH, SAMPLES, 6, 12, 12, device="cuda")
    weight = batched.weight.reshape(-1, *batched.weight.shape[2:])
    assert not runs_on_triton(x[0].repeat(1, BATCH, 1, 1), weight, BATCH, False)
    traced = []

    def recording_backend(graph_module, example_inputs):
        traced.extend(str(node.target) for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)
                      for node in module.graph.nodes)
        return graph_module.forward

    _check(plain, batched, x, "models", atol=1e-4, rtol=1e-4,
           run=torch.compile(batched, backend=recording_backend, fullgraph=True))
    assert traced.count("torchmb.grouped_conv2d.default") == 2, "the forward and the input gradient on the kernel"


def test_channels_last_input_gives_channels_last_output_through_the_kernel() -> None:
    plain, batched = _models(SHAPES[0])
    x = torch.randn(BATCH * SAMPLES, 6, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
    with forward_context(ForwardContext(BATCH, SAMPLES, order="models")):
        y = batched(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    for i, model in enumerate(plain):
        torch.testing.assert_close(y[i * SAMPLES : (i + 1) * SAMPLES], model(x[i * SAMPLES : (i + 1) * SAMPLES]))


def test_double_backward_through_the_layer_matches_plain() -> None:
    """A gradient penalty differentiates the backward: that path keeps cuDNN's differentiable input gradient."""
    plain, batched = _models(SHAPES[0])
    x = torch.randn(BATCH * SAMPLES, 6, 12, 12, device="cuda", requires_grad=True)
    with forward_context(ForwardContext(BATCH, SAMPLES, order="models")):
        (grad,) = torch.autograd.grad(batched(x).square().sum(), x, create_graph=True)
    grad.square().sum().backward()
    for i, model in enumerate(plain):
        own = x[i * SAMPLES : (i + 1) * SAMPLES].detach().requires_grad_()
        own_loss = F.conv2d(own, model.weight, model.bias).square().sum()
        (own_grad,) = torch.autograd.grad(own_loss, own, create_graph=True)
        own_grad.square().sum().backward()
        torch.testing.assert_close(grad[i * SAMPLES : (i + 1) * SAMPLES], own_grad, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(batched.weight.grad[i], model.weight.grad, atol=1e-2, rtol=1e-4)
