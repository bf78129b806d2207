"""The torch.func path: own state under vmap, children on their fast paths, randomness and buffers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import conversion_paths
from support.torchvision_ops import import_torchvision
from torch import Tensor, nn

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent, assert_isolated

torchvision = import_torchvision()
import timm  # noqa: E402  (timm imports torchvision, which must be imported through import_torchvision first)
from timm.models import convnext as timm_convnext  # noqa: E402
from timm.models import swin_transformer as timm_swin  # noqa: E402
from torchvision.models import convnext as tv_convnext  # noqa: E402
from torchvision.models import swin_transformer as tv_swin  # noqa: E402

B, N = 3, 2
DOUBLE = dict(atol=1e-9, rtol=1e-9)


def generic_paths(batched: BatchModule) -> dict[str, str]:
    return {entry.name: entry.path for entry in batched.conversion_report() if entry.generic}


def registered_layers_everywhere(batched: BatchModule, plain_type: type[nn.Module]) -> int:
    """How many modules of ``plain_type`` the model had, asserting each is now a registered batched layer."""
    plain = [name for name, m in batched._template.named_modules() if type(m) is plain_type]
    for name in plain:
        assert isinstance(batched.module.get_submodule(name), batch_layers.AbstractBatchModule), name
    return len(plain)


class Tokens(nn.Module):
    """A root owning a class token and positions around registered layers (the ViT pattern, in small)."""

    def __init__(self, d: int = 6, tokens: int = 3) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, d))
        self.gamma = nn.Parameter(torch.randn(d))
        self.embed = nn.Linear(4, d)
        self.blocks = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.head = nn.Linear(d, 2)

    class Bias(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.b = nn.Parameter(torch.randn(d))

        def forward(self, x: Tensor) -> Tensor:
            return x + self.b

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:  # iterated, not called: each block is called from the root's own code
            x = block(x)
        x = x * self.gamma.view(1, 1, -1)
        return self.head(x[:, 0] + F.linear(x[:, 1], self.blocks[0].weight))  # a child's weight read directly


def test_own_parameters_keep_the_childrens_fast_paths() -> None:
    torch.manual_seed(0)
    batched = BatchModule(Tokens(), B)
    x = torch.randn(B, N, 3, 4, dtype=torch.float64)
    batched(x.float())  # its read of self.blocks[0].weight, hidden from the source reading, is found here
    assert generic_paths(batched) == {"": "generic-own"}
    assert registered_layers_everywhere(batched, nn.Linear) == 4
    assert batched.module.cls_token.shape == (B, 1, 1, 6)
    assert_equivalent(lambda: Tokens().double(), B, x, steps=3, **DOUBLE)
    assert_isolated(BatchModule.from_factory(Tokens, B, seed=0), x.float(), model=1)


class Gate(nn.Module):
    """No registered layer below: batched whole, its child running under its vmap."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.inner = Tokens.Bias(d)
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * torch.sigmoid(self.w)


class Gated(Tokens):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.gate(self.embed(x[:, 0]))[:, :2]


def test_a_whole_subtree_inside_an_own_state_module() -> None:
    torch.manual_seed(0)
    batched = BatchModule(Gated(), B)
    assert generic_paths(batched) == {"": "generic-own", "gate": "generic-whole"}
    x = torch.randn(B, N, 3, 4, dtype=torch.float64)
    assert_equivalent(lambda: Gated().double(), B, x, steps=2, **DOUBLE)
    copied = copy.deepcopy(batched)
    torch.testing.assert_close(copied(x.float()), batched(x.float()))


def test_own_parameters_with_the_shared_input() -> None:
    torch.manual_seed(0)
    x = torch.randn(N, 3, 4, dtype=torch.float64)
    assert_equivalent(lambda: Tokens().double(), B, x, steps=2, shared_input=True, **DOUBLE)


def tiny_timm_vit() -> nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, embed_dim=16, num_heads=2, num_classes=10
    ).double()


def test_timm_vit_root_broadcasts_its_tokens_and_its_layers_stay_registered() -> None:
    """The root's cls_token is expanded to the data's rows in a helper method (``_pos_embed``) and
    concatenated, pos_embed added: both on the merged axis, the root no region."""
    torch.manual_seed(0)
    batched = BatchModule(tiny_timm_vit(), B)
    assert conversion_paths(batched)[""] == "broadcast-own"  # cls_token, pos_embed
    assert generic_paths(batched) == {}
    assert registered_layers_everywhere(batched, nn.Linear) == 9
    assert registered_layers_everywhere(batched, nn.Conv2d) == 1
    assert_equivalent(tiny_timm_vit, B, torch.randn(B, N, 3, 16, 16, dtype=torch.float64), steps=2, **DOUBLE)
    shared = torch.randn(N, 3, 16, 16, dtype=torch.float64)
    assert_equivalent(tiny_timm_vit, B, shared, steps=2, shared_input=True, **DOUBLE)


@pytest.mark.parametrize(
    "variant", [{"reg_tokens": 2}, {"no_embed_class": True}, {"class_token": False, "global_pool": "avg"}]
)
def test_timm_vit_variants_of_its_tokens_match_plain_models(variant: dict) -> None:
    def make() -> nn.Module:
        return timm.create_model(
            "vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1, embed_dim=16, num_heads=2, **variant
        ).double()

    torch.manual_seed(0)
    assert conversion_paths(BatchModule(make(), B))[""] == "broadcast-own"
    assert_equivalent(make, B, torch.randn(B, N, 3, 16, 16, dtype=torch.float64), steps=2, **DOUBLE)


def test_a_flag_taking_the_other_branch_keeps_the_root_per_model() -> None:
    """With dynamic_img_size, timm's _pos_embed resamples pos_embed through a function of its own: not an
    element-wise use, so the root is a region."""

    def make() -> nn.Module:
        return timm.create_model(
            "vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1, embed_dim=16, num_heads=2,
            dynamic_img_size=True,
        ).double()  # fmt: skip

    torch.manual_seed(0)
    assert generic_paths(BatchModule(make(), B))[""] == "generic-own"
    assert_equivalent(make, B, torch.randn(B, N, 3, 16, 16, dtype=torch.float64), steps=2, **DOUBLE)



def test_torchvision_vit_class_token_and_encoder_positions() -> None:
    """The root expands class_token to ``n = x.shape[0]`` rows: broadcast on the merged axis. With the shared
    input, ``_process_input`` reshapes the patches to the n it read from the input, one model's count: the
    first shared-input forward finds that and runs the root per model."""

    def make() -> nn.Module:
        return torchvision.models.VisionTransformer(
            image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=10
        ).double()

    torch.manual_seed(0)
    batched = BatchModule(make(), B)
    paths = conversion_paths(batched)
    assert (paths[""], paths["encoder"]) == ("broadcast-own", "broadcast-own")  # encoder: pos_embedding
    assert registered_layers_everywhere(batched, nn.Conv2d) == 1
    assert_equivalent(make, B, torch.randn(B, N, 3, 16, 16, dtype=torch.float64), steps=2, **DOUBLE)
    batched.double()(torch.randn(B, N, 3, 16, 16, dtype=torch.float64))
    assert batched.generic_modules == []
    batched(torch.randn(N, 3, 16, 16, dtype=torch.float64), shared_input=True)
    assert batched.generic_modules == ["VisionTransformer"]
    assert "reshape of dim 0 to 2 rows, one model's sample count n" in batched.conversion_report()[0].reason
    assert_equivalent(make, B, torch.randn(N, 3, 16, 16, dtype=torch.float64), steps=2, shared_input=True, **DOUBLE)


LAYER_SCALE_BLOCKS = {
    # torchvision ConvNeXt: `self.layer_scale * result` with layer_scale (C, 1, 1)
    "torchvision-cnblock": (lambda: tv_convnext.CNBlock(8, layer_scale=0.5, stochastic_depth_prob=0.0), (8, 5, 5)),
    # timm ConvNeXt: `x.mul(self.gamma.reshape(1, -1, 1, 1))`
    "timm-convnext-block": (lambda: timm_convnext.ConvNeXtBlock(8, ls_init_value=0.5, kernel_size=3), (8, 5, 5)),
    # timm LayerScale, in place: `x.mul_(self.gamma)`
    "timm-layerscale-inplace": (
        lambda: nn.Sequential(nn.Linear(4, 6), timm.layers.LayerScale(6, 0.5, inplace=True), nn.Linear(6, 3)),
        (4,),
    ),
}


@pytest.mark.parametrize("name", LAYER_SCALE_BLOCKS)
def test_layer_scales(name: str) -> None:
    make, shape = LAYER_SCALE_BLOCKS[name]
    torch.manual_seed(0)
    batched = BatchModule(make(), B)
    assert registered_layers_everywhere(batched, nn.Linear) >= 2
    assert sum(path == "generic-own" for path in generic_paths(batched).values()) <= 1
    assert_equivalent(lambda: make().double(), B, torch.randn(B, N, *shape, dtype=torch.float64), steps=2, **DOUBLE)


def test_swin_relative_position_tables() -> None:
    def timm_attention() -> nn.Module:
        return timm_swin.WindowAttention(8, num_heads=2, window_size=2).double()

    def torchvision_attention() -> nn.Module:
        return tv_swin.ShiftedWindowAttention(8, [2, 2], [1, 1], num_heads=2).double()

    torch.manual_seed(0)
    for make, shape in ((timm_attention, (4, 8)), (torchvision_attention, (4, 4, 8))):
        batched = BatchModule(make(), B)
        assert generic_paths(batched) == {"": "generic-own"}  # relative_position_bias_table (and its index)
        assert registered_layers_everywhere(batched, nn.Linear) == 2
        # torchvision's attention reads self.qkv.weight itself: the root's code sees each model's slice
        assert_equivalent(make, B, torch.randn(B, N, *shape, dtype=torch.float64), steps=2, **DOUBLE)


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching")
def test_constant_tensor_arguments_of_a_generic_module_are_not_split() -> None:
    # timm's shifted-window block hands its attention a (windows, N, N) mask; here windows == B * n == 6
    def swin_block() -> nn.Module:
        return timm_swin.SwinTransformerBlock(8, (4, 6), num_heads=2, window_size=2, shift_size=1).double()

    # EVA's blocks hand their attention rotary tables computed from non-persistent buffers
    def eva() -> nn.Module:
        return timm.create_model(
            "eva02_tiny_patch14_224", img_size=28, patch_size=14, depth=1, embed_dim=16, num_heads=2, num_classes=5
        ).double()

    torch.manual_seed(0)
    assert_equivalent(swin_block, 2, torch.randn(2, 3, 4, 6, 8, dtype=torch.float64), steps=2, **DOUBLE)
    assert_equivalent(eva, B, torch.randn(B, N, 3, 28, 28, dtype=torch.float64), steps=2, **DOUBLE)


# -- randomness -------------------------------------------------------------------------------------------


class OwnNoise(nn.Module):
    """Randomness in a generic module's own code: an in-place draw on a fresh tensor, and torch.rand."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x: Tensor) -> Tensor:
        keep = torch.empty(x.shape[0], 16).bernoulli_(0.5) if self.training else 1.0
        return x * self.w * keep + (torch.rand(16) if self.training else 0.0)


def test_randomness_in_generic_code_differs_between_models() -> None:
    batched = BatchModule(OwnNoise(), 4)  # its w is used element-wise: broadcast per model on the merged axis,
    out = batched(torch.ones(4, 8, 16))  # until the first forward finds torch.rand(16) drawn once for all models
    assert batched.generic_modules == ["OwnNoise"]
    assert all(not torch.equal(out[0], out[i]) for i in range(1, 4))
    batched.eval()
    torch.testing.assert_close(batched(torch.ones(4, 8, 16)), torch.ones(4, 8, 16))


@pytest.mark.parametrize("mode", ["batch", "row"])
def test_stochastic_depth_draws_per_model(mode: str) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), torchvision.ops.StochasticDepth(0.5, mode))

    batched = BatchModule(make(), 16)
    if mode == "batch":  # one draw per batch, so one per model: run under vmap
        assert generic_paths(batched) == {"1": "generic-whole"}
    else:  # one draw per sample is already per model on the merged axis
        assert generic_paths(batched) == {}
    kept = (batched(torch.ones(5, 4), shared_input=True) != 0).any(-1)  # (B, n): which samples survived
    if mode == "batch":
        assert all(len(set(row.tolist())) == 1 for row in kept), "a model keeps or drops all its samples"
    assert len({tuple(row.tolist()) for row in kept}) > 1, "models draw independently"
    torch.manual_seed(0)
    assert_equivalent(make, 3, torch.randn(3, N, 4), steps=2, train=False)


def test_convnext_block_trains_with_stochastic_depth_in_each_mode() -> None:
    # torchvision's CNBlock owns layer_scale; its StochasticDepth("row") runs on the merged axis
    torch.manual_seed(0)
    batched = BatchModule(tv_convnext.CNBlock(8, layer_scale=0.5, stochastic_depth_prob=0.5), 8)
    x = torch.randn(8, 4, 8, 3, 3)
    out = batched(x)
    out.square().sum().backward()
    dropped = (out - x).flatten(2).abs().sum(-1) == 0  # (B, n): the residual branch dropped, per sample
    assert dropped.any() and not dropped.all()
    assert len({tuple(row.tolist()) for row in dropped}) > 1


def test_timm_drop_path_in_a_vit_draws_per_model() -> None:
    def make() -> nn.Module:
        return timm.create_model(
            "vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, embed_dim=16, num_heads=2, drop_path_rate=0.5
        )

    batched = BatchModule(make(), 4)
    x = torch.randn(8, 3, 16, 16)
    torch.manual_seed(0)
    first = batched(x, shared_input=True)
    assert all(not torch.allclose(first[0], first[i]) for i in range(1, 4))
    first.sum().backward()
    batched.eval()
    torch.testing.assert_close(batched(x, shared_input=True), batched(x, shared_input=True))


# -- buffers ----------------------------------------------------------------------------------------------


class RunningMean(nn.Module):
    """An EMA kept by reassignment, the way custom norms and EMA trackers write it."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("running", torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.running = 0.9 * self.running + 0.1 * x.detach().mean(0)
        return (x - self.running) * self.scale


class Accumulator(nn.Module):
    """No parameters; a buffer that accumulates data."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        self.total += x.detach().sum(0)
        return x - self.total


def test_reassigned_buffer_is_written_back_per_model() -> None:
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(5, 5), RunningMean())  # noqa: E731
    report = assert_equivalent(make, B, torch.randn(B, N, 5), steps=3)
    assert "final model 2 1.running" in report
    batched = BatchModule(make(), B)
    x = torch.randn(B, N, 5)
    batched(x)
    assert not torch.equal(batched.module[1].running[0], batched.module[1].running[1])


def test_parameter_free_module_with_a_buffer_keeps_one_per_model() -> None:
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(5, 5), Accumulator(), nn.Linear(5, 2))  # noqa: E731
    batched = BatchModule(make(), B)
    assert generic_paths(batched) == {"1": "generic-whole"}
    assert batched.module[1].total.shape == (B, 5)
    assert_equivalent(make, B, torch.randn(B, N, 5), steps=3)
    assert_isolated(batched, torch.randn(B, N, 5))


def test_non_persistent_buffer_is_a_shared_constant() -> None:
    class Offsets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("offset", torch.arange(5.0), persistent=False)

        def forward(self, x: Tensor) -> Tensor:
            return x + self.offset

    batched = BatchModule(nn.Sequential(nn.Linear(5, 5), Offsets()), B)
    assert generic_paths(batched) == {}
    assert batched.module[1].offset.shape == (5,)


@pytest.mark.cuda
def test_timm_vit_trains_on_cuda_with_fused_attention() -> None:
    """The blocks run on the merged axis outside the root's vmap, so SDPA gets plain tensors."""

    def make() -> nn.Module:
        return timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10, drop_path_rate=0.1
        ).cuda()

    torch.manual_seed(0)
    assert_equivalent(make, B, torch.randn(B, N, 3, 32, 32, device="cuda"), steps=2, train=False, atol=1e-4)
    batched = BatchModule(make(), 8)
    with torch.autocast("cuda", torch.bfloat16):
        out = batched(torch.randn(16, 3, 32, 32, device="cuda"), shared_input=True)
    out.float().square().sum().backward()
    assert all(p.grad is not None for p in batched.parameters())
    assert not torch.equal(out[0], out[1])


@pytest.mark.cuda
def test_convnext_block_trains_on_cuda() -> None:
    def make() -> nn.Module:
        return tv_convnext.CNBlock(16, layer_scale=0.5, stochastic_depth_prob=0.0).cuda()

    torch.manual_seed(0)
    assert_equivalent(make, B, torch.randn(B, N, 16, 8, 8, device="cuda"), steps=2, atol=1e-4)


class Counting(nn.Module):
    """No parameters of its own, registered layers below, and a buffer it changes: refused, not pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.register_buffer("seen", torch.zeros(5))
        self.register_buffer("table", torch.arange(5.0))  # a constant, like a positional table

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.seen += x.detach().sum(0)
        return self.fc(x) + self.table


def test_buffers_of_a_module_without_parameters_above_registered_layers() -> None:
    batched = BatchModule(Counting(), B)
    entry = batched.conversion_report()[0]
    assert entry.path == "passthrough" and "buffers seen, table stay shared constants" in entry.reason
    assert batched.module.table.shape == (5,)
    batched.eval()
    assert_equivalent(lambda: Counting().eval(), B, torch.randn(B, N, 5), steps=1, train=False)
    batched.train()
    with pytest.raises(RuntimeError, match=r"Counting changed its buffers seen in forward.*move it into a child"):
        batched(torch.randn(B, N, 5))


class TableBias(nn.Module):
    """Swin V2's pattern: a bias computed by a small registered MLP from a coordinate table."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))
        self.register_buffer("coords", torch.linspace(-1, 1, 6).view(1, 3, 2), persistent=persistent)
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.mlp(self.coords)  # (1, 3, 3): per model, though no sample axis
        return self.fc(x) * self.scale + bias[0, 0]


@pytest.mark.parametrize("persistent", [True, False], ids=["per-model-table", "constant-table"])
def test_a_region_calls_a_layer_on_a_table(persistent: bool) -> None:
    torch.manual_seed(0)
    assert_equivalent(lambda: TableBias(persistent).double(), B, torch.randn(B, N, 3, dtype=torch.float64), **DOUBLE)


class FourierPositions(nn.Module):
    """XCiT's encoder in small: called with sizes alone, it builds a grid, projects it with a registered
    layer and repeats the result for every sample."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.project = nn.Linear(2, d)

    def forward(self, samples: int, tokens: int) -> Tensor:
        grid = torch.linspace(-1, 1, 2 * tokens, dtype=self.project.weight.dtype).view(1, tokens, 2)
        return self.project(grid).repeat(samples, 1, 1)


class EncodedTokens(nn.Module):
    def __init__(self, d: int = 4, tokens: int = 3) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.positions = FourierPositions(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.positions(x.shape[0], x.shape[1])
        return self.head(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1))


def test_a_region_calls_a_child_with_no_tensor_that_runs_a_layer_on_a_constant() -> None:
    torch.manual_seed(0)
    batched = BatchModule(EncodedTokens(), B)
    assert generic_paths(batched) == {"": "generic-own"}
    assert registered_layers_everywhere(batched, nn.Linear) == 2
    inputs = torch.randn(B, N, 3, 4, dtype=torch.float64)
    assert_equivalent(lambda: EncodedTokens().double(), B, inputs, **DOUBLE)


class BiasedAttention(nn.Module):
    """BEiT's attention in small: it owns a relative position bias and hands it to fused attention as a
    float mask, which must get its gradient (on CPU, vmap's flash kernel would refuse a mask needing one)."""

    def __init__(self, d: int = 4, heads: int = 2, tokens: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens))
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: Tensor) -> Tensor:
        n, tokens, d = x.shape
        qkv = self.qkv(x).reshape(n, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.unsqueeze(0))
        return out.transpose(1, 2).reshape(n, tokens, d)


def test_a_region_attends_with_a_learned_float_mask() -> None:
    torch.manual_seed(0)
    batched = BatchModule(BiasedAttention(), B)
    assert generic_paths(batched) == {"": "generic-own"}
    inputs = torch.randn(B, N, 3, 4, dtype=torch.float64)
    assert_equivalent(lambda: BiasedAttention().double(), B, inputs, **DOUBLE)


class DroppedAttention(nn.Module):
    """EVA's attention in small: it owns a parameter (a layer scale) and drops attention weights."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: Tensor) -> Tensor:
        n, tokens, d = x.shape
        q, k, v = self.qkv(x).reshape(n, tokens, 3, 2, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0)
        return self.gamma * out.transpose(1, 2).reshape(n, tokens, d)


def test_attention_dropout_in_a_region_draws_per_model() -> None:
    """On CPU torch has no batching rule for attention dropout (it would loop, warning); spelled out, each
    model draws its own mask."""
    torch.manual_seed(0)
    batched = BatchModule(DroppedAttention(), B)
    one_input = torch.randn(1, N, 4, 8)
    outputs = batched(one_input.expand(B, -1, -1, -1))
    assert not torch.equal(outputs[0], outputs[1])
    batched.eval()
    plain = batched.unbatch(0).eval()
    torch.testing.assert_close(batched(one_input.expand(B, -1, -1, -1))[0], plain(one_input[0]))


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_patch16_224"])
def test_layers_called_from_a_region_see_its_tensors_as_the_models_data(name: str) -> None:
    """A ViT's root resampling its positions (``dynamic_img_size``) runs per model; the blocks it calls
    escape onto the merged axis with the region's tensors, which are the models' data: no block is mistaken
    for code calling its layers on constants (each block had been made a region of its own, then its
    attention and MLP)."""

    def make() -> nn.Module:
        return timm.create_model(name, img_size=32, patch_size=8, depth=2, dynamic_img_size=True).double()

    batched = BatchModule(make(), 2)
    batched(torch.randn(2, 2, 3, 32, 32, dtype=torch.float64))
    assert batched.generic_modules == ["VisionTransformer"]  # the root alone
    assert_equivalent(make, 2, torch.randn(2, 2, 3, 32, 32, dtype=torch.float64), steps=2)
