"""Optimizer step for B copies of the 784-512-512-10 MLP: torchmb.optim against torch.optim anchors (GPU).

Parameters are stacked with a leading model axis, ``(B, *shape)``. Measured in one run, median of CUDA-event
timed steps:

- ``torch_foreach``: ``torch.optim`` with ``foreach=True`` on the same stacked parameters, scalar
  hyperparameters (one model set of equal size, no per-model values): the anchor to match or beat.
- ``torch_fused``: ``torch.optim`` with ``fused=True`` on the stacked parameters (for information).
- ``batched_per_model``: ``torchmb.optim`` with a different lr (and momentum / beta1) for every model,
  default path (the fused CuPy kernels where CuPy is installed).
- ``batched_per_model_reference``: the same with ``fused=False`` (torch ops with per-model broadcasts).
- ``batched_scalar``: ``torchmb.optim`` with scalar hyperparameters, default path.
- ``separate``: B independent ``torch.optim`` optimizers (``foreach=True``), one per model's own tensors.

Usage: ``PYTHONPATH=. python3 tests/benchmarks/bench_optim.py [--batch 256] [--out bench.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torchmb.optim as mo

SHAPES = [(512, 784), (512,), (512, 512), (512,), (10, 512), (10,)]


def stacked(batch: int, device: torch.device) -> list[torch.Tensor]:
    params = []
    for shape in SHAPES:
        p = (torch.randn(batch, *shape, device=device) * 0.05).requires_grad_()
        p.grad = torch.randn_like(p)
        params.append(p)
    return params


def separate(batch: int, device: torch.device) -> list[list[torch.Tensor]]:
    models = []
    for _ in range(batch):
        own = []
        for shape in SHAPES:
            p = (torch.randn(*shape, device=device) * 0.05).requires_grad_()
            p.grad = torch.randn_like(p)
            own.append(p)
        models.append(own)
    return models


def time_ms(step, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        step()
    if not torch.cuda.is_available():  # a CPU smoke run of the script: host clock
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(algorithm: str, batch: int, device: torch.device, iters: int) -> dict[str, float]:
    lrs = torch.logspace(-4, -1, batch).tolist()
    per_model_momentum = torch.linspace(0.8, 0.99, batch).tolist()
    if algorithm == "sgd":
        def torch_opt(params, **kw):
            return torch.optim.SGD(params, lr=0.01, momentum=0.9, **kw)
        batched_scalar = dict(lr=0.01, momentum=0.9)
        batched_per_model = dict(lr=lrs, momentum=per_model_momentum)
        cls = mo.SGD
    else:
        def torch_opt(params, **kw):
            return torch.optim.Adam(params, lr=1e-3, **kw)
        batched_scalar = dict(lr=1e-3)
        batched_per_model = dict(lr=lrs, betas=(per_model_momentum, 0.999))
        cls = mo.Adam
    results: dict[str, float] = {}
    for name in ("torch_foreach", "torch_fused", "batched_per_model", "batched_per_model_reference",
                 "batched_scalar"):
        params = stacked(batch, device)
        if name == "torch_foreach":
            opt = torch_opt(params, foreach=True)
        elif name == "torch_fused":
            if device.type != "cuda":
                continue
            opt = torch_opt(params, fused=True)
        elif name == "batched_per_model_reference":
            opt = cls(params, **batched_per_model, fused=False)
        else:
            opt = cls(params, **(batched_per_model if name == "batched_per_model" else batched_scalar))
        results[name] = time_ms(opt.step, iters)
        if name == "batched_per_model":
            results["default_path_fused"] = float(opt.fused_steps > 0)
        del opt, params
        torch.cuda.empty_cache()
    models = separate(batch, device)
    optimizers = [torch_opt(own, foreach=True) for own in models]

    def step_all() -> None:
        for opt in optimizers:
            opt.step()

    results["separate"] = time_ms(step_all, max(3, iters // 4), warmup=2)
    optimizers.clear()
    models.clear()
    torch.cuda.empty_cache()
    return results


def elementwise_costs(batch: int, device: torch.device, iters: int) -> dict[str, float]:
    """One pass over the largest weight: a scalar operand against a per-model (B, 1, 1) operand."""
    x = torch.randn(batch, *SHAPES[0], device=device)
    y = torch.randn_like(x)
    c = torch.rand(batch, 1, 1, device=device)
    return {
        "mul_scalar": time_ms(lambda: x.mul_(0.999), iters),
        "mul_per_model": time_ms(lambda: x.mul_(c), iters),
        "axpy_scalar": time_ms(lambda: x.add_(y, alpha=0.5), iters),
        "axpy_per_model": time_ms(lambda: x.addcmul_(y, c), iters),
        "bytes_per_pass": x.numel() * x.element_size(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="run on the CPU (checks the script, not a timing)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench_optim needs a CUDA device (or --smoke)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    numel = args.batch * sum(torch.Size(s).numel() for s in SHAPES)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    report = {"device": name, "torch": torch.__version__, "batch": args.batch,
              "parameters": numel, "results": {}}
    for algorithm in ("sgd", "adam"):
        r = bench(algorithm, args.batch, device, args.iters)
        r.setdefault("torch_fused", float("nan"))
        r["per_model_vs_foreach"] = r["batched_per_model"] / r["torch_foreach"]
        r["scalar_vs_foreach"] = r["batched_scalar"] / r["torch_foreach"]
        r["reference_vs_foreach"] = r["batched_per_model_reference"] / r["torch_foreach"]
        r["separate_vs_per_model"] = r["separate"] / r["batched_per_model"]
        report["results"][algorithm] = r
    report["elementwise"] = elementwise_costs(args.batch, device, args.iters)
    print(f"{report['device']}, torch {report['torch']}, B={args.batch}, {numel / 1e6:.1f} M parameters (fp32)")
    print("median ms per step; torch_* run on the stacked parameters with scalar hyperparameters")
    print(f"{'':6} {'torch foreach':>13} {'torch fused':>11} {'per-model':>10} {'per-model ref':>13} "
          f"{'scalar':>9} {'separate':>10}  {'per-model/foreach':>17} {'separate/per-model':>18}")
    for algorithm, r in report["results"].items():
        print(f"{algorithm:6} {r['torch_foreach']:13.3f} {r['torch_fused']:11.3f} {r['batched_per_model']:10.3f} "
              f"{r['batched_per_model_reference']:13.3f} {r['batched_scalar']:9.3f} {r['separate']:10.2f}  "
              f"{r['per_model_vs_foreach']:17.3f} {r['separate_vs_per_model']:17.1f}x")
        print(f"{'':6} default path fused: {bool(r['default_path_fused'])}; reference path / foreach "
              f"{r['reference_vs_foreach']:.3f}")
    e = report["elementwise"]
    print("one pass over W1 (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in e.items() if k != "bytes_per_pass"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
