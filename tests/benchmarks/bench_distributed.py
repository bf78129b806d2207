"""Model-steps per second of B models sharded across the ranks of a torchrun group (one GPU per rank).

Each rank trains its shard of the B models (SGD steps, n samples per model, per-model inputs); the
ranks never communicate inside a step. The total rate is B divided by the slowest rank's step time.
Run once per world size and compare:

    torchrun --nproc-per-node 1 tests/benchmarks/bench_distributed.py --json one.json
    torchrun --nproc-per-node 2 tests/benchmarks/bench_distributed.py --json two.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchmb import _bench, distributed


def seconds_per_step(name: str, args: argparse.Namespace, device: torch.device, world: int) -> float:
    """This rank's time per training step of its shard of the models."""
    workload = _bench.WORKLOADS[name]
    torch.manual_seed(0)
    models = distributed.local_batch_module(workload.make(), args.batch, init="independent", seed=0).to(device)
    optimizer = torch.optim.SGD(models.parameters(), lr=0.01)
    x = workload.make_input((models.batch, args.samples), device)
    y = torch.randint(0, workload.classes, (models.batch, args.samples), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = models(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum").div(args.samples).backward()
        optimizer.step()

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / args.iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="lenet,mlp")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = distributed.init_from_env(args.device)
    rank, world = distributed.rank_and_world_size()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    rows = []
    for name in args.workloads.split(","):
        seconds = seconds_per_step(name, args, device, world)
        local = distributed.shard_slice(args.batch)
        per_model = torch.full((local.stop - local.start,), seconds, dtype=torch.float64)
        slowest = distributed.gather_models(per_model).max().item()
        row = {"workload": name, "B": args.batch, "world": world, "model_steps_per_s": args.batch / slowest}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and args.json:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
