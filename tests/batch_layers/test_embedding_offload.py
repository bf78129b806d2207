"""batch_layers.Embedding(..., offload=True) against B independently held plain nn.Embedding + torch.optim.

References (as in tests/offload/test_embedding.py, per model):
- full coverage (every model looks up every one of its rows every step): lazy and dense semantics coincide,
  so each model's reference is a dense ``nn.Embedding`` with the same torch optimizer, for every optimizer;
- partial coverage: dense ``nn.Embedding`` + SGD or Adagrad (whose update of a row without gradient is the
  identity), ``nn.Embedding(sparse=True)`` + ``SparseAdam`` for Adam; rows no step touches are checked to be
  bit-identical to their start.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batch_layers
import offload
from batch_layers import Embedding
from batch_layers._base import ForwardContext, forward_context
from batch_layers._embedding_offload import OffloadedBatchEmbedding, offload_embeddings

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
B, N, D, STEPS = 3, 12, 5, 15

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


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - target).pow(2).sum() + out.tanh().sum()


def data(steps: int, full: bool, seed: int = 0, n: int = 4, extra: int | None = None):
    """Per step: ``(B, n, L)`` local indices (each model its own) and ``(B, n, L, D)`` targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_model = []
        for _ in range(B):
            if full:
                idx = torch.cat([torch.randperm(N, generator=g), torch.randint(0, N, (N,), generator=g)])
            else:
                idx = torch.randint(0, N - 3, (2 * n,), generator=g)  # the last 3 rows are never touched
            if extra is not None:
                idx[: 2] = extra
            per_model.append(idx[torch.randperm(idx.numel(), generator=g)])
        idx = torch.stack(per_model).view(B, -1, 2)
        out.append((idx, torch.randn(*idx.shape, D, generator=g)))
    return out


def init_tables(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, N, D, generator=torch.Generator().manual_seed(seed))


def train_reference(w0, cls, kw, steps, sparse=False, device="cpu", **emb_kw):
    refs = [nn.Embedding(N, D, sparse=sparse, _weight=w0[b].clone().to(device), **emb_kw) for b in range(B)]
    opts = [cls(r.parameters(), **kw) for r in refs]
    for idx, target in steps:
        for b in range(B):
            opts[b].zero_grad()
            loss_fn(refs[b](idx[b].to(device)), target[b].to(device)).backward()
            opts[b].step()
    return refs, opts


def train_offloaded(emb, opt, steps, device="cpu"):
    for idx, target in steps:
        opt.zero_grad()
        out = emb(idx.reshape(B * idx.shape[1], -1).to(device))
        loss_fn(out, target.reshape(*out.shape).to(device)).backward()  # a sum of B independent losses
        opt.step()


def state_of(emb, key: str) -> torch.Tensor:
    return emb.state_tables[key].data.view(B, N, D)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,cls,kw", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_full_coverage_equals_b_dense_torch_models(device, name, cls, kw):
    w0 = init_tables()
    steps = data(STEPS, True)
    refs, ref_opts = train_reference(w0, cls, kw, steps)
    emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone(), device=device)
    opt = offload.attach(cls(emb.parameters(), **kw))
    train_offloaded(emb, opt, steps, device)
    for b in range(B):
        torch.testing.assert_close(emb.table_of(b), refs[b].weight.detach(), msg=lambda m, b=b: f"model {b}: {m}")
        ref_state = ref_opts[b].state[refs[b].weight]
        for k in emb.state_tables:
            torch.testing.assert_close(state_of(emb, k)[b], ref_state[k], msg=f"model {b} state {k}")
        for k, v in opt.state[emb.weight].items():  # scalar state (step, eta, mu, ...) advanced like each model's
            assert k not in emb.state_tables
            torch.testing.assert_close(torch.as_tensor(v).cpu().double(), torch.as_tensor(ref_state[k]).double())
    assert sorted(emb.state_tables) == sorted(k for k, v in ref_opts[0].state[refs[0].weight].items()
                                              if isinstance(v, torch.Tensor) and v.shape == (N, D))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,cls,kw,emb_kw", [
    ("sgd", torch.optim.SGD, {"lr": 0.1}, {}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1}, {}),
    ("sgd-padding-freq", torch.optim.SGD, {"lr": 0.1}, {"padding_idx": 2, "scale_grad_by_freq": True}),
    ("sgd-max-norm", torch.optim.SGD, {"lr": 0.1}, {"max_norm": 1.0, "norm_type": 1.5}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_partial_coverage_equals_b_dense_torch_models(device, name, cls, kw, emb_kw):
    w0 = init_tables() * 2
    steps = data(STEPS, False, seed=2, extra=2 if "padding_idx" in emb_kw else None)
    if "padding_idx" in emb_kw:
        w0[:, 2] = 0
    # The reference runs on the layer's device: torch's own max_norm renorm differs between CPU and CUDA
    # (on CUDA, with norm_type 1.5, plain nn.Embedding leaves some looked-up rows above max_norm).
    refs, ref_opts = train_reference(w0, cls, kw, steps, device=device, **emb_kw)
    emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone(), device=device, **emb_kw)
    opt = offload.attach(cls(emb.parameters(), **kw))
    train_offloaded(emb, opt, steps, device)
    for b in range(B):
        touched = torch.zeros(N, dtype=torch.bool)
        for idx, _ in steps:
            touched[idx[b].reshape(-1)] = True
        assert not touched.all()
        expected = refs[b].weight.detach().cpu()
        torch.testing.assert_close(emb.table_of(b), expected, msg=lambda m, b=b: f"model {b}: {m}")
        assert torch.equal(emb.table_of(b)[~touched], w0[b][~touched])
        for k in emb.state_tables:
            torch.testing.assert_close(state_of(emb, k)[b], ref_opts[b].state[refs[b].weight][k].cpu())
    if "padding_idx" in emb_kw:
        assert torch.equal(emb.table.data.view(B, N, D)[:, 2], torch.zeros(B, D))


@pytest.mark.parametrize("device", DEVICES)
def test_adam_equals_b_sparse_embeddings_with_sparse_adam(device):
    w0 = init_tables()
    steps = data(STEPS, False, seed=3)
    refs, ref_opts = train_reference(w0, torch.optim.SparseAdam, {"lr": 0.01}, steps, sparse=True)
    emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone(), device=device)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    train_offloaded(emb, opt, steps, device)
    for b in range(B):
        # SparseAdam divides eps by sqrt(bias_correction2) where Adam does not (tests/offload has the numbers)
        torch.testing.assert_close(emb.table_of(b), refs[b].weight.detach(), rtol=1e-4, atol=1e-5)
        st = ref_opts[b].state[refs[b].weight]
        torch.testing.assert_close(state_of(emb, "exp_avg")[b], st["exp_avg"])
        torch.testing.assert_close(state_of(emb, "exp_avg_sq")[b], st["exp_avg_sq"])
        assert int(st["step"]) == STEPS
    assert int(opt.state[emb.weight]["step"]) == STEPS


def test_models_are_isolated_bit_for_bit():
    """Changing model 0's indices and making its loss NaN leaves the other models' tables and Adam state
    bit-identical, although their rows share the working parameter with model 0's."""
    w0 = init_tables()
    steps = data(STEPS, False, seed=4)
    changed = []
    for i, (idx, target) in enumerate(steps):
        idx, target = idx.clone(), target.clone()
        idx[0] = torch.randint(0, N, idx[0].shape, generator=torch.Generator().manual_seed(i))
        target[0, 0, 0, 0] = float("nan")
        changed.append((idx, target))
    runs = []
    for stream in (steps, changed):
        emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone())
        opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01, weight_decay=0.1))
        train_offloaded(emb, opt, stream)
        runs.append(emb)
    assert bool(runs[1].table_of(0).isnan().any())
    for b in range(1, B):
        assert torch.equal(runs[0].table_of(b), runs[1].table_of(b))
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state_of(runs[0], k)[b], state_of(runs[1], k)[b])


def test_working_ids_name_each_rows_model_and_only_its_rows_get_gradient():
    emb = Embedding(N, D, batch=B, offload=True)
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    idx = torch.tensor([[0, 5], [5, 11], [7, 7]])  # model 0: rows 0, 5; model 1: 5, 11; model 2: 7
    out = emb(idx)
    assert torch.equal(emb.working_ids, torch.tensor([0, 5, 12 + 5, 12 + 11, 24 + 7]))
    assert torch.equal(emb.working_ids // N, torch.tensor([0, 0, 1, 1, 2]))
    out[1].sum().backward()  # model 1's output only
    assert torch.equal(emb.weight.grad.abs().sum(1) != 0, torch.tensor([False, False, True, True, False]))
    opt.step()
    assert emb.working_ids is None and emb.weight.shape == (0, D)


@pytest.mark.parametrize("cache", [{"cache_rows": 8}, {"cache_bytes": 10 * D * 4 * 3}])
def test_cache_and_prefetch_change_nothing(cache):
    w0 = init_tables()
    steps = data(STEPS, False, seed=5)
    plain = Embedding(N, D, batch=B, offload=True, _weight=w0.clone())
    train_offloaded(plain, offload.attach(torch.optim.Adam(plain.parameters(), lr=0.01)), steps)
    emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone(), **cache)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
    for i, (idx, target) in enumerate(steps):
        opt.zero_grad()
        out = emb(idx.reshape(B * idx.shape[1], -1))
        if i + 1 < len(steps):
            emb.prefetch(steps[i + 1][0].reshape(B * idx.shape[1], -1))
        loss_fn(out, target.reshape(out.shape)).backward()
        opt.step()
    assert emb.cache_stats()["hits"] > 0
    with torch.no_grad():  # lookups see the newest rows before the flush
        assert torch.equal(emb(torch.arange(N).repeat(B)), plain.table.data)
    assert torch.equal(emb.state_dict()["weight"], plain.state_dict()["weight"])  # state_dict flushes
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(emb.state_tables[k].data, plain.state_tables[k].data)


def test_shared_input_is_looked_up_by_every_model_in_its_own_table():
    w0 = init_tables()
    emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone(), padding_idx=1)
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=0.5))
    x = torch.tensor([[1, 3], [3, 11]])
    with forward_context(ForwardContext(B, 2, shared=True)):
        out = emb(x)
    assert out.shape == (B * 2, 2, D)
    for b in range(B):
        assert torch.equal(out[2 * b:2 * b + 2], w0[b][x])
    out.sum().backward()
    pad = emb.working_ids.remainder(N) == 1
    assert int(pad.sum()) == B  # every model's padding row is in the working set, without gradient
    assert torch.equal(emb.weight.grad[pad], torch.zeros(B, D)) and bool((emb.weight.grad[~pad] != 0).all())
    opt.step()
    tables = emb.table.data.view(B, N, D)
    for b in range(B):
        assert torch.equal(tables[b, 3], w0[b, 3] - 0.5 * 2)  # looked up twice, gradient 1 each time
        assert torch.equal(tables[b, 11], w0[b, 11] - 0.5)
        assert torch.equal(tables[b, 1], w0[b, 1])  # padding: no gradient
        assert torch.equal(tables[b, 0], w0[b, 0])  # not looked up


def test_bad_indices_raise_before_any_host_access(monkeypatch):
    w0 = init_tables()
    emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone())
    offload.attach(torch.optim.Adam(emb.parameters()))

    def no_host_access(*args, **kwargs):
        raise AssertionError("the host table was read")

    monkeypatch.setattr(emb.table, "_gather_unique", no_host_access)
    # N is a valid row of the B * N host table (model 1's row 0) but not of model 0's table
    for bad, shown in ((N, N), (-1, -1), (N + 3, N + 3)):
        idx = torch.zeros(B, 2, dtype=torch.int64)
        idx[0, 1] = bad
        with pytest.raises(IndexError, match=rf"index {shown} is out of range for an embedding table of {N} rows"):
            emb(idx)
        assert emb.working_ids is None
    with pytest.raises(IndexError, match=f"index {N} is out of range"):
        emb.prefetch(torch.full((B, 1), N))
    with pytest.raises(TypeError, match="int64 or int32"):
        emb(torch.zeros(B, 2))
    with pytest.raises(ValueError, match="multiple of B = 3"):
        emb(torch.zeros(B + 1, 2, dtype=torch.int64))
    assert torch.equal(emb.table.data.view(B, N, D), w0)


def test_construction_and_refusals():
    torch.manual_seed(0)
    emb = Embedding(N, D, padding_idx=-1, batch=B, offload=True, cache_rows=4)
    assert isinstance(emb, Embedding) and isinstance(emb, OffloadedBatchEmbedding)
    assert isinstance(emb.offloaded, offload.OffloadedEmbedding)
    assert emb.padding_idx == N - 1 and emb.table.shape == (B * N, D) and emb.weight.shape == (0, D)
    assert torch.equal(emb.table.data.view(B, N, D)[:, N - 1], torch.zeros(B, D))
    assert "batch=3, offload=True" in repr(emb) and "cache_rows=4" in repr(emb)
    assert [n for n, _ in emb.named_parameters()] == ["weight"]
    assert emb.weight.no_model_axis and not hasattr(Embedding(N, D, batch=B).weight, "no_model_axis")
    with pytest.raises(ValueError, match="sparse=True is not supported"):
        Embedding(N, D, sparse=True, batch=B, offload=True)
    with pytest.raises(ValueError, match=r"_weight must have shape .* \(3, 12, 5\)"):
        Embedding(N, D, _weight=torch.zeros(N, D), batch=B, offload=True)
    with pytest.raises(ValueError, match="padding_idx must be within num_embeddings"):
        Embedding(N, D, padding_idx=N, batch=B, offload=True)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['cache_rows'\]"):
        Embedding(N, D, batch=B, cache_rows=3)
    with pytest.raises(TypeError, match="only with offload=True"):
        Embedding.from_module(nn.Embedding(N, D), B, pin=False)
    with pytest.raises(TypeError, match="LBFGS cannot train"):
        offload.attach(torch.optim.LBFGS(emb.parameters()))
    dense = Embedding(N, D, batch=B)
    assert type(dense) is Embedding and dense.weight.shape == (B, N, D)  # the dense path is unchanged


def test_torchmb_optimizers_are_refused_with_an_explanation():
    from torchmb import optim

    emb = Embedding(N, D, batch=B, offload=True)
    with pytest.raises(ValueError, match=r"Adam: an offloaded embedding's working rows have no model axis"):
        optim.Adam(emb.parameters(), lr=0.01)


def test_per_model_optimizers_are_recognised_by_batch_layers_protocol_and_refused_at_attach():
    from batch_layers._embedding_offload import PerModelOptimizer
    from torchmb import optim

    w = torch.zeros(B, 3, requires_grad=True)
    per_model = optim.SGD([w], lr=0.1)
    assert isinstance(per_model, PerModelOptimizer)
    assert not isinstance(torch.optim.SGD([w], lr=0.1), PerModelOptimizer)
    emb = Embedding(N, D, batch=B, offload=True)
    with pytest.raises(TypeError, match=r"torchmb\.optim\.SGD cannot train an offloaded batch_layers\.Embedding"):
        offload.attach(per_model, emb.offloaded)


def test_from_module_copies_a_plain_table_or_keeps_each_models_own():
    torch.manual_seed(0)
    plain = nn.Embedding(N, D, padding_idx=0, max_norm=3.0)
    emb = Embedding.from_module(plain, B, offload=True)
    assert isinstance(emb, OffloadedBatchEmbedding)
    assert (emb.padding_idx, emb.max_norm) == (0, 3.0)
    assert torch.equal(emb.table.data.view(B, N, D), plain.weight.detach().expand(B, N, D))
    dense = Embedding(N, D, batch=B, scale_grad_by_freq=True)
    emb = Embedding.from_module(dense, B, offload=True, cache_rows=5)
    assert emb.scale_grad_by_freq and emb.cache_stats()["capacity"] == 5
    assert torch.equal(emb.table.data.view(B, N, D), dense.weight.detach())
    with pytest.raises(ValueError, match="holds 3 models, batch=2"):
        Embedding.from_module(dense, 2, offload=True)
    with pytest.raises(TypeError, match="already offloaded"):
        Embedding.from_module(emb, B, offload=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(N, D, padding_idx=0)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        return self.head(self.embed(x).mean(1))


def _batch_module(torchmb, recipe: str):
    torch.manual_seed(0)
    bm = torchmb.BatchModule(Net(), B, init="independent", seed=0)
    before = bm.state_dicts()
    if recipe == "from_module":
        bm.module.embed = Embedding.from_module(bm.module.embed, B, offload=True, cache_rows=6)
    else:
        assert offload_embeddings(bm, cache_rows=6) == ["module.embed"]
    assert isinstance(bm.module.embed, OffloadedBatchEmbedding)
    return bm, before


@pytest.mark.parametrize("recipe", ["from_module", "offload_embeddings"])
def test_batch_module_trains_like_b_plain_models(recipe):
    torchmb = pytest.importorskip("torchmb")
    bm, before = _batch_module(torchmb, recipe)
    after = bm.state_dicts()
    for b in range(B):  # each model keeps its own (independently initialised) table
        assert sorted(after[b]) == sorted(before[b])
        for k in before[b]:
            assert torch.equal(after[b][k], before[b][k]), k
    refs = []
    for b in range(B):
        net = Net()
        net.load_state_dict(before[b])
        refs.append((net, torch.optim.SGD(net.parameters(), lr=0.1)))
    opt = offload.attach(torch.optim.SGD(bm.parameters(), lr=0.1))  # the only change to the loop
    g = torch.Generator().manual_seed(6)
    for _ in range(8):
        x = torch.randint(0, N - 2, (B, 4, 3), generator=g)
        x[:, 0, 0] = 0  # padding rows are looked up
        y = torch.randn(B, 4, 2, generator=g)
        opt.zero_grad()
        ((bm(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for b, (net, o) in enumerate(refs):
            o.zero_grad()
            ((net(x[b]) - y[b]) ** 2).mean().backward()
            o.step()
    got = bm.state_dicts()
    for b, (net, _) in enumerate(refs):
        for k, v in net.state_dict().items():
            torch.testing.assert_close(got[b][k], v, msg=f"model {b} {k}")
        plain = bm.unbatch(b)
        assert type(plain) is Net
        x = torch.randint(0, N, (5, 3))
        with torch.no_grad():
            torch.testing.assert_close(plain(x), net(x))
        assert torch.equal(plain.embed.weight[0], torch.zeros(D))


def test_batch_module_load_state_dicts_writes_the_host_tables_past_the_cache():
    torchmb = pytest.importorskip("torchmb")
    bm, before = _batch_module(torchmb, "from_module")
    opt = offload.attach(torch.optim.Adam(bm.parameters(), lr=0.1))
    x = torch.randint(0, N, (B, 4, 3))
    for _ in range(3):  # rows end up (dirty) in the GPU cache
        opt.zero_grad()
        bm(x).sum().backward()
        opt.step()
    assert bm.module.embed.cache_stats()["hits"] > 0
    bm.load_state_dicts(before)
    for b in range(B):
        assert torch.equal(bm.state_dict_of(b)["embed.weight"], before[b]["embed.weight"])
    with torch.no_grad():  # lookups see the loaded rows, not the cached ones
        out = bm(x)
    for b in range(B):
        net = Net()
        net.load_state_dict(before[b])
        with torch.no_grad():
            torch.testing.assert_close(out[b], net(x[b]))
    fresh = [Net().state_dict() for _ in range(B)]
    bm.load_state_dicts(fresh[1:], slots=[1, 2])
    assert torch.equal(bm.state_dict_of(0)["embed.weight"], before[0]["embed.weight"])
    assert torch.equal(bm.state_dict_of(2)["embed.weight"], fresh[2]["embed.weight"])
    with pytest.raises(NotImplementedError, match=r"select\(\) cannot shrink embed: an offloaded embedding"):
        bm.select([0, 1])


def test_module_state_dict_round_trip_and_shape_check():
    w0 = init_tables()
    emb = Embedding(N, D, batch=B, offload=True, _weight=w0.clone())
    sd = emb.state_dict()
    assert list(sd) == ["weight"] and sd["weight"].shape == (B, N, D) and torch.equal(sd["weight"], w0)
    other = Embedding(N, D, batch=B, offload=True)
    other.load_state_dict(sd)
    assert torch.equal(other.table.data.view(B, N, D), w0)
    with pytest.raises(RuntimeError, match=r"offloaded tables have shape \(3, 12, 5\)"):
        other.load_state_dict({"weight": torch.zeros(B * N, D)})
    dense = batch_layers.Embedding(N, D, batch=B)
    dense.load_state_dict(sd)  # the same state dict as the dense layer's
    assert torch.equal(dense.weight.detach(), w0)


def test_save_and_resume_is_exact(tmp_path):
    w0 = init_tables()
    steps = data(10, False, seed=7)
    whole = Embedding(N, D, batch=B, offload=True, _weight=w0.clone(), cache_rows=6)
    train_offloaded(whole, offload.attach(torch.optim.Adam(whole.parameters(), lr=0.01)), steps)
    first = Embedding(N, D, batch=B, offload=True, _weight=w0.clone(), cache_rows=6)
    opt = offload.attach(torch.optim.Adam(first.parameters(), lr=0.01))  # alive at save: its state is saved
    train_offloaded(first, opt, steps[:4])
    first.save(tmp_path / "ckpt")
    again = Embedding(N, D, batch=B, offload=True, cache_rows=6)
    again.load(tmp_path / "ckpt")
    train_offloaded(again, offload.attach(torch.optim.Adam(again.parameters(), lr=0.01)), steps[4:])
    again.flush()
    whole.flush()
    assert torch.equal(again.table.data, whole.table.data)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(again.state_tables[k].data, whole.state_tables[k].data)


def test_padding_rows_are_never_updated_even_with_weight_decay():
    """Every model's padding row keeps its value and zero state (no gradient, no decoupled decay), as with
    nn.Embedding(padding_idx) + SparseAdam-style lazy updates; max_norm still renormalises it at lookup."""
    w0 = init_tables() * 3
    w0[:, 4] = torch.tensor([3.0, 0, 0, 0, 0])  # norm 3 > max_norm: renormalised when looked up
    emb = Embedding(N, D, padding_idx=4, max_norm=2.0, batch=B, offload=True, _weight=w0.clone())
    opt = offload.attach(torch.optim.AdamW(emb.parameters(), lr=0.1, weight_decay=0.5))
    for idx, target in data(5, False, seed=8, extra=4):
        opt.zero_grad()
        out = emb(idx.reshape(B * idx.shape[1], -1))
        loss_fn(out, target.reshape(out.shape)).backward()
        opt.step()
    tables = emb.table.data.view(B, N, D)
    renormed = w0[:, 4].clone()
    torch.embedding_renorm_(renormed, torch.arange(B), 2.0, 2.0)  # what nn.Embedding's lookup does to it
    assert torch.equal(tables[:, 4], renormed)
    assert torch.equal(state_of(emb, "exp_avg")[:, 4], torch.zeros(B, D))
    assert not torch.equal(tables[:, :4], w0[:, :4])  # the other rows did train


def test_prepare_then_several_lookups_equal_one_lookup():
    w0 = init_tables()
    steps = data(6, False, seed=9)
    one = Embedding(N, D, batch=B, offload=True, _weight=w0.clone())
    train_offloaded(one, offload.attach(torch.optim.Adam(one.parameters(), lr=0.01)), steps)
    two = Embedding(N, D, batch=B, offload=True, _weight=w0.clone())
    opt = offload.attach(torch.optim.Adam(two.parameters(), lr=0.01))
    for idx, target in steps:
        opt.zero_grad()
        idx, target = idx.reshape(B * idx.shape[1], 2), target.reshape(B * idx.shape[1], 2, D)
        two.prepare(idx)
        assert two.weight.shape[0] == sum(idx[b * 4:(b + 1) * 4].unique().numel() for b in range(B))
        (loss_fn(two(idx[:, :1]), target[:, :1]) + loss_fn(two(idx[:, 1:]), target[:, 1:])).backward()
        opt.step()
    torch.testing.assert_close(two.table.data, one.table.data)  # gradients summed in another order


def test_offload_embeddings_by_name_and_signature():
    import inspect

    tree = nn.Sequential(Embedding(N, D, batch=B), nn.Sequential(Embedding(N, D, batch=B)))
    with pytest.raises(KeyError, match=r"no batched \(not yet offloaded\) Embedding named \['2'\]"):
        offload_embeddings(tree, names=["2"])
    assert offload_embeddings(tree, names=["1.0"]) == ["1.0"]
    assert type(tree[0]) is Embedding and isinstance(tree[1][0], OffloadedBatchEmbedding)
    assert offload_embeddings(tree) == ["0"]  # the offloaded one is left alone
    with pytest.raises(ValueError, match="changes layers inside a module"):
        offload_embeddings(Embedding(N, D, batch=B))
    assert "num_embeddings" in inspect.signature(Embedding).parameters  # __new__ does not hide it
