"""Host memory for offloaded tables: allocation, page-locking ("pinning") and the errors around them.

A table is allocated as ordinary host memory and then page-locked in place with ``cudaHostRegister``
(or, for a memory-mapped ``.npy`` file, the mapping is registered). Unlike ``torch.empty(...,
pin_memory=True)``, whose caching allocator rounds every block up to a power of two, this costs
exactly the table's bytes, and it lets a memory-mapped file be pinned without a second copy.
"""

from __future__ import annotations

import mmap
import resource
import threading

import psutil
import torch

import torchmb_config

__all__ = ["HostMemoryError", "host_memory_available", "pin_tensor", "unpin_tensor"]


class HostMemoryError(MemoryError):
    """Host memory for a table could not be allocated or page-locked.

    The message states the bytes asked for and what the machine reports as available; nothing is
    left allocated or registered when it is raised.
    """


def _fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def host_memory_available() -> dict[str, int | None]:
    """What the machine reports: the memory available without swapping (bytes; ``MemAvailable`` of
    /proc/meminfo on Linux, as :func:`psutil.virtual_memory` reads it) and ``RLIMIT_MEMLOCK``.

    Values are ``None`` where the platform does not report them; ``memlock`` is ``None`` when unlimited.
    """
    avail: int | None
    try:
        avail = int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):  # no /proc in a sandbox
        avail = None
    memlock: int | None
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        memlock = None if soft == resource.RLIM_INFINITY else int(soft)
    except (OSError, ValueError, AttributeError):
        memlock = None
    return {"available": avail, "memlock": memlock}


def _memory_report() -> str:
    info = host_memory_available()
    avail = "unknown" if info["available"] is None else _fmt_bytes(info["available"])
    lock = "unlimited" if info["memlock"] is None else _fmt_bytes(info["memlock"])
    return f"MemAvailable {avail}, RLIMIT_MEMLOCK {lock}"


HUGE_PAGES = torchmb_config.SWITCHES["offload_huge_pages"]
"""Whether to allocate tables of at least ``HUGE_PAGE_MIN`` bytes as anonymous memory maps advised for transparent
huge pages (``madvise(MADV_HUGEPAGE)``), so that random rows of a large table cost fewer address
translations on the host and, where the driver maps the pinned pages with large pages, on the GPU.
``$TORCHMB_OFFLOAD_HUGE_PAGES=0`` turns it off (the ``torchmb_config`` switch ``"offload_huge_pages"``).
Where the kernel has no transparent huge pages the advice is ignored and the memory is ordinary."""
HUGE_PAGE_MIN = 32 << 20


def allocate_host(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """An uninitialised plain CPU tensor; a failed allocation raises :class:`HostMemoryError`.

    Large tables are anonymous memory maps advised for huge pages (see :data:`HUGE_PAGES`); the tensor
    holds the map, which is unmapped when the last tensor viewing it is freed.
    """
    nbytes = _nbytes(shape, dtype)
    try:
        if HUGE_PAGES.get() and nbytes >= HUGE_PAGE_MIN and hasattr(mmap, "MADV_HUGEPAGE"):
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # no transparent huge pages here: ordinary pages
                pass
            return torch.frombuffer(m, dtype=torch.uint8).view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError, OSError, ValueError) as e:
        raise HostMemoryError(
            f"could not allocate {_fmt_bytes(nbytes)} ({nbytes} bytes) of host memory for {what} "
            f"({_memory_report()}): {e}"
        ) from e


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return n


# cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every device, mapped for UVA access.
_REGISTER_FLAGS = 0x01 | 0x02
_registered: dict[int, int] = {}
_lock = threading.Lock()


def _cuda_register(ptr: int, nbytes: int) -> int:
    """Calls ``cudaHostRegister``; returns the CUDA error code (0 on success). Patched in tests."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
    return int(getattr(err, "value", err))


def _cuda_unregister(ptr: int) -> int:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(ptr)
    return int(getattr(err, "value", err))


def pin_tensor(t: torch.Tensor, what: str) -> None:
    """Page-lock ``t``'s memory in place (``cudaHostRegister``). Raises :class:`HostMemoryError`.

    On failure the CUDA error is cleared and nothing stays registered.
    """
    if not torch.cuda.is_available():
        raise HostMemoryError(f"cannot pin host memory for {what}: CUDA is not available on this machine")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    ptr = t.data_ptr()
    torch.cuda.init()
    err = _cuda_register(ptr, nbytes)
    if err != 0:
        # Clear the sticky "last error" so later CUDA calls do not report this failure.
        try:
            torch.cuda.cudart().cudaGetLastError()
        except AttributeError:
            pass
        raise HostMemoryError(
            f"could not pin (cudaHostRegister) {_fmt_bytes(nbytes)} ({nbytes} bytes) of host memory for "
            f"{what} ({_memory_report()}): CUDA error {err}"
        )
    with _lock:
        _registered[ptr] = nbytes


def unpin_tensor(t: torch.Tensor) -> None:
    """Undo :func:`pin_tensor` (no-op when ``t`` was not registered by it)."""
    ptr = t.data_ptr()
    with _lock:
        if _registered.pop(ptr, None) is None:
            return
    _cuda_unregister(ptr)


def is_registered(t: torch.Tensor) -> bool:
    with _lock:
        return t.data_ptr() in _registered
