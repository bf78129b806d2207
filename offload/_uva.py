"""The UVA zero-copy engine: CuPy kernels that read and write page-locked host memory from the GPU.

Rows are copied as raw bytes with the widest vector type (16, 8, 4, 2 or 1 bytes) that divides the row
size and the pointers' alignment, so one kernel serves every dtype. A row is handled by a group of ``G``
consecutive threads (``G``: the vectors of a row rounded up to a power of two, at most a warp), so a
512-byte row is one warp reading 32 consecutive 16-byte vectors: whole 128-byte lines, one request each.
Each thread can keep ``UNROLL`` rows in flight (indices first, then all loads, then all stores); the
grid is ``BLOCKS_PER_SM`` blocks per multiprocessor. Both are chosen by measurement (see below): on a
large table the GPU's accesses are limited by address translation of the random host pages, and a
smaller window of rows in flight translates better while still covering the PCIe latency.

One launch moves the rows of up to :data:`MAX_TABLES` host tables of one shape by the same indices
(:func:`gather_tables` / :func:`scatter_tables`: a row's weight and its optimizer state together), to or
from device rows in order or addressed by a position array (a GPU cache's slots), in arrays whose rows may
lie side by side in one tensor (one row stride). Launches go through :mod:`offload.cuda_launch` (one
``cuLaunchKernel`` from packed arguments) with a plan per (op, device, vector width, group, tables, launch
shape), and the checks that guard each ``data_ptr()`` are plain comparisons, the error messages built only
on failure: a few microseconds of host time where ``cupy.cuda.Function`` inside device and stream contexts
took 40-90.

The kernels check every index against the table size themselves (and every position against the device
rows): a row whose index is outside ``[0, num_rows)`` is skipped (nothing outside the table is read or
written) and its position is recorded in a per-device flag that :func:`take_bad_position` reads. The
tables check indices on the host before launching; this guard makes memory safety independent of that
check.
"""

from __future__ import annotations

import collections
import threading

import torch

from . import cuda_launch as _launch

try:
    import cupy
except (ImportError, OSError):  # pragma: no cover - depends on the machine
    cupy = None

__all__ = ["available", "gather_rows", "gather_tables", "launch_counts", "scatter_rows", "scatter_tables",
           "take_bad_position"]

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
// V_T: the vector type rows are moved in. OFFLOAD_G threads move one item (a row of one table), each thread
// group keeps OFFLOAD_U items in flight, OFFLOAD_K tables are moved by the same indices in one launch.
// LD_HOST / ST_HOST: how host memory is read and written.
typedef V_T V;
typedef long long ll;
typedef unsigned long long ull;
__device__ __forceinline__ V ld_host(const V* p) { return LD_HOST(p); }
__device__ __forceinline__ void st_host(V* p, V v) { ST_HOST(p, v); }

template <typename P>
__device__ __forceinline__ P pick(int j, P a, P b, P c, P d) { return j == 0 ? a : j == 1 ? b : j == 2 ? c : d; }

// Item i (< n * OFFLOAD_K) is table j = i % OFFLOAD_K of row r = i / OFFLOAD_K: host row idx[r] of table j and
// device row pos[r] (r where pos is null) of array j. An index outside [0, num_rows) or a device row outside
// [0, dev_rows) skips the item (-1) and records r in *bad (the smallest one wins).
__device__ __forceinline__ void load_items(const ll* __restrict__ idx, const ll* __restrict__ pos, ll i0,
                                           ll nslots, ll items, ll num_rows, ll dev_rows, ull* bad, int sub,
                                           ll (&host)[OFFLOAD_U], ll (&dev)[OFFLOAD_U], int (&part)[OFFLOAD_U]) {
#pragma unroll
  for (int k = 0; k < OFFLOAD_U; ++k) {
    const ll i = i0 + k * nslots;
    ll h = -1, d = 0;
    int j = 0;
    if (i < items) {
      const ll r = i / OFFLOAD_K;
      j = (int)(i - r * OFFLOAD_K);
      h = idx[r];
      d = pos ? pos[r] : r;
      if ((ull)h >= (ull)num_rows || (ull)d >= (ull)dev_rows) {
        if (sub == 0) atomicMin(bad, (ull)r);
        h = -1;
      }
    }
    host[k] = h;
    dev[k] = d;
    part[k] = j;
  }
}

// OFFLOAD_TO_HOST 0 (gather): d_j[pos[r] * rec + c] = h_j[idx[r] * vpr + c] for every row r < n, table
// j < OFFLOAD_K, vector c < vpr; 1 (scatter): h_j[idx[r] * vpr + c] = d_j[pos[r] * rec + c]. One body, two kernels
// (OFFLOAD_NAME): the direction decides only which side is read and which written.
#if OFFLOAD_TO_HOST
typedef V HostV;
typedef const V DevV;
#define FROM(k) pick(part[k], d0, d1, d2, d3)[dev[k] * rec + v]
#define TO(k, x) st_host(pick(part[k], h0, h1, h2, h3) + host[k] * vpr + v, x)
#else
typedef const V HostV;
typedef V DevV;
#define FROM(k) ld_host(pick(part[k], h0, h1, h2, h3) + host[k] * vpr + v)
#define TO(k, x) (pick(part[k], d0, d1, d2, d3)[dev[k] * rec + v] = x)
#endif
extern "C" __global__ void OFFLOAD_NAME(HostV* __restrict__ h0, HostV* __restrict__ h1, HostV* __restrict__ h2,
                                        HostV* __restrict__ h3, DevV* __restrict__ d0, DevV* __restrict__ d1,
                                        DevV* __restrict__ d2, DevV* __restrict__ d3, const ll* __restrict__ idx,
                                        const ll* __restrict__ pos, ll n, ll vpr, ll rec, ll num_rows,
                                        ll dev_rows, ull* bad) {
  const ull t = (ull)blockIdx.x * blockDim.x + threadIdx.x;
  const ll slot = (ll)(t / OFFLOAD_G);
  const int sub = (int)(threadIdx.x % OFFLOAD_G);
  const ll nslots = (ll)(((ull)gridDim.x * blockDim.x) / OFFLOAD_G);
  const ll items = n * OFFLOAD_K;
  for (ll i0 = slot; i0 < items; i0 += nslots * OFFLOAD_U) {
    ll host[OFFLOAD_U], dev[OFFLOAD_U];
    int part[OFFLOAD_U];
    load_items(idx, pos, i0, nslots, items, num_rows, dev_rows, bad, sub, host, dev, part);
    for (ll v = sub; v < vpr; v += OFFLOAD_G) {
      V val[OFFLOAD_U];
#pragma unroll
      for (int k = 0; k < OFFLOAD_U; ++k)
        if (host[k] >= 0) val[k] = FROM(k);
#pragma unroll
      for (int k = 0; k < OFFLOAD_U; ++k)
        if (host[k] >= 0) TO(k, val[k]);
    }
  }
}
"""

MAX_TABLES = 4  # tables one launch moves (more are moved in several launches)
_FMT = "Q" * 10 + "q" * 5 + "Q"  # 4 host tables, 4 device arrays, idx, pos; n, vpr, rec, num_rows, dev_rows; bad

_bad: dict[int, torch.Tensor] = {}
_lock = threading.Lock()
_launches: collections.Counter[str] = collections.Counter()

_NO_BAD = (1 << 63) - 1  # the flag's "nothing seen" value (int64 max; the kernel compares it as unsigned)

_host_ptr_ok: dict[int, bool] = {}


class _Plan:
    """What a launch of one (op, device, vector width, group, tables, launch shape) needs, made once."""

    __slots__ = ("bad", "blocks", "kernel", "rows_per_block", "threads")

    def __init__(self, op: str, device: int, width: int, group: int, k: int) -> None:
        threads, unroll, load, store = _variant()
        defines = {"V_T": _launch.VECTOR_TYPES[width], "OFFLOAD_G": group, "OFFLOAD_U": unroll, "OFFLOAD_K": k,
                   "LD_HOST(p)": _LOADS[load], "ST_HOST(p, v)": _STORES[store],
                   "OFFLOAD_TO_HOST": int(op == "scatter"), "OFFLOAD_NAME": f"offload_{op}"}
        self.kernel = _launch.compile_kernel("offload", _SRC, f"offload_{op}", defines, device, _FMT)
        with _lock:
            if device not in _bad:
                _bad[device] = torch.full((1,), _NO_BAD, dtype=torch.int64, device=torch.device("cuda", device))
        # registers can cap a block below THREADS
        self.threads = min(threads, self.kernel.max_threads_per_block // 32 * 32)
        self.rows_per_block = self.threads * unroll // group
        self.blocks = _launch.sm_count(device) * BLOCKS_PER_SM
        self.bad = _bad[device].data_ptr()


_plans: dict[tuple, _Plan] = {}


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


def _explain(hosts, idx: torch.Tensor, devs, pos: torch.Tensor | None) -> None:
    """Raise the error that says why these operands cannot be moved (the checks of :func:`prepare`, spelled
    out; they are kept as cheap comparisons there)."""
    if not 1 <= len(hosts) == len(devs):
        raise ValueError(f"UVA engine: one device array per host table, got {len(hosts)} tables and {len(devs)}")
    h0, d0 = hosts[0], devs[0]
    for h in hosts:
        if h.device.type != "cpu" or not h.is_contiguous() or h.dim() != 2:
            raise ValueError("UVA engine: the host table must be a contiguous 2-D CPU tensor")
        if h.shape != h0.shape or h.dtype != h0.dtype:
            raise ValueError(f"UVA engine: tables moved together must have one shape and dtype, got "
                             f"{tuple(h.shape)} {h.dtype} and {tuple(h0.shape)} {h0.dtype}")
    for what, t in (("indices", idx), ("positions", pos)):
        if t is not None and (t.device != d0.device or t.dtype != torch.int64 or not t.is_contiguous()
                              or t.dim() != 1):
            raise ValueError(f"UVA engine: {what} must be a contiguous 1-D int64 tensor on {d0.device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if pos is not None and pos.shape[0] != idx.shape[0]:
        raise ValueError(f"UVA engine: {idx.shape[0]} indices need as many positions, got {pos.shape[0]}")
    rows = idx.shape[0] if pos is None else d0.shape[0]
    for d in devs:
        if d.device.type != "cuda" or d.dtype != h0.dtype or d.device != d0.device:
            raise ValueError(f"UVA engine: rows must be a contiguous CUDA tensor of dtype {h0.dtype}, "
                             f"got {d.dtype} on {d.device}")
        if d.dim() != 2 or d.shape[0] != rows or d.shape[1] != h0.shape[1] or d.stride(1) != 1:
            raise ValueError(f"UVA engine: rows must have shape ({rows}, {h0.shape[1]}) with contiguous rows, "
                             f"got {tuple(d.shape)} with strides {d.stride()}")
        if d.stride(0) != d0.stride(0):
            raise ValueError(f"UVA engine: device arrays moved together must have one row stride, got "
                             f"{d.stride(0)} and {d0.stride(0)}")
    raise ValueError("UVA engine: unsupported operands")  # pragma: no cover - every check above passed


def prepare(op: str, hosts, idx: torch.Tensor, devs, pos: torch.Tensor | None = None) -> list[tuple]:
    """Check the operands of a move and compile its kernel, launching nothing: the launches for
    :func:`launch` (one per :data:`MAX_TABLES` tables; none for no indices).

    ``op == "gather"``: ``devs[j][pos[i]] = hosts[j][idx[i]]``; ``"scatter"``: the reverse. ``hosts``: host
    tables of one shape and dtype (contiguous 2-D CPU tensors); ``devs``: CUDA arrays of as many rows as
    there are indices (or, with ``pos``, rows addressed by ``pos``), rows contiguous, one row stride (views
    into one tensor of several tables' rows side by side are fine). Everything that guards a ``data_ptr()``
    is checked here; indices and positions out of range are skipped and flagged by the kernel itself (see
    :func:`take_bad_position`).
    """
    h0, d0 = hosts[0], devs[0]
    k = len(hosts)
    index = d0.get_device()
    shape, dtype = h0.shape, h0.dtype
    num_rows, dim = shape if len(shape) == 2 else (0, 0)
    n = idx.shape[0] if idx.dim() == 1 else -1
    rows = d0.shape[0] if d0.dim() == 2 else -1
    stride = d0.stride()
    ok = (index >= 0 and len(devs) == k and n >= 0 and len(shape) == 2 and idx.dtype == torch.int64
          and idx.get_device() == index and idx.is_contiguous() and (rows == n if pos is None else (
              pos.dim() == 1 and pos.shape[0] == n and pos.dtype == torch.int64 and pos.get_device() == index
              and pos.is_contiguous())))
    if ok:
        for h in hosts:
            if h.get_device() != -1 or h.shape != shape or h.dtype != dtype or not h.is_contiguous():
                ok = False
                break
        for d in devs:
            if (d.get_device() != index or d.dtype != dtype or d.dim() != 2 or d.shape[0] != rows
                    or d.shape[1] != dim or d.stride() != stride or stride[1] != 1):
                ok = False
                break
    if not ok:
        _explain(hosts, idx, devs, pos)
    if n == 0:
        return []
    esize = h0.element_size()
    row_bytes, rec_bytes = dim * esize, stride[0] * esize
    launches = []
    for s in range(0, k, MAX_TABLES):
        hp = [h.data_ptr() for h in hosts[s:s + MAX_TABLES]]
        dp = [d.data_ptr() for d in devs[s:s + MAX_TABLES]]
        width = _launch.vector_width(row_bytes, rec_bytes, *hp, *dp)
        vpr = row_bytes // width
        group = _group(vpr)
        kk = len(hp)
        key = (op, index, width, group, kk, THREADS, UNROLL, BLOCKS_PER_SM, LOAD, STORE)
        plan = _plans.get(key)
        if plan is None:
            plan = _plans.setdefault(key, _Plan(op, index, width, group, kk))
        grid = max(1, min(-(-n * kk // plan.rows_per_block), plan.blocks))
        pad = [0] * (MAX_TABLES - kk)
        launches.append((op, plan, grid, (*hp, *pad, *dp, *pad, idx.data_ptr(), 0 if pos is None else pos.data_ptr(),
                                          n, vpr, rec_bytes // width, num_rows, rows, plan.bad)))
    return launches


def launch(launches: list[tuple]) -> None:
    """Launch what :func:`prepare` built, on torch's current stream (keep its tensors alive until then)."""
    for op, plan, grid, args in launches:
        _launch.launch(plan.kernel, grid, plan.threads, args)
        _launches[op] += 1


def check_and_compile(host: torch.Tensor, idx: torch.Tensor, dev_rows: torch.Tensor) -> None:
    """Everything a launch checks and builds, without launching (for all-or-nothing commits)."""
    prepare("scatter", (host,), idx, (dev_rows,))


def gather_rows(host: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = host[idx[i]]`` by a kernel reading page-locked ``host`` over PCIe (stream-ordered).

    Rows whose index is out of range are skipped (``out[i]`` is left as it was) and flagged: check the
    indices before (the tables do), or call :func:`take_bad_position` after.
    """
    launch(prepare("gather", (host,), idx, (out,)))


def scatter_rows(host: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``host[idx[i]] = src[i]`` by a kernel writing page-locked ``host`` over PCIe (stream-ordered).

    ``idx`` must be free of duplicates (which of two writes to one row lands is unspecified). Rows whose
    index is out of range are skipped and flagged, as for :func:`gather_rows`.
    """
    launch(prepare("scatter", (host,), idx, (src,)))


def gather_tables(hosts, idx: torch.Tensor, outs, pos: torch.Tensor | None = None) -> None:
    """``outs[j][pos[i]] = hosts[j][idx[i]]`` for every table ``j`` in one launch (up to :data:`MAX_TABLES`
    tables; ``pos`` defaults to ``i``): a row's weight and its optimizer state move together. See
    :func:`prepare` for the operands."""
    launch(prepare("gather", hosts, idx, outs, pos))


def scatter_tables(hosts, idx: torch.Tensor, srcs, pos: torch.Tensor | None = None) -> None:
    """``hosts[j][idx[i]] = srcs[j][pos[i]]`` for every table ``j`` in one launch; ``idx`` free of
    duplicates. See :func:`gather_tables`."""
    launch(prepare("scatter", hosts, idx, srcs, pos))


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
