"""The ``"hybrid"`` engine: both engines at once on disjoint rows of one call, the CPU engine moving the
lone rows (see :data:`LONE_BLOCK_BYTES`) on a side stream while the UVA kernel moves the rest."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _engine_cpu, _uva
from ._engine import RowEngine, RowStorage, register_engine

LONE_BLOCK_BYTES = 128 << 10
"""The hybrid engine's split: a row of a call is *lone* when no other row of the call lies in the same
``LONE_BLOCK_BYTES``-aligned block of the table. The CPU engine moves the lone rows, the UVA kernel the rest.
Measured on H200s (``tests/benchmarks/bench_host_table.py --lone``; 131,072 sorted random rows of a 5 GB
table): the UVA kernel read them at 0.76-0.87 of the contiguous copy, but as many rows two to a 1 KiB block,
four to a 64 KiB block or all within 2 GiB at 0.88-0.92. What costs the GPU is reaching host addresses far
from the others, and the few lone rows (3.4% at 128 KiB) cost most: the kernel read the other 96.6% in
1.29-1.34 ms against 1.43-1.57 ms for as many rows drawn at random, and with the lone rows' bytes copied
beside it the two took 1.33-1.38 ms (0.88-0.91)."""

HYBRID_MIN_LONE_BYTES = 1 << 20
"""The hybrid engine leaves every row to the UVA kernel when its lone rows (see :data:`LONE_BLOCK_BYTES`)
hold fewer bytes than this: the CPU part costs a host synchronisation and a fixed ~0.2 ms, more than the
kernel loses on a few lone rows. Calls whose lone rows, were the rows spread uniformly, would not reach it
skip the count (and its synchronisation) altogether."""


def lone_split(storage: RowStorage, uniq: Tensor) -> tuple[Tensor, Tensor] | None:
    """The hybrid's split of distinct GPU indices: the positions of the lone rows and of the others (each
    in the order of ``uniq``, which should be ascending: neighbours are compared), or ``None`` where the
    lone rows are too few to hand to the CPU engine (see :data:`HYBRID_MIN_LONE_BYTES`)."""
    n = uniq.numel()
    row_bytes = storage.row_bytes
    rows_per_block = LONE_BLOCK_BYTES / row_bytes
    if rows_per_block < 2 or n < 2:  # a row as long as a block reaches its addresses in one sweep
        return None
    expected = n * math.exp(-n * rows_per_block / max(1, storage.num_rows))  # lone rows if spread uniformly
    if expected * row_bytes < HYBRID_MIN_LONE_BYTES:
        return None
    block = uniq * row_bytes // LONE_BLOCK_BYTES
    same = torch.nn.functional.pad(block[1:] == block[:-1], (1, 1))  # same[i]: rows i - 1 and i share a block
    near = same[1:] | same[:-1]
    lone = torch.nonzero(~near).squeeze(1)  # (reads the count back)
    if lone.numel() * row_bytes < HYBRID_MIN_LONE_BYTES:
        return None
    return lone, torch.nonzero_static(near, size=n - lone.numel()).squeeze(1)


def hybrid(storage: RowStorage, op: str, uniq: Tensor, rows: Tensor) -> None:
    """``rows[:] = storage[uniq]`` (gather) or ``storage[uniq] = rows`` (scatter) for checked, distinct
    (best ascending) GPU indices by both engines at once: the UVA kernel on the current stream, the CPU
    engine's copies of the lone rows on a side stream, so that GPU-initiated and DMA transfers share the
    PCIe link (see :data:`LONE_BLOCK_BYTES`)."""
    split = lone_split(storage, uniq)
    if split is None:
        (_uva.gather_rows if op == "gather" else _uva.scatter_rows)(storage.tensor, uniq, rows)
        storage.note_gpu_access("read" if op == "gather" else "write")
        return
    lone, near = split
    storage.synchronize(reads=op == "scatter")  # the CPU part must not overtake earlier GPU accesses
    main = torch.cuda.current_stream(storage.device)
    side = storage.side_stream()
    lone_idx = torch.empty(lone.numel(), dtype=torch.int64, pin_memory=True)
    lone_idx.copy_(uniq.index_select(0, lone), non_blocking=True)
    staged = (torch.empty(lone.numel(), storage.dim, dtype=storage.dtype, device=storage.device) if op == "gather"
              else rows.index_select(0, lone))
    ready = torch.cuda.Event()
    ready.record(main)  # before the kernel: the CPU part need not wait for it
    if op == "gather":
        _uva.gather_tables([storage.tensor], uniq.index_select(0, near), [rows], pos=near)
    else:
        _uva.scatter_tables([storage.tensor], uniq.index_select(0, near), [rows], pos=near)
    storage.note_gpu_access("read" if op == "gather" else "write")
    ready.synchronize()
    side.wait_event(ready)
    with torch.cuda.stream(side):
        if op == "gather":
            _engine_cpu.gather_cpu(storage, lone_idx, staged)
        else:
            _engine_cpu.scatter_cpu(storage, lone_idx, staged)
    main.wait_stream(side)
    staged.record_stream(side)
    if op == "gather":
        rows.index_copy_(0, lone, staged)


class HybridEngine(RowEngine):
    name = "hybrid"

    def check(self, storage: RowStorage) -> None:
        self._require_gpu(self.name, storage)

    def gather(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor,
               pos: Tensor | None) -> None:
        hybrid(storage, "gather", uniq, out)

    def scatter(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor,
                pos: Tensor | None) -> None:
        hybrid(storage, "scatter", uniq, rows)


register_engine(HybridEngine())
