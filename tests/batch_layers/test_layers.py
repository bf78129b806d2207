"""Every registered batched layer against B independently held torch layers with different weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import batch_layers
from torchmb import lookup_batch_module


@dataclass
class LayerCase:
    name: str
    make: Any  # () -> plain nn.Module
    sample_shape: tuple[int, ...]
    modes: tuple[str, ...] = ("train", "eval")
    atol: float = 1e-5
    kwargs: dict = field(default_factory=dict)


def _bn(cls, **kw):
    def make():
        layer = cls(6, **kw)
        if layer.affine:
            nn.init.normal_(layer.weight)
            nn.init.normal_(layer.bias)
        if layer.track_running_stats:
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2)
        return layer

    return make


LAYER_CASES = [
    LayerCase("linear", lambda: nn.Linear(7, 5), (7,)),
    LayerCase("linear-nobias-3d-input", lambda: nn.Linear(7, 5, bias=False), (3, 7)),
    LayerCase("conv1d-stride-dilation", lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=1), (4, 17)),
    LayerCase("conv1d-circular", lambda: nn.Conv1d(4, 6, 3, padding=2, padding_mode="circular"), (4, 9)),
    LayerCase("conv2d", lambda: nn.Conv2d(3, 4, 3), (3, 8, 8)),
    LayerCase("conv2d-groups-same", lambda: nn.Conv2d(4, 6, 3, groups=2, padding="same"), (4, 7, 7)),
    LayerCase("conv2d-valid-nobias", lambda: nn.Conv2d(3, 4, (3, 2), padding="valid", bias=False), (3, 6, 5)),
    LayerCase("conv2d-reflect", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (3, 6, 6)),
    LayerCase("conv2d-replicate-same", lambda: nn.Conv2d(3, 4, 4, padding="same", padding_mode="replicate"), (3, 6, 6)),
    LayerCase("conv3d", lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1)), (2, 4, 5, 4)),
    LayerCase("batchnorm1d", _bn(nn.BatchNorm1d), (6,)),
    LayerCase("batchnorm1d-3d-input", _bn(nn.BatchNorm1d), (6, 5)),
    LayerCase("batchnorm2d", _bn(nn.BatchNorm2d), (6, 3, 3)),
    LayerCase("batchnorm2d-cumulative", _bn(nn.BatchNorm2d, momentum=None), (6, 3, 3)),
    LayerCase("batchnorm2d-no-affine", _bn(nn.BatchNorm2d, affine=False), (6, 3, 3)),
    LayerCase("batchnorm2d-no-running-stats", _bn(nn.BatchNorm2d, track_running_stats=False), (6, 3, 3)),
    LayerCase("batchnorm3d", _bn(nn.BatchNorm3d), (6, 2, 3, 2)),
]

BATCH, SAMPLES = 3, 4


def batched_from(plain_layers: list[nn.Module]) -> batch_layers.AbstractBatchModule:
    """A batched layer holding plain_layers[i]'s parameters and buffers as model i."""
    batched_class = lookup_batch_module(type(plain_layers[0]))
    assert batched_class is not None, f"{type(plain_layers[0]).__name__} is not registered"
    batched = batched_class.from_module(plain_layers[0], len(plain_layers))
    with torch.no_grad():
        for name, target in batched.state_dict(keep_vars=True).items():
            target.copy_(torch.stack([layer.state_dict()[name] for layer in plain_layers]))
    return batched


def run_case(case: LayerCase, mode: str, device: str, steps: int = 2) -> None:
    torch.manual_seed(0)
    plain = [case.make().to(device) for _ in range(BATCH)]
    batched = batched_from(plain).to(device)
    for layer in (*plain, batched):
        layer.train(mode == "train")
    for _ in range(steps):  # twice, so running statistics updated by the first step are used by the second
        x = torch.randn(BATCH, SAMPLES, *case.sample_shape, device=device)
        x_batched = x.reshape(BATCH * SAMPLES, *case.sample_shape).requires_grad_()
        y_batched = batched(x_batched)
        grad = torch.randn_like(y_batched)
        y_batched.backward(grad)
        for i, layer in enumerate(plain):
            layer.zero_grad()
            x_i = x[i].clone().requires_grad_()
            y_i = layer(x_i)
            y_i.backward(grad.view(BATCH, SAMPLES, *grad.shape[1:])[i])
            torch.testing.assert_close(y_batched.view(BATCH, SAMPLES, *y_i.shape[1:])[i], y_i, atol=case.atol, rtol=0)
            torch.testing.assert_close(
                x_batched.grad.view(BATCH, SAMPLES, *case.sample_shape)[i], x_i.grad, atol=case.atol, rtol=0
            )
            for name, param in layer.named_parameters():
                torch.testing.assert_close(getattr(batched, name).grad[i], param.grad, atol=case.atol, rtol=0)
        batched.zero_grad()
    for i, layer in enumerate(plain):
        for name, value in layer.state_dict().items():
            torch.testing.assert_close(batched.state_dict()[name][i], value, atol=case.atol, rtol=0)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
def test_layer_matches_independent_torch_layers(case: LayerCase, mode: str) -> None:
    run_case(case, mode, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
def test_layer_matches_independent_torch_layers_cuda(case: LayerCase, mode: str) -> None:
    run_case(case, mode, "cuda")


def test_every_registered_layer_has_a_case() -> None:
    covered = {type(case.make()) for case in LAYER_CASES}
    for layer in batch_layers.LAYERS:
        if layer in (batch_layers.Linear, batch_layers.Conv1d, batch_layers.Conv2d, batch_layers.Conv3d) or issubclass(
            layer, (batch_layers.BatchNorm1d, batch_layers.BatchNorm2d, batch_layers.BatchNorm3d)
        ):
            assert layer.base_class in covered, f"no layer case for {layer.__name__}"


@pytest.mark.parametrize(
    ("batched_class", "args"),
    [(batch_layers.Linear, (4, 3)), (batch_layers.Conv2d, (2, 3, 3)), (batch_layers.Conv1d, (2, 4, 2))],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_reset_parameters_draws_like_b_torch_layers(batched_class, args) -> None:
    torch.manual_seed(0)
    batched = batched_class(*args, batch=5)
    torch.manual_seed(0)
    plain = [batched_class.base_class(*args) for _ in range(5)]
    for i, layer in enumerate(plain):
        for name, param in layer.named_parameters():
            assert torch.equal(getattr(batched, name)[i], param)
    assert not torch.equal(batched.weight[0], batched.weight[1])


def test_layer_refuses_input_without_model_axis() -> None:
    layer = batch_layers.Linear(4, 3, batch=3)
    with pytest.raises(ValueError, match=r"multiple of B = 3 \(the merged model axis\), got shape \(4, 4\)"):
        layer(torch.randn(4, 4))


def test_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch must be a positive int"):
        batch_layers.Linear(4, 3, batch=0)


def test_conv_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="divisible by groups"):
        batch_layers.Conv2d(3, 4, 3, groups=2, batch=2)
    with pytest.raises(ValueError, match="padding_mode"):
        batch_layers.Conv2d(3, 4, 3, padding_mode="mirror", batch=2)
    with pytest.raises(ValueError, match="strided"):
        batch_layers.Conv2d(3, 4, 3, stride=2, padding="same", batch=2)


def test_batchnorm_refuses_wrong_rank() -> None:
    with pytest.raises(ValueError, match="expected a 4-D input, got shape"):
        batch_layers.BatchNorm2d(3, batch=2)(torch.randn(4, 3))
