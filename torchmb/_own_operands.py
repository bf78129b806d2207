"""Own parameters that meet the models' data only element-wise: broadcast per model on the merged axis.

A module that owns a layer scale (timm's ``ConvNeXtBlock``: ``x.mul(self.gamma.reshape(1, -1, 1, 1))``,
``LayerScale``: ``x * self.gamma`` or ``x.mul_(self.gamma)``), a learnable affine (``self.scale * x +
self.bias``) or a response norm's ``torch.addcmul(self.bias.view(...), self.weight.view(...), x)`` needs no
per-model region (``torchmb._generic``): each model's parameter only scales or shifts that model's rows. Its
code runs on the merged ``(B*n, ...)`` axis like a module without state, its children called as usual (no
escape, no ``vmap``), and while it runs each own parameter is a :class:`PerModelOperand`: the stacked
``(B, *shape)`` tensor, seen by the module's code as one model's. Its metadata is one model's (``shape``,
``dim()``), a shape op or a cast gives another per-model operand (``reshape(1, -1, 1, 1)`` of ``(B, C)`` is
``(B, 1, C, 1, 1)``), and an element-wise op with the merged data views the data as ``(B, rows, ...)`` (or
``(rows, B, ...)`` samples-major), each model's parameter broadcast over its rows, and merges the result
again: one kernel, as in the plain model. Any other op on a per-model operand with the data raises
:class:`NotElementwise`, and the module runs per model instead (at the first forward, which is undone and
run again; later, as an error).

A class token is the other use such a module makes of its own parameter: ``self.cls_token.expand(x.shape[0],
-1, -1)`` (timm's and torchvision's ViTs), concatenated with the patch tokens. Its leading size is the data's
row count, ``B * n`` on the merged axis, so each model's token is expanded to its own ``n`` rows and merged
as the data is: from then on it is the models' data, and ``torch.cat`` of it with the patches is the plain
op.

Which modules take this path is decided at conversion by reading the source of their ``forward`` and of
the methods of their own that it calls (:func:`elementwise_only`), a branch on one of the module's ``bool``
flags read as the flag's present value takes it: every read of an own parameter is ``self.p`` through
shape ops and casts, used as an operand of ``*``, ``+``, ``-``, ``/`` or of an element-wise method or
function, compared with ``None`` (directly or through a local name assigned once), or expanded to the
data's row count (``x.shape[0]``, ``x.size(0)``, ``len(x)``, ``B`` of ``B, N, C = x.shape``). Any other
leading size of an ``expand`` than -1 or 1 keeps the module per model: a number the merged row count could
equal would be taken for it.
"""

from __future__ import annotations

import ast
import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from batch_layers import current_forward, is_shared_input

from ._calls import followed_methods
from ._tracking import PerModelCodeFound

__all__ = [
    "NotElementwise", "PerModelOperand", "broadcast_own_parameters", "elementwise_only", "is_broadcast_own",
    "operand_names", "restore_plain_class",
]  # fmt: skip


class NotElementwise(RuntimeError):
    """A module's code used its own per-model parameter otherwise than element-wise with the data."""


_METADATA = (Tensor.shape.__get__, Tensor.size, Tensor.dim, Tensor.ndim.__get__, Tensor.ndimension, Tensor.numel,
             Tensor.nelement, Tensor.__len__, Tensor.nbytes.__get__)  # fmt: skip
_PROPERTIES = (
    Tensor.dtype.__get__, Tensor.device.__get__, Tensor.requires_grad.__get__, Tensor.is_cuda.__get__,
    Tensor.layout.__get__, Tensor.grad_fn.__get__, Tensor.is_leaf.__get__, Tensor.is_floating_point,
    Tensor.element_size, Tensor.__repr__, Tensor.__format__, Tensor.storage_offset,
    Tensor.is_complex, Tensor.is_signed, Tensor.is_inference, Tensor.get_device,
)  # fmt: skip
# layout questions: answered for one model's slice of the stack
_LAYOUT = (Tensor.stride, Tensor.is_contiguous)
_CASTS = (Tensor.to, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.type_as, Tensor.contiguous,
          Tensor.clone, Tensor.detach)  # fmt: skip
_ELEMENTWISE = (
    torch.mul, torch.multiply, torch.add, torch.sub, torch.subtract, torch.div, torch.divide, torch.true_divide,
    torch.addcmul, torch.addcdiv, torch.maximum, torch.minimum, torch.lerp, torch.where,
    Tensor.mul, Tensor.multiply, Tensor.add, Tensor.sub, Tensor.subtract, Tensor.div, Tensor.divide,
    Tensor.addcmul, Tensor.addcdiv, Tensor.maximum, Tensor.minimum, Tensor.lerp,
    Tensor.__mul__, Tensor.__rmul__, Tensor.__add__, Tensor.__radd__, Tensor.__sub__, Tensor.__rsub__,
    Tensor.__truediv__, Tensor.__rtruediv__,
    Tensor.mul_, Tensor.add_, Tensor.sub_, Tensor.div_, Tensor.addcmul_, Tensor.addcdiv_, Tensor.lerp_,
    Tensor.__imul__, Tensor.__iadd__, Tensor.__isub__, Tensor.__itruediv__,
)  # fmt: skip


class PerModelOperand(Tensor):
    """A module's own parameter of B models, ``(B, *shape)``, as the module's code sees it on the merged axis:
    one model's metadata, per-model shape ops and casts, element-wise ops broadcast per model over the data."""

    holds_models = True  # what torchmb._tracking labels per-model

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            return _per_model_op(func, args, kwargs)


def _per_model_op(func: Callable, args: tuple, kwargs: dict) -> Any:
    first = args[0] if args else None
    if isinstance(first, PerModelOperand) and func in _METADATA:
        return _metadata(func, first, args[1:], kwargs)
    if func in _PROPERTIES:
        return func(*args, **kwargs)
    if isinstance(first, PerModelOperand) and func in _LAYOUT:
        return func(first.as_subclass(Tensor)[0], *args[1:], **kwargs)
    if _name(func) == "__get__":  # another attribute: a flag such as is_nested (torch.compile reads several)
        value = func(*args, **kwargs)
        if not isinstance(value, Tensor):
            return value  # the same for one model's parameter as for the stacked one
    if func in (Tensor.type_as, Tensor.to) and not isinstance(first, PerModelOperand):
        return func(*args, **kwargs)  # x.type_as(self.gamma): only the parameter's dtype and device are read
    if isinstance(first, PerModelOperand):
        if func is Tensor.expand:
            rows = _expanded_to_rows(first, args[1:], kwargs)
            if rows is not None:
                return rows
        shaped = _shape_op(func, first, args[1:], kwargs)
        if shaped is not None:
            return shaped.as_subclass(PerModelOperand)
    if "out" in kwargs:
        raise NotElementwise(f"{_name(func)} with out= on a per-model parameter")
    values = (*args, *kwargs.values())
    # the arguments themselves are the leaves unless a container holds a tensor (an element-wise op's never
    # does): a layer scale's every forward passes here, and a pytree walk costs several times the op
    nested = any([isinstance(v, dict) or (isinstance(v, (tuple, list)) and any([isinstance(i, Tensor) for i in v]))
                  for v in values])
    leaves, spec = tree_flatten((args, kwargs)) if nested else (values, None)
    batch = next(leaf for leaf in leaves if isinstance(leaf, PerModelOperand)).shape[0]
    data = [leaf for leaf in leaves if isinstance(leaf, Tensor) and not isinstance(leaf, PerModelOperand)]
    if not any([_is_data(t, batch) for t in data]):
        return _per_model_only(func, *(tree_flatten((args, kwargs)) if spec is None else (leaves, spec)), batch)
    if func not in _ELEMENTWISE or nested:
        raise NotElementwise(f"{_name(func)} of a per-model parameter with the models' data")
    return _broadcast(func, args, kwargs, batch)


def _name(func: Callable) -> str:
    return getattr(func, "__name__", str(func))


def _metadata(func: Callable, tensor: Tensor, rest: tuple, kwargs: dict) -> Any:
    shape = tensor.shape[1:]
    if func == Tensor.shape.__get__:
        return shape
    if func is Tensor.size:
        dim = rest[0] if rest else kwargs.get("dim")
        return shape if dim is None else shape[dim]
    if func in (Tensor.dim, Tensor.ndimension) or func == Tensor.ndim.__get__:
        return len(shape)
    if func is Tensor.__len__:
        return shape[0]
    if func == Tensor.nbytes.__get__:
        return math.prod(shape) * tensor.element_size()
    return math.prod(shape)  # numel, nelement


def _plain_dim(dim: int) -> int:
    """A dim of one model's tensor as the dim of the stacked one (negative dims count from the end in both)."""
    return dim + 1 if dim >= 0 else dim


def _sizes(rest: tuple) -> list[int]:
    return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else list(rest)


def _shape_op(func: Callable, tensor: Tensor, rest: tuple, kwargs: dict) -> Tensor | None:
    """The per-model result of a shape op or cast on one model's tensor, computed on the stacked one; None for
    other ops."""
    batch, shape = tensor.shape[0], tensor.shape[1:]
    if func in _CASTS:
        return func(tensor, *rest, **kwargs)
    if func in (Tensor.view, Tensor.reshape, torch.reshape) and not kwargs:
        if len(rest) == 1 and isinstance(rest[0], torch.dtype):
            return None
        sizes = _sizes(rest)  # a -1 resolves to the plain model's size, each model's numel being the plain one
        return tensor.view(batch, *sizes) if func is Tensor.view else tensor.reshape(batch, *sizes)
    if func in (Tensor.unsqueeze, torch.unsqueeze) and len(rest) == 1 and not kwargs:
        dim = rest[0]
        return tensor.unsqueeze(dim + 1 if dim >= 0 else dim)
    if func in (Tensor.squeeze, torch.squeeze) and not kwargs:
        dims = [rest[0]] if rest else [i for i, size in enumerate(shape) if size == 1]
        return tensor.squeeze(tuple([_plain_dim(d) for d in dims])) if dims else tensor
    if func in (Tensor.expand,) and not kwargs:
        sizes = _sizes(rest)
        lifted = tensor.view(batch, *[1] * (len(sizes) - len(shape)), *shape)
        return lifted.expand(batch, *sizes)
    if func in (Tensor.permute, torch.permute) and not kwargs:
        dims = [d % len(shape) for d in _sizes(rest)]
        return tensor.permute(0, *[d + 1 for d in dims])
    if func in (Tensor.transpose, torch.transpose) and len(rest) == 2 and not kwargs:
        return tensor.transpose(_plain_dim(rest[0]), _plain_dim(rest[1]))
    if func is Tensor.__getitem__ and len(rest) == 1:
        index = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        if all([i is None or i is Ellipsis or (type(i) in (int, slice)) for i in index]):
            return tensor[(slice(None), *index)]
    return None


def _expanded_to_rows(tensor: Tensor, rest: tuple, kwargs: dict) -> Tensor | None:
    """``tensor.expand(rows, ...)`` where ``rows`` is the merged data's row count ``B * m`` (the plain code
    expanded a class token to ``x.shape[0]``): each model's tensor expanded to its ``m`` rows, merged as the
    data is; None for any other expand. The source reading lets through only a leading size read from the
    data, or -1 or 1, which no row count equals."""
    context = current_forward()
    sizes = _sizes(rest)
    batch = tensor.shape[0]
    if context is None or kwargs or not sizes or len(sizes) < tensor.dim() - 1 or context.samples < 1:
        return None
    step = batch * context.samples
    samples_major = context.order == "samples"
    rows = sizes[0]
    lifted = _lift(tensor, len(sizes))
    if lifted.shape[1] != 1 or rows <= 1 or rows % step != 0 or (samples_major and rows != step):
        return None
    expanded = lifted.expand(batch, rows // batch, *sizes[1:])
    if samples_major:
        expanded = expanded.transpose(0, 1)
    return expanded.reshape(rows, *expanded.shape[2:])


def _is_data(tensor: Tensor, batch: int) -> bool:
    """Whether ``tensor`` holds the models' data: merged (dim 0 a multiple of ``B * n``) or the shared input."""
    if tensor.dim() == 0:
        return False
    context = current_forward()
    samples = context.samples if context is not None else 1
    return tensor.shape[0] % (batch * max(samples, 1)) == 0 or is_shared_input(tensor, batch)


def _per_model_only(func: Callable, leaves: list, spec: Any, batch: int) -> Any:
    """An op on per-model parameters and constants alone: element-wise ones broadcast the stacked tensors, any
    other runs per model under ``vmap``."""
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, PerModelOperand)]
    if func in _ELEMENTWISE and not _is_in_place(func):
        ranks = [t.dim() - 1 if isinstance(t, PerModelOperand) else t.dim() for t in leaves if isinstance(t, Tensor)]
        rank = max(ranks)
        lifted = list(leaves)
        for i in positions:
            lifted[i] = _lift(leaves[i], rank)
        args, kwargs = tree_unflatten(lifted, spec)
        return func(*args, **kwargs).as_subclass(PerModelOperand)
    if _is_in_place(func):
        raise NotElementwise(f"{_name(func)} in place on a per-model parameter")

    def one_model(*slices: Tensor) -> Any:
        call = list(leaves)
        for i, value in zip(positions, slices):
            call[i] = value
        args, kwargs = tree_unflatten(call, spec)
        return func(*args, **kwargs)

    try:
        out = torch.vmap(one_model, randomness="different")(*[leaves[i].view(leaves[i].shape) for i in positions])
    except RuntimeError as error:  # a Python decision on a parameter, an op without a batching rule
        raise NotElementwise(f"{_name(func)} of a per-model parameter, which vmap cannot run: {error}") from None
    if not isinstance(out, Tensor):
        raise NotElementwise(f"{_name(func)} of a per-model parameter returning {type(out).__name__}")
    return out.as_subclass(PerModelOperand)


_IN_PLACE = (
    Tensor.mul_, Tensor.add_, Tensor.sub_, Tensor.div_, Tensor.addcmul_, Tensor.addcdiv_, Tensor.lerp_,
    Tensor.__imul__, Tensor.__iadd__, Tensor.__isub__, Tensor.__itruediv__,
)  # fmt: skip


def _is_in_place(func: Callable) -> bool:
    """Whether ``func`` writes into its first argument: among the element-wise ops, or by torch's naming."""
    if func in _ELEMENTWISE:
        return func in _IN_PLACE
    name = _name(func)
    return name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))


def _lift(tensor: Tensor, rank: int) -> Tensor:
    """A per-model ``(B, *shape)`` tensor as ``(B, 1, ..., *shape)`` of ``rank + 1`` dims."""
    shape = tensor.shape[1:]
    if len(shape) > rank:
        raise NotElementwise("a per-model parameter with more dims than the data it meets")
    return tensor.view(tensor.shape[0], *[1] * (rank - len(shape)), *shape)


def _broadcast(func: Callable, args: tuple, kwargs: dict, batch: int) -> Tensor:
    """``func`` of the merged data and per-model parameters: each model's rows with its own parameter."""
    context = current_forward()
    samples_major = context is not None and context.order == "samples"
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, Tensor)]
    rank = max([t.dim() - 1 if isinstance(t, PerModelOperand) else t.dim() for t in tensors])

    def lifted(value: Any) -> Any:
        if isinstance(value, PerModelOperand):
            value = _lift(value, rank)
            return value.transpose(0, 1) if samples_major else value
        if not isinstance(value, Tensor) or not _is_data(value, batch):
            return value  # constants (fewer dims, or one row) broadcast over the trailing dims as in the plain model
        if value.dim() != rank:
            raise NotElementwise(f"{_name(func)} of a per-model parameter with data of fewer dims than it")
        if is_shared_input(value, batch):
            return value.unsqueeze(1) if samples_major else value.unsqueeze(0)
        rows = (value.shape[0] // batch, batch) if samples_major else (batch, value.shape[0] // batch)
        return value.view(*rows, *value.shape[1:])

    call_args = [lifted(value) for value in args]
    call_kwargs = {name: lifted(value) for name, value in kwargs.items()}
    if _is_in_place(func):
        target = args[0]
        if isinstance(target, PerModelOperand) or not isinstance(target, Tensor) or is_shared_input(target, batch):
            raise NotElementwise(f"{_name(func)} writing into a per-model parameter or the shared input")
        func(*call_args, **call_kwargs)
        return target
    out = func(*call_args, **call_kwargs)
    return out.reshape(out.shape[0] * out.shape[1], *out.shape[2:])


# -- conversion: which modules, and the class swap -----------------------------------------------------------

_SHAPE_METHODS = frozenset(
    {"reshape", "view", "unsqueeze", "squeeze", "expand", "permute", "transpose", "to", "float", "double", "half",
     "bfloat16", "type_as", "contiguous", "clone", "detach"}
)  # fmt: skip
_ELEMENTWISE_NAMES = frozenset(
    {"mul", "multiply", "add", "sub", "subtract", "div", "divide", "true_divide", "addcmul", "addcdiv", "maximum",
     "minimum", "lerp", "where", "mul_", "add_", "sub_", "div_", "addcmul_", "addcdiv_", "lerp_"}
)  # fmt: skip
_ARITHMETIC = (ast.Mult, ast.Add, ast.Sub, ast.Div)


def elementwise_only(module: nn.Module, names: list[str]) -> bool:
    """Whether the source of ``module``'s ``forward``, and of the methods of its own that ``forward`` calls,
    reads each of its parameters ``names`` only element-wise (see the module docstring); False where the
    source cannot be read. A branch on one of the module's flags (``if self.dynamic_img_size:``) is read as
    the flag's present value takes it."""
    seen: set[str] = set()
    for _, _, definition in followed_methods(module):
        definition = _live_branches(definition, module)
        self_name = definition.args.args[0].arg
        reads = [
            node
            for node in ast.walk(definition)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == self_name
            and node.attr in names
        ]  # fmt: skip
        if not _elementwise_reads(definition, reads, self_name):
            return False
        seen.update(node.attr for node in reads)
    return seen == set(names)  # a parameter read elsewhere (a child, a hook): not seen, not guessed


def _elementwise_reads(definition: ast.FunctionDef | ast.AsyncFunctionDef, reads: list[ast.Attribute],
                       self_name: str) -> bool:  # fmt: skip
    parents = {id(child): node for node in ast.walk(definition) for child in ast.iter_child_nodes(node)}
    assigned = [n.id for n in ast.walk(definition) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    rows = _row_counts(definition, assigned, self_name)
    aliases: dict[str, int] = {}
    pending: list[ast.AST] = list(reads)
    while pending:
        node = pending.pop()
        use = _use(node, parents, rows, self_name)
        if use is None:
            return False
        if isinstance(use, str):  # assigned to a local name: its reads are uses too
            aliases[use] = aliases.get(use, 0) + 1
            pending.extend(n for n in ast.walk(definition) if isinstance(n, ast.Name) and n.id == use and _loads(n))
    return all(assigned.count(name) == 1 for name in aliases)


def _loads(node: ast.Name) -> bool:
    return isinstance(node.ctx, ast.Load)


def _live_branches(
    definition: ast.FunctionDef | ast.AsyncFunctionDef, module: nn.Module
) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """A copy of ``definition`` keeping, of each ``if self.flag:`` or ``if not self.flag:`` on a ``bool``
    attribute of ``module``, the branch its present value takes. A flag changed later sends a use this hid
    through the checks of :class:`PerModelOperand` at run time."""
    self_name = definition.args.args[0].arg

    class _Pruner(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> Any:
            self.generic_visit(node)
            taken = _flag(node.test, module, self_name)
            return node if taken is None else (node.body if taken else node.orelse)

    return _Pruner().visit(copy.deepcopy(definition))


def _flag(test: ast.expr, module: nn.Module, self_name: str) -> bool | None:
    """The value of ``self.flag`` or ``not self.flag`` for a ``bool`` attribute of ``module``, else None."""
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    node = test.operand if negated else test
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == self_name):
        return None
    value = getattr(module, node.attr, None)
    return None if type(value) is not bool else value != negated


def _row_counts(definition: ast.AST, assigned: list[str], self_name: str) -> set[str]:
    """The local names assigned once (``assigned``: every name stored in ``definition``, repeats kept) the
    data's row count: ``n = x.shape[0]``, ``b = x.size(0)``, ``B, N, C = x.shape``."""
    names = []
    for node in ast.walk(definition):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and _is_row_count(node.value, set(), self_name):
            names.append(target.id)
        elif isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name):
            if _is_shape(node.value, self_name):
                names.append(target.elts[0].id)
    return {name for name in names if assigned.count(name) == 1}


def _is_shape(node: ast.expr, self_name: str) -> bool:
    """``x.shape`` or ``x.size()`` of a local name ``x``."""
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        node = node.func
        if not (isinstance(node, ast.Attribute) and node.attr == "size"):
            return False
    elif not (isinstance(node, ast.Attribute) and node.attr == "shape"):
        return False
    return isinstance(node.value, ast.Name) and node.value.id != self_name


def _is_row_count(node: ast.expr, rows: set[str], self_name: str) -> bool:
    """``x.shape[0]``, ``x.size(0)``, ``len(x)`` of a local name ``x``, or a name in ``rows``."""
    if isinstance(node, ast.Name):
        return node.id in rows
    if isinstance(node, ast.Subscript):
        first = isinstance(node.slice, ast.Constant) and node.slice.value == 0
        return first and _is_shape(node.value, self_name)
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords):
        return False
    (arg,) = node.args
    if isinstance(node.func, ast.Name) and node.func.id == "len":
        return isinstance(arg, ast.Name) and arg.id != self_name
    size = isinstance(node.func, ast.Attribute) and node.func.attr == "size"
    local = size and isinstance(node.func.value, ast.Name) and node.func.value.id != self_name
    return local and isinstance(arg, ast.Constant) and arg.value == 0


def _expand_use(call: ast.Call, rows: set[str], self_name: str) -> str | None:
    """How ``expand(...)`` of a per-model expression makes it: ``"rows"`` where its leading size is the data's
    row count (``x.shape[0]``; or the whole ``x.shape``), ``"model"`` where it is -1 or 1, None otherwise (a
    number that the merged data's row count could equal)."""
    if len(call.args) == 1 and _is_shape(call.args[0], self_name):
        return "rows"
    if not call.args or call.keywords:
        return None
    lead = call.args[0]
    if _is_row_count(lead, rows, self_name):
        return "rows"
    if isinstance(lead, ast.UnaryOp) and isinstance(lead.op, ast.USub):
        lead = lead.operand
    return "model" if isinstance(lead, ast.Constant) and lead.value == 1 else None


def _use(node: ast.AST, parents: dict[int, ast.AST], rows: set[str], self_name: str) -> str | bool | None:
    """How a per-model expression is used: True for an element-wise use (or an expand to the data's rows,
    after which it is the data), the local name it is assigned to, or None for any other use."""
    parent = parents.get(id(node))
    while (
        isinstance(parent, ast.Attribute) and parent.attr in _SHAPE_METHODS
        and isinstance(parents.get(id(parent)), ast.Call) and parents[id(parent)].func is parent
    ):  # fmt: skip
        node = parents[id(parent)]  # self.gamma.reshape(...): a per-model expression too
        if parent.attr == "expand":
            expanded = _expand_use(node, rows, self_name)
            if expanded != "model":
                return expanded == "rows" or None
        parent = parents.get(id(node))
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, _ARITHMETIC):
        return True
    if isinstance(parent, ast.AugAssign) and isinstance(parent.op, _ARITHMETIC) and parent.value is node:
        return True
    if isinstance(parent, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops):
        return all(isinstance(c, ast.Constant) and c.value is None for c in parent.comparators) or None
    if isinstance(parent, ast.Attribute) and parent.attr in _ELEMENTWISE_NAMES:
        return True  # self.gamma.mul(x)
    if isinstance(parent, ast.keyword):
        parent = parents.get(id(parent))
    if isinstance(parent, ast.Call) and node is not parent.func:
        func = parent.func
        if isinstance(func, ast.Attribute) and func.attr in _ELEMENTWISE_NAMES:
            return True  # x.mul(self.gamma), torch.addcmul(self.beta, self.alpha, x)
        return None
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name):
        return parent.targets[0].id
    return None


_CLASSES: dict[tuple[type[nn.Module], tuple[str, ...]], type[nn.Module]] = {}


def is_broadcast_own(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are broadcast per model on the merged axis (see the module
    docstring)."""
    return type(module) in _CLASSES.values()


def operand_names(module: nn.Module) -> tuple[str, ...]:
    """The names of the parameters that :func:`broadcast_own_parameters` stacked on ``module``."""
    return module._torchmb_operands


def broadcast_own_parameters(module: nn.Module, batch: int, names: list[str]) -> nn.Module:
    """Stack ``module``'s parameters ``names`` for ``batch`` models (in place) and make its ``forward`` see
    them as :class:`PerModelOperand`; returns it.

    The module's class gains a property per name that reads the stacked parameter as an operand while its
    forward runs. Nothing is written into the module's ``_parameters`` then, so ``torch.compile``, resuming
    after a graph break inside the forward, reads the stacked parameter as the graph's input and makes the
    operand inside the graph (it cannot take a tensor whose metadata is one model's as an input).
    """
    for name in names:
        param = module._parameters[name]
        stacked = param.detach().unsqueeze(0).expand(batch, *param.shape).clone()
        module._parameters[name] = nn.Parameter(stacked, requires_grad=param.requires_grad)
    cls, key = type(module), (type(module), tuple(names))
    if key not in _CLASSES:
        namespace: dict[str, Any] = {name: property(_operand_reader(name)) for name in names}
        namespace["forward"] = _make_forward(cls.forward)
        _CLASSES[key] = type(cls.__name__, (cls,), namespace)
    module.__class__ = _CLASSES[key]
    module._torchmb_operands = tuple(names)
    module._torchmb_forwarding = False
    return module


def restore_plain_class(module: nn.Module) -> None:
    """Undo :func:`broadcast_own_parameters` but for the stacking: ``module`` gets its class back."""
    module.__class__ = type(module).__mro__[1]
    del module._torchmb_operands, module._torchmb_forwarding


def _operand_reader(name: str) -> Callable[[nn.Module], Tensor]:
    def read(self: nn.Module) -> Tensor:
        stacked = self._parameters[name]
        forwarding = self._torchmb_forwarding and stacked is not None
        return stacked.as_subclass(PerModelOperand) if forwarding else stacked

    return read


def _make_forward(original_forward: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        outer = self._torchmb_forwarding
        self._torchmb_forwarding = True
        try:
            return original_forward(self, *args, **kwargs)
        except NotElementwise as refused:  # at the first forward, BatchModule runs the module per model instead
            raise PerModelCodeFound(self, f"uses its own parameter otherwise than element-wise: {refused}") from None
        finally:
            self._torchmb_forwarding = outer

    return forward
