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

With ``--breakdown`` it measures instead where a step's time goes, against a device-to-device copy of
the same bytes (the bandwidth anchor): the host time of a step until it returns (the GPU waits for it at
the start of an isolated step), the time of a step when steps run back to back (the host work hides
behind the previous kernels, so this is the kernels' time), and that kernel time for each fused-kernel
variant (``torchmb.optim._fused.VARIANT``). ``--pattern`` times the same access pattern (read parameter,
gradient and buffer, write parameter and buffer) as a plain CuPy elementwise kernel. ``--ncu`` takes one
step of torch's fused SGD and of the batched SGD, for ``ncu -k regex:"torchmb_sgd|multi_tensor"``.

Usage: ``PYTHONPATH=. python3 tests/benchmarks/bench_optim.py [--batch 256] [--out bench.json]
[--breakdown | --pattern | --ncu]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _timing import cuda_ms, host_profile

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
    return cuda_ms(step, warmup=0, iters=iters)


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


def back_to_back_ms(step, repeats: int = 10, rounds: int = 7) -> float:
    """Median over ``rounds`` of the time per step of ``repeats`` steps queued back to back."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return statistics.median(times)


def host_ms(step, iters: int = 30) -> float:
    """Median host time of one call of ``step`` (until it returns, its kernels queued) on an idle GPU."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def copy_ms(numel: int, device: torch.device) -> float:
    pair = [torch.randn(numel, device=device)]
    pair.append(torch.empty_like(pair[0]))
    ms = back_to_back_ms(lambda: pair[1].copy_(pair[0]))
    pair.clear()
    torch.cuda.empty_cache()
    return ms


VARIANTS = {  # (float4s per thread per work item, streaming hints, min blocks per SM)
    "torchmb_sgd": [(1, 1, 8), (2, 1, 8), (4, 1, 4), (4, 0, 4), (8, 1, 2)],
    "torchmb_adam": [(1, 1, 8), (2, 1, 4), (4, 1, 2)],
}


def breakdown(batch: int, device: torch.device, iters: int) -> dict:
    """Where the time of one step goes (see the module docstring)."""
    from torchmb.optim import _fused

    numel = batch * sum(torch.Size(s).numel() for s in SHAPES)
    out: dict = {}
    copy_numel = numel * 5 // 2  # a copy of this many floats moves as many bytes as a momentum SGD step
    out["copy_ms"] = copy_ms(copy_numel, device)
    out["copy_tb_per_s"] = 2 * copy_numel * 4 / out["copy_ms"] / 1e9
    lrs = torch.logspace(-4, -1, batch).tolist()
    momentum = torch.linspace(0.8, 0.99, batch).tolist()
    for algorithm, kernel, moved in (("sgd", "torchmb_sgd", 5), ("adam", "torchmb_adam", 7)):
        bytes_moved = moved * numel * 4
        rows: dict = {"bytes": bytes_moved, "floor_ms_at_copy_bandwidth": bytes_moved / (out["copy_tb_per_s"] * 1e9)}
        for name in ("torch_fused", "torch_foreach", "batched_per_model"):
            params = stacked(batch, device)
            if algorithm == "sgd":
                if name == "batched_per_model":
                    opt = mo.SGD(params, lr=lrs, momentum=momentum)
                else:
                    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, **{name[6:]: True})
            elif name == "batched_per_model":
                opt = mo.Adam(params, lr=lrs, betas=(momentum, 0.999))
            else:
                opt = torch.optim.Adam(params, lr=1e-3, **{name[6:]: True})
            rows[name] = {
                "isolated_ms": time_ms(opt.step, iters),
                "back_to_back_ms": back_to_back_ms(opt.step),
                "host_ms": host_ms(opt.step),
            }
            rows[name]["back_to_back_tb_per_s"] = bytes_moved / rows[name]["back_to_back_ms"] / 1e9
            if name == "batched_per_model":
                default = _fused.VARIANT[kernel]
                variants = {}
                for variant in VARIANTS[kernel]:
                    _fused.VARIANT[kernel] = variant
                    ms = back_to_back_ms(opt.step)
                    attributes = _fused._kernel(kernel, device.index or 0, variant).attributes
                    variants[str(variant)] = {"back_to_back_ms": ms, "tb_per_s": bytes_moved / ms / 1e9,
                                              "isolated_ms": time_ms(opt.step, iters),
                                              "registers": attributes.get("num_regs"),
                                              "local_bytes": attributes.get("local_size_bytes"),
                                              "resident_blocks": _fused._resident_blocks(kernel, device.index or 0,
                                                                                         variant)}
                _fused.VARIANT[kernel] = default
                rows["variants"] = variants
                rows["fused_steps"] = opt.fused_steps
                rows["launch_through_function"] = any(k[0] == kernel for k in _fused._FUNCTIONS)
                rows["occupancy_from"] = sorted(set(_fused.OCCUPANCY_FROM.values()))
                rows["host_profile"] = host_profile(opt.step, 200, (("tottime", 14),))
            del opt, params
            torch.cuda.empty_cache()
        out[algorithm] = rows
    return out


def pattern_anchor(batch: int, device: torch.device) -> dict:
    """The momentum-SGD access pattern (read p, g, buf; write p, buf in place) as a plain CuPy elementwise
    kernel, against the copy of as many bytes and the fused step, all back to back."""
    import cupy

    from torchmb.optim import _fused

    numel = batch * sum(torch.Size(s).numel() for s in SHAPES)
    p, g, b = (torch.randn(numel, device=device) for _ in range(3))
    kernel = cupy.ElementwiseKernel("float32 g", "float32 p, float32 b", "b = b * 0.9f + g; p = p - 0.01f * b",
                                    "torchmb_bench_sgd_pattern")
    arrays = [cupy.from_dlpack(t) for t in (g, p, b)]
    index = device.index or 0

    def elementwise() -> None:
        with cupy.cuda.Device(index), _fused._stream(index):
            kernel(*arrays)

    out = {"elementwise_ms": back_to_back_ms(elementwise)}
    arrays.clear()
    del p, g, b
    torch.cuda.empty_cache()
    out["copy_ms"] = copy_ms(numel * 5 // 2, device)
    params = stacked(batch, device)
    opt = mo.SGD(params, lr=torch.logspace(-4, -1, batch).tolist(), momentum=torch.linspace(0.8, 0.99, batch).tolist())
    out["fused_step_ms"] = back_to_back_ms(opt.step)
    for key in ("elementwise_ms", "copy_ms", "fused_step_ms"):
        out[key.replace("_ms", "_tb_per_s")] = 5 * numel * 4 / out[key] / 1e9
    return out


def ncu_steps(batch: int, device: torch.device) -> None:
    """One step of torch's fused SGD, then one of the batched SGD (per-model lr and momentum)."""
    params = stacked(batch, device)
    torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True).step()
    del params
    params = stacked(batch, device)
    mo.SGD(params, lr=torch.logspace(-4, -1, batch).tolist(), momentum=torch.linspace(0.8, 0.99, batch).tolist()).step()
    torch.cuda.synchronize()


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
    parser.add_argument("--breakdown", action="store_true", help="host time, kernel time, variants, copy anchor")
    parser.add_argument("--ncu", action="store_true", help="one step each of torch fused SGD and batched SGD")
    parser.add_argument("--pattern", action="store_true",
                        help="SGD's access pattern as a plain elementwise kernel, against the copy and the step")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench_optim needs a CUDA device (or --smoke)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.ncu:
        ncu_steps(args.batch, device)
        return
    if args.pattern:
        if device.type != "cuda":
            raise SystemExit("--pattern needs a CUDA device")
        pattern = pattern_anchor(args.batch, device)
        print(json.dumps(pattern, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(pattern, f, indent=2)
        return
    if args.breakdown:
        if device.type != "cuda":
            raise SystemExit("--breakdown needs a CUDA device")
        report = breakdown(args.batch, device, args.iters)
        report.update(device=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch)
        for algorithm in ("sgd", "adam"):
            print(report[algorithm]["host_profile"])
            print(f"launch through the compiled function: {report[algorithm]['launch_through_function']}, "
                  f"blocks per SM from: {report[algorithm]['occupancy_from']}")
        for algorithm in ("sgd", "adam"):
            r = report[algorithm]
            print(f"{algorithm}: floor {r['floor_ms_at_copy_bandwidth']:.3f} ms at the copy's "
                  f"{report['copy_tb_per_s']:.2f} TB/s")
            for name in ("torch_fused", "torch_foreach", "batched_per_model"):
                v = r[name]
                print(f"  {name:18} isolated {v['isolated_ms']:.3f}  back-to-back {v['back_to_back_ms']:.3f} "
                      f"({v['back_to_back_tb_per_s']:.2f} TB/s)  host {v['host_ms']:.3f} ms")
            for variant, v in r["variants"].items():
                print(f"  variant {variant:12} back-to-back {v['back_to_back_ms']:.3f} ({v['tb_per_s']:.2f} TB/s) "
                      f"isolated {v['isolated_ms']:.3f}  regs {v['registers']} local {v['local_bytes']} "
                      f"blocks {v['resident_blocks']}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        return
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
