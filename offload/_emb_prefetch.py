"""Prefetch for an :class:`~offload.OffloadedEmbedding`: the next step's rows (and their optimizer state)
moved to the GPU on a side stream while the current step computes, admitted to the GPU cache where there
is one, and what the next switch-in may reuse of the work (:class:`_Next`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import _gpu_cache, _host_write, _lookup
from ._index import _as_index
from ._lookup import _compact_values, _stream_ctx

if TYPE_CHECKING:
    from ._embedding import OffloadedEmbedding


@dataclass
class _Next:
    """What :meth:`OffloadedEmbedding.prefetch` learnt about the next step's indices, reused by its switch-in
    when it looks up the very same index tensor (same memory, size and version: unchanged since)."""
    flat: Tensor
    ptr: int
    version: int
    ids: Tensor
    inverse: Tensor
    all_cached: bool  # every row is in the cache at the next switch-in (so no read-back is needed there)
    n_admit: int = 0  # rows that the prefetch admitted to the cache
    runs: tuple[Tensor, Tensor, Tensor] | None = None  # (see _Rows)

    def matches(self, flat: Tensor) -> bool:
        return (flat.data_ptr() == self.ptr and flat.numel() == self.flat.numel() and flat.dtype == self.flat.dtype
                and flat.device == self.flat.device and flat._version == self.version)


def prefetch(emb: OffloadedEmbedding, indices: Tensor) -> None:
    """:meth:`OffloadedEmbedding.prefetch <offload.OffloadedEmbedding.prefetch>` (see there)."""
    emb._sync_device()
    flat = _as_index(indices, emb.table.device)
    cache = _gpu_cache.get(emb)
    if cache is None:
        got = _lookup.distinct(emb, flat)
        ids, inverse = got.ids, got.inverse
        release_pending(emb)
        handles = {"weight": emb.table.prefetch(ids, _checked=True)}
        for k in emb._spec:
            handles[k] = emb._state_tables[k].prefetch(ids, _checked=True)
        emb._pending = (ids, handles)
        emb._next = _Next(flat, flat.data_ptr(), flat._version, ids, inverse, False, runs=got.runs)
        return
    release_pending(emb)
    _gpu_cache.join(emb, host=False)  # (the side stream waits for earlier write-backs itself)
    work = emb._work
    # Rows of the step in progress are cached already or will be written to the host after it: skip them.
    # Only those that bypass the cache can look like misses (the others are cached), so only then.
    bypass = sum(c.n_bypass for c in work.chunks) if work is not None else 0
    exclude = work.sorted_ids if bypass else None
    got = _lookup.distinct(emb, flat, cache, exclude, stamp=cache.clock + 1)
    ids, inverse, n_miss = got.ids, got.inverse, got.n_miss
    # the next step's cached rows are kept for it (not evicted for its misses; a miss marks the scratch row)
    if not got.stamped:
        cache.last_use.index_fill_(0, got.slots, cache.clock + 1)
    cache.reserved += ids.numel() - n_miss
    n_admit = max(0, min(n_miss, cache.capacity - cache.protected - cache.reserved))
    cache.prefetches += 1
    emb._next = _Next(flat, flat.data_ptr(), flat._version, ids, inverse, n_admit == n_miss and bypass == 0,
                      n_admit, got.runs)
    if n_admit == 0:
        return
    device = emb.table.device
    side = None
    if device.type == "cuda":
        if cache.stream is None:
            cache.stream = torch.cuda.Stream(device)
        side = cache.stream
        side.wait_stream(torch.cuda.current_stream(device))
        if emb._wb_event is not None:
            side.wait_event(emb._wb_event)  # host rows evicted earlier have landed
        for t in (ids, got.miss if got.miss is not None else got.miss_ids):
            t.record_stream(side)
    with _stream_ctx(side):
        if got.miss_ids is not None:
            miss_ids = got.miss_ids[:n_admit]
        else:
            miss_ids = _compact_values(got.miss, n_miss, ids)[:n_admit]
        victims, old_ids, n_empty = _gpu_cache.evict(emb, cache, n_admit, protect_from=cache.clock, defer=True)
        # weight and state of every row straight into its slot (one launch with the UVA kernel)
        _host_write.move("gather", _gpu_cache.host_tables(emb), miss_ids, cache.parts, victims,
                         _gpu_cache.uses_uva(emb, cache))
        cache.gen += 1
        if cache.first_gen is None:
            cache.first_gen = cache.gen
        _gpu_cache.install(cache, victims, miss_ids, cache.clock + 1, old_ids, n_empty, gen=cache.gen)
        if side is not None:
            cache.ready = torch.cuda.Event()
            cache.ready.record(side)
    cache.misses += n_admit
    cache.reserved += n_admit


def release_pending(emb: OffloadedEmbedding) -> None:
    if emb._pending is not None:
        for p in emb._pending[1].values():
            p.release()
        emb._pending = None
