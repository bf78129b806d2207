from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import UNBATCHED, AbstractBatchModule, autocast_dtype, copy_into_every_model
from ._checks import check_input_dtype, check_input_size

__all__ = ["Linear"]


def _product(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    weight_t = weight.transpose(1, 2)
    if bias is None:
        return torch.bmm(rows, weight_t)
    if torch.compiler.is_compiling():
        # Inductor runs baddbmm as cuBLAS's, after a copy of the broadcast bias; a separate addition it
        # fuses into the next element-wise kernel (as it unfuses the plain Linear's addmm).
        return torch.bmm(rows, weight_t) + bias.unsqueeze(1)
    return torch.baddbmm(bias.unsqueeze(1), rows, weight_t)


def _check_linear_input(layer: Linear, x: Tensor, weight: Tensor) -> None:
    owner = f"Linear(in_features={weight.shape[-1]}, out_features={weight.shape[-2]}, batch={layer.batch})"
    if x.dim() < 2:
        raise RuntimeError(
            f"{owner}: expected an input (B*n, *, in_features), got shape {tuple(x.shape)}; every model's input "
            f"needs a sample axis n and the feature axis of size {weight.shape[-1]}, so a BatchModule's input is "
            f"(B, n, *, {weight.shape[-1]}); {UNBATCHED}"
        )
    if x.shape[-1] != weight.shape[-1] and not layer.is_shared(x):
        layer.check_merged(x)  # a reshape that mixed models' rows is the cause to name, not the feature size
    check_input_size(owner, x, -1, weight.shape[-1], "in_features", layer.batch)
    check_input_dtype(owner, x, weight)


class _BatchedLinear(torch.autograd.Function):
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


class Linear(AbstractBatchModule):
    r"""``batch`` independent :class:`torch.nn.Linear` layers as one batched matrix product.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: if ``False``, no model has an additive bias.
        batch: number of models B.

    Shape:
        - Input: ``(B*n, *, in_features)`` with the model axis merged into dim 0 (or, inside a
          ``BatchModule``, into another leading dim, e.g. ``(seq, B*n, in_features)``), or the shared
          ``(n, *, in_features)`` input of a shared-input forward.
        - Output: ``(B*n, *, out_features)``.

    Attributes:
        weight: ``(B, out_features, in_features)``, each slice initialised as ``nn.Linear`` does.
        bias: ``(B, out_features)``.

    Examples::

        >>> layer = Linear(20, 30, batch=4)
        >>> layer(torch.randn(4 * 8, 20)).shape
        torch.Size([32, 30])
    """

    base_class: ClassVar[type[nn.Module]] = nn.Linear
    functional_forms: ClassVar[dict[Callable, str]] = {F.linear: "linear_form"}
    merged_order = "models"
    merged_orders = ("models", "samples")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(batch, out_features, in_features, **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(batch, out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every model's slice as :meth:`torch.nn.Linear.reset_parameters` does."""
        for i in range(self.batch):
            nn.init.kaiming_uniform_(self.weight[i], a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                nn.init.uniform_(self.bias[i], -bound, bound)

    @classmethod
    def from_module(cls, module: nn.Linear, batch: int) -> Linear:
        layer = cls(
            module.in_features,
            module.out_features,
            module.bias is not None,
            batch=batch,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        copy_into_every_model(layer, module)
        return layer

    def forward(self, input: Tensor) -> Tensor:
        return self.linear_form(input, self.weight, self.bias)

    def linear_form(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear`` of a merged input with per-model ``(B, out, in)`` weights and ``(B, out)`` bias."""
        _check_linear_input(self, x, weight)
        if self.is_shared(x):
            return self._shared_forward(x, weight, bias)
        dim = self.merged_dim(x)
        if dim:  # sequence-first layout: bring the model axis to the front for the batched product
            return self.linear_form(x.movedim(dim, 0), weight, bias).movedim(0, dim)
        if self.merged_order == "models":
            rows = x.reshape(self.batch, -1, self.in_features)
            y = _BatchedLinear.apply(rows, weight, bias)
            return y.view(*x.shape[:-1], self.out_features)
        # Samples-major: a (n*B, in) input is a strided (B, n, in) view, which the batched product reads
        # as it is; the output is laid back samples-major (a copy).
        self.check_merged(x)
        samples = x.shape[0] // self.batch
        rows = x.reshape(samples, self.batch, -1, self.in_features).transpose(0, 1)
        rows = rows.reshape(self.batch, -1, self.in_features)
        y = _BatchedLinear.apply(rows, weight, bias)
        y = y.view(self.batch, samples, *x.shape[1:-1], self.out_features).transpose(0, 1)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _shared_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        # One GEMM against all models' weights side by side: (m, in) @ (in, B*out), no B-fold input copy.
        rows = x.reshape(-1, self.in_features)
        y = F.linear(rows, weight.reshape(-1, self.in_features), None if bias is None else bias.reshape(-1))
        if self.merged_order == "samples":  # (n, *, B, out) -> (n, B, *, out): a view without middle dims
            y = y.view(x.shape[0], -1, self.batch, self.out_features).transpose(1, 2)
            return y.reshape(self.batch * x.shape[0], *x.shape[1:-1], self.out_features)
        y = y.view(-1, self.batch, self.out_features).transpose(0, 1)
        return y.reshape(self.batch * x.shape[0], *x.shape[1:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, batch={self.batch}"
