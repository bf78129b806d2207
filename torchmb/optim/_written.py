"""torch habits with ``param_groups``: values written into a group by hand, and torch's own schedulers.

A torch user writes ``optimizer.param_groups[0]["lr"] = 0.05``; on a batched optimizer that means 0.05 for every
model, as it would for each of B torch optimizers, so the next step takes it through
:meth:`~torchmb.optim.BatchOptimizer.set_hyperparameter`'s checks first. A ``torch.optim.lr_scheduler`` scheduler
cannot work: it writes each group's learning rate in place as one number (``group["lr"].fill_(value)``), where
a batched optimizer holds one per model, so it is refused when it attaches itself to the optimizer, naming the
batched schedulers that take its place.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from ._values import per_model_values

TORCH_SCHEDULER = (
    "{optimizer} holds one learning rate per model, a (B,) tensor in each parameter group, which the schedulers "
    "of torch.optim.lr_scheduler cannot step (they write one number per group). Use the scheduler of the same "
    "name from torchmb.lr_scheduler (StepLR, MultiStepLR, ExponentialLR, LinearLR, CosineAnnealingLR, LambdaLR, "
    "OneCycleLR: the same arguments, each a number or one per model), or set values with "
    "optimizer.set_hyperparameter('lr', value)"
)


class _PerModelHyperparameters(Protocol):
    """What :func:`adopt_written_values` needs of a :class:`~torchmb.optim.BatchOptimizer` (a protocol, so that
    this part does not import the class made of it)."""

    batch: int
    per_model: tuple[str, ...]
    param_groups: list[dict[str, Any]]

    def set_hyperparameter(self, name: str, value: Any, group: int | None = None) -> None: ...


class TorchHabits:
    """The part of :class:`~torchmb.optim.BatchOptimizer` that meets torch habits: before each step, values written
    into ``param_groups`` by hand are taken as :meth:`set_hyperparameter` takes them (a step pre-hook), and a
    ``torch.optim.lr_scheduler`` scheduler is refused as it attaches itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_step_pre_hook(_before_step)  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        # Every torch LRScheduler wraps the optimizer's step (to warn when it is stepped first) in its __init__,
        # before its first step writes a learning rate.
        if name == "step" and getattr(value, "_wrapped_by_lr_sched", False):
            raise TypeError(TORCH_SCHEDULER.format(optimizer=type(self).__name__))
        super().__setattr__(name, value)


def _before_step(optimizer: _PerModelHyperparameters, args: tuple, kwargs: dict) -> None:
    adopt_written_values(optimizer)


def _is_stored(value: Any, shape: tuple[int]) -> bool:
    """Whether ``value`` is in the form the optimizer keeps: a ``(B,)`` float64 CPU tensor (a check of a few
    hundred nanoseconds, made for every value at every step)."""
    return type(value) is Tensor and value.dtype is torch.float64 and not value.is_cuda and value.shape == shape


def adopt_written_values(optimizer: _PerModelHyperparameters) -> None:
    """Take every per-model hyperparameter written into ``param_groups`` by hand (a number: every model; B numbers:
    one each) through :meth:`set_hyperparameter`, which checks it and keeps it as the optimizer keeps its values.
    A value it refuses is left as written, so every later step refuses it too."""
    shape = (optimizer.batch,)
    for index, group in enumerate(optimizer.param_groups):
        written = {}
        for name in optimizer.per_model:
            value = group[name]
            if type(value) is tuple:  # betas
                if len(value) == 2 and _is_stored(value[0], shape) and _is_stored(value[1], shape):
                    continue
            elif _is_stored(value, shape):
                continue
            written[name] = value
        if not written:
            continue
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"param_groups[{index}] was written by hand ({', '.join(written)}); a compiled step cannot check "
                "it: call optimizer.set_hyperparameter(name, value) outside the compiled code"
            )
        try:
            for name, value in written.items():  # all in the kept form first: each check sees the others
                if name != "betas":
                    group[name] = per_model_values(value, shape[0], name)
                elif isinstance(value, (tuple, list)) and len(value) == 2:  # else set_hyperparameter says why not
                    group[name] = tuple(per_model_values(v, shape[0], f"betas[{k}]") for k, v in enumerate(value))
            for name in written:
                optimizer.set_hyperparameter(name, group[name], group=index)
        except Exception:
            group.update(written)
            raise

