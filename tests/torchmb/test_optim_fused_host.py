"""The fused CUDA kernels' source, compiled for the host, against B torch.optim optimizers.

CI has no GPU, so the kernels' arithmetic, indexing (scalar and float4 paths) and flag handling are
checked here by compiling ``torchmb/optim/_fused.py``'s CUDA source as C++ with a small shim (blocks and
threads become loops) and launching it through the same Python plumbing the CuPy path uses. The CUDA
build itself is tested by the ``cuda`` tests in test_optim.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from torchmb.optim import _fused

from .test_optim import FUSED_CASES, assert_matches_references, run_on

_SHIM = r"""
#include <cmath>
#include <cstdint>
using std::isnan;
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct uint3_ { unsigned x, y, z; };
static uint3_ blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
"""

_RUNNER = r"""
extern "C" void run(int which, long long grid_x, long long grid_y, long long block, void** a, long long row,
                    long long flags) {
    gridDim = {(unsigned)grid_x, (unsigned)grid_y, 1};
    blockDim = {(unsigned)block, 1, 1};
    for (long long y = 0; y < grid_y; ++y)
        for (long long x = 0; x < grid_x; ++x)
            for (long long t = 0; t < block; ++t) {
                blockIdx = {(unsigned)x, (unsigned)y, 0};
                threadIdx = {(unsigned)t, 0, 0};
                if (which == 0)
                    torchmb_sgd((float*)a[0], (const float*)a[1], (float*)a[2], (const float*)a[3],
                                (const float*)a[4], (const float*)a[5], (const float*)a[6], (const float*)a[7],
                                row, flags);
                else
                    torchmb_adam((float*)a[0], (const float*)a[1], (float*)a[2], (float*)a[3], (float*)a[4],
                                 (const float*)a[5], (const float*)a[6], (const float*)a[7], (const float*)a[8],
                                 (const float*)a[9], (const float*)a[10], (const float*)a[11], (const float*)a[12],
                                 row, flags);
            }
}
"""


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    libs = {}
    for vec in (1, 4):
        folder = tmp_path_factory.mktemp(f"fused_vec{vec}")
        source = folder / "kernels.cpp"
        source.write_text(_SHIM + f"#define VEC {vec}\n" + _fused._SOURCE + _RUNNER)
        library = folder / "kernels.so"
        # no FMA contraction: each float operation rounds, as the CUDA build does without fused multiply-adds
        subprocess.run([compiler, "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", str(source),
                        "-o", str(library)], check=True, capture_output=True)
        lib = ctypes.CDLL(str(library))
        lib.run.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong,
                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_longlong, ctypes.c_longlong]
        libs[vec] = lib
    return libs


@pytest.fixture
def launch_on_host(host_kernels, monkeypatch):
    """Route the fused path's launches (same pointers, grid and flags) to the host build."""
    launched = []

    def launch(name, p, pointers, row, flags):
        vec = 4 if row % 4 == 0 and all(ptr % 16 == 0 for ptr in pointers[: _fused._aligned_count(name)]) else 1
        per_row = -(-(row // vec) // 8)
        args = (ctypes.c_void_p * len(pointers))(*pointers)
        host_kernels[vec].run(0 if name == "torchmb_sgd" else 1, max(1, min(per_row, 3)), p.shape[0], 8, args,
                              row, flags)
        launched.append((name, vec))

    monkeypatch.setattr(_fused, "_launch", launch)
    monkeypatch.setattr(_fused, "fused_reason", lambda params, tensors: None)
    return launched


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_kernel_source_matches_torch(case: str, launch_on_host) -> None:
    opt, params, refs = run_on(case, "cpu", fused=True, skip_at=4)
    assert opt.fused_steps == 10
    assert {vec for _, vec in launch_on_host} == {1, 4}, "both the scalar and the float4 paths must run"
    assert_matches_references(opt, params, refs)
