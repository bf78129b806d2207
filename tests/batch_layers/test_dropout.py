"""The dropout family in a BatchModule: masks independent across models and calls, per-model statistics,
the shared-input path, and equality with torch's own dropout applied to each model's rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batch_layers
from torchmb import BatchModule, lookup_batch_module
from torchmb.testing import assert_isolated

B, P = 4, 0.3

# (plain class, per-sample shape, number of trailing dims a mask entry covers: 0 = elementwise)
FAMILY = {
    "Dropout": (nn.Dropout, (64, 32), 0),
    "Dropout1d": (nn.Dropout1d, (64, 16), 1),
    "Dropout2d": (nn.Dropout2d, (64, 4, 4), 2),
    "Dropout3d": (nn.Dropout3d, (64, 2, 2, 4), 3),
    "AlphaDropout": (nn.AlphaDropout, (64, 32), 0),
    "FeatureAlphaDropout": (nn.FeatureAlphaDropout, (64, 4, 4), 2),
}


def _dropped(y: torch.Tensor, x: torch.Tensor, covered: int, alpha: bool) -> torch.Tensor:
    """Boolean mask of dropped entries (elements, or channels when ``covered`` > 0) of one model's output."""
    if alpha:  # torch's alpha dropout: kept entries become a * x + alpha * a * p, dropped ones alpha * a * (p - 1)
        selu_alpha = 1.7580993408473766
        a = 1 / ((selu_alpha**2 * P + 1) * (1 - P)) ** 0.5
        dropped = (y - selu_alpha * a * (P - 1)).abs() < 1e-5
    else:
        dropped = y == 0
        kept = ~dropped
        torch.testing.assert_close(y[kept], x[kept] / (1 - P), atol=1e-6, rtol=1e-6)
    if covered:
        dims = tuple(range(dropped.dim() - covered, dropped.dim()))
        assert torch.equal(dropped.all(dim=dims), dropped.any(dim=dims)), "a channel was only partly dropped"
        dropped = dropped.all(dim=dims)
    return dropped


DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


@DEVICES
@pytest.mark.parametrize("shared", [True, False], ids=["shared-input", "same-data-per-model"])
@pytest.mark.parametrize("name", FAMILY)
def test_masks_independent_across_models_and_calls(name: str, shared: bool, device: str) -> None:
    cls, shape, covered = FAMILY[name]
    alpha = "Alpha" in name
    torch.manual_seed(0)
    model = BatchModule(nn.Sequential(cls(P)), B).to(device)  # identical (no) weights, one input for all
    assert isinstance(model.module[0], lookup_batch_module(cls))
    model.train()
    n = 8
    x = torch.randn(n, *shape, device=device).abs() + 0.5  # nonzero, so a zero output means dropped
    feed = x if shared else x.expand(B, *x.shape).clone()
    first = model(feed, shared_input=shared)
    second = model(feed, shared_input=shared)
    assert first.shape == second.shape == (B, n, *shape)
    masks = [[_dropped(out[b], x, covered, alpha) for b in range(B)] for out in (first, second)]
    for call in masks:
        for b in range(B):
            for c in range(b + 1, B):
                assert not torch.equal(call[b], call[c]), f"models {b} and {c} drew the same mask"
    for b in range(B):
        assert not torch.equal(masks[0][b], masks[1][b]), f"model {b} drew the same mask twice"
    # Per-model statistics: dropped fraction ~ p for every model, and masks of two models uncorrelated.
    for call in masks:
        for b, mask in enumerate(call):
            entries = mask.numel()
            tolerance = 5 * (P * (1 - P) / entries) ** 0.5
            assert abs(mask.float().mean().item() - P) < tolerance, f"model {b}: dropped {mask.float().mean():.3f}"
        both = (call[0] & call[1]).float().mean().item()
        assert abs(both - P * P) < 5 * (P * P * (1 - P * P) / call[0].numel()) ** 0.5


@DEVICES
@pytest.mark.parametrize("shared", [True, False], ids=["shared-input", "merged-input"])
@pytest.mark.parametrize("name", FAMILY)
def test_each_model_gets_torch_dropout_of_its_rows(name: str, shared: bool, device: str) -> None:
    """Reference: plain torch's dropout on the (B*n, ...) rows under the same seed, model b = rows of model b."""
    cls, shape, _ = FAMILY[name]
    n = 3
    x = torch.randn(n, *shape, device=device) if shared else torch.randn(B, n, *shape, device=device)
    merged = x.expand(B, *x.shape).reshape(B * n, *shape) if shared else x.reshape(B * n, *shape)
    model = BatchModule(nn.Sequential(cls(P)), B).train()
    torch.manual_seed(7)
    got = model(x, shared_input=shared)
    torch.manual_seed(7)
    want = cls(P).train()(merged).view(B, n, *shape)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", FAMILY)
def test_alpha_and_plain_dropout_keep_per_model_moments(name: str) -> None:
    cls, shape, _ = FAMILY[name]
    torch.manual_seed(1)
    model = BatchModule(nn.Sequential(cls(P)), B).train()
    x = torch.randn(32, *shape)
    y = model(x, shared_input=True)
    for b in range(B):
        # alpha dropout keeps mean 0 / std 1 of a standard normal input; plain dropout keeps the mean.
        assert abs(y[b].mean().item() - x.mean().item()) < 0.1, f"model {b} mean {y[b].mean():.3f}"
        if "Alpha" in name:
            assert abs(y[b].std().item() - 1) < 0.1, f"model {b} std {y[b].std():.3f}"


@pytest.mark.parametrize("name", FAMILY)
def test_eval_is_identity(name: str) -> None:
    cls, shape, _ = FAMILY[name]
    layer = lookup_batch_module(cls).from_module(cls(P), B).eval()
    x = torch.randn(B * 2, *shape)
    assert torch.equal(layer(x), x)
    plain = nn.Sequential(cls(P), nn.Flatten(), nn.Linear(x[0].numel(), 3)).eval()
    model = BatchModule(plain, B).eval()
    shared = torch.randn(2, *shape)
    out = model(shared, shared_input=True)
    for b in range(B):
        torch.testing.assert_close(out[b], plain(shared), atol=1e-5, rtol=0)


def test_dropout_in_training_keeps_models_isolated() -> None:
    def make() -> nn.Module:
        return nn.Sequential(
            nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 16), nn.AlphaDropout(0.2), nn.Linear(16, 3)
        )

    batched = BatchModule(make(), B, init="independent", seed=0).train()
    assert_isolated(batched, torch.randn(B, 5, 6))
    assert_isolated(batched, torch.randn(5, 6), shared_input=True)


def test_dropout_inplace_on_shared_input_does_not_touch_the_input() -> None:
    model = BatchModule(nn.Sequential(nn.Dropout(P, inplace=True)), B).train()
    x = torch.ones(6, 10)
    y = model(x, shared_input=True)
    assert torch.equal(x, torch.ones(6, 10))
    assert y.shape == (B, 6, 10) and (y == 0).any()


def test_repr_and_arguments() -> None:
    layer = batch_layers.Dropout2d(0.25, batch=3)
    assert repr(layer) == "Dropout2d(p=0.25, inplace=False, batch=3)"
    with pytest.raises(ValueError, match=r"between 0 and 1, but got -0\.1"):
        batch_layers.AlphaDropout(-0.1, batch=3)
