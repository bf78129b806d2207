"""The merged order of a BatchModule: which one ``auto`` takes, and that both train exactly like B plain models."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import MLP, BatchNormCNN, LeNet
from torch import nn

import batch_layers
from batch_layers import SamplesOrderError
from torchmb import BatchModule

B, N = 3, 4
ORDERS = ["models", "samples"]


class ConvZoo(nn.Module):
    """Every layer that runs samples-major: convolutions (strided, grouped, transposed), batch norms, dropout,
    Linear on 2-D and 3-D inputs, with a residual add and pooling between them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.down = nn.Conv2d(8, 6, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.drop = nn.Dropout(0.0)
        self.tokens = nn.Linear(4, 5)
        self.norm1d = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.stem(x)))
        x = x + self.grouped(x)
        x = self.up(F.relu(self.down(x)))
        x = self.drop(x)
        tokens = self.tokens(x.flatten(2).transpose(1, 2))  # (N, H*W, 5): Linear on a 3-D input
        return self.head(self.norm1d(tokens.mean(1)))


class PerPixelLinear(nn.Module):
    """Merges the spatial dims into dim 0 before a Linear: correct models-major only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.mix = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.norm(self.conv(x)))
        n, c, h, w = y.shape
        return self.mix(y.permute(0, 2, 3, 1).reshape(-1, c)).view(n, h, w, 2)


@pytest.mark.parametrize(
    ("make", "expected"),
    [(BatchNormCNN, "samples"), (LeNet, "samples"), (ConvZoo, "samples"), (MLP, "models")],
)
def test_auto_takes_samples_major_for_convolutional_models(make, expected: str) -> None:
    batched = BatchModule(make(), B)
    assert batched.merged_order == expected
    layers = [m for m in batched.modules() if isinstance(m, batch_layers.AbstractBatchModule)]
    assert layers and all(layer.merged_order == expected for layer in layers)
    assert f"merged_order='{expected}'" in repr(batched)


def test_auto_keeps_models_major_where_a_layer_cannot_run_samples_major() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LayerNorm(4 * 6 * 6))
    assert BatchModule(model, B).merged_order == "models"
    with pytest.raises(ValueError, match=r"merged_order='samples' needs .* not: 2"):
        BatchModule(model, B, merged_order="samples")
    with pytest.raises(ValueError, match="merged_order must be 'auto', 'models' or 'samples', got 'rows'"):
        BatchModule(model, B, merged_order="rows")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["per-model-input", "shared-input"])
def test_training_matches_independent_models(order: str, shared: bool) -> None:
    torch.manual_seed(0)
    plain = [ConvZoo() for _ in range(B)]
    batched = BatchModule(ConvZoo(), B, merged_order=order)
    batched.load_state_dicts([m.state_dict() for m in plain])
    opt = torch.optim.SGD(batched.parameters(), lr=0.02)
    opts = [torch.optim.SGD(m.parameters(), lr=0.02) for m in plain]
    for _ in range(3):
        x = torch.randn(N, 3, 8, 8) if shared else torch.randn(B, N, 3, 8, 8)
        out = batched(x, shared_input=shared)
        assert out.shape == (B, N, 2) and out.is_contiguous()
        opt.zero_grad()
        out.square().sum().backward()
        opt.step()
        for i, (model, own_opt) in enumerate(zip(plain, opts)):
            expected = model(x if shared else x[i])
            torch.testing.assert_close(out[i], expected, atol=5e-5, rtol=1e-5)
            own_opt.zero_grad()
            expected.square().sum().backward()
            own_opt.step()
    for i, model in enumerate(plain):
        for key, value in model.state_dict().items():
            torch.testing.assert_close(batched.state_dict_of(i)[key], value, atol=5e-5, rtol=1e-5, msg=key)


def test_both_orders_give_the_same_models() -> None:
    torch.manual_seed(0)
    by_order = {order: BatchModule(LeNet(), B, init="independent", seed=1, merged_order=order) for order in ORDERS}
    x = torch.randn(B, N, 1, 28, 28)
    outs = {order: batched(x) for order, batched in by_order.items()}
    torch.testing.assert_close(outs["models"], outs["samples"], atol=1e-5, rtol=1e-5)
    for out in outs.values():
        out.logsumexp(-1).sum().backward()
    for (name, a), b in zip(by_order["models"].named_parameters(), by_order["samples"].parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("order", ORDERS)
def test_select_keeps_survivors(order: str) -> None:
    # Not bit for bit: a grouped convolution of 2 models may take another kernel than one of 4.
    torch.manual_seed(0)
    x = torch.randn(4, N, 3, 8, 8)
    full = BatchModule(BatchNormCNN(), 4, init="independent", seed=0, merged_order=order)
    survivors = copy.deepcopy(full)
    keep = [3, 0]

    def step(model, inputs):
        model.zero_grad()
        model(inputs).square().mean(dim=(1, 2)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad

    step(full, x)
    step(survivors, x)
    survivors.select(keep)
    for _ in range(2):
        step(full, x)
        step(survivors, x[keep])
    for j, i in enumerate(keep):
        for key, value in full.state_dict_of(i).items():
            torch.testing.assert_close(survivors.state_dict_of(j)[key], value, atol=1e-6, rtol=1e-6, msg=key)


def test_samples_major_refuses_dims_merged_into_dim_0() -> None:
    x = torch.randn(B, N, 3, 5, 5)
    expected = r"exactly B \* n = 3 \* 4 in the samples-major .* merged_order='models'"
    with pytest.raises(SamplesOrderError, match=expected):
        BatchModule(PerPixelLinear(), B, merged_order="samples")(x)


def test_auto_falls_back_to_models_major_and_undoes_the_trial() -> None:
    torch.manual_seed(0)
    plain = [PerPixelLinear() for _ in range(B)]
    batched = BatchModule(PerPixelLinear(), B)
    assert batched.merged_order == "samples"  # by the layers alone: only running the model tells
    batched.load_state_dicts([m.state_dict() for m in plain])
    x = torch.randn(B, N, 3, 5, 5)
    torch.manual_seed(7)
    out = batched(x)
    assert batched.merged_order == "models"
    assert all(m.merged_order == "models" for m in batched.modules() if isinstance(m, batch_layers.AbstractBatchModule))
    # The refused trial left no trace: running statistics were counted once, and the dropout masks are
    # those of a models-major forward started from the same random state.
    assert [batched.state_dict_of(i)["norm.num_batches_tracked"].item() for i in range(B)] == [1] * B
    reference = BatchModule(PerPixelLinear(), B, merged_order="models")
    reference.load_state_dicts([m.state_dict() for m in plain])
    torch.manual_seed(7)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(batched.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert not torch.equal(batched.state_dict_of(0)["norm.running_mean"], plain[0].state_dict()["norm.running_mean"])
    for model in plain:
        model.eval()
    batched.eval()
    out = batched(x)
    for i, model in enumerate(plain):
        model.load_state_dict(batched.state_dict_of(i))
        torch.testing.assert_close(out[i], model(x[i]), atol=1e-5, rtol=1e-5)


def test_samples_major_refuses_outputs_with_merged_dims() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(0, 1))
    batched = BatchModule(model, B, merged_order="samples")
    with pytest.raises(SamplesOrderError, match=r"exactly B \* n = 3 \* 4 rows"):
        batched(torch.randn(B, N, 3, 5, 5))
