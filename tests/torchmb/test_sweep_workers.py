"""Several worker processes on one study: starting together on a fresh SQLite file, and dying mid-batch."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

optuna = pytest.importorskip("optuna", reason="the [sweep] extra (Optuna) is not installed")
from optuna.distributions import FloatDistribution  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from torchmb import sweep  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
# fork: the workers start in milliseconds (torch is imported already), so they really start together
CONTEXT = multiprocessing.get_context("fork")
SPACE = {"lr": FloatDistribution(1e-3, 1.0, log=True)}


def _create(url: str, barrier, results) -> None:
    barrier.wait()
    try:
        sweep.create_study("shared", storage=url)
        results.put("ok")
    except Exception as error:  # reported to the test, which shows it
        results.put(repr(error))


def test_workers_starting_together_on_a_fresh_sqlite_file(tmp_path) -> None:
    for attempt in range(5):  # unordered, one of two workers crashed in 5-6 of 9 starts
        url = f"sqlite:///{tmp_path / f'fresh{attempt}.db'}"
        barrier, results = CONTEXT.Barrier(2), CONTEXT.Queue()
        workers = [CONTEXT.Process(target=_create, args=(url, barrier, results)) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        assert [results.get(timeout=5), results.get(timeout=5)] == ["ok", "ok"]
        assert [s.study_name for s in optuna.get_all_study_summaries(url)] == ["shared"]
        assert not (tmp_path / f"fresh{attempt}.db.lock").exists()


def _train_until_killed(url: str, heartbeat: dict, started) -> None:
    study = sweep.create_study("killed", storage=url, **heartbeat)
    trials = sweep.TrialBatch(study, 3, SPACE)
    trials.report(torch.tensor([0.1, 0.2, 0.3]), step=0)
    started.put((trials.numbers, trials.params("lr")))
    time.sleep(600)  # killed long before


def _start_and_kill(url: str, heartbeat: dict) -> tuple[list[int], list[float]]:
    started = CONTEXT.Queue()
    worker = CONTEXT.Process(target=_train_until_killed, args=(url, heartbeat, started))
    worker.start()
    numbers, lrs = started.get(timeout=60)
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    return numbers, lrs


def test_a_killed_workers_trials_are_failed_and_retried(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    heartbeat = {"heartbeat_interval": 1, "grace_period": 2, "max_retry": 1}
    numbers, lrs = _start_and_kill(url, heartbeat)
    study = sweep.create_study("killed", storage=url, **heartbeat)
    alive = sweep.TrialBatch(study, 2, SPACE)  # a living worker's trials: their heartbeat goes on
    time.sleep(4)  # past the grace period (SQLite's clock counts whole seconds)
    retried = sweep.TrialBatch(study, 3, SPACE)
    assert sorted(retried.params("lr")) == sorted(lrs), "the dead worker's trials come back first"
    states = {t.number: t.state for t in study.get_trials()}
    assert [states[n] for n in numbers] == [TrialState.FAIL] * 3
    assert [states[n] for n in alive.numbers] == [TrialState.RUNNING] * 2
    retried.tell(torch.tensor([0.5, 0.6, 0.7]))
    alive.tell(torch.tensor([0.1, 0.2]))
    assert TrialState.RUNNING not in {t.state for t in study.get_trials()}
    assert sum(t.state == TrialState.COMPLETE for t in study.get_trials()) == 5


def test_a_restarted_worker_resumes_its_batch(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    numbers, lrs = _start_and_kill(url, {"heartbeat_interval": 60})
    study = sweep.create_study("killed", storage=url)
    trials = sweep.TrialBatch.resume(study, numbers)
    assert trials.numbers == numbers and trials.params("lr") == lrs
    keep = trials.report(torch.tensor([0.2, 0.3, 0.4]), step=1)
    assert keep.tolist() == [0, 1, 2]
    trials.tell(torch.tensor([0.5, 0.6, 0.7]))
    finished = {t.number: t for t in study.get_trials()}
    assert [finished[n].state for n in numbers] == [TrialState.COMPLETE] * 3
    assert [finished[n].value for n in numbers] == pytest.approx([0.5, 0.6, 0.7])
    assert finished[numbers[0]].intermediate_values == pytest.approx({0: 0.1, 1: 0.2})
    with pytest.raises(ValueError, match=f"trial {numbers[0]} is COMPLETE, not RUNNING"):
        sweep.TrialBatch.resume(study, numbers)
    with pytest.raises(ValueError, match="has no trial 99"):
        sweep.TrialBatch.resume(study, [99])
