"""Timing shared by the benchmarks (run as scripts: this folder is on their import path)."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
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


def wall_seconds(fn: Callable[[], object], iters: int = 10, warmup: int = 2, repeats: int = 3,
                 finish: Callable[[], object] | None = None) -> float:
    """Median over ``repeats`` of the wall-clock seconds per call of ``iters`` back-to-back calls,
    synchronised once at the end: launch and host overhead count, as in training. ``finish`` runs before
    that synchronisation, inside the timing (e.g. ``HostTable.synchronize``, which writes a deferred
    scatter)."""
    for _ in range(warmup):
        fn()
    if finish is not None:
        finish()
    torch.cuda.synchronize()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        if finish is not None:
            finish()
        torch.cuda.synchronize()
        means.append((time.perf_counter() - start) / iters)
    return statistics.median(means)


def compiled_training_step(model: torch.nn.Module) -> Callable[[torch.Tensor], None]:
    """One step of ``model`` under ``torch.compile``: the forward of an input, then the backward of its sum."""
    compiled = torch.compile(model)

    def step(x: torch.Tensor) -> None:
        compiled(x).sum().backward()

    return step


def round_milliseconds(step: Callable[[torch.Tensor], None], x: torch.Tensor, steps: int = 20,
                       rounds: int = 3) -> list[float]:
    """Milliseconds per step of ``step(x)`` in each of ``rounds`` rounds of ``steps`` back-to-back steps, each
    synchronised once at its end, after three untimed steps (the first compiles)."""
    for _ in range(3):
        step(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            step(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return times


def enqueue_seconds(fn: Callable[[], object], calls: int, runs: int = 1, warmup: int = 0) -> float:
    """The best over ``runs`` of the host seconds per call of ``calls`` back-to-back calls of ``fn``, each run's
    clock stopped before the device is synchronised: what the host takes to enqueue the work, with nothing
    waiting on the GPU (as in a training step, whose host time this measures where the GPU keeps up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return best


def host_profile(fn: Callable[[], object], calls: int, sorts: tuple[tuple[str, int], ...] = (("tottime", 25),)) -> str:
    """cProfile of ``calls`` calls of ``fn`` (the device synchronised after, outside the profile), as text: the
    top ``lines`` entries by each ``(sort key, lines)`` of ``sorts``. Where the host time of a step goes."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    for key, lines in sorts:
        stats.sort_stats(key).print_stats(lines)
    return text.getvalue()
