"""Batched recurrent cells: B models' RNNCell / LSTMCell / GRUCell, thin over ``batch_layers.functional``'s
cells (one batched product per projection, the gate nonlinearities on the merged rows)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from . import functional
from ._base import AbstractBatchModule, stack_copies
from .functional._recurrent_cells import GATES

__all__ = ["GRUCell", "LSTMCell", "RNNCell"]


class _CellBase(AbstractBatchModule):
    """``batch`` independent RNN / LSTM / GRU cells: one batched product per projection, gates on merged rows."""

    merged_order = "models"
    mode: ClassVar[str]

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        gates = GATES[self.mode] * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(batch, gates, input_size, **factory_kwargs))
        self.weight_hh = nn.Parameter(torch.empty(batch, gates, hidden_size, **factory_kwargs))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty(batch, gates, **factory_kwargs))
            self.bias_hh = nn.Parameter(torch.empty(batch, gates, **factory_kwargs))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every model's slices as torch's cells do, model after model."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for i in range(self.batch):
            for param in self.parameters():
                nn.init.uniform_(param[i], -stdv, stdv)

    @classmethod
    def _constructor_kwargs(cls, module: nn.Module) -> dict:
        return {}

    @classmethod
    def from_module(cls, module: nn.RNNCellBase, batch: int) -> _CellBase:
        layer = cls(
            module.input_size,
            module.hidden_size,
            module.bias,
            batch=batch,
            device=module.weight_ih.device,
            dtype=module.weight_ih.dtype,
            **cls._constructor_kwargs(module),
        )
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(stack_copies(module.get_parameter(name), batch))
        return layer

    def _check_rows(self, x: Tensor, size: int, what: str) -> bool:
        """Refuse a merged ``(B*N, size)`` tensor or unbatched models' ``(B*size,)`` that cannot be B models';
        whether it is the shared one."""
        if x.dim() == 1:
            if x.shape[0] == size and self.is_shared(x):  # one shared unbatched sample
                return True
            if x.shape[0] != self.batch * size:
                raise ValueError(
                    f"{type(self).__name__}: expected an unbatched {what} of shape ({self.batch} * {size},), got "
                    f"{tuple(x.shape)}"
                )
            return False
        if x.dim() != 2 or x.shape[1] != size:
            raise ValueError(f"{type(self).__name__}: expected {what} of shape (B*N, {size}), got {tuple(x.shape)}")
        if self.is_shared(x):
            return True
        if x.shape[0] % self.batch:
            raise ValueError(
                f"{type(self).__name__}: expected {what}'s dim 0 to be a multiple of B = {self.batch} (the merged "
                f"model axis), got shape {tuple(x.shape)}"
            )
        return False

    def _check(self, x: Tensor, states: tuple[Tensor, ...], what: tuple[str, ...]) -> tuple[bool, ...]:
        """Check the input and the given states; whether each is shared by all models."""
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__}: expected a floating-point input, got dtype {x.dtype}")
        shared = [self._check_rows(x, self.input_size, "input")]
        for state, name in zip(states, what):
            shared.append(self._check_rows(state, self.hidden_size, name))
            if name == "hidden state" and self._per_model(x, shared[0]) != self._per_model(state, shared[-1]):
                raise ValueError(
                    f"{type(self).__name__}: input {tuple(x.shape)} and hidden state {tuple(state.shape)} disagree on "
                    "the batch size"
                )
        return tuple(shared)

    def _per_model(self, x: Tensor, shared: bool) -> int:
        """Samples per model of a checked input or state (1 for unbatched models)."""
        if x.dim() == 1:
            return 1
        return x.shape[0] if shared else x.shape[0] // self.batch

    def _weights(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        return self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            text += ", bias=False"
        return f"{text}, batch={self.batch}"


_CELL_DOC = """

    Args:
        input_size, hidden_size, bias{extra}: as :class:`torch.nn.{name}`.
        batch: number of models B.

    Shape:
        - input: ``(B*N, input_size)`` or, for unbatched models, ``(B * input_size,)``.
        - {state}: like the output; zeros when omitted.
        - output: ``(B*N, hidden_size)`` (``(B * hidden_size,)`` unbatched).
"""


class RNNCell(_CellBase):
    """``batch`` independent :class:`torch.nn.RNNCell` cells."""

    base_class: ClassVar[type[nn.Module]] = nn.RNNCell

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        nonlinearity: str = "tanh",
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity: {nonlinearity}. Select from 'tanh' or 'relu'.")
        self.mode = "RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU"
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, bias, batch=batch, device=device, dtype=dtype)

    @classmethod
    def _constructor_kwargs(cls, module: nn.RNNCell) -> dict:
        return {"nonlinearity": module.nonlinearity}

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        shared = self._check(input, () if hx is None else (hx,), ("hidden state",))
        cell = functional.rnn_tanh_cell if self.nonlinearity == "tanh" else functional.rnn_relu_cell
        return cell(input, hx, *self._weights(), layout=self.layout, shared=shared)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.nonlinearity == "tanh" else text.replace(", batch=", ", nonlinearity='relu', batch=")


class LSTMCell(_CellBase):
    """``batch`` independent :class:`torch.nn.LSTMCell` cells."""

    base_class: ClassVar[type[nn.Module]] = nn.LSTMCell
    mode = "LSTM"

    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        if hx is not None and (not isinstance(hx, tuple) or len(hx) != 2):
            raise TypeError(f"{type(self).__name__}: expected hx as a tuple (h_0, c_0)")
        shared = self._check(input, () if hx is None else hx, ("hidden state", "cell state"))
        return functional.lstm_cell(input, hx, *self._weights(), layout=self.layout, shared=shared)


class GRUCell(_CellBase):
    """``batch`` independent :class:`torch.nn.GRUCell` cells."""

    base_class: ClassVar[type[nn.Module]] = nn.GRUCell
    mode = "GRU"

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        shared = self._check(input, () if hx is None else (hx,), ("hidden state",))
        return functional.gru_cell(input, hx, *self._weights(), layout=self.layout, shared=shared)


RNNCell.__doc__ += _CELL_DOC.format(extra=", nonlinearity", name="RNNCell", state="hx")
LSTMCell.__doc__ += _CELL_DOC.format(extra="", name="LSTMCell", state="hx = (h_0, c_0)")
GRUCell.__doc__ += _CELL_DOC.format(extra="", name="GRUCell", state="hx")
