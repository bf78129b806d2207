"""OffloadedEmbedding: an nn.Embedding whose table and optimizer state live in host memory.

Each training step the distinct rows that the step looks up are switched into a small GPU working
parameter (``emb.weight``); any elementwise torch optimizer updates it, and after ``optimizer.step()``
the updated rows *and their optimizer state* are written back. Rows a step does not touch are not
touched at all (lazy, SparseAdam-like semantics), which is what makes the table size free.

The module is a composition of its parts, each a module of its own: the GPU cache of hot rows
(:mod:`offload._gpu_cache`), a step's working set (:mod:`offload._working_set`) and its lookups
(:mod:`offload._lookup`), prefetch (:mod:`offload._emb_prefetch`), optimizer-state switching around
``optimizer.step()`` (:mod:`offload._optim_state`), writes to the host tables (:mod:`offload._host_write`)
and checkpoints (:mod:`offload._checkpoint`). :func:`~offload.attach` and :func:`~offload.detach` are in
:mod:`offload._attach`.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checkpoint, _emb_prefetch, _gpu_cache, _host_write, _lookup, _optim_state, _working_set
from ._emb_prefetch import _Next
from ._gpu_cache import _Cache
from ._index import _as_index
from ._prefetch import Prefetch
from ._table import HostTable
from ._working_set import _Work

__all__ = ["OffloadedEmbedding"]


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
        # evicted rows still to be written back, (ids, their cache records): see _gpu_cache.launch_evicted
        self._evicted: list[tuple[Tensor, Tensor]] = []
        self._next: _Next | None = None
        self._pending: tuple[Tensor, dict[str, Prefetch]] | None = None
        self._loaded: dict | None = None
        if fresh:
            self.reset_parameters()
        _optim_state._ALL.add(self)

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

    # -- the GPU cache (offload._gpu_cache) ------------------------------------------------------------------
    def _cache_capacity(self) -> int:
        return _gpu_cache.capacity(self)

    def _drop_cache(self) -> None:
        _gpu_cache.join(self)
        self._cache = None
        self._next = None
        self._release_pending()

    def _release_pending(self) -> None:
        _emb_prefetch.release_pending(self)

    def cache_stats(self) -> dict[str, int]:
        """``{"capacity", "hits", "misses"}`` counted over distinct rows: a miss is a row that had to come from
        the host (at switch-in, or earlier by :meth:`prefetch`), a hit one that was in the cache already."""
        return _gpu_cache.stats(self)

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host tables."""
        _gpu_cache.flush(self)

    # -- steps: the working set (offload._working_set), prefetch (offload._emb_prefetch) -------------------------
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
        _emb_prefetch.prefetch(self, indices)

    def prepare(self, indices: Tensor) -> None:
        """Switch in the rows of ``indices`` for the coming step (all lookups of the step may then use any
        of them). ``forward`` does this by itself for the first lookup of a step."""
        self._sync_device()
        if self._work is not None:
            _optim_state.end_work(self, check=True)
        _working_set.begin(self, _as_index(indices, self.table.device))

    def forward(self, input: Tensor) -> Tensor:
        self._sync_device()
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"OffloadedEmbedding expects int32 or int64 indices, got {input.dtype}")
        training = torch.is_grad_enabled() and self.weight.requires_grad
        if not training:
            return _lookup.lookup_no_grad(self, input)
        flat = input.reshape(-1).to(self.weight.device, torch.int64)
        if self._work is not None and self._optimizer is None:
            _optim_state.end_work(self, check=True)  # nothing will step these rows: start afresh
        first = self._work is None
        if first:
            local = _working_set.begin(self, flat).view(input.shape)
        else:
            local = _working_set.locate(self, flat).view(input.shape)
        work = self._work
        table = work.chunks[0].leaf if len(work.chunks) == 1 else torch.cat([c.leaf for c in work.chunks])
        if (first and work.runs is not None and len(work.chunks) == 1 and self.padding_idx is None
                and not self.scale_grad_by_freq and table.dtype == torch.float32):
            return _lookup._Lookup.apply(table, local, work.runs)
        pad = None
        if self.padding_idx is not None:
            p = torch.searchsorted(work.sorted_ids, torch.tensor([self.padding_idx], device=flat.device))
            p = p.clamp_(max=work.sorted_ids.numel() - 1)
            if bool(work.sorted_ids[p] == self.padding_idx):
                pad = int(p if work.perm is None else work.perm[p])
        return F.embedding(local, table, pad, None, self.norm_type, self.scale_grad_by_freq, False)

    def _write_rows(self, ids: Tensor, rows: Tensor) -> None:
        """Weight rows only (renormalisation outside a step): into the cache where cached, else the host."""
        _gpu_cache.join(self)
        cache = self._cache
        if cache is not None:
            slots = cache.slot_of.index_select(0, ids)
            hit = slots != cache.capacity
            cache.weight[slots[hit]] = rows[hit]
            cache.dirty[slots[hit]] = True
            ids, rows = ids[~hit], rows[~hit]
        _host_write.commit(ids, [(self.table, rows)])

    # -- the optimizer (offload._optim_state) ---------------------------------------------------------------
    def _attach(self, optimizer: torch.optim.Optimizer) -> None:
        _optim_state.attach_optimizer(self, optimizer)

    def _pre_step(self, optimizer: torch.optim.Optimizer) -> None:
        _optim_state.pre_step(self, optimizer)

    def _post_step(self, optimizer: torch.optim.Optimizer) -> None:
        _optim_state.post_step(self, optimizer)

    # -- checkpoints (offload._checkpoint) -------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Save the table, the per-row optimizer state and the optimizer's scalar state for this table to the
        directory ``path`` (``.npy`` files, ``meta.json`` and a ``manifest.json`` of sizes and CRC-32s),
        atomically: a kill at any moment leaves the old checkpoint or the new one, complete (see
        :mod:`offload.checkpoint_files`).

        Optimizer hyperparameters and other parameters' state are saved the usual way
        (``optimizer.state_dict()``).
        """
        _checkpoint.save(self, path)

    def load(self, path: str | os.PathLike, *, mmap_mode: str | None = "c", pin: bool | None = None,
             verify_checksums: bool = True) -> None:
        """Load a checkpoint written by :meth:`save` into this module.

        The table (and, at the next :func:`attach`, the optimizer state) is memory-mapped from the ``.npy``
        files: ``mmap_mode="c"`` (copy-on-write, the checkpoint is not modified), ``"r+"`` (train in place in
        the files; their checksums are then dropped from the manifest) or ``None`` (read into memory). Call
        :func:`attach` with an optimizer of the saved class afterwards; training then continues exactly where
        it stopped. Every file is checked first against the manifest (sizes, and CRC-32s unless
        ``verify_checksums=False``: a full read of the files); a missing, truncated or altered file raises
        :class:`offload.checkpoint_files.DamagedFileError` naming it, and the module stays as it was.
        """
        _checkpoint.load(self, path, mmap_mode=mmap_mode, pin=pin, verify_checksums=verify_checksums)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, mmap_mode: str | None = "c", device=None,
                        pin: bool | None = None, engine=None, verify_checksums: bool = True,
                        **kwargs) -> OffloadedEmbedding:
        """A new module over a checkpoint written by :meth:`save` (see :meth:`load`); ``kwargs`` go to
        ``__init__`` (``padding_idx``, ``cache_rows``, ...)."""
        return _checkpoint.from_checkpoint(cls, path, mmap_mode=mmap_mode, device=device, pin=pin, engine=engine,
                                           verify_checksums=verify_checksums, **kwargs)
