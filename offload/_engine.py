"""The copy-engine interface of :class:`~offload.HostTable`, and the registry of engines.

An engine moves rows between a table's page-locked host memory and a tensor on the CUDA compute device. The
table does everything around it (checks indices, deduplicates, writes deferred rows first, patches pending
prefetches, routes a CPU compute device and host indices to the CPU engine), so an engine sees only the
core of a call: distinct, bounds-checked indices on the device and a contiguous tensor of the table's dtype.

Adding an engine: subclass :class:`RowEngine` in a module of its own, ``register_engine`` an instance there,
and import that module in :mod:`offload._choice` (which validates engine names against this registry); it
can then be named by ``engine=`` and :func:`~offload.set_engine`. ``"auto"`` picks only among the engines
that :func:`~offload.engine_choice` measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from . import _uva

if TYPE_CHECKING:
    from ._table import HostTable


class RowEngine:
    """One way of moving a table's rows; stateless (its state, if any, belongs to the table or the device)."""

    name: ClassVar[str]
    by_position: ClassVar[bool] = False
    """Whether :meth:`gather` / :meth:`scatter` take ``pos`` (rows addressed by position in the device
    tensor); else the table permutes the rows through a temporary and passes ``pos=None``."""

    def check(self, table: HostTable) -> None:
        """Raise ``RuntimeError`` (or ``ImportError``) when this engine cannot serve ``table`` (asked for
        explicitly: ``"auto"`` never picks an engine that cannot)."""

    def gather(self, table: HostTable, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor,
               pos: Tensor | None) -> None:
        """``out[:] = table[uniq]`` (``out[pos[i]] = table[uniq[i]]``), queued on the current stream.
        ``uniq``: distinct, checked indices on the device; ``uniq_cpu`` their host copy, or ``None``."""
        raise NotImplementedError

    def scatter(self, table: HostTable, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor,
                pos: Tensor | None) -> None:
        """``table[uniq] = rows`` (``table[uniq[i]] = rows[pos[i]]``): ordered after the current stream's
        work; ``rows`` is contiguous, of the table's dtype."""
        raise NotImplementedError

    @staticmethod
    def _require_gpu(name: str, table: HostTable) -> None:
        """For engines whose GPU reads host memory: a CUDA compute device, CuPy and a pinned table."""
        if table.device.type != "cuda":
            raise RuntimeError(f"the {name!r} offload engine needs a CUDA compute device; this table's is the CPU")
        _uva.require()
        if not table.pinned:
            raise RuntimeError(f"the {name!r} offload engine needs a pinned table (create it with pin=True)")


ENGINES: dict[str, RowEngine] = {}
"""The registered engines by name (``"auto"`` is not one: it picks among them)."""


def register_engine(engine: RowEngine) -> RowEngine:
    """Add ``engine`` to :data:`ENGINES` under its ``name``; refuses a name taken already."""
    if engine.name in ENGINES or engine.name == "auto":
        raise ValueError(f"an offload engine named {engine.name!r} exists already")
    ENGINES[engine.name] = engine
    return engine
