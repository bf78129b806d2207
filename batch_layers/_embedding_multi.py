"""Many small embedding tables of different sizes and dims in one tensor, looked up in one launch with their
outputs concatenated (:class:`MultiEmbedding`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import _embedding_cuda as _cuda
from ._base import AbstractBatchModule, stack_copies
from .functional._embedding import check_index_tensor, raise_bad_indices, use_kernels

__all__ = ["MultiEmbedding"]


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


class MultiEmbedding(nn.Module):
    r"""Several small embedding tables of different sizes and dims in one tensor, looked up in one
    launch with their outputs concatenated (the "many tiny embeddings" of recommendation models).

    Table ``t`` has ``num_embeddings[t]`` rows of ``embedding_dims[t]``; all live in one flat parameter
    ``weight`` of shape ``(B, sum_t num_t * dim_t)`` (``B = batch`` independent models, 1 by default),
    and :meth:`table` gives the ``(B, num_t, dim_t)`` view of table ``t``. The forward takes one index
    column per table and returns ``(*, sum_t dim_t)``: table 0's row, then table 1's, ...

    Args:
        num_embeddings: rows of each table.
        embedding_dims: the dim of each table, or one int for all.
        batch: number of models B (keyword-only, default 1).

    Shape:
        - Input: ``(B*n, T)`` int64/int32 (merged model axis; with ``B = 1`` any ``(*, T)``), or a shared
          ``(n, T)`` inside a shared-input forward.
        - Output: ``(B*n, sum(embedding_dims))``.

    On CUDA with CuPy both the gather and the backward (fp32 atomics) are single launches over all
    tables; elsewhere (and under deterministic algorithms) each table is looked up with torch indexing.
    Bad indices raise ``IndexError`` naming the value and the table's size.

    Examples::

        >>> emb = MultiEmbedding([100, 7, 3000], [8, 2, 16])
        >>> emb(torch.tensor([[5, 6, 2999], [0, 0, 0]])).shape
        torch.Size([2, 26])
    """

    def __init__(
        self,
        num_embeddings: Sequence[int],
        embedding_dims: Sequence[int] | int,
        *,
        batch: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        nums = [int(n) for n in num_embeddings]
        if isinstance(embedding_dims, int):
            dims = [embedding_dims] * len(nums)
        else:
            dims = [int(d) for d in embedding_dims]
        if not nums or len(nums) != len(dims):
            raise ValueError(f"need one dim per table: got {len(nums)} tables and {len(dims)} dims")
        if any(n < 1 for n in nums) or any(d < 1 for d in dims):
            raise ValueError(f"table sizes and dims must be positive, got {nums} and {dims}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        self.batch = batch
        self.num_embeddings = tuple(nums)
        self.embedding_dims = tuple(dims)
        sizes = [n * d for n, d in zip(nums, dims)]
        woff = [0]
        for s in sizes[:-1]:
            woff.append(woff[-1] + s)
        col_start = [0]
        for d in dims[:-1]:
            col_start.append(col_start[-1] + d)
        col_table = [t for t, d in enumerate(dims) for _ in range(d)]
        self.register_buffer("rows", torch.tensor(nums, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("woff", torch.tensor(woff, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("dims", torch.tensor(dims, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("col_start", torch.tensor(col_start, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("col_table", torch.tensor(col_table, dtype=torch.int32, device=device), persistent=False)
        self.weight = nn.Parameter(torch.empty(batch, sum(sizes), device=device, dtype=dtype))
        self.reset_parameters()

    def table(self, t: int) -> Tensor:
        """The ``(B, num_t, dim_t)`` view of table ``t`` inside ``weight`` (shares its memory)."""
        n, d = self.num_embeddings[t], self.embedding_dims[t]
        start = sum(a * b for a, b in zip(self.num_embeddings[:t], self.embedding_dims[:t]))
        return self.weight[:, start : start + n * d].view(self.weight.shape[0], n, d)

    def reset_parameters(self) -> None:
        """Every table from N(0, 1), as ``nn.Embedding``."""
        nn.init.normal_(self.weight)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Embedding], *, batch: int = 1) -> MultiEmbedding:
        """One MultiEmbedding holding copies of ``modules``' tables (``batch`` copies of each)."""
        for m in modules:
            if m.padding_idx is not None or m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
                raise ValueError(
                    "MultiEmbedding supports plain tables only (no padding_idx, max_norm, scale_grad_by_freq or sparse)"
                )
        w = modules[0].weight
        layer = cls(
            [m.num_embeddings for m in modules],
            [m.embedding_dim for m in modules],
            batch=batch,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            for t, m in enumerate(modules):
                layer.table(t).copy_(stack_copies(m.weight, batch))
        return layer

    def _meta(self) -> dict[str, Tensor]:
        return {
            "rows": self.rows,
            "woff": self.woff,
            "dims": self.dims,
            "col_start": self.col_start,
            "col_table": self.col_table,
        }

    def forward(self, input: Tensor) -> Tensor:
        T = len(self.num_embeddings)
        B = self.weight.shape[0]
        check_index_tensor(input, self.weight)
        if input.dim() < 1 or input.shape[-1] != T:
            raise ValueError(f"expected indices of shape (*, {T}) (one column per table), got {tuple(input.shape)}")
        lead = input.shape[:-1]
        idx = input.reshape(-1, T)
        shared = B > 1 and AbstractBatchModule.is_shared(self, idx)  # type: ignore[arg-type]
        if not shared and idx.shape[0] % B:
            raise ValueError(f"expected the merged (B*n, {T}) indices of B = {B} models, got {tuple(input.shape)}")
        samples = idx.shape[0] * B if shared else idx.shape[0]
        per = samples // B
        if self.weight.is_cuda:
            _cuda.raise_pending(self.weight.device)
        else:
            raise_bad_indices(idx, self.rows.to(idx.device))
        D = sum(self.embedding_dims)
        kernels = use_kernels(self.weight) and not torch.are_deterministic_algorithms_enabled()
        if kernels:
            flat = idx if idx.is_contiguous() else idx.contiguous()
            w = self.weight if self.weight.is_contiguous() else self.weight.contiguous()
            out = _MultiLookupFn.apply(w, flat, self._meta(), per, samples)
        else:
            rows = self.rows.to(idx.device)
            if self.weight.is_cuda and idx.numel():
                _cuda.record_bad_indices(idx, rows)
            full = idx.long().repeat(B, 1) if shared else idx.long()
            valid = (full >= 0) & (full < rows)
            safe = torch.where(valid, full, 0)
            model = torch.arange(samples, device=idx.device) // max(per, 1)
            parts = []
            for t in range(T):
                part = self.table(t)[model, safe[:, t]]
                parts.append(part.masked_fill(~valid[:, t : t + 1], 0) if self.weight.is_cuda else part)
            out = torch.cat(parts, dim=1)
        if shared:
            return out.view(samples, D)
        return out.view(*lead, D)

    def check(self) -> None:
        """Synchronise and raise a pending ``IndexError`` from an earlier lookup on this device."""
        if self.weight.is_cuda:
            _cuda.check(self.weight.device)

    def extra_repr(self) -> str:
        s = f"num_embeddings={list(self.num_embeddings)}, embedding_dims={list(self.embedding_dims)}"
        return s + (f", batch={self.batch}" if self.batch != 1 else "")
