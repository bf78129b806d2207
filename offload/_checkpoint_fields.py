"""The fields of an :class:`~offload.OffloadedEmbedding` that :mod:`offload._checkpoint` reads and writes by
their old private names, kept over the embedding's parts until the checkpoint code takes the parts it needs
(``RowTables``, ``OptimizerState``, ``GpuCache``: see docs/design.md); then this module goes."""

from __future__ import annotations

import weakref

from ._table import HostTable


class CheckpointFields:
    """``_state_tables``, ``_spec``, ``_optimizer``, ``_loaded`` and ``_pending`` of the embedding, over its parts
    ``_tables`` (:class:`~offload._row_tables.RowTables`), ``_optim``
    (:class:`~offload._optim_state.OptimizerState`) and ``_prefetcher``."""

    @property
    def _state_tables(self) -> dict[str, HostTable]:
        return self._tables.states

    @_state_tables.setter
    def _state_tables(self, tables: dict[str, HostTable]) -> None:
        self._tables.states = tables

    @property
    def _spec(self) -> dict[str, float]:
        return self._tables.spec

    @_spec.setter
    def _spec(self, spec: dict[str, float]) -> None:
        self._tables.spec = spec

    @property
    def _optimizer(self) -> weakref.ref | None:
        optimizer = self._optim.optimizer
        return None if optimizer is None else weakref.ref(optimizer)

    @_optimizer.setter
    def _optimizer(self, ref: weakref.ref | None) -> None:
        self._optim.optimizer = None if ref is None else ref()

    @property
    def _loaded(self) -> dict | None:
        return self._optim.loaded

    @_loaded.setter
    def _loaded(self, loaded: dict | None) -> None:
        self._optim.loaded = loaded

    @property
    def _pending(self) -> None:
        return None

    @_pending.setter
    def _pending(self, value: None) -> None:
        self._prefetcher.release_pending()
