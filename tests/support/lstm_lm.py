"""A small LSTM language model over packed variable-length sequences (plain torch)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class LSTMLM(nn.Module):
    """Embedding, an ``nn.LSTM`` over packed sequences, and a linear decoder.

    Takes ``(n, T)`` token ids and ``(n,)`` lengths (clamped to ``1..T``, so any integers are valid);
    returns ``(n, T, vocab)`` logits (positions past a sequence's end see a zero hidden state).
    """

    def __init__(
        self,
        vocab: int = 19,
        embed: int = 8,
        hidden: int = 12,
        num_layers: int = 2,
        dropout: float = 0.0,
        bidirectional: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers, batch_first=True, dropout=dropout, bidirectional=bidirectional)
        self.decoder = nn.Linear(hidden * (2 if bidirectional else 1), vocab)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        steps = tokens.shape[1]
        packed = pack_padded_sequence(
            self.embed(tokens), lengths.clamp(1, steps).cpu(), batch_first=True, enforce_sorted=False
        )
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=steps)
        return self.decoder(out)
