"""Hyperparameter sweeps: B Optuna trials trained as one ``BatchModule``, pruned by dropping models.

Optuna (the optional ``[sweep]`` extra) keeps the study: which hyperparameters were tried, the
intermediate values each trial reported, which were pruned. The default storage is a SQLite file
(embedded, nothing to start); any Optuna RDB URL (``postgresql://...``) lets several processes or
machines work on one study, each training its own batch of trials.

Typical loop::

    study = torchmb.sweep.create_study("lr-sweep", direction="maximize")
    trials = torchmb.sweep.TrialBatch(study, 64, {"lr": FloatDistribution(1e-4, 1, log=True)})
    models = BatchModule(Net(), trials.batch)
    optimizer = torchmb.optim.SGD(models.parameters(), lr=trials.values("lr"))
    for epoch in range(epochs):
        ...train...
        keep = trials.report(validation_accuracy, step=epoch)   # prunes through the study's pruner
        validation_accuracy = validation_accuracy[keep]
        if len(keep) == 0:                                      # every trial pruned: nothing left to tell
            break
        torchmb.sweep.select(keep, models, optimizer)
    trials.tell(validation_accuracy)

Workers that die: with an RDB storage, each ``TrialBatch`` records a heartbeat for its running trials
every ``heartbeat_interval`` seconds (:func:`create_study`); the next batch any worker asks first fails
the trials whose heartbeat stopped for longer than the grace period, and re-asks them with the same
hyperparameters up to ``max_retry`` times. A worker restarting from its own checkpoint before then
continues its trials with :meth:`TrialBatch.resume`.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from .optim._population import select_index

if TYPE_CHECKING:
    import optuna

__all__ = ["DEFAULT_STORAGE", "TrialBatch", "create_study", "select"]

DEFAULT_STORAGE = "sqlite:///torchmb-sweep.db"


def _optuna():
    try:
        import optuna
    except ImportError as error:
        raise ImportError("torchmb.sweep needs Optuna: pip install 'torchmb[sweep]'") from error
    return optuna


class Selectable(Protocol):
    def select(self, keep: Any) -> Any: ...


def create_study(
    study_name: str,
    *,
    storage: str | optuna.storages.BaseStorage | None = DEFAULT_STORAGE,
    direction: str = "maximize",
    pruner: optuna.pruners.BasePruner | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    load_if_exists: bool = True,
    heartbeat_interval: int | None = 60,
    grace_period: int | None = None,
    max_retry: int = 0,
) -> optuna.Study:
    """An Optuna study in ``storage`` (a SQLite file by default; ``None`` keeps it in memory).

    ``load_if_exists`` lets several processes pointing at one RDB URL join the same study. Processes
    starting at once on a fresh SQLite file create its tables one after another (a lock file beside
    the database orders them); for a database server, create the study once before the workers start,
    or use :func:`torchmb.distributed.create_study`.

    Args:
        storage: an RDB URL, ``None`` (in memory), or an Optuna storage object (used as it is, so the
            heartbeat arguments below do not apply to it).
        heartbeat_interval: with an RDB URL, the seconds between the heartbeats a :class:`TrialBatch`
            records for its running trials; ``None`` records none. A trial whose heartbeat stopped for
            longer than ``grace_period`` (default twice the interval) belongs to a dead worker: the next
            batch asked of the study marks it failed.
        grace_period: see ``heartbeat_interval``.
        max_retry: how many times a trial failed that way is asked again, with the same
            hyperparameters, by the next batches (0: it stays failed).
    """
    optuna = _optuna()
    if max_retry < 0:
        raise ValueError(f"max_retry must be a non-negative number of retries, got {max_retry}")
    with _creation_lock(storage):
        if isinstance(storage, str):
            storage = _rdb_storage(optuna, storage, heartbeat_interval, grace_period, max_retry)
        return optuna.create_study(
            study_name=study_name,
            storage=storage,
            direction=direction,
            pruner=pruner,
            sampler=sampler,
            load_if_exists=load_if_exists,
        )


def _rdb_storage(
    optuna: Any, url: str, heartbeat_interval: int | None, grace_period: int | None, max_retry: int
) -> optuna.storages.RDBStorage:
    if heartbeat_interval is None:
        return optuna.storages.RDBStorage(url)
    with warnings.catch_warnings():  # Optuna marks heartbeats experimental (they serve its optimize loop)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry) if max_retry else None
        return optuna.storages.RDBStorage(
            url,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            heartbeat_stale_trial_callback=retry,
        )


@contextmanager
def _creation_lock(storage: Any):
    """Held while a SQLite file's tables are created: two processes creating them at once collide."""
    if not isinstance(storage, str):
        yield
        return
    import sqlalchemy

    url = sqlalchemy.engine.make_url(storage)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        yield
        return
    from optuna.storages.journal import JournalFileOpenLock

    lock = JournalFileOpenLock(url.database)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


class _Heartbeat:
    """Records a heartbeat for each running trial of a batch every interval, on a daemon thread.

    Optuna's own heartbeat thread serves one trial of its ``optimize`` loop; a batch has many, and its
    trials leave it as they are pruned or told.
    """

    def __init__(self, storage: Any, interval: int, trial_ids: list[int]) -> None:
        self._storage = storage
        self._interval = interval
        self._ids = list(trial_ids)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for trial_id in self._ids:  # a trial without a heartbeat is never taken for stale, so record one now
            storage.record_heartbeat(trial_id)
        self._thread = threading.Thread(target=self._run, name="torchmb-sweep-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                ids = list(self._ids)
            for trial_id in ids:
                self._storage.record_heartbeat(trial_id)

    def keep(self, trial_ids: list[int]) -> None:
        """Beat only for ``trial_ids`` from now on; stop when none is left."""
        with self._lock:
            self._ids = list(trial_ids)
        if not trial_ids:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class TrialBatch:
    """B trials asked from ``study`` at once, one per model of a ``BatchModule``.

    Args:
        study: the Optuna study.
        batch: number of trials (models) to ask for.
        distributions: the search space, name -> ``optuna.distributions.BaseDistribution``.

    The order of :attr:`trials` is the model order; :meth:`report` drops pruned trials from it and
    returns the indices of the models to keep, to pass to :func:`select`.

    Before asking, trials of dead workers (see :func:`create_study`'s heartbeat) are marked failed, and
    the retries that makes are asked first. While the batch has running trials, a daemon thread records
    their heartbeats.
    """

    def __init__(
        self, study: optuna.Study, batch: int, distributions: Mapping[str, optuna.distributions.BaseDistribution]
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be a positive number of trials, got {batch}")
        if not distributions:
            raise ValueError("distributions must name at least one hyperparameter")
        optuna = _optuna()
        with warnings.catch_warnings():  # Optuna's heartbeats are experimental and meant for its optimize loop:
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # this class beats itself
            warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with", UserWarning)
            optuna.storages.fail_stale_trials(study)
            trials = [study.ask(dict(distributions)) for _ in range(batch)]
        self._start(study, trials)

    @classmethod
    def resume(cls, study: optuna.Study, numbers: Sequence[int]) -> TrialBatch:
        """The running trials ``numbers`` of ``study`` as a batch again, in that model order.

        For a worker that restarts from its own checkpoint (save :attr:`numbers` with it): the trials
        keep their hyperparameters and reported values, and the batch records their heartbeats again.
        A trial that is no longer running (told, or failed after its heartbeat stopped) is refused.
        """
        optuna = _optuna()
        numbers = [int(n) for n in numbers]
        if not numbers:
            raise ValueError("resume: give the numbers of at least one trial")
        found = {t.number: t for t in study.get_trials(deepcopy=False)}
        for number in numbers:
            if number not in found:
                raise ValueError(f"resume: study {study.study_name!r} has no trial {number}")
            state = found[number].state
            if state != optuna.trial.TrialState.RUNNING:
                raise ValueError(
                    f"resume: trial {number} is {state.name}, not RUNNING (a trial whose worker's heartbeat "
                    "stopped for longer than the grace period is failed, and retried if max_retry allows)"
                )
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"resume: trial numbers repeat in {numbers}")
        batch = cls.__new__(cls)
        batch._start(study, [optuna.trial.Trial(study, found[n]._trial_id) for n in numbers])
        return batch

    def _start(self, study: optuna.Study, trials: list[optuna.Trial]) -> None:
        self.study = study
        self.trials: list[optuna.Trial] = trials
        storage = study._storage  # Optuna keeps the storage private; its heartbeat methods are public
        interval = storage.get_heartbeat_interval() if hasattr(storage, "record_heartbeat") else None
        self._heartbeat = _Heartbeat(storage, interval, self._trial_ids()) if interval else None

    def _trial_ids(self) -> list[int]:
        return [trial._trial_id for trial in self.trials]

    def _dropped(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.keep(self._trial_ids())

    @property
    def batch(self) -> int:
        """The number of trials, one per model."""
        return len(self.trials)

    @property
    def numbers(self) -> list[int]:
        """The Optuna trial numbers, in model order."""
        return [trial.number for trial in self.trials]

    def params(self, name: str) -> list[Any]:
        """Hyperparameter ``name`` of every model as Optuna gave it (any type: a categorical's choice), in order."""
        if not self.trials:
            raise ValueError("this batch has no running trials left (every one was pruned, failed or told)")
        if name not in self.trials[0].params:
            raise KeyError(f"no hyperparameter {name!r}; the search space has {sorted(self.trials[0].params)}")
        return [trial.params[name] for trial in self.trials]

    def values(self, name: str, *, device: torch.device | str | None = None) -> Tensor:
        """Hyperparameter ``name`` of every model, ``(B,)`` float64 (pass it to a batched optimizer).

        A categorical hyperparameter whose choices are not all numbers has no such values: read it with
        :meth:`params`.
        """
        params = self.params(name)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in params):
            choices = self.trials[0].distributions[name]
            raise TypeError(
                f"hyperparameter {name!r} is categorical with non-numeric choices ({choices}); values() gives "
                f"numbers for an optimizer, read each model's choice with params({name!r})"
            )
        return torch.tensor([float(v) for v in params], dtype=torch.float64, device=device)

    def _floats(self, values: Tensor | Sequence[float], what: str) -> list[float]:
        values = torch.as_tensor(values).detach().double().cpu().flatten().tolist()
        if not self.trials and values:
            raise ValueError(
                f"{what}: every trial of this batch is already finished (pruned, failed or told), so it takes no "
                f"values, got {len(values)}; index the values with report's keep, as the models are"
            )
        if len(values) != self.batch:
            raise ValueError(f"{what}: expected {self.batch} values (one per model), got {len(values)}")
        return values

    def report(self, values: Tensor | Sequence[float], step: int) -> Tensor:
        """Report each model's intermediate value; prune through the study's pruner.

        A non-finite value marks its trial failed (the model diverged). Pruned and failed trials are
        told to the study and dropped.

        Returns:
            The indices (into the current models) of the models to keep training, in order.
        """
        optuna = _optuna()
        keep = []
        for index, (trial, value) in enumerate(zip(self.trials, self._floats(values, "report"))):
            if not math.isfinite(value):
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            trial.report(value, step)
            if trial.should_prune():
                self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            keep.append(index)
        self.trials = [self.trials[i] for i in keep]
        self._dropped()
        return torch.tensor(keep, dtype=torch.long)

    def tell(self, values: Tensor | Sequence[float]) -> None:
        """Finish every remaining trial with its final value (non-finite: failed)."""
        optuna = _optuna()
        for trial, value in zip(self.trials, self._floats(values, "tell")):
            if math.isfinite(value):
                self.study.tell(trial, value)
            else:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        self.trials = []
        self._dropped()


def select(keep: Tensor | Sequence[int], *objects: Selectable) -> None:
    """Shrink every object (``BatchModule``, batched optimizer, scheduler, loss scaler) to the models ``keep``.

    All or nothing: ``keep`` and the objects' numbers of models are checked before any object changes, and
    modules (whose ``select`` may refuse what the others cannot, such as an offloaded embedding) go first.
    """
    if not objects:
        raise ValueError("select needs at least one object with a select(keep) method")
    for obj in objects:
        if not callable(getattr(obj, "select", None)):
            raise TypeError(f"{type(obj).__name__} has no select(keep) method")
    batches = [(type(obj).__name__, obj.batch) for obj in objects if getattr(obj, "batch", None) is not None]
    if len({batch for _, batch in batches}) > 1:
        held = ", ".join(f"{name} B = {batch}" for name, batch in batches)
        raise ValueError(f"select: the objects hold different numbers of models ({held}); select them separately")
    if batches:
        select_index(keep, batches[0][1])  # refuses a bad keep before anything changes
    for obj in sorted(objects, key=lambda obj: not isinstance(obj, torch.nn.Module)):
        obj.select(keep)
