"""Layers torchmb refuses to batch, with the reason and what to do instead.

They are registered like every batched layer, so that converting a model that contains one stops with a
clear ``TypeError`` at that layer instead of failing somewhere inside it (a lazy module would otherwise
be found through its parent class, e.g. ``nn.LazyConv2d -> nn.Conv2d``, and break on its uninitialised
weight; ``nn.SyncBatchNorm`` would be batched generically and fail in its first forward).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from ._base import AbstractBatchModule

__all__ = ["OUT_OF_SCOPE", "LazyLinear", "SyncBatchNorm"]

_LAZY = (
    "{name} is out of scope for torchmb: a lazy module's weight shapes are unknown until its first forward. "
    "Materialise it first: run one forward of the plain model on an example input (the {name} then becomes "
    "an nn.{concrete}), and convert that model."
)
_SYNC = (
    "SyncBatchNorm is out of scope for torchmb: it synchronises one model's batch statistics across "
    "processes, while torchmb trains B models on one device (and shards whole models across ranks, not one "
    "model's data). Use nn.BatchNorm1d/2d/3d instead (e.g. build the model without converting it with "
    "nn.SyncBatchNorm.convert_sync_batchnorm); each model then keeps its own statistics."
)


class _OutOfScope(AbstractBatchModule):
    """A registered placeholder whose construction and ``from_module`` raise ``TypeError(message)``."""

    message: ClassVar[str]

    def __init__(self, *args: Any, batch: int, **kwargs: Any) -> None:
        raise TypeError(self.message)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> AbstractBatchModule:
        raise TypeError(cls.message)


def _lazy(base: type[nn.Module]) -> type[_OutOfScope]:
    name = base.__name__
    concrete = name.removeprefix("Lazy")
    return type(
        name,
        (_OutOfScope,),
        {
            "base_class": base,
            "message": _LAZY.format(name=name, concrete=concrete),
            "__doc__": f"Refuses :class:`torch.nn.{name}` (out of scope): materialise it into nn.{concrete} first.",
            "__module__": __name__,
            "__qualname__": name,
        },
    )


LazyLinear = _lazy(nn.LazyLinear)


class SyncBatchNorm(_OutOfScope):
    """Refuses :class:`torch.nn.SyncBatchNorm` (out of scope): use ``nn.BatchNorm1d/2d/3d``."""

    base_class = nn.SyncBatchNorm
    message = _SYNC


# Every lazy module torch has (they subclass the concrete layers, so without these entries the registry
# would hand them to Linear/ConvNd/BatchNormNd/InstanceNormNd), plus SyncBatchNorm.
OUT_OF_SCOPE: tuple[type[_OutOfScope], ...] = (
    LazyLinear,
    *(
        _lazy(getattr(nn, name))
        for name in (
            "LazyConv1d",
            "LazyConv2d",
            "LazyConv3d",
            "LazyConvTranspose1d",
            "LazyConvTranspose2d",
            "LazyConvTranspose3d",
            "LazyBatchNorm1d",
            "LazyBatchNorm2d",
            "LazyBatchNorm3d",
            "LazyInstanceNorm1d",
            "LazyInstanceNorm2d",
            "LazyInstanceNorm3d",
        )
        if hasattr(nn, name)
    ),
    SyncBatchNorm,
)
