"""Python control flow on several models' data is refused at the first forward, never pooled silently."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchmb
from torchmb import BatchModule, PooledDecisionError

B = 3


class DataGate(nn.Module):
    """Takes one of two branches on the sign of a hidden mean: per model in a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.mean() > 0:
            return self.b(h)
        return self.c(h)


class LoopsOnData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(int(self.a(x).abs().sum().item()) % 3):
            x = x * 2
        return self.a(x)


class AssertsOnData(nn.Module):
    """A check that must hold for every model: one decision for all models is what the author means."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torchmb.allow_pooled_decisions():
            assert torch.isfinite(h).all()
        return h


@pytest.mark.parametrize("make", [DataGate, LoopsOnData], ids=["if", "item"])
@pytest.mark.parametrize("shared_input", [False, True], ids=["per-model", "shared"])
def test_a_decision_on_several_models_data_is_refused_at_the_first_forward(make: type, shared_input: bool) -> None:
    batched = BatchModule(make(), B, init="independent", seed=0)
    with torch.no_grad():  # the models' hidden means take opposite signs: their decisions differ
        batched.module.a.bias.copy_(torch.tensor([10.0, -10.0, 10.0]).unsqueeze(1))
    x = torch.randn(5, 4) if shared_input else torch.randn(B, 5, 4)
    refused = r"test_control_flow.py:\d+\): Python control flow on it would decide once for all models"
    with pytest.raises(PooledDecisionError, match=refused):
        batched(x, shared_input=shared_input)
    with pytest.raises(PooledDecisionError):  # until a forward has passed the check
        batched(x, shared_input=shared_input)


def test_decisions_on_the_shared_input_and_on_constants_are_the_same_for_every_model() -> None:
    class SharedGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 2)
            self.register_buffer("limit", torch.tensor(100.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.abs().max() > self.limit:  # the shared input: every model sees the same data
                x = x.clamp(-1, 1)
            return self.a(x)

    batched = BatchModule(SharedGate(), B, init="independent", seed=0)
    x = torch.randn(5, 4)
    torch.testing.assert_close(batched(x, shared_input=True)[2], batched.unbatch(2)(x), rtol=0, atol=1e-6)


def test_allowed_decisions_and_library_checks_pass() -> None:
    batched = BatchModule(AssertsOnData(), B, init="independent", seed=0)
    assert batched(torch.randn(B, 5, 4)).shape == (B, 5, 2)
    embedding = BatchModule(nn.Embedding(10, 3), B)  # its index checks look at every model's indices
    assert embedding(torch.randint(0, 10, (B, 5))).shape == (B, 5, 3)
