"""B LoRA adapters on one frozen base against B plain peft models (``torchmb.adapters``).

The reference is B ``PeftModel`` instances built by peft from the same base model, each with the
``LoraConfig`` of its rank, alpha and dropout, each trained by its own ``torch.optim.AdamW``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.torchvision_ops import import_torchvision

import torchmb
import torchmb.optim as mo
from torchmb.adapters import BatchLora, LoraLinear, batch_lora

import_torchvision()  # transformers imports torchvision, whose operators this machine's CPU torch may lack
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

B = 16
RANKS = [1, 2, 3, 4, 5, 6, 7, 8] * 2
ALPHAS = [4.0, 8.0, 16.0, 2.0] * 4
LRS = [10.0 ** (-1 - (i % 5) / 2) for i in range(B)]
TARGETS = ["q_proj", "v_proj", "down_proj"]
VOCAB, SEQ, SAMPLES, STEPS = 48, 6, 2, 3


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def plain_adapters(base: torch.nn.Module, configs: list) -> list[torch.nn.Module]:
    """B peft models; each adapter random (lora_B too, so that the first step already sees them)."""
    models = []
    for i, config in enumerate(configs):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(copy.deepcopy(base), config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
        models.append(model)
    return models


def batch_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids, targets = torch.randint(0, VOCAB, (2, B, SAMPLES, SEQ), generator=g)
    return ids, targets


def lm_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One cross-entropy per model from ``(B, n, seq, V)`` logits."""
    return F.cross_entropy(logits.flatten(1, 2).transpose(1, 2), targets.flatten(1), reduction="none").mean(1)


def test_sixteen_adapters_of_different_ranks_and_learning_rates_match_sixteen_peft_models() -> None:
    base = tiny_llama()
    bm = batch_lora(base, B, ranks=RANKS, alphas=ALPHAS, target_modules=TARGETS, seed=0)
    models = plain_adapters(base, bm.lora_configs)
    bm.load_peft_state_dicts([peft.get_peft_model_state_dict(m) for m in models])
    bm.train()

    opt = mo.AdamW(bm.parameters(), lr=LRS, weight_decay=0.1)  # bm.parameters(): the shared base included
    plain_opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LRS[i], weight_decay=0.1)
        for i, m in enumerate(models)
    ]
    for step in range(STEPS):
        ids, targets = batch_data(step)
        losses = lm_losses(bm(input_ids=ids).logits, targets)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        for i, (model, plain_opt) in enumerate(zip(models, plain_opts)):
            loss = F.cross_entropy(model(input_ids=ids[i]).logits.reshape(-1, VOCAB), targets[i].reshape(-1))
            torch.testing.assert_close(losses[i], loss, rtol=1e-10, atol=1e-12)
            plain_opt.zero_grad()
            loss.backward()
            plain_opt.step()

    exported = bm.peft_state_dicts()
    for i, model in enumerate(models):
        expected = peft.get_peft_model_state_dict(model)
        assert exported[i].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(exported[i][key], value, rtol=1e-10, atol=1e-12, msg=f"model {i}: {key}")
    for _, layer in bm.named_modules():  # the padding beyond each model's rank stayed exactly zero
        if isinstance(layer, LoraLinear):
            for i, rank in enumerate(RANKS):
                assert not layer.lora_A["default"].weight[i, rank:].any()
                assert not layer.lora_B["default"].weight[i, :, rank:].any()


def test_adapters_leave_as_peft_models_and_peft_state_dicts() -> None:
    base = tiny_llama()
    ranks, alphas = [2, 5, 3], [4.0, 10.0, 1.0]
    bm = batch_lora(base, 3, ranks=ranks, alphas=alphas, target_modules=TARGETS, seed=1)
    with torch.no_grad():
        for name, p in bm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
        for _, layer in bm.named_modules():
            if isinstance(layer, LoraLinear):
                layer.set_models(ranks, [a / r for a, r in zip(alphas, ranks)], [0.0] * 3)  # re-zero the padding
    ids = batch_data(0)[0][:3]
    logits = bm(input_ids=ids).logits
    for i, state in enumerate(bm.peft_state_dicts()):
        assert state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (ranks[i], 32)
        assert bm.state_dict_of(i)["model.layers.1.mlp.down_proj.lora_B.default.weight"].shape == (32, ranks[i])
        config = peft.LoraConfig(r=ranks[i], lora_alpha=alphas[i], target_modules=TARGETS)
        plain = peft.get_peft_model(copy.deepcopy(base), config)
        result = peft.set_peft_model_state_dict(plain, state)
        assert not result.unexpected_keys
        torch.testing.assert_close(plain(input_ids=ids[i]).logits, logits[i], rtol=1e-10, atol=1e-12)
        unbatched = bm.unbatch(i)
        assert isinstance(unbatched, peft.PeftModel) and unbatched.peft_config["default"].r == ranks[i]
        torch.testing.assert_close(unbatched(input_ids=ids[i]).logits, logits[i], rtol=1e-10, atol=1e-12)


def test_peft_loads_a_saved_unbatched_adapter(tmp_path) -> None:
    base = tiny_llama()
    bm = batch_lora(base, 2, ranks=[3, 1], alphas=[6.0, 2.0], target_modules=["q_proj"], seed=2)
    with torch.no_grad():
        bm.module.model.layers[0].self_attn.q_proj.lora_B["default"].weight[:, :, :1].normal_()
    ids = batch_data(0)[0][:2]
    logits = bm(input_ids=ids).logits
    bm.unbatch(1).save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    assert loaded.peft_config["default"].r == 1 and loaded.peft_config["default"].lora_alpha == 2.0
    torch.testing.assert_close(loaded(input_ids=ids[1]).logits, logits[1], rtol=1e-10, atol=1e-12)


def test_the_base_model_is_stored_once_and_runs_as_plain_layers() -> None:
    base = tiny_llama()
    bm = batch_lora(base, 4, ranks=[1, 2, 4, 8], target_modules=TARGETS, seed=0)
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    adapter_bytes = sum(
        8 * (layer.in_features + layer.out_features) * 8  # rank 8, float64
        for name, layer in base.named_modules()
        if name.rsplit(".", 1)[-1] in TARGETS
    )
    stored = sum(p.numel() * p.element_size() for p in bm.parameters())
    assert stored == base_bytes + 4 * adapter_bytes
    assert len(bm.state_dict()) == len(list(bm.parameters())) + 0  # no persistent buffer beside them
    q_proj = bm.module.model.layers[0].self_attn.q_proj
    assert type(q_proj) is LoraLinear and type(q_proj.base_layer) is torch.nn.Linear
    assert type(bm.module.model.layers[0].mlp.up_proj) is torch.nn.Linear  # not targeted: plain, shared
    assert {e.path for e in bm.conversion_report()} <= {"shared", "passthrough", "registered"}
    assert "ranks=[1, 2, 4, 8]" in repr(q_proj) and "shared by all models" in repr(bm)


def test_per_model_dropout() -> None:
    base = tiny_llama()
    dropouts = [0.0, 0.5, 0.0, 0.9]
    bm = batch_lora(base, 4, ranks=4, alphas=8.0, dropouts=dropouts, target_modules=["v_proj"], seed=3)
    assert [c.lora_dropout for c in bm.lora_configs] == dropouts
    with torch.no_grad():
        for name, p in bm.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(0))
    ids = batch_data(0)[0][:4]
    bm.eval()
    evaluated = bm(input_ids=ids).logits
    bm.train()
    first, second = bm(input_ids=ids).logits, bm(input_ids=ids).logits
    for i, p in enumerate(dropouts):
        if p == 0:  # no dropout: exactly the evaluation output, every time
            assert torch.equal(first[i], evaluated[i]) and torch.equal(second[i], evaluated[i])
        else:  # independent masks per forward
            assert not torch.allclose(first[i], second[i])
            assert not torch.allclose(first[i], evaluated[i])


def test_select_keeps_each_survivors_rank_and_scaling() -> None:
    base = tiny_llama()
    bm = batch_lora(base, 4, ranks=[1, 2, 3, 4], alphas=[1.0, 2.0, 3.0, 40.0], target_modules=TARGETS, seed=4)
    with torch.no_grad():
        for name, p in bm.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(1))
        for _, layer in bm.named_modules():
            if isinstance(layer, LoraLinear):
                layer.set_models([1, 2, 3, 4], [1.0, 1.0, 1.0, 10.0], [0.0] * 4)
    ids = batch_data(0)[0][:4]
    before = bm(input_ids=ids).logits
    states = bm.state_dicts()
    bm.select([3, 0])
    assert bm.ranks == [4, 1] and [c.r for c in bm.lora_configs] == [4, 1]
    torch.testing.assert_close(bm(input_ids=ids[[3, 0]]).logits, before[[3, 0]], rtol=1e-12, atol=1e-12)
    assert all(torch.equal(bm.state_dict_of(0)[k], states[3][k]) for k in states[3])


def test_gpt2_conv1d_base_layers_and_rslora() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config).double().eval()
    bm = batch_lora(
        base, 2, ranks=[2, 4], alphas=[3.0, 5.0], target_modules=["c_attn"], fan_in_fan_out=True, use_rslora=True
    )
    with torch.no_grad():
        for name, p in bm.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(2))
                p[0, :, 2:] = 0
    ids = batch_data(0)[0][:2]
    logits = bm.eval()(input_ids=ids).logits  # GPT-2's dropouts off, as in the plain models
    for i in range(2):
        torch.testing.assert_close(bm.unbatch(i)(input_ids=ids[i]).logits, logits[i], rtol=1e-10, atol=1e-12)
    assert bm.lora_configs[1].use_rslora


def test_refusals() -> None:
    base = tiny_llama()
    with pytest.raises(TypeError, match="expects the base model, not a PeftModel"):
        batch_lora(peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=TARGETS)), 2, ranks=2)
    with pytest.raises(ValueError, match=r"ranks: expected a number or 2 numbers"):
        batch_lora(base, 2, ranks=[1, 2, 3], target_modules=TARGETS)
    with pytest.raises(ValueError, match="ranks: expected positive ints"):
        batch_lora(base, 2, ranks=[0, 2], target_modules=TARGETS)
    with pytest.raises(ValueError, match="init_lora_weights=True or 'gaussian'"):
        batch_lora(base, 2, ranks=2, target_modules=TARGETS, init_lora_weights="pissa")
    with pytest.raises(ValueError, match="bias='none'"):
        batch_lora(base, 2, ranks=2, target_modules=TARGETS, bias="all")
    with pytest.raises(ValueError, match=r"adapts nn.Linear layers.*matched 1 layers of which 0"):
        batch_lora(base, 2, ranks=2, target_modules=["embed_tokens"])
    bm = batch_lora(base, 2, ranks=[1, 3], target_modules=["q_proj"], seed=0)
    states = bm.state_dicts()
    states[0], states[1] = states[1], states[0]  # rank 3 into the slot of rank 1
    with pytest.raises(ValueError, match=r"model 0 has rank 1, so expected 1 in dim 0, got shape \(3, 32\)"):
        bm.load_state_dicts(states)
    exported = bm.peft_state_dicts()
    del exported[1]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    with pytest.raises(KeyError, match="adapter state dict 1: missing keys"):
        bm.load_peft_state_dicts(exported)
    with pytest.raises(ValueError, match="ranks: expected 2 ranks in"):
        bm.module.model.layers[0].self_attn.q_proj.set_models([1, 4], [1.0, 1.0], [0.0, 0.0])


def test_a_peft_model_batched_as_it_is_keeps_its_adapter() -> None:
    """Without batch_lora, BatchModule batches a PeftModel's LoRA layers with that adapter's settings."""
    base = tiny_llama()
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj"]))
    with torch.no_grad():
        model.base_model.model.model.layers[1].self_attn.q_proj.lora_B["default"].weight.normal_()
    bm = torchmb.BatchModule(model.get_base_model(), 2)
    assert not isinstance(bm, BatchLora)
    ids = batch_data(0)[0][:2]
    expected = torch.stack([model(input_ids=ids[i]).logits for i in range(2)])
    torch.testing.assert_close(bm(input_ids=ids).logits, expected, rtol=1e-10, atol=1e-12)


def test_adapters_of_a_plain_torch_model_on_a_shared_input() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    bm = batch_lora(mlp, 3, ranks=[1, 4, 2], dropouts=[0.0, 0.3, 0.0], target_modules=["0", "2"])
    with torch.no_grad():
        for name, p in bm.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(3))
        for _, layer in bm.named_modules():
            if isinstance(layer, LoraLinear):
                layer.set_models([1, 4, 2], [8 / 1, 8 / 4, 8 / 2], [0.0, 0.3, 0.0])  # re-zero the padding
    x = torch.randn(5, 6, dtype=torch.float64)
    bm.eval()
    out = bm(x, shared_input=True)
    torch.testing.assert_close(out, bm(x.expand(3, 5, 6)), rtol=1e-12, atol=1e-12)
    for i in range(3):
        torch.testing.assert_close(out[i], bm.unbatch(i).eval()(x), rtol=1e-10, atol=1e-12)
    bm.train()  # per-model dropout on the shared input: model 1 draws its own mask, the others none
    trained = bm(x, shared_input=True)
    for i in (0, 2):  # (the expanded input takes the per-model product, the shared one a single GEMM)
        torch.testing.assert_close(trained[i], out[i], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(trained[1], out[1])
