"""HostTable, HostArray and the engine switch, against plain torch indexing."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from support.lone import lone_positions

import offload
import torchmb_config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _table(device, rows=50, dim=7, dtype=torch.float32, seed=0):
    src = (torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)
    return src, offload.HostTable.from_tensor(src, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8])
def test_gather_and_scatter_match_indexing(device, dtype):
    src, t = _table(device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50, (4, 9), generator=g)  # with duplicates
    out = t.gather(idx.to(device))
    assert out.shape == (4, 9, 7) and out.device.type == device and out.dtype == dtype
    assert torch.equal(out.cpu(), src[idx])
    new_idx = torch.randperm(50, generator=g)[:13]
    rows = (torch.randn(13, 7, generator=g) * 100).to(dtype)
    t.scatter(new_idx, rows.to(device))
    expected = src.clone()
    expected[new_idx] = rows
    assert torch.equal(t.data, expected)
    buf = torch.empty(13, 7, dtype=dtype, device=device)
    assert t.gather(new_idx, unique=True, out=buf).data_ptr() == buf.data_ptr()
    assert torch.equal(buf.cpu(), rows)


def test_bounds_duplicates_and_types_are_checked_before_any_access():
    src, t = _table("cpu")
    for bad in ([0, 50], [-1, 2]):
        for call in (lambda i: t.gather(torch.tensor(i)), lambda i: t.gather(torch.tensor(i), unique=True),
                     lambda i: t.scatter(torch.tensor(i), torch.zeros(2, 7)), lambda i: t.prefetch(torch.tensor(i))):
            with pytest.raises(IndexError, match=f"index {max(bad) if bad[1] == 50 else -1} is out of range "
                                                 f"for a table of 50 rows"):
                call(bad)
    assert torch.equal(t.data, src)  # nothing was written
    with pytest.raises(ValueError, match="index 3 appears more than once"):
        t.scatter(torch.tensor([3, 1, 3]), torch.zeros(3, 7))
    assert torch.equal(t.data, src)
    with pytest.raises(TypeError, match=r"indices must be an integer tensor, got dtype torch\.float32"):
        t.gather(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"rows must have shape idx.shape \+ \(7,\)"):
        t.scatter(torch.tensor([1, 2]), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        t.gather(torch.tensor([1, 2]), unique=True, out=torch.empty(3, 7))


def test_prefetch_returns_rows_and_stays_fresh():
    src, t = _table("cpu")
    idx = torch.tensor([[5, 2], [5, 40]])
    p = t.prefetch(idx)
    t.scatter(torch.tensor([40, 9]), torch.full((2, 7), 3.0))  # after the prefetch started
    expected = src.clone()
    expected[40] = 3.0
    assert torch.equal(p.result().view(2, 2, 7), expected[idx])
    assert torch.equal(p.indices, torch.tensor([2, 5, 40]))
    p.release()
    t.scatter(torch.tensor([2]), torch.zeros(1, 7))
    assert torch.equal(p.rows()[0], expected[2])  # released: no longer patched


def test_npy_memory_mapping(tmp_path):
    arr = np.arange(60, dtype=np.float32).reshape(12, 5)
    path = tmp_path / "t.npy"
    np.save(path, arr)
    shared = offload.HostTable.from_npy(path)  # r+: writes reach the file
    shared.scatter(torch.tensor([3]), torch.full((1, 5), -1.0))
    shared.synchronize()
    del shared
    assert np.load(path)[3].tolist() == [-1.0] * 5
    cow = offload.HostTable.from_npy(path, mmap_mode="c")
    cow.scatter(torch.tensor([4]), torch.full((1, 5), -2.0))
    assert cow.data[4].tolist() == [-2.0] * 5 and np.load(path)[4].tolist() == arr[4].tolist()
    ro = offload.HostTable.from_npy(path, mmap_mode="r")
    assert ro.gather(torch.tensor([4])).tolist() == [arr[4].tolist()]
    with pytest.raises(RuntimeError, match="read-only memory map"):
        ro.scatter(torch.tensor([4]), torch.zeros(1, 5))
    loaded = offload.HostTable.from_npy(path, mmap_mode=None)
    assert loaded.data[3].tolist() == [-1.0] * 5
    np.save(tmp_path / "bad.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="needs a 2-D array, got shape"):
        offload.HostTable.from_npy(tmp_path / "bad.npy")


def test_bfloat16_save_and_load(tmp_path):
    src, t = _table("cpu", dtype=torch.bfloat16)
    t.save_npy(tmp_path / "b.npy")
    back = offload.HostTable.from_npy(tmp_path / "b.npy", dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back.data, src)


def test_failed_allocation_names_size_and_availability():
    with pytest.raises(offload.HostMemoryError, match=r"could not allocate .* of host memory for a "
                                                     r"1099511627776 x 65536 .*MemAvailable"):
        offload.HostTable(1 << 40, 1 << 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_pinning_without_cuda_is_refused():
    with pytest.raises(offload.HostMemoryError, match="CUDA is not available"):
        offload.HostTable(4, 4, pin=True)


def test_engine_switch():
    assert offload.get_engine() in ("auto", "uva", "cpu")
    old = offload.get_engine()
    with offload.use_engine("cpu"):
        assert offload.get_engine() == "cpu"
    assert offload.get_engine() == old
    with pytest.raises(ValueError, match="offload engine must be one of"):
        offload.set_engine("gpu")
    _, t = _table("cpu")
    assert t.resolved_engine("gather") == "cpu" == t.resolved_engine("scatter", host_indices=True)
    # a CPU device: every engine (for indices anywhere) is the CPU's
    assert offload.engine_choice("cpu") == dict.fromkeys(["gather", "scatter", "gather host", "scatter host"], "cpu")
    t.engine = "uva"
    with pytest.raises(RuntimeError, match="needs a CUDA compute device"):
        t.gather(torch.tensor([1]))


def test_block_addresses_stacked_model_tables():
    src, t = _table("cpu", rows=12, dim=3)
    assert torch.equal(t.block(2, 4), src[8:12])
    assert torch.equal(t.gather(torch.tensor([2 * 4 + 1])), src[[9]])
    with pytest.raises(IndexError, match="block 3 of 4 rows is outside a table of 12 rows"):
        t.block(3, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_host_array_and_batches(device, tmp_path):
    x = np.random.default_rng(0).integers(0, 255, size=(23, 3, 4), dtype=np.uint8)
    y = np.arange(23, dtype=np.int64)
    xs = offload.HostArray(torch.from_numpy(x), device=device)
    assert xs.shape == (23, 3, 4)
    got = xs[torch.tensor([[4, 2], [4, 0]])]
    assert got.shape == (2, 2, 3, 4) and torch.equal(got.cpu(), torch.from_numpy(x)[torch.tensor([[4, 2], [4, 0]])])
    np.save(tmp_path / "y.npy", y)
    ys = offload.HostArray.from_npy(tmp_path / "y.npy", device=device)
    assert ys.shape == (23,)
    seen = []
    g = torch.Generator().manual_seed(0)
    for xb, yb in offload.batches(xs, ys, batch_size=5, shuffle=True, generator=g):
        assert xb.device.type == device and xb.shape[1:] == (3, 4) and xb.shape[0] == yb.shape[0] <= 5
        assert torch.equal(xb.cpu(), torch.from_numpy(x)[yb.cpu()])  # rows of x and y stay paired
        seen += yb.tolist()
    assert sorted(seen) == list(range(23)) and seen != list(range(23))
    assert sum(1 for _ in offload.batches(xs, batch_size=5, drop_last=True)) == 4
    with pytest.raises(ValueError, match="arrays differ in length"):
        next(offload.batches(xs, offload.HostArray(torch.zeros(3)), batch_size=2))


def test_host_array_over_npy_maps_the_file(tmp_path):
    """HostArray.from_npy maps the file (rows of any shape): read-only by default (its table refuses
    scatters), with ``mmap_mode="r+"`` written in place."""
    x = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
    np.save(tmp_path / "x.npy", x)
    ro = offload.HostArray.from_npy(tmp_path / "x.npy", device="cpu")
    assert ro.shape == (4, 2, 3) and torch.equal(ro[torch.tensor([3, 0])], torch.from_numpy(x)[[3, 0]])
    with pytest.raises(RuntimeError, match="read-only memory map"):
        ro.table.scatter(torch.tensor([1]), torch.zeros(1, 6))
    rw = offload.HostArray.from_npy(tmp_path / "x.npy", mmap_mode="r+", device="cpu")
    rw.table.scatter(torch.tensor([2]), torch.full((1, 6), -1.0))
    rw.table.synchronize()
    assert np.load(tmp_path / "x.npy")[2].tolist() == [[-1.0] * 3] * 2
    assert torch.equal(ro[torch.tensor([2])], torch.full((1, 2, 3), -1.0))  # the same file, mapped twice


def test_engines_get_the_tables_storage(monkeypatch):
    """An engine is handed the table's storage, never the table: an object with every member of the
    engine interface's protocol (offload._engine.RowStorage), over the table's rows."""
    from offload import _engine
    seen = []

    class Probe(_engine.RowEngine):
        name = "probe"

        def check(self, storage):
            seen.append(storage)

    monkeypatch.setitem(_engine.ENGINES, "probe", Probe())
    src = torch.arange(12.0).view(6, 2)
    t = offload.HostTable.from_tensor(src, device="cpu", engine="probe")
    assert t.resolved_engine("gather") == "probe"
    (storage,) = seen
    assert storage is t.storage and not isinstance(storage, offload.HostTable)
    protocol = _engine.RowStorage
    members = set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}
    assert {"tensor", "device", "land", "note_gpu_access", "patch_prefetches"} <= members
    assert all(hasattr(storage, m) for m in members), sorted(m for m in members if not hasattr(storage, m))
    assert torch.equal(storage.tensor, src) and (storage.num_rows, storage.dim, storage.row_bytes) == (6, 2, 8)
    p = t.prefetch(torch.tensor([4, 1]))
    assert storage.watched
    t.scatter(torch.tensor([1]), torch.full((1, 2), -3.0))  # patched into the prefetched rows
    assert p.result().tolist() == [[8.0, 9.0], [-3.0, -3.0]]
    p.release()
    assert not storage.watched


def _advised_huge(ptr: int) -> bool:
    """Whether the mapping holding ``ptr`` carries the MADV_HUGEPAGE advice ("hg" in /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="needs Linux transparent huge pages")
@pytest.mark.parametrize("huge", [True, False])
def test_large_tables_are_usable_with_and_without_huge_pages(monkeypatch, request, huge):
    """A table above the huge-page threshold lives in an anonymous map advised for huge pages; it behaves
    like any other table, and its memory stays valid while any tensor viewing it lives."""
    from offload import _memory

    old = torchmb_config.set("offload_huge_pages", huge)
    request.addfinalizer(lambda: torchmb_config.set("offload_huge_pages", old))
    monkeypatch.setattr(_memory, "HUGE_PAGE_MIN", 1 << 20)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(4096, 96, generator=g)  # 1.5 MiB
    maps = []
    real_mmap = _memory.mmap.mmap
    monkeypatch.setattr(_memory.mmap, "mmap", lambda *a, **k: maps.append(real_mmap(*a, **k)) or maps[-1])
    t = offload.HostTable.from_tensor(src, device="cpu", pin=False)
    assert torch.equal(t.data, src) and t.data.is_contiguous()
    # Without huge pages the table is torch's allocation, which may land in heap memory that another library
    # (NumPy, for its large arrays) advised earlier in the process: what is checked is that no map was made.
    assert len(maps) == huge
    if huge:
        assert _advised_huge(t.data.data_ptr())
    idx = torch.randperm(4096, generator=g)[:700]
    vals = torch.randn(700, 96, generator=g)
    t.scatter(idx, vals)
    expected = src.clone()
    expected[idx] = vals
    view = t.data[100:200]
    del t
    assert torch.equal(view, expected[100:200])  # the map outlives the table while a view holds it
    z = offload.HostTable(3000, 128, fill=0.0, device="cpu", pin=False)
    assert not z.data.any()


def test_wide_views_keep_the_bytes():
    from offload._row_copy import _wide

    x = torch.randn(10, 12)  # 48-byte rows: complex128 (16 bytes)
    assert _wide(x).dtype == torch.complex128 and _wide(x).shape == (10, 3)
    assert torch.equal(_wide(x).view(torch.float32), x)
    assert _wide(torch.zeros(4, 3, dtype=torch.int16)).dtype == torch.int16  # 6-byte rows
    assert _wide(torch.zeros(4, 5, dtype=torch.uint8)).dtype == torch.uint8
    assert _wide(x[1:]).dtype == torch.complex128  # row offsets of 48 bytes stay 16-byte aligned
    y = torch.randn(10, 2)[1:]  # 8-byte rows at an 8-byte offset
    assert _wide(y).dtype == torch.int64 and torch.equal(_wide(y).view(torch.float32), y)


@pytest.mark.parametrize("device", DEVICES)
def test_distinct_indices_in_any_order_keep_their_order(device):
    """Distinct indices out of order (sorted internally on a GPU, for the host's sake) come back and are
    written in the caller's order, through gather, scatter and prefetch with unique=True."""
    src, t = _table(device, rows=300, dim=5)
    g = torch.Generator().manual_seed(2)
    idx = torch.randperm(300, generator=g)[:77]
    assert not bool((idx[1:] >= idx[:-1]).all())
    assert torch.equal(t.gather(idx.to(device), unique=True).cpu(), src[idx])
    out = torch.full((77, 5), -1.0, device=device)
    t.gather(idx.to(device), unique=True, out=out)
    assert torch.equal(out.cpu(), src[idx])
    p = t.prefetch(idx.view(7, 11).to(device), unique=True)
    vals = torch.randn(77, 5, generator=g)
    t.scatter(idx.to(device), vals.to(device), unique=True)
    expected = src.clone()
    expected[idx] = vals
    assert torch.equal(t.data, expected)
    assert torch.equal(p.indices.cpu(), idx) and torch.equal(p.rows().cpu(), vals)  # patched, in order
    with pytest.raises(ValueError, match="index 12 appears more than once"):
        t.scatter(torch.tensor([40, 12, 7, 12, 40]).to(device), torch.zeros(5, 5, device=device))
    assert torch.equal(t.data, expected)


# ----------------------------------------------------------------------------------------------------------
# The CPU engine's worker pool (on a CPU compute device every gather and scatter runs on it)


def _pool_settings(monkeypatch, threads, chunk_bytes, piece_bytes=1, way="pool"):
    from offload import _row_copy, _staging
    monkeypatch.setattr(_row_copy, "CPU_COPY", way)
    monkeypatch.setattr(_row_copy, "CPU_THREADS", threads)
    monkeypatch.setattr(_row_copy, "MIN_PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(_staging._Staging, "CHUNK_BYTES", chunk_bytes)


@pytest.mark.parametrize("way,threads", [("torch", 1), ("pool", 1), ("pool", 3), ("pool", 8)])
@pytest.mark.parametrize("chunk_rows", [1, 3.3, 64, 10_000])
@pytest.mark.parametrize("n", [1, 2, 7, 1000])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 5), (torch.bfloat16, 3), (torch.float64, 16)])
def test_pooled_gather_and_scatter_match_indexing(monkeypatch, way, threads, chunk_rows, n, dtype, dim):
    """Rows copied by torch or by the pool in chunks of 1, 3.3 (chunk sizes that are no multiple of the row
    size), 64 or more rows than asked for, cut into pieces among 1, 3 or 8 threads (so n = 1 and 2 leave
    workers without work), equal plain indexing of an independent copy of the table."""
    row_bytes = dim * torch.empty((), dtype=dtype).element_size()
    _pool_settings(monkeypatch, threads, int(chunk_rows * row_bytes), way=way)
    g = torch.Generator().manual_seed(n * 31 + threads)
    ref = (torch.randn(3000, dim, generator=g) * 100).to(dtype)
    t = offload.HostTable.from_tensor(ref, device="cpu", engine="cpu")
    expected = ref.clone()
    idx = torch.randperm(3000, generator=g)[:n]
    assert torch.equal(t.gather(idx, unique=True), expected[idx])
    dup = torch.cat([idx, idx[: n // 2]])  # deduplicated, then gathered in pieces
    assert torch.equal(t.gather(dup.view(1, -1)), expected[dup].view(1, -1, dim))
    vals = (torch.randn(n, dim, generator=g) * 100).to(dtype)
    t.scatter(idx, vals)
    expected[idx] = vals
    assert torch.equal(t.data, expected)
    vals = (torch.randn(n, dim, generator=g) * 100).to(dtype)
    t.scatter(idx.sort().values, vals, unique=True)
    expected[idx.sort().values] = vals
    assert torch.equal(t.data, expected)


def test_pool_threads_do_the_work(monkeypatch):
    """With 4 threads and enough rows, pieces run on pool threads as well as on the caller."""
    from offload import _row_copy
    _pool_settings(monkeypatch, 4, 64 * 20)
    seen = set()
    real = _row_copy.take_rows

    def spy(src, idx, out):
        seen.add(threading.get_ident())
        time.sleep(0.002)  # long enough that the caller cannot take every piece before a worker wakes
        real(src, idx, out)

    monkeypatch.setattr(_row_copy, "take_rows", spy)
    src, t = _table_of(rows=2000, dim=16)
    idx = torch.arange(0, 2000, 3)
    assert torch.equal(t.gather(idx, unique=True), src[idx])
    assert threading.get_ident() in seen and len(seen) > 1


def _table_of(rows, dim):
    src = torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows))
    return src, offload.HostTable.from_tensor(src, device="cpu")


class _Gate:
    """A stand-in for a CUDA event: opened by a timer thread."""

    def __init__(self, delay):
        self.event = threading.Event()
        self.timer = threading.Timer(delay, self.event.set)
        self.timer.start()

    def query(self):
        return self.event.is_set()

    def synchronize(self):
        self.event.wait()


def test_run_rows_covers_every_row_once_and_respects_gates(monkeypatch):
    from offload import _row_copy
    monkeypatch.setattr(_row_copy, "MIN_PIECE_BYTES", 1)
    rounds = [(0, 5), (5, 6), (6, 40), (40, 41), (41, 100)]
    gates = [_Gate(0.01 * (r + 1)) for r in range(len(rounds))]
    hits = np.zeros(100, dtype=np.int64)
    lock = threading.Lock()
    early = []

    def fn(s, e):
        r = next(i for i, (a, b) in enumerate(rounds) if a <= s < b)
        if not gates[r].query():
            early.append((s, e))
        assert rounds[r][0] <= s < e <= rounds[r][1]  # pieces never straddle a round
        with lock:
            hits[s:e] += 1

    ready = []

    def on_ready(r):
        ready.append(r)

    _row_copy._run_rows(fn, rounds, 8, threads=6, gates=gates)
    assert hits.tolist() == [1] * 100 and not early
    hits[:] = 0
    _row_copy._run_rows(fn, rounds, 8, threads=6, on_ready=on_ready)  # without gates: every round at once
    assert hits.tolist() == [1] * 100 and sorted(ready) == list(range(len(rounds)))
    hits[:], ready[:] = 0, []
    gates = [_Gate(0.005 * (r + 1)) for r in range(len(rounds))]
    _row_copy._run_rows(fn, rounds, 8, threads=1, gates=gates, on_ready=on_ready)  # the caller alone, in order
    assert hits.tolist() == [1] * 100 and not early and ready == list(range(len(rounds)))


@pytest.mark.parametrize("dim,dtype", [(128, torch.float32), (7, torch.float64), (13, torch.uint8)])
def test_hybrid_lone_split_matches_brute_force(monkeypatch, dim, dtype):
    """The hybrid's split (lone rows to the CPU engine, the rest to the UVA kernel) against a brute-force
    reading of its definition, for row sizes that do not divide the block; too few lone bytes, or rows as
    long as a block, leave everything to the kernel; and rows that, spread uniformly, would leave fewer lone
    bytes than the threshold are not even counted."""
    from offload import _engine_hybrid
    g = torch.Generator().manual_seed(0)
    num_rows = 50_000
    t = offload.HostTable(num_rows, dim, dtype, device="cpu")
    row_bytes = dim * t.data.element_size()
    monkeypatch.setattr(_engine_hybrid, "LONE_BLOCK_BYTES", 24 * row_bytes + 5)
    uniq = torch.randperm(num_rows, generator=g)[:3000].sort().values
    expected = lone_positions(uniq.tolist(), row_bytes, _engine_hybrid.LONE_BLOCK_BYTES)
    assert 0 < len(expected) < 3000  # both parts have rows
    monkeypatch.setattr(_engine_hybrid, "HYBRID_MIN_LONE_BYTES", 1)
    lone, near = _engine_hybrid.lone_split(t.storage, uniq)
    assert lone.tolist() == expected
    assert near.tolist() == sorted(set(range(3000)) - set(expected))
    monkeypatch.setattr(_engine_hybrid, "HYBRID_MIN_LONE_BYTES", len(expected) * row_bytes + 1)
    assert _engine_hybrid.lone_split(t.storage, uniq) is None  # too few
    monkeypatch.setattr(_engine_hybrid, "HYBRID_MIN_LONE_BYTES", row_bytes)
    dense = torch.arange(0, num_rows, 2)  # 12 rows a block: uniformly spread, 0.15 lone rows expected

    def no_count(*args, **kwargs):
        raise AssertionError("counted lone rows where none were expected")

    monkeypatch.setattr(torch, "nonzero", no_count)
    assert _engine_hybrid.lone_split(t.storage, dense) is None
    monkeypatch.setattr(_engine_hybrid, "LONE_BLOCK_BYTES", row_bytes)  # a row per block: nothing gained
    assert _engine_hybrid.lone_split(t.storage, uniq) is None


def test_worker_exception_reaches_the_caller(monkeypatch):
    """An exception raised in a pool thread is raised by the call, once no thread copies rows any more; the
    pool works on afterwards, and an exception of on_ready (the caller's part) surfaces too."""
    from offload import _row_copy
    _pool_settings(monkeypatch, 4, 1 << 20)
    main = threading.get_ident()
    running = [0]
    lock = threading.Lock()
    failed = []

    def fn(s, e):
        with lock:
            running[0] += 1
        try:
            time.sleep(0.002)
            if threading.get_ident() != main and not failed:
                failed.append(s)
                raise KeyError(f"piece {s} failed in a worker")
        finally:
            with lock:
                running[0] -= 1

    with pytest.raises(KeyError, match="failed in a worker"):
        _row_copy._run_rows(fn, [(0, 40), (40, 80)], 8, threads=4)
    assert running[0] == 0 and failed
    hits = np.zeros(80, dtype=np.int64)
    _row_copy._run_rows(lambda s, e: hits.__setitem__(slice(s, e), hits[s:e] + 1), [(0, 40), (40, 80)], 8, threads=4)
    assert hits.tolist() == [1] * 80

    def bad_ready(r):
        raise RuntimeError(f"round {r} could not be shipped")

    def slow(s, e):
        with lock:
            running[0] += 1
        time.sleep(0.002)
        with lock:
            running[0] -= 1

    with pytest.raises(RuntimeError, match="could not be shipped"):
        _row_copy._run_rows(slow, [(0, 40), (40, 80)], 8, threads=4, on_ready=bad_ready)
    assert running[0] == 0

    src, t = _table_of(rows=500, dim=4)
    real = _row_copy.take_rows

    def broken(s, idx, out):
        if threading.get_ident() != main:
            raise OSError("worker could not read the table")
        time.sleep(0.005)  # the caller is slow: the workers get pieces
        real(s, idx, out)

    monkeypatch.setattr(_row_copy, "take_rows", broken)
    with pytest.raises(OSError, match="worker could not read the table"):
        for _ in range(5):  # until a worker (not the caller) takes a piece
            t.gather(torch.arange(0, 500, 2), unique=True)
    monkeypatch.setattr(_row_copy, "take_rows", real)
    assert torch.equal(t.gather(torch.arange(0, 500, 2), unique=True), src[::2])
