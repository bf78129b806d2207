"""Operators per training step, torchmb against the plain model on all B*n samples, and which operators
torchmb has more of (issue 24's host-cost target: launches at most 1.2x the plain model's).

    PYTHONPATH=.:tests python tests/benchmarks/launch_diff.py --workloads tv-resnet18,timm-convnext_atto \
        [--batch 16] [--samples 2] [--diff 20]

Counts one steady step (after one untimed step) of ``bench``'s own torchmb and limit steps on the CPU in two
ways: ``aten``, ``bench --launches``'s count (:func:`torchmb.cli.bench_measure.aten_op_names`, the outermost
ATen operators, views and no-op ``to``/``contiguous`` included, since each costs host time), and
``computing``, the operators that reach a kernel (:mod:`support.launches`, about one GPU launch each). For
each it prints the two totals and their ratio, then the operators torchmb dispatches more (+) or fewer (-)
times than the plain model.
"""

from __future__ import annotations

import argparse
import collections

import torch
from support.launches import count_launches
from support.torchvision_ops import import_torchvision
from torch.profiler import ProfilerActivity, profile

from torchmb.cli import bench_steps
from torchmb.cli.bench_measure import aten_op_names


def aten_ops_per_step(step) -> collections.Counter[str]:
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    return aten_op_names(profiler.events())


def print_difference(kind: str, batched: collections.Counter, plain: collections.Counter, rows: int) -> None:
    total_batched, total_plain = sum(batched.values()), sum(plain.values())
    print(f"  {kind}: torchmb {total_batched}, plain {total_plain}, {total_batched / total_plain:.2f}x")
    differences = {op: batched[op] - plain[op] for op in batched.keys() | plain.keys() if batched[op] != plain[op]}
    for op, difference in sorted(differences.items(), key=lambda item: (-abs(item[1]), item[0]))[:rows]:
        print(f"    {difference:+5d}  {op}  ({batched[op]} against {plain[op]})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="tv-resnet18,timm-convnext_atto,timm-vit_tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--diff", type=int, default=25, help="how many of the largest differences to list")
    args = parser.parse_args()
    import_torchvision()  # its model definitions, where its compiled operators do not load (CPU torch)
    torch.manual_seed(0)
    for name in args.workloads.split(","):
        steps = bench_steps.Steps(bench_steps.WORKLOADS[name], args.batch, args.samples, torch.device("cpu"))
        counts = {}
        for impl in ("torchmb", "limit"):
            step = steps.builders()[impl]()
            step()  # the first step creates the optimizer's state and settles the merged order
            counts[impl] = aten_ops_per_step(step), count_launches(step)
        print(f"== {name} B={args.batch}")
        for index, kind in enumerate(("aten", "computing")):
            print_difference(kind, counts["torchmb"][index], counts["limit"][index], args.diff)


if __name__ == "__main__":
    main()
