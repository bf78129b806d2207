"""The conversion walk: which path each module of a plain model takes, and the report of it.

Each module takes one of five paths (:class:`ConversionEntry.path`):

- ``"registered"``: its type (or a parent type whose ``forward`` it keeps) has a batched class.
- ``"generic-whole"``: nothing below it is registered, but it or a module below it holds per-model state
  (parameters, persistent buffers), is parametrized (``torch.nn.utils.parametrize``) or draws one random
  value per batch; the whole subtree runs under one ``vmap``.
- ``"generic-own"``: it owns parameters and has registered layers below it; only its own state goes
  through ``vmap``, its children are converted as usual and keep their fast paths. So does a module
  without parameters whose code must run per model (``torchmb._calls``): it calls a method other than
  ``forward`` of a child with per-model state, or such a child on constants alone.
- ``"broadcast-own"``: it owns parameters that its ``forward`` uses only element-wise with the data (a layer
  scale, ``x.mul(self.gamma.reshape(1, -1, 1, 1))``; ``torchmb._own_operands``): its code runs on the merged
  axis, each own parameter broadcast per model over that model's rows; its children are converted as usual.
- ``"shared"``: every parameter in its subtree is shared by all models (frozen, stored once: see
  ``BatchModule``'s ``shared``) and it holds no persistent buffer; the plain module runs unchanged on all
  B*n samples of the merged axis, with the plain layer's own kernels.
- ``"passthrough"``: no per-model state of its own; it runs unchanged on the merged model axis (its
  children are converted). Persistent buffers of a module without parameters above registered layers
  are constants kept once; changing one in forward is refused.

Parameters shared between modules (tied weights) stay one batched parameter, and a module reachable
under two names stays one batched module.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_map

from batch_layers import AbstractBatchModule, is_shared_parameter

from ._calls import _CONTAINERS, per_model_call
from ._generic import batch_generically, escape_from_regions, is_generic, is_per_model
from ._own_operands import (
    broadcast_own_parameters,
    elementwise_only,
    is_broadcast_own,
    operand_names,
    restore_plain_class,
)  # fmt: skip
from ._registry import lookup_batch_module, registered_batch_modules

__all__ = ["ConversionEntry", "convert", "run_per_model", "stacked_state", "warn_if_mostly_generic"]


ConversionPath = Literal["registered", "generic-whole", "generic-own", "broadcast-own", "passthrough", "shared"]


@dataclass(frozen=True)
class ConversionEntry:
    """How one module of the plain model was batched.

    Attributes:
        name: its qualified name in the model (``""`` for the root).
        type: its plain class name.
        path: ``"registered"``, ``"generic-whole"``, ``"generic-own"``, ``"broadcast-own"``, ``"passthrough"`` or
            ``"shared"``.
        reason: why it took that path.
        parameters: parameter elements per model that this path batches (the subtree's for
            ``"registered"`` and ``"generic-whole"``, the module's own for ``"generic-own"``); a tied
            parameter counts once.
        shared: parameter elements that the same modules hold once for all models (frozen, shared
            parameters; see ``BatchModule``'s ``shared``).
    """

    name: str
    type: str
    path: ConversionPath
    reason: str
    parameters: int
    shared: int = 0

    @property
    def generic(self) -> bool:
        """Whether this module's state goes through ``torch.func`` (the slow path)."""
        return self.path in ("generic-whole", "generic-own")


def convert(model: nn.Module, batch: int) -> tuple[nn.Module, list[ConversionEntry]]:
    """Batch ``model`` in place: ``batch`` models; returns the converted root and one entry per module."""
    walk = _Walk(batch)
    ties = _tied_parameters(model)
    converted = walk.convert(model, "")
    converted._torchmb_outermost = True  # its outputs are the model's: never broadcast over the samples
    _retie(converted, ties)
    for module in converted.modules():
        if is_generic(module) and not module._torchmb_whole:
            _escape_below(module)
    return converted, walk.entries


def run_per_model(
    root: nn.Module, module: nn.Module, batch: int, reason: str, entries: list[ConversionEntry]
) -> ConversionEntry:
    """Make ``module``, a module of the converted ``root`` without state of its own whose code the first
    forward found mixing the models, run its code per model (a region); its entry in ``entries`` says why.
    Returns the new entry."""
    name = next(n for n, m in root.named_modules(remove_duplicate=False) if m is module)
    broadcast = is_broadcast_own(module)
    if not broadcast and (_owns_parameters(module) or is_generic(module) or isinstance(module, AbstractBatchModule)):
        raise RuntimeError(f"torchmb cannot run {name or 'the model'} per model: {reason}")
    position = next(i for i, entry in enumerate(entries) if entry.name == name)
    owns = f"owns {', '.join(operand_names(module))}" if broadcast else "no parameters"
    # Without state below it, the whole subtree runs per model (one model after the other where vmap cannot).
    whole = not broadcast and next(module.parameters(), None) is None and next(module.buffers(), None) is None
    entry = ConversionEntry(
        name,
        entries[position].type,
        "generic-whole" if whole else "generic-own",
        f"{owns}; at the first forward, its code {reason}: its code runs per model",
        entries[position].parameters,
    )
    entries[position] = entry
    if broadcast:  # its parameters are stacked already
        restore_plain_class(module)
    batch_generically(module, batch, whole=whole, stacked=broadcast)
    if not whole:
        _escape_below(module)
    return entry


def stacked_state(root: nn.Module) -> dict[int, tuple[Tensor, str]]:
    """Every per-model parameter and buffer of the batched layers and generic modules of ``root``, by
    ``id``, with its qualified name: tensors of all B models, which only their owner's code may read."""
    found = {}
    for module_name, module in root.named_modules():
        if is_broadcast_own(module):
            for name in operand_names(module):
                found[id(module._parameters[name])] = (module._parameters[name], f"{module_name}.{name}".lstrip("."))
            continue
        if not (isinstance(module, AbstractBatchModule) or is_generic(module)):
            continue
        batch = module.batch if isinstance(module, AbstractBatchModule) else module._torchmb_batch
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and is_per_model(module, name, tensor, batch):
                    found[id(tensor)] = (tensor, f"{module_name}.{name}" if module_name else name)
    return found


def _escape_below(module: nn.Module) -> None:
    """Let every module below a generic-own module leave its ``vmap`` when called from its code, except
    inside a subtree batched whole, whose modules run under that subtree's own ``vmap``."""
    for child in module.children():
        escape_from_regions(child)
        if not (is_generic(child) and child._torchmb_whole):
            _escape_below(child)


def warn_if_mostly_generic(entries: list[ConversionEntry]) -> None:
    """A ``UserWarning`` when most of a model's parameters go through ``torch.func`` (the slow path)."""
    total = sum(entry.parameters for entry in entries)
    generic = [entry for entry in entries if entry.generic and entry.parameters]
    share = sum(entry.parameters for entry in generic) / total if total else 0.0
    if share > 0.5:
        largest = sorted(generic, key=lambda entry: -entry.parameters)[:3]
        named = "; ".join(f"{entry.name or entry.type} ({entry.reason})" for entry in largest)
        warnings.warn(
            f"torchmb: {share:.0%} of the model's parameters are batched through torch.func, without a "
            f"registered batched layer (slower); largest: {named}. See BatchModule.conversion_report()",
            UserWarning,
            stacklevel=3,
        )


class _Walk:
    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.entries: list[ConversionEntry] = []
        self.converted: dict[int, nn.Module] = {}
        self.fast_below: dict[int, bool] = {}
        self.counted: set[int] = set()

    def convert(self, module: nn.Module, name: str) -> nn.Module:
        if id(module) not in self.converted:
            self.converted[id(module)] = self._convert_new(module, name)
        return self.converted[id(module)]

    def _convert_new(self, module: nn.Module, name: str) -> nn.Module:
        if _all_shared(module):
            for sub_name, sub in module.named_modules(prefix=name):
                reason = "every parameter shared by all models: the plain module runs on all B*n samples"
                self._record(sub, sub_name, "shared", reason, sub.parameters(recurse=False))
            return module
        batch_class = lookup_batch_module(type(module))
        mixed = batch_class is not None and not batch_class.keeps_shared_parameters
        if mixed and any(map(is_shared_parameter, module.parameters())):
            # A registered layer mixing shared and per-model parameters (a frozen weight, a trained bias): its
            # plain code under vmap, reading the shared ones unbatched (one matrix product for all models).
            shared = ", ".join(n for n, p in module.named_parameters() if is_shared_parameter(p))
            reason = f"mixes parameters shared by all models ({shared}) with per-model ones: the plain code per model"
            self._record(module, name, "generic-whole", reason, module.parameters())
            return batch_generically(module, self.batch, whole=True)
        if batch_class is not None and not parametrize.is_parametrized(module):
            batched = batch_class.from_module(module, self.batch)  # first: refuses what it cannot batch
            self._record(module, name, "registered", f"registered: {batch_class.__qualname__}", module.parameters())
            return batched
        broadcast = self._broadcast_names(module)
        if broadcast:
            reason = f"owns {', '.join(broadcast)}, used only element-wise: broadcast per model on the merged axis"
            self._record(module, name, "broadcast-own", reason, module.parameters(recurse=False))
            self._convert_children(module, name)
            return broadcast_own_parameters(module, self.batch, broadcast)
        whole_reason = self._whole_reason(module)
        if whole_reason is not None:
            self._record(module, name, "generic-whole", whole_reason, module.parameters())
            return batch_generically(module, self.batch, whole=True)
        own = _own_state(module)
        owns_parameters = _owns_parameters(module)
        call = None if owns_parameters or isinstance(module, _CONTAINERS) else per_model_call(module, _stateful)
        region = owns_parameters or call is not None
        if call is not None:
            self._record(module, name, "generic-own", f"no parameters; its {call}: its code runs per model", ())
        elif own and not owns_parameters:
            # Registered layers below and buffers only: the buffers are constants (positional tables), kept
            # once rather than sending the module's code through vmap; one changing in forward is refused.
            own_buffers = ", ".join(own)
            reason = f"no parameters; buffers {own_buffers} stay shared constants, changing them in forward is refused"
            self._record(module, name, "passthrough", reason, ())
            _refuse_buffer_changes(module)
        elif own:
            self._record(module, name, "generic-own", f"owns {', '.join(own)}", module.parameters(recurse=False))
        else:
            self._record(module, name, "passthrough", "no per-model state of its own", ())
        self._convert_children(module, name)
        _adapt_transformer(module)
        return batch_generically(module, self.batch, whole=False) if region else module

    def _convert_children(self, module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            converted = self.convert(child, f"{name}.{child_name}" if name else child_name)
            if converted is not child:
                setattr(module, child_name, converted)

    def _broadcast_names(self, module: nn.Module) -> list[str]:
        """The own parameters of ``module`` to broadcast per model on the merged axis (``torchmb._own_operands``),
        or ``[]`` where its code must run per model: it holds persistent buffers, is parametrized or a container,
        calls or reads its children's per-model state, or its ``forward`` uses a parameter otherwise than
        element-wise."""
        own = _own_state(module)
        parameters = [name for name, p in module._parameters.items() if p is not None]
        if not own or not _owns_parameters(module) or own != parameters:
            return []  # persistent buffers, or a shared parameter (not in own), keep the per-model region
        if parametrize.is_parametrized(module) or isinstance(module, _CONTAINERS):
            return []
        if per_model_call(module, _stateful) is not None or not elementwise_only(module, own):
            return []
        return own

    def _whole_reason(self, module: nn.Module) -> str | None:
        """Why ``module``'s whole subtree goes through ``vmap``, or None when it should not."""
        if parametrize.is_parametrized(module):
            return f"parametrized ({', '.join(module.parametrizations)}): the parametrization runs per model"
        if self._fast_path_below(module) or isinstance(module, _CONTAINERS):
            return None  # a container never reads its children's state: they decide for themselves
        if any(_draws_once_per_batch(m) for m in module.modules()):
            return "draws one random value per batch: under vmap, one per model"
        if not any(_own_state(m) for m in module.modules()):
            return None
        overridden = _overridden_parent(type(module))
        if overridden is not None:
            parent = f"{overridden.__module__}.{overridden.__qualname__}"
            return f"subclass of registered {parent} overriding forward; no registered layer below"
        if next(module.parameters(), None) is None:
            return "holds persistent buffers (per model, as they may change in training); no parameters"
        return f"unregistered type {type(module).__qualname__}; no registered layer below"

    def _fast_path_below(self, module: nn.Module) -> bool:
        """Whether a registered layer that keeps its fast path lies in ``module``'s subtree (or is it)."""
        key = id(module)
        if key not in self.fast_below:
            registered = lookup_batch_module(type(module)) is not None
            self.fast_below[key] = not parametrize.is_parametrized(module) and (
                registered or any(self._fast_path_below(child) for child in module.children())
            )
        return self.fast_below[key]

    def _record(
        self, module: nn.Module, name: str, path: ConversionPath, reason: str, params: Iterable[nn.Parameter]
    ) -> None:
        fresh = [p for p in params if id(p) not in self.counted]
        self.counted.update(id(p) for p in fresh)
        count = sum(p.numel() for p in fresh if not is_shared_parameter(p))
        shared = sum(p.numel() for p in fresh if is_shared_parameter(p))
        self.entries.append(ConversionEntry(name, type(module).__qualname__, path, reason, count, shared))


def _own_state(module: nn.Module) -> list[str]:
    """The names of ``module``'s own per-model parameters (those not shared by all models) and persistent
    buffers."""
    params = [name for name, p in module._parameters.items() if p is not None and not is_shared_parameter(p)]
    buffers = [
        name for name, b in module._buffers.items() if b is not None and name not in module._non_persistent_buffers_set
    ]
    return params + buffers


def _owns_parameters(module: nn.Module) -> bool:
    return any(p is not None and not is_shared_parameter(p) for p in module._parameters.values())


def _all_shared(module: nn.Module) -> bool:
    """Whether ``module``'s subtree holds parameters, all shared by all models, and nothing per model (no
    persistent buffer, no once-per-batch random draw): the plain module then computes every model's."""
    return (
        any(map(is_shared_parameter, module.parameters()))
        and not any(_own_state(m) for m in module.modules())
        and not any(_draws_once_per_batch(m) for m in module.modules())
    )


def _stateful(module: nn.Module) -> bool:
    """Whether ``module``'s subtree holds per-model state (of a registered layer or not)."""
    return any(_own_state(m) for m in module.modules())


def _refuse_buffer_changes(module: nn.Module) -> None:
    module.register_forward_pre_hook(_note_buffer_versions)
    module.register_forward_hook(_check_buffer_versions)


def _buffer_versions(module: nn.Module) -> dict[str, tuple[int, int]]:
    return {name: (id(module._buffers[name]), module._buffers[name]._version) for name in _own_state(module)}


def _note_buffer_versions(module: nn.Module, args: tuple) -> None:
    if not torch.compiler.is_compiling():  # version counters are not traceable; eager forwards check
        module._torchmb_buffer_versions = _buffer_versions(module)


def _check_buffer_versions(module: nn.Module, args: tuple, output: object) -> None:
    if torch.compiler.is_compiling():
        return
    before = module._torchmb_buffer_versions
    changed = [name for name, version in _buffer_versions(module).items() if before.get(name) != version]
    if changed:
        raise RuntimeError(
            f"{type(module).__qualname__} changed its buffers {', '.join(changed)} in forward. torchmb keeps the "
            "buffers of a module without parameters whose children are registered layers once, for all models "
            "(constants); a buffer that changes must be per model: move it into a child module of its own, "
            "which torchmb batches per model"
        )


def _draws_once_per_batch(module: nn.Module) -> bool:
    """torchvision's ``StochasticDepth(mode="batch")`` keeps or drops the whole batch with one draw: run on
    the merged axis, one draw would decide for all models."""
    return type(module).__name__ == "StochasticDepth" and getattr(module, "mode", None) == "batch"


def _overridden_parent(cls: type[nn.Module]) -> type[nn.Module] | None:
    registered = registered_batch_modules()
    return next((parent for parent in cls.__mro__[1:] if parent in registered), None)


def _adapt_transformer(module: nn.Module) -> None:
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        if not module.self_attn.batch_first:
            # Its feed-forward and norms see (seq, B*n, d): hand them batch-first tensors, so that
            # the model axis is found even where seq == B*n and the shapes alone cannot tell.
            for child in module.children():
                if isinstance(child, AbstractBatchModule) and not hasattr(child, "batch_first"):
                    _sequence_first_around(child)
    if isinstance(module, nn.TransformerEncoder):
        # torch's nested-tensor inference path drops padded positions into a nested tensor, which
        # has no merged model axis; the padded computation gives the same results.
        module.use_nested_tensor = False


def _sequence_first_around(module: AbstractBatchModule) -> None:
    """Run ``module`` on ``(B*n, seq, ...)`` tensors although its caller passes ``(seq, B*n, ...)``."""

    def to_batch_first(tensor):
        return tensor.movedim(1, 0) if isinstance(tensor, Tensor) and tensor.dim() > 2 else tensor

    def to_sequence_first(tensor):
        return tensor.movedim(0, 1) if isinstance(tensor, Tensor) and tensor.dim() > 2 else tensor

    module.register_forward_pre_hook(lambda _, args: tree_map(to_batch_first, args))
    module.register_forward_hook(lambda _, args, out: tree_map(to_sequence_first, out))
    module.sequence_first = True


# -- tied parameters -------------------------------------------------------------------------------------


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that hold one parameter, for each parameter held twice."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module_name, name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Make each group of tied parameters one batched parameter again (the first holder's)."""
    for (first_module, first_name), *others in ties:
        shared = model.get_submodule(first_module)._parameters[first_name]
        for module_name, name in others:
            holder = model.get_submodule(module_name)
            current = holder._parameters[name]
            if current is shared:
                continue
            if current.shape != shared.shape:
                raise ValueError(
                    f"cannot keep {module_name}.{name} tied to {first_module}.{first_name}: their batched shapes "
                    f"differ ({tuple(current.shape)} vs {tuple(shared.shape)})"
                )
            holder._parameters[name] = shared
