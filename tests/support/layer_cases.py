"""The table of layer cases: every registered batched layer against B independently held torch layers.

Each case builds one plain layer and the merged inputs for B models; ``run_case`` stacks B plain layers
(different weights) into the batched class that torchmb registers for them and compares outputs, input
gradients, parameter gradients and (after two steps) buffers, model by model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
