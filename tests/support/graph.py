"""Looking into the autograd graph behind a batched layer's output."""

from __future__ import annotations

import torch

__all__ = ["grouped_conv_node"]


def grouped_conv_node(y: torch.Tensor) -> torch.autograd.graph.Node:
    """The ``_GroupedConv`` node behind a convolution's output, reached through the merged view of its
    grouped result that the layer takes outside the Function."""
    node = y.grad_fn
    while type(node).__name__ != "_GroupedConvBackward":
        (node, _), *_ = node.next_functions
    return node
