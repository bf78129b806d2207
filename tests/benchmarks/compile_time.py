"""Where the first compiled training step of a zoo model goes, torchmb against the plain model on all B*n samples.

    PYTHONPATH=.:tests python tests/benchmarks/compile_time.py tv-mobilenet_v3_small [--batch 16] [--impl limit]
        [--samples 128] [--size 32] [--device cuda]

The step is ``bench``'s forward and summed cross-entropy under ``torch.compile``, then backward (which compiles
the backward graph). It prints the first step's seconds, the kernels Inductor generated, and torch's own
compile-time counters (``torch._dynamo.utils.compile_times``) for the phases that tell where the time went:
dynamo's tracing of the Python, AOTAutograd's joint graph, Inductor's lowering, its scheduler (which simplifies
every node's index expressions), code generation and the wait for the kernels' compiles. Inductor's caches are
off, so every run compiles from nothing; run each implementation in a process of its own.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config as inductor_config
import torch._inductor.metrics as inductor_metrics
from host_time import ZOO, losses
from support.torchvision_ops import import_torchvision
from torch._dynamo.utils import compile_times

PHASES = (
    "bytecode_tracing",
    "aot_trace_joint_graph",
    "GraphLowering.run",
    "Scheduler.__init__",
    "Scheduler.codegen",
    "GraphLowering.codegen",
    "async_compile.wait",
)


def first_step_seconds(name: str, batch: int, impl: str, samples: int, size: int, device: torch.device) -> float:
    """Seconds of one compiled training step of ``name`` (torchmb's ``BatchModule`` or the plain model), the
    compile included."""
    loss_of, _ = losses(name, batch, samples, size, device)[impl]
    compiled = torch.compile(loss_of)
    start = time.perf_counter()
    compiled().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=ZOO)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--impl", choices=("torchmb", "limit"), default="torchmb")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    import_torchvision()
    inductor_config.force_disable_caches = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # bench's fp32
    seconds = first_step_seconds(args.workload, args.batch, args.impl, args.samples, args.size,
                                 torch.device(args.device))
    print(f"{args.workload} B={args.batch} {args.impl}: first step {seconds:.1f} s, "
          f"{inductor_metrics.generated_kernel_count} kernels generated")
    for line in compile_times(repr="str", aggregate=True).splitlines():
        if any(phase in line for phase in PHASES):
            print("  ", line.strip())


if __name__ == "__main__":
    main()
