"""The fused CUDA kernels' source, compiled for the host, against B torch.optim optimizers.

CI has no GPU, so the kernels' arithmetic, work-item walk (tensors, models, chunks; full and partial
chunks; float4 and scalar rows), table building and flag handling are checked here by compiling
``torchmb/optim/_fused.py``'s CUDA source as C++ with a small shim (blocks and threads become loops) and
launching it through the same Python plumbing the CuPy path uses (coefficient cache, pointer tables,
fill kernel). The CUDA build itself is tested by the ``cuda`` tests in test_optim.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

import torchmb.lr_scheduler as mls
import torchmb.optim as mo
from torchmb.optim import _fused

from .test_optim import CASES, FUSED_CASES, assert_matches_references, references, run_on, set_grads

_SHIM = r"""
#include <cmath>
#include <cstdint>
using std::isnan;
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
struct uint3_ { unsigned x, y, z; };
static uint3_ blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(a, b)
"""

_RUNNER = r"""
extern "C" void run(int which, long long grid, long long block, const long long* a) {
    gridDim = {(unsigned)grid, 1, 1};
    blockDim = {(unsigned)block, 1, 1};
    for (long long x = 0; x < grid; ++x)
        for (long long t = 0; t < block; ++t) {
            blockIdx = {(unsigned)x, 0, 0};
            threadIdx = {(unsigned)t, 0, 0};
            if (which == 0)
                torchmb_sgd((const ll*)a[0], a[1], a[2], a[3]);
            else if (which == 1)
                torchmb_adam((const ll*)a[0], a[1], a[2], a[3]);
            else
                torchmb_fill((ll*)a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                             a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24],
                             a[25]);
        }
}
"""

_HOST_BLOCK = 8  # threads per block in the host build (a chunk is _HOST_BLOCK * UNROLL float4s or floats)
_WHICH = {"torchmb_sgd": 0, "torchmb_adam": 1, "torchmb_fill": 2}


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    libs = {}
    for unroll in (1, 4):
        folder = tmp_path_factory.mktemp(f"fused_unroll{unroll}")
        source = folder / "kernels.cpp"
        header = f"#define BLOCK {_HOST_BLOCK}\n#define UNROLL {unroll}\n#define STREAMING 1\n#define MIN_BLOCKS 1\n"
        source.write_text(_SHIM + header + _fused._SOURCE + _RUNNER)
        library = folder / "kernels.so"
        # no FMA contraction: each float operation rounds, as the CUDA build does without fused multiply-adds
        subprocess.run([compiler, "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", str(source),
                        "-o", str(library)], check=True, capture_output=True)
        lib = ctypes.CDLL(str(library))
        lib.run.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.POINTER(ctypes.c_longlong)]
        libs[unroll] = lib
    return libs


@pytest.fixture(params=[1, 4], ids=["unroll1", "unroll4"])
def launch_on_host(request, host_kernels, monkeypatch):
    """Route the fused path's launches (same tables, work items and flags) to the host build."""
    unroll = request.param
    launched = []

    def launch(name, device, grid, args):
        assert device.type == "cpu"
        values = (ctypes.c_longlong * len(args))(*args)
        block = _fused._FILL_WIDTH if name == "torchmb_fill" else _HOST_BLOCK
        host_kernels[unroll].run(_WHICH[name], grid, block, values)
        launched.append(name)

    monkeypatch.setattr(_fused, "_launch", launch)
    monkeypatch.setattr(_fused, "_grid", lambda name, device, items: max(1, min(items, 3)))
    monkeypatch.setattr(_fused, "_BLOCK", _HOST_BLOCK)
    for name in ("torchmb_sgd", "torchmb_adam"):
        monkeypatch.setitem(_fused.VARIANT, name, (unroll, 1, 1))
    monkeypatch.setattr(_fused, "fused_reason", lambda params, tensors: None)
    return launched


def _tables(opt) -> list[torch.Tensor]:
    return [table.view(-1, _fused._TABLE_STRIDE) for _, plan in opt._fused_plans.values()
            for table, _ in plan._tables.values()]


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_kernel_source_matches_torch(case: str, launch_on_host) -> None:
    opt, params, refs = run_on(case, "cpu", fused=True, skip_at=4)
    assert opt.fused_steps == 10
    kernel = "torchmb_sgd" if CASES[case][0] is mo.SGD else "torchmb_adam"
    assert launch_on_host.count(kernel) == 10, "one launch per step for the whole group"
    vec = {int(v) for table in _tables(opt) for v in table[:, _fused._E_VEC]}
    assert vec == {0, 1}, "both the scalar and the float4 rows must run"
    assert_matches_references(opt, params, refs)


@pytest.mark.parametrize("case", ["sgd_momentum", "adamw_amsgrad"])
def test_fused_work_items_cover_full_and_partial_chunks(case: str, launch_on_host) -> None:
    """Rows of several chunks (full ones take the unrolled path), a partial last chunk, scalar rows that
    span chunks, and more work items than blocks: every element is stepped exactly once."""
    cls, tcls, per_model, shared = CASES[case]
    g = torch.Generator().manual_seed(3)
    shapes = [(40, 9), (7, 13), (64,), (3,)]  # rows 360 (float4: 90), 91 (scalar), 64 (float4), 3 (scalar)
    params = [torch.randn(4, *s, generator=g).requires_grad_() for s in shapes]
    refs = references(params, tcls, per_model, shared)
    opt = cls(params, **per_model, **shared, fused=True)
    for _ in range(4):
        grads = [torch.randn(4, *s, generator=g) for s in shapes]
        set_grads(params, grads)
        opt.step()
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [x[i] for x in grads])
            ref.step()
    table = _tables(opt)[-1]
    chunk = _HOST_BLOCK * _fused.VARIANT["torchmb_sgd" if cls is mo.SGD else "torchmb_adam"][0]
    assert table[:, _fused._E_CHUNKS].tolist() == [-(-90 // chunk), -(-91 // chunk), -(-16 // chunk), 1]
    assert_matches_references(opt, params, refs)


def test_fused_sgd_uploads_coefficients_only_when_a_hyperparameter_changes(launch_on_host, monkeypatch) -> None:
    """A scheduler changes lr between steps, set_hyperparameter and an in-place edit change momentum and lr:
    every change reaches the kernel, and unchanged steps upload nothing."""
    cls, tcls, per_model, shared = CASES["sgd_momentum"]
    uploads = []
    original = _fused.FusedStep.set_coefficients

    def counting(self, host, device, key=None):
        uploads.append(host.clone())
        return original(self, host, device, key)

    monkeypatch.setattr(_fused.FusedStep, "set_coefficients", counting)
    g = torch.Generator().manual_seed(5)
    shapes = [(6, 8), (5,)]
    params = [torch.randn(4, *s, generator=g).requires_grad_() for s in shapes]
    refs = references(params, tcls, per_model, shared)
    opt = cls(params, **per_model, **shared, fused=True)
    sched = mls.StepLR(opt, step_size=3, gamma=[0.5, 0.1, 0.9, 1.0])
    ref_scheds = [torch.optim.lr_scheduler.StepLR(ref, step_size=3, gamma=gm) for (_, ref), gm in
                  zip(refs, [0.5, 0.1, 0.9, 1.0])]
    changed = []
    for t in range(9):
        if t == 5:  # one model's momentum, through the API
            opt.set_hyperparameter("momentum", [0.9, 0.0, 0.7, 0.8])
            refs[2][1].param_groups[0]["momentum"] = 0.7
        if t == 7:  # an in-place edit of the stored (B,) tensor
            opt.param_groups[0]["lr"][0] = 0.25
            refs[0][1].param_groups[0]["lr"] = 0.25
        before = len(uploads)
        grads = [torch.randn(4, *s, generator=g) for s in shapes]
        set_grads(params, grads)
        opt.step()
        changed.append(len(uploads) - before)
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [x[i] for x in grads])
            ref.step()
        sched.step()
        for s in ref_scheds:
            s.step()
    # step 0: first upload; step 1: momentum buffers now exist for every model with momentum (the first
    # step's buf = grad needs other coefficients); lr changes before steps 3 and 6; momentum at 5, lr at 7
    assert changed == [1, 1, 0, 1, 0, 1, 1, 1, 0]
    assert_matches_references(opt, params, refs)


def test_fused_tables_are_rebuilt_only_when_tensor_addresses_change(launch_on_host) -> None:
    cls, _, per_model, shared = CASES["adam"]
    g = torch.Generator().manual_seed(7)
    params = [torch.randn(4, 6, 4, generator=g).requires_grad_(), torch.randn(4, 3, generator=g).requires_grad_()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = cls(params, **per_model, **shared, fused=True)
    opt.step()
    fills = launch_on_host.count("torchmb_fill")
    assert fills > 0
    for _ in range(3):  # same tensors, new values: the cached table serves
        for p in params:
            p.grad.copy_(torch.randn(p.shape, generator=g))
        opt.step()
    assert launch_on_host.count("torchmb_fill") == fills
    old = [p.grad for p in params]
    for p in params:  # new gradient tensors (new addresses): a new table
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    assert launch_on_host.count("torchmb_fill") > fills
    table = _tables(opt)[-1]
    assert table[:, 1].tolist() == [p.grad.data_ptr() for p in params]
    fills = launch_on_host.count("torchmb_fill")
    for p, grad in zip(params, old):  # the first addresses again: that table is still cached
        p.grad = grad
    opt.step()
    assert launch_on_host.count("torchmb_fill") == fills
    assert opt.fused_steps == 6


def test_fused_step_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        _fused.FusedStep("rmsprop")
    plan = _fused.FusedStep("sgd")
    p = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="set_coefficients first"):
        plan.launch([(p, p, p)], [0], 0)
    with pytest.raises(ValueError, match=r"shape \(sets, 5, B\)"):
        plan.set_coefficients(torch.zeros(1, 4, 3, dtype=torch.float64), p.device)
    plan.set_coefficients(torch.zeros(1, 5, 3, dtype=torch.float64), p.device)
    with pytest.raises(IndexError, match=r"one coefficient set per tensor in \[0, 1\)"):
        plan.launch([(p, p, p)], [1], 0)
    with pytest.raises(ValueError, match="coefficients hold 3 models, the tensors 2"):
        plan.launch([(torch.zeros(2, 4),) * 3], [0], 0)
    with pytest.raises(ValueError, match=r"a state or gradient of shape \(3, 5\) for a parameter of shape \(3, 4\)"):
        plan.launch([(p, torch.zeros(3, 5), p)], [0], 0)
