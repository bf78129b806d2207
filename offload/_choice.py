"""Which engine a table uses: the default-engine switch (:func:`get_engine`, :func:`set_engine`,
:func:`use_engine`, ``$TORCHMB_OFFLOAD_ENGINE``) and what ``"auto"`` picks (:func:`engine_choice`, measured
once per device: it also sets the CPU engine's way of copying rows and its staging chunk size).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal, Protocol

import torch
from torch import Tensor

import torchmb_config

from . import _engine_cpu, _engine_hybrid, _engine_uva, _row_copy, _staging, _uva
from ._engine import ENGINES
from ._memory import host_memory_available

__all__ = ["engine_choice", "get_engine", "set_engine", "use_engine"]


class MeasuredTable(Protocol):
    """What :func:`engine_choice` uses of the table it measures on (a :class:`~offload.HostTable`)."""

    engine: str | None

    def gather_distinct(self, ids: Tensor, out: Tensor, *, engine: str | None = None) -> None: ...
    def scatter_distinct(self, ids: Tensor, rows: Tensor, *, engine: str | None = None) -> None: ...
    def gather(self, idx, *, unique: bool = False, out: Tensor | None = None) -> Tensor: ...
    def scatter(self, idx, rows: Tensor, *, unique: bool = False) -> None: ...
    def synchronize(self, *, reads: bool = True) -> None: ...
    def close(self) -> None: ...


TABLE: Callable[..., MeasuredTable] | None = None
"""The table class that :func:`engine_choice` measures on: :class:`~offload.HostTable`, which sets it
here when it is defined (``offload._table`` imports this module; this module does not import it)."""

_REGISTERED = (_engine_cpu, _engine_hybrid, _engine_uva)
"""The engine modules (importing one registers its engine): adding an engine adds its module here."""
Engine = Literal["auto", "uva", "cpu", "hybrid"]
ENV_ENGINE = "TORCHMB_OFFLOAD_ENGINE"

# ----------------------------------------------------------------------------------------------------------
# The engine switch


def _check_engine(name: str) -> str:
    names = ("auto", *ENGINES)
    if name not in names:
        raise ValueError(f"offload engine must be one of {names}, got {name!r}")
    return name


_SWITCH = torchmb_config.SWITCHES["offload_engine"]
_SWITCH.parse = _SWITCH.check = _check_engine  # the engine names are offload's


def get_engine() -> str:
    """The default engine of tables created without ``engine=``: ``"auto"``, ``"uva"``, ``"cpu"`` or ``"hybrid"``.

    Starts as ``$TORCHMB_OFFLOAD_ENGINE`` (default ``"auto"``).
    """
    return _SWITCH.get()


def set_engine(name: Engine) -> None:
    """Set the default engine (see :func:`get_engine`)."""
    _SWITCH.set(name)


@contextlib.contextmanager
def use_engine(name: Engine) -> Iterator[None]:
    """Use ``name`` as the default engine inside the block; the old default is restored after."""
    old = get_engine()
    set_engine(name)
    try:
        yield
    finally:
        set_engine(old)


_picked: dict[int, dict[str, str]] = {}  # device -> engine_choice's answer
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
(see :data:`offload._row_copy.CPU_COPY`)."""

CPU_CHOICES_HOST = (("torch", 16, 1), ("torch", 32, 1), ("torch", 64, 1))
"""The same for the CPU engine with indices in host memory, whose calls overlap one another (see
:func:`engine_choice`); 64 MiB chunks copy the measuring call's rows in one piece. (On an H200 with 16 host
cores the pool took 6 to 12 times as long as torch's indexing in back-to-back calls, so it is not tried.)"""

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
    rows of a large table that lie far from the others (see :data:`~offload._engine_hybrid.LONE_BLOCK_BYTES`),
    which the measuring table's dense rows do not have, and where measured on a 5 GB table its own costs
    outweighed that gain.
    Without CuPy or a suitable GPU every answer is ``"cpu"``.
    """
    if not torch.cuda.is_available():
        return dict.fromkeys(CHOICE_KEYS, "cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return dict.fromkeys(CHOICE_KEYS, "cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _choice_lock:
        got = _picked.get(index)
        if got is None:
            got = (_measure(torch.device("cuda", index)) if _uva.available(dev)
                   else dict.fromkeys(CHOICE_KEYS, "cpu"))
            _picked[index] = got
    return dict(got)


def _set_way(key: tuple[int, str], way: tuple[str, int, int]) -> None:
    """Set the CPU engine's way of copying rows for ``key`` (see :data:`CPU_CHOICES`)."""
    _row_copy.set_copy_way(key, way[0], way[2])
    _staging.set_chunk_bytes(key, way[1] << 20)


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
    table = TABLE(rows, dim, torch.float32, device=device, pin=True, engine="cpu", fill=None)
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
                    table.gather_distinct(idx_dev, buf, engine=eng)
                else:
                    table.scatter_distinct(idx_dev, buf, engine=eng)

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
