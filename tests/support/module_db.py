"""torch's own module test database (``torch.testing._internal.common_modules.module_db``) against torchmb.

Each case is one ``ModuleInfo``, one of its module inputs, a train or eval mode and per-model or shared
input. B plain modules are built by the same constructor, model ``i`` after ``torch.manual_seed(SEED + i)``,
and ``BatchModule.from_factory`` of that constructor batches them; in float64 on the CPU, the batched
module's outputs, parameter gradients, input gradients and buffers must equal the plain modules', model by
model. Per-model, model ``i`` gets the ``i``-th draw of the input (module_db's input function run under
another seed) and the batched module their stack, ``(B, *plain_shape)``; shared, every plain model gets the
first draw and the batched module that draw with ``shared_input=True``.

Lazy modules are materialised by the constructor (one forward on the case's input, as a user's first step
would), since their parameters cannot be batched before they have a shape.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import torchmb

# torch's test utilities import what the machine has (numba.cuda on a CUDA machine), whose own imports may
# warn of NumPy deprecations: not ours to fail on.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.testing._internal.common_modules import ModuleInfo, module_db

# Importing torch's test utilities freezes torch.backends' flags (torch.backends.disable_global_flags), which
# tests/conftest.py and other tests set: thaw them again (the flag is a global of torch.backends' functions).
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

BATCH = 3
SEED = 0
INPUT_SEED = 1000
DTYPE = torch.float64
MODULES: dict[str, ModuleInfo] = {info.name: info for info in module_db}


@dataclass(frozen=True)
class Case:
    """One comparison: ``module`` (module_db's name), its ``index``-th input in ``mode``, ``shared`` or not."""

    module: str
    index: int
    mode: str  # "train" or "eval"
    shared: bool

    @property
    def info(self) -> ModuleInfo:
        return MODULES[self.module]

    @property
    def module_input(self) -> Any:
        return module_inputs(self.module, self.mode == "train", INPUT_SEED)[self.index]

    @property
    def desc(self) -> str:
        return self.module_input.desc

    @property
    def constructor_kwargs(self) -> dict[str, Any]:
        return self.module_input.constructor_input.kwargs

    def __str__(self) -> str:
        return f"{self.module}[{self.index}:{self.desc or '-'}]-{self.mode}-{'shared' if self.shared else 'per-model'}"


@functools.cache
def module_inputs(name: str, training: bool, seed: int) -> list[Any]:
    """module_db's inputs of ``name`` for ``training``, drawn after ``torch.manual_seed(seed)``."""
    info = MODULES[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return info.module_inputs_func(info, device="cpu", dtype=DTYPE, requires_grad=True, training=training)


def modes(info: ModuleInfo) -> tuple[str, ...]:
    """Train, and eval where module_db says the module computes otherwise in eval."""
    return ("train", "eval") if info.train_and_eval_differ else ("train",)


def cases_of(name: str, mode: str, shared: bool) -> list[Case]:
    """Every input of module ``name`` in ``mode``, per-model or shared."""
    return [Case(name, index, mode, shared) for index in range(len(module_inputs(name, mode == "train", INPUT_SEED)))]


def _leaves(value: Any) -> list[Any]:
    return tree_flatten(value)[0]


def _fresh(value: Any) -> Any:
    """A detached copy of every tensor (keeping ``requires_grad``), so each run starts a graph of its own."""
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t, value)


def _constructor(case: Case) -> Callable[[], nn.Module]:
    cinput = case.module_input.constructor_input
    finput = case.module_input.forward_input
    training = case.mode == "train"

    def make() -> nn.Module:
        module = case.info.module_cls(*cinput.args, **cinput.kwargs).to(DTYPE)
        if isinstance(module, nn.modules.lazy.LazyModuleMixin):
            with torch.random.fork_rng(), torch.no_grad():
                module(*_fresh(finput.args), **_fresh(finput.kwargs))
        return module.train(training)

    return make


def _draws(case: Case) -> list[tuple[tuple, dict]]:
    """Each model's forward arguments: the shared draw B times, or B draws of module_db's input function."""
    seeds = [INPUT_SEED] * BATCH if case.shared else [INPUT_SEED + i for i in range(BATCH)]
    training = case.mode == "train"
    draws = [module_inputs(case.module, training, seed)[case.index].forward_input for seed in seeds]
    return [(_fresh(draw.args), _fresh(draw.kwargs)) for draw in draws]


def _stack_draws(draws: list[tuple[tuple, dict]]) -> tuple[tuple, dict]:
    """The batched module's arguments: every tensor the stack of the models' tensors, ``(B, *shape)``."""
    per_model = [_leaves(draw) for draw in draws]
    _, spec = tree_flatten(draws[0])
    stacked = []
    for values in zip(*per_model):
        if isinstance(values[0], Tensor):
            stacked.append(torch.stack([v.detach() for v in values]).requires_grad_(values[0].requires_grad))
        else:
            stacked.append(values[0])
    return tree_unflatten(stacked, spec)


def _grad_weights(outputs: list[Tensor], generator: torch.Generator) -> list[Tensor | None]:
    return [
        torch.randn(out.shape, dtype=out.dtype, generator=generator) if out.requires_grad else None for out in outputs
    ]


def _backward(outputs: list[Tensor], weights: list[Tensor | None]) -> None:
    terms = [(out * w).sum() for out, w in zip(outputs, weights) if w is not None]
    if terms:
        torch.stack(terms).sum().backward()


def _float_tensors(value: Any) -> list[Tensor]:
    return [leaf for leaf in _leaves(value) if isinstance(leaf, Tensor)]


def run_case(case: Case, *, values: bool = True) -> None:
    """Build, run and compare one case; raises whatever the batched module raises (a refusal), or an
    ``AssertionError`` where a result differs from the plain modules'. ``values=False`` compares shapes
    only (a module that draws random numbers draws other ones batched). torch's warnings about the plain
    modules' arguments (and about its ``vmap`` fallbacks) are not the subject here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run_case(case, values)


def _run_case(case: Case, values: bool) -> None:
    make = _constructor(case)
    plain = [torchmb_seeded(make, SEED + i) for i in range(BATCH)]
    draws = _draws(case)
    bm = torchmb.BatchModule.from_factory(make, BATCH, seed=SEED)
    bm.train(case.mode == "train")
    if case.shared:
        args, kwargs = _fresh(draws[0])
        out = bm(*args, shared_input=True, **kwargs)
    else:
        args, kwargs = _stack_draws(draws)
        out = bm(*args, **kwargs)

    plain_outs = [model(*args_i, **kwargs_i) for model, (args_i, kwargs_i) in zip(plain, draws)]
    expected = [_float_tensors(o) for o in plain_outs]
    got = _float_tensors(out)
    assert len(got) == len(expected[0]), f"{case}: {len(got)} output tensors, plain gives {len(expected[0])}"
    for k, value in enumerate(got):
        want = torch.stack([e[k] for e in expected])
        assert value.shape == want.shape, f"{case}: output {k} of shape {tuple(value.shape)}, not {tuple(want.shape)}"
        if values:
            torch.testing.assert_close(value, want, msg=lambda m, k=k: f"{case}: output {k}: {m}", equal_nan=True)

    generator = torch.Generator().manual_seed(7)
    weights = _grad_weights(got, generator)
    _backward(got, weights)
    for i, outs_i in enumerate(expected):
        _backward(outs_i, [None if w is None else w[i] for w in weights])

    if values:
        _compare_parameters(case, bm, plain)
        _compare_input_grads(case, args, kwargs, draws)
        _compare_buffers(case, bm, plain)


def torchmb_seeded(make: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return make()


def _compare_parameters(case: Case, bm: torchmb.BatchModule, plain: list[nn.Module]) -> None:
    batched = dict(bm.module.named_parameters())
    for name, param in plain[0].named_parameters():
        target = batched[name]
        assert target.shape == (BATCH, *param.shape), f"{case}: parameter {name} of shape {tuple(target.shape)}"
        for i, model in enumerate(plain):
            want = model.get_parameter(name).grad
            have = None if target.grad is None else target.grad[i]
            if want is None:
                assert have is None or not have.any(), f"{case}: {name} has a gradient the plain model lacks"
                continue
            assert have is not None, f"{case}: no gradient for {name}"
            message = f"{case}: gradient of {name}[{i}]"
            torch.testing.assert_close(have, want, equal_nan=True, msg=lambda m, message=message: f"{message}: {m}")


def _compare_input_grads(case: Case, args: tuple, kwargs: dict, draws: list[tuple[tuple, dict]]) -> None:
    batched = _leaves((args, kwargs))
    per_model = [_leaves(draw) for draw in draws]
    for k, value in enumerate(batched):
        if not isinstance(value, Tensor) or not value.requires_grad:
            continue
        grads = [draw[k].grad for draw in per_model]
        if all(g is None for g in grads):
            assert value.grad is None or not value.grad.any(), f"{case}: input {k} has a gradient the plain lacks"
            continue
        grads = [torch.zeros_like(draw[k]) if g is None else g for draw, g in zip(per_model, grads)]
        want = torch.stack(grads).sum(0) if case.shared else torch.stack(grads)
        assert value.grad is not None, f"{case}: no gradient for input {k}"
        torch.testing.assert_close(value.grad, want, equal_nan=True, msg=lambda m, k=k: f"{case}: input grad {k}: {m}")


def _compare_buffers(case: Case, bm: torchmb.BatchModule, plain: list[nn.Module]) -> None:
    for i, model in enumerate(plain):
        state = bm.state_dict_of(i)
        for name, buffer in model.named_buffers():
            message = f"{case}: buffer {name}[{i}]"
            torch.testing.assert_close(state[name], buffer, msg=lambda m, message=message: f"{message}: {m}")
