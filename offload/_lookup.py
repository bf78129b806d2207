"""The lookups of an :class:`~offload.OffloadedEmbedding`: deduplicating and bounds-checking a step's
indices with one host synchronisation (:func:`distinct`), the autograd function of a step's first lookup
(:class:`Lookup`), and lookups that train nothing (:func:`lookup_no_grad`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _cache_cuda
from ._gpu_cache import CacheSlots
from ._index import _check_bounds
from ._table import HostTable


@dataclass
class _Rows:
    """What :func:`distinct` found: the distinct ids (sorted) and ``ids[inverse] == flat``;
    with a cache each id's slot and the misses, as a mask over ``ids`` or compacted (their positions in ``ids``
    and their ids), their number, and whether the slots' LRU stamps are set already."""
    ids: Tensor
    inverse: Tensor
    slots: Tensor | None = None
    miss: Tensor | None = None
    n_miss: int = 0
    miss_pos: Tensor | None = None
    miss_ids: Tensor | None = None
    stamped: bool = False
    runs: tuple[Tensor, Tensor, Tensor] | None = None  # from the CuPy kernels: see _cache_cuda.segment_sum


class Lookup(torch.autograd.Function):
    """``table[local]`` for the indices of a step's first lookup, whose backward sums each row's gradient
    with :func:`_cache_cuda.segment_sum` over the runs of the deduplication that made ``local`` (two
    launches where ``F.embedding``'s dense backward sorts the indices again, some 20; deterministic too)."""

    @staticmethod
    def forward(ctx, table: Tensor, local: Tensor, runs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        ctx.runs = runs
        ctx.count = table.shape[0]
        return table.index_select(0, local.reshape(-1)).view(*local.shape, table.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.reshape(-1, grad.shape[-1]).contiguous()
        return _cache_cuda.segment_sum(grad, ctx.runs, ctx.count), None, None


def _compact(mask: Tensor, count: int) -> Tensor:
    """Positions of the ``count`` true entries of ``mask``, in order, without asking the device for the count
    (the caller knows it)."""
    pos = torch.cumsum(mask, 0)
    pos -= 1
    dest = pos.masked_fill_(~mask, count)
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, dest, torch.arange(mask.numel(), device=mask.device))
    return out[:count]


def _compact_values(mask: Tensor, count: int, values: Tensor) -> Tensor:
    """``values[mask]`` (the caller knows that ``count`` entries are true) without a host synchronisation: each
    true entry goes to its 1-based rank, every other one to the dropped entry 0."""
    dest = torch.cumsum(mask, 0)
    dest.mul_(mask)
    out = torch.empty(count + 1, dtype=values.dtype, device=values.device)
    out.scatter_(0, dest, values)
    return out[1:]


def _stream_ctx(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def renorm(rows: Tensor, max_norm: float, norm_type: float) -> None:
    """``nn.Embedding``'s ``max_norm``: every row of ``rows`` renormalised in place."""
    with torch.no_grad():
        idx = torch.arange(rows.shape[0], device=rows.device)
        torch.embedding_renorm_(rows, idx, max_norm, norm_type)


def distinct(table: HostTable, flat: Tensor, cache: CacheSlots | None = None, exclude: Tensor | None = None,
             stamp: int = -1) -> _Rows:
    """Deduplicate and bounds-check ``flat``, indices of ``table``'s rows, with one host synchronisation (see
    :class:`_Rows`). The caller has joined the cache's side-stream work (a prefetch admission may still be
    writing the slot map).

    With a cache, each distinct id's slot and the misses: ids to fetch from the host (not cached, and not
    in the sorted ``exclude``); with ``stamp >= 0`` their slots' LRU stamps are set to it (where the CuPy
    kernels run: ``stamped``). The one value read back also carries the smallest and largest index, so no
    index out of range reaches a kernel that touches host memory.
    """
    n_flat = flat.numel()
    if n_flat == 0:
        empty = flat.new_empty(0)
        none = None if cache is None else empty
        return _Rows(empty, empty, none, None if cache is None else empty.bool())
    num_rows = table.num_rows
    if _cache_cuda.usable(flat.device):
        ids, inverse, slots, miss_pos, miss_ids, stats, runs = _cache_cuda.dedup(
            flat.contiguous(), None if cache is None else cache.slot_of, 0 if cache is None else cache.capacity,
            num_rows, exclude if exclude is not None and exclude.numel() else None, stamp,
            None if cache is None else cache.last_use)
        n, lo, hi, n_miss = stats.tolist()  # the one host synchronisation
        _check_bounds(lo, hi, num_rows)
        if cache is None:
            return _Rows(ids[:n], inverse, runs=runs)
        return _Rows(ids[:n], inverse, slots[:n], None, n_miss, miss_pos[:n_miss], miss_ids[:n_miss], stamp >= 0,
                     runs)
    sorted_flat, order = torch.sort(flat)
    first = torch.ones(n_flat, dtype=torch.bool, device=flat.device)
    torch.ne(sorted_flat[1:], sorted_flat[:-1], out=first[1:])
    seg = torch.cumsum(first, 0)
    seg -= 1
    inverse = torch.empty_like(seg).scatter_(0, order, seg)
    stats = [seg[-1:] + 1, sorted_flat[:1], sorted_flat[-1:]]
    if cache is not None:
        slot_flat = cache.slot_of.index_select(0, sorted_flat.clamp(0, num_rows - 1))
        miss_flat = slot_flat == cache.capacity
        if exclude is not None and exclude.numel():
            at = torch.searchsorted(exclude, sorted_flat).clamp_(max=exclude.numel() - 1)
            miss_flat &= exclude[at] != sorted_flat
        stats.append((miss_flat & first).sum().view(1))
    vals = torch.cat(stats).tolist()  # the one host synchronisation
    _check_bounds(vals[1], vals[2], num_rows)
    n = vals[0]
    ids = torch.empty(n, dtype=torch.int64, device=flat.device).scatter_(0, seg, sorted_flat)
    if cache is None:
        return _Rows(ids, inverse)
    slots = torch.empty(n, dtype=torch.int64, device=flat.device).scatter_(0, seg, slot_flat)
    miss = torch.empty(n, dtype=torch.bool, device=flat.device).scatter_(0, seg, miss_flat)
    return _Rows(ids, inverse, slots, miss, vals[3])


def lookup_rows(table: HostTable, cache: CacheSlots | None, ids: Tensor) -> Tensor:
    """Rows ``ids`` (distinct, checked) for a lookup that trains nothing: from the cache where cached, else
    from the host."""
    rows = torch.empty(ids.numel(), table.dim, dtype=table.dtype, device=table.device)
    if cache is None:
        table.gather_distinct(ids, rows)
        return rows
    slots = cache.slot_of.index_select(0, ids)
    torch.index_select(cache.weight, 0, slots, out=rows)
    miss = torch.nonzero(slots == cache.capacity).squeeze(1)
    if miss.numel():
        host = torch.empty(miss.numel(), table.dim, dtype=table.dtype, device=table.device)
        table.gather_distinct(ids[miss], host)
        rows[miss] = host
    return rows

