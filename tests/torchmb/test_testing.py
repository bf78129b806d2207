"""``torchmb.testing`` fails every kind of model that is not B independent models, deterministically.

Each test below feeds a checker a model that breaks exactly one thing, so that each check (outputs,
gradients, buffers, decisions, the comparison with plain models) is the only one that can catch it:
turning that check off makes its test fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchmb
from batch_layers import current_forward
from torchmb import BatchModule
from torchmb.testing import assert_equivalent, assert_isolated

B, N = 4, 3


class LeaksIntoAnOutput(nn.Module):
    """A second output holds every model's mean; the loss reads only the first, so no gradient leaks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, y.detach().mean(0, keepdim=True).expand_as(y)


def _first_output_loss(output: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return output[0].square().mean()


class _MixGradients(torch.autograd.Function):
    """The identity forward; backward adds the mean gradient over dim 0, the merged model axis."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad + grad.mean(0, keepdim=True)


class LeaksIntoGradients(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 4)
        self.second = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_MixGradients.apply(self.first(x)))


class LeaksIntoABuffer(nn.Module):
    """Counts the data it sees in a buffer; the outputs and gradients never read it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.detach().abs().mean())
        return self.fc(x)


class LeaksIntoBatchNormStatistics(nn.Module):
    """Feeds a batch norm (in training mode) every model's mean; only its running statistics see it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)
        self.norm = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.norm(x.detach() + x.detach().mean(0, keepdim=True))
        return self.fc(x)


class PooledWhere(nn.Module):
    """Chooses a branch on the sign of a statistic of all models' data with tensor ops (no Python bool)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return torch.where(h.mean() > 0, self.b(h), -self.b(h))


class PooledIf(PooledWhere):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if h.mean() > 0 else -self.b(h)


def _independent_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def _isolated(make: Callable[[], nn.Module], seed: int = 0, **kwargs: object) -> None:
    torch.manual_seed(seed)
    batched = BatchModule.from_factory(make, B, seed=seed)
    batched(torch.randn(B, N, 5))  # a first forward, so that BatchModule's own check is behind it
    assert_isolated(batched, torch.randn(B, N, 5), **kwargs)


def test_assert_isolated_passes_independent_models() -> None:
    _isolated(_independent_mlp)


def test_a_leak_into_an_output_fails_the_output_check() -> None:
    with pytest.raises(AssertionError, match=r"output 1 of model \d changed"):
        _isolated(LeaksIntoAnOutput, loss_fn=_first_output_loss)


def test_a_leak_into_gradients_fails_the_gradient_check() -> None:
    with pytest.raises(AssertionError, match=r"gradient of first\.(weight|bias) of model \d changed"):
        _isolated(LeaksIntoGradients)


def test_a_buffer_shared_by_the_models_is_refused_before_the_buffer_check() -> None:
    # A module without parameters above registered layers keeps its buffers once; conversion's guard refuses
    # the pooled update in forward, before assert_isolated would see it (its buffer check: the next test).
    with pytest.raises(RuntimeError, match=r"LeaksIntoABuffer changed its buffers seen in forward"):
        _isolated(LeaksIntoABuffer)


def test_a_leak_into_per_model_buffers_fails_the_buffer_check() -> None:
    with pytest.raises(AssertionError, match=r"buffer norm\.running_mean of model \d changed"):
        _isolated(LeaksIntoBatchNormStatistics)


@pytest.mark.parametrize("seed", range(8))
def test_a_decision_pooled_by_tensor_ops_fails_for_every_seed(seed: int) -> None:
    with pytest.raises(AssertionError, match=r"input (replaced|scaled by -?1000): output 0 of model \d changed"):
        _isolated(PooledWhere, seed=seed)


@pytest.mark.parametrize("seed", range(8))
def test_a_python_decision_on_pooled_data_fails_for_every_seed(seed: int) -> None:
    torch.manual_seed(seed)
    batched = BatchModule.from_factory(PooledIf, B, seed=seed)
    with torch.no_grad():  # models that decide differently: a decision every model takes alike is allowed
        batched.module.a.bias[0] += 100.0
        batched.module.a.bias[1] -= 100.0
    x = torch.randn(B, N, 5)
    with torchmb.allow_pooled_decisions():
        batched(x)  # passes BatchModule's own check of its first forward: the checkers must look themselves
    with pytest.raises(AssertionError, match=r"not B independent models: __bool__ of a tensor holding several"):
        assert_isolated(batched, x)
    signs = itertools.cycle([1.0, -1.0])  # every other model built decides the other way

    def disagreeing() -> nn.Module:
        model = PooledIf()
        with torch.no_grad():
            model.a.bias += 100.0 * next(signs)
        return model

    with pytest.raises(AssertionError, match=r"not B independent models: __bool__ of a tensor holding several"):
        assert_equivalent(disagreeing, B, x, steps=1)


class DiffersWhenBatched(nn.Module):
    """A plain model that computes something else inside a batched forward: outputs differ."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y + 1e-3 if current_forward() is not None else y


class _ScaleGradientWhenBatched(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        ctx.scale = 1.01 if current_forward() is not None else 1.0
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * ctx.scale


class GradientDiffersWhenBatched(nn.Module):
    """Same outputs, but the batched gradients are scaled: only the gradient comparison sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGradientWhenBatched.apply(self.fc(x))


def test_assert_equivalent_passes_an_equivalent_model() -> None:
    report = assert_equivalent(_independent_mlp, B, torch.randn(B, N, 5))
    assert report


def test_assert_equivalent_fails_a_model_whose_outputs_differ() -> None:
    with pytest.raises(AssertionError, match=r"step 0 model 0 output 0: batched and plain differ"):
        assert_equivalent(DiffersWhenBatched, B, torch.randn(B, N, 5), steps=1)


def test_assert_equivalent_fails_a_model_whose_gradients_differ() -> None:
    with pytest.raises(AssertionError, match=r"step 0 model 0 grad fc\.(weight|bias): batched and plain differ"):
        assert_equivalent(GradientDiffersWhenBatched, B, torch.randn(B, N, 5), steps=1)


class LeaksIntoLaterModels(nn.Module):
    """A cumulative sum over dim 0, the merged model axis: each model's output holds every earlier model's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y + 0.1 * y.detach().cumsum(0)


class LeaksIntoEarlierModels(LeaksIntoLaterModels):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        # A sum over every later row, as a product with a constant matrix: a mix of rows that the first
        # forward's checks do not look for (they look for cat, slices, flips), assert_isolated's to catch.
        later = torch.ones(y.shape[0], y.shape[0], dtype=y.dtype).triu()
        return y + 0.1 * later @ y.detach()


class LeaksIntoModelZero(LeaksIntoLaterModels):
    """The last model's rows are added to the first model's, and to no other's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        rows = y.shape[0] // B
        # A constant permutation matrix moves the last model's rows to the first model's place (a shuffle that
        # the first forward's checks do not look for, as they look for cat, slices and rolls: assert_isolated's
        # to catch).
        first = (torch.arange(y.shape[0]) < rows).unsqueeze(1)
        rolled = torch.eye(y.shape[0], dtype=y.dtype).roll(rows, 0)
        return y + 0.1 * first * (rolled @ y.detach())


def test_a_leak_into_later_models_only_is_caught_by_default() -> None:
    with pytest.raises(AssertionError, match=r"output 0 of model [123] changed when model 0 was disturbed"):
        _isolated(LeaksIntoLaterModels)


def test_a_leak_into_earlier_models_only_is_caught_by_default() -> None:
    with pytest.raises(AssertionError, match=r"output 0 of model [012] changed when model 3 was disturbed"):
        _isolated(LeaksIntoEarlierModels)


def test_model_zero_is_compared_too() -> None:
    with pytest.raises(AssertionError, match=r"output 0 of model 0 changed when model 3 was disturbed"):
        _isolated(LeaksIntoModelZero, model=-1)


def test_assert_isolated_leaves_the_random_state_as_it_found_it() -> None:
    batched = BatchModule.from_factory(_independent_mlp, B, seed=0)
    x = torch.randn(B, N, 5)
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    assert_isolated(batched, x, seed=7)
    assert torch.equal(torch.rand(5), expected)
