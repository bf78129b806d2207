"""The base class of batched optimizers: per-model hyperparameters, step counts and population changes.

Every parameter handed to a batched optimizer has a leading model axis, ``(B, *shape)``, and model ``i``
owns ``p[i]``. Each hyperparameter that the algorithm lets vary is held per model, as a ``(B,)``
float64 tensor on the CPU in ``param_groups[g][name]`` (``betas`` is a pair of them), so a sweep can
give every model its own learning rate, weight decay or momentum. A step turns the hyperparameters and
the per-model step counts into per-model coefficients on the CPU (float64, the arithmetic ``torch.optim``
does in Python), sends them to the device in one copy, and applies them as ``(B, 1, ..., 1)`` tensors
broadcast over each parameter (the fused CUDA path, ``_fused.py``, reads them as ``(B,)`` rows in one
launch per group, and keeps SGD's on the device until a hyperparameter changes). The number of kernel
launches of a step depends on the number of parameter tensors (fused: on the number of groups), never on
B, and each model's arithmetic does not depend on the other models' values.

A step is traceable by ``torch.compile`` without graph breaks: hyperparameters are validated where they are
set, never in ``step()``; state is created lazily by checks of the state dict alone, or, where it depends on
hyperparameter values (momentum buffers), when the values are set. The few host checks an eager step
makes to skip work no model needs (:func:`any_model`, :func:`save_rows`, :func:`shared_values`) give
way, while dynamo traces, to branch-free forms with the same numbers; the fused kernels are not traced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from batch_layers import is_shared_parameter

from . import _population
from ._loading import check_state_layout
from ._population import _as_index, per_model_entries, select_index
from ._values import per_model_values
from ._written import TorchHabits

__all__ = ["BatchOptimizer", "per_model_values"]

NO_MODEL_AXIS = (
    "an offloaded embedding's working rows have no model axis; optimise them with a torch.optim optimizer "
    "through offload.attach (see the offload tutorial)"
)


def check_range(
    name: str,
    values: Tensor,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise naming the models whose ``values`` leave ``[low, high]`` (ends open as asked)."""
    bad = torch.zeros_like(values, dtype=torch.bool)
    if low is not None:
        bad |= values <= low if low_open else values < low
    if high is not None:
        bad |= values >= high if high_open else values > high
    if bool(bad.any()):
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        models = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"Invalid {name}: expected values in {interval}, got {values[bad].tolist()} for models {models}"
        )


# Coefficient helpers: every coefficient is a list with one (B, 1, ..., 1) tensor per parameter tensor,
# so each model's arithmetic is the same whatever the other models' values are (survivors of a select,
# or the models beside one whose hyperparameters changed, continue bit for bit).


def lerp_(xs: list[Tensor], ys: list[Tensor], cs: list[Tensor]) -> None:
    """``x += c * (y - x)``."""
    for x, y, c in zip(xs, ys, cs):
        if c.dtype == x.dtype:
            x.lerp_(y, c)
        else:  # a 16-bit tensor with float32 weights: lerp wants matching dtypes
            x.add_((y - x) * c)


def axpy_(xs: list[Tensor], ys: list[Tensor], cs: list[Tensor]) -> None:
    """``x += c * y``."""
    for x, y, c in zip(xs, ys, cs):
        x.addcmul_(y, c)


def axpy(xs: list[Tensor], ys: list[Tensor], cs: list[Tensor]) -> list[Tensor]:
    """``x + c * y`` as new tensors."""
    return [torch.addcmul(x, y, c) for x, y, c in zip(xs, ys, cs)]


class BatchOptimizer(TorchHabits, torch.optim.Optimizer):
    """Base class of batched optimizers: one independent optimizer per model, stepped as one.

    Subclasses set ``per_model`` (the names of the hyperparameters that may differ between models; a
    name may hold a pair such as ``betas``), ``cpu_state`` (state entries kept on the CPU as float64
    ``(B,)`` tensors, always including ``"step"``), and implement ``_init_state`` and ``_step_group``.

    Args:
        params: tensors with a leading model axis of the same size B, or parameter groups (dicts).
        defaults: the default hyperparameters (numbers or length-B sequences).
    """

    per_model: ClassVar[tuple[str, ...]] = ("lr",)
    cpu_state: ClassVar[tuple[str, ...]] = ("step",)

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any], fused: bool | None = False
    ) -> None:
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None (automatic), True or False, got {fused!r}")
        self._batch: int | None = None
        self._fused_plans: dict[int, tuple[dict[str, Any], Any]] = {}
        self.fused = fused
        self.fused_steps = 0
        """How many parameter-group steps the fused CUDA kernels took (the rest took the reference path)."""
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        # torch pickles (and deep-copies) only defaults, state and param_groups; B and the fused switch too
        return {**super().__getstate__(), "_batch": self._batch, "fused": self.fused, "fused_steps": self.fused_steps}

    def _use_fused(self, params: list[Tensor], tensors: list[Tensor]) -> bool:
        """Whether this step runs the fused kernels: ``fused=None`` takes them where they apply (and the
        ``batch_layers`` backend allows), ``True`` insists (or raises), ``False`` never takes them."""
        if self.fused is False:
            return False
        if torch.compiler.is_compiling():
            # CuPy launches cannot be traced; Inductor fuses the reference step instead
            if self.fused is True:
                raise RuntimeError(
                    f"{type(self).__name__}(fused=True): the fused kernels cannot run inside torch.compile; "
                    "use fused=None, which compiles the reference step (Inductor fuses it)"
                )
            return False
        from . import _fused

        reason = _fused.fused_reason(params, tensors)
        if reason is None:
            return True
        if self.fused is True:
            raise RuntimeError(f"{type(self).__name__}(fused=True) cannot run the fused kernels: {reason}")
        if _fused.cupy is None and params[0].is_cuda and _fused.get_backend() == "cupy":
            raise ImportError(
                "the batch_layers backend 'cupy' was requested but CuPy could not be imported; "
                "install cupy-cuda12x / cupy-cuda13x or use set_backend('auto'|'torch')"
            ) from _fused.CUPY_ERROR
        return False

    def _fused_plan(self, group: dict[str, Any], kind: str):
        """The device-side state of ``group``'s fused step (coefficients, pointer tables), made on first use."""
        plans = self.__dict__.setdefault("_fused_plans", {})  # also after unpickling (torch keeps 3 entries)
        found = plans.get(id(group))
        if found is None or found[0] is not group or found[1].kind != kind:
            from ._fused import FusedStep

            found = plans[id(group)] = (group, FusedStep(kind))  # holds group: its id stays unique
        return found[1]

    # ---- population size and hyperparameters -------------------------------------------------
    @property
    def batch(self) -> int:
        """The number of models B."""
        assert self._batch is not None
        return self._batch

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(_without_shared(type(self).__name__, param_group, self._batch is None))
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                if p.dim() == 0:
                    raise ValueError(
                        f"{type(self).__name__}: parameters need a leading model axis (B, ...), got a 0-d tensor"
                    )
                if getattr(p, "no_model_axis", False):
                    raise ValueError(f"{type(self).__name__}: {NO_MODEL_AXIS}")
                if p.is_complex():
                    raise TypeError(f"{type(self).__name__}: complex parameters are not supported, got {p.dtype}")
                if self._batch is None:
                    self._batch = int(p.shape[0])
                if p.shape[0] != self._batch:
                    raise ValueError(
                        f"{type(self).__name__}: every parameter needs the same leading model axis "
                        f"B = {self._batch}, got a parameter of shape {tuple(p.shape)}"
                    )
            for name in self.per_model:
                group[name] = self._normalize(name, group[name])
            self._check_group(group)
        except Exception:
            self.param_groups.pop()
            raise
        self._init_group_state(group)

    def _normalize(self, name: str, value: Any) -> Any:
        if name == "betas":
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise ValueError(f"betas: expected a pair (beta1, beta2), each a number or {self.batch} numbers")
            betas = (
                per_model_values(value[0], self.batch, "betas[0]"),
                per_model_values(value[1], self.batch, "betas[1]"),
            )
            self._validate("betas", betas)
            return betas
        values = per_model_values(value, self.batch, name)
        self._validate(name, values)
        return values

    def _validate(self, name: str, values: Any) -> None:
        """Raise on out-of-range hyperparameter values (subclasses extend)."""
        if name in ("lr", "eps", "weight_decay", "momentum", "lr_decay", "initial_accumulator_value"):
            check_range(name, values, low=0.0)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raise where ``group``'s hyperparameters do not go together (subclasses extend). Runs where they are
        set (construction, :meth:`set_hyperparameter`, :meth:`load_state_dict`), never in ``step()``."""

    def _init_group_state(self, group: dict[str, Any]) -> None:
        """Create the state that ``group``'s hyperparameter values call for, eagerly wherever they are set, so
        that a compiled step finds it (Adagrad's accumulators, momentum buffers)."""

    def _create_group_state(self, group: dict[str, Any]) -> None:
        """Every parameter's state in ``group`` (one not yet selected down to B models gets it at its first step)."""
        for p in group["params"]:
            if p.shape[0] == self.batch:
                self.state_for(p, group)

    def get_hyperparameter(self, name: str, group: int = 0) -> Any:
        """A copy of the per-model values of ``name`` in ``param_groups[group]``: ``(B,)`` float64."""
        value = self.param_groups[group][name]
        if isinstance(value, tuple):
            return tuple(v.clone() for v in value)
        return value.clone() if isinstance(value, Tensor) else value

    def set_hyperparameter(self, name: str, value: Any, group: int | None = None) -> None:
        """Set ``name`` to a number (all models) or B numbers, in one parameter group or (None) all of them.

        ``betas`` takes a pair; ``beta1`` / ``beta2`` set one half of it.
        """
        groups = self.param_groups if group is None else [self.param_groups[group]]
        half = {"beta1": 0, "beta2": 1}.get(name) if "betas" in self.per_model else None
        key = "betas" if half is not None else name
        if key not in self.per_model:
            raise KeyError(
                f"{type(self).__name__} has no per-model hyperparameter {name!r}; "
                f"expected one of {list(self.per_model)}"
            )
        updates = []  # every group is checked before any changes
        for g in groups:
            new = value
            if half is not None:
                new = list(g["betas"])
                new[half] = value
            new = self._normalize(key, tuple(new) if half is not None else new)
            self._check_group({**g, key: new})
            updates.append((g, new))
        for g, new in updates:
            g[key] = new
            self._init_group_state(g)

    def step_counts(self) -> Tensor:
        """The number of steps each model has taken: ``(B,)`` float64 (the largest over its parameters)."""
        counts = torch.zeros(self.batch, dtype=torch.float64)
        for state in self.state.values():
            if "step" in state:
                counts = torch.maximum(counts, state["step"])
        return counts

    # ---- population changes -------------------------------------------------------------------
    def per_model_hyperparameters(self, group: dict[str, Any]) -> list[str]:
        """The entries of ``group`` held per model, ``(B,)`` each (a pair of them for ``betas``): the
        hyperparameters, and those a scheduler stored in the group (``initial_lr``)."""
        return per_model_entries(group, self.batch)

    def select(self, keep: Any) -> None:
        """Keep only the models ``keep`` (distinct indices, in the new order, or a bool mask of length B).

        Re-indexes every per-model hyperparameter (including those a scheduler stored in the groups,
        such as ``initial_lr``) and every state tensor along the model axis. Call it with the same
        ``keep`` as ``BatchModule.select``, before or after it; the survivors then continue exactly as
        they would have.
        """
        index = select_index(keep, self.batch)
        self.__dict__.pop("_fused_plans", None)
        for group in self.param_groups:
            for key in self.per_model_hyperparameters(group):
                value = group[key]
                group[key] = tuple(v[index] for v in value) if isinstance(value, tuple) else value[index]
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                for key, value in state.items():
                    if isinstance(value, Tensor) and value.dim() and value.shape[0] == self.batch:
                        state[key] = value[index.to(value.device)]
        self._batch = int(index.numel())

    def load_model_state(
        self, dst: Any, source: BatchOptimizer | None = None, src: Any = None, *, hyperparameters: bool = True
    ) -> None:
        """Copy models' optimizer state into other slots (population-based training's exploit step).

        Args:
            dst: destination model index, or a sequence of them.
            source: the optimizer to copy from (``None``: this one). It must be the same class with the
                same parameter groups and parameter shapes (its B may differ).
            src: source model index / indices in ``source``, one per ``dst``.
            hyperparameters: also copy the per-model hyperparameters (PBT's exploit copies them and then
                perturbs them with :meth:`set_hyperparameter`).

        Only optimizer state is copied; copy the weights with the model (``BatchModule``).
        """
        _population.load_model_state(self, dst, source, src, hyperparameters=hyperparameters)
        if hyperparameters:  # a copied momentum may call for state (momentum buffers) that the slots lacked
            for group in self.param_groups:
                self._init_group_state(group)

    # ---- state --------------------------------------------------------------------------------
    def state_for(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """``p``'s state in ``group``, its missing entries created as a step creates them."""
        state = self.state[p]
        if p.shape[0] != self.batch:
            raise ValueError(
                f"{type(self).__name__}: a parameter has shape {tuple(p.shape)} but the optimizer "
                f"holds B = {self.batch} models; call optimizer.select(keep) with the same keep "
                "as BatchModule.select(keep)"
            )
        if "step" not in state:
            state["step"] = torch.zeros(self.batch, dtype=torch.float64)
        self._init_state(p, group, state)
        return state

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Add the state entries of ``p`` that are missing (called before every step; idempotent)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As in ``torch.optim``; the whole state is checked first (its number of models, hyperparameter
        values, state shapes), and a state that does not fit changes nothing."""
        self._check_loadable(state_dict)
        super().load_state_dict(state_dict)
        self.__dict__.pop("_fused_plans", None)
        for group in self.param_groups:
            for name in self.per_model:
                group[name] = self._normalize(name, group[name])
        for state in self.state.values():
            for key in self.cpu_state:
                if key in state:
                    state[key] = state[key].to("cpu", torch.float64)
        for group in self.param_groups:
            self._init_group_state(group)

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Raise where ``state_dict`` does not fit this optimizer, before anything is loaded."""
        owner = type(self).__name__
        check_state_layout(state_dict, self.param_groups, self.batch, self.per_model, self.cpu_state, owner)
        for saved in state_dict["param_groups"]:
            self._check_group({**saved, **{name: self._normalize(name, saved[name]) for name in self.per_model}})

    # ---- stepping -----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As in ``torch.optim``. torch marks its own ``zero_grad`` as not to be traced, a graph break in a
        compiled training step; compiled, ``set_to_none=True`` is traced here instead."""
        if not (set_to_none and torch.compiler.is_compiling()):
            super().zero_grad(set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _coefficients(self, params: list[Tensor], values: dict[str, list[Tensor]]) -> dict[str, list[Tensor]]:
        """Per-parameter ``(B,)`` float64 CPU values as ``(B, 1, ..., 1)`` device tensors, in one copy per device.

        Coefficients are float32 for 16-bit parameters (their arithmetic runs in float32, as with the
        Python numbers ``torch.optim`` passes) and the parameter's dtype otherwise.
        """
        keys = []  # per parameter: (device, coefficient dtype, dims)
        for p in params:
            dtype = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
            keys.append((p.device, dtype, p.dim()))
        stacked: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        rows = {  # per name and parameter: the row of its vector among those stacked for its device and dtype
            name: [position(stacked.setdefault(key[:2], []), v) for key, v in zip(keys, per_param)]
            for name, per_param in values.items()
        }
        moved: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        for (device, dtype), vectors in stacked.items():
            host = torch.stack(vectors).to(dtype)
            if device.type == "cuda" and not torch.compiler.is_compiling():  # a graph's copy is Inductor's
                moved[(device, dtype)] = host.pin_memory().to(device, non_blocking=True)
            else:
                moved[(device, dtype)] = host.to(device)
        views: dict[tuple, Tensor] = {}
        out: dict[str, list[Tensor]] = {}
        for name, per_param in rows.items():
            column = []
            for key, row in zip(keys, per_param):
                view = views.get((*key, row))
                if view is None:
                    view = views[(*key, row)] = moved[key[:2]][row].view(-1, *([1] * (key[2] - 1)))
                column.append(view)
            out[name] = column
        return out

    def _skip_mask(self, skip: Any) -> Tensor | None:
        """``skip`` as a ``(B,)`` bool CPU mask; None where no model skips, which only an eager step can check
        (compiled, a bool mask is kept whatever it holds, and indices are not traceable)."""
        if skip is None:
            return None
        if isinstance(skip, Tensor) and skip.dtype == torch.bool and skip.shape == (self.batch,):
            mask = skip.detach().to("cpu")
        else:  # indices, or a mask of the wrong shape for _as_index to refuse
            mask = torch.zeros(self.batch, dtype=torch.bool)
            mask[_as_index(skip, self.batch, "skip")] = True
        return mask if any_model(mask) else None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, skip: Any = None) -> Any:
        """Take one optimization step for every model.

        Args:
            closure: re-evaluates the model and returns the loss (as in ``torch.optim``).
            skip: models that must not step this time (a bool mask of length B or indices): their
                weights, state and step counts stay exactly as they are. ``torchmb.amp.GradScaler``
                uses it to skip only the models whose gradients overflowed. Under ``torch.compile`` give
                a bool mask tensor (indices are read on the host).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip_mask = self._skip_mask(skip)
        for group in self.param_groups:
            params, grads, states = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.shape[0] != self.batch:
                    raise ValueError(
                        f"{type(self).__name__}: a parameter has shape {tuple(p.shape)} but the optimizer "
                        f"holds B = {self.batch} models; call optimizer.select(keep) with the same keep "
                        "as BatchModule.select(keep)"
                    )
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if p.grad.shape != p.shape:
                    raise ValueError(
                        f"{type(self).__name__}: gradient of shape {tuple(p.grad.shape)} for a parameter "
                        f"of shape {tuple(p.shape)}"
                    )
                params.append(p)
                grads.append(p.grad)
                states.append(self.state_for(p, group))
            if not params:
                continue
            steps = [state["step"] for state in states]
            if all(s is steps[0] for s in steps):  # the usual case (one object, see below): one addition
                counts = [steps[0] + 1] * len(steps)
            else:  # equal counts share one object, so per-count coefficients are computed and sent once
                counts = shared_values([s + 1 for s in steps])
            kept = []  # skipped models keep their rows of these (and their step counts, below)
            if skip_mask is not None:
                owned = [v for s in states for k, v in s.items() if isinstance(v, Tensor) and k not in self.cpu_state]
                kept = save_rows([*params, *owned], skip_mask)
            self._step_group(group, params, grads, states, counts, skip_mask)
            for state, count in zip(states, counts):
                state["step"] = count if skip_mask is None else torch.where(skip_mask, state["step"], count)
            restore_rows(kept)
        return loss

    def _step_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: list[dict[str, Any]],
        counts: list[Tensor],
        skip_mask: Tensor | None,
    ) -> None:
        raise NotImplementedError


def _without_shared(optimizer: str, group: dict[str, Any], first: bool) -> dict[str, Any]:
    """``group`` less the frozen parameters that all models share (stored once, without a model axis: a
    ``BatchModule``'s frozen backbone, which ``bm.parameters()`` lists). One that requires grad is refused."""
    params = group["params"]
    params = [params] if isinstance(params, Tensor) else list(params)
    trainable_shared = [tuple(p.shape) for p in params if is_shared_parameter(p) and p.requires_grad]
    if trainable_shared:
        raise ValueError(
            f"{optimizer}: parameters of shapes {trainable_shared} are shared by all models (stored once, without "
            "a model axis) and require grad; one tensor trained from every model's gradient would tie the models "
            "together: freeze them again (requires_grad_(False)), or build the BatchModule with shared=... leaving "
            "them out, so that each model trains its own"
        )
    kept = [p for p in params if not is_shared_parameter(p)]
    if first and params and not kept:
        raise ValueError(
            f"{optimizer}: no per-model parameter to optimise: every one given is shared by all models (frozen, "
            "stored once)"
        )
    return {**group, "params": kept}


def shared_values(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` with equal ones replaced by one object (the first of them), so per-object work runs once.

    Compiled, ``tensors`` are returned as they are: merging compares values, which a graph cannot branch on,
    and Inductor fuses the per-object work anyway.
    """
    first = tensors[0]
    if all(t is first for t in tensors) or torch.compiler.is_compiling():
        return tensors
    distinct: list[Tensor] = []
    out = []
    for t in tensors:
        for d in distinct:
            if t is d or torch.equal(t, d):
                out.append(d)
                break
        else:
            distinct.append(t)
            out.append(t)
    return out


def position(seen: list[Tensor], t: Tensor) -> int:
    """The index of the object ``t`` in ``seen``, appended if new.

    Identity, not ``id()``: dynamo guards on the ``id`` of a tensor it reads from the optimizer, so a compiled
    step would recompile whenever a step replaces a state tensor or a scheduler a hyperparameter. The newest
    entries are looked at first, since one object repeated for every parameter is the usual case.
    """
    for i in range(len(seen) - 1, -1, -1):
        if seen[i] is t:
            return i
    seen.append(t)
    return len(seen) - 1


def set_indices(tensors: list[Tensor]) -> tuple[list[int], list[Tensor]]:
    """Per entry, the index of its object among the distinct objects of ``tensors``; and those objects."""
    distinct: list[Tensor] = []
    return [position(distinct, t) for t in tensors], distinct


def per_count(counts: list[Tensor], fn: Callable[[Tensor], Any]) -> list[Any]:
    """``[fn(c) for c in counts]``, computing once per distinct tensor object."""
    sets, distinct = set_indices(counts)
    results = [fn(c) for c in distinct]
    return [results[i] for i in sets]


def any_model(mask: Tensor) -> bool:
    """Whether any model's entry of the host ``(B,)`` bool ``mask`` is set, so that an eager step can skip work
    that no model needs. A compiled graph cannot branch on values: there it is True and the work is done for
    every model; each caller says why that gives the numbers an eager step gives."""
    return torch.compiler.is_compiling() or bool(mask.any())


def state_needed(mask: Tensor, what: str) -> bool:
    """Whether a step creates state that only the models set in the host ``(B,)`` bool ``mask`` use.

    A compiled graph cannot create state depending on values: the optimizer creates it when the values are
    set (``_init_group_state``), and a graph that finds it missing checks on the device that no model needs
    it, so a value written straight into ``param_groups`` fails loudly instead of stepping without ``what``.
    """
    if torch.compiler.is_compiling():
        torch._assert_async(
            ~mask.any(),
            f"{what} became non-zero without set_hyperparameter (a direct write to param_groups); its state does "
            "not exist yet: set it with set_hyperparameter, or take one eager step before the compiled ones",
        )
        return False
    return bool(mask.any())


def prepare_grads(
    params: list[Tensor],
    grads: list[Tensor],
    maximize: bool,
    weight_decay: Tensor | None,
    coefs: dict[str, list[Tensor]],
) -> list[Tensor]:
    """``-grad`` when maximizing, plus L2 weight decay (``None``: the optimizer has none; else when any model
    has some), without touching ``.grad``.

    Compiled, the decay is always added: what an eager step adds when some model has decay, and for a model
    without it ``g + 0 * p``, which is ``g`` for finite weights.
    """
    if maximize:
        grads = list(torch._foreach_neg(grads))
    if weight_decay is not None and any_model(weight_decay != 0):
        grads = axpy(grads, params, coefs["weight_decay"])
    return grads


def zero_mask(values: list[Tensor]) -> Tensor:
    """The models whose value is 0 in any of the per-parameter ``(B,)`` vectors, as a bool mask."""
    mask = torch.zeros_like(values[0], dtype=torch.bool)
    for v in values:
        mask |= v == 0
    return mask


def save_rows(tensors: list[Tensor], mask: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The rows of ``tensors`` of the models set in ``mask``, for :func:`restore_rows` to put back after a block.

    Used for models that skip a step, and for models whose step size is 0: a per-model step size folded
    into a denominator (``p += m / (d / s)``) cannot express ``s == 0``, so those models' weights are
    restored, which is what ``p += 0 * m / d`` leaves for finite values. Eagerly only the rows named are
    copied (none when no model is set); compiled, which rows is a value the graph cannot branch on, so whole
    tensors are kept and the restore selects per model (Inductor fuses it into the step).
    """
    if torch.compiler.is_compiling():
        return [(t, mask.to(t.device).view(-1, *([1] * (t.dim() - 1))), t.clone()) for t in tensors]
    index = mask.nonzero().flatten()
    if not index.numel():
        return []
    saved = []
    for t in tensors:
        idx = index.to(t.device)
        saved.append((t, idx, t.index_select(0, idx)))
    return saved


def restore_rows(saved: list[tuple[Tensor, Tensor, Tensor]]) -> None:
    """Put back what :func:`save_rows` kept: ``(tensor, model indices or a broadcast mask, old values)``."""
    for t, where, old in saved:
        if where.dtype == torch.bool:
            t.copy_(torch.where(where, old, t))
        else:
            t.index_copy_(0, where, old)
