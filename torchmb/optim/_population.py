"""Copying models' optimizer state between slots of batched optimizers (population-based training's exploit
step): :meth:`BatchOptimizer.load_model_state <torchmb.optim.BatchOptimizer.load_model_state>`."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor


class ModelStates(Protocol):
    """What copying models' state between slots needs of an optimizer (``BatchOptimizer`` is one)."""

    param_groups: list[dict[str, Any]]
    cpu_state: tuple[str, ...]

    @property
    def batch(self) -> int: ...

    def per_model_hyperparameters(self, group: dict[str, Any]) -> list[str]: ...

    def state_for(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]: ...


def per_model_entries(group: dict[str, Any], batch: int) -> list[str]:
    """The entries of a parameter group held per model: ``(B,)`` tensors, or tuples of them (``betas``)."""
    names = []
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, Tensor) and value.shape == (batch,):
            names.append(key)
        elif isinstance(value, tuple) and value and all(isinstance(v, Tensor) and v.shape == (batch,) for v in value):
            names.append(key)
    return names


def _as_index(keep: Any, batch: int, what: str = "keep", *, distinct: bool = False) -> Tensor:
    """``keep`` (bool mask of length B, or a sequence/tensor of model indices) as a CPU int64 index; with
    ``distinct``, a model named twice is refused."""
    if isinstance(keep, Tensor):
        index = keep.detach().to("cpu")
    else:
        index = torch.as_tensor(list(keep) if not isinstance(keep, (list, tuple)) else keep)
    if index.dtype == torch.bool:
        if index.shape != (batch,):
            raise ValueError(
                f"{what}: a boolean mask must have shape ({batch},) (one entry per model), got {tuple(index.shape)}"
            )
        return index.nonzero().flatten()
    if index.numel() == 0:
        index = index.to(torch.int64)
    if index.dim() != 1 or index.is_floating_point() or index.is_complex():
        raise ValueError(
            f"{what}: expected a 1-d sequence of integer model indices or a ({batch},) bool mask, "
            f"got dtype {index.dtype} and shape {tuple(index.shape)}"
        )
    index = index.to(torch.int64)
    if index.numel() and (int(index.min()) < -batch or int(index.max()) >= batch):
        raise IndexError(
            f"{what}: model indices must lie in [0, {batch}) (or [-{batch}, 0) from the end), got {index.tolist()}: "
            f"out of range for batch={batch}"
        )
    index = index.remainder(batch)
    if distinct and index.unique().numel() != index.numel():
        _refuse_repeats(index, batch, what)
    return index


def _refuse_repeats(index: Tensor, batch: int, what: str) -> None:
    values = index.tolist()
    repeated = sorted({i for i in values if values.count(i) > 1})
    mask_hint = ""
    if len(values) == batch and set(values) <= {0, 1}:
        mask_hint = f"; for a 0/1 mask pass booleans: torch.tensor({values}, dtype=torch.bool)"
    raise ValueError(f"{what}: each model may be named once, got {values} (models {repeated} repeated){mask_hint}")


def select_index(keep: Any, batch: int) -> Tensor:
    """The survivors ``keep`` of a ``select`` (distinct model indices in their new order, or a bool mask of
    length B) as a CPU int64 index; what every ``select`` of torchmb accepts."""
    index = _as_index(keep, batch, "select", distinct=True)
    if index.numel() == 0:
        raise ValueError("select: keep at least one model")
    return index


def load_model_state(
    opt: ModelStates, dst: Any, source: ModelStates | None, src: Any, *, hyperparameters: bool = True
) -> None:
    """Copy models ``src`` of ``source`` (``None``: ``opt``) into slots ``dst`` of ``opt`` (see
    ``BatchOptimizer.load_model_state``, which then creates the state the copied hyperparameters call for)."""
    source = opt if source is None else source
    if type(source) is not type(opt):
        raise TypeError(f"load_model_state: source must be a {type(opt).__name__}, got {type(source).__name__}")
    if src is None:
        raise ValueError("load_model_state: give the source model index src")
    dst_index = _as_index([dst] if isinstance(dst, int) else dst, opt.batch, "dst", distinct=True)
    src_index = _as_index([src] if isinstance(src, int) else src, source.batch, "src")
    if dst_index.numel() != src_index.numel():
        raise ValueError(
            f"load_model_state: dst and src must name as many models, got {dst_index.numel()} "
            f"and {src_index.numel()}"
        )
    if len(source.param_groups) != len(opt.param_groups):
        raise ValueError("load_model_state: source has a different number of parameter groups")
    for group, src_group in zip(opt.param_groups, source.param_groups):
        if len(group["params"]) != len(src_group["params"]):
            raise ValueError("load_model_state: source groups hold a different number of parameters")
        for p, q in zip(group["params"], src_group["params"]):
            if p.shape[1:] != q.shape[1:]:
                raise ValueError(
                    f"load_model_state: parameter shapes differ: {tuple(p.shape)} and {tuple(q.shape)}"
                )
    # Read everything first so that opt-copies between overlapping slots see the old values.
    copies = []
    for group, src_group in zip(opt.param_groups, source.param_groups):
        if hyperparameters:
            for key in source.per_model_hyperparameters(src_group):
                if key in group:
                    value = src_group[key]
                    rows = tuple(v[src_index] for v in value) if isinstance(value, tuple) else value[src_index]
                    copies.append(("group", group, key, rows))
        for p, q in zip(group["params"], src_group["params"]):
            src_state = source.state_for(q, src_group)
            own = opt.state_for(p, group)
            for key, value in src_state.items():
                if isinstance(value, Tensor) and key in own:
                    copies.append(("state", own, key, value[src_index.to(value.device)].clone()))
    for kind, holder, key, rows in copies:
        if kind == "group":
            value = holder[key]
            if isinstance(value, tuple):
                holder[key] = tuple(v.index_copy(0, dst_index, r) for v, r in zip(value, rows))
            else:
                holder[key] = value.index_copy(0, dst_index, rows)
        elif key in opt.cpu_state:  # bookkeeping vectors may be shared between parameters: never in place
            holder[key] = holder[key].index_copy(0, dst_index, rows.to(torch.float64))
        else:
            target = holder[key]
            target.index_copy_(0, dst_index.to(target.device), rows.to(target.device, target.dtype))
