"""Plain state dicts in and out of a BatchModule's batched tensors.

Every entry of the batched module's state dict is either per model, ``(B, *plain_shape)``, with model ``i``'s
tensor at ``[i]``, or stored once for all models with the plain shape (a constant buffer).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["is_per_model", "load_plain_states", "loading_plan", "model_index", "plain_model"]

PlainShapes = Mapping[str, tuple[int, ...]]


def is_per_model(key: str, value: Tensor, batch: int, plain_shapes: PlainShapes) -> bool:
    """Whether the batched state entry ``key`` holds one tensor per model (else one for all of them)."""
    plain = plain_shapes.get(key)
    if plain is None:
        raise KeyError(f"state entry {key!r} has no counterpart in the plain model")
    if tuple(value.shape) == (batch, *plain):
        return True
    if tuple(value.shape) == plain:
        return False
    raise RuntimeError(f"state entry {key!r} has shape {tuple(value.shape)}; expected {(batch, *plain)} or {plain}")


def load_plain_states(
    targets: Mapping[str, Tensor],
    state_dicts: Sequence[Mapping[str, Any]],
    slots: list[int],
    batch: int,
    plain_shapes: PlainShapes,
    shared_keys: Collection[str] = (),
) -> None:
    """Copy ``state_dicts[j]`` into model ``slots[j]`` of the batched state ``targets`` (keep_vars tensors,
    written in place so that parameters keep their identity). Everything is checked before anything is
    written: keys, shapes, that entries stored once agree, and that the parameters all models share
    (``shared_keys``, frozen) keep their stored values."""
    if len(state_dicts) != len(slots):
        raise ValueError(f"expected {len(slots)} state dicts (one per model), got {len(state_dicts)}")
    for i, state in enumerate(state_dicts):
        missing = sorted(set(targets) - set(state))
        unexpected = sorted(set(state) - set(targets))
        if missing or unexpected:
            raise KeyError(f"state dict {i}: missing keys {missing}, unexpected keys {unexpected}")
        for key, value in state.items():
            if tuple(value.shape) != plain_shapes[key]:
                raise ValueError(
                    f"state dict {i}: {key!r} expected shape {plain_shapes[key]}, got {tuple(value.shape)}"
                )
            if key in shared_keys and not torch.equal(value.to(targets[key].device, targets[key].dtype), targets[key]):
                raise ValueError(
                    f"state dict {i}: {key!r} is a parameter shared by all models (frozen, stored once) and the "
                    "state holds a different value; shared parameters cannot change by loading (build the "
                    "BatchModule with shared=... leaving it out to give every model its own)"
                )
    shared = {key for key, target in targets.items() if not is_per_model(key, target, batch, plain_shapes)}
    for key in shared:  # checked before any entry is written
        target = targets[key]
        first = state_dicts[0][key].to(target.device, target.dtype)
        if any(not torch.equal(first, state[key].to(target.device, target.dtype)) for state in state_dicts[1:]):
            raise ValueError(f"{key!r} is stored once for all models; the state dicts disagree on it")
        if len(slots) != batch and not torch.equal(first, target):
            raise ValueError(f"{key!r} is stored once for all models; loading into some slots cannot change it")
    with torch.no_grad():
        for key, target in targets.items():
            values = [state[key] for state in state_dicts]
            if key in shared:
                target.copy_(values[0].to(target.device, target.dtype))
                continue
            stacked = torch.stack([v.to(target.device, target.dtype) for v in values])
            if slots == list(range(batch)):
                target.copy_(stacked)
            else:
                target[torch.tensor(slots, device=target.device)] = stacked


def model_index(index: Any, batch: int) -> int:
    """``index`` (an int, NumPy int or integer 0-d tensor in ``[-batch, batch)``) as a model index in
    ``[0, batch)``; a float, a bool or an index out of range is refused."""
    try:
        if isinstance(index, bool):
            raise TypeError
        index = operator.index(index)
    except TypeError:
        raise TypeError(
            f"a model index must be an int in [-{batch}, {batch}), got {index!r} ({type(index).__name__})"
        ) from None
    if not -batch <= index < batch:
        raise IndexError(f"model index {index} is out of range for batch={batch}")
    return index % batch


def loading_plan(
    state_dicts: Mapping[str, Any] | Sequence[Mapping[str, Any]], slots: Sequence[int] | None, batch: int
) -> tuple[list[int], list[Mapping[str, Any]]]:
    """The slots (distinct models, all ``batch`` of them when ``None``) and one state dict for each, from
    ``BatchModule.load_state_dicts``' arguments: a single state dict goes into every slot."""
    if slots is None:
        slots = list(range(batch))
    else:
        slots = [model_index(s, batch) for s in slots]
        repeated = sorted({s for s in slots if slots.count(s) > 1})
        if repeated:
            raise ValueError(f"load_state_dicts: slots name each model once; models {repeated} repeat in {slots}")
    if isinstance(state_dicts, Mapping):
        return slots, [state_dicts] * len(slots)
    if not isinstance(state_dicts, Sequence) or isinstance(state_dicts, str):
        raise TypeError(
            f"load_state_dicts expects a plain state dict or a sequence of them, got {type(state_dicts).__name__}"
        )
    if len(state_dicts) != len(slots):
        per = "slot" if len(slots) != batch else f"model, B = {batch}"
        raise ValueError(
            f"load_state_dicts: expected {len(slots)} state dicts (one per {per}) or a single one for all "
            f"of them, got a sequence of {len(state_dicts)}"
        )
    return slots, list(state_dicts)


def plain_model(model: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """``model`` (a copy of the plain template) holding ``state``, in ``state``'s dtypes (a batched model made
    ``.double()`` gives float64 plain models); tied parameters stay tied."""
    with torch.no_grad():
        for key, tensor in model.state_dict(keep_vars=True).items():
            if tensor.dtype != state[key].dtype:
                tensor.data = tensor.data.to(state[key].dtype)
    model.load_state_dict(state)
    return model
