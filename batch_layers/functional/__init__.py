"""Batched functionals: what ``torch.nn.functional`` computes for one model, computed for B models at once.

Every function takes the merged input (B models' samples on dim 0, see :class:`Layout`), the per-model
weights stacked on a leading model axis, ``(B, *plain_shape)``, and the :class:`Layout` as an argument: it
reads the layout from nowhere else. The batched layers of ``batch_layers`` are thin modules over these
functions, as ``torch.nn``'s are over ``torch.nn.functional``.
"""

from .._layout import Layout, MergedOrder
from ._activation import prelu
from ._attention import multi_head_attention_forward
from ._dropout import alpha_dropout, dropout, dropout1d, dropout2d, dropout3d, expand_shared, feature_alpha_dropout
from ._linear import bilinear, linear, transposed_linear
from ._recurrent import gru, lstm, rnn_relu, rnn_tanh
from ._recurrent_cells import gru_cell, lstm_cell, rnn_relu_cell, rnn_tanh_cell

__all__ = ["Layout", "MergedOrder"]
__all__ += ["bilinear", "linear", "transposed_linear"]
__all__ += ["alpha_dropout", "dropout", "dropout1d", "dropout2d", "dropout3d", "expand_shared", "feature_alpha_dropout"]
__all__ += ["prelu"]
__all__ += ["multi_head_attention_forward"]
__all__ += ["gru", "gru_cell", "lstm", "lstm_cell", "rnn_relu", "rnn_relu_cell", "rnn_tanh", "rnn_tanh_cell"]
