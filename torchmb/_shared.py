"""Parameters that all models of a ``BatchModule`` share: stored once, without a model axis, and frozen.

Fine-tuning sweeps train B heads or adapters on one frozen pretrained backbone. Replicating the backbone B
times would cost B times its memory and run its forward on B equal weight sets; instead its parameters are
marked shared (:func:`batch_layers.mark_shared_parameter`) before conversion, and the converter
(``torchmb._convert``) leaves a module whose parameters are all shared as the plain module, which then
computes all B*n samples of the merged axis with its own kernels. A layer mixing shared and per-model
parameters runs its plain code per model through ``torch.func``, the shared ones read unbatched. The
plain model kept for ``unbatch`` holds the same shared tensors, so the backbone is in memory once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from batch_layers import is_shared_parameter, mark_shared_parameter

__all__ = ["SharedMarksKept", "SharedSpec", "copy_sharing", "shared_keys", "shared_names", "shared_summary"]

SharedSpec = Callable[[str, nn.Parameter], bool] | Iterable[str] | None


def shared_names(model: nn.Module, shared: SharedSpec) -> set[str]:
    """The names of ``model``'s parameters that ``shared`` (see :class:`torchmb.BatchModule`) says all
    models share: ``None`` the frozen ones, a function ``(name, parameter) -> bool``, or their names."""
    named = dict(model.named_parameters())
    if shared is None:
        chosen = {name for name, p in named.items() if not p.requires_grad}
    elif callable(shared):
        chosen = {name for name, p in named.items() if shared(name, p)}
    elif isinstance(shared, str):
        raise TypeError(f"shared expects a function (name, parameter) -> bool or names, got the string {shared!r}")
    else:
        chosen = set(shared)
        unknown = sorted(chosen - set(named))
        if unknown:
            raise KeyError(f"shared names parameters the model does not have: {unknown}")
    trainable = sorted(name for name in chosen if named[name].requires_grad)
    if trainable:
        raise ValueError(
            "shared parameters must be frozen (requires_grad=False): one tensor trained from all models' "
            f"gradients would tie the models together; these require grad: {trainable}"
        )
    return chosen


def copy_sharing(model: nn.Module, names: set[str]) -> tuple[nn.Module, nn.Module]:
    """Two deep copies of ``model`` (the template for ``unbatch``, the one to convert) holding the same
    parameter tensors under ``names``, marked shared."""
    template = copy.deepcopy(model)
    template_parameters = dict(template.named_parameters())
    memo = {id(p): template_parameters[name] for name, p in model.named_parameters() if name in names}
    for parameter in memo.values():
        mark_shared_parameter(parameter)
    return template, copy.deepcopy(model, memo)


def mark_shared_keys(module: nn.Module, keys: Iterable[str]) -> None:
    """Mark ``module``'s state entries ``keys`` shared again (a parameter's Python attributes do not
    survive its deepcopy or pickling)."""
    state = module.state_dict(keep_vars=True)
    for key in keys:
        mark_shared_parameter(state[key])


def shared_keys(module: nn.Module) -> frozenset[str]:
    """The state-dict keys of ``module``'s shared parameters (every name of a tied one)."""
    return frozenset(key for key, value in module.state_dict(keep_vars=True).items() if is_shared_parameter(value))


def shared_summary(module: nn.Module) -> str:
    """What ``module`` holds once for all models, for a ``repr``."""
    shared = [p for p in module.parameters() if is_shared_parameter(p)]
    return f"shared by all models: {len(shared)} parameters ({sum(p.numel() for p in shared):,} elements)"


class SharedMarksKept:
    """Keeps a ``BatchModule``'s shared parameters marked (see :func:`batch_layers.mark_shared_parameter`)
    through ``copy.deepcopy`` and pickling, which drop a parameter's Python attributes."""

    module: nn.Module
    shared_keys: frozenset[str]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        mark_shared_keys(copied.module, copied.shared_keys)
        return copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # nn.Module's
        mark_shared_keys(self.module, self.__dict__.get("shared_keys", ()))
