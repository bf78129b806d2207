"""The LoRA bench workload (``python -m torchmb bench --workloads lora-llama``) runs, on a tiny decoder."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.torchvision_ops import import_torchvision

from torchmb.cli import bench as _bench
from torchmb.cli import bench_lora as _bench_lora
from torchmb.cli import bench_steps

import_torchvision()  # transformers imports torchvision, whose operators this machine's CPU torch may lack
pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_lora_rows_time_the_batched_adapters_the_limit_and_the_loop(monkeypatch) -> None:
    full = _bench_lora.LORA_LLAMA
    assert full.implementations == ("torchmb", "limit", "loop") and full.batches == (16,)
    tiny = dataclasses.replace(full, make=_bench_lora._decoder(lambda: _bench_lora.llama_config(32, 2, 64, 8)))
    monkeypatch.setitem(bench_steps.WORKLOADS, "lora-llama", tiny)
    cpu = torch.device("cpu")
    rows = _bench.run(["lora-llama"], [3], 2, cpu, None, iters=1, repeats=1, warmup=1, log=lambda _: None)
    assert [row["impl"] for row in rows] == ["torchmb", "limit", "loop"]
    assert all(row["model_steps_per_s"] > 0 and "error" not in row for row in rows)
    by_impl = {row["impl"]: row for row in rows}
    assert by_impl["torchmb"]["limit"] == "limit" and by_impl["loop"]["vs_limit"] > 0
    assert "| lora-llama | 3 | fp32 | torchmb |" in _bench.table(rows)


def test_the_lora_steps_train_every_adapter_and_leave_the_decoder_frozen() -> None:
    workload = dataclasses.replace(
        _bench_lora.LORA_LLAMA,
        make=_bench_lora._decoder(lambda: _bench_lora.llama_config(32, 2, 64, 8)),
    )
    steps = _bench_lora.LoraSteps(workload, 4, 2, torch.device("cpu"))
    assert steps.x.shape == (4, 2, 8) and steps.ranks == [4, 8, 16, 4]
    torch.manual_seed(0)
    step = steps.builders()["torchmb"]()
    model = step.model
    before = [s["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] for s in model.peft_state_dicts()]
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    step()
    after = [s["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] for s in model.peft_state_dicts()]
    assert [a.shape[0] for a in after] == [4, 8, 16, 4]
    assert all(not torch.equal(b, a) for b, a in zip(before, after))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())
