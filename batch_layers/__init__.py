"""Grouped-weight versions of torch.nn layers: B independent copies of a layer as one module.

Every parameter has shape ``(B, *torch_shape)``; inputs carry the model axis merged into dim 0
(models-major, see :mod:`batch_layers._base`).
"""

from ._base import AbstractBatchModule, ForwardContext, current_forward, forward_context
from ._batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from ._conv import Conv1d, Conv2d, Conv3d
from ._linear import Linear

__all__ = [
    "LAYERS",
    "AbstractBatchModule",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ForwardContext",
    "Linear",
    "current_forward",
    "forward_context",
]

# The batched layers torchmb registers for their ``base_class``.
LAYERS: tuple[type[AbstractBatchModule], ...] = (
    Linear,
    Conv1d,
    Conv2d,
    Conv3d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
)
