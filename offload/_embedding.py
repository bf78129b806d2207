"""OffloadedEmbedding: an nn.Embedding whose table and optimizer state live in host memory.

Each training step the distinct rows that the step looks up are switched into a small GPU working
parameter (``emb.weight``); any elementwise torch optimizer updates it, and after ``optimizer.step()``
the updated rows *and their optimizer state* are written back. Rows a step does not touch are not
touched at all (lazy, SparseAdam-like semantics), which is what makes the table size free.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _cache_cuda, _uva
from ._optim import row_state_spec
from ._table import HostTable, Prefetch, _as_index, _check_bounds, get_engine

__all__ = ["OffloadedEmbedding", "attach", "detach"]

_SORTED_WRITE_BACK_ROWS = 1 << 15  # evictions at least this large are written back in ascending row order
_FLUSH_ROWS = 1 << 16
_ALL: weakref.WeakSet[OffloadedEmbedding] = weakref.WeakSet()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while host rows are being committed, so Ctrl-C cannot split a commit."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask"):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    else:
        yield


def _stage_rows(rows: Tensor) -> Tensor:
    """Phase 1 of a commit: a host copy of ``rows`` that no later GPU work can change."""
    if rows.device.type == "cpu":
        return rows.detach().clone()
    out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    out.copy_(rows.detach(), non_blocking=True)
    return out


def _cache_engine(table: HostTable, op: str) -> str:
    """The engine that moves a GPU cache's rows: with the default choice (``"auto"``) the UVA kernel where it
    can run, as its gathers and write-backs are stream-ordered (prefetch admissions and write-backs of evicted
    rows then run on side streams with no host synchronisation, which the CPU and hybrid engines need for
    their host indices); an explicit engine is honoured."""
    if ((table.engine or get_engine()) == "auto" and table.device.type == "cuda" and table.pinned
            and _uva.available(table.device)):
        return "uva"
    return table.resolved_engine(op)


def _check_writable(tables: list[HostTable]) -> None:
    for t in tables:
        t._check_writable()


def _land(tables: list[HostTable]) -> None:
    """Before a kernel of ours touches their rows: the tables' deferred host writes are written first (as
    their gathers and scatters do)."""
    for t in tables:
        t._land()


def _prepare_uva(op: str, tables: list[HostTable], ids: Tensor, devs: list[Tensor],
                 pos: Tensor | None = None) -> list[tuple]:
    """The UVA launches that move rows ``ids`` of ``tables`` to or from ``devs`` (see :func:`_uva.prepare`):
    one per four tables of one shape and dtype (a row's weight and its optimizer state move together)."""
    t0 = tables[0]._data
    if all(t._data.shape == t0.shape and t._data.dtype == t0.dtype for t in tables):
        return _uva.prepare(op, [t._data for t in tables], ids, devs, pos)
    return [x for t, d in zip(tables, devs, strict=True) for x in _uva.prepare(op, [t._data], ids, [d], pos)]


def _noted(tables: list[HostTable], kind: str, ids: Tensor, rows: list[Tensor], pos: Tensor | None = None) -> None:
    """Tell ``tables`` that a kernel on the current stream read (``kind="read"``) or wrote rows ``ids`` of
    them; written rows (``rows[j][pos]``, or ``rows[j]`` in the order of ``ids``) are patched into pending
    :meth:`HostTable.prefetch` copies."""
    for t, r in zip(tables, rows, strict=True):
        t._note_gpu_access(kind)
        if kind == "write" and t._prefetches:
            t._patch_prefetches(ids, r if pos is None else r.index_select(0, pos))


def _commit(ids: Tensor, writes: list[tuple[HostTable, Tensor]], engines: list[str] | None = None) -> None:
    """Write ``rows`` to rows ``ids`` of every table, all or nothing.

    Phase 1 copies every table's rows to host memory (where GPU faults, out-of-memory and the like can
    happen); only when all copies are complete does phase 2 write them into the tables, a plain memory copy
    per table with signals held back. An exception in phase 1 leaves every table as it was.
    """
    if ids.numel() == 0:
        return
    if ids.device.type != "cuda":
        engines = []
    elif engines is None:
        engines = [t.resolved_engine("scatter") for t, _ in writes]
    if engines and all(e == "uva" for e in engines):
        # One kernel writes the rows of every table (of one shape) by the same ids: validated and compiled
        # before anything is launched.
        ids = ids.contiguous()
        tables = [t for t, _ in writes]
        rows_list = [rows.detach().to(t.dtype).contiguous() for t, rows in writes]
        _check_writable(tables)
        launches = _prepare_uva("scatter", tables, ids, rows_list)
        _land(tables)
        with _signals_deferred() if len(launches) > 1 else contextlib.nullcontext():
            _uva.launch(launches)
        _noted(tables, "write", ids, rows_list)
        return
    if engines and all(e in ("uva", "hybrid") for e in engines):
        # Stream-ordered kernels writing host memory: validate and compile everything first, so that
        # nothing can fail between the first launch and the last.
        ids = ids.contiguous()
        rows_list = [rows.detach().to(t.dtype).contiguous() for t, rows in writes]
        for (t, _), rows in zip(writes, rows_list, strict=True):
            _uva.check_and_compile(t._data, ids, rows)
        with _signals_deferred():
            for (t, _), rows, engine in zip(writes, rows_list, engines, strict=True):
                t._scatter_unique(ids, None, rows, engine)
        return
    ids_cpu = ids.cpu()
    staged = [_stage_rows(rows) for _, rows in writes]
    if ids.device.type == "cuda":
        torch.cuda.current_stream(ids.device).synchronize()
    for table, _ in writes:
        table.synchronize()
    with _signals_deferred():
        for (table, rows), host_rows in zip(writes, staged, strict=True):
            table._data.index_copy_(0, ids_cpu, host_rows)
            table._patch_prefetches(ids, rows)


class _Cache:
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
    runs: tuple[Tensor, Tensor, Tensor] | None = None  # of the first lookup's indices (see _Lookup)


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


@dataclass
class _Rows:
    """What :meth:`OffloadedEmbedding._distinct` found: the distinct ids (sorted) and ``ids[inverse] == flat``;
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


class _Lookup(torch.autograd.Function):
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

class OffloadedEmbedding(nn.Module):
    r"""A drop-in for :class:`torch.nn.Embedding` whose table lives in page-locked host memory.

    The first arguments are those of ``nn.Embedding``. ``emb.weight`` is the *working parameter*: the
    distinct rows of the current step, switched in by ``forward``; the full table is ``emb.table`` (a
    :class:`~offload.HostTable`). Give ``model.parameters()`` to any supported torch optimizer as usual and
    call :func:`offload.attach` on it once: after each ``optimizer.step()`` the updated rows and their
    optimizer state are written back. A training loop changes by two lines::

        emb = offload.OffloadedEmbedding(10_000_000, 128)         # was nn.Embedding(10_000_000, 128)
        opt = offload.attach(torch.optim.Adam(model.parameters()))  # was torch.optim.Adam(...)

    Semantics (lazy): rows absent from a step are not updated at all: no weight decay, no momentum drift,
    no decay of moment estimates, exactly as ``torch.optim.SparseAdam`` treats them. Scalar optimizer state
    (Adam's ``step``, ASGD's ``eta`` and ``mu``) is shared by the whole table and advances every step. So
    ``Adam`` here behaves as ``nn.Embedding(sparse=True)`` with ``SparseAdam`` (which puts ``eps`` inside
    the bias correction; otherwise the same), and an optimizer whose update of a row with zero gradient is
    the identity (plain SGD, Adagrad) behaves exactly as on a dense ``nn.Embedding``. With SGD and
    ``dampening != 0`` a row's first momentum step is ``(1 - dampening) * grad`` (torch's per-tensor
    first-step rule has no per-row meaning).

    Supported optimizers: SGD (momentum, nesterov), Adam, AdamW, Adamax, Adadelta, Adagrad, RMSprop, ASGD,
    Rprop, NAdam, RAdam, and any declared with :func:`offload.register_optimizer`. LBFGS (not
    elementwise) and SparseAdam (use Adam) are refused.

    Args:
        num_embeddings: number of rows; this and ``embedding_dim``, ``padding_idx``, ``max_norm``,
            ``norm_type``, ``scale_grad_by_freq``, ``sparse``, ``_weight``, ``_freeze``, ``device`` and
            ``dtype`` are as for ``nn.Embedding``. ``device`` is the compute device (the working rows'
            device; ``.to()`` moves it). ``sparse`` is accepted and has no effect: gradients already cover
            only the step's rows.
        table: an existing :class:`~offload.HostTable` to use as the weight.
        cache_rows: keep up to this many hot rows (weight and optimizer state) on the GPU, written back to
            the host when evicted (least recently used first; on the GPU, rows unused for 4096 steps or more
            count as equally old). ``0`` disables the cache. Every row a step fetches from the host is admitted
            (as long as the cache has slots the step does not use itself); the row -> slot map is a device
            tensor, so a hit costs no host work, and evicted rows are written back on a side stream while
            the step computes (with the UVA engine). With a cache,
            :meth:`prefetch` admits the next step's rows early.
        cache_bytes: alternatively, the cache's size in bytes (weight plus per-row state).
        pin: passed to the :class:`~offload.HostTable` (and so is ``engine``).

    Each step, all lookups should use the rows known at the first ``forward``; later lookups of new rows
    work (they become separate leaves folded in before ``step``), but gradient clipping over
    ``model.parameters()`` between ``backward`` and ``step`` sees only the first lookup's rows. Call
    :meth:`prepare` with all of a step's indices first when that matters. Use ``torch.no_grad()`` for
    evaluation: grad-mode forwards between steps extend the working set.

    Shape:
        - Input: integer tensor of any shape ``(*)``.
        - Output: ``(*, embedding_dim)``.

    Examples:
        >>> emb = OffloadedEmbedding(1000, 16)
        >>> opt = attach(torch.optim.Adam(emb.parameters(), lr=0.1))
        >>> emb(torch.tensor([[1, 2], [2, 999]])).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Tensor | None = None, _freeze: bool = False, device=None,
                 dtype=None, *, table: HostTable | None = None, cache_rows: int = 0,
                 cache_bytes: int | None = None, pin: bool | None = None, engine=None):
        super().__init__()
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        if padding_idx is not None:
            if padding_idx > 0:
                if padding_idx >= self.num_embeddings:
                    raise ValueError("padding_idx must be within num_embeddings")
            elif padding_idx < 0:
                if padding_idx < -self.num_embeddings:
                    raise ValueError("padding_idx must be within num_embeddings")
                padding_idx = self.num_embeddings + padding_idx
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        if cache_rows < 0 or (cache_bytes is not None and cache_bytes < 0):
            raise ValueError(f"cache size must be >= 0, got cache_rows={cache_rows}, cache_bytes={cache_bytes}")
        self.cache_rows = int(cache_rows)
        self.cache_bytes = cache_bytes
        self._pin, self._engine = pin, engine
        compute = torch.device(device) if device is not None else torch.device("cpu")
        dtype = dtype or (table.dtype if table is not None else torch.get_default_dtype())
        fresh = table is None and _weight is None
        if table is not None:
            if tuple(table.shape) != (self.num_embeddings, self.embedding_dim) or table.dtype != dtype:
                raise ValueError(f"table has shape {tuple(table.shape)} and dtype {table.dtype}; expected "
                                 f"({self.num_embeddings}, {self.embedding_dim}) and {dtype}")
        elif _weight is not None:
            if tuple(_weight.shape) != (self.num_embeddings, self.embedding_dim):
                raise ValueError("Shape of weight does not match num_embeddings and embedding_dim")
            table = HostTable.from_tensor(_weight.to(dtype), device=compute, pin=pin, engine=engine)
        else:
            table = HostTable(self.num_embeddings, self.embedding_dim, dtype, device=compute, pin=pin,
                              engine=engine, fill=None)
        self.table = table
        self.weight = nn.Parameter(torch.empty(0, self.embedding_dim, device=compute, dtype=dtype),
                                   requires_grad=not _freeze)
        self._state_tables: dict[str, HostTable] = {}
        self._spec: dict[str, float] = {}
        self._self_init = True
        self._optimizer: weakref.ref | None = None
        self._work: _Work | None = None
        self._cache: _Cache | None = None
        self._wb_stream: torch.cuda.Stream | None = None  # write-backs of evicted rows (UVA engine)
        self._wb_event = None
        self._evicted: list[tuple[Tensor, Tensor]] = []  # (ids, their cache records): see _launch_evicted
        self._next: _Next | None = None
        self._pending: tuple[Tensor, dict[str, Prefetch]] | None = None
        self._loaded: dict | None = None
        if fresh:
            self.reset_parameters()
        _ALL.add(self)

    # -- parameters and state dicts --------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Fill the table from N(0, 1), the padding row with zeros (as ``nn.Embedding``); clears the cache."""
        self._require_idle("reset_parameters")
        self._drop_cache()
        data = self.table.data
        data.normal_()
        if self.padding_idx is not None:
            data[self.padding_idx].zero_()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The full table, as nn.Embedding would store it (a view of host memory, not a copy).
        self.flush()
        destination[prefix + "weight"] = self.table.data if keep_vars else self.table.data.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        if tuple(value.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                              f"the table has shape {(self.num_embeddings, self.embedding_dim)}")
            return
        self._require_idle("load_state_dict")
        self.flush()
        self._drop_cache()
        with torch.no_grad():
            self.table.data.copy_(value)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2.0:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.cache_rows or self.cache_bytes:
            s += f", cache_rows={self._cache_capacity()}"
        return s

    @property
    def state_tables(self) -> dict[str, HostTable]:
        """The host tables of per-row optimizer state (``{"exp_avg": HostTable, ...}``), once attached."""
        return dict(self._state_tables)

    @property
    def working_ids(self) -> Tensor | None:
        """Row ids of the current step's working rows, in ``weight``'s row order (``None`` between steps)."""
        if self._work is None:
            return None
        return torch.cat([c.ids for c in self._work.chunks]) if len(self._work.chunks) > 1 else \
            self._work.chunks[0].ids

    # -- devices ---------------------------------------------------------------------------------------------
    def _sync_device(self) -> torch.device:
        dev = self.weight.device
        if self.weight.dtype != self.table.dtype:
            raise TypeError(f"OffloadedEmbedding: weight dtype {self.weight.dtype} differs from the table's "
                            f"{self.table.dtype}; the table's dtype is fixed when it is created")
        if self.table.device != dev:
            self._require_idle("moving to another device")
            self.flush()
            self._drop_cache()
            self.table.device = dev
            for t in self._state_tables.values():
                t.device = dev
        return dev

    def _require_idle(self, what: str) -> None:
        if self._work is not None:
            raise RuntimeError(f"OffloadedEmbedding: {what} in the middle of a step (rows are switched in; "
                               f"call optimizer.step() first)")

    # -- cache -----------------------------------------------------------------------------------------------
    def _cache_capacity(self) -> int:
        if self.cache_bytes is not None:
            row = self.embedding_dim * self.table._data.element_size() * (1 + len(self._spec))
            return min(self.num_embeddings, self.cache_bytes // row)
        return min(self.num_embeddings, self.cache_rows)

    def _get_cache(self) -> _Cache | None:
        cap = self._cache_capacity()
        if cap <= 0:
            return None
        if self._cache is None:
            self._cache = _Cache(cap, self.table.num_rows, self.embedding_dim, self.table.dtype, self.table.device,
                                 tuple(self._spec))
        return self._cache

    def _tables(self) -> list[HostTable]:
        """The host tables of a row: the weight's, then the per-row state's (the cache's ``parts`` order)."""
        return [self.table, *(self._state_tables[k] for k in self._spec)]

    def _cache_uva(self, cache: _Cache) -> bool:
        """Whether the cache's rows move by the UVA kernel (see :func:`_cache_engine`), worked out once per
        engine setting."""
        key = (get_engine(), self.table.engine)
        got = cache.uva
        if got is None or got[:2] != key:
            ok = self.table.device.type == "cuda" and all(
                _cache_engine(t, op) == "uva" for t in self._tables() for op in ("gather", "scatter"))
            got = cache.uva = (*key, ok)
        return got[2]

    def _move(self, op: str, tables: list[HostTable], ids: Tensor, devs: list[Tensor], pos: Tensor | None,
              uva: bool) -> None:
        """``devs[j][pos[i]] = tables[j][ids[i]]`` (``"gather"``) or the reverse (``"scatter"``, ``ids``
        distinct), on the current stream: one UVA launch for all the tables, or each table's engine through
        a temporary (``pos`` ``None``: in order)."""
        if ids.numel() == 0:
            return
        if uva:
            if op == "scatter":
                _check_writable(tables)
            launches = _prepare_uva(op, tables, ids, devs, pos)
            _land(tables)
            _uva.launch(launches)
            _noted(tables, "read" if op == "gather" else "write", ids, devs, pos)
            return
        if op == "scatter":  # (all tables or none)
            _commit(ids, [(t, d if pos is None else d.index_select(0, pos)) for t, d in zip(tables, devs, strict=True)],
                    [_cache_engine(t, "scatter") for t in tables])
            return
        for t, d in zip(tables, devs, strict=True):
            tmp = torch.empty(ids.numel(), t.dim, dtype=t.dtype, device=d.device)
            t._gather_unique(ids, None, tmp, _cache_engine(t, "gather"))
            if pos is None:
                d.copy_(tmp)
            else:
                d.index_copy_(0, pos, tmp)

    def _drop_cache(self) -> None:
        self._join()
        self._cache = None
        self._next = None
        self._release_pending()

    def _release_pending(self) -> None:
        if self._pending is not None:
            for p in self._pending[1].values():
                p.release()
            self._pending = None

    def cache_stats(self) -> dict[str, int]:
        """``{"capacity", "hits", "misses"}`` counted over distinct rows: a miss is a row that had to come from
        the host (at switch-in, or earlier by :meth:`prefetch`), a hit one that was in the cache already."""
        c = self._cache
        if c is None:
            return {"capacity": self._cache_capacity(), "hits": 0, "misses": 0}
        hits = c.hits - c.prefetch_hits - (0 if c.prefetch_hits_dev is None else int(c.prefetch_hits_dev))
        return {"capacity": self._cache_capacity(), "hits": hits, "misses": c.misses}

    def _join(self, host: bool = True) -> None:
        """Make the current stream wait for this module's side-stream work: prefetch admissions into the cache
        and, with ``host``, the write-backs of evicted rows (before host rows are read)."""
        self._launch_evicted()
        if host:
            c = self._cache
            if c is not None and c.states_ready is not None:  # (state rows still landing in their slots)
                torch.cuda.current_stream(self.table.device).wait_event(c.states_ready)
                c.states_ready = None
            if self._wb_event is not None:
                torch.cuda.current_stream(self.table.device).wait_event(self._wb_event)

    def _launch_evicted(self, wait: bool = True) -> None:
        """Start writing back the rows that prefetch admissions evicted (deferred until the step's own state
        gathers are consumed, so that they need not wait for the write-back). With ``wait`` the current
        stream waits for the prefetch admission; without, only the write-back does (after a step, so that
        the admission of the next step's rows goes on overlapping the work that follows)."""
        c = self._cache
        ready = None
        if c is not None and c.ready is not None:
            ready = c.ready
            if wait:
                torch.cuda.current_stream(self.table.device).wait_event(ready)
                c.ready = None
        if self._evicted:  # (nn.Module attribute assignments cost microseconds: only when there is work)
            evicted, self._evicted = self._evicted, []
            for ids, records in evicted:
                self._write_back(ids, records, after=ready)

    def _write_back(self, ids: Tensor, records: Tensor, after=None) -> None:
        """Commit evicted rows (``records``: their cache records, weight and state side by side) to the host
        tables; with the UVA engine in one launch on a side stream, so the write-back of one step's evictions
        overlaps its compute (the next host read waits for it, see :meth:`_join`). ``after``: the event of
        the prefetch admission that produced ``ids`` and ``records`` on its side stream (the write-back then
        waits for that alone), else they are the current stream's."""
        if ids.numel() == 0:
            return
        tables = self._tables()
        parts = list(records.unbind(1))
        cuda = ids.device.type == "cuda"
        current = torch.cuda.current_stream(ids.device) if cuda else None
        if not (cuda and self._cache is not None and self._cache_uva(self._cache)):
            if after is not None:
                current.wait_event(after)
            _commit(ids, list(zip(tables, parts, strict=True)),
                    [_cache_engine(t, "scatter") for t in tables] if cuda else None)
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
            self._move("scatter", tables, ids, parts, None, True)
            ev = torch.cuda.Event()
            ev.record(wb)
        ids.record_stream(wb)
        records.record_stream(wb)
        self._wb_event = ev

    def _evict(self, cache: _Cache, k: int, protect_from: int,
               defer: bool = False) -> tuple[Tensor, Tensor | None, int]:
        """``k`` slots for new rows: empty ones first, then the least recently used among the slots not used
        since ``protect_from``; the rows they held (and their optimizer state) are written back to the host
        (with ``defer``, by the next :meth:`_launch_evicted`). Returns ``(slots, evicted row ids, number of
        empty slots among them)``: :meth:`_install` clears the evicted rows' slot-map entries."""
        # Slots fill in order: the empty ones are [filled, capacity). Only when they run out are rows evicted,
        # the least recently used of the filled slots (in no particular order: no sort needed). The slots of
        # this step and the next are stamped >= protect_from, all others below it, and the callers ask for
        # at most ``capacity - protected - reserved`` slots (an upper bound on those stamped): the k smallest
        # stamps are slots that neither step uses, with no masking of the others.
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
            self._write_back(old_ids, records)
        return victims, old_ids, n_empty

    @staticmethod
    def _install(cache: _Cache, slots: Tensor, ids: Tensor, use: int, old_ids: Tensor | None, n_empty: int,
                 gen: int | None = None, chunk_slots: Tensor | None = None, miss_pos: Tensor | None = None) -> None:
        """Map rows ``ids`` (whose records were gathered into ``slots``, from :meth:`_evict` with ``old_ids``
        and ``n_empty``) to their slots, stamped ``use`` (and with ``gen``, as that prefetch's admissions);
        ``chunk_slots[miss_pos[i]] = slots[i]``."""
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

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host tables."""
        self._join()
        c = self._cache
        if c is None:
            return
        dirty = torch.nonzero(c.dirty & (c.ids >= 0)).squeeze(1)
        for start in range(0, dirty.numel(), _FLUSH_ROWS):  # (a few rows at a time: little GPU memory)
            slots = dirty[start:start + _FLUSH_ROWS]
            writes = [(self.table, c.weight[slots])]
            writes += [(self._state_tables[k], c.states[k][slots]) for k in self._spec]
            _commit(c.ids[slots], writes)
            c.dirty.index_fill_(0, slots, False)

    # -- fetching rows ---------------------------------------------------------------------------------------
    def _distinct(self, flat: Tensor, cache: _Cache | None = None, exclude: Tensor | None = None,
                  stamp: int = -1) -> _Rows:
        """Deduplicate and bounds-check ``flat`` with one host synchronisation (see :class:`_Rows`).

        With a cache, each distinct id's slot and the misses: ids to fetch from the host (not cached, and not
        in the sorted ``exclude``); with ``stamp >= 0`` their slots' LRU stamps are set to it (where the CuPy
        kernels run: ``stamped``). The one value read back also carries the smallest and largest index, so no
        index out of range reaches a kernel that touches host memory.
        """
        n_flat = flat.numel()
        if cache is not None:
            self._join(host=False)  # a prefetch admission may still be writing the slot map
        if n_flat == 0:
            empty = flat.new_empty(0)
            none = None if cache is None else empty
            return _Rows(empty, empty, none, None if cache is None else empty.bool())
        num_rows = self.table.num_rows
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

    def _fetch(self, got: _Rows, first: bool = True, prefetched: int | None = None,
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
        cache = self._cache
        ids, slots, n_miss = got.ids, got.slots, got.n_miss
        self._join(host=cache is None or n_miss > 0)
        if cache is None:
            return self._fetch_uncached(ids)
        self._release_pending()
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
        uva = self._cache_uva(cache)
        tables = self._tables()
        # (slots reserved by a prefetch for the next step are not victims either)
        n_admit = max(0, min(n_miss, cache.capacity - cache.protected - cache.reserved))
        victims = None
        if n_admit:
            victims, old_ids, n_empty = self._evict(cache, n_admit, protect_from=cache.clock)
            admit_ids = miss_ids[:n_admit]
            # the weight straight into the slots (the lookup reads it now); the state on a side stream below
            self._move("gather", tables[:1], admit_ids, cache.parts[:1], victims, uva)
            self._install(cache, victims, admit_ids, cache.clock, old_ids, n_empty, chunk_slots=slots,
                          miss_pos=miss_pos)
            chunk.n_admit = n_admit
            cache.protected += n_admit
        rows = cache.weight.index_select(0, slots)  # (rows not admitted read the scratch row, replaced below)
        if n_admit < n_miss:
            self._move("gather", tables[:1], miss_ids[n_admit:], [rows], miss_pos[n_admit:], uva)
        if len(tables) > 1:
            self._gather_states(cache, chunk, tables[1:], miss_ids, victims, uva)
        return chunk, rows

    def _gather_states(self, cache: _Cache, chunk: _Chunk, tables: list[HostTable], miss_ids: Tensor,
                       victims: Tensor | None, uva: bool) -> None:
        """Start moving the per-row state of a lookup's misses from the host: that of the admitted ones
        (``victims``, the first of ``miss_ids``) into their slots, the others' into ``chunk.bypass_states``;
        on the cache's side stream (the optimizer step reads them, see :meth:`_resolve_states`), one launch
        each with the UVA kernel."""
        n_admit = chunk.n_admit
        n_bypass = miss_ids.numel() - n_admit
        buf = None
        if n_bypass:
            buf = torch.empty(n_bypass, len(tables), self.embedding_dim, dtype=self.table.dtype,
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
                self._move("gather", tables, miss_ids[:n_admit], cache.parts[1:], victims, uva)
            if n_bypass:
                self._move("gather", tables, miss_ids[n_admit:], list(buf.unbind(1)), None, uva)
            if side is not None:
                cache.states_ready = torch.cuda.Event()
                cache.states_ready.record(side)
        if side is not None:
            for t in (miss_ids, victims, buf):
                if t is not None:
                    t.record_stream(side)

    def _fetch_uncached(self, ids: Tensor) -> tuple[_Chunk, Tensor]:
        chunk = _Chunk(ids=ids, slots=None)
        pending, self._pending = self._pending, None
        # from the prefetch when it holds exactly these rows, else from the host
        use_pending = pending is not None and (pending[0] is ids or (
            pending[0].numel() == ids.numel() and bool(torch.equal(pending[0], ids))))
        if use_pending:
            rows = pending[1]["weight"].rows()
            states = {k: pending[1][k] for k in self._spec if k in pending[1]}
            pending[1]["weight"].release()
        else:
            if pending is not None:
                for p in pending[1].values():
                    p.release()
            rows = torch.empty(ids.numel(), self.embedding_dim, dtype=self.table.dtype, device=self.table.device)
            self.table._gather_unique(ids, None, rows, self.table.resolved_engine("gather"))
            states = {}
        for k in self._spec:
            if k not in states:
                states[k] = self._state_tables[k].prefetch(ids, _checked=True)
        chunk.states = states
        return chunk, rows

    def _resolve_states(self, chunk: _Chunk, rows: bool = True) -> dict[str, Tensor]:
        """Per-row state of a chunk's rows (waits for its side-stream gathers); without ``rows`` only the
        wait (admitted rows' state lands in the cache either way)."""
        out = {}
        if chunk.slots is None:  # (no cache: from the tables' prefetches)
            for k in self._spec:
                p = chunk.states.get(k)
                out[k] = None if p is None else p.rows()
                if p is not None:
                    p.release()
            chunk.states = {}
            return out
        cache = self._cache
        if cache.states_ready is not None:
            torch.cuda.current_stream(self.table.device).wait_event(cache.states_ready)
            cache.states_ready = None
        if rows:
            for j, k in enumerate(self._spec):
                got = cache.states[k].index_select(0, chunk.slots)
                if chunk.n_bypass:
                    got.index_copy_(0, chunk.miss_pos[chunk.n_admit:], chunk.bypass_states[:, j])
                out[k] = got
        chunk.bypass_states = None
        return out

    def prefetch(self, indices: Tensor) -> None:
        """Start moving the rows (and their optimizer state) that the next step will look up to the GPU, on a
        side stream, while the current step computes.

        With a cache, the rows not cached are admitted to it now (the least recently used rows not needed by
        the current step make room), so the next step finds them as hits. Without one, the next switch-in
        uses them when they are exactly its rows; rows written back in between are patched in, so they are
        never stale.

        Deduplication and the bounds check happen here (one host synchronisation); the next switch-in of the
        very same index tensor, unchanged since, reuses them, so a step whose rows the cache holds needs no
        host synchronisation at all. Pass the tensor the next step will look up.
        """
        self._sync_device()
        flat = _as_index(indices, self.table.device)
        cache = self._get_cache()
        if cache is None:
            got = self._distinct(flat)
            ids, inverse = got.ids, got.inverse
            self._release_pending()
            handles = {"weight": self.table.prefetch(ids, _checked=True)}
            for k in self._spec:
                handles[k] = self._state_tables[k].prefetch(ids, _checked=True)
            self._pending = (ids, handles)
            self._next = _Next(flat, flat.data_ptr(), flat._version, ids, inverse, False, runs=got.runs)
            return
        self._release_pending()
        self._join(host=False)  # (the side stream waits for earlier write-backs itself)
        work = self._work
        # Rows of the step in progress are cached already or will be written to the host after it: skip them.
        # Only those that bypass the cache can look like misses (the others are cached), so only then.
        bypass = sum(c.n_bypass for c in work.chunks) if work is not None else 0
        exclude = work.sorted_ids if bypass else None
        got = self._distinct(flat, cache, exclude, stamp=cache.clock + 1)
        ids, inverse, n_miss = got.ids, got.inverse, got.n_miss
        # the next step's cached rows are kept for it (not evicted for its misses; a miss marks the scratch row)
        if not got.stamped:
            cache.last_use.index_fill_(0, got.slots, cache.clock + 1)
        cache.reserved += ids.numel() - n_miss
        n_admit = max(0, min(n_miss, cache.capacity - cache.protected - cache.reserved))
        cache.prefetches += 1
        self._next = _Next(flat, flat.data_ptr(), flat._version, ids, inverse, n_admit == n_miss and bypass == 0,
                           n_admit, got.runs)
        if n_admit == 0:
            return
        device = self.table.device
        side = None
        if device.type == "cuda":
            if cache.stream is None:
                cache.stream = torch.cuda.Stream(device)
            side = cache.stream
            side.wait_stream(torch.cuda.current_stream(device))
            if self._wb_event is not None:
                side.wait_event(self._wb_event)  # host rows evicted earlier have landed
            for t in (ids, got.miss if got.miss is not None else got.miss_ids):
                t.record_stream(side)
        with _stream_ctx(side):
            if got.miss_ids is not None:
                miss_ids = got.miss_ids[:n_admit]
            else:
                miss_ids = _compact_values(got.miss, n_miss, ids)[:n_admit]
            victims, old_ids, n_empty = self._evict(cache, n_admit, protect_from=cache.clock, defer=True)
            # weight and state of every row straight into its slot (one launch with the UVA kernel)
            self._move("gather", self._tables(), miss_ids, cache.parts, victims, self._cache_uva(cache))
            cache.gen += 1
            if cache.first_gen is None:
                cache.first_gen = cache.gen
            self._install(cache, victims, miss_ids, cache.clock + 1, old_ids, n_empty, gen=cache.gen)
            if side is not None:
                cache.ready = torch.cuda.Event()
                cache.ready.record(side)
        cache.misses += n_admit
        cache.reserved += n_admit

    # -- the working set -------------------------------------------------------------------------------------
    def _renorm(self, rows: Tensor) -> None:
        with torch.no_grad():
            idx = torch.arange(rows.shape[0], device=rows.device)
            torch.embedding_renorm_(rows, idx, self.max_norm, self.norm_type)

    def _index_sorted(self, work: _Work) -> None:
        all_ids = torch.cat([c.ids for c in work.chunks]) if len(work.chunks) > 1 else work.chunks[0].ids
        work.sorted_ids, work.perm = torch.sort(all_ids)

    def prepare(self, indices: Tensor) -> None:
        """Switch in the rows of ``indices`` for the coming step (all lookups of the step may then use any
        of them). ``forward`` does this by itself for the first lookup of a step."""
        self._sync_device()
        if self._work is not None:
            self._end_work(check=True)
        self._begin(_as_index(indices, self.table.device))

    def _begin(self, flat: Tensor) -> Tensor:
        """Start a step's working set with the rows of ``flat``; returns each index's working row."""
        cache = self._get_cache()
        prefetched = None
        if cache is not None:
            self._join(host=False)
            cache.clock += 1
            cache.protected, cache.reserved = cache.reserved, 0
        nxt, self._next = self._next, None
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
            got = self._distinct(flat, cache, stamp=-1 if cache is None else cache.clock)
        chunk, rows = self._fetch(got, prefetched=prefetched, reserved=matched)
        if cache is not None:
            cache.prefetches, cache.first_gen = 0, None
        if self.max_norm is not None:
            self._renorm(rows)
        self.weight.data = rows
        self.weight.grad = None
        # Autograd runs on a fresh leaf that shares the rows' memory, not on ``weight`` itself: a graph of an
        # earlier step that is still referenced would otherwise pin ``weight``'s old shape. Its gradient is
        # handed to ``weight`` as soon as it is accumulated, so clipping between backward and step sees it.
        chunk.leaf = rows.detach().requires_grad_(True)
        weight = self.weight
        chunk.leaf.register_post_accumulate_grad_hook(lambda leaf: setattr(weight, "grad", leaf.grad))
        self._work = _Work(chunks=[chunk], sorted_ids=got.ids, perm=None,
                           renormed=self.max_norm is not None, runs=got.runs)
        self._work.version = self.weight._version
        return got.inverse

    def _locate(self, flat: Tensor) -> Tensor:
        work = self._work
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
                self._distinct(new)
                raise RuntimeError("OffloadedEmbedding: new rows looked up after the optimizer's step began")
            cache = self._cache
            got = self._distinct(new, cache, stamp=-1 if cache is None else cache.clock)
            chunk, rows = self._fetch(got, first=False)
            if self.max_norm is not None:
                self._renorm(rows)
            chunk.leaf = rows.requires_grad_(True)
            work.chunks.append(chunk)
            self._index_sorted(work)
            n = work.sorted_ids.numel()
            pos = torch.searchsorted(work.sorted_ids, flat).clamp_(max=n - 1)
        return pos if work.perm is None else work.perm[pos]

    def forward(self, input: Tensor) -> Tensor:
        self._sync_device()
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"OffloadedEmbedding expects int32 or int64 indices, got {input.dtype}")
        training = torch.is_grad_enabled() and self.weight.requires_grad
        if not training:
            return self._lookup_no_grad(input)
        flat = input.reshape(-1).to(self.weight.device, torch.int64)
        if self._work is not None and self._optimizer is None:
            self._end_work(check=True)  # nothing will step these rows: start afresh
        first = self._work is None
        if first:
            local = self._begin(flat).view(input.shape)
        else:
            local = self._locate(flat).view(input.shape)
        work = self._work
        table = work.chunks[0].leaf if len(work.chunks) == 1 else torch.cat([c.leaf for c in work.chunks])
        if (first and work.runs is not None and len(work.chunks) == 1 and self.padding_idx is None
                and not self.scale_grad_by_freq and table.dtype == torch.float32):
            return _Lookup.apply(table, local, work.runs)
        pad = None
        if self.padding_idx is not None:
            p = torch.searchsorted(work.sorted_ids, torch.tensor([self.padding_idx], device=flat.device))
            p = p.clamp_(max=work.sorted_ids.numel() - 1)
            if bool(work.sorted_ids[p] == self.padding_idx):
                pad = int(p if work.perm is None else work.perm[p])
        return F.embedding(local, table, pad, None, self.norm_type, self.scale_grad_by_freq, False)

    def _lookup_no_grad(self, input: Tensor) -> Tensor:
        """A lookup that trains nothing: rows from the working set, the cache or the host."""
        flat = input.reshape(-1).to(self.weight.device, torch.int64)
        self._join()
        with torch.no_grad():
            ids, inverse = self.table.prepare(flat)
            cache = self._cache
            if cache is None:
                rows = torch.empty(ids.numel(), self.embedding_dim, dtype=self.table.dtype, device=self.weight.device)
                self.table._gather_unique(ids, None, rows, self.table.resolved_engine("gather"))
            else:
                slots = cache.slot_of.index_select(0, ids)
                rows = cache.weight.index_select(0, slots)
                miss = torch.nonzero(slots == cache.capacity).squeeze(1)
                if miss.numel():
                    host = torch.empty(miss.numel(), self.embedding_dim, dtype=self.table.dtype,
                                       device=self.weight.device)
                    self.table._gather_unique(ids[miss], None, host, self.table.resolved_engine("gather"))
                    rows[miss] = host
            work = self._work
            if work is not None and work.sorted_ids.numel() and ids.numel():
                # rows of the step in progress are newer than the cache's and the host's
                n = work.sorted_ids.numel()
                pos = torch.searchsorted(work.sorted_ids, ids).clamp_(max=n - 1)
                found = torch.nonzero(work.sorted_ids[pos] == ids).squeeze(1)
                step_rows = self.weight if len(work.chunks) == 1 or work.folded else \
                    torch.cat([self.weight.data] + [c.leaf.data for c in work.chunks[1:]])
                at = pos[found]
                rows[found] = step_rows.detach().index_select(0, at if work.perm is None else work.perm[at])
            elif self.max_norm is not None:
                before = rows.clone()
                self._renorm(rows)
                changed = (rows != before).any(dim=1)
                if bool(changed.any()):  # nn.Embedding renormalises its weight in place, also without grad
                    ch = torch.nonzero(changed).squeeze(1)
                    self._write_rows(ids[ch], rows[ch])
            out = rows.index_select(0, inverse)
        return out.view(*input.shape, self.embedding_dim)

    def _write_rows(self, ids: Tensor, rows: Tensor) -> None:
        """Weight rows only (renormalisation outside a step): into the cache where cached, else the host."""
        self._join()
        cache = self._cache
        if cache is not None:
            slots = cache.slot_of.index_select(0, ids)
            hit = slots != cache.capacity
            cache.weight[slots[hit]] = rows[hit]
            cache.dirty[slots[hit]] = True
            ids, rows = ids[~hit], rows[~hit]
        _commit(ids, [(self.table, rows)])

    # -- optimizer hooks -------------------------------------------------------------------------------------
    def _fold(self) -> None:
        """Before step: one working parameter for all chunks, and its per-row optimizer state."""
        work = self._work
        if work.folded:
            return
        if len(work.chunks) > 1:
            leaves = [c.leaf for c in work.chunks[1:]]
            grads = [self.weight.grad] + [leaf.grad for leaf in leaves]
            datas = [self.weight.data] + [leaf.data for leaf in leaves]
            if all(g is None for g in grads):
                new_grad = None
            else:
                new_grad = torch.cat([torch.zeros_like(d) if g is None else g for g, d in zip(grads, datas,
                                                                                             strict=True)])
            self.weight.data = torch.cat(datas)
            self.weight.grad = new_grad
        work.version = self.weight._version
        states = [self._resolve_states(c) for c in work.chunks]
        work.state_rows = {k: torch.cat([s[k] for s in states]) if len(states) > 1 else states[0][k]
                           for k in self._spec}
        work.folded = True

    def _pre_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._work is None:
            return
        self._fold()
        if self.padding_idx is not None:
            # The padding row is never trained (nn.Embedding gives it no gradient and SparseAdam no update),
            # but max_norm may have renormalised it: keep its pre-step weight and state to write back.
            pos = torch.nonzero(self.working_ids == self.padding_idx).squeeze(1)
            if pos.numel():
                self._work.pad = (pos, self.weight.data[pos].clone(),
                                  {k: v[pos].clone() for k, v in self._work.state_rows.items()})
        if self.weight.grad is None:
            return  # the optimizer skips a parameter without gradient
        state = optimizer.state[self.weight]
        if len(state) == 0 and self._self_init:
            return  # the optimizer creates its state (fresh, as the host rows are) on this first step
        for k in self._spec:
            state[k] = self._work.state_rows[k]

    def _post_step(self, optimizer: torch.optim.Optimizer) -> None:
        work = self._work
        if work is None or not work.folded:
            return
        if self.weight.grad is None:
            self._end_work(check=True)
            return
        state = optimizer.state[self.weight]
        shape = self.weight.shape
        for k, v in state.items():
            if isinstance(v, Tensor) and v.shape == shape and v.dim() > 0 and k not in self._spec:
                raise RuntimeError(f"{type(optimizer).__name__} keeps per-row state {k!r} that offload does not "
                                   f"know; declare it with offload.register_optimizer")
        rows = {k: state[k] for k in self._spec}
        for k, v in rows.items():
            if not isinstance(v, Tensor) or v.shape != shape:
                raise RuntimeError(f"{type(optimizer).__name__} state {k!r} is not shaped like the rows {tuple(shape)}")
        self._store(work, self.weight.data, rows)
        for k in self._spec:
            del state[k]
        self._finish_work()
        self._launch_evicted(wait=False)

    def _store(self, work: _Work, weight_rows: Tensor, state_rows: dict[str, Tensor]) -> None:
        """A stepped working set back: cached rows into the cache (dirty), the others to the host tables."""
        ids = torch.cat([c.ids for c in work.chunks]) if len(work.chunks) > 1 else work.chunks[0].ids
        if work.pad is not None:
            pos, w_pad, s_pad = work.pad
            weight_rows[pos] = w_pad
            for k in self._spec:
                state_rows[k][pos] = s_pad[k]
        cache = self._cache
        if cache is None or work.chunks[0].slots is None:
            _commit(ids, [(self.table, weight_rows)] + [(self._state_tables[k], state_rows[k]) for k in self._spec])
            return
        # rows not cached land in the scratch row
        dest = torch.cat([c.slots for c in work.chunks]) if len(work.chunks) > 1 else work.chunks[0].slots
        srcs = [weight_rows, *(state_rows[k] for k in self._spec)]
        if not (_cache_cuda.usable(dest.device) and _cache_cuda.store(cache.rows, dest, srcs, cache.dirty)):
            for part, rows in zip(cache.parts, srcs, strict=True):
                part.index_copy_(0, dest, rows)
            cache.dirty.index_fill_(0, dest, True)
        if not any(c.n_bypass for c in work.chunks):
            return
        offsets, bypass = 0, []
        for c in work.chunks:
            if c.n_bypass:
                bypass.append(c.miss_pos[c.n_admit:] + offsets)
            offsets += c.ids.numel()
        sel = torch.cat(bypass)
        _commit(ids[sel], [(self.table, weight_rows[sel])] + [(self._state_tables[k], state_rows[k][sel])
                                                              for k in self._spec])

    def _end_work(self, check: bool) -> None:
        """Drop a working set that no optimizer stepped (writing back renormalised rows)."""
        work = self._work
        if work is None:
            return
        if check and self.weight._version != work.version and not work.folded:
            self._work = None
            raise RuntimeError("OffloadedEmbedding.weight was changed in place (by an optimizer step?) but no "
                               "attached optimizer wrote the rows back: call offload.attach(optimizer)")
        if not work.folded:
            for c in work.chunks:
                self._resolve_states(c, rows=False)  # (the side streams' gathers are waited for)
        if work.renormed:
            w = self.weight.data if len(work.chunks) == 1 or work.folded else \
                torch.cat([self.weight.data] + [c.leaf.data for c in work.chunks[1:]])
            ids = torch.cat([c.ids for c in work.chunks])
            self._write_rows(ids, w.detach())
        self._finish_work()

    def _finish_work(self) -> None:
        self._work = None
        self.weight.grad = None
        self.weight.data = torch.empty(0, self.embedding_dim, dtype=self.table.dtype, device=self.weight.device)

    # -- attaching an optimizer ------------------------------------------------------------------------------
    def _attach(self, optimizer: torch.optim.Optimizer) -> None:
        group = next((g for g in optimizer.param_groups if any(p is self.weight for p in g["params"])), None)
        if group is None:
            raise ValueError("offload.attach: this OffloadedEmbedding's weight is not among the optimizer's "
                             "parameters (build the optimizer from model.parameters())")
        current = self._optimizer() if self._optimizer is not None else None
        if current is optimizer and self._loaded is None:
            return
        if current is not None and current is not optimizer:
            raise RuntimeError("offload.attach: this OffloadedEmbedding is already attached to another optimizer "
                               "(offload.detach it first)")
        spec, self_init = row_state_spec(optimizer, group)
        self._require_idle("attach")
        self.flush()
        self._drop_cache()
        loaded, self._loaded = self._loaded, None
        tables: dict[str, HostTable] = {}
        if loaded is not None:
            if loaded["optimizer"] != type(optimizer).__name__ or sorted(loaded["row_state"]) != sorted(spec):
                raise ValueError(f"the checkpoint holds state of {loaded['optimizer']} "
                                 f"({sorted(loaded['row_state'])}); cannot resume it with "
                                 f"{type(optimizer).__name__} ({sorted(spec)})")
            for k in spec:
                tables[k] = HostTable.from_npy(os.path.join(loaded["path"], f"state.{k}.npy"),
                                               mmap_mode=loaded["mmap_mode"], dtype=self.table.dtype,
                                               device=self.table.device, pin=loaded["pin"], engine=self._engine)
            state = optimizer.state[self.weight]
            state.clear()
            for k, v in loaded["scalars"].items():
                state[k] = _scalar_from_json(v, self.weight.device)
        else:
            for k, fill in spec.items():
                tables[k] = HostTable(self.num_embeddings, self.embedding_dim, self.table.dtype,
                                      device=self.table.device, pin=self._pin, engine=self._engine, fill=fill)
        self._state_tables = tables
        self._spec = spec
        self._self_init = self_init
        self._optimizer = weakref.ref(optimizer)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Save the table, the per-row optimizer state and the optimizer's scalar state for this table to the
        directory ``path`` (``.npy`` files plus ``meta.json``), atomically: a complete checkpoint or none.

        Optimizer hyperparameters and other parameters' state are saved the usual way
        (``optimizer.state_dict()``).
        """
        self._require_idle("save")
        self.flush()
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        try:
            self.table.save_npy(os.path.join(tmp, "weight.npy"))
            for k, t in self._state_tables.items():
                t.save_npy(os.path.join(tmp, f"state.{k}.npy"))
            opt = self._optimizer() if self._optimizer is not None else None
            scalars = {}
            if opt is not None:
                for k, v in opt.state.get(self.weight, {}).items():
                    if k not in self._spec:
                        scalars[k] = _scalar_to_json(k, v)
            meta = {"format": 1, "num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                    "dtype": str(self.table.dtype).removeprefix("torch."), "padding_idx": self.padding_idx,
                    "optimizer": type(opt).__name__ if opt is not None else None,
                    "row_state": sorted(self._spec) if opt is not None else [], "scalars": scalars}
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
            old = None
            if os.path.exists(path):
                old = f"{path}.old-{os.getpid()}"
                os.replace(path, old)
            os.replace(tmp, path)
            if old is not None:
                shutil.rmtree(old)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load(self, path: str | os.PathLike, *, mmap_mode: str | None = "c", pin: bool | None = None) -> None:
        """Load a checkpoint written by :meth:`save` into this module.

        The table (and, at the next :func:`attach`, the optimizer state) is memory-mapped from the ``.npy``
        files: ``mmap_mode="c"`` (copy-on-write, the checkpoint is not modified), ``"r+"`` (train in place in
        the files) or ``None`` (read into memory). Call :func:`attach` with an optimizer of the saved class
        afterwards; training then continues exactly where it stopped.
        """
        self._require_idle("load")
        path = os.fspath(path)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        dtype = getattr(torch, meta["dtype"])
        if (meta["num_embeddings"], meta["embedding_dim"]) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"{path} holds a ({meta['num_embeddings']}, {meta['embedding_dim']}) table; this "
                             f"module has ({self.num_embeddings}, {self.embedding_dim})")
        if dtype != self.table.dtype:
            raise ValueError(f"{path} holds a {dtype} table; this module's is {self.table.dtype}")
        table = HostTable.from_npy(os.path.join(path, "weight.npy"), mmap_mode=mmap_mode, dtype=dtype,
                                   device=self.weight.device, pin=pin, engine=self._engine)
        self.table.close()
        self.table = table
        self._drop_cache()
        self._state_tables = {}
        self._spec = {}
        self._pending = None
        opt = self._optimizer() if self._optimizer is not None else None
        self._optimizer = None
        self._loaded = None
        if meta["optimizer"] is not None:
            self._loaded = {"path": path, "mmap_mode": mmap_mode, "pin": pin, "optimizer": meta["optimizer"],
                            "row_state": meta["row_state"], "scalars": meta["scalars"]}
        if opt is not None:
            opt.state.pop(self.weight, None)
            if self._loaded is not None:
                self._attach(opt)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, mmap_mode: str | None = "c", device=None,
                        pin: bool | None = None, engine=None, **kwargs) -> OffloadedEmbedding:
        """A new module over a checkpoint written by :meth:`save` (see :meth:`load`); ``kwargs`` go to
        ``__init__`` (``padding_idx``, ``cache_rows``, ...)."""
        path = os.fspath(path)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        dtype = getattr(torch, meta["dtype"])
        table = HostTable.from_npy(os.path.join(path, "weight.npy"), mmap_mode=mmap_mode, dtype=dtype,
                                   device=device, pin=pin, engine=engine)
        kwargs.setdefault("padding_idx", meta["padding_idx"])
        self = cls(meta["num_embeddings"], meta["embedding_dim"], device=device, dtype=dtype, table=table,
                   pin=pin, engine=engine, **kwargs)
        if meta["optimizer"] is not None:
            self._loaded = {"path": path, "mmap_mode": mmap_mode, "pin": pin, "optimizer": meta["optimizer"],
                            "row_state": meta["row_state"], "scalars": meta["scalars"]}
        return self


def _scalar_to_json(key: str, v) -> dict:
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise RuntimeError(f"optimizer state {key!r} is neither per-row nor a scalar: shape {tuple(v.shape)}")
        return {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch."), "device": v.device.type,
                "shape": list(v.shape)}
    if isinstance(v, (int, float, bool)):
        return {"value": v}
    raise RuntimeError(f"optimizer state {key!r} of type {type(v).__name__} cannot be saved by offload")


def _scalar_from_json(d: dict, device: torch.device):
    if "dtype" not in d:
        return d["value"]
    dev = device if d["device"] != "cpu" else torch.device("cpu")
    return torch.tensor(d["value"], dtype=getattr(torch, d["dtype"]), device=dev).reshape(d["shape"])


# ----------------------------------------------------------------------------------------------------------

_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(optimizer: torch.optim.Optimizer, *modules: OffloadedEmbedding) -> torch.optim.Optimizer:
    """Make ``optimizer`` write the rows it updates back to the host: the one extra line of a training loop.

    Finds every :class:`OffloadedEmbedding` whose working parameter the optimizer holds (or uses
    ``modules``), creates the host tables of their per-row optimizer state and registers step hooks:
    before ``step`` the rows' state is switched in, after ``step`` rows and state are written back.
    Returns ``optimizer``.

    Raises:
        TypeError: for an optimizer that is not elementwise (LBFGS) or unknown.
        ValueError: a given module's weight is not in the optimizer.
    """
    if not modules:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        modules = tuple(m for m in list(_ALL) if id(m.weight) in held)
    for m in modules:
        if not isinstance(m, OffloadedEmbedding):
            raise TypeError(f"offload.attach takes OffloadedEmbedding modules, got {type(m).__name__}")
        m._attach(optimizer)
    entry = _HOOKED.get(optimizer)
    if entry is None:
        mods: weakref.WeakSet[OffloadedEmbedding] = weakref.WeakSet()

        def pre(opt, args, kwargs):
            for m in list(mods):
                m._pre_step(opt)

        def post(opt, args, kwargs):
            for m in list(mods):
                m._post_step(opt)

        handles = (optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post))
        entry = _HOOKED[optimizer] = (mods, handles)
    for m in modules:
        entry[0].add(m)
    return optimizer


def detach(optimizer: torch.optim.Optimizer, *modules: OffloadedEmbedding) -> None:
    """Undo :func:`attach` (for ``modules``, or all): cached rows are flushed to the host first."""
    entry = _HOOKED.get(optimizer)
    if entry is None:
        return
    mods, handles = entry
    targets = modules or tuple(mods)
    for m in targets:
        m._require_idle("detach")
        m.flush()
        mods.discard(m)
        m._optimizer = None
    if not mods:
        for h in handles:
            h.remove()
        del _HOOKED[optimizer]
