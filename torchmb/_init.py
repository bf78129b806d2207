"""Independent initialisation: model ``i`` of B is the plain model seeded with ``seed + i``.

Two ways, streamed one plain model at a time into the batched parameters so that initialising costs
about one extra plain model of memory:

- :meth:`BatchModule.from_factory` calls the user's factory once per model after
  ``torch.manual_seed(seed + i)``: custom ``__init__`` code, ``self.apply(_init_weights)`` schemes and
  bare ``nn.Parameter`` attributes are initialised exactly as B plain constructions would be.
- ``init="independent"`` on a module instance can only call each submodule's ``reset_parameters()``
  (torch.nn's layer defaults; ``_reset_parameters()`` where a module has only that, as
  ``nn.MultiheadAttention``); parameters of a module with neither are left as given, identical in every
  model, and :func:`reset_uncovered` names them so the constructor can warn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["build_with_seed", "random_state_kept", "reset_uncovered", "reset_with_seed", "seeded"]


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Run a block, then restore torch's CPU random state and that of every CUDA device already initialised."""
    devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block after ``torch.manual_seed(seed)``, restoring the random state afterwards."""
    with random_state_kept():
        torch.manual_seed(seed)
        yield


def _reset_method(module: nn.Module) -> Callable[[], None] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return reset
    return None


def reset_with_seed(model: nn.Module, seed: int) -> nn.Module:
    """Re-initialise ``model`` in place: each submodule's ``reset_parameters()`` (else its
    ``_reset_parameters()``), in ``modules()`` order, after seeding torch with ``seed``; returns it."""
    with seeded(seed):
        for submodule in model.modules():
            reset = _reset_method(submodule)
            if reset is not None:
                reset()
    return model


def reset_uncovered(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters that :func:`reset_with_seed` leaves as they are: those owned by a
    module with no reset method (a bare ``nn.Parameter`` such as a position table or a class token)."""
    return [
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        if _reset_method(module) is None
        for key, parameter in module._parameters.items()
        if parameter is not None
    ]


def build_with_seed(make_model: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``make_model()`` called after ``torch.manual_seed(seed)``, as a plain construction would be."""
    with seeded(seed):
        model = make_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory must return an nn.Module, got {type(model).__name__}")
    return model
