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

- **Code that must run per model.** In the forwards that check decisions, code of the model's own (not
  torch's, nor a batched layer's) that mixes the models on the merged axis is found as it runs: a read of a
  batched layer's stacked parameter or buffer (``self.fc.weight.norm()`` in the parent), concatenating or
  splitting per-model tensors along dim 0 (``torch.cat([image1, image2])``, ``x.chunk(2)``, ``x[:k]``), a
  random draw made once for all models and broadcast over their samples, a batched layer called on
  constants alone (T5's bucket table). The tracker raises :class:`PerModelCodeFound` naming the module
  whose forward is running; ``BatchModule`` makes that module run per model (a region of
  ``torchmb._generic``) and runs the forward again. A constant of one row (transformers' ``(1, seq)``
  position ids) handed to a batched layer is broadcast over the samples instead, as in the plain model.
  A decision on several models' data is allowed where every model's own value is the same and equals the
  pooled one (transformers' ``padding_mask.all()`` shortcut): each model's value is recomputed from the
  ops that reduced its rows (``torchmb._merged_ops``). A decision on a random draw made for all models
  (LayerDrop's ``torch.rand([]) < p``) is refused.
- **Attention calls.** Whether the model's own code (not a batched layer's) calls
  ``F.scaled_dot_product_attention``: ``BatchModule`` then traces its compiled forward under the mode that
  routes those calls through the attention table (``torchmb._attention_choice``).
- **Shared operands.** In a shared-input forward, the model's own code combining a shared tensor with a
  per-model one gets the shared one as B merged copies (``torchmb._shared_operands``); in a checked
  forward, its softmax or GLU over dim 0 of per-model data is refused (``torchmb._dim0_reductions``).

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
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import batch_layers
import offload
from batch_layers import AbstractBatchModule, current_forward, is_shared_parameter, stacked_reads_watched_elsewhere

from ._dim0_reductions import refuse_reduction_over_models
from ._generic import is_generic, looping_over_models, noting_merged_tensors
from ._merged_ops import PooledSize, Recipes, random_draw, sample_axis_op, shared_metadata
from ._shared_operands import expand_shared_operands, index_merged_rows

__all__ = [
    "Kind",
    "ModelDataTracker",
    "PerModelCodeFound",
    "PooledDecisionError",
    "allow_pooled_decisions",
    "check_every_forward",
    "checking_decisions",
]


class PooledDecisionError(RuntimeError):
    """Python control flow in a batched forward decided on a tensor holding several models' data."""


class PerModelCodeFound(RuntimeError):
    """The code of ``module`` (no batched layer, not run per model) mixed the models on the merged axis at
    the first forward; ``BatchModule`` runs it per model from then on."""

    def __init__(self, module: nn.Module, reason: str) -> None:
        super().__init__(f"{type(module).__name__}: {reason}")
        self.module = module
        self.reason = reason


class Kind(enum.Enum):
    """A tracked tensor's label (a tensor without one is a constant, the same for every model)."""

    SHARED = "shared"
    PER_MODEL = "per-model"
    RANDOM = "random"  # drawn from constants alone by the model's code: one draw for all models


_SCALAR_DECISIONS = frozenset(
    {Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__complex__, Tensor.__index__, Tensor.item}
)
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
_BATCH_LAYERS_DIR = os.path.dirname(batch_layers.__file__) + os.sep
# torch's Python wrappers through which an op of the model's code reaches the tracker (F.layer_norm)
_WRAPPERS = tuple(
    os.path.join(os.path.dirname(torch.__file__), *path)
    for path in (("nn", "functional.py"), ("functional.py",), ("_tensor.py",), ("overrides.py",), ("_jit_internal.py",))
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
        check_decisions: raise :class:`PooledDecisionError` on a Python decision on per-model data, and
            :class:`PerModelCodeFound` on code that mixes the models on the merged axis.
        stacked: the batched model's per-model parameters and buffers, by ``id``, with their names.
    """

    def __init__(self, *, check_decisions: bool, stacked: dict[int, tuple[Tensor, str]] | None = None) -> None:
        super().__init__()
        self.check_decisions = check_decisions
        # id -> (weak reference, kind): a dead tensor's entry fails the identity check, so an id reused
        # by a new tensor inherits nothing (cheaper per op than torch.utils.weak's dictionaries).
        self._kinds: dict[int, tuple[weakref.ref, Kind]] = {}
        self._hooks: list[Any] = []
        self._shared_forward = False
        self._layer_depth = 0  # > 0 inside a batched layer or a generic module, whose code is trusted
        self._stacked = stacked or {}
        self._running: list[nn.Module] = []  # the modules whose forward is in progress, innermost last
        self._recipes: Recipes | None = None
        self.calls_attention = False  # code other than a batched layer's called F.scaled_dot_product_attention

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
            or getattr(tensor, "holds_models", False)  # an own parameter broadcast per model (torchmb._own_operands)
        ):
            return Kind.PER_MODEL
        entry = self._kinds.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        stacked = self._stacked.get(id(tensor))
        return Kind.PER_MODEL if stacked is not None and stacked[0] is tensor else None

    def is_shared(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is the shared input or was computed from it (and constants) alone."""
        return self.kind(tensor) is Kind.SHARED

    def _is_per_model(self, tensor: Tensor) -> bool:
        return self.kind(tensor) is Kind.PER_MODEL

    def _is_constant(self, tensor: Tensor) -> bool:
        return self.kind(tensor) is None

    def __enter__(self) -> ModelDataTracker:
        context = current_forward()
        if self.check_decisions and context is not None and context.samples:  # n = 0: no rows to decide on
            self._recipes = Recipes(context.batch, context.batch * context.samples, context.order)
        self._hooks = [
            register_module_forward_pre_hook(self._before_module),
            register_module_forward_hook(self._after_module),
        ]
        self._reads = stacked_reads_watched_elsewhere() if self.check_decisions else contextlib.nullcontext()
        self._reads.__enter__()  # a read of a stacked tensor is this tracker's to find (_check_mixing)
        self._merged = noting_merged_tensors(lambda tensor: self.mark((tensor,), Kind.PER_MODEL))
        self._merged.__enter__()  # a region's data handed on the merged axis to a callee that escapes
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        self._merged.__exit__(*exc_info)
        self._reads.__exit__(*exc_info)
        for hook in self._hooks:
            hook.remove()

    def _before_module(self, module: nn.Module, args: tuple) -> tuple | None:
        """Count the batched layers and generic modules being run (their code is trusted); in a checked
        forward, note the module as running: a batched layer called by the model's code on constants alone
        gets a one-row constant broadcast over the samples, and any other makes its caller run per model, as
        does a call of a module holding per-model state on sizes alone (its result has no sample axis)."""
        if isinstance(module, AbstractBatchModule) or is_generic(module):
            self._layer_depth += 1
            if self._shared_forward and not is_generic(module) and not _in_region():  # (vmap has no rule for equal)
                self._share_constant_rows(args)
        if not self.check_decisions:
            return None
        caller = self._running[-1] if self._running else None
        self._running.append(module)
        if caller is None or _runs_its_own_way(caller) or _in_region():
            return None
        tensors = _tensors(args)
        if not _runs_its_own_way(module):
            if args and not tensors and _holds_per_model_state(module):  # XCiT's self.pos_embed(B, Hp, Wp)
                raise PerModelCodeFound(caller, f"calls {type(module).__name__} on sizes alone {args}")
            return None
        if not tensors or any(self.kind(t) is not None for t in tensors):
            return None
        if all(t.dim() and t.shape[0] == 1 for t in tensors):
            broadcast_one_row_constants(module)
            return broadcast_rows(module, args)
        if all(_rows_alike(t) for t in tensors):
            return None  # a constant row already broadcast over the samples (BERT's token type ids)
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise PerModelCodeFound(caller, f"calls {type(module).__name__} on constants alone (shapes {shapes})")

    def _share_constant_rows(self, args: tuple) -> None:
        """In a shared-input forward, constants of one row repeated over the n samples (BERT's token type ids,
        its buffer expanded to the shared input's batch) handed to a batched layer are shared like the input:
        every model sees them, as every plain model does."""
        context = current_forward()
        tensors = _tensors(args)
        if context is not None and tensors and all(
            self.kind(t) is None and t.dim() and t.shape[0] == context.samples and _rows_alike(t) for t in tensors
        ):
            self.mark(tensors, Kind.SHARED)

    def _after_module(self, module: nn.Module, args: Any, output: Any) -> None:
        """Label a batched layer's new outputs per-model (whatever ops made them, seen by this mode or
        not), unless the layer has no parameters and computed them from shared inputs alone in their
        layout (a layer norm without affine), rather than expanded to B copies (``B`` times the rows)."""
        if self._running and self._running[-1] is module:
            self._running.pop()
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
        if func is F.scaled_dot_product_attention and not self.calls_attention:
            frame = _caller()
            self.calls_attention = frame is not None and not frame.f_code.co_filename.startswith(_BATCH_LAYERS_DIR)
        if self.check_decisions:
            self._check_mixing(func, args, kwargs)
            if func in _DECISIONS:
                decided = self._decision(func, args, kwargs)
                if decided is not _UNDECIDED:
                    return decided
            if not self._layer_depth and args and self._labelled_per_model(args[0]):
                refuse_reduction_over_models(func, args, kwargs)
        if self._shared_forward and not self._layer_depth and func is Tensor.__getitem__:
            args = index_merged_rows(args, self.is_shared)
        if self._shared_forward and not self._layer_depth and self._mixes_shared_and_per_model(args, kwargs):
            args, kwargs = expand_shared_operands(func, args, kwargs, self.is_shared, self._labelled_per_model)
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            kind = self._kind_of(args, kwargs)
            if kind is None and self.check_decisions and random_draw(func) and not _trusted(_caller()):
                kind = Kind.RANDOM
            if kind is not None:
                self._kinds[id(out)] = (weakref.ref(out), kind)
                # (a batched layer's own ops need no recipe: its code is trusted and its outputs are merged. Their
                # recipes held the layer's grouped copies until the forward ended: models-major, 1.5x its memory)
                if kind is Kind.PER_MODEL and self._recipes is not None and not self._layer_depth:
                    self._recipes.record(out, func, args, kwargs, self._is_per_model)
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            kind = self._kind_of(args, kwargs)
            if kind is not None:
                self.mark(out, kind)
        elif func is Tensor.numel and self._recipes is not None and self._kind_of(args, kwargs) is Kind.PER_MODEL:
            return PooledSize(out, self._recipes.batch)
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
        """An op's output label from its inputs': per-model over shared over random over constant."""
        kind = None
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, Tensor):
                    found = self.kind(tensor)
                    if found is Kind.PER_MODEL:
                        return found
                    if found is not None and (kind is None or kind is Kind.RANDOM):
                        kind = found
        return kind

    def _check_mixing(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Raise :class:`PerModelCodeFound` where the model's own code mixes the models on the merged axis."""
        module = self._running[-1] if self._running else None
        context = current_forward()
        if module is None or context is None or not context.samples or _runs_its_own_way(module) or _in_region():
            return  # (n = 0: no model has a row to mix)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        read = next((self._stacked[id(t)][1] for t in tensors if self._stacked.get(id(t), (None,))[0] is t), None)
        kinds = {self.kind(t) for t in tensors}
        mixing = ""
        if read is not None and not shared_metadata(func):
            mixing = f"reads {read}, all models' stacked tensor"
        elif Kind.PER_MODEL in kinds:
            mixing = sample_axis_op(func, args, kwargs, self._is_per_model, self._is_constant, context)
            if mixing:
                mixing += " of per-model tensors"
        if Kind.RANDOM in kinds and not mixing and len(kinds - {None}) > 1:
            mixing = _random_broadcast(tensors, [self.kind(t) for t in tensors])
        if mixing:
            frame = _caller()
            if not _trusted(frame):
                raise PerModelCodeFound(module, f"{_where(frame)} {mixing}")

    def _decision(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The value of a Python decision that every model takes alike, or ``_UNDECIDED`` to run it."""
        if _in_region():
            return _UNDECIDED  # each model's own decision (vmap refuses one it cannot take per model)
        kind = self._kind_of(args, kwargs)
        if kind is Kind.RANDOM and not _POOLED_ALLOWED.get() and not _trusted(_caller()):
            raise PooledDecisionError(
                f"{func.__name__} of a random draw made once for all models in a BatchModule forward "
                f"({_where(_caller())}): as a Python decision (LayerDrop's `torch.rand([]) < p`, stochastic depth "
                "of the whole batch) it would drop or keep the same layers in every model, where each model "
                "draws its own. Draw per sample with tensor ops (a mask of shape (n, 1, ...)), or wrap a decision "
                "meant for all models in `with torchmb.allow_pooled_decisions():`"
            )
        if kind is not Kind.PER_MODEL:
            return _UNDECIDED
        if func in _SCALAR_DECISIONS and self._recipes is not None:
            values = self._recipes.per_model_values(args[0], self._is_per_model)
            if values is not None:
                pooled = func(*args, **kwargs)
                if all(func(value, *args[1:], **kwargs) == pooled for value in values):
                    return pooled  # every model decides as the pooled data does
        _refuse_pooled_decision(func)
        return _UNDECIDED


_UNDECIDED = object()


def _runs_its_own_way(module: nn.Module) -> bool:
    """Whether ``module``'s code handles the merged axis itself: a batched layer's, or a generic module's
    (which runs under ``vmap``)."""
    return isinstance(module, AbstractBatchModule) or is_generic(module)


def _holds_per_model_state(module: nn.Module) -> bool:
    """Whether ``module`` or a module below it holds per-model parameters or is a batched layer."""
    modules_own_way = any(_runs_its_own_way(m) for m in module.modules())
    return modules_own_way or any(not is_shared_parameter(p) for p in module.parameters())


def _rows_alike(tensor: Tensor) -> bool:
    """Whether every row of ``tensor`` is its first (one row expanded, or repeated, over the samples)."""
    if tensor.dim() == 0:
        return False
    return tensor.stride(0) == 0 or torch.equal(tensor, tensor[:1].expand_as(tensor))


def _in_region() -> bool:
    """Whether the code running is each model's own: a region's, under ``vmap``, or a subtree's run once per
    model (``torchmb._generic``)."""
    return torch._C._functorch.peek_interpreter_stack() is not None or looping_over_models()


def _random_broadcast(tensors: list[Tensor], kinds: list[Kind | None]) -> str:
    """What mixes where a random tensor drawn once meets the models' data without a row for each sample."""
    data = [t for t, kind in zip(tensors, kinds) if kind in (Kind.PER_MODEL, Kind.SHARED)]
    for tensor, kind in zip(tensors, kinds):
        if kind is Kind.RANDOM and any(
            tensor.dim() < other.dim() or (tensor.dim() and other.dim() and tensor.shape[0] != other.shape[0])
            for other in data
        ):
            return f"broadcasts one random draw of shape {tuple(tensor.shape)} over every model's samples"
    return ""


def broadcast_one_row_constants(module: nn.Module) -> None:
    """From now on, hand ``module`` each one-row constant broadcast over the ``B * n`` merged rows."""
    if not getattr(module, "_torchmb_broadcasts_rows", False):
        module.register_forward_pre_hook(broadcast_rows)
        module._torchmb_broadcasts_rows = True


def broadcast_rows(module: nn.Module, args: tuple) -> tuple | None:
    """``args`` with every one-row tensor expanded to the forward's ``B * n`` merged rows (a view)."""
    context = current_forward()
    rows = context.batch * context.samples if context is not None else 1
    if rows == 1 or not any(isinstance(a, Tensor) and a.dim() and a.shape[0] == 1 for a in args):
        return None
    return tuple(
        a.expand(rows, *a.shape[1:]) if isinstance(a, Tensor) and a.dim() and a.shape[0] == 1 else a for a in args
    )


def _caller() -> Any:
    """The frame of the code whose op the tracker sees (past this file and torch's Python wrappers)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__ or frame.f_code.co_filename in _WRAPPERS):
        frame = frame.f_back
    return frame


def _trusted(frame: Any) -> bool:
    return frame is None or frame.f_code.co_filename.startswith(_TRUSTED_DIRS)


def _where(frame: Any) -> str:
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    return f"{name} ({frame.f_code.co_filename}:{frame.f_lineno})"


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
