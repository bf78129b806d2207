"""Refuse, in a checked forward, the model's own code reducing or normalising over dim 0 of per-model data.

On the merged axis dim 0 holds every model's samples, so ``F.softmax(x, 0)``, ``x.sum(0)`` or
``torch.cumsum(x, dim=0)`` in a plain model's code (``nn.Softmax2d`` on an unbatched ``(C, H, W)`` input
normalises over dim -3, which is dim 0 there) would compute across models: a silently wrong result. The
first forward of every ``BatchModule`` (and every forward under ``torchmb.testing``) refuses it instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["refuse_reduction_over_models"]

_OVER_DIM = frozenset(
    {
        F.softmax,
        F.log_softmax,
        F.softmin,
        F.glu,
        torch.softmax,
        torch.log_softmax,
        Tensor.softmax,
        Tensor.log_softmax,
        torch.sum,
        Tensor.sum,
        torch.mean,
        Tensor.mean,
        torch.prod,
        Tensor.prod,
        torch.cumsum,
        Tensor.cumsum,
        torch.cumprod,
        Tensor.cumprod,
        torch.logsumexp,
        Tensor.logsumexp,
        torch.amax,
        Tensor.amax,
        torch.amin,
        Tensor.amin,
        torch.std,
        Tensor.std,
        torch.var,
        Tensor.var,
        torch.norm,
        Tensor.norm,
    }
)


def _dims(func: Any, args: tuple, kwargs: dict) -> Any:
    if "dim" in kwargs:
        return kwargs["dim"]
    position = 2 if func is torch.norm or func is Tensor.norm else 1
    return args[position] if len(args) > position else None


def refuse_reduction_over_models(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise where ``func`` reduces or normalises ``args[0]`` (per-model data) over dim 0."""
    if func not in _OVER_DIM or not args or not isinstance(args[0], Tensor) or args[0].dim() < 1:
        return
    dims = _dims(func, args, kwargs)
    if isinstance(dims, int) and not isinstance(dims, bool):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return  # over every dim (a scalar statistic) or a named dim: not this check's
    if any(d % args[0].dim() == 0 for d in dims):
        raise ValueError(
            f"{getattr(func, '__name__', func)} over dim 0 of a tensor of shape {tuple(args[0].shape)} holding "
            "several models' data: in a BatchModule forward dim 0 is the merged model axis, so this would compute "
            "across models (a plain model would reduce over its own samples, or, for an input without a batch "
            "dim, over its first feature dim). Give every model's input a batch dim, or reduce per model"
        )
