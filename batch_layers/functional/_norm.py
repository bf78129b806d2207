"""Batched normalisations: batch norm (the models as channel groups) and the per-sample norms.

A batch norm's statistics mix samples, so model ``b``'s channels become channels ``b*C .. b*C + C-1`` of one
batch norm over the grouped ``(n, B*C, ...)`` layout (a free view samples-major; a channels-last input stays
channels-last, cuDNN's NHWC batch norm). The per-sample norms (layer, RMS, group, instance) take their
statistics within one sample, so the normalisation runs unchanged on the merged tensor; only the elementwise
affine differs per model, one broadcast product and sum with the ``(B, ...)`` weights on the ``(B, n, ...)``
view. A shared ``(n, ...)`` input is normalised once; the per-model affine broadcasts it to B models. Layer
and RMS norms of a merged input may instead run fused Triton kernels that apply each row's model's affine
themselves (the kernel table of norms, :mod:`batch_layers._norm_table`, chooses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._base import autocast_dtype
from .._layout import Layout, from_grouped, shared_to_grouped, to_grouped
from .._norm_table import runs_fused_norm
from .._norm_triton import norm_affine_backward, norm_affine_forward

__all__ = ["batch_norm", "frozen_batch_norm", "group_norm", "instance_norm", "layer_norm", "rms_norm"]


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    *,
    layout: Layout,
    shared: bool = False,
    num_batches_tracked: Tensor | None = None,
) -> Tensor:
    """:func:`torch.nn.functional.batch_norm` for B models, each with its own statistics.

    Args:
        input: the merged ``(B*n, C, *)`` input (with ``shared``, one ``(n, C, *)`` every model reads).
        running_mean, running_var: ``(B, C)``, updated in place per model in training (or None).
        weight, bias: ``(B, C)`` (or None).
        momentum: as torch's; ``None`` (``nn.BatchNorm``'s cumulative average) moves each model's running
            statistics by ``1 / num_batches_tracked``, its own ``(B,)`` count (given, already incremented).

    Returns:
        the merged ``(B*n, C, *)`` in ``layout``'s order.
    """
    batch = layout.batch
    channels = shared_to_grouped(input, batch) if shared else to_grouped(input, batch, layout.order)
    flat_weight = None if weight is None else weight.reshape(-1)
    flat_bias = None if bias is None else bias.reshape(-1)
    if training and running_mean is not None and momentum is None:
        y = _cumulative_average(channels, running_mean, running_var, flat_weight, flat_bias, eps, num_batches_tracked)
    else:
        flat_mean = None if running_mean is None else running_mean.view(-1)
        flat_var = None if running_var is None else running_var.view(-1)
        momentum = 0.0 if momentum is None else momentum
        y = F.batch_norm(channels, flat_mean, flat_var, flat_weight, flat_bias, training, momentum, eps)
    return from_grouped(y, batch, layout.order, unread=True)


def _cumulative_average(channels, running_mean, running_var, weight, bias, eps, num_batches_tracked) -> Tensor:
    """``momentum=None``: each model averages its running stats over its own batch count."""
    if num_batches_tracked is None:
        raise ValueError("batch_norm with momentum=None (a cumulative average) needs each model's num_batches_tracked")
    dims = [0, *range(2, channels.dim())]
    with torch.no_grad():
        var, mean = torch.var_mean(channels, dim=dims, correction=1)
        factor = (1.0 / num_batches_tracked.to(mean.dtype)).repeat_interleave(running_mean.shape[1])
        running_mean.view(-1).lerp_(mean, factor)
        running_var.view(-1).lerp_(var, factor)
    return F.batch_norm(channels, None, None, weight, bias, True, 0.0, eps)


def frozen_batch_norm(
    input: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-5,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """torchvision's ``FrozenBatchNorm2d`` for B models: ``(x - running_mean) / sqrt(running_var + eps) *
    weight + bias`` with each model's ``(B, C)`` buffers, as one scale-and-shift of the merged
    ``(B*n, C, H, W)`` input (with ``shared``, one ``(n, C, H, W)``)."""
    scale = weight * (running_var + eps).rsqrt()
    shift = bias - running_mean * scale
    models = _split(input, layout, shared)  # (B, n, C, H, W)
    return layout.merge(models * scale[:, None, :, None, None] + shift[:, None, :, None, None], unread=True)


def _split(x: Tensor, layout: Layout, shared: bool) -> Tensor:
    """``(B, n, ...)``: the merged ``x`` split by model, or the shared ``x`` expanded (a view)."""
    return x.expand(layout.batch, *x.shape) if shared else layout.split(x)


def _per_model(t: Tensor, dims: int, trailing: int = 0) -> Tensor:
    """View a ``(B, *shape)`` parameter for broadcasting against ``(B, m, ...)``: ``(B, 1.., *shape, 1..)``."""
    return t.view(t.shape[0], *([1] * (dims - t.dim() - trailing)), *t.shape[1:], *([1] * trailing))


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, layout: Layout, shared: bool, trailing: int = 0):
    """``y * weight + bias`` per model on the ``(B, m, ...)`` view of the normalised ``y``."""
    if weight is None and bias is None:
        return y
    models = _split(y, layout, shared)
    dims = models.dim()
    if weight is None:
        out = models + _per_model(bias, dims, trailing)
    elif bias is None:
        out = models * _per_model(weight, dims, trailing)
    else:
        # a product and a sum rather than one addcmul: addcmul's backward multiplies the activation by its
        # ``value`` (1) once more, one more full-size kernel per norm
        out = models * _per_model(weight, dims, trailing) + _per_model(bias, dims, trailing)
    # torch's norms return the dtype of their normalised result (float32 under autocast for the ones on
    # its float32 list, the input's dtype otherwise), never one promoted by the float32 weights.
    out = layout.merge(out, unread=True)  # a product's or sum's result: their backward reads only their inputs
    return out if out.dtype == y.dtype else out.to(y.dtype)  # no aten::to dispatched for nothing


def layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.layer_norm` for B models: the merged ``(B*n, *, *normalized_shape)`` input
    (with ``shared``, one ``(n, ...)``), ``weight`` and ``bias`` ``(B, *normalized_shape)``. Without an affine
    the output of a shared input stays shared. The kernel table of norms (:mod:`batch_layers._norm_table`)
    chooses the fused kernels or torch's norm plus a broadcast affine."""
    if _takes_fused(input, normalized_shape, (weight, bias), layout, shared):
        return _FusedNorm.apply(input, weight, bias, tuple(normalized_shape), eps, layout, False)
    return _affine(F.layer_norm(input, normalized_shape, None, None, eps), weight, bias, layout, shared)


def rms_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.rms_norm` for B models, as :func:`layer_norm` (``weight``
    ``(B, *normalized_shape)``, no bias)."""
    if _takes_fused(input, normalized_shape, (weight,), layout, shared, rms=True):
        # torch's default: the machine epsilon of the float type it computes in (float32 for every fused dtype)
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        return _FusedNorm.apply(input, weight, None, tuple(normalized_shape), eps, layout, True)
    return _affine(F.rms_norm(input, normalized_shape, None, eps), weight, None, layout, shared)


def _takes_fused(input: Tensor, normalized_shape: Sequence[int], params: tuple[Tensor | None, ...], layout: Layout,
                 shared: bool, rms: bool = False) -> bool:
    """Whether a (with ``rms``, RMS) norm with this per-model affine runs on the fused kernels: the kernel
    table's choice, for the shapes they read (any other goes to the composite, whose checks raise torch's
    errors)."""
    params = tuple(p for p in params if p is not None)
    if shared or not params:  # a shared input is normalised once, then broadcast to the models
        return False
    shape = tuple(normalized_shape)
    if input.dim() <= len(shape) or tuple(input.shape[input.dim() - len(shape) :]) != shape:
        return False
    if input.shape[0] % layout.batch or any(tuple(p.shape) != (layout.batch, *shape) for p in params):
        return False
    return runs_fused_norm(input, math.prod(shape), rms)


class _FusedNorm(torch.autograd.Function):
    """A layer norm (or, with ``rms``, an RMS norm) of the merged input's rows with each row's model's weight
    and bias, forward and backward on the Triton kernels of :mod:`batch_layers._norm_triton`.

    The output's dtype is the one the composite gives: the input's, or float32 for a layer norm under autocast
    (torch's policy), read from the input as it is rather than from a float32 copy. A backward that is
    itself differentiated (``create_graph=True``) differentiates the composite instead: the kernels have no
    derivatives of their own.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, layout, rms):
        features, batch = math.prod(normalized_shape), layout.batch
        # CUDA's autocast runs torch's layer norm in float32 (the kernels run on CUDA tensors only; on CPU,
        # Triton's interpreter in the tests); an RMS norm under autocast keeps the composite (rms_norm)
        out_dtype = torch.float32 if x.is_cuda and autocast_dtype("cuda") is not None else x.dtype
        w = None if weight is None else weight.reshape(batch, features).contiguous()
        b = None if bias is None else bias.reshape(batch, features).contiguous()
        y, mean, rstd = norm_affine_forward(x.contiguous(), w, b, features, eps, layout, rms, out_dtype)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.config = (normalized_shape, eps, layout, rms, out_dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        normalized_shape, eps, layout, rms, out_dtype = ctx.config
        needs = (ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                 bias is not None and ctx.needs_input_grad[2])
        if torch.is_grad_enabled():
            grads = _composite_grads(grad, x, weight, bias, normalized_shape, eps, layout, rms, out_dtype, needs)
        else:
            features, batch = math.prod(normalized_shape), layout.batch
            w = None if weight is None else weight.reshape(batch, features).contiguous()
            param_dtype = (weight if weight is not None else bias).dtype
            dx, dw, db = norm_affine_backward(grad, x.contiguous(), w, mean, rstd, features, layout, rms, needs,
                                              param_dtype)
            grads = (None if dx is None else dx.view(x.shape), None if dw is None else dw.view(weight.shape),
                     None if db is None else db.view(bias.shape).to(bias.dtype))
        return (*grads, None, None, None, None)


def _composite_grads(grad, x, weight, bias, normalized_shape, eps, layout, rms, out_dtype, needs):
    """The gradients ``needs`` asks for, differentiably, through the composite of the same norm of ``x``
    computed in ``out_dtype`` (as autocast would have)."""
    rows = x.to(out_dtype)
    if rms:
        y = _affine(F.rms_norm(rows, normalized_shape, None, eps), weight, None, layout, False)
    else:
        y = _affine(F.layer_norm(rows, normalized_shape, None, None, eps), weight, bias, layout, False)
    inputs = [t for t, need in zip((x, weight, bias), needs) if need]
    found = iter(torch.autograd.grad(y, inputs, grad, create_graph=True))
    return tuple(next(found) if need else None for need in needs)


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.group_norm` for B models: the merged ``(B*n, C, *)`` input (with ``shared``,
    one ``(n, C, *)``), ``weight`` and ``bias`` ``(B, C)``."""
    y = F.group_norm(input, num_groups, None, None, eps)
    return _affine(y, weight, bias, layout, shared, trailing=input.dim() - 2)


def instance_norm(
    input: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    layout: Layout,
    shared: bool = False,
) -> Tensor:
    """:func:`torch.nn.functional.instance_norm` for B models: the merged ``(B*n, C, *)`` input (with
    ``shared``, one ``(n, C, *)``), ``(B, C)`` running statistics, weight and bias.

    With ``use_input_stats`` each instance is normalised by its own statistics and, where running statistics
    are given, model ``b``'s move towards the mean over *its own* samples of the per-instance mean and
    unbiased variance (by ``momentum``), as torch's instance norm moves a single model's. Otherwise each
    model's running statistics and affine apply as one scale-and-shift.
    """
    trailing = input.dim() - 2
    if use_input_stats:
        y = F.instance_norm(input, None, None, None, None, True, 0.0, eps)
        if running_mean is not None and momentum != 0.0:
            _update_running_stats(input, running_mean, running_var, momentum, layout, shared)
        return _affine(y, weight, bias, layout, shared, trailing)
    if running_mean is None or running_var is None:
        raise ValueError("instance_norm: expected running_mean and running_var when use_input_stats=False")
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -running_mean * scale
    if bias is not None:
        shift = shift + bias
    models = _split(input, layout, shared)
    dims = models.dim()
    out = models * _per_model(scale, dims, trailing) + _per_model(shift, dims, trailing)
    out = layout.merge(out, unread=True)
    return out if out.dtype == input.dtype else out.to(input.dtype)


@torch.no_grad()
def _update_running_stats(x: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float, layout: Layout,
                          shared: bool) -> None:
    stats_dtype = torch.promote_types(x.dtype, running_mean.dtype)
    var, mean = torch.var_mean(x.detach().to(stats_dtype), dim=tuple(range(2, x.dim())), correction=1)
    if shared:  # every model saw the same samples
        var, mean = var.mean(0).expand(layout.batch, -1), mean.mean(0).expand(layout.batch, -1)
    else:
        var, mean = layout.split(var).mean(1), layout.split(mean).mean(1)
    running_mean.lerp_(mean.to(running_mean.dtype), momentum)
    running_var.lerp_(var.to(running_var.dtype), momentum)
