"""Per-model gradient clipping and divergence checks.

``torch.nn.utils.clip_grad_norm_`` on a batched model would compute one norm over all B models and
scale every model by it, so one model's large gradient would shrink the others' steps. The functions
here treat ``p[i]`` as model ``i``'s and never mix models: each model is clipped by its own total norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from batch_layers import is_shared_parameter

from .optim._base import NO_MODEL_AXIS, per_model_values

__all__ = ["clip_grad_norm_", "clip_grad_value_", "diverged", "diverged_indices"]


def _as_list(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    """The tensors given, less the frozen parameters shared by all models (no model axis, no gradient)."""
    tensors = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    return [t for t in tensors if not is_shared_parameter(t)]


def _batch_of(tensors: list[Tensor], what: str) -> int:
    batch = None
    for t in tensors:
        if t.dim() == 0:
            raise ValueError(f"{what}: expected tensors with a leading model axis (B, ...), got a 0-d tensor")
        if getattr(t, "no_model_axis", False):
            raise ValueError(f"{what}: {NO_MODEL_AXIS}")
        if batch is None:
            batch = int(t.shape[0])
        elif t.shape[0] != batch:
            raise ValueError(
                f"{what}: every tensor needs the same leading model axis B = {batch}, got shape {tuple(t.shape)}"
            )
    if batch is None:
        raise ValueError(f"{what}: got no tensors")
    return batch


def _per_model(value: Any, batch: int, name: str, like: Tensor) -> float | Tensor:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return per_model_values(value, batch, name).to(like.device, like.dtype)


def _refuse_negative(value: Any, batch: int, name: str) -> None:
    """A negative bound would flip or zero gradients (torch's own functions do so silently): refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{name}: expected a non-negative number, got {value}")
        return
    values = per_model_values(value, batch, name)
    if bool((values < 0).any()):
        models = (values < 0).nonzero().flatten().tolist()
        raise ValueError(f"{name}: expected non-negative values, got {values[values < 0].tolist()} for models {models}")


def _rows(value: float | Tensor, like: Tensor) -> float | Tensor:
    if isinstance(value, float):
        return value
    return value.to(like.device, like.dtype).view(-1, *([1] * (like.dim() - 1)))


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor], max_norm: Any, norm_type: float | str = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """Clip each model's gradients by its own total norm, in place.

    Model ``i``'s gradients (``p.grad[i]`` of every parameter) are scaled by
    ``min(1, max_norm[i] / (norm_i + 1e-6))``, exactly as ``torch.nn.utils.clip_grad_norm_`` would scale
    model ``i`` held on its own.

    Args:
        parameters: parameters with a leading model axis ``(B, ...)`` (those without a gradient are skipped).
        max_norm: a number or B numbers.
        norm_type: the p of the p-norm (``float("inf")`` or ``"inf"`` for the max norm).
        error_if_nonfinite: raise (naming the models) when a model's norm is inf or NaN.

    Returns:
        The per-model total norms before clipping, ``(B,)``.
    """
    params = _as_list(parameters)
    batch = _batch_of(params, "clip_grad_norm_")
    _refuse_negative(max_norm, batch, "max_norm")
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.zeros(batch, device=params[0].device)
    first = grads[0].device
    norms = [torch.linalg.vector_norm(g.reshape(batch, -1), norm_type, dim=1).to(first) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type, dim=0)
    if error_if_nonfinite:
        bad = ~torch.isfinite(total)
        if bool(bad.any()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for the gradients of models "
                f"{bad.nonzero().flatten().tolist()} is non-finite, so they cannot be clipped. "
                "To disable this error and scale those gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
    limit = _per_model(max_norm, batch, "max_norm", total)
    coef = torch.clamp(limit / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device).view(-1, *([1] * (g.dim() - 1))))
    return total


@torch.no_grad()
def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: Any) -> None:
    """Clamp each model's gradients to ``[-clip_value[i], clip_value[i]]``, in place.

    Args:
        parameters: parameters with a leading model axis ``(B, ...)``.
        clip_value: a number or B non-negative numbers.
    """
    params = _as_list(parameters)
    batch = _batch_of(params, "clip_grad_value_")
    grads = [p.grad for p in params if p.grad is not None]
    _refuse_negative(clip_value, batch, "clip_value")
    if isinstance(clip_value, (int, float)) and not isinstance(clip_value, bool):
        value = float(clip_value)
        for g in grads:
            g.clamp_(min=-value, max=value)
        return
    values = per_model_values(clip_value, batch, "clip_value")
    for g in grads:
        bound = _rows(values, g)
        g.clamp_(min=-bound, max=bound)


@torch.no_grad()
def diverged(
    losses: Tensor | None = None, parameters: Tensor | Iterable[Tensor] | None = None, *, grads: bool = False
) -> Tensor:
    """Which models diverged: a bool ``(B,)`` mask of models whose loss or parameters hold inf or NaN.

    Args:
        losses: per-model losses with a leading model axis, ``(B,)`` or ``(B, ...)``.
        parameters: parameters with a leading model axis ``(B, ...)``.
        grads: also count non-finite gradients of ``parameters``.

    Returns:
        A bool tensor on the device of the first input; ``diverged_indices`` gives a list of indices.
        Nothing is synchronised with the host.
    """
    tensors: list[Tensor] = []
    if losses is not None:
        tensors.append(losses if losses.dim() else losses.reshape(1))
        if losses.dim() == 0:
            raise ValueError("diverged: expected per-model losses with a leading model axis (B, ...), got a 0-d tensor")
    if parameters is not None:
        params = _as_list(parameters)
        _batch_of(params, "diverged")  # refuses tensors without a model axis before they are detached
        tensors.extend(p.detach() for p in params)
        if grads:
            tensors.extend(p.grad for p in params if p.grad is not None)
    if not tensors:
        raise ValueError("diverged: give losses, parameters or both")
    batch = _batch_of(tensors, "diverged")
    device = tensors[0].device
    mask = torch.zeros(batch, dtype=torch.bool, device=device)
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            mask |= (~torch.isfinite(t)).reshape(batch, -1).any(dim=1).to(device)
    return mask


def diverged_indices(
    losses: Tensor | None = None, parameters: Tensor | Iterable[Tensor] | None = None, *, grads: bool = False
) -> list[int]:
    """The indices of the models :func:`diverged` reports (synchronises with the device)."""
    return diverged(losses, parameters, grads=grads).nonzero().flatten().tolist()
