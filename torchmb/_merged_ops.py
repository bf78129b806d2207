"""Which ops of a model's own code mix the models on the merged ``(B*n, ...)`` axis, and each model's value
of a tensor reduced over it.

A ``BatchModule``'s first forward runs under ``torchmb._tracking``'s tracker, which asks this module about
each op of code that is neither torch's nor a batched layer's:

- :func:`sample_axis_op`: concatenating or splitting per-model tensors along dim 0 (``torch.cat([a, b])``,
  ``x.chunk(2)``, ``x[:k]``). On the merged axis ``torch.cat([image1, image2])`` puts every model's first
  images before every model's second images, and ``x[:k]`` takes the first models' rows.
- :func:`random_draw`: a random tensor drawn from constants alone (``torch.rand([])``): one draw for all
  models, where each model would draw its own.
- :func:`per_model_values`: a Python decision (``bool``, ``.item()``) on a tensor reduced over several
  models' data (``padding_mask.all()``) is each model's own decision when every model's value is the same;
  this recomputes the tensor for each model from the recorded ops that made it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._C._functorch as functorch
from torch import Tensor
from torch.utils._pytree import tree_map

from batch_layers import ForwardContext

__all__ = ["PooledSize", "Recipes", "random_draw", "sample_axis_op", "shared_metadata"]

_CONCATENATIONS = frozenset({torch.cat, torch.concat, torch.concatenate})
_SPLITS = frozenset(
    {
        torch.chunk, Tensor.chunk, torch.split, Tensor.split, torch.tensor_split, Tensor.tensor_split,
        torch.narrow, Tensor.narrow, torch.split_with_sizes, Tensor.split_with_sizes,
    }
)  # fmt: skip
_STACKS = frozenset({torch.stack, torch.vstack, torch.row_stack, torch.hstack})
_UNBINDS = frozenset({torch.unbind, Tensor.unbind})
_REORDERS = frozenset({torch.flip, Tensor.flip, torch.flipud, Tensor.flipud, torch.roll, Tensor.roll})
_RESHAPES = frozenset({torch.reshape, Tensor.reshape, Tensor.view})
_RANDOM = frozenset(
    {
        torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
        torch.randint_like, torch.bernoulli, torch.normal, torch.multinomial, torch.poisson,
        Tensor.bernoulli, Tensor.bernoulli_, Tensor.uniform_, Tensor.normal_, Tensor.random_,
        Tensor.exponential_, Tensor.geometric_, Tensor.cauchy_, Tensor.log_normal_, Tensor.multinomial,
    }
)  # fmt: skip
# What a stacked (B, ...) tensor shares with each model's slice; its shape and sizes it does not.
_SHARED_METADATA = frozenset({"dtype", "device", "layout", "is_cuda", "requires_grad", "is_leaf", "grad_fn"})


def shared_metadata(func: Callable) -> bool:
    """Whether ``func`` reads only what every model's slice of a stacked tensor shares with it."""
    getter = getattr(func, "__self__", None)
    return getattr(func, "__name__", None) == "__get__" and getattr(getter, "__name__", None) in _SHARED_METADATA


def random_draw(func: Callable) -> bool:
    return func in _RANDOM


def _is_merged(tensor: Any, rows: int) -> bool:
    """Whether ``tensor`` is a merged tensor of the models' data: dim 0 a multiple of ``B * n``, not a
    ``torch.func`` batched tensor (inside a region each model's code sees its own rows)."""
    return (
        isinstance(tensor, Tensor)
        and tensor.dim() > 0
        and tensor.shape[0] % rows == 0
        and not functorch.is_batchedtensor(tensor)
    )


def _dim(args: tuple, kwargs: dict, position: int, default: int = 0) -> int:
    dim = kwargs.get("dim", kwargs.get("axis", args[position] if len(args) > position else default))
    return dim if isinstance(dim, int) else 1  # a tuple of dims: not along the sample axis


def sample_axis_op(
    func: Callable,
    args: tuple,
    kwargs: dict,
    is_per_model: Callable[[Tensor], bool],
    is_constant: Callable[[Tensor], bool],
    context: ForwardContext,
) -> str:
    """``""``, or what ``func`` does along the merged sample axis of a per-model tensor that mixes models."""
    rows = context.batch * context.samples
    if func in _CONCATENATIONS or func in _STACKS:
        tensors = args[0] if args else kwargs.get("tensors", ())
        merged = [t for t in tensors if _is_merged(t, rows) and is_per_model(t)]
        if not merged:
            return ""
        if func in _CONCATENATIONS:
            return f"{func.__name__} along dim 0" if _dim(args, kwargs, 1) % merged[0].dim() == 0 else ""
        if func in (torch.stack, torch.hstack) or merged[0].dim() == 1:  # vstack of 1-D tensors stacks them
            if func is torch.hstack and merged[0].dim() > 1:
                return ""  # along dim 1
            along = _dim(args, kwargs, 1) if func is torch.stack else 0
            return f"{func.__name__} along dim 0" if along % (merged[0].dim() + 1) == 0 else ""
        return f"{func.__name__} along dim 0"
    if not args or not (_is_merged(args[0], rows) and is_per_model(args[0])):
        return ""
    x = args[0]
    if func in _SPLITS:
        position = 1 if func in (torch.narrow, Tensor.narrow) else 2
        return f"{func.__name__} along dim 0" if _dim(args, kwargs, position) % x.dim() == 0 else ""
    if func in _UNBINDS:
        return f"{func.__name__} along dim 0" if _dim(args, kwargs, 1) % x.dim() == 0 else ""
    if func in _REORDERS:
        return f"{func.__name__} along dim 0" if _reorders_dim_0(func, args, kwargs, x.dim()) else ""
    if func in (torch.index_select, Tensor.index_select):
        index = kwargs.get("index", args[2] if len(args) > 2 else None)
        if _dim(args, kwargs, 1) % x.dim() or _keeps_models(index, x.shape[0], is_constant, context):
            return ""
        return "index_select along dim 0"
    if func is Tensor.__getitem__:
        return _indexing(x, args[1], is_constant, context)
    if func in _RESHAPES:
        return _reshape_to_samples(x, args[1:], kwargs, context)
    return ""


def _reshape_to_samples(x: Tensor, sizes: tuple, kwargs: dict, context: ForwardContext) -> str:
    """What a reshape of a merged ``x`` to ``n`` rows, one model's sample count, does: its rows hold several
    models' (a size the code read from the shared input, ``n = x.shape[0]``), or ``""``."""
    sizes = sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else sizes
    sizes = sizes or kwargs.get("shape", ())
    lead = sizes[0] if sizes else None
    if type(lead) is not int or context.batch == 1 or lead != context.samples or x.shape[0] == lead:
        return ""
    return f"reshape of dim 0 to {lead} rows, one model's sample count n"


def _reorders_dim_0(func: Callable, args: tuple, kwargs: dict, dims_of_x: int) -> bool:
    """Whether a flip or roll moves rows along dim 0 (``roll`` without dims rolls the flattened tensor)."""
    if func in (torch.flipud, Tensor.flipud):
        return True
    if func in (torch.roll, Tensor.roll):
        dims = kwargs.get("dims", args[2] if len(args) > 2 else None)
        if dims is None:
            return True
    else:  # flip(x, dims), x.flip(dims) or x.flip(*dims)
        dims = kwargs.get("dims", args[1] if len(args) == 2 else args[1:])
    dims = (dims,) if isinstance(dims, int) else dims
    return any(isinstance(d, int) and d % dims_of_x == 0 for d in dims)


def _describe_index(index: slice) -> str:
    parts = ["" if v is None else str(v) for v in (index.start, index.stop)]
    return ":".join(parts) + ("" if index.step is None else f":{index.step}")


def _indexing(x: Tensor, index: Any, is_constant: Callable[[Tensor], bool], context: ForwardContext) -> str:
    """What ``x[index]`` does to dim 0 of a merged per-model ``x`` that mixes models, or ``""``."""
    first = index[0] if isinstance(index, tuple) and index else index
    if isinstance(first, slice):
        whole = first.start in (None, 0) and first.stop is None and first.step in (None, 1)
        return "" if whole else f"indexing [{_describe_index(first)}] of dim 0"
    if isinstance(first, int) and not isinstance(first, bool):
        return f"indexing [{first!r}] of dim 0"
    if isinstance(first, list) and first and all(isinstance(i, int) and not isinstance(i, bool) for i in first):
        first = torch.tensor(first, device=x.device)
    if isinstance(first, Tensor):
        if _keeps_models(first, x.shape[0], is_constant, context):
            return ""
        kind = "a boolean mask" if first.dtype == torch.bool else f"an index tensor of shape {tuple(first.shape)}"
        return f"indexing dim 0 with {kind}"
    return ""


def _keeps_models(index: Any, rows: int, is_constant: Callable[[Tensor], bool], context: ForwardContext) -> bool:
    """Whether selecting the rows ``index`` of a merged tensor of ``rows`` rows keeps every model's rows with
    its model: a constant integer index (the same in every forward, such as ``torch.arange(x.shape[0])``
    beside a per-row position) whose every row ``i`` picks from the model that owns result row ``i``."""
    if not isinstance(index, Tensor) or index.dtype == torch.bool or index.is_floating_point() or index.dim() == 0:
        return False
    if not is_constant(index) or index.shape[0] % context.batch or functorch.is_batchedtensor(index):
        return False
    source = torch.remainder(index.long(), rows)
    target = torch.arange(index.shape[0], device=index.device).view(-1, *([1] * (index.dim() - 1)))
    if context.order == "models":
        same = source // (rows // context.batch) == target // (index.shape[0] // context.batch)
    else:
        same = source % context.batch == target % context.batch
    return bool(same.all())


class PooledSize(int):
    """``numel()`` of a per-model merged tensor: the pooled count, which remembers each model's count so that
    a decision recomputed per model (``mask.sum() == mask.numel()``) compares with that."""

    per_model: int

    def __new__(cls, pooled: int, batch: int) -> PooledSize:
        size = super().__new__(cls, pooled)
        size.per_model = pooled // batch
        return size


class Recipes:
    """The ops that reduced per-model merged tensors to tensors without the merged axis (``mask.all()``),
    kept so that each model's value can be recomputed from its own rows."""

    def __init__(self, batch: int, rows: int, order: str) -> None:
        self.batch, self.rows, self.order = batch, rows, order
        self._made: dict[int, tuple[weakref.ref, Callable, tuple, dict]] = {}

    def record(self, out: Tensor, func: Callable, args: tuple, kwargs: dict, is_per_model: Callable) -> None:
        """Keep how ``out`` was made if it came from per-model tensors but lost their merged axis."""
        if _is_merged(out, self.rows):
            return
        inputs = [t for t in operand_tensors(args, kwargs) if is_per_model(t)]
        if inputs and all(_is_merged(t, self.rows) or id(t) in self._made for t in inputs):
            self._made[id(out)] = (weakref.ref(out), func, args, kwargs)

    def per_model_values(self, tensor: Tensor, is_per_model: Callable[[Tensor], bool]) -> list[Tensor] | None:
        """Each model's value of ``tensor``, or None when its making was not recorded."""
        try:
            return [self._model_value(tensor, model, is_per_model) for model in range(self.batch)]
        except _Unknown:
            return None

    def _model_value(self, value: Any, model: int, is_per_model: Callable[[Tensor], bool]) -> Any:
        if isinstance(value, PooledSize):
            return value.per_model
        if not isinstance(value, Tensor) or not is_per_model(value):
            return value
        entry = self._made.get(id(value))
        if entry is not None and entry[0]() is value:
            _, func, args, kwargs = entry
            recompute = lambda leaf: self._model_value(leaf, model, is_per_model)  # noqa: E731
            return func(*tree_map(recompute, args), **tree_map(recompute, kwargs))
        if not _is_merged(value, self.rows):
            raise _Unknown
        if self.order == "models":
            return value.view(self.batch, -1, *value.shape[1:])[model]
        return value.view(-1, self.batch, *value.shape[1:])[:, model]


class _Unknown(Exception):
    """A per-model tensor whose models' values cannot be told apart."""


def operand_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among an op's arguments, and inside its tuple and list arguments (``torch.cat``'s)."""
    found = []
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, Tensor):
                found.append(item)
    return found
