"""A loss scaler for mixed precision with one scale per model.

``torch.amp.GradScaler`` keeps one scale for the whole step: one model's fp16 overflow would skip every
model's step and shrink every model's scale. :class:`GradScaler` here is B of them: each model has its
own scale and growth tracker, its gradients are unscaled and checked by themselves, and only the models
whose gradients overflowed skip the step (the others step) and back off.

Typical use, with per-model losses of shape ``(B,)``::

    scaler = torchmb.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        losses = torchmb.batch_loss(...)             # (B,)
    scaler.scale(losses).sum().backward()
    scaler.unscale_(opt)                             # optional, e.g. before clip_grad_norm_
    scaler.step(opt)                                 # skips only the models that overflowed
    scaler.update()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .optim._base import BatchOptimizer, _as_index, per_model_values
from .optim._population import select_index

__all__ = ["GradScaler"]

_READY, _UNSCALED, _STEPPED = 0, 1, 2


class GradScaler:
    """B independent ``torch.amp.GradScaler``: per-model loss scale, overflow check, skip and growth.

    Args:
        device: the device of the losses (``"cuda"``, ``"cpu"``, ...).
        init_scale: initial scale, a number or B numbers.
        growth_factor, backoff_factor, growth_interval: as in ``torch.amp.GradScaler`` (shared).
        enabled: ``False`` makes every method a pass-through (``step`` just steps).
        batch: the number of models B; when omitted it is taken from the first ``scale`` call.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: Any = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        batch: int | None = None,
    ) -> None:
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor should be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor should be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval <= 0:
            raise ValueError(f"growth_interval should be a positive int, got {growth_interval}")
        self._device = torch.device(device)
        self._enabled = enabled
        self._init_scale = init_scale
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._batch = batch
        self._scale: Tensor | None = None
        self._growth_tracker: Tensor | None = None
        self._per_optimizer: dict[int, dict[str, Any]] = {}
        self.last_skipped: Tensor | None = None
        """Bool ``(B,)`` mask (CPU) of the models whose step the last :meth:`step` skipped."""

    # ---- set-up -------------------------------------------------------------------------------
    def is_enabled(self) -> bool:
        """Whether the scaler scales (``enabled=True`` and a device with gradient scaling), as torch's."""
        return self._enabled

    @property
    def batch(self) -> int | None:
        """The number of models B (``None`` until the first :meth:`scale` when not given)."""
        return self._batch

    def _lazy_init(self, batch: int, device: torch.device) -> None:
        if self._batch is not None and self._batch != batch:
            raise ValueError(f"GradScaler: expected outputs with a leading model axis of {self._batch}, got {batch}")
        self._batch = batch
        scale = per_model_values(self._init_scale, batch, "init_scale")
        if bool((scale <= 0).any()):
            raise ValueError(f"init_scale must be positive, got {scale.tolist()}")
        self._scale = scale.to(device=device, dtype=torch.float32)
        self._growth_tracker = torch.zeros(batch, dtype=torch.int32, device=device)

    def _check_init(self, what: str) -> None:
        if self._scale is None:
            raise RuntimeError(
                f"GradScaler.{what}: no scale yet; call scale(losses) first (it learns B from the "
                "losses' leading model axis)"
            )

    # ---- the step -----------------------------------------------------------------------------
    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Any:
        """Multiply model ``i``'s outputs (``outputs[i]``, leading model axis B) by model ``i``'s scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            if outputs.dim() == 0:
                raise ValueError(
                    "GradScaler.scale: expected per-model losses with a leading model axis (B, ...), "
                    "got a 0-d tensor; scale the (B,) losses before summing them"
                )
            if self._scale is None:
                self._lazy_init(int(outputs.shape[0]), outputs.device)
            assert self._scale is not None
            if outputs.shape[0] != self._scale.shape[0]:
                raise ValueError(
                    f"GradScaler.scale: expected a leading model axis of {self._scale.shape[0]}, got "
                    f"shape {tuple(outputs.shape)}"
                )
            scale = self._scale.to(outputs.device, non_blocking=True)
            return outputs * scale.view(-1, *([1] * (outputs.dim() - 1)))
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return map(self.scale, outputs)

    def _state(self, optimizer: BatchOptimizer) -> dict[str, Any]:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": None})

    def unscale_(self, optimizer: BatchOptimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by their model's scale, in place, and record
        which models' gradients hold an inf or NaN."""
        if not self._enabled:
            return
        self._check_init("unscale_")
        state = self._state(optimizer)
        if state["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        batch = self._scale.shape[0]
        inv_scale = self._scale.double().reciprocal().float()
        found = torch.zeros(batch, dtype=torch.bool, device=self._scale.device)
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise ValueError("GradScaler: sparse gradients are not supported")
                if g.dim() == 0 or g.shape[0] != batch:
                    raise ValueError(
                        f"GradScaler: expected gradients with a leading model axis of {batch}, got "
                        f"shape {tuple(g.shape)}"
                    )
                bad = ~torch.isfinite(g).reshape(batch, -1).all(dim=1)
                found |= bad.to(found.device)
                g.mul_(inv_scale.to(g.device).view(-1, *([1] * (g.dim() - 1))))
        state["found_inf"] = found
        state["stage"] = _UNSCALED

    def step(self, optimizer: BatchOptimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then step ``optimizer`` for the models whose gradients are finite only."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if not isinstance(optimizer, BatchOptimizer):
            raise TypeError(
                "torchmb.amp.GradScaler.step needs a torchmb.optim optimizer (it skips single "
                f"models), got {type(optimizer).__name__}"
            )
        self._check_init("step")
        state = self._state(optimizer)
        if state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] == _READY:
            self.unscale_(optimizer)
        skipped = state["found_inf"].to("cpu")
        self.last_skipped = skipped
        retval = optimizer.step(*args, skip=skipped if bool(skipped.any()) else None, **kwargs)
        state["stage"] = _STEPPED
        return retval

    def update(self, new_scale: Any = None) -> None:
        """Per model: back off after an overflow, grow after ``growth_interval`` clean steps.

        Args:
            new_scale: set the scales instead (a number or B numbers).
        """
        if not self._enabled:
            return
        self._check_init("update")
        assert self._scale is not None and self._growth_tracker is not None
        if new_scale is not None:
            values = per_model_values(new_scale, self._scale.shape[0], "new_scale")
            self._scale.copy_(values.to(self._scale.device, torch.float32))
        else:
            found_infs = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
            if not found_infs:
                raise RuntimeError("No inf checks were recorded prior to update.")
            found = found_infs[0].clone()
            for other in found_infs[1:]:
                found |= other.to(found.device)
            tracker = torch.where(found, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
            grow = ~found & (tracker == self._growth_interval)
            grown = self._scale * self._growth_factor
            scale = torch.where(grow & torch.isfinite(grown), grown, self._scale)
            self._scale = torch.where(found, self._scale * self._backoff_factor, scale)
            self._growth_tracker = torch.where(grow, torch.zeros_like(tracker), tracker)
        self._per_optimizer = {}

    # ---- inspection and population changes ---------------------------------------------------
    def get_scale(self) -> Tensor:
        """The current per-model scales, ``(B,)`` float32 (a copy; ``init_scale`` before the first scale)."""
        if self._scale is None:
            if self._batch is None:
                raise RuntimeError("GradScaler.get_scale: B is not known before the first scale() call")
            return per_model_values(self._init_scale, self._batch, "init_scale").float()
        return self._scale.clone()

    def get_growth_tracker(self) -> Tensor:
        """The number of consecutive clean steps of each model, ``(B,)`` int32."""
        self._check_init("get_growth_tracker")
        assert self._growth_tracker is not None
        return self._growth_tracker.clone()

    def select(self, keep: Any) -> None:
        """Keep only the models ``keep`` (indices in the new order, or a bool mask of length B)."""
        if self._scale is None:  # before the first scale(): only B and a per-model init_scale change
            if self._batch is None:  # nothing per model yet: the first scale() learns the survivors' B
                return
            index = select_index(keep, self._batch)
            if not isinstance(self._init_scale, (int, float)):
                self._init_scale = per_model_values(self._init_scale, self._batch, "init_scale")[index]
            self._batch = int(index.numel())
            return
        assert self._growth_tracker is not None
        index = select_index(keep, self._scale.shape[0])
        self._scale = self._scale[index.to(self._scale.device)]
        self._growth_tracker = self._growth_tracker[index.to(self._growth_tracker.device)]
        self._batch = int(index.numel())
        self._per_optimizer = {}

    def load_model_state(self, dst: Any, source: GradScaler | None = None, src: Any = None) -> None:
        """Copy models' scale and growth tracker into other slots (population-based training's exploit)."""
        source = self if source is None else source
        self._check_init("load_model_state")
        source._check_init("load_model_state")
        assert self._scale is not None and self._growth_tracker is not None
        assert source._scale is not None and source._growth_tracker is not None
        if src is None:
            raise ValueError("load_model_state: give the source model index src")
        dst_index = _as_index([dst] if isinstance(dst, int) else dst, self._scale.shape[0], "dst", distinct=True)
        src_index = _as_index([src] if isinstance(src, int) else src, source._scale.shape[0], "src")
        if dst_index.numel() != src_index.numel():
            raise ValueError("load_model_state: dst and src must name as many models")
        scale = source._scale[src_index.to(source._scale.device)].clone()
        tracker = source._growth_tracker[src_index.to(source._growth_tracker.device)].clone()
        self._scale.index_copy_(0, dst_index.to(self._scale.device), scale.to(self._scale.device))
        self._growth_tracker.index_copy_(
            0, dst_index.to(self._growth_tracker.device), tracker.to(self._growth_tracker.device)
        )

    def state_dict(self) -> dict[str, Any]:
        """Scales and trackers (CPU copies) and the growth settings, as ``torch.amp.GradScaler``'s."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale().cpu(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": None if self._growth_tracker is None else self._growth_tracker.cpu(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned: the per-model scales and growth trackers and the growth
        settings. A state of another number of models is refused, with nothing changed; a disabled scaler
        ignores it, as torch's does."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
        missing = sorted(keys - set(state_dict))
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: the state lacks {missing}")
        scale, tracker = state_dict["scale"], state_dict["_growth_tracker"]
        batch = int(scale.shape[0]) if isinstance(scale, Tensor) and scale.dim() == 1 else None
        if batch is None or (tracker is not None and tuple(tracker.shape) != (batch,)):
            shapes = (getattr(scale, "shape", scale), getattr(tracker, "shape", tracker))
            raise ValueError(
                f"GradScaler.load_state_dict: expected a per-model scale and growth tracker of shape (B,), got {shapes}"
            )
        if self._batch is not None and batch != self._batch:
            raise ValueError(
                f"GradScaler.load_state_dict: the state holds B = {batch} models, this scaler B = {self._batch}; "
                "select the models first so that both hold the same number"
            )
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._batch = batch
        device = self._scale.device if self._scale is not None else self._device
        self._scale = scale.to(device, torch.float32).clone()
        self._growth_tracker = (
            torch.zeros(self._batch, dtype=torch.int32, device=device)
            if tracker is None
            else tracker.to(device, torch.int32).clone()
        )
        self._per_optimizer = {}
