"""Independent initialisation: model ``i`` is the plain model constructed after ``manual_seed(seed + i)``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchmb import BatchModule


class TinyGPT(nn.Module):
    """Initialises itself as GPT-2 does: ``normal_(std=0.02)``, zero biases, a bare position table."""

    def __init__(self, vocab: int = 11, dim: int = 8, seq: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.01)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(tokens) + self.pos[: tokens.shape[-1]])))


def test_from_factory_equals_plain_constructions_with_seed_plus_index() -> None:
    batched = BatchModule.from_factory(TinyGPT, 3, seed=7)
    for i in range(3):
        torch.manual_seed(7 + i)
        plain = TinyGPT()
        got = batched.state_dict_of(i)
        for key, value in plain.state_dict().items():
            assert torch.equal(got[key], value), (i, key)
    tokens = torch.randint(0, 11, (3, 2, 5))
    torch.manual_seed(8)
    torch.testing.assert_close(batched(tokens)[1], TinyGPT()(tokens[1]), rtol=0, atol=1e-6)


def test_from_factory_builds_one_model_at_a_time_and_restores_the_random_state() -> None:
    built = []

    def make_model() -> nn.Module:
        assert len(built) < 2 or built[-2] is None  # the model before the last one was freed
        built.append(TinyGPT())
        if len(built) > 1:
            built[-2] = None
        return built[-1]

    state = torch.get_rng_state()
    BatchModule.from_factory(make_model, 4, seed=0)
    assert len(built) == 4
    assert torch.equal(torch.get_rng_state(), state)


def test_from_factory_refuses_what_is_not_a_factory() -> None:
    with pytest.raises(TypeError, match="callable that builds one model"):
        BatchModule.from_factory(TinyGPT(), 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must return an nn\.Module"):
        BatchModule.from_factory(lambda: 3, 2)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match=r"use BatchModule\.from_factory"):
        BatchModule(TinyGPT, 2)  # type: ignore[arg-type]


def test_independent_init_of_an_instance_warns_about_what_reset_parameters_misses() -> None:
    with pytest.warns(UserWarning, match=r"identical in all 3 models: pos\. BatchModule.from_factory"):
        batched = BatchModule(TinyGPT(), 3, init="independent", seed=0)
    assert torch.equal(batched.state_dict_of(0)["pos"], batched.state_dict_of(2)["pos"])
