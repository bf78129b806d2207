"""``torch.compile`` of a BatchModule and of a whole training step: no graph breaks inside the forward of a
model made of registered layers, and the numbers eager torchmb gives.

Compiling is slow on a CPU: the models are tiny, most tests use the ``aot_eager`` backend (dynamo and
AOTAutograd, which is where graph breaks and tracing errors show) and one uses Inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from support.compiled import DYNAMO_WARNINGS, fresh_dynamo  # noqa: F401 (a fixture)
from support.models import MLP, BatchNormCNN, LayerScaleBlock, LeNet, check_like_seeded_plain_models
from support.resnet import ResNet18
from support.transformer import TransformerLM
from torch import nn

import batch_layers
import torchmb
from torchmb import BatchModule

B, N = 2, 3
# on a GPU Inductor advises TF32 (which the conftest keeps off, for comparisons at fp32 tolerances)
pytestmark = [
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning"),
    *DYNAMO_WARNINGS,
    pytest.mark.usefixtures("fresh_dynamo"),
]

FULLGRAPH_CASES = {
    "mlp": (MLP, lambda: torch.randn(B, N, 12)),
    "lenet": (LeNet, lambda: torch.randn(B, N, 1, 28, 28)),
    "resnet": (lambda: ResNet18(width=2), lambda: torch.randn(B, N, 3, 8, 8)),
    "transformer": (lambda: TransformerLM(num_layers=1), lambda: torch.randint(0, 23, (B, N, 5))),
}


def _output_and_grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = module(x)
    out.square().sum().backward()
    return [out.detach(), *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("name", FULLGRAPH_CASES)
def test_forward_compiles_in_one_graph_with_eager_numbers(name: str) -> None:
    make, make_input = FULLGRAPH_CASES[name]
    torch.manual_seed(0)
    batched = BatchModule(make(), B, init="independent", seed=0)
    reference = copy.deepcopy(batched)
    x = make_input()
    compiled = torch.compile(batched, backend="aot_eager", fullgraph=True)
    for got, want in zip(_output_and_grads(compiled, x), _output_and_grads(reference, x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for got, want in zip(batched.buffers(), reference.buffers(), strict=True):  # running statistics updated once
        torch.testing.assert_close(got, want)
    assert batched.merged_order == reference.merged_order


def test_inductor_trains_lenet_like_eager() -> None:
    torch.manual_seed(0)
    batched = BatchModule(LeNet(), B, init="independent", seed=0)
    reference = copy.deepcopy(batched)
    x = torch.randn(B, N, 1, 28, 28)
    compiled = torch.compile(batched, backend="inductor", fullgraph=True)
    for got, want in zip(_output_and_grads(compiled, x), _output_and_grads(reference, x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class _PerPixelLinear(nn.Module):
    """A BatchNorm'd convolution whose spatial dims are then merged into dim 0: only models-major keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.mix = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv(x))
        n, c, h, w = y.shape
        return self.mix(y.permute(0, 2, 3, 1).reshape(-1, c)).view(n, h, w, 2)


@pytest.mark.parametrize(("make", "order"), [(_PerPixelLinear, "models"), (BatchNormCNN, "samples")])
def test_compiling_settles_the_order_once_as_eager_does(make, order: str) -> None:
    """The first compiled call's checks (a dry run) settle ``auto``'s order before dynamo traces: the graph
    is traced once, in that order, and the buffers are updated once per call."""
    torch.manual_seed(0)
    batched = BatchModule(make(), B)
    reference = copy.deepcopy(batched)
    assert batched.merged_order == "models"
    x = torch.randn(B, N, 3, 4, 4)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(batched, backend=counter, fullgraph=True)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), reference(x))
        assert batched.merged_order == reference.merged_order == order
    for got, want in zip(batched.buffers(), reference.buffers(), strict=True):  # updated three times, not four
        torch.testing.assert_close(got, want)
    assert counter.frame_count == 1  # traced once, in the settled order, and never retraced
    assert all(m.merged_order == order for m in batched.modules() if isinstance(m, batch_layers.AbstractBatchModule))


class _BreaksGraph(nn.Module):
    """Breaks dynamo's graph between its layers (as data-dependent Python would), then may raise."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.first = nn.Linear(5, 8)
        self.second = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch._dynamo.graph_break()
        if self.fail:
            raise RuntimeError("the model failed")
        return self.second(h)


def test_the_forward_context_survives_a_graph_break_and_an_error() -> None:
    torch.manual_seed(0)
    batched = BatchModule(_BreaksGraph(), B, init="independent", seed=0)
    reference = copy.deepcopy(batched)
    x = torch.randn(N, 5)  # shared input: the second layer must still know it is shared
    compiled = torch.compile(batched, backend="aot_eager")
    torch.testing.assert_close(compiled(x, shared_input=True), reference(x, shared_input=True))
    failing = torch.compile(BatchModule(_BreaksGraph(fail=True), B), backend="aot_eager")
    with pytest.raises(RuntimeError, match="the model failed"):
        failing(torch.randn(B, N, 5))
    assert batch_layers.current_forward() is None


class _LayerScaleBreaksGraph(LayerScaleBlock):
    """A layer scale read after a graph break: dynamo resumes inside the forward of a module whose own
    parameters are broadcast per model (timm's ConvNeXt block, where a depthwise kernel broke the graph)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        torch._dynamo.graph_break()
        return y.mul(self.gamma.reshape(1, -1, 1, 1)) + self.shift + x


def test_a_graph_break_inside_a_broadcast_own_module_compiles_like_plain_models() -> None:
    batched = BatchModule.from_factory(_LayerScaleBreaksGraph, B, seed=0)
    assert batched.conversion_report()[0].path == "broadcast-own"
    x = torch.randn(B, N, 4, 5, 5)
    out = torch.compile(batched, backend="aot_eager")(x)
    out.square().sum().backward()
    assert type(batched.module.gamma) is nn.Parameter and batched.module.gamma.shape == (B, 4)
    check_like_seeded_plain_models(_LayerScaleBreaksGraph, batched, x, out)


@pytest.mark.parametrize("entered_compiling", [False, True], ids=["entered-eagerly", "entered-compiling"])
def test_a_forward_scope_is_left_from_the_store_it_entered(monkeypatch, entered_compiling: bool) -> None:
    """Across a graph break a scope may be entered eagerly and left while dynamo compiles, or the reverse:
    it is left from the store it was entered in (before: ``AttributeError: ... no attribute 'token'``)."""
    outer = batch_layers.ForwardContext(B, 1)
    inner = batch_layers.ForwardContext(B, N)
    with batch_layers.forward_context(outer):
        scope = batch_layers.forward_context(inner)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: entered_compiling)
        assert scope.__enter__() is inner
        assert batch_layers.current_forward() is inner
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: not entered_compiling)
        scope.__exit__(None, None, None)
        monkeypatch.undo()
        assert batch_layers.current_forward() is outer
    assert batch_layers.current_forward() is None


@pytest.mark.parametrize("optimizer", [torchmb.optim.SGD, torchmb.optim.Adam])
def test_compiled_training_step_matches_eager(optimizer) -> None:
    """Forward, ``batch_loss``, backward and a ``torchmb.optim`` step in one compiled function."""
    torch.manual_seed(0)
    batched = BatchModule(BatchNormCNN(), B, init="independent", seed=0)
    eager = copy.deepcopy(batched)
    kwargs = {"lr": [0.1, 0.01]} | ({"momentum": 0.9} if optimizer is torchmb.optim.SGD else {})
    optimizers = {id(m): optimizer(m.parameters(), **kwargs) for m in (batched, eager)}

    def step(model: BatchModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt = optimizers[id(model)]
        opt.zero_grad(set_to_none=True)
        losses = torchmb.batch_loss(model(x), y, loss_fn=F.cross_entropy)
        losses.sum().backward()
        opt.step()
        return losses.detach()

    compiled_step = torch.compile(step, backend="aot_eager")
    for _ in range(3):
        x, y = torch.randn(B, N, 3, 8, 8), torch.randint(0, 4, (B, N))
        torch.testing.assert_close(compiled_step(batched, x, y), step(eager, x, y))
    for got, want in zip(batched.state_dict().values(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["mlp", "lenet"])
# torch 2.11's CUDA-graph trees warn that a captured graph is empty here (not investigated; the numbers match eager)
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_reduce_overhead_trains_like_eager_on_cuda(name: str) -> None:
    make, make_input = FULLGRAPH_CASES[name]
    torch.manual_seed(0)
    batched = BatchModule(make(), B, init="independent", seed=0).cuda()
    reference = copy.deepcopy(batched)
    compiled = torch.compile(batched, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # the first calls record, later ones replay the CUDA graph
        x = make_input().cuda()
        for p in (*batched.parameters(), *reference.parameters()):
            p.grad = None
        for got, want in zip(_output_and_grads(compiled, x), _output_and_grads(reference, x), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.cuda
def test_cupy_embedding_kernels_run_as_operators_in_a_compiled_graph() -> None:
    pytest.importorskip("cupy")
    make, make_input = FULLGRAPH_CASES["transformer"]
    torch.manual_seed(0)
    batched = BatchModule(make(), B, init="independent", seed=0).cuda()
    reference = copy.deepcopy(batched)
    x = make_input().cuda()
    compiled = torch.compile(batched, fullgraph=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, acc_events=True) as profile:
        got = _output_and_grads(compiled, x)
    for got_tensor, want in zip(got, _output_and_grads(reference, x), strict=True):
        torch.testing.assert_close(got_tensor, want, atol=1e-5, rtol=1e-4)
    ran = {event.key for event in profile.key_averages()}
    assert {"torchmb::embedding_gather", "torchmb::embedding_scatter"} <= ran
