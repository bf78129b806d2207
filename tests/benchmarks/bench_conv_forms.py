"""Formulations of B models' small convolutions, forward + backward (H100/H200, fp32, n=128 per model).

    PYTHONPATH=. python tests/benchmarks/bench_conv_forms.py [--depthwise]

Rows: cuDNN's grouped convolution (NCHW and channels-last, autotuned, and with cuDNN's heuristics), the
same as a depthwise convolution with a channel multiplier followed by a sum over input channels, the
batched layer (``batch_layers.Conv2d``, samples-major: the Triton kernel where it applies) and the limit
(one model's convolution over all B*n images). Prints milliseconds and kernel launches per call.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from _timing import cuda_ms
from torch.profiler import ProfilerActivity, profile

import batch_layers


def launches(fn) -> float:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key) / 3


def heuristic(fn):
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=False):
        return fn()


def grouped(x, w, b, batch, padding, groups=1):
    return F.conv2d(x, w.flatten(0, 1), b.flatten(), padding=padding, groups=batch * groups)


def depthwise_sum(x, w, b, batch, padding):
    models, cout, cin, k, _ = w.shape
    per_input = w.transpose(1, 2).reshape(models * cin * cout, 1, k, k)
    y = F.conv2d(x, per_input, padding=padding, groups=models * cin)
    y = y.unflatten(1, (models, cin, cout)).sum(2).flatten(1, 2)
    return y + b.flatten()[:, None, None]


def run(name, cin, cout, k, size, batch, samples=128, padding=0, groups=1):
    dev = torch.device("cuda")
    x = torch.randn(samples, batch * cin, size, size, device=dev, requires_grad=True)
    w = torch.randn(batch, cout, cin // groups, k, k, device=dev, requires_grad=True)
    b = torch.randn(batch, cout, device=dev, requires_grad=True)
    xl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    x1 = torch.randn(batch * samples, cin, size, size, device=dev, requires_grad=True)
    w1 = torch.randn(cout, cin // groups, k, k, device=dev, requires_grad=True)
    b1 = torch.randn(cout, device=dev, requires_grad=True)
    ref = grouped(x, w, b, batch, padding, groups)
    small = cin * cout <= 256 and groups == 1  # the multiplier form's intermediate holds cin*cout channels per model
    if small:
        torch.testing.assert_close(depthwise_sum(x, w, b, batch, padding), ref, rtol=1e-2, atol=0.1)
    gy = torch.randn_like(ref)
    layer = batch_layers.Conv2d(cin, cout, k, padding=padding, groups=groups, batch=batch, device=dev)
    layer.merged_order = "samples"
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    merged = x.detach().view(samples * batch, cin, size, size).requires_grad_()
    gy_merged = gy.view(samples * batch, cout, *gy.shape[2:])
    torch.testing.assert_close(layer(merged).view(ref.shape), ref, rtol=1e-2, atol=0.1)
    gyl = gy.contiguous(memory_format=torch.channels_last)
    gy1 = torch.randn(batch * samples, cout, *ref.shape[2:], device=dev)
    forms = {
        "grouped": lambda: grouped(x, w, b, batch, padding, groups).backward(gy),
        "grouped-heuristic": lambda: heuristic(lambda: grouped(x, w, b, batch, padding, groups).backward(gy)),
        "grouped-cl": lambda: grouped(xl, w, b, batch, padding, groups).backward(gyl),
        "layer": lambda: layer(merged).backward(gy_merged),
        "limit": lambda: F.conv2d(x1, w1, b1, padding=padding, groups=groups).backward(gy1),
    }
    if small:
        forms["depthwise+sum"] = lambda: depthwise_sum(x, w, b, batch, padding).backward(gy)
    row = []
    for form, fn in forms.items():
        try:
            ms = cuda_ms(fn, warmup=3, iters=10)
            row.append(f"{form} {ms:.3f} ms ({launches(fn):.0f} launches)")
        except RuntimeError as error:
            row.append(f"{form} error {str(error)[:60]}")
        x.grad = w.grad = b.grad = xl.grad = x1.grad = w1.grad = b1.grad = merged.grad = None
        layer.zero_grad()
    print(f"{name} B={batch}: " + "; ".join(row), flush=True)


def main() -> None:
    torch.backends.cudnn.benchmark = True
    if "--depthwise" in sys.argv:
        for batch in (16, 64):
            run("convnext dw 40 k7 8", 40, 40, 7, 8, batch, padding=3, groups=40)
            run("effnet dw 96 k3 16", 96, 96, 3, 16, batch, padding=1, groups=96)
            run("lenet conv1 1->6 k5 28", 1, 6, 5, 28, batch * 4)
        return
    for batch in (16, 64, 256):
        run("lenet conv1 1->6 k5 28", 1, 6, 5, 28, batch)
        run("lenet conv2 6->16 k5 12", 6, 16, 5, 12, batch)
    for batch in (16, 64):
        run("resnet 64->64 k3 32", 64, 64, 3, 32, batch, padding=1)
        run("small 16->16 k3 16", 16, 16, 3, 16, batch, padding=1)


if __name__ == "__main__":
    main()
