"""The fused per-model-affine norm kernels (``batch_layers/_norm_triton.py``) against B independently held plain
``nn.LayerNorm`` / ``nn.RMSNorm``: outputs, input, weight and bias gradients, in both merged orders, with odd
and several trailing normalised dims, float32 and bfloat16; under autocast and with double backward on a GPU;
and the kernel table of norms, which keeps the composite where the kernels do not apply.

The kernel tests run on a GPU (``cuda``) and, where Triton is importable, on the CPU under Triton's
interpreter (the table's CUDA condition bypassed there)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import batch_layers
import torchmb_config
from batch_layers import Layout, _kernel_table, _norm_table, _norm_triton
from batch_layers._kernel_table import choose
from batch_layers._norm_table import NORM_OPS, NormCall, explain_norm_kernels
from batch_layers.functional import _norm as functional_norm
from torchmb import BatchModule

B, N, TOKENS = 3, 4, 5
OP = next(iter(NORM_OPS))
FUSED = "_FusedNormBackward"
KINDS = ["layer", "layer-no-bias", "rms"]
SHAPES = [(37,), (3, 7)]  # an odd D; several trailing dims, normalised as one row of 21
TOLERANCES = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


def _triton_interpreter(monkeypatch) -> None:
    """Run the kernels on CPU tensors under Triton's interpreter (fresh kernels, dropped again afterwards)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(functional_norm, "runs_fused_norm", lambda x, features, rms: True)  # the table asks for CUDA
    _norm_triton._kernels.cache_clear()


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.cuda), "interpreter"])
def device(request, monkeypatch):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        pytest.importorskip("triton")
        yield "cuda"
        return
    _triton_interpreter(monkeypatch)
    yield "cpu"
    _norm_triton._kernels.cache_clear()


def _plain(kind: str, shape: tuple[int, ...], device: str, dtype: torch.dtype) -> list[nn.Module]:
    """B plain norms with their own random weights (and biases)."""
    torch.manual_seed(0)
    if kind == "rms":
        models = [nn.RMSNorm(shape, eps=1e-5, device=device, dtype=dtype) for _ in range(B)]
    else:
        models = [nn.LayerNorm(shape, bias=kind == "layer", device=device, dtype=dtype) for _ in range(B)]
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
    return models


def _batched(plain: list[nn.Module], order: str) -> nn.Module:
    kind = batch_layers.LayerNorm if isinstance(plain[0], nn.LayerNorm) else batch_layers.RMSNorm
    batched = kind.from_module(plain[0], B)
    batched.merged_order = order
    with torch.no_grad():
        for name, p in batched.named_parameters():
            p.copy_(torch.stack([dict(model.named_parameters())[name] for model in plain]))
    return batched


def _run_and_compare(plain, batched, x: torch.Tensor, order: str, fused: bool = True, reference: str = "") -> None:
    """Run the batched norm on the merged ``x`` (``(B, N, ...)``, split by model) and each plain model on its
    own rows (on the ``reference`` device if given); compare outputs and every gradient."""
    layout = Layout(B, order)
    x = x.detach().requires_grad_()
    y = batched(layout.merge(x))
    assert (type(y.grad_fn).__name__ == FUSED) == fused, type(y.grad_fn).__name__
    ramp = torch.linspace(-1, 1, y[0].numel(), device=x.device).view_as(y[0])  # every element its own gradient
    (layout.split(y).float() * ramp).sum().backward()
    tol = TOLERANCES[x.dtype]
    for i, model in enumerate(plain):
        model = model.to(reference) if reference else model
        own = x[i].detach().to(model.weight.device).requires_grad_()
        y_own = model(own)
        (y_own.float() * ramp.to(own.device)).sum().backward()
        assert layout.split(y)[i].dtype == y_own.dtype
        torch.testing.assert_close(layout.split(y)[i], y_own.to(x.device), **tol)
        torch.testing.assert_close(x.grad[i], own.grad.to(x.device), **tol)
        for name, p in model.named_parameters():
            got = dict(batched.named_parameters())[name].grad[i]
            # a sum over N * TOKENS rows: bfloat16's rounding of the result, relative to its size
            torch.testing.assert_close(got, p.grad.to(x.device), atol=tol["atol"] * 4, rtol=tol["rtol"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("shape", SHAPES, ids=["odd-D", "two-dims"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_norm_matches_b_plain_norms(device: str, kind: str, order: str, shape, dtype) -> None:
    plain = _plain(kind, shape, device, dtype)
    x = torch.randn(B, N, TOKENS, *shape, device=device).to(dtype) * 2 + 0.5
    _run_and_compare(plain, _batched(plain, order), x, order)


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_a_models_rows_split_over_several_programs(device: str, order: str, kind: str) -> None:
    """Enough rows per model that several backward programs share each model's (their partial weight and bias
    sums added up per model)."""
    samples, tokens, features = 8, 40, 37
    block_r = _norm_triton._blocks(features, _norm_triton.BACKWARD_TILE, _norm_triton.BACKWARD_PER_THREAD)[0]
    assert _norm_triton._splits(torch.device(device), B, samples * tokens, block_r) > 1
    plain = _plain(kind, (features,), device, torch.float32)
    x = torch.randn(B, samples, tokens, features, device=device)
    _run_and_compare(plain, _batched(plain, order), x, order)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")  # plain RMSNorm's
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_bfloat16_input_with_float32_weights_keeps_the_input_dtype(device: str, kind: str) -> None:
    plain = _plain(kind, (24,), device, torch.float32)
    x = torch.randn(B, N, TOKENS, 24, device=device).bfloat16()
    reference = ""
    if device == "cuda" and kind == "layer":  # torch 2.11's CUDA layer_norm refuses the mix; its CPU one computes it
        try:
            plain[0](x[0])
        except RuntimeError as error:
            assert "expected scalar type" in str(error)
            reference = "cpu"
    _run_and_compare(plain, _batched(plain, "samples"), x, "samples", reference=reference)


def test_a_batch_module_trains_like_b_plain_models(device: str) -> None:
    """A small pre-norm block in a BatchModule (its first forward tracked, then untracked): one SGD step's
    outputs, losses and weights as B plain models give them."""
    def make() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 16), nn.GELU(), nn.RMSNorm(16), nn.Linear(16, 2))

    torch.manual_seed(0)
    plain = [make().to(device) for _ in range(B)]
    for model in plain:  # weights and biases other than ones and zeros
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    batched = BatchModule(make(), B).to(device)
    batched.load_state_dicts([m.state_dict() for m in plain])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in plain]
    batched_optimizer = torch.optim.SGD(batched.parameters(), lr=0.1)
    ran = []
    for layer in batched.modules():
        if isinstance(layer, batch_layers.LayerNorm):  # RMSNorm's too
            layer.register_forward_hook(lambda _, args, out: ran.append(type(out.grad_fn).__name__))
    x = torch.randn(B, N, TOKENS, 12, device=device)
    for _ in range(2):
        y = batched(x)
        assert y.shape == (B, N, TOKENS, 2)
        batched_optimizer.zero_grad()
        y.square().sum().backward()
        batched_optimizer.step()
        for i, (model, optimizer) in enumerate(zip(plain, optimizers)):
            own = model(x[i])
            torch.testing.assert_close(y[i], own, atol=1e-5, rtol=1e-5)
            optimizer.zero_grad()
            own.square().sum().backward()
            optimizer.step()
    assert ran == [FUSED] * 4
    for i, model in enumerate(plain):
        for name, p in batched.unbatch(i).named_parameters():
            torch.testing.assert_close(p, dict(model.named_parameters())[name], atol=1e-5, rtol=1e-5)


def test_only_the_weights_need_gradients(device: str) -> None:
    """The first norm of a model reads data that needs no gradient: the kernels write no input gradient."""
    plain = _plain("layer", (37,), device, torch.float32)
    batched = _batched(plain, "models")
    x = torch.randn(B * N, TOKENS, 37, device=device)
    y = batched(x)
    assert type(y.grad_fn).__name__ == FUSED
    y.sum().backward()
    for i, model in enumerate(plain):
        model(x.view(B, N, TOKENS, 37)[i]).sum().backward()
        torch.testing.assert_close(batched.weight.grad[i], model.weight.grad, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(batched.bias.grad[i], model.bias.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_under_autocast_the_fused_norm_returns_what_the_composite_does(kind: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    plain = _plain(kind, (48,), "cuda", torch.float32)
    batched = _batched(plain, "models")
    x = torch.randn(B * N, TOKENS, 48, device="cuda").bfloat16().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = batched(x)
        with torchmb_config.use("triton", False):
            composite = batched(x)
        reference = [model(x.view(B, N, TOKENS, 48)[i]) for i, model in enumerate(plain)]
    fused = kind == "layer"  # an RMS norm under autocast keeps the composite (rms_norm's policy varies)
    assert (type(y.grad_fn).__name__ == FUSED) == fused and type(composite.grad_fn).__name__ != FUSED
    assert y.dtype == composite.dtype == reference[0].dtype
    tol = 1e-5 if y.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, torch.cat(reference), atol=tol, rtol=tol)
    (grad,) = torch.autograd.grad(y.sum(), x)
    (want,) = torch.autograd.grad(torch.cat(reference).sum(), x)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, want, atol=1e-2, rtol=1e-2)


def test_a_differentiated_backward_runs_through_the_composite(device: str) -> None:
    """``create_graph=True``: second-order gradients (a gradient penalty) as B plain layer norms give them."""
    plain = [model.double() for model in _plain("layer", (9,), device, torch.float32)]
    batched = _batched(plain, "models").float()
    x = torch.randn(B * N, 9, device=device).requires_grad_()
    y = batched(x)
    assert type(y.grad_fn).__name__ == FUSED
    (grad_x,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    grad_x.pow(2).sum().backward()
    for i, model in enumerate(plain):
        own = x.detach().view(B, N, 9)[i].double().requires_grad_()
        (own_grad,) = torch.autograd.grad((model(own) ** 2).sum(), own, create_graph=True)
        own_grad.pow(2).sum().backward()
        torch.testing.assert_close(grad_x.view(B, N, 9)[i].double(), own_grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(x.grad.view(B, N, 9)[i].double(), own.grad, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(batched.weight.grad[i].double(), model.weight.grad, atol=1e-3, rtol=1e-3)


def test_shared_input_and_no_affine_keep_the_composite(device: str) -> None:
    x = torch.randn(N, 16, device=device, requires_grad=True)
    weight = torch.randn(B, 16, device=device, requires_grad=True)
    layout = Layout(B, "models")
    shared = batch_layers.functional.layer_norm(x, (16,), weight, None, layout=layout, shared=True)
    assert type(shared.grad_fn).__name__ != FUSED and shared.shape == (B * N, 16)
    merged = torch.randn(B * N, 16, device=device)
    assert type(batch_layers.functional.layer_norm(merged, (16,), weight, layout=layout).grad_fn).__name__ == FUSED
    plain = batch_layers.functional.layer_norm(merged.requires_grad_(), (16,), layout=layout)
    assert type(plain.grad_fn).__name__ != FUSED


def test_the_table_takes_the_kernels_on_cuda_only_where_they_apply(monkeypatch) -> None:
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    vit = NormCall(True, torch.float32, 192)
    assert choose(OP, vit, NORM_OPS).name == "triton-norm-affine"
    assert choose(OP, NormCall(True, torch.bfloat16, 8192), NORM_OPS).name == "triton-norm-affine"
    for call in (NormCall(False, torch.float32, 192), NormCall(True, torch.float64, 192),
                 NormCall(True, torch.float32, 8193), NormCall(True, torch.float32, 192, compiling=True),
                 NormCall(True, torch.float32, 192, transformed=True),
                 NormCall(True, torch.float32, 192, contiguous=False),
                 NormCall(True, torch.float32, 192, rms=True, autocast=True)):
        assert choose(OP, call, NORM_OPS).name == "aten", call
    with torchmb_config.use("triton", False):
        assert choose(OP, vit, NORM_OPS).name == "aten"
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", False)
    assert choose(OP, vit, NORM_OPS).name == "aten"


def test_explain_names_the_kernel_and_every_unmet_condition(monkeypatch) -> None:
    monkeypatch.setattr(_kernel_table, "TRITON_INSTALLED", True)
    text = explain_norm_kernels(cuda=True, dtype=torch.float32, features=192)
    assert text.startswith(f"{OP}: triton-norm-affine (") and "not " not in text
    text = explain_norm_kernels(cuda=False, dtype=torch.float32, features=192)
    assert f"{OP}: aten" in text and "not triton-norm-affine: needs a CUDA tensor" in text
    text = explain_norm_kernels(cuda=True, dtype=torch.float32, features=192, compiling=True)
    assert "needs not traced by torch.compile" in text
    with torchmb_config.use("triton", False):
        assert "the 'triton' switch on" in explain_norm_kernels(cuda=True, dtype=torch.float32, features=192)
    monkeypatch.setitem(_norm_table.TRITON_NORM.limits, "max_features", 128)
    assert "at most 128 normalised features" in explain_norm_kernels(cuda=True, dtype=torch.float32, features=192)


def test_a_cpu_norm_and_a_compiled_one_keep_the_composite() -> None:
    """On CPU tensors the functional norms never reach the kernels (nor import Triton); under torch.compile
    the call value says it is traced."""
    layout = Layout(B, "models")
    weight = torch.randn(B, 16, requires_grad=True)
    y = batch_layers.functional.layer_norm(torch.randn(B * N, 16), (16,), weight, layout=layout)
    assert type(y.grad_fn).__name__ != FUSED
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        seen.append(NormCall.of(x, 16, False))
        return x + 1

    traced(torch.randn(2, 16))
    assert seen[0].compiling and not NormCall.of(torch.randn(2, 16), 16, False).compiling


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_compiled_norm_traces_the_composite_without_graph_breaks(where: str) -> None:
    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    plain = _plain("layer", (32,), where, torch.float32)
    batched = _batched(plain, "models")
    merged = torch.randn(B * N, TOKENS, 32, device=where, requires_grad=True)
    y = torch.compile(batched, fullgraph=True, backend="aot_eager")(merged)
    (y * y).sum().backward()
    for i, model in enumerate(plain):
        own = merged.detach().view(B, N, TOKENS, 32)[i].requires_grad_()
        y_own = model(own)
        (y_own * y_own).sum().backward()
        torch.testing.assert_close(y.view(B, N, TOKENS, 32)[i], y_own, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged.grad.view(B, N, TOKENS, 32)[i], own.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched.weight.grad[i], model.weight.grad, atol=1e-4, rtol=1e-5)


def test_the_call_sees_an_rms_norm_under_autocast() -> None:
    x = torch.randn(2, 16)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        assert NormCall.of(x, 16, True).autocast
    assert not NormCall.of(x, 16, True).autocast


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward AD's own
def test_torch_func_transforms_and_forward_mode_ad_keep_the_composite() -> None:
    """The kernels have neither a batching rule nor a jvp: under ``torch.func`` transforms and forward-mode AD
    the call says so (and the table then chooses the composite, as tested above)."""
    x = torch.randn(2, 16)
    assert not NormCall.of(x, 16, False).transformed
    seen = []
    torch.func.vmap(lambda row: seen.append(NormCall.of(row, 16, False)) or row)(x)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        seen.append(NormCall.of(dual, 16, False))
    assert [call.transformed for call in seen] == [True, True]
