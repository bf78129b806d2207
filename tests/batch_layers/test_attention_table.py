"""The attention table takes torch's math path for short float32 sequences on CUDA and leaves every other
call to torch's own choice; routed through it, an attention call returns what ``F.scaled_dot_product_attention``
returns, whichever kernel runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from batch_layers import explain_attention_kernels, scaled_dot_product_attention
from batch_layers._attention_table import ATTENTION_OPS, MATH_ATTENTION, AttentionCall
from batch_layers._kernel_table import choose

OP = next(iter(ATTENTION_OPS))
VIT_TINY = AttentionCall(cuda=True, dtype=torch.float32, keys=65, head_dim=64, scores=2048 * 3 * 65 * 65,
                         compiling=True)
"""ViT-Tiny's attention at B=16, n=128 (32x32 images, patch 4: 65 tokens, 3 heads of 64), compiled."""


def kernel(call: AttentionCall) -> str:
    return choose(OP, call, ATTENTION_OPS).name


def test_short_float32_sequences_compiled_for_cuda_take_the_math_path() -> None:
    assert kernel(VIT_TINY) == "math"
    assert kernel(VIT_TINY._replace(keys=256)) == "math"
    assert kernel(VIT_TINY._replace(head_dim=128)) == "math"


@pytest.mark.parametrize(
    "change",
    [
        {"compiling": False},
        {"cuda": False},
        {"dtype": torch.bfloat16},
        {"dtype": torch.float16},
        {"dtype": torch.float64},
        {"autocast": True},
        {"nested": True},
        {"unrestricted": False},
        {"head_dim": 256},
        {"keys": 257},
        {"scores": 2**23 - 1},
    ],
)
def test_every_other_call_keeps_torchs_choice(change: dict) -> None:
    assert kernel(VIT_TINY._replace(**change)) == "sdpa"


def test_the_limits_are_read_at_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MATH_ATTENTION.limits, "max_keys", 64)
    assert kernel(VIT_TINY) == "sdpa"
    monkeypatch.setitem(MATH_ATTENTION.limits, "max_keys", 65)
    assert kernel(VIT_TINY) == "math"


def test_explain_names_the_kernel_and_what_a_call_lacks() -> None:
    text = explain_attention_kernels(cuda=True, dtype=torch.float32, keys=65, head_dim=64, scores=10**8,
                                     compiling=True)
    assert text.startswith("scaled dot-product attention: math (forward and backward")
    text = explain_attention_kernels(cuda=True, dtype=torch.float32, keys=400, head_dim=64, scores=10**8,
                                     compiling=True)
    assert "scaled dot-product attention: sdpa" in text
    assert "not math: needs at most 256 keys (the scores" in text
    text = explain_attention_kernels(cuda=True, dtype=torch.float32, keys=65, head_dim=64, scores=10**8)
    assert "not math: needs under torch.compile" in text


def test_a_call_is_read_from_the_tensors_and_torchs_settings() -> None:
    query, key = torch.randn(4, 3, 10, 8), torch.randn(4, 3, 12, 8)
    assert AttentionCall.of(query, key) == AttentionCall(False, torch.float32, 12, 8, 4 * 3 * 10 * 12)
    assert AttentionCall.of(query.bfloat16(), key.bfloat16()).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert AttentionCall.of(query, key).autocast
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert not AttentionCall.of(query, key).unrestricted
    assert AttentionCall.of(query, key).unrestricted


def _kernels_run(call) -> set[str]:
    """The attention operators ``call()`` runs (torch's profiler, CPU)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        call()
    return {event.key for event in profile.key_averages()
            if "attention" in event.key and event.key.startswith("aten::_")}


CASES = {
    "plain": ((6, 2, 9, 8), (6, 2, 9, 8), {}),
    "cross, scaled": ((6, 2, 5, 8), (6, 2, 9, 8), {"scale": 0.3}),
    "causal": ((6, 2, 9, 8), (6, 2, 9, 8), {"is_causal": True}),
    "boolean mask": ((6, 2, 9, 8), (6, 2, 9, 8), {"attn_mask": torch.rand(9, 9) > 0.3}),
    "additive mask": ((6, 2, 9, 8), (6, 2, 9, 8), {"attn_mask": torch.randn(6, 1, 9, 9)}),
    "grouped query": ((6, 4, 9, 8), (6, 2, 9, 8), {"enable_gqa": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_math_path_returns_what_torch_returns(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On this CPU and eager, the table's CUDA and compiler conditions are dropped, so that the math path runs
    here (torch's own choice is its flash kernel for the CPU): the same result and gradients, whatever the
    arguments."""
    kept = [c for c in MATH_ATTENTION.conditions if c[0] != "a CUDA tensor" and not c[0].startswith("under torch")]
    assert len(kept) == len(MATH_ATTENTION.conditions) - 2
    monkeypatch.setattr(MATH_ATTENTION, "conditions", kept)
    monkeypatch.setitem(MATH_ATTENTION.limits, "min_scores", 0)
    torch.manual_seed(0)
    query_shape, key_shape, options = CASES[case]
    query = torch.randn(query_shape, requires_grad=True)
    key, value = (torch.randn(key_shape, requires_grad=True) for _ in range(2))
    assert _kernels_run(lambda: scaled_dot_product_attention(query, key, value, **options)) == {
        "aten::_scaled_dot_product_attention_math"}
    assert "aten::_scaled_dot_product_attention_math" not in _kernels_run(
        lambda: F.scaled_dot_product_attention(query, key, value, **options))
    got = scaled_dot_product_attention(query, key, value, **options)
    got_grads = torch.autograd.grad(got.square().sum(), (query, key, value))
    want = F.scaled_dot_product_attention(query, key, value, **options)
    want_grads = torch.autograd.grad(want.square().sum(), (query, key, value))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)


def test_torchs_choice_runs_where_the_table_leaves_it() -> None:
    query = torch.randn(6, 2, 9, 8)
    assert _kernels_run(lambda: scaled_dot_product_attention(query, query, query)) == _kernels_run(
        lambda: F.scaled_dot_product_attention(query, query, query))
