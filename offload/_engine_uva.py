"""The ``"uva"`` engine: a CuPy kernel on the current stream reads (writes) the page-locked rows directly
over PCIe (see :mod:`offload._uva`); it takes rows by position, so out-of-order indices need no temporary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from . import _uva
from ._engine import RowEngine, register_engine

if TYPE_CHECKING:
    from ._table import HostTable


class UvaEngine(RowEngine):
    name = "uva"
    by_position = True

    def check(self, table: HostTable) -> None:
        self._require_gpu(self.name, table)

    def gather(self, table: HostTable, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor,
               pos: Tensor | None) -> None:
        _uva.gather_tables([table._data], uniq, [out], pos=pos)
        table._note_gpu_access("read")

    def scatter(self, table: HostTable, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor,
                pos: Tensor | None) -> None:
        _uva.scatter_tables([table._data], uniq, [rows], pos=pos)
        table._note_gpu_access("write")


register_engine(UvaEngine())
