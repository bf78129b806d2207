"""A fix to torch.compile's Inductor backend that compiled BatchModules need, applied when dynamo first traces one
(Inductor is imported by then anyway; importing it with torchmb would double torchmb's import time).

Inductor's scheduler renames a read of a buffer that a scatter mutated (``scatter_add`` into a zero buffer: the
backward of ``max_pool2d``, of an embedding) to the mutation's own buffer, which is what orders the read after
the scatter. ``SchedulerNode.recompute_size_and_body`` re-extracts a node's reads from its loop body and puts
that rename back only when the node also has a fake dependency (torch 2.13 and earlier:
pytorch/pytorch#185509, fixed upstream by pytorch/pytorch#185873). The CPU backend recomputes a node so when it
fuses nodes of compatible ranges (a ``(6144,)`` pointwise node with a ``(3, 32, 64)`` one), and the fused
kernel then reads the buffer before the scatter has written it. A samples-major LeNet compiled with Inductor
on one CPU thread trained on zero convolution gradients that way: ``threshold_backward`` read
``max_pool2d``'s gradient buffer while it still held zeros. The fix is upstream's: apply the node's mutation
renames after every recompute. Renaming is idempotent, so on a torch that has the fix it changes nothing.
Compile cache keys carry :data:`CACHE_KEY_TAG` from then on, so that no kernel compiled without the fix is reused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

CACHE_KEY_TAG = "torchmb-inductor-scatter-order"
_APPLIED = False


def keep_scatter_order_in_inductor() -> None:
    """Make Inductor's scheduler keep a read of a scatter-mutated buffer after the scatter (see the module's
    docstring). Applied once per process."""
    global _APPLIED
    if _APPLIED:
        return
    from torch._inductor.scheduler import SchedulerNode

    recompute = getattr(SchedulerNode, "recompute_size_and_body", None)
    if recompute is not None:  # a torch (>= 2.5) whose scheduler has no such method has nothing to fix there
        SchedulerNode.recompute_size_and_body = renames_reapplied(recompute)
        _tag_compile_caches()
    _APPLIED = True


def _tag_compile_caches() -> None:
    """Inductor's on-disk caches outlive a process and their keys hash torch's source, not this patch: a kernel
    compiled without the fix (an earlier torchmb, the same torch) would be reused. The fix goes into every
    compile cache key through torch's tag for that, after whatever tag the user set."""
    config = getattr(torch.compiler, "config", None)  # torch >= 2.6
    if config is not None and CACHE_KEY_TAG not in config.cache_key_tag.split("|"):
        config.cache_key_tag = "|".join(filter(None, [config.cache_key_tag, CACHE_KEY_TAG]))


def renames_reapplied(recompute: Callable[..., None]) -> Callable[..., None]:
    """``SchedulerNode.recompute_size_and_body`` that applies the node's mutation renames to the reads it
    re-extracts, as torch's own ``refresh_dependencies`` does."""

    @functools.wraps(recompute)
    def recompute_size_and_body(node: Any, *args: Any, **kwargs: Any) -> None:
        recompute(node, *args, **kwargs)
        renames = getattr(node, "mutation_renames", None)  # the node's own renames, where torch keeps them
        if renames:
            node.set_read_writes(node.read_writes.rename(renames))

    return recompute_size_and_body
