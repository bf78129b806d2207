"""``BatchModule.select``'s shrinking of every per-model tensor to the surviving models, all or nothing.

Every survivor's tensor is gathered first (:func:`gather_survivors`, which may fail and changes
nothing); only then are they swapped in (:func:`commit_survivors`, which cannot fail halfway).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .optim._population import select_index

__all__ = ["Survivors", "commit_survivors", "gather_survivors", "survivor_index"]


@dataclass
class Survivors:
    """The survivors' tensors, each beside the parameter or buffer it replaces."""

    parameters: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)
    buffers: list[tuple[Tensor, Tensor]] = field(default_factory=list)


def survivor_index(keep: Sequence[int] | Tensor, batch: int) -> Tensor:
    """``keep`` (distinct model indices, negative ones counting from the end, or a boolean mask of length
    ``batch``) as a CPU index tensor of the survivors, in ``keep``'s order; read exactly as the optimizers'
    ``select`` reads it."""
    return select_index(keep, batch)


def gather_survivors(
    state: dict[str, Tensor], index: Tensor, is_per_model: Callable[[str, Tensor], bool]
) -> Survivors:
    """The rows ``index`` of every per-model entry of ``state`` (a ``state_dict(keep_vars=True)``; a
    tensor under several keys, tied, is gathered once), and of each parameter's gradient."""
    survivors = Survivors()
    seen: set[int] = set()
    with torch.no_grad():
        for key, value in state.items():
            if id(value) in seen or not is_per_model(key, value):
                continue
            seen.add(id(value))
            rows = index.to(value.device)
            if isinstance(value, nn.Parameter):
                replacement = nn.Parameter(value.detach()[rows], requires_grad=value.requires_grad)
                if value.grad is not None:
                    replacement.grad = value.grad[rows]
                survivors.parameters.append((value, replacement))
            else:
                survivors.buffers.append((value, value.detach()[rows]))
    return survivors


def commit_survivors(survivors: Survivors) -> None:
    """Swap the gathered tensors in; parameters and buffers keep their identity."""
    for parameter, replacement in survivors.parameters:
        _swap_parameter(parameter, replacement)
    for buffer, kept in survivors.buffers:
        buffer.data = kept


def _swap_parameter(parameter: nn.Parameter, replacement: nn.Parameter) -> None:
    """Give ``parameter`` (its identity, Python attributes and optimizer entries) ``replacement``'s data,
    gradient and a fresh gradient accumulator, even while graphs built from it are alive.

    Assigning ``.data`` would keep autograd's cached accumulator, whose recorded shape then fails the
    next backward; ``torch.utils.swap_tensors`` refuses a tensor that a live graph has saved. The swap
    of the underlying tensors is what ``swap_tensors`` does after its checks: live graphs keep the old
    tensor, now ``replacement``'s, and its accumulator is made to raise should they run backward.
    """
    if parameter.requires_grad:
        old_accumulator = torch.autograd.graph.get_gradient_edge(parameter).node
        old_accumulator.register_prehook(_refuse_backward_across_select)
    torch._C._swap_tensor_impl(parameter, replacement)


def _refuse_backward_across_select(grad_outputs: Any) -> None:
    raise RuntimeError(
        "backward through a graph built before BatchModule.select() shrank the models; compute the loss again "
        "after select() (or call backward before it)"
    )
