"""A shared operand meeting a per-model one in the model's own code: the shared one becomes B copies.

In a shared-input forward, the shared ``(n, ...)`` input and what the model computes from it alone stay
``(n, ...)``, while a per-model activation is merged ``(B*n, ...)``. Where the model's code combines the two
(a residual ``x + self.fc(x)``, ``torch.cat([x, h], 1)``, attention of per-model queries over the shared
keys), each model must meet its own copy of the shared one: ``(B*n, ...)`` in the merged order, which is
what a plain model given the input computes. Batched layers combine the shared input with their weights on
purpose (``Linear`` multiplies it once by all models' weights) and are left alone; so is code under
``torch.func`` (the generic path), where ``vmap`` broadcasts an unmapped tensor itself. A shared tensor
indexed by the merged rows (an ``arange`` over a batch size read from a per-model activation) is indexed as
B merged copies too (:func:`index_merged_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from batch_layers import current_forward

from ._merged_ops import operand_tensors

__all__ = ["expand_shared_operands", "index_merged_rows", "is_in_place"]


def is_in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``x += y``)."""
    name = getattr(func, "__name__", "")
    return name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))


def _merged_copies(tensor: Tensor, batch: int, order: str) -> Tensor:
    """``(n, ...)`` as B models' merged ``(B*n, ...)`` copies in ``order``."""
    if order == "models":
        return tensor.expand(batch, *tensor.shape).reshape(-1, *tensor.shape[1:])
    return tensor.unsqueeze(1).expand(tensor.shape[0], batch, *tensor.shape[1:]).reshape(-1, *tensor.shape[1:])


def expand_shared_operands(
    func: Any, args: tuple, kwargs: dict, is_shared: Callable[[Tensor], bool], is_per_model: Callable[[Tensor], bool]
) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each shared tensor that meets a per-model activation of as many dims,
    whose dim 0 holds B times its rows, replaced by B merged copies.

    A shared tensor of fewer dims (a statistic over the samples, a row vector) broadcasts over every
    model's rows alike and stays as it is, as does one of a single row. An in-place op writing into a
    shared tensor cannot hold every model's result and is refused.
    """
    context = current_forward()
    if context is None:
        return args, kwargs
    batch = context.batch
    per_model = [t for t in operand_tensors(args, kwargs) if is_per_model(t)]

    def expanded(value: Any) -> Any:
        if not isinstance(value, Tensor) or not value.dim() or value.shape[0] == 1 or not is_shared(value):
            return value
        aligned = [p for p in per_model if p.dim() == value.dim()]
        if any(p.shape[0] == batch * value.shape[0] for p in aligned):
            return _merged_copies(value, batch, context.order)
        for p in aligned:
            _refuse_model_axis_elsewhere(func, value, p, batch)
        return value

    def each(value: Any) -> Any:
        if isinstance(value, (tuple, list)):
            return type(value)(expanded(item) for item in value)
        return expanded(value)

    new_args = tuple(each(value) for value in args)
    if args and is_in_place(func) and new_args[0] is not args[0]:
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} writes in place into a tensor computed from the shared input alone "
            "(one for all models) a value that differs between models; in a shared-input forward, write out of "
            "place (x = x + y instead of x += y)"
        )
    return new_args, {key: each(value) for key, value in kwargs.items()}


def _refuse_model_axis_elsewhere(func: Any, shared: Tensor, per_model: Tensor, batch: int) -> None:
    """A per-model tensor with the shared one's rows in dim 0 and B times its size in another dim holds the
    models in that dim (a sequence-first layout, ``(seq, B*n, d)``), where no copy of the shared rows can
    line up with them."""
    if per_model.shape[0] != shared.shape[0]:
        return
    for dim in range(1, shared.dim()):
        if shared.shape[dim] > 1 and per_model.shape[dim] == batch * shared.shape[dim]:
            raise ValueError(
                f"{getattr(func, '__name__', func)}: a tensor computed from the shared input, shape "
                f"{tuple(shared.shape)}, meets a per-model tensor of shape {tuple(per_model.shape)} whose model axis "
                f"is in dim {dim} (a sequence-first layout); torchmb's merged model axis stands in dim 0 at the "
                "BatchModule boundary: give the model batch-first inputs (batch_first=True) and let it transpose"
            )


def index_merged_rows(args: tuple, is_shared: Callable[[Tensor], bool]) -> tuple:
    """The arguments of ``Tensor.__getitem__``, with a shared ``(n, ...)`` tensor replaced by B merged copies
    where its integer index along dim 0 reaches past its n rows into the B*n merged ones: code that read the
    batch size from a per-model activation and indexes the shared tensor with it (transformers' masks,
    ``padding_mask[torch.arange(batch_size)[:, None], ...]``), which each model's plain copy does on its own
    rows. An index past the merged rows is refused here rather than on the device (a CUDA kernel asserts).
    Reading the index's range waits for the device: in shared-input forwards only, for such indexes only."""
    context = current_forward()
    shared, index = args if len(args) == 2 else (None, None)
    if context is None or not isinstance(shared, Tensor) or not shared.dim() or not is_shared(shared):
        return args
    first = index[0] if isinstance(index, tuple) and index else index
    if not isinstance(first, Tensor) or first.dtype not in _INDEX_DTYPES or not first.numel():
        return args
    rows, merged = shared.shape[0], context.batch * shared.shape[0]
    if rows != context.samples:
        return args
    low, high = int(first.min()), int(first.max())
    if high >= merged or low < -rows:
        raise IndexError(
            f"index {high if high >= merged else low} along dim 0 of a tensor computed from the shared input alone, "
            f"shape {tuple(shared.shape)}: its {rows} rows are the samples every model sees, and the merged "
            f"activations have B * n = {merged}"
        )
    if high < rows or low < 0:
        return args
    return (_merged_copies(shared, context.batch, context.order), index)


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)
