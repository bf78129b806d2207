"""What a compiled training step keeps for its backward, against the plain model's on all B*n samples: the kernel
table's compiled products must not keep more than the B models' own weights and activations (a product whose
filters hold a block per pixel pair kept 16 blocks, 12 of them zeros, of every 1x1 layer on 2x2 images)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from support.compiled import COMPILED_PRODUCTS, DYNAMO_WARNINGS, fresh_dynamo, gpu_conditions_lifted
from support.torchvision_ops import import_torchvision
from torch import nn
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition

from torchmb import BatchModule
from torchmb.cli.bench_zoo import ZOO_MODELS

pytestmark = DYNAMO_WARNINGS

__all__ = ["fresh_dynamo"]  # a fixture the compiled tests use

BATCH, SAMPLES = 2, 2


def saved_for_backward(model: nn.Module, x: torch.Tensor) -> list[int]:
    """The element counts of the tensors one compiled training step of ``model`` keeps for its backward, split
    from the forward as Inductor splits it (AOTAutograd's min-cut partition)."""
    saved = []

    def backward_compiler(graph, inputs):
        for node in graph.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and not node.name.startswith("tangents") and isinstance(value, torch.Tensor):
                saved.append(value.numel())
        return make_boxed_func(graph.forward)

    def backend(graph_module, example_inputs):
        return aot_module_simplified(graph_module, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     bw_compiler=backward_compiler, partition_fn=min_cut_rematerialization_partition)

    compiled = torch.compile(model, backend=backend, dynamic=False)
    for _ in range(2):  # the first forward checks the model's code
        compiled(x).sum().backward()
    return saved


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", ["timm-convnext_atto", "tv-efficientnet_b0", "tv-regnet_x_400mf", "tv-resnet18"])
def test_a_compiled_model_keeps_what_b_plain_models_keep(monkeypatch, name: str) -> None:
    """A zoo model on 32x32 images, compiled with the GPU's choices (its 1x1 layers on 2x2 images as the pointwise
    product, ResNet's strided layers as products of patches): no tensor kept for the backward is larger than the
    plain model's largest on all B*n samples or the B models' largest stacked weight; all together at most the
    plain step's plus B - 1 more copies of the weights, and a tenth for the products' layout copies (some
    filters kept transposed as well: 1.01-1.09x at this size)."""
    gpu_conditions_lifted(monkeypatch, COMPILED_PRODUCTS)
    import_torchvision()  # timm imports torchvision
    torch.manual_seed(0)
    model = ZOO_MODELS[name][0]()
    weights = sum(p.numel() for p in model.parameters())
    largest_weight = max(p.numel() for p in model.parameters())
    x = torch.randn(BATCH, SAMPLES, 3, 32, 32)
    plain = saved_for_backward(model, x.flatten(0, 1))
    torch._dynamo.reset()
    batched = saved_for_backward(BatchModule(model, BATCH), x)
    assert max(batched) <= max(max(plain), BATCH * largest_weight), (max(batched), max(plain))
    assert sum(batched) <= 1.1 * (sum(plain) + (BATCH - 1) * weights), (sum(batched), sum(plain), weights)
