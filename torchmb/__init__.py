"""torchmb: train many PyTorch models at once on one GPU.

``BatchModule(model, batch=B)`` turns one model into B independent models that train as one module:
hyperparameter sweeps, seed studies and ensembles in the time one model used to take.
"""

from batch_layers import AbstractBatchModule

from . import adapters, amp, clip, distributed, graphs, lr_scheduler, memory, optim, sweep, testing
from ._convert import ConversionEntry
from ._module import BatchModule
from ._registry import (
    lookup_batch_module,
    refuse_batch_module,
    refused_batch_modules,
    register_batch_module,
    registered_batch_modules,
)
from ._tracking import PooledDecisionError, allow_pooled_decisions
from .checkpoint import load_checkpoint, save_checkpoint
from .functional import batch_accuracy, batch_loss, batch_topk, merge_batch, split_batch

__version__ = "0.3.0"

__all__ = [
    "AbstractBatchModule",
    "BatchModule",
    "ConversionEntry",
    "PooledDecisionError",
    "adapters",
    "allow_pooled_decisions",
    "amp",
    "batch_accuracy",
    "batch_loss",
    "batch_topk",
    "clip",
    "distributed",
    "graphs",
    "load_checkpoint",
    "lookup_batch_module",
    "lr_scheduler",
    "memory",
    "merge_batch",
    "optim",
    "refuse_batch_module",
    "refused_batch_modules",
    "register_batch_module",
    "registered_batch_modules",
    "save_checkpoint",
    "split_batch",
    "sweep",
    "testing",
]
