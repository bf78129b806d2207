"""Batched ``F.linear``, ``F.bilinear`` and the transposed linear of transformers' ``Conv1D``."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .._base import autocast_dtype
from .._layout import Layout, reshape_unread

__all__ = ["bilinear", "linear", "transposed_linear"]


def _product(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    weight_t = weight.transpose(1, 2)
    if bias is None:
        return torch.bmm(rows, weight_t)
    if torch.compiler.is_compiling():
        # Inductor runs baddbmm as cuBLAS's, after a copy of the broadcast bias; a separate addition it
        # fuses into the next element-wise kernel (as it unfuses the plain Linear's addmm).
        return torch.bmm(rows, weight_t) + bias.unsqueeze(1)
    return torch.baddbmm(bias.unsqueeze(1), rows, weight_t)


class BatchedLinear(torch.autograd.Function):
    """``y[b] = x[b] @ W[b].T + bias[b]`` with a backward that writes each gradient in its own layout.

    Autograd through ``baddbmm(bias, x, W.transpose(1, 2))`` yields the weight gradient transposed, which
    the accumulation then copies into ``W``'s layout: a quarter of an MLP step's GPU time at B=64.
    Here ``grad_W = grad_y^T @ x`` is computed directly as ``(B, out, in)``. The backward is built
    from differentiable ops, so double backward works.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        dtype = autocast_dtype(rows.device.type)
        if dtype is None:
            y = _product(rows, weight, bias)
        else:  # autocast does not reach a custom backward: cast here, once
            rows, weight = rows.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(rows.device.type, enabled=False):
                y = _product(rows, weight, bias)
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        rows, weight = ctx.saved_tensors
        grad = grad.to(rows.dtype)
        if grad.stride(0) < grad.stride(1):  # models interleaved (samples-major): per-model sums would depend on B
            grad = grad.contiguous()
        grad_rows = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = torch.bmm(grad.transpose(1, 2), rows) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias


def _check_rows(name: str, x: Tensor, batch: int) -> None:
    if x.dim() == 0 or x.shape[0] % batch:
        raise ValueError(
            f"{name}: expected dim 0 of the merged input to be a multiple of B = {batch} (the merged model axis), "
            f"got shape {tuple(x.shape)}"
        )


def linear(
    input: Tensor, weight: Tensor, bias: Tensor | None = None, *, layout: Layout, shared: bool = False
) -> Tensor:
    """``F.linear`` of B models: ``y[b] = x[b] @ weight[b].T + bias[b]`` as one batched product.

    Args:
        input: ``(B*n, *, in_features)`` merged in ``layout``'s order, or, with ``shared``, the
            ``(n, *, in_features)`` input every model sees (never copied B times: one dense product
            against all models' weights side by side).
        weight: ``(B, out_features, in_features)``.
        bias: ``(B, out_features)`` or ``None``.
        layout: the number of models and the order of the merged dim 0.
        shared: whether ``input`` is one ``(n, ...)`` tensor shared by all models.

    Returns:
        ``(B*n, *, out_features)`` in ``layout``'s order.
    """
    batch, in_features, out_features = layout.batch, weight.shape[-1], weight.shape[-2]
    if shared:
        # One GEMM against all models' weights side by side: (m, in) @ (in, B*out), no B-fold input copy.
        rows = input.reshape(-1, in_features)
        y = F.linear(rows, weight.reshape(-1, in_features), None if bias is None else bias.reshape(-1))
        if layout.order == "samples":  # (n, *, B, out) -> (n, B, *, out): a view without middle dims
            y = y.view(input.shape[0], -1, batch, out_features).transpose(1, 2)
        else:
            y = y.view(-1, batch, out_features).transpose(0, 1)
        return y.reshape(batch * input.shape[0], *input.shape[1:-1], out_features)
    _check_rows("linear", input, batch)
    if layout.order == "models":
        y = BatchedLinear.apply(input.reshape(batch, -1, in_features), weight, bias)
        return reshape_unread(y, (*input.shape[:-1], out_features))  # its backward reads the input and weight
    # Samples-major: a (n*B, in) input is a strided (B, n, in) view, which the batched product reads as it
    # is; the output is laid back samples-major (a copy).
    samples = input.shape[0] // batch
    rows = input.reshape(samples, batch, -1, in_features).transpose(0, 1).reshape(batch, -1, in_features)
    y = BatchedLinear.apply(rows, weight, bias)
    y = y.view(batch, samples, *input.shape[1:-1], out_features).transpose(0, 1)
    return y.reshape(*input.shape[:-1], out_features)


def transposed_linear(
    input: Tensor, weight: Tensor, bias: Tensor | None = None, *, layout: Layout, shared: bool = False
) -> Tensor:
    """:func:`linear` with each model's weight stored ``(in_features, out_features)``, as transformers'
    ``Conv1D`` (GPT-2) stores it: ``y[b] = x[b] @ weight[b] + bias[b]``; ``weight`` is
    ``(B, in_features, out_features)``."""
    return linear(input, weight.transpose(1, 2), bias, layout=layout, shared=shared)


def bilinear(
    input1: Tensor,
    input2: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    layout: Layout,
    shared: tuple[bool, bool] = (False, False),
) -> Tensor:
    """``F.bilinear`` of B models: ``y[b] = x1[b]^T weight[b] x2[b] + bias[b]``.

    One batched product contracts one input with every model's weight and a batched matrix-vector product
    the other; which input goes first (or whether the outer product ``x1 x2^T`` meets the weight) keeps the
    intermediate smallest. A shared input is contracted first, as one dense product against all models'
    weights, so it is never copied B times. Under autocast it computes in the widest input dtype, as
    ``torch.bilinear`` (on autocast's "promote" list) does.

    Args:
        input1: ``(B*n, *, in1_features)`` merged in ``layout``'s order (``(n, *, in1_features)`` if shared).
        input2: ``(B*n, *, in2_features)`` with the same leading dims per model.
        weight: ``(B, out_features, in1_features, in2_features)``.
        bias: ``(B, out_features)`` or ``None``.
        layout: the number of models and the order of the merged dim 0.
        shared: whether ``input1``, ``input2`` are each the ``(n, ...)`` input shared by all models.

    Returns:
        ``(B*n, *, out_features)`` in ``layout``'s order.
    """
    device = input1.device.type
    if torch.is_autocast_enabled(device):
        # torch.bilinear is on autocast's "promote" list (computed in the widest input dtype), while the
        # bmm/matmul used here would run in the low-precision dtype: do what autocast does for bilinear.
        tensors = [t for t in (input1, input2, weight, bias) if t is not None]
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
        with torch.autocast(device, enabled=False):
            return _bilinear(input1.to(dtype), input2.to(dtype), weight.to(dtype), bias, layout, shared)
    return _bilinear(input1, input2, weight, bias, layout, shared)


def _bilinear(
    input1: Tensor, input2: Tensor, weight: Tensor, bias: Tensor | None, layout: Layout, shared: tuple[bool, bool]
) -> Tensor:
    batch = layout.batch
    shared1, shared2 = shared
    shape1 = (batch * input1.shape[0], *input1.shape[1:]) if shared1 else tuple(input1.shape)
    shape2 = (batch * input2.shape[0], *input2.shape[1:]) if shared2 else tuple(input2.shape)
    if shape1[:-1] != shape2[:-1]:
        raise ValueError(
            f"Bilinear: input1 {tuple(input1.shape)} and input2 {tuple(input2.shape)} must agree in every dim "
            "but the last (per model)"
        )
    out, in1, in2 = weight.shape[1:]
    x1 = _by_model(input1, shared1, layout, in1)  # (B, m, in1); an expanded view when shared
    x2 = _by_model(input2, shared2, layout, in2)
    rows = x1.shape[1]
    if shared1 or (not shared2 and out * in2 <= min(out * in1, in1 * in2)):
        partial = _contract(input1, x1, shared1, weight.transpose(1, 2), out * in2)
        y = torch.matmul(partial.view(batch, rows, out, in2), x2.unsqueeze(-1)).squeeze(-1)
    elif shared2 or out * in1 <= in1 * in2:
        partial = _contract(input2, x2, shared2, weight.permute(0, 3, 1, 2), out * in1)
        y = torch.matmul(partial.view(batch, rows, out, in1), x1.unsqueeze(-1)).squeeze(-1)
    else:  # the outer product x1 x2^T is the smallest intermediate
        outer = (x1.unsqueeze(3) * x2.unsqueeze(2)).reshape(batch, rows, in1 * in2)
        y = torch.bmm(outer, weight.reshape(batch, out, in1 * in2).transpose(1, 2))
    if bias is not None:
        y = y + bias.unsqueeze(1).to(y.dtype)
    per_model = y.reshape(batch, shape1[0] // batch, *shape1[1:-1], out)
    return layout.merge(per_model)


def _by_model(x: Tensor, shared: bool, layout: Layout, features: int) -> Tensor:
    """``(B, m, features)``: each model's rows of a merged input, or an expanded view of a shared one."""
    if shared:
        return x.expand(layout.batch, *x.shape).reshape(layout.batch, -1, features)
    _check_rows("bilinear", x, layout.batch)
    return layout.split(x).reshape(layout.batch, -1, features)


def _contract(given: Tensor, rows: Tensor, shared: bool, weight: Tensor, width: int) -> Tensor:
    """``rows @ weight`` per model, ``(B, m, width)``; ``weight`` is ``(B, in, ...)`` with ``in`` first.

    A shared input is multiplied once by all models' weights side by side (one dense GEMM).
    """
    batch, features = weight.shape[0], weight.shape[1]
    if shared:
        dense = given.reshape(-1, features) @ weight.transpose(0, 1).reshape(features, batch * width)
        return dense.view(-1, batch, width).transpose(0, 1)
    return torch.bmm(rows, weight.reshape(batch, features, width))
