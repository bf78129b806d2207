"""The ``torch.func`` path: a module's own state becomes B models, without a batched layer.

A generic module keeps its identity and its state-dict keys. Its per-model state (every parameter and
persistent buffer, of the module itself or, for a subtree batched whole, of every module below it) is
replaced in place by ``(B, *shape)`` stacks, and its class is swapped for a subclass whose ``forward``
runs the original ``forward`` under ``vmap`` over the models (``randomness="different"``), the way
``torch.nn.utils.parametrize`` swaps classes. Non-persistent buffers are not part of a model's state
(``state_dict`` leaves them out): they stay one tensor, shared by all models as constants.

While a generic module's own code runs under ``vmap`` (its *region*), every module it calls, whether a
registered batched layer, a container of them or another generic module, *escapes*: its tensor arguments
are taken out of the ``vmap`` onto the merged ``(B*n, ...)`` axis, the call runs outside the ``vmap``
exactly as it would anywhere else in the model, and its outputs are handed back to the region as
per-model tensors. So a root that owns a ``cls_token`` keeps every registered layer below it on its fast
path, and a parameter of a child read directly by the region's code (``self.qkv.weight``) is that
model's slice. Inside a region, tensors created from nothing (``torch.empty``, ``x.new_zeros``) are made
per model, so in-place randomness on them (``torch.empty(s).bernoulli_(p)``) draws for each model, as do
random tensors drawn from sizes alone (``torch.rand([])``), and
``out=`` arguments (which ``vmap`` cannot batch) are written by ``copy_``.

A subtree batched whole whose code ``vmap`` cannot run (an op with a data-dependent shape such as
``nonzero``, a Python decision on each model's data: mixture-of-experts routing) runs once per model
instead, from its first such forward on, on each model's slices.

A generic module's methods other than ``forward`` run per model only when called from a region (the
conversion walk makes a module whose code calls them one, ``torchmb._calls``); called on the merged axis
of a batched forward, they would read the stacked state as one model's, so they raise instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch._C._functorch as functorch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch.func import vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from batch_layers import (
    AbstractBatchModule,
    ForwardContext,
    check_merged_rows,
    check_stacked_read,
    current_forward,
    forward_context,
    is_shared_input,
    is_shared_parameter,
)

from ._calls import _MODULE_API  # nn.Module's own names, which torch's machinery calls: never guarded

__all__ = ["batch_generically", "escape_from_regions", "is_generic", "looping_over_models", "noting_merged_tensors"]

_GENERIC_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
_MODULE_BASES = frozenset(nn.Module.__mro__)


def is_generic(module: nn.Module) -> bool:
    """Whether ``module`` was batched through ``torch.func`` rather than a registered batched layer."""
    return type(module) in _GENERIC_CLASSES.values()


def is_per_model(module: nn.Module, name: str, tensor: Tensor, batch: int) -> bool:
    """Whether ``module``'s parameter or buffer ``name`` holds one slice per model in its dim 0."""
    if is_shared_parameter(tensor):
        return False
    if name in module._buffers:
        shared = module.shared_buffers if isinstance(module, AbstractBatchModule) else ()
        if name in shared or name in module._non_persistent_buffers_set:
            return False
    return tensor.dim() > 0 and tensor.shape[0] == batch


def _stack(tensor: Tensor, batch: int) -> Tensor:
    return tensor.detach().unsqueeze(0).expand(batch, *tensor.shape).clone()


def batch_generically(module: nn.Module, batch: int, *, whole: bool, stacked: bool = False) -> nn.Module:
    """Turn ``module`` (in place) into ``batch`` models run through ``torch.func.vmap``; returns it.

    Args:
        module: the module to batch.
        batch: number of models B.
        whole: stack the state of every module below ``module`` too (a subtree with no registered
            layer); otherwise only ``module``'s own state, its children being batched on their own.
        stacked: the state is stacked already (a module whose parameters were broadcast per model until its
            first forward found a use that is not element-wise).
    """
    done: dict[int, Tensor] = {}
    for owner in () if stacked else module.modules() if whole else (module,):
        for name, param in owner._parameters.items():
            if param is not None and not is_shared_parameter(param):  # a shared one is read unbatched
                if id(param) not in done:
                    done[id(param)] = nn.Parameter(_stack(param, batch), requires_grad=param.requires_grad)
                owner._parameters[name] = done[id(param)]
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                owner._buffers[name] = _stack(buffer, batch)
    module.__class__ = _generic_class(type(module))
    module._torchmb_batch = batch
    module._torchmb_whole = whole
    return module


def _generic_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _GENERIC_CLASSES:
        namespace = {name: _make_guarded(cls, name, method) for name, method in _other_methods(cls).items()}
        namespace.update(forward=_make_forward(cls.forward), extra_repr=_make_extra_repr(cls.extra_repr),
                         __getattr__=_make_guarded_getattr(cls.__getattr__))
        _GENERIC_CLASSES[cls] = type(f"FuncBatched{cls.__name__}", (cls,), namespace)
    return _GENERIC_CLASSES[cls]


def _make_guarded_getattr(getattr_: Callable[[nn.Module, str], Any]) -> Callable[[nn.Module, str], Any]:
    """``getattr_`` (``nn.Module``'s, which every parameter read goes through), refusing a read of the module's
    stacked ``(B, ...)`` parameter by code other than its own during a batched forward (a parent's helper
    reaching it after the first forward): ``batch_layers.check_stacked_read``, as for registered layers."""

    def guarded_getattr(self: nn.Module, name: str) -> Any:
        value = getattr_(self, name)
        if (
            isinstance(value, nn.Parameter)
            and not torch.compiler.is_compiling()
            and current_forward() is not None
            and not is_shared_parameter(value)
        ):
            check_stacked_read(self, name, value, sys._getframe(1))
        return value

    return guarded_getattr


def _other_methods(cls: type[nn.Module]) -> dict[str, Callable[..., Any]]:
    """The methods ``cls`` and its bases below ``nn.Module`` define, other than ``forward`` and dunders."""
    methods = {}
    for owner in reversed(cls.__mro__):  # a subclass's definition replaces its base's
        if owner in _MODULE_BASES:
            continue
        for name, value in vars(owner).items():
            if inspect.isfunction(value) and name != "forward" and name not in _MODULE_API:
                if not (name.startswith("__") and name.endswith("__")):
                    methods[name] = value
    return methods


def _make_guarded(cls: type[nn.Module], name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, refusing to run on the merged axis of a batched forward: its code would read the stacked
    ``(B, ...)`` state as one model's (outside a forward, the user's own calls, it runs as it is)."""

    @functools.wraps(method)
    def guarded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _outside_regions() and current_forward() is not None:
            caller = sys._getframe(1)
            where = f"{getattr(caller.f_code, 'co_qualname', caller.f_code.co_name)} ({caller.f_code.co_filename}:"
            raise RuntimeError(
                f"{cls.__qualname__}.{name}() was called by {where}{caller.f_lineno}) on the merged model axis: "
                f"{cls.__qualname__} is batched through torch.func, its state stacked for all {self._torchmb_batch} "
                "models, so only its forward, or code that runs per model, may call its other methods. torchmb "
                "runs a module's code per model where it finds self.<child>.<method>(...) in it; call the method "
                "that way, from the module that uses its result"
            )
        return method(self, *args, **kwargs)

    return guarded


def _make_extra_repr(original_extra_repr: Callable[[nn.Module], str]) -> Callable[[nn.Module], str]:
    def extra_repr(self: nn.Module) -> str:
        scope = "whole subtree" if self._torchmb_whole else "own state"
        if getattr(self, "_torchmb_looped", False):
            scope += ", one model after the other: vmap cannot run its code"
        own = original_extra_repr(self)
        return ", ".join(p for p in (own, f"batch={self._torchmb_batch}, batched via torch.func ({scope})") if p)

    return extra_repr


def _make_forward(original_forward: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(_vmapped_call, self, original_forward)
        if torch.compiler.is_dynamo_compiling():  # one graph break: the region runs eagerly (torchmb._eager_regions)
            from ._eager_regions import run_eagerly

            return run_eagerly(_on_merged_axis, self, call, args, kwargs)
        return _on_merged_axis(self, call, args, kwargs)

    return forward


# -- regions: a generic module's own code, running under vmap --------------------------------------------


@dataclass
class _Region:
    """The generic module whose own code is running under ``vmap`` at ``level``.

    ``real`` maps each of its subtree's tensors, by owner and name, to the stacked tensor it stands for;
    the region's code sees per-model slices in their place, and an escaping call gets the real ones back.
    """

    level: int
    batch: int
    mode: TorchFunctionMode
    real: dict[tuple[int, str], Tensor]


_REGION: contextvars.ContextVar[_Region | None] = contextvars.ContextVar("torchmb_region", default=None)


def _outside_regions() -> bool:
    """Whether no region's code is running. Code that dynamo traces never is one: regions run eagerly in a
    compiled model (and dynamo cannot trace ``ContextVar.get``)."""
    return torch.compiler.is_dynamo_compiling() or _REGION.get() is None


def escape_from_regions(module: nn.Module) -> None:
    """Make ``module`` run on the merged model axis whenever a generic module's own code calls it."""
    if is_generic(module) or "_torchmb_escapes" in module.__dict__:
        return  # a generic module escapes in its own forward
    inner = module.__dict__.get("forward")  # an instance-level forward someone installed before us
    module.forward = functools.partial(_escaping_forward, module, inner)
    module._torchmb_escapes = True


def _escaping_forward(module: nn.Module, inner: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    call = inner if inner is not None else functools.partial(type(module).forward, module)
    return _on_merged_axis(module, call, args, kwargs)


def _on_merged_axis(module: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    if _outside_regions():
        return call(*args, **kwargs)
    region = _REGION.get()
    interpreter = retrieve_current_functorch_interpreter()
    if interpreter is None or interpreter.level() != region.level:
        raise RuntimeError(
            f"{type(module).__name__} was called inside a torch.func transform within a generic module's "
            "forward; torchmb cannot take its inputs out onto the merged model axis there"
        )
    if _runs_in_region(module, region, args, kwargs):
        return call(*args, **kwargs)
    merged_args, merged_kwargs, context = _merged_call(region, args, kwargs)
    slices = _swap(module, region.real)  # the callee's own subtree computes with the stacked tensors
    token = _REGION.set(None)
    try:
        with interpreter.lower(), _pop_mode_temporarily(), forward_context(context):
            out = call(*merged_args, **merged_kwargs)
    finally:
        _REGION.reset(token)
        for key, real in _swap(module, slices).items():
            region.real[key] = real  # an escaped generic module may have reassigned a buffer
    return tree_map(functools.partial(_to_region, region, type(module).__name__), out)


def _runs_in_region(module: nn.Module, region: _Region, args: tuple, kwargs: dict) -> bool:
    """Whether a callee runs in the region, under its ``vmap``, rather than escaping: a module without
    state of its own (a container, a parameter-free module) called with no per-model tensor. What it
    computes from constants then becomes per model as the region's own code does (XCiT's Fourier encoder
    builds a coordinate grid, runs its Conv on it and repeats the result for every sample: on the merged
    axis, the repeat would interleave the models). Its layers, called on those constants, escape and
    compute one result per model from copies of them."""
    if isinstance(module, AbstractBatchModule) or is_generic(module):
        return False
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    if any(functorch.maybe_get_level(t) == region.level for t in tensors):
        return False
    outer = current_forward()
    return not (outer is not None and outer.shared and any(_rows(t) == outer.samples for t in tensors))


def _swap(root: nn.Module, values: dict[tuple[int, str], Tensor]) -> dict[tuple[int, str], Tensor]:
    """Put ``values`` into the modules below ``root``; returns what they held."""
    previous = {}
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for name in table:
                key = (id(module), name)
                if key in values:
                    previous[key] = table[name]
                    table[name] = values[key]
    return previous


def _merged_call(region: _Region, args: tuple, kwargs: dict) -> tuple[tuple, dict, ForwardContext | None]:
    """A region's call arguments on the merged axis, and the forward context the callee runs in.

    Per-model tensors are merged models-major, ``m`` rows per model, and the callee's layers are told
    ``n = m`` (a bias table handed to a small MLP has ``m = 1``). A call with only constants (a
    coordinate table) computes one result per model: its tensors are copied for every model, unless one
    is the shared input of a shared-input forward, which the layers recognise as it is.
    """
    outer = current_forward()
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    per_model = [t for t in tensors if functorch.maybe_get_level(t) == region.level]
    if per_model:
        merge = functools.partial(_to_merged, region)
        rows = per_model[0].shape[0] if per_model[0].dim() else 1
    elif not tensors or (outer is not None and outer.shared and any(_rows(t) == outer.samples for t in tensors)):
        return args, kwargs, outer
    else:
        merge = functools.partial(_copied_for_every_model, region.batch)
        rows = _rows(tensors[0])
    merged_args, merged_kwargs = tree_map(merge, (args, kwargs))
    return merged_args, merged_kwargs, ForwardContext(region.batch, rows, False, "models")


def _rows(tensor: Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _copied_for_every_model(batch: int, value: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    return value.expand(batch, *value.shape).reshape(-1, *value.shape[1:]) if value.dim() else value.expand(batch)


_NOTE_MERGED: contextvars.ContextVar[Callable[[Tensor], None] | None] = contextvars.ContextVar(
    "torchmb_note_merged", default=None
)


@contextlib.contextmanager
def noting_merged_tensors(note: Callable[[Tensor], None]) -> Iterator[None]:
    """Inside the block ``note`` receives every region tensor taken out onto the merged axis for a callee that
    escapes: the models' data, though no op a forward's tracker sees makes it (``torchmb._tracking``)."""
    token = _NOTE_MERGED.set(note)
    try:
        yield
    finally:
        _NOTE_MERGED.reset(token)


def _to_merged(region: _Region, value: Any) -> Any:
    if not isinstance(value, Tensor) or functorch.maybe_get_level(value) != region.level:
        return value  # the same for every model (a constant or the shared input): passed as it is
    physical = functorch._remove_batch_dim(value, region.level, region.batch, 0)
    merged = physical.reshape(-1, *physical.shape[2:]) if physical.dim() > 1 else physical
    note = _NOTE_MERGED.get()
    if note is not None:
        note(merged)
    return merged


def _to_region(region: _Region, owner: str, value: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    if value.dim() == 0 or value.shape[0] % region.batch:
        raise ValueError(
            f"{owner} returned a tensor of shape {tuple(value.shape)} to a generic module's forward; its dim 0 "
            f"must be a multiple of batch={region.batch} (the merged model axis)"
        )
    return functorch._add_batch_dim(value.view(region.batch, -1, *value.shape[1:]), 0, region.level)


class _PerModelTensors(TorchFunctionMode):
    """Inside a region: tensors made from nothing get a model axis; ``out=`` is written by ``copy_``."""

    FRESH = frozenset(
        {
            torch.empty, torch.zeros, torch.ones, torch.full,
            Tensor.new_empty, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full,
        }
    )  # fmt: skip (``zeros_like(x)`` has x's model axis, or none: T5's bucket arithmetic on constants)
    DRAWN = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal})

    def __init__(self, level: int, batch: int) -> None:
        super().__init__()
        self.level, self.batch = level, batch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "cpu":
            # Under vmap torch would call its CPU flash kernel, which has no batching rule (a loop over the
            # models, with a performance warning) and refuses a mask needing a gradient (BEiT's learned
            # relative position bias); its math path batches.
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        out = kwargs.get("out")
        if isinstance(out, Tensor) and functorch.maybe_get_level(out) == self.level:
            result = func(*args, **{k: v for k, v in kwargs.items() if k != "out"})
            return out.copy_(result)
        result = func(*args, **kwargs)
        if func in self.DRAWN and isinstance(result, Tensor) and functorch.maybe_get_level(result) != self.level:
            # A draw from sizes alone (LayerDrop's torch.rand([])): each model draws its own.
            physical = torch.stack([result, *(func(*args, **kwargs) for _ in range(self.batch - 1))])
            return functorch._add_batch_dim(physical, 0, self.level)
        if func in self.FRESH and isinstance(result, Tensor) and functorch.maybe_get_level(result) != self.level:
            physical = result.unsqueeze(0).expand(self.batch, *result.shape).contiguous()
            return functorch._add_batch_dim(physical, 0, self.level)
        return result


# -- the vmapped call --------------------------------------------------------------------------------------


def _region_state(module: nn.Module) -> list[tuple[tuple[int, str], Tensor, bool]]:
    """Every tensor of ``module``'s subtree, once per owner and name, and whether it is mapped."""
    batch = module._torchmb_batch
    found = []
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    found.append(((id(owner), name), tensor, is_per_model(owner, name, tensor, batch)))
    return found


def _per_model_arguments(module: nn.Module, leaves: list) -> tuple[list[int], list[Tensor]]:
    """Which argument leaves hold the models' data on the merged axis, and those as ``(B, m, ...)``.

    The first tensor is the data (or the shared input); a later tensor with the same rows in dim 0 is
    per model too, one with other rows a constant such as a mask or rotary tables, passed as it is.
    """
    batch = module._torchmb_batch
    positions, per_model = [], []
    merged_rows = None
    for position, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor) or is_shared_input(leaf, batch):
            continue  # constants, and the shared input that every model reads as it is
        if merged_rows is None:
            check_merged_rows(leaf, batch, f"{type(module).__name__} (batched via torch.func)", "tensor argument")
            merged_rows = leaf.shape[0]
        elif leaf.dim() == 0 or leaf.shape[0] != merged_rows:
            continue
        positions.append(position)
        per_model.append(leaf.view(batch, -1, *leaf.shape[1:]))
    return positions, per_model


def _vmapped_call(module: nn.Module, original_forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    batch = module._torchmb_batch
    leaves, spec = tree_flatten((args, kwargs))
    positions, mapped_inputs = _per_model_arguments(module, leaves)
    state = _region_state(module)
    real = {key: tensor for key, tensor, _ in state}
    mapped_keys = [key for key, _, mapped in state if mapped]
    unmapped = {key: tensor for key, tensor, mapped in state if not mapped}
    output_spec: list = []
    reassigned_shared: dict[tuple[int, str], Tensor] = {}

    def one_model(mapped_state: list[Tensor], *inputs: Tensor) -> tuple[list[Tensor], dict]:
        level = functorch.current_level()
        slices = {**unmapped, **dict(zip(mapped_keys, mapped_state))}
        call_leaves = list(leaves)
        for position, tensor in zip(positions, inputs):
            call_leaves[position] = tensor
        call_args, call_kwargs = tree_unflatten(call_leaves, spec)
        region = _Region(level, batch, _PerModelTensors(level, batch), dict(real))
        _swap(module, slices)
        token = _REGION.set(region)
        try:
            with region.mode:
                out = original_forward(module, *call_args, **call_kwargs)
            reassigned = _reassigned_buffers(module, slices)
        finally:
            _REGION.reset(token)
            _swap(module, region.real)
        for key, value in list(reassigned.items()):
            if key in unmapped:
                if functorch.maybe_get_level(value) == level:
                    raise RuntimeError(
                        f"{type(module).__name__} assigned a per-model value to a buffer that is shared by all "
                        "models (a non-persistent buffer); register it as a persistent buffer"
                    )
                reassigned_shared[key] = reassigned.pop(key)
        out_leaves, out_spec = tree_flatten(out)
        output_spec.append((out_spec, [_TENSOR if isinstance(t, Tensor) else t for t in out_leaves]))
        return [t for t in out_leaves if isinstance(t, Tensor)], reassigned

    rows = mapped_inputs[0].shape[1] if mapped_inputs and mapped_inputs[0].dim() > 1 else 1
    if getattr(module, "_torchmb_outermost", False):
        rows = 1  # the model's own output: BatchModule returns it as it is, (B, 1, ...)
    if module._torchmb_whole and getattr(module, "_torchmb_looped", False):
        return _looped_call(module, original_forward, leaves, spec, dict(zip(positions, mapped_inputs)), rows)
    mapped_state = [real[key] for key in mapped_keys]
    try:
        outputs, reassigned = vmap(one_model, randomness="different")(mapped_state, *mapped_inputs)
    except RuntimeError as error:
        if not _data_dependent(error):
            raise
        if not module._torchmb_whole:
            raise RuntimeError(
                f"{type(module).__name__} runs per model under torch.func.vmap (its batched layers below it on the "
                f"merged axis), and vmap cannot run its code, whose shapes depend on each model's data: {error}. "
                "Keep the shapes fixed (torch.where with the mask instead of indexing by it), or move that code into "
                "a module of its own without batched layers below it, which then runs one model after the other"
            ) from error
        module._torchmb_looped = True  # from now on, one model after the other
        return _looped_call(module, original_forward, leaves, spec, dict(zip(positions, mapped_inputs)), rows)
    _swap(module, {**reassigned_shared, **reassigned})
    out_spec, out_leaves = output_spec[0]
    tensors = iter(_broadcast_one_row(t, rows).reshape(-1, *t.shape[2:]) for t in outputs)
    return tree_unflatten([next(tensors) if leaf is _TENSOR else leaf for leaf in out_leaves], out_spec)


def _data_dependent(error: RuntimeError) -> bool:
    """Whether ``vmap`` refused an op whose result's shape or a Python decision depends on each model's data
    (``nonzero``, ``if x.any():``, ``.item()``)."""
    message = str(error)
    return "vmap" in message and any(
        clue in message for clue in ("data-dependent", "dynamic shape", ".item()", "Tensor.item()")
    )


def _looped_call(
    module: nn.Module,
    original_forward: Callable[..., Any],
    leaves: list,
    spec: Any,
    inputs: dict[int, Tensor],
    rows: int,
) -> Any:
    """A subtree batched whole whose code ``vmap`` cannot run (mixture-of-experts routing through
    ``nonzero``): its forward runs once per model, on that model's slices of the stacked state and of the
    per-model arguments, and the outputs are stacked."""
    batch = module._torchmb_batch
    state = _region_state(module)
    real = {key: tensor for key, tensor, _ in state}
    mapped = [key for key, _, per_model in state if per_model]
    outputs, reassigned = [], []
    token = _LOOPING.set(True)
    try:
        for model in range(batch):
            slices = {key: real[key][model] for key in mapped}
            call_leaves = [inputs[i][model] if i in inputs else leaf for i, leaf in enumerate(leaves)]
            call_args, call_kwargs = tree_unflatten(call_leaves, spec)
            _swap(module, slices)
            try:
                outputs.append(tree_flatten(original_forward(module, *call_args, **call_kwargs)))
                reassigned.append(_reassigned_buffers(module, slices))
            finally:
                _swap(module, real)
    finally:
        _LOOPING.reset(token)
    _swap(module, {key: torch.stack([each[key] for each in reassigned]) for key in reassigned[0]})
    out_leaves, out_spec = outputs[0]
    merged = []
    for i, leaf in enumerate(out_leaves):
        if isinstance(leaf, Tensor):
            stacked = _broadcast_one_row(torch.stack([leaves_of[0][i] for leaves_of in outputs]), rows)
            leaf = stacked.reshape(-1, *stacked.shape[2:])
        merged.append(leaf)
    return tree_unflatten(merged, out_spec)


_LOOPING: contextvars.ContextVar[bool] = contextvars.ContextVar("torchmb_looping", default=False)


def looping_over_models() -> bool:
    """Whether the code running is one model's, in a subtree run once per model (see ``_looped_call``)."""
    return _LOOPING.get()


_TENSOR = object()  # where a tensor stands in a generic module's output (a None there is the module's own)


def _broadcast_one_row(stacked: Tensor, rows: int) -> Tensor:
    """A ``(B, 1, ...)`` output of a module called on ``(B, rows, ...)`` data as ``(B, rows, ...)``: one row
    per model that the plain model broadcasts over its samples (BART's positions, ``(1, seq, d)``; T5's
    position bias), given to the merged axis for each of the model's samples."""
    if rows > 1 and stacked.dim() > 1 and stacked.shape[1] == 1:
        return stacked.expand(stacked.shape[0], rows, *stacked.shape[2:])
    return stacked


def _reassigned_buffers(module: nn.Module, given: dict[tuple[int, str], Tensor]) -> dict[tuple[int, str], Tensor]:
    """The buffers below ``module`` that its forward replaced by new tensors (``self.b = 0.9 * self.b``)."""
    current = {}
    for owner in module.modules():
        for name, tensor in owner._buffers.items():
            key = (id(owner), name)
            if key in given and tensor is not given[key]:
                current[key] = tensor
    return current
