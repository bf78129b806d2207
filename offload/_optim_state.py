"""Optimizer-state switching of an :class:`~offload.OffloadedEmbedding`: the host tables of per-row state that
:func:`~offload.attach` creates (:func:`attach_optimizer`), and the step hooks around ``optimizer.step()``:
before it the working rows are folded into one parameter and their state handed to the optimizer
(:func:`pre_step`), after it rows and state go back to the cache or the host tables (:func:`post_step`)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import _cache_cuda, _checkpoint, _gpu_cache, _host_write, _working_set
from ._optim import row_state_spec
from ._table import HostTable
from ._working_set import _Work

if TYPE_CHECKING:
    from ._embedding import OffloadedEmbedding

_ALL: weakref.WeakSet[OffloadedEmbedding] = weakref.WeakSet()
"""Every OffloadedEmbedding, for :func:`~offload.attach` to find those whose weight an optimizer holds."""


def attach_optimizer(emb: OffloadedEmbedding, optimizer: torch.optim.Optimizer) -> None:
    group = next((g for g in optimizer.param_groups if any(p is emb.weight for p in g["params"])), None)
    if group is None:
        raise ValueError("offload.attach: this OffloadedEmbedding's weight is not among the optimizer's "
                         "parameters (build the optimizer from model.parameters())")
    current = emb._optimizer() if emb._optimizer is not None else None
    if current is optimizer and emb._loaded is None:
        return
    if current is not None and current is not optimizer:
        raise RuntimeError("offload.attach: this OffloadedEmbedding is already attached to another optimizer "
                           "(offload.detach it first)")
    spec, self_init = row_state_spec(optimizer, group)
    emb._require_idle("attach")
    _gpu_cache.flush(emb)
    emb._drop_cache()
    loaded, emb._loaded = emb._loaded, None
    if loaded is not None:
        tables = _checkpoint.resume_state(emb, optimizer, spec, loaded)
    else:
        tables: dict[str, HostTable] = {}
        for k, fill in spec.items():
            tables[k] = HostTable(emb.num_embeddings, emb.embedding_dim, emb.table.dtype,
                                  device=emb.table.device, pin=emb._pin, engine=emb._engine, fill=fill)
    emb._state_tables = tables
    emb._spec = spec
    emb._self_init = self_init
    emb._optimizer = weakref.ref(optimizer)


def fold(emb: OffloadedEmbedding) -> None:
    """Before step: one working parameter for all chunks, and its per-row optimizer state."""
    work = emb._work
    if work.folded:
        return
    if len(work.chunks) > 1:
        leaves = [c.leaf for c in work.chunks[1:]]
        grads = [emb.weight.grad] + [leaf.grad for leaf in leaves]
        datas = [emb.weight.data] + [leaf.data for leaf in leaves]
        if all(g is None for g in grads):
            new_grad = None
        else:
            new_grad = torch.cat([torch.zeros_like(d) if g is None else g for g, d in zip(grads, datas,
                                                                                          strict=True)])
        emb.weight.data = torch.cat(datas)
        emb.weight.grad = new_grad
    work.version = emb.weight._version
    states = [_working_set.resolve_states(emb, c) for c in work.chunks]
    work.state_rows = {k: torch.cat([s[k] for s in states]) if len(states) > 1 else states[0][k]
                       for k in emb._spec}
    work.folded = True


def pre_step(emb: OffloadedEmbedding, optimizer: torch.optim.Optimizer) -> None:
    if emb._work is None:
        return
    fold(emb)
    if emb.padding_idx is not None:
        # The padding row is never trained (nn.Embedding gives it no gradient and SparseAdam no update),
        # but max_norm may have renormalised it: keep its pre-step weight and state to write back.
        pos = torch.nonzero(emb.working_ids == emb.padding_idx).squeeze(1)
        if pos.numel():
            emb._work.pad = (pos, emb.weight.data[pos].clone(),
                              {k: v[pos].clone() for k, v in emb._work.state_rows.items()})
    if emb.weight.grad is None:
        return  # the optimizer skips a parameter without gradient
    state = optimizer.state[emb.weight]
    if len(state) == 0 and emb._self_init:
        return  # the optimizer creates its state (fresh, as the host rows are) on this first step
    for k in emb._spec:
        state[k] = emb._work.state_rows[k]


def post_step(emb: OffloadedEmbedding, optimizer: torch.optim.Optimizer) -> None:
    work = emb._work
    if work is None or not work.folded:
        return
    if emb.weight.grad is None:
        end_work(emb, check=True)
        return
    state = optimizer.state[emb.weight]
    shape = emb.weight.shape
    for k, v in state.items():
        if isinstance(v, Tensor) and v.shape == shape and v.dim() > 0 and k not in emb._spec:
            raise RuntimeError(f"{type(optimizer).__name__} keeps per-row state {k!r} that offload does not "
                               f"know; declare it with offload.register_optimizer")
    rows = {k: state[k] for k in emb._spec}
    for k, v in rows.items():
        if not isinstance(v, Tensor) or v.shape != shape:
            raise RuntimeError(f"{type(optimizer).__name__} state {k!r} is not shaped like the rows {tuple(shape)}")
    store(emb, work, emb.weight.data, rows)
    for k in emb._spec:
        del state[k]
    finish_work(emb)
    _gpu_cache.launch_evicted(emb, wait=False)


def store(emb: OffloadedEmbedding, work: _Work, weight_rows: Tensor, state_rows: dict[str, Tensor]) -> None:
    """A stepped working set back: cached rows into the cache (dirty), the others to the host tables."""
    ids = torch.cat([c.ids for c in work.chunks]) if len(work.chunks) > 1 else work.chunks[0].ids
    if work.pad is not None:
        pos, w_pad, s_pad = work.pad
        weight_rows[pos] = w_pad
        for k in emb._spec:
            state_rows[k][pos] = s_pad[k]
    cache = emb._cache
    if cache is None or work.chunks[0].slots is None:
        _host_write.commit(ids, [(emb.table, weight_rows)] + [(emb._state_tables[k], state_rows[k]) for k in emb._spec])
        return
    # rows not cached land in the scratch row
    dest = torch.cat([c.slots for c in work.chunks]) if len(work.chunks) > 1 else work.chunks[0].slots
    srcs = [weight_rows, *(state_rows[k] for k in emb._spec)]
    if not (_cache_cuda.usable(dest.device) and _cache_cuda.store(cache.rows, dest, srcs, cache.dirty)):
        for part, rows in zip(cache.parts, srcs, strict=True):
            part.index_copy_(0, dest, rows)
        cache.dirty.index_fill_(0, dest, True)
    if not any(c.n_bypass for c in work.chunks):
        return
    offsets, bypass = 0, []
    for c in work.chunks:
        if c.n_bypass:
            bypass.append(c.miss_pos[c.n_admit:] + offsets)
        offsets += c.ids.numel()
    sel = torch.cat(bypass)
    _host_write.commit(ids[sel], [(emb.table, weight_rows[sel])] + [(emb._state_tables[k], state_rows[k][sel])
                                                          for k in emb._spec])


def end_work(emb: OffloadedEmbedding, check: bool) -> None:
    """Drop a working set that no optimizer stepped (writing back renormalised rows)."""
    work = emb._work
    if work is None:
        return
    if check and emb.weight._version != work.version and not work.folded:
        emb._work = None
        raise RuntimeError("OffloadedEmbedding.weight was changed in place (by an optimizer step?) but no "
                           "attached optimizer wrote the rows back: call offload.attach(optimizer)")
    if not work.folded:
        for c in work.chunks:
            _working_set.resolve_states(emb, c, rows=False)  # (the side streams' gathers are waited for)
    if work.renormed:
        w = emb.weight.data if len(work.chunks) == 1 or work.folded else \
            torch.cat([emb.weight.data] + [c.leaf.data for c in work.chunks[1:]])
        ids = torch.cat([c.ids for c in work.chunks])
        emb._write_rows(ids, w.detach())
    finish_work(emb)


def finish_work(emb: OffloadedEmbedding) -> None:
    emb._work = None
    emb.weight.grad = None
    emb.weight.data = torch.empty(0, emb.embedding_dim, dtype=emb.table.dtype, device=emb.weight.device)

