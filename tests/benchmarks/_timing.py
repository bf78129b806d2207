"""Timing shared by the layer benchmarks (run as scripts: this folder is on their import path)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls, each timed with CUDA events after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
