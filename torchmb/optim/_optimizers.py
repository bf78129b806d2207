"""Batched SGD, Adam, AdamW, RMSprop and Adagrad with per-model hyperparameters.

Each class follows the update of its ``torch.optim`` namesake for every model separately, with per-model
coefficients broadcast as ``(B, 1, ..., 1)`` tensors. Where a per-model step size has to be folded into a
denominator, the arithmetic is ``torch.optim``'s own capturable form (``p += m / (d / s)``), equal to the
plain form up to float rounding; each step makes as many passes over the parameters as
``torch.optim``'s multi-tensor (``foreach``) step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ._base import (
    BatchOptimizer,
    any_model,
    axpy,
    axpy_,
    check_range,
    lerp_,
    per_count,
    prepare_grads,
    restore_rows,
    save_rows,
    set_indices,
    shared_values,
    state_needed,
    zero_mask,
)

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "RMSprop"]

Params = Iterable[Tensor] | Iterable[dict[str, Any]]

_PER_MODEL_NOTE = """
    Every hyperparameter listed as per-model takes a number (all models) or a length-B sequence or
    tensor (one value per model); they are stored as ``(B,)`` float64 tensors in ``param_groups`` and
    changed with :meth:`set_hyperparameter` or a ``torchmb.lr_scheduler`` scheduler.
"""


class SGD(BatchOptimizer):
    __doc__ = f"""Stochastic gradient descent, one independent ``torch.optim.SGD`` per model.

    Args:
        params: parameters with a leading model axis ``(B, ...)``, or parameter groups.
        lr, momentum, dampening, weight_decay: per-model hyperparameters, as in ``torch.optim.SGD``.
        nesterov: Nesterov momentum (needs every model's momentum > 0 and dampening 0).
        maximize: maximize the objective instead of minimizing it.
    {_PER_MODEL_NOTE}
    A model whose momentum is 0 keeps no momentum history (as ``torch.optim.SGD`` creates none); if its
    momentum later becomes non-zero its buffer starts from that step's gradient. The momentum buffers are
    created when a non-zero momentum is set (construction, :meth:`set_hyperparameter`,
    :meth:`load_state_dict`), so that a compiled step finds them.

    Examples:
        >>> w = torch.nn.Parameter(torch.randn(4, 3, 2))  # 4 models' (3, 2) weights
        >>> opt = SGD([w], lr=[0.1, 0.01, 0.001, 0.0001], momentum=0.9)
    """

    per_model = ("lr", "momentum", "dampening", "weight_decay")
    cpu_state = ("step", "momentum_started")

    def __init__(
        self,
        params: Params,
        lr: Any = 1e-3,
        momentum: Any = 0.0,
        dampening: Any = 0.0,
        weight_decay: Any = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        fused: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, fused=fused)

    def _check_group(self, group: dict[str, Any]) -> None:
        if group["nesterov"] and (bool((group["momentum"] <= 0).any()) or bool((group["dampening"] != 0).any())):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening for every model")

    def _init_group_state(self, group: dict[str, Any]) -> None:
        if bool((group["momentum"] != 0).any()):
            self._create_group_state(group)

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if "momentum_buffer" not in state and state_needed(group["momentum"] != 0, "SGD momentum"):
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["momentum_started"] = torch.zeros(self.batch, dtype=torch.float64)

    def _step_group(self, group, params, grads, states, counts, skip_mask) -> None:
        has_buffers = "momentum_buffer" in states[0]
        bufs = [state["momentum_buffer"] for state in states] if has_buffers else None
        flags = shared_values([state["momentum_started"] for state in states]) if has_buffers else None
        if self._use_fused(params, [*params, *grads, *(bufs or [])]):
            self._fused_step(group, params, grads, bufs, flags)
            self.fused_steps += 1
        else:
            coefs = self._coefficients(params, self._values(group, flags, len(params)))
            self._reference_step(group, params, grads, bufs, coefs)
        if flags is not None:  # after the launch: this host work overlaps the kernel
            active = group["momentum"] != 0

            def advance(flag: Tensor) -> Tensor:
                old = flag != 0
                started = old | active if skip_mask is None else torch.where(skip_mask, old, old | active)
                return started.to(torch.float64)

            for state, started in zip(states, per_count(flags, advance)):
                state["momentum_started"] = started

    @staticmethod
    def _values(group: dict[str, Any], flags: list[Tensor] | None, n: int) -> dict[str, list[Tensor]]:
        """Per-parameter coefficients, ``(B,)`` float64 each (``flags``: per parameter, or None without momentum)."""
        lr, momentum, dampening, wd = group["lr"], group["momentum"], group["dampening"], group["weight_decay"]
        values: dict[str, list[Tensor]] = {"neg_lr": [-lr] * n, "weight_decay": [wd] * n}
        if flags is not None:
            active = momentum != 0

            def mom_damp(flag: Tensor) -> tuple[Tensor, Tensor]:
                started = (flag != 0) & active
                return torch.where(started, momentum, 0.0), torch.where(started, 1 - dampening, 1.0)

            per = per_count(flags, mom_damp)
            values["mom"], values["damp"] = [c[0] for c in per], [c[1] for c in per]
            values["momentum"] = [momentum] * n
        return values

    def _fused_step(self, group, params, grads, bufs, flags) -> None:
        """One launch for the group; the coefficients stay on the device until a hyperparameter changes."""
        from . import _fused

        plan = self._fused_plan(group, "sgd")
        if flags is None:
            sets, distinct = [0] * len(params), []
        else:
            sets, distinct = set_indices(flags)
        key = (group["lr"], group["momentum"], group["dampening"], group["weight_decay"], *distinct)
        if not plan.coefficients_match(key):
            values = self._values(group, distinct if flags is not None else None, max(1, len(distinct)))
            host = torch.zeros(max(1, len(distinct)), 5, self.batch, dtype=torch.float64)
            for s in range(host.shape[0]):
                host[s, 0], host[s, 1] = values["neg_lr"][s], values["weight_decay"][s]
                if flags is not None:
                    host[s, 2], host[s, 3], host[s, 4] = values["mom"][s], values["damp"][s], values["momentum"][s]
            plan.set_coefficients(host, params[0].device, key)
            plan.meta["weight_decay"] = bool((group["weight_decay"] != 0).any())
        bits = (
            (_fused.SGD_MAXIMIZE if group["maximize"] else 0)
            | (_fused.SGD_WEIGHT_DECAY if plan.meta["weight_decay"] else 0)
            | (_fused.SGD_MOMENTUM if bufs is not None else 0)
            | (_fused.SGD_NESTEROV if group["nesterov"] else 0)
        )
        tensors = [(p, g, bufs[i] if bufs is not None else p) for i, (p, g) in enumerate(zip(params, grads))]
        plan.launch(tensors, sets, bits)

    @staticmethod
    def _reference_step(group, params, grads, bufs, coefs) -> None:
        grads = prepare_grads(params, grads, group["maximize"], group["weight_decay"], coefs)
        if bufs is not None:
            torch._foreach_mul_(bufs, coefs["mom"])
            axpy_(bufs, grads, coefs["damp"])
            grads = axpy(grads, bufs, coefs["momentum"]) if group["nesterov"] else bufs
        axpy_(params, grads, coefs["neg_lr"])


class Adam(BatchOptimizer):
    __doc__ = f"""Adam, one independent ``torch.optim.Adam`` per model.

    Args:
        params: parameters with a leading model axis ``(B, ...)``, or parameter groups.
        lr, betas, eps, weight_decay: per-model hyperparameters, as in ``torch.optim.Adam``
            (``betas`` is a pair whose halves are each a number or B numbers).
        amsgrad: use the AMSGrad variant.
        maximize: maximize the objective instead of minimizing it.
    {_PER_MODEL_NOTE}
    Examples:
        >>> w = torch.nn.Parameter(torch.randn(3, 5))
        >>> opt = Adam([w], lr=torch.logspace(-4, -2, 3), betas=(0.9, [0.99, 0.999, 0.9999]))
    """

    per_model = ("lr", "betas", "eps", "weight_decay")
    cpu_state = ("step",)
    decoupled_weight_decay = False

    def __init__(
        self,
        params: Params,
        lr: Any = 1e-3,
        betas: tuple[Any, Any] = (0.9, 0.999),
        eps: Any = 1e-8,
        weight_decay: Any = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        fused: bool | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, fused=fused)

    def _validate(self, name: str, values: Any) -> None:
        if name == "betas":
            check_range("beta parameter at index 0", values[0], 0.0, 1.0, high_open=True)
            check_range("beta parameter at index 1", values[1], 0.0, 1.0, high_open=True)
        else:
            super()._validate(name, values)

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states, counts, skip_mask) -> None:
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        max_sqs = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else None
        if self._use_fused(params, [*params, *grads, *exp_avgs, *exp_avg_sqs, *(max_sqs or [])]):
            self._fused_step(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, counts)
            self.fused_steps += 1
            return
        n = len(params)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        # torch's capturable Adam: denom = sqrt(v) / (bc2_sqrt * -step_size) + eps / -step_size, p += m / denom.
        # A model whose step size is 0 folds in 1 instead and gets its weights restored afterwards.

        def coefficients(count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            step_size = lr / (1 - beta1**count)
            safe = torch.where(step_size == 0, 1.0, step_size)
            return step_size, (1 - beta2**count) ** 0.5 * -safe, eps / -safe

        per = per_count(counts, coefficients)
        step_size = [c[0] for c in per]
        values: dict[str, list[Tensor]] = {
            "one_minus_beta1": [1 - beta1] * n,
            "one_minus_beta2": [1 - beta2] * n,
            "scale": [c[1] for c in per],
            "eps_scaled": [c[2] for c in per],
        }
        if self.decoupled_weight_decay:
            values["decay"] = [1 - lr * wd] * n
            l2 = None
        else:
            values["weight_decay"] = [wd] * n
            l2 = wd
        coefs = self._coefficients(params, values)
        if self.decoupled_weight_decay and any_model(wd != 0):  # compiled always: p * (1 - lr * 0) is p exactly
            torch._foreach_mul_(params, coefs["decay"])
        grads = prepare_grads(params, grads, group["maximize"], l2, coefs)
        lerp_(exp_avgs, grads, coefs["one_minus_beta1"])
        # v = beta2 * v + (1 - beta2) * g^2, as a lerp towards g^2: the same two passes as torch's mul_ + addcmul_
        lerp_(exp_avg_sqs, torch._foreach_mul(grads, grads), coefs["one_minus_beta2"])
        if max_sqs is not None:
            torch._foreach_maximum_(max_sqs, exp_avg_sqs)
            denom = torch._foreach_sqrt(max_sqs)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, coefs["scale"])
        torch._foreach_add_(denom, coefs["eps_scaled"])
        kept = save_rows(params, zero_mask(step_size))
        torch._foreach_addcdiv_(params, exp_avgs, denom)
        restore_rows(kept)

    def _fused_step(self, group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, counts) -> None:
        """torch's plain single-tensor Adam per element, one launch for the group.

        The coefficients that depend only on the hyperparameters are kept (host side) until one changes;
        the bias corrections change with the step counts, so the coefficients are uploaded every step.
        """
        from . import _fused

        plan = self._fused_plan(group, "adam")
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        key = (lr, beta1, beta2, eps, wd)
        if not _fused.same_values(plan.meta.get("key"), key):
            decoupled = self.decoupled_weight_decay and bool((wd != 0).any())
            l2 = not self.decoupled_weight_decay and bool((wd != 0).any())
            static = torch.zeros(8, self.batch, dtype=torch.float64)
            static[0], static[1], static[2], static[5] = 1 - beta1, beta2, 1 - beta2, eps
            if l2:
                static[6] = wd
            if decoupled:
                static[7] = 1 - lr * wd
            plan.meta.update(key=tuple(k.clone() for k in key), static=static, l2=l2, decoupled=decoupled)
        sets, distinct = set_indices(counts)
        host = plan.meta["static"].repeat(len(distinct), 1, 1)
        for s, count in enumerate(distinct):
            host[s, 3] = -(lr / (1 - beta1**count))
            host[s, 4] = (1 - beta2**count) ** 0.5
        plan.set_coefficients(host, params[0].device)
        bits = (
            (_fused.ADAM_MAXIMIZE if group["maximize"] else 0)
            | (_fused.ADAM_L2 if plan.meta["l2"] else 0)
            | (_fused.ADAM_DECOUPLED if plan.meta["decoupled"] else 0)
            | (_fused.ADAM_AMSGRAD if max_sqs is not None else 0)
        )
        tensors = [
            (p, g, m, v, max_sqs[i] if max_sqs is not None else v)
            for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs))
        ]
        plan.launch(tensors, sets, bits)


class AdamW(Adam):
    __doc__ = f"""AdamW (decoupled weight decay), one independent ``torch.optim.AdamW`` per model.

    Args:
        params: parameters with a leading model axis ``(B, ...)``, or parameter groups.
        lr, betas, eps, weight_decay: per-model hyperparameters, as in ``torch.optim.AdamW``.
        amsgrad: use the AMSGrad variant.
        maximize: maximize the objective instead of minimizing it.
    {_PER_MODEL_NOTE}
    """

    decoupled_weight_decay = True

    def __init__(
        self,
        params: Params,
        lr: Any = 1e-3,
        betas: tuple[Any, Any] = (0.9, 0.999),
        eps: Any = 1e-8,
        weight_decay: Any = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            fused=fused,
        )


class RMSprop(BatchOptimizer):
    __doc__ = f"""RMSprop, one independent ``torch.optim.RMSprop`` per model.

    Args:
        params: parameters with a leading model axis ``(B, ...)``, or parameter groups.
        lr, alpha, eps, weight_decay, momentum: per-model hyperparameters, as in ``torch.optim.RMSprop``.
        centered: normalize by the centered second moment.
        maximize: maximize the objective instead of minimizing it.
    {_PER_MODEL_NOTE}
    """

    per_model = ("lr", "alpha", "eps", "weight_decay", "momentum")

    def __init__(
        self,
        params: Params,
        lr: Any = 1e-2,
        alpha: Any = 0.99,
        eps: Any = 1e-8,
        weight_decay: Any = 0.0,
        momentum: Any = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _validate(self, name: str, values: Any) -> None:
        if name == "alpha":
            check_range("alpha", values, 0.0)
        else:
            super()._validate(name, values)

    def _init_group_state(self, group: dict[str, Any]) -> None:
        if bool((group["momentum"] > 0).any()):
            self._create_group_state(group)

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if "square_avg" not in state:
            state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if "momentum_buffer" not in state and state_needed(group["momentum"] > 0, "RMSprop momentum"):
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["centered"] and "grad_avg" not in state:
            state["grad_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _step_group(self, group, params, grads, states, counts, skip_mask) -> None:
        n = len(params)
        lr, alpha, eps, wd = group["lr"], group["alpha"], group["eps"], group["weight_decay"]
        has_buffers = "momentum_buffer" in states[0]
        values: dict[str, list[Tensor]] = {
            "one_minus_alpha": [1 - alpha] * n,
            "eps": [eps] * n,
            "weight_decay": [wd] * n,
        }
        if has_buffers:
            values["momentum"] = [group["momentum"]] * n
            values["neg_lr"] = [-lr] * n
        else:  # p += g / (avg / -lr); a model with lr 0 folds in -1 and gets its weights restored
            values["neg_lr"] = [torch.where(lr == 0, -1.0, -lr)] * n
        coefs = self._coefficients(params, values)
        grads = prepare_grads(params, grads, group["maximize"], wd, coefs)
        square_avgs = [s["square_avg"] for s in states]
        lerp_(square_avgs, torch._foreach_mul(grads, grads), coefs["one_minus_alpha"])
        if group["centered"]:
            grad_avgs = [s["grad_avg"] for s in states]
            lerp_(grad_avgs, grads, coefs["one_minus_alpha"])
            avg = list(torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1))
            torch._foreach_sqrt_(avg)
        else:
            avg = list(torch._foreach_sqrt(square_avgs))
        torch._foreach_add_(avg, coefs["eps"])
        if has_buffers:
            bufs = [s["momentum_buffer"] for s in states]
            torch._foreach_mul_(bufs, coefs["momentum"])
            torch._foreach_addcdiv_(bufs, grads, avg)
            axpy_(params, bufs, coefs["neg_lr"])
        else:
            torch._foreach_div_(avg, coefs["neg_lr"])
            kept = save_rows(params, zero_mask([lr]))
            torch._foreach_addcdiv_(params, grads, avg)
            restore_rows(kept)


class Adagrad(BatchOptimizer):
    __doc__ = f"""Adagrad, one independent ``torch.optim.Adagrad`` per model.

    Args:
        params: parameters with a leading model axis ``(B, ...)``, or parameter groups.
        lr, lr_decay, weight_decay, initial_accumulator_value, eps: per-model hyperparameters, as in
            ``torch.optim.Adagrad`` (the accumulator is created at construction, as there).
        maximize: maximize the objective instead of minimizing it.
    {_PER_MODEL_NOTE}
    """

    per_model = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")

    def __init__(
        self,
        params: Params,
        lr: Any = 1e-2,
        lr_decay: Any = 0.0,
        weight_decay: Any = 0.0,
        initial_accumulator_value: Any = 0.0,
        eps: Any = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _init_group_state(self, group: dict[str, Any]) -> None:
        self._create_group_state(group)

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if "sum" not in state:  # each model's initial value, rounded to p's dtype as torch.full_like would
            init = group["initial_accumulator_value"].to(p.device, p.dtype).view(-1, *([1] * (p.dim() - 1)))
            state["sum"] = torch.empty_like(p, memory_format=torch.preserve_format).copy_(init.expand_as(p))

    def _step_group(self, group, params, grads, states, counts, skip_mask) -> None:
        n = len(params)
        lr, lr_decay, eps, wd = group["lr"], group["lr_decay"], group["eps"], group["weight_decay"]
        clr = per_count(counts, lambda c: lr / (1 + (c - 1) * lr_decay))
        # p += g / (std / -clr); a model with clr 0 folds in -1 and gets its weights restored
        values: dict[str, list[Tensor]] = {
            "eps": [eps] * n,
            "weight_decay": [wd] * n,
            "neg_clr": per_count(clr, lambda c: torch.where(c == 0, -1.0, -c)),
        }
        coefs = self._coefficients(params, values)
        grads = prepare_grads(params, grads, group["maximize"], wd, coefs)
        sums = [s["sum"] for s in states]
        torch._foreach_addcmul_(sums, grads, grads, value=1.0)
        std = list(torch._foreach_sqrt(sums))
        torch._foreach_add_(std, coefs["eps"])
        torch._foreach_div_(std, coefs["neg_clr"])
        kept = save_rows(params, zero_mask(clr))
        torch._foreach_addcdiv_(params, grads, std)
        restore_rows(kept)
