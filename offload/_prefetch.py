"""Prefetch: a table's rows gathered on a side stream ahead of their use, patched by later scatters so
they never go stale (:meth:`HostTable.prefetch <offload.HostTable.prefetch>` starts one and hands it to
the table's storage, which patches it until :meth:`Prefetch.release`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._storage import HostStorage


class Prefetch:
    """Rows of a :class:`HostTable` being gathered on a side stream (see :meth:`HostTable.prefetch`).

    Attributes:
        indices: the distinct row indices, sorted (or in the given order when prefetched with ``unique=True``).
        inverse: ``indices[inverse]`` is the flattened index tensor that was asked for (``None`` with
            ``unique=True``).
    """

    def __init__(self, storage: HostStorage, indices: Tensor, inverse: Tensor | None, buf: Tensor, event,
                 sorted_: bool = False):
        self.storage = storage
        self.indices = indices
        self.inverse = inverse
        self._buf = buf
        self._event = event
        self._sorted = sorted_
        storage.watch(self)

    def patch(self, idx: Tensor, rows: Tensor) -> None:
        """Write ``rows``, just written to rows ``idx`` of the table, into the prefetched rows they are among
        (the table's storage calls this for each write until :meth:`release`)."""
        n = self.indices.numel()
        if n == 0:
            return
        if self._sorted:
            keys, order = self.indices, None
        else:
            keys, order = torch.sort(self.indices)
        if self._event is not None:
            stream = torch.cuda.current_stream(self.storage.device)
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
            stream = torch.cuda.current_stream(self.storage.device)
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
        self.storage.unwatch(self)
