"""Bad input into a batched layer is refused where a plain torch layer refuses it, with an error in the user's
terms: the size the layer was built for and the one it got, the model axis B and the samples n."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batch_layers
from torchmb import BatchModule

B, N = 4, 3


def test_linear_names_the_feature_size_it_wants_and_got() -> None:
    with pytest.raises(RuntimeError):
        nn.Linear(4, 5)(torch.randn(N, 6))  # torch refuses it too
    models = BatchModule(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)), B)
    expected = (
        r"Linear\(in_features=4, out_features=5, batch=4\): expected an input with in_features = 4 in its last dim, "
        r"got 6: input of shape \(12, 6\), whose dim 0 merges the model axis B = 4 with each model's n = 3 samples"
    )
    with pytest.raises(RuntimeError, match=expected):
        models(torch.randn(B, N, 6))
    with pytest.raises(RuntimeError, match=r"got 6: .*dim 0 holds the n = 3 samples shared by the B = 4 models"):
        models(torch.randn(N, 6), shared_input=True)


def test_linear_names_a_missing_feature_axis() -> None:
    models = BatchModule(nn.Linear(4, 2), B)
    with pytest.raises(RuntimeError, match=r"got shape \(16,\); .*a BatchModule's input is \(B, n, \*, 4\)"):
        models(torch.randn(B, 4))


def test_linear_refuses_another_dtype_as_torch_does() -> None:
    with pytest.raises(RuntimeError):
        nn.Linear(4, 2)(torch.randn(N, 4, dtype=torch.float64))
    models = BatchModule(nn.Linear(4, 2), B)
    with pytest.raises(RuntimeError, match=r"expected an input of dtype torch.float32 \(the layer's weights\), got "):
        models(torch.randn(B, N, 4, dtype=torch.float64))
    models.double()
    assert models(torch.randn(B, N, 4, dtype=torch.float64)).dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts both, as for a plain layer
        assert models(torch.randn(B, N, 4)).dtype == torch.bfloat16


def test_conv_names_the_channels_it_wants_not_groups() -> None:
    with pytest.raises(RuntimeError):
        nn.Conv2d(3, 16, 3)(torch.randn(N, 5, 8, 8))
    models = BatchModule(nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU()), B)
    expected = (
        r"Conv2d\(3, 16, batch=4\): expected an input with in_channels = 3 in its dim 1, got 5: input of shape "
        r"\(12, 5, 8, 8\), whose dim 0 merges the model axis B = 4 with each model's n = 3 samples"
    )
    with pytest.raises(RuntimeError, match=expected):
        models(torch.randn(B, N, 5, 8, 8))
    with pytest.raises(RuntimeError, match=r"expected a 4-d input \(B\*n, C, H, W\) with C = in_channels = 3, got"):
        models(torch.randn(B, 3, 8, 8))  # no sample axis: n would be read as the channels


def _bags(offsets: list[int], length: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Every model's indices ``0..length-1`` of a table of 10 rows, with the same local ``offsets``."""
    return torch.arange(length).repeat(B), torch.tensor(offsets * B)


# torch refuses the first two always; decreasing offsets only when its CPU kernel's bound check happens to
# meet them (seen both ways on torch 2.13), so for those the batched refusal is checked alone.
@pytest.mark.parametrize(("offsets", "torch_refuses"), [([2, 4], True), ([0, 9], True), ([0, 3, 1], False)])
def test_embedding_bag_refuses_the_offsets_torch_refuses(offsets: list[int], torch_refuses: bool) -> None:
    if torch_refuses:
        with pytest.raises(RuntimeError):
            nn.EmbeddingBag(10, 3, mode="sum")(torch.arange(4), torch.tensor(offsets))
    layer = batch_layers.EmbeddingBag(10, 3, mode="sum", batch=B)
    refusal = rf"start at 0 \(offsets\[0\] has to be 0.*model 0's offsets are \[{offsets[0]}"
    with pytest.raises(RuntimeError, match=refusal):
        layer(*_bags(offsets))


@pytest.mark.parametrize("offsets", [[0, 2], [0, 4], [0, 0, 1]])
def test_embedding_bag_takes_the_offsets_torch_takes(offsets: list[int]) -> None:
    layer = batch_layers.EmbeddingBag(10, 3, mode="mean", batch=B)
    out = layer(*_bags(offsets)).view(B, len(offsets), 3)
    for b in range(B):
        plain = nn.EmbeddingBag.from_pretrained(layer.weight[b].detach(), mode="mean")
        torch.testing.assert_close(out[b], plain(torch.arange(4), torch.tensor(offsets)))
