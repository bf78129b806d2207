"""Batched embedding layers whose backward is an atomic scatter-add (CuPy kernel) instead of a sort.

``nn.Embedding``'s CUDA backward sorts the indices and reduces by key; for the many-repeated indices
and small dims of recommendation and language models an atomic scatter-add is several times faster.
The lookup, its kernel and reference paths, are the functional core's
(:func:`batch_layers.functional.embedding`); the layers here hold the tables and call it.

Bad indices (negative, or ``>= num_embeddings``) raise ``IndexError`` naming the value and the table
size. On the CPU that happens at once; on CUDA the kernels skip the bad entry (a zero row forward, no
gradient), record it on the device and in pinned host memory, and the error is raised by the next
forward of any embedding layer once the report has reached the host, or by :func:`check_indices` /
the layer's :meth:`check`, which synchronise. No device-side assert, no per-step host sync.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch
from torch import Tensor, nn

from . import _embedding_cuda as _cuda
from ._base import AbstractBatchModule, stack_copies
from .functional._embedding import SPARSE_MESSAGE, batched_embedding, embedding, normalize_padding_idx

__all__ = ["Embedding", "FastEmbedding", "batched_embedding", "check_indices"]


def check_indices(device: torch.device | str | None = None) -> None:
    """Synchronise and raise the pending ``IndexError`` of a bad index looked up on ``device`` (every
    CUDA device if ``None``). On the CPU bad indices raise at once, so this is a no-op there."""
    _cuda.check(device)


_SHARED_DOC = """
    The merged model axis is models-major (row ``b*n + i`` is sample ``i`` of model ``b``). Inside a
    shared-input forward of :class:`torchmb.BatchModule` a ``(n, *)`` input is looked up by every
    model in its own table without B copies of the indices.
"""


def stacked_tables(embeddings: Tensor, batch: int | None) -> Tensor:
    """``from_pretrained``'s tables as ``(B, num, dim)``: given so, or one ``(num, dim)`` table copied into
    ``batch`` slots."""
    if embeddings.dim() == 2:
        if batch is None:
            raise ValueError("a 2-D embeddings tensor is one table: pass batch= (the number of copies)")
        return stack_copies(embeddings, batch)
    if embeddings.dim() != 3:
        raise ValueError(f"embeddings must be (B, num, dim) or (num, dim), got {tuple(embeddings.shape)}")
    if batch is not None and batch != embeddings.shape[0]:
        raise ValueError(f"batch={batch} disagrees with embeddings of shape {tuple(embeddings.shape)}")
    return embeddings


# The class that ``Embedding(..., offload=True)`` builds: batch_layers._embedding_offload's
# OffloadedBatchEmbedding, set by set_offloaded_class when it is defined (it imports this module; this module
# does not import it).
_OFFLOADED: list[type[Embedding]] = []


def set_offloaded_class(cls: type[Embedding]) -> None:
    """Make ``Embedding(..., offload=True)`` build ``cls``."""
    _OFFLOADED[:] = [cls]


class Embedding(AbstractBatchModule):
    r"""``batch`` independent :class:`torch.nn.Embedding` tables, looked up in one launch.

    Args:
        num_embeddings: rows of each table.
        embedding_dim: size of each row.
        padding_idx: row of every table that gets no gradient (and starts at zero).
        max_norm, norm_type: renormalise looked-up rows whose ``norm_type``-norm exceeds ``max_norm``,
            in place, as ``nn.Embedding`` does.
        scale_grad_by_freq: divide each row's gradient by its frequency in the model's mini-batch.
        sparse: must be ``False`` (refused with an explanation).
        _weight: an initial ``(batch, num_embeddings, embedding_dim)`` weight (used as the parameter).
        _freeze: with ``_weight``, do not train it.
        batch: number of models B.
        offload: keep the B tables and their optimizer state in (pinned) host memory and switch only each
            step's rows onto the compute device: builds an
            :class:`~batch_layers._embedding_offload.OffloadedBatchEmbedding`, which also takes
            ``cache_rows``, ``cache_bytes``, ``pin`` and ``engine`` (see :mod:`offload`).

    Shape:
        - Input: ``(B*n, *)`` int64/int32 indices with the model axis merged into dim 0.
        - Output: ``(B*n, *, embedding_dim)``.

    Attributes:
        weight: ``(B, num_embeddings, embedding_dim)``, each slice initialised from N(0, 1) (with
            ``offload=True``: the working rows of the step; the tables are ``table``).
    {shared}
    The backward is an atomic scatter-add on CUDA (a CuPy kernel) and ``index_add_`` elsewhere; see
    :mod:`batch_layers._embedding`. Bad indices raise ``IndexError`` (on CUDA at the next forward or
    :meth:`check`).

    Examples::

        >>> emb = Embedding(10, 3, batch=4)
        >>> emb(torch.randint(0, 10, (4 * 5, 7))).shape
        torch.Size([20, 7, 3])
    """

    base_class: ClassVar[type[nn.Module]] = nn.Embedding
    merged_order = "models"

    def __new__(cls, *args, offload: bool = False, **kwargs):
        if offload and cls is Embedding:
            return super().__new__(Embedding._offloaded())  # its __init__ then takes the same arguments
        return super().__new__(cls)

    @staticmethod
    def _offloaded() -> type[Embedding]:
        if not _OFFLOADED:  # (importing batch_layers registers it)
            raise ImportError("the offloaded Embedding is not registered: import batch_layers")
        return _OFFLOADED[0]

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        offload: bool = False,
        **offload_options,
    ) -> None:
        if offload:
            raise TypeError(
                f"{type(self).__name__} does not support offload=True (only batch_layers.Embedding "
                "itself builds an offloaded layer)"
            )
        if offload_options:
            raise TypeError(
                f"Embedding got unexpected keyword arguments {sorted(offload_options)} (cache_rows, "
                "cache_bytes, pin and engine apply only with offload=True)"
            )
        super().__init__(batch)
        if sparse:
            raise ValueError(SPARSE_MESSAGE)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = False
        if _weight is None:
            self.weight = nn.Parameter(
                torch.empty(batch, num_embeddings, embedding_dim, **factory_kwargs), requires_grad=not _freeze
            )
            self.reset_parameters()
        else:
            expected = (batch, num_embeddings, embedding_dim)
            if tuple(_weight.shape) != expected:
                raise ValueError(
                    f"_weight must have shape (batch, num_embeddings, embedding_dim) = {expected}, "
                    f"got {tuple(_weight.shape)}"
                )
            self.weight = nn.Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        """Every model's table from N(0, 1), its padding row zeroed (as ``nn.Embedding``)."""
        for i in range(self.weight.shape[0]):
            nn.init.normal_(self.weight[i])
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[:, self.padding_idx].fill_(0)

    @classmethod
    def from_module(cls, module: nn.Embedding, batch: int, *, offload: bool = False, **offload_options) -> Embedding:
        """B copies of ``module``'s table and settings.

        With ``offload=True`` the copies are written straight into host memory (see
        :class:`~batch_layers._embedding_offload.OffloadedBatchEmbedding`; ``offload_options`` are its ``cache_rows``,
        ``cache_bytes``, ``pin``, ``engine`` and ``device``).
        """
        if offload:
            return Embedding._offloaded().from_module(module, batch, **offload_options)
        if offload_options:
            raise TypeError(
                f"from_module got unexpected keyword arguments {sorted(offload_options)} (they apply "
                "only with offload=True)"
            )
        if module.sparse:
            raise ValueError(SPARSE_MESSAGE)
        return cls(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            module.max_norm,
            module.norm_type,
            module.scale_grad_by_freq,
            _weight=stack_copies(module.weight, batch),
            _freeze=not module.weight.requires_grad,
            batch=batch,
        )

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        *,
        batch: int | None = None,
    ) -> Embedding:
        """From ``(B, num, dim)`` tables, or one ``(num, dim)`` table copied into ``batch`` slots."""
        embeddings = stacked_tables(embeddings, batch)
        b, num, dim = embeddings.shape
        return cls(
            num,
            dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight=embeddings,
            _freeze=freeze,
            batch=b,
        )

    def forward(self, input: Tensor) -> Tensor:
        shared = self.is_shared(input)
        if not shared and input.dim():
            dim = self.merged_dim(input, feature_dims=0)
            if dim:  # sequence-first token ids, (seq, B*n): look up with the model axis in front
                return self.forward(input.movedim(dim, 0)).movedim(0, dim)
        return embedding(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            layout=self.layout,
            shared=shared,
        )

    def check(self) -> None:
        """Synchronise and raise a pending ``IndexError`` from an earlier lookup on this device."""
        if self.weight.is_cuda:
            _cuda.check(self.weight.device)


Embedding.__doc__ = Embedding.__doc__.replace("{shared}", _SHARED_DOC)
# ``__new__`` only routes offload=True; let help(), inspect and autodoc show the constructor's signature.
Embedding.__new__.__signature__ = inspect.signature(Embedding.__init__)


class FastEmbedding(nn.Embedding):
    r"""A drop-in :class:`torch.nn.Embedding` (same constructor, state dict and behaviour) whose backward
    is the atomic scatter-add kernel on CUDA.

    It *is* an ``nn.Embedding`` (``isinstance`` holds, ``weight`` is ``(num_embeddings, dim)``), so
    optimizers, checkpoints and ``from_pretrained`` work unchanged. ``sparse=True`` is refused.
    Out-of-range indices raise ``IndexError`` (on CUDA at the next forward or :meth:`check`).

    Examples::

        >>> emb = FastEmbedding(1000, 16, padding_idx=0)
        >>> emb(torch.tensor([[0, 5, 999]])).shape
        torch.Size([1, 3, 16])
    """

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("sparse") or (len(args) > 6 and args[6]):
            raise ValueError(SPARSE_MESSAGE)
        super().__init__(*args, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        return batched_embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
        )

    def check(self) -> None:
        """Synchronise and raise a pending ``IndexError`` from an earlier lookup on this device."""
        if self.weight.is_cuda:
            _cuda.check(self.weight.device)
