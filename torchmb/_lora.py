"""B LoRA adapters of one peft ``lora.Linear`` layer on its frozen base layer, stored once.

peft's ``lora.Linear`` computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. Batched, the
base layer (its parameters shared by all models, see ``torchmb._shared``) stays the plain module and runs
over all B*n samples of the merged axis; ``lora_A`` and ``lora_B`` become batched ``Linear`` layers, and
every model has its own rank, scaling and dropout probability.

Ranks differ by zero-padding to the largest: model ``i`` of rank ``r_i`` uses rows ``:r_i`` of its
``lora_A`` weight ``(r, in)`` and columns ``:r_i`` of its ``lora_B`` weight ``(out, r)``. The weights are
multiplied by a 0/1 rank mask in ``forward``, so the padding never reaches an output and its gradient is
exactly zero: an optimizer whose update of a zero parameter with a zero gradient is zero (SGD, Adam, AdamW
with weight decay, ...) keeps it zero, and model ``i`` trains exactly as the plain adapter of rank ``r_i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from batch_layers import AbstractBatchModule, Linear, is_shared_parameter

__all__ = ["LoraDropout", "LoraLinear"]


class LoraDropout(AbstractBatchModule):
    """Dropout with model ``i``'s probability ``p[i]`` on its rows: independent masks, kept values scaled
    by ``1 / (1 - p[i])`` as ``nn.Dropout`` does; a shared input is expanded to every model's copy first.
    Identity in evaluation mode and where every ``p`` is zero.

    Attributes:
        p: ``(B,)`` float64, each model's probability.
    """

    merged_order: ClassVar[str] = "models"
    merged_orders: ClassVar[tuple[str, ...]] = ("models",)

    def __init__(self, *, batch: int, device: torch.device | str | None = None) -> None:
        super().__init__(batch)
        self.register_buffer("p", torch.zeros(batch, dtype=torch.float64, device=device), False)
        self.dropping = False  # host-side: whether any model drops (checked once, where p is set)

    def set_probabilities(self, p: Tensor) -> None:
        """Take ``p``, one dropout probability per model (``(B,)``), as this module's."""
        with torch.no_grad():
            self.p = p.to(self.p.device, torch.float64).clone()
        self.batch = len(p)
        self.dropping = bool((p > 0).any())

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and self.dropping):
            return x
        rows = self.split(x)  # a shared input: an expanded view, each model's mask drawn on its own copy
        shape = (self.batch,) + (1,) * (rows.dim() - 1)
        probability = self.p.to(rows.device).view(shape)
        kept = torch.rand(rows.shape, device=rows.device, dtype=torch.float64) >= probability
        return self.merge(rows * kept / (1 - probability).to(rows.dtype))

    def extra_repr(self) -> str:
        return f"p={sorted(set(self.p.tolist()))}, batch={self.batch}"


class LoraLinear(AbstractBatchModule):
    """``batch`` LoRA adapters of one peft ``lora.Linear`` layer, on its base layer shared by all models.

    Built by :meth:`from_module` from a ``peft.tuners.lora.layer.Linear`` holding one adapter (plain LoRA:
    no DoRA or other variant, not merged) whose base layer is frozen and shared by all models; every model
    starts with that adapter's rank, scaling and dropout. :meth:`set_models` gives each its own.

    Attributes:
        base_layer: the plain base layer, run over all B*n samples.
        lora_A, lora_B: ``{adapter: batch_layers.Linear}``, weights ``(B, r, in)`` and ``(B, out, r)``
            (keys as in peft, so state dicts keep peft's names).
        ranks: ``(B,)`` each model's rank (at most ``r``); scaling: ``(B,)`` each model's
            ``lora_alpha / r_i`` (or ``/ sqrt(r_i)`` with rsLoRA).
        lora_dropout: ``{adapter: LoraDropout}``, each model's dropout probability.
    """

    merged_order: ClassVar[str] = "models"
    merged_orders: ClassVar[tuple[str, ...]] = ("models",)
    keeps_shared_parameters: ClassVar[bool] = True

    def __init__(self, base_layer: nn.Module, adapter: str, lora_A: Linear, lora_B: Linear, *, batch: int) -> None:
        super().__init__(batch)
        self.base_layer = base_layer
        self.adapter = adapter
        self.lora_A = nn.ModuleDict({adapter: lora_A})
        self.lora_B = nn.ModuleDict({adapter: lora_B})
        self.lora_dropout = nn.ModuleDict({adapter: LoraDropout(batch=batch, device=lora_A.weight.device)})
        self.max_rank = lora_A.out_features
        factory = {"device": lora_A.weight.device}
        self.register_buffer("ranks", torch.full((batch,), self.max_rank, dtype=torch.long, **factory), False)
        self.register_buffer("scaling", torch.ones(batch, dtype=torch.float64, **factory), False)
        self.padded = False  # host-side: whether any model's rank is below the largest (the mask is needed)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> LoraLinear:
        adapters = list(module.lora_A.keys())
        if len(adapters) != 1 or list(module.active_adapters) != adapters:
            raise ValueError(
                f"torchmb batches a peft LoRA layer holding exactly one active adapter; this one holds {adapters} "
                f"with {list(module.active_adapters)} active"
            )
        (adapter,) = adapters
        if module.merged or module.disable_adapters or module.lora_variant:
            raise ValueError(
                f"torchmb batches plain LoRA adapters that are neither merged nor disabled (no DoRA or other "
                f"variant); adapter {adapter!r} is {'merged' if module.merged else 'a variant or disabled'}"
            )
        base = module.get_base_layer()
        per_model = [name for name, p in base.named_parameters() if not is_shared_parameter(p)]
        if per_model or any(True for _ in base.buffers()):
            raise ValueError(
                f"a LoRA layer's base layer must be frozen and shared by all models (stored once, without buffers); "
                f"{type(base).__name__} has per-model state {per_model or 'in buffers'}: freeze it, or leave it "
                "out of BatchModule's shared=... only for adapters you train per model"
            )
        layer = cls(
            base,
            adapter,
            Linear.from_module(module.lora_A[adapter], batch),
            Linear.from_module(module.lora_B[adapter], batch),
            batch=batch,
        )
        dropout = module.lora_dropout[adapter]
        layer.set_models(
            [module.r[adapter]] * batch,
            [module.scaling[adapter]] * batch,
            [dropout.p if isinstance(dropout, nn.Dropout) else 0.0] * batch,
        )
        return layer.train(module.training)

    def set_models(self, ranks: Sequence[int], scaling: Sequence[float], dropout: Sequence[float]) -> None:
        """Give model ``i`` rank ``ranks[i]`` (at most ``r``), the factor ``scaling[i]`` and the dropout
        probability ``dropout[i]``; weights beyond a model's rank are set to zero."""
        ranks_ = torch.as_tensor(list(ranks), dtype=torch.long)
        if ranks_.shape != (self.batch,) or bool(((ranks_ < 1) | (ranks_ > self.max_rank)).any()):
            raise ValueError(f"ranks: expected {self.batch} ranks in [1, {self.max_rank}], got {list(ranks)}")
        dropout_ = torch.as_tensor(list(dropout), dtype=torch.float64)
        if dropout_.shape != (self.batch,) or bool(((dropout_ < 0) | (dropout_ >= 1)).any()):
            raise ValueError(f"dropout: expected {self.batch} probabilities in [0, 1), got {list(dropout)}")
        with torch.no_grad():
            self.ranks.copy_(ranks_)
            self.scaling.copy_(torch.as_tensor(list(scaling), dtype=torch.float64))
            self.lora_dropout[self.adapter].set_probabilities(dropout_)
            self._refresh()
            self.lora_A[self.adapter].weight.mul_(self.rank_mask().unsqueeze(2))
            self.lora_B[self.adapter].weight.mul_(self.rank_mask().unsqueeze(1))

    def keep_models(self, index: Tensor) -> None:
        """Keep the per-model settings of models ``index`` (``BatchModule.select`` shrinks the weights)."""
        for name in ("ranks", "scaling"):
            setattr(self, name, getattr(self, name)[index.to(self.ranks.device)])
        dropout = self.lora_dropout[self.adapter]
        dropout.set_probabilities(dropout.p[index.to(dropout.p.device)])
        self.batch = len(index)
        self._refresh()

    def _refresh(self) -> None:
        self.padded = bool((self.ranks < self.max_rank).any())

    def rank_mask(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """``(B, r)``: 1 where a row of ``lora_A`` (a column of ``lora_B``) is within the model's rank."""
        positions = torch.arange(self.max_rank, device=self.ranks.device)
        return (positions < self.ranks.unsqueeze(1)).to(dtype)

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.is_shared(x):
            result = self.expand_shared(result) if self.is_shared(result) else result
        lora_A, lora_B = self.lora_A[self.adapter], self.lora_B[self.adapter]
        weight_A, weight_B = lora_A.weight, lora_B.weight
        if self.padded:
            mask = self.rank_mask(weight_A.dtype)
            weight_A, weight_B = weight_A * mask.unsqueeze(2), weight_B * mask.unsqueeze(1)
        if x.dtype != weight_A.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(weight_A.dtype)  # as peft's _cast_input_dtype
        x = self.lora_dropout[self.adapter](x)  # a module: its per-model output is known as such
        y = lora_B.linear_form(lora_A.linear_form(x, weight_A), weight_B, lora_B.bias)
        return (result + self._scaled(y)).to(result.dtype)

    def _scaled(self, y: Tensor) -> Tensor:
        """Model ``i``'s rows times its scaling, computed as peft's ``tensor * float`` is (in at least float32)."""
        rows = self.split(y)
        compute = torch.promote_types(rows.dtype, torch.float32)
        scaling = self.scaling.to(rows.device, compute).view((self.batch,) + (1,) * (rows.dim() - 1))
        return self.merge((rows.to(compute) * scaling).to(rows.dtype))

    def extra_repr(self) -> str:
        ranks = sorted(set(self.ranks.tolist()))
        return f"adapter={self.adapter!r}, r={self.max_rank}, ranks={ranks}, batch={self.batch}"
