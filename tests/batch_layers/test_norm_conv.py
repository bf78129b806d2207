"""ConvTransposeNd, Bilinear, the per-sample norms, PReLU and the refusals beyond the generic layer table:
shared inputs, sequence-first layouts, ``output_size``, initialisation, conversion and bad input."""

from __future__ import annotations

import pytest
import torch
from support.graph import grouped_conv_node
from torch import nn

import batch_layers
from torchmb import BatchModule, lookup_batch_module, refuse_batch_module, refused_batch_modules
from torchmb.testing import assert_equivalent, assert_isolated

B, N = 3, 4


def _randomize(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.PReLU):
                param.normal_(1.0, 0.5)
        for module in model.modules():
            if getattr(module, "running_mean", None) is not None:
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2)
    return model


class TwoInputBilinear(nn.Module):
    """Bilinear fed either the (shared) input twice or the input and a transformed copy of it."""

    def __init__(self, mixed: bool, sizes: tuple[int, int, int] = (5, 4, 3), swap: bool = False) -> None:
        super().__init__()
        in1, in2, out = sizes
        self.mixed, self.swap = mixed, swap
        self.proj = nn.Linear(in1, in2)
        second = in2 if mixed else in1
        self.bilinear = nn.Bilinear(second, in1, out) if swap else nn.Bilinear(in1, second, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        other = torch.tanh(self.proj(x)) if self.mixed else x
        return self.bilinear(other, x) if self.swap else self.bilinear(x, other)


class SequenceFirst(nn.Module):
    """Applies ``layer`` to a sequence-first ``(seq, n, d)`` view, as nn.Transformer*(batch_first=False) does."""

    def __init__(self, layer: nn.Module, d: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layer = layer
        self.two_inputs = isinstance(layer, nn.Bilinear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).transpose(0, 1)  # (seq, n, d)
        if self.two_inputs:
            h = self.layer(h, torch.tanh(h))
        else:
            h = self.layer(h)
        return h.transpose(0, 1)


SHARED_MODELS = {
    "convtranspose2d": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3, stride=2), nn.ReLU()), (3, 4, 4)),
    "convtranspose2d-groups": (lambda: nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2), (4, 3, 3)),
    "convtranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), (3, 5)),
    "bilinear-shared-both": (lambda: TwoInputBilinear(mixed=False), (5,)),
    "bilinear-shared-x1": (lambda: TwoInputBilinear(mixed=True), (5,)),
    "bilinear-shared-x1-outer-sizes": (lambda: TwoInputBilinear(mixed=True, sizes=(2, 3, 8)), (2,)),
    "bilinear-shared-x2": (lambda: TwoInputBilinear(mixed=True, swap=True), (5,)),
    "layernorm": (lambda: _randomize(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 2))), (5, 6)),
    "layernorm-no-affine": (lambda: nn.Sequential(nn.LayerNorm(6, elementwise_affine=False), nn.Linear(6, 2)), (6,)),
    "rmsnorm": (lambda: _randomize(nn.Sequential(nn.RMSNorm(6), nn.Linear(6, 2))), (6,)),
    "groupnorm": (lambda: _randomize(nn.Sequential(nn.GroupNorm(2, 4), nn.Conv2d(4, 2, 1))), (4, 3, 3)),
    "instancenorm2d-affine-running": (
        lambda: _randomize(nn.Sequential(nn.InstanceNorm2d(4, affine=True, track_running_stats=True))),
        (4, 3, 3),
    ),
    "instancenorm1d-running": (
        lambda: _randomize(nn.Sequential(nn.InstanceNorm1d(4, track_running_stats=True), nn.Conv1d(4, 2, 1))),
        (4, 5),
    ),
    "prelu": (lambda: nn.Sequential(nn.PReLU(init=0.1), nn.Linear(6, 2)), (6,)),
    "prelu-channels": (lambda: _randomize(nn.Sequential(nn.PReLU(4), nn.Conv2d(4, 2, 1))), (4, 3, 3)),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", SHARED_MODELS)
def test_shared_input_matches_independent_models(name: str, train: bool) -> None:
    make, shape = SHARED_MODELS[name]
    torch.manual_seed(0)
    report = assert_equivalent(make, B, torch.randn(N, *shape), steps=3, train=train, shared_input=True)
    assert report, "nothing was compared"


SEQUENCE_FIRST = {
    "layernorm": lambda: _randomize(SequenceFirst(nn.LayerNorm(6))),
    "rmsnorm": lambda: _randomize(SequenceFirst(nn.RMSNorm(6))),
    "prelu": lambda: SequenceFirst(nn.PReLU(init=0.3)),
    "bilinear": lambda: SequenceFirst(nn.Bilinear(6, 6, 6)),
}


@pytest.mark.parametrize("name", SEQUENCE_FIRST)
def test_sequence_first_layout(name: str) -> None:
    torch.manual_seed(0)
    # seq = 5 differs from n, so the merged axis is found in dim 1.
    assert_equivalent(SEQUENCE_FIRST[name], B, torch.randn(B, N, 5, 6), steps=3)
    batched = BatchModule(SEQUENCE_FIRST[name](), B, init="independent", seed=1)
    assert_isolated(batched, torch.randn(B, N, 5, 6))


@pytest.mark.parametrize("cls", [nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d])
def test_conv_transpose_output_size(cls: type[nn.Module]) -> None:
    dims = {nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}[cls]
    torch.manual_seed(0)
    plain = [cls(2, 3, 3, stride=2, padding=1) for _ in range(B)]
    batched = lookup_batch_module(cls).from_module(plain[0], B)
    with torch.no_grad():
        batched.weight.copy_(torch.stack([p.weight for p in plain]))
        batched.bias.copy_(torch.stack([p.bias for p in plain]))
    x = torch.randn(B, N, 2, *([4] * dims))
    size = [8] * dims  # (4 - 1) * 2 - 2 + 3 = 7, so output_size 8 needs output_padding 1
    y = batched(x.flatten(0, 1), output_size=size)
    assert y.shape == (B * N, 3, *size)
    for i, layer in enumerate(plain):
        torch.testing.assert_close(y.view(B, N, *y.shape[1:])[i], layer(x[i], output_size=size), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="requested an output size"):
        batched(x.flatten(0, 1), output_size=[12] * dims)


@pytest.mark.parametrize(
    ("batched_class", "args"),
    [
        (batch_layers.ConvTranspose2d, (2, 3, 3)),
        (batch_layers.ConvTranspose1d, (4, 2, 2)),
        (batch_layers.Bilinear, (3, 4, 2)),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_reset_parameters_draws_like_b_torch_layers(batched_class, args) -> None:
    torch.manual_seed(0)
    batched = batched_class(*args, batch=4)
    torch.manual_seed(0)
    plain = [batched_class.base_class(*args) for _ in range(4)]
    for i, layer in enumerate(plain):
        for name, param in layer.named_parameters():
            assert torch.equal(getattr(batched, name)[i], param), name
    assert not torch.equal(batched.weight[0], batched.weight[1])


@pytest.mark.parametrize(
    ("make", "attributes"),
    [
        (lambda: nn.LayerNorm((2, 3), eps=1e-3, bias=False), {"normalized_shape": (2, 3), "eps": 1e-3}),
        (lambda: nn.RMSNorm(4, eps=None), {"normalized_shape": (4,), "eps": None}),
        (lambda: nn.GroupNorm(2, 4, eps=1e-4, affine=False), {"num_groups": 2, "eps": 1e-4, "affine": False}),
        (lambda: nn.InstanceNorm2d(4, momentum=None, track_running_stats=True), {"momentum": None}),
        (lambda: nn.PReLU(4, init=0.5), {"num_parameters": 4, "init": 0.5}),
        (lambda: nn.ConvTranspose2d(2, 4, 3, 2, 1, 1, 2, False, 1), {"output_padding": (1, 1), "groups": 2}),
        (lambda: nn.Dropout2d(0.2, inplace=True), {"p": 0.2, "inplace": True}),
    ],
)
def test_from_module_keeps_hyperparameters_and_defaults(make, attributes) -> None:
    plain = make()
    batched = lookup_batch_module(type(plain)).from_module(plain, 2)
    for name, value in attributes.items():
        assert getattr(batched, name) == value, name
    for name, tensor in plain.state_dict().items():
        assert batched.state_dict()[name].shape == (2, *tensor.shape)
        assert torch.equal(batched.state_dict()[name][1], tensor)
    assert "batch=2" in repr(batched)


def test_local_response_norm_runs_per_sample() -> None:
    """nn.LocalResponseNorm has no parameters and no batched class: it runs on the merged axis as it is."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 6, 3), nn.LocalResponseNorm(3, alpha=0.5, k=1.5), nn.Conv2d(6, 2, 1))

    assert lookup_batch_module(nn.LocalResponseNorm) is None
    torch.manual_seed(0)
    x = torch.randn(B, N, 3, 5, 5)
    assert_equivalent(make, B, x, steps=3)
    batched = BatchModule(make(), B, init="independent", seed=0)
    assert not batched.generic_modules
    assert_isolated(batched, x)


@pytest.mark.parametrize(
    ("name", "args"), [("LazyLinear", (6,)), ("LazyConv2d", (6, 3)), ("LazyBatchNorm1d", ()), ("SyncBatchNorm", (6,))]
)
def test_out_of_scope_layers_are_refused_by_the_registry(name: str, args: tuple[int, ...]) -> None:
    plain = getattr(nn, name)(*args)
    assert type(plain) in refused_batch_modules()
    with pytest.raises(TypeError, match=f"{name} is out of scope for torchmb"):
        lookup_batch_module(type(plain))

    class MySyncBatchNorm(nn.SyncBatchNorm):  # a subclass of a refused type is refused too
        pass

    with pytest.raises(TypeError, match="SyncBatchNorm is out of scope for torchmb"):
        lookup_batch_module(MySyncBatchNorm)


def test_refusing_a_type_of_your_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchmb import _registry

    monkeypatch.setattr(_registry, "_REFUSED", refused_batch_modules())  # (this test's refusal goes after it)

    class Unbatchable(nn.Linear):
        pass

    assert lookup_batch_module(Unbatchable) is batch_layers.Linear
    refuse_batch_module(Unbatchable, "Unbatchable is out of scope: it talks to a server per sample")
    with pytest.raises(TypeError, match="Unbatchable is out of scope: it talks to a server"):
        BatchModule(nn.Sequential(Unbatchable(3, 2)), 2)
    with pytest.raises(ValueError, match="Unbatchable is refused already"):
        refuse_batch_module(Unbatchable, "another reason")
    with pytest.raises(TypeError, match=r"expects an nn\.Module subclass, got 3"):
        refuse_batch_module(3, "no")  # type: ignore[arg-type]


def test_sync_batchnorm_refused_by_batch_module() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.SyncBatchNorm(6))
    with pytest.raises(TypeError, match=r"SyncBatchNorm is out of scope for torchmb.*nn.BatchNorm1d/2d/3d"):
        BatchModule(model, 2)


def test_lazy_linear_refused_by_batch_module() -> None:
    with pytest.raises(TypeError, match=r"LazyLinear is out of scope for torchmb.*run one forward"):
        BatchModule(nn.Sequential(nn.LazyLinear(3)), 2)


def test_lazy_linear_materialised_first_converts() -> None:
    model = nn.Sequential(nn.LazyLinear(3))
    model(torch.randn(2, 5))  # the documented way out: one forward materialises it as nn.Linear
    batched = BatchModule(model, 2)
    assert isinstance(batched.module[0], batch_layers.Linear)


def test_bad_arguments_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by groups"):
        batch_layers.ConvTranspose2d(3, 4, 3, groups=2, batch=2)
    with pytest.raises(ValueError, match='Only "zeros" padding mode'):
        batch_layers.ConvTranspose2d(3, 4, 3, padding_mode="reflect", batch=2)
    with pytest.raises(ValueError, match="numeric padding"):
        batch_layers.ConvTranspose2d(3, 4, 3, padding="same", batch=2)
    with pytest.raises(ValueError, match="output_padding"):
        batch_layers.ConvTranspose2d(3, 4, 3, stride=2, output_padding=2, batch=2)
    with pytest.raises(ValueError, match=r"expected a 4-D input \(B\*n, 3, \*, \*\).*got shape \(4, 3, 5\)"):
        batch_layers.ConvTranspose2d(3, 4, 3, batch=2)(torch.randn(4, 3, 5))
    with pytest.raises(ValueError, match=r"expected input1 of shape \(B\*n, \*, 5\), got \(4, 4\)"):
        batch_layers.Bilinear(5, 4, 3, batch=2)(torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(ValueError, match="must agree in every dim but the last"):
        batch_layers.Bilinear(5, 4, 3, batch=2)(torch.randn(4, 5), torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"expected an input of shape \(B\*n, \*, 2, 3\), got \(4, 3, 2\)"):
        batch_layers.LayerNorm((2, 3), batch=2)(torch.randn(4, 3, 2))
    with pytest.raises(ValueError, match=r"num_channels \(5\) must be divisible by num_groups \(2\)"):
        batch_layers.GroupNorm(2, 5, batch=2)
    with pytest.raises(ValueError, match=r"GroupNorm: expected an input of shape \(B\*n, 4, \*\)"):
        batch_layers.GroupNorm(2, 4, batch=2)(torch.randn(4, 6, 3))
    with pytest.raises(ValueError, match="expected a 4-D input"):
        batch_layers.InstanceNorm2d(3, batch=2)(torch.randn(4, 3, 5))
    with pytest.raises(ValueError, match=r"match num_features \(3\), but got: 4"):
        batch_layers.InstanceNorm2d(3, affine=True, batch=2)(torch.randn(4, 4, 5, 5))
    with pytest.warns(UserWarning, match="does not match num_features"):
        batch_layers.InstanceNorm2d(3, batch=2)(torch.randn(4, 4, 5, 5))
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        batch_layers.InstanceNorm1d(3, batch=2)(torch.randn(4, 3, 1))
    with pytest.raises(ValueError, match=r"PReLU: expected an input of shape \(B\*n, 4, \*\)"):
        batch_layers.PReLU(4, batch=2)(torch.randn(4, 3, 2))
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
        batch_layers.Dropout(1.5, batch=2)
    with pytest.raises(ValueError, match=r"multiple of B = 3 \(the merged model axis\)"):
        batch_layers.LayerNorm(4, batch=3)(torch.randn(4, 4))


def test_conv_transpose_backward_keeps_the_models_major_input() -> None:
    conv = batch_layers.ConvTranspose2d(3, 4, 2, stride=2, batch=2)
    x = torch.randn(2 * 5, 3, 4, 4, requires_grad=True)
    y = conv(x)
    saved_input, saved_weight = grouped_conv_node(y).saved_tensors
    assert saved_input.data_ptr() == x.data_ptr(), "the layer's own input is kept, no layout copy of it"
    assert saved_weight.data_ptr() == conv.weight.data_ptr()


@pytest.mark.parametrize("order", ["models", "samples"])
def test_conv_transpose_double_backward_matches_finite_differences(order: str) -> None:
    from batch_layers._conv import grouped_conv

    conv = batch_layers.ConvTranspose1d(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2, batch=2,
                                        dtype=torch.float64)
    x = torch.randn(2 * 2, 2, 5, dtype=torch.float64, requires_grad=True)

    def fn(x, weight, bias):
        # B=2 models x 2 groups: weight (B*C_in, C_out/groups, k), 4 groups.
        # stride 2, padding 1, dilation 1, transposed, output_padding 1
        config = (2, (2,), (1,), (1,), 4, True, (1,), order)
        return grouped_conv(x, weight.reshape(4, 2, 3), bias.reshape(8), *config)

    assert torch.autograd.gradcheck(fn, (x, conv.weight, conv.bias))
    assert torch.autograd.gradgradcheck(fn, (x, conv.weight, conv.bias))
