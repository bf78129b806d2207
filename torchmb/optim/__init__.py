"""Batched optimizers: one independent optimizer per model, with per-model hyperparameters.

Parameters carry a leading model axis ``(B, ...)``; every hyperparameter may be a number or B numbers.
"""

from ._base import BatchOptimizer, per_model_values
from ._optimizers import SGD, Adagrad, Adam, AdamW, RMSprop

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "BatchOptimizer", "RMSprop", "per_model_values"]
