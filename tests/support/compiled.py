"""What the compiled-model tests share: the warnings torch raises about its own code while dynamo and Inductor
run, and a dynamo reset around each test (so one test's graphs and recompile counts do not reach the next)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch._dynamo
from torch import Tensor, nn

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
