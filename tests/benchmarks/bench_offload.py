"""Offload benchmark (GPU): every number is a ratio to an anchor measured in the same run.

Part A  gather / scatter of 131,072 random rows of a 10M x 128 fp32 pinned host table, each engine, against
        a pinned contiguous copy of the same bytes (the PCIe limit) and torch's own ways of doing it.
Part B  effective rows/s of a training step (lookup + backward + Adam step + write-back) with the GPU cache,
        heavy-tailed indices against uniform ones.
Part C  end to end: skip-gram with negative sampling trained with Adam; the offloaded model under a GPU
        memory cap (torch.cuda.set_per_process_memory_fraction) smaller than its tables + Adam state,
        against the same model fully on the GPU without the cap (dense nn.Embedding + Adam, and
        nn.Embedding(sparse=True) + SparseAdam, the lazy equivalent).
Part D  (when time and host memory allow) matrix factorisation whose user table + Adam state exceed the
        GPU's physical memory.

    PYTHONPATH=. python3 tests/benchmarks/bench_offload.py --out bench.json [--budget SECONDS] [--parts ABCD]
        [--host-gib GIB] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _timing import host_profile, wall_seconds
from torch import nn

import offload

T0 = time.perf_counter()
RESULTS: list[dict] = []
dev = torch.device("cuda")


def emit(**kw):
    kw["t"] = round(time.perf_counter() - T0, 1)
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)


def heavy_tailed(n, rows, gen, perm=None, alpha=2.5):
    """Pareto-like ranks (as shared/bench part B), spread over the table by a fixed permutation."""
    r = torch.empty(n, device=dev).exponential_(1.0, generator=gen)
    ranks = (torch.exp(r * alpha).long() - 1).clamp_(0, rows - 1)
    return ranks if perm is None else perm[ranks]


def zipf_like(n, rows, gen, perm):
    """Log-uniform ranks (P(rank) ~ 1/rank, word frequencies), spread by a fixed permutation."""
    u = torch.rand(n, device=dev, generator=gen)
    ranks = (torch.exp(u * math.log(rows)).long() - 1).clamp_(0, rows - 1)
    return perm[ranks]


# --------------------------------------------------------------------------------------------------------
def part_a(state):
    """HostTable's gather / scatter against the contiguous copy: bench_host_table.py's default run."""
    import bench_host_table as host_table  # this folder is on the import path of a script run from it

    shared = host_table.setup()
    host_table.anchors(shared)
    host_table.part_a(shared)
    RESULTS.extend(host_table.RESULTS)  # printed as they were measured; kept for this run's JSON and table
    host_table.RESULTS.clear()
    state["table"] = shared["table"]


def part_b(state):
    if "table" not in state:  # (part A not run)
        data = torch.empty(10_000_000, 128)
        data.normal_()
        state["table"] = offload.HostTable.from_tensor(data, device=dev, copy=False, pin=True)
    table = state["table"]
    rows, dim, n = table.num_rows, table.dim, 131_072
    gen = torch.Generator(device=dev).manual_seed(1)
    perm = torch.randperm(rows, device=dev, generator=gen)
    t0 = time.perf_counter()
    emb = offload.OffloadedEmbedding(rows, dim, table=table, device=dev, cache_rows=1 << 20)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=1e-3))
    emit(part="B", note="attach Adam: 2 state tables of 10M x 128 created and pinned",
         s=time.perf_counter() - t0)
    res = {}
    for dist in ("uniform", "heavy"):
        # fresh indices every step (a repeating pool would let the cache hold uniform batches too)
        pool = [torch.randint(0, rows, (n,), device=dev, generator=gen) if dist == "uniform"
                else heavy_tailed(n, rows, gen, perm) for _ in range(40)]
        uniq = sum(int(p.unique().numel()) for p in pool) / len(pool)
        k = [0]

        def step(pool=pool, k=k):
            idx = pool[k[0] % len(pool)]
            k[0] += 1
            opt.zero_grad(set_to_none=True)
            out = emb(idx)
            emb.prefetch(pool[k[0] % len(pool)])
            out.pow(2).mean().backward()
            opt.step()

        h0, m0 = emb.cache_stats()["hits"], emb.cache_stats()["misses"]
        t = wall_seconds(step, 10, 6, 2)  # 26 steps < 40: no batch repeats within the timing
        st = emb.cache_stats()
        hits, misses = st["hits"] - h0, st["misses"] - m0
        res[dist] = n / t
        emit(part="B", dist=dist, indices=n, unique_rows=uniq, ms_per_step=t * 1e3, eff_rows_per_s=n / t,
             cache_hit_rate=hits / max(1, hits + misses))
    emit(part="B", heavy_over_uniform=res["heavy"] / res["uniform"])
    emb.flush()
    offload.detach(opt)
    emb.table = None  # the table of part A is dropped with the state
    gc.collect()
    torch.cuda.empty_cache()


class SkipGram(nn.Module):
    def __init__(self, vocab, dim, make):
        super().__init__()
        self.inp = make(vocab, dim)
        self.out = make(vocab, dim)

    def forward(self, center, ctx):  # center (B,), ctx (B, 1 + negatives): column 0 is the true context
        c = self.inp(center)
        o = self.out(ctx)
        s = torch.einsum("bd,bkd->bk", c, o)
        sign = torch.ones_like(s)
        sign[:, 1:] = -1
        return -F.logsigmoid(s * sign).sum(1).mean()


def count_syncs(fn, steps=5):
    """Host synchronisations per call of ``fn`` (torch's sync debug mode, warnings counted)."""
    import warnings

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = {}
    for w in got:
        msg = str(w.message)
        if "synchroniz" in msg:
            key = f"{os.path.basename(w.filename)}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return sum(where.values()) / steps, {k: v / steps for k, v in sorted(where.items())}


def profile_steps(step, label, steps=5, trace=True):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
    print(f"--- profile: {label} ({steps} steps) ---\n{table}", flush=True)
    # per step: kernel launches (runtime and driver API: CuPy launches through the driver), host syncs, and
    # the GPU's busy time (union of kernel and copy intervals) overall and per stream, against the wall time
    launches = syncs = 0
    for e in prof.key_averages():
        if "LaunchKernel" in e.key:
            launches += e.count
        if "Synchronize" in e.key:
            syncs += e.count
    spans: dict = {}
    lo, hi = float("inf"), 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.setdefault(getattr(e, "device_resource_id", 0), []).append((e.time_range.start, e.time_range.end))
        lo, hi = min(lo, e.time_range.start), max(hi, e.time_range.end)

    def busy(iv):
        total, end = 0.0, -1.0
        for a, b in sorted(iv):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    emit(part="C", profile=label, launches_per_step=launches / steps, sync_calls_per_step=syncs / steps,
         window_ms_per_step=(hi - lo) / 1e3 / steps,
         gpu_busy_ms_per_step=busy([iv for v in spans.values() for iv in v]) / 1e3 / steps,
         busy_ms_per_step_by_stream={str(k): round(busy(v) / 1e3 / steps, 3) for k, v in spans.items()})
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"profile-{len(RESULTS)}.txt"), "w") as f:
            f.write(label + "\n" + table + "\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
        if trace:
            prof.export_chrome_trace(os.path.join(out, f"trace-{len(RESULTS)}.json"))


def part_c(state, profile=False):
    vocab, dim, batch, neg = 4_000_000, 128, 16_384, 5
    gen = torch.Generator(device=dev).manual_seed(2)
    perm = torch.randperm(vocab, device=dev, generator=gen)

    def fresh_batch(_k=0):
        return (zipf_like(batch, vocab, gen, perm),
                zipf_like(batch * (1 + neg), vocab, gen, perm).view(batch, 1 + neg))

    # a fresh batch every timed step (a short repeating pool would let a cache hold every row): the timed
    # steps of one configuration (103) and its sync count and profile (13) take fewer batches than the pool holds
    data = [fresh_batch() for _ in range(128)]
    table_state_bytes = 2 * vocab * dim * 4 * 3
    res = {}

    class Feed:
        """Batches in order with the next one known in advance (what prefetch is given)."""

        def __init__(self, get):
            self.get, self.k = get, 0
            self.cur = get(0)

        def take(self):
            cur = self.cur
            self.k += 1
            self.cur = self.get(self.k)
            return cur, self.cur

    def make_step(model, opt, feed, prefetch=False, phases=None):
        def step():
            (c, x), (nc, nx) = feed.take()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model(c, x)
            t1 = time.perf_counter()
            if prefetch:  # as the tutorial shows: after the forward, before backward
                model.inp.prefetch(nc)
                model.out.prefetch(nx)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            opt.step()
            if phases is not None:  # host time per phase (a phase that synchronises includes the wait)
                t4 = time.perf_counter()
                for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    phases[k] += v

        return step

    def host_phases(model, opt, feed, label, prefetch=False, steps=40):
        """Host milliseconds per step in each phase, and a cProfile of 20 more steps (--profile); the batches
        go on where ``feed`` stands."""
        phases = dict.fromkeys(PHASES, 0.0)
        step = make_step(model, opt, feed, prefetch, phases)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        phases.update(dict.fromkeys(PHASES, 0.0))
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        emit(part="C", host_phases=label, wall_ms_per_step=wall / steps * 1e3,
             **{f"{k}_ms": v / steps * 1e3 for k, v in phases.items()})
        out = os.environ.get("OUT")
        if out:
            text = host_profile(step, 20, (("tottime", 45), ("cumulative", 60)))
            with open(os.path.join(out, f"cprofile-{len(RESULTS)}.txt"), "w") as f:
                f.write(f"{label} (20 steps)\n{text}")

    def run(model, opt, label, prefetch=False, **extra):
        feed = Feed(lambda k: data[k % len(data)])
        step = make_step(model, opt, feed, prefetch)
        torch.cuda.reset_peak_memory_stats()
        # five timings of 20 steps (their spread is reported: on these machines a host-bound step varies by
        # up to 15% between runs)
        means = [wall_seconds(step, 20, 3 if r == 0 else 0, 1) for r in range(5)]
        t = statistics.median(means)
        extra.update(ms_min=min(means) * 1e3, ms_max=max(means) * 1e3)
        res[label] = 1 / t
        if hasattr(model.inp, "cache_stats"):
            extra.update({"cache_" + name: m.cache_stats() for name, m in (("inp", model.inp), ("out", model.out))})
        emit(part="C", impl=label, steps_per_s=1 / t, ms_per_step=t * 1e3,
             peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30, steps_run=feed.k, **extra)
        return step, feed

    torch.manual_seed(0)
    dense = SkipGram(vocab, dim, lambda v, d: nn.Embedding(v, d)).to(dev)
    run(dense, torch.optim.Adam(dense.parameters(), lr=1e-3), "GPU: dense nn.Embedding + Adam (no cap)")
    run(dense, torch.optim.Adam(dense.parameters(), lr=1e-3, fused=True),
        "GPU: dense nn.Embedding + Adam(fused=True) (no cap)")
    del dense
    gc.collect()
    torch.cuda.empty_cache()
    sparse = SkipGram(vocab, dim, lambda v, d: nn.Embedding(v, d, sparse=True)).to(dev)
    sopt = torch.optim.SparseAdam(list(sparse.parameters()), lr=1e-3)
    step, feed = run(sparse, sopt, SPARSE)
    if profile:
        profile_steps(step, "SparseAdam on the GPU", trace=False)
        host_phases(sparse, sopt, feed, "SparseAdam on the GPU")
    del sparse, sopt, step
    gc.collect()
    torch.cuda.empty_cache()

    total = torch.cuda.get_device_properties(dev).total_memory
    cap = 3 * 2**30
    torch.cuda.set_per_process_memory_fraction(cap / total)
    emit(part="C", note="GPU memory cap", cap_gib=cap / 2**30, tables_plus_adam_gib=table_state_bytes / 2**30)
    try:
        t0 = time.perf_counter()
        model = SkipGram(vocab, dim, lambda v, d: offload.OffloadedEmbedding(v, d)).to(dev)
        opts = {"foreach": offload.attach(torch.optim.Adam(model.parameters(), lr=1e-3))}
        emit(part="C", note="offloaded tables + Adam state created and pinned", s=time.perf_counter() - t0)
        base = torch.cuda.memory_allocated()

        def set_caches(model, inp_rows, out_rows):
            for m, r in ((model.inp, inp_rows), (model.out, out_rows)):
                m.flush()
                m._drop_cache()
                m.cache_bytes, m.cache_rows = None, r
            gc.collect()
            torch.cuda.empty_cache()  # (the old caches' blocks would fragment the capped memory)

        def configure(model, opts, adam):
            if adam not in opts:
                offload.detach(opts["foreach"])
                opts[adam] = offload.attach(torch.optim.Adam(model.parameters(), lr=1e-3, fused=True))
            return opts[adam]

        row_bytes = dim * 4 * 3  # weight + exp_avg + exp_avg_sq
        # uncached first: their peak gives the working memory of a step, from which the cache size follows
        work = 0
        configs = [((0, 0), False, "foreach"), ((0, 0), True, "foreach"),
                   (((512 << 20) // row_bytes, (1 << 30) // row_bytes), True, "foreach"),
                   ("cap", True, "foreach"), ("cap", False, "foreach"), ("cap", True, "fused")]
        for rows, prefetch, adam in configs:
            from_cap = rows == "cap"
            if from_cap:
                # The cap is the constraint: the caches get what is left of it after the data, the tables'
                # slot maps (8 bytes per row), 1.5x the uncached step's working memory and 128 MiB of slack,
                # split between the tables in proportion to their lookups per step (1 : 1 + neg): with
                # log-uniform frequencies a cache row saves misses in proportion to the lookups.
                left = cap - base - 2 * vocab * 8 - int(1.5 * work) - (128 << 20)
                slots = max(0, left // (row_bytes + 18))  # (+ slot id, last use, dirty and fresh flags)
                rows = (slots // (2 + neg), slots - slots // (2 + neg))
            set_caches(model, *rows)
            opt = configure(model, opts, adam)
            cap_rows = model.out._cache_capacity()
            label = (f"offload: cache {model.inp._cache_capacity()} + {cap_rows} rows "
                     f"({(model.inp._cache_capacity() + cap_rows) * row_bytes / 2**30:.2f} GiB), "
                     f"prefetch={prefetch}, Adam {adam} (capped)")
            try:
                if cap_rows:  # a cached run is timed only once its caches are full (fresh batches until then)
                    warm = make_step(model, opt, Feed(fresh_batch), prefetch)
                    n_warm = 0
                    while n_warm < 300 and any(m._cache is None or m._cache.filled < m._cache.capacity
                                               for m in (model.inp, model.out)):
                        warm()
                        n_warm += 1
                    emit(part="C", note=f"warm-up steps until the caches were full: {n_warm}", config=label)
                torch.cuda.synchronize()
                step, feed = run(model, opt, label, prefetch)
                if rows == (0, 0) and prefetch and not from_cap:
                    work = torch.cuda.max_memory_allocated() - base
                    emit(part="C", note="working memory of an uncached step", gib=work / 2**30)
                if profile and from_cap:  # (the configurations the report is about)
                    per_step, where = count_syncs(step)
                    emit(part="C", impl_sync=label, syncs_per_step=per_step, where=where)
                    profile_steps(step, label, trace=adam == "fused" and prefetch)
                    host_phases(model, opt, feed, label, prefetch)
            except torch.OutOfMemoryError as e:
                # (a step that ran out of memory is left half done: the remaining configurations are skipped)
                emit(part="C", impl=label, error=repr(e)[:300])
                break
            gc.collect()
        best = max(v for k, v in res.items() if k.startswith("offload"))
        emit(part="C", offload_best_over_sparse_gpu=best / res[SPARSE],
             offload_best_over_dense_gpu=best / max(v for k, v in res.items() if k.startswith("GPU: dense")))
        for o in opts.values():
            offload.detach(o)
        model.inp.table = model.out.table = None
        del model, opts
        gc.collect()
        torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


SPARSE = "GPU: nn.Embedding(sparse=True) + SparseAdam (no cap)"
PHASES = ("forward", "prefetch", "backward", "step")  # (forward: zero_grad and the model's forward)


def part_d(state, budget_left, host_gib=0.0):
    gpu = torch.cuda.get_device_properties(dev).total_memory
    dim = 128
    users = int(gpu * 1.05 / (dim * 4 * 3)) + 1  # table + Adam state just over the GPU's memory
    need = users * dim * 4 * 3
    info = offload.host_memory_available()
    emit(part="D", users=users, table_gib=users * dim * 4 / 2**30, table_plus_adam_gib=need / 2**30,
         gpu_gib=gpu / 2**30, host_available_gib=(info["available"] or 0) / 2**30, budget_left_s=budget_left)
    # (on machines whose memory grows as it is used, MemTotal starts small: --host-gib states the real size)
    host_total = max(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), int(host_gib * 2**30))
    if need > 0.85 * host_total:
        emit(part="D", skipped=f"host memory ({host_total / 2**30:.0f} GiB) is too small for {need / 2**30:.0f} GiB")
        return
    if budget_left < 100:
        emit(part="D", skipped="not enough time left in this run")
        return
    t0 = time.perf_counter()
    # unpinned host memory (page-locking 90 GB takes minutes; the CPU engine stages rows through pinned
    # buffers); every user row starts at 0.01 (a constant fill touches the memory fastest; the values do not
    # change the work of a step)
    table = offload.HostTable(users, dim, torch.float32, device=dev, pin=False, fill=0.01)
    users_emb = offload.OffloadedEmbedding(users, dim, device=dev, table=table, pin=False)
    emit(part="D", note="user table created", s=time.perf_counter() - t0)
    t0 = time.perf_counter()
    items = nn.Embedding(100_000, dim).to(dev)
    opt = offload.attach(torch.optim.Adam([*users_emb.parameters(), *items.parameters()], lr=1e-3))
    emit(part="D", note="Adam state tables created (2 x the user table, host memory)", s=time.perf_counter() - t0)
    gen = torch.Generator(device=dev).manual_seed(3)
    batch = 65_536
    first = []

    def step():
        u = torch.randint(0, users, (batch,), device=dev, generator=gen)
        if not first:
            first.append(u[:4].cpu())
        i = torch.randint(0, 100_000, (batch,), device=dev, generator=gen)
        r = torch.rand(batch, device=dev, generator=gen) * 5
        opt.zero_grad(set_to_none=True)
        pred = (users_emb(u) * items(i)).sum(1)
        F.mse_loss(pred, r).backward()
        opt.step()

    t = wall_seconds(step, 5, 2, 1)
    trained = bool((table.data[first[0]] != 0.01).any(dim=1).all())
    emit(part="D", impl=f"matrix factorisation, {users / 1e6:.1f}M users: table + Adam state "
         f"{need / 2**30:.0f} GiB > GPU {gpu / 2**30:.0f} GiB", steps_per_s=1 / t, ms_per_step=t * 1e3,
         rows_per_step=batch, rows_per_s=batch / t, first_rows_trained=trained,
         peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30)
    offload.detach(opt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench.json"))
    ap.add_argument("--budget", type=float, default=280.0)
    ap.add_argument("--parts", default="ABCD")
    ap.add_argument("--profile", action="store_true", help="profile part C's steps and count host syncs")
    ap.add_argument("--host-gib", type=float, default=0.0,
                    help="the machine's host memory, where MemTotal grows as memory is used (part D)")
    args = ap.parse_args()
    emit(note="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(), threads=torch.get_num_threads(),
         cupy=offload._uva.cupy.__version__ if offload._uva.cupy is not None else None,
         engine=offload.engine_choice(dev), offload_path=os.path.dirname(offload.__file__))
    state: dict = {}
    for p in args.parts:
        try:
            if p == "A":
                part_a(state)
            elif p == "B":
                part_b(state)
            elif p == "C":
                state.pop("table", None)
                gc.collect()
                part_c(state, args.profile)
            elif p == "D":
                state.clear()
                gc.collect()
                part_d(state, args.budget - (time.perf_counter() - T0), args.host_gib)
        except Exception as e:
            import traceback

            emit(part=p, error=repr(e)[:400], tb=traceback.format_exc()[-1500:])
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print("\n| part | what | ms | GB/s, rows/s or steps/s | ratio to anchor |")
    for r in RESULTS:
        if "error" in r:
            print(f"| {r.get('part')} | ERROR {r.get('impl', '')} | {r['error'][:200]} | | |")
        elif "impl" in r or "dist" in r:
            ms = r.get("ms", r.get("ms_per_step"))
            rate = r.get("GBps", r.get("eff_rows_per_s", r.get("steps_per_s")))
            ratio = r.get("ratio")
            print(f"| {r.get('part')} | {r.get('impl', r.get('dist'))} | {ms:.3f} | {rate:.4g} | "
                  f"{'' if ratio is None else f'{ratio:.2f}'} |")
        elif "host_phases" in r:
            print(f"| {r.get('part')} | host ms per phase: {r['host_phases']} | {r['wall_ms_per_step']:.3f} | "
                  + ", ".join(f"{k} {r[k + '_ms']:.2f}" for k in PHASES) + " | |")
        elif "profile" in r:
            print(f"| {r.get('part')} | profile: {r['profile']} | {r['window_ms_per_step']:.3f} (profiled) | "
                  f"launches {r['launches_per_step']:.0f}, syncs {r['sync_calls_per_step']:.1f}, GPU busy "
                  f"{r['gpu_busy_ms_per_step']:.3f} ms | |")
        elif any(k.endswith("over_uniform") or "_over_" in k for k in r):
            print(f"| {r.get('part')} | {json.dumps(r)} | | | |")

if __name__ == "__main__":
    main()
