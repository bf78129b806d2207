"""The table of layer cases: every registered batched layer against B independently held torch layers.

Each case builds one plain layer and the merged inputs for B models; ``run_case`` stacks B plain layers
(different weights) into the batched class that torchmb registers for them and compares outputs, input
gradients, parameter gradients and (after two steps) buffers, model by model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

import batch_layers
from batch_layers import ForwardContext, forward_context
from torchmb import lookup_batch_module

from .torchvision_ops import import_torchvision

BATCH, SAMPLES = 3, 4
# Sums over samples (weight gradients) run in another order than the plain layer's: a few float32 ulps
# of relative difference on top of each case's absolute tolerance.
RTOL = 1e-6


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
    # mode has its own tests, which skip_reason names).
    modes: tuple[str, ...] = ("train", "eval")
    skip_reason: str = ""
    # Keyword arguments for both calls (flags such as need_weights); the last len(keywords) inputs of
    # make_inputs are passed by these names instead of positionally (e.g. key_padding_mask).
    kwargs: dict = field(default_factory=dict)
    keywords: tuple[str, ...] = ()
    # The merged model axis of each output tensor (outputs flattened as a pytree, Nones dropped), e.g.
    # (0, 1, 1) for an LSTM's (output, (h_n, c_n)); None: dim 0 for every output.
    out_dims: tuple[int, ...] | None = None

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


def timm_layer(name: str, *args, **kwargs) -> Callable[[], nn.Module]:
    """A layer of ``timm.layers`` with every parameter drawn from N(1, 0.5) (timm is imported when the case
    builds it; it imports torchvision)."""

    def make() -> nn.Module:
        import_torchvision()
        import timm.layers

        layer = getattr(timm.layers, name)(*args, **kwargs)
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(1.0, 0.5)
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
    LayerCase("timm-stdconv2d-bias-stride", timm_layer("StdConv2d", 4, 6, 3, stride=2, bias=True), (4, 7, 6)),
    LayerCase(
        "timm-scaledstdconv2dsame-dynamic-groups",
        timm_layer("ScaledStdConv2dSame", 4, 6, 3, stride=2, groups=2, gamma=1.7),
        (4, 7, 6),
    ),
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


def _merged(x: Tensor, order: str = "models") -> Tensor:
    merged = (x if order == "models" else x.transpose(0, 1)).reshape(-1, *x.shape[2:])
    return merged.requires_grad_() if merged.is_floating_point() else merged


def _per_model(t: Tensor, i: int, dim: int = 0, order: str = "models") -> Tensor:
    t = t.movedim(dim, 0)
    if order == "samples":
        return t.reshape(-1, BATCH, *t.shape[1:])[:, i].reshape(-1, *t.shape[1:]).movedim(0, dim)
    return t.reshape(BATCH, -1, *t.shape[1:])[i].reshape(-1, *t.shape[1:]).movedim(0, dim)


def _reference_backend(layer: nn.Module):
    """cuDNN's RNN kernels have no backward in eval mode; torch's own CUDA RNN kernels do (other flags kept)."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(
        enabled=cudnn.enabled and not (isinstance(layer, nn.RNNBase) and not layer.training),
        benchmark=cudnn.benchmark,
        deterministic=cudnn.deterministic,
        allow_tf32=cudnn.allow_tf32,
    )


def _call(layer: nn.Module, case: LayerCase, inputs: list[Tensor]) -> list[Tensor]:
    split = len(inputs) - len(case.keywords)
    kwargs = {**case.kwargs, **dict(zip(case.keywords, inputs[split:]))}
    return [t for t in tree_flatten(layer(*inputs[:split], **kwargs))[0] if isinstance(t, Tensor)]


def _fed(inputs: list[Tensor], then: Callable[[list[Tensor]], None] | None) -> list[Tensor]:
    if then is None:
        return inputs
    return [x.clone() if x.requires_grad else x for x in inputs]


def run_case(
    case: LayerCase,
    mode: str,
    device: str,
    steps: int = 2,
    order: str = "models",
    then: Callable[[list[Tensor]], None] | None = None,
) -> None:
    """Compare the batched layer with B plain ones; ``order`` is the merged order it runs in (as a
    ``BatchModule`` of that order would set it, with that forward's context). ``then`` runs on both
    layers' outputs before backward (in-place ops); the layers then read copies of their inputs, so that
    a layer returning its input (dropout in eval mode) hands out no leaf."""
    if case.refuses is not None:
        with pytest.raises(TypeError, match=case.refuses):
            batched_from([case.make()])
        return
    if mode not in case.modes:
        raise ValueError(f"{case.name} is not compared in {mode} mode: {case.skip_reason}")
    torch.manual_seed(0)
    plain = [case.make().to(device) for _ in range(BATCH)]
    batched = batched_from(plain).to(device)
    batched.merged_order = order
    for layer in (*plain, batched):
        layer.train(mode == "train")
    for _ in range(steps):  # twice, so running statistics updated by the first step are used by the second
        inputs = case.inputs(device)
        merged = [_merged(x, order) for x in inputs]
        # Samples-major, layers check their inputs against the forward's n: run them inside one.
        scope = forward_context(ForwardContext(BATCH, inputs[0].shape[1], order=order)) if order == "samples" else None
        with scope or contextlib.nullcontext():
            y_batched = _call(batched, case, _fed(merged, then))
        if then is not None:
            then(y_batched)
        out_dims = case.out_dims or (0,) * len(y_batched)
        grads = [torch.randn_like(y) for y in y_batched]
        torch.autograd.backward(y_batched, grads)
        for i, layer in enumerate(plain):
            layer.zero_grad()
            own = [x[i].clone().requires_grad_() if x.is_floating_point() else x[i] for x in inputs]
            with _reference_backend(layer):
                y_own = _call(layer, case, _fed(own, then))
                if then is not None:
                    then(y_own)
                assert len(y_own) == len(y_batched), f"{case.name}: {len(y_batched)} outputs, plain has {len(y_own)}"
                torch.autograd.backward(y_own, [_per_model(g, i, d, order) for g, d in zip(grads, out_dims)])
            for y_b, y_i, d in zip(y_batched, y_own, out_dims):
                torch.testing.assert_close(_per_model(y_b, i, d, order), y_i, atol=case.atol, rtol=RTOL)
            for x_merged, x_own in zip(merged, own):
                if x_own.requires_grad:
                    grad = _per_model(x_merged.grad, i, 0, order)
                    torch.testing.assert_close(grad, x_own.grad, atol=case.atol, rtol=RTOL)
            for name, param in layer.named_parameters():
                torch.testing.assert_close(
                    batched.get_parameter(name).grad[i],
                    param.grad,
                    atol=case.atol,
                    rtol=RTOL,
                    msg=lambda m, name=name: f"{name}: {m}",
                )
        batched.zero_grad()
    for i, layer in enumerate(plain):
        for name, value in layer.state_dict().items():
            torch.testing.assert_close(batched.state_dict()[name][i], value, atol=case.atol, rtol=RTOL)


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


# -- attention and recurrent layers ---------------------------------------------------------------------------


def attention_inputs(
    tgt: int = 5, src: int = 4, kdim: int = 8, vdim: int = 8, mask: str | None = None, heads: int = 2
) -> Callable[[int, int, str], tuple[Tensor, ...]]:
    """query (L=tgt, 8 features), key and value (S=src) and optionally a mask, each (B, n, ...)."""

    def make(b: int, n: int, device: str) -> tuple[Tensor, ...]:
        inputs = [torch.randn(b, n, tgt, 8, device=device)]
        inputs += [torch.randn(b, n, src, kdim, device=device), torch.randn(b, n, src, vdim, device=device)]
        if mask == "padding":  # one model's sample may hide any keys but the first
            padding = torch.rand(b, n, src, device=device) < 0.4
            padding[..., 0] = False
            inputs.append(padding)
        elif mask == "per-head":  # (N*heads, L, S) per model: (B, n*heads, L, S) merged into (B*n*heads, L, S)
            inputs.append(torch.randn(b, n * heads, tgt, src, device=device))
        return tuple(inputs)

    return make


def sequences(steps: int, features: int) -> Callable[[int, int, str], tuple[Tensor, ...]]:
    return lambda b, n, device: (torch.randn(b, n, steps, features, device=device),)


def small_random(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``make`` with every parameter drawn from N(0, 0.3) (biases off zero, attention logits moderate)."""

    def build() -> nn.Module:
        layer = make()
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.3)
        return layer

    return build


_RECURRENT_DROPOUT = "dropout between layers is random in train mode; test_recurrent.py checks its masks"
# Gradients through time: on CUDA the reference (cuDNN) sums them in another order than the batched steps.
_RECURRENT_ATOL = 5e-5

LAYER_CASES += [
    LayerCase(
        "mha-cross-attention-weights",
        small_random(lambda: nn.MultiheadAttention(8, 2, batch_first=True)),
        make_inputs=attention_inputs(),
    ),
    LayerCase(
        "mha-kdim-vdim-per-head-weights",
        small_random(lambda: nn.MultiheadAttention(8, 2, kdim=3, vdim=6, batch_first=True)),
        make_inputs=attention_inputs(kdim=3, vdim=6),
        kwargs={"average_attn_weights": False},
    ),
    LayerCase(
        "mha-padding-mask-bias-kv-zero-attn",
        small_random(lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True, batch_first=True)),
        make_inputs=attention_inputs(mask="padding"),
        keywords=("key_padding_mask",),
    ),
    LayerCase(
        "mha-per-head-mask-sdpa-nobias",
        small_random(lambda: nn.MultiheadAttention(8, 2, bias=False, batch_first=True)),
        make_inputs=attention_inputs(mask="per-head"),
        kwargs={"need_weights": False},
        keywords=("attn_mask",),
    ),
    LayerCase(
        "mha-dropout",
        small_random(lambda: nn.MultiheadAttention(8, 4, dropout=0.2, batch_first=True)),
        make_inputs=attention_inputs(),
        kwargs={"need_weights": False},
        modes=("eval",),
        skip_reason="attention dropout is random in train mode; test_attention.py checks its masks",
    ),
    LayerCase(
        "rnn-relu-2-layers",
        lambda: nn.RNN(5, 6, 2, nonlinearity="relu", batch_first=True),
        make_inputs=sequences(4, 5),
        out_dims=(0, 1),
        atol=_RECURRENT_ATOL,
    ),
    LayerCase(
        "lstm-bidirectional",
        lambda: nn.LSTM(5, 6, 2, batch_first=True, bidirectional=True),
        make_inputs=sequences(4, 5),
        out_dims=(0, 1, 1),
        atol=_RECURRENT_ATOL,
    ),
    LayerCase(
        "lstm-dropout-between-layers",
        lambda: nn.LSTM(5, 6, 2, batch_first=True, dropout=0.3),
        make_inputs=sequences(4, 5),
        out_dims=(0, 1, 1),
        modes=("eval",),
        skip_reason=_RECURRENT_DROPOUT,
        atol=_RECURRENT_ATOL,
    ),
    LayerCase(
        "gru-bidirectional-nobias",
        lambda: nn.GRU(5, 6, batch_first=True, bidirectional=True, bias=False),
        make_inputs=sequences(4, 5),
        out_dims=(0, 1),
        atol=_RECURRENT_ATOL,
    ),
    LayerCase(
        "rnncell-relu-hx",
        lambda: nn.RNNCell(5, 6, nonlinearity="relu"),
        make_inputs=lambda b, n, device: (torch.randn(b, n, 5, device=device), torch.randn(b, n, 6, device=device)),
    ),
    LayerCase("lstmcell", lambda: nn.LSTMCell(5, 6), (5,)),
    LayerCase(
        "grucell-hx",
        lambda: nn.GRUCell(5, 6),
        make_inputs=lambda b, n, device: (torch.randn(b, n, 5, device=device), torch.randn(b, n, 6, device=device)),
    ),
]
