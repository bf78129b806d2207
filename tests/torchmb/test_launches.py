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


class _InPlaceBlock(nn.Module):
    """torchvision's BasicBlock habits: a ReLU(inplace=True) on each batch norm's output and a residual
    ``+=`` into the second's."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def _in_place_resnet() -> nn.Module:
    return nn.Sequential(_InPlaceBlock(4), _InPlaceBlock(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _pre_norm_mlp() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3))


# The operators autograd adds where a step's tensors are laid out or combined differently from the plain
# model's: copies of a gradient (an in-place op on a view: CopySlices, AsStridedBackward0) and a product by
# addcmul's ``value`` of 1 (its backward).
LAYOUT_OPERATORS = ("aten::copy_", "aten::new_empty_strided", "aten::new_zeros", "aten::mul.Scalar")


@pytest.mark.parametrize(
    ("make", "shape", "classes", "order"),
    [(_in_place_resnet, (4, 6, 6), 3, "samples"), (_pre_norm_mlp, (6,), 3, "models")],
    ids=["in-place-resnet-samples-major", "pre-norm-mlp-models-major"],
)
def test_a_step_dispatches_no_more_copies_than_the_plain_model(make, shape, classes, order) -> None:
    torch.manual_seed(0)
    batch, samples = 4, 2
    x, y = torch.randn(batch, samples, *shape), torch.randint(0, classes, (batch, samples))
    batched = count_launches(sgd_step(BatchModule(make(), batch, merged_order=order), x, y, classes))
    plain = count_launches(sgd_step(make(), x.reshape(batch * samples, *shape), y.reshape(-1), classes))
    extra = {op: batched[op] - plain[op] for op in LAYOUT_OPERATORS if batched[op] > plain[op]}
    assert not extra, (extra, batched - plain)
