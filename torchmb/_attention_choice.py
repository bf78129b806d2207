"""The model's own attention calls, on the kernel of ``batch_layers``' attention table.

A model's code calls ``F.scaled_dot_product_attention`` on the merged rows (timm's and Hugging Face's
attention modules hold no weights of their own around it), so torch picks its kernel as for one model. The
attention table (:func:`batch_layers.scaled_dot_product_attention`) picks from B models' shapes: under
``torch.compile``, for short float32 sequences, torch's math path on TF32, faster than the memory-efficient
kernel torch takes. The first forward's tracker notes whether the model's own code (not a batched layer's)
calls attention (``torchmb._tracking``); ``BatchModule`` traces such a model's compiled forward under
:class:`AttentionKernelChoice`. Its eager forwards run without: the table keeps torch's choice there, and the
mode would route every op through Python. A batched layer's attention (``nn.MultiheadAttention``) asks the
table itself.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from batch_layers import scaled_dot_product_attention

__all__ = ["AttentionKernelChoice"]


class AttentionKernelChoice(TorchFunctionMode):
    """Route ``F.scaled_dot_product_attention`` calls through the attention table."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if func is F.scaled_dot_product_attention:
            return scaled_dot_product_attention(*args, **kwargs)
        return func(*args, **kwargs)
