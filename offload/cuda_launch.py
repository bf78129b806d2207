"""Launching CuPy kernels cheaply on torch's current CUDA stream: the one launcher of every CuPy kernel
(``offload``'s, ``batch_layers``' and the fused optimizers of ``torchmb.optim``).

A small lookup or a cache's bookkeeping is bound by host time, and ``cupy.cuda.Function.__call__`` converts
every argument on each call (tens of microseconds with the stream and device context managers around it).
Here a kernel is compiled once per (kind, device, defines) and kept as a :class:`Kernel` that knows how its
arguments are packed (all 8 bytes: pointers and ``long long``); a launch packs them into a per-thread buffer
and makes one ``cuLaunchKernel`` call through CuPy's driver binding (a few hundred nanoseconds of Python),
which checks the result and raises ``CUDADriverError``. Where CuPy lacks that binding (or
:data:`LAUNCH_MODE` says ``"cupy"``) the launch goes through ``cupy.cuda.Function`` instead.

Callers check their tensors (device, dtype, contiguity, sizes) before passing ``data_ptr()`` here: a launch
trusts its arguments.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
import warnings
from collections import Counter

import torch

try:
    import cupy
except (ImportError, OSError):  # pragma: no cover - depends on the machine
    cupy = None

__all__ = ["KERNELS", "LAUNCHES", "LAUNCH_MODE", "SLOW_LAUNCHES", "VECTOR_TYPES", "Kernel", "compile_kernel",
           "current_device", "launch", "sm_count", "stream_ptr", "vector_width"]

#: Kernel launches per kernel name since import (tests use it to prove a kernel ran).
LAUNCHES: Counter[str] = Counter()
#: The launches among those that took the slower ``cupy.cuda.Function`` call instead of the direct
#: ``cuLaunchKernel`` (see :data:`LAUNCH_MODE`).
SLOW_LAUNCHES: Counter[str] = Counter()
#: Compiled kernels by ``(kind, name, device, *defines)``.
KERNELS: dict[tuple, Kernel] = {}

_LOCK = threading.Lock()
_STREAMS: dict[tuple[int, int], object] = {}
_MAX_ARGS = 32

#: CUDA types of a vector of raw bytes, by width in bytes (for kernels that move rows of any dtype).
VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

_SM_COUNTS: dict[int, int] = {}


def vector_width(*values: int) -> int:
    """The widest vector (16, 8, 4, 2 or 1 bytes) that divides every value: row sizes, strides, addresses."""
    m = 16
    for v in values:
        m |= v
    return m & -m


def sm_count(index: int) -> int:
    """The multiprocessors of CUDA device ``index`` (asked once)."""
    got = _SM_COUNTS.get(index)
    if got is None:
        got = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return got


class _RawStream:
    """A stream handle for ``cupy.cuda.Function.__call__(..., stream=)``, which reads only ``.ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _StreamProtocol:
    """torch's raw stream behind the CUDA stream protocol (for ``cupy.cuda.Stream.from_external``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _stream_ptr_slow(index: int) -> int:
    """The raw ``cudaStream_t`` of torch's current stream on device ``index`` (through torch's Python API)."""
    return torch.cuda.current_stream(index).cuda_stream


#: ``stream_ptr(index)``: the raw ``cudaStream_t`` of torch's current stream on device ``index``.
stream_ptr = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_ptr_slow


def _current_device_slow() -> int:
    """The calling thread's current CUDA device index (through torch's Python API)."""
    return torch.cuda.current_device()


#: ``current_device()``: the calling thread's current CUDA device index (no lazy-init check).
current_device = getattr(torch._C, "_cuda_getDevice", None) or _current_device_slow


def _external_stream(ptr: int, index: int):
    """A cached CuPy stream object wrapping torch's stream ``ptr`` (the slow, always-available path)."""
    key = (index, ptr)
    stream = _STREAMS.get(key)
    if stream is None:
        if hasattr(cupy.cuda, "ExternalStream"):
            with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cupy.cuda.ExternalStream(ptr, index)
        else:
            stream = cupy.cuda.Stream.from_external(_StreamProtocol(ptr))
        _STREAMS[key] = stream
    return stream


class Kernel:
    """A compiled kernel of one device: the CuPy ``Function`` and ``RawKernel``, the raw ``CUfunction``
    (0 where CuPy does not expose it) and how its arguments are packed for ``cuLaunchKernel``."""

    __slots__ = ("function", "index", "name", "pack_into", "ptr", "raw")

    def __init__(self, raw, function, name: str, index: int, fmt: str) -> None:
        if len(fmt) > _MAX_ARGS:
            raise ValueError(f"a kernel launched here takes at most {_MAX_ARGS} arguments, {name} has {len(fmt)}")
        self.raw = raw
        self.function = function
        self.name = name
        self.index = index
        ptr = getattr(function, "ptr", 0) if function is not None else 0
        self.ptr = ptr if isinstance(ptr, int) else 0
        self.pack_into = struct.Struct("<" + fmt).pack_into  # every argument is 8 bytes (pointers, long longs)

    @property
    def max_threads_per_block(self) -> int:
        """The most threads a block of this kernel can have (its registers can cap it below the device's)."""
        return int(self.raw.max_threads_per_block)


def compile_kernel(kind: str, source: str, name: str, defines: dict[str, object], index: int, fmt: str,
                   options: tuple[str, ...] = ("-std=c++17",)) -> Kernel:
    """Kernel ``name`` of ``source`` compiled once per (kind, name, device, defines) and cached; ``defines``
    become ``#define`` lines in front of the source. ``fmt`` is the ``struct`` code of its arguments (``Q`` a
    pointer, ``q`` a long long), in order: every argument is 8 bytes."""
    key = (kind, name, index, *defines.values())
    entry = KERNELS.get(key)
    if entry is None:
        with _LOCK:
            entry = KERNELS.get(key)
            if entry is None:
                header = "".join(f"#define {k} {v}\n" for k, v in defines.items())
                with cupy.cuda.Device(index):
                    raw = cupy.RawKernel(header + source, name, options=options)
                    raw.compile()
                    try:
                        function = raw.kernel  # the loaded cupy.cuda.Function of this device
                    except Exception:  # pragma: no cover - depends on the CuPy version
                        function = None
                entry = Kernel(raw, function, name, index, fmt)
                KERNELS[key] = entry
    return entry


class _ArgBuffer(threading.local):
    """Per-thread ``cuLaunchKernel`` argument storage: ``_MAX_ARGS`` 8-byte slots and the ``void*[]`` that
    points at them. Per thread because the launch releases the GIL (the autograd engine runs backward
    passes on its own threads)."""

    def __init__(self) -> None:
        self.values = (ctypes.c_int64 * _MAX_ARGS)()
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * _MAX_ARGS)(*(base + 8 * k for k in range(_MAX_ARGS)))
        self.params = ctypes.addressof(self.pointers)
        self.ready: set[int] = set()  # devices whose context this thread has made current


_ARGS = _ArgBuffer()
#: How kernels are launched: ``"driver"`` packs the arguments into a per-thread buffer and calls
#: ``cuLaunchKernel`` once (a few hundred ns of Python); ``"cupy"`` calls ``cupy.cuda.Function``,
#: which converts every argument on each call. Tests and the benchmarks flip it (item 0 of the list).
LAUNCH_MODE = ["driver" if cupy is not None and hasattr(getattr(cupy.cuda, "driver", None), "launchKernel")
               else "cupy"]
_DIRECT_LAUNCH = [True]
_DRIVER_LAUNCH = cupy.cuda.driver.launchKernel if LAUNCH_MODE[0] == "driver" else None


def _make_context_current(buf: _ArgBuffer, index: int) -> None:
    """Once per thread and device: make sure a CUDA context is current before a driver-API launch (torch's
    threads have one once they ran CUDA work; a fresh thread may not)."""
    get = getattr(cupy.cuda.driver, "ctxGetCurrent", None)
    if get is None or get() == 0:
        cupy.cuda.runtime.free(0)  # the runtime makes the current device's primary context current
    buf.ready.add(index)


def launch(kernel: Kernel, grid: int, block: int, args: tuple) -> None:
    """Launch ``kernel`` with ``grid`` blocks of ``block`` threads on torch's current stream of its device.

    Fast path (``LAUNCH_MODE[0] == "driver"``): the arguments go into this thread's packed buffer and one
    ``cuLaunchKernel`` call (under the kernel's device when another one is current). Otherwise
    ``cupy.cuda.Function.__call__`` under the kernel's device (or, without it, the ``RawKernel`` inside a
    CuPy external stream).
    """
    index = kernel.index
    stream = stream_ptr(index)
    if kernel.ptr and LAUNCH_MODE[0] == "driver":
        if current_device() == index:
            buf = _ARGS
            if index not in buf.ready:
                _make_context_current(buf, index)
            kernel.pack_into(buf.values, 0, *args)
            _DRIVER_LAUNCH(kernel.ptr, grid, 1, 1, block, 1, 1, 0, stream, buf.params, 0)
        else:
            with cupy.cuda.Device(index):
                buf = _ARGS
                if index not in buf.ready:
                    _make_context_current(buf, index)
                kernel.pack_into(buf.values, 0, *args)
                _DRIVER_LAUNCH(kernel.ptr, grid, 1, 1, block, 1, 1, 0, stream, buf.params, 0)
        LAUNCHES[kernel.name] += 1
        return
    _launch_cupy(kernel, grid, block, args, stream)


def _launch_cupy(kernel: Kernel, grid: int, block: int, args: tuple, stream: int) -> None:
    index = kernel.index
    switch = index != current_device()
    with cupy.cuda.Device(index) if switch else contextlib.nullcontext():
        if kernel.function is not None and _DIRECT_LAUNCH[0]:
            try:
                kernel.function((grid,), (block,), args, stream=_RawStream(stream))
            except (TypeError, AttributeError):  # pragma: no cover - a CuPy without duck-typed streams
                _DIRECT_LAUNCH[0] = False
            else:
                LAUNCHES[kernel.name] += 1
                SLOW_LAUNCHES[kernel.name] += 1
                return
        with _external_stream(stream, index):
            kernel.raw((grid,), (block,), args)
    LAUNCHES[kernel.name] += 1
    SLOW_LAUNCHES[kernel.name] += 1
