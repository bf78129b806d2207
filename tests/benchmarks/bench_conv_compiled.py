"""Compiled stems and 1x1 layers (a convolution, batch norm and SiLU, as the zoo's models hold them) on B
models, forward + backward under ``torch.compile``: the kernel table's compiled products on and off, and the
limit (the plain block on all B*n images, compiled).

    PYTHONPATH=. python tests/benchmarks/bench_conv_compiled.py [--batches 16,64] [--samples 128] [--shapes 0,1]

"on" opens the products as far as the script's ``OPEN`` limits (stems as a product of patches,
``batch_layers._kernel_table.PATCHES``; 1x1 layers of any size and channel count as a product of pixels,
``POINTWISE``'s compiled limits); "off" closes them, so that the layer runs as the table chose before (cuDNN's
grouped convolution, or Triton's grouped kernel from ``min_groups_compiled`` groups). Prints milliseconds per
step (the fastest and slowest of three rounds of 20 steps) for each shape and the ratio of on to off. fp32 with
TF32, as ``bench`` runs it. Needs CUDA. The compiled thresholds of ``PATCHES`` and ``POINTWISE`` rest on these
numbers.
"""

from __future__ import annotations

import argparse

import torch
from _timing import compiled_training_step, round_milliseconds
from torch import nn

from batch_layers import _kernel_table
from torchmb import BatchModule

SHAPES = (
    # name, input channels, output channels, input size, kernel, stride, padding
    ("EfficientNet-B0 stem", 3, 32, 32, 3, 2, 1),
    ("MobileNetV3 stem", 3, 16, 32, 3, 2, 1),
    ("ResNet-18 stem", 3, 64, 32, 7, 2, 3),
    ("LeNet conv1", 1, 6, 28, 5, 1, 0),
    ("EfficientNet-B0 1x1 32->16", 32, 16, 16, 1, 1, 0),
    ("EfficientNet-B0 1x1 16->96", 16, 96, 16, 1, 1, 0),
    ("RegNetX-400MF 1x1 32->32", 32, 32, 16, 1, 1, 0),
    ("RegNetX-400MF 1x1 32->32 stride 2", 32, 32, 16, 1, 2, 0),
    ("squeeze-excitation 96->4", 96, 4, 1, 1, 1, 0),
    ("squeeze-excitation 4->96", 4, 96, 1, 1, 1, 0),
)
"""The zoo's layers on 32x32 images (LeNet's on 28x28) that a compiled step ran as grouped convolutions."""

OPEN = (
    (_kernel_table.PATCHES, {"max_in_per_group": 4, "max_patch_per_output": 1 << 30}),
    (_kernel_table.POINTWISE, {"min_channels_compiled": 1, "max_pixels_compiled": 1 << 30}),
)
CLOSED = (
    (_kernel_table.PATCHES, {"max_in_per_group": 0, "min_in_per_group_strided": 1 << 30}),
    (_kernel_table.POINTWISE, {"min_channels_compiled": _kernel_table.POINTWISE.limits["min_channels"],
                               "max_pixels_compiled": _kernel_table.POINTWISE.limits["max_pixels"]}),
)


def block(c_in: int, c_out: int, kernel: int, stride: int, padding: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False), nn.BatchNorm2d(c_out),
                         nn.SiLU()).cuda()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--shapes", help="indices into SHAPES (all by default)")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    defaults = [(candidate, dict(candidate.limits)) for candidate, _ in OPEN]
    try:
        for batch in map(int, args.batches.split(",")):
            for name, c_in, c_out, size, kernel, stride, padding in shapes:
                x = torch.randn(batch, args.samples, c_in, size, size, device="cuda", requires_grad=c_in > 4)
                times = {}
                for state, limits in (("on", OPEN), ("off", CLOSED)):
                    for candidate, values in limits:
                        candidate.limits.update(values)
                    torch._dynamo.reset()
                    batched = BatchModule(block(c_in, c_out, kernel, stride, padding), batch)
                    times[state] = round_milliseconds(compiled_training_step(batched), x)
                torch._dynamo.reset()
                limit = compiled_training_step(block(c_in, c_out, kernel, stride, padding))
                times["limit"] = round_milliseconds(limit, x.detach().flatten(0, 1).requires_grad_(c_in > 4))
                print(f"B={batch} {name}: " + " | ".join(f"{state} {min(t):.3f}-{max(t):.3f}"
                                                          for state, t in times.items())
                      + f" | on/off {min(times['on']) / min(times['off']):.2f}", flush=True)
                torch.cuda.empty_cache()
    finally:
        for candidate, values in defaults:
            candidate.limits.update(values)


if __name__ == "__main__":
    main()
