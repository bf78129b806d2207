"""``torch.compile`` of real models: a compiled BatchModule of timm's ConvNeXt, torchvision's ResNet-18 and
ViTs trains like the eager one and like B plain models, traced once (no recompiles) and without graph breaks;
a model with a per-model region compiles with the region run eagerly.

Compiling real models is slow on a CPU (tens of seconds each under load): those tests are slow, and the
default run compiles a layer-scale block, a tiny torchvision ViT (its class token on the merged axis) and a
tiny timm ViT whose root runs as a region.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from support.compiled import DYNAMO_WARNINGS, fresh_dynamo  # noqa: F401 (a fixture)
from support.models import LayerScaleBlock
from support.torchvision_ops import import_torchvision
from support.zoo import TIMM_MODELS, TORCHVISION_MODELS, ZooModel, float64, without_randomness
from torch import Tensor, nn

from torchmb import BatchModule

B, N = 2, 2
pytestmark = [*DYNAMO_WARNINGS, pytest.mark.usefixtures("fresh_dynamo")]


def _zoo(name: str) -> ZooModel:
    return next(entry for entry in TIMM_MODELS + TORCHVISION_MODELS if entry.name == name)


def _sgd_step(model: nn.Module, x: Tensor, losses) -> Tensor:
    for p in model.parameters():
        p.grad = None
    out = model(x)
    losses(out).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
    return out.detach()


def _trains_like_eager_and_plain(make, x: Tensor, atol: float = 1e-8, rtol: float = 1e-6) -> None:
    """Two SGD steps of the compiled BatchModule against the eager one and against B plain models: outputs each
    step, parameters after; the second step compiles nothing."""
    plain = [make() for _ in range(B)]
    batched = BatchModule(make(), B)
    batched.load_state_dicts([model.state_dict() for model in plain])
    eager = copy.deepcopy(batched)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(batched, backend=counter)

    def losses(out: Tensor) -> Tensor:
        return out.square().mean(dim=tuple(range(1, out.dim()))).sum()  # each model's mean square, summed

    frames = []
    for _ in range(2):
        got = _sgd_step(compiled, x, losses)
        frames.append(counter.frame_count)
        torch.testing.assert_close(got, _sgd_step(eager, x, losses), atol=atol, rtol=rtol)
        for i, model in enumerate(plain):
            want = _sgd_step(model, x[i], lambda out: out.square().mean())
            torch.testing.assert_close(got[i], want, atol=atol, rtol=rtol)
    for i, model in enumerate(plain):
        for (key, want), got in zip(model.state_dict().items(), batched.state_dicts()[i].values(), strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=key)
    assert frames[0] == frames[1]  # traced once: no recompile in the second step


def test_a_layer_scale_block_compiles_in_one_graph_and_trains_like_plain_models() -> None:
    torch.manual_seed(0)
    x = torch.randn(B, N, 4, 5, 5, dtype=torch.float64)
    _trains_like_eager_and_plain(lambda: LayerScaleBlock().double(), x)
    explained = torch._dynamo.explain(BatchModule(LayerScaleBlock(), B))(x.float())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_a_vit_with_its_class_token_compiles_in_one_graph_and_trains_like_plain_models() -> None:
    """torchvision's ViT: the root's class_token, expanded to the data's rows, is an operand of the graph
    (the root had been a region, all of it run eagerly under torch.compile)."""
    entry = _zoo("vit_b_16")
    torch.manual_seed(0)
    x = torch.randn(B, N, 3, entry.size, entry.size, dtype=torch.float64)
    _trains_like_eager_and_plain(lambda: float64(without_randomness(entry.build())), x)
    explained = torch._dynamo.explain(BatchModule(without_randomness(entry.build()), B))(x.float())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_region_runs_eagerly_inside_a_compiled_model() -> None:
    """timm's ViT resampling its positions (``dynamic_img_size``): the root is a region, under vmap; dynamo
    compiles around it once, the region one graph break."""
    import_torchvision()  # timm imports torchvision
    import timm

    def make() -> nn.Module:
        return timm.create_model(
            "vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1, embed_dim=16, num_heads=2,
            dynamic_img_size=True,
        )  # fmt: skip

    torch.manual_seed(0)
    x = torch.randn(B, N, 3, 16, 16, dtype=torch.float64)
    _trains_like_eager_and_plain(lambda: make().double(), x)
    explained = torch._dynamo.explain(BatchModule(make(), B))(x.float())
    assert explained.graph_break_count == 1
    assert "torch.compiler.disable" in str(explained.break_reasons[0].reason)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["convnext_atto", "resnet18", "vit_tiny_patch16_224"])
def test_a_compiled_zoo_model_trains_like_eager_and_plain_models(name: str) -> None:
    entry = _zoo(name)
    torch.manual_seed(0)
    x = torch.randn(B, N, 3, entry.size, entry.size, dtype=torch.float64)
    _trains_like_eager_and_plain(lambda: float64(without_randomness(entry.build())), x)
    explained = torch._dynamo.explain(BatchModule(without_randomness(entry.build()), B))(x.float())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["convnext_atto", "resnet18", "vit_tiny_patch16_224"])
def test_a_zoo_model_compiles_on_cuda_in_one_graph(name: str) -> None:
    """On CUDA other kernels are chosen, and the GPU machine runs an older torch than CI: there timm's
    ConvNeXt broke the graph at every LayerNorm2d and then failed resuming inside its blocks."""
    entry = _zoo(name)
    torch.manual_seed(0)
    batched = BatchModule(without_randomness(entry.build()), B).cuda()
    explained = torch._dynamo.explain(batched)(torch.randn(B, N, 3, entry.size, entry.size, device="cuda"))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow
def test_convnext_compiles_under_bf16_autocast_without_recompiles() -> None:
    """The issue's case, on a CPU: timm's ConvNeXt under bf16 autocast, Inductor; two steps, traced once."""
    entry = _zoo("convnext_atto")
    torch.manual_seed(0)
    batched = BatchModule(without_randomness(entry.build()), B)
    eager = copy.deepcopy(batched)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(batched, backend=counter)
    x = torch.randn(B, N, 3, entry.size, entry.size)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = compiled(x), eager(x)
        got.float().square().mean().backward()
        torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)
    assert counter.frame_count == 1
