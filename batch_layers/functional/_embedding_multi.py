"""Many small embedding tables of different sizes and dims in one flat ``(B, sum_t num_t * dim_t)`` weight,
looked up in one launch with their rows concatenated (:class:`batch_layers.MultiEmbedding`'s lookup)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _embedding_cuda as _cuda
from .._layout import Layout
from ._embedding import check_index_tensor, raise_bad_indices, use_kernels

__all__ = ["multi_embedding", "multi_table_index"]


def multi_table_index(
    num_embeddings: Sequence[int], embedding_dims: Sequence[int], device: torch.device | str | None = None
) -> dict[str, Tensor]:
    """Where each table lies in the flat weight, as the tensors the kernels read: ``rows`` and ``dims`` of each
    table, ``woff`` (its first element), ``col_start`` (its first output column) and ``col_table`` (the table
    of each output column)."""
    woff, col_start = [0], [0]
    for n, d in zip(num_embeddings[:-1], embedding_dims[:-1]):
        woff.append(woff[-1] + n * d)
        col_start.append(col_start[-1] + d)
    col_table = [t for t, d in enumerate(embedding_dims) for _ in range(d)]
    return {
        "rows": torch.tensor(list(num_embeddings), dtype=torch.int64, device=device),
        "woff": torch.tensor(woff, dtype=torch.int64, device=device),
        "dims": torch.tensor(list(embedding_dims), dtype=torch.int64, device=device),
        "col_start": torch.tensor(col_start, dtype=torch.int64, device=device),
        "col_table": torch.tensor(col_table, dtype=torch.int32, device=device),
    }


class _MultiLookupFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, idx, meta, per, samples):
        out = _cuda.multi_gather(weight, idx, meta, per, samples)
        ctx.save_for_backward(idx)
        ctx.meta = (meta, per, weight.shape, weight.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (idx,) = ctx.saved_tensors
        meta, per, shape, dtype = ctx.meta
        gw = _cuda.multi_scatter(grad.contiguous(), idx, meta, tuple(shape), per)
        return (gw if gw.dtype == dtype else gw.to(dtype)), None, None, None, None


def multi_embedding(
    input: Tensor,
    weight: Tensor,
    num_embeddings: Sequence[int],
    embedding_dims: Sequence[int],
    index: dict[str, Tensor],
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """Look up one index column per table and concatenate the rows: table 0's, then table 1's, ...

    Args:
        input: the merged ``(B*n, *, T)`` indices, one column per table (with ``B = 1`` any ``(*, T)``; with
            ``shared``, one ``(n, T)`` every model looks up in its own tables).
        weight: ``(B, sum_t num_t * dim_t)``, table ``t`` the ``(num_t, dim_t)`` block after those before it.
        num_embeddings, embedding_dims: the rows and the dim of each table.
        index: :func:`multi_table_index` of the tables, on ``weight``'s device.

    Returns:
        ``(B*n, *, sum_t dim_t)`` in ``layout``'s order. On CUDA with CuPy the gather and the backward (fp32
        atomics) are single launches over all tables; elsewhere, and under deterministic algorithms, each table
        is looked up with torch indexing. Bad indices raise ``IndexError`` naming the value and the table's size.
    """
    tables, batch = len(num_embeddings), layout.batch
    check_index_tensor(input, weight)
    if input.dim() < 1 or input.shape[-1] != tables:
        raise ValueError(f"expected indices of shape (*, {tables}) (one column per table), got {tuple(input.shape)}")
    reorder = layout.order == "samples" and batch > 1
    if reorder and not shared:
        if input.dim() < 2 or input.shape[0] % batch:
            raise ValueError(f"expected the merged indices of B = {batch} models in dim 0, got {tuple(input.shape)}")
        input = layout.split(input).reshape(-1, *input.shape[1:])  # models-major, the kernels' order
    lead = input.shape[:-1]
    idx = input.reshape(-1, tables)
    if not shared and idx.shape[0] % batch:
        raise ValueError(f"expected the merged (B*n, {tables}) indices of B = {batch} models, got {tuple(input.shape)}")
    samples = idx.shape[0] * batch if shared else idx.shape[0]
    per = samples // batch
    if weight.is_cuda:
        _cuda.raise_pending(weight.device)
    else:
        raise_bad_indices(idx, index["rows"].to(idx.device))
    if use_kernels(weight) and not torch.are_deterministic_algorithms_enabled():
        flat = idx if idx.is_contiguous() else idx.contiguous()
        w = weight if weight.is_contiguous() else weight.contiguous()
        out = _MultiLookupFn.apply(w, flat, index, per, samples)
    else:
        out = _reference_lookup(idx, weight, num_embeddings, embedding_dims, index, batch, shared, samples, per)
    width = sum(embedding_dims)
    out = out.view(samples, width) if shared else out.view(*lead, width)
    return layout.merge(out.view(batch, -1, *out.shape[1:])) if reorder else out


def _reference_lookup(idx, weight, num_embeddings, embedding_dims, index, batch, shared, samples, per) -> Tensor:
    rows = index["rows"].to(idx.device)
    if weight.is_cuda and idx.numel():
        _cuda.record_bad_indices(idx, rows)
    full = idx.long().repeat(batch, 1) if shared else idx.long()
    valid = (full >= 0) & (full < rows)
    safe = torch.where(valid, full, 0)
    model = torch.arange(samples, device=idx.device) // max(per, 1)
    parts, start = [], 0
    for t, (n, d) in enumerate(zip(num_embeddings, embedding_dims)):
        part = weight[:, start : start + n * d].view(weight.shape[0], n, d)[model, safe[:, t]]
        parts.append(part.masked_fill(~valid[:, t : t + 1], 0) if weight.is_cuda else part)
        start += n * d
    return torch.cat(parts, dim=1)
