"""Host work per training step: the operators a BatchModule step dispatches against the plain model's.

A small model's step is bound by the host: each operator that computes (not a view) is a kernel launch
on a GPU. Counted on CPU with a dispatch mode, for one SGD step (forward, summed cross-entropy,
backward, ``torch.optim.SGD``) of B=64 models against one plain model on the same B*n samples.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from support.models import MLP, LeNet
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchmb import BatchModule

B, N = 64, 2
NOT_LAUNCHES = {"aten::_unsafe_view", "profiler::_record_function_enter_new", "profiler::_record_function_exit"}


class _CountLaunches(TorchDispatchMode):
    """Counts the operators that compute: views and the profiler's markers launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.name() not in NOT_LAUNCHES:
            self.launches[func.name()] += 1
        return func(*args, **(kwargs or {}))


def _launches_per_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classes: int) -> collections.Counter:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        F.cross_entropy(out.reshape(-1, classes), y.reshape(-1), reduction="sum").backward()
        optimizer.step()

    step()  # the first step creates state (and settles the merged order): not a steady step
    with _CountLaunches() as counter:
        step()
    return counter.launches


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "mlp": (MLP, (12,), 5),
    "lenet": (LeNet, (1, 28, 28), 10),
}


@pytest.mark.parametrize("name", CASES)
def test_a_batched_step_launches_at_most_one_and_a_half_times_the_plain_model(name: str) -> None:
    make, shape, classes = CASES[name]
    torch.manual_seed(0)
    x, y = torch.randn(B, N, *shape), torch.randint(0, classes, (B, N))
    batched = _launches_per_step(BatchModule(make(), B), x, y, classes)
    plain = _launches_per_step(make(), x.reshape(B * N, *shape), y.reshape(-1), classes)
    ratio = sum(batched.values()) / sum(plain.values())
    assert ratio <= 1.5, (ratio, batched - plain)
