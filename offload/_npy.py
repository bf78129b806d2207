"""``.npy`` files as tables: :meth:`HostTable.from_npy <offload.HostTable.from_npy>` (memory-mapped or read,
a truncated file refused) and :meth:`HostTable.save_npy <offload.HostTable.save_npy>` (atomic, through
:func:`offload.checkpoint_files.write_file_atomically`), with bfloat16 stored as uint16."""

from __future__ import annotations

import os
from typing import IO, TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ._index import _quiet_readonly
from ._memory import allocate_host
from .checkpoint_files import DamagedFileError, remove_orphans, write_file_atomically

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
    remove_orphans(path)  # what killed save_npy calls left beside it
    _check_length(os.fspath(path))
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


def _check_length(path: str) -> None:
    """Refuse a ``.npy`` file shorter or longer than its header says (a truncated copy or save), naming it,
    where numpy would fail with ``mmap length is greater than file size`` or read garbage."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                return  # 3.0: UTF-8 field names, never a numeric table's
        except (ValueError, EOFError, SyntaxError) as err:
            raise DamagedFileError(f"{path} is damaged: not a readable .npy file ({err})") from err
        data_start = f.tell()
    size = os.stat(path).st_size
    expected = data_start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not dtype.hasobject and size != expected:
        raise DamagedFileError(f"{path} is damaged: {size} bytes where its header ({shape} {dtype}) needs "
                               f"{expected} (truncated?)")


_WRITE_CHUNK = 64 << 20


def write_table(table: HostTable, file: IO[bytes]) -> None:
    """Write ``table`` as ``.npy`` to the binary ``file``: the header, then the table's memory as it is
    (``np.save`` to a file object copies it chunk by chunk first)."""
    table.synchronize()
    arr = np.ascontiguousarray(_numpy_view(table._data))
    header = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(file, header)
    except ValueError:  # a header over 64 KiB
        np.lib.format.write_array_header_2_0(file, header)
    data = memoryview(arr.reshape(-1)).cast("B")
    for start in range(0, len(data), _WRITE_CHUNK):
        file.write(data[start:start + _WRITE_CHUNK])


def save_table(table: HostTable, path) -> None:
    """Write ``table`` to ``path`` as ``.npy``, atomically (see :meth:`HostTable.save_npy`)."""
    write_file_atomically(path, lambda f: write_table(table, f))
