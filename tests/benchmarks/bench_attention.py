"""Scaled dot-product attention in float32, forward and backward: torch's own choice (its memory-efficient
kernel) against its math path, which the attention table (``batch_layers._attention_table.MATH_ATTENTION``)
takes for short sequences, by key count, head dim and query rows, with TF32 products allowed and not.

    PYTHONPATH=. python tests/benchmarks/bench_attention.py [--heads 3] [--compiled] [--json FILE]

Prints, per shape, milliseconds per step (the best of three rounds, CUDA events) and peak memory for both,
and their ratio. Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = (
    *((rows, 65, 64) for rows in (16, 64, 256, 1024, 2048, 8192)),  # ViT-Tiny on 32x32 images, patch 4: 65 tokens
    *((rows, keys, head_dim) for head_dim in (32, 64, 128) for rows, keys in
      ((2048, 65), (675, 197), (517, 257), (256, 401), (256, 577), (256, 1025))),
)
"""(query rows, keys = queries, head dim); the rows shrink as the sequence grows, to keep the scores' memory."""


def milliseconds(step: Callable[[], None], steps: int = 10) -> float:
    for _ in range(3):  # (the first compiles)
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(3):
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / steps)
    return min(rounds)


def measure(rows: int, heads: int, keys: int, head_dim: int, math: bool, compiled: bool) -> tuple[float, float]:
    """Milliseconds per forward and backward, and peak MiB, of one attention shape."""
    q, k, v = (torch.randn(rows, heads, keys, head_dim, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v)

    run = torch.compile(attend) if compiled else attend
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ms = milliseconds(lambda: run(q, k, v).backward(grad))
    return ms, torch.cuda.max_memory_allocated() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="under torch.compile (head dim 64 only)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    results = []
    for tf32 in (True, False):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for rows, keys, head_dim in SHAPES:
            if args.compiled and head_dim != 64:
                continue
            (fused, fused_mib), (math, math_mib) = (
                measure(rows, args.heads, keys, head_dim, use_math, args.compiled) for use_math in (False, True))
            row = {"tf32": tf32, "rows": rows, "keys": keys, "head_dim": head_dim, "compiled": args.compiled,
                   "sdpa_ms": fused, "math_ms": math, "speedup": fused / math, "sdpa_mib": fused_mib,
                   "math_mib": math_mib}
            results.append(row)
            print(f"tf32={tf32} rows={rows} keys={keys} head_dim={head_dim}: sdpa {fused:.3f} ms, math {math:.3f} ms "
                  f"({fused / math:.2f}x); peak {fused_mib:.0f} / {math_mib:.0f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
