"""Optimizer-state switching of an :class:`~offload.OffloadedEmbedding` (:class:`OptimizerState`): which
optimizer is attached and which per-row state it keeps (in the host tables of :class:`RowTables`), and the
step hooks around ``optimizer.step()``: before it the working rows are folded into one parameter and their
state handed to the optimizer (:meth:`~OptimizerState.pre_step`), after it rows and state go back to the
cache or the host tables (:meth:`~OptimizerState.post_step`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from . import _cache_cuda, _host_write
from ._gpu_cache import GpuCache
from ._row_tables import RowTables
from ._table import HostTable
from ._working_set import WorkingSet, _Work


class OptimizerState:
    """The attached optimizer of an embedding whose rows live in ``tables``, and the switching of its per-row
    state between the host tables (or ``cache``) and ``optimizer.state`` around each step of ``work``.

    ``self_init``: the optimizer creates fresh per-row state itself at its first step (so nothing is handed
    to it then); ``loaded``: a checkpoint's optimizer state, resumed at the next attach."""

    def __init__(self, tables: RowTables, cache: GpuCache, work: WorkingSet):
        self.tables = tables
        self.cache = cache
        self.work = work
        self._optimizer: weakref.ref | None = None
        self.self_init = True
        self.loaded: dict | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer() if self._optimizer is not None else None

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer, spec: dict[str, float], states: dict[str, HostTable],
               self_init: bool) -> None:
        """Start switching ``spec``'s per-row state (held in ``states``) for ``optimizer``."""
        self.tables.set_states(spec, states)
        self.self_init = self_init
        self.optimizer = optimizer

    def fold(self, weight: nn.Parameter) -> None:
        """Before step: one working parameter for all chunks, and its per-row optimizer state."""
        work = self.work.current
        if work.folded:
            return
        if len(work.chunks) > 1:
            leaves = [c.leaf for c in work.chunks[1:]]
            grads = [weight.grad] + [leaf.grad for leaf in leaves]
            datas = [weight.data] + [leaf.data for leaf in leaves]
            if all(g is None for g in grads):
                new_grad = None
            else:
                new_grad = torch.cat([torch.zeros_like(d) if g is None else g for g, d in zip(grads, datas,
                                                                                              strict=True)])
            weight.data = torch.cat(datas)
            weight.grad = new_grad
        work.version = weight._version
        states = [self.work.resolve_states(c) for c in work.chunks]
        work.state_rows = {k: torch.cat([s[k] for s in states]) if len(states) > 1 else states[0][k]
                           for k in self.tables.keys}
        work.folded = True

    def pre_step(self, optimizer: torch.optim.Optimizer, weight: nn.Parameter,
                 padding_rows: Callable[[Tensor], Tensor | None]) -> None:
        """Before ``optimizer.step()``: the working rows folded into ``weight`` and their state handed to the
        optimizer. ``padding_rows(ids)``: the positions among the working rows' ``ids`` of padding rows
        (``None`` without padding)."""
        work = self.work.current
        if work is None:
            return
        self.fold(weight)
        pos = padding_rows(work.all_ids())
        if pos is not None:
            # A padding row is never trained (nn.Embedding gives it no gradient and SparseAdam no update),
            # but max_norm may have renormalised it: keep its pre-step weight and state to write back.
            if pos.numel():
                work.pad = (pos, weight.data[pos].clone(), {k: v[pos].clone() for k, v in work.state_rows.items()})
        if weight.grad is None:
            return  # the optimizer skips a parameter without gradient
        state = optimizer.state[weight]
        if len(state) == 0 and self.self_init:
            return  # the optimizer creates its state (fresh, as the host rows are) on this first step
        for k in self.tables.keys:
            state[k] = work.state_rows[k]

    def post_step(self, optimizer: torch.optim.Optimizer, weight: nn.Parameter) -> None:
        work = self.work.current
        if work is None or not work.folded:
            return
        if weight.grad is None:
            self.end_work(weight, check=True)
            return
        state = optimizer.state[weight]
        shape = weight.shape
        keys = self.tables.keys
        for k, v in state.items():
            if isinstance(v, Tensor) and v.shape == shape and v.dim() > 0 and k not in keys:
                raise RuntimeError(f"{type(optimizer).__name__} keeps per-row state {k!r} that offload does not "
                                   f"know; declare it with offload.register_optimizer")
        rows = {k: state[k] for k in keys}
        for k, v in rows.items():
            if not isinstance(v, Tensor) or v.shape != shape:
                raise RuntimeError(f"{type(optimizer).__name__} state {k!r} is not shaped like the rows "
                                   f"{tuple(shape)}")
        self.store(work, weight.data, rows)
        for k in keys:
            del state[k]
        self.finish_work(weight)
        self.cache.launch_evicted(wait=False)

    def store(self, work: _Work, weight_rows: Tensor, state_rows: dict[str, Tensor]) -> None:
        """A stepped working set back: cached rows into the cache (dirty), the others to the host tables."""
        ids = work.all_ids()
        keys = self.tables.keys
        if work.pad is not None:
            pos, w_pad, s_pad = work.pad
            weight_rows[pos] = w_pad
            for k in keys:
                state_rows[k][pos] = s_pad[k]
        srcs = [weight_rows, *(state_rows[k] for k in keys)]
        cache = self.cache.slots
        if cache is None or work.chunks[0].slots is None:
            _host_write.commit(ids, list(zip(self.tables.all(), srcs, strict=True)))
            return
        # rows not cached land in the scratch row
        dest = torch.cat([c.slots for c in work.chunks]) if len(work.chunks) > 1 else work.chunks[0].slots
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
        _host_write.commit(ids[sel], [(t, rows[sel]) for t, rows in zip(self.tables.all(), srcs, strict=True)])

    def end_work(self, weight: nn.Parameter, check: bool) -> None:
        """Drop a working set that no optimizer stepped (writing back renormalised rows)."""
        work = self.work.current
        if work is None:
            return
        if check and weight._version != work.version and not work.folded:
            self.work.current = None
            raise RuntimeError("OffloadedEmbedding.weight was changed in place (by an optimizer step?) but no "
                               "attached optimizer wrote the rows back: call offload.attach(optimizer)")
        if not work.folded:
            for c in work.chunks:
                self.work.resolve_states(c, rows=False)  # (the side streams' gathers are waited for)
        if work.renormed:
            self.cache.write_rows(work.all_ids(), work.weight_rows(weight.data).detach())
        self.finish_work(weight)

    def finish_work(self, weight: nn.Parameter) -> None:
        self.work.current = None
        weight.grad = None
        weight.data = torch.empty(0, self.tables.dim, dtype=self.tables.dtype, device=weight.device)
