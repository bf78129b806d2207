"""timm ConvNeXt-atto's depthwise 7x7 layers for B models on channels-last merged input (the layout its permutes
leave): the kernel table's ``triton-depthwise-merged`` against the grouped path it replaces and the limit,
forward + backward (input, weight and bias gradients) and the forward alone.

    PYTHONPATH=. python tests/benchmarks/bench_depthwise_cl.py [--batches 16,64] [--samples 128] [--image 32]

Prints milliseconds per call (CUDA events, median). ``merged``: ``batch_layers.functional.conv2d`` samples-major
(the zoo's order) taking the merged-layout kernels; ``grouped``: the same call with the entry turned off, i.e.
the copies to the grouped channels-last layout and back, cuDNN's or ATen's depthwise convolution and the
Triton weight-gradient kernel (``triton-depthwise``) where the table takes it; ``plain``: one model's depthwise
convolution over all B*n images (channels-last), the arithmetic's limit. ``--image`` is the input image's side:
the depthwise layers run on 1/4, 1/8, 1/16 and 1/32 of it (32: the bench zoo's 8x8 to 1x1; 224: 56x56 to 7x7).
The kernel table's ``DEPTHWISE_MERGED`` thresholds rest on these numbers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import cuda_ms

from batch_layers import Layout, _kernel_table
from batch_layers._conv_depthwise import runs_depthwise_merged
from batch_layers._kernel_table import ConvCall
from batch_layers.functional import conv2d

STAGES = [(40, 4), (80, 8), (160, 16), (320, 32)]  # ConvNeXt-atto: channels, downsampling of the input image
KERNEL, PADDING = 7, 3


def _timed(step) -> float:
    return cuda_ms(step, warmup=3, iters=20)


def _step(conv, leaves, grad):
    def step():
        torch.autograd.grad(conv(), leaves, grad)
    return step


def measure(batch: int, samples: int, dtype: torch.dtype, channels: int, size: int) -> dict[str, float | str]:
    options = {"device": "cuda", "dtype": dtype}
    layout = Layout(batch, "samples")
    cl = torch.channels_last
    x = torch.randn(batch * samples, channels, size, size, **options).contiguous(memory_format=cl).requires_grad_()
    weight = torch.randn(batch, channels, 1, KERNEL, KERNEL, **options, requires_grad=True)
    bias = torch.randn(batch, channels, **options, requires_grad=True)
    grad = torch.randn(x.shape, **options).contiguous(memory_format=cl)
    plain_w = torch.randn(channels, 1, KERNEL, KERNEL, **options, requires_grad=True)
    plain_b = torch.randn(channels, **options, requires_grad=True)

    def merged():
        return conv2d(x, weight, bias, 1, PADDING, 1, channels, layout=layout)

    def plain():
        return F.conv2d(x, plain_w, plain_b, 1, PADDING, 1, channels)

    row: dict[str, float | str] = {}
    call = ConvCall.of_merged(x, weight.flatten(0, 1), batch, batch * channels, (1, 1), (PADDING,) * 2, (1, 1))
    takes = runs_depthwise_merged(call)
    row["entry"] = "takes it" if takes else "not taken"
    row["merged"] = _timed(_step(merged, (x, weight, bias), grad))
    row["merged_fwd"] = _timed(merged)
    limits = _kernel_table.DEPTHWISE_MERGED.limits
    before = dict(limits)
    limits["max_taps"] = 0  # the grouped path, as before the entry
    try:
        row["grouped"] = _timed(_step(merged, (x, weight, bias), grad))
        row["grouped_fwd"] = _timed(merged)
    finally:
        limits.update(before)
    row["plain"] = _timed(_step(plain, (x, plain_w, plain_b), grad))
    row["plain_fwd"] = _timed(plain)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--image", type=int, default=32, help="the input image's side (the zoo's: 32)")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    columns = ("merged", "grouped", "plain", "merged_fwd", "grouped_fwd", "plain_fwd")
    print(f"{torch.cuda.get_device_name()}, n={args.samples}, {KERNEL}x{KERNEL} depthwise, padding {PADDING}, "
          f"channels-last merged input (samples-major); ms per call, forward + backward unless _fwd")
    print("| B | dtype | channels | image | entry | " + " | ".join(columns) + " | grouped/merged | merged/plain |")
    print("|---" * (len(columns) + 7) + "|")
    for batch in map(int, args.batches.split(",")):
        for dtype in args.dtypes.split(","):
            for channels, down in STAGES:
                size = max(1, args.image // down)
                row = measure(batch, args.samples, getattr(torch, dtype), channels, size)
                print(f"| {batch} | {dtype} | {channels} | {size}x{size} | {row['entry']} | "
                      + " | ".join(f"{row[c]:.3f}" for c in columns)
                      + f" | {row['grouped'] / row['merged']:.2f} | {row['merged'] / row['plain']:.2f} |", flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
