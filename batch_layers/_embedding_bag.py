"""Batched ``nn.EmbeddingBag``: B tables whose looked-up rows (the :class:`~batch_layers.Embedding` lookup,
one gather launch and the atomic scatter-add backward) are reduced into bags by sum, mean or max."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from . import _embedding_cuda as _cuda
from ._base import AbstractBatchModule, stack_copies
from ._embedding import _SHARED_DOC, stacked_tables
from .functional._embedding import SPARSE_MESSAGE, embedding_bag, normalize_padding_idx

__all__ = ["EmbeddingBag"]


class EmbeddingBag(AbstractBatchModule):
    r"""``batch`` independent :class:`torch.nn.EmbeddingBag` tables: sums, means or maxima of bags of rows.

    The per-index rows come from the same lookup as :class:`Embedding` (one gather launch, the atomic
    scatter-add backward), then bags are reduced with torch ops.

    Args:
        num_embeddings: rows of each table.
        embedding_dim: size of each row.
        max_norm: renormalise looked-up rows to this norm (in place), as ``nn.EmbeddingBag``.
        norm_type: the p of the p-norm for ``max_norm``.
        scale_grad_by_freq: divide each row's gradient by its frequency in the model's mini-batch.
        mode: ``"sum"``, ``"mean"`` or ``"max"``.
        sparse: must be ``False`` (refused with an explanation).
        _weight: an initial ``(batch, num_embeddings, embedding_dim)`` weight.
        include_last_offset: each model's offsets end with the end of its last bag.
        padding_idx: row of every table excluded from the bags (and from the mean's count).
        batch: number of models B.

    Shape:
        - 2-D input ``(B*n, L)``: ``n`` bags of ``L`` indices per model, ``offsets`` must be ``None``;
          output ``(B*n, embedding_dim)``.
        - 1-D input ``(B*T,)``: the B models' index lists of ``T`` each, one after the other, with
          ``offsets`` ``(B*m,)`` (``(B*(m+1),)`` with ``include_last_offset``): model b's offsets, local to
          its own list, at ``offsets[b*m : (b+1)*m]``. Output ``(B*m, embedding_dim)``.
        - ``per_sample_weights``: the input's shape (mode ``"sum"`` only).
    {shared}
    Attributes:
        weight: ``(B, num_embeddings, embedding_dim)``, each slice from N(0, 1).
    """

    base_class: ClassVar[type[nn.Module]] = nn.EmbeddingBag
    merged_order = "models"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        if sparse:
            raise ValueError(SPARSE_MESSAGE)
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.mode = mode
        self.sparse = False
        self.include_last_offset = include_last_offset
        self.padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
        if _weight is None:
            self.weight = nn.Parameter(torch.empty(batch, num_embeddings, embedding_dim, **factory_kwargs))
            self.reset_parameters()
        else:
            expected = (batch, num_embeddings, embedding_dim)
            if tuple(_weight.shape) != expected:
                raise ValueError(f"_weight must have shape {expected}, got {tuple(_weight.shape)}")
            self.weight = nn.Parameter(_weight)

    def reset_parameters(self) -> None:
        """Every model's table from N(0, 1), its padding row zeroed (as ``nn.EmbeddingBag``)."""
        for i in range(self.weight.shape[0]):
            nn.init.normal_(self.weight[i])
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[:, self.padding_idx].fill_(0)

    @classmethod
    def from_module(cls, module: nn.EmbeddingBag, batch: int) -> EmbeddingBag:
        """B copies of ``module``'s table and settings."""
        if module.sparse:
            raise ValueError(SPARSE_MESSAGE)
        layer = cls(
            module.num_embeddings,
            module.embedding_dim,
            module.max_norm,
            module.norm_type,
            module.scale_grad_by_freq,
            module.mode,
            _weight=stack_copies(module.weight, batch),
            include_last_offset=module.include_last_offset,
            padding_idx=module.padding_idx,
            batch=batch,
        )
        layer.weight.requires_grad_(module.weight.requires_grad)
        return layer

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        freeze: bool = True,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        *,
        batch: int | None = None,
    ) -> EmbeddingBag:
        """From ``(B, num, dim)`` tables, or one ``(num, dim)`` table copied into ``batch`` slots."""
        embeddings = stacked_tables(embeddings, batch)
        b, num, dim = embeddings.shape
        layer = cls(
            num,
            dim,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            mode,
            sparse,
            embeddings,
            include_last_offset,
            padding_idx,
            batch=b,
        )
        layer.weight.requires_grad_(not freeze)
        return layer

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        is_tensor = isinstance(input, Tensor)  # (anything else: the functional names what it expected)
        shared = is_tensor and self.is_shared(input)
        if is_tensor and not shared and input.dim() == 2 and offsets is None:
            self.check_merged(input)
        return embedding_bag(
            input,
            self.weight,
            offsets,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=self.padding_idx,
            layout=self.layout,
            shared=shared,
        )

    def check(self) -> None:
        """Synchronise and raise a pending ``IndexError`` from an earlier lookup on this device."""
        if self.weight.is_cuda:
            _cuda.check(self.weight.device)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        s += f", mode={self.mode!r}"
        if self.include_last_offset:
            s += ", include_last_offset=True"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + f", batch={self.batch}"


EmbeddingBag.__doc__ = EmbeddingBag.__doc__.replace("{shared}", _SHARED_DOC)
