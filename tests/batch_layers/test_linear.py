"""The batched Linear's own autograd function: layouts, double backward, autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batch_layers


def stacked(plain: list[nn.Linear]) -> batch_layers.Linear:
    layer = batch_layers.Linear.from_module(plain[0], len(plain))
    with torch.no_grad():
        layer.weight.copy_(torch.stack([p.weight for p in plain]))
        layer.bias.copy_(torch.stack([p.bias for p in plain]))
    return layer


def test_backward_copies_nothing() -> None:
    # Autograd through baddbmm(b, x, W.transpose) hands back the weight gradient transposed and
    # AccumulateGrad copies it; the batched Linear computes every gradient in its own layout.
    layer = batch_layers.Linear(5, 3, batch=4)
    y = layer(torch.randn(4 * 6, 5, requires_grad=True)).sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y.backward()
    names = {event.name for event in prof.events()}
    assert "aten::bmm" in names, "the profile must have seen the backward"
    assert not names & {"aten::copy_", "aten::clone", "aten::contiguous"}
    assert layer.weight.grad.stride() == layer.weight.stride()


def test_double_backward_matches_finite_differences() -> None:
    layer = batch_layers.Linear(3, 2, batch=2, dtype=torch.float64)
    x = torch.randn(2 * 3, 3, dtype=torch.float64, requires_grad=True)
    params = (x, layer.weight, layer.bias)

    def fn(x, weight, bias):
        return batch_layers.functional.linear(x, weight, bias, layout=batch_layers.functional.Layout(2))

    assert torch.autograd.gradcheck(fn, params)
    assert torch.autograd.gradgradcheck(fn, params)


def _autocast_case(device: str, dtype: torch.dtype, atol: float) -> None:
    torch.manual_seed(0)
    plain = [nn.Linear(16, 8, device=device) for _ in range(3)]
    layer = stacked(plain)
    x = torch.randn(3, 5, 16, device=device)
    with torch.autocast(device, dtype=dtype):
        y = layer(x.reshape(15, 16))
        expected = [p(x[i]) for i, p in enumerate(plain)]
    assert y.dtype == expected[0].dtype == dtype
    grad = torch.randn_like(y)
    y.backward(grad)
    for i, (p, e) in enumerate(zip(plain, expected)):
        e.backward(grad.view(3, 5, 8)[i])
        torch.testing.assert_close(y.view(3, 5, 8)[i], e, atol=atol, rtol=0)
        torch.testing.assert_close(layer.weight.grad[i], p.weight.grad, atol=atol * 4, rtol=0)
        assert layer.weight.grad.dtype == torch.float32


def test_cpu_bf16_autocast_matches_torch_linear() -> None:
    _autocast_case("cpu", torch.bfloat16, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_autocast_matches_torch_linear(dtype: torch.dtype) -> None:
    _autocast_case("cuda", dtype, atol=3e-2 if dtype == torch.bfloat16 else 5e-3)
