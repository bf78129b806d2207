"""The batched convolution's own autograd function: what it keeps for backward, double backward, autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.graph import autograd_nodes, grouped_conv_node
from support.layer_cases import LayerCase, run_case
from torch import nn

import batch_layers
from batch_layers._base import ForwardContext, forward_context
from batch_layers._conv import grouped_conv
from batch_layers._layout import from_grouped, is_channels_last, to_grouped
from torchmb import BatchModule


def test_backward_keeps_the_models_major_input_not_a_grouped_copy() -> None:
    conv = batch_layers.Conv2d(3, 4, 3, padding=1, batch=2)
    x = torch.randn(2 * 5, 3, 6, 6, requires_grad=True)
    y = conv(x)
    saved_input, saved_weight = grouped_conv_node(y).saved_tensors
    assert saved_input.data_ptr() == x.data_ptr(), "the layer's own input is kept, no layout copy of it"
    assert saved_weight.data_ptr() == conv.weight.data_ptr()


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_samples_major_runs_on_autograds_own_convolution_node_keeping_the_input(device: str, transposed: bool) -> None:
    """Samples-major, the grouped layout of a contiguous input is a view of it: autograd's own
    ``ConvolutionBackward0`` then keeps the layer's input itself (no copy), as ``_GroupedConv`` does, without
    a Python function per layer, and gives the custom function's results (bit for bit on the CPU; cuDNN may
    pick another algorithm for another call)."""
    torch.manual_seed(0)
    conv = (batch_layers.ConvTranspose2d(3, 4, 2, stride=2, batch=2, device=device) if transposed
            else batch_layers.Conv2d(3, 4, 3, padding=1, batch=2, device=device))
    conv.merged_order = "samples"
    x = torch.randn(2 * 5, 3, 6, 6, device=device, requires_grad=True)
    y = conv(x)
    assert "_GroupedConvBackward" not in autograd_nodes(y)
    node = y.grad_fn.next_functions[0][0]
    assert type(node).__name__ == "ConvolutionBackward0"
    assert node._saved_input.data_ptr() == x.data_ptr(), "the layer's own input is kept, no layout copy of it"
    assert node._saved_weight.data_ptr() == conv.weight.data_ptr()
    grad = torch.randn_like(y)
    y.backward(grad)
    grads = [x.grad, conv.weight.grad, conv.bias.grad]
    # the same layer through the custom function (an input that is not contiguous takes it)
    x_strided = torch.empty(2 * 5, 3, 6, 12, device=device).narrow(3, 0, 6).copy_(x.detach()).requires_grad_()
    conv.zero_grad(set_to_none=True)
    y_custom = conv(x_strided)
    assert "_GroupedConvBackward" in autograd_nodes(y_custom)
    y_custom.backward(grad)
    tolerance = 0 if device == "cpu" else 1e-5
    torch.testing.assert_close(y_custom, y, rtol=tolerance, atol=tolerance)
    for got, expected in zip([x_strided.grad, conv.weight.grad, conv.bias.grad], grads):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_channels_last_and_autocast_keep_the_grouped_function() -> None:
    """What autograd's node cannot do as ``_GroupedConv`` does (keep a channels-last input instead of its
    grouped copy, cast once under autocast for a custom backward) stays with the function."""
    conv = batch_layers.Conv2d(3, 4, 3, padding=1, batch=2)
    conv.merged_order = "samples"
    x = torch.randn(2 * 5, 3, 6, 6, requires_grad=True)
    assert "_GroupedConvBackward" in autograd_nodes(conv(x.to(memory_format=torch.channels_last)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "_GroupedConvBackward" in autograd_nodes(conv(x))


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_the_forward_reads_a_replaced_or_parametrized_weight() -> None:
    """The layers read their parameters and buffers from the module's dicts every forward (nothing kept
    between calls): a parameter replaced between steps, a parametrization registered later and a replaced
    buffer are what the next forward computes with, as on B plain layers."""
    torch.manual_seed(0)
    plain = [nn.Conv2d(3, 4, 3) for _ in range(2)]
    conv = batch_layers.Conv2d(3, 4, 3, batch=2)
    conv.merged_order = "samples"
    x = torch.randn(2, 5, 3, 6, 6)  # (B, n, C, H, W)
    merged = x.transpose(0, 1).reshape(10, 3, 6, 6)
    conv(merged)
    conv.weight = nn.Parameter(torch.stack([p.weight for p in plain]).detach())
    conv.bias = nn.Parameter(torch.stack([p.bias for p in plain]).detach())
    got = conv(merged).view(5, 2, 4, 4, 4).transpose(0, 1)
    for i, p in enumerate(plain):
        torch.testing.assert_close(got[i], p(x[i]), atol=1e-5, rtol=1e-5)
    torch.nn.utils.parametrize.register_parametrization(conv, "weight", _Doubled())
    got = conv(merged).view(5, 2, 4, 4, 4).transpose(0, 1)
    for i, p in enumerate(plain):
        torch.testing.assert_close(got[i], F.conv2d(x[i], 2 * p.weight, p.bias), atol=1e-5, rtol=1e-5)

    norms = [nn.BatchNorm2d(4).eval() for _ in range(2)]
    norm = batch_layers.BatchNorm2d(4, batch=2).eval()
    norm.merged_order = "samples"
    features = torch.randn(2, 5, 4, 3, 3)
    merged = features.transpose(0, 1).reshape(10, 4, 3, 3)
    norm(merged)
    for plain_norm in norms:
        plain_norm.running_mean.uniform_(-1, 1)
        plain_norm.running_var.uniform_(0.5, 2)
    norm.running_mean = torch.stack([n.running_mean for n in norms])
    norm.running_var = torch.stack([n.running_var for n in norms])
    got = norm(merged).view(5, 2, 4, 3, 3).transpose(0, 1)
    for i, plain_norm in enumerate(norms):
        torch.testing.assert_close(got[i], plain_norm(features[i]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("order", ["models", "samples"])
def test_double_backward_matches_finite_differences(order: str) -> None:
    conv = batch_layers.Conv1d(2, 3, 3, stride=2, padding=1, batch=2, dtype=torch.float64)
    x = torch.randn(2 * 2, 2, 7, dtype=torch.float64, requires_grad=True)

    def fn(x, weight, bias):
        config = (2, (2,), (1,), (1,), 2, False, (0,), order)
        return grouped_conv(x, weight.reshape(6, 2, 3), bias.reshape(6), *config)

    assert torch.autograd.gradcheck(fn, (x, conv.weight, conv.bias))
    assert torch.autograd.gradgradcheck(fn, (x, conv.weight, conv.bias))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")  # torch's own
def test_uneven_same_padding_takes_torchs_own_padding() -> None:
    run_case(
        LayerCase("conv2d-same-even-kernel", lambda: nn.Conv2d(3, 4, 4, padding="same"), (3, 7, 7)), "train", "cpu"
    )


def _autocast_case(device: str, dtype: torch.dtype, atol: float) -> None:
    torch.manual_seed(0)
    plain = [nn.Conv2d(3, 4, 3, device=device) for _ in range(2)]
    batched = batch_layers.Conv2d.from_module(plain[0], 2).to(device)
    with torch.no_grad():
        batched.weight.copy_(torch.stack([p.weight for p in plain]))
        batched.bias.copy_(torch.stack([p.bias for p in plain]))
    x = torch.randn(2, 3, 3, 8, 8, device=device)
    with torch.autocast(device, dtype=dtype):
        y = batched(x.reshape(6, 3, 8, 8))
        expected = [p(x[i]) for i, p in enumerate(plain)]
    assert y.dtype == expected[0].dtype == dtype
    y.float().sum().backward()
    for i, (p, e) in enumerate(zip(plain, expected)):
        e.float().sum().backward()
        torch.testing.assert_close(y.view(2, 3, 4, 6, 6)[i], e, atol=atol, rtol=0)
        torch.testing.assert_close(batched.weight.grad[i], p.weight.grad, atol=atol * 20, rtol=2e-2)
    assert batched.weight.grad.dtype == torch.float32


def test_cpu_bf16_autocast_matches_torch_conv() -> None:
    _autocast_case("cpu", torch.bfloat16, atol=5e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_autocast_matches_torch_conv(dtype: torch.dtype) -> None:
    _autocast_case("cuda", dtype, atol=5e-2 if dtype == torch.bfloat16 else 1e-2)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_models_beyond_32_bit_indexing_are_convolved_in_slices(monkeypatch, padding_mode: str) -> None:
    torch.manual_seed(0)
    conv = batch_layers.Conv2d(2, 3, 3, padding=1, padding_mode=padding_mode, batch=5)
    x = torch.randn(5 * 4, 2, 6, 6, requires_grad=True)
    expected = conv(x)
    expected.square().sum().backward()
    grads = [x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone()]
    x.grad = conv.weight.grad = conv.bias.grad = None
    # One model's grouped tensors are bounded by 4 samples x 3 channels x (6 + 2 * 2)^2 = 1200 elements
    # (the kernel's reach on both sides): allow two models per kernel call.
    monkeypatch.setattr(batch_layers._kernel_table, "INDEX_LIMIT", 2 * 1200)
    assert conv._models_per_call(x, 5) == 2
    got = conv(x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    got.square().sum().backward()
    for a, b in zip([x.grad, conv.weight.grad, conv.bias.grad], grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)


def test_channels_last_inputs_give_the_same_results() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3))
    batched = BatchModule(net, 3, init="independent", seed=0)
    x = torch.randn(3, 5, 3, 8, 8)
    dense = x.reshape(15, 3, 8, 8).requires_grad_()
    last = dense.detach().to(memory_format=torch.channels_last).requires_grad_()
    expected = batched.module(dense)
    expected.square().sum().backward()
    grads = [p.grad.clone() for p in batched.parameters()]
    batched.zero_grad()
    got = batched.module(last)
    got.square().sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(last.grad, dense.grad, atol=1e-5, rtol=0)
    for a, b in zip(batched.parameters(), grads):
        torch.testing.assert_close(a.grad, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("wide", [True, False], ids=["64-channels-per-model", "few-channels"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_channels_last_stays_channels_last_and_matches_plain_models(device: str, order: str, wide: bool) -> None:
    """Every layer's output is channels-last, as the plain layer's is. Convolutions with 64 input channels
    per model run cuDNN's grouped NHWC kernels; narrower ones run on the contiguous grouped layout (NHWC
    goes group by group there) and hand back a channels-last output."""
    torch.manual_seed(0)
    batch = 3
    width = 64 if wide else 4

    def make() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 6, 3, stride=2),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, width, 1),
            nn.ConvTranspose2d(width, 2, 2, stride=2),
        ).to(device, memory_format=torch.channels_last)

    plain = [make() for _ in range(batch)]
    batched = BatchModule(make(), batch, merged_order=order)
    batched.load_state_dicts([m.state_dict() for m in plain])
    x = torch.randn(batch, 5, width, 9, 9, device=device)  # (B, n, C, H, W)
    seen = []
    for layer in batched.module:
        layer.register_forward_hook(lambda _, args, out: seen.append((args[0], out)))
    rows = x if order == "models" else x.transpose(0, 1)
    merged = rows.reshape(batch * 5, width, 9, 9).contiguous(memory_format=torch.channels_last).requires_grad_()
    with forward_context(ForwardContext(batch, 5, order=order)):
        got = batched.module(merged)
    for layer_input, layer_output in seen:
        assert is_channels_last(layer_input) and is_channels_last(layer_output), "a copy back to NCHW crept in"
    got.square().sum().backward()
    got_per_model = got.view(batch, 5, *got.shape[1:]) if order == "models" else got.view(5, batch, *got.shape[1:])
    grad_per_model = merged.grad.view(*rows.shape)
    if order == "samples":
        got_per_model, grad_per_model = got_per_model.transpose(0, 1), grad_per_model.transpose(0, 1)
    for i, model in enumerate(plain):
        own = x[i].contiguous(memory_format=torch.channels_last).requires_grad_()
        expected = model(own)
        expected.square().sum().backward()
        torch.testing.assert_close(got_per_model[i], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad_per_model[i], own.grad, atol=1e-5, rtol=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(batched.module.get_parameter(name).grad[i], param.grad, atol=1e-4, rtol=1e-5)
        for name, buffer in model.named_buffers():
            torch.testing.assert_close(batched.module.get_buffer(name)[i], buffer, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("order", ["models", "samples"])
def test_grouped_layouts_round_trip_in_both_memory_formats(order: str) -> None:
    per_model = torch.randn(2, 3, 4, 5, 6)  # (B, n, C, H, W)
    if order == "models":
        x = per_model.reshape(6, 4, 5, 6)
    else:
        x = per_model.transpose(0, 1).reshape(6, 4, 5, 6)
    expected = per_model.transpose(0, 1).reshape(3, 8, 5, 6)  # (n, B*C, H, W)
    for memory_format in (torch.contiguous_format, torch.channels_last):
        merged = x.contiguous(memory_format=memory_format)
        grouped = to_grouped(merged, 2, order)
        torch.testing.assert_close(grouped, expected, rtol=0, atol=0)
        assert grouped.is_contiguous(memory_format=memory_format)
        if order == "samples" and memory_format == torch.contiguous_format:
            assert grouped.data_ptr() == merged.data_ptr()  # a view: no copy
        back = from_grouped(grouped, 2, order)
        torch.testing.assert_close(back, x, rtol=0, atol=0)
        assert back.is_contiguous(memory_format=memory_format)
