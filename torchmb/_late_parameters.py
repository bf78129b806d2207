"""Parameters a model creates in ``forward`` after conversion (``if not hasattr(self, "scale"): self.scale =
nn.Parameter(...)``) would be one plain tensor shared by all B models, its gradient summed over them: they
are refused in the forward that creates them, naming the parameter, through torch's global parameter
registration hook (called only when a parameter is registered, so forwards cost nothing)."""

from __future__ import annotations

import weakref

from torch import Tensor, nn

from batch_layers import current_forward

__all__ = ["watch_late_parameters"]

# Every module of every BatchModule, with its name in the model; weak, so a dropped model is forgotten.
_WATCHED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_HOOK: list[object] = []


def watch_late_parameters(model: nn.Module) -> None:
    """Refuse parameters registered on ``model``'s modules (a converted model) during a batched forward."""
    if not _HOOK:
        _HOOK.append(nn.modules.module.register_module_parameter_registration_hook(_refuse_in_forward))
    for name, module in model.named_modules():
        _WATCHED[module] = name


def _refuse_in_forward(module: nn.Module, name: str, param: Tensor | None) -> None:
    if param is None or current_forward() is None:
        return
    path = _WATCHED.get(module)
    if path is None:
        return
    owner = f"{path} ({type(module).__name__})" if path else f"the model's root ({type(module).__name__})"
    raise RuntimeError(
        f"parameter {name!r} of {owner} was created in forward, after BatchModule converted the model: it would "
        "be one tensor shared by all models (its gradient summed over them); create it in __init__, or run the "
        "plain model once before converting it, so that every model gets its own"
    )
