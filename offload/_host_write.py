"""Writing rows back to host tables: several tables (a row's weight and its optimizer state) by the same
ids at once, all or nothing (:func:`commit`), and moving rows of several tables between the host and the
GPU together (:func:`move`: one UVA launch for all of them where it can run)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

from . import _uva
from ._choice import get_engine
from ._table import HostTable


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


def stage_rows(rows: Tensor) -> Tensor:
    """Phase 1 of a commit: a host copy of ``rows`` that no later GPU work can change."""
    if rows.device.type == "cpu":
        return rows.detach().clone()
    out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    out.copy_(rows.detach(), non_blocking=True)
    return out


def cache_engine(table: HostTable, op: str) -> str:
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
        t.storage.check_writable()


def _land(tables: list[HostTable]) -> None:
    """Before a kernel of ours touches their rows: the tables' deferred host writes are written first (as
    their gathers and scatters do)."""
    for t in tables:
        t.storage.land()


def _prepare_uva(op: str, tables: list[HostTable], ids: Tensor, devs: list[Tensor],
                 pos: Tensor | None = None) -> list[tuple]:
    """The UVA launches that move rows ``ids`` of ``tables`` to or from ``devs`` (see :func:`_uva.prepare`):
    one per four tables of one shape and dtype (a row's weight and its optimizer state move together)."""
    hosts = [t.storage.tensor for t in tables]
    if all(h.shape == hosts[0].shape and h.dtype == hosts[0].dtype for h in hosts):
        return _uva.prepare(op, hosts, ids, devs, pos)
    return [x for h, d in zip(hosts, devs, strict=True) for x in _uva.prepare(op, [h], ids, [d], pos)]


def _noted(tables: list[HostTable], kind: str, ids: Tensor, rows: list[Tensor], pos: Tensor | None = None) -> None:
    """Tell ``tables`` that a kernel on the current stream read (``kind="read"``) or wrote rows ``ids`` of
    them; written rows (``rows[j][pos]``, or ``rows[j]`` in the order of ``ids``) are patched into pending
    :meth:`HostTable.prefetch` copies."""
    for t, r in zip(tables, rows, strict=True):
        t.storage.note_gpu_access(kind)
        if kind == "write" and t.storage.watched:
            t.storage.patch_prefetches(ids, r if pos is None else r.index_select(0, pos))


def commit(ids: Tensor, writes: list[tuple[HostTable, Tensor]], engines: list[str] | None = None) -> None:
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
            _uva.check_and_compile(t.storage.tensor, ids, rows)
        with _signals_deferred():
            for (t, _), rows, engine in zip(writes, rows_list, engines, strict=True):
                t.scatter_distinct(ids, rows, engine=engine)
        return
    ids_cpu = ids.cpu()
    staged = [stage_rows(rows) for _, rows in writes]
    if ids.device.type == "cuda":
        torch.cuda.current_stream(ids.device).synchronize()
    for table, _ in writes:
        table.synchronize()
    with _signals_deferred():
        for (table, rows), host_rows in zip(writes, staged, strict=True):
            table.storage.tensor.index_copy_(0, ids_cpu, host_rows)
            table.storage.patch_prefetches(ids, rows)


def move(op: str, tables: list[HostTable], ids: Tensor, devs: list[Tensor], pos: Tensor | None,
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
        commit(ids, [(t, d if pos is None else d.index_select(0, pos)) for t, d in zip(tables, devs, strict=True)],
                [cache_engine(t, "scatter") for t in tables])
        return
    for t, d in zip(tables, devs, strict=True):
        tmp = torch.empty(ids.numel(), t.dim, dtype=t.dtype, device=d.device)
        t.gather_distinct(ids, tmp, engine=cache_engine(t, "gather"))
        if pos is None:
            d.copy_(tmp)
        else:
            d.index_copy_(0, pos, tmp)
