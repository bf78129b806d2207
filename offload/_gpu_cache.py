"""The GPU cache of an :class:`~offload.OffloadedEmbedding`: hot rows (weight and per-row optimizer state)
kept in slots on the GPU, found by a device-side row -> slot map, evicted least recently used first and
written back to the host tables (on a side stream with the UVA engine). :class:`GpuCache` owns the slots
(:class:`CacheSlots`) and the write-backs; the embedding's other parts use it through its methods."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _cache_cuda, _host_write
from ._choice import get_engine
from ._row_tables import RowTables

_SORTED_WRITE_BACK_ROWS = 1 << 15  # evictions at least this large are written back in ascending row order
_FLUSH_ROWS = 1 << 16


class CacheSlots:
    """GPU-resident copies of hot rows (weight and per-row optimizer state), written back on eviction.

    Everything a lookup needs is a device tensor (``slot_of``: row id -> slot), so a hit costs no host work.
    Every array has one row more than there are slots: row ``capacity`` is a scratch row that absorbs the
    reads and writes of rows that are not cached, so no step needs the number of cached rows on the host.
    ``slot_of`` maps a row that is not cached to that scratch row, so slots index every array as they are.

    A slot's weight and per-row state lie side by side (``rows``: ``(capacity + 1, 1 + states, dim)``;
    ``weight`` and ``states[key]`` are views of it), so one index operation or one UVA launch moves all of a
    row: admissions gather weight and state from the host tables straight into their slots, evictions copy
    a victim's whole record out for its write-back.
    """

    def __init__(self, capacity: int, num_rows: int, dim: int, dtype: torch.dtype, device: torch.device,
                 keys: tuple[str, ...] = ()):
        self.capacity = capacity
        self.rows = torch.empty(capacity + 1, 1 + len(keys), dim, dtype=dtype, device=device)
        self.weight = self.rows[:, 0]
        self.states: dict[str, Tensor] = {k: self.rows[:, 1 + j] for j, k in enumerate(keys)}
        self.parts = [self.weight, *self.states.values()]  # in the order of the module's tables
        # int64, as every index op takes it (an int32 map would cost a conversion per lookup)
        self.slot_of = torch.full((num_rows,), capacity, dtype=torch.int64, device=device)
        self.ids = torch.full((capacity + 1,), -1, dtype=torch.int64, device=device)
        # the step that last used a slot: int32, so that the least recently used are found by a top-k over
        # half the key bits (a radix select does a pass per 8 bits)
        self.last_use = torch.full((capacity + 1,), -1, dtype=torch.int32, device=device)
        self.dirty = torch.zeros(capacity + 1, dtype=torch.bool, device=device)
        self.fresh = torch.full((capacity + 1,), -1, dtype=torch.int64, device=device)  # prefetch that admitted it
        self.gen = 0  # prefetch admissions so far (the value ``fresh`` records)
        self.first_gen: int | None = None  # the first prefetch admission since the last switch-in
        self.prefetches = 0  # prefetch calls since the last switch-in
        self.clock = 0
        self.filled = 0  # slots holding a row: they fill in order (empty slots are evicted first), never empty
        self.protected = 0  # upper bound on the slots the current step uses (they are not evicted)
        self.reserved = 0  # slots admitted by prefetch for the next step
        self.hits = 0
        self.misses = 0
        self.prefetch_hits = 0  # hits on rows admitted by prefetch (they were counted as misses then)
        self.prefetch_hits_dev: Tensor | None = None  # the same, counted on the device where the host cannot
        self.stream: torch.cuda.Stream | None = None  # side stream of admissions (prefetch's, and state rows)
        self.ready = None  # event: the last prefetch admission is complete
        self.states_ready = None  # event: the state rows of the last lookup's admissions are in their slots
        self.uva: tuple | None = None  # (engine switch, table engine, whether the UVA kernel moves the rows)


class GpuCache:
    """The GPU cache of an embedding's rows (over the host tables ``tables``): up to ``rows`` rows, or as many
    as ``nbytes`` hold (weight plus per-row state). ``slots`` is ``None`` until a step needs them (and
    after :meth:`drop`); writes of evicted rows back to the host run on a side stream with the UVA engine."""

    def __init__(self, tables: RowTables, rows: int, nbytes: int | None):
        self.tables = tables
        self.rows = rows
        self.nbytes = nbytes
        self.slots: CacheSlots | None = None
        self._wb_stream: torch.cuda.Stream | None = None  # write-backs of evicted rows (UVA engine)
        self.wb_event = None  # the last write-back launched on that stream
        # evicted rows still to be written back, (ids, their cache records): see launch_evicted
        self._evicted: list[tuple[Tensor, Tensor]] = []

    def capacity(self) -> int:
        t = self.tables
        if self.nbytes is not None:
            return min(t.num_rows, self.nbytes // t.row_bytes())
        return min(t.num_rows, self.rows)

    def get(self) -> CacheSlots | None:
        """The slots, made at the first use (``None`` without a cache)."""
        cap = self.capacity()
        if cap <= 0:
            return None
        if self.slots is None:
            t = self.tables
            self.slots = CacheSlots(cap, t.num_rows, t.dim, t.dtype, t.device, t.keys)
        return self.slots

    def drop(self) -> None:
        """Forget the cached rows (after :meth:`flush` when they matter): side-stream work is joined first."""
        self.join()
        self.slots = None

    def uses_uva(self) -> bool:
        """Whether the cache's rows move by the UVA kernel (see :func:`_host_write.cache_engine`), worked
        out once per engine setting."""
        cache = self.slots
        key = (get_engine(), self.tables.weight.engine)
        got = cache.uva
        if got is None or got[:2] != key:
            ok = self.tables.device.type == "cuda" and all(
                _host_write.cache_engine(t, op) == "uva" for t in self.tables.all() for op in ("gather", "scatter"))
            got = cache.uva = (*key, ok)
        return got[2]

    def stats(self) -> dict[str, int]:
        """``{"capacity", "hits", "misses"}`` counted over distinct rows: a miss is a row that had to come from
        the host (at switch-in, or earlier by a prefetch), a hit one that was in the cache already."""
        c = self.slots
        if c is None:
            return {"capacity": self.capacity(), "hits": 0, "misses": 0}
        hits = c.hits - c.prefetch_hits - (0 if c.prefetch_hits_dev is None else int(c.prefetch_hits_dev))
        return {"capacity": self.capacity(), "hits": hits, "misses": c.misses}

    def join(self, host: bool = True) -> None:
        """Make the current stream wait for this cache's side-stream work: prefetch admissions and, with
        ``host``, the write-backs of evicted rows (before host rows are read)."""
        self.launch_evicted()
        if host:
            c = self.slots
            device = self.tables.device
            if c is not None and c.states_ready is not None:  # (state rows still landing in their slots)
                torch.cuda.current_stream(device).wait_event(c.states_ready)
                c.states_ready = None
            if self.wb_event is not None:
                torch.cuda.current_stream(device).wait_event(self.wb_event)

    def launch_evicted(self, wait: bool = True) -> None:
        """Start writing back the rows that prefetch admissions evicted (deferred until the step's own state
        gathers are consumed, so that they need not wait for the write-back). With ``wait`` the current
        stream waits for the prefetch admission; without, only the write-back does (after a step, so that
        the admission of the next step's rows goes on overlapping the work that follows)."""
        c = self.slots
        ready = None
        if c is not None and c.ready is not None:
            ready = c.ready
            if wait:
                torch.cuda.current_stream(self.tables.device).wait_event(ready)
                c.ready = None
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            for ids, records in evicted:
                self.write_back(ids, records, after=ready)

    def write_back(self, ids: Tensor, records: Tensor, after=None) -> None:
        """Commit evicted rows (``records``: their cache records, weight and state side by side) to the host
        tables; with the UVA engine in one launch on a side stream, so the write-back of one step's evictions
        overlaps its compute (the next host read waits for it, see :meth:`join`). ``after``: the event of
        the prefetch admission that produced ``ids`` and ``records`` on its side stream (the write-back then
        waits for that alone), else they are the current stream's."""
        if ids.numel() == 0:
            return
        tables = self.tables.all()
        parts = list(records.unbind(1))
        cuda = ids.device.type == "cuda"
        current = torch.cuda.current_stream(ids.device) if cuda else None
        if not (cuda and self.slots is not None and self.uses_uva()):
            if after is not None:
                current.wait_event(after)
            _host_write.commit(ids, list(zip(tables, parts, strict=True)),
                               [_host_write.cache_engine(t, "scatter") for t in tables] if cuda else None)
            return
        if self._wb_stream is None:
            self._wb_stream = torch.cuda.Stream(ids.device)
        wb = self._wb_stream
        if after is not None:
            # (the evicted rows were cached until the admission: no earlier host access of them is pending)
            wb.wait_event(after)
        else:
            wb.wait_stream(current)
        with torch.cuda.stream(wb):
            _host_write.move("scatter", tables, ids, parts, None, True)
            ev = torch.cuda.Event()
            ev.record(wb)
        ids.record_stream(wb)
        records.record_stream(wb)
        self.wb_event = ev

    def evict(self, k: int, protect_from: int, defer: bool = False) -> tuple[Tensor, Tensor | None, int]:
        """``k`` slots for new rows: empty ones first, then the least recently used among the slots not used
        since ``protect_from``; the rows they held (and their optimizer state) are written back to the host
        (with ``defer``, by the next :meth:`launch_evicted`). Returns ``(slots, evicted row ids, number of
        empty slots among them)``: :func:`install` clears the evicted rows' slot-map entries."""
        # Slots fill in order: the empty ones are [filled, capacity). Only when they run out are rows evicted,
        # the least recently used of the filled slots (in no particular order: no sort needed). The slots of
        # this step and the next are stamped >= protect_from, all others below it, and the callers ask for
        # at most ``capacity - protected - reserved`` slots (an upper bound on those stamped): the k smallest
        # stamps are slots that neither step uses, with no masking of the others.
        cache = self.slots
        filled = cache.filled
        n_empty = min(k, cache.capacity - filled)
        cache.filled += n_empty
        empty = torch.arange(filled, filled + n_empty, device=cache.last_use.device) if n_empty else None
        if k == n_empty:
            return empty, None, n_empty
        if _cache_cuda.usable(cache.last_use.device):  # (4 launches where topk takes some 15)
            old = _cache_cuda.lru_victims(cache.last_use[:filled], k - n_empty, protect_from)
        else:
            old = torch.topk(cache.last_use[:filled], k - n_empty, largest=False, sorted=False).indices
        victims = old if empty is None else torch.cat([empty, old])
        old_ids = cache.ids.index_select(0, old)
        if old.numel() >= _SORTED_WRITE_BACK_ROWS:
            # host rows written in address order translate far faster (see HostTable); below this size the
            # sort's launches cost more host time than the side stream's write-back gains
            old_ids, order = torch.sort(old_ids)
            old = old.index_select(0, order)
        records = cache.rows.index_select(0, old)  # weight and state of each victim, one copy
        if defer:
            self._evicted.append((old_ids, records))
        else:
            self.write_back(old_ids, records)
        return victims, old_ids, n_empty

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host tables."""
        self.join()
        c = self.slots
        if c is None:
            return
        dirty = torch.nonzero(c.dirty & (c.ids >= 0)).squeeze(1)
        for start in range(0, dirty.numel(), _FLUSH_ROWS):  # (a few rows at a time: little GPU memory)
            slots = dirty[start:start + _FLUSH_ROWS]
            writes = [(t, part[slots]) for t, part in zip(self.tables.all(), c.parts, strict=True)]
            _host_write.commit(c.ids[slots], writes)
            c.dirty.index_fill_(0, slots, False)

    def write_rows(self, ids: Tensor, rows: Tensor) -> None:
        """Weight rows only (renormalisation outside a step): into the cache where cached, else the host."""
        self.join()
        cache = self.slots
        if cache is not None:
            slots = cache.slot_of.index_select(0, ids)
            hit = slots != cache.capacity
            cache.weight[slots[hit]] = rows[hit]
            cache.dirty[slots[hit]] = True
            ids, rows = ids[~hit], rows[~hit]
        _host_write.commit(ids, [(self.tables.weight, rows)])


def install(cache: CacheSlots, slots: Tensor, ids: Tensor, use: int, old_ids: Tensor | None, n_empty: int,
            gen: int | None = None, chunk_slots: Tensor | None = None, miss_pos: Tensor | None = None) -> None:
    """Map rows ``ids`` (whose records were gathered into ``slots``, from :meth:`GpuCache.evict` with
    ``old_ids`` and ``n_empty``) to their slots, stamped ``use`` (and with ``gen``, as that prefetch's
    admissions); ``chunk_slots[miss_pos[i]] = slots[i]``."""
    # (``dirty`` keeps the slot's old flag: a row is admitted for a step that will store it, and a clean
    # row marked dirty only costs :meth:`flush` a write of unchanged values)
    if _cache_cuda.usable(slots.device):
        _cache_cuda.install(slots, ids, old_ids, n_empty, cache.ids, cache.slot_of, cache.last_use, use,
                            cache.fresh if gen is not None else None, gen or 0, chunk_slots, miss_pos)
        return
    if old_ids is not None:
        cache.slot_of.index_fill_(0, old_ids, cache.capacity)
    cache.ids.index_copy_(0, slots, ids)
    cache.slot_of.index_copy_(0, ids, slots)
    cache.last_use.index_fill_(0, slots, use)
    if gen is not None:
        cache.fresh.index_fill_(0, slots, gen)
    if chunk_slots is not None:
        chunk_slots.index_copy_(0, miss_pos[: slots.numel()], slots)
