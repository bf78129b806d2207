"""The views a compiled samples-major step moves the model axis with: each a split or a merge of dims, never one
view that regroups dims 0 and 1 at once (``(n, B*C, ...)`` to ``(n*B, C, ...)``). Inductor indexes such a view
through the flattened index and nests those expressions from layer to layer; simplifying them took most of a
zoo model's compile time (MobileNetV3 at B=16 on an H200: 188 seconds to compile, 112 with the views apart)."""

from __future__ import annotations

import math

import pytest
import torch
from support.compiled import (
    COMPILED_PRODUCTS,
    DYNAMO_WARNINGS,
    aot_graphs_backend,
    assert_two_steps_match_plain,
    fresh_dynamo,
    gpu_conditions_lifted,
)
from support.torchvision_ops import import_torchvision
from support.zoo import without_randomness
from torch import fx

from torchmb import BatchModule
from torchmb.cli.bench_zoo import ZOO_MODELS

pytestmark = DYNAMO_WARNINGS

__all__ = ["fresh_dynamo"]  # a fixture the compiled tests use

BATCH, SAMPLES = 3, 4


def regrouping_views(graph: fx.GraphModule) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The ``(input shape, output shape)`` of each view in ``graph`` between a samples-major merged activation
    ``(n*B, C, ...)`` and its grouped ``(n, B*C, ...)`` in one step."""
    found = []
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target not in (torch.ops.aten.view.default,
                                                             torch.ops.aten._unsafe_view.default):
            continue
        before, after = tuple(node.args[0].meta["val"].shape), tuple(node.meta["val"].shape)
        if (len(before) == len(after) >= 3 and {before[0], after[0]} == {SAMPLES, SAMPLES * BATCH}
                and math.prod(before[:2]) == math.prod(after[:2]) and before[2:] == after[2:]):
            found.append((before, after))
    return found


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", ["tv-mobilenet_v3_small", "tv-efficientnet_b0", "tv-resnet18", "tv-regnet_x_400mf"])
def test_a_compiled_samples_major_step_moves_the_model_axis_by_splits_and_merges(monkeypatch, name: str) -> None:
    """A zoo model on 64x64 images (its batch norms see at least 16 values a channel), samples-major, compiled
    with the GPU's choices: no view of its forward or backward graph regroups dims 0 and 1 at once, and two
    training steps match B plain copies'."""
    gpu_conditions_lifted(monkeypatch, COMPILED_PRODUCTS)
    import_torchvision()
    torch.manual_seed(0)
    plain = [without_randomness(ZOO_MODELS[name][0]().double()) for _ in range(BATCH)]
    models = iter(plain)
    batched = BatchModule.from_factory(lambda: next(models), BATCH, merged_order="samples")
    graphs: list[fx.GraphModule] = []
    compiled = torch.compile(batched, backend=aot_graphs_backend(graphs.append), dynamic=False)
    x = torch.randn(BATCH, SAMPLES, 3, 64, 64, dtype=torch.float64)
    assert_two_steps_match_plain(compiled, batched, plain, x)
    assert len(graphs) == 2, "one forward and one backward graph"
    assert [regrouping_views(graph) for graph in graphs] == [[], []]
