"""The checks a batched optimizer's ``load_state_dict`` makes before it loads anything, so that a state
that does not fit (another number of models, other parameter shapes) is refused with nothing changed."""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["check_state_layout"]


def check_state_layout(
    state_dict: Any,
    param_groups: list[dict[str, Any]],
    batch: int,
    per_model: tuple[str, ...],
    cpu_state: tuple[str, ...],
    owner: str,
) -> None:
    """Raise unless ``state_dict`` (an optimizer's ``state_dict()``) holds ``batch`` models' state for
    ``param_groups``: as many groups and parameters, every per-model hyperparameter ``per_model`` present,
    the ``cpu_state`` entries ``(batch,)`` and every other state tensor of its parameter's shape."""
    where = f"{owner}.load_state_dict"
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(f"{where}: expected a dict with 'state' and 'param_groups', as state_dict() gives")
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"{where}: the state has {len(groups)} parameter groups, this optimizer {len(param_groups)}")
    params = {}
    for own, saved in zip(param_groups, groups):
        if len(own["params"]) != len(saved["params"]):
            raise ValueError(
                f"{where}: a parameter group of the state holds {len(saved['params'])} parameters, this "
                f"optimizer's {len(own['params'])}"
            )
        missing = [name for name in per_model if name not in saved]
        if missing:
            raise KeyError(f"{where}: a parameter group of the state lacks the hyperparameters {missing}")
        params.update(zip(saved["params"], own["params"]))
    saved_batch = _saved_batch(groups, per_model)
    if saved_batch is not None and saved_batch != batch:
        raise ValueError(
            f"{where}: the state holds B = {saved_batch} models, this optimizer B = {batch}; select or load the "
            "models first (BatchModule.select, optimizer.select) so that both hold the same number of models"
        )
    for key, entries in state_dict["state"].items():
        p = params.get(key)
        if p is None:
            raise KeyError(f"{where}: the state names parameter {key!r}, which none of its parameter groups holds")
        for name, value in entries.items():
            expected = (batch,) if name in cpu_state else tuple(p.shape)
            if isinstance(value, Tensor) and value.dim() and tuple(value.shape) != expected:
                raise ValueError(
                    f"{where}: state {name!r} of parameter {key!r} has shape {tuple(value.shape)}, expected "
                    f"{expected} (B = {batch} models)"
                )


def _saved_batch(groups: list[dict[str, Any]], per_model: tuple[str, ...]) -> int | None:
    """The number of models a saved optimizer state holds: the length of its per-model hyperparameters."""
    for group in groups:
        for name in per_model:
            value = group[name]
            value = value[0] if isinstance(value, tuple) else value
            if isinstance(value, Tensor) and value.dim() == 1:
                return int(value.shape[0])
    return None
