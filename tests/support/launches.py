"""Counting the operators a training step dispatches that compute (views and the profiler's markers launch
nothing): on a GPU each is about one kernel launch, so their number is a step's host cost, countable on CPU.

Unlike ``bench --launches``'s profiler count (the outermost ATen operators, views and no-op ``to`` and
``contiguous`` included), this counts the operators that reach the kernels, after torch's composite ones
decomposed themselves (``aten::linear`` as ``aten::addmm``; ``aten::to`` to the same dtype as nothing).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

NOT_LAUNCHES = {"aten::_unsafe_view", "profiler::_record_function_enter_new", "profiler::_record_function_exit"}


class CopySizes(TorchDispatchMode):
    """The sizes of the copies (``clone``, ``copy_``) dispatched inside it, and the storages they read (data
    pointers)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.read: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.sizes.append(args[0].numel())
            source = args[0] if func is torch.ops.aten.clone.default else args[1]
            self.read.add(source.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


class CountLaunches(TorchDispatchMode):
    """Counts, by name, the operators dispatched inside it that compute."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.name() not in NOT_LAUNCHES:
            self.launches[func.name()] += 1
        return func(*args, **(kwargs or {}))


def count_launches(run: Callable[[], object]) -> collections.Counter[str]:
    """The computing operators one call of ``run`` dispatches, by name."""
    with CountLaunches() as counter:
        run()
    return counter.launches


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classes: int) -> Callable[[], None]:
    """One SGD step (forward, summed cross-entropy, backward, ``torch.optim.SGD``) of ``model`` on ``x``, ``y``;
    called once here, since the first step creates state (and settles the merged order)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        F.cross_entropy(out.reshape(-1, classes), y.reshape(-1), reduction="sum").backward()
        optimizer.step()

    step()
    return step
