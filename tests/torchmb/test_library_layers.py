"""timm's and torchvision's subclasses of torch layers (and torchvision's FrozenBatchNorm2d) convert to
batched layers, not the torch.func path, and train as B plain models do."""

from __future__ import annotations

import pytest
import torch
from support.torchvision_ops import import_torchvision
from torch import Tensor, nn

import batch_layers
from torchmb import AbstractBatchModule, BatchModule, lookup_batch_module, register_batch_module
from torchmb._registry import _REGISTRY
from torchmb.testing import assert_equivalent

try:
    torchvision = import_torchvision()
    import timm.layers
except ImportError as error:  # the test extra brings both
    pytest.skip(f"needs timm and torchvision: {error}", allow_module_level=True)

from torchvision.models.convnext import LayerNorm2d as ConvNeXtLayerNorm2d
from torchvision.ops.misc import FrozenBatchNorm2d


def randomized(layer: nn.Module) -> nn.Module:
    """Parameters and floating-point buffers drawn off their defaults, so each model differs."""
    with torch.no_grad():
        for tensor in (*layer.parameters(), *(b for b in layer.buffers() if b.is_floating_point())):
            tensor.uniform_(0.5, 1.5)
    return layer


LIBRARY_LAYERS = {
    "timm-BatchNormAct2d": lambda: randomized(timm.layers.BatchNormAct2d(6, act_layer=nn.SiLU)),
    "timm-GroupNormAct": lambda: randomized(timm.layers.GroupNormAct(6, num_groups=2)),
    "timm-GroupNorm1": lambda: randomized(timm.layers.GroupNorm1(6)),
    "timm-LayerNorm2d": lambda: randomized(timm.layers.LayerNorm2d(6)),
    "timm-LayerNorm2dFp32": lambda: randomized(timm.layers.LayerNorm2dFp32(6)),
    "torchvision-LayerNorm2d": lambda: randomized(ConvNeXtLayerNorm2d(6)),
    "torchvision-FrozenBatchNorm2d": lambda: randomized(FrozenBatchNorm2d(6)),
}


@pytest.mark.parametrize("name", list(LIBRARY_LAYERS))
def test_library_norm_after_a_conv_trains_as_plain_copies(name: str) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 6, 3), LIBRARY_LAYERS[name](), nn.Tanh()).double()

    batched = BatchModule(make(), 3)
    assert isinstance(batched.module[1], AbstractBatchModule) and not batched.generic_modules
    torch.manual_seed(0)
    assert_equivalent(make, 3, torch.randn(3, 4, 3, 6, 6, dtype=torch.float64), steps=2, train=True)


def test_timm_linear_layernorm_and_same_padding_conv() -> None:
    def make() -> nn.Module:
        return nn.Sequential(
            timm.layers.create_conv2d(3, 4, 3, stride=2, padding="same"),  # Conv2dSame
            nn.Flatten(),
            timm.layers.Linear(4 * 3 * 3, 5),
            randomized(timm.layers.LayerNorm(5)),
        ).double()

    batched = BatchModule(make(), 3)
    assert [type(m).__name__ for m in batched.module] == ["Conv2dSame", "Flatten", "Linear", "LayerNorm"]
    assert not batched.generic_modules
    torch.manual_seed(0)
    assert_equivalent(make, 3, torch.randn(3, 4, 3, 6, 6, dtype=torch.float64), steps=2)


def test_subclass_of_a_listed_class_keeping_its_forward_takes_the_rule() -> None:
    class Tagged(timm.layers.LayerNorm2d):
        pass

    assert issubclass(lookup_batch_module(Tagged), batch_layers.LayerNorm)
    assert issubclass(lookup_batch_module(Tagged), Tagged)


class OffsetLinear(nn.Linear):
    """A subclass of one's own whose forward adds to its parent's computation."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + 1.0


@pytest.fixture
def clean_registry():
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def test_unlisted_subclass_keeps_its_computation_on_the_generic_path() -> None:
    make = lambda: nn.Sequential(OffsetLinear(4, 3)).double()  # noqa: E731
    assert lookup_batch_module(OffsetLinear) is None
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="100% of the model's parameters are batched through torch.func"):
        assert_equivalent(make, 3, torch.randn(3, 5, 4, dtype=torch.float64), steps=2)


def test_own_subclass_opts_in_to_the_fast_rule(clean_registry) -> None:
    register_batch_module(batch_layers.batched_subclass(OffsetLinear, batch_layers.Linear))
    make = lambda: nn.Sequential(OffsetLinear(4, 3), nn.ReLU(), OffsetLinear(3, 2)).double()  # noqa: E731
    batched = BatchModule(make(), 3)
    assert isinstance(batched.module[0], batch_layers.Linear) and not batched.generic_modules
    torch.manual_seed(0)
    assert_equivalent(make, 3, torch.randn(3, 5, 4, dtype=torch.float64), steps=2)
