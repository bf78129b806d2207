"""Batched layers hand the next op the memory layout a plain layer's output has: fused kernels
(``F.scaled_dot_product_attention``'s flash and memory-efficient ones, cuDNN's NHWC convolutions) and code
that views an output (``y.view(n, -1)``) see what they would see after the plain layer."""

from __future__ import annotations

import pytest
import torch
from support.layer_cases import BATCH, LAYER_CASES, LayerCase, _call, batched_from
from torch import Tensor, nn

import batch_layers
from batch_layers import ForwardContext, forward_context

COMPARED = [case for case in LAYER_CASES if case.refuses is None]
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def layouts_kept(batched: Tensor, plain: Tensor) -> list[str]:
    """The memory formats in which ``plain`` is contiguous but ``batched`` is not."""
    formats = [torch.contiguous_format] + ([_CHANNELS_LAST[plain.dim()]] if plain.dim() in _CHANNELS_LAST else [])
    return [
        str(f) for f in formats if plain.is_contiguous(memory_format=f) and not batched.is_contiguous(memory_format=f)
    ]


def _inputs(case: LayerCase, order: str, shared: bool, channels_last: bool) -> tuple[list[Tensor], list[Tensor]]:
    inputs = case.inputs("cpu")
    if shared:
        merged = [x[0] for x in inputs]
    else:
        merged = [(x if order == "models" else x.transpose(0, 1)).reshape(-1, *x.shape[2:]) for x in inputs]
    own = [x[0] for x in inputs]
    if channels_last:
        merged, own = ([x.contiguous(memory_format=torch.channels_last) for x in xs] for xs in (merged, own))
    return merged, own


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous-input", "channels-last-input"])
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize("case", COMPARED, ids=lambda case: case.name)
def test_output_is_contiguous_where_the_plain_layers_is(
    case: LayerCase, order: str, shared: bool, channels_last: bool
) -> None:
    """Where the plain layer's output is contiguous (in the default or channels-last format), the batched
    layer's is too. (Batch-first ``nn.MultiheadAttention`` returns a transposed view; the batched layer a
    contiguous tensor, which serves any code written for the view.)"""
    torch.manual_seed(0)
    plain = case.make().train(case.modes[0] == "train")
    batched = batched_from([plain] * BATCH)
    if not batched.runs_in(order):
        pytest.skip(f"{case.name} runs models-major only")
    if channels_last and case.inputs("cpu")[0].dim() != 5:
        pytest.skip("channels-last applies to 4-D layer inputs")
    batched.merged_order = order
    merged, own = _inputs(case, order, shared, channels_last)
    with forward_context(ForwardContext(BATCH, own[0].shape[0], shared=shared, order=order)):
        outputs = _call(batched, case, merged)
    for k, (y, y_plain) in enumerate(zip(outputs, _call(plain, case, own))):
        lost = layouts_kept(y, y_plain)
        assert not lost, f"output {k}: strides {y.stride()} are not contiguous in {lost} as plain {y_plain.stride()}"


def test_sequence_first_attention_returns_torchs_contiguous_layout() -> None:
    plain = nn.MultiheadAttention(8, 2)
    batched = batch_layers.MultiheadAttention.from_module(plain, BATCH)
    x = torch.randn(5, BATCH * 4, 8)
    out, _ = batched(x, x, x)
    assert plain(x[:, :4], x[:, :4], x[:, :4])[0].is_contiguous()
    assert out.is_contiguous()
    out.view(-1, 8)  # as code written for torch's layer does
