"""Batched functionals: what ``torch.nn.functional`` computes for one model, computed for B models at once.

Every function takes the merged input (B models' samples on dim 0, see :class:`Layout`), the per-model
weights stacked on a leading model axis, ``(B, *plain_shape)``, and the :class:`Layout` as an argument: it
reads the layout from nowhere else. The batched layers of ``batch_layers`` are thin modules over these
functions, as ``torch.nn``'s are over ``torch.nn.functional``.
"""

from .._layout import Layout, MergedOrder

__all__ = ["Layout", "MergedOrder"]
from ._conv import conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d
from ._embedding import embedding, embedding_bag
from ._embedding_multi import multi_embedding, multi_table_index
from ._norm import batch_norm, frozen_batch_norm, group_norm, instance_norm, layer_norm, rms_norm
from ._std_conv import standardize_weight, std_conv2d

__all__ += ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"]
__all__ += ["standardize_weight", "std_conv2d"]
__all__ += ["batch_norm", "frozen_batch_norm", "group_norm", "instance_norm", "layer_norm", "rms_norm"]
__all__ += ["embedding", "embedding_bag"]
__all__ += ["multi_embedding", "multi_table_index"]
