"""Batched MultiheadAttention and the Transformer layers built on it, against B independent torch modules.

The generic comparison (batch-first, masks, kdim/vdim, bias_k/zero attention, weights) runs from the layer
case table; here: sequence-first and unbatched layouts, the self-attention and shared-key/value projection
paths, every mask form, dropout masks, initialisation, errors, and the Transformer layers (their fused
inference path included).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.layer_cases import batched_from
from torch import Tensor, nn

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent

B, N, L, S, E, H = 3, 2, 5, 4, 8, 2


def plain_layers(**kwargs) -> list[nn.MultiheadAttention]:
    layers = [nn.MultiheadAttention(E, H, **kwargs) for _ in range(B)]
    with torch.no_grad():
        for layer in layers:
            for param in layer.parameters():
                param.normal_(0.0, 0.3)
    return layers


def merge(x: Tensor, batch_first: bool) -> Tensor:
    """(B, N, T, F) per model -> the merged layout a batch_first / sequence-first layer takes."""
    merged = x.reshape(-1, *x.shape[2:])
    return merged if batch_first else merged.transpose(0, 1)


def model_slice(y: Tensor, i: int, batch_first: bool) -> Tensor:
    if batch_first:
        return y.view(B, -1, *y.shape[1:])[i]
    return y.view(y.shape[0], B, -1, *y.shape[2:])[:, i]


def compare(
    plain: list[nn.Module],
    batched: nn.Module,
    batched_args: tuple,
    own_args,
    batch_first: bool = True,
    atol: float = 1e-5,
    **kwargs,
) -> None:
    """Outputs (attention output and weights) and every parameter gradient, model by model."""
    out, weights = batched(*batched_args, **kwargs)
    loss = out.square().sum() + (0 if weights is None else weights.square().sum())
    loss.backward()
    for i, layer in enumerate(plain):
        layer.zero_grad()
        out_i, weights_i = layer(*own_args(i), **kwargs)
        (out_i.square().sum() + (0 if weights_i is None else weights_i.square().sum())).backward()
        torch.testing.assert_close(model_slice(out, i, batch_first), out_i, atol=atol, rtol=0)
        if weights_i is None:
            assert weights is None
        else:
            torch.testing.assert_close(weights.view(B, -1, *weights.shape[1:])[i].view_as(weights_i), weights_i)
        for name, param in layer.named_parameters():
            torch.testing.assert_close(batched.get_parameter(name).grad[i], param.grad, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("inputs", ["self", "key-is-value", "distinct"])
def test_layouts_and_projection_paths(batch_first: bool, inputs: str) -> None:
    torch.manual_seed(0)
    plain = plain_layers(batch_first=batch_first)
    batched = batched_from(plain)
    q = torch.randn(B, N, L, E)
    k = q if inputs == "self" else torch.randn(B, N, S, E)
    v = k if inputs != "distinct" else torch.randn(B, N, S, E)
    q_m = merge(q, batch_first)
    k_m = q_m if inputs == "self" else merge(k, batch_first)
    v_m = k_m if inputs != "distinct" else merge(v, batch_first)

    def own(i: int) -> tuple[Tensor, ...]:
        q_i, k_i, v_i = (t[i] if batch_first else t[i].transpose(0, 1) for t in (q, k, v))
        k_i = q_i if inputs == "self" else k_i
        v_i = k_i if inputs != "distinct" else v_i
        return q_i, k_i, v_i

    compare(plain, batched, (q_m, k_m, v_m), own, batch_first)


@pytest.mark.parametrize("average", [True, False])
def test_unbatched_models(average: bool) -> None:
    torch.manual_seed(0)
    plain = plain_layers(kdim=3, vdim=5)
    batched = batched_from(plain)
    q, k, v = torch.randn(B, L, E), torch.randn(B, S, 3), torch.randn(B, S, 5)
    padding = torch.rand(B, S) < 0.4
    padding[:, 0] = False
    merged = (q.reshape(-1, E), k.reshape(-1, 3), v.reshape(-1, 5))
    out, weights = batched(*merged, key_padding_mask=padding.reshape(-1), average_attn_weights=average)
    assert out.shape == (B * L, E)
    for i, layer in enumerate(plain):
        out_i, weights_i = layer(q[i], k[i], v[i], key_padding_mask=padding[i], average_attn_weights=average)
        torch.testing.assert_close(out.view(B, L, E)[i], out_i)
        torch.testing.assert_close(weights.view(B, *weights_i.shape)[i], weights_i)


def causal(length: int) -> Tensor:
    return torch.ones(length, length, dtype=torch.bool).triu(1)


def mask_kwargs(name: str):
    """(batched kwargs, model i -> plain kwargs) for self-attention over (B, N, L, E)."""
    padding = torch.rand(B, N, L) < 0.3
    padding[..., 0] = False
    if name == "shared-2d-bool":
        return {"attn_mask": causal(L)}, lambda i: {"attn_mask": causal(L)}
    if name == "per-model-2d-float":
        mask = torch.randn(B, L, L)
        return {"attn_mask": mask.reshape(B * L, L)}, lambda i: {"attn_mask": mask[i]}
    if name == "shared-3d-per-head":
        mask = torch.randn(N * H, L, L)
        return {"attn_mask": mask}, lambda i: {"attn_mask": mask}
    if name == "per-model-3d-per-head":
        mask = torch.randn(B, N * H, L, L)
        return {"attn_mask": mask.reshape(B * N * H, L, L)}, lambda i: {"attn_mask": mask[i]}
    if name == "shared-padding":
        return {"key_padding_mask": padding[0]}, lambda i: {"key_padding_mask": padding[0]}
    causal_hint = {"attn_mask": causal(L), "is_causal": True}
    if name == "causal-hint":
        return causal_hint, lambda i: causal_hint
    assert name == "causal-hint-with-padding"
    return (
        {**causal_hint, "key_padding_mask": padding.flatten(0, 1)},
        lambda i: {**causal_hint, "key_padding_mask": padding[i]},
    )


MASKS = [
    "shared-2d-bool",
    "per-model-2d-float",
    "shared-3d-per-head",
    "per-model-3d-per-head",
    "shared-padding",
    "causal-hint",
    "causal-hint-with-padding",
]


@pytest.mark.parametrize("extra_keys", [False, True], ids=["", "bias_kv-zero_attn"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("mask", MASKS)
def test_masks(mask: str, need_weights: bool, extra_keys: bool) -> None:
    torch.manual_seed(0)
    plain = plain_layers(batch_first=True, add_bias_kv=extra_keys, add_zero_attn=extra_keys)
    batched = batched_from(plain)
    batched_kwargs, own_kwargs = mask_kwargs(mask)
    x = torch.randn(B, N, L, E)
    x_m = merge(x, True)
    out, weights = batched(x_m, x_m, x_m, need_weights=need_weights, **batched_kwargs)
    for i, layer in enumerate(plain):
        out_i, weights_i = layer(x[i], x[i], x[i], need_weights=need_weights, **own_kwargs(i))
        torch.testing.assert_close(out.view(B, N, L, E)[i], out_i)
        if need_weights:
            torch.testing.assert_close(weights.view(B, N, *weights_i.shape[1:])[i], weights_i)
        else:
            assert weights is None and weights_i is None


def test_reset_parameters_draws_like_b_torch_layers() -> None:
    for kwargs in ({}, {"kdim": 3, "vdim": 5, "add_bias_kv": True}, {"bias": False}):
        torch.manual_seed(0)
        batched = batch_layers.MultiheadAttention(E, H, batch=4, **kwargs)
        torch.manual_seed(0)
        plain = [nn.MultiheadAttention(E, H, **kwargs) for _ in range(4)]
        for i, layer in enumerate(plain):
            for name, param in layer.named_parameters():
                assert torch.equal(batched.get_parameter(name)[i].view_as(param), param), name
        first = next(n for n, _ in plain[0].named_parameters() if "weight" in n)
        assert not torch.equal(batched.get_parameter(first)[0], batched.get_parameter(first)[1])


def test_attention_dropout_is_independent_across_models() -> None:
    torch.manual_seed(0)
    layer = batch_layers.MultiheadAttention.from_module(nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True), B)
    x = torch.randn(1, L, E).expand(B, L, E).contiguous()  # every model: the same weights and the same sample
    for need_weights in (True, False):
        layer.train()
        out, _ = layer(x, x, x, need_weights=need_weights)
        assert all(not torch.equal(out[0], out[i]) for i in range(1, B)), "models drew the same dropout mask"
        layer.eval()
        out, _ = layer(x, x, x, need_weights=need_weights)
        assert all(torch.equal(out[0], out[i]) for i in range(1, B))
    layer.train()
    _, weights = layer(x, x, x, average_attn_weights=False)
    kept = (weights > 0).float().mean()
    assert 0.35 < kept < 0.65, f"dropout(0.5) kept {kept:.2f} of the attention weights"


def test_shared_input_through_batch_module() -> None:
    """One (n, L, 4) input seen by every model, through a Linear into an encoder layer."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, E), nn.TransformerEncoderLayer(E, H, 16, 0.0, batch_first=True))

    torch.manual_seed(0)
    assert assert_equivalent(make, B, torch.randn(N, L, 4), 2, shared_input=True)


def test_refuses_bad_inputs() -> None:
    layer = batch_layers.MultiheadAttention(E, H, batch_first=True, batch=B)
    x = torch.randn(B * N, L, E)
    with pytest.raises(ValueError, match=r"expected query with 8 features, got shape \(6, 5, 7\)"):
        layer(x[..., :7], x, x)
    with pytest.raises(ValueError, match=r"expected query dim 0 \(batch_first=True\) to be a multiple of B = 3"):
        layer(x[:4], x[:4], x[:4])
    with pytest.raises(ValueError, match=r"expected key_padding_mask of shape \(6, 5\) or \(2, 5\), got \(6, 4\)"):
        layer(x, x, x, key_padding_mask=torch.zeros(B * N, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected attn_mask of shape \(5, 5\) \(shared\)"):
        layer(x, x, x, attn_mask=torch.zeros(4, 5))
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        layer(x, x, x, is_causal=True)

    class SequenceFirstAtTheBoundary(nn.Module):  # (L, N, E) per model: BatchModule merges models into L
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(E, H)

        def forward(self, x: Tensor) -> Tensor:
            return self.attn(x, x, x)[0]

    with pytest.raises(ValueError, match=r"multiple of B \* n = 3 \* 5 .* transpose them itself"):
        BatchModule(SequenceFirstAtTheBoundary(), B)(torch.randn(B, L, B * N, E))
    with pytest.raises(ValueError, match="must all be batched"):
        layer(x, x[0], x[0])
    with pytest.raises(ValueError, match="divisible by num_heads"):
        batch_layers.MultiheadAttention(E, 3, batch=B)
    nested = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(2, E)], layout=torch.jagged)
    with pytest.raises(ValueError, match="use_nested_tensor = False"):
        batch_layers.MultiheadAttention(E, H, batch_first=True, batch=2)(nested, nested, nested)


# -- Transformer layers: the converter batches them through their children ----------------------------


class Wrapped(nn.Module):
    """A Transformer layer behind batch-first (n, L, E) inputs, whatever its own layout."""

    def __init__(self, kind: str, batch_first: bool, norm_first: bool = False) -> None:
        super().__init__()
        self.kind, self.batch_first = kind, batch_first
        if kind == "encoder":
            self.layer = nn.TransformerEncoderLayer(E, H, 16, 0.0, batch_first=batch_first, norm_first=norm_first)
        elif kind == "decoder":
            self.layer = nn.TransformerDecoderLayer(E, H, 16, 0.0, batch_first=batch_first, norm_first=norm_first)
        else:
            with warnings.catch_warnings():  # seq-first: torch warns that its nested-tensor path is off
                warnings.filterwarnings("ignore", "enable_nested_tensor is True")
                self.layer = nn.Transformer(E, H, 1, 1, 16, 0.0, batch_first=batch_first, norm_first=norm_first)

    def forward(self, src: Tensor, tgt: Tensor, padding: Tensor) -> Tensor:
        if not self.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        mask = causal(tgt.shape[0 if not self.batch_first else 1])
        if self.kind == "encoder":
            out = self.layer(src, src_key_padding_mask=padding)
        elif self.kind == "decoder":
            out = self.layer(tgt, src, tgt_mask=mask, tgt_is_causal=True, memory_key_padding_mask=padding)
        else:
            out = self.layer(src, tgt, tgt_mask=mask, src_key_padding_mask=padding, memory_key_padding_mask=padding)
        return out if self.batch_first else out.transpose(0, 1)


def transformer_inputs() -> tuple[Tensor, Tensor, Tensor]:
    torch.manual_seed(1)
    # sequence lengths differ from B*N = 6: a seq-first (T, B*N, E) tensor's model axis must be unambiguous
    src, tgt = torch.randn(B, N, S + 1, E), torch.randn(B, N, L + 2, E)
    padding = torch.zeros(B, N, S + 1, dtype=torch.bool)
    padding[:, 0, -2:] = True
    return src, tgt, padding


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("kind", ["encoder", "decoder", "transformer"])
def test_transformer_layers_batch_through_children(kind: str, batch_first: bool, train: bool) -> None:
    torch.manual_seed(0)
    norm_first = kind == "decoder"
    model = BatchModule(Wrapped(kind, batch_first, norm_first), B)
    assert model.generic_modules == [], "a Transformer child went through the torch.func fallback"
    assert assert_equivalent(
        lambda: Wrapped(kind, batch_first, norm_first), B, transformer_inputs(), steps=2, train=train
    )


def test_encoder_layer_fused_inference_path_is_bypassed(monkeypatch: pytest.MonkeyPatch) -> None:
    """In eval mode without gradients torch runs one fused kernel; the batched layer must not reach it."""
    torch.manual_seed(0)
    plain = [Wrapped("encoder", True) for _ in range(B)]
    batched = BatchModule(Wrapped("encoder", True), B)
    batched.load_state_dicts([m.state_dict() for m in plain])
    src, tgt, padding = transformer_inputs()
    fused = torch._transformer_encoder_layer_fwd
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(args[3].dim())  # in_proj_weight: 2-D for a plain layer
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    with torch.no_grad():
        for model in (batched, *plain):
            model.eval()
        out = batched(src, tgt, padding)
        assert calls == [], "the batched encoder layer ran torch's fused kernel"
        for i, model in enumerate(plain):
            torch.testing.assert_close(out[i], model(src[i], tgt[i], padding[i]))
    assert calls == [2] * B, "the plain layers did not take the fused path, so the check proved nothing"


@pytest.mark.cuda
@pytest.mark.parametrize("need_weights", [True, False])
def test_cuda_bf16_autocast(need_weights: bool) -> None:
    torch.manual_seed(0)
    plain = [layer.cuda() for layer in plain_layers(batch_first=True)]
    batched = batched_from(plain).cuda()
    x = torch.randn(B, N, L, E, device="cuda")
    padding = torch.rand(B, N, L, device="cuda") < 0.3
    padding[..., 0] = False
    with torch.autocast("cuda", dtype=torch.bfloat16):
        x_m = merge(x, True)
        out, _ = batched(x_m, x_m, x_m, key_padding_mask=padding.flatten(0, 1), need_weights=need_weights)
        for i, layer in enumerate(plain):
            want, _ = layer(x[i], x[i], x[i], key_padding_mask=padding[i], need_weights=need_weights)
            # bf16 keeps 8 mantissa bits: both sides round differently (one fused kernel vs batched products)
            torch.testing.assert_close(out.view(B, N, L, E)[i].float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_cuda_transformer_layers(batch_first: bool) -> None:
    torch.manual_seed(0)
    inputs = tuple(t.cuda() for t in transformer_inputs())
    for kind in ("encoder", "decoder", "transformer"):
        assert assert_equivalent(lambda k=kind: Wrapped(k, batch_first).cuda(), B, inputs, steps=2, atol=2e-5)
