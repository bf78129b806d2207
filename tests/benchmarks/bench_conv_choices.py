"""ResNet-18's, MobileNetV3's and EfficientNet-B0's convolutions (32x32 images) for B models: each of the
kernel table's choices against the grouped convolution (cuDNN) and the limit (one model's convolution over
all B*n images), forward + backward and each alone.

    PYTHONPATH=. python tests/benchmarks/bench_conv_choices.py [--batches 16,64] [--samples 128]

Prints milliseconds per call. Every row runs ``batch_layers.functional.conv2d`` samples-major (the order
these models take) as the kernel table's batched matrix products (``matmul`` for few pixels, ``pointwise``
for 1x1 kernels, where they apply) and as the grouped convolution; ``limit`` is the faster of the dense
NCHW and channels-last convolutions. Each also alone: ``_fwd`` the forward, ``_bwd`` both gradients. The
kernel table's ``MATMUL`` and ``POINTWISE`` thresholds rest on these numbers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import cuda_ms

from batch_layers import Layout, _kernel_table
from batch_layers._conv_matmul import runs_as_matmul
from batch_layers._conv_pointwise import runs_pointwise
from batch_layers.functional import conv2d

# (input channels, output channels, input height = width, kernel, stride): torchvision's ResNet-18 on 32x32
SHAPES = [
    (64, 64, 8, 3, 1), (64, 128, 8, 3, 2), (64, 128, 8, 1, 2), (128, 128, 4, 3, 1), (128, 256, 4, 3, 2),
    (256, 256, 2, 3, 1), (256, 512, 2, 3, 2), (512, 512, 1, 3, 1), (64, 64, 32, 3, 1), (128, 128, 16, 3, 1),
    # pointwise convolutions of MobileNetV3 and EfficientNet-B0 on 32x32 images
    (16, 96, 16, 1, 1), (96, 24, 8, 1, 1), (40, 240, 4, 1, 1), (240, 40, 4, 1, 1), (112, 672, 2, 1, 1),
    (320, 1280, 1, 1, 1),
]


def _timed(step) -> float:
    return cuda_ms(step, warmup=3, iters=10)


def _ops(conv, x, weight, prefix: str) -> dict[str, float]:
    """The forward and the backward (both gradients) of ``conv`` timed alone."""
    y = conv()
    ones = torch.ones_like(y)
    return {
        prefix + "fwd": _timed(conv),
        prefix + "bwd": _timed(lambda: torch.autograd.grad(y, (x, weight), ones, retain_graph=True)),
    }


def measure_shape(batch: int, samples: int, dtype: torch.dtype, max_pairs: int, c_in: int, c_out: int, size: int,
                  k: int, stride: int) -> None:
    pad = k // 2
    layout = Layout(batch, "samples")
    options = {"device": "cuda", "dtype": dtype}
    x = torch.randn(batch * samples, c_in, size, size, **options, requires_grad=True)
    weight = torch.randn(batch, c_out, c_in, k, k, **options, requires_grad=True)
    dense_x = torch.randn(batch * samples, c_in, size, size, **options, requires_grad=True)
    dense_w = torch.randn(c_out, c_in, k, k, **options, requires_grad=True)
    dense_cl = dense_x.detach().to(memory_format=torch.channels_last).requires_grad_()

    def run(conv):
        def step():
            y = conv()
            y.backward(torch.ones_like(y))
        return step

    row = {}
    conv = lambda: conv2d(x, weight, None, stride, pad, layout=layout)  # noqa: E731
    candidates = {"matmul": (_kernel_table.MATMUL, runs_as_matmul),
                  "pointwise": (_kernel_table.POINTWISE, runs_pointwise)}
    before = {name: dict(candidate.limits) for name, (candidate, _) in candidates.items()}
    _kernel_table.MATMUL.limits["max_pairs"] = max_pairs
    try:
        for name, (candidate, runs) in candidates.items():
            call = _kernel_table.ConvCall.of_merged(x, weight.flatten(0, 1), batch, batch, (stride, stride), (pad, pad),
                                                    (1, 1))
            if runs(call):
                row[name] = _timed(run(conv))
                row.update(_ops(conv, x, weight, name + "_"))
            candidate.limits["min_channels"] = 10**9  # the next ones, and the grouped convolution, without it
        row["grouped"] = _timed(run(conv))
        row.update(_ops(conv, x, weight, "grouped_"))
    finally:
        for name, (candidate, _) in candidates.items():
            candidate.limits.update(before[name])
    row["limit"] = min(_timed(run(lambda: F.conv2d(dense_x, dense_w, None, stride, pad))),
                       _timed(run(lambda: F.conv2d(dense_cl, dense_w, None, stride, pad))))
    row.update(_ops(lambda: F.conv2d(dense_x, dense_w, None, stride, pad), dense_x, dense_w, "limit_"))
    print(
        f"B={batch} {str(dtype)[6:]} {c_in}->{c_out} {size}x{size} k={k} s={stride}: "
        + " ".join(f"{name}={value:.3f}" for name, value in row.items())
        + "  " + " ".join(f"{name}/limit={row[name] / row['limit']:.2f}" for name in ("matmul", "pointwise", "grouped")
                          if name in row),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-pairs", type=int, default=_kernel_table.MATMUL.limits["max_pairs"],
                        help="try the matrix product up to this many pixel pairs (the table's limit by default)")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    for batch in map(int, args.batches.split(",")):
        for dtype in args.dtypes.split(","):
            for shape in SHAPES:
                measure_shape(batch, args.samples, getattr(torch, dtype), args.max_pairs, *shape)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
