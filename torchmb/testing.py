"""Checks that a batched model is B independent models: equal to plain copies, and isolated.

Both checks need a deterministic model (dropout off, i.e. ``eval()``, or no dropout); batch norm in
training mode is fine. They turn cuDNN's nondeterministic algorithms off while they run, so that two
identical computations agree bit for bit.

Both refuse, in every forward they run, Python control flow on several models' data (``if
h.mean() > 0:`` in the model's ``forward``): such a decision is taken once for all models on their pooled
data whatever the inputs, so it is found by watching the forward, not by chance of a seed (a
``BatchModule`` checks its own first forward the same way).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from batch_layers import is_shared_parameter

from ._init import random_state_kept
from ._module import BatchModule
from ._tracking import PooledDecisionError, check_every_forward

__all__ = ["assert_equivalent", "assert_isolated"]

Inputs = Tensor | Sequence[Tensor]
LossFn = Callable[[Any], Tensor]


def default_loss(output: Any) -> Tensor:
    """Mean square of every floating-point tensor in one model's output."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor to build a loss from; pass loss_fn")
    return sum(t.float().square().mean() for t in leaves)


def _as_tuple(inputs: Inputs) -> tuple[Tensor, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


def _model_output(output: Any, index: int) -> Any:
    return tree_map(lambda t: t[index] if isinstance(t, Tensor) else t, output)


@contextlib.contextmanager
def _checking() -> Iterator[None]:
    """cuDNN deterministic, and every forward watched for Python decisions on several models' data."""
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with check_every_forward():
            yield
    except PooledDecisionError as error:
        raise AssertionError(f"the model is not B independent models: {error}") from error
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


def _compare(actual: Tensor, expected: Tensor, what: str, atol: float, rtol: float, report: dict) -> None:
    diff = (actual.detach().double() - expected.detach().double()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    report[what] = worst
    torch.testing.assert_close(
        actual.detach(),
        expected.detach(),
        atol=atol,
        rtol=rtol,
        equal_nan=True,
        msg=lambda m: f"{what}: batched and plain differ (max abs diff {worst:.3g})\n{m}",
    )


def assert_equivalent(
    make_model: Callable[[], nn.Module],
    batch: int,
    inputs: Inputs,
    steps: int = 5,
    *,
    loss_fn: LossFn = default_loss,
    lr: float = 0.05,
    train: bool = True,
    shared_input: bool = False,
    atol: float = 1e-5,
    rtol: float = 0.0,
) -> dict[str, float]:
    """Train a :class:`BatchModule` and B independently held plain models side by side and compare them.

    ``make_model()`` is called B + 1 times: B plain reference models (different weights if it
    initialises randomly), plus one to convert, into which the references' weights are loaded. Each of
    ``steps`` SGD steps compares every model's outputs and every parameter's gradient; the final
    parameters and buffers are compared at the end.

    Args:
        make_model: builds one plain model.
        batch: number of models B.
        inputs: a tensor or tuple of tensors, each ``(B, n, ...)`` (or ``(n, ...)`` with ``shared_input``).
        steps: SGD steps.
        loss_fn: one model's scalar loss from its output; default mean square of the output.
        lr: SGD learning rate.
        train: ``train()`` or ``eval()`` mode for all models.
        shared_input: feed ``inputs`` to every model through the shared-input path.
        atol, rtol: tolerances (fp32 default: max abs diff 1e-5).

    Returns:
        The largest absolute difference seen for each compared quantity.

    Raises:
        AssertionError: naming the step, model and tensor that differ.
    """
    inputs = _as_tuple(inputs)
    references = [make_model() for _ in range(batch)]
    batched = BatchModule(make_model(), batch)
    batched.load_state_dicts([r.state_dict() for r in references])
    for model in (batched, *references):
        model.train(train)
    batched_opt = torch.optim.SGD(batched.parameters(), lr=lr)
    reference_opts = [torch.optim.SGD(r.parameters(), lr=lr) for r in references]
    report: dict[str, float] = {}
    batched_params = dict(batched.module.named_parameters())
    with _checking():
        for step in range(steps):
            batched_opt.zero_grad(set_to_none=True)
            output = batched(*inputs, shared_input=shared_input)
            sum(loss_fn(_model_output(output, i)) for i in range(batch)).backward()
            for i, (reference, opt) in enumerate(zip(references, reference_opts)):
                opt.zero_grad(set_to_none=True)
                own_inputs = inputs if shared_input else tuple(x[i] for x in inputs)
                expected = reference(*own_inputs)
                loss_fn(expected).backward()
                for j, (got, want) in enumerate(
                    zip(tree_flatten(_model_output(output, i))[0], tree_flatten(expected)[0])
                ):
                    _compare(got, want, f"step {step} model {i} output {j}", atol, rtol, report)
                for name, param in reference.named_parameters():
                    grad = batched_params[name].grad
                    if (grad is None) != (param.grad is None):
                        raise AssertionError(f"step {step} model {i}: gradient of {name} exists in only one of the two")
                    if grad is not None:
                        _compare(grad[i], param.grad, f"step {step} model {i} grad {name}", atol, rtol, report)
            batched_opt.step()
            for opt in reference_opts:
                opt.step()
    for i, reference in enumerate(references):
        got_state = batched.state_dict_of(i)
        for key, want in reference.state_dict().items():
            _compare(got_state[key].to(want.dtype), want, f"final model {i} {key}", atol, rtol, report)
    return report


def assert_isolated(
    batched: BatchModule,
    inputs: Inputs,
    *,
    model: int | Sequence[int] | None = None,
    loss_fn: LossFn = default_loss,
    shared_input: bool = False,
    seed: int = 0,
) -> None:
    """Check that disturbing a model leaves every other model bit-identical.

    The disturbed models are ``model`` (an index or several), by default the first and the last: a leak
    along the merged model axis that reaches only later models (a cumulative sum over dim 0) shows when the
    first is disturbed, one that reaches only earlier models when the last is.

    Each disturbance is compared with an undisturbed run from the same state: the disturbed model's input
    replaced by other values, and scaled by ``1e3`` and by ``-1e3`` (not with ``shared_input``; the scaled
    inputs flip the sign of any statistic pooled over the models, so that a decision taken on it by tensor
    ops, ``torch.where(h.mean() > 0, ...)``, changes for the other models), its parameters shifted, and its
    loss made NaN. Every other model's outputs, gradients and buffers (after the forward and backward)
    must not change by a single bit, and a buffer stored once for all models must not change at all; the
    disturbed model's outputs or gradients must change (otherwise the check would prove nothing).
    ``batched``'s state and torch's random state are restored afterwards.

    Raises:
        AssertionError: naming the disturbance, the model and the tensor that changed, or the Python
            decision taken on several models' data.
    """
    inputs = _as_tuple(inputs)
    batch = batched.batch
    victims = [0, batch - 1] if model is None else [model] if isinstance(model, int) else list(model)
    saved = {k: v.clone() for k, v in batched.module.state_dict().items()}
    try:
        with _checking(), random_state_kept():
            for victim in dict.fromkeys(v % batch for v in victims):
                _disturb_one(batched, inputs, victim, saved, loss_fn, shared_input, seed)
    finally:
        batched.module.load_state_dict(saved)
        batched.zero_grad(set_to_none=True)


def _disturb_one(
    batched: BatchModule,
    inputs: tuple[Tensor, ...],
    victim: int,
    saved: dict[str, Tensor],
    loss_fn: LossFn,
    shared_input: bool,
    seed: int,
) -> None:
    """:func:`assert_isolated`'s disturbances of model ``victim``."""
    batch = batched.batch
    # parameters shared by all models (a frozen backbone) have no model's slice to disturb
    params = {name: p for name, p in batched.module.named_parameters() if not is_shared_parameter(p)}
    buffers = dict(batched.module.named_buffers())
    # A non-persistent buffer (not in the state dict) is one constant for all models.
    per_model_keys = batched.per_model_keys()
    per_model = {name: name in saved and name in per_model_keys for name in buffers}

    def run(run_inputs: tuple[Tensor, ...], poison: bool = False, shift: float = 0.0) -> _Run:
        batched.module.load_state_dict(saved)
        if shift:
            with torch.no_grad():
                for p in params.values():
                    p[victim] += shift
        batched.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        output = batched(*run_inputs, shared_input=shared_input)
        losses = torch.stack([loss_fn(_model_output(output, i)) for i in range(batch)])
        if poison:
            losses = losses * torch.where(torch.arange(batch, device=losses.device) == victim, float("nan"), 1.0)
        losses.sum().backward()
        return _Run(
            outputs=[t.detach().clone() for t in tree_flatten(output)[0] if isinstance(t, Tensor)],
            grads={n: p.grad.clone() for n, p in params.items() if p.grad is not None},
            buffers={n: b.detach().clone() for n, b in buffers.items()},
        )

    def check(what: str, base: _Run, disturbed: _Run, changed: Callable[[Tensor, Tensor], bool]) -> None:
        others = [i for i in range(batch) if i != victim]
        victim_changed = False
        for j, (a, b) in enumerate(zip(base.outputs, disturbed.outputs)):
            for i in others:
                if not torch.equal(a[i], b[i]):
                    raise AssertionError(f"{what}: output {j} of model {i} changed when model {victim} was disturbed")
            victim_changed |= changed(a[victim], b[victim])
        for name in base.grads:
            for i in others:
                if not torch.equal(base.grads[name][i], disturbed.grads[name][i]):
                    raise AssertionError(
                        f"{what}: gradient of {name} of model {i} changed when model {victim} was disturbed"
                    )
            victim_changed |= changed(base.grads[name][victim], disturbed.grads[name][victim])
        for name, value in base.buffers.items():
            if not per_model[name]:
                if not torch.equal(value, disturbed.buffers[name]):
                    raise AssertionError(
                        f"{what}: buffer {name}, stored once for all models, changed when model {victim} was "
                        "disturbed: the models share it"
                    )
                continue
            for i in others:
                if not torch.equal(value[i], disturbed.buffers[name][i]):
                    raise AssertionError(
                        f"{what}: buffer {name} of model {i} changed when model {victim} was disturbed"
                    )
        if not victim_changed:
            raise AssertionError(f"{what}: model {victim} itself did not change, so isolation was not tested")

    def differs(a: Tensor, b: Tensor) -> bool:
        return not torch.equal(a, b)

    def non_finite(_: Tensor, b: Tensor) -> bool:
        return bool((~torch.isfinite(b)).any())

    base = run(inputs)
    if not shared_input:
        check("input replaced", base, run(tuple(_replace(x, victim) for x in inputs)), differs)
        for scale in (1e3, -1e3):
            scaled = tuple(_scale(x, victim, scale) for x in inputs)
            if any(s is not x for s, x in zip(scaled, inputs)):
                check(f"input scaled by {scale:g}", base, run(scaled), differs)
    check("parameters", base, run(inputs, shift=0.5), differs)
    check("NaN loss", base, run(inputs, poison=True), non_finite)


@dataclasses.dataclass
class _Run:
    """What one run of :func:`assert_isolated` compares."""

    outputs: list[Tensor]
    grads: dict[str, Tensor]
    buffers: dict[str, Tensor]


def _replace(x: Tensor, victim: int) -> Tensor:
    """``x`` with model ``victim``'s input replaced by other values of its kind."""
    disturbed = x.clone()
    if x.is_floating_point():
        disturbed[victim] = torch.randn_like(x[victim]) * (x[victim].std() + 1)
    else:
        disturbed[victim] = (x[victim] + 1) % (int(x.max()) + 1)
    return disturbed


def _scale(x: Tensor, victim: int, scale: float) -> Tensor:
    """``x`` with model ``victim``'s input multiplied by ``scale`` (``x`` itself if not floating point)."""
    if not x.is_floating_point():
        return x
    disturbed = x.clone()
    disturbed[victim] *= scale
    return disturbed
