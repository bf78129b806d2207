"""``batch_layers.functional``'s linear, bilinear, prelu, dropout, attention and recurrent functions against B
plain torch calls, one per model, in float64: outputs and the gradients of every weight and input, in both
merged orders, with the shared ``(n, ...)`` input where a function has a path for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batch_layers import functional
from batch_layers.functional import Layout

B, N = 3, 4
DOUBLE = torch.float64
ORDERS = ["models", "samples"]


def assert_like_plain(
    batched: Callable[[list[Tensor], list[Tensor]], list[list[Tensor]]],
    plain: Callable[[list[Tensor], list[Tensor], int], list[Tensor]],
    weights: Sequence[Tensor],
    inputs: Sequence[Tensor],
    shared: Sequence[bool] = (),
) -> None:
    """``batched(weights, inputs)`` gives each model's outputs; ``plain(weights[b], inputs[b], b)`` model b's
    alone (a shared input whole). Outputs and the gradients of a random loss on them must agree."""
    shared = [*shared, *([False] * len(inputs))][: len(inputs)]
    weights = [w.detach().requires_grad_() for w in weights]
    inputs = [x.detach().requires_grad_() for x in inputs]
    per_model = batched(weights, inputs)
    assert len(per_model) == B
    cotangents = [[torch.randn_like(out) for out in outs] for outs in per_model]
    loss = sum((out * c).sum() for outs, cs in zip(per_model, cotangents) for out, c in zip(outs, cs))
    grads = torch.autograd.grad(loss, [*weights, *inputs], allow_unused=True)
    shared_grads = [torch.zeros_like(x) for x in inputs]
    for b in range(B):
        plain_weights = [w[b].detach().requires_grad_() for w in weights]
        plain_inputs = [(x if s else x[b]).detach().requires_grad_() for x, s in zip(inputs, shared)]
        expected = plain(plain_weights, plain_inputs, b)
        assert len(expected) == len(per_model[b])
        for got, want in zip(per_model[b], expected):
            torch.testing.assert_close(got, want)
        loss = sum((out * c).sum() for out, c in zip(expected, cotangents[b]))
        want_grads = torch.autograd.grad(loss, [*plain_weights, *plain_inputs], allow_unused=True)
        for i, want in enumerate(want_grads):
            got = grads[i]
            if i >= len(weights) and shared[i - len(weights)]:
                shared_grads[i - len(weights)] += 0 if want is None else want
                continue
            if want is None:
                assert got is None or not got[b].any()
            else:
                torch.testing.assert_close(got[b], want)
    for s, got, want in zip(shared, grads[len(weights) :], shared_grads):
        if s:
            torch.testing.assert_close(got, want)


def merged(x: Tensor, layout: Layout, shared: bool = False) -> Tensor:
    """A per-model ``(B, n, ...)`` tensor merged in ``layout``'s order (a shared one as it is)."""
    return x if shared else layout.merge(x)


# -- linear, transposed linear, bilinear ---------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(order: str, shared: bool, bias: bool) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    weights = [torch.randn(B, 5, 3, dtype=DOUBLE)] + ([torch.randn(B, 5, dtype=DOUBLE)] if bias else [])
    x = torch.randn(N, 2, 3, dtype=DOUBLE) if shared else torch.randn(B, N, 2, 3, dtype=DOUBLE)

    def batched(w, xs):
        y = functional.linear(merged(xs[0], layout, shared), *w, layout=layout, shared=shared)
        assert y.shape == (B * N, 2, 5)
        return [[out] for out in layout.split(y)]

    assert_like_plain(batched, lambda w, xs, b: [F.linear(xs[0], *w)], weights, [x], [shared])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True])
def test_transposed_linear(order: str, shared: bool) -> None:
    torch.manual_seed(1)
    layout = Layout(B, order)
    weights = [torch.randn(B, 3, 5, dtype=DOUBLE), torch.randn(B, 5, dtype=DOUBLE)]
    x = torch.randn(N, 3, dtype=DOUBLE) if shared else torch.randn(B, N, 3, dtype=DOUBLE)

    def batched(w, xs):
        y = functional.transposed_linear(merged(xs[0], layout, shared), *w, layout=layout, shared=shared)
        return [[out] for out in layout.split(y)]

    def plain(w, xs, b):  # transformers' Conv1D: addmm(bias, x, weight)
        return [torch.addmm(w[1], xs[0], w[0])]

    assert_like_plain(batched, plain, weights, [x], [shared])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("sizes", [(5, 4, 3), (2, 6, 7), (6, 2, 7), (3, 3, 9)])
def test_bilinear(order: str, shared: tuple[bool, bool], sizes: tuple[int, int, int]) -> None:
    """Every contraction order (first input, second input, outer product) and each shared input."""
    torch.manual_seed(2)
    layout = Layout(B, order)
    in1, in2, out = sizes
    weights = [torch.randn(B, out, in1, in2, dtype=DOUBLE), torch.randn(B, out, dtype=DOUBLE)]
    x1, x2 = (
        torch.randn(N, 2, size, dtype=DOUBLE) if s else torch.randn(B, N, 2, size, dtype=DOUBLE)
        for s, size in zip(shared, (in1, in2))
    )

    def batched(w, xs):
        inputs = [merged(x, layout, s) for x, s in zip(xs, shared)]
        y = functional.bilinear(*inputs, *w, layout=layout, shared=shared)
        assert y.shape == (B * N, 2, out)
        return [[row] for row in layout.split(y)]

    assert_like_plain(batched, lambda w, xs, b: [F.bilinear(*xs, *w)], weights, [x1, x2], shared)


def test_bilinear_refuses_inputs_that_disagree() -> None:
    weight = torch.randn(B, 2, 3, 4)
    with pytest.raises(ValueError, match="must agree in every dim but the last"):
        functional.bilinear(torch.randn(B * 2, 3), torch.randn(B * 3, 4), weight, layout=Layout(B))


def test_linear_refuses_rows_that_are_not_b_models() -> None:
    with pytest.raises(ValueError, match=r"multiple of B = 3 \(the merged model axis\), got shape \(4, 2\)"):
        functional.linear(torch.randn(4, 2), torch.randn(B, 5, 2), layout=Layout(B))


# -- prelu ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("channels", [1, 4])
def test_prelu(order: str, shared: bool, channels: int) -> None:
    torch.manual_seed(3)
    layout = Layout(B, order)
    weights = [torch.rand(B, channels, dtype=DOUBLE)]
    shape = (N, 4, 5)
    x = torch.randn(*shape, dtype=DOUBLE) if shared else torch.randn(B, *shape, dtype=DOUBLE)

    def batched(w, xs):
        y = functional.prelu(merged(xs[0], layout, shared), *w, layout=layout, shared=shared)
        return [[row] for row in layout.split(y)]

    assert_like_plain(batched, lambda w, xs, b: [F.prelu(xs[0], w[0])], weights, [x], [shared])


def test_prelu_refuses_an_input_without_its_channels() -> None:
    with pytest.raises(ValueError, match=r"expected an input of shape \(B\*n, 4, \*\) for 4 slopes per model"):
        functional.prelu(torch.randn(B * 2, 3), torch.rand(B, 4), layout=Layout(B))


# -- dropout -------------------------------------------------------------------------------------------------

DROPOUTS = {
    "dropout": (functional.dropout, F.dropout, (N, 50)),
    "dropout1d": (functional.dropout1d, F.dropout1d, (N, 40, 3)),
    "dropout2d": (functional.dropout2d, F.dropout2d, (N, 40, 3, 2)),
    "dropout3d": (functional.dropout3d, F.dropout3d, (N, 40, 2, 2, 2)),
    "alpha_dropout": (functional.alpha_dropout, F.alpha_dropout, (N, 50)),
    "feature_alpha_dropout": (functional.feature_alpha_dropout, F.feature_alpha_dropout, (N, 40, 3, 2)),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", sorted(DROPOUTS))
def test_dropout_of_merged_rows_is_torchs(order: str, name: str) -> None:
    """On a merged input the batched dropout is torch's: under one seed, the same numbers."""
    batched, plain, shape = DROPOUTS[name]
    x = torch.randn(B * shape[0], *shape[1:], dtype=DOUBLE)
    torch.manual_seed(4)
    got = batched(x, 0.3, True, layout=Layout(B, order))
    torch.manual_seed(4)
    torch.testing.assert_close(got, plain(x, 0.3, True))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", sorted(DROPOUTS))
def test_dropout_of_a_shared_input_draws_a_mask_per_model(order: str, name: str) -> None:
    batched, plain, shape = DROPOUTS[name]
    layout = Layout(B, order)
    x = (torch.rand(*shape, dtype=DOUBLE) + 0.5).requires_grad_()
    torch.manual_seed(5)
    y = batched(x, 0.4, True, layout=layout, shared=True)
    assert y.shape == (B * shape[0], *shape[1:])
    torch.manual_seed(5)  # the same draw as torch's dropout of B copies of x, merged in the layout's order
    expected = plain(functional.expand_shared(x.detach(), layout), 0.4, True)
    torch.testing.assert_close(y, expected)
    per_model = layout.split(y)
    assert all(not torch.equal(per_model[0], per_model[b]) for b in range(1, B))
    (grad,) = torch.autograd.grad(y.sum(), x)
    ones = torch.ones_like(x).requires_grad_()
    torch.manual_seed(5)
    (want,) = torch.autograd.grad(plain(functional.expand_shared(ones, layout), 0.4, True).sum(), ones)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("order", ORDERS)
def test_expand_shared_gives_every_model_the_input(order: str) -> None:
    layout = Layout(B, order)
    for x in (torch.randn(N, 3, 5), torch.randn(N, 3, 4, 5).to(memory_format=torch.channels_last)):
        expanded = functional.expand_shared(x, layout)
        assert expanded.is_contiguous(memory_format=torch.channels_last) == (x.dim() == 4)
        for b in range(B):
            torch.testing.assert_close(layout.split(expanded)[b], x)


def test_inactive_dropout_keeps_a_shared_input_shared() -> None:
    x = torch.randn(N, 5)
    assert functional.dropout(x, 0.5, False, layout=Layout(B), shared=True) is x
    assert functional.dropout(x, 0.0, True, layout=Layout(B), shared=True).shape == (N, 5)


# -- multi-head attention ------------------------------------------------------------------------------------

E, HEADS, L, S = 8, 2, 3, 5


def _attention_weights(separate: bool, add_bias_kv: bool) -> tuple[list[Tensor], dict[str, int]]:
    """Per-model weights in the order ``_attention_call`` takes them, and where each sits."""
    shapes = {"in_proj_bias": (3 * E,), "out_proj_weight": (E, E), "out_proj_bias": (E,)}
    if separate:
        shapes.update(q_proj_weight=(E, E), k_proj_weight=(E, 6), v_proj_weight=(E, 7))
    else:
        shapes["in_proj_weight"] = (3 * E, E)
    if add_bias_kv:
        shapes.update(bias_k=(1, 1, E), bias_v=(1, 1, E))
    index = {name: i for i, name in enumerate(shapes)}
    return [torch.randn(B, *shape, dtype=DOUBLE) / 2 for shape in shapes.values()], index


def _attention_call(mha, weights, index, query, key, value, **kwargs):
    def get(name):
        return weights[index[name]] if name in index else None

    return mha(
        query, key, value, E, HEADS, get("in_proj_weight"), get("in_proj_bias"), get("bias_k"), get("bias_v"),
        kwargs.pop("add_zero_attn", False), 0.0, get("out_proj_weight"), get("out_proj_bias"),
        use_separate_proj_weight="q_proj_weight" in index, q_proj_weight=get("q_proj_weight"),
        k_proj_weight=get("k_proj_weight"), v_proj_weight=get("v_proj_weight"), **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize(
    "case", ["self", "self-shared", "cross", "cross-shared-memory", "separate", "bias-kv-zero-attn", "sdpa"]
)
def test_multi_head_attention_forward(order: str, batch_first: bool, case: str) -> None:
    torch.manual_seed(6)
    layout = Layout(B, order)
    weights, index = _attention_weights(case == "separate", case == "bias-kv-zero-attn")
    kdim, vdim = (6, 7) if case == "separate" else (E, E)
    need_weights = case != "sdpa"
    shared = (case == "self-shared", case == "cross-shared-memory", case == "cross-shared-memory")
    kwargs = {"need_weights": need_weights, "add_zero_attn": case == "bias-kv-zero-attn"}
    padding = torch.rand(B, N, S) < 0.3
    padding[..., 0] = False
    kwargs_batched = dict(kwargs, key_padding_mask=None if case.startswith("self") else layout.merge(padding))
    self_attention = case.startswith("self")

    def per_sample(x: Tensor) -> Tensor:  # (N, T, F) to the layout the call takes
        return x if batch_first else x.transpose(0, 1)

    def merge(x: Tensor, is_shared: bool) -> Tensor:  # per-model (B, N, T, F) or shared (N, T, F)
        return per_sample(x if is_shared else layout.merge(x))

    def batched(w, xs):
        query, key, value = (merge(x, s) for x, s in zip(xs, shared))
        if self_attention:
            key = value = query
        out, attn = _attention_call(
            functional.multi_head_attention_forward, w, index, query, key, value, layout=layout,
            batch_first=batch_first, shared=shared, **kwargs_batched,
        )  # fmt: skip
        out = layout.split(out if batch_first else out.transpose(0, 1))
        if not need_weights:
            assert attn is None
            return [[o] for o in out]
        return [[o, a] for o, a in zip(out, layout.split(attn))]

    def plain(w, xs, b):
        query, key, value = (x.transpose(0, 1) for x in xs)  # torch's functional is sequence-first
        if self_attention:
            key = value = query
        mask = None if self_attention else padding[b]
        out, attn = _attention_call(
            F.multi_head_attention_forward, w, index, query, key, value, key_padding_mask=mask, **kwargs
        )
        return [out.transpose(0, 1)] + ([] if attn is None else [attn])

    src = L if self_attention else S
    inputs = [
        torch.randn(*((N,) if s else (B, N)), length, features, dtype=DOUBLE)
        for s, length, features in zip(shared, (L, src, src), (E, kdim, vdim))
    ]
    assert_like_plain(batched, plain, weights, inputs, shared)


# -- recurrent layers and cells ------------------------------------------------------------------------------

FEATURES, HIDDEN, T = 3, 4, 5
RECURRENT = {
    "rnn_tanh": (functional.rnn_tanh, lambda **kw: nn.RNN(FEATURES, HIDDEN, nonlinearity="tanh", **kw)),
    "rnn_relu": (functional.rnn_relu, lambda **kw: nn.RNN(FEATURES, HIDDEN, nonlinearity="relu", **kw)),
    "gru": (functional.gru, lambda **kw: nn.GRU(FEATURES, HIDDEN, **kw)),
    "lstm": (functional.lstm, lambda **kw: nn.LSTM(FEATURES, HIDDEN, **kw)),
    "lstm-proj": (functional.lstm, lambda **kw: nn.LSTM(FEATURES, HIDDEN, proj_size=2, **kw)),
}
RECURRENT_CASES = [  # (kind, input format, num_layers, bidirectional)
    ("rnn_tanh", "seq_first", 2, True),
    ("rnn_relu", "batch_first", 1, False),
    ("gru", "unbatched", 1, True),
    ("gru", "packed", 2, True),
    ("lstm", "seq_first", 1, False),
    ("lstm", "packed", 1, True),
    ("lstm-proj", "batch_first", 2, True),
]


def _to_call(x: Tensor, fmt: str, layout: Layout, shared: bool) -> Tensor:
    """A per-model ``(B, N, T, F)`` input (``(B, T, F)`` unbatched; one model's whole when shared) merged as
    the call takes it."""
    if fmt == "unbatched":
        return x if shared else layout.merge(x)
    rows = x if shared else layout.merge(x)  # (B*N, T, F)
    return rows if fmt == "batch_first" else rows.transpose(0, 1)


def _state_to_call(h: Tensor, fmt: str, layout: Layout, shared: bool) -> Tensor:
    """Per-model states ``(B, L*D, N, H)`` (``(B, L*D, H)`` unbatched) merged as ``(L*D, B*N, H)``."""
    if shared or fmt == "unbatched":
        return h if shared else layout.merge(h)
    return layout.merge(h.transpose(1, 2)).transpose(0, 1)


def _state_per_model(h: Tensor, fmt: str, layout: Layout) -> Tensor:
    if fmt == "unbatched":
        return layout.split(h)
    return layout.split(h.transpose(0, 1)).transpose(1, 2)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(("kind", "fmt", "layers", "bidirectional"), RECURRENT_CASES)
def test_recurrent(order: str, shared: bool, kind: str, fmt: str, layers: int, bidirectional: bool) -> None:
    if shared and fmt == "packed":
        pytest.skip("a shared packed input is checked through the layers (tests/batch_layers/test_recurrent.py)")
    torch.manual_seed(7)
    layout = Layout(B, order)
    function, make = RECURRENT[kind]
    plain = make(num_layers=layers, bidirectional=bidirectional, batch_first=fmt == "batch_first").double()
    names = plain._flat_weights_names
    weights = [torch.randn(B, *getattr(plain, name).shape, dtype=DOUBLE) / 2 for name in names]
    directions = 2 if bidirectional else 1
    out_hidden = plain.proj_size or HIDDEN
    lead = () if shared else (B,)
    per_sample = () if fmt == "unbatched" else (N,)
    x = torch.randn(*lead, *per_sample, T, FEATURES, dtype=DOUBLE)
    states = [torch.randn(*lead, layers * directions, *per_sample, size, dtype=DOUBLE)
              for size in ((out_hidden, HIDDEN) if kind.startswith("lstm") else (out_hidden,))]  # fmt: skip
    lengths = torch.randint(1, T + 1, (B, N))
    lengths[:, 0] = T

    def batched(w, xs):
        if fmt == "packed":
            padded = layout.merge(xs[0]).transpose(0, 1)  # (T, B*N, F)
            given = nn.utils.rnn.pack_padded_sequence(padded, layout.merge(lengths), enforce_sorted=False)
        else:
            given = _to_call(xs[0], fmt, layout, shared)
        hs = [_state_to_call(h, "seq_first" if fmt == "packed" else fmt, layout, shared) for h in xs[1:]]
        out, hidden = function(
            given, tuple(hs) if kind.startswith("lstm") else hs[0], w, True, layers, 0.0, False, bidirectional,
            fmt == "batch_first", layout=layout, shared=[shared] * len(xs),
        )  # fmt: skip
        if fmt == "packed":
            out = nn.utils.rnn.pad_packed_sequence(out)[0]
        if fmt in ("packed", "seq_first"):
            out = out.transpose(0, 1)
        hidden = hidden if isinstance(hidden, tuple) else (hidden,)
        state_fmt = "unbatched" if fmt == "unbatched" else "seq_first"
        finals = [_state_per_model(h, state_fmt, layout) for h in hidden]
        return [[o, *(f[b] for f in finals)] for b, o in enumerate(layout.split(out))]

    def plain_call(w, xs, b):
        given = xs[0] if fmt in ("batch_first", "unbatched") else xs[0].transpose(0, 1)
        if fmt == "packed":
            given = nn.utils.rnn.pack_padded_sequence(given, lengths[b], enforce_sorted=False)
        hx = tuple(xs[1:]) if kind.startswith("lstm") else xs[1]
        out, hidden = torch.func.functional_call(plain, dict(zip(names, w)), (given, hx))
        if fmt == "packed":
            out = nn.utils.rnn.pad_packed_sequence(out)[0]
        if fmt in ("packed", "seq_first"):
            out = out.transpose(0, 1)
        return [out, *(hidden if isinstance(hidden, tuple) else (hidden,))]

    assert_like_plain(batched, plain_call, weights, [x, *states], [shared] * (1 + len(states)))


def test_recurrent_refuses_a_wrong_number_of_parameters() -> None:
    weights = [torch.randn(B, 4 * HIDDEN, FEATURES), torch.randn(B, 4 * HIDDEN, HIDDEN), torch.randn(B, 4 * HIDDEN)]
    with pytest.raises(ValueError, match=r"LSTM: expected 4 parameters \(5 with projections\).*got 3"):
        functional.lstm(torch.randn(T, B, FEATURES), None, weights, True, 1, 0.0, False, False, False,
                        layout=Layout(B))  # fmt: skip


CELLS = {
    "rnn_tanh_cell": (functional.rnn_tanh_cell, torch.rnn_tanh_cell, 1),
    "rnn_relu_cell": (functional.rnn_relu_cell, torch.rnn_relu_cell, 1),
    "gru_cell": (functional.gru_cell, torch.gru_cell, 3),
    "lstm_cell": (functional.lstm_cell, torch.lstm_cell, 4),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("batched_models", [True, False])
@pytest.mark.parametrize("name", sorted(CELLS))
def test_cells(order: str, shared: bool, batched_models: bool, name: str) -> None:
    torch.manual_seed(8)
    layout = Layout(B, order)
    function, plain, gates = CELLS[name]
    weights = [
        torch.randn(B, gates * HIDDEN, FEATURES, dtype=DOUBLE),
        torch.randn(B, gates * HIDDEN, HIDDEN, dtype=DOUBLE),
        torch.randn(B, gates * HIDDEN, dtype=DOUBLE),
        torch.randn(B, gates * HIDDEN, dtype=DOUBLE),
    ]
    lead = () if shared else (B,)
    rows = (N,) if batched_models else ()
    x = torch.randn(*lead, *rows, FEATURES, dtype=DOUBLE)
    states = [torch.randn(*lead, *rows, HIDDEN, dtype=DOUBLE) for _ in range(2 if name == "lstm_cell" else 1)]

    def to_call(t: Tensor) -> Tensor:
        if shared:
            return t
        return layout.merge(t) if batched_models else t.reshape(-1)  # unbatched: models one after another

    def per_model(y: Tensor) -> Tensor:
        return layout.split(y) if batched_models else y.view(B, HIDDEN)

    def batched(w, xs):
        hx = tuple(to_call(h) for h in xs[1:]) if name == "lstm_cell" else to_call(xs[1])
        out = function(to_call(xs[0]), hx, *w, layout=layout, shared=[shared] * len(xs))
        outs = out if isinstance(out, tuple) else (out,)
        return [list(parts) for parts in zip(*(per_model(o).reshape(B, *rows, HIDDEN) for o in outs))]

    def plain_call(w, xs, b):
        rows_of = (lambda t: t) if batched_models else (lambda t: t.unsqueeze(0))
        hx = tuple(rows_of(h) for h in xs[1:]) if name == "lstm_cell" else rows_of(xs[1])
        out = plain(rows_of(xs[0]), hx, *w)
        outs = out if isinstance(out, tuple) else (out,)
        return [o if batched_models else o.squeeze(0) for o in outs]

    assert_like_plain(batched, plain_call, weights, [x, *states], [shared] * (1 + len(states)))
