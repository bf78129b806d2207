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
def test_auto_takes_samples_major_for_convolutional_models_after_the_first_forward(make, expected: str) -> None:
    batched = BatchModule(make(), B)
    layers = [m for m in batched.modules() if isinstance(m, batch_layers.AbstractBatchModule)]
    assert batched.merged_order == "models" and all(layer.merged_order == "models" for layer in layers)
    x = torch.randn(B, N, 12) if make is MLP else torch.randn(B, N, *((1, 28, 28) if make is LeNet else (3, 8, 8)))
    batched(x)
    assert batched.merged_order == expected
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


@pytest.mark.parametrize("order", ORDERS)
def test_channels_last_images_reach_the_layers_channels_last_only_models_major(order: str) -> None:
    """Models-major, merging ``(B, n)`` is a view and the layers see the user's channels-last images; the
    samples-major merge copies them to a contiguous tensor (docs/design.md says why that stays). Either way
    the models are B plain channels-last models."""
    torch.manual_seed(0)
    plain = [ConvZoo().to(memory_format=torch.channels_last) for _ in range(B)]
    batched = BatchModule(ConvZoo().to(memory_format=torch.channels_last), B, merged_order=order)
    batched.load_state_dicts([m.state_dict() for m in plain])
    stem_inputs = []
    batched.module.stem.register_forward_pre_hook(lambda module, args: stem_inputs.append(args[0]))
    images = torch.randn(B * N, 3, 8, 8).contiguous(memory_format=torch.channels_last).view(B, N, 3, 8, 8)
    out = batched(images)
    (stem_input,) = stem_inputs
    assert stem_input.is_contiguous(memory_format=torch.channels_last) == (order == "models")
    assert stem_input.is_contiguous() == (order == "samples")
    out.square().sum().backward()
    torch.optim.SGD(batched.parameters(), lr=0.1).step()
    for i, model in enumerate(plain):
        expected = model(images[i])
        torch.testing.assert_close(out[i], expected, atol=5e-5, rtol=1e-5)
        expected.square().sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
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


def test_samples_major_refuses_outputs_with_merged_dims() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(0, 1))
    batched = BatchModule(model, B, merged_order="samples")
    with pytest.raises(SamplesOrderError, match=r"exactly B \* n = 3 \* 4 rows"):
        batched(torch.randn(B, N, 3, 5, 5))


class ConvNormDrop(nn.Module):
    """A convolutional net with batch norms and dropout: ``auto`` runs it samples-major after its first forward.
    The dropout's input is a sigmoid (never 0), so the zeros of its output are its mask."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(0.3)
        self.conv2 = nn.Conv2d(6, 4, 3, stride=2, padding=1)
        self.norm2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.sigmoid(self.norm(self.conv(x))))
        return self.head(F.relu(self.norm2(self.conv2(y))).mean((2, 3)))


class PatchTokens(nn.Module):
    """ViT-like: a patch embedding, then the patches merged into dim 0 for a per-patch MLP with a batch norm
    over tokens; correct only models-major, which ``auto`` therefore keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 2, stride=2)
        self.mlp = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)  # (n, P, 8)
        n, patches, dim = tokens.shape
        rows = self.drop(torch.sigmoid(self.norm(self.mlp(tokens.reshape(n * patches, dim)))))
        return self.head(rows.view(n, patches, dim).mean(1))


class GivenMask(nn.Module):
    """Dropout with a mask given from outside: the plain models replay the masks the batched dropout drew."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask / (1 - self.p)


def _per_model(merged: torch.Tensor, order: str) -> torch.Tensor:
    """The test's own reading of a merged ``(B*m, ...)`` tensor as ``(B, m, ...)`` in ``order``."""
    if order == "models":
        return merged.view(B, -1, *merged.shape[1:])
    return merged.view(-1, B, *merged.shape[1:]).transpose(0, 1)


@pytest.mark.parametrize(("make", "settled"), [(ConvNormDrop, "samples"), (PatchTokens, "models")])
def test_auto_trains_exactly_like_independent_models_and_draws_once(make, settled: str) -> None:
    """Three steps against B plain models: the first forward runs models-major, then the order ``auto``
    settles on (for good); outputs, gradients, running statistics counted once, state dicts and the random
    state (one dropout draw per forward) are those of the plain models."""
    torch.manual_seed(0)
    plain = [make() for _ in range(B)]
    batched = BatchModule(make(), B)
    batched.load_state_dicts([m.state_dict() for m in plain])
    assert batched.merged_order == "models"
    masks: list[torch.Tensor] = []
    batched.module.drop.register_forward_hook(lambda _, args, out: masks.append(out != 0))
    for model in plain:
        model.drop = GivenMask(0.3)
    opt = torch.optim.SGD(batched.parameters(), lr=0.05)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in plain]
    for step in range(3):
        order = batched.merged_order
        assert order == ("models" if step == 0 else settled)  # decided after the first forward, never re-tried
        x = torch.randn(B, N, 3, 6, 6)
        before = torch.get_rng_state()
        out = batched(x)
        after = torch.get_rng_state()
        assert len(masks) == step + 1  # the dropout ran once: nothing was tried and undone
        torch.set_rng_state(before)
        F.dropout(torch.ones(masks[-1].shape), 0.3, training=True)  # one draw of the merged mask
        assert torch.equal(after, torch.get_rng_state())
        torch.set_rng_state(after)
        opt.zero_grad()
        out.square().sum().backward()
        mask = _per_model(masks[-1], order)
        for i, (model, own_opt) in enumerate(zip(plain, opts)):
            model.drop.mask = mask[i]
            expected = model(x[i])
            torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)
            own_opt.zero_grad()
            expected.square().sum().backward()
            for (name, p), own in zip(batched.named_parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(p.grad[i], own.grad, atol=1e-5, rtol=1e-4, msg=name)
            own_opt.step()
        opt.step()
        for i, model in enumerate(plain):
            ours = batched.state_dict_of(i)
            assert list(ours) == list(model.state_dict())
            for key, value in model.state_dict().items():  # running statistics counted once per step
                torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=1e-4, msg=key)
    assert batched.merged_order == settled
    assert all(m.merged_order == settled for m in batched.modules() if isinstance(m, batch_layers.AbstractBatchModule))


@pytest.mark.parametrize("order", ORDERS)
def test_an_explicit_order_is_kept_from_the_start(order: str) -> None:
    batched = BatchModule(ConvNormDrop(), B, merged_order=order)
    layers = [m for m in batched.modules() if isinstance(m, batch_layers.AbstractBatchModule)]
    for _ in range(2):
        assert batched.merged_order == order and all(layer.merged_order == order for layer in layers)
        batched(torch.randn(B, N, 3, 6, 6))


def test_auto_keeps_models_major_where_the_first_forward_outputs_merged_rows() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(0, 1))
    batched = BatchModule(model, B)
    out = batched(torch.randn(B, N, 3, 5, 5))
    assert out.shape == (B, N * 4, 5, 5) and batched.merged_order == "models"
