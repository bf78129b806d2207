"""A parent that reads its children's parameters or buffers (``self.fc.weight.norm()``, a tied head
``h @ self.emb.weight.t()``) computes per model: found in its source at conversion, or at the first forward
where the source does not show it."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from torchmb import BatchModule
from torchmb.testing import assert_equivalent

B, N = 3, 4
DOUBLE = dict(atol=1e-9, rtol=1e-9)


def paths(batched: BatchModule) -> dict[str, tuple[str, str]]:
    return {entry.name: (entry.path, entry.reason) for entry in batched.conversion_report()}


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) / self.fc.weight.norm()


class TiedHead(nn.Module):
    """A language model whose output layer is its embedding table, read in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.tanh(self.mix(self.emb(ids))) @ self.emb.weight.t()


class SizedByTable(nn.Module):
    """CLIP's text embeddings in small: the table's length, read from its weight, bounds the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(6, 4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        longest = self.positions.weight.shape[0]
        ids = torch.arange(x.shape[1], device=x.device) % longest
        return self.fc(x) + self.positions(ids.expand(x.shape[0], -1))


class TypedByWeight(nn.Module):
    """Reads only what every model's slice shares with the stacked weight: stays on the merged axis."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.to(self.fc.weight.dtype).to(self.fc.weight.device))


def test_a_parent_reading_its_childs_weight_runs_per_model() -> None:
    batched = BatchModule.from_factory(Normed, B, seed=0)
    path, reason = paths(batched)[""]
    assert path == "generic-own"
    assert "forward reads self.fc.weight, a per-model tensor of a module below it" in reason
    assert paths(batched)["fc"][0] == "registered"
    assert_equivalent(lambda: Normed().double(), B, torch.randn(B, N, 4, dtype=torch.float64), steps=2, **DOUBLE)


@pytest.mark.parametrize("make", [TiedHead, SizedByTable])
def test_tied_heads_and_table_sizes_are_each_models(make: type[nn.Module]) -> None:
    if make is TiedHead:
        inputs = torch.randint(0, 10, (B, N, 5))
    else:
        inputs = torch.randn(B, N, 9, 4, dtype=torch.float64)
    assert paths(BatchModule(make(), B))[""][0] == "generic-own"
    assert_equivalent(lambda: make().double(), B, inputs, steps=2, **DOUBLE)


def test_shared_metadata_of_a_childs_weight_keeps_the_merged_axis() -> None:
    batched = BatchModule(TypedByWeight(), B)
    assert paths(batched)[""][0] == "passthrough"
    assert batched.generic_modules == []

