"""Fused CUDA steps (CuPy RawKernels) for batched SGD and Adam/AdamW: one pass over each parameter.

The reference step (``_optimizers.py``) makes as many passes over the parameters as ``torch.optim``'s
multi-tensor step (SGD with momentum: 3 kernels, Adam: 8). These kernels read a parameter, its gradient
and its state once and write the parameter and state once, for every model at once: block row ``y`` is
model ``y``, which loads its own coefficients (``(B,)`` arrays) once. One launch per parameter tensor,
whatever B. The arithmetic is the reference's per element (Adam in torch's plain single-tensor form,
``p += -step_size * m / (sqrt(v) / sqrt(bc2) + eps)``), so the two paths agree to float rounding.

Used when CuPy imports, every tensor is a contiguous float32 CUDA tensor and B <= 65535; chosen by
``fused=None`` (the default) unless the ``batch_layers`` backend switch says ``"torch"``.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter

import torch
from torch import Tensor

from batch_layers._backend import get_backend

try:
    import cupy
except (ImportError, OSError) as error:  # pragma: no cover - depends on the machine
    cupy = None
    _CUPY_ERROR: BaseException | None = error
else:
    _CUPY_ERROR = None

__all__ = ["LAUNCHES", "adam_step", "fused_reason", "sgd_step"]

#: Fused kernel launches per kernel name since import (tests use it to prove the fused path ran).
LAUNCHES: Counter = Counter()

_SOURCE = r"""
typedef long long ll;

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

extern "C" __global__ void torchmb_sgd(float* __restrict__ P, const float* __restrict__ G, float* __restrict__ BUF,
                                       const float* __restrict__ NEG_LR, const float* __restrict__ WD,
                                       const float* __restrict__ MOM, const float* __restrict__ DAMP,
                                       const float* __restrict__ NEST, ll row, ll flags) {
    const ll model = blockIdx.y;
    const float neg_lr = NEG_LR[model];
    const float wd = (flags & 2) ? WD[model] : 0.0f;
    const float mom = (flags & 4) ? MOM[model] : 0.0f;
    const float damp = (flags & 4) ? DAMP[model] : 0.0f;
    const float nest = (flags & 8) ? NEST[model] : 0.0f;
    const ll base = model * row;
    const ll count = row / VEC;
    for (ll j = (ll)blockIdx.x * blockDim.x + threadIdx.x; j < count; j += (ll)gridDim.x * blockDim.x) {
        const ll i = base + j * VEC;
#if VEC == 4
        float4 p = *reinterpret_cast<const float4*>(P + i);
        const float4 g = *reinterpret_cast<const float4*>(G + i);
        float4 b = (flags & 4) ? *reinterpret_cast<const float4*>(BUF + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        sgd_elem(p.x, g.x, b.x, neg_lr, wd, mom, damp, nest, flags);
        sgd_elem(p.y, g.y, b.y, neg_lr, wd, mom, damp, nest, flags);
        sgd_elem(p.z, g.z, b.z, neg_lr, wd, mom, damp, nest, flags);
        sgd_elem(p.w, g.w, b.w, neg_lr, wd, mom, damp, nest, flags);
        *reinterpret_cast<float4*>(P + i) = p;
        if (flags & 4) *reinterpret_cast<float4*>(BUF + i) = b;
#else
        float p = P[i];
        float b = (flags & 4) ? BUF[i] : 0.0f;
        sgd_elem(p, G[i], b, neg_lr, wd, mom, damp, nest, flags);
        P[i] = p;
        if (flags & 4) BUF[i] = b;
#endif
    }
}

extern "C" __global__ void torchmb_adam(float* __restrict__ P, const float* __restrict__ G, float* __restrict__ M,
                                        float* __restrict__ V, float* __restrict__ VMAX,
                                        const float* __restrict__ OMB1, const float* __restrict__ B2,
                                        const float* __restrict__ OMB2, const float* __restrict__ NEG_STEP,
                                        const float* __restrict__ BC2S, const float* __restrict__ EPS,
                                        const float* __restrict__ WD, const float* __restrict__ DECAY,
                                        ll row, ll flags) {
    const ll model = blockIdx.y;
    const float omb1 = OMB1[model], b2 = B2[model], omb2 = OMB2[model];
    const float neg_step = NEG_STEP[model], bc2s = BC2S[model], eps = EPS[model];
    const float wd = (flags & 2) ? WD[model] : 0.0f;
    const float decay = (flags & 4) ? DECAY[model] : 1.0f;
    const ll base = model * row;
    const ll count = row / VEC;
    for (ll j = (ll)blockIdx.x * blockDim.x + threadIdx.x; j < count; j += (ll)gridDim.x * blockDim.x) {
        const ll i = base + j * VEC;
#if VEC == 4
        float4 p = *reinterpret_cast<const float4*>(P + i);
        const float4 g = *reinterpret_cast<const float4*>(G + i);
        float4 m = *reinterpret_cast<const float4*>(M + i);
        float4 v = *reinterpret_cast<const float4*>(V + i);
        float4 vm = (flags & 8) ? *reinterpret_cast<const float4*>(VMAX + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        adam_elem(p.x, g.x, m.x, v.x, vm.x, omb1, b2, omb2, neg_step, bc2s, eps, wd, decay, flags);
        adam_elem(p.y, g.y, m.y, v.y, vm.y, omb1, b2, omb2, neg_step, bc2s, eps, wd, decay, flags);
        adam_elem(p.z, g.z, m.z, v.z, vm.z, omb1, b2, omb2, neg_step, bc2s, eps, wd, decay, flags);
        adam_elem(p.w, g.w, m.w, v.w, vm.w, omb1, b2, omb2, neg_step, bc2s, eps, wd, decay, flags);
        *reinterpret_cast<float4*>(P + i) = p;
        *reinterpret_cast<float4*>(M + i) = m;
        *reinterpret_cast<float4*>(V + i) = v;
        if (flags & 8) *reinterpret_cast<float4*>(VMAX + i) = vm;
#else
        float p = P[i], m = M[i], v = V[i];
        float vm = (flags & 8) ? VMAX[i] : 0.0f;
        adam_elem(p, G[i], m, v, vm, omb1, b2, omb2, neg_step, bc2s, eps, wd, decay, flags);
        P[i] = p;
        M[i] = m;
        V[i] = v;
        if (flags & 8) VMAX[i] = vm;
#endif
    }
}
"""

_KERNELS: dict[tuple, object] = {}
_STREAMS: dict[tuple[int, int], object] = {}
_SMS: dict[int, int] = {}
_LOCK = threading.Lock()
_BLOCK = 256
_MAX_MODELS = 65535  # gridDim.y


def fused_reason(params: list[Tensor], tensors: list[Tensor]) -> str | None:
    """Why the fused kernels cannot run on these tensors (``None``: they can)."""
    if cupy is None:
        return f"CuPy could not be imported ({_CUPY_ERROR!r})"
    if get_backend() == "torch":
        return "the batch_layers backend is 'torch'"
    device = params[0].device
    if device.type != "cuda":
        return f"the parameters are on {device}, not a CUDA device"
    if params[0].shape[0] > _MAX_MODELS:
        return f"B = {params[0].shape[0]} exceeds {_MAX_MODELS} models"
    for t in tensors:
        if t.device != device:
            return f"tensors on several devices ({device} and {t.device})"
        if t.dtype != torch.float32:
            return f"a {t.dtype} tensor (the kernels take float32)"
        if not t.is_contiguous():
            return "a non-contiguous tensor"
    return None


def _kernel(name: str, vec: int, index: int):
    key = (name, vec, index)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                with cupy.cuda.Device(index):
                    kernel = cupy.RawKernel(f"#define VEC {vec}\n" + _SOURCE, name, options=("-std=c++17",))
                    kernel.compile()
                _KERNELS[key] = kernel
    return kernel


class _StreamProtocol:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _stream(device: torch.device):
    """A cached CuPy view of torch's current stream on ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ptr = torch.cuda.current_stream(index).cuda_stream
    stream = _STREAMS.get((index, ptr))
    if stream is None:
        if hasattr(cupy.cuda, "ExternalStream"):
            with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cupy.cuda.ExternalStream(ptr, index)
        else:  # pragma: no cover - a CuPy without ExternalStream
            stream = cupy.cuda.Stream.from_external(_StreamProtocol(ptr))
        _STREAMS[(index, ptr)] = stream
    return index, stream


def _launch(name: str, p: Tensor, pointers: list[int], row: int, flags: int) -> None:
    batch = p.shape[0]
    if row == 0:
        return
    vec = 4 if row % 4 == 0 and all(ptr % 16 == 0 for ptr in pointers[: _aligned_count(name)]) else 1
    index, stream = _stream(p.device)
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    per_row = -(-(row // vec) // _BLOCK)
    grid_x = max(1, min(per_row, max(1, sms * 16 // batch)))
    kernel = _kernel(name, vec, index)
    with cupy.cuda.Device(index), stream:
        kernel((grid_x, batch), (_BLOCK,), (*pointers, row, flags))
    LAUNCHES[name] += 1


def _aligned_count(name: str) -> int:
    """How many leading pointer arguments are per-element arrays (must be 16-byte aligned for float4)."""
    return 3 if name == "torchmb_sgd" else 5


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def sgd_step(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor] | None,
    coefs: dict[str, list[Tensor]],
    maximize: bool,
    weight_decay: bool,
    nesterov: bool,
) -> None:
    """One fused SGD step per parameter tensor (coefficients: ``(B, 1, ...)`` float32 device views)."""
    flags = (
        (1 if maximize else 0) | (2 if weight_decay else 0) | (4 if bufs is not None else 0) | (8 if nesterov else 0)
    )
    for i, (p, g) in enumerate(zip(params, grads)):
        buf = bufs[i] if bufs is not None else None
        pointers = [
            p.data_ptr(),
            g.data_ptr(),
            _ptr(buf) if buf is not None else p.data_ptr(),
            coefs["neg_lr"][i].data_ptr(),
            coefs["weight_decay"][i].data_ptr(),
            coefs["mom"][i].data_ptr() if bufs is not None else 0,
            coefs["damp"][i].data_ptr() if bufs is not None else 0,
            coefs["momentum"][i].data_ptr() if bufs is not None else 0,
        ]
        _launch("torchmb_sgd", p, pointers, p.numel() // p.shape[0], flags)


def adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor] | None,
    coefs: dict[str, list[Tensor]],
    maximize: bool,
    l2: bool,
    decoupled: bool,
) -> None:
    """One fused Adam/AdamW step per parameter tensor."""
    amsgrad = max_exp_avg_sqs is not None
    flags = (1 if maximize else 0) | (2 if l2 else 0) | (4 if decoupled else 0) | (8 if amsgrad else 0)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        vmax = max_exp_avg_sqs[i] if max_exp_avg_sqs is not None else v
        pointers = [
            p.data_ptr(),
            g.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            vmax.data_ptr(),
            coefs["one_minus_beta1"][i].data_ptr(),
            coefs["beta2"][i].data_ptr(),
            coefs["one_minus_beta2"][i].data_ptr(),
            coefs["neg_step_size"][i].data_ptr(),
            coefs["bc2_sqrt"][i].data_ptr(),
            coefs["eps"][i].data_ptr(),
            coefs["weight_decay"][i].data_ptr() if l2 else 0,
            coefs["decay"][i].data_ptr() if decoupled else 0,
        ]
        _launch("torchmb_adam", p, pointers, p.numel() // p.shape[0], flags)
