"""Lightning for a ``LightningModule`` that trains a ``BatchModule``: clipping, schedules and logs per model.

Lightning's own machinery treats the module as one model. Its gradient clipping computes one norm over
every parameter, so one model's large gradient would shrink every other model's step; its scheduler
check refuses ``torchmb.lr_scheduler``; ``self.log`` and ``LearningRateMonitor`` take only scalars. Derive
your module from :class:`BatchLightningModule` instead of ``LightningModule``:

- ``Trainer(gradient_clip_val=...)`` clips each model by its own gradient norm (or value), exactly as B
  models trained alone with that setting; :meth:`~BatchLightningModule.clip_gradients` also takes B bounds.
- ``torchmb.lr_scheduler`` schedulers returned by ``configure_optimizers`` are stepped by Lightning at
  their ``interval`` and ``frequency``, and saved and restored with checkpoints.
- ``self.log(name, values)`` of a ``(B,)`` tensor logs one column per model (``name/model_3``), or the
  reduction in :attr:`~BatchLightningModule.per_model_reduction`.
- :class:`LearningRateMonitor` logs each model's learning rate (and momentum, weight decay).

Mixed precision: ``"bf16-mixed"`` works; ``"16-mixed"`` is refused, because Lightning's one loss scaler
would skip every model's step when one model's gradients overflow (train those with manual optimization
and :class:`torchmb.amp.GradScaler`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor as _LightningLRMonitor
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor

from .. import clip
from ..lr_scheduler import BatchLRScheduler
from ..optim import BatchOptimizer
from ._metrics import Reduction, is_per_model, per_model_metrics

__all__ = ["BatchLightningModule", "LearningRateMonitor"]

if not hasattr(_LightningLRMonitor, "_get_optimizer_stats"):  # the method LearningRateMonitor below extends
    raise ImportError(
        f"torchmb.integrations.lightning needs lightning >= 2.4 (found {pl.__version__}): "
        "pip install 'torchmb[lightning]'"
    )


class BatchLightningModule(pl.LightningModule):
    """A ``LightningModule`` whose parameters carry a model axis (it holds a ``BatchModule``).

    Use it as ``LightningModule``: build the ``BatchModule`` in ``__init__``, return per-model losses
    summed in ``training_step`` (models do not interact, so the sum's gradient is each model's own), and
    a ``torchmb.optim`` optimizer (with a ``torchmb.lr_scheduler`` scheduler) from ``configure_optimizers``.

    Attributes:
        per_model_reduction: how ``self.log`` logs a ``(B,)`` tensor: ``None`` (the default) for one
            column per model, ``"mean"``, ``"min"``, ``"max"``, ``"sum"``, ``"median"`` or a function.
    """

    per_model_reduction: Reduction = None

    # ---- clipping ------------------------------------------------------------------------------
    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: Any = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip each model's gradients on its own (``torchmb.clip``), never by a norm over all models.

        Lightning's default ``configure_gradient_clipping`` calls this with ``Trainer(gradient_clip_val,
        gradient_clip_algorithm)``; an override of ``configure_gradient_clipping`` may call it with B
        bounds (a ``(B,)`` tensor or sequence), one per model.

        Args:
            optimizer: the optimizer whose parameters' gradients are clipped.
            gradient_clip_val: a number or B numbers; ``None`` takes the Trainer's (0 or unset: no clipping).
            gradient_clip_algorithm: ``"norm"`` (each model's total norm, the default) or ``"value"``.
        """
        if gradient_clip_val is None:
            gradient_clip_val = self.trainer.gradient_clip_val
        if gradient_clip_algorithm is None:
            gradient_clip_algorithm = self.trainer.gradient_clip_algorithm or "norm"
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)).lower()
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}")
        if gradient_clip_val is None or (isinstance(gradient_clip_val, (int, float)) and gradient_clip_val == 0):
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return
        if algorithm == "norm":
            clip.clip_grad_norm_(params, gradient_clip_val)
        else:
            clip.clip_grad_value_(params, gradient_clip_val)

    # ---- schedulers ----------------------------------------------------------------------------
    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step a ``torchmb.lr_scheduler`` scheduler (which takes no metric); other schedulers as Lightning does."""
        if isinstance(scheduler, BatchLRScheduler):
            if metric is not None:
                raise ValueError(
                    f"{type(scheduler).__name__} takes no metric; remove 'monitor' from its lr_scheduler config"
                )
            scheduler.step()
            return
        super().lr_scheduler_step(scheduler, metric)

    # ---- logging -------------------------------------------------------------------------------
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``; a ``(B,)`` tensor is logged per model (see :meth:`log_per_model`)."""
        if is_per_model(value):
            self.log_per_model(name, value, self.per_model_reduction, *args, **kwargs)
            return
        super().log(name, value, *args, **kwargs)

    def log_per_model(self, name: str, values: Any, reduction: Reduction = None, *args: Any, **kwargs: Any) -> None:
        """Log one value per model: a column ``name/model_i`` each, or one column reduced by ``reduction``.

        Further arguments are ``LightningModule.log``'s (``prog_bar``, ``on_step``, ``on_epoch``, ...).
        """
        for key, value in per_model_metrics(name, values, reduction).items():
            super().log(key, value, *args, **kwargs)

    # ---- checks and state ----------------------------------------------------------------------
    def on_fit_start(self) -> None:
        """Refuse what would couple the models: Lightning's loss scaler, its plain learning-rate monitor."""
        precision = self.trainer.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            raise RuntimeError(
                "Trainer(precision='16-mixed') scales every model's loss by one scale and skips every model's "
                "step when one model's gradients overflow; use precision='bf16-mixed', or manual optimization "
                "with torchmb.amp.GradScaler (one scale per model)"
            )
        for callback in self.trainer.callbacks:
            if type(callback) is _LightningLRMonitor:
                raise TypeError(
                    "lightning's LearningRateMonitor logs one learning rate per optimizer; use "
                    "torchmb.integrations.lightning.LearningRateMonitor, which logs one per model"
                )
        super().on_fit_start()

    def on_train_start(self) -> None:
        """Keep the optimizers' step counts on the CPU, where ``torchmb.optim`` computes with them.

        Lightning moves a restored optimizer's state to the device (all of it but ``"step"``).
        """
        for optimizer in self.trainer.optimizers:
            if isinstance(optimizer, BatchOptimizer):
                for state in optimizer.state.values():
                    for key in optimizer.cpu_state:
                        if key in state:
                            state[key] = state[key].to("cpu", torch.float64)
        super().on_train_start()


class LearningRateMonitor(_LightningLRMonitor):
    """Lightning's ``LearningRateMonitor``, logging a per-model hyperparameter as one column per model.

    ``lr-SGD/model_3`` is model 3's learning rate (and ``lr-SGD-momentum/model_3`` its momentum with
    ``log_momentum=True``); numbers (a plain torch optimizer's) are logged as Lightning logs them.
    """

    def _get_optimizer_stats(self, optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, float]:
        stats: dict[str, float] = {}
        for name, value in super()._get_optimizer_stats(optimizer, names).items():
            if isinstance(value, Tensor) and value.dim() == 1:
                stats.update({key: float(v) for key, v in per_model_metrics(name, value).items()})
            else:
                stats[name] = value
        return stats
