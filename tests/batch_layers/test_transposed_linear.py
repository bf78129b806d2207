"""``TransposedLinear`` (transformers' ``Conv1D``, weight ``(in, out)``) against B plain ``x @ W + b``."""

from __future__ import annotations

import pytest
import torch

from batch_layers import ForwardContext, TransposedLinear, forward_context

B, N = 3, 5


@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
def test_each_model_computes_x_at_its_weight_plus_its_bias(shared: bool) -> None:
    torch.manual_seed(0)
    layer = TransposedLinear(4, 6, batch=B).double()
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(N, 2, 4, dtype=torch.float64) if shared else torch.randn(B * N, 2, 4, dtype=torch.float64)
    x.requires_grad_(True)
    with forward_context(ForwardContext(B, N, shared)):
        out = layer(x)
    out.square().sum().backward()
    for i in range(B):
        weight = layer.weight[i].detach().clone().requires_grad_(True)
        bias = layer.bias[i].detach().clone().requires_grad_(True)
        rows = x if shared else x[i * N : (i + 1) * N]
        expected = rows @ weight + bias
        torch.testing.assert_close(out[i * N : (i + 1) * N], expected)
        expected.square().sum().backward()
        torch.testing.assert_close(layer.weight.grad[i], weight.grad)
        torch.testing.assert_close(layer.bias.grad[i], bias.grad)


def test_the_weight_keeps_conv1d_layout_and_initialisation() -> None:
    layer = TransposedLinear(4, 6, batch=B)
    assert layer.weight.shape == (B, 4, 6) and layer.bias.shape == (B, 6)
    assert torch.equal(layer.bias, torch.zeros(B, 6))
    assert 0.005 < float(layer.weight.detach().std()) < 0.05  # normal, std 0.02, as Conv1D initialises
