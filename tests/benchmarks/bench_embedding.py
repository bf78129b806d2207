"""Embedding forward+backward on one GPU: torchmb's kernels against torch anchors measured in the same run.

Part 1 (one table, 1M rows, 262,144 indices, dims 16/64/256, uniform and heavy-tailed indices):
    nn.Embedding (sort-based backward), a plain index_add_ backward (atomic, as in
    ../shared/bench/anchors.py), batch_layers.FastEmbedding (this repo's kernels).
Part 2 (B=16 tables of 100k x 64, 16,384 indices per model): batch_layers.Embedding against
    torch.func.vmap over nn.Embedding (torchmb's generic path), a Python loop of 16 nn.Embedding,
    and one nn.Embedding over the stacked tables with offset indices.
Part 3 (26 tables of mixed sizes and dims 4..64, 65,536 samples): MultiEmbedding against a loop of
    nn.Embedding + torch.cat.
Part g: part 1's steps captured in CUDA graphs (GPU time, no launch overhead).
Part h: host time (a 1,000 x 16 table, 256 indices, the GPU idle) of the steps and of their pieces,
    with the fast ``cuLaunchKernel`` launch and with ``cupy.cuda.Function`` (interleaved rounds), and a
    cProfile of torchmb's step (``profile_host.txt``).

Every step is ``weight.grad = None; out = layer(idx); out.backward(g)`` in eager mode, timed by the
wall clock around 20 steps after a synchronize (so CPU launch overhead counts, as in training), the
median of 7 repeats. Usage (GPU machine, CuPy installed):

    PYTHONPATH=. python3 tests/benchmarks/bench_embedding.py [--out DIR]

Writes ``bench_embedding.jsonl`` to ``--out`` (default ``$OUT`` or the current directory) and prints
a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from _timing import host_profile, wall_seconds
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

import batch_layers
from batch_layers import _embedding_cuda as ecuda
from offload import cuda_launch as offload_launch

dev = torch.device("cuda")
RESULTS: list[dict] = []


def step_time(fn) -> float:
    """Median seconds per eager step of ``fn`` (7 repeats of 20 steps, wall clock, launch overhead counts)."""
    return wall_seconds(fn, iters=20, warmup=5, repeats=7)


class IndexAddEmbedding(torch.autograd.Function):
    """The anchor: index_select forward, torch.zeros + index_add_ backward."""

    @staticmethod
    def forward(ctx, weight, idx):
        ctx.save_for_backward(idx)
        ctx.num = weight.shape[0]
        return weight.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        gw = torch.zeros(ctx.num, g.shape[1], device=g.device, dtype=g.dtype)
        gw.index_add_(0, idx, g)
        return gw, None


def indices(dist: str, n: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    if dist == "uniform":
        return torch.randint(0, rows, (n,), device=dev, generator=gen)
    r = torch.empty(n, device=dev).exponential_(1.0, generator=gen)  # heavy-tailed, as anchors.py
    return (torch.exp(r * 2.5).long() - 1).clamp_(0, rows - 1)


OUT_FILE: list[str] = []


def emit(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    if OUT_FILE:
        with open(OUT_FILE[0], "a") as f:
            f.write(json.dumps(row) + "\n")


def part1() -> None:
    rows, nidx = 1_000_000, 1 << 18
    gen = torch.Generator(device=dev).manual_seed(0)
    for dist in ("uniform", "zipf"):
        idx = indices(dist, nidx, rows, gen)
        unique = int(idx.unique().numel())
        for dim in (16, 64, 256):
            single_table(dist, idx, unique, rows, dim, gen)
            torch.cuda.empty_cache()


def single_table(dist: str, idx: torch.Tensor, unique: int, rows: int, dim: int, gen: torch.Generator) -> None:
    ref = nn.Embedding(rows, dim).to(dev)
    fast = batch_layers.FastEmbedding(rows, dim).to(dev)
    with torch.no_grad():
        fast.weight.copy_(ref.weight)
    g = torch.randn(idx.numel(), dim, device=dev, generator=gen)

    def run_ref():
        ref.weight.grad = None
        ref(idx).backward(g)

    def run_index_add():
        ref.weight.grad = None
        IndexAddEmbedding.apply(ref.weight, idx).backward(g)

    def run_fast():
        fast.weight.grad = None
        fast(idx).backward(g)

    # correctness on this very input before timing
    run_ref()
    run_fast()
    err = float((fast.weight.grad - ref.weight.grad).abs().max())
    scale = float(ref.weight.grad.abs().max())
    t_ref, t_add, t_fast = step_time(run_ref), step_time(run_index_add), step_time(run_fast)
    old = ecuda.LAUNCH_MODE[0]
    ecuda.LAUNCH_MODE[0] = "cupy"  # the same step through cupy.cuda.Function launches (the slower host path)
    try:
        t_cupy = step_time(run_fast)
    finally:
        ecuda.LAUNCH_MODE[0] = old
    emit(part=1, dist=dist, unique=unique, dim=dim, nn_embedding_ms=t_ref * 1e3, index_add_ms=t_add * 1e3,
         torchmb_ms=t_fast * 1e3, vs_nn_embedding=t_ref / t_fast, vs_index_add=t_add / t_fast,
         torchmb_cupy_launch_ms=t_cupy * 1e3, max_abs_grad_err=err, max_abs_grad=scale)


def graph_time(fn, replays: int = 20, repeats: int = 7) -> float | None:
    """Median seconds per replay of ``fn`` captured in a CUDA graph (GPU time, no launch overhead);
    ``None`` if ``fn`` cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # report and go on
        print(f"capture failed: {type(err).__name__}: {err}", flush=True)
        torch.cuda.synchronize()
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    del graph
    return statistics.median(times)


def part_graph() -> None:
    """GPU time of part 1's steps, each captured in a CUDA graph (what is left without CPU overhead)."""
    rows, nidx = 1_000_000, 1 << 18
    gen = torch.Generator(device=dev).manual_seed(0)
    for dist in ("uniform", "zipf"):
        idx = indices(dist, nidx, rows, gen)
        for dim in (16, 64, 256):
            ref = nn.Embedding(rows, dim).to(dev)
            fast = batch_layers.FastEmbedding(rows, dim).to(dev)
            g = torch.randn(nidx, dim, device=dev, generator=gen)

            def run_ref(ref=ref, g=g, idx=idx):
                ref.weight.grad = None
                ref(idx).backward(g)

            def run_index_add(ref=ref, g=g, idx=idx):
                ref.weight.grad = None
                IndexAddEmbedding.apply(ref.weight, idx).backward(g)

            def run_fast(fast=fast, g=g, idx=idx):
                fast.weight.grad = None
                fast(idx).backward(g)

            t = {name: graph_time(fn) for name, fn in
                 (("nn_embedding", run_ref), ("index_add", run_index_add), ("torchmb", run_fast))}
            ratio = {f"vs_{k}": (v / t["torchmb"] if v and t["torchmb"] else None) for k, v in t.items()
                     if k != "torchmb"}
            emit(part="graph", dist=dist, dim=dim, **{f"{k}_ms": (v * 1e3 if v else None) for k, v in t.items()},
                 **ratio)
            del ref, fast, g
            torch.cuda.empty_cache()


def host_time(fn, iters: int = 1000, repeats: int = 5) -> float:
    """Median seconds per call of ``fn`` when the GPU is not the bottleneck (tiny work; one synchronize
    per ``iters`` calls), i.e. the host time: Python, torch dispatch, autograd and launch overhead."""
    return wall_seconds(fn, iters=iters, warmup=50, repeats=repeats)


def part_host() -> None:
    """Host time of one eager step (and of its pieces) on a tiny table, where the GPU idles: what bounds
    the small-dim steps of part 1. Also writes a cProfile of torchmb's step to ``profile_host.txt``."""
    rows, dim, nidx = 1000, 16, 256
    gen = torch.Generator(device=dev).manual_seed(5)
    idx = torch.randint(0, rows, (nidx,), device=dev, generator=gen)
    g = torch.randn(nidx, dim, device=dev, generator=gen)
    ref = nn.Embedding(rows, dim).to(dev)
    fast = batch_layers.FastEmbedding(rows, dim).to(dev)
    batched = batch_layers.Embedding(rows, dim, batch=4, device=dev)
    bidx, bg = idx.view(4, -1).reshape(-1), g

    def run_ref():
        ref.weight.grad = None
        ref(idx).backward(g)

    def run_index_add():
        ref.weight.grad = None
        IndexAddEmbedding.apply(ref.weight, idx).backward(g)

    def run_fast():
        fast.weight.grad = None
        fast(idx).backward(g)

    def run_batched():
        batched.weight.grad = None
        batched(bidx).backward(bg)

    def fwd(layer, x):
        def run():
            with torch.no_grad():
                layer(x)
        return run

    modes = ["driver", "cupy"] if ecuda.LAUNCH_MODE[0] == "driver" else ["cupy"]
    w = fast.weight.detach()
    cases = {
        "torchmb_step": run_fast,
        "torchmb_B4_step": run_batched,
        "torchmb_fwd": fwd(fast, idx),
        "gather_call": lambda: ecuda.gather(w, idx, 1, rows, nidx),
        "scatter_call": lambda: ecuda.scatter(g, idx, (rows, dim), 1, rows, nidx, -1, None),
    }
    samples: dict[str, list[float]] = {}
    old = ecuda.LAUNCH_MODE[0]
    try:
        for _ in range(3):  # interleaved rounds, so drift of the host's speed hits every variant alike
            for mode in modes:
                ecuda.LAUNCH_MODE[0] = mode
                for name, fn in cases.items():
                    samples.setdefault(f"{name}_{mode}", []).append(host_time(fn, iters=500, repeats=3))
            samples.setdefault("nn_embedding_step", []).append(host_time(run_ref, iters=500, repeats=3))
            samples.setdefault("index_add_step", []).append(host_time(run_index_add, iters=500, repeats=3))
            samples.setdefault("nn_embedding_fwd", []).append(host_time(fwd(ref, idx), iters=500, repeats=3))
    finally:
        ecuda.LAUNCH_MODE[0] = old
    t = {k: statistics.median(v) for k, v in samples.items()}
    t["new_empty"] = host_time(lambda: w.new_empty((nidx, dim)))
    t["new_zeros_table"] = host_time(lambda: w.new_zeros((rows, dim)))
    t["index_select"] = host_time(lambda: w.index_select(0, idx))
    t["stream_ptr"] = host_time(lambda: offload_launch.stream_ptr(0))
    t["current_device"] = host_time(ecuda._current_device)
    t["torch.cuda.current_device"] = host_time(torch.cuda.current_device)
    emit(part="host", rows=rows, dim=dim, indices=nidx, launch_mode=ecuda.LAUNCH_MODE[0],
         **{f"{k}_us": v * 1e6 for k, v in t.items()})
    text = host_profile(run_fast, 300)
    if OUT_FILE:
        with open(os.path.join(os.path.dirname(OUT_FILE[0]), "profile_host.txt"), "w") as f:
            f.write(text)
    print("\n".join(text.getvalue().splitlines()[:40]), flush=True)


def part2() -> None:
    gen = torch.Generator(device=dev).manual_seed(1)
    for dist in ("uniform", "zipf"):
        batched_tables(dist, gen)
        torch.cuda.empty_cache()


def batched_tables(dist: str, gen: torch.Generator, B: int = 16, rows: int = 100_000, dim: int = 64,
                   n: int = 16_384) -> None:
    x = torch.stack([indices(dist, n, rows, gen) for _ in range(B)])  # (B, n)
    g = torch.randn(B, n, dim, device=dev, generator=gen)
    plain = [nn.Embedding(rows, dim).to(dev) for _ in range(B)]
    batched = batch_layers.Embedding(rows, dim, batch=B, device=dev)
    with torch.no_grad():
        batched.weight.copy_(torch.stack([p.weight for p in plain]))
    params, _ = stack_module_state(plain)
    base = nn.Embedding(rows, dim, device="meta")
    flat_table = nn.Embedding(B * rows, dim).to(dev)
    with torch.no_grad():
        flat_table.weight.copy_(batched.weight.view(B * rows, dim))
    offset_x = (x + torch.arange(B, device=dev).unsqueeze(1) * rows).reshape(-1)
    merged_x, merged_g = x.reshape(-1), g.reshape(B * n, dim)

    def run_ours():
        batched.weight.grad = None
        batched(merged_x).backward(merged_g)

    def run_vmap():
        for p in params.values():
            p.grad = None
        out = vmap(lambda p, xi: functional_call(base, p, (xi,)))(params, x)
        out.backward(g)

    def run_loop():
        outs = []
        for i, p in enumerate(plain):
            p.weight.grad = None
            outs.append(p(x[i]))
        torch.autograd.backward(outs, list(g.unbind(0)))

    def run_flat():
        flat_table.weight.grad = None
        flat_table(offset_x).backward(merged_g)

    run_ours()
    run_loop()
    err = max(float((batched.weight.grad[i] - p.weight.grad).abs().max()) for i, p in enumerate(plain))
    t = {name: step_time(fn) for name, fn in
         (("torchmb", run_ours), ("vmap", run_vmap), ("loop", run_loop), ("flat_nn_embedding", run_flat))}
    emit(part=2, dist=dist, B=B, rows=rows, dim=dim, per_model=n, **{f"{k}_ms": v * 1e3 for k, v in t.items()},
         vs_vmap=t["vmap"] / t["torchmb"], vs_loop=t["loop"] / t["torchmb"],
         vs_flat_nn_embedding=t["flat_nn_embedding"] / t["torchmb"], max_abs_grad_err=err)


def part3() -> None:
    gen = torch.Generator(device=dev).manual_seed(2)
    nums = [int(v) for v in torch.randint(3, 200_000, (26,), generator=torch.Generator().manual_seed(3))]
    dims = [4, 8, 16, 32, 64, 16] * 4 + [8, 8]
    n = 65_536
    tables = [nn.Embedding(r, d).to(dev) for r, d in zip(nums, dims)]
    multi = batch_layers.MultiEmbedding.from_modules(tables)
    x = torch.stack([torch.randint(0, r, (n,), device=dev, generator=gen) for r in nums], dim=1)
    g = torch.randn(n, sum(dims), device=dev, generator=gen)

    def run_multi():
        multi.weight.grad = None
        multi(x).backward(g)

    def run_loop():
        for t in tables:
            t.weight.grad = None
        torch.cat([t(x[:, i]) for i, t in enumerate(tables)], dim=1).backward(g)

    t_multi, t_loop = step_time(run_multi), step_time(run_loop)
    emit(part=3, tables=len(nums), total_dim=sum(dims), samples=n, multi_ms=t_multi * 1e3, loop_ms=t_loop * 1e3,
         vs_loop=t_loop / t_multi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--parts", default="123gh")
    args = parser.parse_args()
    OUT_FILE.append(os.path.join(args.out, "bench_embedding.jsonl"))
    open(OUT_FILE[0], "w").close()
    batch_layers.set_backend("cupy")
    props = torch.cuda.get_device_properties(dev)
    import cupy

    emit(part=0, device=torch.cuda.get_device_name(dev), sms=props.multi_processor_count, torch=torch.__version__,
         cupy=cupy.__version__, cuda=torch.version.cuda)
    for p in args.parts:
        {"1": part1, "2": part2, "3": part3, "g": part_graph, "h": part_host}[p]()
    emit(part=9, launches=dict(ecuda.LAUNCHES), slow_launches=dict(ecuda.SLOW_LAUNCHES),
         launch_mode=ecuda.LAUNCH_MODE[0], scalar_atomics_fallback=sorted(ecuda._VECRED_BROKEN))
    print(f"\n{RESULTS[0]['device']}, torch {torch.__version__}, CuPy {cupy.__version__}")
    print("| indices | dim | nn.Embedding ms | index_add_ ms | torchmb ms | vs nn.Embedding | vs index_add_ |")
    print("|---|---|---|---|---|---|---|")
    for r in RESULTS:
        if r["part"] == 1:
            print(f"| {r['dist']} ({r['unique']:,} unique) | {r['dim']} | {r['nn_embedding_ms']:.3f} | "
                  f"{r['index_add_ms']:.3f} | {r['torchmb_ms']:.3f} | {r['vs_nn_embedding']:.2f}x | "
                  f"{r['vs_index_add']:.2f}x |")
    print("\n| B=16 x 100k x 64 | torchmb ms | vmap ms | loop ms | flat nn.Embedding ms | vs vmap | vs loop |")
    print("|---|---|---|---|---|---|---|")
    for r in RESULTS:
        if r["part"] == 2:
            print(f"| {r['dist']} | {r['torchmb_ms']:.3f} | {r['vmap_ms']:.3f} | {r['loop_ms']:.3f} | "
                  f"{r['flat_nn_embedding_ms']:.3f} | {r['vs_vmap']:.2f}x | {r['vs_loop']:.2f}x |")
    print("\n| GPU time (CUDA graph) | dim | nn.Embedding ms | index_add_ ms | torchmb ms | vs nn.Embedding "
          "| vs index_add_ |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for r in RESULTS:
        if r["part"] == "graph":
            print(f"| {r['dist']} | {r['dim']} | {fmt(r['nn_embedding_ms'], '.3f')} | "
                  f"{fmt(r['index_add_ms'], '.3f')} | {fmt(r['torchmb_ms'], '.3f')} | "
                  f"{fmt(r['vs_nn_embedding'], '.2f')}x | {fmt(r['vs_index_add'], '.2f')}x |")
    for r in RESULTS:
        if r["part"] == "host":
            print(f"\nHost time, {r['rows']} x {r['dim']} table, {r['indices']} indices (GPU idle), us per call:")
            for k, v in r.items():
                if k.endswith("_us"):
                    print(f"  {k[:-3]}: {v:.1f}")
    for r in RESULTS:
        if r["part"] == 3:
            print(f"\nMultiEmbedding {r['tables']} tables, {r['samples']:,} samples: {r['multi_ms']:.3f} ms vs "
                  f"loop {r['loop_ms']:.3f} ms ({r['vs_loop']:.2f}x)")


if __name__ == "__main__":
    main()
