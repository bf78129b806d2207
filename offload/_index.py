"""Index preparation and bounds checks of :class:`~offload.HostTable`: indices become flat int64 tensors
where an engine needs them (the compute device, host memory), and no index outside the table reaches an
engine (they all read or write host memory by it)."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import Tensor


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_index(idx, device: torch.device) -> Tensor:
    if not isinstance(idx, Tensor):
        idx = torch.as_tensor(idx)
    if idx.dtype == torch.bool or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise TypeError(f"indices must be an integer tensor, got dtype {idx.dtype}")
    return idx.reshape(-1).to(device=device, dtype=torch.int64, non_blocking=True)


def _on_host(idx) -> bool:
    """Whether indices are in host memory: a CPU tensor, or anything but a tensor (a numpy array, a list)."""
    return not isinstance(idx, Tensor) or idx.device.type == "cpu"


def _host_flat(idx) -> tuple[Tensor, bool]:
    """Indices in host memory as a flat, contiguous int64 CPU tensor, and whether it is a copy (else it is
    the caller's memory)."""
    if not isinstance(idx, Tensor):
        with _quiet_readonly():
            idx = torch.as_tensor(idx)
    if idx.dtype == torch.bool or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise TypeError(f"indices must be an integer tensor, got dtype {idx.dtype}")
    flat = idx.reshape(-1).to(torch.int64).contiguous()
    return flat, flat.untyped_storage().data_ptr() != idx.untyped_storage().data_ptr()


def _check_host_bounds(flat: Tensor, num_rows: int) -> None:
    """Bounds-check non-empty indices in host memory (no GPU involved)."""
    lo, hi = torch.aminmax(flat)
    _check_bounds(int(lo), int(hi), num_rows)


def _device_index(flat: Tensor, device: torch.device) -> Tensor:
    """Host indices on ``device``, through page-locked memory: the copy is queued on the current stream and
    the host does not wait for it."""
    pinned = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
    pinned.copy_(flat)
    return pinned.to(device, non_blocking=True)


def _host_index(idx: Tensor) -> Tensor:
    """``idx`` (int64) in host memory: as it is when it is there, else in page-locked memory once the current
    stream has written it (an asynchronous copy and one event wait; ``idx.cpu()`` goes through pageable
    memory)."""
    if idx.device.type == "cpu":
        return idx
    host = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    host.copy_(idx, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(idx.device))
    ev.synchronize()
    return host


def _check_bounds(lo: int, hi: int, num_rows: int) -> None:
    if lo < 0:
        raise IndexError(f"index {lo} is out of range for a table of {num_rows} rows (valid: 0..{num_rows - 1})")
    if hi >= num_rows:
        raise IndexError(f"index {hi} is out of range for a table of {num_rows} rows (valid: 0..{num_rows - 1})")


def check_unique(flat: Tensor, num_rows: int) -> bool:
    """Bounds-check non-empty indices that the caller promises distinct, with one host sync; returns
    whether they are ascending."""
    asc = (flat[1:] >= flat[:-1]).all() if flat.numel() > 1 else torch.ones((), dtype=torch.bool,
                                                                              device=flat.device)
    lo, hi, asc = torch.stack([*torch.aminmax(flat), asc.long()]).tolist()
    _check_bounds(lo, hi, num_rows)
    return bool(asc)


def sort_checked(flat: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """``torch.sort(flat)`` of bounds-checked indices, sorting 32-bit keys where every row number fits
    (0.08 against 0.12 ms for 131,072 indices on an H200)."""
    if num_rows <= 1 << 31:
        keys, order = torch.sort(flat.int())
        return keys.long(), order
    return torch.sort(flat)


@contextlib.contextmanager
def _quiet_readonly():
    """torch.from_numpy warns on read-only arrays (pytest runs with warnings as errors); writes are refused
    by the table itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield
