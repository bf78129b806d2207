"""The UVA zero-copy engine: CuPy kernels that read and write page-locked host memory from the GPU.

Rows are copied as raw bytes with the widest vector type (16, 8, 4, 2 or 1 bytes) that divides the row
size and the pointers' alignment, so one kernel serves every dtype. Each thread keeps ``UNROLL``
independent loads in flight before it stores (PCIe reads have microseconds of latency, so the bytes in
flight, not the instruction count, set the bandwidth), and a block of 256 threads covers several rows.
"""

from __future__ import annotations

import collections
import threading
import warnings

import torch

try:
    import cupy
except (ImportError, OSError):  # pragma: no cover - depends on the machine
    cupy = None

__all__ = ["available", "gather_rows", "launch_counts", "scatter_rows"]

_VTYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
UNROLL = 4
THREADS = 256

_SRC = r"""
typedef {vtype} V;
#define UNROLL {unroll}
extern "C" __global__ void offload_gather(const V* __restrict__ table, const long long* __restrict__ idx,
                                          V* __restrict__ out, long long n_vec, long long vpr) {{
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n_vec; e += stride * UNROLL) {{
    V r[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {{
      const long long ek = e + k * stride;
      if (ek < n_vec) {{
        const long long row = ek / vpr;
        r[k] = table[idx[row] * vpr + (ek - row * vpr)];
      }}
    }}
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {{
      const long long ek = e + k * stride;
      if (ek < n_vec) out[ek] = r[k];
    }}
  }}
}}
extern "C" __global__ void offload_scatter(V* __restrict__ table, const long long* __restrict__ idx,
                                           const V* __restrict__ src, long long n_vec, long long vpr) {{
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n_vec; e += stride * UNROLL) {{
    V r[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {{
      const long long ek = e + k * stride;
      if (ek < n_vec) r[k] = src[ek];
    }}
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {{
      const long long ek = e + k * stride;
      if (ek < n_vec) {{
        const long long row = ek / vpr;
        table[idx[row] * vpr + (ek - row * vpr)] = r[k];
      }}
    }}
  }}
}}
"""

_kernels: dict[tuple[int, int], tuple[object, object]] = {}
_sm_count: dict[int, int] = {}
_lock = threading.Lock()
_launches: collections.Counter[str] = collections.Counter()


_host_ptr_ok: dict[int, bool] = {}


def available(device: torch.device | None = None) -> bool:
    """Whether the UVA engine can run here: CuPy importable, a CUDA device present, and that device able
    to use a registered host pointer directly (``cudaDevAttrCanUseHostPointerForRegisteredMem``)."""
    if cupy is None or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    ok = _host_ptr_ok.get(index)
    if ok is None:
        # cudaDevAttrCanUseHostPointerForRegisteredMem = 91
        ok = bool(cupy.cuda.runtime.deviceGetAttribute(91, index))
        _host_ptr_ok[index] = ok
    return ok


def require() -> None:
    """Raise a clear error when the UVA engine cannot run here."""
    if cupy is None:
        raise ImportError(
            "the 'uva' offload engine needs CuPy (pip install cupy-cuda12x or cupy-cuda13x); "
            "use engine='cpu' or engine='auto'"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("the 'uva' offload engine needs a CUDA device; use engine='cpu'")
    if not available():
        raise RuntimeError(
            "the 'uva' offload engine needs a GPU that can use registered host pointers "
            "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0 here); use engine='cpu'"
        )


def launch_counts() -> dict[str, int]:
    """How many UVA gather / scatter kernels were launched in this process (for tests and benchmarks)."""
    return dict(_launches)


def _kernel_pair(device: int, width: int):
    key = (device, width)
    with _lock:
        got = _kernels.get(key)
        if got is None:
            src = _SRC.format(vtype=_VTYPES[width], unroll=UNROLL)
            with cupy.cuda.Device(device):
                mod = cupy.RawModule(code=src)
                got = (mod.get_function("offload_gather"), mod.get_function("offload_scatter"))
            _kernels[key] = got
            _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return got


_streams: dict[tuple[int, int], object] = {}


def _cupy_stream(device: int, handle: int):
    """CuPy's view of a torch stream, cached. (CuPy 14 deprecates ``ExternalStream`` in favour of
    ``Stream.from_external``, which CuPy 13 lacks; the warning is silenced here.)"""
    key = (device, handle)
    got = _streams.get(key)
    if got is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            got = _streams[key] = cupy.cuda.ExternalStream(handle)
    return got


def _width(row_bytes: int, *ptrs: int) -> int:
    for w in (16, 8, 4, 2):
        if row_bytes % w == 0 and all(p % w == 0 for p in ptrs):
            return w
    return 1


def _check(host: torch.Tensor, idx: torch.Tensor, dev_rows: torch.Tensor) -> None:
    if host.device.type != "cpu" or not host.is_contiguous():
        raise ValueError("UVA engine: the host table must be a contiguous CPU tensor")
    if idx.device != dev_rows.device or idx.dtype != torch.int64 or not idx.is_contiguous() or idx.dim() != 1:
        raise ValueError(
            f"UVA engine: indices must be a contiguous 1-D int64 tensor on {dev_rows.device}, "
            f"got {tuple(idx.shape)} {idx.dtype} on {idx.device}"
        )
    if dev_rows.device.type != "cuda" or not dev_rows.is_contiguous() or dev_rows.dtype != host.dtype:
        raise ValueError(
            f"UVA engine: rows must be a contiguous CUDA tensor of dtype {host.dtype}, "
            f"got {dev_rows.dtype} on {dev_rows.device}"
        )
    if dev_rows.dim() != 2 or dev_rows.shape[0] != idx.shape[0] or dev_rows.shape[1] != host.shape[1]:
        raise ValueError(
            f"UVA engine: rows must have shape ({idx.shape[0]}, {host.shape[1]}), got {tuple(dev_rows.shape)}"
        )


def check_and_compile(host: torch.Tensor, idx: torch.Tensor, dev_rows: torch.Tensor) -> None:
    """Everything a launch checks and builds, without launching (for all-or-nothing commits)."""
    _check(host, idx, dev_rows)
    row_bytes = host.shape[1] * host.element_size()
    _kernel_pair(dev_rows.device.index, _width(row_bytes, host.data_ptr(), dev_rows.data_ptr()))


def _launch(op: str, host: torch.Tensor, idx: torch.Tensor, dev_rows: torch.Tensor) -> None:
    _check(host, idx, dev_rows)
    n = idx.shape[0]
    if n == 0:
        return
    row_bytes = host.shape[1] * host.element_size()
    width = _width(row_bytes, host.data_ptr(), dev_rows.data_ptr())
    device = dev_rows.device.index
    gather, scatter = _kernel_pair(device, width)
    vpr = row_bytes // width
    n_vec = n * vpr
    blocks = min(-(-n_vec // (THREADS * UNROLL)), _sm_count[device] * 16)
    args = (cupy.uint64(host.data_ptr()), cupy.uint64(idx.data_ptr()), cupy.uint64(dev_rows.data_ptr()),
            cupy.int64(n_vec), cupy.int64(vpr))
    with cupy.cuda.Device(device):
        stream = _cupy_stream(device, torch.cuda.current_stream(dev_rows.device).cuda_stream)
        with stream:
            (gather if op == "gather" else scatter)((blocks,), (THREADS,), args)
    _launches[op] += 1


def gather_rows(host: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = host[idx[i]]`` by a kernel reading page-locked ``host`` over PCIe (stream-ordered).

    ``idx`` must already be bounds-checked: the kernel does not check it.
    """
    _launch("gather", host, idx, out)


def scatter_rows(host: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``host[idx[i]] = src[i]`` by a kernel writing page-locked ``host`` over PCIe (stream-ordered).

    ``idx`` must be bounds-checked and free of duplicates.
    """
    _launch("scatter", host, idx, src)
