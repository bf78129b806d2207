"""What the compiled-model tests share: the warnings torch raises about its own code while dynamo and Inductor
run, and a dynamo reset around each test (so one test's graphs and recompile counts do not reach the next)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch._dynamo

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
