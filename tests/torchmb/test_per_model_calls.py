"""Modules without state of their own that must run per model: a call of a method other than ``forward`` of a
child with per-model state, or of such a child on constants alone, makes the caller a region (timm's
relative-position attentions); a generic module's other methods refuse the merged axis."""

from __future__ import annotations

import pytest
import torch
from support.models import conversion_paths
from torch import Tensor, nn

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent, assert_isolated

B, N, TOKENS, HEADS, D = 3, 2, 3, 2, 4
DOUBLE = dict(atol=1e-9, rtol=1e-9)



def reasons(batched: BatchModule) -> dict[str, str]:
    return {entry.name: entry.reason for entry in batched.conversion_report()}


def linears_registered(batched: BatchModule) -> bool:
    plain = [name for name, m in batched._template.named_modules() if type(m) is nn.Linear]
    return bool(plain) and all(
        isinstance(batched.module.get_submodule(name), batch_layers.AbstractBatchModule) for name in plain
    )


def tokens(dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(B, N, TOKENS, D, dtype=dtype)


class TableBias(nn.Module):
    """timm's RelPosBias in small: owns a bias table, which its attention asks for through ``get_bias()``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(HEADS, TOKENS, TOKENS))

    def get_bias(self) -> Tensor:
        return self.table.unsqueeze(0)

    def forward(self, attn: Tensor) -> Tensor:
        return attn + self.get_bias()


class CoordinateBias(nn.Module):
    """timm's RelPosMlp in small: no parameters of its own; a registered MLP maps a constant coordinate table
    to the bias."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, HEADS))
        coords = torch.linspace(-1, 1, TOKENS * TOKENS * 2).view(TOKENS, TOKENS, 2)
        self.register_buffer("coords", coords, persistent=False)

    def get_bias(self) -> Tensor:
        return self.mlp(self.coords).permute(2, 0, 1).unsqueeze(0)

    def forward(self, attn: Tensor) -> Tensor:
        return attn + self.get_bias()


class Attention(nn.Module):
    """timm's RelPosAttention in small: no parameters of its own, registered projections, and a relative
    position module asked for its bias (timm's fused path)."""

    def __init__(self, bias: type[nn.Module]) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.rel_pos = bias()
        self.proj = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.add_bias(q @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, t, d))

    def add_bias(self, attn: Tensor) -> Tensor:
        return attn + self.rel_pos.get_bias()


class ScoredAttention(Attention):
    """timm's unfused path: the relative position module's forward adds the bias to the scores."""

    def add_bias(self, attn: Tensor) -> Tensor:
        return self.rel_pos(attn)


def test_a_parent_calling_a_generic_childs_method_runs_per_model() -> None:
    torch.manual_seed(0)
    batched = BatchModule(Attention(TableBias), B)
    assert conversion_paths(batched) == {
        "": "generic-own",
        "qkv": "registered",
        "rel_pos": "generic-whole",
        "proj": "registered",
    }
    assert (
        "add_bias calls self.rel_pos.get_bias() (not forward) of a module with per-model state" in reasons(batched)[""]
    )
    assert linears_registered(batched)
    assert_equivalent(lambda: Attention(TableBias).double(), B, tokens(), steps=2, **DOUBLE)


@pytest.mark.parametrize("attention", [Attention, ScoredAttention])
def test_a_registered_layer_on_a_constant_table_in_a_parameter_free_module(attention: type[Attention]) -> None:
    """Each model's MLP maps the one coordinate table to its own bias, added to that model's scores."""
    torch.manual_seed(0)
    batched = BatchModule(attention(CoordinateBias), B)
    generic = {name for name, path in conversion_paths(batched).items() if path == "generic-own"}
    # Calling the bias module's forward, the attention hands it the scores: it may stay on the merged axis.
    assert generic == ({"", "rel_pos"} if attention is Attention else {"rel_pos"})
    assert "get_bias calls self.mlp, a module with per-model state, on constants alone" in reasons(batched)["rel_pos"]
    assert linears_registered(batched)
    assert batched.module.rel_pos.coords.shape == (TOKENS, TOKENS, 2)  # a constant, stored once
    assert_equivalent(lambda: attention(CoordinateBias).double(), B, tokens(), steps=2, **DOUBLE)


def test_the_models_stay_isolated() -> None:
    torch.manual_seed(0)
    assert_isolated(BatchModule(Attention(CoordinateBias).double(), B), tokens())


class FourierPositions(nn.Module):
    """XCiT's encoder in small: called with sizes, it projects a grid and repeats it for every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(2, D)

    def forward(self, samples: int, count: int) -> Tensor:
        grid = torch.linspace(-1, 1, 2 * count, dtype=self.project.weight.dtype).view(1, count, 2)
        return self.project(grid).repeat(samples, 1, 1)


class Encoded(nn.Module):
    """No parameters of its own: sizes read from the data are the same for every model, so the encoder is
    called on constants alone."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = FourierPositions()
        self.head = nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:
        samples, count = x.shape[0], x.size(1)
        return self.head(x + self.positions(samples, count))


def test_sizes_of_the_data_are_constants() -> None:
    torch.manual_seed(0)
    batched = BatchModule(Encoded(), B)
    assert conversion_paths(batched)[""] == "generic-own"
    assert "calls self.positions, a module with per-model state, on constants alone" in reasons(batched)[""]
    assert_equivalent(lambda: Encoded().double(), B, tokens(), steps=2, **DOUBLE)


class Stages(nn.Module):
    """Ordinary code: every call of a child with state reads the data, and a container's own methods
    (``items()``) are not the model's: it stays on the merged axis."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({"a": nn.Linear(D, D), "b": nn.Linear(D, D)})
        self.head = nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = x.flatten(1)
        h = h.view(x.shape)
        for _, stage in self.stages.items():
            h = torch.relu(stage(h))
        scaled = h * 2
        return self.head(scaled)


def test_ordinary_code_stays_on_the_merged_axis() -> None:
    batched = BatchModule(Stages(), B)
    assert batched.generic_modules == []
    assert conversion_paths(batched)[""] == "passthrough"


class Aliased(nn.Module):
    """Asks for the bias through a local alias, which torchmb does not follow: the call stays on the merged
    axis, where the generic module's method refuses to run."""

    def __init__(self) -> None:
        super().__init__()
        self.rel_pos = TableBias()
        self.fc = nn.Linear(8, TOKENS)

    def forward(self, x: Tensor) -> Tensor:
        rel_pos = self.rel_pos
        return self.fc(x) + rel_pos.get_bias()[0, 0]


def test_a_generic_modules_method_refuses_the_merged_axis() -> None:
    batched = BatchModule(Aliased(), B)
    assert conversion_paths(batched)[""] == "passthrough"
    with pytest.raises(
        RuntimeError,
        match=r"TableBias\.get_bias\(\) was called by Aliased\.forward \(.*test_per_model_calls\.py:\d+\) on the "
        r"merged model axis: TableBias is batched through torch\.func, its state stacked for all 3 models",
    ):
        batched(torch.randn(B, N, TOKENS, 8))
    # Outside a forward the method is the user's to call; it sees the stacked table.
    assert batched.module.rel_pos.get_bias().shape == (1, B, HEADS, TOKENS, TOKENS)
