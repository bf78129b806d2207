"""``select(keep)`` shrinks every layer to the survivors at once, with graphs alive or an error midway."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchmb import BatchModule


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 3))


def _shapes(batched: BatchModule) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in batched.state_dict().items()}


def test_select_with_a_live_validation_graph_shrinks_every_layer() -> None:
    batched = BatchModule(_model(), 4, init="independent", seed=0)
    tokens = torch.randint(0, 10, (4, 5, 2))
    validation = batched(tokens).square().mean(dim=(1, 2))  # computed without no_grad: its graph is alive
    survivors = [batched.state_dict_of(i) for i in (3, 1)]
    batched.select([3, 1])
    assert batched.batch == 2
    assert all(shape[0] == 2 for shape in _shapes(batched).values())
    for j, state in enumerate(survivors):
        for key, value in batched.state_dict_of(j).items():
            assert torch.equal(value, state[key]), key
    batched(tokens[[3, 1]]).sum().backward()
    assert batched.module[2].weight.grad.shape == (2, 3, 8)
    with pytest.raises(RuntimeError, match=r"graph built before BatchModule.select\(\)"):
        validation.sum().backward()


def test_select_that_fails_midway_leaves_the_module_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    batched = BatchModule(_model(), 4, init="independent", seed=0)
    before = {key: value.clone() for key, value in batched.state_dict().items()}
    is_per_model = BatchModule._is_per_model
    calls = []

    def fail_on_the_third_entry(self: BatchModule, key: str, value: torch.Tensor) -> bool:
        calls.append(key)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return is_per_model(self, key, value)

    monkeypatch.setattr(BatchModule, "_is_per_model", fail_on_the_third_entry)
    with pytest.raises(RuntimeError, match="injected failure"):
        batched.select([0, 2])
    monkeypatch.undo()
    assert batched.batch == 4
    assert all(layer.batch == 4 for layer in (batched.module[0], batched.module[2]))
    for key, value in batched.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert batched(torch.randint(0, 10, (4, 5, 2))).shape == (4, 5, 3)
