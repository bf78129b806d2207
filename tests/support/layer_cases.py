"""The table of layer cases: every registered batched layer against B independently held torch layers.

Each case builds one plain layer and the merged inputs for B models; ``run_case`` stacks B plain layers
(different weights) into the batched class that torchmb registers for them and compares outputs, input
gradients, parameter gradients and (after two steps) buffers, model by model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import batch_layers
from torchmb import lookup_batch_module

BATCH, SAMPLES = 3, 4


@dataclass
class LayerCase:
    name: str
    make: Callable[[], nn.Module]
    sample_shape: tuple[int, ...] = ()
    # (batch, samples, device) -> the layer's positional arguments for B models, each (B, n, ...).
    make_inputs: Callable[[int, int, str], tuple[Tensor, ...]] | None = None
    atol: float = 1e-5
    # A registered refusal (out-of-scope layer): from_module must raise TypeError matching this pattern.
    refuses: str | None = None
    # Modes the generic comparison applies to; e.g. dropout is only deterministic in eval (its train
    # mode has its own tests). Other modes are skipped with this reason.
    modes: tuple[str, ...] = ("train", "eval")
    skip_reason: str = ""

    def inputs(self, device: str) -> tuple[Tensor, ...]:
        if self.make_inputs is not None:
            return self.make_inputs(BATCH, SAMPLES, device)
        return (torch.randn(BATCH, SAMPLES, *self.sample_shape, device=device),)


def random_batchnorm(cls: type[nn.Module], **kwargs) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        layer = cls(6, **kwargs)
        if layer.affine:
            nn.init.normal_(layer.weight)
            nn.init.normal_(layer.bias)
        if layer.track_running_stats:
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2)
        return layer

    return make


LAYER_CASES: list[LayerCase] = [
    LayerCase("linear", lambda: nn.Linear(7, 5), (7,)),
    LayerCase("linear-nobias-3d-input", lambda: nn.Linear(7, 5, bias=False), (3, 7)),
    LayerCase("conv1d-stride-dilation", lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=1), (4, 17)),
    LayerCase("conv1d-circular", lambda: nn.Conv1d(4, 6, 3, padding=2, padding_mode="circular"), (4, 9)),
    LayerCase("conv2d", lambda: nn.Conv2d(3, 4, 3), (3, 8, 8)),
    LayerCase("conv2d-groups-same", lambda: nn.Conv2d(4, 6, 3, groups=2, padding="same"), (4, 7, 7)),
    LayerCase("conv2d-valid-nobias", lambda: nn.Conv2d(3, 4, (3, 2), padding="valid", bias=False), (3, 6, 5)),
    LayerCase("conv2d-reflect", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (3, 6, 6)),
    LayerCase("conv2d-replicate-same", lambda: nn.Conv2d(3, 4, 4, padding="same", padding_mode="replicate"), (3, 6, 6)),
    LayerCase("conv3d", lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1)), (2, 4, 5, 4)),
    LayerCase("batchnorm1d", random_batchnorm(nn.BatchNorm1d), (6,)),
    LayerCase("batchnorm1d-3d-input", random_batchnorm(nn.BatchNorm1d), (6, 5)),
    LayerCase("batchnorm2d", random_batchnorm(nn.BatchNorm2d), (6, 3, 3)),
    LayerCase("batchnorm2d-cumulative", random_batchnorm(nn.BatchNorm2d, momentum=None), (6, 3, 3)),
    LayerCase("batchnorm2d-no-affine", random_batchnorm(nn.BatchNorm2d, affine=False), (6, 3, 3)),
    LayerCase("batchnorm2d-no-running-stats", random_batchnorm(nn.BatchNorm2d, track_running_stats=False), (6, 3, 3)),
    LayerCase("batchnorm3d", random_batchnorm(nn.BatchNorm3d), (6, 2, 3, 2)),
    LayerCase(
        "embedding-padding",
        lambda: nn.Embedding(11, 5, padding_idx=2),
        make_inputs=lambda b, n, device: (torch.randint(0, 11, (b, n, 3), device=device),),
    ),
    LayerCase(
        "embeddingbag-mean-2d",
        lambda: nn.EmbeddingBag(11, 5, mode="mean"),
        make_inputs=lambda b, n, device: (torch.randint(0, 11, (b, n, 4), device=device),),
    ),
]


def batched_from(plain_layers: list[nn.Module]) -> batch_layers.AbstractBatchModule:
    """A batched layer holding plain_layers[i]'s parameters and buffers as model i."""
    batched_class = lookup_batch_module(type(plain_layers[0]))
    assert batched_class is not None, f"{type(plain_layers[0]).__name__} is not registered"
    batched = batched_class.from_module(plain_layers[0], len(plain_layers))
    with torch.no_grad():
        for name, target in batched.state_dict(keep_vars=True).items():
            target.copy_(torch.stack([layer.state_dict()[name] for layer in plain_layers]))
    return batched


def _merged(x: Tensor) -> Tensor:
    merged = x.reshape(BATCH * SAMPLES, *x.shape[2:])
    return merged.requires_grad_() if merged.is_floating_point() else merged


def _per_model(t: Tensor, i: int) -> Tensor:
    return t.view(BATCH, -1, *t.shape[1:])[i].reshape(-1, *t.shape[1:])


def run_case(case: LayerCase, mode: str, device: str, steps: int = 2) -> None:
    if case.refuses is not None:
        with pytest.raises(TypeError, match=case.refuses):
            batched_from([case.make()])
        return
    if mode not in case.modes:
        pytest.skip(f"{case.name}: {mode} mode is not compared here: {case.skip_reason}")
    torch.manual_seed(0)
    plain = [case.make().to(device) for _ in range(BATCH)]
    batched = batched_from(plain).to(device)
    for layer in (*plain, batched):
        layer.train(mode == "train")
    for _ in range(steps):  # twice, so running statistics updated by the first step are used by the second
        inputs = case.inputs(device)
        merged = [_merged(x) for x in inputs]
        y_batched = batched(*merged)
        grad = torch.randn_like(y_batched)
        y_batched.backward(grad)
        for i, layer in enumerate(plain):
            layer.zero_grad()
            own = [x[i].clone().requires_grad_() if x.is_floating_point() else x[i] for x in inputs]
            y_i = layer(*own)
            y_i.backward(_per_model(grad, i))
            torch.testing.assert_close(_per_model(y_batched, i), y_i, atol=case.atol, rtol=0)
            for x_merged, x_own in zip(merged, own):
                if x_own.requires_grad:
                    torch.testing.assert_close(_per_model(x_merged.grad, i), x_own.grad, atol=case.atol, rtol=0)
            for name, param in layer.named_parameters():
                torch.testing.assert_close(
                    batched.get_parameter(name).grad[i], param.grad, atol=case.atol, rtol=0, msg=name
                )
        batched.zero_grad()
    for i, layer in enumerate(plain):
        for name, value in layer.state_dict().items():
            torch.testing.assert_close(batched.state_dict()[name][i], value, atol=case.atol, rtol=0)


# -- transposed convolutions, bilinear, norms, PReLU, dropout, refusals --------------------------------------


def randomized(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``make`` with every parameter drawn from N(1, 0.5) and running stats moved off their defaults."""

    def build() -> nn.Module:
        layer = make()
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(1.0, 0.5)
            if getattr(layer, "running_mean", None) is not None:
                layer.running_mean.normal_()
                layer.running_var.uniform_(0.5, 2)
        return layer

    return build


def two_inputs(shape1: tuple[int, ...], shape2: tuple[int, ...]) -> Callable[[int, int, str], tuple[Tensor, ...]]:
    return lambda b, n, device: (torch.randn(b, n, *shape1, device=device), torch.randn(b, n, *shape2, device=device))


_DROPOUT = "dropout is random in train mode; tests/batch_layers/test_dropout.py checks its masks and statistics"
_OUT_OF_SCOPE = {
    "LazyLinear": lambda: nn.LazyLinear(5),
    "LazyConv1d": lambda: nn.LazyConv1d(6, 3),
    "LazyConv2d": lambda: nn.LazyConv2d(6, 3),
    "LazyConv3d": lambda: nn.LazyConv3d(6, 3),
    "LazyConvTranspose1d": lambda: nn.LazyConvTranspose1d(6, 3),
    "LazyConvTranspose2d": lambda: nn.LazyConvTranspose2d(6, 3),
    "LazyConvTranspose3d": lambda: nn.LazyConvTranspose3d(6, 3),
    "LazyBatchNorm1d": lambda: nn.LazyBatchNorm1d(),
    "LazyBatchNorm2d": lambda: nn.LazyBatchNorm2d(),
    "LazyBatchNorm3d": lambda: nn.LazyBatchNorm3d(),
    "LazyInstanceNorm1d": lambda: nn.LazyInstanceNorm1d(),
    "LazyInstanceNorm2d": lambda: nn.LazyInstanceNorm2d(),
    "LazyInstanceNorm3d": lambda: nn.LazyInstanceNorm3d(),
    "SyncBatchNorm": lambda: nn.SyncBatchNorm(6),
}

LAYER_CASES += [
    LayerCase(
        "convtranspose1d-stride-outpad",
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1),
        (4, 7),
    ),
    LayerCase(
        "convtranspose1d-groups-dilation-nobias",
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=3, groups=2, dilation=2, output_padding=1, bias=False),
        (4, 5),
    ),
    LayerCase(
        "convtranspose2d", lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1), (3, 2, 3)
    ),
    LayerCase(
        "convtranspose2d-groups-asym",
        lambda: nn.ConvTranspose2d(4, 6, (2, 3), stride=(2, 1), padding=(0, 1), dilation=(1, 2), groups=2),
        (4, 4, 5),
    ),
    LayerCase(
        "convtranspose3d", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2, output_padding=(1, 0, 1)), (2, 3, 2, 3)
    ),
    LayerCase("bilinear-x1-first", randomized(lambda: nn.Bilinear(5, 4, 3)), make_inputs=two_inputs((5,), (4,))),
    LayerCase(
        "bilinear-x2-first-nobias-3d",
        lambda: nn.Bilinear(3, 6, 2, bias=False),
        make_inputs=two_inputs((2, 3), (2, 6)),
    ),
    LayerCase("bilinear-outer", lambda: nn.Bilinear(2, 3, 8), make_inputs=two_inputs((2,), (3,))),
    LayerCase("layernorm", randomized(lambda: nn.LayerNorm(6)), (5, 6)),
    LayerCase("layernorm-2d-shape-nobias", randomized(lambda: nn.LayerNorm((3, 4), bias=False)), (2, 3, 4)),
    LayerCase("layernorm-no-affine", lambda: nn.LayerNorm(6, elementwise_affine=False, eps=1e-3), (5, 6)),
    LayerCase("rmsnorm", randomized(lambda: nn.RMSNorm(6)), (5, 6)),
    LayerCase("rmsnorm-eps-2d-shape", randomized(lambda: nn.RMSNorm((2, 3), eps=1e-3)), (4, 2, 3)),
    LayerCase("rmsnorm-no-affine", lambda: nn.RMSNorm(6, elementwise_affine=False), (6,)),
    LayerCase("groupnorm", randomized(lambda: nn.GroupNorm(2, 6)), (6, 3, 3)),
    LayerCase("groupnorm-2d-input", randomized(lambda: nn.GroupNorm(1, 6)), (6,)),
    LayerCase("groupnorm-no-affine-1d", lambda: nn.GroupNorm(3, 6, affine=False), (6, 4)),
    LayerCase("instancenorm1d", lambda: nn.InstanceNorm1d(6), (6, 5)),
    LayerCase(
        "instancenorm1d-affine-running",
        randomized(lambda: nn.InstanceNorm1d(6, affine=True, track_running_stats=True)),
        (6, 5),
    ),
    LayerCase("instancenorm2d-affine", randomized(lambda: nn.InstanceNorm2d(6, affine=True)), (6, 3, 4)),
    LayerCase(
        "instancenorm2d-running-stats",
        randomized(lambda: nn.InstanceNorm2d(6, momentum=0.3, track_running_stats=True)),
        (6, 3, 4),
    ),
    LayerCase(
        "instancenorm2d-momentum-none",
        randomized(lambda: nn.InstanceNorm2d(6, momentum=None, affine=True, track_running_stats=True)),
        (6, 3, 3),
    ),
    LayerCase(
        "instancenorm3d-affine-running",
        randomized(lambda: nn.InstanceNorm3d(6, affine=True, track_running_stats=True)),
        (6, 2, 3, 2),
    ),
    LayerCase("prelu", randomized(lambda: nn.PReLU()), (5, 3)),
    LayerCase("prelu-channels", randomized(lambda: nn.PReLU(6)), (6, 3, 2)),
    LayerCase("prelu-channels-2d-input", randomized(lambda: nn.PReLU(6, init=0.1)), (6,)),
    *(
        LayerCase(f"dropout-{layer().__class__.__name__}", layer, shape, modes=("eval",), skip_reason=_DROPOUT)
        for layer, shape in (
            (lambda: nn.Dropout(0.3), (5,)),
            (lambda: nn.Dropout1d(0.3), (6, 5)),
            (lambda: nn.Dropout2d(0.3), (6, 3, 3)),
            (lambda: nn.Dropout3d(0.3), (6, 2, 2, 2)),
            (lambda: nn.AlphaDropout(0.3), (5,)),
            (lambda: nn.FeatureAlphaDropout(0.3), (6, 3, 3)),
        )
    ),
    *(
        LayerCase(f"refuses-{name}", make, refuses=f"{name} is out of scope for torchmb")
        for name, make in _OUT_OF_SCOPE.items()
    ),
]
