"""batch_layers.functional's convolutions against B plain torch.nn.functional calls (float64, outputs and
gradients), in both merged orders, channels-last, on the shared input and beyond 32-bit indexing."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from support.conv_checks import compiled_conv2d_against_plain
from support.functional_reference import assert_matches_plain

import batch_layers
from batch_layers import functional as BF
from batch_layers.functional import Layout

B, N = 3, 2
ORDERS = ["models", "samples"]


def _tensor(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(grad)


def _inputs(*shape: int) -> list[torch.Tensor]:
    return [torch.randn(N, *shape, dtype=torch.float64) for _ in range(B)]


CONV_CASES = {
    # name: (batched, plain, per-model input shape, weight shape, options)
    "conv1d-strided-groups": (BF.conv1d, F.conv1d, (4, 9), (6, 2, 3), dict(stride=2, padding=1, groups=2)),
    "conv2d-dilated": (BF.conv2d, F.conv2d, (3, 7, 7), (4, 3, 3, 3), dict(padding=2, dilation=2)),
    "conv2d-same": (BF.conv2d, F.conv2d, (3, 6, 6), (4, 3, 3, 3), dict(padding="same")),
    "conv2d-valid-depthwise": (BF.conv2d, F.conv2d, (4, 6, 6), (4, 1, 3, 3), dict(padding="valid", groups=4)),
    "conv3d": (BF.conv3d, F.conv3d, (2, 4, 5, 5), (3, 2, 2, 3, 3), dict(stride=(1, 2, 1), padding=1)),
    "conv_transpose1d": (BF.conv_transpose1d, F.conv_transpose1d, (4, 5), (4, 3, 3),
                         dict(stride=2, padding=1, output_padding=1)),
    "conv_transpose2d-groups": (BF.conv_transpose2d, F.conv_transpose2d, (4, 4, 4), (4, 3, 2, 2),
                                dict(stride=2, groups=2)),
    "conv_transpose3d-dilated": (BF.conv_transpose3d, F.conv_transpose3d, (2, 3, 3, 3), (2, 3, 2, 2, 2),
                                 dict(dilation=2, padding=1)),
}


def _out_channels(name: str, weight_shape: tuple[int, ...], options: dict) -> int:
    if name.startswith("conv_transpose"):
        return weight_shape[1] * options.get("groups", 1)
    return weight_shape[0]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(CONV_CASES))
def test_convolution_matches_b_plain_calls(name: str, order: str) -> None:
    torch.manual_seed(0)
    batched, plain, in_shape, weight_shape, options = CONV_CASES[name]
    layout = Layout(B, order)
    weight = _tensor(B, *weight_shape)
    bias = _tensor(B, _out_channels(name, weight_shape, options))
    assert_matches_plain(
        lambda x, w, b: batched(x, w, b, **options, layout=layout),
        lambda x, w, b: plain(x, w, b, **options),
        _inputs(*in_shape),
        [weight, bias],
        layout,
    )


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
def test_padding_modes_pad_each_model_as_torch_does(padding_mode: str, order: str) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)

    def plain(x, w, b):
        return F.conv2d(F.pad(x, (1, 1, 2, 2), mode=padding_mode), w, b, padding=0)

    assert_matches_plain(
        lambda x, w, b: BF.conv2d(x, w, b, padding=(2, 1), layout=layout, padding_mode=padding_mode),
        plain,
        _inputs(3, 6, 6),
        [_tensor(B, 4, 3, 3, 3), _tensor(B, 4)],
        layout,
    )


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("in_channels", [4, 64], ids=["narrow", "64-channels-nhwc"])
def test_channels_last_input_gives_channels_last_output(order: str, in_channels: int) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    y = assert_matches_plain(
        lambda x, w, b: BF.conv2d(x, w, b, padding=1, layout=layout),
        lambda x, w, b: F.conv2d(x, w, b, padding=1),
        _inputs(in_channels, 5, 5),
        [_tensor(B, 5, in_channels, 3, 3), _tensor(B, 5)],
        layout,
        channels_last=True,
    )
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("groups", [1, 2], ids=["dense", "grouped"])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_shared_input_is_convolved_by_every_models_filters(order: str, groups: int, padding_mode: str) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    shared = torch.randn(N, 4, 6, 6, dtype=torch.float64)

    def plain(x, w, b):
        return F.conv2d(F.pad(x, (1, 1, 1, 1), mode=padding_mode) if padding_mode != "zeros" else x, w, b,
                        padding=0 if padding_mode != "zeros" else 1, groups=groups)

    assert_matches_plain(
        lambda x, w, b: BF.conv2d(x, w, b, padding=1, groups=groups, layout=layout, shared=True,
                                  padding_mode=padding_mode),
        plain,
        shared,
        [_tensor(B, 6, 4 // groups, 3, 3), _tensor(B, 6)],
        layout,
    )


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("groups", [1, 2], ids=["dense", "grouped"])
def test_shared_input_of_a_transposed_convolution(order: str, groups: int) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    assert_matches_plain(
        lambda x, w, b: BF.conv_transpose2d(x, w, b, stride=2, groups=groups, layout=layout, shared=True),
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, groups=groups),
        torch.randn(N, 4, 3, 3, dtype=torch.float64),
        [_tensor(B, 4, 6 // groups, 2, 2), _tensor(B, 6)],
        layout,
    )


@pytest.mark.parametrize("order", ORDERS)
def test_models_beyond_32_bit_indexing_are_convolved_in_slices(monkeypatch, order: str) -> None:
    torch.manual_seed(0)
    layout = Layout(5, order)
    # One model's grouped tensors reach 2 samples x 3 channels x (6 + 2 * 2)^2 = 600 elements: two models a call.
    monkeypatch.setattr(batch_layers._kernel_table, "INDEX_LIMIT", 2 * 600)
    x = torch.randn(10, 2, 6, 6, dtype=torch.float64)
    assert BF._conv.models_per_call(x, 5, 2, 3, (1, 1), (1, 1), (3, 3)) == 2
    assert_matches_plain(
        lambda x, w, b: BF.conv2d(x, w, b, padding=1, layout=layout),
        lambda x, w, b: F.conv2d(x, w, b, padding=1),
        [torch.randn(2, 2, 6, 6, dtype=torch.float64) for _ in range(5)],
        [_tensor(5, 3, 2, 3, 3), _tensor(5, 3)],
        layout,
    )


def _standardized(weight: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    """timm's StdConv2d / ScaledStdConv2d weight of one model."""
    channels = weight.reshape(1, weight.shape[0], -1)
    factors = None if gain is None else gain.reshape(-1)
    return F.batch_norm(channels, None, None, factors, training=True, momentum=0.0, eps=eps).reshape_as(weight)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("scaled", [False, True], ids=["std", "scaled-std"])
def test_weight_standardized_convolution_matches_timms_per_model(order: str, scaled: bool) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    gain = _tensor(B, 4, 1, 1, 1) if scaled else None

    def plain(x, w, b, g=None):
        return F.conv2d(x, _standardized(w, g, 1e-6), b, padding=1)

    def batched(x, w, b, g=None):
        return BF.std_conv2d(x, w, b, padding=1, eps=1e-6, gain=g, layout=layout)

    assert_matches_plain(batched, plain, _inputs(3, 5, 5), [_tensor(B, 4, 3, 3, 3), _tensor(B, 4), gain], layout)


def test_conv_refuses_a_merged_input_that_cannot_hold_b_models() -> None:
    with pytest.raises(ValueError, match=r"merged input of B = 3 models' samples in dim 0, got \(4, 3, 5, 5\)"):
        BF.conv2d(torch.randn(4, 3, 5, 5), torch.randn(3, 4, 3, 3, 3), layout=Layout(3))
    with pytest.raises(ValueError, match=r"merged input of B = 3 models' samples in dim 0, got \(4, 4, 5\)"):
        BF.conv_transpose1d(torch.randn(4, 4, 5), torch.randn(3, 4, 2, 3), layout=Layout(3))


@pytest.mark.parametrize("padding", ["full", "same"])
def test_conv_refuses_padding_torch_refuses(padding: str) -> None:
    conv = functools.partial(BF.conv2d, torch.randn(6, 3, 5, 5), torch.randn(3, 4, 3, 3, 3), layout=Layout(3))
    expected = rf"padding must be 'same' \(at stride 1\), 'valid' or numbers, got '{padding}'"
    with pytest.raises(ValueError, match=expected):
        conv(padding=padding, stride=2)


@pytest.mark.cuda
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_the_triton_grouped_kernel_runs_from_the_functional_on_cuda(monkeypatch, order: str,
                                                                   channels_last: bool) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setitem(batch_layers._kernel_table.TRITON_GROUPED.limits, "min_groups", B)
    launches = []
    kernel = BF._conv.grouped_conv2d
    monkeypatch.setattr(BF._conv, "grouped_conv2d", lambda *args: launches.append(1) or kernel(*args))
    torch.manual_seed(0)
    layout = Layout(B, order)
    inputs = [torch.randn(N, 4, 9, 9, device="cuda") for _ in range(B)]
    assert_matches_plain(
        lambda x, w, b: BF.conv2d(x, w, b, padding=1, layout=layout),
        lambda x, w, b: F.conv2d(x, w, b, padding=1),
        inputs,
        [torch.randn(B, 8, 4, 3, 3, device="cuda", requires_grad=True), torch.randn(B, 8, device="cuda")],
        layout,
        channels_last=channels_last,
        atol=1e-4,
        rtol=1e-4,
    )
    assert launches, "the Triton grouped convolution did not run"


@pytest.mark.cuda
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # Inductor's
def test_a_compiled_depthwise_convolution_runs_channels_last_and_matches_plain(monkeypatch, order: str) -> None:
    """Under torch.compile a depthwise convolution of 16 pixels or more runs on a channels-last grouped input (the
    kernel table's ``DEPTHWISE_CHANNELS_LAST``); its result keeps the input's layout and matches B plain calls."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    inputs = [torch.randn(N, 6, 5, 5, device="cuda") for _ in range(B)]
    params = [torch.randn(B, 6, 1, 3, 3, device="cuda", requires_grad=True),
              torch.randn(B, 6, device="cuda", requires_grad=True)]
    traced = compiled_conv2d_against_plain(inputs, params, Layout(B, order), atol=1e-5, rtol=1e-5, stride=2, padding=1,
                                           groups=6)
    assert any(node.target == "contiguous" and node.kwargs.get("memory_format") == torch.channels_last
               for node in traced), "the layout was not taken"
