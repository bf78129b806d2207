"""ResNet-18 for CIFAR-size inputs (3x32x32), written out here so the end-to-end tests depend on nothing but torch.

The layout is He et al.'s ResNet-18 (four stages of two BasicBlocks, strides 1/2/2/2, a 1x1-conv + BatchNorm
shortcut where the shape changes) with the usual CIFAR stem (3x3 conv, no max-pool). ``width`` scales every
stage (64 in the paper); the tests use a small width so CPU stays fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 64, in_channels: int = 3) -> None:
        super().__init__()
        self.in_planes = width
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._stage(width, 2, stride=1)
        self.layer2 = self._stage(2 * width, 2, stride=2)
        self.layer3 = self._stage(4 * width, 2, stride=2)
        self.layer4 = self._stage(8 * width, 2, stride=2)
        self.linear = nn.Linear(8 * width, num_classes)

    def _stage(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)
