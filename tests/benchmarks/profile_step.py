"""Profile one torchmb training step (torch.profiler): where the time of a workload goes.

    python tests/benchmarks/profile_step.py --workload lenet --batch 64 [--shared] [--rows 25]
"""

from __future__ import annotations

import argparse

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
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
