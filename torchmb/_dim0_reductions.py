"""Refuse, in a checked forward, the model's own code normalising over dim 0 of per-model data.

On the merged axis dim 0 holds every model's samples. Softmax and GLU take a dim that torch's modules
count from the end (``nn.Softmax2d`` normalises over dim -3, ``nn.GLU`` splits dim -1), so on an unbatched
input (``(C, H, W)``, ``(features,)``) it is dim 0 once merged, and the module would compute across models:
a silently wrong result. The first forward of every ``BatchModule`` (and every forward under
``torchmb.testing``) refuses it. Reductions over dim 0 (``x.mean(0)``) are left to ``torchmb.testing``'s
isolation checks, which catch every way of mixing samples across dim 0.
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
    }
)


def _dims(func: Any, args: tuple, kwargs: dict) -> Any:
    if "dim" in kwargs:
        return kwargs["dim"]
    if len(args) > 1 and args[1] is not None:
        return args[1]
    if func is F.glu:
        return -1
    return 0 if args[0].dim() in (1, 3) else 1  # softmax's implicit dim, as torch chooses it


def refuse_reduction_over_models(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise where ``func`` normalises ``args[0]`` (per-model data) over dim 0."""
    if func not in _OVER_DIM or not args or not isinstance(args[0], Tensor) or args[0].dim() < 1:
        return
    dims = _dims(func, args, kwargs)
    if isinstance(dims, int) and not isinstance(dims, bool):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return  # a named dim: not this check's
    if any(d % args[0].dim() == 0 for d in dims):
        raise ValueError(
            f"{getattr(func, '__name__', func)} over dim 0 of a tensor of shape {tuple(args[0].shape)} holding "
            "several models' data: in a BatchModule forward dim 0 is the merged model axis, so this would compute "
            "across models (a plain model would normalise over its own samples, or, for an input without a batch "
            "dim, over its first feature dim). Give every model's input a batch dim, or normalise over another dim"
        )
