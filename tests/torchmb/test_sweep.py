from __future__ import annotations

import math

import pytest
import torch

optuna = pytest.importorskip("optuna", reason="the [sweep] extra (Optuna) is not installed")
from optuna.distributions import CategoricalDistribution, FloatDistribution  # noqa: E402
from support.models import MLP  # noqa: E402

import torchmb  # noqa: E402
from torchmb import BatchModule, sweep  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def make_study(tmp_path, pruner=None) -> optuna.Study:
    return sweep.create_study("test", storage=f"sqlite:///{tmp_path / 'sweep.db'}", pruner=pruner)


def test_trials_become_models_and_results_reach_the_study(tmp_path) -> None:
    study = make_study(tmp_path)
    space = {"lr": FloatDistribution(1e-3, 1.0, log=True), "momentum": CategoricalDistribution([0.0, 0.9])}
    trials = sweep.TrialBatch(study, 6, space)
    lrs = trials.values("lr")
    assert lrs.shape == (6,) and lrs.dtype == torch.float64
    assert [t.params["lr"] for t in trials.trials] == lrs.tolist()
    models = BatchModule(MLP(), trials.batch)
    optimizer = torchmb.optim.SGD(models.parameters(), lr=lrs, momentum=trials.values("momentum"))
    x, y = torch.randn(6, 8, 12), torch.randint(0, 5, (6, 8))
    for _ in range(3):
        losses = torchmb.batch_loss(models(x), y)
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
    trials.tell(-losses.detach())
    finished = {t.number: t for t in study.get_trials()}
    assert len(finished) == 6
    for number, loss in zip([t.number for t in study.get_trials()], losses.tolist()):
        assert finished[number].state == optuna.trial.TrialState.COMPLETE
        assert finished[number].value == pytest.approx(-loss)


def test_pruned_and_diverged_trials_are_dropped_with_their_models(tmp_path) -> None:
    # Median pruning from the first step: models below the median of finished trials are pruned.
    first = make_study(tmp_path, optuna.pruners.MedianPruner(n_startup_trials=0, n_warmup_steps=0))
    done = sweep.TrialBatch(first, 4, {"x": FloatDistribution(0, 1)})
    for step in range(2):
        done.report(torch.full((4,), 0.5), step)
    done.tell(torch.full((4,), 0.5))
    trials = sweep.TrialBatch(first, 5, {"x": FloatDistribution(0, 1)})
    numbers = trials.numbers
    models = BatchModule(MLP(), 5, init="independent", seed=0)
    optimizer = torchmb.optim.SGD(models.parameters(), lr=0.1)
    before = models.state_dicts()
    keep = trials.report(torch.tensor([0.9, 0.1, math.nan, 0.8, 0.2]), step=0)
    assert keep.tolist() == [0, 3], "0.1 and 0.2 are below the median 0.5; NaN diverged"
    sweep.select(keep, models, optimizer)
    assert models.batch == optimizer.batch == trials.batch == 2
    assert trials.numbers == [numbers[0], numbers[3]]
    for slot, original in enumerate([0, 3]):
        assert all(torch.equal(models.state_dict_of(slot)[k], v) for k, v in before[original].items())
    states = {t.number: t.state for t in first.get_trials()}
    assert states[numbers[1]] == states[numbers[4]] == optuna.trial.TrialState.PRUNED
    assert states[numbers[2]] == optuna.trial.TrialState.FAIL


def test_studies_persist_in_the_storage_and_are_shared(tmp_path) -> None:
    one = make_study(tmp_path)
    sweep.TrialBatch(one, 3, {"x": FloatDistribution(0, 1)}).tell([1.0, 2.0, 3.0])
    other_process = make_study(tmp_path)  # same name and URL: joins the same study
    assert sorted(t.value for t in other_process.get_trials()) == [1.0, 2.0, 3.0]
    assert other_process.best_value == 3.0


def test_bad_input(tmp_path) -> None:
    study = make_study(tmp_path)
    with pytest.raises(ValueError, match="at least one hyperparameter"):
        sweep.TrialBatch(study, 2, {})
    trials = sweep.TrialBatch(study, 2, {"x": FloatDistribution(0, 1)})
    with pytest.raises(ValueError, match="expected 2 values"):
        trials.report([0.1, 0.2, 0.3], step=0)
    with pytest.raises(KeyError, match="no hyperparameter 'lr'"):
        trials.values("lr")
    with pytest.raises(TypeError, match="has no select"):
        sweep.select([0], object())


def test_a_rung_that_prunes_every_model_ends_the_loop(tmp_path) -> None:
    # The tutorial's loop: the values are indexed with report's keep before the loop can end
    study = make_study(tmp_path, optuna.pruners.ThresholdPruner(lower=0.5))
    trials = sweep.TrialBatch(study, 4, {"x": FloatDistribution(0, 1)})
    models = BatchModule(MLP(), trials.batch)
    optimizer = torchmb.optim.SGD(models.parameters(), lr=0.1)
    accuracy = torch.full((4,), 0.25)
    for rung in range(3):
        keep = trials.report(accuracy, step=rung)
        accuracy = accuracy[keep]
        if len(keep) == 0:
            break
        sweep.select(keep, models, optimizer)
    trials.tell(accuracy)
    assert [t.state for t in study.get_trials()] == [optuna.trial.TrialState.PRUNED] * 4
    with pytest.raises(ValueError, match=r"already finished .* index the values with report's keep"):
        trials.tell(torch.full((4,), 0.25))


def test_categorical_hyperparameters(tmp_path) -> None:
    space = {
        "act": CategoricalDistribution(["relu", "gelu"]),
        "nesterov": CategoricalDistribution([True, False]),
        "width": CategoricalDistribution([16, 32]),
    }
    trials = sweep.TrialBatch(make_study(tmp_path), 5, space)
    assert trials.params("act") == [t.params["act"] for t in trials.trials]
    assert set(trials.params("act")) <= {"relu", "gelu"}
    assert trials.values("width").tolist() == [float(t.params["width"]) for t in trials.trials]
    with pytest.raises(TypeError, match=r"'act' is categorical with non-numeric choices .* params\('act'\)"):
        trials.values("act")
    with pytest.raises(TypeError, match="'nesterov' is categorical with non-numeric choices"):
        trials.values("nesterov")


@pytest.mark.parametrize(
    ("pruner", "acts"),
    [
        (optuna.pruners.MedianPruner(), False),
        (optuna.pruners.MedianPruner(n_startup_trials=0, n_warmup_steps=0), False),
        (optuna.pruners.PercentilePruner(25.0, n_startup_trials=0), False),
        (optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), True),
        (optuna.pruners.HyperbandPruner(min_resource=1, max_resource=4, reduction_factor=2), True),
        (optuna.pruners.ThresholdPruner(lower=0.5), True),
    ],
    ids=["median", "median-no-startup", "percentile", "successive-halving", "hyperband", "threshold"],
)
def test_which_pruners_act_on_a_studys_first_batch(pruner, acts: bool) -> None:
    # What docs/tutorials/optuna.md says: pruners comparing with completed trials wait for a finished batch
    study = sweep.create_study("first", storage=None, pruner=pruner)
    trials = sweep.TrialBatch(study, 8, {"x": FloatDistribution(0, 1)})
    kept = 8
    for step in range(4):
        kept = len(trials.report(torch.linspace(1, 0, trials.batch), step))
    assert (kept < 8) == acts
