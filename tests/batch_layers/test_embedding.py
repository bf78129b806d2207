"""Batched embeddings against B independently held torch embeddings (CPU reference path; CUDA kernels
in the tests marked ``cuda``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batch_layers
import torchmb_config
from batch_layers import _backend
from batch_layers import _embedding_cuda as ecuda
from batch_layers._base import ForwardContext, forward_context
from offload import cuda_launch as offload_launch

B, N = 3, 5


def _copy_weights(batched: nn.Module, plain: list[nn.Module]) -> None:
    with torch.no_grad():
        batched.weight.copy_(torch.stack([p.weight for p in plain]))


def _compare_embedding(kwargs: dict, device: str, dtype=torch.float32, num=11, dim=6, seq=7, high=None,
                       index_dtype=torch.int64, atol=1e-6, rtol=1e-5, steps=2) -> batch_layers.Embedding:
    torch.manual_seed(0)
    plain = [nn.Embedding(num, dim, **kwargs).to(device) for _ in range(B)]
    batched = batch_layers.Embedding(num, dim, **kwargs, batch=B).to(device, dtype)
    _copy_weights(batched, plain)
    for _ in range(steps):  # twice: max_norm renormalises in place, the second step sees it
        x = torch.randint(0, high or num, (B * N, seq), device=device, dtype=index_dtype)
        y = batched(x)
        assert y.shape == (B * N, seq, dim) and y.dtype == dtype
        g = torch.randn(y.shape, device=device)
        batched.weight.grad = None
        y.backward(g.to(dtype))
        for i, layer in enumerate(plain):
            layer.weight.grad = None
            yi = layer(x[i * N:(i + 1) * N])
            yi.backward(g[i * N:(i + 1) * N])
            torch.testing.assert_close(y[i * N:(i + 1) * N].float(), yi, atol=atol, rtol=rtol)
            torch.testing.assert_close(batched.weight.grad[i].float(), layer.weight.grad, atol=atol, rtol=rtol)
            torch.testing.assert_close(batched.weight[i].float(), layer.weight, atol=atol, rtol=rtol)
    return batched


EMBEDDING_CASES = {
    "plain": {},
    "padding": {"padding_idx": 3},
    "negative-padding": {"padding_idx": -1},
    "freq": {"scale_grad_by_freq": True},
    "freq-padding": {"scale_grad_by_freq": True, "padding_idx": 0},
    "max-norm": {"max_norm": 1.5},
    "max-norm-l1": {"max_norm": 2.0, "norm_type": 1.0},
}


@pytest.mark.parametrize("case", list(EMBEDDING_CASES), ids=str)
def test_embedding_matches_torch_cpu(case: str) -> None:
    _compare_embedding(EMBEDDING_CASES[case], "cpu")


def test_embedding_heavy_collisions_and_int32_cpu() -> None:
    # 35 lookups per model over 3 rows: every row is hit many times.
    _compare_embedding({"padding_idx": 1}, "cpu", high=3, index_dtype=torch.int32)


def test_embedding_float64_and_bfloat16_cpu() -> None:
    _compare_embedding({}, "cpu", dtype=torch.float64, atol=1e-6)
    _compare_embedding({"padding_idx": 2}, "cpu", dtype=torch.bfloat16, atol=3e-2, rtol=2e-2, steps=1)


def test_embedding_isolation_across_tables() -> None:
    torch.manual_seed(1)
    emb = batch_layers.Embedding(6, 4, batch=4)
    x = torch.randint(0, 6, (4 * N, 3))
    emb(x).sum().backward()
    base = emb.weight.grad.clone()
    x2 = x.clone()
    x2[:N] = (x2[:N] + 1) % 6  # only model 0's indices change
    emb.weight.grad = None
    emb(x2).sum().backward()
    torch.testing.assert_close(emb.weight.grad[1:], base[1:], rtol=0, atol=0)
    for b in range(4):
        touched = torch.zeros(6, dtype=torch.bool)
        touched[x2[b * N:(b + 1) * N].flatten()] = True
        assert torch.all(emb.weight.grad[b][~touched] == 0)
        assert torch.all(emb.weight.grad[b][touched] != 0)


def test_embedding_shared_input_equals_repeated_input() -> None:
    torch.manual_seed(2)
    emb = batch_layers.Embedding(9, 5, padding_idx=4, batch=B)
    x = torch.randint(0, 9, (N, 4))
    with forward_context(ForwardContext(B, N, shared=True)):
        y_shared = emb(x)
    y_shared.pow(2).sum().backward()
    g_shared = emb.weight.grad.clone()
    emb.weight.grad = None
    y_rep = emb(x.repeat(B, 1))
    y_rep.pow(2).sum().backward()
    torch.testing.assert_close(y_shared, y_rep, rtol=0, atol=0)
    torch.testing.assert_close(g_shared, emb.weight.grad)


def test_embedding_constructors() -> None:
    torch.manual_seed(3)
    plain = nn.Embedding(8, 3, padding_idx=2, max_norm=2.0, scale_grad_by_freq=True)
    batched = batch_layers.Embedding.from_module(plain, 4)
    assert batched.weight.shape == (4, 8, 3) and (batched.padding_idx, batched.max_norm) == (2, 2.0)
    assert all(torch.equal(batched.weight[i], plain.weight) for i in range(4))
    assert repr(batched) == "Embedding(8, 3, padding_idx=2, max_norm=2.0, scale_grad_by_freq=True, batch=4)"
    tables = torch.randn(2, 5, 3)
    pre = batch_layers.Embedding.from_pretrained(tables)
    assert not pre.weight.requires_grad and torch.equal(pre.weight, tables)
    pre2 = batch_layers.Embedding.from_pretrained(tables[0], freeze=False, batch=3)
    assert pre2.weight.requires_grad and pre2.weight.shape == (3, 5, 3) and torch.equal(pre2.weight[2], tables[0])
    w = torch.randn(2, 4, 3)
    own = batch_layers.Embedding(4, 3, _weight=w, batch=2)
    assert own.weight.data_ptr() == w.data_ptr()
    torch.manual_seed(0)
    fresh = batch_layers.Embedding(7, 2, padding_idx=1, batch=3)
    torch.manual_seed(0)
    refs = [nn.Embedding(7, 2, padding_idx=1) for _ in range(3)]
    for i, r in enumerate(refs):
        assert torch.equal(fresh.weight[i], r.weight)


def test_embedding_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="sparse=True is not supported"):
        batch_layers.Embedding(4, 3, sparse=True, batch=2)
    with pytest.raises(ValueError, match="sparse=True is not supported"):
        batch_layers.Embedding.from_module(nn.Embedding(4, 3, sparse=True), 2)
    with pytest.raises(ValueError, match="sparse=True is not supported"):
        batch_layers.FastEmbedding(4, 3, sparse=True)
    with pytest.raises(ValueError, match="sparse=True is not supported"):
        batch_layers.EmbeddingBag(4, 3, sparse=True, batch=2)
    with pytest.raises(ValueError, match="padding_idx must be within num_embeddings = 4"):
        batch_layers.Embedding(4, 3, padding_idx=4, batch=2)
    with pytest.raises(ValueError, match=r"_weight must have shape .* = \(2, 4, 3\), got \(4, 3\)"):
        batch_layers.Embedding(4, 3, _weight=torch.randn(4, 3), batch=2)
    with pytest.raises(ValueError, match="pass batch="):
        batch_layers.Embedding.from_pretrained(torch.randn(4, 3))
    for layer in (batch_layers.Embedding, batch_layers.EmbeddingBag):
        with pytest.raises(ValueError, match=r"batch=3 disagrees with embeddings of shape \(2, 4, 3\)"):
            layer.from_pretrained(torch.randn(2, 4, 3), batch=3)
    emb = batch_layers.Embedding(4, 3, batch=2)
    with pytest.raises(TypeError, match=r"int64 or int32, got torch\.float32"):
        emb(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"multiple of B = 2 \(the merged model axis\)"):
        emb(torch.zeros(3, 2, dtype=torch.long))


@pytest.mark.parametrize("bad", [4, 100, -1, -5])
def test_bad_index_raises_on_cpu(bad: int) -> None:
    emb = batch_layers.Embedding(4, 3, batch=2)
    x = torch.zeros(2, 3, dtype=torch.long)
    x[1, 2] = bad
    with pytest.raises(IndexError, match=rf"index {bad} is out of range for an embedding table of 4 rows"):
        emb(x)
    fast = batch_layers.FastEmbedding(4, 3)
    with pytest.raises(IndexError, match=rf"index {bad} is out of range .* of 4 rows"):
        fast(x)


def test_fast_embedding_is_a_drop_in() -> None:
    torch.manual_seed(4)
    ref = nn.Embedding(20, 8, padding_idx=0, scale_grad_by_freq=True)
    fast = batch_layers.FastEmbedding(20, 8, padding_idx=0, scale_grad_by_freq=True)
    fast.load_state_dict(ref.state_dict())
    assert isinstance(fast, nn.Embedding) and fast.weight.shape == (20, 8)
    x = torch.randint(0, 4, (6, 9))
    g = torch.randn(6, 9, 8)
    ref(x).backward(g)
    fast(x).backward(g)
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad)
    pre = batch_layers.FastEmbedding.from_pretrained(ref.weight.detach(), freeze=False, max_norm=1.0)
    ref_pre = nn.Embedding.from_pretrained(ref.weight.detach().clone(), freeze=False, max_norm=1.0)
    torch.testing.assert_close(pre(x), ref_pre(x))
    torch.testing.assert_close(pre.weight, ref_pre.weight)


def test_second_derivative_is_refused() -> None:
    # the backward is first-order only (as once_differentiable): create_graph=True must not give a silent zero
    emb = batch_layers.Embedding(6, 3, batch=2)
    x = torch.randint(0, 6, (2 * N, 4))
    (gw,) = torch.autograd.grad(emb(x).pow(2).sum(), emb.weight, create_graph=True)
    ref = nn.Embedding(6, 3)
    with torch.no_grad():
        ref.weight.copy_(emb.weight[0])
    (gr,) = torch.autograd.grad(ref(x[:N]).pow(2).sum(), ref.weight)
    torch.testing.assert_close(gw[0], gr)  # the first derivative is still right
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gw.sum().backward()


def test_functional_lookup_shapes_cpu() -> None:
    # one table with any index shape, and B tables with the merged axis; both against F.embedding
    torch.manual_seed(14)
    w = torch.randn(9, 4, requires_grad=True)
    x = torch.randint(0, 9, (2, 3, 5))
    y = batch_layers.batched_embedding(x, w, padding_idx=2)
    w_ref = w.detach().clone().requires_grad_()
    y_ref = torch.nn.functional.embedding(x, w_ref, padding_idx=2)
    assert y.shape == (2, 3, 5, 4)
    g = torch.randn(y.shape)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w_ref.grad)
    with pytest.raises(ValueError, match=r"weight must be \(B, num_embeddings, dim\) or \(num_embeddings, dim\)"):
        batch_layers.batched_embedding(x, torch.randn(9))
    with pytest.raises(ValueError, match=r"numel divisible by B = 3"):
        batch_layers.batched_embedding(torch.zeros(4, dtype=torch.long), torch.randn(3, 9, 4))
    with pytest.raises(TypeError, match="must be a tensor of indices, got list"):
        batch_layers.batched_embedding([1, 2], w)


def _bag_case(mode: str, device: str, *, two_d: bool, include_last: bool = False, psw: bool = False,
              padding_idx: int | None = None, dtype=torch.float32, atol=1e-5) -> None:
    torch.manual_seed(5)
    num, dim = 10, 4
    kw = {"mode": mode, "include_last_offset": include_last, "padding_idx": padding_idx}
    plain = [nn.EmbeddingBag(num, dim, **kw).to(device) for _ in range(B)]
    bag = batch_layers.EmbeddingBag(num, dim, **kw, batch=B).to(device, dtype)
    _copy_weights(bag, plain)
    if two_d:
        x = torch.randint(0, 4, (B * N, 6), device=device)  # few rows: collisions and ties of equal rows
        per_offsets, offsets, T = None, None, None
    else:
        T = 13
        x = torch.randint(0, 4, (B * T,), device=device)
        local = [0, 3, 3, 9] + ([T] if include_last else [])
        per_offsets = len(local)
        offsets = torch.tensor(local * B, device=device)
    weights = torch.randn(x.shape, device=device) if psw else None
    y = bag(x, offsets, weights)
    g = torch.randn(y.shape, device=device)
    y.backward(g.to(dtype))
    rows = y.shape[0] // B
    for i, layer in enumerate(plain):
        if two_d:
            xi, oi, wi = x[i * N:(i + 1) * N], None, None if weights is None else weights[i * N:(i + 1) * N]
        else:
            xi, oi = x[i * T:(i + 1) * T], offsets[i * per_offsets:(i + 1) * per_offsets]
            wi = None if weights is None else weights[i * T:(i + 1) * T]
        yi = layer(xi, oi, wi)
        yi.backward(g[i * rows:(i + 1) * rows])
        torch.testing.assert_close(y[i * rows:(i + 1) * rows].float(), yi, atol=atol, rtol=atol)
        torch.testing.assert_close(bag.weight.grad[i].float(), layer.weight.grad, atol=atol, rtol=atol)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", ["offsets", "offsets-last", "2d", "offsets-padding", "2d-padding"])
def test_embedding_bag_matches_torch_cpu(mode: str, layout: str) -> None:
    _bag_case(mode, "cpu", two_d=layout.startswith("2d"), include_last=layout == "offsets-last",
              padding_idx=1 if layout.endswith("padding") else None)


@pytest.mark.parametrize("layout", ["offsets", "2d"])
def test_embedding_bag_per_sample_weights_cpu(layout: str) -> None:
    _bag_case("sum", "cpu", two_d=layout == "2d", psw=True, padding_idx=2)


def test_embedding_bag_refuses_bad_arguments() -> None:
    bag = batch_layers.EmbeddingBag(5, 2, mode="mean", batch=2)
    with pytest.raises(NotImplementedError, match="only supported for mode='sum'"):
        bag(torch.zeros(4, 3, dtype=torch.long), None, torch.ones(4, 3))
    with pytest.raises(ValueError, match="offsets must be None"):
        bag(torch.zeros(4, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="needs offsets"):
        bag(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="mode must be"):
        batch_layers.EmbeddingBag(5, 2, mode="median", batch=2)
    with pytest.raises(IndexError, match="index 5 is out of range for an embedding table of 5 rows"):
        bag(torch.tensor([[0, 5, 1], [1, 1, 1]]))


def test_embedding_bag_from_module() -> None:
    plain = nn.EmbeddingBag(6, 3, mode="max", padding_idx=0, include_last_offset=True)
    bag = batch_layers.EmbeddingBag.from_module(plain, 2)
    assert (bag.mode, bag.padding_idx, bag.include_last_offset) == ("max", 0, True)
    assert torch.equal(bag.weight[1], plain.weight)


def _multi_reference(multi: batch_layers.MultiEmbedding, tables: list[list[nn.Embedding]], x: torch.Tensor, g):
    batch = multi.weight.shape[0]
    n = x.shape[0] // batch
    for b in range(batch):
        parts = [tables[t][b](x[b * n:(b + 1) * n, t]) for t in range(len(tables))]
        ref = torch.cat(parts, dim=1)
        ref.backward(g[b * n:(b + 1) * n])
        yield b, ref


def _compare_multi(device: str, dtype=torch.float32, atol=1e-6) -> None:
    torch.manual_seed(6)
    nums, dims, batch = [5, 40, 3, 17], [2, 8, 1, 5], 2
    tables = [[nn.Embedding(n, d).to(device) for _ in range(batch)] for n, d in zip(nums, dims)]
    multi = batch_layers.MultiEmbedding(nums, dims, batch=batch, device=device, dtype=dtype)
    with torch.no_grad():
        for t, copies in enumerate(tables):
            multi.table(t).copy_(torch.stack([c.weight for c in copies]))
    x = torch.stack([torch.randint(0, n, (batch * 9,), device=device) for n in nums], dim=1)
    y = multi(x)
    assert y.shape == (batch * 9, sum(dims))
    g = torch.randn(y.shape, device=device)
    y.backward(g.to(dtype))
    for b, ref in _multi_reference(multi, tables, x, g):
        torch.testing.assert_close(y[b * 9:(b + 1) * 9].float(), ref, atol=atol, rtol=atol)
    for t, copies in enumerate(tables):
        view = multi.weight.grad[:, sum(n * d for n, d in zip(nums[:t], dims[:t])):][:, :nums[t] * dims[t]]
        for b, c in enumerate(copies):
            torch.testing.assert_close(view[b].view(nums[t], dims[t]).float(), c.weight.grad, atol=atol, rtol=atol)


def test_multi_embedding_matches_separate_tables_cpu() -> None:
    _compare_multi("cpu")


def test_multi_embedding_from_modules_and_errors() -> None:
    mods = [nn.Embedding(4, 2), nn.Embedding(6, 3)]
    multi = batch_layers.MultiEmbedding.from_modules(mods, batch=2)
    assert torch.equal(multi.table(1)[1], mods[1].weight)
    x = torch.tensor([[3, 5], [0, 2]])  # row b is model b's sample
    expected = torch.cat([mods[0](x[:, 0]), mods[1](x[:, 1])], 1)
    torch.testing.assert_close(multi(x), expected)
    with pytest.raises(IndexError, match="index 6 is out of range for an embedding table of 6 rows"):
        multi(torch.tensor([[3, 6], [0, 0]]))
    with pytest.raises(ValueError, match=r"expected indices of shape \(\*, 2\)"):
        multi(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="plain tables only"):
        batch_layers.MultiEmbedding.from_modules([nn.Embedding(4, 2, padding_idx=0)])
    single = batch_layers.MultiEmbedding([4, 6], 3)
    assert single(torch.tensor([[[1, 2]]])).shape == (1, 1, 6)


def test_backend_switch() -> None:
    assert _backend.get_backend() in _backend.BACKENDS
    with batch_layers.use_torch():
        assert batch_layers.get_backend() == "torch"
        with batch_layers.use_cupy():
            assert batch_layers.get_backend() == "cupy"
        assert batch_layers.get_backend() == "torch"
    old = batch_layers.set_backend("torch")
    assert batch_layers.set_backend(old) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        batch_layers.set_backend("triton")


def test_backend_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    switch = torchmb_config.SWITCHES["backend"]
    monkeypatch.setenv(_backend.ENV_VAR, "TORCH")
    assert switch.from_env() == "torch"
    monkeypatch.setenv(_backend.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="TORCHMB_BACKEND='nope'"):
        switch.from_env()
    monkeypatch.delenv(_backend.ENV_VAR)
    assert switch.from_env() == "auto"


def test_explicit_cupy_backend_without_cupy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ImportError("No module named 'cupy'")
    monkeypatch.setattr(ecuda, "cupy", None)
    monkeypatch.setattr(ecuda, "_CUPY_IMPORT_ERROR", original)
    cuda = torch.device("cuda", 0)
    with batch_layers.use_cupy(), pytest.raises(ImportError, match="CuPy could not be imported") as info:
        ecuda.use_kernels(cuda)
    assert info.value.__cause__ is original
    with batch_layers.use_backend("auto"):
        assert ecuda.use_kernels(cuda) is False  # auto falls back to the reference path
    assert ecuda.use_kernels(torch.device("cpu")) is False


def test_registered_for_torch_classes() -> None:
    from torchmb import BatchModule, lookup_batch_module

    assert lookup_batch_module(nn.Embedding) is batch_layers.Embedding
    assert lookup_batch_module(nn.EmbeddingBag) is batch_layers.EmbeddingBag
    torch.manual_seed(7)
    model = nn.Sequential(nn.Embedding(12, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 2))
    models = BatchModule(model, batch=3, init="independent", seed=0)
    x = torch.randint(0, 12, (3, 5, 3))
    y = models(x)
    y.sum().backward()
    for i in range(3):
        plain = models.unbatch(i)
        yi = plain(x[i])
        torch.testing.assert_close(y[i], yi)
        yi.sum().backward()
        torch.testing.assert_close(models.module[0].weight.grad[i], plain[0].weight.grad)


# ------------------------------------------------------------------------------------------------
# CUDA: the CuPy kernels


def _need_cupy():
    return pytest.importorskip("cupy")


@pytest.fixture
def kernels():
    _need_cupy()
    with batch_layers.use_cupy():
        yield ecuda.LAUNCHES


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(EMBEDDING_CASES), ids=str)
def test_embedding_kernels_match_torch(kernels, case: str) -> None:
    before = dict(kernels)
    _compare_embedding(EMBEDDING_CASES[case], "cuda", atol=1e-5)
    assert kernels["emb_gather"] > before.get("emb_gather", 0)
    assert kernels["emb_scatter"] > before.get("emb_scatter", 0)


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [1, 2, 3, 16, 64, 130, 256])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_embedding_kernels_dims_and_collisions(kernels, dim: int, index_dtype) -> None:
    # 3 rows for 35 * 20 lookups per model: every warp tile de-duplicates, every row gets many atomics.
    _compare_embedding({"padding_idx": 1}, "cuda", num=40, dim=dim, seq=20, high=3, index_dtype=index_dtype,
                       atol=1e-4, rtol=1e-5)
    _compare_embedding({"scale_grad_by_freq": True}, "cuda", num=1000, dim=dim, seq=33, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("dim", [3, 16, 64])
def test_embedding_kernels_half_precision(kernels, dtype, tol: float, dim: int) -> None:
    torch.manual_seed(8)
    num, seq = 50, 64
    emb = batch_layers.Embedding(num, dim, padding_idx=0, batch=B, device="cuda", dtype=dtype)
    x = torch.randint(0, 6, (B * N, seq), device="cuda")  # heavy collisions: ~50 hits per row
    y = emb(x)
    g = torch.randn(y.shape, device="cuda").to(dtype)
    y.backward(g)
    for i in range(B):
        ref = nn.Embedding(num, dim, padding_idx=0).cuda()
        with torch.no_grad():
            ref.weight.copy_(emb.weight[i].float())
        yi = ref(x[i * N:(i + 1) * N])
        yi.backward(g[i * N:(i + 1) * N].float())  # fp32 reference of the same fp16/bf16 data
        assert torch.equal(y[i * N:(i + 1) * N], yi.to(dtype))
        assert emb.weight.grad.dtype == dtype
        torch.testing.assert_close(emb.weight.grad[i].float(), ref.weight.grad, rtol=tol, atol=tol)


@pytest.mark.cuda
def test_backend_parity_and_launch_counter(kernels) -> None:
    torch.manual_seed(9)
    emb = batch_layers.Embedding(300, 24, padding_idx=5, scale_grad_by_freq=True, batch=4, device="cuda")
    x = torch.randint(0, 40, (4 * 16, 10), device="cuda")
    g = torch.randn(4 * 16, 10, 24, device="cuda")
    results = {}
    for backend in ("torch", "cupy"):
        with batch_layers.use_backend(backend):
            before = kernels["emb_scatter"]
            emb.weight.grad = None
            y = emb(x)
            y.backward(g)
            ran = kernels["emb_scatter"] - before
            assert ran == (1 if backend == "cupy" else 0)
            results[backend] = (y.detach(), emb.weight.grad.clone())
    torch.testing.assert_close(results["cupy"][0], results["torch"][0], rtol=0, atol=0)
    torch.testing.assert_close(results["cupy"][1], results["torch"][1], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_kernels_isolation_and_bounds(kernels) -> None:
    # index 20 of table 0 would be row 0 of table 1 without the bound check.
    emb = batch_layers.Embedding(20, 8, batch=2, device="cuda")
    x = torch.tensor([[3, 20], [0, 0]], device="cuda")
    y = emb(x)
    y.sum().backward()
    torch.cuda.synchronize()
    assert torch.all(y[0, 1] == 0) and torch.equal(y[0, 0], emb.weight[0, 3])
    assert torch.all(emb.weight.grad[1, 1:] == 0) and torch.all(emb.weight.grad[1, 0] == 2)
    assert torch.all(emb.weight.grad[0, 3] == 1) and emb.weight.grad[0].abs().sum() == 8
    with pytest.raises(IndexError, match=r"index 20 is out of range for an embedding table of 20 rows"):
        emb.check()
    emb.check()  # the report was consumed
    emb(torch.zeros(2, 2, dtype=torch.long, device="cuda"))


@pytest.mark.cuda
def test_kernels_bad_index_raised_at_next_forward(kernels) -> None:
    emb = batch_layers.Embedding(10, 4, batch=2, device="cuda")
    emb(torch.tensor([[1], [-3]], device="cuda"))  # no exception, no synchronisation here
    torch.cuda.synchronize()  # the report reaches pinned host memory
    with pytest.raises(IndexError, match=r"index -3 is out of range for an embedding table of 10 rows"):
        emb(torch.tensor([[1], [2]], device="cuda"))
    emb(torch.tensor([[1], [2]], device="cuda"))
    batch_layers.check_indices()


@pytest.mark.cuda
def test_reference_path_bad_index_on_cuda_is_asynchronous_too() -> None:
    with batch_layers.use_torch():
        emb = batch_layers.Embedding(10, 4, batch=2, device="cuda")
        y = emb(torch.tensor([[1], [10]], device="cuda"))
        assert torch.all(y[1] == 0)
        with pytest.raises(IndexError, match="index 10 is out of range for an embedding table of 10 rows"):
            emb.check()


@pytest.mark.cuda
def test_kernels_capture_in_cuda_graph(kernels) -> None:
    torch.manual_seed(10)
    num, dim = 500, 32
    emb = batch_layers.Embedding(num, dim, batch=2, device="cuda")
    static_x = torch.randint(0, num, (2 * 64, 5), device="cuda")
    static_g = torch.randn(2 * 64, 5, dim, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile and load the kernels outside the capture
            emb.weight.grad = None
            emb(static_x).backward(static_g)
    torch.cuda.current_stream().wait_stream(side)
    emb.weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = emb(static_x)
        static_y.backward(static_g)
    static_grad = emb.weight.grad
    for _ in range(2):
        static_x.copy_(torch.randint(0, 50, static_x.shape, device="cuda"))
        static_g.normal_()
        graph.replay()
        torch.cuda.synchronize()
        for i in range(2):
            ref = nn.Embedding(num, dim).cuda()
            with torch.no_grad():
                ref.weight.copy_(emb.weight[i])
            yi = ref(static_x[i * 64:(i + 1) * 64])
            yi.backward(static_g[i * 64:(i + 1) * 64])
            torch.testing.assert_close(static_y[i * 64:(i + 1) * 64], yi)
            torch.testing.assert_close(static_grad[i], ref.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_deterministic_path(kernels) -> None:
    torch.manual_seed(11)
    emb = batch_layers.Embedding(100, 16, padding_idx=3, batch=2, device="cuda")
    x = torch.randint(0, 10, (2 * 32, 40), device="cuda")
    g = torch.randn(2 * 32, 40, 16, device="cuda")
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            before = kernels["emb_scatter"]
            emb.weight.grad = None
            emb(x).backward(g)
            assert kernels["emb_scatter"] == before  # the sort-based path ran, not the atomics
            grads.append(emb.weight.grad.clone())
    finally:
        torch.use_deterministic_algorithms(old)
    assert torch.equal(grads[0], grads[1])
    for i in range(2):
        ref = nn.Embedding(100, 16, padding_idx=3).cuda()
        with torch.no_grad():
            ref.weight.copy_(emb.weight[i])
        ref(x[i * 32:(i + 1) * 32]).backward(g[i * 32:(i + 1) * 32])
        torch.testing.assert_close(grads[0][i], ref.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_fast_embedding_kernels(kernels) -> None:
    torch.manual_seed(12)
    ref = nn.Embedding(1000, 64, padding_idx=7).cuda()
    fast = batch_layers.FastEmbedding(1000, 64, padding_idx=7).cuda()
    fast.load_state_dict(ref.state_dict())
    x = torch.randint(0, 30, (128, 20), device="cuda")
    g = torch.randn(128, 20, 64, device="cuda")
    before = kernels["emb_scatter"]
    fast(x).backward(g)
    ref(x).backward(g)
    assert kernels["emb_scatter"] == before + 1
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", ["offsets-last", "2d-padding"])
def test_embedding_bag_kernels_match_torch(kernels, mode: str, layout: str) -> None:
    before = kernels["emb_scatter"]
    _bag_case(mode, "cuda", two_d=layout.startswith("2d"), include_last=layout == "offsets-last",
              padding_idx=1 if layout.endswith("padding") else None, psw=mode == "sum")
    assert kernels["emb_scatter"] == before + 1


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_multi_embedding_kernels(kernels, dtype, atol: float) -> None:
    before = kernels["memb_scatter"]
    if dtype == torch.float32:
        _compare_multi("cuda", dtype, atol)
    else:  # compare with an fp32 run of the same rounded weights
        torch.manual_seed(13)
        multi = batch_layers.MultiEmbedding([30, 4, 9], [3, 16, 5], batch=2, device="cuda", dtype=dtype)
        ref = batch_layers.MultiEmbedding([30, 4, 9], [3, 16, 5], batch=2, device="cuda")
        with torch.no_grad():
            ref.weight.copy_(multi.weight.float())
        x = torch.stack([torch.randint(0, n, (2 * 50,), device="cuda") for n in (30, 4, 9)], dim=1)
        g = torch.randn(2 * 50, 24, device="cuda").to(dtype)
        y = multi(x)
        y.backward(g)
        with batch_layers.use_torch():
            y_ref = ref(x)
            y_ref.backward(g.float())
        assert torch.equal(y.float(), y_ref)
        torch.testing.assert_close(multi.weight.grad.float(), ref.weight.grad, atol=atol, rtol=atol)
    assert kernels["memb_scatter"] == before + 1


@pytest.mark.cuda
def test_multi_embedding_kernel_bad_index(kernels) -> None:
    multi = batch_layers.MultiEmbedding([4, 6], [2, 3], device="cuda")
    y = multi(torch.tensor([[3, 6], [0, 0]], device="cuda"))
    assert torch.all(y[0, 2:] == 0)
    with pytest.raises(IndexError, match="index 6 is out of range for an embedding table of 6 rows"):
        multi.check()


@pytest.mark.cuda
def test_float64_weights_use_reference_or_are_refused() -> None:
    _need_cupy()
    emb = batch_layers.Embedding(10, 4, batch=2, device="cuda", dtype=torch.float64)
    x = torch.randint(0, 10, (4, 3), device="cuda")
    with batch_layers.use_backend("auto"):
        emb(x).sum().backward()
    with batch_layers.use_cupy(), pytest.raises(TypeError, match="CuPy embedding kernels support"):
        emb(x)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["driver", "cupy"])
def test_launch_modes_agree_and_the_fast_one_runs(kernels, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # "driver" packs the arguments for one cuLaunchKernel; "cupy" goes through cupy.cuda.Function
    if mode == "driver" and ecuda.LAUNCH_MODE[0] != "driver":
        pytest.skip("this CuPy has no driver.launchKernel binding")
    monkeypatch.setattr(offload_launch, "LAUNCH_MODE", [mode])  # (the launcher is offload's, shared)
    torch.manual_seed(15)
    before, slow = dict(kernels), dict(ecuda.SLOW_LAUNCHES)
    _compare_embedding({"padding_idx": 2, "scale_grad_by_freq": True}, "cuda", num=50, dim=12, seq=9, high=20,
                       atol=1e-5)
    ran = {k: kernels[k] - before.get(k, 0) for k in ("emb_gather", "emb_count", "emb_scatter")}
    assert all(v == 2 for v in ran.values())  # two steps
    slow_ran = {k: ecuda.SLOW_LAUNCHES[k] - slow.get(k, 0) for k in ran}
    if mode == "cupy":
        assert slow_ran == ran
    elif all(k.ptr for k in offload_launch.KERNELS.values() if k.name in ran):
        assert set(slow_ran.values()) == {0}


@pytest.mark.cuda
def test_kernels_from_a_fresh_thread_and_a_side_stream(kernels) -> None:
    # the driver launch needs a current context in the calling thread, and must use torch's current stream
    import threading

    torch.manual_seed(16)
    ref = nn.Embedding(300, 8).cuda()
    fast = batch_layers.FastEmbedding(300, 8).cuda()
    fast.load_state_dict(ref.state_dict())
    x = torch.randint(0, 300, (64, 7), device="cuda")
    g = torch.randn(64, 7, 8, device="cuda")
    out = {}

    def work():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(side):
            y = fast(x)
            y.backward(g)
            out["y"] = y.clone()
        side.synchronize()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    ref(x).backward(g)
    torch.testing.assert_close(out["y"], ref(x), rtol=0, atol=0)
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_kernels_on_a_device_that_is_not_current(kernels) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.manual_seed(17)
    ref = nn.Embedding(100, 16).to("cuda:1")
    fast = batch_layers.FastEmbedding(100, 16).to("cuda:1")
    fast.load_state_dict(ref.state_dict())
    x = torch.randint(0, 100, (40,), device="cuda:1")
    with torch.cuda.device(0):
        y = fast(x)
        y.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("dim", [4, 6, 16])
def test_gather_and_scatter_at_every_alignment(kernels, offset: int, dim: int) -> None:
    # tensors that start 4, 8 or 12 bytes past a 16-byte boundary take narrower words and chunks
    torch.manual_seed(18)
    num, M = 37, 300
    base = torch.randn(num * dim + offset, device="cuda")
    w = base[offset:].view(num, dim)
    idx = torch.randint(0, num, (M,), device="cuda", dtype=torch.int32)
    torch.testing.assert_close(ecuda.gather(w, idx, 1, num, M), w[idx.long()], rtol=0, atol=0)
    gbase = torch.randn(M * dim + offset, device="cuda")
    g = gbase[offset:].view(M, dim)
    gw = ecuda.scatter(g, idx, (num, dim), 1, num, M, 5, None)
    ref = torch.zeros(num, dim, device="cuda").index_add_(0, idx.long(), g)
    ref[5] = 0
    torch.testing.assert_close(gw, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_kernel_operands_are_checked(kernels) -> None:
    w = torch.randn(10, 4, device="cuda")
    idx = torch.randint(0, 10, (6,), device="cuda")
    with pytest.raises(ValueError, match=r"indices must be on cuda:0, got cpu"):
        ecuda.gather(w, idx.cpu(), 1, 10, 6)
    with pytest.raises(TypeError, match=r"indices must have dtype in .*int64.*got torch\.int16"):
        ecuda.gather(w, idx.to(torch.int16), 1, 10, 6)
    with pytest.raises(ValueError, match="indices must be contiguous"):
        ecuda.gather(w, torch.randint(0, 10, (6, 2), device="cuda").t(), 1, 10, 12)
    with pytest.raises(ValueError, match="weight must be a contiguous CUDA tensor"):
        ecuda.gather(torch.randn(4, 10, device="cuda").t(), idx, 1, 10, 6)
    g = torch.randn(6, 4, device="cuda")
    with pytest.raises(TypeError, match=r"grad_output must have dtype in .*got torch\.float64"):
        ecuda.scatter(g.double(), idx, (10, 4), 1, 10, 6, -1, None)
    with pytest.raises(ValueError, match="grad_output must be contiguous"):
        ecuda.scatter(torch.randn(4, 6, device="cuda").t(), idx, (10, 4), 1, 10, 6, -1, None)
    with pytest.raises(ValueError, match=r"grad_output must hold 6 rows of 4, got shape \(5, 4\)"):
        ecuda.scatter(g[:5], idx, (10, 4), 1, 10, 6, -1, None)
    # sizes that would read or write outside a tensor
    with pytest.raises(ValueError, match=r"gather: 2 tables of 10 rows of 4 need a table of 80 .*\(got \(10, 4\)\)"):
        ecuda.gather(w, idx, 2, 10, 6)
    with pytest.raises(ValueError, match=r"and 6 or 3 indices \(got 5\)"):
        ecuda.gather(w, idx[:5], 2, 5, 3)
    with pytest.raises(ValueError, match=r"scatter: 1 tables of 12 rows of 4 need a table of 48 .*\(got \(10, 4\)\)"):
        ecuda.scatter(g, idx, (10, 4), 1, 12, 6, -1, None)
    with pytest.raises(ValueError, match=r"counts must hold 10 rows' counts, got 9"):
        ecuda.scatter(g, idx, (10, 4), 1, 10, 6, -1, torch.ones(9, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match=r"counts: 2 tables of 3 lookups need 6 or 3 indices, got 5"):
        ecuda.counts(idx[:5], 2, 10, 3)


@pytest.mark.cuda
def test_kernels_shared_and_non_contiguous_indices(kernels) -> None:
    torch.manual_seed(19)
    emb = batch_layers.Embedding(30, 8, padding_idx=0, batch=B, device="cuda")
    x = torch.randint(0, 30, (6, N), device="cuda").t()  # (N, 6), not contiguous
    before = kernels["emb_gather"]
    with forward_context(ForwardContext(B, N, shared=True)):
        y = emb(x)
    assert kernels["emb_gather"] == before + 1 and y.shape == (B * N, 6, 8)
    g = torch.randn(y.shape, device="cuda")
    y.backward(g)
    for i in range(B):
        ref = nn.Embedding(30, 8, padding_idx=0).cuda()
        with torch.no_grad():
            ref.weight.copy_(emb.weight[i])
        yi = ref(x)
        yi.backward(g[i * N:(i + 1) * N])
        torch.testing.assert_close(y[i * N:(i + 1) * N], yi, rtol=0, atol=0)
        torch.testing.assert_close(emb.weight.grad[i], ref.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_gradient_starts_from_zero_on_reused_memory(kernels) -> None:
    # the gradient buffer is an uninitialised allocation zeroed by a memset: fill the allocator's cache
    # with NaN first, so a missing or short zero-fill shows
    torch.manual_seed(20)
    num, dim = 64, 24
    ref = nn.Embedding(num, dim, padding_idx=3).cuda()
    fast = batch_layers.FastEmbedding(num, dim, padding_idx=3).cuda()
    fast.load_state_dict(ref.state_dict())
    x = torch.randint(0, 8, (50,), device="cuda")  # most rows get no gradient and must read exactly 0
    g = torch.randn(50, dim, device="cuda")
    for _ in range(3):
        poison = torch.full((num, dim), float("nan"), device="cuda")
        del poison
        fast.weight.grad = None
        fast(x).backward(g)
        assert torch.isfinite(fast.weight.grad).all()
    ref(x).backward(g)
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
