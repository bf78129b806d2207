"""batch_layers.functional's norms against B plain torch.nn.functional calls (float64, outputs, gradients and
running statistics), in both merged orders, channels-last and on the shared input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.functional_reference import assert_matches_plain

from batch_layers import functional as BF
from batch_layers.functional import Layout

B, N, C = 3, 4, 6
ORDERS = ["models", "samples"]


def _tensor(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(grad)


def _inputs(*shape: int) -> list[torch.Tensor]:
    return [torch.randn(N, *shape, dtype=torch.float64) for _ in range(B)]


class _PerModelStats:
    """Running statistics ``(B, C)`` for the batched call and each model's own copy for its plain call (the
    plain calls run model by model, in order)."""

    def __init__(self) -> None:
        self.mean = torch.randn(B, C, dtype=torch.float64)
        self.var = torch.rand(B, C, dtype=torch.float64) + 0.5
        self.own = [(self.mean[i].clone(), self.var[i].clone()) for i in range(B)]
        self.calls = 0

    def next_model(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.own[self.calls - 1]

    def assert_updated_alike(self) -> None:
        assert self.calls == B
        for i, (mean, var) in enumerate(self.own):
            torch.testing.assert_close(self.mean[i], mean, atol=1e-12, rtol=1e-10)
            torch.testing.assert_close(self.var[i], var, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_batch_norm_matches_b_plain_calls(order: str, training: bool, channels_last: bool) -> None:
    torch.manual_seed(0)
    layout, stats = Layout(B, order), _PerModelStats()
    y = assert_matches_plain(
        lambda x, w, b: BF.batch_norm(x, stats.mean, stats.var, w, b, training, 0.1, 1e-5, layout=layout),
        lambda x, w, b: F.batch_norm(x, *stats.next_model(), w, b, training, 0.1, 1e-5),
        _inputs(C, 3, 3),
        [_tensor(B, C), _tensor(B, C)],
        layout,
        channels_last=channels_last,
    )
    stats.assert_updated_alike()
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last


@pytest.mark.parametrize("order", ORDERS)
def test_batch_norm_with_momentum_none_averages_each_models_batches(order: str) -> None:
    torch.manual_seed(0)
    layout, stats = Layout(B, order), _PerModelStats()
    tracked = torch.tensor([1, 2, 5])  # each model's count, this batch included

    def plain(x, w, b):
        i = stats.calls
        return F.batch_norm(x, *stats.next_model(), w, b, True, 1.0 / float(tracked[i]), 1e-5)

    assert_matches_plain(
        lambda x, w, b: BF.batch_norm(x, stats.mean, stats.var, w, b, True, None, layout=layout,
                                      num_batches_tracked=tracked),
        plain,
        _inputs(C, 5),
        [_tensor(B, C), _tensor(B, C)],
        layout,
    )
    stats.assert_updated_alike()


@pytest.mark.parametrize("order", ORDERS)
def test_batch_norm_of_a_shared_input(order: str) -> None:
    torch.manual_seed(0)
    layout, stats = Layout(B, order), _PerModelStats()
    assert_matches_plain(
        lambda x, w, b: BF.batch_norm(x, stats.mean, stats.var, w, b, True, layout=layout, shared=True),
        lambda x, w, b: F.batch_norm(x, *stats.next_model(), w, b, True),
        torch.randn(N, C, 3, 3, dtype=torch.float64).to(memory_format=torch.channels_last),
        [_tensor(B, C), _tensor(B, C)],
        layout,
    )
    stats.assert_updated_alike()


def test_batch_norm_with_momentum_none_needs_the_batch_counts() -> None:
    with pytest.raises(ValueError, match=r"momentum=None .* needs each model's num_batches_tracked"):
        BF.batch_norm(torch.randn(6, C), torch.zeros(3, C), torch.ones(3, C), training=True, momentum=None,
                      layout=Layout(3))


def _frozen(x, mean, var, w, b):
    """torchvision's FrozenBatchNorm2d of one model."""
    scale = w * (var + 1e-5).rsqrt()
    return x * scale[:, None, None] + (b - mean * scale)[:, None, None]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
def test_frozen_batch_norm(order: str, shared: bool) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    stats = [_tensor(B, C, grad=False), torch.rand(B, C, dtype=torch.float64) + 0.5]
    assert_matches_plain(
        lambda x, m, v, w, b: BF.frozen_batch_norm(x, m, v, w, b, layout=layout, shared=shared),
        _frozen,
        torch.randn(N, C, 3, 3, dtype=torch.float64) if shared else _inputs(C, 3, 3),
        [*stats, _tensor(B, C, grad=False), _tensor(B, C, grad=False)],
        layout,
    )


PER_SAMPLE_CASES = {
    # name: (batched, plain, per-model input shape, per-model parameter shapes (None: no such parameter))
    "layer_norm": (lambda x, w, b, layout, shared: BF.layer_norm(x, (5, C), w, b, 1e-5, layout=layout, shared=shared),
                   lambda x, w, b: F.layer_norm(x, (5, C), w, b, 1e-5), (3, 5, C), [(5, C), (5, C)]),
    "layer_norm-no-bias": (lambda x, w, layout, shared: BF.layer_norm(x, (C,), w, layout=layout, shared=shared),
                           lambda x, w: F.layer_norm(x, (C,), w), (C,), [(C,)]),
    "rms_norm": (lambda x, w, layout, shared: BF.rms_norm(x, (C,), w, 1e-6, layout=layout, shared=shared),
                 lambda x, w: F.rms_norm(x, (C,), w, 1e-6), (2, C), [(C,)]),
    "group_norm": (lambda x, w, b, layout, shared: BF.group_norm(x, 3, w, b, layout=layout, shared=shared),
                   lambda x, w, b: F.group_norm(x, 3, w, b), (C, 4, 4), [(C,), (C,)]),
    "group_norm-1d-weight-only": (lambda x, w, layout, shared: BF.group_norm(x, 2, w, layout=layout, shared=shared),
                                  lambda x, w: F.group_norm(x, 2, w), (C, 5), [(C,)]),
    "layer_norm-bias-only": (lambda x, b, layout, shared: BF.layer_norm(x, (C,), None, b, layout=layout,
                                                                        shared=shared),
                             lambda x, b: F.layer_norm(x, (C,), None, b), (C,), [(C,)]),
    "instance_norm-affine": (lambda x, w, b, layout, shared: BF.instance_norm(x, None, None, w, b, layout=layout,
                                                                              shared=shared),
                             lambda x, w, b: F.instance_norm(x, None, None, w, b), (C, 5, 5), [(C,), (C,)]),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
@pytest.mark.parametrize("name", list(PER_SAMPLE_CASES))
def test_per_sample_norm_matches_b_plain_calls(name: str, shared: bool, order: str) -> None:
    torch.manual_seed(0)
    batched, plain, in_shape, param_shapes = PER_SAMPLE_CASES[name]
    layout = Layout(B, order)
    inputs = torch.randn(N, *in_shape, dtype=torch.float64) if shared else _inputs(*in_shape)
    assert_matches_plain(
        lambda x, *params: batched(x, *params, layout=layout, shared=shared),
        plain,
        inputs,
        [_tensor(B, *shape) for shape in param_shapes],
        layout,
    )


def test_layer_norm_without_an_affine_leaves_a_shared_input_shared() -> None:
    x = torch.randn(N, C)
    torch.testing.assert_close(BF.layer_norm(x, (C,), layout=Layout(B), shared=True), F.layer_norm(x, (C,)))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
def test_instance_norm_moves_each_models_running_statistics(order: str, shared: bool) -> None:
    torch.manual_seed(0)
    layout, stats = Layout(B, order), _PerModelStats()
    assert_matches_plain(
        lambda x, w, b: BF.instance_norm(x, stats.mean, stats.var, w, b, True, 0.3, layout=layout, shared=shared),
        lambda x, w, b: F.instance_norm(x, *stats.next_model(), w, b, True, 0.3),
        torch.randn(N, C, 4, 4, dtype=torch.float64) if shared else _inputs(C, 4, 4),
        [_tensor(B, C), _tensor(B, C)],
        layout,
    )
    stats.assert_updated_alike()


@pytest.mark.parametrize("order", ORDERS)
def test_instance_norm_with_running_statistics_in_evaluation(order: str) -> None:
    torch.manual_seed(0)
    layout, stats = Layout(B, order), _PerModelStats()
    assert_matches_plain(
        lambda x, w, b: BF.instance_norm(x, stats.mean, stats.var, w, b, False, layout=layout),
        lambda x, w, b: F.instance_norm(x, *stats.next_model(), w, b, False),
        _inputs(C, 7),
        [_tensor(B, C), _tensor(B, C)],
        layout,
    )


def test_instance_norm_without_input_statistics_needs_running_statistics() -> None:
    with pytest.raises(ValueError, match="expected running_mean and running_var when use_input_stats=False"):
        BF.instance_norm(torch.randn(6, C, 5), use_input_stats=False, layout=Layout(3))
