"""A read of a batched layer's stacked per-model tensor that neither the source reader nor the first forward
saw (a helper function reached only in eval mode) raises at run time, outside ``torchmb.testing`` too; reads
of what every model shares, and the reads torchmb runs per model, pass."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent

B, N = 3, 5
DOUBLE = dict(atol=1e-9, rtol=1e-9)


def normed(module: nn.Module, h: Tensor) -> Tensor:
    return h / module.fc.weight.norm()


class EvalNormed(nn.Module):
    """Normalises by its child's weight in eval mode only, in a helper function the source reader does not
    follow: the first forward (in training) never reaches the read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h if self.training else normed(self, h)


def test_a_read_missed_at_conversion_and_first_forward_raises_later() -> None:
    batched = BatchModule.from_factory(EvalNormed, B, seed=0)
    x = torch.randn(B, N, 4)
    batched(x)
    assert [entry.path for entry in batched.conversion_report()] == ["passthrough", "registered"]
    batched.eval()
    with pytest.raises(
        batch_layers.StackedReadError,
        match=r"normed \(.*test_stacked_reads.py:\d+\) reads weight of Linear\(batch=3\), a tensor holding every "
        r"model's weight stacked \(3, 4, 4\)",
    ):
        batched(x)
    assert batched.module.fc.weight.shape == (B, 4, 4)  # outside a forward, reads are the user's


def shared_metadata(module: nn.Module, h: Tensor) -> Tensor:
    h = h.to(module.fc.weight.dtype).to(module.fc.weight.device)
    return h if module.fc.bias is None else h * 2


class EvalCast(EvalNormed):
    """Reads only what every model shares (dtype, device, whether a bias exists) in a later branch."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h if self.training else shared_metadata(self, h)


def test_reads_of_what_every_model_shares_pass() -> None:
    assert_equivalent(lambda: EvalCast().double(), B, torch.randn(B, N, 4, dtype=torch.float64), steps=2,
                      train=False, **DOUBLE)
    batched = BatchModule.from_factory(EvalCast, B, seed=0)
    batched(torch.randn(B, N, 4))
    batched.eval()
    batched(torch.randn(B, N, 4))


def test_a_read_seen_in_the_first_forward_runs_per_model() -> None:
    """The same helper reached in the first forward: the tracker runs the parent per model instead."""
    model = EvalNormed().double().eval()
    batched = BatchModule(model, B)
    batched(torch.randn(B, N, 4, dtype=torch.float64))
    (root,) = [entry for entry in batched.conversion_report() if entry.name == ""]
    assert root.path == "generic-own" and "reads fc.weight" in root.reason
    assert_equivalent(lambda: EvalNormed().double(), B, torch.randn(B, N, 4, dtype=torch.float64), steps=2,
                      train=False, **DOUBLE)


class Mixer(nn.Module):
    """Owns a parameter it multiplies its input by as a matrix: no registered layer, it runs per model
    through torch.func (a generic path)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.mix


def mixed_norm(module: nn.Module, h: Tensor) -> Tensor:
    return h / module.mixer.mix.norm()


class EvalMixed(nn.Module):
    """A registered layer, then a generic one whose parameter a helper reads in eval mode only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mixer = Mixer()

    def forward(self, x: Tensor) -> Tensor:
        h = self.mixer(self.fc(x))
        return h if self.training else mixed_norm(self, h)


def test_a_late_read_of_a_generic_modules_parameter_raises() -> None:
    batched = BatchModule.from_factory(EvalMixed, B, seed=0)
    x = torch.randn(B, N, 4)
    batched(x)
    assert [entry.path for entry in batched.conversion_report()] == ["passthrough", "registered", "generic-whole"]
    batched.eval()
    with pytest.raises(batch_layers.StackedReadError, match=r"mixed_norm \(.*\) reads mix of FuncBatchedMixer"):
        batched(x)
    assert batched.module.mixer.mix.shape == (B, 4, 4)  # outside a forward, reads are the user's


def test_a_generic_modules_own_reads_and_first_forward_reads_stay_exact() -> None:
    x = torch.randn(B, N, 4, dtype=torch.float64)
    assert_equivalent(lambda: EvalMixed().double(), B, x, steps=2, **DOUBLE)  # training: its own reads only
    assert_equivalent(lambda: EvalMixed().double().eval(), B, x, steps=2, train=False, **DOUBLE)
