"""The batched convolution's two algorithms on the GPU: cuDNN's grouped convolution (``"grouped"``) against
im2col + one batched GEMM (``"gemm"``), forward + backward (input, weight and bias gradients) of one batched
layer, both merged orders, with one plain layer over all B*n samples (``dense``, the limit's work) beside.
The ``rule`` column is what ``batch_layers.prefers_gemm`` picks today; set ``batch_layers.GEMM_RULES``
from the ``gemm / grouped`` ratios.

    PYTHONPATH=. python tests/benchmarks/bench_grouped_conv.py --out conv_algorithms.json

fp32 with TF32 off for both cuDNN and cuBLAS (``--tf32`` turns it on for both), cuDNN autotuning on, CUDA
events, median of ``--iters`` timings after warm-up. Shapes whose estimated memory passes ``--max-gib``
are skipped with a note; a run stops adding rows after ``--budget-s`` seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from _timing import cuda_ms
from torch import nn

import batch_layers
from batch_layers import ForwardContext, forward_context

SAMPLES = 128
DEVICE = "cuda"
# name -> (dims, in, out, kernel, spatial size, stride, padding, groups): LeNet-5, ResNet-18 (CIFAR),
# MobileNetV2's depthwise and pointwise layers, a strided layer, and 1-d / 3-d ones.
LAYERS = {
    "lenet conv1 1->6 k5 28": (2, 1, 6, 5, 28, 1, 0, 1),
    "lenet conv2 6->16 k5 12": (2, 6, 16, 5, 12, 1, 0, 1),
    "resnet 64->64 k3 32": (2, 64, 64, 3, 32, 1, 1, 1),
    "resnet 64->128 k3 32 s2": (2, 64, 128, 3, 32, 2, 1, 1),
    "resnet 128->128 k3 16": (2, 128, 128, 3, 16, 1, 1, 1),
    "resnet 256->256 k3 8": (2, 256, 256, 3, 8, 1, 1, 1),
    "resnet 512->512 k3 4": (2, 512, 512, 3, 4, 1, 1, 1),
    "mobilenet depthwise 96 k3 16": (2, 96, 96, 3, 16, 1, 1, 96),
    "pointwise 64->128 k1 16": (2, 64, 128, 1, 16, 1, 0, 1),
    "conv1d 16->32 k5 64": (1, 16, 32, 5, 64, 1, 2, 1),
    "conv3d 4->8 k3 8": (3, 4, 8, 3, 8, 1, 1, 1),
}
CONV = {1: batch_layers.Conv1d, 2: batch_layers.Conv2d, 3: batch_layers.Conv3d}
PLAIN = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def _estimated_gib(config: tuple, batch: int, n: int) -> float:
    """Input, output and their gradients, and the im2col matrix counted twice (forward, backward), fp32."""
    dims, cin, cout, kernel, size, stride, padding = config[:7]
    out_size = (size + 2 * padding - kernel) // stride + 1
    activations = batch * n * (cin * size**dims + cout * out_size**dims) * 2
    columns = batch * n * cin * kernel**dims * out_size**dims
    return (activations + 2 * columns) * 4 / 2**30


def _time_layer(config: tuple, batch: int, n: int, order: str, algorithm: str, args) -> float:
    dims, cin, cout, kernel, size, stride, padding, groups = config
    conv = CONV[dims](cin, cout, kernel, stride, padding, groups=groups, batch=batch, device=DEVICE)
    conv.merged_order = order
    x = torch.randn(batch * n, cin, *(size,) * dims, device=DEVICE, requires_grad=True)
    inputs = [x, conv.weight, conv.bias]
    with forward_context(ForwardContext(batch, n, order=order)), batch_layers.use_conv_algorithm(algorithm):
        grad = torch.randn_like(conv(x))

        def step() -> None:
            torch.autograd.grad(conv(x), inputs, grad)

        return cuda_ms(step, warmup=args.warmup, iters=args.iters)


def _time_dense(config: tuple, batch: int, n: int, args) -> float:
    dims, cin, cout, kernel, size, stride, padding, groups = config
    conv = PLAIN[dims](cin, cout, kernel, stride, padding, groups=groups, device=DEVICE)
    x = torch.randn(batch * n, cin, *(size,) * dims, device=DEVICE, requires_grad=True)
    grad = torch.randn_like(conv(x))
    inputs = [x, conv.weight, conv.bias]
    return cuda_ms(lambda: torch.autograd.grad(conv(x), inputs, grad), warmup=args.warmup, iters=args.iters)


def _rule(config: tuple, batch: int, n: int) -> str:
    dims, cin, cout, kernel, size, stride, padding, groups = config
    out_size = (size + 2 * padding - kernel) // stride + 1
    gemm = batch_layers.prefers_gemm(
        groups=batch * groups,
        in_per_group=cin // groups,
        out_per_group=cout // groups,
        kernel_size=(kernel,) * dims,
        output_positions=n * out_size**dims,
        dtype=torch.float32,
        device_type="cuda",
    )
    return "gemm" if gemm else "grouped"


def _measured(fn, *args) -> float | str:
    try:
        return fn(*args)
    except torch.cuda.OutOfMemoryError:
        return "out of memory"
    finally:
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated names from the table")
    parser.add_argument("--orders", default="samples,models")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=24.0, help="skip shapes estimated to need more")
    parser.add_argument("--budget-s", type=float, default=160.0, help="stop adding rows after this long")
    parser.add_argument("--tf32", action="store_true", help="TF32 on for cuDNN and cuBLAS (off by default)")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = args.tf32
    started = time.perf_counter()
    rows, skipped = [], []
    header = f"{'layer':32} {'B':>4} {'order':7} {'grouped':>9} {'gemm':>9} {'dense':>9} {'gemm/grouped':>12} rule"
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, n={args.samples}, ms per forward + backward")
    print(header)
    for name in args.layers.split(","):
        config = LAYERS[name]
        for batch in map(int, args.batches.split(",")):
            gib = _estimated_gib(config, batch, args.samples)
            if gib > args.max_gib or time.perf_counter() - started > args.budget_s:
                reason = f"~{gib:.0f} GiB" if gib > args.max_gib else "time budget"
                skipped.append({"layer": name, "batch": batch, "reason": reason})
                print(f"{name:32} {batch:>4} skipped ({reason})")
                continue
            dense = _measured(_time_dense, config, batch, args.samples, args)
            for order in args.orders.split(","):
                grouped, gemm = (
                    _measured(_time_layer, config, batch, args.samples, order, algorithm, args)
                    for algorithm in ("grouped", "gemm")
                )
                both = isinstance(grouped, float) and isinstance(gemm, float)
                ratio = gemm / grouped if both else math.nan
                row = {
                    "layer": name,
                    "batch": batch,
                    "order": order,
                    "grouped_ms": grouped,
                    "gemm_ms": gemm,
                    "dense_ms": dense,
                    "gemm_over_grouped": ratio,
                    "rule": _rule(config, batch, args.samples),
                }
                rows.append(row)
                cells = [f"{v:9.3f}" if isinstance(v, float) else f"{v:>9}" for v in (grouped, gemm, dense)]
                print(f"{name:32} {batch:>4} {order:7} {' '.join(cells)} {ratio:12.2f} {row['rule']}", flush=True)
    print(f"{time.perf_counter() - started:.0f} s")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "samples": args.samples}
        with open(args.out, "w") as f:
            json.dump({**meta, "tf32": args.tf32, "rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
