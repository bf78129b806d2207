"""The batched convolution's GEMM path (im2col + one batched GEMM) against the grouped one and B plain
layers, the switch that forces either, and the rule that picks one when nothing is forced."""

from __future__ import annotations

import copy

import pytest
import torch
from support.graph import node_names
from support.layer_cases import LAYER_CASES, LayerCase, run_case
from support.models import LeNet
from torch import nn

import batch_layers
from batch_layers import _conv_gemm
from batch_layers._conv_gemm import gemm_conv
from torchmb import BatchModule

ALGORITHMS = ["gemm", "grouped"]
ORDERS = ["models", "samples"]
CONV_CASES = [case for case in LAYER_CASES if case.name.startswith("conv") and "transpose" not in case.name]
# Variants the shared table lacks: strides, dilations and groups together, uneven padding, 1-d and 3-d.
CONV_CASES += [
    LayerCase("conv2d-stride-dilation-groups", lambda: nn.Conv2d(4, 6, (3, 2), (2, 1), (1, 2), (2, 1), 2), (4, 9, 8)),
    LayerCase(
        "conv2d-depthwise-circular", lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4, padding_mode="circular"), (4, 5, 5)
    ),
    LayerCase("conv1d-same-groups", lambda: nn.Conv1d(4, 2, 5, padding="same", groups=2, bias=False), (4, 9)),
    LayerCase("conv3d-padding-dilation-groups", lambda: nn.Conv3d(4, 2, 2, 1, (1, 0, 2), (1, 2, 1), 2), (4, 3, 5, 4)),
    LayerCase("conv3d-stride-reflect", lambda: nn.Conv3d(2, 3, 3, 2, 1, padding_mode="reflect"), (2, 5, 4, 6)),
]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda case: case.name)
def test_both_algorithms_match_plain_layers(case: LayerCase, algorithm: str, order: str) -> None:
    with batch_layers.use_conv_algorithm(algorithm):
        run_case(case, "train", "cpu", order=order)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")  # torch's own
@pytest.mark.parametrize("order", ORDERS)
def test_gemm_takes_uneven_same_padding(order: str) -> None:
    case = LayerCase("conv2d-same-even-kernel", lambda: nn.Conv2d(3, 4, (4, 3), padding="same"), (3, 7, 6))
    with batch_layers.use_conv_algorithm("gemm"):
        run_case(case, "train", "cpu", order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_in_place_relu_on_the_output(algorithm: str, order: str) -> None:
    case = LayerCase("conv2d", lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 6, 6))
    with batch_layers.use_conv_algorithm(algorithm):
        run_case(case, "train", "cpu", order=order, then=lambda outputs: [y.relu_() for y in outputs])


GRADCHECK_CONFIGS = {  # kernel_size, stride, dilation, pads (as F.pad takes them), groups, input spatial size
    "1d": ((3,), (2,), (1,), (1, 2), 1, (7,)),
    "2d": ((3, 2), (1, 2), (2, 1), (0, 1, 2, 0), 2, (6, 5)),
    "3d": ((2, 1, 2), (1, 1, 2), (1, 1, 1), (1, 0, 0, 0, 0, 1), 2, (3, 2, 4)),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dims", GRADCHECK_CONFIGS)
def test_fp64_gradients_and_double_backward_match_finite_differences(dims: str, order: str) -> None:
    kernel_size, stride, dilation, pads, groups, spatial = GRADCHECK_CONFIGS[dims]
    batch, n, in_channels, out_channels = 2, 2, 4, 2
    torch.manual_seed(0)
    x = torch.randn(batch * n, in_channels, *spatial, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(batch * out_channels, in_channels // groups, *kernel_size, dtype=torch.float64)
    bias = torch.randn(batch * out_channels, dtype=torch.float64, requires_grad=True)
    weight.requires_grad_()

    def fn(x, weight, bias):
        return gemm_conv(x, weight, bias, batch, groups, kernel_size, stride, dilation, pads, order)

    assert torch.autograd.gradcheck(fn, (x, weight, bias))
    assert torch.autograd.gradgradcheck(fn, (x, weight, bias))


@pytest.mark.parametrize("order", ORDERS)
def test_fp64_outputs_and_gradients_equal_the_grouped_path(order: str) -> None:
    torch.manual_seed(0)
    conv = batch_layers.Conv2d(6, 4, 3, stride=2, padding=1, dilation=2, groups=2, batch=3, dtype=torch.float64)
    conv.merged_order = order
    x = torch.randn(3 * 4, 6, 9, 9, dtype=torch.float64)
    results = []
    for algorithm in ALGORITHMS:
        conv.zero_grad()
        inputs = x.clone().requires_grad_()
        with batch_layers.use_conv_algorithm(algorithm):
            y = conv(inputs)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape))
        results.append([y, inputs.grad, conv.weight.grad, conv.bias.grad])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_forced_algorithm_runs(algorithm: str) -> None:
    conv = batch_layers.Conv2d(3, 4, 3, batch=2)
    with batch_layers.use_conv_algorithm(algorithm):
        names = node_names(conv(torch.randn(2 * 3, 3, 6, 6)))
    assert ("_GemmConvBackward" in names) == (algorithm == "gemm")
    assert ("_GroupedConvBackward" in names) == (algorithm == "grouped")


def test_backward_keeps_the_input_and_weight_not_the_im2col_matrix() -> None:
    conv = batch_layers.Conv2d(3, 4, 3, padding=1, batch=2)
    x = torch.randn(2 * 5, 3, 6, 6, requires_grad=True)
    with batch_layers.use_conv_algorithm("gemm"):
        y = conv(x)
    node = y.grad_fn
    while type(node).__name__ != "_GemmConvBackward":
        (node, _), *_ = node.next_functions
    saved_input, saved_weight = node.saved_tensors
    assert saved_input.data_ptr() == x.data_ptr()
    assert saved_weight.data_ptr() == conv.weight.data_ptr()


def test_cpu_bf16_autocast_matches_torch_conv() -> None:
    torch.manual_seed(0)
    plain = [nn.Conv2d(3, 4, 3) for _ in range(2)]
    batched = batch_layers.Conv2d.from_module(plain[0], 2)
    with torch.no_grad():
        batched.weight.copy_(torch.stack([p.weight for p in plain]))
        batched.bias.copy_(torch.stack([p.bias for p in plain]))
    x = torch.randn(2, 3, 3, 8, 8)
    with batch_layers.use_conv_algorithm("gemm"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = batched(x.reshape(6, 3, 8, 8))
        expected = [p(x[i]) for i, p in enumerate(plain)]
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    for i, (p, e) in enumerate(zip(plain, expected)):
        e.float().sum().backward()
        torch.testing.assert_close(y.view(2, 3, 4, 6, 6)[i], e, atol=5e-2, rtol=0)
        torch.testing.assert_close(batched.weight.grad[i], p.weight.grad, atol=1, rtol=2e-2)
    assert batched.weight.grad.dtype == torch.float32


LENET_CONV1 = {"in_per_group": 1, "out_per_group": 6, "kernel_size": (5, 5), "output_positions": 128 * 24 * 24}
LENET_CONV2 = {"in_per_group": 6, "out_per_group": 16, "kernel_size": (5, 5), "output_positions": 128 * 8 * 8}
RESNET_CONV = {"in_per_group": 64, "out_per_group": 64, "kernel_size": (3, 3), "output_positions": 128 * 32 * 32}


@pytest.mark.parametrize("shape", [LENET_CONV1, LENET_CONV2], ids=["lenet-conv1", "lenet-conv2"])
@pytest.mark.parametrize("batch", [16, 64, 256])
def test_rule_takes_gemm_for_lenet_on_cuda_only(shape: dict, batch: int) -> None:
    rule = {"groups": batch, "dtype": torch.float32, **shape}
    assert batch_layers.prefers_gemm(device_type="cuda", **rule)
    assert not batch_layers.prefers_gemm(device_type="cpu", **rule)
    assert not batch_layers.prefers_gemm(device_type="mps", **rule)  # no rule: the grouped convolution


def test_rule_keeps_the_grouped_convolution_for_wide_layers_few_models_depthwise_and_other_dtypes() -> None:
    lenet = {"dtype": torch.float32, "device_type": "cuda", **LENET_CONV2}
    assert not batch_layers.prefers_gemm(groups=16, dtype=torch.float32, device_type="cuda", **RESNET_CONV)
    assert not batch_layers.prefers_gemm(groups=2, **lenet)
    depthwise = {**lenet, "in_per_group": 1, "out_per_group": 1, "kernel_size": (3, 3)}
    assert not batch_layers.prefers_gemm(groups=64 * 96, **depthwise)
    assert not batch_layers.prefers_gemm(groups=64, **{**lenet, "dtype": torch.complex64})
    assert not batch_layers.prefers_gemm(groups=2**20, **lenet), "an im2col matrix past 32-bit indexing"


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_layer_asks_the_rule_when_nothing_is_forced(monkeypatch, channels_last: bool) -> None:
    conv = batch_layers.Conv2d(3, 6, 5, batch=8)
    x = torch.randn(8 * 2, 3, 12, 12)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    assert batch_layers.get_conv_algorithm() is None
    assert "_GroupedConvBackward" in node_names(conv(x)), "CPU keeps the grouped convolution"
    monkeypatch.setitem(batch_layers.GEMM_RULES, "cpu", batch_layers.GemmRule(enabled=True))
    expected = "_GroupedConvBackward" if channels_last else "_GemmConvBackward"
    assert expected in node_names(conv(x))


def test_switch_restores_and_refuses_unknown_names(monkeypatch) -> None:
    assert batch_layers.get_conv_algorithm() is None
    with batch_layers.use_conv_algorithm("GEMM") as inside:
        assert inside == batch_layers.get_conv_algorithm() == "gemm"
        with batch_layers.use_conv_algorithm(None):
            assert batch_layers.get_conv_algorithm() is None
        assert batch_layers.get_conv_algorithm() == "gemm"
    assert batch_layers.get_conv_algorithm() is None
    with pytest.raises(ValueError, match="conv algorithm must be one of"):
        batch_layers.set_conv_algorithm("im2col")
    monkeypatch.setenv("TORCHMB_CONV_ALGORITHM", "grouped")
    assert _conv_gemm._from_env() == "grouped"
    monkeypatch.setenv("TORCHMB_CONV_ALGORITHM", "auto")
    assert _conv_gemm._from_env() is None
    monkeypatch.setenv("TORCHMB_CONV_ALGORITHM", "fast")
    with pytest.raises(ValueError, match="TORCHMB_CONV_ALGORITHM='fast'"):
        _conv_gemm._from_env()


# dynamo instantiates the custom autograd Functions it traces and reads .grad of non-leaf tensors it resumes with
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compiles_in_one_graph_with_gemm_forced() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    batched = BatchModule(LeNet(), 2, init="independent", seed=0)
    reference = copy.deepcopy(batched)
    x = torch.randn(2, 3, 1, 28, 28)
    results = []
    with batch_layers.use_conv_algorithm("gemm"):
        for module in (torch.compile(batched, backend="aot_eager", fullgraph=True), reference):
            out = module(x)
            out.square().sum().backward()
            results.append([out.detach(), *(p.grad for p in module.parameters())])
    torch._dynamo.reset()
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("order", ORDERS)
def test_cuda_rule_takes_gemm_for_lenet_and_both_paths_match_plain_layers(order: str) -> None:
    conv = batch_layers.Conv2d(6, 16, 5, batch=8, device="cuda")
    assert "_GemmConvBackward" in node_names(conv(torch.randn(8 * 2, 6, 12, 12, device="cuda")))
    case = LayerCase("lenet-conv2", lambda: nn.Conv2d(6, 16, 5), (6, 12, 12), atol=1e-4)
    for algorithm in ALGORITHMS:
        with batch_layers.use_conv_algorithm(algorithm):
            run_case(case, "train", "cuda", order=order)
