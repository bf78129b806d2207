"""Fused CUDA steps (CuPy RawKernels) for batched SGD and Adam/AdamW: one launch per parameter group.

The reference step (``_optimizers.py``) makes as many passes over the parameters as ``torch.optim``'s
multi-tensor step (SGD with momentum: 3 kernels, Adam: 8). Here one launch steps every parameter tensor
of a group for every model at once, reading each parameter, gradient and state element once and writing
the parameter and state once, so the step moves the fewest bytes it can.

How a launch is laid out:

- Work items are ``(tensor, model, chunk)``: a chunk is ``block * UNROLL`` float4s (or that many single
  floats for rows that cannot be read as float4) of one model's row of one tensor. The grid is exactly the
  blocks that are resident at once; each block walks the work items ``blockIdx.x, + gridDim.x, ...``, so
  the work is spread evenly whatever the tensor sizes and B, and each thread has ``UNROLL`` 16-byte loads
  of every operand in flight. Loads and stores carry the streaming cache hint (nothing is read twice).
- A small device table holds each tensor's pointers, row length, chunk count, first work item and the
  address of its per-model coefficients. It is cached per set of tensor addresses (a few sets are kept,
  since gradients set to ``None`` between steps often come back at alternating addresses) and written
  by a tiny kernel whose arguments carry the values, so a rebuild needs no host memory and is safe inside
  CUDA-graph capture.
- Per-model coefficients (``(sets, rows, B)`` float32 on the device) are uploaded only when the optimizer
  says they changed (:class:`FusedStep`); SGD's stay on the device between steps, Adam's bias corrections
  change every step.

The arithmetic per element is the reference's (Adam in torch's plain single-tensor form,
``p += -step_size * m / (sqrt(v) / sqrt(bc2) + eps)``), so the two paths agree to float rounding.

Used when CuPy imports and every tensor is a contiguous float32 CUDA tensor on one device; chosen by
``fused=None`` (the default) unless the ``batch_layers`` backend switch says ``"torch"``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from batch_layers import get_backend
from offload import cuda_launch

try:
    import cupy
except (ImportError, OSError) as error:  # pragma: no cover - depends on the machine
    cupy = None
    CUPY_ERROR: BaseException | None = error
else:
    CUPY_ERROR = None

__all__ = ["LAUNCHES", "VARIANT", "FusedStep", "fused_reason", "same_values"]

#: Kernel launches per kernel name since import, the launcher's counter (tests use it to prove the fused
#: path ran).
LAUNCHES = cuda_launch.LAUNCHES

_SOURCE = r"""
typedef long long ll;

#if STREAMING
#define LOAD(ptr) __ldcs(ptr)
#define STORE(ptr, value) __stcs(ptr, value)
#else
#define LOAD(ptr) (*(ptr))
#define STORE(ptr, value) (*(ptr) = (value))
#endif

// One table entry per parameter tensor, TABLE_STRIDE int64 fields: up to 6 element pointers (param, grad,
// state...), then the tensor's coefficients (float*, rows of B), its row length (elements per model), its
// chunks per row, its first work item, and whether its rows are read as float4.
#define TABLE_STRIDE 12
#define E_COEF 6
#define E_ROW 7
#define E_CHUNKS 8
#define E_FIRST 9
#define E_VEC 10

__device__ __forceinline__ float nan_max(float a, float b) {
    return (isnan(a) || isnan(b)) ? a + b : fmaxf(a, b);  // torch.maximum propagates NaN
}

__device__ __forceinline__ void sgd_elem(float& p, float g, float& b, float neg_lr, float wd, float mom,
                                         float damp, float nest, ll flags) {
    if (flags & 1) g = -g;
    if (flags & 2) g = g + wd * p;
    if (flags & 4) {
        b = b * mom;
        b = b + damp * g;
        g = (flags & 8) ? g + nest * b : b;
    }
    p = p + neg_lr * g;
}

__device__ __forceinline__ void adam_elem(float& p, float g, float& m, float& v, float& vmax, float omb1,
                                          float b2, float omb2, float neg_step, float bc2s, float eps,
                                          float wd, float decay, ll flags) {
    if (flags & 1) g = -g;
    if (flags & 2) g = g + wd * p;
    if (flags & 4) p = p * decay;
    m = (fabsf(omb1) < 0.5f) ? m + omb1 * (g - m) : g - (g - m) * (1.0f - omb1);  // torch's lerp
    v = v * b2;
    v = v + omb2 * g * g;
    float src = v;
    if (flags & 8) {
        vmax = nan_max(vmax, v);
        src = vmax;
    }
    float denom = sqrtf(src) / bc2s + eps;
    p = p + neg_step * (m / denom);
}

// The work item w of a launch: advances (t, first, end) to the tensor holding w (items only grow within a
// block, so t only moves forward) and returns its entry.
__device__ __forceinline__ const ll* entry_of(const ll* table, ll w, ll batch, ll& t, ll& first, ll& end) {
    while (w >= end) {
        ++t;
        const ll* e = table + t * TABLE_STRIDE;
        first = e[E_FIRST];
        end = first + batch * e[E_CHUNKS];
    }
    return table + t * TABLE_STRIDE;
}

struct SgdCoef {
    float neg_lr, wd, mom, damp, nest;
};

__device__ __forceinline__ SgdCoef sgd_coef(const float* c, ll model, ll batch, ll flags) {
    SgdCoef k;
    k.neg_lr = c[model];
    k.wd = (flags & 2) ? c[batch + model] : 0.0f;
    k.mom = (flags & 4) ? c[2 * batch + model] : 0.0f;
    k.damp = (flags & 4) ? c[3 * batch + model] : 0.0f;
    k.nest = (flags & 8) ? c[4 * batch + model] : 0.0f;
    return k;
}

__device__ __forceinline__ void sgd4(float4& p, const float4& g, float4& b, const SgdCoef& k, ll flags) {
    sgd_elem(p.x, g.x, b.x, k.neg_lr, k.wd, k.mom, k.damp, k.nest, flags);
    sgd_elem(p.y, g.y, b.y, k.neg_lr, k.wd, k.mom, k.damp, k.nest, flags);
    sgd_elem(p.z, g.z, b.z, k.neg_lr, k.wd, k.mom, k.damp, k.nest, flags);
    sgd_elem(p.w, g.w, b.w, k.neg_lr, k.wd, k.mom, k.damp, k.nest, flags);
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
torchmb_sgd(const ll* __restrict__ table, ll total, ll batch, ll flags) {
    const ll chunk = (ll)blockDim.x * UNROLL;
    const bool has_buf = (flags & 4) != 0;
    ll t = -1, first = 0, end = 0;
    for (ll w = blockIdx.x; w < total; w += gridDim.x) {
        const ll* e = entry_of(table, w, batch, t, first, end);
        const ll chunks = e[E_CHUNKS], row = e[E_ROW];
        const ll model = (w - first) / chunks;
        const ll start = (w - first - model * chunks) * chunk;  // in float4s (or floats) of the row
        const SgdCoef k = sgd_coef(reinterpret_cast<const float*>(e[E_COEF]), model, batch, flags);
        float* __restrict__ P = reinterpret_cast<float*>(e[0]) + model * row;
        const float* __restrict__ G = reinterpret_cast<const float*>(e[1]) + model * row;
        float* __restrict__ BUF = reinterpret_cast<float*>(e[2]) + model * row;
        if (e[E_VEC]) {
            float4* p4 = reinterpret_cast<float4*>(P) + start;
            const float4* g4 = reinterpret_cast<const float4*>(G) + start;
            float4* b4 = reinterpret_cast<float4*>(BUF) + start;
            const ll n = row / 4 - start < chunk ? row / 4 - start : chunk;
            if (n == chunk) {
                float4 p[UNROLL], g[UNROLL], b[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const ll j = threadIdx.x + (ll)u * blockDim.x;
                    p[u] = LOAD(p4 + j);
                    g[u] = LOAD(g4 + j);
                    b[u] = has_buf ? LOAD(b4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const ll j = threadIdx.x + (ll)u * blockDim.x;
                    sgd4(p[u], g[u], b[u], k, flags);
                    STORE(p4 + j, p[u]);
                    if (has_buf) STORE(b4 + j, b[u]);
                }
            } else {
                for (ll j = threadIdx.x; j < n; j += blockDim.x) {
                    float4 p = LOAD(p4 + j);
                    const float4 g = LOAD(g4 + j);
                    float4 b = has_buf ? LOAD(b4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
                    sgd4(p, g, b, k, flags);
                    STORE(p4 + j, p);
                    if (has_buf) STORE(b4 + j, b);
                }
            }
        } else {
            const ll n = row - start < chunk ? row - start : chunk;
            for (ll j = start + threadIdx.x; j < start + n; j += blockDim.x) {
                float p = LOAD(P + j);
                float b = has_buf ? LOAD(BUF + j) : 0.0f;
                sgd_elem(p, LOAD(G + j), b, k.neg_lr, k.wd, k.mom, k.damp, k.nest, flags);
                STORE(P + j, p);
                if (has_buf) STORE(BUF + j, b);
            }
        }
    }
}

struct AdamCoef {
    float omb1, b2, omb2, neg_step, bc2s, eps, wd, decay;
};

__device__ __forceinline__ AdamCoef adam_coef(const float* c, ll model, ll batch, ll flags) {
    AdamCoef k;
    k.omb1 = c[model];
    k.b2 = c[batch + model];
    k.omb2 = c[2 * batch + model];
    k.neg_step = c[3 * batch + model];
    k.bc2s = c[4 * batch + model];
    k.eps = c[5 * batch + model];
    k.wd = (flags & 2) ? c[6 * batch + model] : 0.0f;
    k.decay = (flags & 4) ? c[7 * batch + model] : 1.0f;
    return k;
}

__device__ __forceinline__ void adam1(float& p, float g, float& m, float& v, float& vm, const AdamCoef& k,
                                      ll flags) {
    adam_elem(p, g, m, v, vm, k.omb1, k.b2, k.omb2, k.neg_step, k.bc2s, k.eps, k.wd, k.decay, flags);
}

__device__ __forceinline__ void adam4(float4& p, const float4& g, float4& m, float4& v, float4& vm,
                                      const AdamCoef& k, ll flags) {
    adam1(p.x, g.x, m.x, v.x, vm.x, k, flags);
    adam1(p.y, g.y, m.y, v.y, vm.y, k, flags);
    adam1(p.z, g.z, m.z, v.z, vm.z, k, flags);
    adam1(p.w, g.w, m.w, v.w, vm.w, k, flags);
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
torchmb_adam(const ll* __restrict__ table, ll total, ll batch, ll flags) {
    const ll chunk = (ll)blockDim.x * UNROLL;
    const bool ams = (flags & 8) != 0;
    ll t = -1, first = 0, end = 0;
    for (ll w = blockIdx.x; w < total; w += gridDim.x) {
        const ll* e = entry_of(table, w, batch, t, first, end);
        const ll chunks = e[E_CHUNKS], row = e[E_ROW];
        const ll model = (w - first) / chunks;
        const ll start = (w - first - model * chunks) * chunk;
        const AdamCoef k = adam_coef(reinterpret_cast<const float*>(e[E_COEF]), model, batch, flags);
        float* __restrict__ P = reinterpret_cast<float*>(e[0]) + model * row;
        const float* __restrict__ G = reinterpret_cast<const float*>(e[1]) + model * row;
        float* __restrict__ M = reinterpret_cast<float*>(e[2]) + model * row;
        float* __restrict__ V = reinterpret_cast<float*>(e[3]) + model * row;
        float* __restrict__ VM = reinterpret_cast<float*>(e[4]) + model * row;
        if (e[E_VEC]) {
            float4* p4 = reinterpret_cast<float4*>(P) + start;
            const float4* g4 = reinterpret_cast<const float4*>(G) + start;
            float4* m4 = reinterpret_cast<float4*>(M) + start;
            float4* v4 = reinterpret_cast<float4*>(V) + start;
            float4* vm4 = reinterpret_cast<float4*>(VM) + start;
            const ll n = row / 4 - start < chunk ? row / 4 - start : chunk;
            if (n == chunk) {
                float4 p[UNROLL], g[UNROLL], m[UNROLL], v[UNROLL], vm[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const ll j = threadIdx.x + (ll)u * blockDim.x;
                    p[u] = LOAD(p4 + j);
                    g[u] = LOAD(g4 + j);
                    m[u] = LOAD(m4 + j);
                    v[u] = LOAD(v4 + j);
                    vm[u] = ams ? LOAD(vm4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const ll j = threadIdx.x + (ll)u * blockDim.x;
                    adam4(p[u], g[u], m[u], v[u], vm[u], k, flags);
                    STORE(p4 + j, p[u]);
                    STORE(m4 + j, m[u]);
                    STORE(v4 + j, v[u]);
                    if (ams) STORE(vm4 + j, vm[u]);
                }
            } else {
                for (ll j = threadIdx.x; j < n; j += blockDim.x) {
                    float4 p = LOAD(p4 + j), m = LOAD(m4 + j), v = LOAD(v4 + j);
                    float4 vm = ams ? LOAD(vm4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
                    adam4(p, LOAD(g4 + j), m, v, vm, k, flags);
                    STORE(p4 + j, p);
                    STORE(m4 + j, m);
                    STORE(v4 + j, v);
                    if (ams) STORE(vm4 + j, vm);
                }
            }
        } else {
            const ll n = row - start < chunk ? row - start : chunk;
            for (ll j = start + threadIdx.x; j < start + n; j += blockDim.x) {
                float p = LOAD(P + j), m = LOAD(M + j), v = LOAD(V + j);
                float vm = ams ? LOAD(VM + j) : 0.0f;
                adam1(p, LOAD(G + j), m, v, vm, k, flags);
                STORE(P + j, p);
                STORE(M + j, m);
                STORE(V + j, v);
                if (ams) STORE(VM + j, vm);
            }
        }
    }
}

// Writes n (<= FILL_WIDTH) int64 values, carried as kernel arguments, to dst: builds the tables above
// without host memory (so a rebuild is also safe while a CUDA graph is being captured).
extern "C" __global__ void torchmb_fill(ll* __restrict__ dst, ll n, ll v0, ll v1, ll v2, ll v3, ll v4, ll v5,
                                        ll v6, ll v7, ll v8, ll v9, ll v10, ll v11, ll v12, ll v13, ll v14,
                                        ll v15, ll v16, ll v17, ll v18, ll v19, ll v20, ll v21, ll v22,
                                        ll v23) {
    const ll v[24] = {v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11,
                      v12, v13, v14, v15, v16, v17, v18, v19, v20, v21, v22, v23};
    const ll i = threadIdx.x;
    if (i < n) dst[i] = v[i];
}
"""

_TABLE_STRIDE = 12
_E_COEF, _E_ROW, _E_CHUNKS, _E_FIRST, _E_VEC = 6, 7, 8, 9, 10
_FILL_WIDTH = 24
_BLOCK = 256
_TABLES_KEPT = 4  # tables cached per group (one per set of tensor addresses)

#: Kernel variants, per kernel: (float4s per thread per work item, streaming cache hints on/off, minimum
#: resident blocks per multiprocessor promised to the compiler, which caps its registers). Chosen by
#: measurement on an H200 (docs/reference/optim.md); the benchmark script overrides them to compare.
VARIANT: dict[str, tuple[int, int, int]] = {
    "torchmb_sgd": (4, 1, 4),
    "torchmb_adam": (4, 1, 2),
    "torchmb_fill": (1, 0, 1),
}

# kind -> (kernel name, element pointers per tensor, coefficient rows)
_KINDS = {"sgd": ("torchmb_sgd", 3, 5), "adam": ("torchmb_adam", 5, 8)}

# each kernel's arguments for the launcher: Q a pointer, q a long long (every one 8 bytes)
_ARGS = {"torchmb_sgd": "Qqqq", "torchmb_adam": "Qqqq", "torchmb_fill": "Qq" + "q" * _FILL_WIDTH}
_RESIDENT: dict[tuple, int] = {}
OCCUPANCY_FROM: dict[tuple, str] = {}  # where _resident_blocks took blocks per multiprocessor from (benchmark)

# SGD flag bits (the kernel's `flags`)
SGD_MAXIMIZE, SGD_WEIGHT_DECAY, SGD_MOMENTUM, SGD_NESTEROV = 1, 2, 4, 8
# Adam flag bits
ADAM_MAXIMIZE, ADAM_L2, ADAM_DECOUPLED, ADAM_AMSGRAD = 1, 2, 4, 8


def fused_reason(params: list[Tensor], tensors: list[Tensor]) -> str | None:
    """Why the fused kernels cannot run on these tensors (``None``: they can)."""
    if cupy is None:
        return f"CuPy could not be imported ({CUPY_ERROR!r})"
    if get_backend() == "torch":
        return "the batch_layers backend is 'torch'"
    device = params[0].device
    if device.type != "cuda":
        return f"the parameters are on {device}, not a CUDA device"
    for t in tensors:
        if t.device != device:
            return f"tensors on several devices ({device} and {t.device})"
        if t.dtype != torch.float32:
            return f"a {t.dtype} tensor (the kernels take float32)"
        if not t.is_contiguous():
            return "a non-contiguous tensor"
    return None


def same_values(old: tuple[Tensor, ...] | None, new: tuple[Tensor, ...]) -> bool:
    """Whether two tuples of host tensors hold equal shapes and values (``old`` None: no)."""
    if old is None or len(old) != len(new):
        return False
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(old, new))


def _kernel(name: str, index: int, variant: tuple[int, int, int]) -> cuda_launch.Kernel:
    unroll, streaming, min_blocks = variant
    defines = {"BLOCK": _BLOCK, "UNROLL": unroll, "STREAMING": streaming, "MIN_BLOCKS": min_blocks}
    return cuda_launch.compile_kernel("torchmb.optim", _SOURCE, name, defines, index, _ARGS[name])


def _resident_blocks(name: str, index: int, variant: tuple[int, int, int]) -> int:
    """Blocks of ``_BLOCK`` threads of kernel ``name`` resident at once on the whole device."""
    key = (name, index, variant)
    blocks = _RESIDENT.get(key)
    if blocks is None:
        kernel = _kernel(name, index, variant)
        try:
            with cupy.cuda.Device(index):
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, _BLOCK, 0)
            OCCUPANCY_FROM[key] = "occupancy API"
        except (AttributeError, TypeError, cupy.cuda.driver.CUDADriverError):  # pragma: no cover - older CuPy
            per_sm = variant[2]
            OCCUPANCY_FROM[key] = "launch bounds"
        blocks = _RESIDENT[key] = cuda_launch.sm_count(index) * max(1, int(per_sm))
    return blocks


def _launch(name: str, device: torch.device, grid: int, args: tuple) -> None:
    """Launch kernel ``name`` on torch's current stream of ``device`` (``grid`` blocks of ``_BLOCK``;
    ``torchmb_fill`` runs one block of ``_FILL_WIDTH`` threads), through :mod:`offload.cuda_launch`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    block = _FILL_WIDTH if name == "torchmb_fill" else _BLOCK
    cuda_launch.launch(_kernel(name, index, VARIANT[name]), grid, block, args)


def _grid(name: str, device: torch.device, items: int) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(items, _resident_blocks(name, index, VARIANT[name])))


class FusedStep:
    """The device side of one parameter group's fused step: per-model coefficients and pointer tables.

    The optimizer keeps one per parameter group. It decides when the coefficients change
    (:meth:`coefficients_match` compares the host values they were computed from) and uploads new ones
    with :meth:`set_coefficients`; :meth:`launch` then steps every tensor of the group in one launch.

    Args:
        kind: ``"sgd"`` or ``"adam"``.
    """

    def __init__(self, kind: str) -> None:
        if kind not in _KINDS:
            raise ValueError(f"FusedStep: kind must be one of {sorted(_KINDS)}, got {kind!r}")
        self.kind = kind
        self.kernel, self.pointers, self.rows = _KINDS[kind]
        self.coef: Tensor | None = None
        self.meta: dict[str, Any] = {}
        self._coef_key: tuple[Tensor, ...] | None = None
        self._tables: OrderedDict[tuple, tuple[Tensor, int]] = OrderedDict()
        # Tables and coefficients a CUDA graph captured: a replay reads them, so they live as long as this step.
        self._captured: dict[tuple, tuple[Tensor, Tensor]] = {}

    def coefficients_match(self, key: tuple[Tensor, ...]) -> bool:
        """Whether the device coefficients were computed from host values equal to ``key``."""
        return same_values(self._coef_key, key)

    def set_coefficients(self, host: Tensor, device: torch.device, key: tuple[Tensor, ...] | None = None) -> None:
        """Upload ``host`` (``(sets, rows, B)``, float64 on the CPU) as float32 to ``device``.

        ``key`` (host tensors the values were computed from) is kept as a copy for
        :meth:`coefficients_match`. An upload of the same shape overwrites the device buffer in place
        (stream-ordered after the launches that read it).
        """
        if host.dim() != 3 or host.shape[1] != self.rows:
            raise ValueError(
                f"FusedStep({self.kind!r}): coefficients must have shape (sets, {self.rows}, B), "
                f"got {tuple(host.shape)}"
            )
        values = torch.empty(host.shape, dtype=torch.float32, pin_memory=device.type == "cuda")
        values.copy_(host)
        if self.coef is not None and self.coef.shape == values.shape and self.coef.device == device:
            self.coef.copy_(values, non_blocking=True)
        else:
            self.coef = values.to(device, non_blocking=True)
        self._coef_key = None if key is None else tuple(k.clone() for k in key)

    def launch(self, tensors: list[tuple[Tensor, ...]], sets: list[int], flags: int) -> None:
        """Step every tensor of the group in one launch.

        Args:
            tensors: per parameter tensor, its ``pointers`` element tensors in the kernel's order
                (SGD: param, grad, momentum buffer; Adam: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq),
                each ``(B, ...)`` contiguous float32 on one CUDA device. Unused slots may repeat the param.
            sets: per parameter tensor, which coefficient set (first axis of the coefficients) it uses.
            flags: the kernel's flag bits.
        """
        if self.coef is None:
            raise RuntimeError("FusedStep.launch: set_coefficients first")
        first = tensors[0][0]
        batch = int(first.shape[0])
        if len(sets) != len(tensors) or any(not 0 <= s < self.coef.shape[0] for s in sets):
            raise IndexError(
                f"FusedStep.launch: one coefficient set per tensor in [0, {self.coef.shape[0]}) expected, got {sets}"
            )
        if self.coef.shape[2] != batch:
            raise ValueError(f"FusedStep.launch: coefficients hold {self.coef.shape[2]} models, the tensors {batch}")
        unroll = VARIANT[self.kernel][0]
        key = (
            batch,
            self.coef.data_ptr(),
            _BLOCK * unroll,
            tuple(sets),
            tuple(t.data_ptr() for group in tensors for t in group),
            tuple(group[0].numel() for group in tensors),
        )
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = self._build(tensors, sets, batch, _BLOCK * unroll)
            while len(self._tables) > _TABLES_KEPT:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        table, total = found
        if first.is_cuda and torch.cuda.is_current_stream_capturing():
            self._captured[key] = (table, self.coef)
        if total == 0:
            return
        device = first.device
        _launch(self.kernel, device, _grid(self.kernel, device, total), (table.data_ptr(), total, batch, flags))

    def _build(self, tensors: list[tuple[Tensor, ...]], sets: list[int], batch: int, chunk: int) -> tuple[Tensor, int]:
        assert self.coef is not None
        device = tensors[0][0].device
        set_bytes = self.rows * batch * self.coef.element_size()
        values: list[int] = []
        total = 0
        for group, s in zip(tensors, sets):
            if len(group) != self.pointers:
                raise ValueError(f"FusedStep({self.kind!r}): {self.pointers} tensors per parameter expected")
            p = group[0]
            row = p.numel() // batch if batch else 0
            for t in group:
                if t.shape != p.shape:
                    raise ValueError(
                        f"FusedStep({self.kind!r}): a state or gradient of shape {tuple(t.shape)} "
                        f"for a parameter of shape {tuple(p.shape)}"
                    )
            vec = int(row % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in group))
            units = row // 4 if vec else row
            chunks = -(-units // chunk)
            entry = [0] * _TABLE_STRIDE
            entry[: self.pointers] = [t.data_ptr() for t in group]
            entry[_E_COEF] = self.coef.data_ptr() + s * set_bytes
            entry[_E_ROW], entry[_E_CHUNKS], entry[_E_FIRST], entry[_E_VEC] = row, chunks, total, vec
            values.extend(entry)
            total += batch * chunks
        table = torch.empty(len(values), dtype=torch.int64, device=device)
        for start in range(0, len(values), _FILL_WIDTH):
            part = values[start : start + _FILL_WIDTH]
            args = (table.data_ptr() + 8 * start, len(part), *part, *([0] * (_FILL_WIDTH - len(part))))
            _launch("torchmb_fill", device, 1, args)
        return table, total
