"""Profile one torchmb training step (torch.profiler): where the time of a workload goes.

    python tests/benchmarks/profile_step.py --workload lenet --batch 64 [--impl torchmb,vmap+compile]
        [--rows 25] [--host] [--precision bf16] [--no-tf32]

fp32 runs on TF32 tensor cores as in ``bench`` (matrix products and convolutions alike; ``--no-tf32``: neither).

``--host`` prints instead where the host's time of a step goes: the wall time of enqueueing steps (no
sync), the kernel launches per step, and the operators sorted by their own CPU time.
"""

from __future__ import annotations

import argparse

import torch
from _timing import enqueue_seconds
from torch.profiler import ProfilerActivity, profile

from torchmb.cli import bench_steps as _bench_steps
from torchmb.cli.bench import tf32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="lenet", choices=sorted(_bench_steps.WORKLOADS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--impl", default="torchmb", help="comma-separated implementations, profiled one by one")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--host", action="store_true", help="host time, launches and CPU-time table instead")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--no-tf32", dest="tf32", action="store_false", help="fp32 products without TF32")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    builders = _bench_steps.Steps(
        _bench_steps.WORKLOADS[args.workload], args.batch, args.samples, device, precision=args.precision
    ).builders()
    for impl in args.impl.split(","):
        title = f"{args.workload} B={args.batch} {impl} {args.precision}{'' if args.tf32 else ' without TF32'}"
        with tf32(args.tf32):
            profile_one(builders[impl](), title, args.rows, args.host)
        torch.cuda.empty_cache()


def profile_one(step, title: str, rows: int, host: bool) -> None:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 5 / 1e3
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or "LaunchCooperative" in e.key) / 5
    print(f"== {title}: {launches:.0f} kernel launches, {gpu_ms:.3f} GPU ms per step")
    if not host:
        print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
        return
    print(f"enqueue ms per step: {enqueue_seconds(step, calls=20) * 1e3:.3f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
