"""Plain state dicts in and out of a BatchModule's batched tensors.

Every entry of the batched module's state dict is either per model, ``(B, *plain_shape)``, with model ``i``'s
tensor at ``[i]``, or stored once for all models with the plain shape (a constant buffer).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["is_per_model", "load_plain_states"]

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
    with torch.no_grad():
        for key, target in targets.items():
            values = [state[key] for state in state_dicts]
            if is_per_model(key, target, batch, plain_shapes):
                stacked = torch.stack([v.to(target.device, target.dtype) for v in values])
                if slots == list(range(batch)):
                    target.copy_(stacked)
                else:
                    target[torch.tensor(slots, device=target.device)] = stacked
            else:
                first = values[0].to(target.device, target.dtype)
                if any(not torch.equal(first, v.to(target.device, target.dtype)) for v in values[1:]):
                    raise ValueError(f"{key!r} is stored once for all models; the state dicts disagree on it")
                if len(slots) != batch and not torch.equal(first, target):
                    raise ValueError(f"{key!r} is stored once for all models; loading into some slots cannot change it")
                target.copy_(first)
