"""OffloadedEmbedding against plain nn.Embedding + torch.optim (STYLE.md item 15).

References:
- full coverage (every row looked up every step): lazy and dense semantics coincide, so the reference is a
  dense ``nn.Embedding`` with the same torch optimizer, for every supported optimizer;
- partial coverage: ``nn.Embedding(sparse=True)`` + ``SparseAdam`` for Adam, dense ``nn.Embedding`` + plain
  SGD for SGD, and for the others a per-step reference that runs the same torch optimizer on a fresh
  parameter holding only the rows the step touches (the definition of lazy updates), with every untouched
  row checked to be bit-identical to before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.syncs import offload_syncs
from torch import nn

import offload

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
N, D, STEPS = 48, 6, 20

OPTIMIZERS = [
    ("sgd", torch.optim.SGD, {"lr": 0.1}),
    ("sgd-momentum-nesterov-wd", torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                                   "weight_decay": 0.01}),
    ("adam", torch.optim.Adam, {"lr": 0.01}),
    ("adam-amsgrad-wd", torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    ("adamw", torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    ("adamax", torch.optim.Adamax, {"lr": 0.01}),
    ("adadelta", torch.optim.Adadelta, {"lr": 0.5}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("rmsprop-centered-momentum", torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("asgd", torch.optim.ASGD, {"lr": 0.01, "t0": 5.0}),
    ("rprop", torch.optim.Rprop, {"lr": 0.01}),
    ("nadam", torch.optim.NAdam, {"lr": 0.01}),
    ("radam", torch.optim.RAdam, {"lr": 0.01}),
]
# Initial value of each per-row state tensor (as each torch optimizer initialises it), for the lazy reference.
FILLS = {
    "sgd": {}, "sgd-momentum-nesterov-wd": {"momentum_buffer": 0.0},
    "adam": {"exp_avg": 0.0, "exp_avg_sq": 0.0},
    "adam-amsgrad-wd": {"exp_avg": 0.0, "exp_avg_sq": 0.0, "max_exp_avg_sq": 0.0},
    "adamw": {"exp_avg": 0.0, "exp_avg_sq": 0.0}, "adamax": {"exp_avg": 0.0, "exp_inf": 0.0},
    "adadelta": {"square_avg": 0.0, "acc_delta": 0.0}, "adagrad": {"sum": 0.1},
    "rmsprop-centered-momentum": {"square_avg": 0.0, "momentum_buffer": 0.0, "grad_avg": 0.0},
    "asgd": {"ax": 0.0}, "rprop": {"prev": 0.0, "step_size": 0.01},
    "nadam": {"exp_avg": 0.0, "exp_avg_sq": 0.0}, "radam": {"exp_avg": 0.0, "exp_avg_sq": 0.0},
}


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - target).pow(2).sum() + out.tanh().sum()


def batches(steps: int, full: bool, device, seed: int = 0, n: int = N, dist: str = "uniform"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if full:
            idx = torch.cat([torch.randperm(n, generator=g), torch.randint(0, n, (n // 2,), generator=g)])
        elif dist == "uniform":
            idx = torch.randint(0, n - n // 6, (n // 4,), generator=g)  # the last rows are never touched
        else:  # heavy-tailed
            idx = (torch.empty(n // 2).exponential_(generator=g) * 3).long().clamp_(max=n - 1)
        idx = idx[torch.randperm(idx.numel(), generator=g)].view(-1, 2)
        target = torch.randn(*idx.shape, D, generator=g)
        out.append((idx.to(device), target.to(device)))
    return out


def init_weight(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed))


def scalar_state(state: dict, per_row) -> dict:
    return {k: v for k, v in state.items() if k not in per_row}


def assert_scalars_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(torch.as_tensor(a[k]).cpu().double(), torch.as_tensor(b[k]).cpu().double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,cls,kw", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_full_coverage_equals_dense_torch(device, name, cls, kw):
    w0 = init_weight()
    ref = nn.Embedding(N, D, _weight=w0.clone()).to(device)
    ref_opt = cls(ref.parameters(), **kw)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device)
    opt = offload.attach(cls(emb.parameters(), **kw))
    for idx, target in batches(STEPS, True, device):
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            loss_fn(m(idx), target).backward()
            o.step()
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu())
    ref_state = ref_opt.state[ref.weight]
    assert sorted(emb.state_tables) == sorted(FILLS[name])
    for k, t in emb.state_tables.items():
        torch.testing.assert_close(t.data, ref_state[k].cpu(), msg=f"state {k}")
    assert_scalars_equal(scalar_state(opt.state[emb.weight], emb.state_tables),
                         scalar_state(ref_state, emb.state_tables))


class LazyReference:
    """Per step: a fresh parameter of the touched rows, the same torch optimizer, state rows in and out."""

    def __init__(self, w0, cls, kw, fills, self_init):
        self.w = w0.clone()
        self.cls, self.kw, self.self_init = cls, kw, self_init
        self.rows = {k: torch.full_like(w0, v) for k, v in fills.items()}
        self.scalars = None

    def step(self, idx, target):
        rows, local = torch.unique(idx, return_inverse=True)
        p = nn.Parameter(self.w[rows].clone())
        opt = self.cls([p], **self.kw)
        if self.scalars is not None or not self.self_init:
            opt.state[p].clear()
            opt.state[p].update({**(self.scalars or {}), **{k: v[rows].clone() for k, v in self.rows.items()}})
        loss_fn(F.embedding(local, p), target).backward()
        opt.step()
        st = opt.state[p]
        for k in self.rows:
            self.rows[k][rows] = st[k]
        self.scalars = {k: v for k, v in st.items() if k not in self.rows}
        self.w[rows] = p.detach()


@pytest.mark.parametrize("name,cls,kw", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_partial_coverage_is_lazy(name, cls, kw):
    w0 = init_weight()
    data = batches(STEPS, False, "cpu", seed=3)
    ref = LazyReference(w0, cls, kw, FILLS[name], self_init=cls is not torch.optim.SGD)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone())
    opt = offload.attach(cls(emb.parameters(), **kw))
    touched = torch.zeros(N, dtype=torch.bool)
    for idx, target in data:
        ref.step(idx, target)
        opt.zero_grad()
        loss_fn(emb(idx), target).backward()
        opt.step()
        touched[idx.reshape(-1)] = True
    assert not touched.all(), "the test needs rows that no step touches"
    torch.testing.assert_close(emb.table.data, ref.w)
    assert torch.equal(emb.table.data[~touched], w0[~touched])
    for k, t in emb.state_tables.items():
        torch.testing.assert_close(t.data, ref.rows[k], msg=f"state {k}")
        assert torch.equal(t.data[~touched], torch.full_like(t.data[~touched], FILLS[name][k]))
    assert_scalars_equal(scalar_state(opt.state[emb.weight], emb.state_tables), ref.scalars)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_equals_sparse_embedding_with_sparse_adam(device):
    w0 = init_weight()
    ref = nn.Embedding(N, D, sparse=True, _weight=w0.clone()).to(device)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    for idx, target in batches(STEPS, False, device, seed=5):
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            loss_fn(m(idx), target).backward()
            o.step()
    # SparseAdam divides eps by sqrt(bias_correction2) where Adam does not: a relative difference of
    # about eps / sqrt(v) per step, far below these tolerances.
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu(), rtol=1e-4, atol=1e-5)
    st = ref_opt.state[ref.weight]
    torch.testing.assert_close(emb.state_tables["exp_avg"].data, st["exp_avg"].cpu())
    torch.testing.assert_close(emb.state_tables["exp_avg_sq"].data, st["exp_avg_sq"].cpu())
    assert int(opt.state[emb.weight]["step"]) == int(st["step"]) == STEPS


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_equals_dense_embedding_with_sgd(device):
    w0 = init_weight()
    ref = nn.Embedding(N, D, _weight=w0.clone()).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device)
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    for idx, target in batches(STEPS, False, device, seed=6):
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            loss_fn(m(idx), target).backward()
            o.step()
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu())
    assert opt.state[emb.weight] == {} and ref_opt.state[ref.weight] == {}


def _train(emb, opt, data, prefetch=False):
    for i, (idx, target) in enumerate(data):
        opt.zero_grad()
        out = emb(idx)
        if prefetch and i + 1 < len(data):
            emb.prefetch(data[i + 1][0])
        loss_fn(out, target).backward()
        opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache", [{"cache_rows": 10}, {"cache_rows": 100}, {"cache_bytes": 12 * D * 4 * 3}])
@pytest.mark.parametrize("prefetch", [False, True])
def test_cache_and_prefetch_change_nothing(device, cache, prefetch):
    w0 = init_weight()
    data = batches(STEPS, False, device, seed=7, dist="heavy")
    plain = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device)
    popt = offload.attach(torch.optim.Adam(plain.parameters(), lr=0.01))
    _train(plain, popt, data)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device, **cache)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    _train(emb, opt, data, prefetch=prefetch)
    stats = emb.cache_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0
    # the host is behind until the cache is flushed; lookups see the newest rows either way
    with torch.no_grad():
        ids = torch.arange(N, device=device)
        torch.testing.assert_close(emb(ids).cpu(), plain.table.data, rtol=0, atol=0)
    emb.flush()
    assert torch.equal(emb.table.data, plain.table.data)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(emb.state_tables[k].data, plain.state_tables[k].data)


def test_prefetch_is_patched_by_write_back():
    """A prefetch issued before the step that updates some of its rows returns the updated rows."""
    w0 = init_weight()
    data = batches(4, False, "cpu", seed=8)
    ref = offload.OffloadedEmbedding(N, D, _weight=w0.clone())
    ropt = offload.attach(torch.optim.SGD(ref.parameters(), lr=0.5))
    _train(ref, ropt, data)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone())
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.5))
    for i, (idx, target) in enumerate(data):
        opt.zero_grad()
        out = emb(idx)
        if i + 1 < len(data):
            nxt = torch.cat([data[i + 1][0].reshape(-1), idx.reshape(-1)])  # overlaps this step's rows
            emb.prefetch(nxt)
        loss_fn(out, target).backward()
        opt.step()
    assert torch.equal(emb.table.data, ref.table.data)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("cache_rows", [4, 9, 30])
def test_small_cache_two_lookups_and_prefetch_equal_sparse_adam(device, prefetch, cache_rows):
    """A cache smaller than a step's rows (rows bypass it; the least recently used are evicted and written
    back), two lookups with different rows per step, and a prefetch that names rows of the step in progress
    and rows its second lookup will fetch: all the same as nn.Embedding(sparse=True) + SparseAdam."""
    w0 = init_weight()
    ref = nn.Embedding(N, D, sparse=True, _weight=w0.clone()).to(device)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device, cache_rows=cache_rows)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    data = batches(2 * STEPS, False, device, seed=21, dist="heavy")
    pairs = list(zip(data[0::2], data[1::2], strict=True))
    for i, ((a, ta), (b, tb)) in enumerate(pairs):
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            loss = loss_fn(m(a), ta)
            if prefetch and m is emb and i + 1 < len(pairs):
                nxt = pairs[i + 1][0][0].reshape(-1)
                last = torch.tensor([N - 1], device=device)
                emb.prefetch(torch.cat([nxt, a.reshape(-1)[:3], b.reshape(-1)[-3:], last]))
            (loss + loss_fn(m(b), tb)).backward()
            o.step()
    stats = emb.cache_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0
    # SparseAdam divides eps by sqrt(bias_correction2) where Adam does not (see above)
    with torch.no_grad():  # cached rows are newer than the host's: lookups see them
        torch.testing.assert_close(emb(torch.arange(N, device=device)), ref.weight.detach(), rtol=1e-4, atol=1e-5)
    emb.flush()
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu(), rtol=1e-4, atol=1e-5)
    st = ref_opt.state[ref.weight]
    torch.testing.assert_close(emb.state_tables["exp_avg"].data, st["exp_avg"].cpu())
    torch.testing.assert_close(emb.state_tables["exp_avg_sq"].data, st["exp_avg_sq"].cpu())


def test_least_recently_used_rows_are_evicted_and_written_back():
    """A 3-row cache: rows reach the host table when they are evicted (least recently used first) or flushed."""
    w0 = init_weight()
    ref = nn.Embedding(N, D, _weight=w0.clone())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), cache_rows=3)
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.5))
    g = torch.Generator().manual_seed(22)
    for ids in ([0, 1], [2], [0, 3]):  # the third step needs a slot: row 1 (last used in step 1) goes
        idx = torch.tensor(ids)
        target = torch.randn(len(ids), D, generator=g)
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            loss_fn(m(idx), target).backward()
            o.step()
    host = emb.table.data
    assert torch.equal(host[1], ref.weight.detach()[1]) and not torch.equal(host[1], w0[1])
    for row in (0, 2, 3):
        assert torch.equal(host[row], w0[row]), row  # still only in the cache
    assert emb.cache_stats() == {"capacity": 3, "hits": 1, "misses": 4}
    emb.flush()
    assert torch.equal(emb.table.data, ref.weight.detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [False, True])
def test_cache_stats_count_each_distinct_row_once(device, prefetch):
    """With room for every row, each row misses once (at its first switch-in, or earlier when prefetched)
    and hits at every later step: hits + misses is the sum over steps of the distinct rows looked up."""
    data = batches(STEPS, False, device, seed=23, dist="heavy")
    emb = offload.OffloadedEmbedding(N, D, device=device, cache_rows=N)
    opt = offload.attach(torch.optim.Adagrad(emb.parameters(), lr=0.1))
    _train(emb, opt, data, prefetch=prefetch)
    per_step = [idx.unique().numel() for idx, _ in data]
    seen = torch.cat([idx.reshape(-1) for idx, _ in data]).unique().numel()
    stats = emb.cache_stats()
    assert stats["misses"] == seen
    assert stats["hits"] + stats["misses"] == sum(per_step)
    if prefetch:  # one prefetch per step: its admissions were counted on the host, nothing on the device
        assert emb._cache.slots.prefetch_hits > 0 and emb._cache.slots.prefetch_hits_dev is None


def test_out_of_range_with_a_cache_raises_before_any_host_access(monkeypatch):
    w0 = init_weight()
    ref = nn.Embedding(N, D, _weight=w0.clone())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), cache_rows=8)
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    data = batches(3, False, "cpu", seed=24)

    def step(m, o, idx, target):
        o.zero_grad()
        loss_fn(m(idx), target).backward()
        o.step()

    for m, o in ((ref, ref_opt), (emb, opt)):
        step(m, o, *data[0])
    real = emb.table._gather_unique

    def no_host_access(*args, **kwargs):
        raise AssertionError("a host row was read")

    monkeypatch.setattr(emb.table, "_gather_unique", no_host_access)
    with pytest.raises(IndexError, match=f"index {N} is out of range for a table of {N} rows"):
        emb(torch.tensor([[1, N], [2, 3]]))
    with pytest.raises(IndexError, match=f"index -2 is out of range for a table of {N} rows"):
        emb.prefetch(torch.tensor([5, -2]))
    monkeypatch.setattr(emb.table, "_gather_unique", real)
    for idx, target in data[1:]:  # nothing was left half done
        for m, o in ((ref, ref_opt), (emb, opt)):
            step(m, o, idx, target)
    emb.flush()
    torch.testing.assert_close(emb.table.data, ref.weight.detach())


@pytest.mark.parametrize("cache_rows", [0, 6, N])
def test_switch_in_reuses_the_prefetched_deduplication_unless_the_indices_changed(monkeypatch, cache_rows):
    """A switch-in of the index tensor that prefetch saw does not deduplicate it again; an index tensor
    changed in place after the prefetch is deduplicated afresh (the reference is SparseAdam on the indices
    actually looked up)."""
    w0 = init_weight()
    ref = nn.Embedding(N, D, sparse=True, _weight=w0.clone())
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), cache_rows=cache_rows)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    from offload import _lookup

    calls = []
    real = _lookup.distinct

    def counting(module, *args, **kwargs):
        calls.append(1)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(_lookup, "distinct", counting)
    data = batches(STEPS, False, "cpu", seed=26, dist="heavy")
    idx = data[0][0].clone()
    for i, (_, target) in enumerate(data):
        changed = i % 4 == 3
        if changed:  # the buffer is overwritten after its prefetch: the prefetched rows are not these
            idx.copy_(data[i][0])
        ref_opt.zero_grad()
        loss_fn(ref(idx), target).backward()
        ref_opt.step()
        opt.zero_grad()
        out = emb(idx)
        if i + 1 < len(data):
            idx = data[i + 1][0].clone() if i % 4 != 2 else (idx * 0 + data[i + 1][0].flip(0))
            emb.prefetch(idx)
        loss_fn(out, target).backward()
        opt.step()
    n_changed = sum(1 for i in range(STEPS) if i % 4 == 3)
    assert len(calls) == 1 + (STEPS - 1) + n_changed  # first step, every prefetch, each changed buffer
    emb.flush()
    torch.testing.assert_close(emb.table.data, ref.weight.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(emb.state_tables["exp_avg_sq"].data, ref_opt.state[ref.weight]["exp_avg_sq"])


@pytest.mark.cuda
@pytest.mark.parametrize("cache_rows", [2048, 20_000])
def test_a_cached_step_synchronises_with_the_host_at_most_once_per_lookup_and_prefetch(cache_rows):
    """Deduplication, bounds check and the cache's miss count share one read-back; cache lookups, admission,
    eviction and write-back need none, and a step whose indices were prefetched into a cache that holds
    them all needs none at all (torch's sync debug mode counts the synchronisations)."""
    pytest.importorskip("cupy")
    g = torch.Generator().manual_seed(25)
    n, d = 20_000, 16
    data = [((torch.empty(4096).exponential_(generator=g) * 2000).long().clamp_(max=n - 1).cuda(),
             torch.randn(4096, d, generator=g).cuda()) for _ in range(12)]
    emb = offload.OffloadedEmbedding(n, d, device="cuda", engine="uva", cache_rows=cache_rows)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    _train(emb, opt, data[:6], prefetch=True)
    torch.cuda.synchronize()
    ours = offload_syncs(lambda: _train(emb, opt, data[6:], prefetch=True))  # 6 steps, 5 prefetches
    if cache_rows == n:
        assert len(ours) == 1 + 5, ours  # the first step (not prefetched) and the prefetches
    else:
        assert len(ours) <= 6 + 5, ours
    stats = emb.cache_stats()
    assert stats["misses"] > 0 and stats["hits"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_several_lookups_per_step(device):
    """Two lookups with different rows in one step (skip-gram's positives and negatives) == dense SGD,
    and gradient accumulation over two backward passes with different rows."""
    w0 = init_weight()
    ref = nn.Embedding(N, D, _weight=w0.clone()).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device)
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    data = batches(2 * 6, False, device, seed=9)
    for (a, ta), (b, tb) in zip(data[0::2], data[1::2], strict=True):
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            (loss_fn(m(a), ta) + loss_fn(m(b), tb)).backward()
            o.step()
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            loss_fn(m(b), tb).backward()
            loss_fn(m(a), ta).backward()
            o.step()
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu())


def test_prepare_then_several_lookups_match_adam():
    w0 = init_weight()
    data = batches(10, False, "cpu", seed=10)
    one = offload.OffloadedEmbedding(N, D, _weight=w0.clone())
    o1 = offload.attach(torch.optim.Adam(one.parameters(), lr=0.01))
    two = offload.OffloadedEmbedding(N, D, _weight=w0.clone())
    o2 = offload.attach(torch.optim.Adam(two.parameters(), lr=0.01))
    for idx, target in data:
        o1.zero_grad()
        loss_fn(one(idx), target).backward()
        o1.step()
        o2.zero_grad()
        two.prepare(idx)
        assert two.weight.shape[0] == idx.unique().numel()
        loss_fn(two(idx[:1]), target[:1]).add(loss_fn(two(idx[1:]), target[1:])).backward()
        o2.step()
    torch.testing.assert_close(two.table.data, one.table.data)


def test_padding_idx_and_max_norm_match_nn_embedding():
    w0 = init_weight() * 3
    ref = nn.Embedding(N, D, padding_idx=2, max_norm=2.0, _weight=w0.clone())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    emb = offload.OffloadedEmbedding(N, D, padding_idx=2, max_norm=2.0, _weight=w0.clone())
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    for idx, target in batches(8, False, "cpu", seed=11):
        idx = torch.cat([idx, torch.full((1, 2), 2)])
        target = torch.cat([target, torch.randn(1, 2, D)])
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            loss_fn(m(idx), target).backward()
            o.step()
    torch.testing.assert_close(emb.table.data, ref.weight.detach())
    with torch.no_grad():  # eval lookups renormalise in place too
        ids = torch.arange(N)
        torch.testing.assert_close(emb(ids), ref(ids))
    torch.testing.assert_close(emb.table.data, ref.weight.detach())


def test_state_dict_is_the_full_table_and_loads_into_nn_embedding():
    emb = offload.OffloadedEmbedding(N, D)
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    idx, target = batches(1, False, "cpu")[0]
    loss_fn(emb(idx), target).backward()
    opt.step()
    ref = nn.Embedding(N, D)
    ref.load_state_dict(emb.state_dict())
    assert torch.equal(ref.weight.detach(), emb.table.data)
    other = offload.OffloadedEmbedding(N, D)
    other.load_state_dict(ref.state_dict())
    assert torch.equal(other.table.data, ref.weight.detach())
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict({"weight": torch.zeros(N + 1, D)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_rows", [0, 8])
@pytest.mark.parametrize("mmap_mode", ["c", None])
def test_save_and_resume_is_exact(tmp_path, device, cache_rows, mmap_mode):
    w0 = init_weight()
    data = batches(20, False, device, seed=12, dist="heavy")
    full = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device, cache_rows=cache_rows)
    fopt = offload.attach(torch.optim.ASGD(full.parameters(), lr=0.01, t0=3))
    _train(full, fopt, data)
    full.flush()

    first = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device, cache_rows=cache_rows)
    o1 = offload.attach(torch.optim.ASGD(first.parameters(), lr=0.01, t0=3))
    _train(first, o1, data[:10])
    first.save(tmp_path / "ckpt")
    snapshot = (tmp_path / "ckpt" / "weight.npy").read_bytes()
    _train(first, o1, data[10:12])  # training on after the save does not touch the checkpoint
    assert (tmp_path / "ckpt" / "weight.npy").read_bytes() == snapshot

    resumed = offload.OffloadedEmbedding.from_checkpoint(tmp_path / "ckpt", device=device, cache_rows=cache_rows,
                                                         mmap_mode=mmap_mode)
    o2 = offload.attach(torch.optim.ASGD(resumed.parameters(), lr=0.01, t0=3))
    _train(resumed, o2, data[10:])
    resumed.flush()
    assert torch.equal(resumed.table.data, full.table.data)
    assert torch.equal(resumed.state_tables["ax"].data, full.state_tables["ax"].data)
    assert_scalars_equal(scalar_state(o2.state[resumed.weight], ["ax"]), scalar_state(fopt.state[full.weight], ["ax"]))
    if mmap_mode == "c":
        assert (tmp_path / "ckpt" / "weight.npy").read_bytes() == snapshot  # copy-on-write


def test_resume_with_another_optimizer_is_refused(tmp_path):
    emb = offload.OffloadedEmbedding(N, D)
    opt = offload.attach(torch.optim.Adam(emb.parameters()))
    _train(emb, opt, batches(2, False, "cpu"))
    emb.save(tmp_path / "c")
    again = offload.OffloadedEmbedding.from_checkpoint(tmp_path / "c")
    with pytest.raises(ValueError, match="holds state of Adam"):
        offload.attach(torch.optim.Adagrad(again.parameters()))


def test_refuses_non_elementwise_and_unknown_optimizers():
    emb = offload.OffloadedEmbedding(N, D)
    with pytest.raises(TypeError, match="LBFGS cannot train an OffloadedEmbedding: it is not elementwise"):
        offload.attach(torch.optim.LBFGS(emb.parameters()))
    with pytest.raises(TypeError, match="SparseAdam needs sparse gradients"):
        offload.attach(torch.optim.SparseAdam(emb.parameters()))

    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    with pytest.raises(TypeError, match="Mine is not known to offload"):
        offload.attach(Mine(emb.parameters()))
    with pytest.raises(ValueError, match="not among the optimizer's parameters"):
        offload.attach(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1), emb)


def test_unattached_optimizer_is_detected():
    emb = offload.OffloadedEmbedding(N, D)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)  # no attach: the step would be lost
    idx, target = batches(1, False, "cpu")[0]
    loss_fn(emb(idx), target).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"call offload\.attach"):
        emb(idx)


def test_out_of_range_and_bad_indices():
    emb = offload.OffloadedEmbedding(N, D)
    offload.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    with pytest.raises(IndexError, match=f"index {N} is out of range for a table of {N} rows"):
        emb(torch.tensor([0, N]))
    with pytest.raises(IndexError, match=f"index -1 is out of range for a table of {N} rows"):
        emb(torch.tensor([[-1, 3]]))
    with torch.no_grad(), pytest.raises(IndexError, match="index 1000 is out of range"):
        emb(torch.tensor([1000]))
    with pytest.raises(TypeError, match="int32 or int64 indices"):
        emb(torch.tensor([1.0]))


class _Fault(RuntimeError):
    pass


@pytest.mark.parametrize("cache_rows", [0, 4])
def test_failed_write_back_leaves_host_rows_whole(monkeypatch, cache_rows):
    """A fault while committing a step's rows (after the weight's rows were staged, before the optimizer
    state's) leaves the weight and every state table exactly as before; a retry commits all of them."""
    from offload import _host_write

    w0 = init_weight()
    data = batches(3, False, "cpu", seed=13)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), cache_rows=cache_rows)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.1))
    _train(emb, opt, data[:2])
    emb.flush()
    before = {k: t.data.clone() for k, t in emb.state_tables.items()}
    before["weight"] = emb.table.data.clone()

    real = _host_write.stage_rows
    calls = []

    def faulty(rows):
        calls.append(1)
        if len(calls) == 2:
            raise _Fault("injected fault while staging the second table")
        return real(rows)

    idx, target = data[2]
    opt.zero_grad()
    loss_fn(emb(idx), target).backward()
    monkeypatch.setattr(_host_write, "stage_rows", faulty)
    with pytest.raises(_Fault):
        opt.step()
        emb.flush()  # with a cache, rows reach the host at flush (or eviction)
    assert torch.equal(emb.table.data, before["weight"])
    for k, t in emb.state_tables.items():
        assert torch.equal(t.data, before[k]), k
    monkeypatch.setattr(_host_write, "stage_rows", real)
    if cache_rows:
        emb.flush()  # the dirty rows are still in the cache: the retry writes all tables
        changed = ~torch.isclose(emb.table.data, before["weight"]).all(dim=1)
        assert changed.any()
        for k, t in emb.state_tables.items():
            assert torch.equal(~torch.isclose(t.data, before[k]).all(dim=1) | changed, changed), k


def test_crash_between_step_and_write_back_leaves_host_untouched():
    """When the step does not complete (a post-step hook registered before attach raises), nothing of the
    step reaches the host, and training continues afterwards."""
    w0 = init_weight()
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone())
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    boom = {"on": True}

    def hook(o, args, kwargs):
        if boom["on"]:
            raise _Fault("crash after step")

    opt.register_step_post_hook(hook)
    offload.attach(opt)
    idx, target = batches(1, False, "cpu")[0]
    loss_fn(emb(idx), target).backward()
    with pytest.raises(_Fault):
        opt.step()
    assert torch.equal(emb.table.data, w0)
    for t in emb.state_tables.values():
        assert torch.equal(t.data, torch.zeros_like(t.data))
    boom["on"] = False
    opt.zero_grad()
    emb.prepare(idx)  # abandons the interrupted step
    loss_fn(emb(idx), target).backward()
    opt.step()
    assert not torch.equal(emb.table.data, w0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("cache_rows", [0, 9])
def test_fused_and_foreach_adam_equal_sparse_adam(device, impl, cache_rows):
    """torch's fused (one kernel) and foreach Adam train the working rows like the default one: the same
    as nn.Embedding(sparse=True) + SparseAdam, with and without a cache that evicts, with prefetch."""
    w0 = init_weight()
    ref = nn.Embedding(N, D, sparse=True, _weight=w0.clone()).to(device)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device, cache_rows=cache_rows)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01, **{impl: True}))
    data = batches(STEPS, False, device, seed=31, dist="heavy")
    for idx, target in data:
        ref_opt.zero_grad()
        loss_fn(ref(idx), target).backward()
        ref_opt.step()
    _train(emb, opt, data, prefetch=True)
    emb.flush()
    # (SparseAdam puts eps inside the bias correction: weights, and so gradients and moments, drift apart by a
    # few 1e-5; CUDA's fused kernel rounds differently again)
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu(), rtol=1e-4, atol=1e-5)
    st = ref_opt.state[ref.weight]
    torch.testing.assert_close(emb.state_tables["exp_avg"].data, st["exp_avg"].cpu(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(emb.state_tables["exp_avg_sq"].data, st["exp_avg_sq"].cpu(), rtol=1e-4, atol=1e-5)
    assert int(opt.state[emb.weight]["step"]) == STEPS


def test_evicted_rows_are_written_back_in_ascending_row_order(monkeypatch):
    """Host rows written in address order are what makes write-backs fast: every eviction at least
    ``_SORTED_WRITE_BACK_ROWS`` large (here: every one) reaches the host tables sorted by row (and training
    still equals dense Adagrad, whose update of a row without gradient is the identity)."""
    from offload import _gpu_cache, _host_write

    monkeypatch.setattr(_gpu_cache, "_SORTED_WRITE_BACK_ROWS", 1)
    written = []
    real = _host_write.commit

    def recording(ids, writes, engines=None):
        written.append(ids.cpu().clone())
        return real(ids, writes, engines)

    monkeypatch.setattr(_host_write, "commit", recording)
    w0 = init_weight()
    ref = nn.Embedding(N, D, _weight=w0.clone())
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), cache_rows=12)
    opt = offload.attach(torch.optim.Adagrad(emb.parameters(), lr=0.1))
    data = batches(STEPS, False, "cpu", seed=32)  # uniform rows: a 12-row cache evicts at every step
    for idx, target in data:
        ref_opt.zero_grad()
        loss_fn(ref(idx), target).backward()
        ref_opt.step()
    _train(emb, opt, data, prefetch=True)
    evictions = [ids for ids in written if ids.numel() > 1]
    assert len(evictions) >= STEPS // 2
    for ids in evictions:
        assert torch.equal(ids, ids.sort().values) and ids.unique().numel() == ids.numel()
    emb.flush()
    torch.testing.assert_close(emb.table.data, ref.weight.detach())
    torch.testing.assert_close(emb.state_tables["sum"].data, ref_opt.state[ref.weight]["sum"])


@pytest.mark.parametrize("device", DEVICES)
def test_cache_stats_with_two_prefetches_per_step(device):
    """Prefetching the next step's rows twice (two tensors, the same indices): the first admits them, the
    second finds them cached, and the step's hits on them are still not counted again (each row misses once,
    hits at every later step); training equals SparseAdam."""
    w0 = init_weight()
    data = batches(STEPS, False, device, seed=33, dist="heavy")
    ref = nn.Embedding(N, D, sparse=True, _weight=w0.clone()).to(device)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    emb = offload.OffloadedEmbedding(N, D, _weight=w0.clone(), device=device, cache_rows=N)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    for i, (idx, target) in enumerate(data):
        ref_opt.zero_grad()
        loss_fn(ref(idx), target).backward()
        ref_opt.step()
        opt.zero_grad()
        out = emb(idx)
        if i + 1 < len(data):
            emb.prefetch(data[i + 1][0].clone())
            emb.prefetch(data[i + 1][0])
        loss_fn(out, target).backward()
        opt.step()
    per_step = [idx.unique().numel() for idx, _ in data]
    seen = torch.cat([idx.reshape(-1) for idx, _ in data]).unique().numel()
    stats = emb.cache_stats()
    assert stats["misses"] == seen
    assert stats["hits"] + stats["misses"] == sum(per_step)
    emb.flush()
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu(), rtol=1e-4, atol=1e-5)


def _random_schedule_matches_sparse_adam(seed: int, device) -> None:
    """One random schedule: cache size, per step a lookup (sometimes after ``prepare`` of the step's rows),
    maybe a second lookup with other rows, a prefetch of the next step's indices (once, twice, of half of them
    plus rows of this step, or none), no-grad lookups of the whole table in the middle of a step and after it
    (checked against the reference), and flushes."""
    import random

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = 300
    w0 = torch.randn(n, D, generator=g)
    ref = nn.Embedding(n, D, sparse=True, _weight=w0.clone()).to(device)
    # (eps far below the gradients: SparseAdam and Adam place it differently)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-12)
    emb = offload.OffloadedEmbedding(n, D, _weight=w0.clone(), device=device,
                                     cache_rows=rnd.choice([5, 20, 40, 80, 150, 299]))
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01, eps=1e-12))

    def draw():
        idx = torch.empty(rnd.randint(5, 60)).exponential_(generator=g) * rnd.choice([10, 40, 100])
        return idx.long().clamp_(max=n - 1).to(device)

    steps = [(draw(), draw() if rnd.random() < 0.3 else None) for _ in range(25)]
    for i, (a, b) in enumerate(steps):
        ta = torch.randn(a.numel(), D, generator=g).to(device)
        tb = torch.randn(b.numel(), D, generator=g).to(device) if b is not None else None
        for m, o in ((ref, ref_opt), (emb, opt)):
            o.zero_grad()
            if m is emb and rnd.random() < 0.15:
                emb.prepare(a if b is None else torch.cat([a, b]))
            loss = loss_fn(m(a), ta)
            if m is emb and i + 1 < len(steps):
                nxt, mode = steps[i + 1][0], rnd.choice("sdpn")
                if mode == "s":
                    emb.prefetch(nxt)
                elif mode == "d":
                    emb.prefetch(nxt.clone())
                    emb.prefetch(nxt)
                elif mode == "p":
                    emb.prefetch(torch.cat([nxt[: nxt.numel() // 2], a[:3]]))
            if m is emb and rnd.random() < 0.1:  # a read in the middle of a step must not disturb it
                with torch.no_grad():
                    emb(torch.arange(n, device=device))
            if b is not None:
                loss = loss + loss_fn(m(b), tb)
            loss.backward()
            o.step()
        r = rnd.random()
        if r < 0.1:
            emb.flush()
        elif r < 0.2:
            with torch.no_grad():
                torch.testing.assert_close(emb(torch.arange(n, device=device)), ref.weight.detach(), rtol=1e-4,
                                           atol=1e-5)
    emb.flush()
    torch.testing.assert_close(emb.table.data, ref.weight.detach().cpu(), rtol=1e-4, atol=1e-5)
    st = ref_opt.state[ref.weight]
    torch.testing.assert_close(emb.state_tables["exp_avg"].data, st["exp_avg"].cpu(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(emb.state_tables["exp_avg_sq"].data, st["exp_avg_sq"].cpu(), rtol=1e-4, atol=1e-7)


def test_random_schedules_of_lookups_and_prefetches_equal_sparse_adam():
    """Caches from 5 rows to all, second lookups after the prefetch (whose misses must not evict the rows
    the prefetch reserved for the next step, nor this step's rows), repeated and partial prefetches: 40
    random schedules, each the same as nn.Embedding(sparse=True) + SparseAdam."""
    for seed in range(40):
        _random_schedule_matches_sparse_adam(seed, "cpu")


def test_cache_kernel_switch_restores_the_old_setting():
    before = offload.get_cache_kernels()
    with offload.use_cache_kernels(not before):
        assert offload.get_cache_kernels() is (not before)
        with offload.use_cache_kernels(before):
            assert offload.get_cache_kernels() is before
        assert offload.get_cache_kernels() is (not before)
    assert offload.get_cache_kernels() is before
