"""Own parameters used only element-wise (layer scales, affines) run on the merged axis, broadcast per model
(``broadcast-own``), against B plain models; a use the source reading missed sends the module per model at
the first forward, and later raises."""

from __future__ import annotations

import pytest
import torch
from support.models import LayerScaleBlock, check_like_seeded_plain_models, conversion_paths
from support.torchvision_ops import import_torchvision
from torch import Tensor, nn

from torchmb import BatchModule
from torchmb.testing import assert_equivalent

B, N = 3, 2


class _Affine(nn.Module):
    """timm's ResMLP Affine and HGNet's learnable affine: ``torch.addcmul`` and ``scale * x + bias``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(dim) + 0.5)
        self.beta = nn.Parameter(torch.randn(dim))
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * torch.addcmul(self.beta, self.alpha, x) + self.beta.unsqueeze(0)


class _KeywordOperands(nn.Module):
    """Passes its parameters as keyword arguments and to ``torch.where``, beside numbers and a Python tuple."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(dim) + 0.5)
        self.floor = nn.Parameter(torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        shifted = torch.add(x, other=self.floor, alpha=0.5)
        leaky = torch.where(shifted > 0, shifted, self.gain * shifted)
        return torch.addcmul(leaky, self.gain.view(1, -1), x, value=2.0).permute((1, 0)).permute(1, 0)


class _HiddenMatmul(nn.Module):
    """Reads its parameter element-wise (``self.mix * 2.0``), then multiplies the data by a matrix made of it:
    the source reading passes it, the first forward finds the matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mix = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        scale = self.mix * 2.0
        return self.fc(x) @ torch.diag(scale)


class _LaterMatmul(_HiddenMatmul):
    """Multiplies by the matrix only once switched on, after the first forward."""

    switched = False

    def forward(self, x: Tensor) -> Tensor:
        scale = self.mix * 2.0
        return self.fc(x) @ torch.diag(scale) if self.switched else self.fc(x) * scale


class _Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) @ self.w


class _ClassToken(nn.Module):
    """A ViT's root in small: a class token expanded to the data's rows in a helper method (through a name
    unpacked from ``x.shape``), appended to a list and concatenated, positions added; with ``resample`` a
    branch that passes the positions to a function (not element-wise) runs instead."""

    def __init__(self, resample: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 6))
        self.pos_embed = nn.Parameter(torch.randn(1, 4, 6))
        self.head = nn.Linear(6, 2)
        self.resample = resample

    def _tokens(self, x: Tensor) -> Tensor:
        to_cat = []
        if self.cls_token is not None:
            rows, _, _ = x.shape
            to_cat.append(self.cls_token.expand(rows, -1, -1))
        if self.resample:
            pos_embed = nn.functional.interpolate(self.pos_embed.transpose(1, 2), size=x.shape[1] + 1).transpose(1, 2)
        else:
            pos_embed = self.pos_embed
        return torch.cat([*to_cat, x], dim=1) + pos_embed

    def forward(self, x: Tensor) -> Tensor:
        tokens = self._tokens(self.embed(x))
        return self.head(tokens[:, 0] + tokens[:, 1:].mean(dim=1))


class _FixedRows(nn.Module):
    """Expands its parameter to a number of rows written in its code (3): with B = 3 models of one sample, the
    merged row count too, which must not be taken for it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.rows = nn.Parameter(torch.randn(1, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) + self.rows.expand(3, -1)



def _matches_plain_models(make, x: Tensor, **kwargs) -> None:
    assert_equivalent(lambda: make().double(), B, x.double(), steps=2, lr=0.01, atol=1e-9, rtol=1e-7, **kwargs)


@pytest.mark.parametrize("order", ["models", "samples"])
def test_a_layer_scale_block_is_broadcast_per_model_like_plain_models(order: str) -> None:
    torch.manual_seed(0)
    batched = BatchModule.from_factory(LayerScaleBlock, B, seed=0, merged_order=order)
    assert conversion_paths(batched)[""] == "broadcast-own" and batched.generic_modules == []
    x = torch.randn(B, N, 4, 5, 5)
    out = batched(x)
    out.square().sum().backward()
    check_like_seeded_plain_models(LayerScaleBlock, batched, x, out)


@pytest.mark.parametrize("order", ["models", "samples"])
def test_a_layer_scale_step_under_a_dispatch_mode_is_like_plain_models(order: str) -> None:
    """A torch dispatch mode (FlopCounterMode here; profilers and debugging modes alike) calls every backward
    op from Python, so a saved tensor that were the parameter's subclass would reach its torch function there:
    what backward saves must be plain tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    batched = BatchModule.from_factory(LayerScaleBlock, B, seed=0, merged_order=order)
    x = torch.randn(B, N, 4, 5, 5)
    with FlopCounterMode(display=False):
        out = batched(x)
        out.square().sum().backward()
    check_like_seeded_plain_models(LayerScaleBlock, batched, x, out)


def test_affines_and_timm_layer_scales_match_plain_models() -> None:
    import_torchvision()  # timm imports torchvision
    from timm.layers import LayerScale, LayerScale2d

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), LayerScale(6, inplace=True), _Affine(6), LayerScale(6), nn.Linear(6, 2))

    batched = BatchModule(make(), B)
    paths = conversion_paths(batched)
    assert [paths[name] for name in ("1", "2", "3")] == ["broadcast-own"] * 3
    _matches_plain_models(make, torch.randn(B, N, 4))
    _matches_plain_models(lambda: nn.Sequential(nn.Conv2d(3, 4, 1), LayerScale2d(4)), torch.randn(B, N, 3, 4, 4))


@pytest.mark.parametrize("order", ["models", "samples"])
def test_keyword_operands_and_where_match_plain_models(order: str) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), _KeywordOperands(6), nn.Linear(6, 2))

    batched = BatchModule.from_factory(make, B, seed=0, merged_order=order)
    assert conversion_paths(batched)["1"] == "broadcast-own" and batched.generic_modules == []
    x = torch.randn(B, N, 4)
    out = batched(x)
    out.square().sum().backward()
    check_like_seeded_plain_models(make, batched, x, out)


def test_a_layer_scale_on_the_shared_input_gives_each_model_its_own_output() -> None:
    import_torchvision()
    from timm.layers import LayerScale

    def make() -> nn.Module:
        return nn.Sequential(LayerScale(4, init_values=1.0), nn.Linear(4, 3))

    _matches_plain_models(make, torch.randn(N, 4), shared_input=True)


def test_a_use_the_source_hides_runs_the_module_per_model_from_the_first_forward() -> None:
    torch.manual_seed(0)
    batched = BatchModule.from_factory(_HiddenMatmul, B, seed=0)
    assert conversion_paths(batched)[""] == "broadcast-own"
    batched(torch.randn(B, N, 4))
    entry = batched.conversion_report()[0]
    assert entry.path == "generic-own" and "at the first forward" in entry.reason and "matmul" in entry.reason
    assert batched.generic_modules == ["_HiddenMatmul"]
    _matches_plain_models(_HiddenMatmul, torch.randn(B, N, 4))


def test_a_use_found_after_the_first_forward_is_refused() -> None:
    batched = BatchModule(_LaterMatmul(), B)
    batched(torch.randn(B, N, 4))
    batched.module.switched = True
    with pytest.raises(RuntimeError, match="uses its own parameter otherwise than element-wise: matmul"):
        batched(torch.randn(B, N, 4))


def test_a_parameter_used_otherwise_stays_a_per_model_region() -> None:
    batched = BatchModule(_Projection(), B)
    assert conversion_paths(batched)[""] == "generic-own"
    _matches_plain_models(_Projection, torch.randn(B, N, 4))


class _ReadsChildScale(nn.Module):
    """A parent reading its child's broadcast layer scale: on the merged axis that is all models' stack."""

    def __init__(self) -> None:
        super().__init__()
        self.block = LayerScaleBlock()

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x) / self.block.gamma.norm()


def test_a_parent_reading_a_broadcast_parameter_runs_per_model() -> None:
    batched = BatchModule(_ReadsChildScale(), B)
    batched(torch.randn(B, N, 4, 5, 5))
    assert batched.generic_modules == ["_ReadsChildScale"]
    _matches_plain_models(_ReadsChildScale, torch.randn(B, N, 4, 5, 5))


def test_a_per_model_operand_answers_attribute_reads_as_one_models_parameter() -> None:
    """torch.compile's guards read attributes of the parameters (``is_nested``, ``nbytes``, ...) while the
    module's code runs: one model's answer, never a per-model computation (a ConvNeXt failed to compile)."""
    from torchmb._own_operands import PerModelOperand

    stacked = torch.randn(3, 4, 5).as_subclass(PerModelOperand)
    one = torch.randn(4, 5)
    assert stacked.nbytes == one.nbytes
    assert stacked.itemsize == one.itemsize
    assert (stacked.is_nested, stacked.is_sparse, stacked.is_quantized, stacked.is_meta) == (False,) * 4
    assert stacked.shape == one.shape
    assert (stacked.storage_offset(), stacked.is_complex(), stacked.get_device()) == (0, False, -1)
    assert (stacked.stride(), stacked.stride(-1), stacked.is_contiguous()) == (one.stride(), 1, True)
    transposed = torch.randn(3, 5, 4).transpose(1, 2).as_subclass(PerModelOperand)
    assert (transposed.stride(), transposed.is_contiguous()) == (torch.randn(5, 4).t().stride(), False)


@pytest.mark.parametrize("order", ["models", "samples"])
def test_a_class_token_expanded_to_the_datas_rows_is_broadcast_like_plain_models(order: str) -> None:
    batched = BatchModule.from_factory(_ClassToken, B, seed=0, merged_order=order)
    assert conversion_paths(batched)[""] == "broadcast-own" and batched.generic_modules == []
    x = torch.randn(B, N, 3, 4)
    out = batched(x)
    out.square().sum().backward()
    assert batched.generic_modules == []
    check_like_seeded_plain_models(_ClassToken, batched, x, out)
    _matches_plain_models(_ClassToken, torch.randn(N, 3, 4), shared_input=True)


def test_a_branch_the_flag_takes_decides_whether_the_source_is_element_wise() -> None:
    assert conversion_paths(BatchModule(_ClassToken(resample=True), B))[""] == "generic-own"
    _matches_plain_models(lambda: _ClassToken(resample=True), torch.randn(B, N, 3, 4))


def test_an_expand_to_a_number_of_rows_in_the_code_stays_per_model() -> None:
    assert conversion_paths(BatchModule(_FixedRows(), B))[""] == "generic-own"
    _matches_plain_models(_FixedRows, torch.randn(B, 1, 4))
