"""Which tensors of a batched forward hold B models' data, and which are the shared input.

A :class:`ModelDataTracker` is a ``TorchFunctionMode`` that ``BatchModule`` enters for a forward: it marks
the forward's input tensors (*shared* with ``shared_input=True``, else *per-model*) and labels each op's
output from its tensor inputs: per-model if any input is (a parameter, a ``torch.func`` batched tensor,
or a per-model tensor), else shared if any input is shared, else nothing (a constant: a buffer stored
once, a tensor created in ``forward``). Outputs of batched layers are per-model whatever ops they ran.

It serves two purposes:

- **Shared input.** A batched layer asks whether its input is the shared ``(n, ...)`` tensor; a tensor
  derived from the shared input by parameter-free ops (a reshape, ``flatten``, an activation, ``x / 255``)
  is recognised whatever its size, where a rule on sizes would split ``(n * seq, d)`` between models
  when ``seq`` is a multiple of B.
- **Python decisions on several models' data.** ``bool()``, ``.item()``, ``.tolist()`` (an ``if`` or a
  ``while`` on a tensor) of a per-model tensor in the model's code would decide once for all B models on
  their pooled data. With ``check_decisions`` the tracker refuses it with :class:`PooledDecisionError`;
  code of torch, of the batched layers and of ``offload`` is trusted (their checks see the whole batch on purpose), and
  :func:`allow_pooled_decisions` lets a model author take one decision for all models on purpose.

Every op of a tracked forward runs through Python, so ``BatchModule`` tracks only shared-input
forwards and its first forward, and ``torchmb.testing`` tracks every forward it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import batch_layers
import offload
from batch_layers import AbstractBatchModule

from ._generic import is_generic

__all__ = [
    "Kind",
    "ModelDataTracker",
    "PooledDecisionError",
    "allow_pooled_decisions",
    "check_every_forward",
    "checking_decisions",
]


class PooledDecisionError(RuntimeError):
    """Python control flow in a batched forward decided on a tensor holding several models' data."""


class Kind(enum.Enum):
    SHARED = "shared"
    PER_MODEL = "per-model"


_DECISIONS = frozenset(
    {
        Tensor.__bool__,
        Tensor.__int__,
        Tensor.__float__,
        Tensor.__complex__,
        Tensor.__index__,
        Tensor.item,
        Tensor.tolist,
        Tensor.numpy,
    }
)
_TRUSTED_DIRS = tuple(
    os.path.dirname(package.__file__) + os.sep for package in (torch, batch_layers, offload, sys.modules[__package__])
)
_POOLED_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("torchmb_pooled_allowed", default=False)
_CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar("torchmb_checking_decisions", default=False)


def checking_decisions() -> bool:
    """Whether every ``BatchModule`` forward now refuses Python decisions on several models' data."""
    return _CHECKING.get()


@contextlib.contextmanager
def check_every_forward() -> Iterator[None]:
    """Refuse Python decisions on several models' data in every ``BatchModule`` forward of this block,
    not only in each module's first (``torchmb.testing`` runs its checks so)."""
    token = _CHECKING.set(True)
    try:
        yield
    finally:
        _CHECKING.reset(token)


@contextlib.contextmanager
def allow_pooled_decisions() -> Iterator[None]:
    """Let the model's code in this block take Python decisions on several models' data.

    Inside a ``BatchModule`` forward, ``if x.mean() > 0:`` is one decision for all B models on their
    pooled data. Where that is intended (an assertion that must hold for every model, logging), wrap it::

        with torchmb.allow_pooled_decisions():
            assert torch.isfinite(h).all()
    """
    token = _POOLED_ALLOWED.set(True)
    try:
        yield
    finally:
        _POOLED_ALLOWED.reset(token)


class ModelDataTracker(TorchFunctionMode):
    """Label the tensors of a batched forward as shared or per-model (see the module docstring).

    Args:
        check_decisions: raise :class:`PooledDecisionError` on a Python decision on per-model data.
    """

    def __init__(self, *, check_decisions: bool) -> None:
        super().__init__()
        self.check_decisions = check_decisions
        self._kinds: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._hook: Any = None

    def mark(self, tensors: Iterable[Any], kind: Kind) -> None:
        """Label every tensor among ``tensors`` (other values are skipped)."""
        for tensor in tensors:
            if isinstance(tensor, Tensor):
                self._kinds[tensor] = kind

    def is_shared(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is the shared input or was computed from it (and constants) alone."""
        return self._kinds.get(tensor) is Kind.SHARED

    def __enter__(self) -> ModelDataTracker:
        self._hook = register_module_forward_hook(self._after_module)
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        self._hook.remove()

    def _after_module(self, module: nn.Module, args: Any, output: Any) -> None:
        """Label a batched layer's outputs per-model, unless computed from the shared input alone in its
        layout: a layer without parameters (layer norm without affine) or an input passed through
        (dropout in eval mode) keeps it shared. A layer that expanded the shared input to B copies (with
        ``expand_shared``) gives ``B`` times its rows, and a kernel the mode did not see an unlabelled
        tensor: both are per-model."""
        if isinstance(module, AbstractBatchModule):
            batch = module.batch
        elif is_generic(module):
            batch = 0  # every output of the torch.func path comes from the models' own parameters
        else:
            return
        inputs = [value for value in tree_flatten(args)[0] if isinstance(value, Tensor)]
        expanded_rows = {batch * value.shape[0] for value in inputs if value.dim() and self.is_shared(value)}
        for tensor in tree_flatten(output)[0]:
            if not isinstance(tensor, Tensor) or any(tensor is value for value in inputs):
                continue
            stays_shared = batch and self.is_shared(tensor) and tensor.dim() and tensor.shape[0] not in expanded_rows
            if not stays_shared:
                self._kinds[tensor] = Kind.PER_MODEL

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = self._kind_of(args, kwargs)
        if kind is Kind.PER_MODEL and self.check_decisions and func in _DECISIONS:
            _refuse_pooled_decision(func)
        out = func(*args, **kwargs)
        if kind is not None:
            if isinstance(out, Tensor):
                self._kinds[out] = kind
            elif isinstance(out, (tuple, list)):
                self.mark(out, kind)
        return out

    def _kind_of(self, args: tuple, kwargs: dict) -> Kind | None:
        kind = None
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if not isinstance(tensor, Tensor):
                    continue
                if isinstance(tensor, nn.Parameter) or torch._C._functorch.is_batchedtensor(tensor):
                    return Kind.PER_MODEL
                found = self._kinds.get(tensor)
                if found is Kind.PER_MODEL:
                    return found
                kind = kind or found
        return kind


def _refuse_pooled_decision(func: Any) -> None:
    if _POOLED_ALLOWED.get():
        return
    frame = sys._getframe(1)
    while frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame.f_code.co_filename.startswith(_TRUSTED_DIRS):  # the code that asked for the Python value
        return
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    raise PooledDecisionError(
        f"{func.__name__} of a tensor holding several models' data in a BatchModule forward ({where}): Python "
        "control flow on it would decide once for all models, on their pooled data. Decide per model with "
        "tensor ops (torch.where, a mask), or wrap a decision meant for all models (an assertion, logging) "
        "in `with torchmb.allow_pooled_decisions():`"
    )
