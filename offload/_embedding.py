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

from . import _uva
from ._optim import row_state_spec
from ._table import HostTable, Prefetch, _check_bounds

__all__ = ["OffloadedEmbedding", "attach", "detach"]

_INT64_MAX = torch.iinfo(torch.int64).max
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


def _commit(ids: Tensor, writes: list[tuple[HostTable, Tensor]]) -> None:
    """Write ``rows`` to rows ``ids`` of every table, all or nothing.

    Phase 1 copies every table's rows to host memory (where GPU faults, out-of-memory and the like can
    happen); only when all copies are complete does phase 2 write them into the tables, a plain memory copy
    per table with signals held back. An exception in phase 1 leaves every table as it was.
    """
    if ids.numel() == 0:
        return
    engines = [t.resolved_engine("scatter") for t, _ in writes] if ids.device.type == "cuda" else []
    if engines and all(e in ("uva", "hybrid") for e in engines):
        # Stream-ordered kernels writing host memory: validate and compile everything first, so that
        # nothing can fail between the first launch and the last.
        ids = ids.contiguous()
        rows_list = [rows.detach().to(t.dtype).contiguous() for t, rows in writes]
        for (t, _), rows in zip(writes, rows_list, strict=True):
            _uva.check_and_compile(t._data, ids, rows)
        ids_cpu = ids.cpu() if "hybrid" in engines else None
        with _signals_deferred():
            for (t, _), rows, engine in zip(writes, rows_list, engines, strict=True):
                t._scatter_unique(ids, ids_cpu, rows, engine)
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
    """GPU-resident copies of hot rows (weight and per-row optimizer state), written back on eviction."""

    def __init__(self, capacity: int, num_rows: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.capacity = capacity
        self.weight = torch.empty(capacity, dim, dtype=dtype, device=device)
        self.states: dict[str, Tensor] = {}
        self.slot_of = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.last_use = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.clock = 0
        self.hits = 0
        self.misses = 0


@dataclass
class _Chunk:
    ids: Tensor  # distinct row ids (device)
    slots: Tensor | None  # cache slot per row, -1 = not cached (bypass)
    states: dict[str, Prefetch] = field(default_factory=dict)  # rows of the state tables being gathered
    admit: Tensor | None = None  # positions (into ids) of rows admitted to the cache this chunk
    admit_slots: Tensor | None = None
    leaf: Tensor | None = None  # the rows as the autograd leaf of the lookups (chunks > 0 are folded in before step)


@dataclass
class _Work:
    chunks: list[_Chunk]
    sorted_ids: Tensor
    perm: Tensor
    version: int = 0
    renormed: bool = False
    folded: bool = False
    state_rows: dict[str, Tensor] = field(default_factory=dict)
    pad: tuple | None = None


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
            the host when evicted (least recently used first). ``0`` disables the cache.
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
        self._pending: tuple[Tensor, dict[str, Prefetch]] | None = None
        self._loaded: dict | None = None
        if fresh:
            self.reset_parameters()
        _ALL.add(self)

    # -- parameters and state dicts --------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Fill the table from N(0, 1), the padding row with zeros (as ``nn.Embedding``); clears the cache."""
        self._require_idle("reset_parameters")
        self._cache = None
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
        self._cache = None
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
            self._cache = None
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
            self._cache = _Cache(cap, self.num_embeddings, self.embedding_dim, self.table.dtype, self.table.device)
            for key in self._spec:
                self._cache.states[key] = torch.empty_like(self._cache.weight)
        return self._cache

    def cache_stats(self) -> dict[str, int]:
        """``{"capacity", "hits", "misses"}`` counted over row lookups at switch-in."""
        c = self._cache
        return {"capacity": self._cache_capacity(), "hits": c.hits if c else 0, "misses": c.misses if c else 0}

    def _evict_write_back(self, cache: _Cache, slots: Tensor) -> None:
        ids = cache.ids[slots]
        keep = (ids >= 0) & cache.dirty[slots]
        if bool(keep.any()):
            s = slots[keep]
            writes = [(self.table, cache.weight[s])]
            writes += [(self._state_tables[k], cache.states[k][s]) for k in self._spec]
            _commit(ids[keep], writes)
        valid = ids >= 0
        cache.slot_of[ids[valid]] = -1
        cache.ids[slots] = -1
        cache.dirty[slots] = False

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host tables."""
        c = self._cache
        if c is None:
            return
        slots = torch.nonzero(c.dirty & (c.ids >= 0)).squeeze(1)
        if slots.numel():
            writes = [(self.table, c.weight[slots])]
            writes += [(self._state_tables[k], c.states[k][slots]) for k in self._spec]
            _commit(c.ids[slots], writes)
            c.dirty[slots] = False

    # -- fetching rows ---------------------------------------------------------------------------------------
    def _fetch(self, ids: Tensor) -> tuple[_Chunk, Tensor]:
        """Rows ``ids`` (distinct, checked) for a new chunk of the working set: from the cache, a pending
        :meth:`prefetch`, or the host tables; per-row state starts gathering on a side stream."""
        cache = self._get_cache()
        chunk = _Chunk(ids=ids, slots=None)
        pending, self._pending = self._pending, None
        if cache is None:
            miss_ids, miss_pos = ids, None
        else:
            slots = cache.slot_of[ids].long()
            miss = slots < 0
            miss_pos = torch.nonzero(miss).squeeze(1)
            miss_ids = ids[miss_pos]
            cache.misses += miss_ids.numel()
            cache.hits += ids.numel() - miss_ids.numel()
            chunk.slots = slots
        # rows not in the cache: from the prefetch when it holds exactly them, else from the host
        use_pending = (pending is not None and pending[0].numel() == miss_ids.numel()
                       and bool(torch.equal(pending[0], miss_ids)))
        if use_pending:
            miss_rows = pending[1]["weight"].rows()
            state_pf = {k: pending[1][k] for k in self._spec if k in pending[1]}
            pending[1]["weight"].release()
        else:
            if pending is not None:
                for p in pending[1].values():
                    p.release()
            miss_rows = torch.empty(miss_ids.numel(), self.embedding_dim, dtype=self.table.dtype,
                                    device=self.table.device)
            self.table._gather_unique(miss_ids, None, miss_rows, self.table.resolved_engine("gather"))
            state_pf = {}
        for k in self._spec:
            if k not in state_pf:
                state_pf[k] = self._state_tables[k].prefetch(miss_ids, _checked=True)
        chunk.states = state_pf
        if cache is None:
            return chunk, miss_rows
        n_miss = miss_ids.numel()
        hit = chunk.slots >= 0
        cache.last_use[chunk.slots[hit]] = cache.clock  # this step's cached rows are not evicted for its misses
        if n_miss:
            key = torch.where(cache.last_use == cache.clock, torch.full_like(cache.last_use, _INT64_MAX),
                              cache.last_use)
            n_free = int((key != _INT64_MAX).sum())
            n_admit = min(n_miss, n_free)
            if n_admit:
                victims = torch.topk(key, n_admit, largest=False).indices
                self._evict_write_back(cache, victims)
                admit_ids = miss_ids[:n_admit]
                cache.weight[victims] = miss_rows[:n_admit]
                cache.ids[victims] = admit_ids
                cache.slot_of[admit_ids] = victims.to(torch.int32)
                cache.dirty[victims] = False
                chunk.slots[miss_pos[:n_admit]] = victims
                chunk.admit = miss_pos[:n_admit]
                chunk.admit_slots = victims
                cache.last_use[victims] = cache.clock
        rows = cache.weight.index_select(0, chunk.slots.clamp(min=0))
        if n_miss:
            rows[miss_pos] = miss_rows
        return chunk, rows

    def _resolve_states(self, chunk: _Chunk) -> dict[str, Tensor]:
        """Per-row state of a chunk's rows (waits for its side-stream gathers); admitted rows' state is
        placed in the cache."""
        out = {}
        cache = self._cache
        for k in self._spec:
            p = chunk.states[k]
            miss_rows = p.rows()
            p.release()
            if chunk.slots is None:
                out[k] = miss_rows
                continue
            if chunk.admit is not None and chunk.admit.numel():
                cache.states[k][chunk.admit_slots] = miss_rows[: chunk.admit.numel()]
            rows = cache.states[k].index_select(0, chunk.slots.clamp(min=0))
            miss_pos = torch.nonzero(self._miss_mask(chunk)).squeeze(1)
            if miss_pos.numel():
                rows[miss_pos] = miss_rows
            out[k] = rows
        chunk.states = {}
        chunk.admit = chunk.admit_slots = None
        return out

    @staticmethod
    def _miss_mask(chunk: _Chunk) -> Tensor:
        """Rows of the chunk that came from the host (admitted or bypassing), in ``ids`` order."""
        mask = chunk.slots < 0
        if chunk.admit is not None:
            mask[chunk.admit] = True
        return mask

    def prefetch(self, indices: Tensor) -> None:
        """Start gathering the rows (and their optimizer state) that the next step will look up, on a side
        stream, while the current step computes. The next switch-in uses them when its rows not in the cache
        are exactly these; rows written back in between are patched in, so they are never stale."""
        ids, _ = self.table.prepare(indices)
        cache = self._cache
        if cache is not None:
            ids = ids[cache.slot_of[ids] < 0]
        if self._pending is not None:
            for p in self._pending[1].values():
                p.release()
        handles = {"weight": self.table.prefetch(ids, _checked=True)}
        for k in self._spec:
            handles[k] = self._state_tables[k].prefetch(ids, _checked=True)
        self._pending = (ids, handles)

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
        self._begin(indices)

    def _begin(self, indices: Tensor) -> None:
        ids, _ = self.table.prepare(indices)
        cache = self._get_cache()
        if cache is not None:
            cache.clock += 1
        chunk, rows = self._fetch(ids)
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
        self._work = _Work(chunks=[chunk], sorted_ids=ids, perm=torch.arange(ids.numel(), device=ids.device),
                           renormed=self.max_norm is not None)
        self._work.version = self.weight._version

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
            new_ids = torch.unique(new)
            lo, hi = torch.stack([new_ids[0], new_ids[-1]]).tolist()
            _check_bounds(lo, hi, self.num_embeddings)
            if work.folded:
                raise RuntimeError("OffloadedEmbedding: new rows looked up after the optimizer's step began")
            chunk, rows = self._fetch(new_ids)
            if self.max_norm is not None:
                self._renorm(rows)
            chunk.leaf = rows.requires_grad_(True)
            work.chunks.append(chunk)
            self._index_sorted(work)
            n = work.sorted_ids.numel()
            pos = torch.searchsorted(work.sorted_ids, flat).clamp_(max=n - 1)
        return work.perm[pos]

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
        if self._work is None:
            self._begin(flat)
        local = self._locate(flat).view(input.shape)
        work = self._work
        table = work.chunks[0].leaf if len(work.chunks) == 1 else torch.cat([c.leaf for c in work.chunks])
        pad = None
        if self.padding_idx is not None:
            p = torch.searchsorted(work.sorted_ids, torch.tensor([self.padding_idx], device=flat.device))
            p = p.clamp_(max=work.sorted_ids.numel() - 1)
            if bool(work.sorted_ids[p] == self.padding_idx):
                pad = int(work.perm[p])
        return F.embedding(local, table, pad, None, self.norm_type, self.scale_grad_by_freq, False)

    def _lookup_no_grad(self, input: Tensor) -> Tensor:
        """A lookup that trains nothing: rows from the working set, the cache or the host."""
        flat = input.reshape(-1).to(self.weight.device, torch.int64)
        with torch.no_grad():
            ids, inverse = self.table.prepare(flat)
            cache = self._cache
            if cache is None:
                rows = torch.empty(ids.numel(), self.embedding_dim, dtype=self.table.dtype, device=self.weight.device)
                self.table._gather_unique(ids, None, rows, self.table.resolved_engine("gather"))
            else:
                slots = cache.slot_of[ids].long()
                rows = cache.weight.index_select(0, slots.clamp(min=0))
                miss = torch.nonzero(slots < 0).squeeze(1)
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
                rows[found] = step_rows.detach().index_select(0, work.perm[pos[found]])
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
        cache = self._cache
        if cache is not None:
            slots = cache.slot_of[ids].long()
            hit = slots >= 0
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
        slots = torch.cat([c.slots for c in work.chunks]) if len(work.chunks) > 1 else work.chunks[0].slots
        cached = slots >= 0
        cs = slots[cached]
        cache.weight[cs] = weight_rows[cached]
        for k in self._spec:
            cache.states[k][cs] = state_rows[k][cached]
        cache.dirty[cs] = True
        sel = torch.nonzero(~cached).squeeze(1)
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
                self._resolve_states(c)  # admitted rows' state into the cache
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
        self._cache = None
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
        self._cache = None
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
