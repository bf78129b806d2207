"""A small U-Net (Ronneberger et al.) with ConvTranspose2d up-sampling, for the end-to-end tests.

Two down-sampling levels of (conv-norm-ReLU) x 2 with max-pooling, a bottleneck, and two up-sampling levels
that upsample with ``nn.ConvTranspose2d(stride=2)``, concatenate the skip connection along channels and
convolve again. ``norm`` picks the normalisation ("batch", "group" or "instance"), so the same net exercises
BatchNorm2d, GroupNorm or InstanceNorm2d; the bottleneck uses PReLU and Dropout2d.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(2, channels)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=True, track_running_stats=True)
    raise ValueError(f"norm must be 'batch', 'group' or 'instance', got {kind!r}")


class DoubleConv(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int, norm: str) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            _norm(norm, out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            _norm(norm, out_channels),
            nn.ReLU(),
        )


class Up(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, norm: str) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, 2, stride=2)
        self.conv = DoubleConv(in_channels, out_channels, norm)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x, output_size=skip.shape[-2:])
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, classes: int = 2, width: int = 8, norm: str = "batch",
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.inc = DoubleConv(in_channels, width, norm)
        self.down1 = DoubleConv(width, 2 * width, norm)
        self.down2 = DoubleConv(2 * width, 4 * width, norm)
        self.bottleneck = nn.Sequential(nn.PReLU(4 * width), nn.Dropout2d(dropout))
        self.up1 = Up(4 * width, 2 * width, norm)
        self.up2 = Up(2 * width, width, norm)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(F.max_pool2d(x1, 2))
        x3 = self.bottleneck(self.down2(F.max_pool2d(x2, 2)))
        return self.head(self.up2(self.up1(x3, x2), x1))
