"""Many small embedding tables of different sizes and dims in one tensor, looked up in one launch with their
outputs concatenated (:class:`MultiEmbedding`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from . import _embedding_cuda as _cuda
from ._base import AbstractBatchModule, stack_copies
from ._layout import Layout
from .functional._embedding_multi import multi_embedding, multi_table_index

__all__ = ["MultiEmbedding"]


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
        for name, tensor in multi_table_index(nums, dims, device).items():
            self.register_buffer(name, tensor, persistent=False)
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
        rows = input.reshape(-1, input.shape[-1]) if isinstance(input, Tensor) and input.dim() else None
        # (not a batched layer: it asks the base class's test of the shared input with its own batch)
        shared = self.weight.shape[0] > 1 and rows is not None and AbstractBatchModule.is_shared(self, rows)  # type: ignore[arg-type]
        return multi_embedding(
            input,
            self.weight,
            self.num_embeddings,
            self.embedding_dims,
            self._meta(),
            layout=Layout(self.weight.shape[0]),
            shared=shared,
        )

    def check(self) -> None:
        """Synchronise and raise a pending ``IndexError`` from an earlier lookup on this device."""
        if self.weight.is_cuda:
            _cuda.check(self.weight.device)

    def extra_repr(self) -> str:
        s = f"num_embeddings={list(self.num_embeddings)}, embedding_dims={list(self.embedding_dims)}"
        return s + (f", batch={self.batch}" if self.batch != 1 else "")
