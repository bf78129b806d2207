"""Code that mixes the models on the merged sample axis, found at the first forward: concatenating or
splitting per-model tensors along dim 0, reading a batched layer's weight where the source reader cannot see
it, a random draw made once for all models. Each either runs per model, matching B plain models, or is
refused; none computes a wrong result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchmb import BatchModule, PooledDecisionError
from torchmb.testing import assert_equivalent, assert_isolated

B, N = 3, 4
DOUBLE = dict(atol=1e-9, rtol=1e-9)


def paths(batched: BatchModule) -> dict[str, tuple[str, str]]:
    return {entry.name: (entry.path, entry.reason) for entry in batched.conversion_report()}


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.norm(self.conv(x)))


class RaftLike(nn.Module):
    """torchvision's RAFT: one encoder pass over both frames, concatenated along the sample axis and split back."""

    def __init__(self) -> None:
        super().__init__()
        self.feature_encoder = Encoder()
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, image1: Tensor, image2: Tensor) -> Tensor:
        fmaps = self.feature_encoder(torch.cat([image1, image2], dim=0))
        fmap1, fmap2 = torch.chunk(fmaps, chunks=2, dim=0)
        return self.head(torch.cat([fmap1, fmap2], dim=1))


class Siamese(nn.Module):
    """Two inputs through one tower, split by slicing the first half off."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, left: Tensor, right: Tensor) -> Tensor:
        both = self.tower(torch.cat((left, right)))
        n = left.shape[0]
        return F.pairwise_distance(both[:n], both[n:]).unsqueeze(1)


class SimCLR(nn.Module):
    """Two augmented views of each sample, concatenated; the contrastive logits compare every pair of rows."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: Tensor) -> Tensor:
        views = torch.cat([x + 0.1, x.flip(-1)], dim=0)
        z = F.normalize(self.encoder(views), dim=1)
        similarity = z @ z.T
        n = x.shape[0]
        return torch.cat([similarity[:n, n:], similarity[n:, :n]], dim=1)


class AliasedNorm(nn.Module):
    """Reads its child's weight through a local alias, which the source reader does not follow."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        fc = self.fc
        return fc(x) / fc.weight.norm()


@pytest.mark.parametrize(
    ("make", "inputs", "found"),
    [
        (RaftLike, lambda: (torch.randn(B, N, 3, 6, 6), torch.randn(B, N, 3, 6, 6)), "cat along dim 0"),
        (Siamese, lambda: (torch.randn(B, N, 5), torch.randn(B, N, 5)), "cat along dim 0"),
        (SimCLR, lambda: (torch.randn(B, N, 5),), "cat along dim 0"),
        (AliasedNorm, lambda: (torch.randn(B, N, 4),), "reads fc.weight, all models' stacked tensor"),
    ],
    ids=["raft", "siamese", "simclr", "aliased-weight"],
)
def test_code_mixing_the_models_runs_per_model(make: type[nn.Module], inputs, found: str) -> None:
    torch.manual_seed(0)
    batched = BatchModule(make(), B)
    assert paths(batched)[""][0] == "passthrough"  # the source shows nothing
    x = inputs()
    batched(*x)
    path, reason = paths(batched)[""]
    assert path == "generic-own"
    assert "at the first forward" in reason and found in reason
    make_double = lambda: make().double()  # noqa: E731
    assert_equivalent(make_double, B, tuple(t.double() for t in x), steps=2, **DOUBLE)


def test_the_models_stay_isolated() -> None:
    torch.manual_seed(0)
    assert_isolated(BatchModule(RaftLike().double(), B), (torch.randn(B, N, 3, 6, 6).double(),) * 2)


def test_splitting_inside_a_child_runs_only_that_child_per_model() -> None:
    class Halves(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            first, second = x.split(x.shape[0] // 2)
            return torch.cat([second, first])

    model = nn.Sequential(nn.Linear(4, 4), Halves(), nn.Linear(4, 2))
    torch.manual_seed(0)
    batched = BatchModule(model, B)
    batched(torch.randn(B, N, 4))
    assert paths(batched)["1"][0] == "generic-whole" and "split along dim 0" in paths(batched)["1"][1]
    assert paths(batched)[""][0] == "passthrough"
    torch.manual_seed(0)
    assert_equivalent(
        lambda: nn.Sequential(nn.Linear(4, 4), Halves(), nn.Linear(4, 2)).double(),
        B,
        torch.randn(B, N, 4, dtype=torch.float64),
        **DOUBLE,
    )


class LayerDrop(nn.Module):
    """Wav2Vec2's LayerDrop: one Python draw decides whether a layer runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = layer(x)
        return x


def test_a_python_decision_on_one_random_draw_is_refused() -> None:
    batched = BatchModule(LayerDrop(), B)
    with pytest.raises(PooledDecisionError, match=r"random draw made once for all models .*LayerDrop\.forward"):
        batched(torch.randn(B, N, 4))
    batched.eval()
    assert batched(torch.randn(B, N, 4)).shape == (B, N, 4)  # no draw in evaluation


class BatchDrop(nn.Module):
    """Stochastic depth of the whole batch (torchvision's mode="batch"): one draw scales every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        keep = torch.empty([1] * x.dim()).bernoulli_(0.5)
        return x + self.fc(x) * keep


def test_one_random_draw_broadcast_over_every_model_becomes_each_models() -> None:
    torch.manual_seed(0)
    batched = BatchModule(BatchDrop(), B)
    with torch.no_grad():  # the residual branch adds a large constant: kept or not is plain to see
        batched.module.fc.weight.zero_()
        batched.module.fc.bias.fill_(100.0)
    x = torch.zeros(B, N, 4)
    kept = set()
    for _ in range(10):
        out = batched(x)
        assert torch.equal(out, out[:, :1].expand_as(out))  # one draw per model, for all its samples
        kept |= {tuple(bool(v) for v in out[:, 0, 0] > 50)}
    assert "broadcasts one random draw of shape (1, 1)" in paths(batched)[""][1]
    assert len(kept) > 1 and any(len(set(row)) > 1 for row in kept)  # models draw apart


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")  # a region breaks the graph
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo, as in test_docs
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_a_compiled_first_forward_finds_it_too() -> None:
    """torch.compile traces no mode: the first forward's checks run eagerly before tracing."""
    torch.manual_seed(0)
    batched = BatchModule(Siamese().double(), B)
    x = (torch.randn(B, N, 5, dtype=torch.float64), torch.randn(B, N, 5, dtype=torch.float64))
    out = torch.compile(batched, backend="eager")(*x)
    assert paths(batched)[""][0] == "generic-own"
    for i in range(B):
        torch.testing.assert_close(out[i], batched.unbatch(i)(x[0][i], x[1][i]), **DOUBLE)
