"""Real models from torchvision and timm: each converts, matches B plain copies over training steps, trains
with its randomness on (different per model) and keeps its registered layers on their fast path.

The models are the libraries' own definitions at tiny sizes (tests/support/zoo.py). The comparison runs in
float64 with several samples per model, so that batch norms over small spatial maps are well conditioned.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.torchvision_ops import import_torchvision
from support.zoo import TIMM_MODELS, TORCHVISION_MODELS, ZooModel, float64, is_random, without_randomness
from torch import Tensor, nn

import torchmb
from torchmb.testing import assert_equivalent

BATCH = 2
SAMPLES = 4


def _marks(entry: ZooModel) -> list:
    marks = [pytest.mark.slow] if entry.slow else []
    if entry.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=entry.xfail))
    return marks


def _params(entries: list[ZooModel], prefix: str) -> list:
    return [pytest.param(entry, id=f"{prefix}-{entry.name}", marks=_marks(entry)) for entry in entries]


ZOO = _params(TORCHVISION_MODELS, "torchvision") + _params(TIMM_MODELS, "timm")


def _converting(entry: ZooModel):
    """Where most of the model's parameters go generic, converting it warns so."""
    if entry.mostly_generic:
        return pytest.warns(UserWarning, match="of the model's parameters are batched through torch.func")
    return contextlib.nullcontext()


def _images(entry: ZooModel, batch: int, dtype: torch.dtype, samples: int, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, samples, 3, entry.size, entry.size, generator=generator, dtype=dtype)


def _logits(output) -> Tensor:
    """The classification logits: torchvision's GoogLeNet and Inception return a named tuple in training."""
    return output if isinstance(output, Tensor) else output[0]


def test_every_torchvision_classification_builder_is_in_the_zoo() -> None:
    models = import_torchvision().models
    assert sorted(entry.name for entry in TORCHVISION_MODELS) == sorted(models.list_models(module=models))


@pytest.mark.parametrize("entry", ZOO)
def test_zoo_model_matches_plain_copies(entry: ZooModel) -> None:
    def make() -> nn.Module:
        return float64(without_randomness(entry.build()))

    torch.manual_seed(0)
    images = _images(entry, BATCH, torch.float64, entry.samples)
    with _converting(entry):
        batched = torchmb.BatchModule(make(), BATCH)
        batched(images)  # code found mixing the models at the first forward runs per model from there on
    assert len(batched.generic_modules) == entry.generic, (entry.why_generic, batched.generic_modules)
    with _converting(entry):
        assert_equivalent(
            make,
            BATCH,
            images,
            steps=2,
            loss_fn=lambda output: _logits(output).square().mean(),
            lr=0.01,
            atol=1e-8,
            rtol=1e-6,
        )


def _unzeroed(model: nn.Module) -> nn.Module:
    """``model`` with every all-zero parameter set to small random values (in place).

    Several models start with a zero classifier head (torchvision's ViT, timm's ResMLP, Mixer, Sequencer),
    so their logits do not depend on the dropout masks before a first step, and the models' different
    draws could not show in them.
    """
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(std=0.02)
    return model


@pytest.mark.parametrize("entry", ZOO)
def test_zoo_model_trains_with_randomness_per_model(entry: ZooModel) -> None:
    torch.manual_seed(0)
    plain = _unzeroed(entry.build())
    with _converting(entry):
        batched = torchmb.BatchModule(plain, BATCH)  # every model a copy of the plain one
    image = _images(entry, 1, torch.float32, SAMPLES)
    same_images = image.expand(BATCH, *image.shape[1:])

    plain.eval()
    batched.eval()
    with torch.no_grad():
        expected = _logits(plain(image[0]))
        evaluated = _logits(batched(same_images))
    for i in range(BATCH):
        torch.testing.assert_close(evaluated[i], expected, atol=1e-4, rtol=1e-4)

    batched.train()
    optimizer = torch.optim.SGD(batched.parameters(), lr=0.01)
    logits = _logits(batched(same_images))
    losses = logits.square().mean(dim=(1, 2))
    assert torch.isfinite(losses).all()
    losses.sum().backward()
    optimizer.step()
    # The copies saw the same images: only their own dropout / stochastic-depth draws can tell them apart.
    if is_random(plain):
        assert not torch.equal(logits[0], logits[1]), "the models drew the same random masks"
    else:
        torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
