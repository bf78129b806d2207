"""Batched recurrent layers: B models' RNN / LSTM / GRU stepped together (their cells are in
:mod:`batch_layers._recurrent_cells`).

cuDNN runs one weight set per call, so B models would take B calls. Here the input projection of every
time step of every model is one batched product before the loop (``(B, T*N, F) @ (B, F, G)``); each time
step is then one batched product ``(B, N, H) @ (B, H, G)`` for the hidden projection of all models plus the
gate nonlinearities on the merged ``B*N`` rows (torch's fused LSTM/GRU cell kernels on CUDA, the same
maths in plain torch elsewhere). Per-step work scales with ``B``, kernel launches do not.

Packed sequences: the batched layer receives a :class:`~torch.nn.utils.rnn.PackedSequence` of ``B*N``
sequences (model ``b``'s sample ``i`` is sequence ``b * N + i`` in the unsorted order, as
``pack_padded_sequence(..., enforce_sorted=False)`` of a merged batch gives). It is unpacked into the
merged layout, every state stops updating once its sequence ends (and a reverse direction starts at its
sequence's own last element), and the output is packed again with the input's ``batch_sizes``,
``sorted_indices`` and ``unsorted_indices``; ``h_n`` / ``c_n`` come back in the unsorted order, as torch does.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from ._base import AbstractBatchModule, current_forward, stack_copies

__all__ = ["GRU", "LSTM", "RNN"]

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}

# torch's fused CUDA cell kernels (what nn.LSTMCell / nn.GRUCell run on CUDA), with autograd formulas:
# one kernel for all gate nonlinearities of a step forward, one backward. Reached through torch.ops.
_FUSED_LSTM = getattr(torch.ops.aten, "_thnn_fused_lstm_cell", None)
_FUSED_GRU = getattr(torch.ops.aten, "_thnn_fused_gru_cell", None)


def _fused_cells(t: Tensor) -> bool:
    return t.is_cuda and _FUSED_LSTM is not None and _FUSED_GRU is not None


def _lstm_cell(gates_x: Tensor, gates_h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step on merged rows: gates ``(R, 4H)`` (input part with both biases, hidden part), ``c`` ``(R, H)``."""
    if _fused_cells(gates_x):
        h, c, _ = _FUSED_LSTM(gates_x.contiguous(), gates_h.contiguous(), c.contiguous())
        return h, c
    i, f, g, o = (gates_x + gates_h).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru_cell(gates_x: Tensor, gates_h: Tensor, h: Tensor) -> Tensor:
    """One GRU step on merged rows; ``gates_h`` must include the hidden bias (it is gated by ``r``)."""
    if _fused_cells(gates_x):
        return _FUSED_GRU(gates_x.contiguous(), gates_h.contiguous(), h.contiguous())[0]
    x_r, x_z, x_n = gates_x.chunk(3, dim=-1)
    h_r, h_z, h_n = gates_h.chunk(3, dim=-1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return (1 - z) * n + z * h


def _rnn_cell(gates_x: Tensor, gates_h: Tensor, mode: str) -> Tensor:
    pre = gates_x + gates_h
    return torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)


def _bmm_t(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(B, m, in) @ (B, out, in)^T (+ (B, out))``."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


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
        gate_size = _GATES[self.mode] * hidden_size
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

    def _check_features(self, x: Tensor) -> None:
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__}: expected a floating-point input, got dtype {x.dtype}")
        if x.shape[-1] != self.input_size:
            raise ValueError(
                f"{type(self).__name__}: expected input with {self.input_size} features (input_size), got shape "
                f"{tuple(x.shape)}"
            )

    def _time_major(self, x: Tensor) -> tuple[Tensor, str]:
        """The input as ``(T, B, N, F)`` and its layout: ``"batch_first"``, ``"seq_first"`` or ``"unbatched"``."""
        self._check_features(x)
        if x.dim() == 2:  # unbatched models: each (T, F), merged (B*T, F)
            if self.is_shared(x):
                return x.unsqueeze(1).unsqueeze(1).expand(-1, self.batch, 1, -1), "unbatched"
            if x.shape[0] % self.batch:
                raise ValueError(
                    f"{type(self).__name__}: expected an unbatched input's dim 0 to be a multiple of B = {self.batch} "
                    f"(models' sequences one after another), got shape {tuple(x.shape)}"
                )
            return x.view(self.batch, -1, 1, x.shape[-1]).transpose(0, 1), "unbatched"
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected a 2-D or 3-D input, got shape {tuple(x.shape)}")
        seq = x.transpose(0, 1) if self.batch_first else x  # (T, rows, F)
        layout = "batch_first" if self.batch_first else "seq_first"
        rows = seq.shape[1]
        if self.is_shared(x):
            return seq.unsqueeze(1).expand(-1, self.batch, -1, -1), layout
        context = current_forward()
        step = self.batch * (context.samples if context is not None else 1)
        if rows % step:
            where = f"B * n = {self.batch} * {context.samples}" if context is not None else f"B = {self.batch}"
            raise ValueError(
                f"{type(self).__name__}: expected the input's batch dim ({0 if self.batch_first else 1}) to be a "
                f"multiple of {where} (the merged model axis), got shape {tuple(x.shape)}; a sequence-first model "
                "must take batch-first inputs at the BatchModule boundary and transpose them itself"
            )
        return seq.reshape(seq.shape[0], self.batch, -1, seq.shape[-1]), layout

    def _initial_state(
        self, state: Tensor | None, per_model: int, size: int, like: Tensor, layout: str, what: str
    ) -> Tensor:
        """``(L*D, B, N, size)`` from a merged ``h_0`` / ``c_0`` (zeros when ``None``)."""
        layers = self.num_layers * self._directions
        if state is None:
            return like.new_zeros(layers, self.batch, per_model, size)
        if layout == "unbatched":
            expected = (self.batch * layers, size)
            if tuple(state.shape) == expected:
                return state.view(self.batch, layers, 1, size).transpose(0, 1)
            if tuple(state.shape) == (layers, size) and self.is_shared(state):  # one shared unbatched state
                return state.view(layers, 1, 1, size).expand(-1, self.batch, -1, -1)
        else:
            expected = (layers, self.batch * per_model, size)
            if tuple(state.shape) == expected:
                return state.view(layers, self.batch, per_model, size)
            if self.is_shared(state) and tuple(state.shape) == (layers, per_model, size):
                return state.unsqueeze(1).expand(-1, self.batch, -1, -1)
        raise ValueError(f"{type(self).__name__}: expected {what} of shape {expected}, got {tuple(state.shape)}")

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input: Tensor | PackedSequence, hx: Tensor | tuple[Tensor, Tensor] | None = None):
        packed = isinstance(input, PackedSequence)
        valid = None
        shared_packed = False
        if packed:
            padded, lengths = pad_packed_sequence(input)  # (T, M, F), unsorted (original) order
            self._check_features(padded)
            sequences = padded.shape[1]
            context = current_forward()
            step = self.batch * (context.samples if context is not None else 1)
            if _shared_rows(self.batch, sequences):  # one packed batch seen by every model
                shared_packed = True
                padded = (
                    padded.unsqueeze(1).expand(-1, self.batch, -1, -1).reshape(padded.shape[0], -1, padded.shape[-1])
                )
                lengths = lengths.repeat(self.batch)
            elif sequences % step:
                where = f"B * n = {self.batch} * {context.samples}" if context is not None else f"B = {self.batch}"
                raise ValueError(
                    f"{type(self).__name__}: expected a PackedSequence of a multiple of {where} sequences "
                    f"(the merged model axis), got {sequences}"
                )
            x = padded.view(padded.shape[0], self.batch, -1, padded.shape[-1])
            layout = "seq_first"
            steps = torch.arange(padded.shape[0], device=lengths.device).unsqueeze(1)
            valid = (steps < lengths.unsqueeze(0)).to(padded.device).view(*x.shape[:3], 1)
        else:
            x, layout = self._time_major(input)
        per_model = x.shape[2]
        if self.mode == "LSTM":
            if hx is not None and (not isinstance(hx, tuple) or len(hx) != 2):
                raise TypeError(f"{type(self).__name__}: expected hx as a tuple (h_0, c_0), got {type(hx).__name__}")
            h0, c0 = (None, None) if hx is None else hx
            c0 = self._initial_state(c0, per_model, self.hidden_size, x, layout, "c_0")
        else:
            if isinstance(hx, tuple):
                raise TypeError(f"{type(self).__name__}: expected hx as one tensor, got a tuple")
            h0, c0 = hx, None
        h0 = self._initial_state(h0, per_model, self._out_hidden, x, layout, "h_0")
        out, h_n, c_n = self._layers(x, h0, c0, valid)  # (T, B, N, D*H), (L*D, B, N, H)
        h_n = self._state_to_layout(h_n, layout)
        hidden = h_n if c_n is None else (h_n, self._state_to_layout(c_n, layout))
        if shared_packed:  # every model's copy of the shared sequences, merged: B*M sequences
            merged = out.reshape(out.shape[0], -1, out.shape[-1])
            return pack_padded_sequence(merged, lengths, enforce_sorted=False), hidden
        if packed:
            merged = out.reshape(out.shape[0], -1, out.shape[-1])
            if input.sorted_indices is not None:
                merged = merged.index_select(1, input.sorted_indices)
            keep = torch.arange(merged.shape[1], device=input.batch_sizes.device).unsqueeze(
                0
            ) < input.batch_sizes.unsqueeze(1)
            data = merged[keep.to(merged.device)]
            return PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices), hidden
        if layout == "unbatched":
            return out.transpose(0, 1).reshape(-1, out.shape[-1]), hidden
        if layout == "batch_first":
            return out.permute(1, 2, 0, 3).reshape(-1, out.shape[0], out.shape[-1]), hidden
        return out.reshape(out.shape[0], -1, out.shape[-1]), hidden

    def _state_to_layout(self, state: Tensor, layout: str) -> Tensor:
        if layout == "unbatched":
            return state.transpose(0, 1).reshape(-1, state.shape[-1])
        return state.reshape(state.shape[0], -1, state.shape[-1])

    def _layers(self, x: Tensor, h0: Tensor, c0: Tensor | None, valid: Tensor | None):
        """All layers over ``x`` ``(T, B, N, F)``: returns ``(T, B, N, D*H_out)``, ``h_n``, ``c_n`` ``(L*D, B, N, *)``.

        A bidirectional layer runs both directions in one time loop: the reverse direction's inputs are
        flipped in time and its models are appended to the model axis (2B weight sets), so every step is
        one batched product for both directions instead of two.
        """
        steps, batch, per_model, _ = x.shape
        directions = self._directions
        both_valid = None if valid is None or directions == 1 else torch.cat([valid, valid.flip(0)], dim=1)
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            flat = x.permute(1, 0, 2, 3).reshape(batch, steps * per_model, x.shape[-1])
            gates, w_hh, b_hh, w_hr = [], [], [], []
            for direction in range(directions):
                suffix = "_reverse" if direction else ""
                w_ih = getattr(self, f"weight_ih_l{layer}{suffix}")
                b_ih = getattr(self, f"bias_ih_l{layer}{suffix}") if self.bias else None
                bias_hh = getattr(self, f"bias_hh_l{layer}{suffix}") if self.bias else None
                if b_ih is not None and self.mode != "GRU":  # both biases enter the gates linearly: add once
                    b_ih, bias_hh = b_ih + bias_hh, None
                step_gates = _bmm_t(flat, w_ih, b_ih).view(batch, steps, per_model, -1).transpose(0, 1)
                gates.append(step_gates.flip(0) if direction else step_gates)
                w_hh.append(getattr(self, f"weight_hh_l{layer}{suffix}"))
                b_hh.append(bias_hh)
                w_hr.append(getattr(self, f"weight_hr_l{layer}{suffix}") if self.proj_size > 0 else None)
            first = layer * directions
            if directions == 1:
                out, h, c = self._direction(
                    gates[0].contiguous(),
                    h0[first],
                    None if c0 is None else c0[first],
                    w_hh[0],
                    b_hh[0],
                    w_hr[0],
                    valid,
                )
                x = out
            else:
                out, h, c = self._direction(
                    torch.cat(gates, dim=1),
                    h0[first : first + 2].flatten(0, 1),
                    None if c0 is None else c0[first : first + 2].flatten(0, 1),
                    torch.cat(w_hh),
                    None if b_hh[0] is None else torch.cat(b_hh),
                    None if w_hr[0] is None else torch.cat(w_hr),
                    both_valid,
                )
                x = torch.cat([out[:, :batch], out[:, batch:].flip(0)], dim=-1)
            h_n.extend(h.split(batch))
            if c is not None:
                c_n.extend(c.split(batch))
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        return x, torch.stack(h_n), (torch.stack(c_n) if c_n else None)

    def _direction(self, gates_x, h, c, w_hh, b_hh, w_hr, valid):
        """Run the recurrence over ``gates_x`` ``(T, B', N, G)`` in time order; returns ``(T, B', N, H)``, h, c."""
        steps, batch, per_model, _ = gates_x.shape
        rows = batch * per_model
        h = h.to(gates_x.dtype)
        if c is not None:
            c = c.to(gates_x.dtype)
        outputs: list[Tensor | None] = [None] * steps
        step_gates = gates_x.unbind(0)  # one backward (a stack), not T zero-filled full-size gradients
        masks = valid.unbind(0) if valid is not None else None
        w_hh_t = w_hh.transpose(1, 2)  # once, not one transpose (and autograd node) per step
        w_hr_t = None if w_hr is None else w_hr.transpose(1, 2)
        b_hh = None if b_hh is None else b_hh.unsqueeze(1)
        for t in range(steps):
            if self.mode.startswith("RNN"):  # one product with the input gates added in, then the nonlinearity
                pre = torch.baddbmm(step_gates[t], h, w_hh_t)
                h_new, c_new = (torch.tanh(pre) if self.mode == "RNN_TANH" else torch.relu(pre)), None
                if masks is not None:
                    h_new = torch.where(masks[t], h_new, h)
                h = outputs[t] = h_new
                continue
            gates_h = torch.bmm(h, w_hh_t) if b_hh is None else torch.baddbmm(b_hh, h, w_hh_t)
            if self.mode == "LSTM":
                h_new, c_new = _lstm_cell(step_gates[t].view(rows, -1), gates_h.view(rows, -1), c.reshape(rows, -1))
                h_new = h_new.view(batch, per_model, -1)
                c_new = c_new.view(batch, per_model, -1)
                if w_hr is not None:
                    h_new = torch.bmm(h_new, w_hr_t)
            else:
                h_new = _gru_cell(step_gates[t].view(rows, -1), gates_h.view(rows, -1), h.reshape(rows, -1))
                h_new = h_new.view(batch, per_model, -1)
                c_new = None
            if masks is not None:  # finished sequences keep their state; reverse ones wait for their start
                h_new = torch.where(masks[t], h_new, h)
                if c_new is not None:
                    c_new = torch.where(masks[t], c_new, c)
            h, c = h_new, c_new
            outputs[t] = h
        return torch.stack(outputs), h, c

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
