"""A run-time guard on reads of a batched layer's stacked ``(B, ...)`` parameters and buffers from code that is
not the layer's own, during a batched forward.

A parent that reads its child's weight (``x / self.fc.weight.norm()``) would get every model's weight stacked
and compute across models. ``torchmb`` finds such reads when converting (reading the parent's source) and in
each model's first forward (watching every op), and runs that parent per model. A read in code neither saw (a
helper function, reached only in eval mode or after some steps) would still compute silently on the stacked
tensor; this guard refuses it instead, in every forward.

The check runs in the layer's ``__getattr__``, which ``nn.Module`` already calls for every parameter and
buffer read, only inside a batched forward: the layer's own code, torch's, and that of torchmb's packages
pass by their module name; other code passes where it reads the layer's tensors as ``self`` (a subclass's
``forward`` run on the batched layer), or reads only what every model shares (``.dtype``, ``.device``,
``is None``: the instruction after the read says so, decided once per call site). Reads under ``vmap`` (a
region's per-model slice) are not stacked tensors and never reach the check.
"""

from __future__ import annotations

import contextvars
import dis
from types import CodeType
from typing import Any

import torch
from torch import nn

__all__ = ["StackedReadError", "check_stacked_read", "stacked_reads_watched_elsewhere"]

# Code of these packages reads stacked tensors on purpose (a layer's forward, torch's fast-path checks, a
# region's state swap, the first forward's tracker).
_TRUSTED_PACKAGES = frozenset({"torch", "batch_layers", "torchmb", "offload"})
_SHARED_ATTRIBUTES = frozenset({"dtype", "device", "layout", "is_cuda", "requires_grad", "is_floating_point"})
_NONE_TESTS = frozenset(
    {"POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE"}
)
_WATCHED_ELSEWHERE: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_layers_reads_watched", default=False)
_SHARED_READ_SITES: dict[tuple[CodeType, int], bool] = {}


class StackedReadError(RuntimeError):
    """Code other than a batched layer's own read the layer's stacked per-model tensor during a forward."""


class stacked_reads_watched_elsewhere:
    """Leave reads of stacked tensors to another check in this block (``torchmb``'s first-forward tracker,
    which runs the reading module per model instead of refusing it)."""

    def __enter__(self) -> None:
        self._token = _WATCHED_ELSEWHERE.set(True)

    def __exit__(self, *exc_info: object) -> None:
        _WATCHED_ELSEWHERE.reset(self._token)


def check_stacked_read(layer: nn.Module, name: str, value: Any, frame: Any) -> None:
    """Raise :class:`StackedReadError` where ``frame``'s code reads ``layer.<name>``, a stacked per-model tensor
    (``value``), and not only metadata every model shares; called inside a batched forward."""
    if frame.f_globals.get("__name__", "").partition(".")[0] in _TRUSTED_PACKAGES:
        return
    if torch._C._functorch.is_batchedtensor(value) or _WATCHED_ELSEWHERE.get():
        return
    if name in getattr(layer, "shared_buffers", ()):
        return
    if getattr(value, "shared_across_models", False) or frame.f_locals.get("self") is layer:
        return
    site = (frame.f_code, frame.f_lasti)
    shared = _SHARED_READ_SITES.get(site)
    if shared is None:
        shared = _SHARED_READ_SITES[site] = _reads_shared_metadata(*site)
    if shared:
        return
    where = f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
    raise StackedReadError(
        f"{where} reads {name} of {type(layer).__name__}(batch={getattr(layer, 'batch', '?')}), a tensor holding "
        f"every model's {name} stacked {tuple(value.shape)}, in a batched forward: it would compute across models. "
        "torchmb runs a module per model where its forward (or a method of its own) shows the read, or where its "
        "first forward makes it; this read was in neither (a helper function, a branch taken later, such as in "
        "eval mode). Read the layer's tensors in the reading module's forward or one of its methods"
    )


def _reads_shared_metadata(code: CodeType, offset: int) -> bool:
    """Whether the attribute read at ``offset`` is followed only by a read of metadata every model shares
    (``.dtype``) or a test against ``None``."""
    instructions = list(dis.get_instructions(code))
    position = next((i for i, ins in enumerate(instructions) if ins.offset == offset), None)
    if position is None or position + 1 >= len(instructions):
        return False
    following = instructions[position + 1]
    if following.opname in ("LOAD_ATTR", "LOAD_METHOD") and following.argval in _SHARED_ATTRIBUTES:
        return True
    if following.opname in _NONE_TESTS:
        return True
    after = instructions[position + 2] if position + 2 < len(instructions) else None
    return (
        following.opname == "LOAD_CONST"
        and following.argval is None
        and after is not None
        and after.opname in ("IS_OP", "COMPARE_OP")
    )

