"""ResNet-18's convolutions (CIFAR size) as B models' grouped convolution, NCHW against channels-last,
forward + backward, against the limit (one model's convolution over all B*n images).

    PYTHONPATH=. python tests/benchmarks/bench_grouped_layouts.py [--batches 16,64] [--samples 128]

Prints milliseconds per call for the grouped convolution with a contiguous (NCHW) and a channels-last
input, a loop of B dense convolutions, and the limit in both layouts, for fp32 (TF32) and bf16. The kernel
table's ``channels-last (converted)`` candidate rests on these numbers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import cuda_ms

# (input channels, output channels, input height = width, kernel, stride): ResNet-18's layers on 32x32 images
SHAPES = [
    (64, 64, 8, 3, 1), (64, 128, 8, 3, 2), (128, 128, 4, 3, 1), (256, 256, 2, 3, 1), (512, 512, 1, 3, 1),
    (64, 128, 8, 1, 2), (64, 64, 32, 3, 1), (128, 128, 16, 3, 1),
]


def forward_backward(conv):
    def step():
        y = conv()
        y.backward(torch.ones_like(y))
    return step


def measure(batch: int, samples: int, dtype: torch.dtype) -> None:
    for shape in SHAPES:
        measure_shape(batch, samples, dtype, *shape)
        torch.cuda.empty_cache()


def measure_shape(batch: int, samples: int, dtype: torch.dtype, c_in: int, c_out: int, size: int, k: int,
                  stride: int) -> None:
    pad = k // 2
    options = {"device": "cuda", "dtype": dtype, "requires_grad": True}
    grouped_in = torch.randn(samples, batch * c_in, size, size, **options)
    grouped_cl = grouped_in.detach().to(memory_format=torch.channels_last).requires_grad_()
    weight = torch.randn(batch * c_out, c_in, k, k, **options)
    dense_in = torch.randn(batch * samples, c_in, size, size, **options)
    dense_cl = dense_in.detach().to(memory_format=torch.channels_last).requires_grad_()
    dense_weight = torch.randn(c_out, c_in, k, k, **options)
    model_ins = [torch.randn(samples, c_in, size, size, **options) for _ in range(batch)]
    model_weights = [torch.randn(c_out, c_in, k, k, **options) for _ in range(batch)]
    rows = {
        "grouped": lambda: F.conv2d(grouped_in, weight, None, stride, pad, 1, batch),
        "grouped_cl": lambda: F.conv2d(grouped_cl, weight, None, stride, pad, 1, batch),
        "loop": lambda: torch.cat([F.conv2d(x, w, None, stride, pad) for x, w in zip(model_ins, model_weights)]),
        "limit": lambda: F.conv2d(dense_in, dense_weight, None, stride, pad),
        "limit_cl": lambda: F.conv2d(dense_cl, dense_weight, None, stride, pad),
    }
    ms = {name: cuda_ms(forward_backward(conv)) for name, conv in rows.items()}
    limit = min(ms["limit"], ms["limit_cl"])
    print(
        f"B={batch} {str(dtype)[6:]} in={c_in} out={c_out} {size}x{size} k={k} stride={stride}: "
        + " ".join(f"{name}={value:.3f}" for name, value in ms.items())
        + f"  grouped_cl/grouped={ms['grouped_cl'] / ms['grouped']:.2f}"
        + f"  best grouped/limit={min(ms['grouped'], ms['grouped_cl']) / limit:.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--samples", type=int, default=128)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    for batch in map(int, args.batches.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            measure(batch, args.samples, dtype)


if __name__ == "__main__":
    main()
