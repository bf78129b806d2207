"""Batched recurrent layers (``torch.rnn_tanh``, ``rnn_relu``, ``lstm``, ``gru``): B models stepped together.

cuDNN runs one weight set per call, so B models would take B calls. Here the input projection of every
time step of every model is one batched product before the loop (``(B, T*N, F) @ (B, F, G)``); each time
step is then one batched product ``(B, N, H) @ (B, H, G)`` for the hidden projection of all models plus the
gate nonlinearities on the merged ``B*N`` rows. Per-step work scales with ``B``, kernel launches do not.

Packed sequences: a :class:`~torch.nn.utils.rnn.PackedSequence` of ``B*N`` sequences (merged in the
layout's order, unsorted, as ``pack_padded_sequence(..., enforce_sorted=False)`` of a merged batch gives) is
unpacked, every state stops updating once its sequence ends (and a reverse direction starts at its
sequence's own last element), and the output is packed again with the input's ``batch_sizes``,
``sorted_indices`` and ``unsorted_indices``; ``h_n`` / ``c_n`` come back in the unsorted order, as torch's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .._layout import Layout
from ._recurrent_cells import GATES, bmm_t, gru_step, lstm_step

__all__ = ["gru", "lstm", "rnn_relu", "rnn_tanh"]

_NAMES = {"LSTM": "LSTM", "GRU": "GRU", "RNN_TANH": "RNN", "RNN_RELU": "RNN"}


def _split_dim1(t: Tensor, layout: Layout) -> Tensor:
    """``(T, B*N, ...)`` merged in ``layout``'s order to ``(T, B, N, ...)`` (a view)."""
    if layout.order == "models":
        return t.view(t.shape[0], layout.batch, -1, *t.shape[2:])
    return t.view(t.shape[0], -1, layout.batch, *t.shape[2:]).transpose(1, 2)


def _merge_dim1(t: Tensor, layout: Layout) -> Tensor:
    """Inverse of :func:`_split_dim1`: ``(T, B, N, ...)`` to ``(T, B*N, ...)`` in ``layout``'s order."""
    if layout.order == "models":
        return t.reshape(t.shape[0], -1, *t.shape[3:])
    return t.transpose(1, 2).reshape(t.shape[0], -1, *t.shape[3:])


def _time_major(x: Tensor, batch_first: bool, shared: bool, layout: Layout, name: str) -> tuple[Tensor, str]:
    """The input as ``(T, B, N, F)`` and its format: ``"batch_first"``, ``"seq_first"`` or ``"unbatched"``."""
    batch = layout.batch
    if x.dim() == 2:  # unbatched models: each (T, F), merged (B*T, F)
        if shared:
            return x.unsqueeze(1).unsqueeze(1).expand(-1, batch, 1, -1), "unbatched"
        if x.shape[0] % batch:
            raise ValueError(
                f"{name}: expected an unbatched input's dim 0 to be a multiple of B = {batch} (models' sequences one "
                f"after another), got shape {tuple(x.shape)}"
            )
        return layout.split(x).unsqueeze(2).transpose(0, 1), "unbatched"
    if x.dim() != 3:
        raise ValueError(f"{name}: expected a 2-D or 3-D input, got shape {tuple(x.shape)}")
    seq = x.transpose(0, 1) if batch_first else x  # (T, rows, F)
    fmt = "batch_first" if batch_first else "seq_first"
    if shared:
        return seq.unsqueeze(1).expand(-1, batch, -1, -1), fmt
    if seq.shape[1] % batch:
        raise ValueError(
            f"{name}: expected the input's batch dim ({0 if batch_first else 1}) to be a multiple of B = {batch} "
            f"(the merged model axis), got shape {tuple(x.shape)}"
        )
    return _split_dim1(seq, layout), fmt


def _initial_state(
    state: Tensor | None, shared: bool, shape: tuple[int, int, int], like: Tensor, fmt: str, layout: Layout,
    what: str, name: str,
) -> Tensor:  # fmt: skip
    """``(L*D, B, N, size)`` from a merged ``h_0`` / ``c_0`` (zeros when ``None``); ``shape`` is ``(L*D, N, size)``."""
    layers, per_model, size = shape
    batch = layout.batch
    if state is None:
        return like.new_zeros(layers, batch, per_model, size)
    if fmt == "unbatched":
        expected = (batch * layers, size)
        if tuple(state.shape) == expected:
            return layout.split(state).unsqueeze(2).transpose(0, 1)
        if tuple(state.shape) == (layers, size) and shared:  # one shared unbatched state
            return state.view(layers, 1, 1, size).expand(-1, batch, -1, -1)
    else:
        expected = (layers, batch * per_model, size)
        if tuple(state.shape) == expected:
            return _split_dim1(state, layout)
        if shared and tuple(state.shape) == (layers, per_model, size):
            return state.unsqueeze(1).expand(-1, batch, -1, -1)
    raise ValueError(f"{name}: expected {what} of shape {expected}, got {tuple(state.shape)}")


def _state_to_layout(state: Tensor, fmt: str, layout: Layout) -> Tensor:
    if fmt == "unbatched":
        return layout.merge(state.squeeze(2).transpose(0, 1))
    return _merge_dim1(state, layout)


def _param_groups(params: Sequence[Tensor], groups: int, has_biases: bool, name: str) -> list[tuple]:
    """``(w_ih, w_hh, b_ih, b_hh, w_hr)`` per layer and direction from torch's flat weight order."""
    base = 4 if has_biases else 2
    if len(params) not in (groups * base, groups * (base + 1)):
        raise ValueError(
            f"{name}: expected {groups * base} parameters ({groups * (base + 1)} with projections) in torch's flat "
            f"weight order (weight_ih, weight_hh{', bias_ih, bias_hh' if has_biases else ''}[, weight_hr] per layer "
            f"and direction), got {len(params)}"
        )
    per_group = len(params) // groups
    out = []
    for g in range(groups):
        chunk = list(params[g * per_group : (g + 1) * per_group])
        biases = chunk[2:4] if has_biases else [None, None]
        out.append((chunk[0], chunk[1], *biases, chunk[base] if per_group > base else None))
    return out


def _recurrent(
    mode: str, input: Tensor | PackedSequence, hx: Tensor | tuple[Tensor, Tensor] | None, params: Sequence[Tensor],
    has_biases: bool, num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool,
    layout: Layout, shared: Sequence[bool],
):  # fmt: skip
    name = _NAMES[mode]
    flags = (*shared, False, False, False)
    batch, directions = layout.batch, 2 if bidirectional else 1
    groups = _param_groups(params, num_layers * directions, has_biases, name)
    hidden_size = groups[0][0].shape[1] // GATES[mode]
    out_hidden = groups[0][4].shape[1] if groups[0][4] is not None else hidden_size
    packed = isinstance(input, PackedSequence)
    valid = None
    if packed:
        padded, lengths = pad_packed_sequence(input)  # (T, M, F), unsorted (original) order
        if flags[0]:  # one packed batch seen by every model: B*M sequences
            padded = _merge_dim1(padded.unsqueeze(1).expand(-1, batch, -1, -1), layout)
            lengths = layout.merge(lengths.expand(batch, -1))
        elif padded.shape[1] % batch:
            raise ValueError(
                f"{name}: expected a PackedSequence of a multiple of B = {batch} sequences, got {padded.shape[1]}"
            )
        x, fmt = _split_dim1(padded, layout), "seq_first"
        steps = torch.arange(padded.shape[0], device=lengths.device).unsqueeze(1)
        valid = _split_dim1((steps < lengths.unsqueeze(0)).to(padded.device).unsqueeze(-1), layout)
    else:
        x, fmt = _time_major(input, batch_first, flags[0], layout, name)
    per_model = x.shape[2]
    states = num_layers * directions
    if mode == "LSTM":
        if hx is not None and (not isinstance(hx, tuple) or len(hx) != 2):
            raise TypeError(f"{name}: expected hx as a tuple (h_0, c_0), got {type(hx).__name__}")
        h0, c0 = (None, None) if hx is None else hx
        c0 = _initial_state(c0, flags[2], (states, per_model, hidden_size), x, fmt, layout, "c_0", name)
    else:
        if isinstance(hx, tuple):
            raise TypeError(f"{name}: expected hx as one tensor, got a tuple")
        h0, c0 = hx, None
    h0 = _initial_state(h0, flags[1], (states, per_model, out_hidden), x, fmt, layout, "h_0", name)
    out, h_n, c_n = _layers(mode, x, h0, c0, valid, groups, num_layers, directions, dropout if train else 0.0)
    h_n = _state_to_layout(h_n, fmt, layout)
    hidden = h_n if c_n is None else (h_n, _state_to_layout(c_n, fmt, layout))
    if packed:
        merged = _merge_dim1(out, layout)  # (T, B*M, D*H)
        if flags[0]:
            return pack_padded_sequence(merged, lengths, enforce_sorted=False), hidden
        if input.sorted_indices is not None:
            merged = merged.index_select(1, input.sorted_indices)
        sequences = torch.arange(merged.shape[1], device=input.batch_sizes.device)
        data = merged[(sequences.unsqueeze(0) < input.batch_sizes.unsqueeze(1)).to(merged.device)]
        return PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices), hidden
    if fmt == "unbatched":
        return layout.merge(out.squeeze(2).transpose(0, 1)), hidden
    if fmt == "batch_first":
        return layout.merge(out.permute(1, 2, 0, 3)), hidden
    return _merge_dim1(out, layout), hidden


def _layers(mode, x, h0, c0, valid, groups, num_layers, directions, dropout):
    """All layers over ``x`` ``(T, B, N, F)``: returns ``(T, B, N, D*H_out)``, ``h_n``, ``c_n`` ``(L*D, B, N, *)``.

    A bidirectional layer runs both directions in one time loop: the reverse direction's inputs are
    flipped in time and its models are appended to the model axis (2B weight sets), so every step is
    one batched product for both directions instead of two.
    """
    steps, batch, per_model, _ = x.shape
    both_valid = None if valid is None or directions == 1 else torch.cat([valid, valid.flip(0)], dim=1)
    h_n, c_n = [], []
    for layer in range(num_layers):
        flat = x.permute(1, 0, 2, 3).reshape(batch, steps * per_model, x.shape[-1])
        gates, w_hh, b_hh, w_hr = [], [], [], []
        for direction in range(directions):
            w_ih, weight_hh, b_ih, bias_hh, weight_hr = groups[layer * directions + direction]
            if b_ih is not None and mode != "GRU":  # both biases enter the gates linearly: add once
                b_ih, bias_hh = b_ih + bias_hh, None
            step_gates = bmm_t(flat, w_ih, b_ih).view(batch, steps, per_model, -1).transpose(0, 1)
            gates.append(step_gates.flip(0) if direction else step_gates)
            w_hh.append(weight_hh)
            b_hh.append(bias_hh)
            w_hr.append(weight_hr)
        first = layer * directions
        if directions == 1:
            c = None if c0 is None else c0[first]
            out, h, c = _direction(mode, gates[0].contiguous(), h0[first], c, w_hh[0], b_hh[0], w_hr[0], valid)
            x = out
        else:
            out, h, c = _direction(
                mode,
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
        if dropout and layer < num_layers - 1:
            x = F.dropout(x, dropout, training=True)
    return x, torch.stack(h_n), (torch.stack(c_n) if c_n else None)


def _direction(mode, gates_x, h, c, w_hh, b_hh, w_hr, valid):
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
        if mode.startswith("RNN"):  # one product with the input gates added in, then the nonlinearity
            pre = torch.baddbmm(step_gates[t], h, w_hh_t)
            h_new = torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)
            if masks is not None:
                h_new = torch.where(masks[t], h_new, h)
            h = outputs[t] = h_new
            continue
        gates_h = torch.bmm(h, w_hh_t) if b_hh is None else torch.baddbmm(b_hh, h, w_hh_t)
        if mode == "LSTM":
            h_new, c_new = lstm_step(step_gates[t].view(rows, -1), gates_h.view(rows, -1), c.reshape(rows, -1))
            h_new = h_new.view(batch, per_model, -1)
            c_new = c_new.view(batch, per_model, -1)
            if w_hr is not None:
                h_new = torch.bmm(h_new, w_hr_t)
        else:
            h_new = gru_step(step_gates[t].view(rows, -1), gates_h.view(rows, -1), h.reshape(rows, -1))
            h_new = h_new.view(batch, per_model, -1)
            c_new = None
        if masks is not None:  # finished sequences keep their state; reverse ones wait for their start
            h_new = torch.where(masks[t], h_new, h)
            if c_new is not None:
                c_new = torch.where(masks[t], c_new, c)
        h, c = h_new, c_new
        outputs[t] = h
    return torch.stack(outputs), h, c


_ARGS = """

    Args:
        input: ``(T, B*N, input_size)`` (``(B*N, T, input_size)`` with ``batch_first``) merged in ``layout``'s
            order, ``(B*T, input_size)`` for unbatched models, or a
            :class:`~torch.nn.utils.rnn.PackedSequence` of ``B*N`` sequences.
        hx: {state}: ``(num_layers * D, B*N, H)`` (``(B * num_layers * D, H)`` unbatched), or ``None`` for zeros.
        params: every layer's and direction's ``weight_ih, weight_hh[, bias_ih, bias_hh]{proj}`` in torch's
            flat order (``nn.{module}._flat_weights``), each ``(B, *torch_shape)``.
        has_biases, num_layers, dropout, train, bidirectional, batch_first: as ``nn.{module}``'s.
        layout: the number of models and the order of the merged batch dim.
        shared: one flag per tensor ({tensors}): whether it is the input (``(T, N, F)``, ...) or state
            (``(num_layers * D, N, H)``) shared by all models; missing flags are false.

    Returns:
        ``(output, {returned})`` as ``nn.{module}`` returns them, merged in ``layout``'s order.
"""


def rnn_tanh(
    input: Tensor | PackedSequence, hx: Tensor | None, params: Sequence[Tensor], has_biases: bool, num_layers: int,
    dropout: float, train: bool, bidirectional: bool, batch_first: bool, *, layout: Layout,
    shared: Sequence[bool] = (),
) -> tuple[Tensor | PackedSequence, Tensor]:  # fmt: skip
    """``torch.rnn_tanh`` of B models: an Elman RNN with tanh."""
    args = (params, has_biases, num_layers, dropout, train, bidirectional, batch_first, layout, shared)
    return _recurrent("RNN_TANH", input, hx, *args)


def rnn_relu(
    input: Tensor | PackedSequence, hx: Tensor | None, params: Sequence[Tensor], has_biases: bool, num_layers: int,
    dropout: float, train: bool, bidirectional: bool, batch_first: bool, *, layout: Layout,
    shared: Sequence[bool] = (),
) -> tuple[Tensor | PackedSequence, Tensor]:  # fmt: skip
    """``torch.rnn_relu`` of B models: an Elman RNN with ReLU."""
    args = (params, has_biases, num_layers, dropout, train, bidirectional, batch_first, layout, shared)
    return _recurrent("RNN_RELU", input, hx, *args)


def gru(
    input: Tensor | PackedSequence, hx: Tensor | None, params: Sequence[Tensor], has_biases: bool, num_layers: int,
    dropout: float, train: bool, bidirectional: bool, batch_first: bool, *, layout: Layout,
    shared: Sequence[bool] = (),
) -> tuple[Tensor | PackedSequence, Tensor]:  # fmt: skip
    """``torch.gru`` of B models."""
    args = (params, has_biases, num_layers, dropout, train, bidirectional, batch_first, layout, shared)
    return _recurrent("GRU", input, hx, *args)


def lstm(
    input: Tensor | PackedSequence, hx: tuple[Tensor, Tensor] | None, params: Sequence[Tensor], has_biases: bool,
    num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool, *, layout: Layout,
    shared: Sequence[bool] = (),
) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:  # fmt: skip
    """``torch.lstm`` of B models (with projections when ``params`` holds each ``weight_hr``)."""
    args = (params, has_biases, num_layers, dropout, train, bidirectional, batch_first, layout, shared)
    return _recurrent("LSTM", input, hx, *args)


for _function, _module, _state, _proj, _tensors, _returned in (
    (rnn_tanh, "RNN", "h_0", "", "input, h_0", "h_n"),
    (rnn_relu, "RNN", "h_0", "", "input, h_0", "h_n"),
    (gru, "GRU", "h_0", "", "input, h_0", "h_n"),
    (lstm, "LSTM", "the tuple (h_0, c_0), each", "[, weight_hr]", "input, h_0, c_0", "(h_n, c_n)"),
):
    _function.__doc__ += _ARGS.format(
        state=_state, proj=_proj, module=_module, tensors=_tensors, returned=_returned
    )
