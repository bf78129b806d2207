"""Batched ``nn.EmbeddingBag``: B tables whose looked-up rows (the :class:`~batch_layers.Embedding` lookup,
one gather launch and the atomic scatter-add backward) are reduced into bags by sum, mean or max."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from . import _embedding_cuda as _cuda
from ._base import AbstractBatchModule, stack_copies
from ._embedding import (
    _SHARED_DOC,
    _SPARSE_MSG,
    _check_index_tensor,
    _normalize_padding,
    batched_embedding,
    stacked_tables,
)

__all__ = ["EmbeddingBag"]


def _check_offsets(offsets: Tensor, length: int) -> None:
    """Refuse what torch's EmbeddingBag refuses, per model (row of ``offsets``, local to its ``length`` indices):
    a first offset other than 0, a decreasing offset, one beyond the model's indices. On the host for CPU
    tensors; on the device otherwise (no synchronisation: a device-side assert, as torch's own)."""
    if offsets.shape[1] == 0:
        return
    first, steps = offsets[:, 0], offsets.diff(dim=1)
    bad = (first != 0) | (steps < 0).any(1) | (offsets > length).any(1)
    rule = (
        f"each model's offsets index its own {length} indices: they start at 0 (offsets[0] has to be 0, as in "
        f"torch), never decrease and do not exceed {length}"
    )
    if offsets.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"EmbeddingBag: {rule}")
    elif bool(bad.any()):
        model = int(bad.nonzero()[0])
        raise RuntimeError(f"EmbeddingBag: {rule}; model {model}'s offsets are {offsets[model].tolist()}")


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
            raise ValueError(_SPARSE_MSG)
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
        self.padding_idx = _normalize_padding(padding_idx, num_embeddings)
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
            raise ValueError(_SPARSE_MSG)
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
        B = self.batch
        _check_index_tensor(input, self.weight)
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise NotImplementedError(
                    f"per_sample_weights is only supported for mode='sum' (as in torch), got mode={self.mode!r}"
                )
            if per_sample_weights.shape != input.shape:
                raise ValueError(
                    f"per_sample_weights must have the input's shape {tuple(input.shape)}, "
                    f"got {tuple(per_sample_weights.shape)}"
                )
        shared = self.is_shared(input)
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("if input is 2-D, offsets must be None (each row is one bag)")
            if not shared:
                self.check_merged(input)
            bags_per_model = input.shape[0] if shared else input.shape[0] // B
            length = input.shape[1]
            pos = torch.arange(input.numel(), device=input.device)
            bag = pos // max(length, 1)  # bag of each position within the (shared or merged) input
            if not shared:
                bag = bag - (bag // bags_per_model) * bags_per_model  # local bag within the model
            per = input.numel() if shared else input.numel() // B
            in_range = torch.ones_like(bag, dtype=torch.bool)
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError("a 1-D input needs offsets (the start of each bag)")
            _check_index_tensor(offsets, self.weight, "offsets")
            groups = 1 if shared else B
            if input.numel() % groups or offsets.numel() % groups:
                raise ValueError(
                    f"expected B = {B} models' indices and offsets, got input {tuple(input.shape)} "
                    f"and offsets {tuple(offsets.shape)}"
                )
            per = input.numel() // groups
            starts = offsets.long().view(groups, -1)
            _check_offsets(starts, per)
            if self.include_last_offset:
                if starts.shape[1] < 1:
                    raise ValueError("include_last_offset=True needs at least one offset per model")
                ends = starts[:, -1:]
                starts = starts[:, :-1]
            else:
                ends = torch.full((groups, 1), per, device=input.device, dtype=torch.long)
            bags_per_model = starts.shape[1]
            local_pos = torch.arange(per, device=input.device).expand(groups, per)
            bag = (torch.searchsorted(starts.contiguous(), local_pos.contiguous(), right=True) - 1).reshape(-1)
            in_range = ((local_pos < ends) & (bag.view(groups, per) >= 0)).reshape(-1)
            bag = bag.clamp(min=0)
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D (B*n, L), got shape {tuple(input.shape)}")

        rows = batched_embedding(
            input.reshape(-1),
            self.weight,
            None,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            shared=shared,
        )  # (B*per, dim), models-major
        dim = self.embedding_dim
        idx_all = input.reshape(-1).repeat(B) if shared else input.reshape(-1)
        keep = in_range.repeat(B) if shared else in_range
        if self.padding_idx is not None:
            keep = keep & (idx_all != self.padding_idx)
        model = torch.arange(B * per, device=input.device) // max(per, 1)
        bag_all = bag.repeat(B) if shared else bag
        nbags = B * bags_per_model
        target = torch.where(keep, model * bags_per_model + bag_all, nbags)  # nbags: a dump row
        out_rows = nbags + 1
        if self.mode == "max":
            src = rows
            out = torch.zeros(out_rows, dim, dtype=rows.dtype, device=rows.device)
            out = out.scatter_reduce(0, target.unsqueeze(1).expand(-1, dim), src, "amax", include_self=False)
        else:
            w = keep.to(rows.dtype)
            if per_sample_weights is not None:
                psw = per_sample_weights.reshape(-1)
                w = w * (psw.repeat(B) if shared else psw).to(rows.dtype)
            src = rows * w.unsqueeze(1)
            out = torch.zeros(out_rows, dim, dtype=rows.dtype, device=rows.device)
            if rows.is_cuda and torch.are_deterministic_algorithms_enabled():
                out = out.index_put((target,), src, accumulate=True)
            else:
                out = out.index_add(0, target, src)
            if self.mode == "mean":
                count = torch.zeros(out_rows, dtype=rows.dtype, device=rows.device).index_add(
                    0, target, keep.to(rows.dtype)
                )
                out = out / count.clamp(min=1).unsqueeze(1)
        return out[:nbags]

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
