"""Batched functionals: what ``torch.nn.functional`` computes for one model, computed for B models at once.

Every function takes the merged input (B models' samples on dim 0, see :class:`Layout`), the per-model
weights stacked on a leading model axis, ``(B, *plain_shape)``, and the :class:`Layout` as an argument: it
reads the layout from nowhere else. The batched layers of ``batch_layers`` are thin modules over these
functions, as ``torch.nn``'s are over ``torch.nn.functional``.
"""

from .._layout import Layout, MergedOrder, expand_shared
from ._activation import prelu
from ._attention import multi_head_attention_forward
from ._conv import conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d
from ._dropout import alpha_dropout, dropout, dropout1d, dropout2d, dropout3d, feature_alpha_dropout
from ._embedding import embedding, embedding_bag
from ._embedding_multi import multi_embedding, multi_table_index
from ._linear import bilinear, linear, transposed_linear
from ._norm import batch_norm, frozen_batch_norm, group_norm, instance_norm, layer_norm, rms_norm
from ._recurrent import gru, lstm, rnn_relu, rnn_tanh
from ._recurrent_cells import gru_cell, lstm_cell, rnn_relu_cell, rnn_tanh_cell
from ._std_conv import standardize_weight, std_conv2d

__all__ = [
    "Layout",
    "MergedOrder",
    "alpha_dropout",
    "batch_norm",
    "bilinear",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "embedding",
    "embedding_bag",
    "expand_shared",
    "feature_alpha_dropout",
    "frozen_batch_norm",
    "group_norm",
    "gru",
    "gru_cell",
    "instance_norm",
    "layer_norm",
    "linear",
    "lstm",
    "lstm_cell",
    "multi_embedding",
    "multi_head_attention_forward",
    "multi_table_index",
    "prelu",
    "rms_norm",
    "rnn_relu",
    "rnn_relu_cell",
    "rnn_tanh",
    "rnn_tanh_cell",
    "standardize_weight",
    "std_conv2d",
    "transposed_linear",
]
