"""The ``torch.func`` path: any module with parameters becomes B models, without a batched layer.

The module keeps its identity and its state-dict keys: each of its parameters and buffers is replaced in
place by a ``(B, *shape)`` stack, and its class is swapped for a subclass whose ``forward`` runs the
original ``forward`` under ``vmap`` over the models (``functional_call``, ``randomness="different"`` so
that dropout masks are independent). The same class swap is how ``torch.nn.utils.parametrize`` works.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from batch_layers import check_merged_rows, is_shared_input

__all__ = ["batch_generically", "is_generic"]

_GENERIC_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def is_generic(module: nn.Module) -> bool:
    """Whether ``module`` was batched through ``torch.func`` rather than a registered batched layer."""
    return type(module) in _GENERIC_CLASSES.values()


def _stack(tensor: Tensor, batch: int) -> Tensor:
    return tensor.detach().unsqueeze(0).expand(batch, *tensor.shape).clone()


def batch_generically(module: nn.Module, batch: int) -> nn.Module:
    """Turn ``module`` (in place) into ``batch`` models run through ``torch.func.vmap``; returns it."""
    stacked: dict[int, Tensor] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                if id(param) not in stacked:
                    stacked[id(param)] = nn.Parameter(_stack(param, batch), requires_grad=param.requires_grad)
                owner._parameters[name] = stacked[id(param)]
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[name] = _stack(buffer, batch)
    module.__class__ = _generic_class(type(module))
    module._torchmb_batch = batch
    module._torchmb_calling_original = False
    return module


def _generic_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _GENERIC_CLASSES:
        _GENERIC_CLASSES[cls] = type(
            f"FuncBatched{cls.__name__}",
            (cls,),
            {"forward": _make_forward(cls.forward), "extra_repr": _make_extra_repr(cls.extra_repr)},
        )
    return _GENERIC_CLASSES[cls]


def _make_extra_repr(original_extra_repr):
    def extra_repr(self: nn.Module) -> str:
        own = original_extra_repr(self)
        return ", ".join(p for p in (own, f"batch={self._torchmb_batch}, batched via torch.func") if p)

    return extra_repr


def _make_forward(original_forward):
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._torchmb_calling_original:
            # functional_call re-enters here with one model's parameters swapped in.
            return original_forward(self, *args, **kwargs)
        return _vmapped_call(self, args, kwargs)

    return forward


def _vmapped_call(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    batch = module._torchmb_batch
    leaves, spec = tree_flatten((args, kwargs))
    mapped_positions, mapped, in_dims = [], [], []
    for position, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor) or is_shared_input(leaf, batch):
            continue  # constants, and the shared input that every model reads as it is
        check_merged_rows(leaf, batch, f"{type(module).__name__} (batched via torch.func)", "tensor argument")
        mapped_positions.append(position)
        mapped.append(leaf.view(batch, -1, *leaf.shape[1:]))
        in_dims.append(0)
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())

    def one_model(params: dict, buffers: dict, *tensors: Tensor) -> Any:
        call_leaves = list(leaves)
        for position, tensor in zip(mapped_positions, tensors):
            call_leaves[position] = tensor
        call_args, call_kwargs = tree_unflatten(call_leaves, spec)
        return functional_call(module, {**params, **buffers}, call_args, call_kwargs)

    module._torchmb_calling_original = True
    try:
        out = vmap(one_model, in_dims=(0, 0, *in_dims), randomness="different")(params, buffers, *mapped)
    finally:
        module._torchmb_calling_original = False
    return tree_map(lambda t: t.reshape(-1, *t.shape[2:]) if isinstance(t, Tensor) else t, out)
