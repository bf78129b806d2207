"""Prefetch for an :class:`~offload.OffloadedEmbedding`: the next step's rows (and their optimizer state)
moved to the GPU on a side stream while the current step computes, admitted to the GPU cache where there
is one (:class:`Prefetcher`), and what the next switch-in may reuse of the work (:class:`_Next`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import _gpu_cache, _host_write, _lookup
from ._gpu_cache import GpuCache
from ._lookup import _compact_values, _stream_ctx
from ._prefetch import Prefetch
from ._row_tables import RowTables


@dataclass
class _Next:
    """What :meth:`Prefetcher.prefetch` learnt about the next step's indices, reused by its switch-in when it
    looks up the very same index tensor (same memory, size and version: unchanged since)."""
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


class Prefetcher:
    """The next step's rows of ``tables``, fetched early: admitted to ``cache`` where there is one, else held
    as pending :class:`~offload.Prefetch` handles until the next switch-in takes them (:meth:`take_pending`)."""

    def __init__(self, tables: RowTables, cache: GpuCache):
        self.tables = tables
        self.cache = cache
        self._next: _Next | None = None
        self._pending: tuple[Tensor, dict[str, Prefetch]] | None = None

    def take_next(self) -> _Next | None:
        """What the last prefetch learnt about its indices, once (the next switch-in takes it)."""
        nxt, self._next = self._next, None
        return nxt

    def take_pending(self) -> tuple[Tensor, dict[str, Prefetch]] | None:
        """Without a cache: ``(ids, {"weight": handle, state name: handle, ...})`` of the last prefetch, once."""
        pending, self._pending = self._pending, None
        return pending

    def release_pending(self) -> None:
        if self._pending is not None:
            for p in self._pending[1].values():
                p.release()
            self._pending = None

    def clear(self) -> None:
        """Forget the last prefetch (the cache it filled was dropped, or the tables replaced)."""
        self._next = None
        self.release_pending()

    def prefetch(self, flat: Tensor, exclude: Tensor | None) -> None:
        """:meth:`OffloadedEmbedding.prefetch <offload.OffloadedEmbedding.prefetch>` of the checked index tensor
        ``flat`` (see there); ``exclude``: the sorted rows of the step in progress when some of them bypass
        the cache (they will be written to the host after it, not fetched now)."""
        tables = self.tables
        cache = self.cache.get()
        if cache is None:
            got = _lookup.distinct(tables.weight, flat)
            ids, inverse = got.ids, got.inverse
            self.release_pending()
            handles = {"weight": tables.weight.prefetch(ids, _checked=True)}
            for k in tables.keys:
                handles[k] = tables.states[k].prefetch(ids, _checked=True)
            self._pending = (ids, handles)
            self._next = _Next(flat, flat.data_ptr(), flat._version, ids, inverse, False, runs=got.runs)
            return
        self.release_pending()
        self.cache.join(host=False)  # (the side stream waits for earlier write-backs itself)
        got = _lookup.distinct(tables.weight, flat, cache, exclude, stamp=cache.clock + 1)
        ids, inverse, n_miss = got.ids, got.inverse, got.n_miss
        # the next step's cached rows are kept for it (not evicted for its misses; a miss marks the scratch row)
        if not got.stamped:
            cache.last_use.index_fill_(0, got.slots, cache.clock + 1)
        cache.reserved += ids.numel() - n_miss
        n_admit = max(0, min(n_miss, cache.capacity - cache.protected - cache.reserved))
        cache.prefetches += 1
        self._next = _Next(flat, flat.data_ptr(), flat._version, ids, inverse, n_admit == n_miss and exclude is None,
                           n_admit, got.runs)
        if n_admit == 0:
            return
        device = tables.device
        side = None
        if device.type == "cuda":
            if cache.stream is None:
                cache.stream = torch.cuda.Stream(device)
            side = cache.stream
            side.wait_stream(torch.cuda.current_stream(device))
            if self.cache.wb_event is not None:
                side.wait_event(self.cache.wb_event)  # host rows evicted earlier have landed
            for t in (ids, got.miss if got.miss is not None else got.miss_ids):
                t.record_stream(side)
        with _stream_ctx(side):
            if got.miss_ids is not None:
                miss_ids = got.miss_ids[:n_admit]
            else:
                miss_ids = _compact_values(got.miss, n_miss, ids)[:n_admit]
            victims, old_ids, n_empty = self.cache.evict(n_admit, protect_from=cache.clock, defer=True)
            # weight and state of every row straight into its slot (one launch with the UVA kernel)
            _host_write.move("gather", tables.all(), miss_ids, cache.parts, victims, self.cache.uses_uva())
            cache.gen += 1
            if cache.first_gen is None:
                cache.first_gen = cache.gen
            _gpu_cache.install(cache, victims, miss_ids, cache.clock + 1, old_ids, n_empty, gen=cache.gen)
            if side is not None:
                cache.ready = torch.cuda.Event()
                cache.ready.record(side)
        cache.misses += n_admit
        cache.reserved += n_admit
