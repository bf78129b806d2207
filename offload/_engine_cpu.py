"""The ``"cpu"`` engine: the CPU copies rows between the table and page-locked staging memory (see
:mod:`offload._staging`), by torch's indexing or on a pool of threads (see :mod:`offload._row_copy`), and
each staging chunk crosses PCIe by an asynchronous copy as soon as its rows are there, so CPU copying and
the DMA overlap.

It also serves every table on a CPU compute device (:func:`host_rows`) and indices in host memory
(:func:`gather_host`, :func:`scatter_host`: no GPU synchronisation; a scatter's rows are written after it
returns, see :data:`~offload._staging.DEFER_SCATTER`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import _row_copy, _staging
from ._engine import RowEngine, RowStorage, register_engine
from ._index import _check_bounds, _check_host_bounds, _device_index, _host_flat, _host_index
from ._row_copy import _copy_plan, _row_array, _row_writer, _run_rows, _wide_pair
from ._staging import PendingWrite, _staging_for


def scatter_host_indices(storage: RowStorage, idx, rows: Tensor, unique: bool) -> None:
    """:meth:`HostTable.scatter` of indices in host memory: checked on the host (distinct by a sort unless
    ``unique``), written after the call returns (see :func:`scatter_host`)."""
    flat, owned = _host_flat(idx)
    if flat.numel() == 0:
        return
    if unique:
        _check_host_bounds(flat, storage.num_rows)
    else:
        keys = np.sort(flat.numpy())
        _check_bounds(int(keys[0]), int(keys[-1]), storage.num_rows)
        dup = np.flatnonzero(keys[1:] == keys[:-1])
        if dup.size:
            raise ValueError(f"scatter needs distinct indices, but index {int(keys[dup[0]])} appears "
                             "more than once")
    scatter_host(storage, flat, owned, rows)


def host_rows(storage: RowStorage, op: str, idx_cpu: Tensor, rows: Tensor) -> None:
    """A CPU compute device: ``rows[:] = table[idx]`` or ``table[idx] = rows``, in one torch indexing
    call or on the worker pool (see :data:`~offload._row_copy.CPU_COPY`)."""
    way, threads = _copy_plan(None, op)
    if op == "gather" and (not rows.is_contiguous() or rows.dtype != storage.dtype):
        raise ValueError(f"gather needs a contiguous {storage.dtype} output, got {rows.dtype}")
    if op == "scatter":
        rows = rows.detach().to(storage.dtype).contiguous()
    if way == "torch":
        table_w, rows_w = _wide_pair(storage.tensor, rows)
        if op == "gather":
            torch.index_select(table_w, 0, idx_cpu, out=rows_w)
        else:
            table_w.index_copy_(0, idx_cpu, rows_w)
        return
    row_bytes = storage.row_bytes
    src, idx, other = storage.numpy_rows(), idx_cpu.numpy(), _row_array(rows)
    per = max(1, _staging.host_chunk_bytes() // row_bytes)
    rounds = [(s, min(idx.shape[0], s + per)) for s in range(0, idx.shape[0], per)]
    if op == "gather":
        _run_rows(lambda s, e: _row_copy.take_rows(src, idx[s:e], other[s:e]), rounds, row_bytes, threads=threads)
    else:
        _run_rows(lambda s, e: _row_copy.put_rows(src, idx[s:e], other[s:e]), rounds, row_bytes, threads=threads)


def gather_cpu(storage: RowStorage, uniq_cpu: Tensor, out: Tensor, use: str = "gather") -> None:
    """The CPU engine's gather to the GPU: rows are copied into page-locked staging memory chunk by
    chunk (by torch or the worker pool, see :data:`~offload._row_copy.CPU_COPY`), and each chunk's copy to ``out`` is
    queued (on the current stream) as soon as its rows are there."""
    n = uniq_cpu.numel()
    if n == 0:
        return
    stage = _staging_for(storage.device)
    stream = torch.cuda.current_stream(storage.device)
    row_bytes = storage.row_bytes
    way, threads = _copy_plan(storage.device.index, use)
    with stage.lock:
        per = stage.rows_per_chunk(row_bytes, use)
        if per == 0:  # a row longer than the staging memory: copy directly
            out.copy_(storage.tensor.index_select(0, uniq_cpu), non_blocking=False)
            return
        for b0, b1 in stage.batches(n, row_bytes, per):
            piece, ev = stage.take((b1 - b0) * row_bytes)
            view = piece.view(storage.dtype).view(b1 - b0, storage.dim)
            rounds = [(s, min(b1, s + per)) for s in range(b0, b1, per)]
            if way == "torch":
                src_w, dst_w = _wide_pair(storage.tensor, view)

                def fn(s, e, src_w=src_w, dst_w=dst_w, b0=b0):
                    torch.index_select(src_w, 0, uniq_cpu[s:e], out=dst_w[s - b0:e - b0])
            else:
                src, idx, dst = storage.numpy_rows(), uniq_cpu.numpy(), _row_array(view)

                def fn(s, e, src=src, idx=idx, dst=dst, b0=b0):
                    _row_copy.take_rows(src, idx[s:e], dst[s - b0:e - b0])

            def on_ready(r, view=view, rounds=rounds, b0=b0):
                s, e = rounds[r]
                out[s:e].copy_(view[s - b0:e - b0], non_blocking=True)

            try:
                _run_rows(fn, rounds, row_bytes, threads=threads, on_ready=on_ready)
            finally:  # after every copy that was queued, also when a piece failed
                ev.record(stream)


def scatter_cpu(storage: RowStorage, uniq_cpu: Tensor, rows: Tensor, use: str = "scatter") -> None:
    """The CPU engine's scatter from the GPU: each chunk of ``rows`` is copied into page-locked staging
    memory (queued on the current stream, all at once), and its rows are written into the table (by
    torch or the worker pool, see :data:`~offload._row_copy.CPU_COPY`) as soon as its copy has finished."""
    n = uniq_cpu.numel()
    if n == 0:
        return
    stage = _staging_for(storage.device)
    stream = torch.cuda.current_stream(storage.device)
    row_bytes = storage.row_bytes
    way, threads = _copy_plan(storage.device.index, use)
    with stage.lock:
        per = stage.rows_per_chunk(row_bytes, use)
        if per == 0:
            storage.tensor.index_copy_(0, uniq_cpu, rows.cpu())
            return
        batches = stage.batches(n, row_bytes, per)
        # the next batch's copies may be queued while this one's rows are written only if its staging
        # cannot overlap this one's
        ahead = len(batches) > 1 and stage.max_pending(batches[0][1] * row_bytes) >= 1

        def stage_in(b0: int, b1: int):
            piece, ev = stage.take((b1 - b0) * row_bytes)
            view = piece.view(storage.dtype).view(b1 - b0, storage.dim)
            rounds = [(s, min(b1, s + per)) for s in range(b0, b1, per)]
            gates = []
            for s, e in rounds:
                view[s - b0:e - b0].copy_(rows[s:e], non_blocking=True)
                gate = torch.cuda.Event()
                gate.record(stream)
                gates.append(gate)
            ev.record(stream)
            return b0, view, rounds, gates

        pending = stage_in(*batches[0])
        for k in range(len(batches)):
            b0, view, rounds, gates = pending
            if ahead and k + 1 < len(batches):
                pending = stage_in(*batches[k + 1])
            rows_np = None if way == "torch" else storage.numpy_rows()
            _run_rows(_row_writer(way, storage.tensor, rows_np, uniq_cpu, view, b0), rounds, row_bytes,
                      threads=threads, gates=gates)
            if not ahead and k + 1 < len(batches):
                pending = stage_in(*batches[k + 1])


def gather_host(storage: RowStorage, flat: Tensor, out: Tensor) -> None:
    """``out[:] = rows[flat]`` by the CPU engine for checked, non-empty host indices: no GPU sync, the copy
    to ``out`` queued on the current stream."""
    storage.land()
    storage.wait_gpu(reads=False)  # UVA writes launched before
    gather_cpu(storage, flat, out, "gather host")


def scatter_host(storage: RowStorage, flat: Tensor, owned: bool, rows: Tensor) -> None:
    """``table[flat] = rows`` by the CPU engine for checked, distinct, non-empty host indices (``owned``:
    ``flat`` is no memory of the caller's). Deferred (see :data:`~offload._staging.DEFER_SCATTER`): the rows' copy into
    staging memory is queued, then the previous deferred scatter is written (while that copy runs)."""
    storage.check_writable()
    rows = rows.to(device=storage.device, dtype=storage.dtype).contiguous()
    n = flat.numel()
    nbytes = n * storage.row_bytes
    stage = _staging_for(storage.device)
    stream = torch.cuda.current_stream(storage.device)
    storage.wait_gpu(reads=True)  # GPU reads and writes launched before finish before the host writes
    with stage.lock:
        prev = storage.pending
        if prev is not None and prev.done:  # written already (its staging was taken): raise its error
            storage.land()
            prev = None
        if not (_staging.DEFER_SCATTER and storage.defer_ok and nbytes <= stage.nbytes // 2):
            storage.land()
            scatter_cpu(storage, flat, rows, "scatter host")
        else:
            plan = _copy_plan(storage.device.index, "scatter host")
            p = PendingWrite(stage, storage.tensor, storage.numpy_rows() if plan[0] == "pool" else None,
                             flat if owned else flat.clone(), "scatter host", plan)
            piece, p.event = stage.take(nbytes, holder=p)
            p.view = piece.view(storage.dtype).view(n, storage.dim)
            p.view.copy_(rows, non_blocking=True)
            p.event.record(stream)
            storage.pending = p
            if prev is not None:
                prev.land()  # while this call's copy runs
                if prev.error is not None:
                    p.cancel()
                    storage.pending = None
                    raise RuntimeError(f"{prev.error} (this scatter was not written either)") from prev.error
    if storage.watched:
        storage.patch_prefetches(_device_index(flat, storage.device), rows)


class CpuEngine(RowEngine):
    name = "cpu"

    def gather(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, out: Tensor,
               pos: Tensor | None) -> None:
        storage.synchronize(reads=False)
        gather_cpu(storage, _host_index(uniq) if uniq_cpu is None else uniq_cpu, out)

    def scatter(self, storage: RowStorage, uniq: Tensor, uniq_cpu: Tensor | None, rows: Tensor,
                pos: Tensor | None) -> None:
        storage.synchronize()
        scatter_cpu(storage, _host_index(uniq) if uniq_cpu is None else uniq_cpu, rows)


register_engine(CpuEngine())
