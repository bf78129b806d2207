"""The shared input is recognised by identity, through the parameter-free ops before the first layer."""

from __future__ import annotations

import torch
from torch import nn

from torchmb import BatchModule

B = 4


class FlattenTokens(nn.Module):
    """``(n, seq, d)`` to ``(n * seq, d)`` before the first layer, as a token-wise model may do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.relu(x.flatten(0, 1) / 2)
        return self.proj(rows).view(-1, x.shape[1] * 5)


def _plain_outputs(batched: BatchModule, x: torch.Tensor) -> torch.Tensor:
    return torch.stack([batched.unbatch(i)(x) for i in range(batched.batch)])


def test_shared_input_flattened_to_a_multiple_of_the_batch_is_still_shared() -> None:
    x = torch.randn(2, 2 * B, 3)  # seq = 2B: (n * seq) rows is a multiple of B * n
    batched = BatchModule(FlattenTokens(), B, init="independent", seed=0)
    out = batched(x, shared_input=True)
    assert out.shape == (B, 2, 2 * B * 5)
    torch.testing.assert_close(out, _plain_outputs(batched, x), rtol=0, atol=1e-6)
    torch.testing.assert_close(out, batched(x.expand(B, *x.shape)), rtol=0, atol=1e-6)


class SharedMeetsModels(nn.Module):
    """A tensor computed from the shared input meets one computed by the models: the result is per model."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.flatten(0, 1)
        return self.second(self.first(rows) * rows.mean())


def test_a_tensor_mixing_shared_and_per_model_data_is_per_model() -> None:
    x = torch.randn(2, B, 3)
    batched = BatchModule(SharedMeetsModels(), B, init="independent", seed=0)
    out = batched(x, shared_input=True)
    torch.testing.assert_close(out, _plain_outputs(batched, x), rtol=0, atol=1e-6)
