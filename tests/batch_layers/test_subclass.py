"""batched_subclass: a plain subclass's own forward on the batched layer, against B plain subclass layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.layer_cases import BATCH
from torch import Tensor, nn

import batch_layers
from batch_layers import batched_subclass


class ShiftedClampedLinear(nn.Linear):
    """Adds to its parent's computation, through ``super().forward``."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).clamp(-1, 1) + 0.25


class ChannelsLastNorm(nn.LayerNorm):
    """timm's and torchvision's ``LayerNorm2d``: ``F.layer_norm`` over channels between two permutes."""

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return y.permute(0, 3, 1, 2)


class NormThenAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d`` in short: counts batches, ``F.batch_norm``, then an activation child."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.num_batches_tracked.add_(1)
        y = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )
        return self.act(y)


class PaddedConv(nn.Conv2d):
    """timm's ``Conv2dSame`` in short: reads the kernel size off the weight and pads before ``F.conv2d``."""

    def forward(self, x: Tensor) -> Tensor:
        height, width = self.weight.shape[-2:]
        x = F.pad(x, (width // 2, width // 2, height // 2, height // 2))
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class ByteScaledLinear(nn.Linear):
    """Reads its weight's attributes as torch.compile's guards do: one model's size in bytes, so the scale is 1."""

    def forward(self, x: Tensor) -> Tensor:
        assert not (self.weight.is_nested or self.weight.is_sparse)
        return F.linear(x, self.weight, self.bias) * (self.weight.nbytes / (self.weight.numel() * self.weight.itemsize))


class SummedWeightLinear(nn.Linear):
    """Uses its weight outside any functional: a sum that would run across all models' weights."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) * self.weight.sum()


def randomized(layer: nn.Module) -> nn.Module:
    with torch.no_grad():
        for tensor in (*layer.parameters(), *(b for b in layer.buffers() if b.is_floating_point())):
            tensor.uniform_(0.5, 1.5)
    return layer


CASES = {
    "linear-super-forward": (lambda: randomized(ShiftedClampedLinear(4, 3)), (4,), batch_layers.Linear),
    "layernorm-permuted": (lambda: randomized(ChannelsLastNorm(4)), (4, 3, 5), batch_layers.LayerNorm),
    "batchnorm-act": (lambda: randomized(NormThenAct(4)), (4, 3, 3), batch_layers.BatchNorm2d),
    "conv-padded": (lambda: randomized(PaddedConv(3, 4, 3)), (3, 5, 5), batch_layers.Conv2d),
    "linear-reads-nbytes": (lambda: randomized(ByteScaledLinear(4, 3)), (4,), batch_layers.Linear),
}


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("name", list(CASES))
def test_subclass_forward_runs_per_model(name: str, order: str) -> None:
    make, sample_shape, parent = CASES[name]
    if not parent.runs_in(order):
        pytest.skip(f"{parent.__name__} runs models-major only")
    torch.manual_seed(0)
    plain = [make() for _ in range(BATCH)]
    batched = batched_subclass(type(plain[0]), parent).from_module(plain[0], BATCH)
    batched.merged_order = order
    with torch.no_grad():
        for key, target in batched.state_dict(keep_vars=True).items():
            target.copy_(torch.stack([layer.state_dict()[key] for layer in plain]))
    assert isinstance(batched, type(plain[0]))
    x = torch.randn(BATCH, 2, *sample_shape, requires_grad=True)
    merged = (x if order == "models" else x.transpose(0, 1)).reshape(-1, *sample_shape)
    with batch_layers.forward_context(batch_layers.ForwardContext(BATCH, 2, order=order)):
        y = batched(merged)
    y = y.view(BATCH, 2, *y.shape[1:]) if order == "models" else y.view(2, BATCH, *y.shape[1:]).transpose(0, 1)
    grad = torch.randn_like(y)
    y.backward(grad)
    for i, layer in enumerate(plain):
        own = x[i].detach().requires_grad_()
        y_own = layer(own)
        y_own.backward(grad[i])
        torch.testing.assert_close(y[i], y_own, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(x.grad[i], own.grad, atol=1e-5, rtol=1e-6)
        for key, param in layer.named_parameters():
            torch.testing.assert_close(batched.get_parameter(key).grad[i], param.grad, atol=1e-5, rtol=1e-6)
        for key, buffer in layer.named_buffers():
            torch.testing.assert_close(batched.get_buffer(key)[i], buffer, atol=1e-6, rtol=1e-6)


def test_a_use_of_the_weights_outside_the_functionals_is_refused_not_mixed() -> None:
    layer = batched_subclass(SummedWeightLinear, batch_layers.Linear).from_module(SummedWeightLinear(4, 3), BATCH)
    with pytest.raises(TypeError, match=r"SummedWeightLinear\.forward applies sum to a per-model tensor"):
        layer(torch.randn(BATCH * 2, 4))


def test_a_functional_given_a_tensor_shared_by_the_models_is_refused() -> None:
    class ZeroBiasNorm(nn.LayerNorm):
        def forward(self, x: Tensor) -> Tensor:
            return F.layer_norm(x, self.normalized_shape, self.weight, torch.zeros(self.normalized_shape), self.eps)

    layer = batched_subclass(ZeroBiasNorm, batch_layers.LayerNorm).from_module(ZeroBiasNorm(BATCH), BATCH)
    with pytest.raises(TypeError, match=r"ZeroBiasNorm\.forward applies layer_norm to a per-model tensor"):
        layer(torch.randn(BATCH * 2, BATCH))


def test_state_the_parent_class_does_not_hold_is_refused() -> None:
    class ScaledLinear(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 3)
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) * self.scale

    with pytest.raises(TypeError, match="which holds no scale: register a batched class"):
        batched_subclass(ScaledLinear, batch_layers.Linear).from_module(ScaledLinear(), BATCH)


def test_only_subclasses_of_a_class_with_functional_forms() -> None:
    with pytest.raises(TypeError, match="must derive from Linear"):
        batched_subclass(ChannelsLastNorm, batch_layers.Linear)
    with pytest.raises(TypeError, match="must declare functional_forms"):
        batched_subclass(type("Sub", (nn.PReLU,), {"forward": nn.PReLU.forward}), batch_layers.PReLU)
