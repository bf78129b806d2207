"""Which order should the merged model axis have: models-major ``(B n)`` or samples-major ``(n B)``?

Times forward+backward of a batched Linear and a batched Conv2d both ways (B=64, n=128 by default), as
they would run between two layers of a batched model: the input arrives in the merged layout and the
output must leave in it. Also times a plain layer on the same B*n samples as the limit.

    python tests/benchmarks/bench_axis_order.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def cuda_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def linear_models_major(x, w, b, batch):
    y = torch.baddbmm(b.unsqueeze(1), x.view(batch, -1, x.shape[-1]), w.transpose(1, 2))
    return y.view(-1, w.shape[1])


def linear_samples_major_bmm(x, w, b, batch):
    rows = x.view(-1, batch, x.shape[-1]).transpose(0, 1)
    y = torch.baddbmm(b.unsqueeze(1), rows, w.transpose(1, 2))
    return y.transpose(0, 1).reshape(-1, w.shape[1])


def linear_samples_major_einsum(x, w, b, batch):
    y = torch.einsum("nbi,boi->nbo", x.view(-1, batch, x.shape[-1]), w) + b
    return y.reshape(-1, w.shape[1])


def conv_models_major(x, w, b, batch):
    n = x.shape[0] // batch
    grouped = x.view(batch, n, *x.shape[1:]).transpose(0, 1).reshape(n, -1, *x.shape[2:])
    y = F.conv2d(grouped, w.flatten(0, 1), b.flatten(), groups=batch)
    y = y.view(n, batch, -1, *y.shape[2:]).transpose(0, 1)
    return y.reshape(batch * n, *y.shape[2:])


def conv_samples_major(x, w, b, batch):
    n = x.shape[0] // batch
    y = F.conv2d(x.view(n, -1, *x.shape[2:]), w.flatten(0, 1), b.flatten(), groups=batch)
    return y.view(batch * n, -1, *y.shape[2:])


def measure(name, impl, x, w, b, batch):
    x = x.detach().requires_grad_()
    w, b = w.detach().requires_grad_(), b.detach().requires_grad_()
    y0 = impl(x, w, b, batch)
    grad = torch.randn_like(y0)

    def step():
        x.grad = w.grad = b.grad = None
        impl(x, w, b, batch).backward(grad)

    return {"layer": name, "impl": impl.__name__, "ms": cuda_ms(step)}


def measure_plain(name, plain, x, w, b, batch):
    def plain_layer(x, w, b, batch):
        return plain(x)

    return measure(name, plain_layer, x, w, b, batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    batch, n = args.batch, args.samples
    results = []
    for name, fin, fout in [("linear 784->512", 784, 512), ("linear 512->512", 512, 512), ("linear 120->84", 120, 84)]:
        x = torch.randn(batch * n, fin, device=dev)
        w = torch.randn(batch, fout, fin, device=dev) * 0.05
        b = torch.randn(batch, fout, device=dev)
        for impl in (linear_models_major, linear_samples_major_bmm, linear_samples_major_einsum):
            results.append(measure(name, impl, x, w, b, batch))
        plain = torch.nn.Linear(fin, fout, device=dev)
        results.append(measure_plain(name, plain, x, w, b, batch))
    for name, cin, cout, size in [("conv 1->6 k5 28x28", 1, 6, 28), ("conv 6->16 k5 12x12", 6, 16, 12)]:
        x = torch.randn(batch * n, cin, size, size, device=dev)
        w = torch.randn(batch, cout, cin, 5, 5, device=dev) * 0.1
        b = torch.randn(batch, cout, device=dev)
        for impl in (conv_models_major, conv_samples_major):
            results.append(measure(name, impl, x, w, b, batch))
        plain = torch.nn.Conv2d(cin, cout, 5, device=dev)
        results.append(measure_plain(name, plain, x, w, b, batch))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": batch, "samples": n}
    for row in results:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
