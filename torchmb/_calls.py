"""Which modules must run their own code per model although they hold no per-model state: found by reading it.

A module without per-model state of its own runs on the merged ``(B*n, ...)`` axis, and only the
``forward`` of a module it calls is batched (a registered layer's, or a generic module's ``vmap``). Two
kinds of call in its code, and one kind of read, bypass that, and all would compute garbage on the merged axis:

- **A method other than ``forward``** of a child holding per-model state (``self.rel_pos.get_bias()``:
  timm's attention asks its relative-position module for the bias). The method's code runs in the caller's
  context: there it reads the child's stacked ``(B, ...)`` tensors, or hands its registered layers
  whatever it computed, as if it were one model's.
- **A child holding per-model state called on constants alone** (``self.mlp(self.coords)``: a registered
  MLP over a coordinate table). Its result is one per model, but has no sample axis for the merged code
  that uses it.
- **A read of a child's per-model tensor** (``self.fc.weight.norm()``, a tied head ``h @ self.emb.weight.t()``,
  ``self.position_embedding.weight.shape[0]``): on the merged axis it is all models' stacked tensor, ``(B, ...)``.
  Reads of metadata that every model shares (``.dtype``, ``.device``) are not counted, nor the fast-path
  checks of torch's Transformer layers.

Run per model instead, under ``vmap`` as a region (``torchmb._generic``), the caller's code is right by
construction: the child's state is each model's slice, the method's calls of registered layers escape, and
a call on constants computes one result per model. So the conversion walk makes such a caller a region.

Calls are found by parsing the source of the caller's ``forward`` and of the methods of its own that
``forward`` calls (``self.get_bias()``), following ``self.<child>...`` attribute chains through the real
module tree; an argument counts as a constant when it reads none of the method's parameters, nor anything
computed from them, except their metadata (``x.shape``, ``x.size(1)``, ``len(x)``: the same for every
model). Parameters of a method the walk follows are data, so a constant passed into a helper is missed,
not guessed. Code this cannot see (a call through ``getattr`` or an alias, source that cannot be read)
keeps the module on the merged axis; a generic module's other methods then refuse to run there
(``torchmb._generic``), so a missed call still fails loudly rather than silently.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterator

from torch import nn

from ._registry import lookup_batch_module

__all__ = ["followed_methods", "per_model_call"]

_MODULE_API = frozenset(dir(nn.Module))  # parameters(), train(), ...: nn.Module's own, which any module offers
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_TRANSFORMER_LAYERS = (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_CONTAINER_API = frozenset().union(*(dir(container) for container in _CONTAINERS))  # items(), append(), ...
_METADATA_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "layout", "is_cuda", "requires_grad"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "get_device"})
_METADATA_FUNCTIONS = frozenset({"len", "isinstance"})
# What a stacked tensor has in common with each model's slice (unlike .shape, whose dim 0 is B)
_SHARED_METADATA = frozenset({"dtype", "device", "layout", "is_cuda", "requires_grad", "is_floating_point"})


def per_model_call(module: nn.Module, stateful: Callable[[nn.Module], bool]) -> str | None:
    """The first call in ``module``'s code that must run per model, described, or None when none is found.

    Args:
        module: the plain module whose code is read.
        stateful: whether a module's subtree holds per-model state.
    """
    if not any(stateful(child) for child in module.children()):
        return None  # every call this finds is of a child with per-model state: no source to read
    for name, function, definition in followed_methods(module):
        self_name = definition.args.args[0].arg
        read = None if _fast_path_check(module, function) else _per_model_read(module, definition, self_name)
        if read is not None:
            return f"{name} {read}"
        data = _data_names(definition)
        for call in _calls(definition):
            found = _per_model(module, call, self_name, data, stateful)
            if found is not None:
                return f"{name} {found}"
    return None


def followed_methods(module: nn.Module) -> Iterator[tuple[str, Callable, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """``module``'s ``forward`` and the methods of its own class that it calls (``self.get_bias()``), and
    theirs in turn, each once: name, function and parsed definition; a method whose source cannot be read is
    left out."""
    pending = [("forward", type(module).forward)]
    followed = {"forward"}
    while pending:
        name, function = pending.pop()
        definition = _definition(function)
        if definition is None or not definition.args.args:
            continue
        yield name, function, definition
        self_name = definition.args.args[0].arg
        for call in _calls(definition):
            own = _own_method(module, call.func, self_name)
            if own is not None and own[0] not in followed:
                followed.add(own[0])
                pending.append(own)


def _per_model(
    module: nn.Module, call: ast.Call, self_name: str, data: set[str], stateful: Callable[[nn.Module], bool]
) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr != "forward" and func.attr not in _MODULE_API:
        receiver = _submodule(module, func.value, self_name)
        if (
            receiver is not None
            and not (isinstance(receiver, _CONTAINERS) and func.attr in _CONTAINER_API)
            and lookup_batch_module(type(receiver)) is None  # a registered layer's methods are its batched class's
            and callable(getattr(type(receiver), func.attr, None))
            and stateful(receiver)
        ):
            return f"calls {ast.unparse(func)}() (not forward) of a module with per-model state"
    callee = func.value if isinstance(func, ast.Attribute) and func.attr == "forward" else func
    target = _submodule(module, callee, self_name)
    arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
    if target is not None and stateful(target) and not any(_reads_data(arg, data) for arg in arguments):
        return f"calls {ast.unparse(callee)}, a module with per-model state, on constants alone"
    return None


def _fast_path_check(module: nn.Module, function: Callable) -> bool:
    """Whether ``function`` is torch's code of a Transformer layer, whose reads of its attention's weights only
    check what every model shares (device, ``requires_grad``) before its inference fast path, which
    ``BatchModule`` turns off."""
    torch_code = getattr(inspect.getmodule(function), "__name__", "").startswith("torch.")
    return torch_code and isinstance(module, _TRANSFORMER_LAYERS)


def _per_model_read(module: nn.Module, definition: ast.AST, self_name: str) -> str | None:
    """The first read of a per-model parameter or buffer of a module below ``module`` (``self.fc.weight``)
    other than of its metadata that every model shares (``self.fc.weight.dtype``), described."""
    shared_metadata = {
        id(node.value)
        for node in ast.walk(definition)
        if isinstance(node, ast.Attribute) and node.attr in _SHARED_METADATA
    }
    for node in ast.walk(definition):
        if not isinstance(node, ast.Attribute) or id(node) in shared_metadata:
            continue
        owner = _submodule(module, node.value, self_name)
        if owner is None or owner is module:
            continue
        persistent = node.attr in owner._buffers and node.attr not in owner._non_persistent_buffers_set
        if (owner._parameters.get(node.attr) is not None) or (persistent and owner._buffers[node.attr] is not None):
            return f"reads {ast.unparse(node)}, a per-model tensor of a module below it"
    return None


@functools.cache
def _definition(function: Callable) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """``function``'s parsed definition, or None where its source cannot be read (built in, made at run time)."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):  # SyntaxError: a continuation line dedent cannot shift
        return None
    definition = tree.body[0] if tree.body else None
    return definition if isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _calls(definition: ast.AST) -> Iterator[ast.Call]:
    return (node for node in ast.walk(definition) if isinstance(node, ast.Call))


def _own_method(module: nn.Module, func: ast.expr, self_name: str) -> tuple[str, Callable] | None:
    """``self.<name>`` as a method of the module's own class (not nn.Module's), to be read too."""
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == self_name):
        return None
    if func.attr in _MODULE_API:
        return None
    try:
        method = inspect.getattr_static(type(module), func.attr)
    except AttributeError:
        return None
    return (func.attr, method) if inspect.isfunction(method) else None


def _submodule(module: nn.Module, node: ast.expr, self_name: str) -> nn.Module | None:
    """The module that ``self.a.b`` names in ``module``'s tree, or None if the expression is not such a chain
    (a subscript, a call, ``getattr``) or names no module (an attribute that is None, a tensor)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not (names and isinstance(node, ast.Name) and node.id == self_name):
        return None
    current = module
    for name in reversed(names):
        current = current._modules.get(name)
        if current is None:
            return None
    return current


def _data_names(definition: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The local names that may hold the models' data: the parameters (all but ``self``), those of nested
    functions and lambdas, and every name assigned from an expression that reads one of them."""
    data = {arg.arg for arg in _parameters(definition.args)[1:]}
    bindings: list[tuple[ast.AST, ast.AST]] = []
    for node in ast.walk(definition):
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)) and node is not definition:
            data.update(arg.arg for arg in _parameters(node.args))
        elif isinstance(node, ast.Assign):
            bindings.extend((target, node.value) for target in node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            bindings.append((node.target, node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            bindings.append((node.target, node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bindings.append((node.optional_vars, node.context_expr))
    changed = True
    while changed:  # to a fixed point: a name may be assigned before the name it reads is known to be data
        changed = False
        for target, value in bindings:
            names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} - data
            if names and _reads_data(value, data):
                data |= names
                changed = True
    return data


def _parameters(arguments: ast.arguments) -> list[ast.arg]:
    extra = [arg for arg in (arguments.vararg, arguments.kwarg) if arg is not None]
    return [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, *extra]


def _reads_data(node: ast.AST, data: set[str]) -> bool:
    """Whether ``node`` reads one of the ``data`` names other than through its metadata."""
    if isinstance(node, ast.Name):
        return node.id in data
    if isinstance(node, ast.Attribute) and node.attr in _METADATA_ATTRIBUTES:
        return False
    if isinstance(node, ast.Call):
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in _METADATA_METHODS) or (
            isinstance(func, ast.Name) and func.id in _METADATA_FUNCTIONS
        ):
            return any(_reads_data(arg, data) for arg in node.args)  # x.size(i): i may come from data
    return any(_reads_data(child, data) for child in ast.iter_child_nodes(node))
