"""torch's own module test database against torchmb: every ``ModuleInfo`` of
``torch.testing._internal.common_modules.module_db`` and every module input, per-model and shared, float64
on the CPU, B = 3 plain modules against ``BatchModule.from_factory`` of the same constructor (outputs,
parameter and input gradients, buffers; see ``support/module_db.py``).

Every case passes, or is refused at conversion or in its first forward by an error whose message the
tables below name, with the reason. A case that starts failing, or a refusal that goes away or changes,
fails here. The default run covers every module's first input (per-model and shared); the rest is
``slow`` (``make test-all``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from support.module_db import BATCH, DTYPE, INPUT_SEED, MODULES, Case, cases_of, modes, module_inputs, run_case
from torch import nn
from torch.testing._internal.common_modules import ModuleErrorEnum

from torchmb import BatchModule


@dataclass(frozen=True)
class Refusal:
    reason: str
    match: str  # the error message, a regex
    applies: Callable[[Case], bool]


def _zero_dim(case: Case) -> bool:
    """A 0-dim input: the first (refused shared too), or any other (a class index target) per model."""
    forward = case.module_input.forward_input
    tensors = [v for v in (*forward.args, *forward.kwargs.values()) if isinstance(v, torch.Tensor)]
    return bool(tensors) and (tensors[0].dim() == 0 or (not case.shared and any(t.dim() == 0 for t in tensors)))


def _tensor_constructor_argument(case: Case) -> bool:
    values = (*case.module_input.constructor_input.args, *case.constructor_kwargs.values())
    return any(isinstance(value, torch.Tensor) for value in values)


def _reduces(case: Case) -> bool:
    return case.module.endswith("Loss") and case.constructor_kwargs.get("reduction", "mean") != "none"


_UNBATCHED_LAYERS = {
    *(f"nn.{prefix}Conv{kind}{d}d" for prefix in ("", "Lazy") for kind in ("", "Transpose") for d in (1, 2, 3)),
    "nn.Linear",
    "nn.Bilinear",
    *(f"nn.InstanceNorm{d}d" for d in (1, 2, 3)),
}

REFUSALS = [
    Refusal(
        "a 0-dim input has no sample axis for the model axis to stand before",
        r"expects every tensor argument as \(B=3, n, \.\.\.\)|expects tensors of shape \(n, \.\.\.\), got a scalar",
        _zero_dim,
    ),
    Refusal(
        "a homoscedastic variance of one value per sample row has other rows than the input once merged",
        r"var is of incorrect size",
        lambda case: case.module == "nn.GaussianNLLLoss" and case.desc == "homoscedastic" and not case.shared,
    ),
    Refusal(
        "MultiLabelMarginLoss of an unbatched (C,) input returns one number even with reduction='none': on the "
        "merged (B*C,) input it would be one for all models, and the output check refuses it",
        r"the model returned a tensor of shape \(\) whose dim 0 is not a multiple of batch=3",
        lambda case: case.module == "nn.MultiLabelMarginLoss" and case.desc.startswith("1d") and not case.shared,
    ),
    Refusal(
        "a loss reduced over the samples mixes all B models' samples into one number on the merged axis; "
        "torchmb.batch_loss reduces per model (with shared input the loss is every model's and passes)",
        r"the model returned a tensor of shape \(\) whose dim 0 is not a multiple of batch=3",
        lambda case: _reduces(case) and not case.shared and not _tensor_constructor_argument(case)
        and case.module not in {"nn.CTCLoss", "nn.LinearCrossEntropyLoss"},  # the latter reduces per model: (B,)
    ),
    Refusal(
        "an unbatched input (one sample without a batch dim) to a layer whose batched form needs one",
        r"without a batch dim|expected a \d-D input",
        lambda case: case.module in _UNBATCHED_LAYERS and "no_batch_dim" in case.desc,
    ),
    Refusal(
        "CTCLoss takes log-probabilities sequence-first (T, N, C) and one length per sample: with the models "
        "stacked in front, torch's own size checks refuse the merged tensors",
        r"Expected tensor to have size \d+ at dimension 0|input_lengths must be of size batch_size",
        lambda case: case.module == "nn.CTCLoss" and not case.shared,
    ),
]

_SEQUENCE_FIRST = {
    "nn.MultiheadAttention",
    "nn.Transformer",
    "nn.TransformerEncoder",
    "nn.TransformerEncoderLayer",
    "nn.TransformerDecoderLayer",
}


def _sequence_first(case: Case) -> bool:
    """A batched input to a layer built with batch_first=False (torch's default): (seq, N, E)."""
    args = case.module_input.forward_input.args
    if case.module not in _SEQUENCE_FIRST or args[0].dim() < 3:  # an unbatched (seq, E) input runs
        return False
    given = (*case.module_input.constructor_input.args, *case.constructor_kwargs.values())
    layers = [m for value in given if isinstance(value, nn.Module) for m in value.modules()]  # TransformerEncoder's
    batch_first = case.constructor_kwargs.get("batch_first", False)
    return not (batch_first or any(getattr(m, "batch_first", False) for m in layers))


REFUSALS += [
    Refusal(
        "a sequence-first (batch_first=False) input (seq, N, E): the models stacked in front of it put the "
        "merged model axis on the sequence; the BatchModule boundary takes batch-first inputs",
        r"sequence-first",
        _sequence_first,
    ),
    Refusal(
        "an unbatched input whose softmax / GLU runs over dim -3 / -1, which is dim 0 once merged: it would "
        "compute across models, and the first forward refuses it",
        r"over dim 0 of a tensor of shape .* holding several models' data",
        lambda case: case.module in {"nn.Softmax2d", "nn.GLU"} and "no_batch_dim" in case.desc and not case.shared,
    ),
]

# Cases failing for a known root cause still open, each with its reason (none now).
PENDING: dict[str, str] = {}


# Modules that draw random numbers in forward: the batched module draws other ones than B plain modules,
# so only shapes are compared (randomness per model is tested in tests/torchmb/test_generic.py).
RANDOM = {"nn.FractionalMaxPool2d", "nn.FractionalMaxPool3d"}


def refusal(case: Case) -> Refusal | None:
    """The first rule that applies (a 0-dim input is refused at the boundary, before any loss reduces)."""
    return next((rule for rule in REFUSALS if rule.applies(case)), None)


def check(case: Case) -> None:
    rule = refusal(case)
    if rule is None:
        run_case(case, values=case.module not in RANDOM)
        return
    with pytest.raises(Exception, match=rule.match):
        run_case(case)


DEFAULT = [Case(name, 0, "train", shared) for name in MODULES for shared in (False, True)]


def _pending(module: str) -> list:
    return [pytest.mark.xfail(strict=True, reason=PENDING[module])] if module in PENDING else []


@pytest.mark.parametrize("case", [pytest.param(case, id=str(case), marks=_pending(case.module)) for case in DEFAULT])
def test_module_db_first_input(case: Case) -> None:
    check(case)


def _slow_cases() -> list:
    return [
        pytest.param(case, id=str(case), marks=_pending(case.module))
        for name, info in MODULES.items()
        for mode in modes(info)
        for shared in (False, True)
        for case in cases_of(name, mode, shared)
        if case not in DEFAULT
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", _slow_cases())
def test_module_db(case: Case) -> None:
    check(case)


def test_the_default_run_covers_every_module() -> None:
    assert {case.module for case in DEFAULT} == set(MODULES)
    assert len(MODULES) >= 100
    assert all(module_inputs(name, True, INPUT_SEED) for name in MODULES)


def _error_inputs() -> list:
    found = []
    for name, info in MODULES.items():
        if info.module_error_inputs_func is not None:
            inputs = info.module_error_inputs_func(info, device="cpu", dtype=DTYPE, requires_grad=True, training=True)
            found += [pytest.param(name, error, id=f"{name}-error{k}") for k, error in enumerate(inputs)]
    return found


@pytest.mark.parametrize("name, error", _error_inputs())
def test_module_db_error_inputs_are_refused(name: str, error) -> None:
    """module_db's error inputs (ModuleErrorEnum): torch's construction errors stay torch's; a forward that
    raises on the plain module raises on the batched one too (often torchmb's own check, first)."""
    info = MODULES[name]
    given, forward = error.module_error_input.constructor_input, error.module_error_input.forward_input

    def make() -> nn.Module:
        return info.module_cls(*given.args, **given.kwargs)

    with warnings.catch_warnings():  # torch's patterns hold "[[...]" (a nested-set FutureWarning of re)
        warnings.simplefilter("ignore")
        pattern = re.compile(error.error_regex)
    if error.error_on == ModuleErrorEnum.CONSTRUCTION_ERROR:
        with pytest.raises(error.error_type, match=pattern):
            BatchModule.from_factory(make, BATCH, seed=0)
        return
    with pytest.raises(error.error_type, match=pattern), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make()(*forward.args, **forward.kwargs)
    batched = BatchModule.from_factory(make, BATCH, seed=0)

    def stacked(value):
        return torch.stack([value] * BATCH) if isinstance(value, torch.Tensor) and value.dim() else value

    with pytest.raises(Exception), warnings.catch_warnings():  # noqa: B017 - the batched checks' own errors
        warnings.simplefilter("ignore")
        batched(*map(stacked, forward.args), **{key: stacked(value) for key, value in forward.kwargs.items()})
