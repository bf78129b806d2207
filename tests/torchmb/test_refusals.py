"""State-changing calls (loads, selects, copies between slots) check their whole input first: a refused call
changes nothing, and the object still steps as it did. Inputs that torch would read one way and batching
another (a 0/1 list, fractional indices, a slot named twice) are refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import torchmb
from torchmb import BatchModule, sweep
from torchmb.amp import GradScaler
from torchmb.lr_scheduler import ExponentialLR, MultiStepLR, StepLR


def _trained(batch: int, steps: int = 2) -> tuple[BatchModule, torchmb.optim.Adam]:
    models = BatchModule(nn.Linear(3, 2), batch, init="independent", seed=batch)
    optimizer = torchmb.optim.Adam(models.parameters(), lr=[0.01 * (i + 1) for i in range(batch)])
    for _ in range(steps):
        _step(models, optimizer)
    return models, optimizer


def _step(models: BatchModule, optimizer: torchmb.optim.BatchOptimizer) -> None:
    optimizer.zero_grad()
    generator = torch.Generator().manual_seed(0)
    models(torch.randn(models.batch, 5, 3, generator=generator)).square().sum().backward()
    optimizer.step()


def _tensors(state: object) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_flatten(state)[0]
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _assert_same(a: object, b: object) -> None:
    left, right = _tensors(a), _tensors(b)
    assert len(left) == len(right)
    assert all(torch.equal(x, y) for x, y in zip(left, right))


def _steps_as_before(models: BatchModule, optimizer: torchmb.optim.BatchOptimizer, before: tuple) -> None:
    """``models`` and ``optimizer`` step exactly as the copies ``before`` taken ahead of a refused call."""
    reference_models, reference_optimizer = before
    _step(models, optimizer)
    _step(reference_models, reference_optimizer)
    _assert_same(models.state_dict(), reference_models.state_dict())
    _assert_same(optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"])


def test_optimizer_state_of_8_models_is_refused_by_4_with_nothing_changed() -> None:
    models, optimizer = _trained(4)
    _, other = _trained(8)
    before = copy.deepcopy((models, optimizer))
    with pytest.raises(ValueError, match=r"the state holds B = 8 models, this optimizer B = 4"):
        optimizer.load_state_dict(other.state_dict())
    _assert_same(optimizer.state_dict(), before[1].state_dict())
    _steps_as_before(models, optimizer, before)


def test_optimizer_state_with_a_bad_value_or_shape_is_refused_with_nothing_changed() -> None:
    models, optimizer = _trained(4)
    before = copy.deepcopy((models, optimizer))
    negative = copy.deepcopy(optimizer.state_dict())
    negative["param_groups"][0]["lr"] = torch.tensor([0.1, -0.1, 0.1, 0.1], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Invalid lr.*models \[1\]"):
        optimizer.load_state_dict(negative)
    short = copy.deepcopy(optimizer.state_dict())
    short["state"][0]["exp_avg"] = short["state"][0]["exp_avg"][:2]
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 has shape \(2, 2, 3\), expected \(4, 2, 3\)"):
        optimizer.load_state_dict(short)
    _assert_same(optimizer.state_dict(), before[1].state_dict())
    _steps_as_before(models, optimizer, before)


def test_scheduler_state_of_8_models_is_refused_by_4_with_nothing_changed() -> None:
    _, optimizer = _trained(4)
    scheduler = StepLR(optimizer, step_size=1, gamma=[0.5, 0.6, 0.7, 0.8])
    _, other_optimizer = _trained(8)
    other = StepLR(other_optimizer, step_size=2, gamma=0.9)
    before = scheduler.state_dict()
    with pytest.raises(ValueError, match=r"the state holds B = 8 models \(base_lrs\), this scheduler B = 4"):
        scheduler.load_state_dict(other.state_dict())
    with pytest.raises(KeyError, match="not a StepLR state"):
        scheduler.load_state_dict(ExponentialLR(optimizer, gamma=0.5).state_dict())
    _assert_same(scheduler.state_dict(), before)
    lrs = optimizer.get_hyperparameter("lr")
    scheduler.step()
    gammas = torch.tensor([0.5, 0.6, 0.7, 0.8], dtype=torch.float64)
    assert torch.equal(optimizer.get_hyperparameter("lr"), lrs * gammas)


def test_grad_scaler_state_of_8_models_is_refused_by_4_with_nothing_changed() -> None:
    scaler = GradScaler("cpu", init_scale=[1.0, 2.0, 4.0, 8.0])
    scaler.scale(torch.ones(4))
    other = GradScaler("cpu", init_scale=16.0)
    other.scale(torch.ones(8))
    with pytest.raises(ValueError, match=r"the state holds B = 8 models, this scaler B = 4"):
        scaler.load_state_dict(other.state_dict())
    incomplete = dict(other.state_dict())
    del incomplete["_growth_tracker"]
    with pytest.raises(KeyError, match=r"lacks \['_growth_tracker'\]"):
        scaler.load_state_dict(incomplete)
    assert scaler.get_scale().tolist() == [1.0, 2.0, 4.0, 8.0]
    assert scaler.scale(torch.ones(4)).tolist() == [1.0, 2.0, 4.0, 8.0]


def test_sweep_select_is_all_or_nothing() -> None:
    models, optimizer = _trained(4)
    scheduler = ExponentialLR(optimizer, gamma=0.9)
    before = copy.deepcopy((models, optimizer))
    with pytest.raises(ValueError, match="integer model indices"):
        sweep.select([0.0, 2.0], models, optimizer, scheduler)
    _, three = _trained(3)
    with pytest.raises(ValueError, match=r"different numbers of models \(BatchModule B = 4, Adam B = 3\)"):
        sweep.select([0, 1], models, three)
    assert models.batch == optimizer.batch == scheduler.batch == 4
    _steps_as_before(models, optimizer, before)


def test_every_select_reads_keep_alike_and_refuses_repeats_and_fractions() -> None:
    models, optimizer = _trained(4)
    scheduler = ExponentialLR(optimizer, gamma=0.9)
    scaler = GradScaler("cpu", batch=4)
    for selectable in (models, optimizer, scheduler, scaler):
        with pytest.raises(ValueError, match=r"models \[1\] repeated.*dtype=torch.bool"):
            selectable.select([1, 0, 1, 1])
        with pytest.raises(ValueError, match="integer model indices"):
            selectable.select([0.5, 1.7])
    survivors = [models.state_dict_of(i) for i in (0, 2, 3)]
    sweep.select(torch.tensor([1, 0, 1, 1], dtype=torch.bool), models, optimizer, scheduler, scaler)
    assert models.batch == optimizer.batch == scheduler.batch == scaler.batch == 3
    for i, state in enumerate(survivors):
        _assert_same(models.state_dict_of(i), state)


def test_grad_scaler_select_before_its_first_scale_learns_the_survivors_b_later() -> None:
    scaler = GradScaler("cpu")
    scaler.select([0, 2])
    assert scaler.scale(torch.ones(2)).tolist() == [2.0**16, 2.0**16]


def test_load_state_dicts_writes_each_state_into_its_own_slot() -> None:
    plain = [nn.Linear(3, 2) for _ in range(2)]
    models = BatchModule(nn.Linear(3, 2), 4, init="independent", seed=0)
    untouched = [models.state_dict_of(i) for i in (0, 2)]
    models.load_state_dicts([plain[0].state_dict(), plain[1].state_dict()], slots=[3, 1])
    _assert_same(models.state_dict_of(3), plain[0].state_dict())
    _assert_same(models.state_dict_of(1), plain[1].state_dict())
    _assert_same([models.state_dict_of(0), models.state_dict_of(2)], untouched)


def test_load_state_dicts_refuses_a_slot_named_twice_and_bad_counts() -> None:
    models = BatchModule(nn.Linear(3, 2), 4, init="independent", seed=0)
    before = models.state_dicts()
    states = [nn.Linear(3, 2).state_dict() for _ in range(2)]
    with pytest.raises(ValueError, match=r"models \[2\] repeat in \[2, 2\]"):
        models.load_state_dicts(states, slots=[2, 2])
    with pytest.raises(ValueError, match=r"expected 4 state dicts \(one per model, B = 4\).*got a sequence of 0"):
        models.load_state_dicts([])
    with pytest.raises(ValueError, match=r"expected 3 state dicts \(one per slot\)"):
        models.load_state_dicts(states, slots=[0, 1, 3])
    with pytest.raises(TypeError, match=r"model index must be an int in \[-4, 4\), got 1.0"):
        models.load_state_dicts(states, slots=[1.0, 2])
    _assert_same(models.state_dicts(), before)


class AddsATable(nn.Module):
    """No parameters of its own above a registered layer: its buffer is one constant for all models."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("table", torch.arange(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.table


def test_load_state_dicts_checks_entries_stored_once_before_writing_any() -> None:
    plain = nn.Sequential(nn.Linear(3, 2), AddsATable())
    models = BatchModule(plain, 2, init="independent", seed=0)
    before = models.state_dicts()
    other = copy.deepcopy(plain)
    other[1].table += 1
    with pytest.raises(ValueError, match=r"'1\.table' is stored once for all models; the state dicts disagree"):
        models.load_state_dicts([nn.Sequential(nn.Linear(3, 2), AddsATable()).state_dict(), other.state_dict()])
    _assert_same(models.state_dicts(), before)


def test_grad_scaler_copies_refuse_a_destination_named_twice() -> None:
    scaler = GradScaler("cpu", init_scale=[1.0, 2.0, 4.0])
    scaler.scale(torch.ones(3))
    with pytest.raises(ValueError, match=r"dst: each model may be named once, got \[1, 1\]"):
        scaler.load_model_state([1, 1], src=[0, 2])
    assert scaler.get_scale().tolist() == [1.0, 2.0, 4.0]


def test_load_model_state_refuses_a_destination_named_twice() -> None:
    models, optimizer = _trained(4)
    before = copy.deepcopy((models, optimizer))
    with pytest.raises(ValueError, match=r"dst: each model may be named once, got \[0, 0\]"):
        optimizer.load_model_state([0, 0], None, [1, 2])
    _assert_same(optimizer.state_dict(), before[1].state_dict())
    optimizer.load_model_state([1, 2], None, [0, 0])  # one source copied twice is fine
    state = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(state[1], state[0]) and torch.equal(state[2], state[0])


def test_unbatch_keeps_the_batched_dtype_and_wants_an_int() -> None:
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    models = BatchModule(plain, 2, init="independent", seed=0)
    models.double()
    reference = copy.deepcopy(plain).double()
    reference.load_state_dict(models.state_dict_of(1))
    model = models.unbatch(1)
    assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} == {torch.float64}
    x = torch.randn(5, 3, dtype=torch.float64)
    assert torch.equal(model(x), reference(x))
    with pytest.raises(TypeError, match=r"model index must be an int in \[-2, 2\), got 1.0 \(float\)"):
        models.unbatch(1.0)
    with pytest.raises(TypeError, match="got True"):
        models.state_dict_of(True)
    assert torch.equal(models.unbatch(torch.tensor(1))(x), reference(x))


def test_unbatch_keeps_tied_parameters_tied_when_casting() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    models = BatchModule(Tied(), 2).double()
    model = models.unbatch(0)
    assert model.a.weight is model.b.weight and model.a.weight.dtype == torch.float64


@pytest.mark.parametrize(
    "make", [ExponentialLR, lambda o, gamma: StepLR(o, 1, gamma), lambda o, gamma: MultiStepLR(o, [1], gamma)]
)
def test_schedulers_refuse_a_negative_decay(make) -> None:
    _, optimizer = _trained(4, steps=0)
    with pytest.raises(ValueError, match=r"Invalid gamma: .* got \[-0.5\] for models \[1\]"):
        make(optimizer, gamma=[0.9, -0.5, 0.9, 0.9])
    lrs = torch.tensor([0.01, 0.02, 0.03, 0.04], dtype=torch.float64)
    assert torch.equal(optimizer.get_hyperparameter("lr"), lrs)


class CreatesAParameterInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.scale = nn.Parameter(torch.ones(2))
        return self.fc(x) * self.scale


def test_a_parameter_created_in_forward_after_conversion_is_refused_there() -> None:
    models = BatchModule(nn.Sequential(CreatesAParameterInForward()), 3)
    with pytest.raises(RuntimeError, match=r"parameter 'scale' of 0 \(CreatesAParameterInForward\) was created in"):
        models(torch.randn(3, 4, 3))
    assert [name for name, _ in models.named_parameters()] == ["module.0.fc.weight", "module.0.fc.bias"]


def test_a_parameter_created_by_a_forward_before_conversion_is_per_model() -> None:
    plain = CreatesAParameterInForward()
    plain(torch.randn(4, 3))
    references = [copy.deepcopy(plain) for _ in range(3)]
    models = BatchModule(plain, 3)
    x = torch.randn(3, 4, 3)
    models(x).square().sum().backward()
    for i, reference in enumerate(references):
        reference(x[i]).square().sum().backward()
        assert torch.allclose(models.module.scale.grad[i], reference.scale.grad)
    models.module.fc.scale = nn.Parameter(torch.ones(3, 2))  # outside forward: the user's own batched parameter


@pytest.fixture
def optuna():
    optuna = pytest.importorskip("optuna", reason="the [sweep] extra (Optuna) is not installed")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def test_report_fails_trials_that_report_inf_or_nan(optuna) -> None:
    study = sweep.create_study("refusals", storage=None)
    trials = sweep.TrialBatch(study, 4, {"x": optuna.distributions.FloatDistribution(0, 1)})
    numbers = trials.numbers
    keep = trials.report(torch.tensor([0.5, math.inf, -math.inf, math.nan]), step=0)
    assert keep.tolist() == [0]
    assert trials.numbers == numbers[:1]
    states = {t.number: t.state for t in study.get_trials()}
    assert [states[n] for n in numbers[1:]] == [optuna.trial.TrialState.FAIL] * 3


def test_values_refuses_a_categorical_of_words(optuna) -> None:
    study = sweep.create_study("refusals", storage=None)
    trials = sweep.TrialBatch(study, 2, {"optimizer": optuna.distributions.CategoricalDistribution(["adam", "sgd"])})
    with pytest.raises(TypeError, match=r"'optimizer' is categorical with non-numeric choices"):
        trials.values("optimizer")
