"""batch_layers.functional's embedding lookups against B plain torch.nn.functional calls (float64, outputs and
the tables' gradients), in both merged orders and on the shared input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batch_layers import functional as BF
from batch_layers.functional import Layout

B, N, NUM, DIM = 3, 4, 7, 5
ORDERS = ["models", "samples"]


def _tables() -> torch.Tensor:
    return torch.randn(B, NUM, DIM, dtype=torch.float64, requires_grad=True)


def _compare(layout: Layout, y: torch.Tensor, weight: torch.Tensor, plain_outputs: list, plain_tables: list) -> None:
    """``y`` and ``weight.grad`` (after a backward of a random output gradient) against each model's plain output
    and its table's gradient after the same gradient's slice."""
    grad = torch.randn_like(y)
    y.backward(grad)
    for i, (y_i, table_i) in enumerate(zip(plain_outputs, plain_tables)):
        y_i.backward(layout.split(grad)[i])
        torch.testing.assert_close(layout.split(y)[i], y_i, atol=1e-12, rtol=0, msg=lambda m, i=i: f"model {i}: {m}")
        torch.testing.assert_close(weight.grad[i], table_i.grad, atol=1e-12, rtol=1e-10,
                                   msg=lambda m, i=i: f"model {i} table grad: {m}")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
@pytest.mark.parametrize("options", [{}, {"padding_idx": 2, "scale_grad_by_freq": True}], ids=["plain", "pad-freq"])
def test_embedding_matches_b_plain_lookups(order: str, shared: bool, options: dict) -> None:
    torch.manual_seed(0)
    layout, weight = Layout(B, order), _tables()
    indices = [torch.randint(0, NUM, (N, 6)) for _ in range(B)]
    if shared:
        indices = [indices[0]] * B
    merged = indices[0] if shared else layout.merge(torch.stack(indices))
    y = BF.embedding(merged, weight, **options, layout=layout, shared=shared)
    tables = [weight[i].detach().clone().requires_grad_() for i in range(B)]
    _compare(layout, y, weight, [F.embedding(idx, t, **options) for idx, t in zip(indices, tables)], tables)


@pytest.mark.parametrize("order", ORDERS)
def test_embedding_max_norm_renormalises_each_models_rows_in_place(order: str) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    weight = torch.randn(B, NUM, DIM, dtype=torch.float64) * 3
    tables = [weight[i].clone() for i in range(B)]
    indices = [torch.randint(0, NUM, (N,)) for _ in range(B)]
    y = BF.embedding(layout.merge(torch.stack(indices)), weight, max_norm=1.5, layout=layout)
    for i in range(B):
        torch.testing.assert_close(layout.split(y)[i], F.embedding(indices[i], tables[i], max_norm=1.5))
        torch.testing.assert_close(weight[i], tables[i])


def test_embedding_refuses_tables_of_another_batch() -> None:
    with pytest.raises(ValueError, match=r"weight must be \(B, num_embeddings, dim\) with B = 2, got \(3, 7, 5\)"):
        BF.embedding(torch.zeros(4, dtype=torch.long), torch.randn(3, NUM, DIM), layout=Layout(2))
    with pytest.raises(ValueError, match=r"merged indices of B = 3 models in dim 0, got \(4, 2\)"):
        BF.embedding(torch.zeros(4, 2, dtype=torch.long), torch.randn(3, NUM, DIM), layout=Layout(3, "samples"))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_of_fixed_bags_matches_b_plain_calls(order: str, shared: bool, mode: str) -> None:
    torch.manual_seed(0)
    layout, weight = Layout(B, order), _tables()
    indices = [torch.randint(0, NUM, (N, 5)) for _ in range(B)]
    weights = [torch.rand(N, 5, dtype=torch.float64) for _ in range(B)] if mode == "sum" else [None] * B
    if shared:
        indices, weights = [indices[0]] * B, [weights[0]] * B
    merged = indices[0] if shared else layout.merge(torch.stack(indices))
    merged_weights = weights[0] if shared or mode != "sum" else layout.merge(torch.stack(weights))
    y = BF.embedding_bag(merged, weight, mode=mode, per_sample_weights=merged_weights, padding_idx=1, layout=layout,
                         shared=shared)
    tables = [weight[i].detach().clone().requires_grad_() for i in range(B)]
    expected = [F.embedding_bag(idx, t, mode=mode, per_sample_weights=w, padding_idx=1)
                for idx, t, w in zip(indices, tables, weights)]
    _compare(layout, y, weight, expected, tables)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
@pytest.mark.parametrize("include_last_offset", [False, True], ids=["starts", "with-end"])
def test_embedding_bag_with_offsets_matches_b_plain_calls(order: str, shared: bool, include_last_offset: bool) -> None:
    torch.manual_seed(0)
    layout, weight = Layout(B, order), _tables()
    indices = [torch.randint(0, NUM, (9,)) for _ in range(B)]
    offsets = [torch.tensor([0, 2, 2, 6, 9] if include_last_offset else [0, 2, 2, 6]) for _ in range(B)]
    if shared:
        indices = [indices[0]] * B
    merged, merged_offsets = (indices[0], offsets[0]) if shared else (torch.cat(indices), torch.cat(offsets))
    y = BF.embedding_bag(merged, weight, merged_offsets, mode="mean", include_last_offset=include_last_offset,
                         layout=layout, shared=shared)
    tables = [weight[i].detach().clone().requires_grad_() for i in range(B)]
    expected = [F.embedding_bag(idx, t, o, mode="mean", include_last_offset=include_last_offset)
                for idx, t, o in zip(indices, tables, offsets)]
    _compare(layout, y, weight, expected, tables)


def test_embedding_bag_refuses_what_torch_refuses() -> None:
    weight, layout = torch.randn(2, NUM, DIM), Layout(2)
    with pytest.raises(ValueError, match="mode must be 'sum', 'mean' or 'max', got 'min'"):
        BF.embedding_bag(torch.zeros(4, 3, dtype=torch.long), weight, mode="min", layout=layout)
    with pytest.raises(ValueError, match="a 1-D input needs offsets"):
        BF.embedding_bag(torch.zeros(4, dtype=torch.long), weight, layout=layout)
    with pytest.raises(NotImplementedError, match="per_sample_weights is only supported for mode='sum'"):
        BF.embedding_bag(torch.zeros(4, 3, dtype=torch.long), weight, per_sample_weights=torch.ones(4, 3),
                         layout=layout)


@pytest.mark.cuda
@pytest.mark.parametrize("order", ORDERS)
def test_embedding_on_cuda_matches_b_plain_lookups(order: str) -> None:
    torch.manual_seed(0)
    layout = Layout(B, order)
    weight = torch.randn(B, NUM, DIM, device="cuda", requires_grad=True)
    indices = [torch.randint(0, NUM, (N, 6), device="cuda") for _ in range(B)]
    y = BF.embedding(layout.merge(torch.stack(indices)), weight, padding_idx=0, layout=layout)
    tables = [weight[i].detach().clone().requires_grad_() for i in range(B)]
    grad = torch.randn_like(y)
    y.backward(grad)
    for i, (idx, table) in enumerate(zip(indices, tables)):
        y_i = F.embedding(idx, table, padding_idx=0)
        y_i.backward(layout.split(grad)[i])
        torch.testing.assert_close(layout.split(y)[i], y_i, atol=0, rtol=0)
        torch.testing.assert_close(weight.grad[i], table.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shared", [False, True], ids=["merged", "shared"])
def test_multi_embedding_matches_b_plain_lookups_per_table(order: str, shared: bool) -> None:
    torch.manual_seed(0)
    layout, nums, dims = Layout(B, order), [7, 3, 11], [2, 4, 3]
    weight = torch.randn(B, sum(n * d for n, d in zip(nums, dims)), dtype=torch.float64, requires_grad=True)
    indices = [torch.stack([torch.randint(0, n, (N,)) for n in nums], dim=1) for _ in range(B)]
    if shared:
        indices = [indices[0]] * B
    merged = indices[0] if shared else layout.merge(torch.stack(indices))
    y = BF.multi_embedding(merged, weight, nums, dims, BF.multi_table_index(nums, dims), layout=layout,
                           shared=shared)
    flats = [weight[i].detach().clone().requires_grad_() for i in range(B)]
    expected = []
    for idx, flat in zip(indices, flats):
        starts = [sum(n * d for n, d in zip(nums[:t], dims[:t])) for t in range(len(nums))]
        tables = [flat[s : s + n * d].view(n, d) for s, n, d in zip(starts, nums, dims)]
        expected.append(torch.cat([F.embedding(idx[:, t], table) for t, table in enumerate(tables)], dim=1))
    _compare(layout, y, weight, expected, flats)
