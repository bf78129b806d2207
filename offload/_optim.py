"""Which optimizer state is per row, and what a row's state is before its first step.

An offloaded table keeps every per-element optimizer state tensor (``exp_avg``, ``momentum_buffer``,
``sum``, ...) as a host table of the same shape as the weight; scalars (``step``, ASGD's ``eta`` and ``mu``,
NAdam's ``mu_product``) stay in the optimizer's own state. This module maps optimizer classes to their
per-row state and its initial value, mirroring each optimizer's own initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["register_optimizer", "row_state_spec"]

RowStateFn = Callable[[dict[str, Any]], dict[str, float]]

_SPECS: dict[type, tuple[RowStateFn, bool]] = {}
_REFUSED: dict[type, str] = {}


def register_optimizer(cls: type[torch.optim.Optimizer], row_state: RowStateFn | None = None, *,
                       self_init: bool = True, overwrite: bool = False):
    """Declare how ``cls`` keeps per-element state, so OffloadedEmbedding can train with it.

    ``row_state(group)`` gets the parameter group and returns ``{state_key: initial_value}`` for every state
    tensor shaped like the parameter; every other state entry must be a scalar shared by all rows. The
    optimizer must update each element from that element's own gradient and state (elementwise).
    ``self_init=True`` (the torch optimizers with a ``step`` counter) lets the optimizer create its state
    on its first step, as it always does; ``self_init=False`` makes OffloadedEmbedding fill the per-row
    state in before the first step (SGD, whose first momentum step would otherwise differ for rows that
    appear later). Usable as a decorator on ``row_state``; refuses to overwrite unless ``overwrite=True``.
    """
    def deco(fn: RowStateFn) -> RowStateFn:
        if cls in _SPECS and not overwrite:
            raise ValueError(f"{cls.__name__} is already registered for offloading (pass overwrite=True)")
        _SPECS[cls] = (fn, self_init)
        return fn

    return deco if row_state is None else deco(row_state)


def row_state_spec(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[dict[str, float], bool]:
    """``({key: initial value}, self_init)`` of the per-row state ``optimizer`` keeps for a parameter of
    ``group`` (see :func:`register_optimizer`).

    Raises:
        TypeError: the optimizer is not elementwise (LBFGS) or not known (see :func:`register_optimizer`).
    """
    for cls in type(optimizer).__mro__:
        if cls in _REFUSED:
            raise TypeError(_REFUSED[cls])
        if cls in _SPECS:
            fn, self_init = _SPECS[cls]
            return dict(fn(group)), self_init
    known = ", ".join(sorted(c.__name__ for c in _SPECS))
    raise TypeError(
        f"{type(optimizer).__name__} is not known to offload: OffloadedEmbedding needs an elementwise "
        f"optimizer whose per-row state it can split ({known}); declare others with "
        f"offload.register_optimizer"
    )


_REFUSED[torch.optim.LBFGS] = (
    "LBFGS cannot train an OffloadedEmbedding: it is not elementwise (it keeps a history of whole flattened "
    "parameter vectors and runs line searches over all of them), so its state cannot be split by row. "
    "Use an elementwise optimizer such as Adam, Adagrad or SGD."
)
_REFUSED[torch.optim.SparseAdam] = (
    "SparseAdam needs sparse gradients; with OffloadedEmbedding use torch.optim.Adam, which it already "
    "runs lazily (only the rows of each step are updated, as SparseAdam does)."
)

register_optimizer(torch.optim.SGD, lambda g: {"momentum_buffer": 0.0} if g["momentum"] != 0 else {},
                   self_init=False)
register_optimizer(torch.optim.Adam, lambda g: {"exp_avg": 0.0, "exp_avg_sq": 0.0,
                                                **({"max_exp_avg_sq": 0.0} if g["amsgrad"] else {})})
if not issubclass(torch.optim.AdamW, torch.optim.Adam):  # a subclass from torch 2.8 on
    register_optimizer(torch.optim.AdamW, _SPECS[torch.optim.Adam][0])
register_optimizer(torch.optim.Adamax, lambda g: {"exp_avg": 0.0, "exp_inf": 0.0})
register_optimizer(torch.optim.Adadelta, lambda g: {"square_avg": 0.0, "acc_delta": 0.0})
register_optimizer(torch.optim.Adagrad, lambda g: {"sum": float(g["initial_accumulator_value"])})
register_optimizer(torch.optim.RMSprop, lambda g: {"square_avg": 0.0,
                                                   **({"momentum_buffer": 0.0} if g["momentum"] > 0 else {}),
                                                   **({"grad_avg": 0.0} if g["centered"] else {})})
register_optimizer(torch.optim.ASGD, lambda g: {"ax": 0.0})
register_optimizer(torch.optim.Rprop, lambda g: {"prev": 0.0, "step_size": float(g["lr"])})
register_optimizer(torch.optim.NAdam, lambda g: {"exp_avg": 0.0, "exp_avg_sq": 0.0})
register_optimizer(torch.optim.RAdam, lambda g: {"exp_avg": 0.0, "exp_avg_sq": 0.0})
