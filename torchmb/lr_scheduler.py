"""Per-model learning-rate schedules for ``torchmb.optim`` optimizers.

Each scheduler is B independent ``torch.optim.lr_scheduler`` schedulers run as one: its arguments may
be a number (every model) or B values (one per model), and it writes each model's learning rate into
the optimizer's per-model ``lr`` (``(B,)`` float64). The recurrences are ``torch``'s own, evaluated in
float64 for all models at once, so model ``i`` follows exactly the schedule a torch scheduler built with
model ``i``'s arguments would give it. ``select(keep)`` shrinks the schedule with the population (call
it with the optimizer's).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from .optim._base import BatchOptimizer, check_range, per_model_values
from .optim._population import select_index

__all__ = [
    "BatchLRScheduler",
    "CosineAnnealingLR",
    "ExponentialLR",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "OneCycleLR",
    "StepLR",
]


def _per_model_ints(value: Any, batch: int, name: str, minimum: int = 1) -> Tensor:
    values = per_model_values(value, batch, name)
    if bool((values != values.round()).any()):
        raise ValueError(f"{name}: expected integers, got {values.tolist()}")
    check_range(name, values, low=minimum)
    return values.to(torch.int64)


def _decay(gamma: Any, batch: int) -> Tensor:
    """Per-model multiplicative decays: non-negative, since a negative one would make learning rates negative."""
    values = per_model_values(gamma, batch, "gamma")
    check_range("gamma", values, low=0.0)
    return values


def _batch(optimizer: Any, who: str) -> int:
    if not isinstance(optimizer, BatchOptimizer):
        raise TypeError(f"{who} needs a torchmb.optim optimizer (per-model lr), got {type(optimizer).__name__}")
    return optimizer.batch


class BatchLRScheduler:
    """Base class of batched schedulers: B torch schedulers, one per model, stepped together.

    Subclasses implement ``get_lr`` (per parameter group, a ``(B,)`` float64 tensor) and list their
    per-model arguments in ``per_model_args`` so that :meth:`select` re-indexes them.

    Args:
        optimizer: a ``torchmb.optim`` optimizer.
        last_epoch: the index of the last epoch when resuming (``-1`` starts afresh), as in torch.
    """

    per_model_args: ClassVar[tuple[str, ...]] = ()

    def __init__(self, optimizer: BatchOptimizer, last_epoch: int = -1) -> None:
        _batch(optimizer, type(self).__name__)
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"].clone())
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(
                        f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a "
                        "scheduler with last_epoch >= 0"
                    )
        self.base_lrs: list[Tensor] = [group["initial_lr"].clone() for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    @property
    def batch(self) -> int:
        """The number of models B."""
        return int(self.base_lrs[0].shape[0])

    def get_lr(self) -> list[Tensor]:
        """The next learning rates: one ``(B,)`` float64 tensor per parameter group."""
        raise NotImplementedError

    def step(self) -> None:
        """Advance every model's schedule by one step (call after ``optimizer.step()``)."""
        self._step_count += 1
        self.last_epoch += 1
        values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr.to(torch.float64).clone()
        self._last_lr = [group["lr"].clone() for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[Tensor]:
        """The learning rates the last step set: one ``(B,)`` float64 tensor per parameter group."""
        return [lr.clone() for lr in self._last_lr]

    def _group_values(self, key: str) -> list[Tensor]:
        return [group[key] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer (tensors copied)."""
        return {key: _copy(value) for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`; one of another scheduler or number of models is refused, with
        nothing changed."""
        self._check_loadable(state_dict)
        self.__dict__.update({key: _copy(value) for key, value in state_dict.items()})

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        name = type(self).__name__
        own = self.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"{name}.load_state_dict: not a {name} state (missing {missing}, unexpected {unexpected})"
            )
        base_lrs = state_dict["base_lrs"]
        if len(base_lrs) != len(own["base_lrs"]):
            raise ValueError(
                f"{name}.load_state_dict: the state has {len(base_lrs)} parameter groups, the optimizer "
                f"{len(own['base_lrs'])}"
            )
        for key in self.per_model_state():
            values = state_dict[key] if key in ("base_lrs", "_last_lr") else [state_dict[key]]
            for value in values:
                held = len(value) if isinstance(value, (Tensor, list)) else self.batch
                if held != self.batch:
                    raise ValueError(
                        f"{name}.load_state_dict: the state holds B = {held} models ({key}), this scheduler "
                        f"B = {self.batch}; select the models first so that both hold the same number"
                    )

    def select(self, keep: Any) -> None:
        """Keep only the models ``keep`` (indices in the new order, or a bool mask of length B).

        Call it with the same ``keep`` as ``optimizer.select`` (which re-indexes the learning rates).
        """
        index = select_index(keep, self.batch)
        for name in self.per_model_state():
            value = getattr(self, name)
            if isinstance(value, Tensor):
                setattr(self, name, value[index])
            elif name in ("base_lrs", "_last_lr"):  # one (B,) tensor per parameter group
                setattr(self, name, [v[index] for v in value])
            else:  # a list with one entry per model
                setattr(self, name, [value[i] for i in index.tolist()])

    def per_model_state(self) -> tuple[str, ...]:
        """The entries of :meth:`state_dict` held per model: the learning rates (a ``(B,)`` tensor per parameter
        group) and the scheduler's own per-model arguments (a tensor or a list of B)."""
        return ("base_lrs", "_last_lr", *self._per_model_attrs())

    def _per_model_attrs(self) -> tuple[str, ...]:
        return self.per_model_args


def _copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


class StepLR(BatchLRScheduler):
    """Decay each model's learning rate by ``gamma`` every ``step_size`` epochs (``torch``'s StepLR).

    Args:
        optimizer: a ``torchmb.optim`` optimizer.
        step_size: period of the decay, per model (int or B ints).
        gamma: multiplicative decay, per model.
        last_epoch: as in torch.
    """

    per_model_args = ("step_size", "gamma")

    def __init__(self, optimizer: BatchOptimizer, step_size: Any, gamma: Any = 0.1, last_epoch: int = -1) -> None:
        batch = _batch(optimizer, "StepLR")
        self.step_size = _per_model_ints(step_size, batch, "step_size")
        self.gamma = _decay(gamma, batch)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[Tensor]:
        lrs = self._group_values("lr")
        if self.last_epoch == 0:
            return [lr.clone() for lr in lrs]
        keep = torch.remainder(self.last_epoch, self.step_size) != 0
        return [torch.where(keep, lr, lr * self.gamma) for lr in lrs]


class MultiStepLR(BatchLRScheduler):
    """Decay each model's learning rate by ``gamma`` at each of its milestones (``torch``'s MultiStepLR).

    Args:
        optimizer: a ``torchmb.optim`` optimizer.
        milestones: epoch indices shared by all models, or B such lists (one per model). A repeated
            milestone decays by ``gamma`` once per repetition, as in torch.
        gamma: multiplicative decay, per model.
        last_epoch: as in torch.
    """

    per_model_args = ("milestones", "gamma")

    def __init__(
        self,
        optimizer: BatchOptimizer,
        milestones: Iterable[int] | Sequence[Iterable[int]],
        gamma: Any = 0.1,
        last_epoch: int = -1,
    ) -> None:
        batch = _batch(optimizer, "MultiStepLR")
        milestones = list(milestones)
        if milestones and all(isinstance(m, Iterable) and not isinstance(m, (str, bytes)) for m in milestones):
            if len(milestones) != batch:
                raise ValueError(f"milestones: expected one list per model ({batch}), got {len(milestones)}")
            per_model = [[int(x) for x in m] for m in milestones]
        elif all(isinstance(m, int) and not isinstance(m, bool) for m in milestones):
            per_model = [[int(x) for x in milestones] for _ in range(batch)]
        else:
            raise TypeError("milestones: expected a list of ints, or one list of ints per model")
        width = max(1, max(len(m) for m in per_model))
        table = torch.full((batch, width), -1, dtype=torch.int64)
        for i, m in enumerate(per_model):
            if any(x < 0 for x in m):
                raise ValueError(f"milestones: expected non-negative epochs, got {m} for model {i}")
            table[i, : len(m)] = torch.tensor(m, dtype=torch.int64)
        self.milestones = table
        self.gamma = _decay(gamma, batch)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[Tensor]:
        count = (self.milestones == self.last_epoch).sum(1)
        factor = self.gamma ** count.to(torch.float64)
        return [torch.where(count > 0, lr * factor, lr) for lr in self._group_values("lr")]


class ExponentialLR(BatchLRScheduler):
    """Decay each model's learning rate by its ``gamma`` every epoch (``torch``'s ExponentialLR)."""

    per_model_args = ("gamma",)

    def __init__(self, optimizer: BatchOptimizer, gamma: Any, last_epoch: int = -1) -> None:
        self.gamma = _decay(gamma, _batch(optimizer, "ExponentialLR"))
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[Tensor]:
        if self._is_initial:
            return [lr.clone() for lr in self._group_values("lr")]
        return [lr * self.gamma for lr in self._group_values("lr")]


class LinearLR(BatchLRScheduler):
    """Scale each model's learning rate linearly from ``start_factor`` to ``end_factor`` over ``total_iters``.

    ``torch``'s LinearLR (a warm-up when ``start_factor < end_factor``), with every argument per model.
    """

    per_model_args = ("start_factor", "end_factor", "total_iters")

    def __init__(
        self,
        optimizer: BatchOptimizer,
        start_factor: Any = 1.0 / 3,
        end_factor: Any = 1.0,
        total_iters: Any = 5,
        last_epoch: int = -1,
    ) -> None:
        batch = _batch(optimizer, "LinearLR")
        self.start_factor = per_model_values(start_factor, batch, "start_factor")
        self.end_factor = per_model_values(end_factor, batch, "end_factor")
        check_range("start_factor", self.start_factor, 0.0, 1.0, low_open=True)
        check_range("end_factor", self.end_factor, 0.0, 1.0)
        self.total_iters = _per_model_ints(total_iters, batch, "total_iters", minimum=0)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[Tensor]:
        lrs = self._group_values("lr")
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in lrs]
        if self._is_initial:
            return [lr.clone() for lr in lrs]
        start, end = self.start_factor, self.end_factor
        total = self.total_iters.to(torch.float64)
        factor = 1.0 + (end - start) / (total * start + (self.last_epoch - 1) * (end - start))
        done = self.total_iters < self.last_epoch
        return [torch.where(done, lr, lr * factor) for lr in lrs]


class CosineAnnealingLR(BatchLRScheduler):
    """Cosine annealing from each model's initial lr to its ``eta_min`` over ``T_max`` epochs (torch's form)."""

    per_model_args = ("T_max", "eta_min")

    def __init__(self, optimizer: BatchOptimizer, T_max: Any, eta_min: Any = 0.0, last_epoch: int = -1) -> None:
        batch = _batch(optimizer, "CosineAnnealingLR")
        self.T_max = _per_model_ints(T_max, batch, "T_max")
        self.eta_min = per_model_values(eta_min, batch, "eta_min")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[Tensor]:
        lrs = self._group_values("lr")
        if self._is_initial:
            return [lr.clone() for lr in lrs]
        t_max = self.T_max.to(torch.float64)
        eta, epoch = self.eta_min, self.last_epoch
        if self._step_count == 1 and epoch > 0:
            return [eta + (base - eta) * (1 + torch.cos(epoch * math.pi / t_max)) / 2 for base in self.base_lrs]
        restart = torch.remainder(epoch - 1 - self.T_max, 2 * self.T_max) == 0
        out = []
        for base, lr in zip(self.base_lrs, lrs):
            at_restart = lr + (base - eta) * (1 - torch.cos(math.pi / t_max)) / 2
            regular = (1 + torch.cos(math.pi * epoch / t_max)) / (1 + torch.cos(math.pi * (epoch - 1) / t_max)) * (
                lr - eta
            ) + eta
            out.append(torch.where(restart, at_restart, regular))
        return out


class LambdaLR(BatchLRScheduler):
    """Each model's learning rate is its initial lr times ``lr_lambda(epoch)`` (``torch``'s LambdaLR).

    Args:
        optimizer: a ``torchmb.optim`` optimizer.
        lr_lambda: one function of the epoch returning a number (all models) or B numbers, or a list of
            B functions (one per model).
        last_epoch: as in torch.
    """

    per_model_args = ("lr_lambdas",)

    def __init__(
        self,
        optimizer: BatchOptimizer,
        lr_lambda: Callable[[int], Any] | Sequence[Callable[[int], Any]],
        last_epoch: int = -1,
    ) -> None:
        if isinstance(lr_lambda, (list, tuple)):
            batch = _batch(optimizer, "LambdaLR")
            if len(lr_lambda) != batch:
                raise ValueError(f"lr_lambda: expected one function per model ({batch}), got {len(lr_lambda)}")
            if not all(callable(f) for f in lr_lambda):
                raise TypeError("lr_lambda: every entry must be callable")
            self.lr_lambdas: list[Callable[[int], Any]] = list(lr_lambda)
            self._shared = False
        elif callable(lr_lambda):
            self.lr_lambdas = [lr_lambda]
            self._shared = True
        else:
            raise TypeError(f"lr_lambda: expected a function or a list of B functions, got {type(lr_lambda).__name__}")
        super().__init__(optimizer, last_epoch)

    def _per_model_attrs(self) -> tuple[str, ...]:
        return () if self._shared else ("lr_lambdas",)

    def _factors(self) -> Tensor:
        if self._shared:
            return per_model_values(self.lr_lambdas[0](self.last_epoch), self.batch, "lr_lambda(epoch)")
        return torch.tensor([float(f(self.last_epoch)) for f in self.lr_lambdas], dtype=torch.float64)

    def get_lr(self) -> list[Tensor]:
        factors = self._factors()
        return [base * factors for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        """As torch: functions are not saved, a callable object's ``__dict__`` is."""
        state = {key: _copy(value) for key, value in self.__dict__.items() if key not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [None if isinstance(f, types.FunctionType) else dict(f.__dict__) for f in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_loadable(state_dict)
        state = dict(state_dict)
        lambdas = state.pop("lr_lambdas")
        if len(lambdas) != len(self.lr_lambdas):
            raise ValueError(
                f"load_state_dict: the state holds {len(lambdas)} lr_lambdas, this scheduler {len(self.lr_lambdas)}"
            )
        self.__dict__.update({key: _copy(value) for key, value in state.items()})
        for f, saved in zip(self.lr_lambdas, lambdas):
            if saved is not None:
                f.__dict__.update(saved)


class OneCycleLR(BatchLRScheduler):
    """The 1cycle policy (``torch``'s OneCycleLR) with per-model peaks, momenta and divisors.

    Args:
        optimizer: a ``torchmb.optim`` optimizer.
        max_lr, base_momentum, max_momentum, div_factor, final_div_factor: per model.
        total_steps, epochs, steps_per_epoch, pct_start, anneal_strategy, cycle_momentum, three_phase:
            shared by all models, as in torch.
        last_epoch: as in torch.

    With ``cycle_momentum`` the momentum (SGD, RMSprop) or ``beta1`` (Adam, AdamW) cycles per model too.
    """

    def __init__(
        self,
        optimizer: BatchOptimizer,
        max_lr: Any,
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        cycle_momentum: bool = True,
        base_momentum: Any = 0.85,
        max_momentum: Any = 0.95,
        div_factor: Any = 25.0,
        final_div_factor: Any = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        batch = _batch(optimizer, "OneCycleLR")
        if total_steps is not None:
            if not isinstance(total_steps, int) or total_steps <= 0:
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            self.total_steps = total_steps
        elif epochs is not None and steps_per_epoch is not None:
            if not isinstance(epochs, int) or epochs <= 0:
                raise ValueError(f"Expected positive integer epochs, but got {epochs}")
            if not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
                raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
            self.total_steps = epochs * steps_per_epoch
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        if not isinstance(pct_start, float) or not 0 <= pct_start <= 1:
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
        self.anneal_strategy = anneal_strategy
        if three_phase:
            self._schedule_phases = [
                dict(
                    end_step=float(pct_start * self.total_steps) - 1,
                    start_lr="initial_lr",
                    end_lr="max_lr",
                    start_momentum="max_momentum",
                    end_momentum="base_momentum",
                ),
                dict(
                    end_step=float(2 * pct_start * self.total_steps) - 2,
                    start_lr="max_lr",
                    end_lr="initial_lr",
                    start_momentum="base_momentum",
                    end_momentum="max_momentum",
                ),
                dict(
                    end_step=self.total_steps - 1,
                    start_lr="initial_lr",
                    end_lr="min_lr",
                    start_momentum="max_momentum",
                    end_momentum="max_momentum",
                ),
            ]
        else:
            self._schedule_phases = [
                dict(
                    end_step=float(pct_start * self.total_steps) - 1,
                    start_lr="initial_lr",
                    end_lr="max_lr",
                    start_momentum="max_momentum",
                    end_momentum="base_momentum",
                ),
                dict(
                    end_step=self.total_steps - 1,
                    start_lr="max_lr",
                    end_lr="min_lr",
                    start_momentum="base_momentum",
                    end_momentum="max_momentum",
                ),
            ]
        max_lrs = per_model_values(max_lr, batch, "max_lr")
        div = per_model_values(div_factor, batch, "div_factor")
        final_div = per_model_values(final_div_factor, batch, "final_div_factor")
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group["initial_lr"] = max_lrs / div
                group["max_lr"] = max_lrs.clone()
                group["min_lr"] = group["initial_lr"] / final_div
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
                raise ValueError("optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
            self.use_beta1 = "betas" in optimizer.defaults
            max_m = per_model_values(max_momentum, batch, "max_momentum")
            base_m = per_model_values(base_momentum, batch, "base_momentum")
            if last_epoch == -1:
                for i, group in enumerate(optimizer.param_groups):
                    self._set_momentum(optimizer, i, max_m)
                    group["max_momentum"] = max_m.clone()
                    group["base_momentum"] = base_m.clone()
        super().__init__(optimizer, last_epoch)

    def _set_momentum(self, optimizer: BatchOptimizer, group: int, value: Tensor) -> None:
        # through the optimizer, which checks the values and creates the momentum buffers a compiled step needs
        optimizer.set_hyperparameter("beta1" if self.use_beta1 else "momentum", value, group=group)

    def _anneal(self, start: Tensor, end: Tensor, pct: float) -> Tensor:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self) -> list[Tensor]:
        step_num = self.last_epoch
        if step_num > self.total_steps:
            raise ValueError(
                f"Tried to step {step_num} times. The specified number of total steps is {self.total_steps}"
            )
        lrs = []
        for g, group in enumerate(self.optimizer.param_groups):
            start_step = 0.0
            for i, phase in enumerate(self._schedule_phases):
                end_step = phase["end_step"]
                if step_num <= end_step or i == len(self._schedule_phases) - 1:
                    pct = (step_num - start_step) / (end_step - start_step)
                    lr = self._anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct)
                    if self.cycle_momentum:
                        momentum = self._anneal(group[phase["start_momentum"]], group[phase["end_momentum"]], pct)
                        self._set_momentum(self.optimizer, g, momentum)
                    break
                start_step = phase["end_step"]
            lrs.append(lr)
        return lrs
