"""Staging memory of the CPU engine and its deferred writes.

:class:`_Staging` is the page-locked memory through which the CPU engine's rows cross PCIe (one per device,
shared by its tables, handed out in rotation); a :class:`PendingWrite` is a scatter of host indices whose
rows wait there to be written into the table after the call returned (see :data:`DEFER_SCATTER`).
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor

from ._row_copy import _row_writer, _run_rows

# The staging chunk size that engine_choice measured fastest, by (CUDA device index, use): see rows_per_chunk
_chunks: dict[tuple[int, str], int] = {}


def set_chunk_bytes(key: tuple[int, str], nbytes: int) -> None:
    """Move rows for ``key`` (CUDA device index, use: see :meth:`_Staging.rows_per_chunk`) in chunks of
    ``nbytes`` (what :func:`~offload.engine_choice` measured fastest)."""
    _chunks[key] = nbytes


def host_chunk_bytes() -> int:
    """The chunk size of row copies on a CPU compute device (no staging memory there, nothing measured)."""
    return _Staging.CHUNK_BYTES or _Staging.DEFAULT_CHUNK


class _Staging:
    """Page-locked staging memory of the CPU engine, shared by the tables on one device: ``BYTES`` bytes in
    units of 1 MiB, handed out in rotation as pieces of whole units. Each unit remembers the event recorded
    after the copy that last used it, and is handed out again only once that copy has finished.

    A gather or scatter takes one piece per batch of rows (the whole call when it fits in half of the
    memory, so that the next call's rows can be copied in while this call's copies drain) and moves it in
    chunks ("rounds") of ``CHUNK_BYTES``: the pool's threads copy the rows of one chunk while the DMA
    engine moves the chunks before it. A piece may also be held by a deferred scatter (see
    :data:`DEFER_SCATTER`) until its rows are written into the table: taking it writes them first."""

    BYTES = 128 << 20  # two calls of 131,072 rows of 512 bytes
    UNIT = 1 << 20
    CHUNK_BYTES: int | None = None  # a fixed chunk size; None: as measured by offload.engine_choice, else DEFAULT_CHUNK
    # torch's CPU indexing costs 0.08 ms (an H200 VM, 2026-11-22) to 0.2 ms (another) per call however small
    # (its thread pool waking up), so its chunks are large; engine_choice measures the size.
    DEFAULT_CHUNK = 16 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self.nbytes = max(self.BYTES // self.UNIT, 1) * self.UNIT
        self.units = self.nbytes // self.UNIT
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.lock = threading.RLock()
        self.events: list[torch.cuda.Event | None] = [None] * self.units
        self.holders: list[PendingWrite | None] = [None] * self.units
        self.next = 0

    def rows_per_chunk(self, row_bytes: int, use: str) -> int:
        """Rows per chunk for rows of ``row_bytes`` (0: a row does not fit, copy directly) for ``use``
        (see :func:`_copy_plan`)."""
        key = (self.device.index, use)
        if key not in _chunks:
            key = (self.device.index, use.split()[0])
        want = type(self).CHUNK_BYTES or _chunks.get(key, self.DEFAULT_CHUNK)
        return min(max(want, row_bytes), self.nbytes) // row_bytes

    def batches(self, n: int, row_bytes: int, per: int) -> list[tuple[int, int]]:
        """Row ranges of ``n`` rows of ``row_bytes`` for one staging piece each, in whole chunks of ``per``
        rows: all ``n`` at once when they fit in half of the staging memory, else at most a third of it each,
        so that one batch can be held while the next is taken (see :meth:`max_pending`)."""
        if n * row_bytes <= self.nbytes // 2:
            return [(0, n)]
        third = (self.units + 1) // 3 * self.UNIT
        step = per * max(1, third // (per * row_bytes))
        return [(s, min(n, s + step)) for s in range(0, n, step)]

    def max_pending(self, nbytes: int) -> int:
        """How many chunks of ``nbytes`` a caller may hold (not yet consumed) while taking one more: so
        many that the next one, after a wrap-around, cannot overlap any of them."""
        k = -(-nbytes // self.UNIT)
        return max(0, (self.units - k + 1) // k - 1)

    def take(self, nbytes: int, holder: PendingWrite | None = None) -> tuple[Tensor, torch.cuda.Event]:
        """The next ``nbytes`` of staging memory, once the deferred writes that hold them are written and the
        copies that last used them have finished, and the event to record after the copy that uses them
        now. ``holder``: the deferred write that will hold them (see :meth:`release`)."""
        k = -(-nbytes // self.UNIT)
        if self.next + k > self.units:
            self.next = 0
        start = self.next
        self.next = (start + k) % self.units
        for p in {id(h): h for h in self.holders[start:start + k] if h is not None}.values():
            p.land()  # a failure stays with the write, for its table to raise
        waited = set()
        for ev in self.events[start:start + k]:
            if ev is not None and id(ev) not in waited:
                ev.synchronize()
                waited.add(id(ev))
        ev = torch.cuda.Event()
        self.events[start:start + k] = [ev] * k
        self.holders[start:start + k] = [holder] * k
        if holder is not None:
            holder.units = (start, k)
        return self.buf[start * self.UNIT:start * self.UNIT + nbytes], ev

    def release(self, holder: PendingWrite) -> None:
        """The memory that ``holder`` took may be handed out again (once its copy has finished)."""
        start, k = holder.units
        for i in range(start, start + k):
            if self.holders[i] is holder:
                self.holders[i] = None


_staging: dict[int, _Staging] = {}


def _staging_for(device: torch.device) -> _Staging:
    got = _staging.get(device.index)
    if got is None:
        got = _staging[device.index] = _Staging(device)
    return got


DEFER_SCATTER = True
"""Whether the CPU engine's scatter with indices in host memory returns once the copy of its rows into
page-locked staging memory is queued on the current stream, leaving them to be written into the table
later: at the table's next use (any gather or scatter, :attr:`HostTable.data`, :meth:`HostTable.save_npy`,
:meth:`HostTable.synchronize`, :meth:`HostTable.close`) or when their staging memory is taken again,
whichever comes first. Back-to-back scatters then write one call's rows into the table while the next
call's copy runs. Only for tables in private memory (not memory-mapped files or shared memory, whose
writes are in place when scatter returns, as before) and calls of at most half the staging memory."""


class PendingWrite:
    """The rows of one deferred scatter (see :data:`DEFER_SCATTER`): their copy from the GPU into staging
    memory is queued (its end recorded by ``event``); :meth:`land` writes them into the table, once. It
    never raises an ``Exception``: a failure is kept in :attr:`error`, which the table raises at its next
    use, naming the rows."""

    def __init__(self, stage: _Staging, data: Tensor, np_rows: np.ndarray | None, idx: Tensor, use: str,
                 plan: tuple[str, int]):
        self.stage = stage
        self.data = data
        self.np_rows = np_rows  # the table as numpy rows (the "pool" way), else None
        self.idx = idx  # the caller's indices, copied
        self.use = use
        self.way, self.threads = plan  # (see _copy_plan), as when np_rows was chosen
        self.view: Tensor | None = None  # the staged rows
        self.event: torch.cuda.Event | None = None
        self.units = (0, 0)  # set by _Staging.take
        self.done = False
        self.error: RuntimeError | None = None

    def _describe(self) -> str:
        idx = self.idx
        n = idx.numel()
        lo, hi = (int(v) for v in torch.aminmax(idx))
        head = ", ".join(str(int(v)) for v in idx[:8])
        return f"{n} rows (indices {head}{', ...' if n > 8 else ''}; from {lo} to {hi})"

    def cancel(self) -> None:
        """Drop the write (its staging memory is handed out again once its copy has finished)."""
        self.done = True
        self.stage.release(self)
        self.view = None

    def land(self) -> None:
        """Write the rows into the table, after their copy has finished (the caller holds the stage lock)."""
        if self.done:
            return
        self.done = True
        writing = False
        try:
            self.event.synchronize()
            writing = True
            view, idx = self.view, self.idx
            row_bytes = view.shape[1] * view.element_size()
            per = self.stage.rows_per_chunk(row_bytes, self.use)
            n = idx.numel()
            rounds = [(s, min(n, s + per)) for s in range(0, n, per)]
            _run_rows(_row_writer(self.way, self.data, self.np_rows, idx, view), rounds, row_bytes,
                      threads=self.threads)
            self.idx = None
        except BaseException as exc:
            what = "some of them may be written, others not" if writing else "none of them was written"
            self.error = RuntimeError(f"an earlier scatter into this host table failed after it returned: "
                                      f"its {self._describe()} did not all land ({what}): {exc!r}")
            self.error.__cause__ = exc
            if not isinstance(exc, Exception):  # KeyboardInterrupt and the like go on at once
                raise
        finally:
            self.stage.release(self)
            self.view = None

