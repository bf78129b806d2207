"""A step's working set of an :class:`~offload.OffloadedEmbedding`: the distinct rows its lookups use,
switched in from the GPU cache, a pending prefetch or the host tables (:meth:`WorkingSet.begin` at the first
lookup, :meth:`WorkingSet.locate` for later ones, each new batch of rows a :class:`_Chunk`), with their
per-row optimizer state gathered on a side stream for the optimizer step (:meth:`WorkingSet.resolve_states`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import _gpu_cache, _host_write, _lookup
from ._emb_prefetch import Prefetcher
from ._gpu_cache import CacheSlots, GpuCache
from ._lookup import _compact, _Rows, _stream_ctx
from ._prefetch import Prefetch
from ._row_tables import RowTables
from ._table import HostTable


@dataclass
class _Chunk:
    ids: Tensor  # distinct row ids (device), sorted
    slots: Tensor | None  # cache slot per row (int64), the scratch row = not cached (bypass); None without one
    states: dict[str, Prefetch] = field(default_factory=dict)  # without a cache: the state rows being gathered
    miss_pos: Tensor | None = None  # positions (into ids) of the rows that came from the host
    n_admit: int = 0  # the first n_admit of them were admitted to the cache
    leaf: Tensor | None = None  # the rows as the autograd leaf of the lookups (chunks > 0 are folded in before step)
    bypass_states: Tensor | None = None  # with a cache: the state rows of the misses not admitted (rows, key, dim)

    @property
    def n_bypass(self) -> int:
        return 0 if self.miss_pos is None else self.miss_pos.numel() - self.n_admit


@dataclass
class _Work:
    chunks: list[_Chunk]
    sorted_ids: Tensor
    perm: Tensor | None  # sorted_ids[i] is row perm[i] of the working set (None: the identity)
    version: int = 0
    renormed: bool = False
    folded: bool = False
    state_rows: dict[str, Tensor] = field(default_factory=dict)
    pad: tuple | None = None
    runs: tuple[Tensor, Tensor, Tensor] | None = None  # of the first lookup's indices (see Lookup)

    def all_ids(self) -> Tensor:
        """The rows' ids in the working parameter's row order (chunk after chunk)."""
        return torch.cat([c.ids for c in self.chunks]) if len(self.chunks) > 1 else self.chunks[0].ids

    def weight_rows(self, weight: Tensor) -> Tensor:
        """All working rows: the working parameter ``weight`` holds the first chunk's until the step folds
        the others in."""
        if len(self.chunks) == 1 or self.folded:
            return weight
        return torch.cat([weight.data] + [c.leaf.data for c in self.chunks[1:]])

    def index_sorted(self) -> None:
        self.sorted_ids, self.perm = torch.sort(self.all_ids())


class WorkingSet:
    """A step's rows of ``tables``: ``current`` is the step's :class:`_Work` (``None`` between steps), its
    rows come from ``cache``, ``prefetcher``'s pending rows or the host tables."""

    def __init__(self, tables: RowTables, cache: GpuCache, prefetcher: Prefetcher):
        self.tables = tables
        self.cache = cache
        self.prefetcher = prefetcher
        self.current: _Work | None = None

    def begin(self, flat: Tensor, weight: nn.Parameter, max_norm: float | None, norm_type: float) -> Tensor:
        """Start a step's working set with the rows of ``flat`` in ``weight`` (the working parameter: its
        ``data`` becomes the rows, renormalised with ``max_norm``); returns each index's working row."""
        cache = self.cache.get()
        prefetched = None
        if cache is not None:
            self.cache.join(host=False)
            cache.clock += 1
            cache.protected, cache.reserved = cache.reserved, 0
        nxt = self.prefetcher.take_next()
        same = nxt is not None and nxt.matches(flat)
        matched = cache is not None and same
        if same:
            # the indices :meth:`prefetch` saw: deduplicated and bounds-checked there, no read-back here
            got = _Rows(nxt.ids, nxt.inverse, runs=nxt.runs)
            if cache is not None:
                got.slots = cache.slot_of.index_select(0, got.ids)
                if not nxt.all_cached:
                    got.miss = got.slots == cache.capacity
                    got.n_miss = int(got.miss.sum())
                elif cache.prefetches == 1:
                    prefetched = nxt.n_admit
        else:
            if cache is not None:
                self.cache.join(host=False)
            got = _lookup.distinct(self.tables.weight, flat, cache, stamp=-1 if cache is None else cache.clock)
        chunk, rows = self.fetch(got, prefetched=prefetched, reserved=matched)
        if cache is not None:
            cache.prefetches, cache.first_gen = 0, None
        if max_norm is not None:
            _lookup.renorm(rows, max_norm, norm_type)
        weight.data = rows
        weight.grad = None
        # Autograd runs on a fresh leaf that shares the rows' memory, not on ``weight`` itself: a graph of an
        # earlier step that is still referenced would otherwise pin ``weight``'s old shape. Its gradient is
        # handed to ``weight`` as soon as it is accumulated, so clipping between backward and step sees it.
        chunk.leaf = rows.detach().requires_grad_(True)
        chunk.leaf.register_post_accumulate_grad_hook(lambda leaf: setattr(weight, "grad", leaf.grad))
        self.current = _Work(chunks=[chunk], sorted_ids=got.ids, perm=None,
                             renormed=max_norm is not None, runs=got.runs)
        self.current.version = weight._version
        return got.inverse


    def locate(self, flat: Tensor, max_norm: float | None, norm_type: float) -> Tensor:
        """Each index's working row, switching in the rows of ``flat`` that the step has not seen yet."""
        work = self.current
        n = work.sorted_ids.numel()
        if flat.numel() == 0:
            return flat
        if n:
            pos = torch.searchsorted(work.sorted_ids, flat).clamp_(max=n - 1)
            found = work.sorted_ids[pos] == flat
            all_found = bool(found.all())
        else:
            all_found = False
        if not all_found:
            new = flat if not n else flat[~found]
            if work.folded:
                # (checked first: an index out of range is still reported as such)
                _lookup.distinct(self.tables.weight, new)
                raise RuntimeError("OffloadedEmbedding: new rows looked up after the optimizer's step began")
            cache = self.cache.slots
            if cache is not None:
                self.cache.join(host=False)
            got = _lookup.distinct(self.tables.weight, new, cache, stamp=-1 if cache is None else cache.clock)
            chunk, rows = self.fetch(got, first=False)
            if max_norm is not None:
                _lookup.renorm(rows, max_norm, norm_type)
            chunk.leaf = rows.requires_grad_(True)
            work.chunks.append(chunk)
            work.index_sorted()
            n = work.sorted_ids.numel()
            pos = torch.searchsorted(work.sorted_ids, flat).clamp_(max=n - 1)
        return pos if work.perm is None else work.perm[pos]


    def fetch(self, got: _Rows, first: bool = True, prefetched: int | None = None,
              reserved: bool = False) -> tuple[_Chunk, Tensor]:
        """Rows ``got.ids`` (distinct, checked; with a cache, their slots and misses, see :class:`_Rows`) for a
        new chunk of the working set: from the cache, a pending :meth:`prefetch`, or the host tables; per-row
        state starts gathering on a side stream. Rows from the host are admitted to the cache (evicting the
        least recently used rows) as far as it has room.

        ``first``: the chunk starts the step. ``prefetched``: the number of rows that the one :meth:`prefetch`
        since the last step admitted for exactly these rows, all of which it found cached or admitted (its
        admissions are this chunk's prefetch hits).
        ``reserved``: a prefetch of exactly these indices counted their cached rows in ``cache.reserved`` (which
        became ``cache.protected`` at this step), so they are not counted again."""
        cache = self.cache.slots
        ids, slots, n_miss = got.ids, got.slots, got.n_miss
        self.cache.join(host=cache is None or n_miss > 0)
        if cache is None:
            return self.fetch_uncached(ids)
        self.prefetcher.release_pending()
        n = ids.numel()
        chunk = _Chunk(ids=ids, slots=slots)
        # This step's cached rows are not evicted for its misses (a miss marks the scratch row). (Always: the
        # prefetch marked them for this step, but a later lookup of the step before may have marked some since.)
        if not got.stamped:
            cache.last_use.index_fill_(0, slots, cache.clock)
        if prefetched is not None:
            cache.prefetch_hits += prefetched
        elif first and cache.first_gen is not None:  # hits on rows that prefetches admitted since the last step
            hits = (cache.fresh.index_select(0, slots) >= cache.first_gen).sum()
            cache.prefetch_hits_dev = hits if cache.prefetch_hits_dev is None else cache.prefetch_hits_dev + hits
        cache.hits += n - n_miss
        cache.misses += n_miss
        if not reserved:
            cache.protected += n - n_miss
        if n_miss == 0:
            chunk.miss_pos = ids.new_empty(0)
            return chunk, cache.weight.index_select(0, slots)
        miss_pos, miss_ids = got.miss_pos, got.miss_ids
        if miss_pos is None:
            miss_pos = _compact(got.miss, n_miss)
            miss_ids = ids.index_select(0, miss_pos)
        chunk.miss_pos = miss_pos
        uva = self.cache.uses_uva()
        tables = self.tables.all()
        # (slots reserved by a prefetch for the next step are not victims either)
        n_admit = max(0, min(n_miss, cache.capacity - cache.protected - cache.reserved))
        victims = None
        if n_admit:
            victims, old_ids, n_empty = self.cache.evict(n_admit, protect_from=cache.clock)
            admit_ids = miss_ids[:n_admit]
            # the weight straight into the slots (the lookup reads it now); the state on a side stream below
            _host_write.move("gather", tables[:1], admit_ids, cache.parts[:1], victims, uva)
            _gpu_cache.install(cache, victims, admit_ids, cache.clock, old_ids, n_empty, chunk_slots=slots,
                               miss_pos=miss_pos)
            chunk.n_admit = n_admit
            cache.protected += n_admit
        rows = cache.weight.index_select(0, slots)  # (rows not admitted read the scratch row, replaced below)
        if n_admit < n_miss:
            _host_write.move("gather", tables[:1], miss_ids[n_admit:], [rows], miss_pos[n_admit:], uva)
        if len(tables) > 1:
            self.gather_states(cache, chunk, tables[1:], miss_ids, victims, uva)
        return chunk, rows


    def gather_states(self, cache: CacheSlots, chunk: _Chunk, tables: list[HostTable], miss_ids: Tensor,
                      victims: Tensor | None, uva: bool) -> None:
        """Start moving the per-row state of a lookup's misses from the host: that of the admitted ones
        (``victims``, the first of ``miss_ids``) into their slots, the others' into ``chunk.bypass_states``;
        on the cache's side stream (the optimizer step reads them, see :meth:`resolve_states`), one launch
        each with the UVA kernel."""
        n_admit = chunk.n_admit
        n_bypass = miss_ids.numel() - n_admit
        buf = None
        if n_bypass:
            buf = torch.empty(n_bypass, len(tables), self.tables.dim, dtype=self.tables.dtype,
                              device=miss_ids.device)
            chunk.bypass_states = buf
        side = None
        if miss_ids.device.type == "cuda":
            if cache.stream is None:
                cache.stream = torch.cuda.Stream(miss_ids.device)
            side = cache.stream
            side.wait_stream(torch.cuda.current_stream(miss_ids.device))  # (the victims' old records copied out)
        with _stream_ctx(side):
            if n_admit:
                _host_write.move("gather", tables, miss_ids[:n_admit], cache.parts[1:], victims, uva)
            if n_bypass:
                _host_write.move("gather", tables, miss_ids[n_admit:], list(buf.unbind(1)), None, uva)
            if side is not None:
                cache.states_ready = torch.cuda.Event()
                cache.states_ready.record(side)
        if side is not None:
            for t in (miss_ids, victims, buf):
                if t is not None:
                    t.record_stream(side)


    def fetch_uncached(self, ids: Tensor) -> tuple[_Chunk, Tensor]:
        chunk = _Chunk(ids=ids, slots=None)
        pending = self.prefetcher.take_pending()
        keys = self.tables.keys
        # from the prefetch when it holds exactly these rows, else from the host
        use_pending = pending is not None and (pending[0] is ids or (
            pending[0].numel() == ids.numel() and bool(torch.equal(pending[0], ids))))
        if use_pending:
            rows = pending[1]["weight"].rows()
            states = {k: pending[1][k] for k in keys if k in pending[1]}
            pending[1]["weight"].release()
        else:
            if pending is not None:
                for p in pending[1].values():
                    p.release()
            table = self.tables.weight
            rows = torch.empty(ids.numel(), table.dim, dtype=table.dtype, device=table.device)
            table.gather_distinct(ids, rows)
            states = {}
        for k in keys:
            if k not in states:
                states[k] = self.tables.states[k].prefetch(ids, _checked=True)
        chunk.states = states
        return chunk, rows


    def resolve_states(self, chunk: _Chunk, rows: bool = True) -> dict[str, Tensor]:
        """Per-row state of a chunk's rows (waits for its side-stream gathers); without ``rows`` only the
        wait (admitted rows' state lands in the cache either way)."""
        out = {}
        if chunk.slots is None:  # (no cache: from the tables' prefetches)
            for k in self.tables.keys:
                p = chunk.states.get(k)
                out[k] = None if p is None else p.rows()
                if p is not None:
                    p.release()
            chunk.states = {}
            return out
        cache = self.cache.slots
        if cache.states_ready is not None:
            torch.cuda.current_stream(self.tables.device).wait_event(cache.states_ready)
            cache.states_ready = None
        if rows:
            for j, k in enumerate(self.tables.keys):
                got = cache.states[k].index_select(0, chunk.slots)
                if chunk.n_bypass:
                    got.index_copy_(0, chunk.miss_pos[chunk.n_admit:], chunk.bypass_states[:, j])
                out[k] = got
        chunk.bypass_states = None
        return out


    def working_ids(self) -> Tensor | None:
        """Row ids of the step's working rows, in the working parameter's row order (``None`` between steps)."""
        work = self.current
        if work is None:
            return None
        return work.all_ids()

    def bypassed(self) -> Tensor | None:
        """The step's rows, sorted, when some of them bypass the cache (they go to the host after the step),
        else ``None``."""
        work = self.current
        if work is None or not any(c.n_bypass for c in work.chunks):
            return None
        return work.sorted_ids

    def overlay(self, ids: Tensor, rows: Tensor, weight: Tensor) -> bool:
        """Replace the ``rows`` of ``ids`` (distinct, sorted) that the step in progress holds by its rows
        (newer than the cache's and the host's); ``weight``: the working parameter. Returns whether a step
        with rows is in progress."""
        work = self.current
        if work is None or not work.sorted_ids.numel() or not ids.numel():
            return False
        n = work.sorted_ids.numel()
        pos = torch.searchsorted(work.sorted_ids, ids).clamp_(max=n - 1)
        found = torch.nonzero(work.sorted_ids[pos] == ids).squeeze(1)
        at = pos[found]
        rows[found] = work.weight_rows(weight).detach().index_select(0, at if work.perm is None else work.perm[at])
        return True


def lookup_no_grad(flat: Tensor, cache: GpuCache, work: WorkingSet, weight: Tensor, max_norm: float | None,
                   norm_type: float) -> Tensor:
    """A lookup that trains nothing (``flat``: indices on the compute device): rows from ``work``, the step in
    progress, else from ``cache`` or the host tables; ``max_norm`` renormalises them in place as
    ``nn.Embedding`` does, also without grad."""
    table = cache.tables.weight
    cache.join()
    with torch.no_grad():
        ids, inverse = table.prepare(flat)
        rows = _lookup.lookup_rows(table, cache.slots, ids)
        # rows of the step in progress are newer than the cache's and the host's
        if not work.overlay(ids, rows, weight) and max_norm is not None:
            before = rows.clone()
            _lookup.renorm(rows, max_norm, norm_type)
            changed = (rows != before).any(dim=1)
            if bool(changed.any()):
                ch = torch.nonzero(changed).squeeze(1)
                cache.write_rows(ids[ch], rows[ch])
        return rows.index_select(0, inverse)
