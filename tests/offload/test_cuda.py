"""GPU-only: the UVA kernel against the CPU engine (and plain indexing), with proof that the kernel ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.lone import lone_positions

import offload
from offload import _memory

pytestmark = pytest.mark.cuda


def _launches(op: str) -> int:
    return offload.uva_launch_counts().get(op, 0)


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.float32, 3), (torch.bfloat16, 5),
                                       (torch.float16, 64), (torch.float64, 7), (torch.uint8, 13),
                                       (torch.int64, 1)])
def test_uva_and_cpu_engines_agree(monkeypatch, dtype, dim):
    """The three engines against plain indexing; the hybrid's CPU part moves exactly the lone rows (here:
    those with no other row of the call among the 3 rows of their block)."""
    pytest.importorskip("cupy")
    from offload import _engine_cpu, _engine_hybrid
    g = torch.Generator().manual_seed(0)
    rows = 20_011
    src = (torch.randn(rows, dim, generator=g) * 50).to(dtype)
    uva = offload.HostTable.from_tensor(src, device="cuda", engine="uva")
    cpu = offload.HostTable.from_tensor(src, device="cuda", engine="cpu")
    hyb = offload.HostTable.from_tensor(src, device="cuda", engine="hybrid")
    assert uva.pinned and cpu.pinned and hyb.pinned
    row_bytes = dim * src.element_size()
    monkeypatch.setattr(_engine_hybrid, "LONE_BLOCK_BYTES", 3 * row_bytes)
    monkeypatch.setattr(_engine_hybrid, "HYBRID_MIN_LONE_BYTES", 1)
    by_cpu = []
    for name in ("gather_cpu", "scatter_cpu"):
        real = getattr(_engine_cpu, name)

        def counted(table, idx, rows_, *args, real=real):
            by_cpu.append(sorted(idx.tolist()))
            return real(table, idx, rows_, *args)

        monkeypatch.setattr(_engine_cpu, name, counted)
    idx = torch.randint(0, rows, (3, 4099), generator=g).cuda()
    before = _launches("gather")
    a = uva.gather(idx)
    assert _launches("gather") == before + 1
    b = cpu.gather(idx)
    assert _launches("gather") == before + 1  # the CPU engine launched no kernel
    assert torch.equal(a, b) and torch.equal(a.cpu(), src[idx.cpu()])
    by_cpu.clear()
    c = hyb.gather(idx)
    assert _launches("gather") == before + 2 and torch.equal(c, a)  # hybrid: the kernel ran for its share
    uniq = idx.unique().tolist()
    assert by_cpu == [[uniq[i] for i in lone_positions(uniq, row_bytes, 3 * row_bytes)]]
    new = torch.randperm(rows, generator=g)[:5003].cuda()
    vals = (torch.randn(5003, dim, generator=g) * 50).to(dtype).cuda()
    before = _launches("scatter")
    uva.scatter(new, vals)
    assert _launches("scatter") == before + 1
    cpu.scatter(new, vals)
    by_cpu.clear()
    hyb.scatter(new, vals)
    assert _launches("scatter") == before + 2
    keys = sorted(new.tolist())
    assert by_cpu == [[keys[i] for i in lone_positions(keys, row_bytes, 3 * row_bytes)]] and 0 < len(by_cpu[0]) < 5003
    assert torch.equal(uva.data, cpu.data) and torch.equal(hyb.data, cpu.data)
    expected = src.clone()
    expected[new.cpu()] = vals.cpu()
    assert torch.equal(uva.data, expected)


@pytest.mark.parametrize("engine", ["uva", "cpu", "hybrid"])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.bfloat16, 5), (torch.uint8, 13)])
def test_distinct_indices_out_of_order_on_every_engine(monkeypatch, engine, dtype, dim):
    """Distinct indices out of order, promised with unique=True (sorted on the GPU; the UVA kernel then
    moves each row straight to or from its place in the caller's order, one launch a call) against plain
    indexing of an independent copy, with a prefetch of some of the rows patched by the scatter."""
    if engine != "cpu":
        pytest.importorskip("cupy")
    from offload import _engine_hybrid
    monkeypatch.setattr(_engine_hybrid, "LONE_BLOCK_BYTES", 3 * dim * torch.empty((), dtype=dtype).element_size())
    monkeypatch.setattr(_engine_hybrid, "HYBRID_MIN_LONE_BYTES", 1)
    g = torch.Generator().manual_seed(4)
    rows = 9001
    src = (torch.randn(rows, dim, generator=g) * 50).to(dtype)
    expected = src.clone()
    t = offload.HostTable.from_tensor(src, device="cuda", engine=engine)
    for n in (4099, 2):
        idx = torch.randperm(rows, generator=g)[:n]
        if n == 2:
            idx = idx.sort(descending=True).values
        assert not bool((idx[1:] >= idx[:-1]).all())
        before = offload.uva_launch_counts()
        out = torch.full((n, dim), 7, dtype=dtype, device="cuda")
        assert t.gather(idx.cuda(), unique=True, out=out).data_ptr() == out.data_ptr()
        assert torch.equal(out.cpu(), expected[idx])
        if engine == "uva":
            assert _launches("gather") == before.get("gather", 0) + 1
        part = idx[: n // 2 + 1]
        p = t.prefetch(part.cuda(), unique=True)
        vals = (torch.randn(n, dim, generator=g) * 50).to(dtype)
        t.scatter(idx.cuda(), vals.cuda(), unique=True)
        expected[idx] = vals
        if engine == "uva":
            assert _launches("scatter") == before.get("scatter", 0) + 1
        assert torch.equal(t.data, expected)
        assert torch.equal(p.rows().cpu(), expected[part])  # patched, in the prefetch's order
        p.release()


def test_uva_prefetch_on_side_stream_is_patched():
    pytest.importorskip("cupy")
    src = torch.randn(5000, 32)
    t = offload.HostTable.from_tensor(src, device="cuda", engine="uva")
    idx = torch.arange(0, 5000, 3, device="cuda")
    p = t.prefetch(idx)
    t.scatter(idx[:10], torch.zeros(10, 32, device="cuda"))
    got = p.result()
    expected = src[idx.cpu()]
    expected[:10] = 0
    assert torch.equal(got.cpu(), expected)


def test_auto_engine_is_measured_once():
    choice = offload.engine_choice("cuda")
    assert set(choice) == {"gather", "scatter", "gather host", "scatter host"}
    assert set(choice.values()) <= {"uva", "cpu"}
    assert offload.engine_choice("cuda") == choice
    t = offload.HostTable(100, 4, device="cuda", engine="auto")
    assert t.resolved_engine("gather") == choice["gather"]


def test_pin_failure_reports_size_and_leaves_nothing(monkeypatch):
    before = dict(_memory._registered)
    monkeypatch.setattr(_memory, "_cuda_register", lambda ptr, n: 2)  # cudaErrorMemoryAllocation
    with pytest.raises(offload.HostMemoryError, match=r"could not pin \(cudaHostRegister\) 3\.8 MiB "
                                                     r"\(4000000 bytes\).*MemAvailable .*CUDA error 2"):
        offload.HostTable(10_000, 100, device="cuda")
    assert _memory._registered == before


def test_memory_mapped_table_on_the_gpu(tmp_path):
    """A memory-mapped (unpinned) table: the CPU engine stages its rows; writes reach the file."""
    arr = np.random.default_rng(0).standard_normal((4096, 16)).astype(np.float32)
    np.save(tmp_path / "t.npy", arr)
    t = offload.HostTable.from_npy(tmp_path / "t.npy", device="cuda")
    assert not t.pinned and t.resolved_engine("gather") == "cpu"
    idx = torch.tensor([5, 4095, 17], device="cuda")
    assert torch.equal(t.gather(idx).cpu(), torch.from_numpy(arr)[idx.cpu()])
    t.scatter(torch.tensor([1], device="cuda"), torch.full((1, 16), 7.0, device="cuda"))
    del t
    assert np.load(tmp_path / "t.npy")[1].tolist() == [7.0] * 16
    with pytest.raises(RuntimeError, match="'uva' offload engine needs a pinned table"):
        offload.HostTable.from_npy(tmp_path / "t.npy", device="cuda", engine="uva").gather(idx)


@pytest.mark.parametrize("cache_rows", [0, 300])
def test_embedding_training_identical_on_both_engines(cache_rows):
    pytest.importorskip("cupy")
    g = torch.Generator().manual_seed(0)
    n, d = 5000, 32
    w0 = torch.randn(n, d, generator=g)
    data = [((torch.empty(512).exponential_(generator=g) * 400).long().clamp_(max=n - 1).view(64, 8).cuda(),
             torch.randn(64, 8, d, generator=g).cuda()) for _ in range(12)]
    tables = {}
    for engine in ("uva", "cpu", "hybrid"):
        emb = offload.OffloadedEmbedding(n, d, _weight=w0.clone(), device="cuda", engine=engine,
                                         cache_rows=cache_rows)
        opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
        before = _launches("gather") + _launches("scatter")
        for i, (idx, target) in enumerate(data):
            opt.zero_grad()
            out = emb(idx)
            if i + 1 < len(data):
                emb.prefetch(data[i + 1][0])
            (out - target).pow(2).sum().backward()
            opt.step()
        emb.flush()
        ran = _launches("gather") + _launches("scatter") - before
        assert (ran > 0) == (engine != "cpu")
        tables[engine] = (emb.table.data.clone(), {k: t.data.clone() for k, t in emb.state_tables.items()})
    ref = torch.nn.Embedding(n, d, sparse=True, _weight=w0.clone()).cuda()
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    for idx, target in data:
        ropt.zero_grad()
        (ref(idx) - target).pow(2).sum().backward()
        ropt.step()
    for other in ("cpu", "hybrid"):
        assert torch.equal(tables["uva"][0], tables[other][0])
        for k in tables["uva"][1]:
            assert torch.equal(tables["uva"][1][k], tables[other][1][k])
    # SparseAdam divides eps by sqrt(bias_correction2), Adam does not: the hottest rows (touched every step,
    # large gradients) drift apart by a few 1e-5 over 12 steps at lr 0.01 (seen on an H200).
    torch.testing.assert_close(tables["uva"][0], ref.weight.detach().cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads,unroll,load,store", [(256, 4, "plain", "plain"), (32, 1, "cs", "cs"),
                                                       (1024, 8, "nc", "wt"), (128, 3, "plain", "cs")])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.float32, 3), (torch.uint8, 13),
                                       (torch.float32, 1000), (torch.float16, 40)])
def test_uva_kernel_variants_match_indexing(monkeypatch, threads, unroll, load, store, dtype, dim):
    """Every launch shape and cache policy the benchmark can pick copies exactly the rows asked for."""
    pytest.importorskip("cupy")
    from offload import _uva

    for name, value in (("THREADS", threads), ("UNROLL", unroll), ("LOAD", load), ("STORE", store),
                        ("BLOCKS_PER_SM", 1)):
        monkeypatch.setattr(_uva, name, value)
    g = torch.Generator().manual_seed(dim)
    rows = 3001
    src = (torch.randn(rows, dim, generator=g) * 50).to(dtype)
    host = src.clone().pin_memory()
    idx = torch.randperm(rows, generator=g)[:1777]
    out = torch.full((1777, dim), 7, dtype=dtype, device="cuda")
    _uva.gather_rows(host, idx.cuda(), out)
    assert torch.equal(out.cpu(), src[idx])
    vals = (torch.randn(1777, dim, generator=g) * 50).to(dtype)
    _uva.scatter_rows(host, idx.cuda(), vals.cuda())
    torch.cuda.synchronize()
    expected = src.clone()
    expected[idx] = vals
    assert torch.equal(host, expected)
    assert _uva.take_bad_position("cuda") is None


def test_uva_kernel_refuses_out_of_range_indices():
    """Indices that slip past the host check are skipped by the kernel itself and flagged: the rows just
    outside the table (guard rows of the same pinned buffer) are neither read nor written."""
    pytest.importorskip("cupy")
    from offload import _uva

    big = torch.randn(120, 16).pin_memory()
    host = big[10:110]  # the table: 100 rows with 10 guard rows on each side
    big[:10] = float("nan")  # a read of a guard row would show up as NaN
    big[110:] = float("nan")
    before = big.clone()
    idx = torch.tensor([5, 100, 7, -1, 99, 1 << 40], device="cuda")
    out = torch.zeros(6, 16, device="cuda")
    _uva.gather_rows(host, idx, out)
    assert _uva.take_bad_position("cuda") == 1
    got = out.cpu()
    assert torch.equal(got[[0, 2, 4]], host[[5, 7, 99]]) and torch.equal(got[[1, 3, 5]], torch.zeros(3, 16))
    assert _uva.take_bad_position("cuda") is None  # the flag was reset
    _uva.scatter_rows(host, idx[3:], torch.ones(3, 16, device="cuda"))
    torch.cuda.synchronize()
    assert _uva.take_bad_position("cuda") == 0
    after = before.clone()
    after[10 + 99] = 1.0
    assert torch.equal(big.isnan(), after.isnan()) and torch.equal(big.nan_to_num(), after.nan_to_num())


@pytest.mark.parametrize("tables", [1, 3, 4, 6])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.float16, 5), (torch.uint8, 13)])
def test_uva_tables_move_together_by_slots(tables, dtype, dim):
    """One launch (per four tables) moves the rows of several tables by the same indices to and from
    device rows addressed by slots, in arrays whose rows lie side by side (a GPU cache's records), exactly
    as indexing does; slots and indices out of range are skipped and flagged."""
    pytest.importorskip("cupy")
    from offload import _uva

    g = torch.Generator().manual_seed(tables * 100 + dim)
    rows, n, slots_n = 4001, 1500, 2600
    srcs = [(torch.randn(rows, dim, generator=g) * 50).to(dtype) for _ in range(tables)]
    hosts = [s.clone().pin_memory() for s in srcs]
    records = torch.zeros(slots_n, tables, dim, dtype=dtype, device="cuda")
    parts = list(records.unbind(1))
    idx = torch.randperm(rows, generator=g)[:n]
    pos = torch.randperm(slots_n, generator=g)[:n]
    before = offload.uva_launch_counts().get("gather", 0)
    _uva.gather_tables(hosts, idx.cuda(), parts, pos.cuda())
    assert offload.uva_launch_counts().get("gather", 0) == before + -(-tables // 4)
    got = records.cpu()
    for j in range(tables):
        assert torch.equal(got[pos, j], srcs[j][idx])
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[pos] = False
    assert not got[untouched].any()
    # back, to other rows, from the same slots
    new = torch.randperm(rows, generator=g)[:n]
    records.copy_((torch.randn(records.shape, generator=g) * 50).to(dtype))
    _uva.scatter_tables(hosts, new.cuda(), parts, pos.cuda())
    torch.cuda.synchronize()
    back = records.cpu()
    for j in range(tables):
        expected = srcs[j].clone()
        expected[new] = back[pos, j]
        assert torch.equal(hosts[j], expected)
    assert _uva.take_bad_position("cuda") is None
    # in order (no slots), from separate tensors
    outs = [torch.empty(n, dim, dtype=dtype, device="cuda") for _ in range(tables)]
    _uva.gather_tables(hosts, new.cuda(), outs)
    for j in range(tables):
        assert torch.equal(outs[j].cpu(), hosts[j][new])
    # a slot or an index out of range: that row is skipped and flagged, the others move
    bad_pos = torch.tensor([0, slots_n, 2], device="cuda")
    bad_idx = torch.tensor([1, 2, rows], device="cuda")
    records.zero_()
    _uva.gather_tables(hosts, bad_idx, parts, bad_pos)
    assert _uva.take_bad_position("cuda") == 1
    got = records.cpu()
    assert torch.equal(got[0, 0], hosts[0][1]) and not got[1:].any()
    if tables > 1:
        with pytest.raises(ValueError, match="one row stride"):
            _uva.gather_tables(hosts[:2], idx.cuda(), [records[:, 0], torch.empty(slots_n, dim, dtype=dtype,
                                                                                  device="cuda")], pos.cuda())
    with pytest.raises(ValueError, match="positions must be"):
        _uva.gather_tables(hosts, idx.cuda(), parts, pos.cuda().int())


@pytest.mark.parametrize("dim", [128, 3])
def test_cache_kernels_deduplicate_and_sum_gradients_in_a_fixed_order(dim):
    """The deduplication kernels give torch.unique's ids and inverse; the lookup backward built on them sums
    each id's rows (hot ids spanning many tiles of sorted positions) as index_add does, with the same bits
    every time."""
    pytest.importorskip("cupy")
    from offload import _cache_cuda

    g = torch.Generator().manual_seed(dim)
    n = 20_000
    flat = (torch.empty(n).exponential_(generator=g) * 50).long().cuda()
    ids, inverse, _, _, _, stats, runs = _cache_cuda.dedup(flat)
    count, lo, hi, _ = stats.tolist()
    uniq, inv = torch.unique(flat, return_inverse=True)
    assert count == uniq.numel() and (lo, hi) == (int(flat.min()), int(flat.max()))
    assert torch.equal(ids[:count], uniq) and torch.equal(inverse, inv)
    grad = torch.randn(n, dim, generator=g).cuda()
    got = _cache_cuda.segment_sum(grad, runs, count)
    ref = torch.zeros(count, dim, dtype=torch.float64, device="cuda").index_add_(0, inv, grad.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(got, _cache_cuda.segment_sum(grad, runs, count))


def test_lru_victims_are_the_least_recently_used_slots():
    """The cache's victim selection (an age histogram, its threshold and a claiming pass) picks k distinct
    slots, none stamped at the current step or later, each at least as old as every slot it leaves."""
    pytest.importorskip("cupy")
    from offload import _cache_cuda

    g = torch.Generator().manual_seed(7)
    clock = 5000
    stamps = torch.randint(clock - 300, clock + 2, (100_003,), generator=g, dtype=torch.int32)
    stamps[:50] = 0  # older than LRU_AGES steps: one bucket, all chosen first anyway
    for k in (1, 50, 777, int((stamps < clock).sum()) // 3, int((stamps < clock).sum())):
        got = _cache_cuda.lru_victims(stamps.cuda(), k, clock).cpu()
        assert got.unique().numel() == k and (stamps[got] < clock).all()
        left = torch.ones(stamps.numel(), dtype=torch.bool)
        left[got] = False
        left &= stamps < clock
        assert not left.any() or stamps[got].max() <= stamps[left].min()
        assert stamps[got].max() == torch.topk(stamps, k, largest=False).values.max()


def test_uva_launch_modes_agree(monkeypatch):
    """The UVA kernels through one cuLaunchKernel call and through cupy.cuda.Function copy the same rows."""
    pytest.importorskip("cupy")
    from offload import _uva
    from offload import cuda_launch as _launch

    src = torch.randn(3000, 64)
    host = src.clone().pin_memory()
    idx = torch.randperm(3000)[:1000]
    for mode in ("driver", "cupy"):
        if mode == "driver" and _launch.LAUNCH_MODE[0] != "driver":
            continue
        monkeypatch.setattr(_launch, "LAUNCH_MODE", [mode])
        slow = _launch.SLOW_LAUNCHES["offload_gather"]
        out = torch.zeros(1000, 64, device="cuda")
        _uva.gather_rows(host, idx.cuda(), out)
        assert torch.equal(out.cpu(), src[idx])
        assert (_launch.SLOW_LAUNCHES["offload_gather"] > slow) == (mode == "cupy")


@pytest.mark.parametrize("engine", ["cpu", "hybrid"])
@pytest.mark.parametrize("way,threads", [("torch", 1), ("pool", 1), ("pool", 6)])
@pytest.mark.parametrize("chunk", [4 << 10, (12 << 10) + 100, 40 << 10])
def test_cpu_engine_staging_rotation_wraps(monkeypatch, engine, way, threads, chunk):
    """The CPU engine (alone and as the hybrid's CPU part, which here moves the rows with no other row of the
    call among the 3 of their block) with tiny staging memory (16 units of 4 KiB): chunks of 1, 3 (a size
    that is no multiple of the row) or 10 units, copied by torch or cut into pieces among 1 or 6 pool
    threads; the rotation wraps around many times, batches are taken one after the other, and every result
    equals plain indexing of an independent copy of the table, down to n = 1 and n below the threads."""
    if engine == "hybrid":
        pytest.importorskip("cupy")
    from offload import _engine_hybrid, _row_copy, _staging
    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(_staging._Staging, "BYTES", 64 << 10)
    monkeypatch.setattr(_staging._Staging, "UNIT", 4 << 10)
    monkeypatch.setattr(_staging._Staging, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(_row_copy, "CPU_COPY", way)
    monkeypatch.setattr(_row_copy, "CPU_THREADS", threads)
    monkeypatch.setattr(_row_copy, "MIN_PIECE_BYTES", 1024)
    monkeypatch.setattr(_engine_hybrid, "LONE_BLOCK_BYTES", 3 * 128 * 4)
    monkeypatch.setattr(_engine_hybrid, "HYBRID_MIN_LONE_BYTES", 1)
    old = _staging._staging.pop(dev.index, None)
    try:
        g = torch.Generator().manual_seed(3)
        src = torch.randn(20_000, 128, generator=g)
        expected = src.clone()
        t = offload.HostTable.from_tensor(src, device=dev, engine=engine)
        for n in (5003, 1, 2, 130):
            idx = torch.randperm(20_000, generator=g)[:n]
            assert torch.equal(t.gather(idx.cuda(), unique=True).cpu(), expected[idx])
            dup = torch.cat([idx, idx[: n // 2]]).cuda()
            assert torch.equal(t.gather(dup).cpu(), expected[dup.cpu()])
            vals = torch.randn(n, 128, generator=g)
            t.scatter(idx.cuda(), vals.cuda(), unique=True)
            expected[idx] = vals
            assert torch.equal(t.data, expected)
        assert _staging._staging[dev.index].units == 16
    finally:  # later users get staging of the default size again
        _staging._staging.pop(dev.index, None)
        if old is not None:
            _staging._staging[dev.index] = old


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_cpu_engine_worker_exception_reaches_the_caller(monkeypatch, op):
    """A pool thread that fails while copying rows makes the GPU gather / scatter raise its exception; the
    staging memory stays consistent (the next calls are right)."""
    import threading
    import time

    from offload import _row_copy, _staging
    monkeypatch.setattr(_row_copy, "CPU_COPY", "pool")
    monkeypatch.setattr(_row_copy, "CPU_THREADS", 4)
    monkeypatch.setattr(_row_copy, "MIN_PIECE_BYTES", 4096)
    monkeypatch.setattr(_staging._Staging, "CHUNK_BYTES", 64 << 10)
    main = threading.get_ident()
    name = "take_rows" if op == "gather" else "put_rows"
    real = getattr(_row_copy, name)

    def broken(*args):
        if threading.get_ident() != main:
            raise MemoryError(f"a worker failed to {op} rows")
        time.sleep(0.002)  # a slow caller: the workers get pieces
        real(*args)

    g = torch.Generator().manual_seed(5)
    src = torch.randn(30_000, 64, generator=g)
    expected = src.clone()
    t = offload.HostTable.from_tensor(src, device="cuda", engine="cpu")
    idx = torch.randperm(30_000, generator=g)[:8000].cuda()
    vals = torch.randn(8000, 64, generator=g).cuda()
    monkeypatch.setattr(_row_copy, name, broken)
    with pytest.raises(MemoryError, match=f"a worker failed to {op} rows"):
        for _ in range(5):  # until a worker (not the caller) takes a piece
            t.gather(idx, unique=True) if op == "gather" else t.scatter(idx, vals, unique=True)
    monkeypatch.setattr(_row_copy, name, real)
    assert torch.equal(t.gather(idx, unique=True).cpu(), t.data[idx.cpu()])
    t.scatter(idx, vals, unique=True)
    expected[idx.cpu()] = vals.cpu()
    assert torch.equal(t.data, expected)
