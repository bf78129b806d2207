from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import functional
from ._base import UNBATCHED, AbstractBatchModule, copy_into_every_model
from ._checks import check_input_dtype, check_input_size

__all__ = ["Linear", "LinearWeights"]


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
        _add_linear_parameters(self, batch, out_features, in_features, bias, factory_kwargs)
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
            return functional.linear(x, weight, bias, layout=self.layout, shared=True)
        dim = self.merged_dim(x)
        if dim:  # sequence-first layout: bring the model axis to the front for the batched product
            return functional.linear(x.movedim(dim, 0), weight, bias, layout=self.layout).movedim(0, dim)
        return functional.linear(x, weight, bias, layout=self.layout)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, batch={self.batch}"


def _add_linear_parameters(module: nn.Module, batch: int, out_features: int, in_features: int, bias: bool,
                           factory_kwargs: dict) -> None:
    """Give ``module`` B linear maps' uninitialised ``(B, out, in)`` weight and ``(B, out)`` bias (or a ``None``
    bias) and their sizes, as ``nn.Linear`` names them."""
    module.in_features = in_features
    module.out_features = out_features
    module.weight = nn.Parameter(torch.empty(batch, out_features, in_features, **factory_kwargs))
    if bias:
        module.bias = nn.Parameter(torch.empty(batch, out_features, **factory_kwargs))
    else:
        module.register_parameter("bias", None)


class LinearWeights(nn.Module):
    """The ``(B, out, in)`` weight and ``(B, out)`` bias of B linear maps, under a child's name, for a layer
    whose plain counterpart holds them in a child (attention's ``out_proj``, a loss's ``linear``) and that
    draws their initial values itself."""

    def __init__(self, batch: int, out_features: int, in_features: int, bias: bool, factory_kwargs: dict) -> None:
        super().__init__()
        _add_linear_parameters(self, batch, out_features, in_features, bias, factory_kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
