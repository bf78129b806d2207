"""Stems as one batched matrix product of patches (``batch_layers/_conv_patches.py``) against B plain
convolutions: outputs and gradients (first and second order) in float64 on the CPU for every geometry; the
kernel table's compiled conditions for it and for the compiled pointwise product; and compiled, on the CPU
(the table's GPU condition lifted) and on a GPU, where the table chooses it."""

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
from support.conv_checks import check_product_against_plain_conv2d, compiled_conv2d_against_plain
from support.torchvision_ops import import_torchvision
from torch import nn

from batch_layers import Layout, _kernel_table
from batch_layers import functional as BF
from batch_layers._conv_patches import patches_conv2d, runs_as_patches
from torchmb import BatchModule

pytestmark = DYNAMO_WARNINGS

__all__ = ["fresh_dynamo"]  # a fixture the compiled tests use

BATCH, SAMPLES = 3, 2
GEOMETRIES = [  # in, out, kernel, stride, padding, dilation, groups, height, width
    (3, 8, 3, 2, 1, 1, 1, 9, 7),  # an EfficientNet's stem: odd sizes, stride 2
    (1, 6, 5, 1, 0, 1, 1, 8, 8),  # LeNet's first layer: one channel, no padding
    (3, 5, 7, 2, 3, 1, 1, 11, 11),  # a ResNet's 7x7 stem
    (4, 6, 3, 1, 2, 2, 2, 6, 5),  # dilated, two groups per model
    (2, 4, (1, 3), (2, 1), (0, 1), 1, 1, 5, 6),  # an uneven kernel, stride and padding
]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-model"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
def test_the_product_is_b_plain_convolutions(geometry, order: str, channels_last: bool, bias: bool,
                                             stacked: bool) -> None:
    """The result keeps the input's storage."""
    check_product_against_plain_conv2d(patches_conv2d, geometry, order, channels_last, bias, stacked, BATCH, SAMPLES)


def stem(batch: int, cin: int, cout: int, kernel: int, cuda: bool = True) -> _kernel_table.ConvCall:
    return _kernel_table.ConvCall(cuda, 4, torch.float32, batch * cin, (batch * cout, cin, kernel, kernel), batch,
                                  False, (2, 2), (1, 1), (32, 32), (kernel // 2, kernel // 2))


def test_the_table_takes_compiled_stems_whose_patches_are_at_most_thrice_the_output_and_wide_strided_layers(
        monkeypatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    efficientnet = stem(64, 3, 32, 3)
    assert runs_as_patches(efficientnet)
    assert runs_as_patches(stem(16, 3, 16, 3)), "MobileNetV3's stem: 27 per pixel for 16 channels"
    assert runs_as_patches(stem(64, 3, 64, 7)), "ResNet-18's stem: 147 per pixel for 64 channels"
    lenet = _kernel_table.ConvCall(True, 4, torch.float32, 64, (64 * 6, 1, 5, 5), 64, size=(28, 28), padding=(0, 0))
    assert "elements per output channel" in _kernel_table.PATCHES.unmet(lenet)[0]
    depthwise = _kernel_table.ConvCall(True, 4, torch.float32, 64 * 32, (64 * 32, 1, 3, 3), 64 * 32, size=(16, 16),
                                       padding=(1, 1))
    assert not runs_as_patches(depthwise), "a depthwise convolution's patches are nine times its output"
    assert "input channels per group" in _kernel_table.PATCHES.unmet(stem(64, 16, 64, 3))[0]
    assert not runs_as_patches(stem(64, 3, 32, 3, cuda=False)), "GPU only"
    assert runs_as_patches(stem(64, 64, 128, 3)), "a strided layer of 64 channels per model (ResNet-18's)"
    assert not runs_as_patches(stem(64, 16, 16, 3)), "RegNet's strided groups of 16 channels"
    assert not runs_as_patches(stem(64, 64, 64, 3)._replace(stride=(1, 1))), "stride 1: 9x its input"
    assert not runs_as_patches(efficientnet._replace(size=(), padding=())), "the image's size is needed"
    op = "weight grad"
    assert _kernel_table.choose(op, efficientnet, _kernel_table.OPS).name == "patches-matmul"


def patchify(batch: int, cin: int, cout: int, kernel: int, padding: int = 0) -> _kernel_table.ConvCall:
    return _kernel_table.ConvCall(True, 4, torch.float32, batch * cin, (batch * cout, cin, kernel, kernel), batch,
                                  False, (kernel, kernel), (1, 1), (8, 8), (padding, padding))


def test_eager_steps_take_strided_stems_and_patchify_layers_from_16_models_and_wide_strided_ones_from_64(
        monkeypatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert runs_as_patches(stem(16, 3, 32, 3)), "EfficientNet-B0's and RegNet's stem: 27 per pixel for 32 channels"
    assert runs_as_patches(stem(16, 3, 16, 3)), "MobileNetV3's stem: 27 per pixel for 16 channels"
    assert "under torch.compile" in _kernel_table.PATCHES.unmet(stem(8, 3, 32, 3))[0], "eager, 8 models"
    assert not runs_as_patches(stem(64, 3, 64, 7)), "ResNet-18's stem, eager: 147 per pixel for 64 channels"
    assert not runs_as_patches(stem(64, 3, 32, 3)._replace(stride=(1, 1))), "a stem of stride 1 (CIFAR's ResNet)"
    assert runs_as_patches(patchify(16, 3, 40, 4)), "ConvNeXt's stem: 4x4 of stride 4"
    assert runs_as_patches(patchify(16, 40, 80, 2)), "ConvNeXt's downsampling: 2x2 of stride 2"
    assert not runs_as_patches(patchify(16, 40, 80, 2, padding=1)), "padded: its windows read the zeros"
    assert not runs_as_patches(patchify(16, 32, 32, 1)._replace(stride=(2, 2))), "1x1 of stride 2 (RegNet's)"
    assert runs_as_patches(stem(64, 64, 128, 3)), "eager from 64 models on: cuDNN launches per model"
    assert runs_as_patches(stem(64, 64, 128, 1)), "ResNet-18's 1x1 downsampling of 16x16 images"
    assert "under torch.compile" in _kernel_table.PATCHES.unmet(stem(16, 64, 128, 3))[0], "eager, 16 models"
    assert not runs_as_patches(stem(64, 64, 64, 3)._replace(stride=(1, 1))), "eager stride 1"


def test_compiled_pointwise_products_take_larger_images_and_fewer_channels(monkeypatch) -> None:
    def pointwise(cin: int, cout: int, size: int) -> _kernel_table.ConvCall:
        return _kernel_table.ConvCall(True, 4, torch.float32, 64 * cin, (64 * cout, cin, 1, 1), 64, size=(size, size),
                                      padding=(0, 0))

    expand, squeeze = pointwise(16, 96, 16), pointwise(96, 4, 1)
    assert not _kernel_table.POINTWISE.applies(expand) and not _kernel_table.POINTWISE.applies(squeeze)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _kernel_table.POINTWISE.applies(expand), "a 16x16 image under torch.compile"
    assert _kernel_table.POINTWISE.applies(squeeze), "4 output channels under torch.compile"
    assert "pixels per image" in _kernel_table.POINTWISE.unmet(pointwise(16, 96, 32))[0]


def _gpu_conditions_lifted(monkeypatch) -> None:
    gpu_conditions_lifted(monkeypatch, (_kernel_table.PATCHES, _kernel_table.POINTWISE))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_model_runs_its_stem_as_patches_and_trains_as_plain_copies(monkeypatch) -> None:
    """A stem, batch norm, SiLU and a 1x1 layer compiled whole: the stem takes the product of patches and the 1x1
    layer of an 8x8 image with 4 output channels the product of pixels (above their eager limits); outputs and
    every parameter's gradient match B plain models in float64."""
    _gpu_conditions_lifted(monkeypatch)
    traced = []
    for name in ("patches_conv2d", "pointwise_conv2d"):
        product = getattr(BF._conv, name)
        monkeypatch.setattr(BF._conv, name, lambda *args, name=name, product=product: traced.append(name)
                            or product(*args))
    torch.manual_seed(0)
    plain = [nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.SiLU(), nn.Conv2d(16, 4, 1)).double()
             for _ in range(BATCH)]
    models = iter(plain)
    batched = BatchModule.from_factory(lambda: next(models), BATCH)
    x = torch.randn(BATCH, SAMPLES, 3, 16, 16, dtype=torch.float64)
    compiled = torch.compile(batched, dynamic=False)
    assert_two_steps_match_plain(compiled, batched, plain, x)
    assert set(traced) == {"patches_conv2d", "pointwise_conv2d"}, traced


@pytest.mark.parametrize("order", ["models", "samples"])
def test_an_eager_downsampling_block_of_64_models_takes_the_product_and_trains_as_plain_copies(
        monkeypatch, order: str) -> None:
    """A ResNet's downsampling (a 3x3 convolution of stride 2 from 64 channels, batch norm, ReLU and the 1x1
    shortcut of stride 2) for 64 models, eagerly: both convolutions take the product of patches; outputs and
    every parameter's gradient match 64 plain models in float64."""
    _gpu_conditions_lifted(monkeypatch)
    traced = []
    product = BF._conv.patches_conv2d
    monkeypatch.setattr(BF._conv, "patches_conv2d", lambda *args: traced.append(args[1].shape) or product(*args))
    batch = _kernel_table.PATCHES.limits["min_groups_eager_wide"]
    torch.manual_seed(0)

    class Downsample(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(64, 8, 3, 2, 1, bias=False)
            self.norm = nn.BatchNorm2d(8)
            self.shortcut = nn.Conv2d(64, 8, 1, 2)

        def forward(self, x):
            return torch.relu(self.norm(self.conv(x))) + self.shortcut(x)

    plain = [Downsample().double() for _ in range(batch)]
    models = iter(plain)
    batched = BatchModule.from_factory(lambda: next(models), batch, merged_order=order)
    x = torch.randn(batch, 1, 64, 5, 5, dtype=torch.float64)
    assert_two_steps_match_plain(batched, batched, plain, x)
    assert len(traced) == 4, f"both convolutions as products, in both steps: {traced}"


def test_eager_strided_stems_and_patchify_layers_of_16_models_take_the_product_and_train_as_plain_copies(
        monkeypatch) -> None:
    """torchvision's stem block (3x3 of stride 2, batch norm, SiLU) before timm's ConvNeXt (its 4x4 stem of stride
    4, three 2x2 downsamplings of stride 2, layer norms, layer scales) for 16 models, eagerly, in the merged order
    BatchModule picks (models-major: timm's LayerNorm2d): all five strided convolutions take the product of
    patches; outputs and every parameter's gradient match 16 plain models in float64."""
    import_torchvision()
    from timm.models.convnext import ConvNeXt
    from torchvision.ops import Conv2dNormActivation

    _gpu_conditions_lifted(monkeypatch)
    traced = []
    product = BF._conv.patches_conv2d
    monkeypatch.setattr(BF._conv, "patches_conv2d", lambda *args: traced.append(args[1].shape[-2:]) or product(*args))
    batch = _kernel_table.PATCHES.limits["min_groups_eager"]
    torch.manual_seed(0)
    plain = [nn.Sequential(Conv2dNormActivation(3, 16, stride=2, activation_layer=nn.SiLU),
                           ConvNeXt(in_chans=16, num_classes=3, depths=(1,) * 4, dims=(8,) * 4)).double()
             for _ in range(batch)]
    models = iter(plain)
    batched = BatchModule.from_factory(lambda: next(models), batch)
    x = torch.randn(batch, 1, 3, 64, 64, dtype=torch.float64)
    assert_two_steps_match_plain(batched, batched, plain, x)
    expected = [(3, 3), (4, 4), (2, 2), (2, 2), (2, 2)] * 2
    assert [tuple(k) for k in traced] == expected, "every strided stem and patchify layer, in both steps"


@pytest.mark.cuda
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("order", ["models", "samples"])
# Inductor's advice, raised where the test turns TF32 off for an exact comparison
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning")
def test_a_compiled_stem_takes_the_product_on_a_gpu_and_matches_plain(monkeypatch, order: str) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    inputs = [torch.randn(SAMPLES, 3, 17, 17, device="cuda") for _ in range(BATCH)]
    params = [torch.randn(BATCH, 16, 3, 3, 3, device="cuda", requires_grad=True),
              torch.randn(BATCH, 16, device="cuda", requires_grad=True)]
    traced = [node.target for node in compiled_conv2d_against_plain(inputs, params, Layout(BATCH, order), atol=1e-4,
                                                                    rtol=1e-4, stride=2, padding=1)]
    assert "unfold" in traced and torch.baddbmm in traced, f"the product of patches did not run: {traced}"


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_efficientnet_keeps_no_grouped_convolution_that_turns_off_channels_last(monkeypatch) -> None:
    """Inductor lays a training graph out channels-last only where no convolution is grouped with more than one
    input channel per group (``GraphLowering.decide_layout_opt``). With the products on the GPU's compiled
    paths, torchvision's EfficientNet-B0 keeps none: its stem takes the product of patches, its 1x1 layers
    (16x16 images, 4-channel squeeze-excitation) the product of pixels; only depthwise convolutions stay."""
    import_torchvision()
    from torchvision.models import efficientnet_b0

    _gpu_conditions_lifted(monkeypatch)
    blocking, depthwise = [], []

    def count(graph) -> None:
        for node in graph.graph.nodes:
            if node.target == torch.ops.aten.convolution.default and node.args[-1] > 1:
                weight = node.args[1].meta["val"]
                (blocking if weight.shape[1] > 1 else depthwise).append(tuple(weight.shape))

    torch.manual_seed(0)
    batched = BatchModule(efficientnet_b0(num_classes=10), 2)
    compiled = torch.compile(batched, backend=aot_graphs_backend(count))
    x = torch.randn(2, 2, 3, 32, 32)
    for _ in range(2):  # a second step: the first forward checks the model's code
        compiled(x).sum().backward()
    assert depthwise, "the graph holds the depthwise convolutions (the check sees convolutions)"
    assert not blocking, f"grouped convolutions of more than one input channel per group: {blocking}"


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_vit_takes_its_patch_embedding_as_patches_in_one_graph(monkeypatch) -> None:
    """timm's ViT (8x8 patches of 3 channels for 192: a stem the product takes) runs its compiled forward under
    torchmb's attention choice, a torch-function mode; ``Tensor.unflatten`` there broke the graph on torch 2.11."""
    import_torchvision()  # timm imports torchvision
    import timm

    _gpu_conditions_lifted(monkeypatch)
    traced = []
    product = BF._conv.patches_conv2d
    monkeypatch.setattr(BF._conv, "patches_conv2d", lambda *args: traced.append(args) or product(*args))
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=10)
    explained = torch._dynamo.explain(BatchModule(model, 2))(torch.randn(2, 2, 3, 32, 32))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert traced, "the patch embedding did not take the product of patches"
