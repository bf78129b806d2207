"""BatchModule and the batched optimizers meet an offloaded embedding (rows on the host, no model axis)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batch_layers
import torchmb
from torchmb import BatchModule


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def offloaded_model() -> BatchModule:
    batched = BatchModule(Bag(), 3, init="independent", seed=0)
    batched.module.embed = batch_layers.Embedding.from_module(batched.module.embed, 3, offload=True)
    return batched


def test_select_refuses_before_changing_anything() -> None:
    batched = offloaded_model()
    before = batched.state_dicts()
    with pytest.raises(NotImplementedError, match="cannot shrink embed: an offloaded embedding"):
        batched.select([0, 2])
    assert batched.batch == 3
    after = batched.state_dicts()
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)


def test_working_rows_are_refused_by_per_model_tools() -> None:
    rows = nn.Parameter(torch.zeros(3, 4))  # as many rows as models: must not be mistaken for a model axis
    rows.no_model_axis = True
    rows.grad = torch.ones(3, 4)
    with pytest.raises(ValueError, match="working rows have no model axis"):
        torchmb.optim.SGD([rows], lr=0.1)
    with pytest.raises(ValueError, match="working rows have no model axis"):
        torchmb.clip.clip_grad_norm_([rows], 1.0)
    with pytest.raises(ValueError, match="working rows have no model axis"):
        torchmb.clip.diverged(parameters=[rows])


def test_unbatch_of_an_offloaded_model_is_a_plain_model() -> None:
    batched = offloaded_model()
    tokens = torch.randint(0, 10, (3, 5, 6))
    out = batched(tokens)
    for i in range(3):
        plain = batched.unbatch(i)
        assert type(plain) is Bag
        torch.testing.assert_close(plain(tokens[i]), out[i], atol=1e-6, rtol=0)
