"""Which tensors of a batched forward hold B models' data, and which are the shared input.

A :class:`ModelDataTracker` is a ``TorchFunctionMode`` that ``BatchModule`` enters for a forward: it marks
the forward's input tensors (*shared* with ``shared_input=True``, else *per-model*) and labels each op's
output from its tensor inputs: per-model if any input is (a parameter, a ``torch.func`` batched tensor,
or a per-model tensor), else shared if any input is shared, else nothing (a constant: a buffer stored
once, a tensor created in ``forward``). As a batched layer returns, its new outputs are labelled
per-model, unless the layer has no parameters and kept its shared inputs' layout (a layer norm without
affine; a layer that expands the shared input to B copies returns B times its rows).

It serves two purposes:

- **Shared input.** A batched layer asks whether its input is the shared ``(n, ...)`` tensor; a tensor
  derived from the shared input by parameter-free ops (a reshape, ``flatten``, an activation, ``x / 255``)
  is recognised whatever its size, where a rule on sizes would split ``(n * seq, d)`` between models
  when ``seq`` is a multiple of B.
- **Python decisions on several models' data.** ``bool()``, ``.item()``, ``.tolist()`` (an ``if`` or a
  ``while`` on a tensor) of a per-model tensor in the model's code would decide once for all B models on
  their pooled data. With ``check_decisions`` the tracker refuses it with :class:`PooledDecisionError`.
  The code of torch, of the batched layers and of ``offload`` is trusted (their checks look at the whole
  batch on purpose), and :func:`allow_pooled_decisions` lets a model author decide for all models.

In a shared-input forward, the model's own code combining a shared tensor with a per-model one gets the
shared one as B merged copies (``torchmb._shared_operands``); in a checked forward, its reductions over
dim 0 of per-model data are refused (``torchmb._dim0_reductions``).

Every op of a tracked forward runs through Python (about 3 us), so ``BatchModule`` tracks only
shared-input forwards and its first forward, and ``torchmb.testing`` every forward it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import os
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import batch_layers
import offload
from batch_layers import AbstractBatchModule, is_shared_parameter

from ._dim0_reductions import refuse_reduction_over_models
from ._generic import is_generic
from ._shared_operands import expand_shared_operands

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
    """A tracked tensor's label (a tensor without one is a constant, the same for every model)."""

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
        # id -> (weak reference, kind): a dead tensor's entry fails the identity check, so an id reused
        # by a new tensor inherits nothing (cheaper per op than torch.utils.weak's dictionaries).
        self._kinds: dict[int, tuple[weakref.ref, Kind]] = {}
        self._hooks: list[Any] = []
        self._shared_forward = False
        self._layer_depth = 0  # > 0 inside a batched layer or a generic module, whose code is trusted

    def mark(self, tensors: Iterable[Any], kind: Kind) -> None:
        """Label every tensor among ``tensors`` (other values are skipped)."""
        for tensor in tensors:
            if isinstance(tensor, Tensor):
                self._kinds[id(tensor)] = (weakref.ref(tensor), kind)
                self._shared_forward = self._shared_forward or kind is Kind.SHARED

    def kind(self, tensor: Tensor) -> Kind | None:
        """``tensor``'s label: per-model, shared, or ``None`` for a constant."""
        if type(tensor) is not Tensor and (
            (isinstance(tensor, nn.Parameter) and not is_shared_parameter(tensor))  # a shared one: a constant
            or torch._C._functorch.is_batchedtensor(tensor)
        ):
            return Kind.PER_MODEL
        entry = self._kinds.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def is_shared(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is the shared input or was computed from it (and constants) alone."""
        return self.kind(tensor) is Kind.SHARED

    def __enter__(self) -> ModelDataTracker:
        self._hooks = [
            register_module_forward_pre_hook(self._before_module),
            register_module_forward_hook(self._after_module),
        ]
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        for hook in self._hooks:
            hook.remove()

    def _before_module(self, module: nn.Module, args: Any) -> None:
        if isinstance(module, AbstractBatchModule) or is_generic(module):
            self._layer_depth += 1

    def _after_module(self, module: nn.Module, args: Any, output: Any) -> None:
        """Label a batched layer's new outputs per-model (whatever ops made them, seen by this mode or
        not), unless the layer has no parameters and computed them from shared inputs alone in their
        layout (a layer norm without affine), rather than expanded to B copies (``B`` times the rows)."""
        generic = is_generic(module)
        if not (generic or isinstance(module, AbstractBatchModule)):
            return
        self._layer_depth -= 1
        inputs = _tensors(args)
        kinds = [self.kind(value) for value in inputs]
        shared_only = not generic and bool(kinds) and all(kind is Kind.SHARED for kind in kinds)
        if shared_only and next(module.parameters(), None) is not None:
            shared_only = False
        expanded_rows = {module.batch * value.shape[0] for value in inputs if value.dim()} if shared_only else set()
        for tensor in _tensors(output):
            if any(tensor is value for value in inputs):
                continue  # passed through (dropout in eval mode): keeps its label
            shared = shared_only and tensor.dim() and tensor.shape[0] not in expanded_rows
            self._kinds[id(tensor)] = (weakref.ref(tensor), Kind.SHARED if shared else Kind.PER_MODEL)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.check_decisions and func in _DECISIONS and self._kind_of(args, kwargs) is Kind.PER_MODEL:
            _refuse_pooled_decision(func)
        if self.check_decisions and not self._layer_depth and args and self._labelled_per_model(args[0]):
            refuse_reduction_over_models(func, args, kwargs)
        if self._shared_forward and not self._layer_depth and self._mixes_shared_and_per_model(args, kwargs):
            args, kwargs = expand_shared_operands(func, args, kwargs, self.is_shared, self._labelled_per_model)
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            kind = self._kind_of(args, kwargs)
            if kind is not None:
                self._kinds[id(out)] = (weakref.ref(out), kind)
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            kind = self._kind_of(args, kwargs)
            if kind is not None:
                self.mark(out, kind)
        return out

    def _labelled_per_model(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is an activation labelled per-model (not a parameter or a ``vmap``-ed tensor)."""
        entry = self._kinds.get(id(tensor))
        return entry is not None and entry[0]() is tensor and entry[1] is Kind.PER_MODEL

    def _mixes_shared_and_per_model(self, args: tuple, kwargs: dict) -> bool:
        """Whether an op's operands hold both a shared tensor and a per-model activation."""
        shared = per_model = False
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, Tensor):
                    shared = shared or self.is_shared(tensor)
                    per_model = per_model or self._labelled_per_model(tensor)
        return shared and per_model

    def _kind_of(self, args: tuple, kwargs: dict) -> Kind | None:
        """An op's output label from its inputs': per-model over shared over constant."""
        kind = None
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, Tensor):
                    found = self.kind(tensor)
                    if found is Kind.PER_MODEL:
                        return found
                    kind = kind or found
        return kind


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in a module's arguments or output (a tensor, the common case, without a pytree walk)."""
    if isinstance(value, Tensor):
        return [value]
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, Tensor)]


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
