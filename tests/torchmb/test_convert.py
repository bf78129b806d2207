"""The conversion walk: its report, tied weights and parametrizations."""

from __future__ import annotations

import copy

import pytest
import torch
from support.models import WithCustom
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from torchmb import BatchModule, ConversionEntry
from torchmb.testing import assert_equivalent

B, N = 3, 4


def test_conversion_report_names_each_path_and_reason() -> None:
    batched = BatchModule(WithCustom(), B)
    report = {entry.name: entry for entry in batched.conversion_report()}
    assert report[""] == ConversionEntry("", "WithCustom", "passthrough", "no per-model state of its own", 0)
    assert report["fc"].path == "registered" and report["fc"].reason == "registered: Linear"
    assert report["fc"].parameters == 5 * 8 + 8
    assert report["film"].path == "generic-whole"
    assert report["film"].reason == "unregistered type FiLM; no registered layer below"
    assert report["film"].parameters == 16 and report["film"].generic
    assert batched.generic_modules == ["film"]
    assert "torch.func path: film" in repr(batched)
    assert "batched via torch.func (whole subtree)" in repr(batched.module.film)


def test_warns_when_most_parameters_go_generic() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(100))

        def forward(self, x: Tensor) -> Tensor:
            return x * self.w.flip(0)  # not element-wise alone: the module runs per model

    with pytest.warns(UserWarning, match=r"96% of the model's parameters .* largest: 1 \(unregistered type .*Scale;"):
        BatchModule(nn.Sequential(nn.Linear(1, 2), Scale()), B)


# -- tied weights -----------------------------------------------------------------------------------------


class TiedLM(nn.Module):
    """The decoder shares the embedding's weight, as LSTM and Transformer language models do."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.decoder = nn.Linear(d, vocab)
        self.decoder.weight = self.embedding.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.decoder(torch.tanh(self.mix(self.embedding(tokens))))


def test_tied_weights_stay_one_batched_parameter() -> None:
    batched = BatchModule(TiedLM(), B, init="independent", seed=0)
    assert batched.module.decoder.weight is batched.module.embedding.weight
    assert len(list(batched.parameters())) == len(list(TiedLM().parameters())) == 4
    state = batched.state_dict_of(1)
    assert set(state) == set(TiedLM().state_dict())
    assert torch.equal(state["decoder.weight"], state["embedding.weight"])
    plain = batched.unbatch(1)
    assert plain.decoder.weight is plain.embedding.weight


def test_tied_weights_train_as_the_plain_models() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (B, N, 5))
    assert_equivalent(TiedLM, B, tokens, steps=3, lr=0.5)
    batched = BatchModule(TiedLM(), B, init="independent", seed=0)
    optimizer = torch.optim.SGD(batched.parameters(), lr=0.5)
    batched(tokens).square().sum().backward()
    optimizer.step()
    assert batched.module.decoder.weight is batched.module.embedding.weight
    survivors = copy.deepcopy(batched).select([2, 0])
    assert survivors.module.decoder.weight is survivors.module.embedding.weight
    assert torch.equal(survivors.module.embedding.weight[0], batched.module.embedding.weight[2])
    reloaded = BatchModule(TiedLM(), B)
    reloaded.load_state_dicts(batched.state_dicts())
    assert reloaded.module.decoder.weight is reloaded.module.embedding.weight
    torch.testing.assert_close(reloaded(tokens), batched(tokens))


class Holder(nn.Module):
    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


class TiedAcrossPaths(nn.Module):
    """A generic module (Holder) holding a registered layer's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.holder = Holder(self.fc.weight)
        self.head = nn.Linear(4, 20)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.holder(self.fc(x)))


def test_tied_weight_across_a_generic_module() -> None:
    batched = BatchModule(TiedAcrossPaths(), B)
    assert batched.generic_modules == ["holder"]
    assert batched.module.holder.w is batched.module.fc.weight
    torch.manual_seed(0)
    assert_equivalent(TiedAcrossPaths, B, torch.randn(B, N, 4), steps=3)


# -- parametrizations -------------------------------------------------------------------------------------


class Symmetric(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def user_parametrized() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 9))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    return model


PARAMETRIZED = {
    "weight_norm": lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 9)),
    "spectral_norm": lambda: nn.Sequential(parametrizations.spectral_norm(nn.Linear(4, 5)), nn.Linear(5, 9)),
    "orthogonal": lambda: nn.Sequential(parametrizations.orthogonal(nn.Linear(4, 4)), nn.Linear(4, 9)),
    "user": user_parametrized,
}


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching")
@pytest.mark.parametrize("name", PARAMETRIZED)
def test_parametrizations_match_plain_models(name: str) -> None:
    make = PARAMETRIZED[name]
    batched = BatchModule(make(), B)
    entry = next(e for e in batched.conversion_report() if e.name == "0")
    assert entry.path == "generic-whole" and entry.reason.startswith("parametrized (weight)")
    assert set(batched.state_dicts()[0]) == set(make().state_dict())
    torch.manual_seed(0)
    report = assert_equivalent(lambda: make().double(), B, torch.randn(B, N, 4, dtype=torch.float64), steps=3)
    if name == "spectral_norm":  # its power-iteration vectors are buffers that move in training, per model
        assert "final model 2 0.parametrizations.weight.0._u" in report
        batched.load_state_dicts([make().state_dict() for _ in range(B)])
        batched(torch.randn(B, N, 4))
        u = batched.module[0].parametrizations.weight[0]._u
        assert u.shape == (B, 5) and not torch.equal(u[0], u[1])


def test_repr_lists_a_few_generic_modules() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x: Tensor) -> Tensor:
            return x * self.w.flip(0)  # not element-wise alone: the module runs per model

    batched = BatchModule(nn.Sequential(nn.Linear(2, 100), *(Scale() for _ in range(7))), B)
    assert "torch.func path: 1, 2, 3, 4, 5, ... (7 in all, see conversion_report())" in repr(batched)
