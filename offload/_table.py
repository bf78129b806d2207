"""Tables of rows in host memory that the GPU gathers from and scatters to.

:class:`HostTable` is the building block of the package: a ``(num_rows, dim)`` table in page-locked host
memory with ``gather(idx)`` (rows to the compute device) and ``scatter(idx, rows)`` (rows back), through
one of three engines, plus :meth:`HostTable.prefetch` on a side stream. :class:`HostArray` is the read-mostly
variant for dataset rows of any shape.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from . import _uva
from ._memory import allocate_host, host_memory_available, pin_tensor, unpin_tensor

__all__ = [
    "HostArray",
    "HostTable",
    "Prefetch",
    "batches",
    "engine_choice",
    "get_engine",
    "set_engine",
    "use_engine",
]

Engine = Literal["auto", "uva", "cpu", "hybrid"]
_ENGINES = ("auto", "uva", "cpu", "hybrid")
ENV_ENGINE = "TORCHMB_OFFLOAD_ENGINE"

# ----------------------------------------------------------------------------------------------------------
# The engine switch


def _check_engine(name: str) -> str:
    if name not in _ENGINES:
        raise ValueError(f"offload engine must be one of {_ENGINES}, got {name!r}")
    return name


_engine: str = _check_engine(os.environ.get(ENV_ENGINE) or "auto")


def get_engine() -> str:
    """The default engine of tables created without ``engine=``: ``"auto"``, ``"uva"``, ``"cpu"`` or ``"hybrid"``.

    Starts as ``$TORCHMB_OFFLOAD_ENGINE`` (default ``"auto"``).
    """
    return _engine


def set_engine(name: Engine) -> None:
    """Set the default engine (see :func:`get_engine`)."""
    global _engine
    _engine = _check_engine(name)


@contextlib.contextmanager
def use_engine(name: Engine) -> Iterator[None]:
    """Use ``name`` as the default engine inside the block; the old default is restored after."""
    old = get_engine()
    set_engine(name)
    try:
        yield
    finally:
        set_engine(old)


_choice: dict[int, dict[str, str]] = {}
_chunks: dict[tuple[int, str], int] = {}
_movers: dict[tuple[int, str], str] = {}
_threads: dict[tuple[int, str], int] = {}
_choice_lock = threading.RLock()

MEASURE_BYTES = 2 << 30
"""Size of the pinned table that :func:`engine_choice` measures on (at most an eighth of the available
host memory). It must be large: on an H200 the UVA kernel reads random rows of a 256 MiB table at 0.9 of
the contiguous-copy bandwidth but those of a 5 GB table at 0.7 (address translation), so a small
measuring table favours the UVA engine."""

HOST_UVA_MARGIN = 1.1
"""With indices in host memory, :func:`engine_choice` picks the UVA engine only when the CPU engine takes
this many times as long on the measuring table. The CPU engine's time hardly depends on the table's size,
the UVA kernel's grows with it: in one run on an H200 the UVA scatter of host indices took 1.48 ms on the
2 GiB measuring table and 1.72 ms on a 5 GB table, the CPU engine's 1.53 and 1.32 ms."""


CPU_CHOICES = (("torch", 8, 1), ("torch", 16, 1), ("torch", 32, 1), ("pool", 4, 8), ("pool", 8, 8),
               ("pool", 8, 16), ("pool", 16, 16))
"""How the CPU engine copies rows, as :func:`engine_choice` tries them: ``(way, staging chunk MiB, threads)``
(see :data:`CPU_COPY`)."""

CPU_CHOICES_HOST = (("torch", 16, 1), ("torch", 32, 1), ("torch", 64, 1))
"""The same for the CPU engine with indices in host memory, whose calls overlap one another (see
:func:`engine_choice`); 64 MiB chunks copy the measuring call's rows in one piece. (On an H200 with 16 host
cores the pool took 6 to 12 times as long as torch's indexing in back-to-back calls, so it is not tried.)"""

LONE_BLOCK_BYTES = 128 << 10
"""The hybrid engine's split: a row of a call is *lone* when no other row of the call lies in the same
``LONE_BLOCK_BYTES``-aligned block of the table. The CPU engine moves the lone rows, the UVA kernel the rest.
Measured on H200s (``tests/benchmarks/bench_host_table.py --lone``; 131,072 sorted random rows of a 5 GB
table): the UVA kernel read them at 0.76-0.87 of the contiguous copy, but as many rows two to a 1 KiB block,
four to a 64 KiB block or all within 2 GiB at 0.88-0.92. What costs the GPU is reaching host addresses far
from the others, and the few lone rows (3.4% at 128 KiB) cost most: the kernel read the other 96.6% in
1.29-1.34 ms against 1.43-1.57 ms for as many rows drawn at random, and with the lone rows' bytes copied
beside it the two took 1.33-1.38 ms (0.88-0.91)."""

HYBRID_MIN_LONE_BYTES = 1 << 20
"""The hybrid engine leaves every row to the UVA kernel when its lone rows (see :data:`LONE_BLOCK_BYTES`)
hold fewer bytes than this: the CPU part costs a host synchronisation and a fixed ~0.2 ms, more than the
kernel loses on a few lone rows. Calls whose lone rows, were the rows spread uniformly, would not reach it
skip the count (and its synchronisation) altogether."""

_measured: dict[int, dict[str, dict[str, float]]] = {}  # device -> op -> what -> seconds (for reports)


CHOICE_KEYS = ("gather", "scatter", "gather host", "scatter host")
"""The keys of :func:`engine_choice`: the operation, and ``" host"`` for indices in host memory."""


def engine_choice(device: torch.device | str | int | None = None) -> dict[str, str]:
    """What ``"auto"`` picks on ``device``: ``"uva"`` or ``"cpu"`` for ``"gather"`` and ``"scatter"`` with
    indices on the GPU and for ``"gather host"`` and ``"scatter host"``, with indices in host memory (a CPU
    tensor, a numpy array or a list).

    Measured once per device and process, on a pinned table of :data:`MEASURE_BYTES` (allocated for the
    measurement and freed after). Device indices: 131,072 random rows gathered and scattered one call at a
    time (each timed to its end) by the UVA engine and by the CPU engine in each way of
    :data:`CPU_CHOICES` (the fastest is kept for it). Host indices: the same rows in back-to-back calls
    timed together, as a training loop or data loader makes them, by the UVA engine (the indices are
    copied to the GPU and checked there, which waits for the previous call) and by the CPU engine in each
    way of :data:`CPU_CHOICES_HOST` (its calls check the indices on the host and overlap one another; the
    UVA engine must win by :data:`HOST_UVA_MARGIN`). The hybrid engine is not tried: its gain lies in the
    rows of a large table that lie far from the others (see :data:`LONE_BLOCK_BYTES`), which the measuring
    table's dense rows do not have, and where measured on a 5 GB table its own costs outweighed that gain.
    Without CuPy or a suitable GPU every answer is ``"cpu"``.
    """
    if not torch.cuda.is_available():
        return dict.fromkeys(CHOICE_KEYS, "cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return dict.fromkeys(CHOICE_KEYS, "cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _choice_lock:
        got = _choice.get(index)
        if got is None:
            got = (_measure(torch.device("cuda", index)) if _uva.available(dev)
                   else dict.fromkeys(CHOICE_KEYS, "cpu"))
            _choice[index] = got
    return dict(got)


def _set_way(key: tuple[int, str], way: tuple[str, int, int]) -> None:
    """Set the CPU engine's way of copying rows for ``key`` (see :data:`CPU_CHOICES`)."""
    _movers[key], _chunks[key], _threads[key] = way[0], way[1] << 20, way[2]


def _fastest_way(key: tuple[int, str], choices, timer) -> tuple[dict, float]:
    """Time ``timer(way)`` with each way of ``choices`` set for ``key``; leave the fastest set. Returns the
    times by way and the fastest time."""
    by_way = {}
    for way in choices:
        _set_way(key, way)
        by_way[way] = timer(way)
    way = min(by_way, key=by_way.__getitem__)
    _set_way(key, way)
    return by_way, by_way[way]


def _median_seconds(fn, device: torch.device, samples: int = 5) -> float:
    """The median wall-clock seconds of ``fn()`` followed by a device synchronisation."""
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _ways_report(by_way: dict) -> dict[str, float]:
    return {f"cpu {w[0]} {w[1]} MiB {w[2]} threads": t for w, t in by_way.items()}


def _measure(device: torch.device) -> dict[str, str]:
    dim, n = 128, 131_072
    row_bytes = dim * 4
    avail = host_memory_available()["available"] or MEASURE_BYTES * 8
    rows = max(4 * n, min(MEASURE_BYTES, avail // 8) // row_bytes)
    table = HostTable(rows, dim, torch.float32, device=device, pin=True, engine="cpu", fill=None)
    g = torch.Generator().manual_seed(0)
    idx_dev = torch.randperm(rows, generator=g)[:n].sort().values.to(device)
    buf = torch.randn(n, dim, device=device)
    best: dict[str, str] = {}
    report = _measured.setdefault(device.index, {})
    with torch.cuda.device(device):
        for op in ("gather", "scatter"):
            key = (device.index, op)

            def run(eng, op=op):  # as gather() / scatter() do it: indices on the device only
                if op == "gather":
                    table._gather_unique(idx_dev, None, buf, eng)
                else:
                    table._scatter_unique(idx_dev, None, buf, eng)

            def timed(eng, run=run):
                run(eng)
                torch.cuda.synchronize(device)
                return _median_seconds(lambda: run(eng), device)

            times = {"uva": timed("uva")}
            by_way, times["cpu"] = _fastest_way(key, CPU_CHOICES, lambda way, timed=timed: timed("cpu"))
            best[op] = min(times, key=times.__getitem__)
            report[op] = {**_ways_report(by_way), **times}
        idx_host = idx_dev.cpu()
        for op in ("gather", "scatter"):
            use = f"{op} host"
            key = (device.index, use)

            def run_host(op=op):  # as gather() / scatter() do it, with the indices in host memory
                if op == "gather":
                    table.gather(idx_host, unique=True, out=buf)
                else:
                    table.scatter(idx_host, buf, unique=True)

            def timed_host(eng, run_host=run_host, calls=16):  # back-to-back calls, timed to the end of the last
                table.engine = eng

                def calls_then_land():
                    for _ in range(calls):
                        run_host()
                    table.synchronize()

                for _ in range(2):
                    run_host()
                table.synchronize()
                torch.cuda.synchronize(device)
                return _median_seconds(calls_then_land, device) / calls

            times = {"uva": timed_host("uva")}
            by_way, times["cpu"] = _fastest_way(key, CPU_CHOICES_HOST,
                                                lambda way, timed_host=timed_host: timed_host("cpu"))
            table.engine = "cpu"
            best[use] = "uva" if times["cpu"] > HOST_UVA_MARGIN * times["uva"] else "cpu"
            report[use] = {**_ways_report(by_way), **times}
    table.close()
    return best


# ----------------------------------------------------------------------------------------------------------
# Staging buffers of the CPU engine


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
    CHUNK_BYTES: int | None = None  # a fixed chunk size; None: as measured by engine_choice, else DEFAULT_CHUNK
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
        self.holders: list[_PendingWrite | None] = [None] * self.units
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

    def take(self, nbytes: int, holder: _PendingWrite | None = None) -> tuple[Tensor, torch.cuda.Event]:
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

    def release(self, holder: _PendingWrite) -> None:
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


# ----------------------------------------------------------------------------------------------------------
# The CPU engine's row copies: a pool of worker threads

CPU_COPY: str | None = None
"""How the CPU engine copies rows between the table and staging memory: ``"torch"`` (one multi-threaded
torch ``index_select`` / ``index_copy_`` per staging chunk, in the calling thread) or ``"pool"`` (numpy
``take`` / ``put`` by the threads of a worker pool, several per chunk, which run without the GIL while they
copy); ``None``: as :func:`engine_choice` measured (``"torch"`` where nothing was measured, such as on a
CPU compute device)."""

CPU_THREADS: int | None = None
"""Threads (the calling thread included) of the ``"pool"`` way; ``None``: as measured, else
``min(8, torch.get_num_threads())`` (the GIL, taken briefly around each piece, limits how many help)."""

MIN_PIECE_BYTES = 512 << 10
"""The least that one pool thread copies at a time (each piece costs a few microseconds under the GIL)."""

FANOUT = 4
"""How many sleeping workers each thread wakes when a copy starts (a tree: the caller does not pay for
every wake-up itself)."""


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


def _take(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[idx]`` (numpy releases the GIL for it). Indices are checked before: ``mode="clip"``
    spares numpy's own check and the copy of ``out`` that ``mode="raise"`` makes."""
    np.take(src, idx, out=out, mode="clip")


def _put(dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
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
    return lambda s, e: _put(np_rows, ii[s:e], src[s - first:e - first])


# ----------------------------------------------------------------------------------------------------------
# Deferred scatters of the CPU engine

DEFER_SCATTER = True
"""Whether the CPU engine's scatter with indices in host memory returns once the copy of its rows into
page-locked staging memory is queued on the current stream, leaving them to be written into the table
later: at the table's next use (any gather or scatter, :attr:`HostTable.data`, :meth:`HostTable.save_npy`,
:meth:`HostTable.synchronize`, :meth:`HostTable.close`) or when their staging memory is taken again,
whichever comes first. Back-to-back scatters then write one call's rows into the table while the next
call's copy runs. Only for tables in private memory (not memory-mapped files or shared memory, whose
writes are in place when scatter returns, as before) and calls of at most half the staging memory."""


class _PendingWrite:
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


# ----------------------------------------------------------------------------------------------------------
# Index preparation


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_index(idx, device: torch.device) -> Tensor:
    if not isinstance(idx, Tensor):
        idx = torch.as_tensor(idx)
    if idx.dtype == torch.bool or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise TypeError(f"indices must be an integer tensor, got dtype {idx.dtype}")
    return idx.reshape(-1).to(device=device, dtype=torch.int64, non_blocking=True)


def _on_host(idx) -> bool:
    """Whether indices are in host memory: a CPU tensor, or anything but a tensor (a numpy array, a list)."""
    return not isinstance(idx, Tensor) or idx.device.type == "cpu"


def _host_flat(idx) -> tuple[Tensor, bool]:
    """Indices in host memory as a flat, contiguous int64 CPU tensor, and whether it is a copy (else it is
    the caller's memory)."""
    if not isinstance(idx, Tensor):
        with _quiet_readonly():
            idx = torch.as_tensor(idx)
    if idx.dtype == torch.bool or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise TypeError(f"indices must be an integer tensor, got dtype {idx.dtype}")
    flat = idx.reshape(-1).to(torch.int64).contiguous()
    return flat, flat.untyped_storage().data_ptr() != idx.untyped_storage().data_ptr()


def _check_host_bounds(flat: Tensor, num_rows: int) -> None:
    """Bounds-check non-empty indices in host memory (no GPU involved)."""
    lo, hi = torch.aminmax(flat)
    _check_bounds(int(lo), int(hi), num_rows)


def _device_index(flat: Tensor, device: torch.device) -> Tensor:
    """Host indices on ``device``, through page-locked memory: the copy is queued on the current stream and
    the host does not wait for it."""
    pinned = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
    pinned.copy_(flat)
    return pinned.to(device, non_blocking=True)


def _host_index(idx: Tensor) -> Tensor:
    """``idx`` (int64) in host memory: as it is when it is there, else in page-locked memory once the current
    stream has written it (an asynchronous copy and one event wait; ``idx.cpu()`` goes through pageable
    memory)."""
    if idx.device.type == "cpu":
        return idx
    host = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    host.copy_(idx, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(idx.device))
    ev.synchronize()
    return host


def _check_bounds(lo: int, hi: int, num_rows: int) -> None:
    if lo < 0:
        raise IndexError(f"index {lo} is out of range for a table of {num_rows} rows (valid: 0..{num_rows - 1})")
    if hi >= num_rows:
        raise IndexError(f"index {hi} is out of range for a table of {num_rows} rows (valid: 0..{num_rows - 1})")


# ----------------------------------------------------------------------------------------------------------


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
        :data:`CPU_COPY`), and copies each chunk to the GPU as soon as its rows are there, so CPU gathering
        and the DMA overlap (scatter is the reverse: each chunk's rows are written into the table as soon
        as its copy from the GPU has landed).
        ``"hybrid"`` runs both at once on disjoint rows: the CPU engine moves a large call's lone rows, those
        with no other row of the call within the same 128 KiB of the table, and the UVA kernel the rest
        (see :data:`LONE_BLOCK_BYTES`). Its split costs a second synchronisation and the CPU engine's fixed
        cost, which on the machines measured outweighed what the kernel gains (:func:`engine_choice` does
        not pick it).
        ``"auto"`` uses :func:`engine_choice`, measured once per device, apart for indices on the GPU and
        indices in host memory. On a CPU compute device every engine is plain CPU indexing.

    Indices in host memory (a CPU tensor, a numpy array, a list) with the ``"cpu"`` engine never wait for
    the GPU: they are checked on the host, the rows are copied into staging memory while the previous
    call's copy to the GPU may still run, and the call returns with its own copy queued on the current
    stream. Such a gather copies the rows as indexed (repeats included: deduplicating on the host costs more
    than it saves), and such a scatter writes the rows into the table after it returns (see
    :data:`DEFER_SCATTER`), before anything else uses the table.

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
        self._init(data, device=device, pin=pin, engine=engine, keepalive=None)

    # -- construction -----------------------------------------------------------------------------------
    def _init(self, data: Tensor, *, device, pin, engine, keepalive) -> None:
        if data.dim() != 2 or not data.is_contiguous() or data.device.type != "cpu":
            raise ValueError(f"a HostTable holds a contiguous 2-D CPU tensor, got {tuple(data.shape)} on {data.device}")
        self.device = _default_device() if device is None else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"HostTable device {self.device} requested but CUDA is not available")
        self.engine = None if engine is None else _check_engine(engine)
        self.num_rows, self.dim = data.shape
        self.dtype = data.dtype
        self._keepalive = keepalive
        self._read_events: dict[int, torch.cuda.Event] = {}
        self._write_events: dict[int, torch.cuda.Event] = {}
        self._prefetches: weakref.WeakSet[Prefetch] = weakref.WeakSet()
        self._side: torch.cuda.Stream | None = None
        self._pending: _PendingWrite | None = None  # a deferred scatter (see DEFER_SCATTER)
        # whether scatters may be deferred: not for memory that outlives the process (a mapped file, shared
        # memory), where rows must be in place when scatter returns
        self._defer_ok = keepalive is None and not data.is_shared()
        self._pinned_here = False
        want_pin = torch.cuda.is_available() if pin is None else bool(pin)
        if want_pin and not data.is_pinned():
            pin_tensor(data, f"a {self.num_rows} x {self.dim} {self.dtype} table")
            self._pinned_here = True
        self._data = data
        self.pinned = bool(want_pin or (torch.cuda.is_available() and data.is_pinned()))

    @classmethod
    def from_tensor(cls, tensor: Tensor, *, device=None, pin: bool | None = None, engine: Engine | None = None,
                    copy: bool = True) -> HostTable:
        """A table holding ``tensor``'s rows (2-D). ``copy=False`` uses a contiguous CPU ``tensor`` in place."""
        if tensor.dim() != 2:
            raise ValueError(f"HostTable.from_tensor needs a 2-D tensor (rows, dim), got shape {tuple(tensor.shape)}")
        self = cls.__new__(cls)
        if copy or tensor.device.type != "cpu" or not tensor.is_contiguous():
            if not copy:
                raise ValueError("copy=False needs a contiguous CPU tensor")
            data = allocate_host(tuple(tensor.shape), tensor.dtype, f"a {tuple(tensor.shape)} {tensor.dtype} table")
            data.copy_(tensor.detach())
        else:
            data = tensor.detach()
        self._init(data, device=device, pin=pin, engine=engine, keepalive=None)
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
        arr = np.load(os.fspath(path), mmap_mode=mmap_mode)
        if arr.ndim != 2:
            raise ValueError(f"{os.fspath(path)}: a HostTable needs a 2-D array, got shape {arr.shape}")
        if mmap_mode is None:
            data = allocate_host(arr.shape, _torch_dtype(arr.dtype), f"the table in {os.fspath(path)}")
            data.copy_(torch.from_numpy(arr))
            keepalive = None
        else:
            with _quiet_readonly():
                data = torch.from_numpy(arr)
            keepalive = arr
        if dtype is not None and dtype != data.dtype:
            data = data.view(dtype)
        if pin is None:
            pin = mmap_mode is None and torch.cuda.is_available()
        self = cls.__new__(cls)
        self._init(data, device=device, pin=pin, engine=engine, keepalive=keepalive)
        self._readonly = mmap_mode == "r"
        return self

    def save_npy(self, path: str | os.PathLike) -> None:
        """Write the table to ``path`` as ``.npy`` (atomically: a temporary file renamed into place).

        bfloat16 is stored as uint16 (load it back with ``from_npy(path, dtype=torch.bfloat16)``).
        """
        self.synchronize()
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".npy.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, _numpy_view(self._data))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def close(self) -> None:
        """Write a deferred scatter and unpin the memory (the table stays readable on the CPU; the ``"uva"``
        engine no longer applies)."""
        self._land()
        if getattr(self, "_pinned_here", False):
            self.synchronize()
            unpin_tensor(self._data)
            self._pinned_here = False
            self.pinned = self._data.is_pinned() if torch.cuda.is_available() else False

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- plain accessors ----------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_rows, self.dim))

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.dim * self._data.element_size()

    @property
    def data(self) -> Tensor:
        """The host tensor itself, after pending GPU writes to it have landed."""
        self.synchronize()
        return self._data

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
        and write a deferred scatter into the table (see :data:`DEFER_SCATTER`), raising its error if that
        failed."""
        self._land()
        self._wait_gpu(reads=reads)

    def _land(self) -> None:
        """Write this table's deferred scatter, if any; raise its error if it failed (once)."""
        p = getattr(self, "_pending", None)
        if p is None:
            return
        with p.stage.lock:
            p.land()
            if self._pending is p:
                self._pending = None
        if p.error is not None:
            raise p.error

    def _wait_gpu(self, *, reads: bool) -> None:
        """Wait until the GPU-side writes (and, with ``reads``, reads) of this table launched so far finished."""
        for ev in list(self._write_events.values()):
            ev.synchronize()
        self._write_events.clear()
        if reads:
            for ev in list(self._read_events.values()):
                ev.synchronize()
            self._read_events.clear()

    # -- engines -----------------------------------------------------------------------------------------
    def resolved_engine(self, op: Literal["gather", "scatter"], *, host_indices: bool = False) -> str:
        """The engine that ``op`` uses now: ``"uva"``, ``"cpu"`` or ``"hybrid"``, for indices on the GPU or
        (``host_indices=True``) in host memory."""
        want = self.engine or get_engine()
        if self.device.type != "cuda":
            if want in ("uva", "hybrid"):
                raise RuntimeError(f"the {want!r} offload engine needs a CUDA compute device; this table's is the CPU")
            return "cpu"
        if want in ("uva", "hybrid"):
            _uva.require()
            if not self.pinned:
                raise RuntimeError(f"the {want!r} offload engine needs a pinned table (create it with pin=True)")
            return want
        if want == "cpu" or not self.pinned:
            return "cpu"
        return engine_choice(self.device)[f"{op} host" if host_indices else op]

    def _host_route(self, idx, op: str) -> bool:
        """Whether ``op`` of ``idx`` takes the CPU engine's path for host indices (see the class notes)."""
        return (self.device.type == "cuda" and _on_host(idx)
                and self.resolved_engine(op, host_indices=True) == "cpu")

    def _note_gpu_access(self, kind: str) -> None:
        events = self._write_events if kind == "write" else self._read_events
        stream = torch.cuda.current_stream(self.device)
        ev = events.get(stream.cuda_stream)
        if ev is None:
            ev = events[stream.cuda_stream] = torch.cuda.Event()
        ev.record(stream)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _lone_split(self, uniq: Tensor) -> tuple[Tensor, Tensor] | None:
        """The hybrid's split of distinct GPU indices: the positions of the lone rows and of the others (each
        in the order of ``uniq``, which should be ascending: neighbours are compared), or ``None`` where the
        lone rows are too few to hand to the CPU engine (see :data:`HYBRID_MIN_LONE_BYTES`)."""
        n = uniq.numel()
        row_bytes = self.dim * self._data.element_size()
        rows_per_block = LONE_BLOCK_BYTES / row_bytes
        if rows_per_block < 2 or n < 2:  # a row as long as a block reaches its addresses in one sweep
            return None
        expected = n * math.exp(-n * rows_per_block / max(1, self.num_rows))  # lone rows if spread uniformly
        if expected * row_bytes < HYBRID_MIN_LONE_BYTES:
            return None
        block = uniq * row_bytes // LONE_BLOCK_BYTES
        same = torch.nn.functional.pad(block[1:] == block[:-1], (1, 1))  # same[i]: rows i - 1 and i share a block
        near = same[1:] | same[:-1]
        lone = torch.nonzero(~near).squeeze(1)  # (reads the count back)
        if lone.numel() * row_bytes < HYBRID_MIN_LONE_BYTES:
            return None
        return lone, torch.nonzero_static(near, size=n - lone.numel()).squeeze(1)

    def _hybrid(self, op: str, uniq: Tensor, rows: Tensor) -> None:
        """``rows[:] = table[uniq]`` (gather) or ``table[uniq] = rows`` (scatter) for checked, distinct
        (best ascending) GPU indices by both engines at once: the UVA kernel on the current stream, the CPU
        engine's copies of the lone rows on a side stream, so that GPU-initiated and DMA transfers share the
        PCIe link (see :data:`LONE_BLOCK_BYTES`)."""
        split = self._lone_split(uniq)
        if split is None:
            (_uva.gather_rows if op == "gather" else _uva.scatter_rows)(self._data, uniq, rows)
            self._note_gpu_access("read" if op == "gather" else "write")
            return
        lone, near = split
        self.synchronize(reads=op == "scatter")  # the CPU part must not overtake earlier GPU accesses
        main = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        lone_idx = torch.empty(lone.numel(), dtype=torch.int64, pin_memory=True)
        lone_idx.copy_(uniq.index_select(0, lone), non_blocking=True)
        staged = (torch.empty(lone.numel(), self.dim, dtype=self.dtype, device=self.device) if op == "gather"
                  else rows.index_select(0, lone))
        ready = torch.cuda.Event()
        ready.record(main)  # before the kernel: the CPU part need not wait for it
        if op == "gather":
            _uva.gather_tables([self._data], uniq.index_select(0, near), [rows], pos=near)
        else:
            _uva.scatter_tables([self._data], uniq.index_select(0, near), [rows], pos=near)
        self._note_gpu_access("read" if op == "gather" else "write")
        ready.synchronize()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            if op == "gather":
                self._gather_cpu(lone_idx, staged)
            else:
                self._scatter_cpu(lone_idx, staged)
        main.wait_stream(side)
        staged.record_stream(side)
        if op == "gather":
            rows.index_copy_(0, lone, staged)

    def _gather_unique(self, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor, engine: str,
                       pos: Tensor | None = None) -> None:
        """``out[:] = rows[uniq]`` (``out[pos[i]] = rows[uniq[i]]`` with ``pos``, a permutation of the rows of
        ``out`` on the device); ``uniq`` checked, on ``self.device``; ``uniq_cpu`` its CPU copy or None."""
        n = uniq.numel()
        if n == 0:
            return
        if pos is not None and (engine != "uva" or self.device.type != "cuda"):
            rows = torch.empty_like(out)
            self._gather_unique(uniq, uniq_cpu, rows, engine)
            out.index_copy_(0, pos, rows)
            return
        self._land()
        if self.device.type != "cuda":
            self._host_rows("gather", uniq.cpu() if uniq_cpu is None else uniq_cpu, out)
            return
        if engine == "uva":
            _uva.gather_tables([self._data], uniq, [out], pos=pos)
            self._note_gpu_access("read")
            return
        if engine == "hybrid":
            self._hybrid("gather", uniq, out)
            return
        self.synchronize(reads=False)
        self._gather_cpu(_host_index(uniq) if uniq_cpu is None else uniq_cpu, out)

    def _rows_np(self) -> np.ndarray:
        """The table as numpy rows (see :func:`_row_array`), made once."""
        got = getattr(self, "_np_rows", None)
        if got is None:
            got = self._np_rows = _row_array(self._data)
        return got

    def _host_rows(self, op: str, idx_cpu: Tensor, rows: Tensor) -> None:
        """A CPU compute device: ``rows[:] = table[idx]`` or ``table[idx] = rows``, in one torch indexing
        call or on the worker pool (see :data:`CPU_COPY`)."""
        way, threads = _copy_plan(None, op)
        if op == "gather" and (not rows.is_contiguous() or rows.dtype != self.dtype):
            raise ValueError(f"gather needs a contiguous {self.dtype} output, got {rows.dtype}")
        if op == "scatter":
            rows = rows.detach().to(self.dtype).contiguous()
        if way == "torch":
            table_w, rows_w = _wide_pair(self._data, rows)
            if op == "gather":
                torch.index_select(table_w, 0, idx_cpu, out=rows_w)
            else:
                table_w.index_copy_(0, idx_cpu, rows_w)
            return
        row_bytes = self.dim * self._data.element_size()
        table, idx, other = self._rows_np(), idx_cpu.numpy(), _row_array(rows)
        per = max(1, (_Staging.CHUNK_BYTES or _Staging.DEFAULT_CHUNK) // row_bytes)
        rounds = [(s, min(idx.shape[0], s + per)) for s in range(0, idx.shape[0], per)]
        if op == "gather":
            _run_rows(lambda s, e: _take(table, idx[s:e], other[s:e]), rounds, row_bytes, threads=threads)
        else:
            _run_rows(lambda s, e: _put(table, idx[s:e], other[s:e]), rounds, row_bytes, threads=threads)

    def _gather_cpu(self, uniq_cpu: Tensor, out: Tensor, use: str = "gather") -> None:
        """The CPU engine's gather to the GPU: rows are copied into page-locked staging memory chunk by
        chunk (by torch or the worker pool, see :data:`CPU_COPY`), and each chunk's copy to ``out`` is
        queued (on the current stream) as soon as its rows are there."""
        n = uniq_cpu.numel()
        if n == 0:
            return
        stage = _staging_for(self.device)
        stream = torch.cuda.current_stream(self.device)
        row_bytes = self.dim * self._data.element_size()
        way, threads = _copy_plan(self.device.index, use)
        with stage.lock:
            per = stage.rows_per_chunk(row_bytes, use)
            if per == 0:  # a row longer than the staging memory: copy directly
                out.copy_(self._data.index_select(0, uniq_cpu), non_blocking=False)
                return
            for b0, b1 in stage.batches(n, row_bytes, per):
                piece, ev = stage.take((b1 - b0) * row_bytes)
                view = piece.view(self.dtype).view(b1 - b0, self.dim)
                rounds = [(s, min(b1, s + per)) for s in range(b0, b1, per)]
                if way == "torch":
                    src_w, dst_w = _wide_pair(self._data, view)

                    def fn(s, e, src_w=src_w, dst_w=dst_w, b0=b0):
                        torch.index_select(src_w, 0, uniq_cpu[s:e], out=dst_w[s - b0:e - b0])
                else:
                    src, idx, dst = self._rows_np(), uniq_cpu.numpy(), _row_array(view)

                    def fn(s, e, src=src, idx=idx, dst=dst, b0=b0):
                        _take(src, idx[s:e], dst[s - b0:e - b0])

                def on_ready(r, view=view, rounds=rounds, b0=b0):
                    s, e = rounds[r]
                    out[s:e].copy_(view[s - b0:e - b0], non_blocking=True)

                try:
                    _run_rows(fn, rounds, row_bytes, threads=threads, on_ready=on_ready)
                finally:  # after every copy that was queued, also when a piece failed
                    ev.record(stream)

    def _scatter_unique(self, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor, engine: str,
                        pos: Tensor | None = None) -> None:
        """``table[uniq] = rows`` (``table[uniq[i]] = rows[pos[i]]`` with ``pos``, a permutation of the rows
        of ``rows`` on the device); ``uniq`` checked and distinct, on ``self.device``."""
        self._check_writable()
        n = uniq.numel()
        if n == 0:
            return
        if pos is not None and (engine != "uva" or self.device.type != "cuda"):
            rows, pos = rows.index_select(0, pos), None
        self._land()
        if self.device.type != "cuda":
            self._host_rows("scatter", uniq.cpu() if uniq_cpu is None else uniq_cpu, rows)
            self._patch_prefetches(uniq, rows)
            return
        rows = rows.to(self.dtype).contiguous()
        if engine == "uva":
            _uva.scatter_tables([self._data], uniq, [rows], pos=pos)
            self._note_gpu_access("write")
        elif engine == "hybrid":
            self._hybrid("scatter", uniq, rows)
        else:
            self.synchronize()
            self._scatter_cpu(_host_index(uniq) if uniq_cpu is None else uniq_cpu, rows)
        if self._prefetches:
            self._patch_prefetches(uniq, rows if pos is None else rows.index_select(0, pos))

    def _scatter_cpu(self, uniq_cpu: Tensor, rows: Tensor, use: str = "scatter") -> None:
        """The CPU engine's scatter from the GPU: each chunk of ``rows`` is copied into page-locked staging
        memory (queued on the current stream, all at once), and its rows are written into the table (by
        torch or the worker pool, see :data:`CPU_COPY`) as soon as its copy has finished."""
        n = uniq_cpu.numel()
        if n == 0:
            return
        stage = _staging_for(self.device)
        stream = torch.cuda.current_stream(self.device)
        row_bytes = self.dim * self._data.element_size()
        way, threads = _copy_plan(self.device.index, use)
        with stage.lock:
            per = stage.rows_per_chunk(row_bytes, use)
            if per == 0:
                self._data.index_copy_(0, uniq_cpu, rows.cpu())
                return
            batches = stage.batches(n, row_bytes, per)
            # the next batch's copies may be queued while this one's rows are written only if its staging
            # cannot overlap this one's
            ahead = len(batches) > 1 and stage.max_pending(batches[0][1] * row_bytes) >= 1

            def stage_in(b0: int, b1: int):
                piece, ev = stage.take((b1 - b0) * row_bytes)
                view = piece.view(self.dtype).view(b1 - b0, self.dim)
                rounds = [(s, min(b1, s + per)) for s in range(b0, b1, per)]
                gates = []
                for s, e in rounds:
                    view[s - b0:e - b0].copy_(rows[s:e], non_blocking=True)
                    gate = torch.cuda.Event()
                    gate.record(stream)
                    gates.append(gate)
                ev.record(stream)
                return b0, view, rounds, gates

            pending = stage_in(*batches[0])
            for k in range(len(batches)):
                b0, view, rounds, gates = pending
                if ahead and k + 1 < len(batches):
                    pending = stage_in(*batches[k + 1])
                np_rows = None if way == "torch" else self._rows_np()
                _run_rows(_row_writer(way, self._data, np_rows, uniq_cpu, view, b0), rounds, row_bytes,
                          threads=threads, gates=gates)
                if not ahead and k + 1 < len(batches):
                    pending = stage_in(*batches[k + 1])

    def _gather_host(self, flat: Tensor, out: Tensor) -> None:
        """``out[:] = rows[flat]`` by the CPU engine for checked, non-empty host indices: no GPU sync, the copy
        to ``out`` queued on the current stream."""
        self._land()
        self._wait_gpu(reads=False)  # UVA writes launched before
        self._gather_cpu(flat, out, "gather host")

    def _scatter_host(self, flat: Tensor, owned: bool, rows: Tensor) -> None:
        """``table[flat] = rows`` by the CPU engine for checked, distinct, non-empty host indices (``owned``:
        ``flat`` is no memory of the caller's). Deferred (see :data:`DEFER_SCATTER`): the rows' copy into
        staging memory is queued, then the previous deferred scatter is written (while that copy runs)."""
        self._check_writable()
        rows = rows.to(device=self.device, dtype=self.dtype).contiguous()
        n = flat.numel()
        nbytes = n * self.dim * self._data.element_size()
        stage = _staging_for(self.device)
        stream = torch.cuda.current_stream(self.device)
        self._wait_gpu(reads=True)  # GPU reads and writes launched before finish before the host writes
        with stage.lock:
            prev = self._pending
            if prev is not None and prev.done:  # written already (its staging was taken): raise its error
                self._land()
                prev = None
            if not (DEFER_SCATTER and self._defer_ok and nbytes <= stage.nbytes // 2):
                self._land()
                self._scatter_cpu(flat, rows, "scatter host")
            else:
                plan = _copy_plan(self.device.index, "scatter host")
                p = _PendingWrite(stage, self._data, self._rows_np() if plan[0] == "pool" else None,
                                  flat if owned else flat.clone(), "scatter host", plan)
                piece, p.event = stage.take(nbytes, holder=p)
                p.view = piece.view(self.dtype).view(n, self.dim)
                p.view.copy_(rows, non_blocking=True)
                p.event.record(stream)
                self._pending = p
                if prev is not None:
                    prev.land()  # while this call's copy runs
                    if prev.error is not None:
                        p.cancel()
                        self._pending = None
                        raise RuntimeError(f"{prev.error} (this scatter was not written either)") from prev.error
        if self._prefetches:
            self._patch_prefetches(_device_index(flat, self.device), rows)

    # -- public gather / scatter -------------------------------------------------------------------------
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
            self._check_unique(flat)
            return flat, None
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        lo, hi = torch.stack([uniq[0], uniq[-1]]).tolist()
        _check_bounds(lo, hi, self.num_rows)
        return uniq, inverse

    def _check_unique(self, flat: Tensor) -> bool:
        """Bounds-check non-empty indices that the caller promises distinct, with one host sync; returns
        whether they are ascending."""
        asc = (flat[1:] >= flat[:-1]).all() if flat.numel() > 1 else torch.ones((), dtype=torch.bool,
                                                                                  device=flat.device)
        lo, hi, asc = torch.stack([*torch.aminmax(flat), asc.long()]).tolist()
        _check_bounds(lo, hi, self.num_rows)
        return bool(asc)

    def _gather_ordered(self, flat: Tensor, ascending: bool, out: Tensor, engine: str) -> None:
        """``out[:] = rows[flat]`` for checked, distinct, non-empty ``flat``. Indices out of order are sorted
        first on a CUDA device: rows read in address order cost far fewer host address translations (the
        UVA kernel reads sorted random rows of a 5 GB table twice as fast as the same rows unsorted); the
        kernel writes each row to its place in ``out``."""
        if ascending or self.device.type != "cuda" or flat.numel() < 2:
            self._gather_unique(flat, None, out, engine)
            return
        keys, order = self._sort_checked(flat)
        self._gather_unique(keys, None, out, engine, pos=order)

    def _sort_checked(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """``torch.sort(flat)`` of bounds-checked indices, sorting 32-bit keys where every row number fits
        (0.08 against 0.12 ms for 131,072 indices on an H200)."""
        if self.num_rows <= 1 << 31:
            keys, order = torch.sort(flat.int())
            return keys.long(), order
        return torch.sort(flat)

    def gather(self, idx, *, unique: bool = False, out: Tensor | None = None) -> Tensor:
        """Rows ``idx`` on :attr:`device`, shaped ``idx.shape + (dim,)``.

        Args:
            idx: integer indices of any shape (on any device; see the class notes for host indices).
            unique: promise that ``idx`` holds no duplicates (skips deduplication; bounds are still checked).
            out: optional contiguous ``(idx.numel(), dim)`` tensor on :attr:`device` to write into.
        """
        shape = tuple(idx.shape) if isinstance(idx, Tensor) else tuple(np.shape(idx))
        if self._host_route(idx, "gather"):
            flat, _ = _host_flat(idx)
            n = flat.numel()
            rows = self._rows_out(out, n)
            if n:
                _check_host_bounds(flat, self.num_rows)
                self._gather_host(flat, rows)
            return rows.view(*shape, self.dim)
        if unique:
            flat = _as_index(idx, self.device)
            n = flat.numel()
            ascending = self._check_unique(flat) if n else True
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
            self._check_out(out, inverse.numel())
            torch.index_select(rows, 0, inverse, out=out)
            rows = out
        else:
            rows = rows.index_select(0, inverse)
        return rows.view(*shape, self.dim)

    def _check_writable(self) -> None:
        if getattr(self, "_readonly", False):
            raise RuntimeError("this HostTable is a read-only memory map (mmap_mode='r'); it cannot be scattered to")

    def _rows_out(self, out: Tensor | None, n: int) -> Tensor:
        """``out`` checked to hold ``n`` rows, or a new tensor of ``n`` rows on :attr:`device`."""
        if out is None:
            return torch.empty(n, self.dim, dtype=self.dtype, device=self.device)
        self._check_out(out, n)
        return out

    def _check_out(self, out: Tensor, n: int) -> None:
        bad = out.shape != (n, self.dim) or out.dtype != self.dtype or out.device != self.device
        if bad or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous ({n}, {self.dim}) {self.dtype} tensor on {self.device}, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")

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
            flat, owned = _host_flat(idx)
            if flat.numel() == 0:
                return
            if unique:
                _check_host_bounds(flat, self.num_rows)
            else:
                keys = np.sort(flat.numpy())
                _check_bounds(int(keys[0]), int(keys[-1]), self.num_rows)
                dup = np.flatnonzero(keys[1:] == keys[:-1])
                if dup.size:
                    raise ValueError(f"scatter needs distinct indices, but index {int(keys[dup[0]])} appears "
                                     "more than once")
            self._scatter_host(flat, owned, flat_rows)
            return
        flat = _as_index(idx, self.device)
        n = flat.numel()
        if n == 0:
            return
        if unique:
            if self._check_unique(flat):
                keys, order = flat, None
            else:
                keys, order = self._sort_checked(flat)
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
        if unique and not _checked and self._host_route(idx, "gather"):
            return self._prefetch_host(idx)
        if self.device.type != "cuda":
            uniq, inverse, ascending = self._prefetch_indices(idx, unique, _checked)
            buf = torch.empty(uniq.numel() + 1, self.dim, dtype=self.dtype)
            if uniq.numel():
                self._gather_ordered(uniq, ascending, buf[:-1], "cpu")
            p = Prefetch(self, uniq, inverse, buf, None, sorted_=inverse is not None or _checked)
            self._prefetches.add(p)
            return p
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            uniq, inverse, ascending = self._prefetch_indices(idx, unique, _checked)
            buf = torch.empty(uniq.numel() + 1, self.dim, dtype=self.dtype, device=self.device)
            if uniq.numel():
                self._gather_ordered(uniq, ascending, buf[:-1], self.resolved_engine("gather"))
            ev = torch.cuda.Event()
            ev.record(side)
        p = Prefetch(self, uniq, inverse, buf, ev, sorted_=inverse is not None or _checked)
        self._prefetches.add(p)
        return p

    def _prefetch_host(self, idx) -> Prefetch:
        """:meth:`prefetch` of distinct host indices with the CPU engine: checked on the host, the rows staged
        now, their copy (and the indices' copy, for patching) queued on the side stream."""
        flat, _ = _host_flat(idx)
        n = flat.numel()
        if n:
            _check_host_bounds(flat, self.num_rows)
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            buf = torch.empty(n + 1, self.dim, dtype=self.dtype, device=self.device)
            if n:
                self._gather_host(flat, buf[:-1])
            ids = _device_index(flat, self.device)
            ev = torch.cuda.Event()
            ev.record(side)
        p = Prefetch(self, ids, None, buf, ev)
        self._prefetches.add(p)
        return p

    def _prefetch_indices(self, idx, unique: bool, checked: bool) -> tuple[Tensor, Tensor | None, bool]:
        if checked:  # distinct, in-range int64 indices on the device (checked by the caller), used as given
            return idx, None, True
        if unique:
            flat = _as_index(idx, self.device)
            return flat, None, (self._check_unique(flat) if flat.numel() else True)
        uniq, inverse = self.prepare(idx)
        return uniq, inverse, True

    def _patch_prefetches(self, idx: Tensor, rows: Tensor) -> None:
        for p in list(self._prefetches):
            p._patch(idx, rows)


class Prefetch:
    """Rows of a :class:`HostTable` being gathered on a side stream (see :meth:`HostTable.prefetch`).

    Attributes:
        indices: the distinct row indices, sorted (or in the given order when prefetched with ``unique=True``).
        inverse: ``indices[inverse]`` is the flattened index tensor that was asked for (``None`` with
            ``unique=True``).
    """

    def __init__(self, table: HostTable, indices: Tensor, inverse: Tensor | None, buf: Tensor, event,
                 sorted_: bool = False):
        self.table = table
        self.indices = indices
        self.inverse = inverse
        self._buf = buf
        self._event = event
        self._sorted = sorted_

    def _patch(self, idx: Tensor, rows: Tensor) -> None:
        n = self.indices.numel()
        if n == 0:
            return
        if self._sorted:
            keys, order = self.indices, None
        else:
            keys, order = torch.sort(self.indices)
        if self._event is not None:
            stream = torch.cuda.current_stream(self.table.device)
            stream.wait_event(self._event)
            self._buf.record_stream(stream)
        pos = torch.searchsorted(keys, idx).clamp_(max=n - 1)
        hit = keys[pos] == idx
        if order is not None:
            pos = order[pos]
        dest = torch.where(hit, pos, torch.full_like(pos, n))
        self._buf.index_copy_(0, dest, rows.to(self._buf.dtype))
        if self._event is not None:
            self._event.record(stream)

    def rows(self) -> Tensor:
        """The ``(len(indices), dim)`` rows of :attr:`indices`, valid on the current stream."""
        if self._event is not None:
            stream = torch.cuda.current_stream(self.table.device)
            stream.wait_event(self._event)
            for t in (self._buf, self.indices, self.inverse):
                if t is not None and t.numel():
                    t.record_stream(stream)
        return self._buf[:-1]

    def result(self) -> Tensor:
        """The rows in the order (and, flattened, the number) of the indices asked for."""
        rows = self.rows()
        return rows if self.inverse is None else rows.index_select(0, self.inverse)

    def release(self) -> None:
        """Stop patching this prefetch (call when its rows have been consumed)."""
        self.table._prefetches.discard(self)


# ----------------------------------------------------------------------------------------------------------


class HostArray:
    """Rows of a dataset in host memory (or a memory-mapped ``.npy``), gathered to the GPU by index.

    Row ``i`` may have any shape (an image, a token sequence); batches come back shaped
    ``idx.shape + row_shape`` on the compute device. Built on :class:`HostTable`, so it has the same
    engines, bounds checks and prefetch.

    Args:
        data: a tensor or array whose first axis indexes rows.
        device, pin, engine: as for :class:`HostTable`.

    Examples:
        >>> x = HostArray(torch.arange(12.).view(6, 2))
        >>> x[torch.tensor([4, 1])].tolist()
        [[8.0, 9.0], [2.0, 3.0]]
    """

    def __init__(self, data, *, device=None, pin: bool | None = None, engine: Engine | None = None,
                 _table: HostTable | None = None, _row_shape: tuple[int, ...] | None = None):
        if _table is not None:
            self.table, self.row_shape = _table, tuple(_row_shape or ())
            return
        t = data if isinstance(data, Tensor) else torch.from_numpy(np.ascontiguousarray(data))
        if t.dim() < 1:
            raise ValueError("HostArray needs at least one axis (rows)")
        self.row_shape = tuple(t.shape[1:])
        flat = t.reshape(t.shape[0], -1) if t.dim() != 2 else t
        if flat.shape[1] == 0:
            raise ValueError(f"HostArray rows must not be empty, got row shape {self.row_shape}")
        self.table = HostTable.from_tensor(flat, device=device, pin=pin, engine=engine)

    @classmethod
    def from_npy(cls, path: str | os.PathLike, *, mmap_mode: Literal["r+", "c", "r"] | None = "r",
                 device=None, pin: bool | None = None, engine: Engine | None = None) -> HostArray:
        """A dataset over a ``.npy`` file, memory-mapped read-only by default (see :meth:`HostTable.from_npy`)."""
        arr = np.load(os.fspath(path), mmap_mode=mmap_mode)
        if arr.ndim < 1:
            raise ValueError(f"{os.fspath(path)}: HostArray needs at least one axis (rows)")
        row_shape = tuple(arr.shape[1:])
        flat = arr.reshape(arr.shape[0], -1)
        if mmap_mode is None:
            table = HostTable.from_tensor(torch.from_numpy(flat), device=device, pin=pin, engine=engine)
        else:
            with _quiet_readonly():
                data = torch.from_numpy(flat)
            table = HostTable.__new__(HostTable)
            table._init(data, device=device, pin=bool(pin), engine=engine, keepalive=arr)
            table._readonly = mmap_mode == "r"
        return cls(None, _table=table, _row_shape=row_shape)

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.table.num_rows, *self.row_shape))

    def __getitem__(self, idx) -> Tensor:
        return self.gather(idx)

    def gather(self, idx, *, unique: bool = False) -> Tensor:
        """Rows ``idx`` on the compute device, shaped ``idx.shape + row_shape``."""
        shape = tuple(idx.shape) if isinstance(idx, Tensor) else tuple(np.shape(idx))
        return self.table.gather(idx, unique=unique).view(*shape, *self.row_shape)

    def prefetch(self, idx, *, unique: bool = False, _checked: bool = False) -> Prefetch:
        """Start gathering ``idx`` on a side stream (see :meth:`HostTable.prefetch`)."""
        return self.table.prefetch(idx, unique=unique)

    def __repr__(self) -> str:
        return f"HostArray(shape={tuple(self.shape)}, dtype={self.table.dtype}, device={self.device})"


def batches(*arrays: HostArray, batch_size: int, shuffle: bool = False, generator: torch.Generator | None = None,
            drop_last: bool = False) -> Iterator[Tensor | tuple[Tensor, ...]]:
    """Iterate over minibatches of equally long :class:`HostArray`\\ s, each batch on the compute device.

    The next batch is prefetched on a side stream while the caller works on the current one. Yields one
    tensor for one array, else a tuple.
    """
    if not arrays:
        raise ValueError("batches() needs at least one HostArray")
    n = len(arrays[0])
    for a in arrays[1:]:
        if len(a) != n:
            raise ValueError(f"batches(): arrays differ in length ({n} vs {len(a)})")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stops = list(range(batch_size, n + 1, batch_size))
    if not drop_last and (not stops or stops[-1] != n) and n > 0:
        stops.append(n)
    starts = [0, *stops[:-1]]

    def start(k: int) -> list[Prefetch]:
        idx = order[starts[k]:stops[k]]
        return [a.prefetch(idx, unique=True) for a in arrays]

    pending = start(0) if stops else None
    for k in range(len(stops)):
        current = pending
        pending = start(k + 1) if k + 1 < len(stops) else None
        out = []
        for a, p in zip(arrays, current, strict=True):
            out.append(p.rows().view(-1, *a.row_shape))
            p.release()
        yield out[0] if len(out) == 1 else tuple(out)


# ----------------------------------------------------------------------------------------------------------
# numpy <-> torch dtype helpers

_NP_STORE = {torch.bfloat16: np.uint16}


def _numpy_view(t: Tensor) -> np.ndarray:
    if t.dtype in _NP_STORE:
        return t.view(torch.int16).numpy().view(_NP_STORE[t.dtype])
    return t.numpy()


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


@contextlib.contextmanager
def _quiet_readonly():
    """torch.from_numpy warns on read-only arrays (pytest runs with warnings as errors); writes are refused
    by the table itself."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield

