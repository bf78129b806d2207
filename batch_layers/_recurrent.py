"""Batched recurrent layers: B models' RNN / LSTM / GRU stepped together (their cells are in
:mod:`batch_layers._recurrent_cells`).

The modules hold torch's parameters with a leading model axis and check their inputs; the recurrence (one
batched product per time step for all models, packed sequences, bidirectional layers in one loop) is
``batch_layers.functional``'s ``rnn_tanh`` / ``rnn_relu`` / ``lstm`` / ``gru``, to which ``forward`` hands
the layer's :class:`~batch_layers.functional.Layout`.

Packed sequences: the batched layer receives a :class:`~torch.nn.utils.rnn.PackedSequence` of ``B*N``
sequences (model ``b``'s sample ``i`` is sequence ``b * N + i`` in the unsorted order, as
``pack_padded_sequence(..., enforce_sorted=False)`` of a merged batch gives); the output is packed again with
the input's ``batch_sizes``, ``sorted_indices`` and ``unsorted_indices``; ``h_n`` / ``c_n`` come back in the
unsorted order, as torch does.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from . import functional
from ._base import AbstractBatchModule, current_forward, stack_copies
from .functional._recurrent_cells import GATES

__all__ = ["GRU", "LSTM", "RNN"]

_FUNCTIONALS = {
    "LSTM": functional.lstm,
    "GRU": functional.gru,
    "RNN_TANH": functional.rnn_tanh,
    "RNN_RELU": functional.rnn_relu,
}


def _shared_rows(batch: int, rows: int) -> bool:
    context = current_forward()
    if context is None or not context.shared or batch == 1:
        return False
    return rows % (batch * context.samples) != 0 and rows % context.samples == 0


class _RNNBase(AbstractBatchModule):
    """``batch`` independent ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` layers; parameters named as torch names them."""

    merged_order = "models"
    mode: ClassVar[str]

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
            raise ValueError(
                "dropout should be a number in range [0, 1] representing the probability of an element being zeroed"
            )
        if dropout > 0 and num_layers == 1:
            warnings.warn(
                "dropout option adds dropout after all but last recurrent layer, so non-zero dropout expects "
                f"num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}",
                stacklevel=2,
            )
        for name, value in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(proj_size, int) or proj_size < 0:
            raise ValueError(
                f"proj_size should be a positive integer or zero to disable projections, got {proj_size!r}"
            )
        if proj_size >= hidden_size:
            raise ValueError(f"proj_size ({proj_size}) has to be smaller than hidden_size ({hidden_size})")
        factory_kwargs = {"device": device, "dtype": dtype}
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        directions = 2 if bidirectional else 1
        gate_size = GATES[self.mode] * hidden_size
        real_hidden = proj_size if proj_size > 0 else hidden_size
        self._flat_weights_names: list[str] = []
        for layer in range(num_layers):
            for direction in range(directions):
                layer_input = input_size if layer == 0 else real_hidden * directions
                suffix = "_reverse" if direction == 1 else ""
                shapes = [("weight_ih", (gate_size, layer_input)), ("weight_hh", (gate_size, real_hidden))]
                if bias:
                    shapes += [("bias_ih", (gate_size,)), ("bias_hh", (gate_size,))]
                if proj_size > 0:
                    shapes.append(("weight_hr", (proj_size, hidden_size)))
                for name, shape in shapes:
                    full = f"{name}_l{layer}{suffix}"
                    self.register_parameter(full, nn.Parameter(torch.empty(batch, *shape, **factory_kwargs)))
                    self._flat_weights_names.append(full)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every model's slices as ``nn.{RNN,LSTM,GRU}.reset_parameters`` does, model after model."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for i in range(self.batch):
            for param in self.parameters():
                nn.init.uniform_(param[i], -stdv, stdv)

    @classmethod
    def from_module(cls, module: nn.RNNBase, batch: int) -> _RNNBase:
        kwargs = {"proj_size": module.proj_size} if cls.mode == "LSTM" else {}
        reference = next(module.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch already warned about dropout with num_layers=1 for the module
            layer = cls(
                module.input_size,
                module.hidden_size,
                module.num_layers,
                module.bias,
                module.batch_first,
                module.dropout,
                module.bidirectional,
                batch=batch,
                device=reference.device,
                dtype=reference.dtype,
                **kwargs,
            )
        with torch.no_grad():
            for name in layer._flat_weights_names:
                getattr(layer, name).copy_(stack_copies(getattr(module, name), batch))
        return layer

    def flatten_parameters(self) -> None:
        """A no-op kept for models that call it (``nn.LSTM`` packs weights for cuDNN; nothing here uses cuDNN)."""

    # -- shapes -----------------------------------------------------------------------------------
    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _out_hidden(self) -> int:
        return self.proj_size if self.proj_size > 0 else self.hidden_size

    def _check_features(self, x: Tensor, shape: tuple[int, ...] | None = None) -> None:
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__}: expected a floating-point input, got dtype {x.dtype}")
        if x.shape[-1] != self.input_size:
            raise ValueError(
                f"{type(self).__name__}: expected input with {self.input_size} features (input_size), got shape "
                f"{shape or tuple(x.shape)}"
            )

    def _check_input(self, x: Tensor) -> bool:
        """Refuse an input whose batch dim cannot hold B models' samples; whether it is the shared input."""
        self._check_features(x)
        if x.dim() == 2:  # unbatched models: each (T, F), merged (B*T, F)
            if self.is_shared(x):
                return True
            if x.shape[0] % self.batch:
                raise ValueError(
                    f"{type(self).__name__}: expected an unbatched input's dim 0 to be a multiple of B = {self.batch} "
                    f"(models' sequences one after another), got shape {tuple(x.shape)}"
                )
            return False
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected a 2-D or 3-D input, got shape {tuple(x.shape)}")
        if self.is_shared(x):
            return True
        rows = x.shape[0 if self.batch_first else 1]
        context = current_forward()
        step = self.batch * (context.samples if context is not None else 1)
        if rows % step:
            where = f"B * n = {self.batch} * {context.samples}" if context is not None else f"B = {self.batch}"
            raise ValueError(
                f"{type(self).__name__}: expected the input's batch dim ({0 if self.batch_first else 1}) to be a "
                f"multiple of {where} (the merged model axis), got shape {tuple(x.shape)}; a sequence-first model "
                "must take batch-first inputs at the BatchModule boundary and transpose them itself"
            )
        return False

    def _check_packed(self, input: PackedSequence) -> bool:
        """Refuse a packed batch whose sequences cannot be B models' samples; whether it is the shared input."""
        sequences = int(input.batch_sizes[0]) if len(input.batch_sizes) else 0
        self._check_features(input.data, (len(input.batch_sizes), sequences, input.data.shape[-1]))
        if _shared_rows(self.batch, sequences):  # one packed batch seen by every model
            return True
        context = current_forward()
        step = self.batch * (context.samples if context is not None else 1)
        if sequences % step:
            where = f"B * n = {self.batch} * {context.samples}" if context is not None else f"B = {self.batch}"
            raise ValueError(
                f"{type(self).__name__}: expected a PackedSequence of a multiple of {where} sequences "
                f"(the merged model axis), got {sequences}"
            )
        return False

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input: Tensor | PackedSequence, hx: Tensor | tuple[Tensor, Tensor] | None = None):
        if isinstance(input, PackedSequence):
            shared_input = self._check_packed(input)
        else:
            shared_input = self._check_input(input)
        if self.mode == "LSTM":
            if hx is not None and (not isinstance(hx, tuple) or len(hx) != 2):
                raise TypeError(f"{type(self).__name__}: expected hx as a tuple (h_0, c_0), got {type(hx).__name__}")
            states = () if hx is None else hx
        else:
            if isinstance(hx, tuple):
                raise TypeError(f"{type(self).__name__}: expected hx as one tensor, got a tuple")
            states = () if hx is None else (hx,)
        shared = (shared_input, *(self.is_shared(state) for state in states))
        params = [getattr(self, name) for name in self._flat_weights_names]
        return _FUNCTIONALS[self.mode](
            input, hx, params, self.bias, self.num_layers, self.dropout, self.training, self.bidirectional,
            self.batch_first, layout=self.layout, shared=shared,
        )  # fmt: skip

    def extra_repr(self) -> str:
        parts = [f"{self.input_size}, {self.hidden_size}"]
        if self.proj_size != 0:
            parts.append(f"proj_size={self.proj_size}")
        if self.num_layers != 1:
            parts.append(f"num_layers={self.num_layers}")
        if self.bias is not True:
            parts.append(f"bias={self.bias}")
        if self.batch_first is not False:
            parts.append(f"batch_first={self.batch_first}")
        if self.dropout != 0:
            parts.append(f"dropout={self.dropout}")
        if self.bidirectional is not False:
            parts.append(f"bidirectional={self.bidirectional}")
        parts.append(f"batch={self.batch}")
        return ", ".join(parts)


_SHARED_DOC = """

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional{extra}: as
            :class:`torch.nn.{name}`.
        batch: number of models B.

    Shape:
        - input: ``(B*N, T, input_size)`` if ``batch_first`` else ``(T, B*N, input_size)`` (model ``b``'s
          sample ``i`` at ``b * N + i``), ``(B*T, input_size)`` for unbatched models, or a
          :class:`~torch.nn.utils.rnn.PackedSequence` of ``B*N`` sequences.
        - {state}: ``(num_layers * D, B*N, H)`` (``(B * num_layers * D, H)`` for unbatched models);
          zeros when omitted.
        - output: the input's layout with ``D * H_out`` features (a ``PackedSequence`` for a packed input,
          with the input's ``sorted_indices``); the final states like the initial ones.

    Attributes:
        weight_ih_l[k], weight_hh_l[k], bias_ih_l[k], bias_hh_l[k]{attr}(and ``_reverse``): torch's
            parameters with a leading model axis, ``(B, *torch_shape)``.

    Dropout between layers draws independent masks for every model and sample.
"""


class RNN(_RNNBase):
    """``batch`` independent :class:`torch.nn.RNN` layers (tanh or ReLU) stepped together."""

    base_class: ClassVar[type[nn.Module]] = nn.RNN

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or 'relu'.")
        self.nonlinearity = nonlinearity
        self.mode = "RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU"
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            batch=batch, device=device, dtype=dtype,
        )  # fmt: skip

    @classmethod
    def from_module(cls, module: nn.RNN, batch: int) -> RNN:
        reference = next(module.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch already warned about dropout with num_layers=1
            layer = cls(
                module.input_size,
                module.hidden_size,
                module.num_layers,
                module.nonlinearity,
                module.bias,
                module.batch_first,
                module.dropout,
                module.bidirectional,
                batch=batch,
                device=reference.device,
                dtype=reference.dtype,
            )
        with torch.no_grad():
            for name in layer._flat_weights_names:
                getattr(layer, name).copy_(stack_copies(getattr(module, name), batch))
        return layer

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.nonlinearity == "tanh" else text.replace(", batch=", ", nonlinearity='relu', batch=")


class LSTM(_RNNBase):
    """``batch`` independent :class:`torch.nn.LSTM` layers (with ``proj_size``) stepped together."""

    base_class: ClassVar[type[nn.Module]] = nn.LSTM
    mode = "LSTM"


class GRU(_RNNBase):
    """``batch`` independent :class:`torch.nn.GRU` layers stepped together."""

    base_class: ClassVar[type[nn.Module]] = nn.GRU
    mode = "GRU"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            batch=batch, device=device, dtype=dtype,
        )  # fmt: skip


RNN.__doc__ += _SHARED_DOC.format(extra=", nonlinearity", name="RNN", state="hx", attr=" ")
LSTM.__doc__ += _SHARED_DOC.format(extra=", proj_size", name="LSTM", state="hx = (h_0, c_0)", attr=", weight_hr_l[k] ")
GRU.__doc__ += _SHARED_DOC.format(extra="", name="GRU", state="hx", attr=" ")
