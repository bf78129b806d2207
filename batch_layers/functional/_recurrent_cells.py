"""Batched recurrent cells (``torch.rnn_tanh_cell``, ``rnn_relu_cell``, ``lstm_cell``, ``gru_cell``) and the
gate nonlinearities that the recurrent layers step with: one batched product per projection, the gates on
the merged ``B*N`` rows (torch's fused LSTM/GRU cell kernels on CUDA, the same maths in plain torch
elsewhere)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._layout import Layout

__all__ = ["gru_cell", "lstm_cell", "rnn_relu_cell", "rnn_tanh_cell"]

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}

# torch's fused CUDA cell kernels (what nn.LSTMCell / nn.GRUCell run on CUDA), with autograd formulas:
# one kernel for all gate nonlinearities of a step forward, one backward. Reached through torch.ops.
_FUSED_LSTM = getattr(torch.ops.aten, "_thnn_fused_lstm_cell", None)
_FUSED_GRU = getattr(torch.ops.aten, "_thnn_fused_gru_cell", None)


def _fused_cells(t: Tensor) -> bool:
    return t.is_cuda and _FUSED_LSTM is not None and _FUSED_GRU is not None


def lstm_step(gates_x: Tensor, gates_h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step on merged rows: gates ``(R, 4H)`` (input part with both biases, hidden part), ``c`` ``(R, H)``."""
    if _fused_cells(gates_x):
        h, c, _ = _FUSED_LSTM(gates_x.contiguous(), gates_h.contiguous(), c.contiguous())
        return h, c
    i, f, g, o = (gates_x + gates_h).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def gru_step(gates_x: Tensor, gates_h: Tensor, h: Tensor) -> Tensor:
    """One GRU step on merged rows; ``gates_h`` must include the hidden bias (it is gated by ``r``)."""
    if _fused_cells(gates_x):
        return _FUSED_GRU(gates_x.contiguous(), gates_h.contiguous(), h.contiguous())[0]
    x_r, x_z, x_n = gates_x.chunk(3, dim=-1)
    h_r, h_z, h_n = gates_h.chunk(3, dim=-1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return (1 - z) * n + z * h


def bmm_t(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(B, m, in) @ (B, out, in)^T (+ (B, out))``."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def _rows(x: Tensor, size: int, shared: bool, layout: Layout, what: str) -> tuple[Tensor, bool]:
    """``(B, N, size)`` from a merged ``(B*N, size)`` tensor or unbatched models' ``(B*size,)``, and whether
    it was batched; a shared ``(N, size)`` or ``(size,)`` one becomes an expanded view."""
    batch = layout.batch
    batched = x.dim() == 2
    if x.dim() not in (1, 2) or x.shape[-1 if batched else 0] != (size if batched or shared else batch * size):
        raise ValueError(f"expected {what} of shape (B*N, {size}) or ({batch} * {size},), got {tuple(x.shape)}")
    if shared:
        return (x.expand(batch, *x.shape) if batched else x.expand(batch, 1, size)), batched
    if batched and x.shape[0] % batch:
        raise ValueError(f"expected {what}'s dim 0 to be a multiple of B = {batch}, got shape {tuple(x.shape)}")
    # Unbatched models' vectors lie one after another in either order (one "row" per model).
    return (layout.split(x) if batched else x.view(batch, 1, size)), batched


def _cell_gates(
    input: Tensor, hx: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None,
    layout: Layout, shared: tuple[bool, ...],
) -> tuple[Tensor, Tensor, Tensor, bool]:  # fmt: skip
    """The input and hidden gates ``(B, N, G)`` of one step, the hidden state ``(B, N, H)``, and whether batched."""
    shared = (*shared, False, False, False)
    hidden_size = w_hh.shape[-1]
    inputs, batched = _rows(input, w_ih.shape[-1], shared[0], layout, "input")
    if hx is None:
        h = inputs.new_zeros(layout.batch, inputs.shape[1], hidden_size)
    else:
        h, _ = _rows(hx, hidden_size, shared[1], layout, "hidden state")
        if h.shape[1] != inputs.shape[1]:
            raise ValueError(
                f"input {tuple(input.shape)} and hidden state {tuple(hx.shape)} disagree on the batch size"
            )
    gates_x = bmm_t(inputs, w_ih, b_ih)
    gates_h = bmm_t(h.to(gates_x.dtype), w_hh, b_hh)
    return gates_x, gates_h, h, batched


def _merged(y: Tensor, batched: bool, layout: Layout) -> Tensor:
    return layout.merge(y) if batched else y.reshape(-1)  # (B*N, H), or (B*H,): models one after another


_CELL_ARGS = """

    Args:
        input: ``(B*N, input_size)`` merged in ``layout``'s order or, for unbatched models, ``(B * input_size,)``
            (each model's vector after the other, in either order).
        hx: {state} like the output (zeros when ``None``).
        w_ih, w_hh: ``(B, G * hidden_size, input_size)`` and ``(B, G * hidden_size, hidden_size)``.
        b_ih, b_hh: ``(B, G * hidden_size)`` or ``None``.
        layout: the number of models and the order of the merged dim 0.
        shared: one flag per tensor ({tensors}): whether it is the ``(N, size)`` tensor (``(size,)``
            unbatched) shared by all models; missing flags are false.

    Returns:
        ``(B*N, hidden_size)`` (``(B * hidden_size,)`` unbatched){returns}.
"""


def _plain_rnn_cell(
    nonlinearity, input, hx, w_ih, w_hh, b_ih, b_hh, layout: Layout, shared: tuple[bool, ...]
) -> Tensor:  # fmt: skip
    gates_x, gates_h, _, batched = _cell_gates(input, hx, w_ih, w_hh, b_ih, b_hh, layout, shared)
    return _merged(nonlinearity(gates_x + gates_h), batched, layout)


def rnn_tanh_cell(
    input: Tensor, hx: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
    b_hh: Tensor | None = None, *, layout: Layout, shared: tuple[bool, ...] = (),
) -> Tensor:  # fmt: skip
    """``torch.rnn_tanh_cell`` of B models: ``h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh)`` per model."""
    return _plain_rnn_cell(torch.tanh, input, hx, w_ih, w_hh, b_ih, b_hh, layout, shared)


def rnn_relu_cell(
    input: Tensor, hx: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
    b_hh: Tensor | None = None, *, layout: Layout, shared: tuple[bool, ...] = (),
) -> Tensor:  # fmt: skip
    """``torch.rnn_relu_cell`` of B models: ``h' = relu(x W_ih^T + b_ih + h W_hh^T + b_hh)`` per model."""
    return _plain_rnn_cell(torch.relu, input, hx, w_ih, w_hh, b_ih, b_hh, layout, shared)


def gru_cell(
    input: Tensor, hx: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
    b_hh: Tensor | None = None, *, layout: Layout, shared: tuple[bool, ...] = (),
) -> Tensor:  # fmt: skip
    """``torch.gru_cell`` of B models."""
    gates_x, gates_h, h, batched = _cell_gates(input, hx, w_ih, w_hh, b_ih, b_hh, layout, shared)
    batch, per_model = gates_x.shape[:2]
    rows = batch * per_model
    h_new = gru_step(gates_x.reshape(rows, -1), gates_h.reshape(rows, -1), h.to(gates_x.dtype).reshape(rows, -1))
    return _merged(h_new.view(batch, per_model, -1), batched, layout)


def lstm_cell(
    input: Tensor, hx: tuple[Tensor, Tensor] | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
    b_hh: Tensor | None = None, *, layout: Layout, shared: tuple[bool, ...] = (),
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``torch.lstm_cell`` of B models."""
    if hx is not None and (not isinstance(hx, tuple) or len(hx) != 2):
        raise TypeError("lstm_cell: expected hx as a tuple (h_0, c_0)")
    flags = (*shared, False, False, False)
    gates_x, gates_h, h, batched = _cell_gates(
        input, None if hx is None else hx[0], w_ih, w_hh, b_ih, b_hh, layout, flags[:2]
    )
    c = h.new_zeros(h.shape) if hx is None else _rows(hx[1], w_hh.shape[-1], flags[2], layout, "cell state")[0]
    batch, per_model = gates_x.shape[:2]
    rows = batch * per_model
    c = c.to(gates_x.dtype).reshape(rows, -1)
    h_new, c_new = lstm_step(gates_x.reshape(rows, -1), gates_h.reshape(rows, -1), c)
    return (
        _merged(h_new.view(batch, per_model, -1), batched, layout),
        _merged(c_new.view(batch, per_model, -1), batched, layout),
    )


for _cell, _state, _tensors, _returns in (
    (rnn_tanh_cell, "h", "input, hx", ""),
    (rnn_relu_cell, "h", "input, hx", ""),
    (gru_cell, "h", "input, hx", ""),
    (lstm_cell, "the tuple (h, c), each", "input, h, c", ": h' and c'"),
):
    _cell.__doc__ += _CELL_ARGS.format(state=_state, tensors=_tensors, returns=_returns)
