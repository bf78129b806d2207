"""Hugging Face's ``Trainer`` training a ``BatchModule`` of a transformers model: B models, one per setting.

``transformers.Trainer`` sees one model: it computes one loss, clips all parameters by one norm (its default
``max_grad_norm=1.0`` would couple the models: one model's large gradient would shrink every other
model's step), builds a ``torch.optim`` optimizer with one learning rate and logs scalars.
:class:`BatchTrainer` keeps the ``Trainer``'s loop, data handling, evaluation and callbacks, and makes each
of those per model:

- the loss: the model's own Hugging Face loss (``ForCausalLM``'s shifted cross entropy, ``ForMaskedLM``'s)
  evaluated per model on the ``(B, n, ...)`` logits with ``torchmb.batch_loss``, or your ``loss_fn``;
  their sum is backpropagated (models do not interact, so each gets its own gradient);
- clipping: ``max_grad_norm`` bounds each model's own gradient norm (``torchmb.clip``);
- the optimizer: ``torchmb.optim`` (AdamW for ``optim="adamw_torch"``, the default) with per-model
  ``learning_rates`` and ``weight_decays`` (by default the arguments' values for every model), biases and
  norm weights without decay as the ``Trainer`` groups them;
- the schedule: ``lr_scheduler_type`` with its warm-up, the ``Trainer``'s own schedule function applied
  to each model's learning rate (``torchmb.lr_scheduler.LambdaLR``);
- the logs: ``loss``, ``eval_loss``, ``grad_norm`` and ``learning_rate`` as one column per model
  (``loss/model_3``), beside ``loss`` and ``eval_loss`` averaged over the models;
- checkpoints: ``save_strategy`` and ``train(resume_from_checkpoint=...)`` save and restore every model's
  weights (a tied weight stored once), optimizer state and schedule.

Every model sees the same batches (a sweep): the data collator's ``(n, ...)`` tensors are the shared
input of all B models.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import Tensor
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

from .. import clip, lr_scheduler, optim
from .._module import BatchModule
from ..functional import batch_loss
from ..optim import per_model_values
from ._metrics import is_per_model, per_model_metrics

__all__ = ["BatchTrainer"]

# The Trainer methods BatchTrainer overrides: where one is missing (transformers before 5.0 clipped inside its
# loop), the Trainer would silently clip, schedule or log all models as one
_OVERRIDDEN = ("_clip_grad_norm", "_get_grad_norm", "_get_learning_rate", "_save", "_issue_warnings_after_load")
if not all(hasattr(transformers.Trainer, name) for name in _OVERRIDDEN):
    raise ImportError(
        f"torchmb.integrations.transformers needs transformers >= 5.0 (found {transformers.__version__}): "
        "pip install 'torchmb[transformers]'"
    )

_OPTIMIZERS: dict[str, Callable[..., optim.BatchOptimizer]] = {
    "adamw_torch": lambda params, args: optim.AdamW(
        params, lr=0.0, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon
    ),
    "adamw_torch_fused": lambda params, args: optim.AdamW(
        params, lr=0.0, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, fused=None
    ),
    "sgd": lambda params, args: optim.SGD(params, lr=0.0),
    "adagrad": lambda params, args: optim.Adagrad(params, lr=0.0),
    "rmsprop": lambda params, args: optim.RMSprop(params, lr=0.0),
}
_HF_LOSSES = (ForCausalLMLoss, ForMaskedLMLoss)


def _tensor_key(tensor: Tensor) -> tuple:
    """Equal for two names of one tensor (a tied weight)."""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)


class BatchTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a ``BatchModule`` of a Hugging Face model, everything per model.

    Args:
        model: the ``BatchModule`` (``torchmb.BatchModule(hf_model, B)``).
        args: ``TrainingArguments``, as for ``Trainer``.
        learning_rates: B learning rates (or one for all); default ``args.learning_rate``.
        weight_decays: B weight decays (or one); default ``args.weight_decay``.
        loss_fn: ``loss_fn(logits, labels) -> (B,)`` per-model losses, for ``(B, n, ...)`` logits and the
            collator's ``(n, ...)`` labels; default the model's Hugging Face loss (causal or masked LM).
        **kwargs: ``Trainer``'s other arguments (datasets, ``data_collator``, ``callbacks``, ...). A
            ``(optimizer, scheduler)`` pair in ``optimizers`` must be ``torchmb.optim`` /
            ``torchmb.lr_scheduler`` ones.
    """

    def __init__(
        self,
        model: BatchModule,
        args: transformers.TrainingArguments,
        *,
        learning_rates: Any = None,
        weight_decays: Any = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, BatchModule):
            raise TypeError(f"BatchTrainer trains a torchmb.BatchModule, got {type(model).__name__}")
        optimizer, _ = kwargs.get("optimizers", (None, None))
        if optimizer is not None and not isinstance(optimizer, optim.BatchOptimizer):
            raise TypeError(
                f"optimizers: expected a torchmb.optim optimizer (per-model state), got {type(optimizer).__name__}"
            )
        if kwargs.get("compute_loss_func") is not None:
            raise TypeError("BatchTrainer takes loss_fn(logits, labels) -> (B,) losses instead of compute_loss_func")
        if kwargs.get("compute_metrics") is not None:
            raise TypeError(
                "BatchTrainer evaluates each model's loss (eval_loss/model_i); for other metrics, evaluate "
                "models.unbatch(i) or compute them per model from the (B, n, ...) outputs in your own loop"
            )
        batch = model.batch
        self.learning_rates = per_model_values(
            args.learning_rate if learning_rates is None else learning_rates, batch, "learning_rates"
        )
        self.weight_decays = per_model_values(
            args.weight_decay if weight_decays is None else weight_decays, batch, "weight_decays"
        )
        hf_loss = getattr(model.module, "loss_function", None) if loss_fn is None else None
        if loss_fn is None and hf_loss not in _HF_LOSSES:
            raise ValueError(
                f"no per-model loss for {type(model.module).__name__} (its Hugging Face loss is "
                f"{getattr(hf_loss, '__name__', hf_loss)}); pass loss_fn(logits, labels) -> (B,) losses"
            )
        self.loss_fn = loss_fn
        self._hf_loss = hf_loss
        self._sums: dict[str, Tensor] = {}  # per-model loss sums since the last log, and their counts
        self._counts: dict[str, int] = {}
        super().__init__(model=model, args=args, **kwargs)
        # The per-model loss is normalised as the model's own Hugging Face loss is (over the label tokens
        # of all accumulated micro-batches), so the Trainer counts them as it would for the model alone.
        self.model_accepts_loss_kwargs = self._hf_loss is not None
        self._loss_shifts_labels = self._hf_loss is ForCausalLMLoss
        if args.label_names is None:  # found on the Hugging Face model's forward, not BatchModule's
            self.label_names = transformers.utils.find_labels(type(model.module))
        self._evaluated: dict[str, Any] = {}

    @property
    def batch(self) -> int:
        """The number of models B."""
        return self.model.batch

    def _set_signature_columns_if_needed(self) -> None:
        """The data columns the wrapped Hugging Face model's ``forward`` takes (``BatchModule.forward`` takes any)."""
        if self._signature_columns is None:
            columns = list(inspect.signature(self.model.module.forward).parameters)
            self._signature_columns = [*columns, *sorted({"label", "label_ids", *self.label_names})]

    # ---- optimizer and schedule ----------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> optim.BatchOptimizer:
        """A ``torchmb.optim`` optimizer for ``args.optim``, with the per-model learning rates and decays."""
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        name = str(getattr(self.args.optim, "value", self.args.optim))
        if name not in _OPTIMIZERS:
            raise ValueError(f"BatchTrainer: optim={name!r} has no per-model version; use one of {sorted(_OPTIMIZERS)}")
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.weight_decays},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        optimizer = _OPTIMIZERS[name]([g for g in groups if g["params"]], self.args)
        optimizer.set_hyperparameter("lr", self.learning_rates)
        self.optimizer = optimizer
        return optimizer

    def get_decay_parameter_names(self, model: Any) -> list[str]:
        """The ``Trainer``'s rule (no decay for biases and norm weights), read on one plain model: the batched
        norms are no longer ``nn.LayerNorm`` instances."""
        if not isinstance(model, BatchModule):
            return super().get_decay_parameter_names(model)
        plain = super().get_decay_parameter_names(model.unbatch(0))
        return [f"module.{name}" for name in plain]

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> lr_scheduler.BatchLRScheduler:
        """``args.lr_scheduler_type`` (with its warm-up) applied to each model's learning rate."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler
        optimizer = self.optimizer if optimizer is None else optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        if not isinstance(optimizer, optim.BatchOptimizer):
            raise TypeError(f"BatchTrainer needs a torchmb.optim optimizer, got {type(optimizer).__name__}")
        # The Trainer's schedules are LambdaLRs: build one on a stand-in optimizer to take its function.
        stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        schedule = transformers.get_scheduler(
            self.args.lr_scheduler_type,
            optimizer=stand_in,
            num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
        )
        if not isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
            raise ValueError(
                f"lr_scheduler_type={self.args.lr_scheduler_type!r} is not a schedule of the step alone; pass a "
                "torchmb.lr_scheduler scheduler in optimizers=(optimizer, scheduler)"
            )
        self.lr_scheduler = lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
        return self.lr_scheduler

    # ---- loss ----------------------------------------------------------------------------------
    def per_model_loss(self, logits: Tensor, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
        """Each model's loss, ``(B,)``, from its ``(B, n, ...)`` logits and the shared ``(n, ...)`` labels."""
        if self.loss_fn is not None:
            return self.loss_fn(logits, labels)
        vocab_size = logits.shape[-1]
        hf_loss = self._hf_loss

        def one_model(model_logits: Tensor, model_labels: Tensor, reduction: str) -> Tensor:
            return hf_loss(model_logits, model_labels, vocab_size, num_items_in_batch=num_items_in_batch)

        return batch_loss(logits, labels, loss_fn=one_model)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        """The ``Trainer``'s step (backpropagating the sum of the per-model losses), reporting their mean."""
        return super().training_step(model, inputs, num_items_in_batch) / self.batch

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The sum of the per-model losses (to backpropagate); the per-model values are kept for the logs."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError(f"BatchTrainer needs 'labels' in each batch, got {sorted(inputs)}")
        outputs = model(**inputs, shared_input=True)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        losses = self.per_model_loss(logits, labels, num_items_in_batch)
        if losses.shape != (self.batch,):
            raise ValueError(f"the per-model loss must have shape ({self.batch},), got {tuple(losses.shape)}")
        self._accumulate("loss" if model.training else "eval", losses.detach())
        loss = losses.sum()
        return (loss, outputs) if return_outputs else loss

    def _accumulate(self, name: str, losses: Tensor) -> None:
        self._sums[name] = self._sums.get(name, 0) + losses.double()
        self._counts[name] = self._counts.get(name, 0) + 1

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[Tensor | None, None, None]:
        """The evaluation loss (each model's kept for the logs); no predictions, whose model axis the
        ``Trainer``'s gathering would take for samples."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach() / self.batch, None, None

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate``, its metrics with the loss of each model (``eval_loss/model_i``)."""
        metrics = super().evaluate(*args, **kwargs)
        return {**metrics, **self._evaluated}

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Tensor] | None = None) -> None:
        """The ``Trainer``'s save, each tied weight stored once (safetensors refuses two names for one tensor;
        loading the one fills the other, as it is the same parameter)."""
        if state_dict is None:
            state_dict, seen = {}, set()
            for name, tensor in self.model.state_dict().items():
                if _tensor_key(tensor) not in seen:
                    seen.add(_tensor_key(tensor))
                    state_dict[name] = tensor
        super()._save(output_dir, state_dict)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """Missing tied copies are expected (see ``_save``); other missing or unexpected keys are refused."""
        state = self.model.state_dict()
        loaded = {_tensor_key(t) for name, t in state.items() if name not in load_result.missing_keys}
        missing = [name for name in load_result.missing_keys if _tensor_key(state[name]) not in loaded]
        if missing or load_result.unexpected_keys:
            raise RuntimeError(
                f"the checkpoint does not fit this BatchModule: missing {missing}, "
                f"unexpected {list(load_result.unexpected_keys)}"
            )

    # ---- clipping ------------------------------------------------------------------------------
    def _clip_grad_norm(self, model: Any) -> list[float]:
        """Clip each model's gradients by its own norm to ``max_grad_norm``; return the per-model norms."""
        return self._per_model_norms(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> list[float]:
        return self._per_model_norms(model, float("inf")) if grad_norm is None else grad_norm

    def _get_learning_rate(self) -> list[float]:
        """Each model's learning rate (of the first parameter group), as the schedule last set it."""
        return self.lr_scheduler.get_last_lr()[0].tolist()

    @staticmethod
    def _per_model_norms(model: Any, max_norm: float) -> list[float]:
        params = [p for p in model.parameters() if p.grad is not None]
        return clip.clip_grad_norm_(params, max_norm).tolist() if params else []

    # ---- logging -------------------------------------------------------------------------------
    def log(self, logs: dict[str, Any], start_time: float | None = None) -> None:
        """The ``Trainer``'s logs with each per-model value as one column per model.

        ``loss`` and ``eval_loss`` become each model's mean loss since the last log (columns
        ``loss/model_i``) and, under their own names, the mean over the models.
        """
        out: dict[str, Any] = {}
        for name, value in logs.items():
            kept = "loss" if name == "loss" else "eval" if name.endswith("_loss") else None
            if kept in self._counts:
                value = self._sums.pop(kept) / self._counts.pop(kept)
                out[name] = float(value.mean())
            if isinstance(value, list):
                value = torch.tensor(value, dtype=torch.float64)
            if is_per_model(value) or (isinstance(value, Tensor) and value.numel() == self.batch > 1):
                out.update({key: float(v) for key, v in per_model_metrics(name, value.reshape(-1)).items()})
            elif name not in out:
                out[name] = value
        if any(name.endswith("_loss") and name != "loss" for name in logs):
            self._evaluated = out
        super().log(out, start_time)
