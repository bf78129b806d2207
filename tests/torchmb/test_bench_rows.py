"""How ``python -m torchmb bench`` measures a row and survives one that fails: the memory estimate that
skips a B too large, out-of-memory caught, compile errors and rows past their time limit reported in the
row, launches (ATen operators on the CPU) counted per step, TF32 set for the run, saved runs reported."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torchmb.__main__ import main
from torchmb.cli import bench as _bench
from torchmb.cli import bench_measure, bench_memory
from torchmb.cli.bench_steps import WORKLOADS

CPU = torch.device("cpu")
QUICK = {"iters": 1, "repeats": 1, "warmup": 1, "log": lambda line: None}


def test_one_model_footprint_counts_parameters_gradients_and_the_saved_activations() -> None:
    samples = 3
    footprint = bench_memory.one_model_footprint(WORKLOADS["mlp"], samples, CPU)
    parameters = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert footprint.state_bytes == 2 * 4 * parameters  # fp32 weights and their gradients
    # saved for backward: the two ReLU outputs (each also the next linear's input), log-softmax's output, the
    # int64 targets and nll_loss's scalar total weight; the input and the weights are left out
    assert footprint.activation_bytes == 2 * samples * 512 * 4 + samples * 10 * 4 + samples * 8 + 4
    assert footprint.sample_bytes == 28 * 28 * 4 + 8  # an fp32 image and an int64 class


def test_each_implementation_needs_its_own_share_of_weights_and_activations() -> None:
    footprint = bench_memory.Footprint(state_bytes=100, activation_bytes=10, sample_bytes=3)
    act = round(bench_memory.TRANSIENT * 10)
    assert bench_memory.estimated_need("torchmb", 8, footprint) == 8 * (100 + act)
    assert bench_memory.estimated_need("vmap+compile", 8, footprint) == 8 * (100 + act)
    assert bench_memory.estimated_need("limit+compile", 8, footprint) == 100 + 8 * act
    assert bench_memory.estimated_need("loop", 8, footprint) == 8 * 100 + act
    assert bench_memory.estimated_need("torchmb", 8, footprint, samples=5) == 8 * 5 * 3 + 8 * (100 + act)
    assert bench_memory.free_memory(CPU) is None


def _measured(row, build, timer, batch, repeats, iters, warmup, compiled, launches) -> None:
    build()  # the implementation is made; its step is not timed
    row.update(model_steps_per_s=1.0, model_steps_per_s_range=[1.0, 1.0])


def test_a_batch_the_free_memory_cannot_hold_is_skipped_with_a_note_before_it_runs(monkeypatch) -> None:
    footprint = bench_memory.one_model_footprint(WORKLOADS["mlp"], 2, CPU)
    free = bench_memory.estimated_need("torchmb", 4, footprint, 2) + 1  # B=4 fits, B=8 does not
    monkeypatch.setattr(_bench, "free_memory", lambda device: free)
    monkeypatch.setattr(_bench, "measure", _measured)
    rows = _bench.run(["mlp"], [4, 8], 2, CPU, ("torchmb", "limit"), **QUICK)
    by_key = {(r["B"], r["impl"]): r for r in rows}
    assert by_key[(4, "torchmb")]["model_steps_per_s"] > 0
    need = bench_memory.estimated_need("torchmb", 8, footprint, 2) / 2**30
    assert by_key[(8, "torchmb")]["skipped"] == (
        f"needs about {need:,.1f} GiB by the memory estimate, {free / 2**30:,.1f} GiB free"
    )
    assert by_key[(8, "limit")]["model_steps_per_s"] > 0, "one model on 8*n samples needs less"
    assert "| mlp | 8 | fp32 | torchmb | skipped: needs about" in _bench.table(rows)
    assert _bench.summary(rows).splitlines()[3].startswith("| mlp | 8 | fp32 | skipped | skipped |")
    rows = _bench.run(["mlp"], [8], 2, CPU, ("torchmb",), memory_check=False, **QUICK)
    assert rows[0]["model_steps_per_s"] > 0, "--no-memory-check runs it"


def test_inputs_too_large_to_make_fail_every_row_of_their_batch_and_the_run_goes_on(monkeypatch) -> None:
    real_steps = _bench.Steps

    def steps(workload, batch, *args):
        if batch > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_steps(workload, batch, *args)

    monkeypatch.setattr(_bench, "Steps", steps)
    monkeypatch.setattr(_bench, "measure", _measured)
    rows = _bench.run(["mlp"], [8, 2, 16], 2, CPU, ("torchmb", "limit"), **QUICK)
    failure = "making the inputs: OutOfMemoryError: CUDA out of memory. Tried to allocate 80.00 GiB"
    assert [(r["B"], r["impl"], r.get("error"), r.get("out_of_memory"), r.get("skipped")) for r in rows] == [
        (8, "torchmb", failure, True, None),
        (8, "limit", failure, True, None),
        (2, "torchmb", None, None, None),
        (2, "limit", None, None, None),
        (16, "torchmb", None, None, "B=8 ran out of memory"),
        (16, "limit", None, None, "B=8 ran out of memory"),
    ]


def test_out_of_memory_is_recognised_through_the_errors_that_wrap_it() -> None:
    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        except torch.cuda.OutOfMemoryError as error:
            raise RuntimeError("backend compiler failed") from error
    except RuntimeError as wrapped:
        assert bench_measure.is_out_of_memory(wrapped)
    assert bench_measure.is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not bench_measure.is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"))


def test_a_compile_that_fails_or_runs_past_the_row_time_limit_is_reported_and_the_run_goes_on(monkeypatch) -> None:
    limit_hit_fails = []

    def broken(fn):
        def call(*args):
            raise AttributeError("'_ForwardScope' object has no attribute 'token'\nmore lines")

        return call

    def slow(fn):
        def call(*args):
            limit_hit_fails.append(torch._dynamo.config.fail_on_recompile_limit_hit)
            time.sleep(30)

        return call

    fakes = iter((broken, slow))
    monkeypatch.setattr(torch, "compile", lambda fn: next(fakes)(fn))
    impls = ("torchmb+compile", "limit+compile", "torchmb")
    start = time.perf_counter()
    rows = _bench.run(["mlp"], [2], 2, CPU, impls, row_timeout_s=2, **QUICK)
    assert time.perf_counter() - start < 20
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["torchmb+compile"]["error"] == "AttributeError: '_ForwardScope' object has no attribute 'token'"
    assert by_impl["limit+compile"]["error"] == "past the row's time limit of 2 s (while compiling)"
    assert by_impl["torchmb"]["model_steps_per_s"] > 0 and "error" not in by_impl["torchmb"]
    assert limit_hit_fails == [True], "a compiled row refuses to fall back to eager at dynamo's recompile limit"
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False
    table = _bench.table(rows)
    assert "| torchmb+compile | AttributeError: '_ForwardScope' object has no attribute 'token' |" in table
    assert "| limit+compile | past the row's time limit of 2 s (while compiling) |" in table


def test_time_limit_interrupts_the_block_and_disarms_after() -> None:
    with pytest.raises(bench_measure.RowTimeout, match=r"past the row's time limit of 0\.2 s"):
        with bench_measure.time_limit(0.2):
            time.sleep(5)
    with bench_measure.time_limit(0.2):
        pass
    time.sleep(0.3)  # nothing fires after the block
    with bench_measure.time_limit(None):
        time.sleep(0.01)


def _event(name: str, device: bool = False, parent: object = None) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, cpu_parent=parent)


def test_launches_kernels_and_outermost_aten_operators_are_counted_from_profiler_events() -> None:
    linear = _event("aten::linear")
    backward = _event("autograd::engine::evaluate_function: AddmmBackward0")
    events = [
        linear, _event("aten::addmm", parent=linear), _event("cudaLaunchKernel", parent=linear),
        backward, _event("aten::mm", parent=backward), _event("cudaLaunchKernelExC"), _event("cuLaunchKernel"),
        _event("cudaGraphLaunch"), _event("cudaMemcpyAsync"),
        _event("ampere_sgemm_128x64_tn", device=True), _event("triton_poi_fused_relu_0", device=True),
        _event("Memcpy DtoD (Device -> Device)", device=True),
    ]
    assert bench_measure.count_events(events) == {"aten_ops": 2, "launches": 4, "kernels": 2}
    assert bench_measure.count_events(events[:2]) == {"aten_ops": 1}
    assert bench_measure.aten_op_names(events) == {"aten::linear": 1, "aten::mm": 1}


def test_the_limit_rows_launch_count_is_the_plain_models_step_profiled_alone() -> None:
    rows = _bench.run(["mlp"], [2], 4, CPU, ("torchmb", "limit"), launches=True, **QUICK)
    by_impl = {r["impl"]: r for r in rows}
    torch.manual_seed(0)
    plain = WORKLOADS["mlp"].make()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        optimizer.step()

    step()
    expected = bench_measure.profile_step(step, bench_measure.Timer(CPU))
    assert set(expected) == {"aten_ops"}, "no launches on the CPU"
    assert by_impl["limit"]["aten_ops_per_step"] == expected["aten_ops"]
    torchmb = by_impl["torchmb"]
    assert torchmb["aten_ops_vs_limit"] == torchmb["aten_ops_per_step"] / expected["aten_ops"]
    assert "launches_per_step" not in torchmb
    assert f"| {torchmb['aten_ops_per_step']:,} ({torchmb['aten_ops_vs_limit']:.2f}) ATen ops |" in _bench.table(rows)


def test_a_profiler_that_fails_leaves_the_rows_timings_and_says_why(monkeypatch) -> None:
    def failing(step, timer):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")

    monkeypatch.setattr(bench_measure, "profile_step", failing)
    rows = _bench.run(["mlp"], [2], 4, CPU, ("torchmb",), launches=True, **QUICK)
    assert rows[0]["model_steps_per_s"] > 0 and "error" not in rows[0]
    assert rows[0]["launches_error"] == "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"
    assert "| not counted: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED |" in _bench.table(rows)


def test_a_run_sets_tf32_as_asked_and_restores_it(monkeypatch) -> None:
    seen = []

    def measure(row, build, timer, batch, repeats, iters, warmup, compiled, launches):
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        row.update(model_steps_per_s=1.0, model_steps_per_s_range=[1.0, 1.0])

    monkeypatch.setattr(_bench, "measure", measure)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    rows = _bench.run(["mlp"], [1], 2, CPU, ("torchmb",), **QUICK)
    rows += _bench.run(["mlp"], [1], 2, CPU, ("torchmb",), allow_tf32=False, **QUICK)
    assert seen == [(True, True), (False, False)]
    assert [r["tf32"] for r in rows] == [True, False]
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_report_prints_the_table_and_summary_of_saved_runs(tmp_path, capsys) -> None:
    def timed(impl: str, speed: float, precision: str) -> dict:
        return {"workload": "timm-convnext_atto", "B": 16, "n": 128, "impl": impl, "precision": precision,
                "model_steps_per_s": speed, "model_steps_per_s_range": [speed, speed]}

    for precision in ("fp32", "bf16"):
        rows = [timed("torchmb", 200, precision), timed("vmap", 400, precision), timed("limit", 1000, precision)]
        _bench.add_ratios(rows)
        (tmp_path / f"{precision}.json").write_text(json.dumps({"environment": {}, "rows": rows}))
    main(["bench", "--report", str(tmp_path / "fp32.json"), str(tmp_path / "bf16.json")])
    out = capsys.readouterr().out
    assert "| timm-convnext_atto | 16 | fp32 | torchmb | 200 (200-200) | 0.50 (0.50-0.50) |" in out
    assert "| timm-convnext_atto | 16 | fp32 | 0.50 | 0.20 |" in out
    assert "| timm-convnext_atto | 16 | bf16 | 0.50 | 0.20 |" in out


@pytest.mark.cuda
def test_launches_are_counted_on_cuda_by_the_command_line(tmp_path) -> None:
    """In a process of its own, as users run it: inside the test session torch.profiler once recorded no CUDA
    activity for these rows (on an H200, cause not found), which the command line never did."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    saved = tmp_path / "rows.json"
    command = [sys.executable, "-m", "torchmb", "bench", "--device", "cuda", "--workloads", "lenet", "--batches", "2",
               "--samples", "4", "--impls", "torchmb,limit", "--launches", "--iters", "1", "--repeats", "1",
               "--no-progress", "--json", str(saved)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    rows = json.loads(saved.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["torchmb", "limit"]
    for row in rows:
        assert row["launches_per_step"] > 0 and row["kernels_per_step"] > 0 and row["aten_ops_per_step"] > 0
    assert rows[0]["launches_vs_limit"] > 0


@pytest.mark.cuda
def test_a_batch_too_large_is_skipped_or_caught_on_cuda() -> None:
    cuda = torch.device("cuda")
    # ResNet-18 at 100,000 models: the estimate skips it before its inputs or models are made
    rows = _bench.run(["resnet18"], [100_000], 128, cuda, ("torchmb",), **QUICK)
    assert rows[0]["skipped"].startswith("needs about")
    # run anyway, the wide MLP on 5M samples per model (inputs 47 GB, each activation 41 GB) runs out of
    # memory on an H100 or H200: caught, marked and freed
    allocated = torch.cuda.memory_allocated(cuda)
    rows = _bench.run(["wide-mlp"], [2], 5_000_000, cuda, ("torchmb",), memory_check=False, **QUICK)
    assert rows[0]["out_of_memory"] and rows[0]["error"].startswith("out of memory")
    assert torch.cuda.memory_allocated(cuda) <= allocated + 2**26  # at most cuBLAS's workspaces stay
    rows = _bench.run(["wide-mlp"], [2], 128, cuda, ("torchmb",), **QUICK)
    assert rows[0]["model_steps_per_s"] > 0


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # the compiler's own (TF32, recompiles)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, as dynamo traces
def test_compiled_zoo_rows_report_a_result_or_an_error_in_bf16_and_fp32() -> None:
    impls = ("torchmb", "torchmb+compile", "vmap", "vmap+compile", "limit", "limit+compile")
    for precision in ("bf16", "fp32"):
        rows = _bench.run(["timm-convnext_atto"], [2], 4, torch.device("cuda"), impls, precision=precision,
                          row_timeout_s=240, launches=True, **QUICK)
        assert [r["impl"] for r in rows] == list(impls)
        for row in rows:
            assert ("model_steps_per_s" in row) != ("error" in row), row
            if row["impl"].endswith("+compile") and "error" not in row:
                assert row["compile_s"] > 0 and row["graphs"] >= 1
