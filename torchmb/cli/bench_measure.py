"""Measuring one row of ``python -m torchmb bench``: its steps per second, peak memory, compile time and
launches per step, inside a time limit, with its failures told apart (out of memory or another error).

A row's first step (which compiles, captures or autotunes cuDNN) is timed on its own (``first_step_s``;
``compile_s`` for the compiled implementations) and never counts toward the steady state's
``ms_per_step``. Launches per step come from ``torch.profiler`` over one steady step after the timings:
on CUDA the kernel launches the host issued (``cudaLaunchKernel``-type runtime calls, a CUDA graph's replay
counting once) and the kernels the device ran; on every device the ATen operators the host dispatched (the
outermost ones: ``aten::linear`` counts, not the ``aten::addmm`` inside it).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

__all__ = ["RowTimeout", "aten_op_names", "count_events", "first_line", "is_out_of_memory", "measure", "time_limit"]

REPEAT_SECONDS = 0.1  # each timing lasts about this long (at least 2 steps, at most --iters)
_LAUNCHES = ("LaunchKernel", "LaunchCooperativeKernel", "cudaGraphLaunch")  # runtime and driver API names
_ALLOCATION_FAILURES = ("out of memory", "CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED")


class RowTimeout(BaseException):
    """A row ran past its time limit. A ``BaseException``, as ``KeyboardInterrupt`` is: the compiler's own
    ``except Exception`` (autotuning skips a configuration that fails) must not swallow it."""


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds_per_call(self, fn: Callable[[], object], iters: int) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - start) / iters


def free(device: torch.device) -> None:
    """On CUDA, let go of what the last row left (its reference cycles too) and count peak memory afresh.
    Nothing on other devices, where no peak is measured (and a full garbage collection takes most of a
    small row's time)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`RowTimeout` in the block once ``seconds`` have passed (a POSIX interval timer). The
    signal is handled when Python next runs, so a long call into C (a cuDNN autotuning pass) ends first.
    No limit with ``None``, off the main thread, or where the platform has no ``SIGALRM``."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise RowTimeout(f"past the row's time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def first_line(error: BaseException) -> str:
    """``Type: the message's first line`` (at most 200 characters): what a row reports of an error."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` or one it was raised from is the device running out of memory (the compiler wraps
    it in its own errors; cuDNN and cuBLAS report failed allocations as runtime errors)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.cuda.OutOfMemoryError) or any(m in str(error) for m in _ALLOCATION_FAILURES):
            return True
        error = error.__cause__ or error.__context__
    return False


def count_events(events: Iterable) -> dict[str, int]:
    """Per profiled step: ``aten_ops`` (outermost ATen operators); with device events, ``launches`` (kernel
    launch calls of the CUDA runtime and driver APIs, a graph replay once) and ``kernels`` (kernels run on
    the device, copies and fills left out). ``events`` are ``torch.profiler`` events (``name``,
    ``device_type``, ``cpu_parent``)."""
    events = list(events)
    launches = kernels = 0
    has_device = False
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            has_device = True
            kernels += not event.name.startswith(("Memcpy", "Memset"))
        elif any(name in event.name for name in _LAUNCHES):
            launches += 1
    counts = {"aten_ops": sum(aten_op_names(events).values())}
    if has_device or launches:
        counts.update(launches=launches, kernels=kernels)
    return counts


def aten_op_names(events: Iterable) -> collections.Counter[str]:
    """The outermost ATen operators among ``events`` (``torch.profiler`` events), by name: what
    :func:`count_events` counts as ``aten_ops``, to tell which operators one step has more of than another."""
    return collections.Counter(
        event.name
        for event in events
        if event.device_type != torch.autograd.DeviceType.CUDA
        and event.name.startswith("aten::")
        and not _inside_aten(event)
    )


def _inside_aten(event: object) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def profile_step(step: Callable[[], object], timer: Timer) -> dict[str, int]:
    """Count one steady step's operators, launches and kernels (see :func:`count_events`)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if timer.device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        step()
        timer.sync()
    return count_events(profiler.events())


def measure(
    row: dict,
    build: Callable[[], Callable[[], object]],
    timer: Timer,
    batch: int,
    repeats: int,
    iters: int,
    warmup: int,
    compiled: bool = False,
    launches: bool = False,
) -> None:
    """Build one implementation, time it into ``row`` and let it go. With ``launches``, count one steady
    step's launches too (after the timings, so that the profiler slows none of them)."""
    device = timer.device
    if compiled:
        counters.clear()
    step = build()
    if hasattr(step, "note"):
        row["note"] = step.note
    start = time.perf_counter()
    step()
    timer.sync()
    row["first_step_s"] = time.perf_counter() - start
    if compiled:
        row["compile_s"] = row["first_step_s"]
    if device.type == "cuda":
        row["first_step_peak_mib"] = _mib(device)
        torch.cuda.reset_peak_memory_stats(device)
    one = timer.seconds_per_call(step, max(1, warmup))  # the warm-up steps estimate a step's time
    iters = max(2, min(iters, round(REPEAT_SECONDS / max(one, 1e-9))))
    seconds = sorted(timer.seconds_per_call(step, iters) for _ in range(repeats))
    median = statistics.median(seconds)
    row.update(
        ms_per_step=median * 1e3,
        model_steps_per_s=batch / median,
        model_steps_per_s_range=[batch / seconds[-1], batch / seconds[0]],
        repeats=repeats,
        iters=iters,
    )
    if device.type == "cuda":
        row["peak_mib"] = _mib(device)
    if compiled:
        row["graphs"] = counters["stats"]["unique_graphs"]  # more than one: graph breaks or recompiles
    if launches:
        try:
            row.update({f"{name}_per_step": count for name, count in profile_step(step, timer).items()})
        except Exception as error:  # the timings stand without the counts
            row["launches_error"] = first_line(error)
