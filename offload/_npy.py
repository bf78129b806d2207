"""``.npy`` files as tables: :meth:`HostTable.from_npy <offload.HostTable.from_npy>` (memory-mapped or read)
and :meth:`HostTable.save_npy <offload.HostTable.save_npy>` (atomic), with bfloat16 stored as uint16."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ._index import _quiet_readonly
from ._memory import allocate_host

if TYPE_CHECKING:
    from ._table import HostTable

_NP_STORE = {torch.bfloat16: np.uint16}


def _numpy_view(t: Tensor) -> np.ndarray:
    if t.dtype in _NP_STORE:
        return t.view(torch.int16).numpy().view(_NP_STORE[t.dtype])
    return t.numpy()


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


def load_table(cls: type[HostTable], path, *, mmap_mode, dtype, device, pin, engine) -> HostTable:
    """A ``cls`` over the 2-D ``.npy`` file ``path`` (see :meth:`HostTable.from_npy`)."""
    arr = np.load(os.fspath(path), mmap_mode=mmap_mode)
    if arr.ndim != 2:
        raise ValueError(f"{os.fspath(path)}: a HostTable needs a 2-D array, got shape {arr.shape}")
    if mmap_mode is None:
        data = allocate_host(arr.shape, _torch_dtype(arr.dtype), f"the table in {os.fspath(path)}")
        data.copy_(torch.from_numpy(arr))
        keepalive = None
    else:
        with _quiet_readonly():
            data = torch.from_numpy(arr)
        keepalive = arr
    if dtype is not None and dtype != data.dtype:
        data = data.view(dtype)
    if pin is None:
        pin = mmap_mode is None and torch.cuda.is_available()
    self = cls.__new__(cls)
    self._init(data, device=device, pin=pin, engine=engine, keepalive=keepalive)
    self._readonly = mmap_mode == "r"
    return self


def save_table(table: HostTable, path) -> None:
    """Write ``table`` to ``path`` as ``.npy``, atomically (see :meth:`HostTable.save_npy`)."""
    table.synchronize()
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, _numpy_view(table._data))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
