"""Every registered batched class names its ``forward`` arguments as the plain layer does, so a model that
calls ``self.norm(input=x)`` or ``self.rnn(input, hx=h)`` runs batched as it runs plain."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from support.torchvision_ops import import_torchvision
from torch import nn

import batch_layers
import torchmb

# The layers of optional libraries that torchmb batches by qualified name (torchmb._registry's table).
_BY_NAME = {
    "torchvision.ops.misc.FrozenBatchNorm2d": batch_layers.FrozenBatchNorm2d,
    "timm.layers.std_conv.StdConv2d": batch_layers.StdConv2d,
    "timm.layers.std_conv.StdConv2dSame": batch_layers.StdConv2dSame,
    "timm.layers.std_conv.ScaledStdConv2d": batch_layers.ScaledStdConv2d,
    "timm.layers.std_conv.ScaledStdConv2dSame": batch_layers.ScaledStdConv2dSame,
}


def _registered() -> list[tuple[type[nn.Module], type[nn.Module]]]:
    registered = torchmb.registered_batch_modules().items()
    pairs = list(registered)  # refused types are not registered (torchmb.refused_batch_modules)
    import_torchvision()
    for name, batched in _BY_NAME.items():
        module, _, cls = name.rpartition(".")
        pairs.append((getattr(importlib.import_module(module), cls), batched))
    return pairs


def _names(forward) -> list[str]:
    return list(inspect.signature(forward).parameters)


@pytest.mark.parametrize("plain, batched", _registered(), ids=lambda cls: cls.__qualname__)
def test_forward_argument_names_match_the_plain_layer(plain: type[nn.Module], batched: type[nn.Module]) -> None:
    assert _names(batched.forward) == _names(plain.forward)


def test_the_table_is_what_the_registry_looks_up() -> None:
    for plain, batched in _registered():
        assert torchmb.lookup_batch_module(plain) is batched
    assert len(_registered()) >= 30


@pytest.mark.parametrize(
    "make, keyword, shape",
    [
        (lambda: nn.Linear(4, 3), "input", (5, 4)),
        (lambda: nn.Conv1d(2, 3, 3), "input", (5, 2, 7)),
        (lambda: nn.LayerNorm(4), "input", (5, 4)),
        (lambda: nn.BatchNorm1d(4), "input", (5, 4)),
        (lambda: nn.PReLU(), "input", (5, 4)),
    ],
)
def test_keyword_input_reaches_the_batched_layer(make, keyword: str, shape: tuple[int, ...]) -> None:
    plain = []
    for seed in range(3):
        torch.manual_seed(seed)
        plain.append(make())
    batched = torchmb.BatchModule.from_factory(make, 3, seed=0)
    x = torch.randn(3, *shape)
    expected = torch.stack([model(**{keyword: x[i]}) for i, model in enumerate(plain)])
    torch.testing.assert_close(batched(**{keyword: x}), expected)
    torch.testing.assert_close(batched(**{keyword: x[0]}, shared_input=True), torch.stack([m(x[0]) for m in plain]))
