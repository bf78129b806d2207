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
        if len(keep) == 0:
            break
        torchmb.sweep.select(keep, models, optimizer)
    trials.tell(validation_accuracy)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    storage: str | None = DEFAULT_STORAGE,
    direction: str = "maximize",
    pruner: optuna.pruners.BasePruner | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    load_if_exists: bool = True,
) -> optuna.Study:
    """An Optuna study in ``storage`` (a SQLite file by default; ``None`` keeps it in memory).

    ``load_if_exists`` lets several processes pointing at one RDB URL join the same study.
    """
    optuna = _optuna()
    return optuna.create_study(
        study_name=study_name,
        storage=storage,
        direction=direction,
        pruner=pruner,
        sampler=sampler,
        load_if_exists=load_if_exists,
    )


class TrialBatch:
    """B trials asked from ``study`` at once, one per model of a ``BatchModule``.

    Args:
        study: the Optuna study.
        batch: number of trials (models) to ask for.
        distributions: the search space, name -> ``optuna.distributions.BaseDistribution``.

    The order of :attr:`trials` is the model order; :meth:`report` drops pruned trials from it and
    returns the indices of the models to keep, to pass to :func:`select`.
    """

    def __init__(
        self, study: optuna.Study, batch: int, distributions: Mapping[str, optuna.distributions.BaseDistribution]
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be a positive number of trials, got {batch}")
        if not distributions:
            raise ValueError("distributions must name at least one hyperparameter")
        self.study = study
        self.trials: list[optuna.Trial] = [study.ask(dict(distributions)) for _ in range(batch)]

    @property
    def batch(self) -> int:
        """The number of trials, one per model."""
        return len(self.trials)

    @property
    def numbers(self) -> list[int]:
        """The Optuna trial numbers, in model order."""
        return [trial.number for trial in self.trials]

    def values(self, name: str, *, device: torch.device | str | None = None) -> Tensor:
        """Hyperparameter ``name`` of every model, ``(B,)`` float64 (pass it to a batched optimizer)."""
        if name not in self.trials[0].params:
            raise KeyError(f"no hyperparameter {name!r}; the search space has {sorted(self.trials[0].params)}")
        values = [trial.params[name] for trial in self.trials]
        words = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
        if words:
            raise TypeError(
                f"hyperparameter {name!r} is categorical with non-numeric choices (such as {words[0]!r}), which "
                f"values() cannot give as numbers; read each model's choice as trial.params[{name!r}] for trial in "
                "the TrialBatch's trials"
            )
        return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)

    def _floats(self, values: Tensor | Sequence[float], what: str) -> list[float]:
        values = torch.as_tensor(values).detach().double().cpu().flatten().tolist()
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
