"""A small Transformer encoder language model (plain torch) for the end-to-end tests and the tutorial."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class TransformerLM(nn.Module):
    """Token embedding + sinusoidal positions, a causal ``nn.TransformerEncoder`` and a linear decoder.

    Takes ``(n, seq)`` token ids (batch first at the model's boundary, whatever the encoder's layout) and an
    optional ``(n, seq)`` boolean key padding mask; returns ``(n, seq, vocab)`` logits.
    """

    def __init__(
        self,
        vocab: int = 23,
        d_model: int = 16,
        nhead: int = 2,
        num_layers: int = 2,
        dim_feedforward: int = 32,
        dropout: float = 0.0,
        batch_first: bool = True,
        norm_first: bool = False,
        max_len: int = 64,
    ) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.d_model = d_model
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, dropout, batch_first=batch_first, norm_first=norm_first
        )
        # nested tensors are an inference-only fast path that needs batch_first; keep it off (see the docs)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.decoder = nn.Linear(d_model, vocab)
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        seq = tokens.shape[1]
        x = self.embed(tokens) * math.sqrt(self.d_model) + self.pe[:seq]
        if not self.batch_first:
            x = x.transpose(0, 1)  # (seq, n, d): the model axis is merged into dim 1 here
        mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.encoder(x, mask=mask, is_causal=True, src_key_padding_mask=padding_mask)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return self.decoder(x)
