"""CuPy kernels of the batched embedding layers, and the asynchronous bad-index report.

Kernels (all launched on torch's current CUDA stream, no host synchronisation, capturable in a CUDA
graph once compiled):

``emb_gather``
    Forward of ``Embedding``: ``out[i] = weight[b(i) * num + idx[i]]`` for every looked-up position ``i``
    of all B tables in one launch (``b(i) = i // per``, the models-major merged axis). Rows are copied
    as raw 16/8/4/2-byte words, so every dtype takes the same path. Lanes of a warp are split into
    slots of ``G`` lanes, one looked-up row per slot, so a warp moves ``32 / G`` rows at once.
``emb_scatter``
    Backward: atomically adds the output gradient into an fp32 weight gradient. Each warp takes a tile
    of 32 positions, finds positions that hit the same row with ``__match_any_sync`` and lets one
    *leader* sum their gradients in registers before a single vectorised atomic (``red.global.add.v4.f32``
    on sm_90, scalar ``atomicAdd`` elsewhere): heavy-tailed indices make far fewer atomics on hot rows.
    fp16/bf16 gradients are read and widened to fp32, so accumulation is fp32 for every dtype.
``emb_count``
    Row frequencies for ``scale_grad_by_freq``.
``memb_gather`` / ``memb_scatter``
    The same for :class:`MultiEmbedding`: one output column per thread, tables of different sizes and
    dims in one flat tensor.

Bad indices (negative, or not below the table size) are never read or written: the gather writes a
zero row, the scatter skips it, and the first bad value is recorded in a per-device record. The record
lives in device memory (claimed with one ``atomicCAS``) and is mirrored into pinned host memory, so the
host can see a report without synchronising; :func:`raise_pending` turns it into an ``IndexError`` at
the next forward, and :func:`check` synchronises and raises at once.

Launches are built for little host time, because a small lookup's training step is bound by it (the
GPU work of 262,144 lookups of dim 16 takes about 60 us): a per-call plan cached by (device, dtypes,
dim, alignment) holds the compiled kernel and what follows from those keys; the argument checks are the
few that guard a ``data_ptr()`` (kept as cheap comparisons, with the full error messages built only on
failure); and a launch packs its 8-byte arguments into a per-thread buffer for one ``cuLaunchKernel``
through CuPy's driver binding (:data:`LAUNCH_MODE`), instead of ``cupy.cuda.Function.__call__``, which
converts every argument on each call. The launcher is :mod:`offload.cuda_launch`'s (the offload package's UVA
kernels use the same one; imports point from ``batch_layers`` to ``offload``).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from offload.cuda_launch import LAUNCH_MODE, LAUNCHES, SLOW_LAUNCHES, sm_count
from offload.cuda_launch import compile_kernel as _compile
from offload.cuda_launch import current_device as _current_device
from offload.cuda_launch import launch as _launch

from ._backend import get_backend

try:
    import cupy
except (ImportError, OSError) as _err:  # pragma: no cover - depends on the machine
    cupy = None
    _CUPY_IMPORT_ERROR: BaseException | None = _err
else:
    _CUPY_IMPORT_ERROR = None

__all__ = [
    "LAUNCHES",
    "LAUNCH_MODE",
    "SLOW_LAUNCHES",
    "check",
    "cupy_available",
    "raise_pending",
    "record_bad_indices",
    "use_kernels",
]

# (LAUNCHES, SLOW_LAUNCHES and LAUNCH_MODE are offload.cuda_launch's, shared with the offload kernels: kernel
# launches per kernel name since import, the launches among them that took the slower cupy.cuda.Function
# call, and how kernels are launched)

_LOCK = threading.Lock()
_RECORDS: dict[int, tuple[Tensor, Tensor, object]] = {}

_COMMON = r"""
typedef long long ll;
typedef unsigned long long ull;

__device__ __forceinline__ void report_bad(ull* rec, volatile ll* mirror, ll v, ll num) {
    if (atomicCAS(rec, 0ULL, 1ULL) == 0ULL) {
        rec[1] = (ull)v;
        rec[2] = (ull)num;
        mirror[1] = v;
        mirror[2] = num;
        __threadfence_system();
        mirror[0] = 1;
    }
}
"""

_GATHER = _COMMON + r"""
// WORD: the raw word a row is copied in; IDX: index dtype.
typedef WORD word_t;
extern "C" __global__ void emb_gather(
        const word_t* __restrict__ weight, const IDX* __restrict__ idx, word_t* __restrict__ out,
        ll M, ll words, ll per, ll idx_len, ll num, ll log2g, ull* rec, ll* mirror) {
    const int lane = threadIdx.x & 31;
    const int G = 1 << log2g;
    const int slot = lane >> log2g, cl = lane & (G - 1);
    const ll rows_per_warp = 32 >> log2g;
    ll warp = ((ll)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const ll nwarps = ((ll)gridDim.x * blockDim.x) >> 5;
    for (ll i = warp * rows_per_warp + slot; i - slot < M; i += nwarps * rows_per_warp) {
        if (i >= M) continue;
        const ll j = (idx_len == M) ? i : i % idx_len;
        const ll v = (ll)idx[j];
        word_t* o = out + i * words;
        if (v >= 0 && v < num) {
            const word_t* src = weight + ((i / per) * num + v) * words;
            for (ll w = cl; w < words; w += G) o[w] = src[w];
        } else {
            const word_t z = word_t();
            for (ll w = cl; w < words; w += G) o[w] = z;
            if (cl == 0) report_bad(rec, mirror, v, num);
        }
    }
}
"""

_SCATTER = _COMMON + r"""
// GT: gradient element type (0 float, 1 half, 2 bfloat16); VEC: elements per chunk; IDX: index dtype.
#if GT == 0
typedef float gt;
#else
typedef unsigned short gt;
#endif

__device__ __forceinline__ float widen(gt x) {
#if GT == 0
    return x;
#elif GT == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#else
    return __uint_as_float(((unsigned)x) << 16);
#endif
}

__device__ __forceinline__ void load_chunk(const gt* p, float* a) {
#if GT == 0 && VEC == 4
    float4 t = *reinterpret_cast<const float4*>(p); a[0] = t.x; a[1] = t.y; a[2] = t.z; a[3] = t.w;
#elif GT == 0 && VEC == 2
    float2 t = *reinterpret_cast<const float2*>(p); a[0] = t.x; a[1] = t.y;
#elif GT != 0 && VEC == 4
    uint2 t = *reinterpret_cast<const uint2*>(p);
    a[0] = widen((gt)(t.x & 0xffff)); a[1] = widen((gt)(t.x >> 16));
    a[2] = widen((gt)(t.y & 0xffff)); a[3] = widen((gt)(t.y >> 16));
#elif GT != 0 && VEC == 2
    unsigned t = *reinterpret_cast<const unsigned*>(p);
    a[0] = widen((gt)(t & 0xffff)); a[1] = widen((gt)(t >> 16));
#else
    a[0] = widen(*p);
#endif
}

__device__ __forceinline__ void red_chunk(float* p, const float* a) {
#if VEC == 4 && VECRED && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "f"(a[0]), "f"(a[1]), "f"(a[2]), "f"(a[3]));
#elif VEC == 2 && VECRED && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a[0]), "f"(a[1]));
#else
    #pragma unroll
    for (int k = 0; k < VEC; ++k) atomicAdd(p + k, a[k]);
#endif
}

extern "C" __global__ void emb_scatter(
        const gt* __restrict__ grad, const IDX* __restrict__ idx, float* __restrict__ gw,
        const int* __restrict__ counts, ll M, ll dim, ll per, ll idx_len, ll num, ll pad, ll log2g) {
    __shared__ unsigned char leader_lane[32][32];   // up to 1024 threads a block
    const unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int G = 1 << log2g, S = 32 >> log2g;
    const int slot = lane >> log2g, cl = lane & (G - 1);
    const ll C = dim / VEC;
    const ll nwarps = ((ll)gridDim.x * blockDim.x) >> 5;
    for (ll base = (((ll)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 32; base < M; base += nwarps * 32) {
        const ll i = base + lane;
        ll key = -1;
        if (i < M) {
            const ll j = (idx_len == M) ? i : i % idx_len;
            const ll v = (ll)idx[j];
            if (v >= 0 && v < num && v != pad) key = (i / per) * num + v;
        }
        const unsigned peers = __match_any_sync(FULL, key);
        const bool leader = key >= 0 && (__ffs(peers) - 1) == lane;
        const unsigned leaders = __ballot_sync(FULL, leader);
        const int nlead = __popc(leaders);
        if (leader) leader_lane[wib][__popc(leaders & ((1u << lane) - 1u))] = (unsigned char)lane;
        __syncwarp();
        for (int r = 0; r < nlead; r += S) {
            const int k = r + slot;
            const int src = k < nlead ? leader_lane[wib][k] : 0;
            const unsigned pm = __shfl_sync(FULL, peers, src);
            const ll row = __shfl_sync(FULL, key, src);
            if (k < nlead) {
                const float scale = counts ? 1.0f / (float)counts[row] : 1.0f;
                for (ll c = cl; c < C; c += G) {
                    float acc[VEC], t[VEC];
                    #pragma unroll
                    for (int q = 0; q < VEC; ++q) acc[q] = 0.0f;
                    unsigned m = pm;
                    while (m) {
                        const int p = __ffs(m) - 1;
                        m &= m - 1u;
                        load_chunk(grad + (base + p) * dim + c * VEC, t);
                        #pragma unroll
                        for (int q = 0; q < VEC; ++q) acc[q] += t[q];
                    }
                    #pragma unroll
                    for (int q = 0; q < VEC; ++q) acc[q] *= scale;
                    red_chunk(gw + row * dim + c * VEC, acc);
                }
            }
        }
        __syncwarp();
    }
}
"""

_COUNT = r"""
typedef long long ll;
extern "C" __global__ void emb_count(const IDX* __restrict__ idx, int* __restrict__ counts,
                                     ll M, ll per, ll idx_len, ll num) {
    for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < M; i += (ll)gridDim.x * blockDim.x) {
        const ll j = (idx_len == M) ? i : i % idx_len;
        const ll v = (ll)idx[j];
        if (v >= 0 && v < num) atomicAdd(counts + (i / per) * num + v, 1);
    }
}
"""

_MULTI_GATHER = _COMMON + r"""
// ELEM: raw element word; IDX: index dtype. One thread per output element (s, col).
typedef ELEM elem_t;
extern "C" __global__ void memb_gather(
        const elem_t* __restrict__ weight, const IDX* __restrict__ idx, elem_t* __restrict__ out,
        const ll* __restrict__ rows, const ll* __restrict__ woff, const ll* __restrict__ dims,
        const ll* __restrict__ col_start, const int* __restrict__ col_table,
        ll M, ll T, ll D, ll per, ll idx_len, ll total, ull* rec, ll* mirror) {
    const ll n = M * D;
    for (ll e = (ll)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (ll)gridDim.x * blockDim.x) {
        const ll s = e / D, col = e - s * D;
        const int t = col_table[col];
        const ll j = (idx_len == M * T) ? s * T + t : (s * T + t) % idx_len;
        const ll v = (ll)idx[j];
        const ll num = rows[t];
        if (v >= 0 && v < num) {
            out[e] = weight[(s / per) * total + woff[t] + v * dims[t] + (col - col_start[t])];
        } else {
            out[e] = elem_t();
            if (col == col_start[t]) report_bad(rec, mirror, v, num);
        }
    }
}
"""

_MULTI_SCATTER = r"""
typedef long long ll;
#if GT == 0
typedef float gt;
__device__ __forceinline__ float widen(gt x) { return x; }
#elif GT == 1
typedef unsigned short gt;
__device__ __forceinline__ float widen(gt x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
#else
typedef unsigned short gt;
__device__ __forceinline__ float widen(gt x) { return __uint_as_float(((unsigned)x) << 16); }
#endif
extern "C" __global__ void memb_scatter(
        const gt* __restrict__ grad, const IDX* __restrict__ idx, float* __restrict__ gw,
        const ll* __restrict__ rows, const ll* __restrict__ woff, const ll* __restrict__ dims,
        const ll* __restrict__ col_start, const int* __restrict__ col_table,
        ll M, ll T, ll D, ll per, ll idx_len, ll total) {
    const ll n = M * D;
    for (ll e = (ll)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (ll)gridDim.x * blockDim.x) {
        const ll s = e / D, col = e - s * D;
        const int t = col_table[col];
        const ll j = (idx_len == M * T) ? s * T + t : (s * T + t) % idx_len;
        const ll v = (ll)idx[j];
        if (v >= 0 && v < rows[t])
            atomicAdd(gw + (s / per) * total + woff[t] + v * dims[t] + (col - col_start[t]), widen(grad[e]));
    }
}
"""

_WORDS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_IDX = {torch.int64: "long long", torch.int32: "int"}
_GT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ELEM = {8: "unsigned long long", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
# Index of the compiled variant that failed for a given key (fall back to scalar atomics once).
_VECRED_BROKEN: set[int] = set()


# --------------------------------------------------------------------------------------------------
# availability and dispatch


def cupy_available() -> bool:
    """Whether CuPy imported (the kernels can run on CUDA tensors)."""
    return cupy is not None


def use_kernels(device: torch.device) -> bool:
    """Whether the CuPy kernels run for tensors on ``device`` under the current backend switch.

    Raises:
        ImportError: the backend is ``"cupy"``, the tensors are on CUDA and CuPy cannot be imported
            (chained to the original import error).
    """
    backend = get_backend()
    if device.type != "cuda" or backend == "torch":
        return False
    if cupy is None:
        if backend == "cupy":
            raise ImportError(
                "batch_layers backend 'cupy' was requested but CuPy could not be imported; install "
                "cupy-cuda12x / cupy-cuda13x matching your CUDA, or use set_backend('auto'|'torch')"
            ) from _CUPY_IMPORT_ERROR
        return False
    return True


def _max_grid(index: int) -> int:
    """Grid cap of a grid-stride kernel: 32 blocks per multiprocessor."""
    return sm_count(index) * 32


def _grid(work: int, block: int, index: int) -> int:
    return max(1, min((work + block - 1) // block, _max_grid(index)))


def _check_operand(t: Tensor, what: str, index: int, dtypes) -> None:
    if t.get_device() != index or not t.is_cuda:
        raise ValueError(f"{what} must be on cuda:{index}, got {t.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{what} must have dtype in {tuple(dtypes)}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous before its data_ptr() reaches a kernel")


def _log2_lanes(chunks: int) -> int:
    """log2 of the lanes given to one row: the smallest power of two >= chunks, at most 32."""
    g = 1
    while g < chunks and g < 32:
        g *= 2
    return g.bit_length() - 1


# --------------------------------------------------------------------------------------------------
# bad-index record


def _device_index(device: torch.device | str | int | None) -> int:
    """The CUDA device index of ``device`` (the current device for ``None`` or a bare ``"cuda"``)."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return _current_device() if index is None else index


def _record(index: int) -> tuple[Tensor, Tensor, object]:
    """The bad-index record of device ``index``: ``(device int64[4], pinned host int64[4], its numpy view)``."""
    rec = _RECORDS.get(index)
    if rec is None:
        with _LOCK:
            rec = _RECORDS.get(index)
            if rec is None:
                dev = torch.zeros(4, dtype=torch.int64, device=torch.device("cuda", index))
                host = torch.zeros(4, dtype=torch.int64).pin_memory()
                rec = (dev, host, host.numpy())
                _RECORDS[index] = rec
    return rec


def _raise_from(device_index: int, host_view) -> None:
    dev, host, _ = _RECORDS[device_index]
    value, size = int(host_view[1]), int(host_view[2])
    dev.zero_()
    host.zero_()
    raise IndexError(
        f"index {value} is out of range for an embedding table of {size} rows (valid indices are "
        f"0..{size - 1}); found on cuda:{device_index} by an earlier lookup, whose output rows for it "
        "were zeros and whose gradient skipped it"
    )


def raise_pending(device: torch.device | int | None = None) -> None:
    """Raise the ``IndexError`` of a bad index seen by an earlier kernel on ``device`` (a ``torch.device``
    or a CUDA device index; every device with a record if ``None``), if the report has already reached
    the host. Costs no synchronisation; every forward calls it."""
    if device is not None:
        index = device if isinstance(device, int) else _device_index(device)
        rec = _RECORDS.get(index)
        if rec is not None and rec[2][0] != 0:
            _raise_from(index, rec[2])
        return
    for index, rec in list(_RECORDS.items()):
        if rec[2][0] != 0:
            _raise_from(index, rec[2])


def check(device: torch.device | str | None = None) -> None:
    """Synchronise ``device`` (all CUDA devices with a record if ``None``) and raise the pending
    ``IndexError`` of any bad embedding index looked up so far."""
    if not torch.cuda.is_available():
        return
    devices = list(_RECORDS) if device is None else [_device_index(device)]
    for index in devices:
        if index in _RECORDS:
            torch.cuda.synchronize(index)
            dev, host, view = _RECORDS[index]
            if view[0] == 0 and int(dev[0]) != 0:  # reported by the torch path's device record only
                host.copy_(dev)
            if view[0] != 0:
                _raise_from(index, view)


def record_bad_indices(idx: Tensor, num: Tensor | int) -> None:
    """Reference-path bad-index report for CUDA tensors, built from torch ops without a host sync.

    ``num`` is the table size, a Python int or a tensor broadcastable to ``idx`` (one size per table).
    """
    dev_rec, host, _ = _record(idx.get_device())
    full = idx.long()
    nums = (num.to(full.device).expand_as(full) if isinstance(num, Tensor) else torch.full_like(full, num))
    flat, nums = full.reshape(-1), nums.reshape(-1)
    bad = (flat < 0) | (flat >= nums)
    first = bad.to(torch.int32).argmax()
    new = torch.stack([bad.any().long(), flat[first], nums[first], torch.zeros_like(flat[first])])
    keep = dev_rec[0] != 0
    dev_rec.copy_(torch.where(keep, dev_rec, new))
    host.copy_(dev_rec, non_blocking=True)


# --------------------------------------------------------------------------------------------------
# launches
#
# The hot path (one lookup = one gather launch forward, one zero-fill and one scatter launch backward)
# is built to cost little host time: a per-call *plan* cached by (device, dtypes, dim, alignment)
# holds the compiled kernel and everything derived from those keys, the argument checks are the few
# that guard a data_ptr(), and the launch packs its arguments into a per-thread buffer for one
# cuLaunchKernel. Small lookups are bound by this host time, not by the GPU.


class _GatherPlan:
    __slots__ = ("kernel", "log2g", "max_grid", "mirror", "rec", "rows_per_block", "words")

    def __init__(self, index: int, word: int, words: int, idx_dtype: torch.dtype) -> None:
        self.kernel = _compile("gather", _GATHER, "emb_gather", {"WORD": _WORDS[word], "IDX": _IDX[idx_dtype]}, index,
                               "QQQqqqqqqQQ")
        self.words = words
        self.log2g = _log2_lanes(words)
        self.rows_per_block = _BLOCK // 32 * (32 >> self.log2g)
        self.max_grid = _max_grid(index)
        dev_rec, host, _ = _record(index)
        self.rec, self.mirror = dev_rec.data_ptr(), host.data_ptr()


class _ScatterPlan:
    __slots__ = ("kernel", "log2g", "max_grid")

    def __init__(self, index: int, gt: int, vec: int, dim: int, idx_dtype: torch.dtype) -> None:
        defines = {"GT": gt, "VEC": vec, "IDX": _IDX[idx_dtype], "VECRED": int(index not in _VECRED_BROKEN)}
        try:
            kernel = _compile("scatter", _SCATTER, "emb_scatter", defines, index, "QQQQqqqqqqq")
        except Exception:  # the vector `red` needs PTX 8.1 (CUDA 12.1+); fall back to scalar atomics
            if not defines["VECRED"]:
                raise
            _VECRED_BROKEN.add(index)
            defines["VECRED"] = 0
            kernel = _compile("scatter", _SCATTER, "emb_scatter", defines, index, "QQQQqqqqqqq")
        self.kernel = kernel
        self.log2g = _log2_lanes(dim // vec)
        self.max_grid = _max_grid(index)


_BLOCK = 256
_GATHER_PLANS: dict[tuple, _GatherPlan] = {}
_SCATTER_PLANS: dict[tuple, _ScatterPlan] = {}


def _check_sizes(what: str, rows_shape, table_shape, n_idx: int, tables: int, num: int, per: int, dim: int) -> None:
    """Raise the ValueError of a ``gather`` / ``scatter`` whose sizes would index outside a tensor."""
    raise ValueError(
        f"{what}: {tables} tables of {num} rows of {dim} need a table of {tables * num * dim} elements (got "
        f"{tuple(table_shape)}), {tables * per} rows of {dim} (got {tuple(rows_shape)}) and {tables * per} or "
        f"{per} indices (got {n_idx})"
    )


def gather(weight: Tensor, idx: Tensor, tables: int, num: int, per: int, out_shape=None) -> Tensor:
    """Rows of ``weight`` (``tables * num`` rows of ``dim``, contiguous, on CUDA) for the ``tables * per``
    merged positions of ``idx`` (position ``i`` reads table ``i // per``, index ``idx.flatten()[i %
    idx.numel()]``), as a new ``out_shape`` tensor (default ``(tables * per, dim)``)."""
    dim = weight.shape[-1]
    M = tables * per
    out = weight.new_empty((M, dim) if out_shape is None else out_shape)
    if M == 0 or dim == 0:
        return out
    index = weight.get_device()
    if index < 0 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous CUDA tensor before its data_ptr() reaches a kernel, "
                         f"got {weight.device}{'' if weight.is_contiguous() else ' (not contiguous)'}")
    if idx.get_device() != index or idx.dtype not in _IDX or not idx.is_contiguous():
        _check_operand(idx, "indices", index, _IDX)
    n_idx = idx.numel()
    if out.numel() != M * dim or weight.numel() != tables * num * dim or (n_idx != M and n_idx != per):
        _check_sizes("gather", out.shape, weight.shape, n_idx, tables, num, per, dim)
    wptr = weight.data_ptr()
    row_bytes = dim * weight.element_size()
    word = row_bytes | wptr | 16
    word &= -word  # the widest word (<= 16 bytes) that divides the row size and the weight's address
    key = (index, word, row_bytes, idx.dtype)
    plan = _GATHER_PLANS.get(key)
    if plan is None:
        plan = _GATHER_PLANS.setdefault(key, _GatherPlan(index, word, row_bytes // word, idx.dtype))
    grid = min(-(-M // plan.rows_per_block), plan.max_grid)
    _launch(plan.kernel, grid, _BLOCK, (
        wptr, idx.data_ptr(), out.data_ptr(), M, plan.words, per, n_idx, num, plan.log2g, plan.rec, plan.mirror,
    ))
    return out


def counts(idx: Tensor, tables: int, num: int, per: int) -> Tensor:
    """``(tables * num,)`` int32 occurrence counts of each row among the merged positions."""
    out = torch.zeros(tables * num, dtype=torch.int32, device=idx.device)
    M = tables * per
    if M == 0:
        return out
    index = idx.get_device()
    _check_operand(idx, "indices", index, _IDX)
    if idx.numel() != M and idx.numel() != per:
        raise ValueError(f"counts: {tables} tables of {per} lookups need {M} or {per} indices, got {idx.numel()}")
    kernel = _compile("count", _COUNT, "emb_count", {"IDX": _IDX[idx.dtype]}, index, "QQqqqq")
    _launch(kernel, _grid(M, _BLOCK, index), _BLOCK, (idx.data_ptr(), out.data_ptr(), M, per, idx.numel(), num))
    return out


def scatter(grad: Tensor, idx: Tensor, shape: tuple[int, ...], tables: int, num: int, per: int,
            pad: int, freq: Tensor | None) -> Tensor:
    """fp32 weight gradient of ``shape`` (``tables * num * dim`` elements): the ``tables * per`` rows of
    ``grad`` (contiguous, fp32/fp16/bf16, any shape ending in ``dim``) atomically summed at the merged
    positions of ``idx``; ``pad`` (or -1) is a row that gets nothing; ``freq``, if given, the int32
    counts each row's sum is divided by."""
    dim = shape[-1]
    gw = grad.new_zeros(shape, dtype=torch.float32)
    M = tables * per
    if M == 0 or dim == 0:
        return gw
    index = grad.get_device()
    gt = _GT.get(grad.dtype)
    if gt is None or index < 0 or not grad.is_contiguous():
        _check_operand(grad, "grad_output", index, _GT)
    if idx.get_device() != index or idx.dtype not in _IDX or not idx.is_contiguous():
        _check_operand(idx, "indices", index, _IDX)
    n_idx = idx.numel()
    if grad.numel() != M * dim:
        raise ValueError(f"grad_output must hold {M} rows of {dim}, got shape {tuple(grad.shape)}")
    if gw.numel() != tables * num * dim or (n_idx != M and n_idx != per):
        _check_sizes("scatter", grad.shape, shape, n_idx, tables, num, per, dim)
    if freq is not None:
        _check_operand(freq, "counts", index, (torch.int32,))
        if freq.numel() != tables * num:
            raise ValueError(f"counts must hold {tables * num} rows' counts, got {freq.numel()}")
    gptr = grad.data_ptr()
    vec = dim | 4
    vec &= -vec  # the widest chunk (<= 4 elements) that divides dim and fits the gradient's alignment
    esize = grad.element_size()
    while vec > 1 and gptr % (vec * esize):
        vec //= 2
    key = (index, grad.dtype, dim, idx.dtype, vec)
    plan = _SCATTER_PLANS.get(key)
    if plan is None:
        plan = _SCATTER_PLANS.setdefault(key, _ScatterPlan(index, gt, vec, dim, idx.dtype))
    grid = min(-(-M // _BLOCK), plan.max_grid)  # one warp a tile of 32 positions
    _launch(plan.kernel, grid, _BLOCK, (
        gptr, idx.data_ptr(), gw.data_ptr(), 0 if freq is None else freq.data_ptr(),
        M, dim, per, n_idx, num, pad, plan.log2g,
    ))
    return gw


def multi_gather(weight: Tensor, idx: Tensor, meta: dict[str, Tensor], per: int, samples: int) -> Tensor:
    """MultiEmbedding forward: ``(samples, D)`` from ``weight`` ``(B, total)`` and ``idx`` ``(*, T)``."""
    D = meta["col_table"].numel()
    T = meta["rows"].numel()
    out = weight.new_empty((samples, D))
    if samples == 0 or D == 0:
        return out
    index = weight.get_device()
    _check_operand(idx, "indices", index, _IDX)
    _check_operand(weight, "weight", index, (weight.dtype,))
    for name in ("rows", "woff", "dims", "col_start"):
        _check_operand(meta[name], name, index, (torch.int64,))
    _check_operand(meta["col_table"], "col_table", index, (torch.int32,))
    kernel = _compile("mgather", _MULTI_GATHER, "memb_gather",
                      {"ELEM": _ELEM[weight.element_size()], "IDX": _IDX[idx.dtype]}, index, "QQQQQQQQqqqqqqQQ")
    dev_rec, host, _ = _record(index)
    _launch(kernel, _grid(samples * D, _BLOCK, index), _BLOCK, (
        weight.data_ptr(), idx.data_ptr(), out.data_ptr(), meta["rows"].data_ptr(), meta["woff"].data_ptr(),
        meta["dims"].data_ptr(), meta["col_start"].data_ptr(), meta["col_table"].data_ptr(),
        samples, T, D, per, idx.numel(), weight.shape[-1], dev_rec.data_ptr(), host.data_ptr(),
    ))
    return out


def multi_scatter(grad: Tensor, idx: Tensor, meta: dict[str, Tensor], shape: tuple[int, ...], per: int) -> Tensor:
    """MultiEmbedding backward: fp32 ``(B, total)`` gradient."""
    gw = grad.new_zeros(shape, dtype=torch.float32)
    samples, D = grad.shape
    if samples == 0 or D == 0:
        return gw
    index = grad.get_device()
    _check_operand(grad, "grad_output", index, _GT)
    _check_operand(idx, "indices", index, _IDX)
    kernel = _compile("mscatter", _MULTI_SCATTER, "memb_scatter",
                      {"GT": _GT[grad.dtype], "IDX": _IDX[idx.dtype]}, index, "QQQQQQQQqqqqqq")
    _launch(kernel, _grid(samples * D, _BLOCK, index), _BLOCK, (
        grad.data_ptr(), idx.data_ptr(), gw.data_ptr(), meta["rows"].data_ptr(), meta["woff"].data_ptr(),
        meta["dims"].data_ptr(), meta["col_start"].data_ptr(), meta["col_table"].data_ptr(),
        samples, meta["rows"].numel(), D, per, idx.numel(), shape[-1],
    ))
    return gw
