"""Batched RNN / LSTM / GRU and their cells against B independently held torch layers.

The layer case table covers batch-first layers and the cells; here: sequence-first and unbatched layouts,
packed sequences (unsorted, with per-model lengths), initial states, projections, dropout masks between
layers, initialisation, errors, and (on CUDA) the fused cell kernels and bf16 autocast.
"""

from __future__ import annotations

import pytest
import torch
from support.layer_cases import batched_from
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import batch_layers
from batch_layers.functional import _recurrent_cells
from torchmb import BatchModule
from torchmb.testing import assert_equivalent

B, N, T, F, H = 3, 4, 6, 5, 7


def run_against_plain(
    cls: type[nn.Module],
    kwargs: dict,
    layout: str = "seq_first",
    packed: bool = False,
    initial_state: bool = False,
    device: str = "cpu",
    enforce_sorted: bool = False,
    atol: float = 1e-5,
) -> None:
    """Outputs, final states, input gradients and parameter gradients of every model."""
    torch.manual_seed(0)
    batch_first = layout == "batch_first"
    plain = [cls(F, H, batch_first=batch_first, **kwargs).to(device) for _ in range(B)]
    batched = batched_from(plain).to(device)
    directions = 2 if kwargs.get("bidirectional") else 1
    states = kwargs.get("num_layers", 1) * directions
    out_hidden = kwargs.get("proj_size", 0) or H
    unbatched = layout == "unbatched"
    x = torch.randn(B, T, F, device=device) if unbatched else torch.randn(B, N, T, F, device=device)
    if enforce_sorted:
        # sorted over all B*N merged sequences: model b's are at least as long as model b+1's
        lengths = torch.arange(B * N, 0, -1).div(2, rounding_mode="floor").clamp(1, T).view(B, N)
    else:
        lengths = torch.randint(1, T + 1, (B, N))
        lengths[0, 0] = T
    h0 = torch.randn(B, states, *(() if unbatched else (N,)), out_hidden, device=device)
    c0 = torch.randn(B, states, *(() if unbatched else (N,)), H, device=device)

    x_merged = x.reshape(-1, F) if unbatched else x.reshape(-1, T, F)
    x_merged.requires_grad_()
    inp = x_merged if batch_first or unbatched else x_merged.transpose(0, 1)
    if packed:
        inp = pack_padded_sequence(inp, lengths.flatten(), batch_first=batch_first, enforce_sorted=enforce_sorted)
    hx = None
    if initial_state:
        if unbatched:
            h_m, c_m = h0.reshape(-1, out_hidden), c0.reshape(-1, H)
        else:
            h_m, c_m = h0.transpose(0, 1).reshape(states, -1, out_hidden), c0.transpose(0, 1).reshape(states, -1, H)
        hx = (h_m, c_m) if cls is nn.LSTM else h_m
    out, hidden = batched(inp, hx)
    if packed:
        assert isinstance(out, PackedSequence)
        assert torch.equal(out.batch_sizes, inp.batch_sizes)
        for got, want in ((out.sorted_indices, inp.sorted_indices), (out.unsorted_indices, inp.unsorted_indices)):
            assert (got is None and want is None) or torch.equal(got, want)
        out, _ = pad_packed_sequence(out, batch_first=batch_first)
    finals = list(hidden) if isinstance(hidden, tuple) else [hidden]
    grads = [torch.randn_like(t) for t in (out, *finals)]
    torch.autograd.backward([out, *finals], grads)

    def model_view(t: Tensor, i: int, merged_dim: int) -> Tensor:
        if unbatched:
            return t.view(B, -1, *t.shape[1:])[i].reshape(-1, *t.shape[1:])
        t = t.movedim(merged_dim, 0)
        return t.view(B, -1, *t.shape[1:])[i].movedim(0, merged_dim)

    out_dim = 0 if batch_first else 1
    for i, layer in enumerate(plain):
        x_i = x[i].clone().requires_grad_()
        inp_i = x_i if batch_first or unbatched else x_i.transpose(0, 1)
        if packed:
            inp_i = pack_padded_sequence(inp_i, lengths[i], batch_first=batch_first, enforce_sorted=enforce_sorted)
        hx_i = None
        if initial_state:
            hx_i = (h0[i], c0[i]) if cls is nn.LSTM else h0[i]
        out_i, hidden_i = layer(inp_i, hx_i)
        if packed:
            out_i, _ = pad_packed_sequence(out_i, batch_first=batch_first, total_length=out.shape[1 - out_dim])
        finals_i = list(hidden_i) if isinstance(hidden_i, tuple) else [hidden_i]
        torch.autograd.backward(
            [out_i, *finals_i],
            [model_view(grads[0], i, out_dim), *(model_view(g, i, 1) for g in grads[1:])],
        )
        torch.testing.assert_close(model_view(out, i, out_dim), out_i, atol=atol, rtol=0)
        for got, want in zip(finals, finals_i):
            torch.testing.assert_close(model_view(got, i, 1), want, atol=atol, rtol=0)
        torch.testing.assert_close(x_merged.grad.view(B, *x.shape[1:])[i], x_i.grad, atol=atol, rtol=0)
        for name, param in layer.named_parameters():
            torch.testing.assert_close(batched.get_parameter(name).grad[i], param.grad, atol=atol, rtol=0, msg=name)


KINDS = {
    "rnn-tanh": (nn.RNN, {}),
    "rnn-relu-2-layers-bidirectional": (nn.RNN, {"nonlinearity": "relu", "num_layers": 2, "bidirectional": True}),
    "lstm-2-layers-bidirectional": (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
    "lstm-nobias": (nn.LSTM, {"bias": False}),
    "gru-2-layers-bidirectional": (nn.GRU, {"num_layers": 2, "bidirectional": True}),
    "gru-nobias": (nn.GRU, {"bias": False}),
}


@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "unbatched"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_layouts_with_initial_states(kind: str, layout: str) -> None:
    cls, kwargs = KINDS[kind]
    run_against_plain(cls, kwargs, layout, initial_state=True)


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_sequences(kind: str, batch_first: bool) -> None:
    cls, kwargs = KINDS[kind]
    run_against_plain(cls, kwargs, "batch_first" if batch_first else "seq_first", packed=True, initial_state=True)


def test_packed_sequences_sorted() -> None:
    run_against_plain(nn.GRU, {"bidirectional": True}, packed=True, enforce_sorted=True)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_lstm_projections(packed: bool) -> None:
    kwargs = {"num_layers": 2, "bidirectional": True, "proj_size": 3}
    run_against_plain(nn.LSTM, kwargs, "batch_first", packed=packed, initial_state=True)


def test_lstm_lm_batches_without_fallback() -> None:
    from support.lstm_lm import LSTMLM

    model = BatchModule(LSTMLM(), B)
    assert model.generic_modules == []
    assert isinstance(model.module.lstm, batch_layers.LSTM)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_shared_input_through_batch_module(batch_first: bool) -> None:
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(F, H, 2, batch_first=batch_first, bidirectional=True)
            self.head = nn.Linear(2 * H, 3)

        def forward(self, x: Tensor) -> Tensor:  # x: (n, T, F), the same for every model
            out, _ = self.lstm(x if batch_first else x.transpose(0, 1))
            return self.head(out if batch_first else out.transpose(0, 1))

    torch.manual_seed(0)
    assert assert_equivalent(Reader, B, torch.randn(N, T, F), steps=2, shared_input=True)


def test_shared_packed_input_through_batch_module() -> None:
    class PackedReader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(F, H, batch_first=True, bidirectional=True)

        def forward(self, x: Tensor, lengths: Tensor) -> Tensor:  # the same (n, T, F) batch for every model
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, h = self.gru(packed)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
            return out + torch.cat(list(h), dim=-1).unsqueeze(1)  # final states of both directions too

    torch.manual_seed(0)
    inputs = (torch.randn(B * N, T, F), torch.randint(1, T + 1, (B * N,)))  # n = B*N: a multiple of B on purpose
    assert assert_equivalent(PackedReader, B, inputs, steps=2, shared_input=True)


def test_models_that_flatten_parameters_still_run() -> None:
    class Flattening(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(F, H, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            self.rnn.flatten_parameters()  # common in models written for DataParallel
            return self.rnn(x)[0]

    torch.manual_seed(0)
    assert assert_equivalent(Flattening, B, torch.randn(B, N, T, F), steps=1)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_dropout_between_layers_is_independent_across_models(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    layer = batched_from([cls(F, H, 2, dropout=0.5, batch_first=True)] * B)  # every model: the same weights
    x = torch.randn(1, T, F).expand(B, T, F).contiguous()  # and the same sample
    layer.train()
    out = layer(x)[0]
    assert all(not torch.equal(out[0], out[i]) for i in range(1, B)), "models drew the same dropout mask"
    layer.eval()
    out = layer(x)[0]
    for i in range(1, B):  # no dropout: equal up to the rounding of the CPU's batched matmul kernels
        torch.testing.assert_close(out[i], out[0])


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(nn.LSTM, {"num_layers": 2, "bidirectional": True, "proj_size": 3}), (nn.GRU, {}), (nn.RNN, {"bias": False})],
    ids=["lstm", "gru", "rnn"],
)
def test_reset_parameters_draws_like_b_torch_layers(cls: type[nn.Module], kwargs: dict) -> None:
    batched_cls = {nn.LSTM: batch_layers.LSTM, nn.GRU: batch_layers.GRU, nn.RNN: batch_layers.RNN}[cls]
    torch.manual_seed(0)
    batched = batched_cls(F, H, batch=4, **kwargs)
    torch.manual_seed(0)
    plain = [cls(F, H, **kwargs) for _ in range(4)]
    for i, layer in enumerate(plain):
        for name, param in layer.named_parameters():
            assert torch.equal(batched.get_parameter(name)[i], param), name
    assert not torch.equal(batched.weight_ih_l0[0], batched.weight_ih_l0[1])


@pytest.mark.parametrize("cls", [nn.RNNCell, nn.LSTMCell, nn.GRUCell])
def test_cells_draw_like_torch_and_take_states_and_unbatched_inputs(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    batched = batched_from([cls(F, H) for _ in range(B)])  # positional construction: same draws below
    torch.manual_seed(0)
    plain = [cls(F, H) for _ in range(B)]
    for i, layer in enumerate(plain):
        for name, param in layer.named_parameters():
            assert torch.equal(batched.get_parameter(name)[i], param)
    x, h, c = torch.randn(B, N, F), torch.randn(B, N, H), torch.randn(B, N, H)
    for unbatched in (False, True):
        xs, hs, cs = (t[:, 0] for t in (x, h, c)) if unbatched else (x, h, c)
        merged = [t.reshape(-1) if unbatched else t.reshape(-1, t.shape[-1]) for t in (xs, hs, cs)]
        state = (merged[1], merged[2]) if cls is nn.LSTMCell else merged[1]
        out = batched(merged[0], state)
        outs = out if isinstance(out, tuple) else (out,)
        for i, layer in enumerate(plain):
            want = layer(xs[i], (hs[i], cs[i]) if cls is nn.LSTMCell else hs[i])
            wants = want if isinstance(want, tuple) else (want,)
            for got, expected in zip(outs, wants):
                torch.testing.assert_close(got.view(B, *expected.shape)[i], expected)


def test_cell_through_batch_module_with_a_loop() -> None:
    class Stepper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.LSTMCell(F, H)
            self.out = nn.Linear(H, 2)

        def forward(self, x: Tensor) -> Tensor:  # x: (n, T, F)
            h = c = x.new_zeros(x.shape[0], H)
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
            return self.out(h)

    torch.manual_seed(0)
    assert assert_equivalent(Stepper, B, torch.randn(B, N, T, F), steps=2)


def test_refuses_bad_inputs() -> None:
    layer = batch_layers.LSTM(F, H, batch_first=True, batch=B)
    with pytest.raises(ValueError, match=r"expected input with 5 features \(input_size\), got shape \(6, 4, 3\)"):
        layer(torch.randn(6, 4, 3))
    with pytest.raises(ValueError, match=r"batch dim \(0\) to be a multiple of B = 3"):
        layer(torch.randn(4, T, F))
    with pytest.raises(ValueError, match=r"expected h_0 of shape \(1, 6, 7\), got \(1, 5, 7\)"):
        layer(torch.randn(6, T, F), (torch.zeros(1, 5, H), torch.zeros(1, 6, H)))
    with pytest.raises(TypeError, match=r"expected hx as a tuple \(h_0, c_0\)"):
        layer(torch.randn(6, T, F), torch.zeros(1, 6, H))
    with pytest.raises(TypeError, match="floating-point input"):
        layer(torch.zeros(6, T, F, dtype=torch.long))

    class SequenceFirstAtTheBoundary(nn.Module):  # (T, N, F) per model: BatchModule merges models into T
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(F, H)

        def forward(self, x: Tensor) -> Tensor:
            return self.rnn(x)[0]

    with pytest.raises(ValueError, match=r"multiple of B \* n = 3 \* 6 .* transpose them itself"):
        BatchModule(SequenceFirstAtTheBoundary(), B)(torch.randn(B, T, B * 2, F))
    packed = pack_padded_sequence(torch.randn(4, T, F), torch.tensor([6, 5, 4, 3]), batch_first=True)
    with pytest.raises(
        ValueError, match=r"PackedSequence of a multiple of B = 3 sequences \(the merged model axis\), got 4"
    ):
        layer(packed)
    with pytest.raises(ValueError, match="has to be smaller than hidden_size"):
        batch_layers.LSTM(F, H, proj_size=H, batch=B)
    with pytest.raises(ValueError, match="Unknown nonlinearity"):
        batch_layers.RNN(F, H, nonlinearity="gelu", batch=B)
    with pytest.raises(ValueError, match=r"hidden state of shape \(B\*N, 7\), got \(6, 6\)"):
        batch_layers.GRUCell(F, H, batch=B)(torch.randn(6, F), torch.randn(6, 6))


# -- CUDA: fused cell kernels, bf16 autocast ------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["lstm-2-layers-bidirectional", "gru-2-layers-bidirectional", "rnn-tanh"])
def test_cuda_packed_matches_plain(kind: str) -> None:
    cls, kwargs = KINDS[kind]
    run_against_plain(cls, kwargs, "batch_first", packed=True, initial_state=True, device="cuda", atol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_cuda_fused_cells_run_and_match_the_reference_maths(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    rows, hidden = 10, 16
    gates = 4 if mode == "LSTM" else 3
    gx, gh = (torch.randn(rows, gates * hidden, device="cuda", requires_grad=True) for _ in range(2))
    state = torch.randn(rows, hidden, device="cuda", requires_grad=True)
    name = "_FUSED_LSTM" if mode == "LSTM" else "_FUSED_GRU"
    original, calls = getattr(_recurrent_cells, name), []
    assert original is not None, f"torch has no fused {mode} cell kernel"
    monkeypatch.setattr(_recurrent_cells, name, lambda *a: calls.append(1) or original(*a))
    step = _recurrent_cells.lstm_step if mode == "LSTM" else _recurrent_cells.gru_step
    fused = step(gx, gh, state)
    assert calls, "the fused CUDA kernel did not run"
    monkeypatch.setattr(_recurrent_cells, "_fused_cells", lambda t: False)
    reference = step(gx, gh, state)
    fused, reference = (list(r) if isinstance(r, tuple) else [r] for r in (fused, reference))
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    grads_fused = torch.autograd.grad(sum(t.square().sum() for t in fused), (gx, gh, state))
    grads_reference = torch.autograd.grad(sum(t.square().sum() for t in reference), (gx, gh, state))
    for a, b in zip(grads_fused, grads_reference):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_cuda_bf16_autocast(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    plain = [cls(F, H, 2, batch_first=True).cuda() for _ in range(B)]
    batched = batched_from(plain).cuda()
    x = torch.randn(B, N, T, F, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = batched(x.reshape(-1, T, F))
        for i, layer in enumerate(plain):
            want, _ = layer(x[i])
            # bf16 has 8 mantissa bits; both sides round differently (cuDNN vs batched products)
            torch.testing.assert_close(out.view(B, N, T, -1)[i].float(), want.float(), atol=3e-2, rtol=3e-2)
