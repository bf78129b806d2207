"""Attaching an optimizer to :class:`~offload.OffloadedEmbedding` modules: :func:`attach` registers the step
hooks that switch the rows' optimizer state in before ``optimizer.step()`` and write rows and state back
after it (see :mod:`offload._optim_state`); :func:`detach` removes them."""

from __future__ import annotations

import weakref

import torch

from . import _optim_state
from ._embedding import OffloadedEmbedding

__all__ = ["attach", "detach"]

_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(optimizer: torch.optim.Optimizer, *modules: OffloadedEmbedding) -> torch.optim.Optimizer:
    """Make ``optimizer`` write the rows it updates back to the host: the one extra line of a training loop.

    Finds every :class:`OffloadedEmbedding` whose working parameter the optimizer holds (or uses
    ``modules``), creates the host tables of their per-row optimizer state and registers step hooks:
    before ``step`` the rows' state is switched in, after ``step`` rows and state are written back.
    Returns ``optimizer``.

    Raises:
        TypeError: for an optimizer that is not elementwise (LBFGS) or unknown.
        ValueError: a given module's weight is not in the optimizer.
    """
    if not modules:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        modules = tuple(m for m in list(_optim_state._ALL) if id(m.weight) in held)
    for m in modules:
        if not isinstance(m, OffloadedEmbedding):
            raise TypeError(f"offload.attach takes OffloadedEmbedding modules, got {type(m).__name__}")
        m._attach(optimizer)
    entry = _HOOKED.get(optimizer)
    if entry is None:
        mods: weakref.WeakSet[OffloadedEmbedding] = weakref.WeakSet()

        def pre(opt, args, kwargs):
            for m in list(mods):
                m._pre_step(opt)

        def post(opt, args, kwargs):
            for m in list(mods):
                m._post_step(opt)

        handles = (optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post))
        entry = _HOOKED[optimizer] = (mods, handles)
    for m in modules:
        entry[0].add(m)
    return optimizer


def detach(optimizer: torch.optim.Optimizer, *modules: OffloadedEmbedding) -> None:
    """Undo :func:`attach` (for ``modules``, or all): cached rows are flushed to the host first."""
    entry = _HOOKED.get(optimizer)
    if entry is None:
        return
    mods, handles = entry
    targets = modules or tuple(mods)
    for m in targets:
        m._require_idle("detach")
        m.flush()
        mods.discard(m)
        m._optimizer = None
    if not mods:
        for h in handles:
            h.remove()
        del _HOOKED[optimizer]
