"""End to end: a 2-layer Transformer encoder LM and a 2-layer LSTM LM over packed sequences, batched.

Each is trained side by side with B independently held plain models (``assert_equivalent``: outputs and
every gradient at each SGD step, final weights) and checked for isolation (``assert_isolated``: another
model's input, weights or a NaN loss leave the rest bit-identical).
"""

from __future__ import annotations

import pytest
import torch
from support.lstm_lm import LSTMLM
from support.transformer import TransformerLM
from torch import nn

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent, assert_isolated

B, N, SEQ = 3, 2, 7  # SEQ != B*N: a sequence-first tensor's model axis is then unambiguous


def lm_inputs(device: str = "cpu", vocab: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    tokens = torch.randint(0, vocab, (B, N, SEQ), device=device)
    padding = torch.zeros(B, N, SEQ, dtype=torch.bool, device=device)
    padding[:, 0, -3:] = True  # sample 0 of every model is shorter
    return tokens, padding


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer_lm_equivalent(batch_first: bool, train: bool) -> None:
    torch.manual_seed(0)
    assert assert_equivalent(lambda: TransformerLM(batch_first=batch_first), B, lm_inputs(), steps=3, train=train)


def test_transformer_lm_converts_every_layer_and_is_isolated() -> None:
    torch.manual_seed(0)
    model = BatchModule(TransformerLM(), B, init="independent", seed=0)
    assert model.generic_modules == []
    kinds = {type(m) for m in model.modules()}
    assert {batch_layers.MultiheadAttention, batch_layers.Linear, batch_layers.Embedding} <= kinds
    assert_isolated(model, lm_inputs())


def test_transformer_lm_dropout_trains_like_plain_in_eval_and_differs_per_model_in_train() -> None:
    torch.manual_seed(0)
    model = BatchModule(TransformerLM(dropout=0.3), B)  # "copy": every model starts from the same weights
    tokens = lm_inputs()[0][:1].expand(B, N, SEQ)  # and sees the same tokens
    model.train()
    out = model(tokens)
    assert all(not torch.equal(out[0], out[i]) for i in range(1, B)), "dropout masks were shared across models"
    model.eval()
    out = model(tokens)
    assert all(torch.equal(out[0], out[i]) for i in range(1, B))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_encoder_nested_tensor_inference_path() -> None:
    """nn.TransformerEncoder's nested-tensor path (eval, no grad, padding mask) must be turned off."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor=True, torch's default

        def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
            return self.encoder(x, src_key_padding_mask=padding)

    torch.manual_seed(0)
    plain = [Encoder().eval() for _ in range(B)]
    batched = BatchModule(Encoder(), B).eval()
    batched.load_state_dicts([m.state_dict() for m in plain])
    x = torch.randn(B, N, SEQ, 8)
    padding = lm_inputs()[1]
    assert batched.module.encoder.use_nested_tensor is False, "the converter turns torch's nested path off"
    with torch.no_grad():
        out = batched(x, padding)
        for i, model in enumerate(plain):
            # torch's nested path leaves padded positions at 0; compare the real ones
            want = model(x[i], padding[i])
            keep = ~padding[i]
            torch.testing.assert_close(out[i][keep], want[keep])


def lstm_inputs(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    tokens = torch.randint(0, 19, (B, N + 1, SEQ), device=device)
    lengths = torch.randint(1, SEQ + 1, (B, N + 1))
    lengths[0, 0] = SEQ
    return tokens, lengths


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["unidirectional", "bidirectional"])
def test_lstm_lm_packed_equivalent(bidirectional: bool, train: bool) -> None:
    torch.manual_seed(0)
    assert assert_equivalent(lambda: LSTMLM(bidirectional=bidirectional), B, lstm_inputs(), steps=3, train=train)


def test_lstm_lm_is_isolated() -> None:
    torch.manual_seed(0)
    model = BatchModule(LSTMLM(), B, init="independent", seed=0)
    assert model.generic_modules == []
    assert_isolated(model, lstm_inputs())


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["transformer", "lstm"])
def test_end_to_end_cuda(model: str) -> None:
    torch.manual_seed(0)
    if model == "transformer":
        inputs = lm_inputs("cuda")

        def make() -> nn.Module:
            return TransformerLM().cuda()
    else:
        tokens, lengths = lstm_inputs("cuda")
        inputs = (tokens, lengths)

        def make() -> nn.Module:
            return LSTMLM(bidirectional=True).cuda()

    assert assert_equivalent(make, B, inputs, steps=3, atol=2e-5)
    assert_isolated(BatchModule(make(), B, init="independent", seed=0), inputs)
