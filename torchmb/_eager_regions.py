"""A generic module's region run eagerly inside a compiled model (imported only when dynamo traces one).

Dynamo cannot trace a region (``torchmb._generic``): its ``vmap`` pops and pushes functorch levels around
each escaping call, and the region's mode and context variables are Python state it does not model. Left to
itself, dynamo breaks the graph at the region and then compiles each frame the region runs as a graph of its
own, guarded on each layer's attributes: a timm ConvNeXt hit the recompile limit that way. :func:`run_eagerly`
is ``torch.compiler.disable``d, so the region is one graph break and runs eagerly as a whole, its layers
included; the code around it stays compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch._dynamo

__all__ = ["run_eagerly"]


def _call(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


run_eagerly = torch._dynamo.disable(_call, recursive=True, reason="a torchmb region runs under vmap, eagerly")
