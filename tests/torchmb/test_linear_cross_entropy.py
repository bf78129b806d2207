"""torch's LinearCrossEntropyLoss batched: each model's logits from its own weight, its loss over its own
samples (``(B,)`` when reduced), on torch's reference path and on its chunked one (``options``), against B
plain modules trained side by side."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent

pytestmark = pytest.mark.skipif(not hasattr(nn, "LinearCrossEntropyLoss"), reason="torch < 2.13")

B, N, IN, C = 3, 6, 5, 4
DOUBLE = dict(atol=1e-9, rtol=1e-9)


def options(chunked: bool) -> nn.LinearCrossEntropyOptions | None:
    return nn.LinearCrossEntropyOptions(batch_chunk_size=2) if chunked else None


@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
@pytest.mark.parametrize("chunked", [False, True], ids=["reference", "chunked"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_each_model_computes_its_own_loss(reduction: str, chunked: bool, shared: bool) -> None:
    """Class weights drawn per model, an ignored class, a bias: outputs and every gradient as B plain modules."""

    def make() -> nn.Module:
        weight = torch.rand(C, dtype=torch.float64) + 0.5
        return nn.LinearCrossEntropyLoss(
            IN, C, bias=True, reduction=reduction, weight=weight, ignore_index=1, options=options(chunked)
        ).double()

    samples = (N,) if shared else (B, N)
    inputs = (torch.randn(*samples, IN, dtype=torch.float64), torch.randint(0, C, samples))
    assert_equivalent(make, B, inputs, steps=2, shared_input=shared, **DOUBLE)


def test_the_layer_is_registered_and_reduces_per_model() -> None:
    batched = BatchModule(nn.LinearCrossEntropyLoss(IN, C, options=options(True)).double(), B)
    assert isinstance(batched.module, batch_layers.LinearCrossEntropyLoss)
    assert [entry.path for entry in batched.conversion_report()] == ["registered"]
    loss = batched(torch.randn(B, N, IN, dtype=torch.float64), torch.randint(0, C, (B, N)))
    assert loss.shape == (B,)
    loss.sum().backward()
    assert all(batched.module.linear.weight.grad[i].abs().sum() > 0 for i in range(B))


@pytest.mark.parametrize("out_features", [(), (3,)])
def test_probability_targets_and_k_dimensional_losses(out_features: tuple[int, ...]) -> None:
    def make() -> nn.Module:
        return nn.LinearCrossEntropyLoss(IN, C, out_features=out_features, label_smoothing=0.1).double()

    target = torch.randn(B, N, C, *out_features, dtype=torch.float64).softmax(2)
    assert_equivalent(make, B, (torch.randn(B, N, IN, dtype=torch.float64), target), steps=2, **DOUBLE)


def test_an_input_without_a_batch_dim() -> None:
    """Each model's input a single ``(in_features,)`` sample and its target ``(C,)`` class probabilities
    (the merged input then has ``B * in_features`` rows, the target ``B * C``)."""

    def make() -> nn.Module:
        return nn.LinearCrossEntropyLoss(IN, C, reduction="none").double()

    target = torch.randn(B, C, dtype=torch.float64).softmax(1)
    assert_equivalent(make, B, (torch.randn(B, IN, dtype=torch.float64), target), steps=2, **DOUBLE)


class Classifier(nn.Module):
    """A body and a LinearCrossEntropyLoss head returning the loss, as a language model with a chunked head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, 8), nn.Tanh())
        self.head = nn.LinearCrossEntropyLoss(8, C, options=options(True))

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        return self.head(self.body(x), target)


def test_a_loss_head_inside_a_model() -> None:
    inputs = (torch.randn(B, N, IN, dtype=torch.float64), torch.randint(0, C, (B, N)))
    assert_equivalent(lambda: Classifier().double(), B, inputs, steps=3, **DOUBLE)


def test_a_target_without_the_models_rows_is_refused() -> None:
    layer = batch_layers.LinearCrossEntropyLoss(IN, C, batch=B)
    with pytest.raises(ValueError, match=r"expected the target's dim 0 to hold the B = 3 models' merged rows"):
        layer(torch.randn(B * N, IN), torch.randint(0, C, (7,)))
