"""Dataset rows in host memory gathered to the GPU by index: :class:`HostArray` (rows of any shape, built on
:class:`~offload.HostTable`) and :func:`batches` (minibatches, the next one prefetched while the caller
works on the current one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from ._choice import Engine
from ._index import _quiet_readonly
from ._prefetch import Prefetch
from ._table import HostTable, table_over

__all__ = ["HostArray", "batches"]


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
            table = table_over(data, keepalive=arr, writable=mmap_mode != "r", device=device, pin=bool(pin),
                               engine=engine)
        return cls(None, _table=table, _row_shape=row_shape)

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def device(self) -> torch.device:
        """The compute device that indexing returns rows on."""
        return self.table.device

    @property
    def shape(self) -> torch.Size:
        """``(rows, *row_shape)``, as the array was made."""
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
