"""Batched embedding lookups: ``F.embedding`` and ``F.embedding_bag`` for B tables at once.

The lookup runs one of two paths with one signature (see :mod:`batch_layers._backend`):

- the **kernel path** (CUDA tensors, CuPy importable): one gather launch for all B tables and one
  scatter launch that atomically adds the output gradient into an fp32 gradient (warp-level
  de-duplication of repeated rows, vectorised atomics), then casts to the weight's dtype
  (:mod:`batch_layers._embedding_cuda`; under ``torch.compile``, its operators in
  :mod:`batch_layers._embedding_ops`);
- the **reference path** (CPU, no CuPy, or ``set_backend("torch")``): ``index_select`` forward and
  ``index_add_`` backward into an fp32 (fp64 for fp64 weights) gradient.

Under ``torch.use_deterministic_algorithms(True)`` the backward on CUDA is a sort-based
``index_put_(accumulate=True)``, which torch makes deterministic. Bad indices (negative, or
``>= num_embeddings``) raise ``IndexError`` naming the value and the table size: on the CPU at once, on CUDA
at the next lookup once the device's report reached the host (see :mod:`batch_layers._embedding`).

The kernels address B tables models-major (row ``b * n + i`` looks up in table ``b``); a samples-major
:class:`Layout` reorders the indices before and the rows after.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _embedding_cuda as _cuda
from .. import _embedding_ops as _ops
from .._backend import get_backend
from .._layout import Layout

__all__ = [
    "SPARSE_MESSAGE",
    "batched_embedding",
    "check_index_tensor",
    "embedding",
    "embedding_bag",
    "normalize_padding_idx",
    "raise_bad_indices",
    "use_kernels",
]

SPARSE_MESSAGE = (
    "sparse=True is not supported: torchmb's embeddings return a dense gradient (the atomic scatter "
    "writes it directly, and every torch.optim optimizer accepts it); sparse gradients would also mix "
    "the B models' rows in one sparse tensor. Use sparse=False (the default)"
)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_kernels(weight: Tensor) -> bool:
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


def normalize_padding_idx(padding_idx: int | None, num: int) -> int | None:
    if padding_idx is None:
        return None
    if not -num <= padding_idx < num:
        raise ValueError(
            f"padding_idx must be within num_embeddings = {num} (in [{-num}, {num - 1}]), got {padding_idx}"
        )
    return padding_idx + num if padding_idx < 0 else padding_idx


def check_index_tensor(input: Tensor, weight: Tensor, what: str = "input") -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"{what} must be a tensor of indices, got {type(input).__name__}")
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what} must be an integer tensor of dtype int64 or int32, got {input.dtype}")
    if input.device != weight.device:
        raise ValueError(f"{what} is on {input.device} but the embedding weight is on {weight.device}")


def raise_bad_indices(idx: Tensor, num: int | Tensor) -> None:
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
    raise_bad_indices(idx, num)  # the renorm needs the unique rows, a host sync torch takes too
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
        raise ValueError(SPARSE_MESSAGE)
    wdim = weight.dim()
    if wdim != 3 and wdim != 2:
        raise ValueError(f"weight must be (B, num_embeddings, dim) or (num_embeddings, dim), got {tuple(weight.shape)}")
    check_index_tensor(input, weight)
    shape = weight.shape
    tables = shape[0] if wdim == 3 else 1
    num, dim = shape[-2], shape[-1]
    pad = -1 if padding_idx is None else normalize_padding_idx(padding_idx, num)
    if weight.is_cuda:
        if not torch.compiler.is_compiling():  # a compiled lookup's bad index shows at check() or eagerly
            _cuda.raise_pending(weight.get_device())
        kernels = use_kernels(weight)
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
            raise_bad_indices(idx, num)
        if max_norm is not None:
            _renorm_(weight, idx, tables, num, per, max_norm, norm_type)
    w = weight if weight.is_contiguous() else weight.contiguous()
    meta = (tables, num, per, pad, bool(scale_grad_by_freq), kernels, shape, weight.dtype, out_shape)
    if _functorch_active() or torch.compiler.is_compiling():  # both trace Function.apply, not the C++ apply
        return _LookupFn.apply(w, idx, meta)
    return _lookup_apply(w, idx, meta)



def _models_major(x: Tensor, layout: Layout) -> Tensor:
    """Merged rows of ``layout`` as models-major rows (a copy samples-major), the kernels' order."""
    if x.shape[0] % layout.batch:
        raise ValueError(f"expected the merged indices of B = {layout.batch} models in dim 0, got {tuple(x.shape)}")
    return layout.split(x).reshape(-1, *x.shape[1:])


def _in_layout(y: Tensor, layout: Layout) -> Tensor:
    """Models-major rows of B models in ``layout``'s order."""
    return layout.merge(y.view(layout.batch, -1, *y.shape[1:]))


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.embedding` for B models, each looking up in its own table.

    Args:
        input: the merged ``(B*n, *)`` indices (with ``shared``, one ``(n, *)`` index tensor every model looks
            up in its own table, without B copies of it).
        weight: ``(B, num_embeddings, embedding_dim)``.
        padding_idx, max_norm, norm_type, scale_grad_by_freq: as torch's, applied per table (``padding_idx`` is
            a row of each table; ``max_norm`` renormalises the looked-up rows in place).
        sparse: must be ``False``; sparse gradients are refused.

    Returns:
        the merged ``(B*n, *, embedding_dim)`` in ``layout``'s order.
    """
    if weight.dim() != 3 or weight.shape[0] != layout.batch:
        raise ValueError(
            f"weight must be (B, num_embeddings, dim) with B = {layout.batch}, got {tuple(weight.shape)}"
        )
    samples_major = layout.order == "samples" and input.dim() > 0
    if samples_major and not shared:
        check_index_tensor(input, weight)
        input = _models_major(input, layout)
    out = batched_embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse, shared=shared)
    return _in_layout(out, layout) if samples_major else out


def embedding_bag(
    input: Tensor,
    weight: Tensor,
    offsets: Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.embedding_bag` for B models: the rows of :func:`embedding` reduced into bags by
    ``mode`` (``"sum"``, ``"mean"`` or ``"max"``).

    Args:
        input: a 2-D ``(B*n, L)``: ``n`` bags of ``L`` indices per model, merged in ``layout``'s order
            (``offsets`` None); or a 1-D ``(B*T,)``: the B models' index lists of ``T`` each, one after the
            other, with ``offsets`` ``(B*m,)`` (``(B*(m+1),)`` with ``include_last_offset``), model b's local
            to its own list at ``offsets[b*m : (b+1)*m]``. With ``shared``, one model's input (and offsets)
            that every model looks up in its own table.
        weight: ``(B, num_embeddings, embedding_dim)``.
        per_sample_weights: the input's shape (mode ``"sum"`` only).
        The others: as torch's, per table.

    Returns:
        ``(B*n, embedding_dim)`` (``(B*m, embedding_dim)`` for a 1-D input), merged in ``layout``'s order.
    """
    if sparse:
        raise ValueError(SPARSE_MESSAGE)
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
    check_index_tensor(input, weight)
    if per_sample_weights is not None:
        if mode != "sum":
            raise NotImplementedError(
                f"per_sample_weights is only supported for mode='sum' (as in torch), got mode={mode!r}"
            )
        if per_sample_weights.shape != input.shape:
            raise ValueError(
                f"per_sample_weights must have the input's shape {tuple(input.shape)}, "
                f"got {tuple(per_sample_weights.shape)}"
            )
    padding_idx = normalize_padding_idx(padding_idx, weight.shape[1])
    reorder = layout.order == "samples"
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("if input is 2-D, offsets must be None (each row is one bag)")
        if reorder and not shared:
            input = _models_major(input, layout)
            if per_sample_weights is not None:
                per_sample_weights = _models_major(per_sample_weights, layout)
        bag, in_range, per, bags_per_model = _fixed_bags(input, layout.batch, shared)
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("a 1-D input needs offsets (the start of each bag)")
        check_index_tensor(offsets, weight, "offsets")
        bag, in_range, per, bags_per_model = _offset_bags(input, offsets, layout.batch, shared, include_last_offset)
    else:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D (B*n, L), got shape {tuple(input.shape)}")
    rows = batched_embedding(
        input.reshape(-1), weight, None, max_norm, norm_type, scale_grad_by_freq, shared=shared
    )  # (B*per, dim), models-major
    bags = _reduce_bags(rows, input, bag, in_range, per, bags_per_model, layout.batch, shared, mode,
                        per_sample_weights, padding_idx)
    return _in_layout(bags, layout) if reorder else bags


def _fixed_bags(input: Tensor, batch: int, shared: bool) -> tuple[Tensor, Tensor, int, int]:
    """A 2-D input's bags (rows of ``L`` indices): each position's bag within its model, whether it is in a bag
    (all are), the positions per model and the bags per model."""
    bags_per_model = input.shape[0] if shared else input.shape[0] // batch
    length = input.shape[1]
    pos = torch.arange(input.numel(), device=input.device)
    bag = pos // max(length, 1)  # bag of each position within the (shared or merged) input
    if not shared:
        bag = bag - (bag // bags_per_model) * bags_per_model  # local bag within the model
    per = input.numel() if shared else input.numel() // batch
    return bag, torch.ones_like(bag, dtype=torch.bool), per, bags_per_model


def _offset_bags(input: Tensor, offsets: Tensor, batch: int, shared: bool, include_last_offset: bool):
    """A 1-D input's bags, as :func:`_fixed_bags`, from each model's ``offsets``."""
    groups = 1 if shared else batch
    if input.numel() % groups or offsets.numel() % groups:
        raise ValueError(
            f"expected B = {batch} models' indices and offsets, got input {tuple(input.shape)} "
            f"and offsets {tuple(offsets.shape)}"
        )
    per = input.numel() // groups
    starts = offsets.long().view(groups, -1)
    _check_offsets(starts, per)
    if include_last_offset:
        if starts.shape[1] < 1:
            raise ValueError("include_last_offset=True needs at least one offset per model")
        ends = starts[:, -1:]
        starts = starts[:, :-1]
    else:
        ends = torch.full((groups, 1), per, device=input.device, dtype=torch.long)
    local_pos = torch.arange(per, device=input.device).expand(groups, per)
    bag = (torch.searchsorted(starts.contiguous(), local_pos.contiguous(), right=True) - 1).reshape(-1)
    in_range = ((local_pos < ends) & (bag.view(groups, per) >= 0)).reshape(-1)
    return bag.clamp(min=0), in_range, per, starts.shape[1]


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


def _reduce_bags(rows, input, bag, in_range, per, bags_per_model, batch, shared, mode, per_sample_weights,
                 padding_idx) -> Tensor:
    """The models-major ``(B*bags_per_model, dim)`` bags of the looked-up ``rows``."""
    dim = rows.shape[-1]
    idx_all = input.reshape(-1).repeat(batch) if shared else input.reshape(-1)
    keep = in_range.repeat(batch) if shared else in_range
    if padding_idx is not None:
        keep = keep & (idx_all != padding_idx)
    model = torch.arange(batch * per, device=input.device) // max(per, 1)
    bag_all = bag.repeat(batch) if shared else bag
    nbags = batch * bags_per_model
    target = torch.where(keep, model * bags_per_model + bag_all, nbags)  # nbags: a dump row
    out_rows = nbags + 1
    if mode == "max":
        out = torch.zeros(out_rows, dim, dtype=rows.dtype, device=rows.device)
        out = out.scatter_reduce(0, target.unsqueeze(1).expand(-1, dim), rows, "amax", include_self=False)
    else:
        w = keep.to(rows.dtype)
        if per_sample_weights is not None:
            psw = per_sample_weights.reshape(-1)
            w = w * (psw.repeat(batch) if shared else psw).to(rows.dtype)
        src = rows * w.unsqueeze(1)
        out = torch.zeros(out_rows, dim, dtype=rows.dtype, device=rows.device)
        if rows.is_cuda and torch.are_deterministic_algorithms_enabled():
            out = out.index_put((target,), src, accumulate=True)
        else:
            out = out.index_add(0, target, src)
        if mode == "mean":
            count = torch.zeros(out_rows, dtype=rows.dtype, device=rows.device).index_add(
                0, target, keep.to(rows.dtype)
            )
            out = out / count.clamp(min=1).unsqueeze(1)
    return out[:nbags]
