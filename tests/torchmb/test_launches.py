"""Host work per training step: the operators a BatchModule step dispatches against the plain model's.

A small model's step is bound by the host: each operator that computes (not a view) is a kernel launch
on a GPU. Counted on CPU with a dispatch mode, for one SGD step (forward, summed cross-entropy,
backward, ``torch.optim.SGD``) of B=64 models against one plain model on the same B*n samples.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.launches import CopySizes, count_launches, sgd_step
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


def _in_place_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)
    )


def _group_norm_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(4, 3),
    )


# The operators autograd adds where a layer's output is a view or its affine an addcmul, unlike the plain
# layer's: copies of the gradient where an in-place op (a ReLU(inplace=True), a residual +=) writes into a
# view (CopySlices, AsStridedBackward0), and addcmul's backward product by its ``value`` of 1.
LAYOUT_OPERATORS = ("aten::copy_", "aten::new_empty_strided", "aten::new_zeros", "aten::mul.Scalar")


@pytest.mark.parametrize(
    ("make", "shape", "classes", "order"),
    [
        (_in_place_resnet, (4, 6, 6), 3, "samples"),
        (_in_place_mlp, (6,), 3, "models"),
        (_group_norm_cnn, (3, 6, 6), 3, "models"),
    ],
    ids=["resnet-samples-major", "mlp-models-major", "group-norm-cnn-models-major"],
)
def test_a_step_dispatches_no_more_copies_than_the_plain_model(make, shape, classes, order) -> None:
    torch.manual_seed(0)
    batch, samples = 4, 2
    x, y = torch.randn(batch, samples, *shape), torch.randint(0, classes, (batch, samples))
    batched = count_launches(sgd_step(BatchModule(make(), batch, merged_order=order), x, y, classes))
    plain = count_launches(sgd_step(make(), x.reshape(batch * samples, *shape), y.reshape(-1), classes))
    extra = {op: batched[op] - plain[op] for op in LAYOUT_OPERATORS if batched[op] > plain[op]}
    assert not extra, (extra, batched - plain)


def test_a_shared_input_step_copies_no_buffer() -> None:
    """Every shared-input forward runs under the tracker that recognises the shared tensors; only the forwards
    that also check the model's code (the first) may run again, and only they need the buffers copied to
    restore them: a ResNet-18's steady shared-input step cloned its 60 batch-norm buffers (20% of its kernels)."""
    torch.manual_seed(0)
    batched = BatchModule(_in_place_resnet(), 4)
    x, y = torch.randn(2, 4, 6, 6), torch.randint(0, 3, (4, 2))
    optimizer = torch.optim.SGD(batched.parameters(), lr=0.01)
    buffers = {buffer.untyped_storage().data_ptr() for buffer in batched.buffers()}
    assert len(buffers) == 12  # four batch norms' running statistics and counts
    for step in range(3):
        with CopySizes() as copies:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(batched(x, shared_input=True).reshape(-1, 3), y.reshape(-1))
            loss.backward()
            optimizer.step()
        assert bool(copies.read & buffers) == (step == 0), step  # the first forward checks, and may run again
