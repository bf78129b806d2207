"""timm's weight-standardised convolutions (StdConv2d, StdConv2dSame, ScaledStdConv2d, ScaledStdConv2dSame)
against B independently held timm layers, in float64: outputs, input gradients and the gradients of weight,
bias and gain, in both merged orders."""

from __future__ import annotations

import pytest
import torch
from support.torchvision_ops import import_torchvision
from torch import Tensor, nn

import batch_layers
from torchmb import BatchModule, lookup_batch_module
from torchmb.testing import assert_equivalent

try:
    import_torchvision()  # timm imports torchvision
    from timm.layers import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame
except ImportError as error:  # the test extra brings timm
    pytest.skip(f"needs timm: {error}", allow_module_level=True)

BATCH, SAMPLES = 3, 2

# name -> (timm layer, input (C, H, W)); odd and unequal sizes, so that "SAME" pads unevenly and differently
# per dim where it is dynamic.
CASES = {
    "std": (lambda: StdConv2d(3, 4, 3), (3, 7, 6)),
    "std-bias-stride-eps": (lambda: StdConv2d(4, 6, 3, stride=2, bias=True, eps=1e-3), (4, 9, 8)),
    "std-groups-dilation": (lambda: StdConv2d(4, 6, 3, dilation=2, groups=2), (4, 9, 9)),
    "std-padding-rect-kernel": (lambda: StdConv2d(3, 4, (3, 1), padding=(2, 0), bias=True), (3, 5, 6)),
    "std-torch-same": (lambda: StdConv2d(3, 4, (3, 5), padding="same", dilation=(2, 1)), (3, 7, 6)),
    "std-same-dynamic-stride": (lambda: StdConv2dSame(3, 4, 3, stride=2), (3, 7, 10)),
    "std-same-dynamic-even-kernel": (lambda: StdConv2dSame(4, 4, 2, groups=4, bias=True), (4, 5, 6)),
    "std-same-static": (lambda: StdConv2dSame(3, 4, 3), (3, 5, 6)),
    "scaled": (lambda: ScaledStdConv2d(3, 6, 3, gamma=1.7), (3, 7, 6)),
    "scaled-nobias-stride-groups": (lambda: ScaledStdConv2d(4, 6, 3, stride=2, groups=2, bias=False), (4, 9, 8)),
    "scaled-1x1-eps": (lambda: ScaledStdConv2d(5, 3, 1, eps=1e-4, gain_init=0.5), (5, 3, 4)),
    "scaled-same-dynamic": (lambda: ScaledStdConv2dSame(3, 4, 3, stride=2, gamma=1.7), (3, 7, 10)),
    "scaled-same-dynamic-dilation": (lambda: ScaledStdConv2dSame(4, 4, 2, dilation=3, groups=2), (4, 9, 7)),
    "scaled-same-static-nobias": (lambda: ScaledStdConv2dSame(3, 4, 5, bias=False), (3, 7, 8)),
}


def randomized(layer: nn.Module) -> nn.Module:
    """Every parameter off its default (the gains too), so that each model differs."""
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.5, 1.0)
    return layer.double()


def stacked(plain: list[nn.Module]) -> batch_layers.AbstractBatchModule:
    """The batched layer torchmb registers for the plain layers' class, model i holding plain[i]'s state."""
    batched = lookup_batch_module(type(plain[0])).from_module(plain[0], len(plain))
    with torch.no_grad():
        for name, target in batched.state_dict(keep_vars=True).items():
            target.copy_(torch.stack([layer.state_dict()[name] for layer in plain]))
    return batched


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("name", list(CASES))
def test_batched_layer_matches_independent_timm_layers(name: str, order: str) -> None:
    make, sample_shape = CASES[name]
    torch.manual_seed(0)
    plain = [randomized(make()) for _ in range(BATCH)]
    batched = stacked(plain)
    batched.merged_order = order
    x = torch.randn(BATCH, SAMPLES, *sample_shape, dtype=torch.float64)
    merged = (x if order == "models" else x.transpose(0, 1)).reshape(-1, *sample_shape).requires_grad_()
    context = batch_layers.ForwardContext(BATCH, SAMPLES, order=order)
    with batch_layers.forward_context(context):
        y = batched(merged)
    y = (
        y.view(BATCH, SAMPLES, *y.shape[1:])
        if order == "models"
        else y.view(SAMPLES, BATCH, *y.shape[1:]).transpose(0, 1)
    )
    grad = torch.randn_like(y)
    y.backward(grad)
    x_grad = (
        merged.grad.view(BATCH, SAMPLES, *sample_shape)
        if order == "models"
        else merged.grad.view(SAMPLES, BATCH, *sample_shape).transpose(0, 1)
    )
    for i, layer in enumerate(plain):
        own = x[i].clone().requires_grad_()
        y_own = layer(own)
        y_own.backward(grad[i])
        torch.testing.assert_close(y[i], y_own, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(x_grad[i], own.grad, atol=1e-12, rtol=1e-10)
        for key, param in layer.named_parameters():
            torch.testing.assert_close(batched.get_parameter(key).grad[i], param.grad, atol=1e-11, rtol=1e-10)


@pytest.mark.parametrize("name", list(CASES))
def test_batched_layer_takes_timm_hyperparameters(name: str) -> None:
    plain = CASES[name][0]()
    batched = lookup_batch_module(type(plain)).from_module(plain, 2)
    assert type(batched).__name__ == type(plain).__name__
    for attribute in ("padding", "stride", "dilation", "groups", "eps", "scale", "gain_init"):
        assert getattr(batched, attribute, None) == getattr(plain, attribute, None), attribute
    assert batched.same_pad == getattr(plain, "same_pad", False)  # only timm's Same classes have one


@pytest.mark.parametrize(
    ("batched_class", "plain_class", "args"),
    [
        (batch_layers.StdConv2d, StdConv2d, (3, 4, 3)),
        (batch_layers.StdConv2dSame, StdConv2dSame, (3, 4, 2, 2)),
        (batch_layers.ScaledStdConv2d, ScaledStdConv2d, (3, 4, 3, 2)),
        (batch_layers.ScaledStdConv2dSame, ScaledStdConv2dSame, (3, 4, 3, 2)),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_constructor_draws_and_pads_like_b_timm_layers(batched_class, plain_class, args) -> None:
    torch.manual_seed(0)
    batched = batched_class(*args, batch=3)
    torch.manual_seed(0)
    plain = [plain_class(*args) for _ in range(3)]
    assert (batched.padding, batched.same_pad) == (plain[0].padding, getattr(plain[0], "same_pad", False))
    assert getattr(batched, "scale", None) == getattr(plain[0], "scale", None)
    for i, layer in enumerate(plain):
        for key, param in layer.named_parameters():
            assert torch.equal(batched.get_parameter(key)[i], param), key


class DoubledStdConv2d(StdConv2d):
    """A subclass of timm's that overrides ``forward`` again: the batched class would skip its computation."""

    def forward(self, x: Tensor) -> Tensor:
        return 2 * super().forward(x)


def test_a_subclass_overriding_forward_again_keeps_its_computation_on_the_generic_path() -> None:
    def make() -> nn.Module:
        return nn.Sequential(randomized(DoubledStdConv2d(3, 4, 3)), nn.Tanh())

    assert lookup_batch_module(DoubledStdConv2d) is None
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="100% of the model's parameters are batched through torch.func"):
        assert_equivalent(make, 3, torch.randn(3, 2, 3, 6, 5, dtype=torch.float64), steps=2, atol=1e-10)


def nf_stem() -> nn.Module:
    """An NF-Net's stem in short: Same convolutions, an activation, a scaled one, a classifier."""
    return nn.Sequential(
        randomized(ScaledStdConv2dSame(3, 8, 3, stride=2, gamma=1.7)),
        nn.SiLU(),
        randomized(StdConv2dSame(8, 8, 3, stride=2, groups=2)),
        nn.ReLU(inplace=True),
        randomized(ScaledStdConv2d(8, 6, 1)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


@pytest.mark.parametrize("shared_input", [False, True], ids=["per-model", "shared"])
def test_std_convs_train_as_b_plain_models_on_the_fast_path(shared_input: bool) -> None:
    batched = BatchModule(nf_stem(), 3)
    assert not batched.generic_modules
    assert isinstance(batched.module[2], batch_layers.StdConv2dSame)
    torch.manual_seed(0)
    shape = (2, 3, 9, 11) if shared_input else (3, 2, 3, 9, 11)
    inputs = torch.randn(*shape, dtype=torch.float64)
    assert_equivalent(nf_stem, 3, inputs, steps=3, shared_input=shared_input, atol=1e-10)
