"""Host work per training step: the operators a BatchModule step dispatches against the plain model's.

A small model's step is bound by the host: each operator that computes (not a view) is a kernel launch
on a GPU. Counted on CPU with a dispatch mode, for one SGD step (forward, summed cross-entropy,
backward, ``torch.optim.SGD``) of B=64 models against one plain model on the same B*n samples.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.launches import count_launches, sgd_step
from support.models import MLP, LeNet
from torch import nn

from torchmb import BatchModule

B, N = 64, 2


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "mlp": (MLP, (12,), 5),
    "lenet": (LeNet, (1, 28, 28), 10),
}


@pytest.mark.parametrize("name", CASES)
def test_a_batched_step_launches_at_most_one_and_a_half_times_the_plain_model(name: str) -> None:
    make, shape, classes = CASES[name]
    torch.manual_seed(0)
    x, y = torch.randn(B, N, *shape), torch.randint(0, classes, (B, N))
    batched = count_launches(sgd_step(BatchModule(make(), B), x, y, classes))
    plain = count_launches(sgd_step(make(), x.reshape(B * N, *shape), y.reshape(-1), classes))
    ratio = sum(batched.values()) / sum(plain.values())
    assert ratio <= 1.5, (ratio, batched - plain)
