"""HostTable gather / scatter bandwidth (GPU): part A of bench_offload.py, plus the levers behind it.

Default: part A, which bench_offload.py runs from here too: a 10M x 128 fp32 table of torch.empty +
normal_, pinned in place; 131,072 rows gathered and scattered by each engine and by the ``auto`` choice,
with the indices on the GPU and in host memory, each figure against a pinned contiguous copy of the same
bytes measured in the same run. Every figure is the time per call of back-to-back calls (the last one's
work finished, deferred host writes included); the "one call" rows time single calls to their end.

``--explore`` adds the measurements that locate the limits: the UVA kernel on four access patterns
(contiguous rows, a small window, the whole table sorted and unsorted), UVA traffic concurrent with a DMA
copy, the CPU engine's worker pool (its fixed cost, CPU copies alone by thread count against torch's
indexing, the staging chunk size and thread count with the DMA) and hybrid splits. ``--explore-all``
adds UVA launch shapes and cache policies, a cudaHostAlloc table and a huge-page table (slow).

    PYTHONPATH=. python3 tests/benchmarks/bench_host_table.py --out host_table.json [--explore | --explore-all]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch
from _timing import wall_seconds

import offload
from offload import _choice, _engine_hybrid, _memory, _row_copy, _staging, _uva

T0 = time.perf_counter()
RESULTS: list[dict] = []
dev = torch.device("cuda")


def emit(**kw):
    kw["t"] = round(time.perf_counter() - T0, 1)
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)


def meminfo(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def setup():
    rows, dim, n = 10_000_000, 128, 131_072
    t0 = time.perf_counter()
    data = torch.empty(rows, dim)
    data.normal_()
    t_fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    table = offload.HostTable.from_tensor(data, device=dev, copy=False, pin=True)
    emit(part="A", note="10M x 128 fp32 table", fill_s=t_fill, pin_s=time.perf_counter() - t0,
         anon_huge_gib=(meminfo("AnonHugePages") or 0) / 2**30)
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, rows, (n,), device=dev, generator=gen)
    uniq = torch.randperm(rows, device=dev, generator=gen)[:n]
    uniq_sorted = uniq.sort().values
    return dict(rows=rows, dim=dim, n=n, data=data, table=table, idx=idx, idx_cpu=idx.cpu(), uniq=uniq,
                uniq_cpu=uniq.cpu(), uniq_sorted=uniq_sorted, uniq_sorted_cpu=uniq_sorted.cpu(), nbytes=n * dim * 4)


def anchors(s):
    n, dim, nbytes = s["n"], s["dim"], s["nbytes"]
    buf = torch.empty(n, dim, pin_memory=True)
    dbuf = torch.empty(n, dim, device=dev)
    h2d = wall_seconds(lambda: dbuf.copy_(buf, non_blocking=True), 20)
    d2h = wall_seconds(lambda: buf.copy_(dbuf, non_blocking=True), 20)
    emit(part="A", op="gather", impl="anchor: pinned contiguous H2D copy", ms=h2d * 1e3, GBps=nbytes / h2d / 1e9)
    emit(part="A", op="scatter", impl="anchor: pinned contiguous D2H copy", ms=d2h * 1e3, GBps=nbytes / d2h / 1e9)
    s.update(h2d=h2d, d2h=d2h, buf=buf, dbuf=dbuf)


def part_a(s):
    data, table, idx, idx_cpu, uniq, uniq_sorted = (s[k] for k in ("data", "table", "idx", "idx_cpu", "uniq",
                                                                    "uniq_sorted"))
    uniq_sorted_cpu = s["uniq_sorted_cpu"]
    n, dim, nbytes, h2d, d2h, buf, dbuf = (s[k] for k in ("n", "dim", "nbytes", "h2d", "d2h", "buf", "dbuf"))

    def torch_staged():
        torch.index_select(data, 0, idx_cpu, out=buf)
        dbuf.copy_(buf, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # buf is reused: no overlap with the next call

    t = wall_seconds(torch_staged, 5)
    emit(part="A", op="gather", impl="anchor: torch index_select -> pinned buffer -> copy", ms=t * 1e3,
         GBps=nbytes / t / 1e9, ratio=h2d / t)

    def torch_race():  # as /work/shared/bench/anchors.py times it: call i+1's indexing overlaps call i's copy
        torch.index_select(data, 0, idx_cpu, out=buf)  # (and races on buf: its results may be wrong)
        dbuf.copy_(buf, non_blocking=True)

    t = wall_seconds(torch_race, 10)
    emit(part="A", op="gather", impl="anchor: the same, back to back without a wait (races on the buffer)",
         ms=t * 1e3, GBps=nbytes / t / 1e9, ratio=h2d / t)
    t = wall_seconds(lambda: data[idx_cpu].to(dev), 3, 1, 1)
    emit(part="A", op="gather", impl="anchor: host[idx].cuda()", ms=t * 1e3, GBps=nbytes / t / 1e9, ratio=h2d / t)

    t0 = time.perf_counter()
    choice = offload.engine_choice(dev)  # first: the cpu engine and the hybrid's cpu part use what it measured
    measure_s = time.perf_counter() - t0
    for engine in ("uva", "cpu", "hybrid"):
        table.engine = engine
        try:
            got = table.gather(idx)
            torch.cuda.synchronize()
            ok = torch.equal(got.cpu(), data[idx_cpu])
            for label, fn in [("gather(idx) [dedup + bounds check]", lambda: table.gather(idx)),
                              ("gather(unique sorted idx, unique=True)",
                               lambda: table.gather(uniq_sorted, unique=True, out=dbuf)),
                              ("gather(unique unsorted idx, unique=True)",
                               lambda: table.gather(uniq, unique=True, out=dbuf))]:
                t = wall_seconds(fn, 10)
                emit(part="A", op="gather", impl=f"offload {engine}: {label}", ms=t * 1e3, GBps=nbytes / t / 1e9,
                     ratio=h2d / t, correct=ok)
            src = torch.randn(n, dim, device=dev)
            table.scatter(uniq, src, unique=True)
            torch.cuda.synchronize()
            ok = torch.equal(table.data[uniq.cpu()], src.cpu())
            for label, fn in [("scatter(idx) [distinct check]", lambda src=src: table.scatter(uniq, src)),
                              ("scatter(idx, unique=True)",
                               lambda src=src: table.scatter(uniq, src, unique=True)),
                              ("scatter(unique sorted idx, unique=True)",
                               lambda src=src: table.scatter(uniq_sorted, src, unique=True))]:
                t = wall_seconds(fn, 10)
                emit(part="A", op="scatter", impl=f"offload {engine}: {label}", ms=t * 1e3, GBps=nbytes / t / 1e9,
                     ratio=d2h / t, correct=ok)
            host_rows(s, engine, src)
        except Exception as e:  # report and go on
            emit(part="A", impl=f"offload {engine}", error=repr(e)[:400])
    table.engine = None
    src = torch.randn(n, dim, device=dev)
    emit(part="A", note="auto engine choice", choice=choice, measure_s=measure_s,
         cpu_way={k[1]: (_row_copy._movers.get(k), _staging._chunks.get(k, 0) >> 20, _row_copy._threads.get(k))
                  for k in _staging._chunks}, measured=_choice._measured)
    for label, fn, anchor in [("gather(idx) [dedup + bounds check]", lambda: table.gather(idx), h2d),
                              ("gather(unique sorted idx, unique=True)",
                               lambda: table.gather(uniq_sorted, unique=True, out=dbuf), h2d),
                              ("gather(unique unsorted idx, unique=True)",
                               lambda: table.gather(uniq, unique=True, out=dbuf), h2d),
                              ("scatter(idx) [distinct check]", lambda: table.scatter(uniq, src), d2h),
                              ("scatter(idx, unique=True)", lambda: table.scatter(uniq, src, unique=True), d2h),
                              ("scatter(unique sorted idx, unique=True)",
                               lambda: table.scatter(uniq_sorted, src, unique=True), d2h)]:
        t = wall_seconds(fn, 10)
        emit(part="A", op=label.split("(")[0], impl=f"offload auto: {label}", ms=t * 1e3, GBps=nbytes / t / 1e9,
             ratio=anchor / t)
    host_rows(s, "auto", src)
    emit(part="A", note="auto engine choice (host indices)", choice=offload.engine_choice(dev),
         resolved={op: table.resolved_engine(op, host_indices=True) for op in ("gather", "scatter")})
    # single calls, each to its end: the latency of one call
    for label, fn, anchor in [("gather(unique sorted idx, unique=True), one call",
                               lambda: table.gather(uniq_sorted, unique=True, out=dbuf), h2d),
                              ("gather(unique sorted host idx, unique=True), one call",
                               lambda: table.gather(uniq_sorted_cpu, unique=True, out=dbuf), h2d),
                              ("scatter(idx, unique=True), one call",
                               lambda: table.scatter(uniq, src, unique=True), d2h),
                              ("scatter(unique sorted host idx, unique=True), one call",
                               lambda: table.scatter(uniq_sorted_cpu, src, unique=True), d2h)]:
        def one(fn=fn):
            fn()
            table.synchronize()
            torch.cuda.synchronize()

        t = wall_seconds(one, 10)
        emit(part="A", op=label.split("(")[0], impl=f"offload auto: {label}", ms=t * 1e3, GBps=nbytes / t / 1e9,
             ratio=anchor / t)
    # HostArray over the same table (dataset rows by index), and batches() of it (shuffled, prefetched)
    xs = offload.HostArray(None, _table=table, _row_shape=(dim,))
    fresh = [torch.randint(0, s["rows"], (n,)) for _ in range(8)]
    calls = iter(range(1 << 30))
    for label, fn in [("HostArray x[host idx]", lambda: xs[idx_cpu]), ("HostArray x[device idx]", lambda: xs[idx]),
                      ("HostArray x[host idx], another of 8 random index sets each call",
                       lambda: xs[fresh[next(calls) % 8]])]:
        t = wall_seconds(fn, 10)
        emit(part="A", op="gather", impl=f"offload auto: {label}", ms=t * 1e3, GBps=nbytes / t / 1e9, ratio=h2d / t)
    it = offload.batches(xs, batch_size=n, shuffle=True, drop_last=True)
    next(it)  # (draws the permutation of 10M rows)
    torch.cuda.synchronize()
    t0, k = time.perf_counter(), 0
    for _ in it:
        k += 1
    torch.cuda.synchronize()
    t = (time.perf_counter() - t0) / k
    emit(part="A", op="gather", impl=f"offload auto: batches(HostArray, batch_size={n}, shuffle=True), per batch",
         ms=t * 1e3, GBps=nbytes / t / 1e9, ratio=h2d / t, batches=k)


def host_rows(s, engine, src):
    """Part A's rows with the indices in host memory (``engine``: the table's engine, already set)."""
    table, data, idx_cpu, uniq_cpu, uniq_sorted_cpu, dbuf = (s[k] for k in ("table", "data", "idx_cpu", "uniq_cpu",
                                                                           "uniq_sorted_cpu", "dbuf"))
    nbytes, h2d, d2h = s["nbytes"], s["h2d"], s["d2h"]
    ok = torch.equal(table.gather(idx_cpu).cpu(), data[idx_cpu])
    for label, fn in [("gather(host idx) [repeats, bounds check]", lambda: table.gather(idx_cpu)),
                      ("gather(unique sorted host idx, unique=True)",
                       lambda: table.gather(uniq_sorted_cpu, unique=True, out=dbuf))]:
        t = wall_seconds(fn, 10)
        emit(part="A", op="gather", impl=f"offload {engine}: {label}", ms=t * 1e3, GBps=nbytes / t / 1e9,
             ratio=h2d / t, correct=ok, path=table.resolved_engine("gather", host_indices=True))
    table.scatter(uniq_cpu, src)
    ok = torch.equal(table.data[uniq_cpu], src.cpu())
    for label, fn in [("scatter(host idx) [distinct check]", lambda: table.scatter(uniq_cpu, src)),
                      ("scatter(unique sorted host idx, unique=True)",
                       lambda: table.scatter(uniq_sorted_cpu, src, unique=True))]:
        t = wall_seconds(fn, 10, finish=table.synchronize)
        emit(part="A", op="scatter", impl=f"offload {engine}: {label}", ms=t * 1e3, GBps=nbytes / t / 1e9,
             ratio=d2h / t, correct=ok, path=table.resolved_engine("scatter", host_indices=True))


# --------------------------------------------------------------------------------------------------------
# Exploration


def _set(module, **kw):
    """Set ``module``'s settings ``kw``; returns their old values (to set back the same way)."""
    old = {k: getattr(module, k) for k in kw}
    for k, v in kw.items():
        setattr(module, k, v)
    return old


def kernel_variants(s, host, tag):
    """Raw UVA kernels (no table overhead) over several index patterns and launch shapes."""
    n, dim, h2d, d2h, dbuf = (s[k] for k in ("n", "dim", "h2d", "d2h", "dbuf"))
    g = torch.Generator(device=dev).manual_seed(5)
    patterns = {
        "contiguous rows 0..n-1": torch.arange(n, device=dev),
        "window 4n rows, sorted": torch.randperm(4 * n, device=dev, generator=g)[:n].sort().values,
        "whole table, sorted": s["uniq_sorted"],
        "whole table, random order": s["uniq"],
    }
    src = torch.randn(n, dim, device=dev)
    shapes = [(_uva.THREADS, _uva.UNROLL, _uva.BLOCKS_PER_SM)]
    if tag == "main":
        shapes = [(256, 1, 8), (256, 1, 4), (256, 1, 2), (256, 1, 1), (256, 2, 8), (256, 4, 8), (256, 16, 8),
                  (1024, 8, 2)]
    default = (_uva.THREADS, _uva.UNROLL, _uva.BLOCKS_PER_SM)
    for threads, unroll, bps in shapes:
        old = _set(_uva, THREADS=threads, UNROLL=unroll, BLOCKS_PER_SM=bps)
        try:
            pats = patterns if (threads, unroll, bps) == default else {"whole table, sorted": s["uniq_sorted"]}
            for pname, p in pats.items():
                tg = wall_seconds(lambda p=p: _uva.gather_rows(host, p, dbuf), 10)
                ts = wall_seconds(lambda p=p: _uva.scatter_rows(host, p, src), 10)
                emit(part="X", what=f"{tag} raw kernel", threads=threads, unroll=unroll, blocks_per_sm=bps,
                     pattern=pname, gather_ms=tg * 1e3, gather_ratio=h2d / tg, scatter_ms=ts * 1e3,
                     scatter_ratio=d2h / ts)
        except Exception as e:
            emit(part="X", what=f"{tag} raw kernel", threads=threads, unroll=unroll, error=repr(e)[:300])
        finally:
            _set(_uva, **old)
    if tag != "main":
        return
    p = s["uniq_sorted"]
    for load in ("cs", "nc"):
        old = _set(_uva, LOAD=load)
        try:
            tg = wall_seconds(lambda: _uva.gather_rows(host, p, dbuf), 10)
            emit(part="X", what="raw gather, load policy", load=load, gather_ms=tg * 1e3, gather_ratio=h2d / tg)
        finally:
            _set(_uva, **old)
    for store in ("cs", "wt"):
        old = _set(_uva, STORE=store)
        try:
            q = patterns["whole table, sorted"]
            ts = wall_seconds(lambda q=q: _uva.scatter_rows(host, q, src), 10)
            emit(part="X", what="raw scatter, store policy", store=store, scatter_ms=ts * 1e3, scatter_ratio=d2h / ts)
        finally:
            _set(_uva, **old)
    # correctness of the default variant on this table
    _uva.gather_rows(host, p, dbuf)
    torch.cuda.synchronize()
    emit(part="X", what="raw gather correct", ok=bool(torch.equal(dbuf.cpu(), host[p.cpu()])))


def concurrency(s):
    """The UVA kernel on half the rows while a DMA copy moves the other half's bytes: does the link carry both?"""
    n, h2d, d2h, buf, dbuf, host = (s[k] for k in ("n", "h2d", "d2h", "buf", "dbuf", "data"))
    half = n // 2
    p = s["uniq_sorted"][:half]
    side = torch.cuda.Stream()
    out = dbuf[:half]
    for op in ("gather", "scatter"):
        def kern(op=op):
            if op == "gather":
                _uva.gather_rows(host, p, out)
            else:
                _uva.scatter_rows(host, p, out)

        def dma(op=op):
            if op == "gather":
                dbuf[half:].copy_(buf[half:], non_blocking=True)
            else:
                buf[half:].copy_(dbuf[half:], non_blocking=True)

        def both():
            side.wait_stream(torch.cuda.current_stream())
            kern()
            with torch.cuda.stream(side):
                dma()
            torch.cuda.current_stream().wait_stream(side)

        tk, td, tb = wall_seconds(kern, 10), wall_seconds(dma, 10), wall_seconds(both, 10)
        anchor = h2d if op == "gather" else d2h
        emit(part="X", what=f"concurrency {op}: UVA half + DMA half", kernel_ms=tk * 1e3, dma_ms=td * 1e3,
             both_ms=tb * 1e3, both_ratio=anchor / tb)


def host_side(s):
    table, idx, n = s["table"], s["idx"], s["n"]
    t = wall_seconds(lambda: torch.unique(idx, sorted=True, return_inverse=True), 10)
    emit(part="X", what="torch.unique(idx, return_inverse) on GPU", ms=t * 1e3)
    t = wall_seconds(lambda: torch.sort(idx), 10)
    emit(part="X", what="torch.sort(idx) on GPU", ms=t * 1e3)
    t = wall_seconds(lambda: torch.stack(torch.aminmax(idx)).tolist(), 10)
    emit(part="X", what="aminmax + tolist (sync)", ms=t * 1e3)
    t = wall_seconds(lambda: table.prepare(idx), 10)
    emit(part="X", what="table.prepare(idx) (dedup + bounds check)", ms=t * 1e3)
    t = wall_seconds(lambda: table.prepare(s["uniq_sorted"], unique=True), 10)
    emit(part="X", what="table.prepare(uniq, unique=True)", ms=t * 1e3)
    t = wall_seconds(lambda: s["uniq_sorted"].cpu(), 10)
    emit(part="X", what="indices to host (.cpu())", ms=t * 1e3)
    t = wall_seconds(lambda: torch.empty(n, s["dim"], device=dev), 10)
    emit(part="X", what="torch.empty rows on GPU", ms=t * 1e3)


def pool_overhead(s):
    """The worker pool's fixed cost: a call whose pieces do nothing, on 1 (the caller alone) to 16 threads,
    with each thread waking FANOUT others (and the caller waking them all)."""
    old = _row_copy.FANOUT
    try:
        for threads in (2, 4, 8, 16):
            for fanout in ((4, 16) if threads > 4 else (4,)):
                _row_copy.FANOUT = fanout
                rounds = [(0, threads)]
                for _ in range(20):
                    _row_copy._run_rows(lambda a, b: None, rounds, 1 << 20, threads=threads)
                t0 = time.perf_counter()
                for _ in range(200):
                    _row_copy._run_rows(lambda a, b: None, rounds, 1 << 20, threads=threads)
                emit(part="X", what="pool: empty call", threads=threads, fanout=fanout,
                     us=(time.perf_counter() - t0) / 200 * 1e6)
    finally:
        _row_copy.FANOUT = old


def cpu_side(s):
    """CPU copies alone (no DMA): torch's multi-threaded index_select / index_copy_ in one call and in
    chunks, and the pool's numpy take / put by thread count and chunk, between the table and page-locked
    memory."""
    data, n, dim, nbytes = s["data"], s["n"], s["dim"], s["nbytes"]
    ic = s["uniq_sorted"].cpu()
    pin = torch.empty(n, dim, pin_memory=True)
    src_rows, pin_rows, idx = _row_copy._row_array(data), _row_copy._row_array(pin), ic.numpy()
    w_data, w_pin = _row_copy._wide(data), _row_copy._wide(pin)
    for mib in (64, 16, 4, 1):
        per = (mib << 20) // 512

        def sel(per=per):
            for a in range(0, n, per):
                torch.index_select(w_data, 0, ic[a:a + per], out=w_pin[a:a + per])

        def cop(per=per):
            for a in range(0, n, per):
                w_data.index_copy_(0, ic[a:a + per], w_pin[a:a + per])

        tg, ts = wall_seconds(sel, 5), wall_seconds(cop, 5)
        emit(part="X", what=f"CPU alone: torch, {torch.get_num_threads()} threads", chunk_mib=mib,
             take_ms=tg * 1e3, take_GBps=nbytes / tg / 1e9, put_ms=ts * 1e3, put_GBps=nbytes / ts / 1e9)
    for threads, mib in ((4, 8), (8, 4), (8, 8), (8, 16), (12, 8), (16, 8), (16, 16), (16, 64)):
        per = (mib << 20) // 512
        rounds = [(r0, min(n, r0 + per)) for r0 in range(0, n, per)]
        tg = wall_seconds(lambda rounds=rounds, threads=threads: _row_copy._run_rows(
            lambda a, b: _row_copy.take_rows(src_rows, idx[a:b], pin_rows[a:b]), rounds, 512, threads=threads), 5)
        ts = wall_seconds(lambda rounds=rounds, threads=threads: _row_copy._run_rows(
            lambda a, b: _row_copy.put_rows(src_rows, idx[a:b], pin_rows[a:b]), rounds, 512, threads=threads), 5)
        emit(part="X", what="CPU alone: pool take / put", threads=threads, chunk_mib=mib, take_ms=tg * 1e3,
             take_GBps=nbytes / tg / 1e9, put_ms=ts * 1e3, put_GBps=nbytes / ts / 1e9)


def cpu_engine_ways(s):
    """The CPU engine (staging + DMA) in each way of copying rows: torch in chunks, the pool by threads."""
    table, dbuf, h2d, d2h, uniq_sorted = (s[k] for k in ("table", "dbuf", "h2d", "d2h", "uniq_sorted"))
    src = torch.randn(s["n"], s["dim"], device=dev)
    table.engine = "cpu"
    old = _staging._Staging.CHUNK_BYTES, _row_copy.CPU_COPY, _row_copy.CPU_THREADS
    try:
        for way, mib, threads in (("torch", 4, 1), ("torch", 8, 1), ("torch", 16, 1), ("torch", 32, 1),
                                  ("pool", 8, 8), ("pool", 16, 8), ("pool", 8, 16), ("pool", 16, 16)):
            _staging._Staging.CHUNK_BYTES, _row_copy.CPU_COPY, _row_copy.CPU_THREADS = mib << 20, way, threads
            tg = wall_seconds(lambda: table.gather(uniq_sorted, unique=True, out=dbuf), 10)
            ts = wall_seconds(lambda: table.scatter(uniq_sorted, src, unique=True), 10)
            emit(part="X", what="cpu engine", way=way, chunk_mib=mib, threads=threads, gather_ms=tg * 1e3,
                 gather_ratio=h2d / tg, scatter_ms=ts * 1e3, scatter_ratio=d2h / ts)
    finally:
        _staging._Staging.CHUNK_BYTES, _row_copy.CPU_COPY, _row_copy.CPU_THREADS = old
        table.engine = None


def hostalloc_table(s):
    """The same rows in memory from cudaHostAlloc (the driver's own pinned allocation) instead of
    cudaHostRegister of ordinary memory: does the driver map it with larger GPU pages?"""
    import ctypes

    cp = _uva.cupy
    nbytes = s["data"].numel() * 4
    ptr = cp.cuda.runtime.hostAlloc(nbytes, 0x01 | 0x02)  # portable | mapped
    try:
        host = torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.float32).view(s["data"].shape)
        host.copy_(s["data"])
        kernel_variants(s, host, "cudaHostAlloc table")
        host = None
        torch.cuda.synchronize()
    finally:
        cp.cuda.runtime.freeHost(ptr)


def lone_rows(s):
    """What the hybrid's split rests on (see offload._engine_hybrid.LONE_BLOCK_BYTES): the UVA kernel over index sets
    of the same size that differ in how close their rows lie; over the rows that are not lone in blocks of
    several sizes against as many rows drawn at random, alone and with the lone rows' bytes copied at the
    same time; and the hybrid engine with each block size."""
    table, host, dbuf, h2d, d2h, n = (s[k] for k in ("table", "data", "dbuf", "h2d", "d2h", "n"))
    rows = s["rows"]
    src = torch.randn(n, s["dim"], device=dev)
    g = torch.Generator(device=dev).manual_seed(11)
    patterns = {"random rows of the whole table, sorted": s["uniq_sorted"],
                "random rows within 2 GiB, sorted": torch.randperm(4 << 20, device=dev, generator=g)[:n].sort().values}
    for per, block_rows, what in ((2, 2, "two to a 1 KiB block"), (8, 8, "eight to a 4 KiB block"),
                                  (4, 128, "four to a 64 KiB block")):
        blocks = torch.randperm(rows // block_rows, device=dev, generator=g)[:n // per].sort().values
        within = torch.randperm(block_rows, device=dev, generator=g)[:per].sort().values
        patterns[f"random rows {what}, sorted"] = (blocks[:, None] * block_rows + within).reshape(-1)
    for what, p in patterns.items():
        tg = wall_seconds(lambda p=p: _uva.gather_rows(host, p, dbuf), 10)
        ts = wall_seconds(lambda p=p: _uva.scatter_rows(host, p, src), 10)
        emit(part="L", what="raw kernel", pattern=what, gather_ms=tg * 1e3, gather_ratio=h2d / tg,
             scatter_ms=ts * 1e3, scatter_ratio=d2h / ts)
    staging = torch.empty(n, s["dim"]).pin_memory()
    side = torch.cuda.Stream()
    for block in (32 << 10, 64 << 10, 128 << 10, 256 << 10):
        old = _set(_engine_hybrid, LONE_BLOCK_BYTES=block, HYBRID_MIN_LONE_BYTES=1)
        try:
            lone, near = _engine_hybrid.lone_split(table.storage, s["uniq_sorted"])
            near_idx = s["uniq_sorted"][near]
            others = s["uniq_sorted"][torch.randperm(n, device=dev, generator=g)[:near.numel()].sort().values]
            k = near.numel()

            def near_and_copy(near_idx=near_idx, k=k):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    dbuf[k:].copy_(staging[:n - k], non_blocking=True)
                _uva.gather_rows(host, near_idx, dbuf[:k])
                torch.cuda.current_stream().wait_stream(side)

            t_near = wall_seconds(lambda near_idx=near_idx, k=k: _uva.gather_rows(host, near_idx, dbuf[:k]), 10)
            t_others = wall_seconds(lambda others=others, k=k: _uva.gather_rows(host, others, dbuf[:k]), 10)
            t_both = wall_seconds(near_and_copy, 10)
            table.engine = "hybrid"
            tg = wall_seconds(lambda: table.gather(s["uniq_sorted"], unique=True, out=dbuf), 10)
            ts = wall_seconds(lambda: table.scatter(s["uniq_sorted"], src, unique=True), 10)
            emit(part="L", what="lone split", block_kib=block >> 10, lone_rows=lone.numel(),
                 kernel_not_lone_ms=t_near * 1e3, kernel_as_many_random_ms=t_others * 1e3,
                 with_lone_bytes_copied_ms=t_both * 1e3, with_copy_ratio=h2d / t_both,
                 hybrid_gather_ms=tg * 1e3, hybrid_gather_ratio=h2d / tg, hybrid_scatter_ms=ts * 1e3,
                 hybrid_scatter_ratio=d2h / ts)
        finally:
            _set(_engine_hybrid, **old)
            table.engine = None
    out = table.gather(s["uniq_sorted"], unique=True)  # the default split's rows are right
    emit(part="L", what="hybrid correct", ok=bool(torch.equal(out.cpu(), s["data"][s["uniq_sorted_cpu"]])))


def ceiling(s):
    """A device-side gather from a GPU-resident table plus one contiguous H2D copy of the same bytes."""
    gpu_table = s["data"].to(dev)
    dbuf, h2d, buf = s["dbuf"], s["h2d"], s["buf"]
    out = torch.empty_like(dbuf)
    t_g = wall_seconds(lambda: torch.index_select(gpu_table, 0, s["uniq_sorted"], out=out), 10)

    def both():
        dbuf.copy_(buf, non_blocking=True)
        torch.index_select(gpu_table, 0, s["uniq_sorted"], out=out)

    t_b = wall_seconds(both, 10)
    emit(part="X", what="ceiling: GPU-resident gather + contiguous H2D", gpu_gather_ms=t_g * 1e3,
         both_ms=t_b * 1e3, ratio=h2d / t_b)
    gpu_table = None
    torch.cuda.empty_cache()


def huge_table(s):
    t0 = time.perf_counter()
    before = meminfo("AnonHugePages") or 0
    ht = offload.HostTable.from_tensor(s["data"], device=dev, pin=True)  # allocate_host: huge-page advised
    emit(part="X", what="huge-page table (copy of the data)", s=time.perf_counter() - t0,
         anon_huge_gib_added=((meminfo("AnonHugePages") or 0) - before) / 2**30, huge_pages=_memory.HUGE_PAGES.get())
    kernel_variants(s, ht.storage.tensor, "huge-page table")
    ht.engine = "cpu"
    tg = wall_seconds(lambda: ht.gather(s["uniq_sorted"], unique=True, out=s["dbuf"]), 10)
    emit(part="X", what="huge-page table, cpu engine gather", ms=tg * 1e3, ratio=s["h2d"] / tg)
    ht.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_table.json"))
    ap.add_argument("--explore", action="store_true")
    ap.add_argument("--lone", action="store_true", help="part A and the hybrid's lone-row measurements only")
    ap.add_argument("--explore-all", action="store_true", help="--explore plus launch shapes, cudaHostAlloc and "
                    "huge-page tables (slow)")
    ap.add_argument("--ncu", action="store_true", help="a few kernels on a 1 GiB table, for ncu")
    args = ap.parse_args()
    if args.ncu:
        data = torch.randn(2_000_000, 128)
        table = offload.HostTable.from_tensor(data, device=dev, copy=False, pin=True, engine="uva")
        p = torch.randperm(2_000_000, device=dev)[:131_072].sort().values
        rows = table.gather(p, unique=True)
        table.scatter(p, rows, unique=True)
        table.gather(torch.arange(131_072, device=dev), unique=True)
        table.scatter(torch.arange(131_072, device=dev), rows, unique=True)
        torch.cuda.synchronize()
        return
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = None
    try:
        link = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current,"
                               "pcie.link.gen.max", "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        link = None
    emit(note="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(), threads=torch.get_num_threads(),
         cupy=_uva.cupy.__version__ if _uva.cupy is not None else None, thp=thp, pcie=link,
         uva=dict(threads=_uva.THREADS, unroll=_uva.UNROLL, blocks_per_sm=_uva.BLOCKS_PER_SM, load=_uva.LOAD,
                  store=_uva.STORE), chunk_mib=(_staging._Staging.CHUNK_BYTES or _staging._Staging.DEFAULT_CHUNK) >> 20,
         cpus=len(os.sched_getaffinity(0)), kernel=os.uname().release)
    s = setup()
    anchors(s)
    steps = [part_a, lone_rows] if args.lone else [part_a]
    if args.explore or args.explore_all:
        steps = [part_a, lone_rows, cpu_engine_ways, cpu_side, pool_overhead,
                 lambda s: kernel_variants(s, s["data"], "default shape"), concurrency]
        if args.explore_all:
            steps += [lambda s: kernel_variants(s, s["data"], "main"), hostalloc_table, huge_table]
    for step in steps:
        try:
            step(s)
        except Exception as e:
            import traceback

            emit(error=repr(e)[:400], tb=traceback.format_exc()[-1500:])
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print("\n| what | ms | GB/s | share of the contiguous copy |")
    for r in RESULTS:
        if r.get("part") == "A" and "impl" in r and "ms" in r:
            print(f"| {r['op']}: {r['impl']} | {r['ms']:.3f} | {r['GBps']:.1f} | "
                  f"{r.get('ratio', 1.0):.2f} |")


if __name__ == "__main__":
    main()
