"""Shared-input forwards where the model's own code meets the shared input: a residual over it, an output
computed from it alone, no samples at all; and norms without a bias. Each against B plain models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchmb import BatchModule

B = 3


def plain_models(make, batch: int = B) -> list[nn.Module]:
    models = []
    for seed in range(batch):
        torch.manual_seed(seed)
        models.append(make())
    return models


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x)


class Concat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return torch.cat([x, self.fc(x), torch.relu(x).mean(0, keepdim=True).expand_as(x)], dim=1)


class InPlaceResidual(Residual):
    def forward(self, x):
        x = x * 2
        x += self.fc(x)
        return x


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc(x), x.flatten(1), x.sum()


@pytest.mark.parametrize("make", [Residual, Concat], ids=["residual", "concat"])
@pytest.mark.parametrize("order", ["models", "samples"])
def test_a_shared_operand_meets_each_models_own_activation(make, order: str) -> None:
    plain = plain_models(make)
    batched = BatchModule.from_factory(make, B, seed=0, merged_order=order)
    x = torch.randn(6, 4, requires_grad=True)
    out = batched(x, shared_input=True)
    out.pow(2).sum().backward()
    grads = [torch.autograd.grad(model(x).pow(2).sum(), x)[0] for model in plain]
    torch.testing.assert_close(out, torch.stack([model(x) for model in plain]))
    torch.testing.assert_close(x.grad, torch.stack(grads).sum(0))


def test_an_in_place_write_of_per_model_values_into_a_shared_tensor_is_refused() -> None:
    batched = BatchModule.from_factory(InPlaceResidual, B, seed=0)
    with pytest.raises(RuntimeError, match=r"writes in place into a tensor computed from the shared input alone"):
        batched(torch.randn(6, 4), shared_input=True)
    per_model = torch.randn(B, 6, 4)  # per-model inputs: every tensor is per model, nothing to refuse
    expected = torch.stack([model(per_model[i]) for i, model in enumerate(plain_models(InPlaceResidual))])
    torch.testing.assert_close(batched(per_model), expected)


def test_an_output_without_per_model_state_is_every_models() -> None:
    norm = BatchModule(nn.LayerNorm(5, elementwise_affine=False), B)
    x = torch.randn(6, 5)
    assert norm(x, shared_input=True).shape == (B, 6, 5)
    torch.testing.assert_close(norm(x, shared_input=True), nn.LayerNorm(5, elementwise_affine=False)(x).expand(B, 6, 5))

    plain = plain_models(TwoOutputs)
    batched = BatchModule.from_factory(TwoOutputs, B, seed=0)
    x = torch.randn(6, 5, 1)[..., 0]
    fc, flat, total = batched(x, shared_input=True)
    torch.testing.assert_close(fc, torch.stack([model(x)[0] for model in plain]))
    torch.testing.assert_close(flat, x.flatten(1).expand(B, 6, 5))
    torch.testing.assert_close(total, x.sum().expand(B))
    assert BatchModule(nn.ReLU(), B)(x, shared_input=True).shape == (B, 6, 5)


@pytest.mark.parametrize("shared", [False, True])
def test_no_samples_gives_an_empty_batch(shared: bool) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))

    batched = BatchModule.from_factory(make, B, seed=0)
    x = torch.randn(0, 4) if shared else torch.randn(B, 0, 4)
    out = batched.eval()(x, shared_input=shared)
    assert out.shape == (B, 0, 2)
    assert plain_models(make)[0].eval()(torch.randn(0, 4)).shape == (0, 2)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.BatchNorm2d(4, bias=False), (5, 4, 3, 3)),
        (lambda: nn.GroupNorm(2, 4, bias=False), (5, 4, 3)),
        (lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True, bias=False), (5, 4, 6)),
        (lambda: nn.LayerNorm(4, bias=False), (5, 4)),
    ],
    ids=["batchnorm", "groupnorm", "instancenorm", "layernorm"],
)
def test_norms_without_bias(make, shape: tuple[int, ...]) -> None:
    plain = plain_models(make)
    for model in plain:
        nn.init.normal_(model.weight)
    batched = BatchModule(make(), B)
    batched.load_state_dicts([model.state_dict() for model in plain])
    assert batched.module.bias is None
    x = torch.randn(B, *shape, requires_grad=True)
    out = batched(x)
    out.pow(2).sum().backward()
    for i, model in enumerate(plain):
        xi = x[i].detach().requires_grad_()
        expected = model(xi)
        expected.pow(2).sum().backward()
        torch.testing.assert_close(out[i], expected)
        torch.testing.assert_close(x.grad[i], xi.grad)
        torch.testing.assert_close(batched.module.weight.grad[i], model.weight.grad)
        assert batched.state_dict_of(i).keys() == model.state_dict().keys()
        for name, buffer in model.named_buffers():
            torch.testing.assert_close(batched.state_dict_of(i)[name], buffer)


def test_a_softmax_over_the_merged_model_axis_is_refused() -> None:
    unbatched = BatchModule(nn.Softmax2d(), B)
    with pytest.raises(ValueError, match=r"softmax over dim 0 of a tensor of shape \(12, 5, 6\) holding several"):
        unbatched(torch.randn(B, 4, 5, 6))  # each model's input (C, H, W): dim -3 is dim 0 once merged
    with pytest.raises(ValueError, match=r"glu over dim 0 of a tensor of shape \(12,\)"):
        BatchModule(nn.GLU(), B)(torch.randn(B, 4))
    x = torch.randn(B, 2, 4, 5, 6)  # with a batch dim, dim -3 is each sample's channels
    torch.testing.assert_close(BatchModule(nn.Softmax2d(), B)(x), nn.Softmax2d()(x.flatten(0, 1)).view_as(x))


@pytest.mark.parametrize("make", [lambda: nn.GRU(4, 3, num_layers=2), lambda: nn.LSTMCell(4, 3)], ids=["gru", "cell"])
def test_unbatched_recurrent_layers_with_a_shared_input_and_state(make) -> None:
    plain = plain_models(make)
    batched = BatchModule.from_factory(make, B, seed=0)
    cell = isinstance(plain[0], nn.LSTMCell)
    x = torch.randn(4) if cell else torch.randn(5, 4)  # one unbatched sample (cell) or sequence (GRU)
    state = (torch.randn(3), torch.randn(3)) if cell else torch.randn(2, 3)
    got = batched(x, state, shared_input=True)
    for i, model in enumerate(plain):
        for have, want in zip(got, model(x, state)):
            torch.testing.assert_close(have[i], want)


class IndexesByMergedRows(nn.Module):
    """Reads the batch size from an activation and indexes a second input with it (transformers' masks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h + table[torch.arange(h.shape[0])]


@pytest.mark.parametrize("order", ["models", "samples"])
def test_a_shared_tensor_indexed_by_the_merged_rows_gives_each_model_its_rows(order: str) -> None:
    torch.manual_seed(0)
    batched = BatchModule(IndexesByMergedRows(), 3, merged_order=order)
    x, table = torch.randn(5, 4), torch.randn(5, 4)
    out = batched(x, table, shared_input=True)
    for i in range(3):
        torch.testing.assert_close(out[i], batched.unbatch(i)(x, table))
