"""GPU-only: gather and scatter with indices in host memory (the CPU engine's path that never waits for the
GPU, and its deferred scatters), against plain torch indexing.

Most tests hold the stream back with ``torch.cuda._sleep`` before their calls: every copy the calls queue
then runs only after the host has gone on to the next calls, so a staging region reused too early, or a
write landing out of order, shows in the results.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import offload
from offload import _row_copy, _staging, _uva

pytestmark = pytest.mark.cuda

HOLD = 20_000_000  # GPU clock cycles that torch.cuda._sleep holds the stream back (about 10 ms)


@pytest.fixture
def small_staging(monkeypatch):
    """Staging of 64 units of 4 KiB (calls of up to 128 KiB are staged whole and deferred), fresh for the
    test and dropped after it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(_staging._Staging, "BYTES", 256 << 10)
    monkeypatch.setattr(_staging._Staging, "UNIT", 4 << 10)
    old = _staging._staging.pop(dev.index, None)
    yield dev
    _staging._staging.pop(dev.index, None)
    if old is not None:
        _staging._staging[dev.index] = old


def _table_of(rows=2000, dim=32, seed=0, engine="cpu"):
    src = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))
    return src, offload.HostTable.from_tensor(src, device="cuda", engine=engine)


@pytest.mark.parametrize("way", ["torch", "pool"])
def test_back_to_back_gathers_reuse_staging_safely(small_staging, monkeypatch, way):
    """Many gathers of host indices queued behind a held stream: staging wraps around many times, calls of
    one staging piece (deferred copies) and of several (larger than half the staging) alternate, and every
    result equals plain indexing."""
    monkeypatch.setattr(_row_copy, "CPU_COPY", way)
    monkeypatch.setattr(_row_copy, "CPU_THREADS", 3)
    src, t = _table_of()
    g = torch.Generator().manual_seed(1)
    sizes = [1, 700, 64, 2000, 5, 1000, 333] * 6  # rows of 128 bytes: 700 rows take 22 units, 2000 take 63
    idxs = [torch.randint(0, 2000, (n,), generator=g) for n in sizes]
    torch.cuda._sleep(HOLD)
    outs = []
    for i, idx in enumerate(idxs):
        if i % 3 == 0:
            outs.append(t.gather(idx))  # repeats: rows as indexed
        elif i % 3 == 1:
            outs.append(t.gather(idx.numpy()))  # a numpy array
        else:
            uniq = torch.randperm(2000, generator=g)[:len(idx)]
            idxs[i] = uniq
            outs.append(t.gather(uniq, unique=True))
    for idx, out in zip(idxs, outs, strict=True):
        assert torch.equal(out.cpu(), src[idx])


@pytest.mark.parametrize("defer", [True, False])
def test_back_to_back_scatters_land_in_order(small_staging, monkeypatch, defer):
    """Scatters of host indices (deferred, and not deferred) queued behind a held stream, on overlapping
    rows, with gathers of host and device indices in between: every gather sees exactly the writes before
    it, and the table ends as plain indexing leaves it."""
    monkeypatch.setattr(_staging, "DEFER_SCATTER", defer)
    src, t = _table_of()
    expected = src.clone()
    g = torch.Generator().manual_seed(2)
    torch.cuda._sleep(HOLD)
    checks = []
    for i in range(40):
        n = (5, 300, 1100, 64)[i % 4]  # 1100 rows of 128 bytes: more than half the staging
        idx = torch.randperm(400 if i % 2 else 2000, generator=g)[:n]  # overlapping rows
        vals = torch.randn(n, 32, generator=g)
        t.scatter(idx, vals.cuda(), unique=bool(i % 3))
        expected[idx] = vals
        probe = torch.randint(0, 2000, (50,), generator=g)
        got = t.gather(probe.cuda() if i % 5 == 0 else probe)  # device indices now and then
        checks.append((got, expected[probe].clone()))
    for got, want in checks:
        assert torch.equal(got.cpu(), want)
    assert torch.equal(t.data, expected)


def test_host_indices_do_not_wait_for_the_gpu():
    """Gathers and a scatter of host indices return while the stream is still held back (no GPU sync); a
    gather with device indices waits for it (its bounds check reads back from the GPU)."""
    _, t = _table_of(rows=5000)
    idx = torch.randperm(5000, generator=torch.Generator().manual_seed(3))[:1000]
    vals = torch.randn(1000, 32, device="cuda")
    t.gather(idx, unique=True)
    t.scatter(idx, vals, unique=True)
    t.synchronize()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(4 * HOLD)
    rows = t.gather(idx, unique=True)
    rows2 = t.gather(idx[:500].numpy())
    t.scatter(idx, vals * 2, unique=True)  # (the next use of the table waits for its rows)
    t_calls = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_all = time.perf_counter() - t0
    assert t_calls < 0.5 * t_all, (t_calls, t_all)
    assert torch.equal(rows, vals) and torch.equal(rows2, vals[:500])
    assert torch.equal(t.gather(idx, unique=True), vals * 2)
    t0 = time.perf_counter()
    torch.cuda._sleep(4 * HOLD)
    t.gather(idx.cuda(), unique=True)
    t_calls = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert t_calls > 0.5 * (time.perf_counter() - t0)


@pytest.mark.parametrize("idx_of", [list, np.array, torch.tensor])
def test_out_of_range_host_indices_raise_before_any_copy(monkeypatch, idx_of):
    src, t = _table_of(rows=50, dim=8)
    t.scatter(torch.tensor([3]), torch.ones(1, 8, device="cuda"))  # a deferred write, pending

    def no_staging(*args, **kwargs):
        raise RuntimeError("staging memory was taken")

    monkeypatch.setattr(_staging._Staging, "take", no_staging)
    for bad, named in (([0, 50], 50), ([-1, 2], -1), ([7, 2**40], 2**40)):
        calls = (lambda i: t.gather(i), lambda i: t.gather(i, unique=True), lambda i: t.prefetch(i, unique=True),
                 lambda i: t.scatter(i, torch.zeros(2, 8, device="cuda")),
                 lambda i: t.scatter(i, torch.zeros(2, 8, device="cuda"), unique=True))
        for call in calls:
            with pytest.raises(IndexError, match=f"index {named} is out of range for a table of 50 rows"):
                call(idx_of(bad))
    with pytest.raises(ValueError, match="index 4 appears more than once"):
        t.scatter(idx_of([4, 1, 4]), torch.zeros(3, 8, device="cuda"))
    monkeypatch.undo()
    expected = src.clone()
    expected[3] = 1.0
    assert torch.equal(t.data, expected)  # the pending write landed; nothing else was written


def test_engine_choice_knows_where_the_indices_are():
    choice = offload.engine_choice("cuda")
    assert set(choice) == {"gather", "scatter", "gather host", "scatter host"}
    assert set(choice.values()) <= {"uva", "cpu"}  # the hybrid is chosen explicitly or not at all
    t = offload.HostTable(100, 4, device="cuda", engine="auto")
    for op in ("gather", "scatter"):
        assert t.resolved_engine(op) == choice[op]
        assert t.resolved_engine(op, host_indices=True) == choice[f"{op} host"]
    t.engine = "cpu"  # an explicit engine is honoured whatever the indices
    assert t.resolved_engine("gather", host_indices=True) == "cpu" == t.resolved_engine("gather")
    if _uva.available(t.device):
        t.engine = "uva"
        assert t.resolved_engine("gather", host_indices=True) == "uva" == t.resolved_engine("scatter")
    with offload.use_engine("cpu"):
        assert offload.HostTable(10, 4, device="cuda").resolved_engine("scatter", host_indices=True) == "cpu"


def test_uva_engine_and_host_indices_interleave(small_staging):
    """The UVA kernel (reading and writing host memory from the GPU, stream-ordered) and deferred CPU-engine
    writes on the same rows, switching engines between calls."""
    pytest.importorskip("cupy")
    src, t = _table_of(rows=500)
    expected = src.clone()
    g = torch.Generator().manual_seed(4)
    torch.cuda._sleep(HOLD)
    checks = []
    for i in range(24):
        t.engine = ("cpu", "uva", "cpu", "hybrid")[i % 4]
        idx = torch.randperm(120, generator=g)[:60]
        vals = torch.randn(60, 32, generator=g)
        t.scatter(idx if i % 2 == 0 else idx.cuda(), vals.cuda(), unique=True)
        expected[idx] = vals
        t.engine = ("uva", "cpu", "hybrid", "cpu")[i % 4]
        probe = torch.randint(0, 120, (40,), generator=g)
        checks.append((t.gather(probe if i % 3 else probe.cuda()), expected[probe].clone()))
    for got, want in checks:
        assert torch.equal(got.cpu(), want)
    assert torch.equal(t.data, expected)


def test_deferred_scatter_failure_names_the_rows(small_staging, monkeypatch):
    """A deferred write that fails raises at the table's next use, naming its rows; a scatter whose call
    finds the previous one failed writes nothing either; afterwards the table works again."""
    monkeypatch.setattr(_row_copy, "CPU_COPY", "pool")
    monkeypatch.setattr(_row_copy, "CPU_THREADS", 1)
    src, t = _table_of(rows=100, dim=8)
    real = _row_copy.put_rows

    def broken(*args):
        raise MemoryError("no memory to write rows")

    monkeypatch.setattr(_row_copy, "put_rows", broken)
    t.scatter(torch.tensor([7, 3, 9]), torch.ones(3, 8, device="cuda"), unique=True)  # returns: deferred
    with pytest.raises(RuntimeError, match=r"its 3 rows \(indices 7, 3, 9; from 3 to 9\) did not all land "
                                           r"\(some of them may be written, others not\).*no memory to write rows"):
        t.synchronize()
    assert torch.equal(t.data, src)  # reported once; nothing was written here (the copy failed at once)
    t.scatter(torch.tensor([1]), torch.ones(1, 8, device="cuda"))
    with pytest.raises(RuntimeError, match=r"its 1 rows \(indices 1; from 1 to 1\).*this scatter was not "
                                           r"written either"):
        t.scatter(torch.tensor([2]), torch.ones(1, 8, device="cuda"))
    monkeypatch.setattr(_row_copy, "put_rows", real)
    assert torch.equal(t.data, src)
    t.scatter(torch.tensor([2]), torch.full((1, 8), 5.0, device="cuda"))
    expected = src.clone()
    expected[2] = 5.0
    assert torch.equal(t.gather(torch.arange(100).cuda()).cpu(), expected)


def test_memory_mapped_table_is_written_before_scatter_returns(tmp_path):
    """A table over a file is never deferred: the file holds the rows when scatter returns."""
    arr = np.zeros((64, 4), dtype=np.float32)
    np.save(tmp_path / "t.npy", arr)
    t = offload.HostTable.from_npy(tmp_path / "t.npy", device="cuda")
    t.scatter(np.array([5, 1]), torch.full((2, 4), 2.0, device="cuda"))
    assert t.storage.pending is None
    assert np.load(tmp_path / "t.npy", mmap_mode="r")[[1, 5]].tolist() == [[2.0] * 4] * 2
    shared = torch.zeros(64, 4).share_memory_()
    s = offload.HostTable.from_tensor(shared, device="cuda", copy=False, engine="cpu")
    s.scatter([9], torch.ones(1, 4, device="cuda"))
    assert s.storage.pending is None and shared[9].tolist() == [1.0] * 4


def test_prefetch_and_host_array_with_host_indices(small_staging):
    src, t = _table_of(rows=300)
    g = torch.Generator().manual_seed(5)
    idx = torch.randperm(300, generator=g)[:90]
    torch.cuda._sleep(HOLD)
    p = t.prefetch(idx.view(9, 10), unique=True)
    vals = torch.randn(10, 32, generator=g)
    t.scatter(idx[20:30], vals.cuda(), unique=True)  # after the prefetch: patched into it
    expected = src[idx].clone()
    expected[20:30] = vals
    assert torch.equal(p.indices.cpu(), idx) and torch.equal(p.rows().cpu(), expected)
    p.release()
    images = torch.randint(0, 255, (200, 3, 5), dtype=torch.uint8, generator=g)
    xs = offload.HostArray(images, device="cuda", engine="cpu")
    pick = torch.randint(0, 200, (4, 16), generator=g)
    assert torch.equal(xs[pick].cpu(), images[pick])
    same = torch.Generator()
    same.set_state(g.get_state())
    order = torch.randperm(200, generator=same)  # the order that batches() draws
    got = torch.cat([xb.cpu() for xb in offload.batches(xs, batch_size=17, shuffle=True, generator=g)])
    assert torch.equal(got, images[order])
