"""Property-based shape fuzzing: Linear, ConvNd, ConvTransposeNd and the norms over random hyperparameters
and input shapes, each against B independently held torch layers (outputs, input and parameter gradients,
buffers; see ``support.layer_cases.run_case``)."""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.layer_cases import LayerCase, randomized, run_case
from torch import nn

# Random sizes sum gradients over up to a few hundred terms in a different order than the B plain layers
# do; 1e-4 absolute leaves room for that fp32 rounding, while a wrong model axis is off by O(1).
ATOL = 1e-4
FUZZ = settings(max_examples=25, deadline=None, derandomize=True)
modes = st.sampled_from(["train", "eval"])


def check(make, sample_shape: tuple[int, ...], mode: str) -> None:
    run_case(LayerCase("fuzz", make, sample_shape, atol=ATOL), mode, "cpu", steps=1)


@FUZZ
@given(
    in_features=st.integers(1, 8),
    out_features=st.integers(1, 8),
    bias=st.booleans(),
    leading=st.lists(st.integers(1, 3), max_size=2),
    mode=modes,
)
def test_linear(in_features, out_features, bias, leading, mode) -> None:
    check(lambda: nn.Linear(in_features, out_features, bias=bias), (*leading, in_features), mode)


@st.composite
def conv_setups(draw, transposed: bool):
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    in_channels = groups * draw(st.integers(1, 2))
    out_channels = groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3 if transposed else 2)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    bias = draw(st.booleans())
    if transposed:
        padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
        output_padding = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
        size = tuple(draw(st.integers(1, 4)) for _ in range(dims))
        out = [(n - 1) * s - 2 * p + d * (k - 1) + op + 1
               for n, s, p, d, k, op in zip(size, stride, padding, dilation, kernel, output_padding)]
        assume(min(out) > 0)
        cls = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[dims - 1]
        kwargs = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups, bias=bias,
                      dilation=dilation)
    else:
        padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
        if all(s == 1 for s in stride):
            padding = draw(st.one_of(st.sampled_from(["same", "valid"]), st.integers(0, 2)))
        else:
            padding = draw(st.one_of(st.just("valid"), st.integers(0, 2)))
        # Large enough for the dilated kernel and for reflect padding (padding < size).
        size = tuple(max(d * (k - 1) + 1, 3) + draw(st.integers(0, 3)) for k, d in zip(kernel, dilation))
        cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias,
                      padding_mode=padding_mode)
    assume(math.prod(size) <= 64)
    return (lambda: cls(in_channels, out_channels, kernel, **kwargs)), (in_channels, *size)


@FUZZ
@given(setup=conv_setups(transposed=False), mode=modes)
def test_conv(setup, mode) -> None:
    check(*setup, mode)


@FUZZ
@given(setup=conv_setups(transposed=True), mode=modes)
def test_conv_transpose(setup, mode) -> None:
    check(*setup, mode)


@st.composite
def norm_setups(draw):
    kind = draw(st.sampled_from(["layer", "rms", "group", "instance"]))
    affine = draw(st.booleans())
    if kind in ("layer", "rms"):
        normalized = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
        assume(math.prod(normalized) >= 3)
        leading = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        if kind == "layer":
            bias = draw(st.booleans())
            eps = draw(st.sampled_from([1e-5, 1e-3]))

            def make():
                return nn.LayerNorm(normalized, eps=eps, elementwise_affine=affine, bias=bias)
        else:
            eps = draw(st.sampled_from([None, 1e-3]))

            def make():
                return nn.RMSNorm(normalized, eps=eps, elementwise_affine=affine)
        return randomized(make), (*leading, *normalized)
    spatial = tuple(draw(st.lists(st.integers(1, 4), min_size=1 if kind == "instance" else 0, max_size=3)))
    if kind == "group":
        groups = draw(st.integers(1, 3))
        channels = groups * draw(st.integers(1, 3))
        assume(channels // groups * math.prod(spatial) >= 3)  # a group of 1-2 values is numerically degenerate
        return randomized(lambda: nn.GroupNorm(groups, channels, affine=affine)), (channels, *spatial)
    assume(math.prod(spatial) >= 3)
    channels = draw(st.integers(1, 4))
    track = draw(st.booleans())
    momentum = draw(st.sampled_from([0.1, 0.5, None]))
    cls = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[len(spatial) - 1]
    return (
        randomized(lambda: cls(channels, momentum=momentum, affine=affine, track_running_stats=track)),
        (channels, *spatial),
    )


@FUZZ
@given(setup=norm_setups(), mode=modes)
def test_norms(setup, mode) -> None:
    check(*setup, mode)
