"""How the CPU engine copies rows between a table and staging memory: torch's multi-threaded indexing, or
numpy ``take`` / ``put`` on a pool of worker threads (which copy without the GIL).

:func:`_run_rows` runs one row copy, cut into rounds (a staging chunk each) and pieces, on the calling
thread and the pool's workers; :func:`_copy_plan` says which way and how many threads, as set here or as
:func:`~offload.engine_choice` measured (it sets them with :func:`set_copy_way`).
"""

from __future__ import annotations

import os
import queue
import threading

import numpy as np
import torch
from torch import Tensor

# The ways engine_choice measured fastest, by (CUDA device index, use): see _copy_plan
_movers: dict[tuple[int, str], str] = {}
_threads: dict[tuple[int, str], int] = {}


def set_copy_way(key: tuple[int, str], way: str, threads: int) -> None:
    """Copy rows for ``key`` (CUDA device index, use: see :func:`_copy_plan`) in ``way`` with ``threads``
    (what :func:`~offload.engine_choice` measured fastest)."""
    _movers[key], _threads[key] = way, threads


CPU_COPY: str | None = None
"""How the CPU engine copies rows between the table and staging memory: ``"torch"`` (one multi-threaded
torch ``index_select`` / ``index_copy_`` per staging chunk, in the calling thread) or ``"pool"`` (numpy
``take`` / ``put`` by the threads of a worker pool, several per chunk, which run without the GIL while they
copy); ``None``: as :func:`~offload.engine_choice` measured (``"torch"`` where nothing was measured, such as on a
CPU compute device)."""

CPU_THREADS: int | None = None
"""Threads (the calling thread included) of the ``"pool"`` way; ``None``: as measured, else
``min(8, torch.get_num_threads())`` (the GIL, taken briefly around each piece, limits how many help)."""

MIN_PIECE_BYTES = 512 << 10
"""The least that one pool thread copies at a time (each piece costs a few microseconds under the GIL)."""

FANOUT = 4
"""How many sleeping workers each thread wakes when a copy starts (a tree: the caller does not pay for
every wake-up itself)."""


def _wide(t: Tensor) -> Tensor:
    """``t`` (2-D, contiguous) viewed with the widest element type that divides its rows and alignment, so
    that CPU row copies move 16 or 8 bytes per element instead of one float at a time."""
    row_bytes = t.shape[1] * t.element_size()
    offset = t.storage_offset() * t.element_size()
    for dt in (torch.complex128, torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dt).element_size()
        if row_bytes % size == 0 and t.data_ptr() % size == 0 and offset % size == 0:
            return t.view(torch.uint8).view(dt) if t.dtype != dt else t
    return t.view(torch.uint8)


def _copy_plan(index: int | None, use: str) -> tuple[str, int]:
    """``(way, threads)`` of the CPU engine on CUDA device ``index`` (None: a CPU device) for ``use``:
    ``"gather"`` or ``"scatter"`` (the CPU engine and the hybrid's CPU part), or ``"gather host"`` or
    ``"scatter host"`` (host indices, measured apart; where not measured, as ``"gather"`` / ``"scatter"``)."""
    key = (index, use)
    if key not in _movers:
        key = (index, use.split()[0])
    way = CPU_COPY or _movers.get(key, "torch")
    if way not in ("torch", "pool"):
        raise ValueError(f"offload CPU_COPY must be 'torch', 'pool' or None, got {way!r}")
    if way == "torch":
        return way, 1
    return way, max(1, int(CPU_THREADS or _threads.get(key) or min(8, torch.get_num_threads())))


def _wide_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_wide` views of two row tensors with the same row size, in one element type."""
    wa, wb = _wide(a), _wide(b)
    if wa.dtype != wb.dtype:
        wa, wb = a.view(torch.uint8), b.view(torch.uint8)
    return wa, wb


def _row_array(t: Tensor) -> np.ndarray:
    """A contiguous 2-D tensor as a 1-D numpy array of raw rows (one ``void`` element per row), so that a row
    copy is one ``memcpy`` whatever the dtype (bfloat16 included). No data is copied."""
    rows = t.shape[0]
    row_bytes = t.shape[1] * t.element_size()
    flat = t.detach().view(torch.uint8).reshape(-1).numpy() if t.numel() else np.empty(0, np.uint8)
    return flat.view(np.dtype((np.void, row_bytes))).reshape(rows)


def take_rows(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[idx]`` (numpy releases the GIL for it). Indices are checked before: ``mode="clip"``
    spares numpy's own check and the copy of ``out`` that ``mode="raise"`` makes."""
    np.take(src, idx, out=out, mode="clip")


def put_rows(dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    """``dst[idx] = src`` (numpy releases the GIL for it)."""
    dst[idx] = src


class _Job:
    """One parallel row copy: ``fn(s, e)`` over pieces of the rows ``rounds[r] = (s, e)``.

    Each round is cut into up to ``threads`` pieces of at least :data:`MIN_PIECE_BYTES`. Pieces are handed
    out in order to the pool's workers and to the calling thread; a round whose pieces are all done is put
    on :attr:`ready`. Rounds open to the workers one by one (:meth:`open`: scatter opens a round once its
    rows have arrived in host memory) or all at once. The first exception stops the job; the caller
    re-raises it after :meth:`close`, which returns once no thread runs a piece of the job any more.
    """

    def __init__(self, fn, rounds: list[tuple[int, int]], row_bytes: int, threads: int):
        self.fn = fn
        self.pieces: list[tuple[int, int]] = []
        self.owner: list[int] = []
        self.ends: list[int] = []  # pieces of rounds < r + 1
        self.left: list[int] = []
        for r, (s, e) in enumerate(rounds):
            k = max(1, min(threads, (e - s), (e - s) * row_bytes // MIN_PIECE_BYTES))
            for i in range(k):
                self.pieces.append((s + (e - s) * i // k, s + (e - s) * (i + 1) // k))
                self.owner.append(r)
            self.ends.append(len(self.pieces))
            self.left.append(k)
        self.cond = threading.Condition(threading.Lock())
        self.next = 0  # the next piece to hand out
        self.opened = 0  # pieces below this may be handed out
        self.active = 0  # threads inside run()
        self.closed = False
        self.error: BaseException | None = None
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()  # finished rounds; -1 after an error

    def open(self, rounds: int) -> None:
        """Let the workers take the pieces of the first ``rounds`` rounds."""
        with self.cond:
            self.opened = self.ends[rounds - 1] if rounds else 0
            self.cond.notify_all()

    def _piece(self, wait: bool) -> int | None:
        with self.cond:
            while True:
                if self.closed or self.error is not None or self.next >= len(self.pieces):
                    return None
                if self.next < self.opened:
                    self.next += 1
                    return self.next - 1
                if not wait:
                    return None
                self.cond.wait()

    def _do(self, i: int) -> None:
        s, e = self.pieces[i]
        try:
            self.fn(s, e)
        except BaseException as exc:  # handed to the caller, which re-raises it
            with self.cond:
                if self.error is None:
                    self.error = exc
                self.cond.notify_all()
            self.ready.put(-1)
            return
        with self.cond:
            r = self.owner[i]
            self.left[r] -= 1
            if self.left[r] == 0:
                self.ready.put(r)

    def run(self) -> None:
        """A worker's part: pieces until none is left (waiting for rounds still to open)."""
        with self.cond:
            if self.closed:
                return
            self.active += 1
        try:
            while (i := self._piece(wait=True)) is not None:
                self._do(i)
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()

    def help(self) -> bool:
        """The caller's part: one open piece, if there is one."""
        i = self._piece(wait=False)
        if i is None:
            return False
        self._do(i)
        return True

    def close(self) -> None:
        """Hand out no more pieces and wait until no worker runs one."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            while self.active:
                self.cond.wait()


class _Pool:
    """Daemon worker threads for :class:`_Job`\\ s, started on first use (one pool per process; a forked
    child starts its own)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queues: list[queue.SimpleQueue] = []

    def start(self, job: _Job, workers: int) -> None:
        """Workers ``0 .. workers - 1`` join ``job``; each wakes up to :data:`FANOUT` of the others."""
        with self.lock:
            while len(self.queues) < workers:
                q: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._main, args=(q,), daemon=True,
                                 name=f"torchmb-offload-{len(self.queues)}").start()
                self.queues.append(q)
        self._wake(job, 0, workers)

    def _wake(self, job: _Job, lo: int, hi: int) -> None:
        """Wake workers ``lo .. hi - 1``: the first of each of up to FANOUT groups, which wakes the rest."""
        n = hi - lo
        if n <= 0:
            return
        step = -(-n // max(1, FANOUT))
        for a in range(lo, hi, step):
            self.queues[a].put((job, a + 1, min(hi, a + step)))

    def _main(self, q: queue.SimpleQueue) -> None:
        while True:
            job, lo, hi = q.get()
            try:
                self._wake(job, lo, hi)
            finally:
                job.run()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool()
        return _pool


def _forget_pool() -> None:  # in a forked child: the parent's threads do not exist there
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _run_rows(fn, rounds: list[tuple[int, int]], row_bytes: int, *, threads: int, on_ready=None,
              gates=None) -> None:
    """Run ``fn(s, e)`` over every row range of ``rounds`` on ``threads`` threads: the calling thread and
    ``threads - 1`` of the worker pool (for ``threads=1``, one call per round in the calling thread).

    ``on_ready(r)`` runs in the calling thread as soon as round ``r`` is complete (rounds complete in any
    order). ``gates[r]`` (an object with ``query()`` and ``synchronize()``, such as a CUDA event) holds
    round ``r`` back until it has completed; rounds open in order. Exceptions raised by ``fn`` in any thread
    (the first one) or by ``on_ready`` are raised here, once no thread runs ``fn`` any more.
    """
    if not rounds:
        return
    if threads <= 1:
        for r, (s, e) in enumerate(rounds):
            if gates is not None:
                gates[r].synchronize()
            fn(s, e)
            if on_ready is not None:
                on_ready(r)
        return
    job = _Job(fn, rounds, row_bytes, threads)
    nrounds = len(rounds)
    opened = 0
    if gates is None:
        job.open(nrounds)
        opened = nrounds
    workers = min(threads, len(job.pieces)) - 1
    if workers > 0:
        _get_pool().start(job, workers)
    try:
        done = 0
        while done < nrounds and job.error is None:
            while opened < nrounds and gates[opened].query():
                opened += 1
                job.open(opened)
            try:
                r = job.ready.get_nowait()
            except queue.Empty:
                if job.help():
                    continue
                if opened < nrounds:  # nothing to do before the next round's rows arrive
                    gates[opened].synchronize()
                    continue
                r = job.ready.get()
            if r < 0:
                break
            if on_ready is not None:
                on_ready(r)
            done += 1
    finally:
        job.close()
    if job.error is not None:
        raise job.error


def _row_writer(way: str, data: Tensor, np_rows: np.ndarray | None, idx: Tensor, staged: Tensor, first: int = 0):
    """``fn(s, e)`` that writes staged rows ``staged[s - first:e - first]`` into rows ``idx[s:e]`` of the table
    ``data``: by torch's ``index_copy_`` (way ``"torch"``) or by numpy's ``put`` into ``np_rows``, the table's
    numpy rows (the pool's way)."""
    if way == "torch":
        dst, src = _wide_pair(data, staged)
        return lambda s, e: dst.index_copy_(0, idx[s:e], src[s - first:e - first])
    ii, src = idx.numpy(), _row_array(staged)
    return lambda s, e: put_rows(np_rows, ii[s:e], src[s - first:e - first])

