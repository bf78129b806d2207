"""Tables of rows in host memory that the GPU gathers from and scatters to.

:class:`HostTable` is the building block of the package: a ``(num_rows, dim)`` table in page-locked host
memory with ``gather(idx)`` (rows to the compute device) and ``scatter(idx, rows)`` (rows back), through
one of the engines (see :mod:`offload._engine`), plus :meth:`HostTable.prefetch` on a side stream. It checks
and deduplicates indices and hands each call's core to an engine, with its storage
(:class:`~offload._storage.HostStorage`: the host tensor and what keeps GPU accesses, deferred writes and
pending prefetches in order). :class:`~offload.HostArray` is the read-mostly variant for dataset rows of any
shape.
"""

from __future__ import annotations

import contextlib
import os
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from . import _choice, _engine_cpu, _npy
from ._choice import Engine, _check_engine, engine_choice, get_engine
from ._engine import ENGINES
from ._index import (
    _as_index,
    _check_bounds,
    _check_host_bounds,
    _default_device,
    _device_index,
    _host_flat,
    _on_host,
    check_unique,
    sort_checked,
)
from ._memory import allocate_host
from ._prefetch import Prefetch
from ._storage import HostStorage

__all__ = ["HostTable", "table_over"]


class HostTable:
    """A ``(num_rows, dim)`` table in page-locked host memory, gathered to and scattered from the GPU.

    Args:
        num_rows: number of rows.
        dim: row length.
        dtype: element type (any torch dtype; rows are moved as raw bytes).
        device: the compute device that :meth:`gather` returns rows on (default: the current CUDA device,
            or the CPU on a machine without CUDA).
        pin: page-lock the memory (default: whenever CUDA is available). Pinning is what makes
            asynchronous copies and the ``"uva"`` engine possible.
        engine: ``"auto"``, ``"uva"``, ``"cpu"`` or ``"hybrid"``; ``None`` follows :func:`get_engine`.
        fill: initial value of every element (``None`` leaves the memory uninitialised).

    Engines:
        ``"uva"`` launches a CuPy kernel that reads (writes) the page-locked rows directly over PCIe.
        ``"cpu"`` copies rows into page-locked staging memory chunk by chunk, with torch's multi-threaded
        indexing or with numpy on a pool of threads (whichever :func:`engine_choice` measured faster, see
        :data:`~offload._row_copy.CPU_COPY`), and copies each chunk to the GPU as soon as its rows are there,
        so CPU gathering and the DMA overlap (scatter is the reverse: each chunk's rows are written into the
        table as soon as its copy from the GPU has landed).
        ``"hybrid"`` runs both at once on disjoint rows: the CPU engine moves a large call's lone rows, those
        with no other row of the call within the same 128 KiB of the table, and the UVA kernel the rest
        (see :data:`~offload._engine_hybrid.LONE_BLOCK_BYTES`). Its split costs a second synchronisation and
        the CPU engine's fixed cost, which on the machines measured outweighed what the kernel gains
        (:func:`engine_choice` does not pick it).
        ``"auto"`` uses :func:`engine_choice`, measured once per device, apart for indices on the GPU and
        indices in host memory. On a CPU compute device every engine is plain CPU indexing.

    Indices in host memory (a CPU tensor, a numpy array, a list) with the ``"cpu"`` engine never wait for
    the GPU: they are checked on the host, the rows are copied into staging memory while the previous
    call's copy to the GPU may still run, and the call returns with its own copy queued on the current
    stream. Such a gather copies the rows as indexed (repeats included: deduplicating on the host costs more
    than it saves), and such a scatter writes the rows into the table after it returns (see
    :data:`~offload._staging.DEFER_SCATTER`), before anything else uses the table.

    Indices are checked before any engine touches host memory: they must be integers in
    ``[0, num_rows)``, else :class:`IndexError` names the first bad value and the table size. ``gather``
    deduplicates them (each row crosses PCIe once); ``scatter`` refuses duplicates.

    GPU work is ordered on the current CUDA stream. ``"uva"`` writes land when the stream reaches them,
    deferred ``"cpu"`` writes at the table's next use; every CPU-side access of the table (the ``"cpu"``
    engine, :attr:`data` readers that call :meth:`synchronize`, :meth:`save_npy`) waits for them first.

    Batched layers store B models' tables as one ``HostTable`` of ``B * rows`` rows and address row ``i``
    of model ``b`` as ``b * rows + i`` (see :meth:`block`).

    Examples:
        >>> t = HostTable(1000, 8)
        >>> t.scatter(torch.tensor([3, 7]), torch.ones(2, 8, device=t.device))
        >>> t.gather(torch.tensor([[7, 3], [3, 0]])).shape
        torch.Size([2, 2, 8])
    """

    def __init__(self, num_rows: int, dim: int, dtype: torch.dtype = torch.float32, *,
                 device: torch.device | str | None = None, pin: bool | None = None,
                 engine: Engine | None = None, fill: float | None = 0.0):
        num_rows, dim = int(num_rows), int(dim)
        if num_rows < 0 or dim <= 0:
            raise ValueError(f"HostTable needs num_rows >= 0 and dim > 0, got ({num_rows}, {dim})")
        data = allocate_host((num_rows, dim), dtype, f"a {num_rows} x {dim} {dtype} table")
        if fill is not None:
            data.fill_(fill)
        self._init(data, device=device, pin=pin, engine=engine)

    # -- construction -----------------------------------------------------------------------------------
    def _init(self, data: Tensor, *, device, pin, engine, keepalive: object = None, writable: bool = True) -> None:
        device = _default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"HostTable device {device} requested but CUDA is not available")
        self.engine = None if engine is None else _check_engine(engine)
        self._storage = HostStorage(data, device, pin=pin, keepalive=keepalive, writable=writable)
        self.num_rows, self.dim = data.shape
        self.dtype = data.dtype

    @classmethod
    def from_tensor(cls, tensor: Tensor, *, device=None, pin: bool | None = None, engine: Engine | None = None,
                    copy: bool = True) -> HostTable:
        """A table holding ``tensor``'s rows (2-D). ``copy=False`` uses a contiguous CPU ``tensor`` in place."""
        if tensor.dim() != 2:
            raise ValueError(f"HostTable.from_tensor needs a 2-D tensor (rows, dim), got shape {tuple(tensor.shape)}")
        if copy or tensor.device.type != "cpu" or not tensor.is_contiguous():
            if not copy:
                raise ValueError("copy=False needs a contiguous CPU tensor")
            data = allocate_host(tuple(tensor.shape), tensor.dtype, f"a {tuple(tensor.shape)} {tensor.dtype} table")
            data.copy_(tensor.detach())
        else:
            data = tensor.detach()
        self = cls.__new__(cls)
        self._init(data, device=device, pin=pin, engine=engine)
        return self

    @classmethod
    def from_npy(cls, path: str | os.PathLike, *, mmap_mode: Literal["r+", "c", "r"] | None = "r+",
                 dtype: torch.dtype | None = None, device=None, pin: bool | None = None,
                 engine: Engine | None = None) -> HostTable:
        """A table over a 2-D ``.npy`` file.

        With ``mmap_mode`` (default ``"r+"``: writes go to the file) the file is memory-mapped, not read, so a
        table larger than half of RAM loads without a second copy; ``"c"`` is copy-on-write (the file stays
        as it is), ``"r"`` read-only (:meth:`scatter` then fails). ``mmap_mode=None`` reads it into memory.
        ``pin`` defaults to pinning only a table read into memory; ``pin=True`` page-locks the mapping
        itself (it must then fit in RAM). ``dtype`` reinterprets the stored bytes (``.npy`` has no
        bfloat16: such tables are stored as uint16 and loaded with ``dtype=torch.bfloat16``).
        """
        data, keepalive = _npy.read_array(path, mmap_mode=mmap_mode, dtype=dtype)
        if pin is None:
            pin = mmap_mode is None and torch.cuda.is_available()
        self = cls.__new__(cls)
        self._init(data, device=device, pin=pin, engine=engine, keepalive=keepalive, writable=mmap_mode != "r")
        return self

    def save_npy(self, path: str | os.PathLike) -> None:
        """Write the table to ``path`` as ``.npy`` (atomically: a temporary file renamed into place).

        bfloat16 is stored as uint16 (load it back with ``from_npy(path, dtype=torch.bfloat16)``).
        """
        _npy.save_array(self.data, path)

    def close(self) -> None:
        """Write a deferred scatter and unpin the memory (the table stays readable on the CPU; the ``"uva"``
        engine no longer applies)."""
        storage = getattr(self, "_storage", None)  # (None: the constructor failed)
        if storage is not None:
            storage.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- plain accessors ----------------------------------------------------------------------------------
    @property
    def storage(self) -> HostStorage:
        """The table's rows in host memory and what orders access to them: what its engine is handed (see
        :mod:`offload._engine`)."""
        return self._storage

    @property
    def device(self) -> torch.device:
        """The compute device that :meth:`gather` returns rows on."""
        return self._storage.device

    @device.setter
    def device(self, device: torch.device) -> None:
        self._storage.device = device

    @property
    def pinned(self) -> bool:
        """Whether the host memory is page-locked."""
        return self._storage.pinned

    @property
    def shape(self) -> torch.Size:
        """``(num_rows, dim)``."""
        return torch.Size((self.num_rows, self.dim))

    @property
    def nbytes(self) -> int:
        """The table's size in host memory, in bytes."""
        return self.num_rows * self._storage.row_bytes

    @property
    def data(self) -> Tensor:
        """The host tensor itself, after pending GPU writes to it have landed."""
        self.synchronize()
        return self._storage.tensor

    def block(self, index: int, rows: int) -> Tensor:
        """Rows ``index * rows`` to ``(index + 1) * rows`` of the host tensor (model ``index``'s table when B
        models' ``rows``-row tables are stacked), after pending GPU writes have landed."""
        if rows <= 0 or index < 0 or (index + 1) * rows > self.num_rows:
            raise IndexError(f"block {index} of {rows} rows is outside a table of {self.num_rows} rows")
        return self.data[index * rows:(index + 1) * rows]

    def __repr__(self) -> str:
        return (f"HostTable({self.num_rows}, {self.dim}, dtype={self.dtype}, device={self.device}, "
                f"pinned={self.pinned}, engine={self.engine or get_engine()!r})")

    def synchronize(self, *, reads: bool = True) -> None:
        """Wait until the GPU-side writes (and, with ``reads``, reads) of this table launched so far finished,
        and write a deferred scatter into the table (see :data:`~offload._staging.DEFER_SCATTER`), raising its
        error if that failed."""
        self._storage.synchronize(reads=reads)

    # -- engines -----------------------------------------------------------------------------------------
    def resolved_engine(self, op: Literal["gather", "scatter"], *, host_indices: bool = False) -> str:
        """The engine that ``op`` uses now: ``"uva"``, ``"cpu"`` or ``"hybrid"``, for indices on the GPU or
        (``host_indices=True``) in host memory."""
        want = self.engine or get_engine()
        if want != "auto":
            ENGINES[want].check(self._storage)
            return want
        if self.device.type != "cuda" or not self.pinned:
            return "cpu"
        return engine_choice(self.device)[f"{op} host" if host_indices else op]

    def _host_route(self, idx, op: str) -> bool:
        """Whether ``op`` of ``idx`` takes the CPU engine's path for host indices (see the class notes)."""
        return (self.device.type == "cuda" and _on_host(idx)
                and self.resolved_engine(op, host_indices=True) == "cpu")

    def _gather_unique(self, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor, engine: str,
                       pos: Tensor | None = None) -> None:
        """``out[:] = rows[uniq]`` (``out[pos[i]] = rows[uniq[i]]`` with ``pos``, a permutation of the rows of
        ``out`` on the device); ``uniq`` checked, on ``self.device``; ``uniq_cpu`` its CPU copy or None."""
        n = uniq.numel()
        if n == 0:
            return
        eng = ENGINES[engine]
        if pos is not None and (not eng.by_position or self.device.type != "cuda"):
            rows = torch.empty_like(out)
            self._gather_unique(uniq, uniq_cpu, rows, engine)
            out.index_copy_(0, pos, rows)
            return
        storage = self._storage
        storage.land()
        if self.device.type != "cuda":
            _engine_cpu.host_rows(storage, "gather", uniq.cpu() if uniq_cpu is None else uniq_cpu, out)
            return
        eng.gather(storage, uniq, uniq_cpu, out, pos)

    def _scatter_unique(self, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor, engine: str,
                        pos: Tensor | None = None) -> None:
        """``table[uniq] = rows`` (``table[uniq[i]] = rows[pos[i]]`` with ``pos``, a permutation of the rows
        of ``rows`` on the device); ``uniq`` checked and distinct, on ``self.device``."""
        storage = self._storage
        storage.check_writable()
        n = uniq.numel()
        if n == 0:
            return
        eng = ENGINES[engine]
        if pos is not None and (not eng.by_position or self.device.type != "cuda"):
            rows, pos = rows.index_select(0, pos), None
        storage.land()
        if self.device.type != "cuda":
            _engine_cpu.host_rows(storage, "scatter", uniq.cpu() if uniq_cpu is None else uniq_cpu, rows)
            storage.patch_prefetches(uniq, rows)
            return
        rows = rows.to(self.dtype).contiguous()
        eng.scatter(storage, uniq, uniq_cpu, rows, pos)
        if storage.watched:
            storage.patch_prefetches(uniq, rows if pos is None else rows.index_select(0, pos))

    # -- public gather / scatter -------------------------------------------------------------------------
    def gather_distinct(self, ids: Tensor, out: Tensor, *, engine: str | None = None) -> None:
        """``out[:] = rows[ids]`` for ``ids`` as :meth:`prepare` returns them (distinct, checked), unchecked."""
        self._gather_unique(ids, None, out, engine or self.resolved_engine("gather"))

    def scatter_distinct(self, ids: Tensor, rows: Tensor, *, engine: str | None = None) -> None:
        """``table[ids] = rows`` for distinct, checked ``ids`` on :attr:`device` (as :meth:`prepare` returns
        them), unchecked."""
        self._scatter_unique(ids, None, rows, engine or self.resolved_engine("scatter"))

    def prepare(self, idx, *, unique: bool = False) -> tuple[Tensor, Tensor | None]:
        """Check and deduplicate indices: returns ``(rows, inverse)`` with ``rows`` the distinct indices,
        sorted, on :attr:`device` and ``inverse`` such that ``rows[inverse]`` is the flattened input
        (``None`` when ``unique=True``: the caller promises distinct indices, which are kept in order).

        Raises:
            TypeError: non-integer indices.
            IndexError: an index outside ``[0, num_rows)``, naming it and the table size.
        """
        flat = _as_index(idx, self.device)
        if flat.numel() == 0:
            return flat, (None if unique else flat)
        if unique:
            check_unique(flat, self.num_rows)
            return flat, None
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        lo, hi = torch.stack([uniq[0], uniq[-1]]).tolist()
        _check_bounds(lo, hi, self.num_rows)
        return uniq, inverse

    def _gather_ordered(self, flat: Tensor, ascending: bool, out: Tensor, engine: str) -> None:
        """``out[:] = rows[flat]`` for checked, distinct, non-empty ``flat``. Indices out of order are sorted
        first on a CUDA device: rows read in address order cost far fewer host address translations (the
        UVA kernel reads sorted random rows of a 5 GB table twice as fast as the same rows unsorted); the
        kernel writes each row to its place in ``out``."""
        if ascending or self.device.type != "cuda" or flat.numel() < 2:
            self._gather_unique(flat, None, out, engine)
            return
        keys, order = sort_checked(flat, self.num_rows)
        self._gather_unique(keys, None, out, engine, pos=order)

    def gather(self, idx, *, unique: bool = False, out: Tensor | None = None) -> Tensor:
        """Rows ``idx`` on :attr:`device`, shaped ``idx.shape + (dim,)``.

        Args:
            idx: integer indices of any shape (on any device; see the class notes for host indices).
            unique: promise that ``idx`` holds no duplicates (skips deduplication; bounds are still checked).
            out: optional contiguous ``(idx.numel(), dim)`` tensor on :attr:`device` to write into.
        """
        shape = tuple(idx.shape) if isinstance(idx, Tensor) else tuple(np.shape(idx))
        if self._host_route(idx, "gather"):
            return self._gather_host_indices(idx, out).view(*shape, self.dim)
        if unique:
            flat = _as_index(idx, self.device)
            n = flat.numel()
            ascending = check_unique(flat, self.num_rows) if n else True
            engine = self.resolved_engine("gather")
            rows = self._rows_out(out, n)
            if n:
                self._gather_ordered(flat, ascending, rows, engine)
            return rows.view(*shape, self.dim)
        uniq, inverse = self.prepare(idx)
        engine = self.resolved_engine("gather")
        rows = torch.empty(uniq.numel(), self.dim, dtype=self.dtype, device=self.device)
        self._gather_unique(uniq, None, rows, engine)
        if out is not None:
            _check_out(self, out, inverse.numel())
            torch.index_select(rows, 0, inverse, out=out)
            rows = out
        else:
            rows = rows.index_select(0, inverse)
        return rows.view(*shape, self.dim)

    def _gather_host_indices(self, idx, out: Tensor | None) -> Tensor:
        """:meth:`gather` of indices in host memory (any, repeats included) by the CPU engine: checked on the
        host and copied as indexed, with no GPU synchronisation. Returns the ``(n, dim)`` rows (``out`` if
        given)."""
        flat, _ = _host_flat(idx)
        n = flat.numel()
        rows = self._rows_out(out, n)
        if n:
            _check_host_bounds(flat, self.num_rows)
            _engine_cpu.gather_host(self._storage, flat, rows)
        return rows

    def _rows_out(self, out: Tensor | None, n: int) -> Tensor:
        """``out`` checked to hold ``n`` rows, or a new tensor of ``n`` rows on :attr:`device`."""
        if out is None:
            return torch.empty(n, self.dim, dtype=self.dtype, device=self.device)
        _check_out(self, out, n)
        return out

    def scatter(self, idx, rows: Tensor, *, unique: bool = False) -> None:
        """Write ``rows`` (shaped ``idx.shape + (dim,)``) to rows ``idx`` of the table.

        Indices must be distinct (checked unless ``unique=True``: then the caller promises it). Indices on
        the GPU are written in ascending index order (sorted on the device first when they are not), which
        is what makes writes to a large table fast; host indices with the ``"cpu"`` engine in the order
        given (their distinctness is checked with a sort on the host), after the call returns (see the
        class notes).
        """
        flat_rows = rows.reshape(-1, self.dim) if rows.dim() >= 1 and rows.shape[-1] == self.dim else None
        n_idx = idx.numel() if isinstance(idx, Tensor) else int(np.size(idx))
        if flat_rows is None or flat_rows.shape[0] != n_idx:
            raise ValueError(f"scatter: rows must have shape idx.shape + ({self.dim},) = "
                             f"({n_idx}, {self.dim}) after flattening, got {tuple(rows.shape)}")
        if self._host_route(idx, "scatter"):
            _engine_cpu.scatter_host_indices(self._storage, idx, flat_rows, unique)
            return
        flat = _as_index(idx, self.device)
        n = flat.numel()
        if n == 0:
            return
        if unique:
            if check_unique(flat, self.num_rows):
                keys, order = flat, None
            else:
                keys, order = sort_checked(flat, self.num_rows)
        else:
            keys, order = torch.sort(flat)
            dup = (keys[1:] == keys[:-1]).any() if n > 1 else torch.zeros((), dtype=torch.bool, device=flat.device)
            lo, hi, dup = torch.stack([keys[0], keys[-1], dup.long()]).tolist()
            _check_bounds(lo, hi, self.num_rows)
            if dup:
                first = int(keys[1:][keys[1:] == keys[:-1]][0])
                raise ValueError(f"scatter needs distinct indices, but index {first} appears more than once")
        self._scatter_unique(keys, None, flat_rows.to(self.device), self.resolved_engine("scatter"), pos=order)

    # -- prefetch ----------------------------------------------------------------------------------------
    def prefetch(self, idx, *, unique: bool = False, _checked: bool = False) -> Prefetch:
        """Start gathering rows ``idx`` on a side stream; :meth:`Prefetch.rows` waits and returns them.

        Rows scattered to the table after this call (and before :meth:`Prefetch.release`) are patched
        into the prefetched copy, so it never goes stale.
        """
        return _start_prefetch(self, idx, unique, _checked)


def _start_prefetch(table: HostTable, idx, unique: bool, checked: bool) -> Prefetch:
    """:meth:`HostTable.prefetch`: the rows gathered on the table's side stream (on a CPU compute device: now),
    the handle watched by the table's storage."""
    if unique and not checked and table._host_route(idx, "gather"):
        return _prefetch_host(table, idx)
    storage = table.storage
    if table.device.type != "cuda":
        uniq, inverse, ascending = _prefetch_indices(table, idx, unique, checked)
        buf = torch.empty(uniq.numel() + 1, table.dim, dtype=table.dtype)
        if uniq.numel():
            table._gather_ordered(uniq, ascending, buf[:-1], "cpu")
        return Prefetch(storage, uniq, inverse, buf, None, sorted_=inverse is not None or checked)
    side = storage.side_stream()
    side.wait_stream(torch.cuda.current_stream(table.device))
    with torch.cuda.stream(side):
        uniq, inverse, ascending = _prefetch_indices(table, idx, unique, checked)
        buf = torch.empty(uniq.numel() + 1, table.dim, dtype=table.dtype, device=table.device)
        if uniq.numel():
            table._gather_ordered(uniq, ascending, buf[:-1], table.resolved_engine("gather"))
        ev = torch.cuda.Event()
        ev.record(side)
    return Prefetch(storage, uniq, inverse, buf, ev, sorted_=inverse is not None or checked)


def _prefetch_host(table: HostTable, idx) -> Prefetch:
    """:func:`_start_prefetch` of distinct host indices with the CPU engine: checked on the host, the rows
    staged now, their copy (and the indices' copy, for patching) queued on the side stream."""
    flat, _ = _host_flat(idx)
    n = flat.numel()
    if n:
        _check_host_bounds(flat, table.num_rows)
    storage = table.storage
    side = storage.side_stream()
    side.wait_stream(torch.cuda.current_stream(table.device))
    with torch.cuda.stream(side):
        buf = torch.empty(n + 1, table.dim, dtype=table.dtype, device=table.device)
        if n:
            _engine_cpu.gather_host(storage, flat, buf[:-1])
        ids = _device_index(flat, table.device)
        ev = torch.cuda.Event()
        ev.record(side)
    return Prefetch(storage, ids, None, buf, ev)


def _prefetch_indices(table: HostTable, idx, unique: bool, checked: bool) -> tuple[Tensor, Tensor | None, bool]:
    """``(distinct indices, inverse or None, whether ascending)`` of a prefetch's ``idx``."""
    if checked:  # distinct, in-range int64 indices on the device (checked by the caller), used as given
        return idx, None, True
    if unique:
        flat = _as_index(idx, table.device)
        return flat, None, (check_unique(flat, table.num_rows) if flat.numel() else True)
    uniq, inverse = table.prepare(idx)
    return uniq, inverse, True


def _check_out(table: HostTable, out: Tensor, n: int) -> None:
    bad = out.shape != (n, table.dim) or out.dtype != table.dtype or out.device != table.device
    if bad or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({n}, {table.dim}) {table.dtype} tensor on {table.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")


def table_over(data: Tensor, *, keepalive: object, writable: bool, device=None, pin: bool | None = None,
               engine: Engine | None = None) -> HostTable:
    """A table over the contiguous 2-D CPU tensor ``data``, used in place, that views memory ``keepalive``
    keeps (a memory map: written in place when a scatter returns); ``writable=False`` refuses scatters."""
    table = HostTable.__new__(HostTable)
    table._init(data, device=device, pin=pin, engine=engine, keepalive=keepalive, writable=writable)
    return table


_choice.TABLE = HostTable  # the class engine_choice measures on
