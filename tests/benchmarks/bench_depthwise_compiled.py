"""Compiled depthwise blocks (batch norm, SiLU, depthwise convolution, batch norm, SiLU: EfficientNet-B0's
shapes) on B models, forward + backward under ``torch.compile``: the kernel table's channels-last depthwise
layout (``batch_layers._kernel_table.DEPTHWISE_CHANNELS_LAST``) on and off, and the limit (the plain block on
all B*n images, compiled).

    PYTHONPATH=. python tests/benchmarks/bench_depthwise_compiled.py [--batches 16,64] [--samples 128]

Prints milliseconds per step (the best of three rounds of 20 steps) for each shape: on, off, on again (the
repeat shows the noise), limit. fp32 with TF32, as ``bench`` runs it. Needs CUDA.
"""

from __future__ import annotations

import argparse

import torch
from _timing import compiled_training_step, round_milliseconds
from torch import nn

from batch_layers import _kernel_table
from torchmb import BatchModule

SHAPES = ((32, 3, 16, 1), (144, 5, 16, 2), (240, 5, 4, 1), (672, 5, 2, 1))
"""(channels, kernel, input size, stride) of EfficientNet-B0's depthwise layers on 32x32 images."""


def block(channels: int, kernel: int, stride: int) -> nn.Module:
    return nn.Sequential(
        nn.BatchNorm2d(channels), nn.SiLU(),
        nn.Conv2d(channels, channels, kernel, stride, kernel // 2, groups=channels, bias=False),
        nn.BatchNorm2d(channels), nn.SiLU(),
    ).cuda()  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--samples", type=int, default=128)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    limits = _kernel_table.DEPTHWISE_CHANNELS_LAST.limits
    default_pixels = limits["min_pixels"]
    for batch in map(int, args.batches.split(",")):
        for channels, kernel, size, stride in SHAPES:
            x = torch.randn(batch, args.samples, channels, size, size, device="cuda")
            row = [f"B={batch} {channels} channels, {kernel}x{kernel}, {size}x{size}, stride {stride}"]
            for on in (True, False, True):
                limits["min_pixels"] = 1 if on else 1 << 30
                torch._dynamo.reset()
                batched = BatchModule(block(channels, kernel, stride), batch)
                row.append(f"{'on' if on else 'off'} {min(round_milliseconds(compiled_training_step(batched), x)):.3f}")
            limits["min_pixels"] = default_pixels
            torch._dynamo.reset()
            limit = compiled_training_step(block(channels, kernel, stride))
            row.append(f"limit {min(round_milliseconds(limit, x.flatten(0, 1))):.3f}")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
