"""CuPy kernels of the GPU cache's bookkeeping (OffloadedEmbedding), each replacing several torch operations.

A cached training step is bound by host time: every torch operation costs the host a few microseconds
whatever its size, and the bookkeeping of a lookup, an admission and a store took some 40 of them per
table. These kernels do the same work in fewer launches (through :mod:`offload.cuda_launch`'s cheap path):

``cache_mark`` / ``cache_fill``
    Deduplication of sorted indices (with ``torch.sort`` before and one ``cumsum`` between them): the
    distinct ids, each index's position among them (the inverse), and with a cache each id's slot, the
    stamp of the slots used (LRU clock), and the misses (ids not cached and not excluded) already compacted,
    with their positions; plus the count, smallest and largest index and number of misses in one small
    tensor for the one host read-back.
``cache_install``
    Admission: the evicted rows' slot-map entries cleared, the admitted rows mapped to their slots, the
    slots' ids, LRU stamps and prefetch generation set, and the lookup's slot list patched.
``cache_store``
    A stepped working set back into the cache: weight and state rows into their records, the slots marked
    dirty.

The torch implementations beside their callers (``_lookup.py``, ``_gpu_cache.py``, ``_optim_state.py``) are
the reference (and the path on the CPU or without CuPy); :func:`use_cache_kernels` switches these off
(environment variable ``TORCHMB_OFFLOAD_KERNELS=0``). Every index a kernel writes through is one the cache
made itself; the kernels still skip entries out of range rather than write outside an array.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

import torchmb_config

from . import cuda_launch as _launch

try:
    import cupy
except (ImportError, OSError):  # pragma: no cover - depends on the machine
    cupy = None

_SWITCH = torchmb_config.SWITCHES["offload_cache_kernels"]


def get_cache_kernels() -> bool:
    """Whether the GPU cache's bookkeeping uses these kernels where they can run (CUDA tensors, CuPy
    importable); else the torch operations beside their callers (``offload._lookup``, ``_gpu_cache``,
    ``_optim_state``). Starts as ``$TORCHMB_OFFLOAD_KERNELS``
    (``0`` turns them off; default on)."""
    return _SWITCH.get()


def set_cache_kernels(enabled: bool) -> None:
    """Switch the cache kernels on or off (see :func:`get_cache_kernels`)."""
    _SWITCH.set(enabled)


@contextlib.contextmanager
def use_cache_kernels(enabled: bool) -> Iterator[None]:
    """Switch the cache kernels on or off inside the block; the old setting is restored after."""
    with _SWITCH.use(enabled):
        yield

_BLOCK = 256

_SRC = r"""
typedef long long ll;

// Sorted indices s[0..n): ranks[i] = 1 where a new id starts, ranks[n + i] = 1 where that id is a miss (its
// slot is the scratch row cap and it is not in the sorted exclude[0..m)); slot_flat[i]: the slot of s[i].
extern "C" __global__ void cache_mark(const ll* __restrict__ s, const ll* __restrict__ slot_of,
                                      const ll* __restrict__ ex, ll* __restrict__ ranks,
                                      ll* __restrict__ slot_flat, ll n, ll num_rows, ll cap, ll m) {
  for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ll)gridDim.x * blockDim.x) {
    const ll v = s[i];
    const ll first = (i == 0 || v != s[i - 1]) ? 1 : 0;
    ll miss = 0;
    if (slot_of) {
      const ll vc = v < 0 ? 0 : (v >= num_rows ? num_rows - 1 : v);
      const ll slot = slot_of[vc];
      slot_flat[i] = slot;
      if (first && slot == cap) {
        miss = 1;
        if (m > 0) {
          ll lo = 0, hi = m;
          while (lo < hi) {
            const ll mid = (lo + hi) >> 1;
            if (ex[mid] < v) lo = mid + 1; else hi = mid;
          }
          if (lo < m && ex[lo] == v) miss = 0;
        }
      }
    }
    ranks[i] = first;
    ranks[n + i] = miss;
  }
}

// After an inclusive cumsum of both rows of ranks: the distinct ids, the inverse, where each id's run of
// sorted positions starts (starts[count] = n), and with a cache the slots (stamped with `stamp` in last_use
// where stamp >= 0 and every index is in range) and the compacted misses; stats = (count, smallest, largest,
// misses).
extern "C" __global__ void cache_fill(const ll* __restrict__ s, const ll* __restrict__ order,
                                      const ll* __restrict__ ranks, const ll* __restrict__ slot_flat,
                                      ll* __restrict__ inverse, ll* __restrict__ ids, ll* __restrict__ slots,
                                      ll* __restrict__ miss_pos, ll* __restrict__ miss_ids,
                                      int* __restrict__ last_use, ll* __restrict__ stats,
                                      ll* __restrict__ starts, ll n, ll stamp, ll cap, ll num_rows) {
  const bool in_range = s[0] >= 0 && s[n - 1] < num_rows;  // (a lookup that will fail stamps nothing)
  for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ll)gridDim.x * blockDim.x) {
    const ll v = s[i];
    const ll seg = ranks[i] - 1;
    inverse[order[i]] = seg;
    if (i == 0 || v != s[i - 1]) {
      ids[seg] = v;
      starts[seg] = i;
      if (slots) {
        const ll slot = slot_flat[i];
        slots[seg] = slot;
        if (stamp >= 0 && in_range && slot >= 0 && slot <= cap) last_use[slot] = (int)stamp;
        const ll r = ranks[n + i];
        if (r != (i == 0 ? 0 : ranks[n + i - 1])) {
          miss_pos[r - 1] = seg;
          miss_ids[r - 1] = v;
        }
      }
    }
    if (i == n - 1) {
      starts[seg + 1] = n;
      stats[0] = seg + 1;
      stats[1] = s[0];
      stats[2] = v;
      stats[3] = slots ? ranks[n + i] : 0;
    }
  }
}

// Admission of k rows new_ids into slots victims (the first n_empty of them empty, the others evicted from
// rows old_ids): slot map, ids, LRU stamps, prefetch generation (fresh may be null), and the lookup's slot
// list (chunk_slots[miss_pos[i]] = victims[i]; may be null).
extern "C" __global__ void cache_install(const ll* __restrict__ victims, const ll* __restrict__ new_ids,
                                         const ll* __restrict__ old_ids, ll* __restrict__ ids,
                                         ll* __restrict__ slot_of, int* __restrict__ last_use,
                                         ll* __restrict__ fresh, ll* __restrict__ chunk_slots,
                                         const ll* __restrict__ miss_pos, ll k, ll n_empty, ll use, ll gen,
                                         ll n_slots, ll num_rows, ll cap) {
  for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < k; i += (ll)gridDim.x * blockDim.x) {
    if (i >= n_empty) {
      const ll o = old_ids[i - n_empty];
      if (o >= 0 && o < num_rows) slot_of[o] = cap;
    }
    const ll slot = victims[i], id = new_ids[i];
    if (slot < 0 || slot >= cap) continue;
    ids[slot] = id;
    if (id >= 0 && id < num_rows) slot_of[id] = slot;
    last_use[slot] = (int)use;
    if (fresh) fresh[slot] = gen;
    if (chunk_slots) {
      const ll p = miss_pos[i];
      if (p >= 0 && p < n_slots) chunk_slots[p] = slot;
    }
  }
}
"""

_STORE_SRC = r"""
typedef long long ll;
typedef V_T V;
// records[dest[r] * rec + j * vpr + c] = src_j[r * vpr + c] for r < n, part j < STORE_K, vector c < vpr;
// dirty[dest[r]] = 1. Rows whose slot is outside [0, slots) are skipped.
extern "C" __global__ void cache_store(V* __restrict__ records, const V* __restrict__ s0,
                                       const V* __restrict__ s1, const V* __restrict__ s2,
                                       const V* __restrict__ s3, const ll* __restrict__ dest,
                                       unsigned char* __restrict__ dirty, ll n, ll vpr, ll rec, ll slots) {
  const ll per = STORE_K * vpr;
  const ll total = n * per;
  for (ll e = (ll)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (ll)gridDim.x * blockDim.x) {
    const ll r = e / per;
    const ll rem = e - r * per;
    const int j = (int)(rem / vpr);
    const ll c = rem - (ll)j * vpr;
    const ll d = dest[r];
    if (d < 0 || d >= slots) continue;
    const V* src = j == 0 ? s0 : j == 1 ? s1 : j == 2 ? s2 : s3;
    records[d * rec + (ll)j * vpr + c] = src[r * vpr + c];
    if (rem == 0) dirty[d] = 1;
  }
}
"""

_SEG_SRC = r"""
typedef long long ll;
#if SEG_VEC == 4
typedef float4 VT;
__device__ __forceinline__ VT vzero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ void vadd(VT& a, const VT b) { a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w; }
#else
typedef float VT;
__device__ __forceinline__ VT vzero() { return 0.f; }
__device__ __forceinline__ void vadd(VT& a, const VT b) { a += b; }
#endif
#define TILE 32

// Phase 1: the sorted positions in tiles of TILE; each (tile, vector column) sums the rows of every run of
// one id in order. A run whose id lies wholly in the tile is that id's sum (written to gw); otherwise it is
// kept as the tile's head (its first run) and/or tail (its last run) for phase 2.
extern "C" __global__ void seg_tiles(const VT* __restrict__ grad, const ll* __restrict__ order,
                                     const ll* __restrict__ ranks, const ll* __restrict__ starts,
                                     VT* __restrict__ gw, VT* __restrict__ head, VT* __restrict__ tail,
                                     ll n, ll vpr, ll n_tiles) {
  for (ll e = (ll)blockIdx.x * blockDim.x + threadIdx.x; e < n_tiles * vpr; e += (ll)gridDim.x * blockDim.x) {
    const ll t = e / vpr, c = e - t * vpr;
    const ll lo = t * TILE, hi = lo + TILE < n ? lo + TILE : n;
    VT acc = vzero();
    bool first = true;
    for (ll j = lo; j < hi; ++j) {
      vadd(acc, grad[order[j] * vpr + c]);
      const bool last = j + 1 == hi;
      if (last || ranks[j + 1] != ranks[j]) {
        const ll seg = ranks[j] - 1;
        if (starts[seg] >= lo && starts[seg + 1] <= hi) {
          gw[seg * vpr + c] = acc;
        } else {
          if (first) head[t * vpr + c] = acc;
          if (last) tail[t * vpr + c] = acc;
        }
        acc = vzero();
        first = false;
      }
    }
  }
}

// Phase 2: an id whose run crosses tiles sums its tail in the first tile, the whole tiles between (their
// head) and its head in the last tile, in order.
extern "C" __global__ void seg_join(const ll* __restrict__ starts, const VT* __restrict__ head,
                                    const VT* __restrict__ tail, VT* __restrict__ gw, ll count, ll vpr) {
  for (ll e = (ll)blockIdx.x * blockDim.x + threadIdx.x; e < count * vpr; e += (ll)gridDim.x * blockDim.x) {
    const ll s = e / vpr, c = e - s * vpr;
    const ll ta = starts[s] / TILE, tb = (starts[s + 1] - 1) / TILE;
    if (ta == tb) continue;
    VT acc = tail[ta * vpr + c];
#pragma unroll 4
    for (ll t = ta + 1; t < tb; ++t) vadd(acc, head[t * vpr + c]);
    vadd(acc, head[tb * vpr + c]);
    gw[s * vpr + c] = acc;
  }
}
"""
_TILE = 32

_LRU_SRC = r"""
typedef long long ll;
typedef unsigned long long ull;
#define HB 4096

__device__ __forceinline__ ll age_bucket(const int* stamps, ll i, ll clock) {
  const ll age = clock - (ll)stamps[i];
  return age < 0 ? 0 : (age >= HB ? HB - 1 : age);
}

// Ages (clock - stamp, at most HB - 1) of the filled slots, counted per block in shared memory.
extern "C" __global__ void lru_hist(const int* __restrict__ stamps, ull* __restrict__ hist, ll filled, ll clock) {
  __shared__ unsigned int h[HB];
  for (int b = threadIdx.x; b < HB; b += blockDim.x) h[b] = 0;
  __syncthreads();
  for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < filled; i += (ll)gridDim.x * blockDim.x)
    atomicAdd(&h[age_bucket(stamps, i, clock)], 1u);
  __syncthreads();
  for (int b = threadIdx.x; b < HB; b += blockDim.x)
    if (h[b]) atomicAdd(&hist[b], (ull)h[b]);
}

// One block of HB / 4 threads: the bucket A in which the k oldest slots end, how many are older (n_gt) and
// how many of bucket A to take: params = (A, n_gt, need).
extern "C" __global__ void lru_threshold(const ull* __restrict__ hist, ll* __restrict__ params, ll k) {
  __shared__ ll part[HB / 4];
  const int t = threadIdx.x;  // buckets HB-1-4t down to HB-4-4t: the oldest first
  ll s = 0;
  for (int q = 0; q < 4; ++q) s += (ll)hist[HB - 1 - (4 * t + q)];
  part[t] = s;
  __syncthreads();
  for (int off = 1; off < HB / 4; off <<= 1) {
    const ll v = t >= off ? part[t - off] : 0;
    __syncthreads();
    part[t] += v;
    __syncthreads();
  }
  ll cum = part[t] - s;
  if (cum < k && cum + s >= k) {
    for (int q = 0; q < 4; ++q) {
      const int b = HB - 1 - (4 * t + q);
      const ll c = (ll)hist[b];
      if (cum + c >= k) {
        params[0] = b;
        params[1] = cum;
        params[2] = k - cum;
        break;
      }
      cum += c;
    }
  }
}

// The k victims: every filled slot of a bucket older than A, and `need` of bucket A (those that claim a place
// first); warp-aggregated claims.
extern "C" __global__ void lru_select(const int* __restrict__ stamps, const ll* __restrict__ params,
                                      ull* __restrict__ ctr, ll* __restrict__ victims, ll filled, ll clock, ll k) {
  const unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const ll A = params[0], n_gt = params[1], need = params[2];
  const ll stride = (ll)gridDim.x * blockDim.x;
  const unsigned below = (1u << lane) - 1u;
  for (ll i0 = (ll)blockIdx.x * blockDim.x + threadIdx.x - lane; i0 < filled; i0 += stride) {
    const ll i = i0 + lane;
    const ll b = i < filled ? age_bucket(stamps, i, clock) : -1;
    const bool older = b > A && A > 0, tie = b == A && A > 0;
    const unsigned mo = __ballot_sync(FULL, older), mt = __ballot_sync(FULL, tie);
    ll base_o = 0, base_t = 0;
    if (lane == 0) {
      if (mo) base_o = (ll)atomicAdd(&ctr[0], (ull)__popc(mo));
      if (mt) base_t = (ll)atomicAdd(&ctr[1], (ull)__popc(mt));
    }
    base_o = __shfl_sync(FULL, base_o, 0);
    base_t = __shfl_sync(FULL, base_t, 0);
    if (older) {
      const ll p = base_o + __popc(mo & below);
      if (p < n_gt) victims[p] = i;
    }
    if (tie) {
      const ll q = base_t + __popc(mt & below);
      if (q < need && n_gt + q < k) victims[n_gt + q] = i;
    }
  }
}
"""
LRU_AGES = 4096  # LRU ages told apart when choosing victims: slots unused for longer count as equally old


def lru_victims(stamps: Tensor, k: int, clock: int) -> Tensor:
    """The ``k`` slots least recently used (smallest ``stamps``, int32, the filled slots') in no particular
    order, as ``torch.topk(stamps, k, largest=False).indices`` but in four launches: a histogram of ages
    (``clock - stamp``; ages of :data:`LRU_AGES` steps and more are one bucket), the bucket where the k
    oldest end, and a pass that claims them. Slots stamped ``clock`` or later (age <= 0) are never chosen:
    the caller guarantees at least ``k`` others."""
    filled = stamps.shape[0]
    index = stamps.get_device()
    if not (stamps.dtype == torch.int32 and stamps.is_contiguous() and index >= 0 and 0 < k <= filled):
        raise ValueError("offload cache kernels: LRU stamps must be a contiguous int32 CUDA tensor of >= k slots")
    work = torch.zeros(LRU_AGES + 5, dtype=torch.int64, device=stamps.device)  # histogram, (A, n_gt, need), claims
    victims = torch.empty(k, dtype=torch.int64, device=stamps.device)
    hist, params, ctr = work.data_ptr(), work.data_ptr() + 8 * LRU_AGES, work.data_ptr() + 8 * (LRU_AGES + 3)
    kern = {name: _launch.compile_kernel("offload_lru", _LRU_SRC, name, {}, index, fmt)
            for name, fmt in (("lru_hist", "QQqq"), ("lru_threshold", "QQq"), ("lru_select", "QQQQqqq"))}
    _launch.launch(kern["lru_hist"], max(1, min(-(-filled // _BLOCK), _launch.sm_count(index) * 4)), _BLOCK,
                   (stamps.data_ptr(), hist, filled, clock))
    _launch.launch(kern["lru_threshold"], 1, LRU_AGES // 4, (hist, params, k))
    _launch.launch(kern["lru_select"], _grid(filled, index), _BLOCK,
                   (stamps.data_ptr(), params, ctr, victims.data_ptr(), filled, clock, k))
    return victims


def segment_sum(grad: Tensor, runs: tuple[Tensor, Tensor, Tensor], count: int) -> Tensor:
    """``gw[d] = sum of grad[p] over the positions p of distinct id d`` (the backward of a lookup of the rows
    that :func:`dedup` found), as a new ``(count, dim)`` float32 tensor, summed in a fixed order (the same
    result every run): within tiles of 32 sorted positions, then across tiles. ``grad``: ``(n, dim)``
    float32, contiguous, on CUDA; ``runs`` and ``count`` from :func:`dedup` of those ``n`` positions."""
    order, ranks, starts = runs
    n, dim = grad.shape
    index = grad.get_device()
    if not (grad.dtype == torch.float32 and grad.is_contiguous() and index >= 0 and order.shape[0] == n
            and ranks.shape[0] == n and starts.shape[0] >= count + 1 and 0 < count <= n
            and all(t.dtype == torch.int64 and t.get_device() == index and t.is_contiguous()
                    for t in (order, ranks, starts))):
        raise ValueError("offload cache kernels: a lookup's gradient and its runs do not match")
    vec = 4 if dim % 4 == 0 and grad.data_ptr() % 16 == 0 else 1
    vpr = dim // vec
    n_tiles = -(-n // _TILE)
    gw = torch.empty(count, dim, dtype=torch.float32, device=grad.device)
    parts = torch.empty(2, n_tiles, dim, dtype=torch.float32, device=grad.device)
    head, tail = parts[0], parts[1]
    tiles = _launch.compile_kernel("offload_seg", _SEG_SRC, "seg_tiles", {"SEG_VEC": vec}, index, "QQQQQQQqqq")
    join = _launch.compile_kernel("offload_seg", _SEG_SRC, "seg_join", {"SEG_VEC": vec}, index, "QQQQqq")
    _launch.launch(tiles, _grid(n_tiles * vpr, index), _BLOCK, (
        grad.data_ptr(), order.data_ptr(), ranks.data_ptr(), starts.data_ptr(), gw.data_ptr(), head.data_ptr(),
        tail.data_ptr(), n, vpr, n_tiles))
    _launch.launch(join, _grid(count * vpr, index), _BLOCK, (
        starts.data_ptr(), head.data_ptr(), tail.data_ptr(), gw.data_ptr(), count, vpr))
    return gw




def usable(device: torch.device) -> bool:
    """Whether the kernels run for tensors on ``device`` now."""
    return cupy is not None and device.type == "cuda" and _SWITCH.get()


def _grid(work: int, index: int) -> int:
    return max(1, min(-(-work // _BLOCK), _launch.sm_count(index) * 32))


def _kernel(name: str, index: int, fmt: str):
    return _launch.compile_kernel("offload_cache", _SRC, name, {}, index, fmt)


def dedup(flat: Tensor, slot_of: Tensor | None = None, capacity: int = 0, num_rows: int = 0,
          exclude: Tensor | None = None, stamp: int = -1, last_use: Tensor | None = None):
    """Deduplicate ``flat`` (non-empty, int64, contiguous, on CUDA) and, with a cache (``slot_of``), look its
    ids up. Returns ``(ids, inverse, slots, miss_pos, miss_ids, stats, runs)``, the first five views of
    buffers as long as ``flat`` (valid up to ``stats[0]`` distinct ids and ``stats[3]`` misses; ``slots``,
    ``miss_pos`` and ``miss_ids`` ``None`` without a cache), ``stats`` the device tensor (count, smallest,
    largest, misses) that the caller reads back and ``runs`` what :func:`segment_sum` needs: the sorting
    permutation, the inclusive id ranks of the sorted positions and where each id's run starts (valid up to
    ``stats[0] + 1``). With ``stamp >= 0`` the ids' slots are stamped in
    ``last_use`` (only if every index is in range: a lookup that fails changes nothing)."""
    n = flat.shape[0]
    index = flat.get_device()
    sorted_flat, order = torch.sort(flat)
    cached = slot_of is not None
    buf = torch.empty((9 if cached else 5) * n + 5, dtype=torch.int64, device=flat.device)
    ranks = buf[: 2 * n]
    inverse, ids, starts = buf[2 * n: 3 * n], buf[3 * n: 4 * n], buf[4 * n: 5 * n + 1]
    stats = buf[-4:]
    slot_flat = slots = miss_pos = miss_ids = None
    if cached:
        slot_flat, slots = buf[5 * n + 1: 6 * n + 1], buf[6 * n + 1: 7 * n + 1]
        miss_pos, miss_ids = buf[7 * n + 1: 8 * n + 1], buf[8 * n + 1: 9 * n + 1]
        if not (slot_of.dtype == torch.int64 and slot_of.get_device() == index and slot_of.is_contiguous()
                and slot_of.shape[0] == num_rows and last_use.dtype == torch.int32
                and last_use.get_device() == index and last_use.is_contiguous()
                and last_use.shape[0] == capacity + 1):
            raise ValueError("offload cache kernels: the slot map or the LRU stamps are not the cache's")
    m = 0
    if exclude is not None:
        m = exclude.shape[0]
        if not (exclude.dtype == torch.int64 and exclude.get_device() == index and exclude.is_contiguous()):
            raise ValueError("offload cache kernels: the excluded ids must be a contiguous int64 CUDA tensor")
    grid = _grid(n, index)
    ptr = Tensor.data_ptr
    _launch.launch(_kernel("cache_mark", index, "QQQQQqqqq"), grid, _BLOCK, (
        ptr(sorted_flat), ptr(slot_of) if cached else 0, ptr(exclude) if m else 0, ptr(ranks),
        ptr(slot_flat) if cached else 0, n, num_rows, capacity, m))
    ranks.view(2, n).cumsum_(1)
    _launch.launch(_kernel("cache_fill", index, "QQQQQQQQQQQQqqqq"), grid, _BLOCK, (
        ptr(sorted_flat), ptr(order), ptr(ranks), ptr(slot_flat) if cached else 0, ptr(inverse), ptr(ids),
        ptr(slots) if cached else 0, ptr(miss_pos) if cached else 0, ptr(miss_ids) if cached else 0,
        ptr(last_use) if cached and stamp >= 0 else 0, ptr(stats), ptr(starts), n, stamp if cached else -1, capacity,
        num_rows))
    return ids, inverse, slots, miss_pos, miss_ids, stats, (order, ranks[:n], starts)


def install(victims: Tensor, new_ids: Tensor, old_ids: Tensor | None, n_empty: int, ids: Tensor, slot_of: Tensor,
            last_use: Tensor, use: int, fresh: Tensor | None = None, gen: int = 0, chunk_slots: Tensor | None = None,
            miss_pos: Tensor | None = None) -> None:
    """Admit rows ``new_ids`` into slots ``victims`` (see the module docstring); all int64 CUDA tensors
    the cache made (``last_use`` int32), contiguous."""
    k = victims.shape[0]
    if k == 0:
        return
    index = victims.get_device()
    for t in (victims, new_ids, old_ids, chunk_slots, miss_pos):
        if t is not None and not (t.dtype == torch.int64 and t.get_device() == index and t.is_contiguous()):
            raise ValueError("offload cache kernels: slots and ids must be contiguous int64 CUDA tensors")
    if new_ids.shape[0] != k or (chunk_slots is not None and (miss_pos is None or miss_pos.shape[0] < k)) or (
            k > n_empty and (old_ids is None or old_ids.shape[0] != k - n_empty)):
        raise ValueError("offload cache kernels: an admission's slots, ids and positions differ in number")
    ptr = Tensor.data_ptr
    _launch.launch(_kernel("cache_install", index, "QQQQQQQQQqqqqqqq"), _grid(k, index), _BLOCK, (
        ptr(victims), ptr(new_ids), ptr(old_ids) if k > n_empty else 0, ptr(ids), ptr(slot_of), ptr(last_use),
        ptr(fresh) if fresh is not None else 0, ptr(chunk_slots) if chunk_slots is not None else 0,
        ptr(miss_pos) if chunk_slots is not None else 0, k, n_empty, use, gen,
        chunk_slots.shape[0] if chunk_slots is not None else 0, slot_of.shape[0], ids.shape[0] - 1))


def store(records: Tensor, dest: Tensor, srcs: list[Tensor], dirty: Tensor) -> bool:
    """``records[dest[i], j] = srcs[j][i]`` and ``dirty[dest] = True`` in one launch; ``False`` (nothing
    done) where the operands do not suit the kernel (the caller then uses torch)."""
    k = len(srcs)
    index = records.get_device()
    n, dim = srcs[0].shape if srcs[0].dim() == 2 else (-1, -1)
    if not (1 <= k <= 4 and records.dim() == 3 and records.shape[1] == k and records.shape[2] == dim
            and records.is_contiguous() and dest.dtype == torch.int64 and dest.get_device() == index
            and dest.is_contiguous() and dest.shape[0] == n and dirty.dtype == torch.bool
            and dirty.get_device() == index and dirty.is_contiguous() and dirty.shape[0] == records.shape[0]):
        return False
    for s in srcs:
        if s.dtype != records.dtype or s.get_device() != index or s.shape != srcs[0].shape or not s.is_contiguous():
            return False
    if n == 0:
        return True
    row_bytes = dim * records.element_size()
    width = _launch.vector_width(row_bytes, records.data_ptr(), *(s.data_ptr() for s in srcs))
    vpr = row_bytes // width
    kernel = _launch.compile_kernel("offload_cache_store", _STORE_SRC, "cache_store",
                                    {"V_T": _launch.VECTOR_TYPES[width], "STORE_K": k}, index, "QQQQQQQqqqq")
    ptrs = [s.data_ptr() for s in srcs] + [0] * (4 - k)
    _launch.launch(kernel, _grid(n * k * vpr, index), _BLOCK, (
        records.data_ptr(), *ptrs, dest.data_ptr(), dirty.data_ptr(), n, vpr, k * vpr, records.shape[0]))
    return True
