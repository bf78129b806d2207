"""Prefetch: a table's rows gathered on a side stream ahead of their use, patched by later scatters so
they never go stale (:meth:`HostTable.prefetch <offload.HostTable.prefetch>` starts one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import _engine_cpu
from ._index import _as_index, _check_host_bounds, _device_index, _host_flat, check_unique

if TYPE_CHECKING:
    from ._table import HostTable


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


def start(table: HostTable, idx, *, unique: bool = False, _checked: bool = False) -> Prefetch:
    """:meth:`HostTable.prefetch <offload.HostTable.prefetch>`: the rows ``idx`` of ``table`` gathered on its
    side stream (see there)."""
    if unique and not _checked and table._host_route(idx, "gather"):
        return _start_host(table, idx)
    if table.device.type != "cuda":
        uniq, inverse, ascending = _indices(table, idx, unique, _checked)
        buf = torch.empty(uniq.numel() + 1, table.dim, dtype=table.dtype)
        if uniq.numel():
            table._gather_ordered(uniq, ascending, buf[:-1], "cpu")
        p = Prefetch(table, uniq, inverse, buf, None, sorted_=inverse is not None or _checked)
        table._prefetches.add(p)
        return p
    side = table._side_stream()
    side.wait_stream(torch.cuda.current_stream(table.device))
    with torch.cuda.stream(side):
        uniq, inverse, ascending = _indices(table, idx, unique, _checked)
        buf = torch.empty(uniq.numel() + 1, table.dim, dtype=table.dtype, device=table.device)
        if uniq.numel():
            table._gather_ordered(uniq, ascending, buf[:-1], table.resolved_engine("gather"))
        ev = torch.cuda.Event()
        ev.record(side)
    p = Prefetch(table, uniq, inverse, buf, ev, sorted_=inverse is not None or _checked)
    table._prefetches.add(p)
    return p


def _start_host(table: HostTable, idx) -> Prefetch:
    """:func:`start` of distinct host indices with the CPU engine: checked on the host, the rows staged
    now, their copy (and the indices' copy, for patching) queued on the side stream."""
    flat, _ = _host_flat(idx)
    n = flat.numel()
    if n:
        _check_host_bounds(flat, table.num_rows)
    side = table._side_stream()
    side.wait_stream(torch.cuda.current_stream(table.device))
    with torch.cuda.stream(side):
        buf = torch.empty(n + 1, table.dim, dtype=table.dtype, device=table.device)
        if n:
            _engine_cpu.gather_host(table, flat, buf[:-1])
        ids = _device_index(flat, table.device)
        ev = torch.cuda.Event()
        ev.record(side)
    p = Prefetch(table, ids, None, buf, ev)
    table._prefetches.add(p)
    return p


def _indices(table: HostTable, idx, unique: bool, checked: bool) -> tuple[Tensor, Tensor | None, bool]:
    if checked:  # distinct, in-range int64 indices on the device (checked by the caller), used as given
        return idx, None, True
    if unique:
        flat = _as_index(idx, table.device)
        return flat, None, (check_unique(flat, table.num_rows) if flat.numel() else True)
    uniq, inverse = table.prepare(idx)
    return uniq, inverse, True
