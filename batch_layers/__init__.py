"""Grouped-weight versions of torch.nn layers: B independent copies of a layer as one module.

Every parameter has shape ``(B, *torch_shape)``; inputs carry the model axis merged into dim 0
(models-major by default, samples-major where a ``BatchModule`` chooses it; see :mod:`batch_layers._base`).
"""

from ._activation import PReLU
from ._attention import MultiheadAttention
from ._attention_table import explain_attention_kernels, scaled_dot_product_attention
from ._backend import get_backend, set_backend, use_backend, use_cupy, use_torch
from ._base import (
    AbstractBatchModule,
    ForwardContext,
    SamplesOrderError,
    SamplesOrderProbe,
    check_merged_rows,
    constant_under_compile,
    current_forward,
    forward_context,
    is_shared_input,
    is_shared_parameter,
    mark_shared_parameter,
    recognise_shared_by,
)
from ._batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from ._bilinear import Bilinear
from ._conv import Conv1d, Conv2d, Conv3d
from ._conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from ._dropout import AlphaDropout, Dropout, Dropout1d, Dropout2d, Dropout3d, FeatureAlphaDropout
from ._embedding import Embedding, FastEmbedding, batched_embedding, check_indices
from ._embedding_bag import EmbeddingBag
from ._embedding_multi import MultiEmbedding
from ._embedding_offload import OffloadedBatchEmbedding, offload_embeddings
from ._frozen_batchnorm import FrozenBatchNorm2d
from ._kernel_table import explain_kernels
from ._layout import Layout
from ._linear import Linear
from ._linear_cross_entropy import LinearCrossEntropyLoss
from ._norm import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm, RMSNorm
from ._norm_table import explain_norm_kernels
from ._recurrent import GRU, LSTM, RNN
from ._recurrent_cells import GRUCell, LSTMCell, RNNCell
from ._stacked_reads import StackedReadError, check_stacked_read, stacked_reads_watched_elsewhere
from ._std_conv import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame
from ._subclass import batched_subclass
from ._transposed_linear import TransposedLinear

__all__ = [
    "GRU",
    "LAYERS",
    "LSTM",
    "RNN",
    "AbstractBatchModule",
    "AlphaDropout",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Bilinear",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "Dropout3d",
    "Embedding",
    "EmbeddingBag",
    "FastEmbedding",
    "FeatureAlphaDropout",
    "ForwardContext",
    "FrozenBatchNorm2d",
    "GRUCell",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LSTMCell",
    "LayerNorm",
    "Layout",
    "Linear",
    "LinearCrossEntropyLoss",
    "MultiEmbedding",
    "MultiheadAttention",
    "OffloadedBatchEmbedding",
    "PReLU",
    "RMSNorm",
    "RNNCell",
    "SamplesOrderError",
    "SamplesOrderProbe",
    "ScaledStdConv2d",
    "ScaledStdConv2dSame",
    "StackedReadError",
    "StdConv2d",
    "StdConv2dSame",
    "TransposedLinear",
    "batched_embedding",
    "batched_subclass",
    "check_indices",
    "check_merged_rows",
    "check_stacked_read",
    "constant_under_compile",
    "current_forward",
    "explain_attention_kernels",
    "explain_kernels",
    "explain_norm_kernels",
    "forward_context",
    "get_backend",
    "is_shared_input",
    "is_shared_parameter",
    "mark_shared_parameter",
    "offload_embeddings",
    "recognise_shared_by",
    "scaled_dot_product_attention",
    "set_backend",
    "stacked_reads_watched_elsewhere",
    "use_backend",
    "use_cupy",
    "use_torch",
]

#: The batched layers torchmb registers for their ``base_class``.
LAYERS: tuple[type[AbstractBatchModule], ...] = (
    Linear,
    Conv1d,
    Conv2d,
    Conv3d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Bilinear,
    LayerNorm,
    RMSNorm,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    PReLU,
    Dropout,
    Dropout1d,
    Dropout2d,
    Dropout3d,
    AlphaDropout,
    FeatureAlphaDropout,
    Embedding,
    EmbeddingBag,
    MultiheadAttention,
    RNN,
    LSTM,
    GRU,
    RNNCell,
    LSTMCell,
    GRUCell,
)
