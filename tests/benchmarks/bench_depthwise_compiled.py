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
import time
from collections.abc import Callable

import torch
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


def compiled_step(model: nn.Module) -> Callable[[torch.Tensor], None]:
    compiled = torch.compile(model)

    def step(x: torch.Tensor) -> None:
        compiled(x).sum().backward()

    return step


def milliseconds(step: Callable[[torch.Tensor], None], x: torch.Tensor, steps: int = 20) -> float:
    for _ in range(3):  # the first compiles
        step(x)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            step(x)
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / steps * 1e3)
    return min(rounds)


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
                row.append(f"{'on' if on else 'off'} {milliseconds(compiled_step(batched), x):.3f}")
            limits["min_pixels"] = default_pixels
            torch._dynamo.reset()
            row.append(f"limit {milliseconds(compiled_step(block(channels, kernel, stride)), x.flatten(0, 1)):.3f}")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
