"""Stacking, unbinding, indexing and reordering per-model tensors along the merged sample axis (dim 0) in a
model's own code, found at the first forward: the module doing it runs per model and matches B plain models;
an index that keeps every model's rows with its model (``h[torch.arange(len(h)), positions]``) stays on the
merged axis."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from torchmb import BatchModule
from torchmb.testing import assert_equivalent, assert_isolated

B, N, D = 3, 4, 5
DOUBLE = dict(atol=1e-9, rtol=1e-9)


class Rows(nn.Module):
    """A Linear, then ``mix`` on its output rows, then a Linear."""

    def __init__(self, mix) -> None:
        super().__init__()
        self.first = nn.Linear(D, D)
        self.last = nn.Linear(D, 2)
        self.mix = mix

    def forward(self, x: Tensor) -> Tensor:
        return self.last(self.mix(self, self.first(x)))


def stack_then_flatten(model: Rows, h: Tensor) -> Tensor:
    both = torch.stack([h, torch.tanh(h)]).flatten(0, 1)  # (2n, D): every row of h, then every tanh row
    return model.first(both).view(2, -1, D).sum(0)


def stack_then_sum(model: Rows, h: Tensor) -> Tensor:
    return torch.stack([h, torch.tanh(h)], 0).sum(0)


def vstack_rows(model: Rows, h: Tensor) -> Tensor:
    return model.first(torch.vstack([h, h.exp()]))[: h.shape[0]]


def unbind_rows(model: Rows, h: Tensor) -> Tensor:
    rows = h.unbind(0)
    return torch.stack([row * rows[0] for row in rows])


def iterate_rows(model: Rows, h: Tensor) -> Tensor:
    return torch.stack([row - h[-1] for row in h])


def first_half_twice(model: Rows, h: Tensor) -> Tensor:
    half = h[: h.shape[0] // 2]
    return torch.cat([half, half * 2], 1).view(-1, D)


def reversed_by_index(model: Rows, h: Tensor) -> Tensor:
    return h[torch.arange(h.shape[0]).flip(0)]


def reversed_by_list(model: Rows, h: Tensor) -> Tensor:
    return h + h[list(range(h.shape[0] - 1, -1, -1))]


def index_select_first_row(model: Rows, h: Tensor) -> Tensor:
    return h - h.index_select(0, torch.zeros(h.shape[0], dtype=torch.long))


def minus_first_sample(model: Rows, h: Tensor) -> Tensor:
    return h - h[0]


def flipped(model: Rows, h: Tensor) -> Tensor:
    return h * h.flip(0)


def rolled(model: Rows, h: Tensor) -> Tensor:
    return h - torch.roll(h, 1, 0)


def selected_by_mask(model: Rows, h: Tensor) -> Tensor:
    return h * h[h[:, 0] > 0].sum(0)


CASES = [
    (stack_then_flatten, "stack along dim 0"),
    (stack_then_sum, "stack along dim 0"),
    (vstack_rows, "vstack along dim 0"),
    (unbind_rows, "unbind along dim 0"),
    (iterate_rows, "unbind along dim 0"),
    (first_half_twice, "indexing [:6] of dim 0"),
    (reversed_by_index, "indexing dim 0 with an index tensor of shape (12,)"),
    (reversed_by_list, "indexing dim 0 with an index tensor of shape (12,)"),
    (index_select_first_row, "index_select along dim 0"),
    (minus_first_sample, "indexing [0] of dim 0"),
    (flipped, "flip along dim 0"),
    (rolled, "roll along dim 0"),
]


@pytest.mark.parametrize(("mix", "found"), CASES, ids=[mix.__name__ for mix, _ in CASES])
def test_rows_moved_along_the_sample_axis_stay_with_their_model(mix, found: str) -> None:
    torch.manual_seed(0)
    batched = BatchModule(Rows(mix), B)
    batched(torch.randn(B, N, D))
    (entry,) = [entry for entry in batched.conversion_report() if entry.name == ""]
    assert entry.path == "generic-own"
    assert "at the first forward" in entry.reason and found in entry.reason
    assert_equivalent(lambda: Rows(mix).double(), B, torch.randn(B, N, D, dtype=torch.float64), steps=2, **DOUBLE)


def test_the_models_stay_isolated() -> None:
    torch.manual_seed(0)
    assert_isolated(BatchModule(Rows(stack_then_flatten).double(), B), torch.randn(B, N, D, dtype=torch.float64))


class LastToken(nn.Module):
    """transformers' pooling of each sequence's last real token: ``h[torch.arange(len(h)), positions]``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = self.fc(x)
        return h[torch.arange(h.shape[0]), lengths.squeeze(1) - 1]


def test_an_index_keeping_each_models_rows_stays_on_the_merged_axis() -> None:
    torch.manual_seed(0)
    x, lengths = torch.randn(B, N, 6, D, dtype=torch.float64), torch.randint(1, 7, (B, N, 1))
    batched = BatchModule(LastToken().double(), B)
    batched(x, lengths)
    assert [entry.path for entry in batched.conversion_report()] == ["passthrough", "registered"]
    assert_equivalent(lambda: LastToken().double(), B, (x, lengths), steps=2, **DOUBLE)


def test_a_mask_of_data_dependent_rows_is_refused_where_vmap_cannot_run_it() -> None:
    """Indexing by a per-model mask has a shape that depends on each model's data: a module with batched layers
    below it runs under vmap, which refuses it, so the first forward raises naming the way out."""
    batched = BatchModule(Rows(selected_by_mask), B)
    with pytest.raises(RuntimeError, match=r"Rows runs per model under torch.func.vmap .* Keep the shapes fixed"):
        batched(torch.randn(B, N, D))


class MaskedSum(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return selected_by_mask(self, h)


def test_a_mask_in_a_module_without_state_runs_one_model_after_the_other() -> None:
    make = lambda: nn.Sequential(nn.Linear(D, D), MaskedSum(), nn.Linear(D, 2)).double()  # noqa: E731
    torch.manual_seed(0)
    batched = BatchModule(make(), B)
    batched(torch.randn(B, N, D, dtype=torch.float64))
    entry = {entry.name: entry for entry in batched.conversion_report()}["1"]
    assert entry.path == "generic-whole" and "indexing dim 0 with a boolean mask" in entry.reason
    assert_equivalent(make, B, torch.randn(B, N, D, dtype=torch.float64), steps=2, **DOUBLE)
