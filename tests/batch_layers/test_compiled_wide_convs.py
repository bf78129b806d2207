"""ResNet's convolutions of many channels per model under ``torch.compile``: strided layers as a product of
patches, stride-1 layers on a channels-last grouped input, 2x2 images of stride 1 as the Toeplitz product
(16 pixel pairs), as the kernel table chooses them compiled. Against B plain models: a compiled stack of
torchvision's ResNet blocks in float64 on the CPU (the table's GPU conditions lifted), torchvision's ResNet-18's
compiled graph, and each path compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from support.compiled import (
    DYNAMO_WARNINGS,
    aot_graphs_backend,
    assert_two_steps_match_plain,
    fresh_dynamo,
    gpu_conditions_lifted,
)
from support.conv_checks import compiled_conv2d_against_plain
from support.torchvision_ops import import_torchvision
from torch import nn

from batch_layers import Layout, _kernel_table
from batch_layers import functional as BF
from torchmb import BatchModule

pytestmark = DYNAMO_WARNINGS

__all__ = ["fresh_dynamo"]  # a fixture the compiled tests use

BATCH, SAMPLES = 2, 2
COMPILED_CANDIDATES = (_kernel_table.MATMUL, _kernel_table.POINTWISE, _kernel_table.PATCHES,
                       _kernel_table.WIDE_CHANNELS_LAST)


def _gpu_conditions_lifted(monkeypatch) -> None:
    gpu_conditions_lifted(monkeypatch, COMPILED_CANDIDATES)


def _resnet_stages() -> nn.Module:
    """A stem and three of torchvision's ResNet blocks on 8x8 images: 64 channels at 8x8, then strided blocks to
    128 channels at 4x4 and at 2x2, each with its 1x1 strided shortcut."""
    import_torchvision()
    from torchvision.models.resnet import BasicBlock

    def shortcut(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 1, 2, bias=False), nn.BatchNorm2d(c_out))

    return nn.Sequential(
        nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        BasicBlock(64, 64), BasicBlock(64, 128, 2, shortcut(64, 128)), BasicBlock(128, 128, 2, shortcut(128, 128)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 5),
    ).double()  # fmt: skip


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_resnet_blocks_take_their_wide_paths_and_train_as_plain_copies(monkeypatch) -> None:
    """Every path of the table's compiled choices for wide layers runs; outputs and every parameter's gradient
    match B plain models in float64 over two steps."""
    _gpu_conditions_lifted(monkeypatch)
    traced = []
    for name in ("patches_conv2d", "pointwise_conv2d", "matmul_conv2d"):
        product = getattr(BF._conv, name)
        monkeypatch.setattr(BF._conv, name, lambda *args, name=name, product=product: traced.append(name)
                            or product(*args))
    choose = _kernel_table.choose

    def recording_choose(op, call, ops):
        chosen = choose(op, call, ops)
        traced.append(chosen.name)
        return chosen

    monkeypatch.setattr(_kernel_table, "choose", recording_choose)
    torch.manual_seed(0)
    plain = [_resnet_stages() for _ in range(BATCH)]
    models = iter(plain)
    batched = BatchModule.from_factory(lambda: next(models), BATCH)
    x = torch.randn(BATCH, SAMPLES, 3, 8, 8, dtype=torch.float64)
    compiled = torch.compile(batched, dynamic=False)
    assert_two_steps_match_plain(compiled, batched, plain, x)
    expected_paths = {"patches_conv2d", "pointwise_conv2d", "matmul_conv2d", "channels-last (wide groups)"}
    assert expected_paths <= set(traced), traced


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_resnet18_keeps_grouped_convolutions_only_of_stride_1_on_channels_last_inputs(monkeypatch) -> None:
    """torchvision's ResNet-18 on 32x32 images, compiled with the GPU's choices: its stem and every strided 3x3
    layer take a product, and the grouped 3x3 layers left (64 and 128 channels at 8x8 and 4x4) read channels-last
    inputs, where cuDNN does not convert each group's slice."""
    import_torchvision()
    from torchvision.models import resnet18

    _gpu_conditions_lifted(monkeypatch)
    grouped = []

    def count(graph) -> None:
        for node in graph.graph.nodes:
            if node.target == torch.ops.aten.convolution.default and node.args[-1] > 1:
                x, weight = (arg.meta["val"] for arg in node.args[:2])
                channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
                grouped.append((tuple(weight.shape[1:]), tuple(node.args[3]), channels_last))

    torch.manual_seed(0)
    batched = BatchModule(resnet18(num_classes=10), BATCH)
    compiled = torch.compile(batched, backend=aot_graphs_backend(count))
    x = torch.randn(BATCH, SAMPLES, 3, 32, 32)
    for _ in range(2):
        compiled(x).sum().backward()
    assert sorted(set(grouped)) == [((64, 3, 3), (1, 1), True), ((128, 3, 3), (1, 1), True)], grouped
    assert len(grouped) == 7, "layer1's four 3x3 layers, layer2's three of stride 1"


TAKEN = {
    "channels-last": lambda node: node.target == "contiguous"
    and node.kwargs.get("memory_format") == torch.channels_last,
    "patches": lambda node: node.target == "unfold",
    "toeplitz": lambda node: node.target == "index_select",  # the taps gathered by an index made on the host
}


@pytest.mark.cuda
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize(("channels", "size", "stride", "path"), [
    (64, 4, 1, "channels-last"),  # a wide stride-1 layer
    (64, 8, 2, "patches"),  # a wide strided layer
    (16, 2, 1, "toeplitz"),  # a 2x2 image of stride 1: 16 pixel pairs
])  # fmt: skip
# Inductor's advice, raised where the test turns TF32 off for an exact comparison
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning")
def test_a_compiled_wide_convolution_takes_its_path_on_a_gpu_and_matches_plain(
        monkeypatch, order: str, channels: int, size: int, stride: int, path: str) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    inputs = [torch.randn(SAMPLES, channels, size, size, device="cuda") for _ in range(BATCH)]
    params = [torch.randn(BATCH, channels, channels, 3, 3, device="cuda", requires_grad=True),
              torch.randn(BATCH, channels, device="cuda", requires_grad=True)]
    traced = compiled_conv2d_against_plain(inputs, params, Layout(BATCH, order), atol=1e-4, rtol=1e-4, stride=stride,
                                           padding=1)
    assert any(map(TAKEN[path], traced)), f"the {path} path was not taken: {[n.target for n in traced]}"
