"""Batched embedding layers whose backward is an atomic scatter-add (CuPy kernel) instead of a sort.

``nn.Embedding``'s CUDA backward sorts the indices and reduces by key; for the many-repeated indices
and small dims of recommendation and language models an atomic scatter-add is several times faster.
Every layer here runs one of two paths with one signature (see :mod:`batch_layers._backend`):

- the **kernel path** (CUDA tensors, CuPy importable): one gather launch for all B tables and one
  scatter launch that atomically adds the output gradient into an fp32 gradient (warp-level
  de-duplication of repeated rows, vectorised atomics), then casts to the weight's dtype;
- the **reference path** (CPU, no CuPy, or ``set_backend("torch")``): ``index_select`` forward and
  ``index_add_`` backward into an fp32 (fp64 for fp64 weights) gradient.

Under ``torch.use_deterministic_algorithms(True)`` the backward on CUDA is a sort-based
``index_put_(accumulate=True)``, which torch makes deterministic.

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
from torch.autograd.function import once_differentiable

from . import _embedding_cuda as _cuda
from . import _embedding_ops as _ops
from ._backend import get_backend
from ._base import AbstractBatchModule, stack_copies

__all__ = ["Embedding", "FastEmbedding", "batched_embedding", "check_indices"]

_SPARSE_MSG = (
    "sparse=True is not supported: torchmb's embeddings return a dense gradient (the atomic scatter "
    "writes it directly, and every torch.optim optimizer accepts it); sparse gradients would also mix "
    "the B models' rows in one sparse tensor. Use sparse=False (the default)"
)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_indices(device: torch.device | str | None = None) -> None:
    """Synchronise and raise the pending ``IndexError`` of a bad index looked up on ``device`` (every
    CUDA device if ``None``). On the CPU bad indices raise at once, so this is a no-op there."""
    _cuda.check(device)


def _use_kernels(weight: Tensor) -> bool:
    """Whether a CUDA ``weight`` is looked up by the kernels (backend switch, CuPy, dtype)."""
    if get_backend() == "torch" or not _cuda.use_kernels(weight.device):
        return False
    if weight.dtype not in _KERNEL_DTYPES:
        if get_backend() == "cupy":
            raise TypeError(
                f"the CuPy embedding kernels support {_KERNEL_DTYPES}, got weight dtype {weight.dtype}; "
                "use set_backend('auto') or set_backend('torch') for it"
            )
        return False
    return True


def _normalize_padding(padding_idx: int | None, num: int) -> int | None:
    if padding_idx is None:
        return None
    if not -num <= padding_idx < num:
        raise ValueError(
            f"padding_idx must be within num_embeddings = {num} (in [{-num}, {num - 1}]), got {padding_idx}"
        )
    return padding_idx + num if padding_idx < 0 else padding_idx


def _check_index_tensor(input: Tensor, weight: Tensor, what: str = "input") -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"{what} must be a tensor of indices, got {type(input).__name__}")
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what} must be an integer tensor of dtype int64 or int32, got {input.dtype}")
    if input.device != weight.device:
        raise ValueError(f"{what} is on {input.device} but the embedding weight is on {weight.device}")


def _raise_bad_now(idx: Tensor, num: int | Tensor) -> None:
    """Synchronous check (CPU tensors, and paths that synchronise anyway)."""
    nums = num if isinstance(num, Tensor) else torch.tensor(num, device=idx.device)
    bad = (idx < 0) | (idx >= nums)
    if torch.compiler.is_compiling():  # no host sync in a graph: the check runs in it
        torch._assert_async(~bad.any(), "an embedding index is out of range for its table")
        return
    if bool(bad.any()):
        pos = int(bad.reshape(-1).nonzero()[0, 0])
        value = int(idx.reshape(-1)[pos])
        size = int(nums.expand_as(idx).reshape(-1)[pos]) if isinstance(num, Tensor) else num
        raise IndexError(
            f"index {value} is out of range for an embedding table of {size} rows (valid indices are 0..{size - 1})"
        )


def _positions(idx: Tensor, tables: int, num: int, per: int) -> tuple[Tensor, Tensor]:
    """Reference path: ``(local index, flat row key)`` for each merged position (int64)."""
    full = idx.long().repeat(tables) if idx.numel() != tables * per else idx.long()
    table = torch.arange(tables * per, device=idx.device) // max(per, 1)
    return full, table * num + full


class _LookupFn(torch.autograd.Function):
    """Row lookup in ``tables`` tables of ``num`` rows (``weight`` holds ``tables * num`` rows).

    ``meta`` is ``(tables, num, per, pad, freq, kernels, weight shape, weight dtype, output shape)``, one
    argument so that ``apply`` has little to walk; the output has its final shape (no view node).
    """

    @staticmethod
    def forward(ctx, weight, idx, meta):
        tables, num, per, _, _, kernels, shape, _, out_shape = meta
        if kernels and torch.compiler.is_compiling():
            out = _ops.gather(weight, idx, tables, num, per, list(out_shape))
        elif kernels:
            out = _cuda.gather(weight, idx, tables, num, per, out_shape)
        else:
            # Written into a tensor of the final shape: a view returned from a custom Function would make
            # in-place ops on the lookup's output illegal.
            flat = weight.view(tables * num, shape[-1])
            out = weight.new_empty(out_shape)
            rows = out.view(-1, shape[-1])
            local, key = _positions(idx, tables, num, per)
            if weight.is_cuda:
                valid = (local >= 0) & (local < num)
                if idx.numel():
                    _cuda.record_bad_indices(idx, num)
                torch.index_select(flat, 0, torch.where(valid, key, 0), out=rows).masked_fill_(~valid.unsqueeze(1), 0)
            else:
                torch.index_select(flat, 0, key, out=rows)  # indices were validated by the caller
        ctx.save_for_backward(idx)
        ctx.meta = meta
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph=True: refuse a second derivative, as once_differentiable
            return _lookup_backward_once(ctx, grad)
        return _lookup_backward(ctx, grad)


def _lookup_backward(ctx, grad):
    if not ctx.needs_input_grad[0]:
        return None, None, None
    (idx,) = ctx.saved_tensors
    tables, num, per, pad, freq, kernels, shape, dtype, _ = ctx.meta
    if kernels and not torch.are_deterministic_algorithms_enabled():
        if not grad.is_contiguous():
            grad = grad.contiguous()
        if torch.compiler.is_compiling():  # dynamo traces the operators, not the launches
            counts = _ops.counts(idx, tables, num, per) if freq else None
            gw = _ops.scatter(grad, idx, list(shape), tables, num, per, pad, counts)
        else:
            counts = _cuda.counts(idx, tables, num, per) if freq else None
            gw = _cuda.scatter(grad, idx, shape, tables, num, per, pad, counts)
    else:
        gw = _reference_scatter(grad.reshape(-1, shape[-1]), idx.reshape(-1), tables, num, per, pad, freq, shape, dtype)
    return (gw if gw.dtype == dtype else gw.to(dtype)), None, None


_lookup_backward_once = once_differentiable(_lookup_backward)
_functorch_active = torch._C._are_functorch_transforms_active
try:  # the C++ apply without Function.apply's Python wrapper (used when no functorch transform is active)
    _lookup_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _LookupFn)
except (AttributeError, KeyError, TypeError):  # pragma: no cover - depends on the torch version
    _lookup_apply = _LookupFn.apply


def _reference_scatter(grad, idx, tables, num, per, pad, freq, shape, dtype) -> Tensor:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    local, key = _positions(idx, tables, num, per)
    dump = tables * num  # an extra row takes padding and bad entries, and is dropped
    valid = (local >= 0) & (local < num)
    target = torch.where(valid & (local != pad), key, dump)
    g = grad.to(acc)
    if freq:
        counts = torch.bincount(torch.where(valid, key, dump), minlength=dump + 1).clamp_(min=1)
        g = g / counts[target].unsqueeze(1).to(acc)
    gw = torch.zeros(dump + 1, grad.shape[-1], dtype=acc, device=grad.device)
    if grad.is_cuda and torch.are_deterministic_algorithms_enabled():
        gw.index_put_((target,), g, accumulate=True)  # sort-based and deterministic under the flag
    else:
        gw.index_add_(0, target, g)
    return gw[:dump].reshape(shape)


def _renorm_(weight: Tensor, idx: Tensor, tables: int, num: int, per: int, max_norm: float, norm_type: float) -> None:
    """``torch.embedding_renorm_`` of the looked-up rows of every table, in place (as nn.Embedding)."""
    _raise_bad_now(idx, num)  # the renorm needs the unique rows, a host sync torch takes too
    _, key = _positions(idx, tables, num, per)
    with torch.no_grad():
        torch.embedding_renorm_(weight.view(tables * num, weight.shape[-1]), key, max_norm, norm_type)


def batched_embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    *,
    shared: bool = False,
) -> Tensor:
    """``F.embedding`` for B tables at once.

    Args:
        input: merged ``(B*n, *)`` indices (model b's are rows ``b*n .. b*n+n-1``), or with
            ``shared=True`` one ``(n, *)`` index tensor every model looks up in its own table.
        weight: ``(B, num_embeddings, embedding_dim)``, or ``(num_embeddings, embedding_dim)`` for one
            table (then ``input`` is any shape, as for ``F.embedding``).
        padding_idx, max_norm, norm_type, scale_grad_by_freq: as :func:`torch.nn.functional.embedding`,
            applied per table (``padding_idx`` is a row index of each table).
        sparse: must be ``False``; sparse gradients are refused.

    Returns:
        ``(B*n, *, embedding_dim)`` (``input.shape + (embedding_dim,)`` when not shared).
    """
    if sparse:
        raise ValueError(_SPARSE_MSG)
    wdim = weight.dim()
    if wdim != 3 and wdim != 2:
        raise ValueError(f"weight must be (B, num_embeddings, dim) or (num_embeddings, dim), got {tuple(weight.shape)}")
    _check_index_tensor(input, weight)
    shape = weight.shape
    tables = shape[0] if wdim == 3 else 1
    num, dim = shape[-2], shape[-1]
    pad = -1 if padding_idx is None else _normalize_padding(padding_idx, num)
    if weight.is_cuda:
        if not torch.compiler.is_compiling():  # a compiled lookup's bad index shows at check() or eagerly
            _cuda.raise_pending(weight.get_device())
        kernels = _use_kernels(weight)
    else:
        kernels = False
    n = input.numel()
    if shared:
        per = n
        out_shape = (tables * input.shape[0], *input.shape[1:], dim) if input.dim() else (tables, dim)
    else:
        if n % tables:
            raise ValueError(
                f"expected the indices to hold {tables} models' lookups (numel divisible by B = {tables}), "
                f"got shape {tuple(input.shape)}"
            )
        per = n // tables
        out_shape = (*input.shape, dim)
    if kernels and max_norm is None:  # the hot path: the kernels read the indices in place
        idx = input if input.is_contiguous() else input.contiguous()
    else:
        idx = input.reshape(-1)
        if not idx.is_contiguous():
            idx = idx.contiguous()
        if not weight.is_cuda:
            _raise_bad_now(idx, num)
        if max_norm is not None:
            _renorm_(weight, idx, tables, num, per, max_norm, norm_type)
    w = weight if weight.is_contiguous() else weight.contiguous()
    meta = (tables, num, per, pad, bool(scale_grad_by_freq), kernels, shape, weight.dtype, out_shape)
    if _functorch_active() or torch.compiler.is_compiling():  # both trace Function.apply, not the C++ apply
        return _LookupFn.apply(w, idx, meta)
    return _lookup_apply(w, idx, meta)


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
            raise ValueError(_SPARSE_MSG)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = _normalize_padding(padding_idx, num_embeddings)
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
            raise ValueError(_SPARSE_MSG)
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
        return batched_embedding(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
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
            raise ValueError(_SPARSE_MSG)
        super().__init__(*args, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        return batched_embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
        )

    def check(self) -> None:
        """Synchronise and raise a pending ``IndexError`` from an earlier lookup on this device."""
        if self.weight.is_cuda:
            _cuda.check(self.weight.device)
