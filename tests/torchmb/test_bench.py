from __future__ import annotations

import json

import pytest
import torch

from torchmb import _bench
from torchmb.__main__ import main


def test_quick_cpu_bench_measures_every_implementation(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    main(["bench", "--device", "cpu", "--quick", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu"
    rows = report["rows"]
    seen = {(r["workload"], r["B"], r["impl"]) for r in rows}
    for workload in ("mlp", "lenet"):
        for batch in (1, 4):
            for impl in ("torchmb", "torchmb-models", "torchmb-shared", "vmap", "vmap-shared", "loop", "limit"):
                assert (workload, batch, impl) in seen
    for row in rows:
        assert "error" not in row, row
        assert row["model_steps_per_s"] > 0
        assert row["vs_vmap"] == pytest.approx(
            row["model_steps_per_s"]
            / next(r for r in rows if (r["workload"], r["B"], r["impl"]) == (row["workload"], row["B"], "vmap"))[
                "model_steps_per_s"
            ]
        )
    assert "| mlp | 4 | torchmb |" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(_bench.WORKLOADS))
def test_every_workload_converts_and_trains_like_plain_models(name: str) -> None:
    workload = _bench.WORKLOADS[name]
    torch.manual_seed(0)
    plain = [workload.make() for _ in range(2)]
    batched = _bench.BatchModule(workload.make(), 2)
    batched.load_state_dicts([m.state_dict() for m in plain])
    x = workload.make_input((2, 2), torch.device("cpu"))
    out = batched(x)
    for i, model in enumerate(plain):
        torch.testing.assert_close(out[i], model(x[i]), atol=2e-5, rtol=1e-4)


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
    stored = _bench._channels_last(x)
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
