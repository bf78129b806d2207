"""Hugging Face transformers models as they are called: tiny models built from configs (no downloads), with
padding masks that differ between models, against B plain copies in float64 (outputs and parameter
gradients)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.torchvision_ops import import_torchvision
from torch import Tensor, nn

from torchmb import BatchModule, batch_loss

import_torchvision()  # transformers imports torchvision, whose operators need not load beside a CPU torch
transformers = pytest.importorskip("transformers")

B, N, SEQ, VOCAB = 2, 3, 8, 100
SMALL = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
DOUBLE = dict(atol=1e-9, rtol=1e-7)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        **SMALL, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return transformers.BertModel(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5Model(config)


def bart() -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    return transformers.BartModel(config)


def llama() -> nn.Module:
    """RoPE, RMSNorm and grouped-query attention (two query heads share one key-value head)."""
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=1, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def mixtral() -> nn.Module:
    """Eager experts: routing through ``nonzero``, whose output size depends on each model's data."""
    config = transformers.MixtralConfig(
        **SMALL, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        experts_implementation="eager",
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
        patch_size=4, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTModel(config)


def clip_text() -> nn.Module:
    config = transformers.CLIPTextConfig(
        **SMALL, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=1
    )
    return transformers.CLIPTextModel(config)


def padded(seq: int = SEQ) -> dict[str, Tensor]:
    """Token ids and a padding mask that differs between the models."""
    ids = torch.randint(2, VOCAB, (B, N, seq))
    mask = torch.ones(B, N, seq, dtype=torch.long)
    mask[0, 0, -3:] = 0
    mask[1, 1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def seq2seq(seq: int = SEQ) -> dict[str, Tensor]:
    return {**padded(seq), "decoder_input_ids": torch.randint(2, VOCAB, (B, N, 5))}


def images() -> dict[str, Tensor]:
    return {"pixel_values": torch.randn(B, N, 3, 8, 8, dtype=torch.float64)}


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, Tensor]]]] = {
    "bert": (bert, padded),
    "gpt2": (gpt2, padded),
    "t5": (t5, seq2seq),
    "bart": (bart, seq2seq),
    "llama": (llama, padded),
    "mixtral": (mixtral, padded),
    "vit": (vit, images),
    "clip-text": (clip_text, padded),
}


def main_output(output: object) -> Tensor:
    for name in ("logits", "last_hidden_state"):
        if name in output:
            return output[name]
    raise AssertionError(f"no logits or hidden states in {type(output).__name__}")


def assert_matches_plain_copies(make: Callable[[], nn.Module], inputs: dict[str, Tensor]) -> BatchModule:
    """Forward outputs and parameter gradients of the batched model equal those of B plain copies."""
    batched = BatchModule.from_factory(lambda: make().double(), B, seed=0)
    plains = [batched.unbatch(i) for i in range(B)]
    out = main_output(batched(**inputs))
    out.square().sum().backward()
    gradients = dict(batched.module.named_parameters())
    for i, plain in enumerate(plains):
        expected = main_output(plain(**{name: value[i] for name, value in inputs.items()}))
        torch.testing.assert_close(out[i], expected, **DOUBLE, msg=lambda m, i=i: f"model {i}'s output: {m}")
        expected.square().sum().backward()
        for name, param in plain.named_parameters():
            if param.grad is not None:
                what = f"model {i}'s {name}.grad"
                torch.testing.assert_close(
                    gradients[name].grad[i], param.grad, **DOUBLE, msg=lambda m, what=what: f"{what}: {m}"
                )
    return batched


@pytest.mark.parametrize("name", CASES)
def test_a_tiny_model_matches_its_plain_copies(name: str) -> None:
    make, inputs = CASES[name]
    torch.manual_seed(0)
    if name == "mixtral":  # its experts and router are unregistered: most parameters take torch.func
        with pytest.warns(UserWarning, match="batched through torch.func"):
            batched = assert_matches_plain_copies(make, inputs())
        assert "one model after the other" in repr(batched.module.model.layers[0].mlp)
    else:
        assert_matches_plain_copies(make, inputs())


def test_gpt2_conv1d_is_a_registered_transposed_linear_keeping_the_plain_state_dict() -> None:
    torch.manual_seed(0)
    batched = BatchModule.from_factory(gpt2, B, seed=0)
    paths = {entry.name: (entry.path, entry.reason) for entry in batched.conversion_report()}
    assert paths["transformer.h.0.attn.c_attn"] == ("registered", "registered: TransposedLinear")
    assert not any(entry.generic for entry in batched.conversion_report())
    plain = gpt2()
    state = batched.state_dict_of(1)
    assert {key: value.shape for key, value in state.items()} == {
        key: value.shape for key, value in plain.state_dict().items()
    }
    plain.load_state_dict(state)
    torch.manual_seed(1)
    assert torch.equal(state["transformer.h.0.attn.c_attn.weight"], gpt2().transformer.h[0].attn.c_attn.weight)


def test_conversion_report_names_each_hf_modules_path() -> None:
    torch.manual_seed(0)
    batched = BatchModule(t5(), B)
    attention = "encoder.block.0.layer.0.SelfAttention"
    assert {entry.name: entry.path for entry in batched.conversion_report()}[attention] == "passthrough"
    batched(**seq2seq())  # its helper method calls the bias table on constants: found as it runs
    paths = {entry.name: (entry.path, entry.reason) for entry in batched.conversion_report()}
    assert paths[attention][0] == "generic-own"
    assert "at the first forward, its code calls Embedding on constants alone (shapes (8, 8))" in paths[attention][1]
    assert paths[f"{attention}.relative_attention_bias"][0] == "registered"
    assert paths["encoder.block.1.layer.0.SelfAttention"][0] == "passthrough"
    assert attention in batched.generic_modules
    paths = {entry.name: entry.path for entry in BatchModule(bart(), B).conversion_report()}
    assert paths["encoder.embed_positions"] == "generic-whole"  # an Embedding subclass with its own forward
    assert paths["encoder.layers.0.self_attn.q_proj"] == "registered"


def test_t5_bias_is_each_models_when_the_sequence_is_a_multiple_of_the_merged_rows() -> None:
    """T5 builds its (L, L) bucket table in a helper method; with L = B * n it once passed for merged data."""
    torch.manual_seed(0)
    assert_matches_plain_copies(t5, seq2seq(seq=B * N))


def test_a_decision_that_differs_between_models_is_still_refused() -> None:
    from torchmb import PooledDecisionError

    class SkipsWhenUnpadded(nn.Module):
        """transformers' shortcut written as a plain model would: one branch if no token is padded."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: Tensor, mask: Tensor) -> Tensor:
            if mask.all():
                return self.fc(x)
            return self.fc(x) * mask.unsqueeze(-1)

    batched = BatchModule(SkipsWhenUnpadded(), B)
    x, mask = torch.randn(B, N, 5, 4), torch.ones(B, N, 5)
    assert batched(x, mask).shape == (B, N, 5, 4)  # no model pads: every model decides alike
    batched = BatchModule(SkipsWhenUnpadded(), B)
    mask[1, 0, -1] = 0  # model 1 pads, model 0 does not
    with pytest.raises(PooledDecisionError, match="Python control flow on it would decide once for all models"):
        batched(x, mask)


def test_a_loss_from_labels_is_refused_and_batch_loss_gives_each_models() -> None:
    """transformers' ``labels=`` loss averages over every row it is given: all models' at once. Each model's
    own loss comes from its logits."""
    torch.manual_seed(0)
    batched = BatchModule.from_factory(lambda: gpt2().double(), B, seed=0)
    inputs = padded()
    with pytest.raises(ValueError, match=r"one value for all models.*torchmb\.batch_loss"):
        batched(**inputs, labels=inputs["input_ids"])
    logits = batched(**inputs).logits
    shifted, targets = logits[:, :, :-1], inputs["input_ids"][:, :, 1:]
    losses = batch_loss(shifted.flatten(1, 2), targets.flatten(1, 2), loss_fn=nn.functional.cross_entropy)
    for i in range(B):
        plain = batched.unbatch(i)
        expected = plain(**{k: v[i] for k, v in inputs.items()}, labels=inputs["input_ids"][i]).loss
        torch.testing.assert_close(losses[i].to(expected.dtype), expected)  # transformers' loss is float32


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_a_shared_input_with_its_padding_mask_matches_plain_copies(name: str) -> None:
    """transformers builds the attention mask by indexing the shared ``(n, seq)`` padding mask with
    ``arange`` over the batch size it reads from the (merged, per-model) embeddings: the batched model indexes
    B merged copies of it, as each plain copy indexes its own. BERT hands its embedding token type ids
    expanded from a buffer to the shared input's n rows: shared like the input."""
    make = CASES[name][0]
    torch.manual_seed(0)
    batched = BatchModule.from_factory(lambda: make().double(), B, seed=0)
    inputs = {name: value[0] for name, value in padded().items()}  # (n, seq): one set that every model sees
    inputs["attention_mask"][1, :3] = 0  # left padding on another row, so rows differ in both directions
    for _ in range(2):  # the first forward, and a later one (every shared-input forward is tracked)
        batched.zero_grad()
        out = main_output(batched(**inputs, shared_input=True))
        out.square().sum().backward()
    gradients = dict(batched.module.named_parameters())
    for i in range(B):
        plain = batched.unbatch(i)
        expected = main_output(plain(**inputs))
        torch.testing.assert_close(out[i], expected, **DOUBLE)
        expected.square().sum().backward()
        for key, param in plain.named_parameters():
            if param.grad is not None:
                torch.testing.assert_close(gradients[key].grad[i], param.grad, **DOUBLE, msg=key)


def test_a_shared_tensor_indexed_past_the_merged_rows_is_refused_before_any_kernel() -> None:
    """An index beyond B*n rows is refused with the shapes, not handed to an indexing kernel (on CUDA a
    device-side assert)."""

    class IndexesTooFar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            rows = self.fc(x).shape[0]  # B*n merged rows
            return self.fc(x) + x[torch.arange(rows + 1) % (rows + 1)][: rows]

    batched = BatchModule(IndexesTooFar(), B)
    with pytest.raises(IndexError, match=rf"index {B * N} along dim 0 of a tensor computed from the shared input.*"
                                         rf"shape \({N}, 4\).*B \* n = {B * N}"):
        batched(torch.randn(N, 4), shared_input=True)
