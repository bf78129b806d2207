from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import batch_layers
from torchmb import AbstractBatchModule, BatchModule, lookup_batch_module, register_batch_module
from torchmb._registry import _REGISTRY
from torchmb.testing import assert_equivalent, assert_isolated


@pytest.fixture
def clean_registry():
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def test_default_layers_are_registered() -> None:
    assert lookup_batch_module(nn.Linear) is batch_layers.Linear
    assert lookup_batch_module(nn.Conv2d) is batch_layers.Conv2d
    assert lookup_batch_module(nn.BatchNorm2d) is batch_layers.BatchNorm2d
    assert lookup_batch_module(nn.ReLU) is None


def test_mro_fallback_only_when_forward_is_inherited() -> None:
    class TaggedLinear(nn.Linear):
        pass

    class ClampedLinear(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x).clamp(-1, 1)

    assert lookup_batch_module(TaggedLinear) is batch_layers.Linear
    assert lookup_batch_module(ClampedLinear) is None
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="100% of the model's parameters are batched through torch.func"):
        # float64: in float32, five steps on inputs of scale 10 drift past the default tolerance on some CPUs
        assert_equivalent(lambda: nn.Sequential(ClampedLinear(3, 4)).double(), 3,
                          torch.randn(3, 5, 3, dtype=torch.float64) * 10)
        assert BatchModule(nn.Sequential(ClampedLinear(3, 4)), 2).generic_modules == ["0"]


def test_register_refuses_silent_overwrite(clean_registry) -> None:
    class Other(AbstractBatchModule):
        base_class = nn.Linear

    with pytest.raises(ValueError, match=r"already batched by batch_layers\._linear\.Linear; pass overwrite=True"):
        register_batch_module(Other)
    register_batch_module(Other, overwrite=True)
    assert lookup_batch_module(nn.Linear) is Other
    register_batch_module(batch_layers.Linear, overwrite=True)
    register_batch_module(batch_layers.Linear)  # the same mapping again is no overwrite


def test_register_refuses_non_batch_classes() -> None:
    with pytest.raises(TypeError, match="expects a subclass of AbstractBatchModule"):
        register_batch_module(int)

    class NoBase(AbstractBatchModule):
        pass

    with pytest.raises(TypeError, match=r"base_class must name the plain nn\.Module"):
        register_batch_module(NoBase)

    class Lonely(nn.Module):
        pass

    with pytest.raises(TypeError, match="exactly one AbstractBatchModule subclass must declare"):
        register_batch_module(Lonely)


class Gain(nn.Module):
    """A plain custom module with a learned per-feature gain."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


class NativeGain(AbstractBatchModule):
    """Written against torchmb's helpers: split to (B, n, ...), compute, merge back."""

    base_class = Gain
    merged_order = "models"

    @classmethod
    def from_module(cls, module: Gain, batch: int) -> NativeGain:
        return cls(module.gain.numel(), batch)

    def __init__(self, features: int, batch: int) -> None:
        super().__init__(batch)
        self.gain = nn.Parameter(torch.ones(batch, features))

    def forward(self, x: Tensor) -> Tensor:
        return self.merge(self.split(x) * self.gain.unsqueeze(1))


def test_decorator_registration_runs_a_custom_batched_module(clean_registry) -> None:
    assert register_batch_module(NativeGain) is NativeGain
    make = lambda: nn.Sequential(nn.Linear(4, 6), Gain(6), nn.Tanh())  # noqa: E731
    batched = BatchModule(make(), 3)
    assert isinstance(batched.module[1], NativeGain) and not batched.generic_modules
    torch.manual_seed(0)
    assert_equivalent(make, 3, torch.randn(3, 5, 4))
    assert_isolated(BatchModule.from_factory(make, 3, seed=0), torch.randn(3, 5, 4))


class Offset(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.offset


class LegacyOffset(AbstractBatchModule):
    """Written as torchmb 0.2's documentation shows: dim 0 in (n, B) order, rearranged by hand."""

    base_class = Offset

    @classmethod
    def from_module(cls, module: Offset, batch: int) -> LegacyOffset:
        return cls(batch, module.offset.numel())

    def __init__(self, batch: int, features: int) -> None:
        super().__init__(batch)
        self.offset = nn.Parameter(torch.zeros(batch, features))

    def forward(self, batch_inputs: Tensor) -> Tensor:
        per_sample = batch_inputs.view(-1, self.batch, batch_inputs.shape[-1])  # (n, B, features)
        return (per_sample + self.offset).view(-1, batch_inputs.shape[-1])


def test_torchmb_02_style_module_registers_and_runs(clean_registry) -> None:
    register_batch_module(Offset)  # the call form the 0.2 page shows: the plain class
    assert lookup_batch_module(Offset) is LegacyOffset
    make = lambda: nn.Sequential(nn.Linear(4, 6), Offset(6), nn.Linear(6, 2))  # noqa: E731
    torch.manual_seed(0)
    assert_equivalent(make, 3, torch.randn(3, 5, 4))
    assert_isolated(BatchModule.from_factory(make, 3, seed=0), torch.randn(3, 5, 4))


def test_torchmb_02_style_module_across_the_switch_to_samples_major(clean_registry) -> None:
    """``auto`` runs the first forward models-major, reordering around the samples-only module, then switches to
    samples-major, where the module runs as it is: both forwards as B plain models give."""
    register_batch_module(Offset)
    make = lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), Offset(36), nn.Linear(36, 2))  # noqa: E731
    torch.manual_seed(0)
    plain = [make() for _ in range(3)]
    batched = BatchModule(make(), 3)
    batched.load_state_dicts([model.state_dict() for model in plain])
    for order in ("models", "samples"):
        assert batched.merged_order == order
        x = torch.randn(3, 5, 3, 5, 5)
        out = batched(x)
        for i, model in enumerate(plain):
            torch.testing.assert_close(out[i], model(x[i]), atol=1e-6, rtol=1e-5)
    assert batched.merged_order == "samples"


def test_plain_class_with_two_batched_classes_is_ambiguous(clean_registry) -> None:
    class Twice(nn.Module):
        pass

    class First(AbstractBatchModule):
        base_class = Twice

    class Second(AbstractBatchModule):
        base_class = Twice

    with pytest.raises(TypeError, match=r"found: .*First, .*Second"):
        register_batch_module(Twice)
