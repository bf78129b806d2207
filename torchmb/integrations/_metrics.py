"""Per-model values as the scalar metrics that loggers take: one column per model, or one reduced value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["REDUCTIONS", "Reduction", "is_per_model", "per_model_metrics"]

REDUCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": torch.mean,
    "min": torch.min,
    "max": torch.max,
    "sum": torch.sum,
    "median": torch.median,
}
Reduction = str | Callable[[Tensor], Any] | None


def is_per_model(value: Any) -> bool:
    """Whether ``value`` holds one number per model: a 1-d tensor of more than one element."""
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() > 1


def per_model_metrics(name: str, values: Any, reduction: Reduction = None) -> dict[str, Tensor]:
    """``{"name/model_0": values[0], ...}``, or ``{name: reduction(values)}``.

    Args:
        name: the metric's name.
        values: one number per model, ``(B,)`` (a tensor, or a sequence of numbers).
        reduction: ``None`` for one column per model, ``"mean"``, ``"min"``, ``"max"``, ``"sum"``,
            ``"median"``, or a function of the ``(B,)`` tensor returning a scalar.
    """
    values = torch.as_tensor(values).detach()
    if values.dim() != 1:
        raise ValueError(f"{name}: expected one value per model, shape (B,), got shape {tuple(values.shape)}")
    if reduction is None:
        return {f"{name}/model_{i}": value for i, value in enumerate(values.unbind())}
    if isinstance(reduction, str):
        if reduction not in REDUCTIONS:
            raise ValueError(f"{name}: reduction must be None (one column per model) or one of {sorted(REDUCTIONS)}")
        reduction = REDUCTIONS[reduction]
    reduced = torch.as_tensor(reduction(values.float() if values.dtype == torch.bool else values))
    if reduced.numel() != 1:
        raise ValueError(f"{name}: the reduction returned {reduced.numel()} values, expected one")
    return {name: reduced.reshape(())}
