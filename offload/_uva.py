"""The UVA zero-copy engine: CuPy kernels that read and write page-locked host memory from the GPU.

Rows are copied as raw bytes with the widest vector type (16, 8, 4, 2 or 1 bytes) that divides the row
size and the pointers' alignment, so one kernel serves every dtype. A row is handled by a group of ``G``
consecutive threads (``G``: the vectors of a row rounded up to a power of two, at most a warp), so a
512-byte row is one warp reading 32 consecutive 16-byte vectors: whole 128-byte lines, one request each.
Each thread can keep ``UNROLL`` rows in flight (indices first, then all loads, then all stores); the
grid is ``BLOCKS_PER_SM`` blocks per multiprocessor. Both are chosen by measurement (see below): on a
large table the GPU's accesses are limited by address translation of the random host pages, and a
smaller window of rows in flight translates better while still covering the PCIe latency.

The kernels check every index against the table size themselves: a row whose index is outside
``[0, num_rows)`` is skipped (nothing outside the table is read or written) and its position is recorded
in a per-device flag that :func:`take_bad_position` reads. The tables check indices on the host before
launching; this guard makes memory safety independent of that check.
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

__all__ = ["available", "gather_rows", "launch_counts", "scatter_rows", "take_bad_position"]

_VTYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

# Launch shape and cache policies. Kept as module state so that the benchmark can measure alternatives;
# every value is part of the compiled kernel's cache key.
THREADS = 256  # threads per block (fewer where the compiled kernel allows fewer)
UNROLL = 1  # rows in flight per thread group
BLOCKS_PER_SM = 1  # grid = multiprocessors * BLOCKS_PER_SM (the grid-stride loop covers the rest)
# Measured on an H200 (tests/benchmarks/bench_host_table.py --explore): for random rows of a 5 GB table
# the limit is address translation, not bytes in flight, and fewer rows in flight translate better:
# 256 threads x 1 row x 1 block per SM read at 0.76 of the contiguous-copy bandwidth, 8 blocks per SM at
# 0.71, 4 rows in flight per thread at 0.63 (contiguous rows: 0.90 either way).
LOAD = "plain"  # host reads (gather): "plain", "cs" (__ldcs, evict-first) or "nc" (__ldg)
STORE = "plain"  # host writes (scatter): "plain", "cs" (__stcs) or "wt" (__stwt, write-through)

_LOADS = {"plain": "*p", "cs": "__ldcs(p)", "nc": "__ldg(p)"}
_STORES = {"plain": "*p = v", "cs": "__stcs(p, v)", "wt": "__stwt(p, v)"}

_SRC = r"""
typedef {vtype} V;
#define OFFLOAD_G {group}
#define OFFLOAD_U {unroll}
__device__ __forceinline__ V ld_host(const V* p) {{ return {load}; }}
__device__ __forceinline__ void st_host(V* p, V v) {{ {store}; }}

// Reads the indices of this group's OFFLOAD_U rows; a row past the end or with an index outside the table
// gets -1 (skipped), and an out-of-range index records its position in *bad (the smallest one wins).
__device__ __forceinline__ void load_rows(const long long* __restrict__ idx, long long r0, long long nslots,
                                          long long n, long long num_rows, unsigned long long* bad, int sub,
                                          long long (&src)[OFFLOAD_U]) {{
#pragma unroll
  for (int k = 0; k < OFFLOAD_U; ++k) {{
    const long long r = r0 + k * nslots;
    long long s = -1;
    if (r < n) {{
      s = idx[r];
      if ((unsigned long long)s >= (unsigned long long)num_rows) {{
        if (sub == 0) atomicMin(bad, (unsigned long long)r);
        s = -1;
      }}
    }}
    src[k] = s;
  }}
}}

extern "C" __global__ void offload_gather(const V* __restrict__ table, const long long* __restrict__ idx,
                                          V* __restrict__ out, long long n, int vpr, long long num_rows,
                                          unsigned long long* bad) {{
  const unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long slot = (long long)(t / OFFLOAD_G);
  const int sub = (int)(threadIdx.x % OFFLOAD_G);
  const long long nslots = (long long)(((unsigned long long)gridDim.x * blockDim.x) / OFFLOAD_G);
  for (long long r0 = slot; r0 < n; r0 += nslots * OFFLOAD_U) {{
    long long src[OFFLOAD_U];
    load_rows(idx, r0, nslots, n, num_rows, bad, sub, src);
    for (int v = sub; v < vpr; v += OFFLOAD_G) {{
      V val[OFFLOAD_U];
#pragma unroll
      for (int k = 0; k < OFFLOAD_U; ++k)
        if (src[k] >= 0) val[k] = ld_host(table + src[k] * vpr + v);
#pragma unroll
      for (int k = 0; k < OFFLOAD_U; ++k)
        if (src[k] >= 0) out[(r0 + k * nslots) * vpr + v] = val[k];
    }}
  }}
}}

extern "C" __global__ void offload_scatter(V* __restrict__ table, const long long* __restrict__ idx,
                                           const V* __restrict__ rows, long long n, int vpr, long long num_rows,
                                           unsigned long long* bad) {{
  const unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long slot = (long long)(t / OFFLOAD_G);
  const int sub = (int)(threadIdx.x % OFFLOAD_G);
  const long long nslots = (long long)(((unsigned long long)gridDim.x * blockDim.x) / OFFLOAD_G);
  for (long long r0 = slot; r0 < n; r0 += nslots * OFFLOAD_U) {{
    long long dst[OFFLOAD_U];
    load_rows(idx, r0, nslots, n, num_rows, bad, sub, dst);
    for (int v = sub; v < vpr; v += OFFLOAD_G) {{
      V val[OFFLOAD_U];
#pragma unroll
      for (int k = 0; k < OFFLOAD_U; ++k)
        if (dst[k] >= 0) val[k] = rows[(r0 + k * nslots) * vpr + v];
#pragma unroll
      for (int k = 0; k < OFFLOAD_U; ++k)
        if (dst[k] >= 0) st_host(table + dst[k] * vpr + v, val[k]);
    }}
  }}
}}
"""

_kernels: dict[tuple, tuple[object, object]] = {}
_sm_count: dict[int, int] = {}
_bad: dict[int, torch.Tensor] = {}
_max_threads: dict[int, int] = {}  # id(kernel) -> the most threads a block of it can have (kernels are kept)
_lock = threading.Lock()
_launches: collections.Counter[str] = collections.Counter()

_NO_BAD = (1 << 63) - 1  # the flag's "nothing seen" value (int64 max; the kernel compares it as unsigned)

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


def _group(vpr: int) -> int:
    """Threads per row: the row's vectors rounded up to a power of two, at most a warp."""
    g = 1
    while g < vpr and g < 32:
        g *= 2
    return g


def _variant() -> tuple[int, int, str, str]:
    if THREADS % 32 or not 32 <= THREADS <= 1024:
        raise ValueError(f"_uva.THREADS must be a multiple of 32 in [32, 1024], got {THREADS}")
    if not 1 <= UNROLL <= 32:
        raise ValueError(f"_uva.UNROLL must be in [1, 32], got {UNROLL}")
    if LOAD not in _LOADS or STORE not in _STORES:
        raise ValueError(f"_uva.LOAD must be one of {tuple(_LOADS)} and STORE one of {tuple(_STORES)}, "
                         f"got {LOAD!r}, {STORE!r}")
    return THREADS, UNROLL, LOAD, STORE


def _kernel_pair(device: int, width: int, group: int):
    _, unroll, load, store = _variant()
    key = (device, width, group, unroll, load, store)
    with _lock:
        got = _kernels.get(key)
        if got is None:
            src = _SRC.format(vtype=_VTYPES[width], group=group, unroll=unroll, load=_LOADS[load],
                              store=_STORES[store])
            with cupy.cuda.Device(device):
                mod = cupy.RawModule(code=src, options=("-std=c++14",))
                got = (mod.get_function("offload_gather"), mod.get_function("offload_scatter"))
            _kernels[key] = got
            _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
            if device not in _bad:
                _bad[device] = torch.full((1,), _NO_BAD, dtype=torch.int64, device=torch.device("cuda", device))
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
    if host.device.type != "cpu" or not host.is_contiguous() or host.dim() != 2:
        raise ValueError("UVA engine: the host table must be a contiguous 2-D CPU tensor")
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


def _shape(host: torch.Tensor, dev_rows: torch.Tensor) -> tuple[int, int, int]:
    row_bytes = host.shape[1] * host.element_size()
    width = _width(row_bytes, host.data_ptr(), dev_rows.data_ptr())
    vpr = row_bytes // width
    return width, vpr, _group(vpr)


def check_and_compile(host: torch.Tensor, idx: torch.Tensor, dev_rows: torch.Tensor) -> None:
    """Everything a launch checks and builds, without launching (for all-or-nothing commits)."""
    _check(host, idx, dev_rows)
    width, _, group = _shape(host, dev_rows)
    _kernel_pair(dev_rows.device.index, width, group)


def _launch(op: str, host: torch.Tensor, idx: torch.Tensor, dev_rows: torch.Tensor) -> None:
    _check(host, idx, dev_rows)
    n = idx.shape[0]
    if n == 0:
        return
    width, vpr, group = _shape(host, dev_rows)
    if vpr >= 1 << 31:
        raise ValueError(f"UVA engine: rows of {vpr} vectors are too long for one kernel")
    device = dev_rows.device.index
    gather, scatter = _kernel_pair(device, width, group)
    kernel = gather if op == "gather" else scatter
    cap = _max_threads.get(id(kernel))
    if cap is None:  # registers can cap a block below THREADS
        cap = _max_threads[id(kernel)] = int(kernel.max_threads_per_block) // 32 * 32
    threads = min(THREADS, cap)
    need = -(-n * group // (threads * UNROLL))
    blocks = max(1, min(need, _sm_count[device] * BLOCKS_PER_SM))
    args = (cupy.uint64(host.data_ptr()), cupy.uint64(idx.data_ptr()), cupy.uint64(dev_rows.data_ptr()),
            cupy.int64(n), cupy.int32(vpr), cupy.int64(host.shape[0]), cupy.uint64(_bad[device].data_ptr()))
    with cupy.cuda.Device(device):
        stream = _cupy_stream(device, torch.cuda.current_stream(dev_rows.device).cuda_stream)
        with stream:
            kernel((blocks,), (threads,), args)
    _launches[op] += 1


def gather_rows(host: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = host[idx[i]]`` by a kernel reading page-locked ``host`` over PCIe (stream-ordered).

    Rows whose index is out of range are skipped (``out[i]`` is left as it was) and flagged: check the
    indices before (the tables do), or call :func:`take_bad_position` after.
    """
    _launch("gather", host, idx, out)


def scatter_rows(host: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``host[idx[i]] = src[i]`` by a kernel writing page-locked ``host`` over PCIe (stream-ordered).

    ``idx`` must be free of duplicates (which of two writes to one row lands is unspecified). Rows whose
    index is out of range are skipped and flagged, as for :func:`gather_rows`.
    """
    _launch("scatter", host, idx, src)


def take_bad_position(device: torch.device | int | None = None) -> int | None:
    """The smallest position ``i`` whose index a UVA kernel on ``device`` refused as out of range since the
    last call (``None`` if none), and reset the flag. Synchronises with the device."""
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
    flag = _bad.get(index)
    if flag is None:
        return None
    got = int(flag.item())
    flag.fill_(_NO_BAD)
    return None if got == _NO_BAD else got
