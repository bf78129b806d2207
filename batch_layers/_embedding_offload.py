"""``batch_layers.Embedding(..., offload=True)``: B models' tables, and their optimizer state, on the host.

The B tables of ``num_embeddings`` rows live in one :class:`offload.HostTable` of ``B * num_embeddings``
rows: model ``b``'s row ``i`` is host row ``b * num_embeddings + i``. A forward turns the merged,
models-major indices into those host rows and looks them up through an :class:`offload.OffloadedEmbedding`
over the whole table, so everything offload does (deduplication, bounds checks, the GPU cache of hot rows,
prefetch, write-back of rows and optimizer state after ``optimizer.step()``, checkpoints) serves all B
models at once, and a training loop changes exactly as for one offloaded table::

    emb = batch_layers.Embedding(num, dim, batch=B, offload=True)   # was: batch=B
    opt = offload.attach(torch.optim.Adam(model.parameters()))       # was: torch.optim.Adam(...)

Each host row keeps its own optimizer state, so the B models' state never mixes; scalar state (Adam's
``step``) is shared by the table and advances every step for every model, as it does for B plain models
stepped together. The optimizer is a ``torch.optim`` one with the same hyperparameters for all B models:
the working parameter holds the step's rows of all models, ``(rows, dim)`` with no model axis, so
``torchmb.optim``'s per-model hyperparameters have nothing to broadcast over and are refused at
:func:`offload.attach` (train the offloaded table with a ``torch.optim`` optimizer and the other parameters
with ``torchmb.optim``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

import offload as _offload

from ._base import AbstractBatchModule
from ._embedding import _SHARED_DOC, Embedding, set_offloaded_class
from .functional._embedding import SPARSE_MESSAGE as _SPARSE_MSG
from .functional._embedding import normalize_padding_idx as _normalize_padding
from .functional._embedding import raise_bad_indices as _raise_bad_now

__all__ = ["OffloadedBatchEmbedding", "offload_embeddings"]


@runtime_checkable
class PerModelOptimizer(Protocol):
    """An optimizer whose hyperparameters may differ between models, as ``torchmb.optim``'s: ``per_model``
    names those hyperparameters (values broadcast over each parameter's model axis). batch_layers owns this
    protocol (it does not import torchmb); an offloaded table's working parameter has no model axis, so such
    an optimizer cannot train it."""

    per_model: tuple[str, ...]


class _HostRows(_offload.OffloadedEmbedding):
    """The flat ``(B * rows, dim)`` offloaded table behind :class:`OffloadedBatchEmbedding`.

    Differs from :class:`offload.OffloadedEmbedding` in two places: the padding row is one per model
    (``b * rows + pad`` for every ``b``: zero at initialisation, never trained), and ``torchmb.optim``
    optimizers are refused with an explanation.
    """

    def __init__(self, num_rows: int, dim: int, *, rows: int, pad: int | None, **kwargs):
        object.__setattr__(self, "_rows", rows)  # before nn.Module.__init__: reset_parameters reads them
        object.__setattr__(self, "_pad", pad)
        super().__init__(num_rows, dim, **kwargs)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self._pad is not None:
            with torch.no_grad():
                self.table.data.view(-1, self._rows, self.embedding_dim)[:, self._pad].zero_()

    def _attach(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, PerModelOptimizer):
            raise TypeError(
                f"torchmb.optim.{type(optimizer).__name__} cannot train an offloaded batch_layers.Embedding: its "
                "working parameter holds only the current step's rows of all B models, (rows, dim) with no model "
                "axis, so per-model hyperparameters have nothing to broadcast over. Train the embedding with a "
                "torch.optim optimizer (one set of hyperparameters for all models), e.g. "
                "offload.attach(torch.optim.Adam(emb.parameters())), and the other parameters with torchmb.optim"
            )
        super()._attach(optimizer)

    def _padding_rows(self, ids: Tensor) -> Tensor | None:
        # Every model's padding row among the working rows keeps its pre-step weight and state (what
        # OffloadedEmbedding does for its single padding row): nn.Embedding gives it no gradient, and lazy
        # optimizers no update (no weight decay either).
        if self._pad is None:
            return None
        return torch.nonzero(ids.remainder(self._rows) == self._pad).squeeze(1)


class OffloadedBatchEmbedding(Embedding):
    r"""``batch`` independent :class:`torch.nn.Embedding` tables kept, with their optimizer state, in host
    memory; what ``batch_layers.Embedding(..., offload=True)`` builds.

    The B tables are one :class:`offload.HostTable` of ``B * num_embeddings`` rows (model ``b``'s row ``i``
    is host row ``b * num_embeddings + i``); ``weight`` is the *working parameter*: the distinct rows that
    the step looks up, of all B models, switched in by ``forward`` (see :class:`offload.OffloadedEmbedding`).
    Build the optimizer from ``model.parameters()`` and call :func:`offload.attach` on it once: after every
    ``optimizer.step()`` the updated rows and their optimizer state go back to the host.

    Args:
        num_embeddings, embedding_dim, padding_idx, max_norm, norm_type: as for
            :class:`batch_layers.Embedding` (per model).
        scale_grad_by_freq, _freeze, batch, device, dtype: likewise. ``device`` is the compute device (the
            working rows'); ``.to()`` moves it, the tables stay in host memory.
        sparse: must be ``False`` (gradients already cover only the step's rows).
        _weight: initial ``(batch, num_embeddings, embedding_dim)`` tables, copied into host memory.
        offload: must be ``True`` (the flag that selects this class).
        cache_rows, cache_bytes, pin, engine: as for :class:`offload.OffloadedEmbedding`; ``cache_rows``
            counts rows of all models together.

    Semantics are offload's lazy ones: a row that no model looks up in a step is not touched (no weight
    decay, no momentum drift); every model's ``padding_idx`` row gets no gradient and no update;
    ``max_norm`` renormalises the looked-up rows at switch-in, as ``nn.Embedding`` does at lookup;
    ``scale_grad_by_freq`` counts frequencies in each model's own mini-batch. Optimizers: every
    elementwise ``torch.optim`` optimizer offload supports (SGD, Adam, AdamW, Adagrad, RMSprop, ...), one set
    of hyperparameters for all B models; ``torchmb.optim`` ones are refused (see the module docstring).

    Shape:
        - Input: ``(B*n, *)`` int64/int32 indices with the model axis merged into dim 0.
        - Output: ``(B*n, *, embedding_dim)``.

    {shared}

    ``weight.no_model_axis`` is ``True``: the working parameter has no leading model axis, so per-model
    tools (``torchmb.clip``, ``torchmb.optim``) must not be given it.

    ``state_dict()`` holds ``weight`` as the full ``(B, num_embeddings, embedding_dim)`` table (a view of
    host memory, cached rows written back first), so ``BatchModule.state_dicts()`` / ``unbatch`` give
    plain per-model state dicts. ``BatchModule.select`` is refused: the tables and their optimizer state
    are not re-indexed along the model axis.

    Bad indices raise ``IndexError`` naming the value and the per-model table size before any host row is
    read.

    Examples::

        >>> emb = Embedding(1000, 8, batch=4, offload=True)
        >>> opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
        >>> emb(torch.randint(0, 1000, (4 * 5, 3))).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        offload: bool = True,
        cache_rows: int = 0,
        cache_bytes: int | None = None,
        pin: bool | None = None,
        engine: str | None = None,
    ) -> None:
        AbstractBatchModule.__init__(self, batch)
        if not offload:
            raise ValueError("OffloadedBatchEmbedding is Embedding(..., offload=True); for tables on the compute "
                             "device use batch_layers.Embedding without offload")
        if sparse:
            raise ValueError(_SPARSE_MSG)
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = _normalize_padding(padding_idx, num_embeddings)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = False
        self.offload = True
        compute = torch.device(device) if device is not None else torch.device("cpu")
        table = None
        if _weight is not None:
            expected = (batch, num_embeddings, embedding_dim)
            if tuple(_weight.shape) != expected:
                raise ValueError(f"_weight must have shape (batch, num_embeddings, embedding_dim) = {expected}, "
                                 f"got {tuple(_weight.shape)}")
            dtype = dtype or _weight.dtype
            table = self._new_table(dtype, compute, pin, engine)
            with torch.no_grad():
                table.data.view(expected).copy_(_weight.detach())
        rows = _HostRows(
            batch * num_embeddings, embedding_dim, rows=num_embeddings, pad=self.padding_idx, max_norm=max_norm,
            norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, _freeze=_freeze, device=compute,
            dtype=dtype, table=table, cache_rows=cache_rows, cache_bytes=cache_bytes, pin=pin, engine=engine,
        )
        # Not a submodule: its one parameter is registered here as ``weight`` (the same tensor, so
        # offload.attach finds the table through it) and the state dict is this module's (B, num, dim) view.
        object.__setattr__(self, "_host", rows)
        self.weight = rows.weight
        # Marks the one parameter of a batched model without a leading model axis, for per-model tools
        # (torchmb.optim, torchmb.clip) to recognise and refuse rather than read its rows as models.
        self.weight.no_model_axis = True

    def _new_table(self, dtype: torch.dtype, device: torch.device, pin, engine) -> _offload.HostTable:
        return _offload.HostTable(self.batch * self.num_embeddings, self.embedding_dim, dtype, device=device,
                                  pin=pin, engine=engine, fill=None)

    # -- the model axis cannot change ---------------------------------------------------------------------
    @property
    def batch(self) -> int:
        """The number of models B (fixed: the host table is laid out by it)."""
        return self.__dict__["_batch"]

    @batch.setter
    def batch(self, value: int) -> None:
        old = self.__dict__.get("_batch")
        if old is not None and value != old:
            raise RuntimeError(
                f"an offloaded batch_layers.Embedding keeps B = {old} models' tables and optimizer state in one "
                f"host table; it cannot change to {value} models (BatchModule.select is not supported with "
                "offload=True: save the models' state dicts and build a new BatchModule instead)"
            )
        self.__dict__["_batch"] = value

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_module(cls, module: nn.Module, batch: int, *, offload: bool = True, cache_rows: int = 0,
                    cache_bytes: int | None = None, pin: bool | None = None, engine: str | None = None,
                    device: torch.device | str | None = None) -> OffloadedBatchEmbedding:
        """The offloaded layer of ``module``'s settings, its tables written straight into host memory.

        ``module`` is a plain ``nn.Embedding`` (every model starts from a copy of its table) or a batched
        :class:`Embedding` of ``batch`` models (each model keeps its own table: the way to offload the
        embedding of a converted ``torchmb.BatchModule``). ``device`` is the compute device (``module``'s
        by default); the other options are those of the constructor.
        """
        if isinstance(module, OffloadedBatchEmbedding):
            raise TypeError("from_module: the module is already offloaded")
        if isinstance(module, Embedding):
            if module.batch != batch:
                raise ValueError(f"from_module: the batched Embedding holds {module.batch} models, batch={batch}")
            tables = module.weight.detach()
        elif isinstance(module, nn.Embedding):
            if module.sparse:
                raise ValueError(_SPARSE_MSG)
            # an expanded view: the copies go straight into host memory, no (B, num, dim) temporary
            tables = module.weight.detach().unsqueeze(0).expand(batch, *module.weight.shape)
        else:
            raise TypeError(f"from_module expects an nn.Embedding or a batch_layers.Embedding, got "
                            f"{type(module).__name__}")
        w = module.weight
        return cls(module.num_embeddings, module.embedding_dim, module.padding_idx, module.max_norm,
                   module.norm_type, module.scale_grad_by_freq, _weight=tables, _freeze=not w.requires_grad,
                   batch=batch, device=w.device if device is None else device, offload=offload,
                   cache_rows=cache_rows, cache_bytes=cache_bytes, pin=pin, engine=engine)

    def reset_parameters(self) -> None:
        """Every model's table from N(0, 1), its padding row zeroed (as ``nn.Embedding``); clears the cache.
        Optimizer state already on the host is kept."""
        self._host.reset_parameters()

    # -- lookups -----------------------------------------------------------------------------------------
    def _host_rows(self, input: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
        """``(local, host row)`` indices of a merged ``(B*n, *)`` (or, shared, ``(n, *)``) index tensor,
        both shaped like the output's leading dims; bounds are checked before anything touches the host."""
        if not isinstance(input, Tensor):
            raise TypeError(f"input must be a tensor of indices, got {type(input).__name__}")
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input must be an integer tensor of dtype int64 or int32, got {input.dtype}")
        B, num = self.batch, self.num_embeddings
        if not shared:
            self.check_merged(input)
        local = input.to(self.weight.device, torch.int64)
        if local.numel():
            _raise_bad_now(local, num)
        offsets = torch.arange(B, device=local.device, dtype=torch.int64) * num
        if shared:
            local = local.unsqueeze(0).expand(B, *local.shape)
            host = local + offsets.view(B, *([1] * (local.dim() - 1)))
            return local.reshape(B * input.shape[0], *input.shape[1:]), host.reshape(B * input.shape[0],
                                                                                     *input.shape[1:])
        host = (local.reshape(B, -1) + offsets.unsqueeze(1)).view(input.shape)
        return local, host

    def forward(self, input: Tensor) -> Tensor:
        local, host = self._host_rows(input, self.is_shared(input))
        out = self._host(host)
        if self.padding_idx is not None and torch.is_grad_enabled() and out.requires_grad:
            # no gradient into any model's padding row (nn.Embedding's rule), its value as looked up
            out = torch.where((local == self.padding_idx).unsqueeze(-1), out.detach(), out)
        return out

    def prepare(self, indices: Tensor, *, shared: bool = False) -> None:
        """Switch in the rows of the merged ``(B*n, *)`` indices (``shared=True``: ``(n, *)`` looked up by
        every model) for the coming step; see :meth:`offload.OffloadedEmbedding.prepare`."""
        self._host.prepare(self._host_rows(indices, shared)[1])

    def prefetch(self, indices: Tensor, *, shared: bool = False) -> None:
        """Start gathering the rows (and optimizer state) of the next step's merged indices on a side
        stream; see :meth:`offload.OffloadedEmbedding.prefetch`."""
        self._host.prefetch(self._host_rows(indices, shared)[1])

    def check(self) -> None:
        """Nothing to do: bad indices raise at the lookup (before any host access)."""

    # -- the host side -----------------------------------------------------------------------------------
    @property
    def offloaded(self) -> _offload.OffloadedEmbedding:
        """The :class:`offload.OffloadedEmbedding` of ``B * num_embeddings`` rows behind this layer (for
        ``offload.attach(optimizer, emb.offloaded)``, ``offload.detach`` and the like)."""
        return self._host

    @property
    def table(self) -> _offload.HostTable:
        """The :class:`offload.HostTable` of all B tables, ``(B * num_embeddings, embedding_dim)``."""
        return self._host.table

    def table_of(self, model: int) -> Tensor:
        """Model ``model``'s ``(num_embeddings, embedding_dim)`` table: a view of host memory (call
        :meth:`flush` first when a cache holds newer rows)."""
        if not -self.batch <= model < self.batch:
            raise IndexError(f"model index {model} is out of range for batch={self.batch}")
        return self._host.table.block(model % self.batch, self.num_embeddings)

    @property
    def state_tables(self) -> dict[str, _offload.HostTable]:
        """Host tables of per-row optimizer state, each ``(B * num_embeddings, embedding_dim)``."""
        return self._host.state_tables

    @property
    def working_ids(self) -> Tensor | None:
        """Host rows of the current step's working rows (``weight``'s row order); ``working_ids //
        num_embeddings`` is each row's model. ``None`` between steps."""
        return self._host.working_ids

    def cache_stats(self) -> dict[str, int]:
        """``{"capacity", "hits", "misses"}`` of the GPU cache of hot rows (all models together)."""
        return self._host.cache_stats()

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host tables."""
        self._host.flush()

    def save(self, path) -> None:
        """Save the B tables and their optimizer state; see :meth:`offload.OffloadedEmbedding.save`."""
        self._host.save(path)

    def load(self, path, *, mmap_mode: str | None = "c", pin: bool | None = None,
             verify_checksums: bool = True) -> None:
        """Load a checkpoint written by :meth:`save` of a layer of the same B, rows and dim; see
        :meth:`offload.OffloadedEmbedding.load`."""
        self._host.load(path, mmap_mode=mmap_mode, pin=pin, verify_checksums=verify_checksums)

    # -- state dicts ---------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        host = self._host
        host.flush()
        if keep_vars:
            # The caller may write through this view (BatchModule.load_state_dicts does): cached copies
            # of rows would then be stale, so the (clean, just flushed) cache is dropped.
            host.release_cache()
        view = host.table.data.view(self.batch, self.num_embeddings, self.embedding_dim)
        destination[prefix + "weight"] = view if keep_vars else view.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        expected = (self.batch, self.num_embeddings, self.embedding_dim)
        if tuple(value.shape) != expected:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, the "
                              f"offloaded tables have shape {expected}")
            return
        self._host._load_from_state_dict({key: value.reshape(-1, self.embedding_dim)}, prefix, local_metadata,
                                         strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        s = nn.Embedding.extra_repr(self) + f", batch={self.batch}, offload=True"
        if self._host.cache_rows or self._host.cache_bytes:
            s += f", cache_rows={self._host.cache_stats()['capacity']}"
        return s


OffloadedBatchEmbedding.__doc__ = OffloadedBatchEmbedding.__doc__.replace("{shared}", _SHARED_DOC)
set_offloaded_class(OffloadedBatchEmbedding)  # what Embedding(..., offload=True) builds


def offload_embeddings(module: nn.Module, *, names: Iterable[str] | None = None, **options) -> list[str]:
    """Swap the batched :class:`Embedding` layers inside ``module`` (a ``torchmb.BatchModule`` or any
    module tree) for their offloaded form, each model keeping its own table; returns the swapped names.

    Args:
        module: the tree to change in place.
        names: qualified names of the embeddings to swap (as in ``module.named_modules()``); all when ``None``.
        options: ``cache_rows``, ``cache_bytes``, ``pin``, ``engine``, ``device`` for
            :meth:`OffloadedBatchEmbedding.from_module`.

    Build the optimizer after the swap (the dense weights it would hold are gone). The dense ``(B, num, dim)``
    weights existed until now; for tables too large for that, swap in one built from the plain model's layer
    instead: ``bm.module.embed = batch_layers.Embedding.from_module(plain.embed, B, offload=True)``.
    """
    wanted = None if names is None else set(names)
    found = {name: m for name, m in module.named_modules()
             if isinstance(m, Embedding) and not isinstance(m, OffloadedBatchEmbedding)
             and (wanted is None or name in wanted)}
    if wanted is not None and wanted - set(found):
        raise KeyError(f"no batched (not yet offloaded) Embedding named {sorted(wanted - set(found))} in "
                       f"{type(module).__name__}; found {sorted(found)}")
    if "" in found:
        raise ValueError("offload_embeddings changes layers inside a module; use "
                         "Embedding.from_module(emb, emb.batch, offload=True) for a lone Embedding")
    for name, m in found.items():
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, OffloadedBatchEmbedding.from_module(m, m.batch, **options))
    return sorted(found)
