"""Profile one torchmb training step (torch.profiler): where the time of a workload goes.

    python tests/benchmarks/profile_step.py --workload lenet --batch 64 [--impl torchmb] [--rows 25] [--host]

``--host`` prints instead where the host's time of a step goes: the wall time of enqueueing steps (no
sync), the kernel launches per step, and the operators sorted by their own CPU time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from torchmb import _bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="lenet", choices=sorted(_bench.WORKLOADS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--impl", default="torchmb")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--host", action="store_true", help="host time, launches and CPU-time table instead")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    steps = _bench._step_functions(_bench.WORKLOADS[args.workload], args.batch, args.samples, device, (args.impl,))
    step = steps[args.impl]
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"== {args.workload} B={args.batch} {args.impl}")
    if not args.host:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        return
    launches = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key or "LaunchCooperative" in e.key)
    print(f"kernel launches per step: {launches / 5:.0f}; enqueue ms per step: {enqueue_ms(step):.3f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


def enqueue_ms(step, steps: int = 20) -> float:
    """Host milliseconds per step of enqueueing ``steps`` steps (the GPU may lag; nothing waits for it)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / steps * 1e3


if __name__ == "__main__":
    main()
