from __future__ import annotations

import json

import pytest
import torch
from support.torchvision_ops import import_torchvision

from torchmb import BatchModule
from torchmb.__main__ import main
from torchmb.cli import bench as _bench
from torchmb.cli import bench_steps as _bench_steps
from torchmb.cli.bench_zoo import ZOO_MODELS


def test_quick_cpu_bench_measures_every_implementation(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    impls = ("torchmb", "torchmb-models", "torchmb-shared", "vmap", "vmap-shared", "loop", "limit")
    flags = ["--device", "cpu", "--quick", "--workloads", "mlp", "--impls", ",".join((*impls, "torchmb+compile"))]
    main(["bench", *flags, "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu"
    rows = report["rows"]
    assert {(r["B"], r["impl"]) for r in rows} == {(b, i) for b in (1, 4) for i in impls}  # --quick compiles nothing
    by_key = {(r["B"], r["impl"]): r for r in rows}
    for row in rows:
        assert "error" not in row, row
        low, high = row["model_steps_per_s_range"]
        assert 0 < low <= row["model_steps_per_s"] <= high
        assert row["repeats"] == 2
        if row["impl"] != "vmap":
            vmap_row = by_key[(row["B"], "vmap")]
            assert row["vs_vmap"] == pytest.approx(row["model_steps_per_s"] / vmap_row["model_steps_per_s"])
        if row["impl"] != "limit":
            assert row["limit"] == "limit"
    assert "| mlp | 4 | fp32 | torchmb |" in capsys.readouterr().out


def _timed(impl: str, steps_per_s: float, low: float, high: float, batch: int = 8, **measured: float) -> dict:
    return {"workload": "mlp", "B": batch, "precision": "fp32", "impl": impl, "model_steps_per_s": steps_per_s,
            "model_steps_per_s_range": [low, high], **measured}


def test_ratios_compare_each_kind_with_its_own_limit_and_overlapping_ranges_tie() -> None:
    rows = [
        _timed("vmap", 100, 95, 105, peak_mib=1000, first_step_peak_mib=2000),
        _timed("vmap+compile", 160, 150, 170, peak_mib=800, first_step_peak_mib=1000),
        _timed("torchmb", 104, 100, 110, peak_mib=500, first_step_peak_mib=3000, launches_per_step=120),
        _timed("torchmb+compile", 200, 190, 210, peak_mib=400, first_step_peak_mib=500, launches_per_step=30),
        _timed("torchmb+graph", 300, 290, 310),
        _timed("limit", 150, 140, 160, launches_per_step=100),
        _timed("limit+compile", 250, 240, 260, launches_per_step=25),
        _timed("limit+graph", 400, 390, 410),
        _timed("limit", 10, 9, 11, batch=16),  # another B: no anchor of B=8's rows
    ]
    _bench.add_ratios(rows)
    by_impl = {r["impl"]: r for r in rows[:-1]}
    torchmb, compiled, graphed = by_impl["torchmb"], by_impl["torchmb+compile"], by_impl["torchmb+graph"]
    assert torchmb["vs_vmap"] == pytest.approx(1.04) and torchmb["vs_vmap_tie"]
    assert torchmb["vs_vmap_range"] == pytest.approx([100 / 105, 110 / 95])
    assert (torchmb["limit"], compiled["limit"], graphed["limit"]) == ("limit", "limit+compile", "limit+graph")
    assert compiled["vs_limit"] == pytest.approx(0.8) and not compiled["vs_limit_tie"]
    assert compiled["vs_vmap"] == pytest.approx(2.0) and compiled["vs_vmap_compile"] == pytest.approx(1.25)
    assert "vs_vmap_compile" not in torchmb and "vs_vmap_compile" not in by_impl["vmap+compile"]
    assert graphed["vs_limit"] == pytest.approx(0.75)
    assert "vs_vmap" not in by_impl["vmap"] and "vs_limit" not in by_impl["limit"]
    # memory against the vmap of the row's mode, launches against the limit of its mode
    assert (torchmb["peak_vs_vmap"], torchmb["first_step_peak_vs_vmap"]) == (0.5, 1.5)
    assert (compiled["peak_vs_vmap"], compiled["first_step_peak_vs_vmap"]) == (0.5, 0.5)
    assert torchmb["launches_vs_limit"] == pytest.approx(1.2) and compiled["launches_vs_limit"] == pytest.approx(1.2)
    assert "peak_vs_vmap" not in graphed and "launches_vs_limit" not in graphed
    assert "vs_vmap" not in rows[-1] and "limit" not in rows[-1]
    text = _bench.table(rows)
    assert "| mlp | 8 | fp32 | torchmb | 104 (100-110) | 1.04 (0.95-1.16) tie |  | 0.69 (0.62-0.79) | limit " \
           "| 500 (0.50) | 3,000 (1.50) |  | 120 (1.20) |" in text
    assert "| torchmb+compile | 200 (190-210) | 2.00 (1.81-2.21) | 1.25 (1.12-1.40) | 0.80 (0.73-0.88) " \
           "| limit+compile | 400 (0.50) | 500 (0.50) |" in text
    summary_line = "| mlp | 8 | fp32 | 1.04 tie | 0.69 | 1.25 | 0.80 | 1.20 / 1.20 | 0.50, 1.50 |"
    assert _bench.summary(rows).splitlines()[2] == summary_line


def test_a_batch_that_runs_out_of_memory_skips_larger_ones_and_the_budget_ends_the_run(monkeypatch) -> None:
    def measure(row, build, timer, batch, repeats, iters, warmup, compiled, launches):
        if batch >= 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        row.update(model_steps_per_s=1.0, model_steps_per_s_range=[1.0, 1.0])

    monkeypatch.setattr(_bench, "measure", measure)
    rows = _bench.run(["mlp"], [1, 2, 3], 2, torch.device("cpu"), ("torchmb",), log=lambda line: None)
    assert [(r.get("error"), r.get("skipped")) for r in rows] == [
        (None, None),
        ("out of memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB", None),
        (None, "B=2 ran out of memory"),
    ]
    assert rows[1]["out_of_memory"] and "| mlp | 2 | fp32 | torchmb | out of memory: " in _bench.table(rows)
    rows = _bench.run(["mlp"], [1], 2, torch.device("cpu"), ("torchmb", "limit"), log=lambda line: None, budget_s=0)
    assert [r["skipped"] for r in rows] == ["past the time budget of 0 s"] * 2


# Workloads that build their own steps (the LoRA ones: a 134M-parameter decoder) have tests of their own on
# a tiny config (tests/torchmb/test_bench_lora.py).
@pytest.mark.parametrize("name", sorted(name for name, w in _bench.WORKLOADS.items() if w.steps is None))
def test_every_workload_converts_and_computes_like_plain_models(name: str) -> None:
    if name in ZOO_MODELS:
        import_torchvision()  # the zoo's builders import torchvision (timm too)
    workload = _bench.WORKLOADS[name]
    torch.manual_seed(0)
    plain = [workload.make().eval() for _ in range(2)]  # eval: the zoo's models drop out in training
    batched = BatchModule(workload.make(), 2).eval()
    batched.load_state_dicts([m.state_dict() for m in plain])
    x = workload.make_input((2, 2), torch.device("cpu"))
    out = batched(x)
    for i, model in enumerate(plain):
        torch.testing.assert_close(out[i], model(x[i]), atol=2e-5, rtol=1e-4)


def test_zoo_rows_train_torchvision_and_timm_models_and_say_where_vmap_needs_one_draw() -> None:
    import_torchvision()
    names = ["tv-efficientnet_b0", "timm-vit_tiny"]
    impls = ("torchmb", "vmap", "limit")
    rows = _bench.run(names, [2], 2, torch.device("cpu"), impls, iters=1, repeats=1, warmup=1, log=lambda _: None)
    assert [(r["workload"], r["impl"]) for r in rows] == [(n, i) for n in names for i in impls]
    for row in rows:
        assert "error" not in row, row
        assert row["model_steps_per_s"] > 0
    notes = {(r["workload"], r["impl"]): r.get("note") for r in rows}
    # torchvision's stochastic depth: vmap's different randomness refuses it, torchmb draws per model
    assert "randomness='same'" in notes[("tv-efficientnet_b0", "vmap")]
    assert notes[("tv-efficientnet_b0", "torchmb")] is None and notes[("timm-vit_tiny", "vmap")] is None


def test_zoo_flag_selects_the_zoo_workloads_and_their_implementations(monkeypatch) -> None:
    seen = {}

    def run(workloads, batches, samples, device, impls, **kwargs):
        seen.update(workloads=workloads, impls=impls)
        return []

    monkeypatch.setattr(_bench, "run", run)
    monkeypatch.setattr(_bench, "warm_up_compiler", lambda device: 1.0)
    main(["bench", "--device", "cpu", "--zoo"])
    compiled_and_eager = ("torchmb", "torchmb+compile", "vmap", "vmap+compile", "limit", "limit+compile")
    assert seen == {"workloads": list(ZOO_MODELS), "impls": compiled_and_eager}
    main(["bench", "--device", "cpu", "--zoo", "--full", "--workloads", "timm-convnext_atto"])
    assert seen == {"workloads": ["timm-convnext_atto"], "impls": (*compiled_and_eager, "loop")}


def test_default_run_compiles_the_small_models_at_b64_only_after_a_compiler_warm_up_and_full_compiles_all(
    monkeypatch, capsys
) -> None:
    seen = {}

    def run(workloads, batches, samples, device, impls, **kwargs):
        seen.update(workloads=workloads, impls=impls, full=kwargs["full"], budget_s=kwargs["budget_s"])
        return []

    warm_ups = []
    monkeypatch.setattr(_bench, "run", run)
    monkeypatch.setattr(_bench, "warm_up_compiler", lambda device: warm_ups.append(device) or 1.0)
    main(["bench", "--device", "cpu"])
    workloads = ["mlp", "lenet", "transformer", "resnet18"]
    assert seen == {"workloads": workloads, "impls": None, "full": False, "budget_s": 150 - 1.0}
    assert warm_ups == [torch.device("cpu")] and "compiler warm-up" in capsys.readouterr().out
    small, large = _bench_steps.WORKLOADS["lenet"], _bench_steps.WORKLOADS["resnet18"]
    eager = ("torchmb", "vmap", "limit")
    assert _bench.default_implementations(small, 64) == _bench.DEFAULT_IMPLEMENTATIONS
    assert _bench.default_implementations(small, 16) == _bench.default_implementations(small, 256) == eager
    assert _bench.default_implementations(large, 16) == eager
    assert _bench.default_implementations(large, 16, full=True) == _bench.DEFAULT_IMPLEMENTATIONS
    main(["bench", "--device", "cpu", "--impls", "torchmb,vmap"])
    main(["bench", "--device", "cpu", "--batches", "16,256"])  # the default set compiles at B=64 only
    assert len(warm_ups) == 1, "a run that compiles nothing warms no compiler up"
    main(["bench", "--device", "cpu", "--full"])
    assert seen == {"workloads": workloads, "impls": None, "full": True, "budget_s": None}
    main(["bench", "--device", "cpu", "--full", "--budget", "100"])
    assert seen["budget_s"] == 100 - 1.0 and len(warm_ups) == 3


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # Inductor's imports
def test_compiler_warm_up_compiles_and_runs_a_function(monkeypatch) -> None:
    compiled = []
    real_compile = torch.compile

    def compile_and_note(fn, *args, **kwargs):
        compiled.append(fn)
        return real_compile(fn, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_and_note)
    assert _bench.warm_up_compiler(torch.device("cpu")) > 0
    assert len(compiled) == 1


def test_unknown_names_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown workload or implementation: vgg"):
        main(["bench", "--device", "cpu", "--quick", "--workloads", "vgg"])


def test_largest_batches_runs_both_searches_up_to_the_cap(capsys) -> None:
    rows = _bench.largest_batches(["lenet"], 2, torch.device("cpu"), upper=3)  # nothing runs out of memory on CPU
    assert [(r["impl"], r["largest_B"]) for r in rows] == [("torchmb", 3), ("vmap", 3)]
    with pytest.raises(SystemExit, match="--max-batch measures device memory"):
        main(["bench", "--device", "cpu", "--max-batch", "8"])


def test_bf16_channels_last_run_trains_every_implementation(tmp_path) -> None:
    out = tmp_path / "bench.json"
    flags = "--device cpu --quick --workloads lenet --impls torchmb,vmap,limit --precision bf16 --channels-last"
    main(["bench", *flags.split(), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["B"], r["impl"]) for r in rows} == {(b, i) for b in (1, 4) for i in ("torchmb", "vmap", "limit")}
    for row in rows:
        assert "error" not in row, row
        assert (row["precision"], row["channels_last"]) == ("bf16", True)
        assert row["model_steps_per_s"] > 0


def test_channels_last_inputs_keep_their_values_and_layout() -> None:
    x = torch.randn(2, 3, 4, 5, 6)
    stored = _bench_steps.channels_last_images(x)
    torch.testing.assert_close(stored, x, rtol=0, atol=0)
    assert stored[0].is_contiguous(memory_format=torch.channels_last)


def test_largest_batches_ends_vmap_search_at_a_refusing_kernel(monkeypatch) -> None:
    real_vmap = _bench.vmap

    def refusing_vmap(fn, **kwargs):
        def call(params, buffers, x):
            if x.shape[0] > 2:
                raise RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED")
            return real_vmap(fn, **kwargs)(params, buffers, x)

        return call

    monkeypatch.setattr(_bench, "vmap", refusing_vmap)
    rows = _bench.largest_batches(["mlp"], 2, torch.device("cpu"), upper=5)
    assert [(r["impl"], r["largest_B"]) for r in rows] == [("torchmb", 5), ("vmap", 2)]
    refusal = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"
    assert rows[1]["refused"] == [f"B=4: {refusal}", f"B=3: {refusal}"]


@pytest.mark.cuda
def test_transformer_vmap_ensemble_runs_on_cuda_with_math_attention() -> None:
    rows = _bench.run(["transformer"], [2], 4, torch.device("cuda"), ("torchmb", "vmap", "limit"), iters=1, warmup=0,
                      log=lambda line: None)
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"torchmb", "vmap", "limit"}
    for row in rows:
        assert "error" not in row, row
        assert row["model_steps_per_s"] > 0
    assert by_impl["vmap"]["attention"] == "math"
    assert "attention" not in by_impl["torchmb"]


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning")
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # torch's own, as dynamo
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # traces
def test_compiled_and_graphed_rows_run_on_cuda_against_their_own_limits() -> None:
    impls = ("torchmb", "torchmb+compile", "torchmb+graph", "vmap", "vmap+compile", "limit", "limit+compile",
             "limit+graph")
    rows = _bench.run(["lenet"], [2], 4, torch.device("cuda"), impls, repeats=2, warmup=1, log=lambda line: None)
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == set(impls)
    for row in rows:
        assert "error" not in row, row
        assert row["peak_mib"] > 0
    for impl in ("torchmb+compile", "vmap+compile", "limit+compile"):
        assert by_impl[impl]["compile_s"] > 0
    assert by_impl["torchmb+compile"]["limit"] == "limit+compile"
    assert by_impl["torchmb+graph"]["limit"] == "limit+graph"


def test_progress_bar_counts_every_timing(capsys) -> None:
    rows = _bench.run(["mlp"], [1, 2], 2, torch.device("cpu"), ("torchmb", "loop"), iters=1, repeats=1, warmup=1,
                      log=lambda _: None, progress=True)
    err = capsys.readouterr().err
    assert len(rows) == 4
    assert "bench: 100%" in err and "4/4" in err and "mlp B=2 loop" in err


def test_register_workload_refuses_a_name_taken(monkeypatch) -> None:
    monkeypatch.setattr(_bench_steps, "WORKLOADS", dict(_bench_steps.WORKLOADS))
    mlp = _bench_steps.WORKLOADS["mlp"]
    extra = _bench_steps.Workload("mlp-copy", mlp.make, mlp.make_input, (2,))
    assert _bench_steps.register_workload(extra) is extra and _bench_steps.WORKLOADS["mlp-copy"] is extra
    with pytest.raises(ValueError, match="a bench workload named 'mlp-copy' exists already"):
        _bench_steps.register_workload(extra)
