"""One value per model: how a hyperparameter given as a number or B numbers is kept, a ``(B,)`` float64 CPU tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["per_model_values"]


def per_model_values(value: Any, batch: int, name: str) -> Tensor:
    """One float64 value per model, as a new ``(batch,)`` CPU tensor.

    Args:
        value: a number (every model gets it), or a length-``batch`` sequence, array or tensor.
        batch: the number of models B.
        name: the hyperparameter's name, for error messages.
    """
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name}: expected a number or {batch} numbers (one per model), got a bool")
    if isinstance(value, Tensor):
        values = value.detach().to("cpu", torch.float64)
    elif isinstance(value, (int, float)):
        values = torch.tensor(float(value), dtype=torch.float64)
    else:
        try:
            values = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"{name}: expected a number or {batch} numbers (one per model), got {type(value).__name__}"
            ) from error
    if values.dim() == 0:
        values = values.expand(batch)
    if values.shape != (batch,):
        raise ValueError(
            f"{name}: expected a number or {batch} values (one per model), got shape {tuple(values.shape)}"
        )
    if not bool(torch.isfinite(values).all()):
        bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
        raise ValueError(f"{name}: values must be finite, got non-finite values for models {bad}")
    return values.clone()
