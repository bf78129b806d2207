"""Looking into the autograd graph behind a batched layer's output."""

from __future__ import annotations

import torch

__all__ = ["grouped_conv_node", "node_names"]


def grouped_conv_node(y: torch.Tensor) -> torch.autograd.graph.Node:
    """The ``_GroupedConv`` node behind a convolution's output, reached through the merged view of its
    grouped result that the layer takes outside the Function."""
    node = y.grad_fn
    while type(node).__name__ != "_GroupedConvBackward":
        (node, _), *_ = node.next_functions
    return node


def node_names(y: torch.Tensor) -> set[str]:
    """The type names of every node in the autograd graph behind ``y``."""
    names, stack, seen = set(), [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names
