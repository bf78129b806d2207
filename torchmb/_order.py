"""The merged order of a ``BatchModule``'s layers: which one it starts in, setting it on every batched layer,
and reordering around a layer that runs in one order only.

``merged_order="auto"`` starts models-major (row ``b*n + i``), which runs every model correctly, and is a
candidate for samples-major (row ``i*B + b``) when every batched layer supports it and one gains from it (a
convolution or batch norm: ``grouped_layout``). Whether a model merges other dims into dim 0, which only the
models-major order keeps apart by model, only its first forward tells: ``BatchModule.forward`` runs it with
a ``batch_layers.SamplesOrderProbe`` and then sets the order for good (see docs/design.md).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_map

from batch_layers import AbstractBatchModule, current_forward

__all__ = ["set_order", "start_order"]


def start_order(model: nn.Module, requested: str, generic_modules: list[str]) -> tuple[str, bool]:
    """The merged order ``model`` starts in for ``requested`` (set on its layers), and whether ``"auto"`` may
    switch to samples-major after the first forward."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, AbstractBatchModule)]
    unable = [name or type(m).__name__ for name, m in layers if not m.runs_in("samples")]
    unable += generic_modules  # the torch.func path splits models-major
    if requested == "samples" and unable:
        raise ValueError(
            "merged_order='samples' needs every batched layer to support the samples-major order; these do "
            f"not: {', '.join(unable)}"
        )
    order = set_order(model, "models" if requested == "auto" else requested)
    return order, requested == "auto" and not unable and any(m.grouped_layout for _, m in layers)


def set_order(model: nn.Module, order: str) -> str:
    """Give every batched layer of ``model`` the merged ``order`` (or reorder around one that cannot run in
    it); returns ``order``."""
    for layer in model.modules():
        if not isinstance(layer, AbstractBatchModule):
            continue
        if layer.runs_in(order):
            if layer.merged_order != order:
                layer.merged_order = order
        elif not getattr(layer, "_reordered", False):  # a samples-only custom layer in a models-major forward
            _reorder_around(layer)
    return order
def _reorder_around(module: AbstractBatchModule) -> None:
    """Give a module that declares ``merged_order = "samples"`` (torchmb 0.2's layout) its layout in a forward
    that runs in another order (``"auto"``'s first forward, or ``"models"``)."""

    def in_its_order() -> bool:
        context = current_forward()
        return context is not None and context.order == module.merged_order

    def to_samples(tensor: Any) -> Any:
        if not isinstance(tensor, Tensor) or module.is_shared(tensor):
            return tensor
        module.check_merged(tensor)
        return tensor.view(module.batch, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)

    def to_models(tensor: Any) -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        module.check_merged(tensor, "output")
        return tensor.view(-1, module.batch, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)

    def before(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return None if in_its_order() else tree_map(to_samples, (args, kwargs))

    def after(_: nn.Module, args: tuple, out: Any) -> Any:
        return None if in_its_order() else tree_map(to_models, out)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)
    module._reordered = True
