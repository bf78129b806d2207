"""``.npy`` files as host tensors, for tables: :func:`read_array` (memory-mapped or read, a truncated file
refused) behind :meth:`HostTable.from_npy <offload.HostTable.from_npy>`, and :func:`write_array` /
:func:`save_array` (atomic, through :func:`offload.checkpoint_files.write_file_atomically`) behind
:meth:`HostTable.save_npy <offload.HostTable.save_npy>` and the embedding's checkpoints, with bfloat16
stored as uint16."""

from __future__ import annotations

import os
from typing import IO

import numpy as np
import torch
from torch import Tensor

from ._index import _quiet_readonly
from ._memory import allocate_host
from .checkpoint_files import DamagedFileError, remove_orphans, write_file_atomically

_NP_STORE = {torch.bfloat16: np.uint16}


def _numpy_view(t: Tensor) -> np.ndarray:
    if t.dtype in _NP_STORE:
        return t.view(torch.int16).numpy().view(_NP_STORE[t.dtype])
    return t.numpy()


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


def read_array(path, *, mmap_mode, dtype) -> tuple[Tensor, np.ndarray | None]:
    """The 2-D ``.npy`` file ``path`` as a CPU tensor (see :meth:`HostTable.from_npy`): a view of its memory
    map with ``mmap_mode`` (returned second: it must outlive the tensor), else read into host memory (and
    ``None``). ``dtype`` reinterprets the stored bytes."""
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
    return data, keepalive


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


def write_array(data: Tensor, file: IO[bytes]) -> None:
    """Write the 2-D CPU tensor ``data`` (a table's rows, landed: see :attr:`HostTable.data`) as ``.npy`` to
    the binary ``file``: the header, then the memory as it is (``np.save`` to a file object copies it chunk
    by chunk first)."""
    arr = np.ascontiguousarray(_numpy_view(data))
    header = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(file, header)
    except ValueError:  # a header over 64 KiB
        np.lib.format.write_array_header_2_0(file, header)
    raw = memoryview(arr.reshape(-1)).cast("B")
    for start in range(0, len(raw), _WRITE_CHUNK):
        file.write(raw[start:start + _WRITE_CHUNK])


def save_array(data: Tensor, path) -> None:
    """Write ``data`` to ``path`` as ``.npy``, atomically (see :meth:`HostTable.save_npy`)."""
    write_file_atomically(path, lambda f: write_array(data, f))
