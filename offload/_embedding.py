"""OffloadedEmbedding: an nn.Embedding whose table and optimizer state live in host memory.

Each training step the distinct rows that the step looks up are switched into a small GPU working
parameter (``emb.weight``); any elementwise torch optimizer updates it, and after ``optimizer.step()``
the updated rows *and their optimizer state* are written back. Rows a step does not touch are not
touched at all (lazy, SparseAdam-like semantics), which is what makes the table size free.

The module composes its parts, each an object of its own module that owns its state: the host tables of a
row (:class:`~offload._row_tables.RowTables`), the GPU cache of hot rows (:class:`~offload._gpu_cache.GpuCache`),
a step's working set (:class:`~offload._working_set.WorkingSet`, with the lookups of :mod:`offload._lookup`),
the prefetcher (:class:`~offload._emb_prefetch.Prefetcher`) and the optimizer-state switcher around
``optimizer.step()`` (:class:`~offload._optim_state.OptimizerState`) and the checkpoint writer
(:class:`~offload._checkpoint.Checkpoints`). :func:`attach` and :func:`detach` (the step hooks) are here.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checkpoint, _lookup, _working_set
from ._checkpoint import Checkpoints
from ._emb_prefetch import Prefetcher
from ._gpu_cache import GpuCache
from ._index import _as_index
from ._optim import row_state_spec
from ._optim_state import OptimizerState
from ._row_tables import RowTables
from ._table import HostTable
from ._working_set import WorkingSet

__all__ = ["OffloadedEmbedding", "attach", "detach"]

_ALL: weakref.WeakSet[OffloadedEmbedding] = weakref.WeakSet()
"""Every OffloadedEmbedding, for :func:`attach` to find those whose weight an optimizer holds."""


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
        self._tables = RowTables(table)
        self.weight = nn.Parameter(torch.empty(0, self.embedding_dim, device=compute, dtype=dtype),
                                   requires_grad=not _freeze)
        self._cache = GpuCache(self._tables, int(cache_rows), cache_bytes)
        self._prefetcher = Prefetcher(self._tables, self._cache)
        self._work = WorkingSet(self._tables, self._cache, self._prefetcher)
        self._optim = OptimizerState(self._tables, self._cache, self._work)
        self._checkpoints = Checkpoints(self._tables, self._optim, self._cache, self._prefetcher)
        if fresh:
            self.reset_parameters()
        _ALL.add(self)

    @property
    def cache_rows(self) -> int:
        """The GPU cache's size in rows (see ``cache_bytes``); read when the cache is next made."""
        return self._cache.rows

    @cache_rows.setter
    def cache_rows(self, rows: int) -> None:
        self._cache.rows = int(rows)

    @property
    def cache_bytes(self) -> int | None:
        """The GPU cache's size in bytes, weight plus per-row state (``None``: ``cache_rows`` decides)."""
        return self._cache.nbytes

    @cache_bytes.setter
    def cache_bytes(self, nbytes: int | None) -> None:
        self._cache.nbytes = nbytes

    @property
    def table(self) -> HostTable:
        """The full table (a :class:`~offload.HostTable`)."""
        return self._tables.weight

    @table.setter
    def table(self, table: HostTable) -> None:
        self._tables.weight = table


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
        return dict(self._tables.states)

    @property
    def working_ids(self) -> Tensor | None:
        """Row ids of the current step's working rows, in ``weight``'s row order (``None`` between steps)."""
        return self._work.working_ids()

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
            self._tables.move_to(dev)
        return dev

    def _require_idle(self, what: str) -> None:
        if self._work.current is not None:
            raise RuntimeError(f"OffloadedEmbedding: {what} in the middle of a step (rows are switched in; "
                               f"call optimizer.step() first)")

    # -- the GPU cache (offload._gpu_cache) ------------------------------------------------------------------
    def _cache_capacity(self) -> int:
        return self._cache.capacity()

    def _drop_cache(self) -> None:
        self._cache.drop()
        self._prefetcher.clear()

    def cache_stats(self) -> dict[str, int]:
        """``{"capacity", "hits", "misses"}`` counted over distinct rows: a miss is a row that had to come from
        the host (at switch-in, or earlier by :meth:`prefetch`), a hit one that was in the cache already."""
        return self._cache.stats()

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host tables."""
        self._cache.flush()

    def release_cache(self) -> None:
        """:meth:`flush` and empty the GPU cache: later steps fetch their rows from the host tables again
        (which a caller may then change directly, through :attr:`table`'s ``data``). Not in the middle of a
        step."""
        self._require_idle("release_cache")
        self.flush()
        self._drop_cache()

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
        self._sync_device()
        self._prefetcher.prefetch(_as_index(indices, self.table.device), self._work.bypassed())

    def prepare(self, indices: Tensor) -> None:
        """Switch in the rows of ``indices`` for the coming step (all lookups of the step may then use any
        of them). ``forward`` does this by itself for the first lookup of a step."""
        self._sync_device()
        if self._work.current is not None:
            self._optim.end_work(self.weight, check=True)
        self._work.begin(_as_index(indices, self.table.device), self.weight, self.max_norm, self.norm_type)

    def forward(self, input: Tensor) -> Tensor:
        self._sync_device()
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"OffloadedEmbedding expects int32 or int64 indices, got {input.dtype}")
        training = torch.is_grad_enabled() and self.weight.requires_grad
        if not training:
            return self._lookup_no_grad(input)
        flat = input.reshape(-1).to(self.weight.device, torch.int64)
        if self._work.current is not None and self._optim.optimizer is None:
            self._optim.end_work(self.weight, check=True)  # nothing will step these rows: start afresh
        first = self._work.current is None
        if first:
            local = self._work.begin(flat, self.weight, self.max_norm, self.norm_type).view(input.shape)
        else:
            local = self._work.locate(flat, self.max_norm, self.norm_type).view(input.shape)
        work = self._work.current
        table = work.chunks[0].leaf if len(work.chunks) == 1 else torch.cat([c.leaf for c in work.chunks])
        if (first and work.runs is not None and len(work.chunks) == 1 and self.padding_idx is None
                and not self.scale_grad_by_freq and table.dtype == torch.float32):
            return _lookup.Lookup.apply(table, local, work.runs)
        pad = None
        if self.padding_idx is not None:
            p = torch.searchsorted(work.sorted_ids, torch.tensor([self.padding_idx], device=flat.device))
            p = p.clamp_(max=work.sorted_ids.numel() - 1)
            if bool(work.sorted_ids[p] == self.padding_idx):
                pad = int(p if work.perm is None else work.perm[p])
        return F.embedding(local, table, pad, None, self.norm_type, self.scale_grad_by_freq, False)

    def _lookup_no_grad(self, input: Tensor) -> Tensor:
        flat = input.reshape(-1).to(self.weight.device, torch.int64)
        rows = _working_set.lookup_no_grad(flat, self._cache, self._work, self.weight, self.max_norm, self.norm_type)
        return rows.view(*input.shape, self.embedding_dim)

    # -- the optimizer (offload._optim_state) ---------------------------------------------------------------
    def _attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Create (or resume from a loaded checkpoint) the host tables of ``optimizer``'s per-row state."""
        group = next((g for g in optimizer.param_groups if any(p is self.weight for p in g["params"])), None)
        if group is None:
            raise ValueError("offload.attach: this OffloadedEmbedding's weight is not among the optimizer's "
                             "parameters (build the optimizer from model.parameters())")
        current = self._optim.optimizer
        if current is optimizer and self._optim.loaded is None:
            return
        if current is not None and current is not optimizer:
            raise RuntimeError("offload.attach: this OffloadedEmbedding is already attached to another "
                               "optimizer (offload.detach it first)")
        spec, self_init = row_state_spec(optimizer, group)
        self._require_idle("attach")
        self.flush()
        self._drop_cache()
        loaded, self._optim.loaded = self._optim.loaded, None
        if loaded is not None:
            tables = _checkpoint.resume_state(self.weight, optimizer, spec, loaded)
        else:
            tables = {k: HostTable(self.num_embeddings, self.embedding_dim, self.table.dtype, device=self.table.device,
                                   pin=self._pin, engine=self._engine, fill=fill) for k, fill in spec.items()}
        self._optim.attach(optimizer, spec, tables, self_init)

    def _padding_rows(self, ids: Tensor) -> Tensor | None:
        """Positions of the padding row among the working rows ``ids`` (``None`` without one): the rows that
        a step leaves untrained."""
        if self.padding_idx is None:
            return None
        return torch.nonzero(ids == self.padding_idx).squeeze(1)

    def _pre_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._optim.pre_step(optimizer, self.weight, self._padding_rows)

    def _post_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._optim.post_step(optimizer, self.weight)

    def _detach(self) -> None:
        self._require_idle("detach")
        self.flush()
        self._optim.optimizer = None

    # -- checkpoints (offload._checkpoint) -------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Save the table, the per-row optimizer state and the optimizer's scalar state for this table to the
        directory ``path`` (``.npy`` files, ``meta.json`` and a ``manifest.json`` of sizes and CRC-32s),
        atomically: a kill at any moment leaves the old checkpoint or the new one, complete (see
        :mod:`offload.checkpoint_files`).

        Optimizer hyperparameters and other parameters' state are saved the usual way
        (``optimizer.state_dict()``).
        """
        self._require_idle("save")
        self._checkpoints.save(path, self.weight, self.padding_idx)

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
        self._require_idle("load")
        optimizer = self._checkpoints.load(path, self.weight, engine=self._engine, mmap_mode=mmap_mode, pin=pin,
                                           verify_checksums=verify_checksums)
        if optimizer is not None:
            self._attach(optimizer)  # resumes the checkpoint's optimizer state

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, mmap_mode: str | None = "c", device=None,
                        pin: bool | None = None, engine=None, verify_checksums: bool = True,
                        **kwargs) -> OffloadedEmbedding:
        """A new module over a checkpoint written by :meth:`save` (see :meth:`load`); ``kwargs`` go to
        ``__init__`` (``padding_idx``, ``cache_rows``, ...)."""
        table, meta, files = _checkpoint.open_checkpoint(path, mmap_mode=mmap_mode, verify_checksums=verify_checksums,
                                                         device=device, pin=pin, engine=engine)
        kwargs.setdefault("padding_idx", meta["padding_idx"])
        emb = cls(meta["num_embeddings"], meta["embedding_dim"], device=device, dtype=getattr(torch, meta["dtype"]),
                  table=table, pin=pin, engine=engine, **kwargs)
        emb._optim.loaded = _checkpoint.resumable(files, meta, mmap_mode=mmap_mode, device=emb.table.device, pin=pin,
                                                  engine=engine)
        files.check_unchanged()  # never the tables of two saves
        return emb


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
        m._detach()
        mods.discard(m)
    if not mods:
        for h in handles:
            h.remove()
        del _HOOKED[optimizer]
