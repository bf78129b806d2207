"""The map from plain ``nn.Module`` types to their batched classes, and the table of types torchmb refuses
to batch, each with the reason and what to do instead."""

from __future__ import annotations

from typing import TypeVar, overload

from torch import nn

import batch_layers
from batch_layers import AbstractBatchModule

from ._lora import LoraLinear

__all__ = ["lookup_batch_module", "refuse_batch_module", "refused_batch_modules", "register_batch_module",
           "registered_batch_modules"]

_REGISTRY: dict[type[nn.Module], type[AbstractBatchModule]] = {}
_REFUSED: dict[type[nn.Module], str] = {}

BatchClass = TypeVar("BatchClass", bound=type[AbstractBatchModule])


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


def _batch_class_for(module_class: type[nn.Module]) -> type[AbstractBatchModule]:
    """torchmb 0.2's docs registered the *plain* class; find the one batched class declaring it."""
    candidates = {c for c in _all_subclasses(AbstractBatchModule) if c.__dict__.get("base_class") is module_class}
    if len(candidates) != 1:
        found = ", ".join(sorted(c.__qualname__ for c in candidates)) or "none"
        raise TypeError(
            f"register_batch_module expects a subclass of AbstractBatchModule; given the plain module "
            f"{module_class.__qualname__}, exactly one AbstractBatchModule subclass must declare "
            f"base_class = {module_class.__qualname__} (found: {found})"
        )
    return candidates.pop()


@overload
def register_batch_module(batch_class: BatchClass, *, overwrite: bool = False) -> BatchClass: ...
@overload
def register_batch_module(batch_class: type[nn.Module], *, overwrite: bool = False) -> type[nn.Module]: ...


def register_batch_module(batch_class, *, overwrite=False):
    """Register ``batch_class`` as the batched version of its ``base_class``; usable as a decorator.

    Args:
        batch_class: a subclass of :class:`AbstractBatchModule` with ``base_class`` set. For torchmb 0.2
            code, the plain module class is accepted too when exactly one batched class declares it.
        overwrite: replace an existing, different registration instead of refusing it.

    Returns:
        ``batch_class`` unchanged, so the function works as a class decorator.

    Raises:
        TypeError: for anything that is not a batched class with a ``base_class``.
        ValueError: if ``base_class`` is already registered to another class and ``overwrite`` is False.
    """
    given = batch_class
    if (
        isinstance(batch_class, type)
        and issubclass(batch_class, nn.Module)
        and not issubclass(batch_class, AbstractBatchModule)
    ):
        batch_class = _batch_class_for(batch_class)
    if not (isinstance(batch_class, type) and issubclass(batch_class, AbstractBatchModule)):
        raise TypeError(f"register_batch_module expects a subclass of AbstractBatchModule, got {batch_class!r}")
    base = batch_class.base_class
    if base is nn.Module or not issubclass(base, nn.Module):
        raise TypeError(f"{batch_class.__qualname__}.base_class must name the plain nn.Module it batches")
    current = _REGISTRY.get(base)
    if current is not None and current is not batch_class and not overwrite:
        raise ValueError(
            f"{base.__qualname__} is already batched by {current.__module__}.{current.__qualname__}; "
            f"pass overwrite=True to replace it with {batch_class.__qualname__}"
        )
    _REGISTRY[base] = batch_class
    return given


# Layers of optional libraries (timm, torchvision, peft) with a batched class, by the plain class's
# qualified name (torchmb imports none of them; a model holding one has imported it).
_BY_NAME: dict[str, type[AbstractBatchModule]] = {
    "torchvision.ops.misc.FrozenBatchNorm2d": batch_layers.FrozenBatchNorm2d,
    "timm.layers.std_conv.StdConv2d": batch_layers.StdConv2d,
    "timm.layers.std_conv.StdConv2dSame": batch_layers.StdConv2dSame,
    "timm.layers.std_conv.ScaledStdConv2d": batch_layers.ScaledStdConv2d,
    "timm.layers.std_conv.ScaledStdConv2dSame": batch_layers.ScaledStdConv2dSame,
    "peft.tuners.lora.layer.Linear": LoraLinear,
    "transformers.pytorch_utils.Conv1D": batch_layers.TransposedLinear,
}

# Subclasses of registered torch layers whose ``forward`` (checked for each name) reaches the layer's
# weights only through the functionals its parent's batched class swaps in (``batch_layers.batched_subclass``):
# ``F.linear``, ``F.conv2d``, ``F.batch_norm``, ``F.layer_norm``, ``F.group_norm``, with permutes, activations
# and dropout around them. Their own ``forward`` runs on the batched layer.
_FUNCTIONAL_SUBCLASSES: frozenset[str] = frozenset(
    {
        "timm.layers.conv2d_same.Conv2dSame",
        "timm.layers.linear.Linear",
        "timm.layers.norm.GroupNorm",
        "timm.layers.norm.GroupNorm1",
        "timm.layers.norm.LayerNorm",
        "timm.layers.norm.LayerNorm2d",
        "timm.layers.norm.LayerNorm2dFp32",
        "timm.layers.norm.LayerNormFp32",
        "timm.layers.norm_act.BatchNormAct2d",
        "timm.layers.norm_act.GroupNorm1Act",
        "timm.layers.norm_act.GroupNormAct",
        "timm.layers.norm_act.LayerNormAct",
        "timm.layers.norm_act.LayerNormAct2d",
        "torchvision.models.convnext.LayerNorm2d",
    }
)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _forward_owner(cls: type[nn.Module]) -> type[nn.Module]:
    """The class in ``cls``'s MRO whose ``forward`` ``cls`` runs."""
    return next(c for c in cls.__mro__ if "forward" in c.__dict__)


def lookup_batch_module(module_class: type[nn.Module]) -> type[AbstractBatchModule] | None:
    """The batched class for ``module_class``: exact type first, then a known layer of timm or torchvision
    by name, then its MRO.

    Raises ``TypeError`` with the reason for a type torchmb refuses (see :func:`refused_batch_modules`), or
    a subclass of one that no registered class comes before in its MRO.

    A subclass that keeps its parent's ``forward`` takes the parent's batched class. One that overrides
    ``forward`` keeps its computation: when the overriding class is one of timm's and torchvision's listed here,
    its own ``forward`` runs with the parent's batched functionals swapped in
    (:func:`batch_layers.batched_subclass`; register that for a subclass of your own); otherwise it is left
    to the ``torch.func`` path.
    """
    if module_class in _REGISTRY:
        return _REGISTRY[module_class]
    for parent in module_class.__mro__:
        if parent in _REFUSED:
            raise TypeError(_REFUSED[parent])
        if parent in _REGISTRY:
            break
    by_name = _BY_NAME.get(_qualified_name(module_class))
    if by_name is not None:
        return by_name
    for parent in module_class.__mro__[1:]:
        if parent in _REGISTRY:
            batch_class = _REGISTRY[parent]
            if module_class.forward is parent.forward:
                return batch_class
            if _qualified_name(_forward_owner(module_class)) in _FUNCTIONAL_SUBCLASSES:
                return batch_layers.batched_subclass(module_class, batch_class)
            return None
    return None


def registered_batch_modules() -> dict[type[nn.Module], type[AbstractBatchModule]]:
    """A copy of the registry: plain module type -> batched class."""
    return dict(_REGISTRY)


def refuse_batch_module(module_class: type[nn.Module], reason: str, *, overwrite: bool = False) -> None:
    """Make converting a model that holds a ``module_class`` (or a subclass, unless a registered class comes
    first in its MRO) stop with ``TypeError(reason)`` at that module; ``reason`` says why and what to do
    instead. Refuses to replace another reason unless ``overwrite``."""
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise TypeError(f"refuse_batch_module expects an nn.Module subclass, got {module_class!r}")
    if module_class in _REFUSED and _REFUSED[module_class] != reason and not overwrite:
        raise ValueError(f"{module_class.__qualname__} is refused already; pass overwrite=True to change the reason")
    _REFUSED[module_class] = reason


def refused_batch_modules() -> dict[type[nn.Module], str]:
    """A copy of the table of refused types: plain module type -> why torchmb refuses it."""
    return dict(_REFUSED)


for _layer in batch_layers.LAYERS:
    register_batch_module(_layer)
if hasattr(nn, "LinearCrossEntropyLoss"):  # torch >= 2.13
    register_batch_module(batch_layers.LinearCrossEntropyLoss)

# Lazy modules: their weight shapes are unknown until the first forward (and, subclassing the concrete layers,
# they would otherwise be handed to Linear, ConvNd, BatchNormNd or InstanceNormNd and break on their
# uninitialised weights). SyncBatchNorm: one model's statistics across processes (batched generically it
# would fail in its first forward).
_LAZY = (
    "{name} is out of scope for torchmb: a lazy module's weight shapes are unknown until its first forward. "
    "Materialise it first: run one forward of the plain model on an example input (the {name} then becomes "
    "an nn.{concrete}), and convert that model."
)
for _name in ("LazyLinear", "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d", "LazyConvTranspose2d",
              "LazyConvTranspose3d", "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d", "LazyInstanceNorm1d",
              "LazyInstanceNorm2d", "LazyInstanceNorm3d"):
    if hasattr(nn, _name):
        refuse_batch_module(getattr(nn, _name), _LAZY.format(name=_name, concrete=_name.removeprefix("Lazy")))
refuse_batch_module(nn.SyncBatchNorm, (
    "SyncBatchNorm is out of scope for torchmb: it synchronises one model's batch statistics across "
    "processes, while torchmb trains B models on one device (and shards whole models across ranks, not one "
    "model's data). Use nn.BatchNorm1d/2d/3d instead (e.g. build the model without converting it with "
    "nn.SyncBatchNorm.convert_sync_batchnorm); each model then keeps its own statistics."
))
