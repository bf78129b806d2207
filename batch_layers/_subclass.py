"""Batched classes for plain subclasses of batched layers' classes that override ``forward``.

timm's ``BatchNormAct2d`` is an ``nn.BatchNorm2d`` whose ``forward`` calls ``F.batch_norm`` on its own
weights and then its ``drop`` and ``act`` children; its ``LayerNorm2d`` permutes around ``F.layer_norm``.
Inheriting the parent's batched class would lose that computation. :func:`batched_subclass` instead builds
a class that runs the subclass's **own** ``forward`` on the batched layer, with the torch functionals that
the parent's batched class declares in ``functional_forms`` (``F.linear``, ``F.conv2d``, ``F.batch_norm``,
``F.layer_norm``, ``F.group_norm``, ``F.rms_norm``) swapped for their batched forms while it runs: a
``TorchFunctionMode`` sees every torch call of that ``forward`` and reroutes those that receive the layer's
per-model tensors (its ``(B, ...)`` parameters and buffers). Everything else in the ``forward`` (permutes,
activations, dropout, its children) runs on the merged model axis as usual.

What the ``forward`` may do with a per-model tensor, and what the batched class does with it:

- pass it to a functional of ``functional_forms``, with the input first and only per-model tensors (or
  ``None``) after it: the batched form runs;
- read its metadata (``shape``, ``size()``, ``dim()``, ``nbytes``, ``dtype``, ``device``, ...): one model's is returned,
  so ``self.weight.shape[-2:]`` (timm's ``Conv2dSame``) reads the kernel size as in the plain layer;
- cast it (``.float()``, ``.to(dtype)``, ``.detach()``): the result is per-model too;
- update it in place by a number (``num_batches_tracked.add_(1)``): every model's copy is updated;
- anything else raises ``TypeError`` naming the call: the class never computes silently across models.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ._base import AbstractBatchModule

__all__ = ["batched_subclass"]

_METADATA = (
    Tensor.shape.__get__,
    Tensor.ndim.__get__,
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.nbytes.__get__,  # also read by torch.compile's guards on the layer's parameters
)
_PROPERTIES = (
    Tensor.dtype.__get__,
    Tensor.device.__get__,
    Tensor.requires_grad.__get__,
    Tensor.is_cuda.__get__,
    Tensor.layout.__get__,
    Tensor.is_floating_point,
    Tensor.element_size,
    Tensor.itemsize.__get__,
)
_CASTS = (Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.to, Tensor.type, Tensor.detach)
_SCALAR_UPDATES = (Tensor.add_, Tensor.sub_, Tensor.mul_, Tensor.div_, Tensor.fill_, Tensor.zero_)


class _SwapFunctionals(TorchFunctionMode):
    """Reroutes the torch calls of one batched layer's ``forward`` that receive its per-model tensors."""

    def __init__(self, layer: AbstractBatchModule) -> None:
        super().__init__()
        self.layer = layer
        # a list searched by identity, not a dict by id(): dynamo before torch 2.13 cannot take id() of a tensor
        # made inside the graph, and every torch call of the forward asks
        self.per_model = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]

    def _holds(self, value: object) -> bool:
        return isinstance(value, Tensor) and any([value is tensor for tensor in self.per_model])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [leaf for leaf in _leaves(args, kwargs) if self._holds(leaf)]
        if not touched:
            return func(*args, **kwargs)
        others = [leaf for leaf in _leaves(args[1:], kwargs) if isinstance(leaf, Tensor)]
        form = self.layer.functional_forms.get(func)
        if form is not None and all([self._holds(tensor) for tensor in others]):
            return getattr(self.layer, form)(*args, **kwargs)
        if func in _METADATA:
            return func(args[0][0], *args[1:], **kwargs)
        if func in _PROPERTIES:
            return func(*args, **kwargs)
        if getattr(func, "__name__", None) == "__get__":  # another attribute: a flag such as is_nested
            value = func(*args, **kwargs)  # (torch.compile reads several)
            if not isinstance(value, Tensor):
                return value  # the same for one model's tensor as for the stacked one
        if func in _CASTS and not others:
            result = func(*args, **kwargs)
            self.per_model.append(result)
            return result
        if func in _SCALAR_UPDATES and not others and args[0] is touched[0]:
            return func(*args, **kwargs)
        plain = type(self.layer).base_class
        forms = ", ".join(sorted(getattr(f, "__name__", str(f)) for f in self.layer.functional_forms)) or "none"
        raise TypeError(
            f"{plain.__module__}.{plain.__qualname__}.forward applies {getattr(func, '__name__', func)} to a "
            f"per-model tensor of the layer; its batched class runs that forward with only these functionals "
            f"batched: {forms}, given the input and per-model tensors only (and metadata reads, casts and "
            f"in-place updates by a number). Register a batched "
            f"class for {plain.__qualname__} (torchmb.register_batch_module) instead."
        )


def _leaves(args: tuple, kwargs: dict) -> list:
    """The leaves of a torch call's arguments: its arguments and the items of its tuples and lists, without a
    pytree walk (a layer norm's every torch call passes here); deeper structures take the walk."""
    leaves = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (tuple, list)):
            if any([isinstance(item, (tuple, list, dict)) for item in value]):
                return tree_flatten((args, kwargs))[0]
            leaves.extend(value)
        elif isinstance(value, dict):
            return tree_flatten((args, kwargs))[0]
        else:
            leaves.append(value)
    return leaves


class _SubclassForward:
    """Mixin of the classes :func:`batched_subclass` builds: the plain subclass's ``forward`` under
    :class:`_SwapFunctionals`, and its extra attributes and parameter-free children carried over."""

    base_class: ClassVar[type[nn.Module]]

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> AbstractBatchModule:
        layer = super().from_module(module, batch)
        own = (*module._parameters.items(), *module._buffers.items())
        extra_state = [name for name, tensor in own if tensor is not None and name not in layer.state_dict()]
        stateful = [name for name, child in module.named_children() if child.state_dict()]
        if extra_state or stateful:
            raise TypeError(
                f"{cls.__qualname__} batches {type(module).__qualname__} through its parent's batched class, which "
                f"holds no {', '.join(extra_state + stateful)}: register a batched class for it instead"
            )
        for name, value in vars(module).items():
            if name not in vars(layer):
                setattr(layer, name, value)
        for name, child in module.named_children():
            layer.add_module(name, child)
        return layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _SwapFunctionals(self):
            return self.base_class.forward(self, *args, **kwargs)


_CLASSES: dict[type[nn.Module], type[AbstractBatchModule]] = {}


def batched_subclass(subclass: type[nn.Module], batch_class: type[AbstractBatchModule]) -> type[AbstractBatchModule]:
    """The batched class of ``subclass``, a plain subclass of ``batch_class.base_class`` that overrides
    ``forward``: ``batch_class`` running ``subclass.forward`` with ``batch_class.functional_forms`` swapped in.

    The class also derives from ``subclass`` (after ``batch_class``), so ``isinstance`` checks and
    ``super().forward(x)`` inside the subclass's ``forward`` behave as in the plain layer.

    Args:
        subclass: the plain subclass, e.g. timm's ``BatchNormAct2d``.
        batch_class: the batched class of a parent of ``subclass`` that declares ``functional_forms``.

    Raises:
        TypeError: if ``subclass`` does not derive from ``batch_class.base_class`` or ``batch_class`` batches
            no functional.

    Examples::

        >>> class Clamped(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x).clamp(-1, 1)
        >>> layer = batched_subclass(Clamped, Linear).from_module(Clamped(4, 3), batch=2)
        >>> layer(torch.randn(2 * 5, 4)).abs().max() <= 1
        tensor(True)
    """
    if not issubclass(subclass, batch_class.base_class) or not batch_class.functional_forms:
        raise TypeError(
            f"batched_subclass: {subclass.__qualname__} must derive from {batch_class.base_class.__qualname__}, "
            f"and {batch_class.__qualname__} must declare functional_forms"
        )
    if subclass not in _CLASSES:
        _CLASSES[subclass] = type(
            subclass.__name__,
            (_SubclassForward, batch_class, subclass),
            {"base_class": subclass, "__module__": __name__, "__qualname__": f"Batched{subclass.__qualname__}"},
        )
    return _CLASSES[subclass]
