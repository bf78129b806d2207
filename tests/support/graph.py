"""Looking into the autograd graph behind a batched layer's output."""

from __future__ import annotations

import torch

__all__ = ["autograd_nodes", "grouped_conv_node"]


def grouped_conv_node(y: torch.Tensor) -> torch.autograd.graph.Node:
    """The ``_GroupedConv`` node behind a convolution's output, reached through the merged view of its
    grouped result that the layer takes outside the Function."""
    node = y.grad_fn
    while type(node).__name__ != "_GroupedConvBackward":
        (node, _), *_ = node.next_functions
    return node


def autograd_nodes(y: torch.Tensor) -> list[str]:
    """The type names of every node of the autograd graph behind ``y``, each node once (its leaves'
    ``AccumulateGrad`` included): each is host time for the engine, and a view's a reshape of its gradient."""
    names, todo, seen = [], [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo += [next_node for next_node, _ in node.next_functions]
    return names
