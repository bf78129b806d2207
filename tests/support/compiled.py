"""What the compiled-model tests share: the warnings torch raises about its own code while dynamo and Inductor
run, a dynamo reset around each test (so one test's graphs and recompile counts do not reach the next), and the
kernel table's compiled choices made on the CPU as on a GPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch._dynamo
from functorch.compile import make_boxed_func
from torch import Tensor, fx, nn
from torch._functorch.aot_autograd import aot_module_simplified

from batch_layers import _kernel_table

# dynamo instantiates the custom autograd Functions it traces and reads .grad of the non-leaf tensors it resumes
# with after a graph break; Inductor's start-up uses torch.jit.script_method
DYNAMO_WARNINGS = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """dynamo's caches and counters reset before and after the test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The kernel table's compiled products, whose conditions gpu_conditions_lifted lifts for a zoo model's compiled
# graph on the CPU
COMPILED_PRODUCTS = (_kernel_table.MATMUL, _kernel_table.POINTWISE, _kernel_table.PATCHES,
                     _kernel_table.WIDE_CHANNELS_LAST, _kernel_table.DEPTHWISE_CHANNELS_LAST)


def gpu_conditions_lifted(monkeypatch: pytest.MonkeyPatch, candidates: Sequence[_kernel_table.Candidate]) -> None:
    """The ``candidates``' conditions without "a CUDA tensor" and the GPU's float types: the CPU takes a GPU's
    compiled paths, in float64 too."""
    lifted = ("a CUDA tensor", "float32, float16 or bfloat16")
    for candidate in candidates:
        monkeypatch.setattr(candidate, "conditions", tuple(c for c in candidate.conditions if c[0] not in lifted))


def aot_graphs_backend(inspect: Callable[[fx.GraphModule], None]) -> Callable:
    """A ``torch.compile`` backend that hands each graph AOTAutograd makes (ATen operators, after
    functionalisation and decompositions) to ``inspect``, then runs it eagerly: the forward graph, and the
    backward graph when a backward first runs."""

    def backend(graph_module, example_inputs):
        def compiler(graph, _):
            inspect(graph)
            return make_boxed_func(graph.forward)

        return aot_module_simplified(graph_module, example_inputs, fw_compiler=compiler, bw_compiler=compiler)

    return backend


def assert_two_steps_match_plain(compiled: Callable[[Tensor], Tensor], batched: nn.Module, plain: Sequence[nn.Module],
                                 x: Tensor) -> None:
    """Two training steps (a second: the first forward checks the model's code) of the ``compiled`` form of
    ``batched`` on the ``(B, n, ...)`` ``x`` against the B ``plain`` models it was made from, each on its own
    samples: the last outputs and every parameter's summed gradient."""
    for _ in range(2):
        y = compiled(x)
        y.square().sum().backward()
    for b, model in enumerate(plain):
        for _ in range(2):
            expected = model(x[b])
            expected.square().sum().backward()
        torch.testing.assert_close(y[b], expected)
        for (name, own), stacked in zip(model.named_parameters(), batched.parameters()):
            torch.testing.assert_close(stacked.grad[b], own.grad, msg=lambda m, name=name: f"{name}: {m}")
