"""The CuPy embedding kernels as ``torch.library`` custom operators, for code that ``torch.compile`` traces.

Dynamo cannot trace a CuPy launch (it reads ``data_ptr()`` and calls into CuPy); as an operator with a
fake (shape-only) kernel it is one opaque node of the graph, and Inductor fuses around it. Eager code
calls :mod:`batch_layers._embedding_cuda` directly: the operator's dispatch costs host time a small
lookup cannot spare.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _embedding_cuda as _cuda

__all__ = ["counts", "gather", "scatter"]


@torch.library.custom_op("torchmb::embedding_gather", mutates_args=())
def gather(weight: Tensor, idx: Tensor, tables: int, num: int, per: int, out_shape: list[int]) -> Tensor:
    """:func:`batch_layers._embedding_cuda.gather`."""
    return _cuda.gather(weight, idx, tables, num, per, tuple(out_shape))


@gather.register_fake
def _(weight: Tensor, idx: Tensor, tables: int, num: int, per: int, out_shape: list[int]) -> Tensor:
    return weight.new_empty(out_shape)


@torch.library.custom_op("torchmb::embedding_scatter", mutates_args=())
def scatter(
    grad: Tensor, idx: Tensor, shape: list[int], tables: int, num: int, per: int, pad: int, freq: Tensor | None
) -> Tensor:
    """:func:`batch_layers._embedding_cuda.scatter` (``grad`` made contiguous, as the kernel reads it)."""
    return _cuda.scatter(grad.contiguous(), idx, tuple(shape), tables, num, per, pad, freq)


@scatter.register_fake
def _(grad: Tensor, idx: Tensor, shape: list[int], tables: int, num: int, per: int, pad: int, freq: Tensor | None):
    return grad.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("torchmb::embedding_counts", mutates_args=())
def counts(idx: Tensor, tables: int, num: int, per: int) -> Tensor:
    """:func:`batch_layers._embedding_cuda.counts`."""
    return _cuda.counts(idx, tables, num, per)


@counts.register_fake
def _(idx: Tensor, tables: int, num: int, per: int) -> Tensor:
    return idx.new_empty((tables * num,), dtype=torch.int32)
