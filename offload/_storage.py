"""A table's rows in host memory and what orders access to them (:class:`HostStorage`): the storage that a
:class:`~offload.HostTable` owns and hands to its engine (which sees it as :class:`~offload._engine.RowStorage`).

It keeps the host tensor (page-locked here or before), the events of GPU work that reads or writes it, the
deferred scatter of the CPU engine, the table's side stream and the pending prefetches that writes must
patch. Everything that touches the host rows goes through it, so each access waits for what it must.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from ._memory import pin_tensor, unpin_tensor
from ._row_copy import _row_array
from ._staging import PendingWrite


class PatchedCopy(Protocol):
    """A copy of rows taken from the table ahead of use (a :class:`~offload.Prefetch`), patched by writes."""

    def patch(self, idx: Tensor, rows: Tensor) -> None: ...


class HostStorage:
    """The ``(num_rows, dim)`` host tensor ``tensor`` of a table whose compute device is ``device``.

    Args:
        tensor: a contiguous 2-D CPU tensor, used in place.
        device: the compute device (a CUDA device with its index, or the CPU).
        pin: page-lock ``tensor`` (unless it is already); ``None``: whenever CUDA is available.
        keepalive: what must outlive the tensor (the memory map it views); such memory, and shared memory,
            is written in place when a scatter returns (:attr:`defer_ok` is false).
        writable: ``False`` for a read-only memory map (scatters are refused).
    """

    def __init__(self, tensor: Tensor, device: torch.device, *, pin: bool | None, keepalive: object = None,
                 writable: bool = True):
        if tensor.dim() != 2 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"a HostTable holds a contiguous 2-D CPU tensor, got {tuple(tensor.shape)} on "
                             f"{tensor.device}")
        self.device = device
        self.writable = writable
        self._keepalive = keepalive
        self._read_events: dict[int, torch.cuda.Event] = {}
        self._write_events: dict[int, torch.cuda.Event] = {}
        self._prefetches: weakref.WeakSet[PatchedCopy] = weakref.WeakSet()
        self._side: torch.cuda.Stream | None = None
        self._np_rows: np.ndarray | None = None
        self.pending: PendingWrite | None = None  # a deferred scatter (see DEFER_SCATTER)
        # whether scatters may be deferred: not for memory that outlives the process (a mapped file, shared
        # memory), where rows must be in place when scatter returns
        self.defer_ok = keepalive is None and not tensor.is_shared()
        self._pinned_here = False
        want_pin = torch.cuda.is_available() if pin is None else bool(pin)
        if want_pin and not tensor.is_pinned():
            pin_tensor(tensor, f"a {tensor.shape[0]} x {tensor.shape[1]} {tensor.dtype} table")
            self._pinned_here = True
        self.tensor = tensor
        self.pinned = bool(want_pin or (torch.cuda.is_available() and tensor.is_pinned()))

    @property
    def num_rows(self) -> int:
        return self.tensor.shape[0]

    @property
    def dim(self) -> int:
        return self.tensor.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def row_bytes(self) -> int:
        return self.dim * self.tensor.element_size()

    def land(self) -> None:
        """Write the deferred scatter, if any; raise its error if it failed (once)."""
        p = self.pending
        if p is None:
            return
        with p.stage.lock:
            p.land()
            if self.pending is p:
                self.pending = None
        if p.error is not None:
            raise p.error

    def wait_gpu(self, *, reads: bool) -> None:
        """Wait until the GPU-side writes (and, with ``reads``, reads) launched so far finished."""
        for ev in list(self._write_events.values()):
            ev.synchronize()
        self._write_events.clear()
        if reads:
            for ev in list(self._read_events.values()):
                ev.synchronize()
            self._read_events.clear()

    def synchronize(self, *, reads: bool = True) -> None:
        """:meth:`land`, then :meth:`wait_gpu`."""
        self.land()
        self.wait_gpu(reads=reads)

    def note_gpu_access(self, kind: str) -> None:
        """Record that work on the current stream reads (``kind="read"``) or writes (``"write"``) the host rows
        (see :meth:`wait_gpu`)."""
        events = self._write_events if kind == "write" else self._read_events
        stream = torch.cuda.current_stream(self.device)
        ev = events.get(stream.cuda_stream)
        if ev is None:
            ev = events[stream.cuda_stream] = torch.cuda.Event()
        ev.record(stream)

    def side_stream(self) -> torch.cuda.Stream:
        """The side stream of prefetches and of the hybrid engine's CPU part, made at its first use."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def check_writable(self) -> None:
        if not self.writable:
            raise RuntimeError("this HostTable is a read-only memory map (mmap_mode='r'); it cannot be scattered to")

    def numpy_rows(self) -> np.ndarray:
        """The host tensor as numpy rows (see :func:`~offload._row_copy._row_array`), made once."""
        if self._np_rows is None:
            self._np_rows = _row_array(self.tensor)
        return self._np_rows

    # -- pending prefetches ------------------------------------------------------------------------------------
    def watch(self, copy: PatchedCopy) -> None:
        """Patch ``copy`` with the rows written to the table from now on, until :meth:`unwatch`."""
        self._prefetches.add(copy)

    def unwatch(self, copy: PatchedCopy) -> None:
        self._prefetches.discard(copy)

    @property
    def watched(self) -> bool:
        """Whether some copy is watched (see :meth:`watch`)."""
        return bool(self._prefetches)

    def patch_prefetches(self, idx: Tensor, rows: Tensor) -> None:
        """Write ``rows``, just written to rows ``idx`` of the table, into every watched copy."""
        for p in list(self._prefetches):
            p.patch(idx, rows)

    def close(self) -> None:
        """Write the deferred scatter and unpin the memory if it was pinned here (it stays readable)."""
        self.land()
        if self._pinned_here:
            self.synchronize()
            unpin_tensor(self.tensor)
            self._pinned_here = False
            self.pinned = self.tensor.is_pinned() if torch.cuda.is_available() else False
