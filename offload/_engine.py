"""The copy-engine interface of :class:`~offload.HostTable`, and the registry of engines.

An engine moves rows between a table's page-locked host memory and a tensor on the CUDA compute device. The
table does everything around it (checks indices, deduplicates, writes deferred rows first, patches pending
prefetches, routes a CPU compute device and host indices to the CPU engine), so an engine sees only the
core of a call: the table's storage (:class:`RowStorage`: the host tensor and what orders access to it),
distinct, bounds-checked indices on the device and a contiguous tensor of the table's dtype.

Adding an engine: subclass :class:`RowEngine` in a module of its own, ``register_engine`` an instance there,
and add that module to ``_REGISTERED`` in :mod:`offload._choice` (which imports it, and validates engine names
against this registry); it can then be named by ``engine=`` and :func:`~offload.set_engine`. ``"auto"``
picks only among the engines that :func:`~offload.engine_choice` measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor

from . import _uva

if TYPE_CHECKING:
    from ._staging import PendingWrite


class RowStorage(Protocol):
    """What an engine gets of a table: its rows in host memory and the bookkeeping that orders access to them
    (implemented by :class:`offload._storage.HostStorage`, which the table owns)."""

    tensor: Tensor
    """The ``(num_rows, dim)`` host tensor itself (no waiting: see :meth:`synchronize`)."""
    device: torch.device
    """The compute device that rows are moved to and from."""
    pinned: bool
    """Whether the host tensor is page-locked (what the GPU's reads of host memory need)."""
    defer_ok: bool
    """Whether a scatter may be written after it returns (not for memory that outlives the process)."""
    pending: PendingWrite | None
    """The deferred scatter not yet written into the table (see :data:`~offload._staging.DEFER_SCATTER`)."""

    @property
    def num_rows(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def row_bytes(self) -> int: ...

    def land(self) -> None:
        """Write the deferred scatter, if any; raise its error if it failed (once)."""

    def wait_gpu(self, *, reads: bool) -> None:
        """Wait for the GPU-side writes (and, with ``reads``, reads) of the table launched so far."""

    def synchronize(self, *, reads: bool = True) -> None:
        """:meth:`land`, then :meth:`wait_gpu`: before the CPU touches the rows."""

    def note_gpu_access(self, kind: str) -> None:
        """Record that work on the current stream reads (``kind="read"``) or writes (``"write"``) the host rows
        (see :meth:`wait_gpu`)."""

    def side_stream(self) -> torch.cuda.Stream:
        """The table's side stream (prefetches, the hybrid engine's CPU part)."""

    def check_writable(self) -> None:
        """Raise ``RuntimeError`` for a read-only table (a memory map opened with ``mmap_mode="r"``)."""

    def numpy_rows(self) -> np.ndarray:
        """The host tensor as numpy rows (see :func:`~offload._row_copy._row_array`), made once."""

    @property
    def watched(self) -> bool:
        """Whether pending prefetches of the table must be patched by writes (:meth:`patch_prefetches`)."""

    def patch_prefetches(self, idx: Tensor, rows: Tensor) -> None:
        """Write ``rows``, just written to rows ``idx`` of the table, into its pending prefetches."""


class RowEngine:
    """One way of moving a table's rows; stateless (its state, if any, belongs to the storage or the device)."""

    name: ClassVar[str]
    by_position: ClassVar[bool] = False
    """Whether :meth:`gather` / :meth:`scatter` take ``pos`` (rows addressed by position in the device
    tensor); else the table permutes the rows through a temporary and passes ``pos=None``."""

    def check(self, storage: RowStorage) -> None:
        """Raise ``RuntimeError`` (or ``ImportError``) when this engine cannot serve ``storage`` (asked for
        explicitly: ``"auto"`` never picks an engine that cannot)."""

    def gather(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor,
               pos: Tensor | None) -> None:
        """``out[:] = storage[uniq]`` (``out[pos[i]] = storage[uniq[i]]``), queued on the current stream.
        ``uniq``: distinct, checked indices on the device; ``uniq_cpu`` their host copy, or ``None``."""
        raise NotImplementedError

    def scatter(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor,
                pos: Tensor | None) -> None:
        """``storage[uniq] = rows`` (``storage[uniq[i]] = rows[pos[i]]``): ordered after the current stream's
        work; ``rows`` is contiguous, of the table's dtype."""
        raise NotImplementedError

    @staticmethod
    def _require_gpu(name: str, storage: RowStorage) -> None:
        """For engines whose GPU reads host memory: a CUDA compute device, CuPy and a pinned table."""
        if storage.device.type != "cuda":
            raise RuntimeError(f"the {name!r} offload engine needs a CUDA compute device; this table's is the CPU")
        _uva.require()
        if not storage.pinned:
            raise RuntimeError(f"the {name!r} offload engine needs a pinned table (create it with pin=True)")


ENGINES: dict[str, RowEngine] = {}
"""The registered engines by name (``"auto"`` is not one: it picks among them)."""


def register_engine(engine: RowEngine) -> RowEngine:
    """Add ``engine`` to :data:`ENGINES` under its ``name``; refuses a name taken already."""
    if engine.name in ENGINES or engine.name == "auto":
        raise ValueError(f"an offload engine named {engine.name!r} exists already")
    ENGINES[engine.name] = engine
    return engine
