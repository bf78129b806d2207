"""GPU-only: offloaded training as the benchmark runs it (two tables, GPU caches that evict every step,
prefetch, torch's fused Adam, the UVA engine) against the same model fully on the GPU with
nn.Embedding(sparse=True) + SparseAdam, and the host synchronisations of such a step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.syncs import offload_syncs
from torch import nn

import offload

pytestmark = pytest.mark.cuda


class SkipGram(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.inp = make()
        self.out = make()

    def forward(self, center, ctx):
        s = torch.einsum("bd,bkd->bk", self.inp(center), self.out(ctx))
        sign = torch.ones_like(s)
        sign[:, 1:] = -1
        # (summed, not averaged: gradients far above Adam's eps, where SparseAdam and Adam differ, see below)
        return -F.logsigmoid(s * sign).sum()


def _batches(steps, rows, batch, neg, seed):
    g = torch.Generator().manual_seed(seed)

    def draw(n):  # heavy-tailed: a few hot rows in every batch, a long tail of rows that come and go
        return (torch.empty(n).exponential_(generator=g) * rows / 12).long().clamp_(max=rows - 1)

    return [(draw(batch).cuda(), draw(batch * (1 + neg)).view(batch, 1 + neg).cuda()) for _ in range(steps)]


def _train(model, opt, data, prefetch):
    for i, (c, x) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = model(c, x)
        if prefetch and i + 1 < len(data):
            model.inp.prefetch(data[i + 1][0])
            model.out.prefetch(data[i + 1][1])
        loss.backward()
        opt.step()


@pytest.mark.parametrize("adam", [{"fused": True}, {"foreach": True}])
@pytest.mark.parametrize("cache_rows", [1500, 6000])
@pytest.mark.parametrize("kernels", [True, False], ids=["cache-kernels", "torch-bookkeeping"])
def test_skip_gram_with_evicting_caches_and_prefetch_equals_sparse_adam_on_the_gpu(adam, cache_rows, kernels):
    """Admissions of the next step's rows on a side stream, write-backs of the rows they evict on another
    (waiting for the admission only), the step in between: the same tables and Adam state as SparseAdam,
    with the cache's bookkeeping and the lookups' backward in their CuPy kernels or in torch operations."""
    pytest.importorskip("cupy")
    from offload import cuda_launch as _launch

    ran = {k: _launch.LAUNCHES[k] for k in ("cache_fill", "cache_install", "cache_store", "seg_tiles",
                                                   "lru_select")}
    rows, dim = 40_000, 64
    g = torch.Generator().manual_seed(3)
    w_in, w_out = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g) * 0.1
    data = _batches(16, rows, 2048, 5, seed=4)
    ref = SkipGram(lambda: nn.Embedding(rows, dim, sparse=True)).cuda()
    with torch.no_grad():
        ref.inp.weight.copy_(w_in)
        ref.out.weight.copy_(w_out)
    # eps far below every gradient: SparseAdam divides it by sqrt(bias_correction2) where Adam does not, and
    # with the default 1e-8 rows whose gradients are that small (negatives seen once) differ by up to 3e-3
    # (seen on an H200 and, identically, on the CPU path)
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.01, eps=1e-12)
    _train(ref, ref_opt, data, prefetch=False)
    weights = iter([w_in, w_out])
    model = SkipGram(lambda: offload.OffloadedEmbedding(rows, dim, _weight=next(weights).clone(), device="cuda",
                                                        engine="uva", cache_rows=cache_rows))
    opt = offload.attach(torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-12, **adam))
    before = offload.uva_launch_counts().get("scatter", 0)
    with offload.use_cache_kernels(kernels):
        _train(model, opt, data, prefetch=True)
        torch.cuda.synchronize()
    for m in (model.inp, model.out):
        st = m.cache_stats()
        assert st["misses"] > cache_rows and st["hits"] > 0  # the caches evicted and hit
    assert offload.uva_launch_counts().get("scatter", 0) > before  # write-backs by the UVA kernel
    assert all((_launch.LAUNCHES[k] > v) == kernels for k, v in ran.items())  # (the kernels ran, or none)
    for m, r in ((model.inp, ref.inp), (model.out, ref.out)):
        m.flush()
        st = ref_opt.state[r.weight]
        torch.testing.assert_close(m.table.data, r.weight.detach().cpu(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(m.state_tables["exp_avg"].data, st["exp_avg"].cpu(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(m.state_tables["exp_avg_sq"].data, st["exp_avg_sq"].cpu(), rtol=1e-4,
                                   atol=1e-7)


@pytest.mark.parametrize("engine,cache_rows", [("uva", 20_000), ("auto", 20_000), ("auto", 6500)])
def test_skip_gram_step_synchronises_only_in_prefetch(engine, cache_rows):
    """A prefetched step of two tables costs exactly one host synchronisation per prefetch (deduplication,
    bounds check and miss count read back together) and none in the switch-in, the backward pass, fused
    Adam, the admissions or the write-backs of evicted rows: also with the default engine ("auto"), whose
    cache transfers are the UVA kernel's whatever it picks for plain gathers (the CPU and hybrid engines
    need host indices)."""
    pytest.importorskip("cupy")
    rows, dim = 20_000, 32
    data = _batches(12, rows, 1024, 5, seed=5)
    model = SkipGram(lambda: offload.OffloadedEmbedding(rows, dim, device="cuda", engine=engine,
                                                        cache_rows=cache_rows))
    opt = offload.attach(torch.optim.Adam(model.parameters(), lr=0.01, fused=True))
    _train(model, opt, data[:6], prefetch=True)
    torch.cuda.synchronize()
    syncs = offload_syncs(lambda: _train(model, opt, data[6:], prefetch=True))  # 6 steps, 5 prefetches each
    # the first step's indices were not prefetched (a new list): its two lookups read back once each
    assert len(syncs) == 2 + 2 * 5, syncs
    if cache_rows < rows:  # (room for two steps' rows of the context table, not for all it sees: it evicted)
        assert model.out.cache_stats()["misses"] > cache_rows


def test_random_schedules_on_the_gpu_equal_sparse_adam():
    """The CPU test's random schedules of lookups and prefetches, on the GPU (side streams, UVA engine)."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("cupy")
    spec = importlib.util.spec_from_file_location("_offload_cpu_tests", Path(__file__).with_name("test_embedding.py"))
    cpu_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_tests)
    for seed in range(12):
        cpu_tests._random_schedule_matches_sparse_adam(seed, "cuda")
