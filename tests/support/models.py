"""Small plain models shared by the tests."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (12, 16, 16, 5)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class ControlFlow(nn.Module):
    """Python control flow on the data and on a hyperparameter: nothing here can be traced once."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(depth))
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, gate: bool = True) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        for i, block in enumerate(self.blocks):
            if i % 2 == 0 and gate:
                h = h + torch.tanh(block(h))
            else:
                h = torch.sigmoid(block(h)) * h
        if h.shape[-1] == 10:
            h = h * 2
        return {"logits": self.out(h), "hidden": h}


class FiLM(nn.Module):
    """A custom parameterised module that no batched layer covers: goes through torch.func."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
        self.shift = nn.Parameter(torch.randn(features))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.scale + self.shift * self.calls.clamp(max=2)


class WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.film = FiLM(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.film(self.fc(x))))


def conversion_paths(batched: nn.Module) -> dict[str, str]:
    """Each module's conversion path (``registered``, ``broadcast-own``, ``generic-own``, ...) by its name in
    ``batched``, a ``BatchModule``."""
    return {entry.name: entry.path for entry in batched.conversion_report()}


def check_like_seeded_plain_models(make, batched: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` of ``batched`` (``BatchModule.from_factory(make, B, seed=0)``, its gradients from
    ``out.square().sum()``) against B plain models ``make()`` seeded 0..B-1: each model's output and every
    parameter's gradient."""
    for i in range(x.shape[0]):
        torch.manual_seed(i)
        plain = make()
        want = plain(x[i])
        want.square().sum().backward()
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)
        for (name, got), expected in zip(batched.module.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(got.grad[i], expected.grad, atol=1e-5, rtol=1e-5, msg=name)


class LayerScaleBlock(nn.Module):
    """ConvNeXt's pattern and more: a residual block with a reshaped layer scale, a bias add and an in-place
    scale through a local name, its own parameters used only element-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.shift = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).mul(self.gamma.reshape(1, -1, 1, 1)) + self.shift
        gamma = self.gamma.view(1, -1, 1, 1)
        return y.mul_(gamma).relu() + x
