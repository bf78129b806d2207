"""The ``"uva"`` engine: a CuPy kernel on the current stream reads (writes) the page-locked rows directly
over PCIe (see :mod:`offload._uva`); it takes rows by position, so out-of-order indices need no temporary."""

from __future__ import annotations

from torch import Tensor

from . import _uva
from ._engine import RowEngine, RowStorage, register_engine


class UvaEngine(RowEngine):
    name = "uva"
    by_position = True

    def check(self, storage: RowStorage) -> None:
        self._require_gpu(self.name, storage)

    def gather(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor,
               pos: Tensor | None) -> None:
        _uva.gather_tables([storage.tensor], uniq, [out], pos=pos)
        storage.note_gpu_access("read")

    def scatter(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor,
                pos: Tensor | None) -> None:
        _uva.scatter_tables([storage.tensor], uniq, [rows], pos=pos)
        storage.note_gpu_access("write")


register_engine(UvaEngine())
