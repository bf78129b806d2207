"""The host tables that hold a row of an :class:`~offload.OffloadedEmbedding`: the weight's and, once an
optimizer is attached, one per per-row optimizer state. Every part of the embedding (its GPU cache, working
set, prefetcher, optimizer-state switcher) reads them here, so replacing a table (a checkpoint load) or
attaching an optimizer changes them for all parts at once."""

from __future__ import annotations

import torch

from ._table import HostTable


class RowTables:
    """``weight``: the table of the weight rows; ``spec``: the per-row state the attached optimizer keeps
    (name -> initial value, see :func:`~offload.row_state_spec`); ``states``: a host table per name."""

    def __init__(self, weight: HostTable):
        self.weight = weight
        self.spec: dict[str, float] = {}
        self.states: dict[str, HostTable] = {}

    @property
    def keys(self) -> tuple[str, ...]:
        """The per-row state names, in the order of :meth:`all` after the weight."""
        return tuple(self.spec)

    def all(self) -> list[HostTable]:
        """The weight's table, then the per-row state's (the order of a cached row's parts)."""
        return [self.weight, *(self.states[k] for k in self.spec)]

    def set_states(self, spec: dict[str, float], states: dict[str, HostTable]) -> None:
        self.spec, self.states = spec, states

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def num_rows(self) -> int:
        return self.weight.num_rows

    @property
    def dim(self) -> int:
        return self.weight.dim

    def row_bytes(self) -> int:
        """Bytes of one row with its per-row state."""
        return self.dim * self.dtype.itemsize * (1 + len(self.spec))

    def move_to(self, device: torch.device) -> None:
        for t in self.all():
            t.device = device
