"""Checkpoints of an :class:`~offload.OffloadedEmbedding`: a directory of ``.npy`` tables (the weight and
each per-row optimizer state) and ``meta.json`` (shape, dtype, padding, the optimizer's class and scalar
state), written and switched in atomically by :mod:`offload.checkpoint_files` (with a manifest of sizes and
CRC-32s) and loaded memory-mapped after checking it; the optimizer state is resumed at the next
:func:`~offload.attach` (:func:`resume_state`)."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import _npy, checkpoint_files
from ._emb_prefetch import Prefetcher
from ._gpu_cache import GpuCache
from ._optim_state import OptimizerState
from ._row_tables import RowTables
from ._table import HostTable

_META = "meta.json"


class Checkpoints:
    """The checkpoint writer of an embedding whose rows live in ``tables``: it saves them with the optimizer
    state that ``optim`` switches (flushing ``cache`` first), and loads a checkpoint in their place
    (dropping ``cache`` and what ``prefetcher`` holds). The embedding checks first that no step is under way."""

    def __init__(self, tables: RowTables, optim: OptimizerState, cache: GpuCache, prefetcher: Prefetcher):
        self.tables = tables
        self.optim = optim
        self.cache = cache
        self.prefetcher = prefetcher

    def save(self, path: str | os.PathLike, weight: Tensor, padding_idx: int | None) -> None:
        """:meth:`OffloadedEmbedding.save <offload.OffloadedEmbedding.save>`: the tables, and the attached
        optimizer's state for ``weight`` (the working parameter), in the directory ``path``, atomically."""
        self.cache.flush()
        tables = self.tables
        opt = self.optim.optimizer
        scalars = {}
        if opt is not None:
            for k, v in opt.state.get(weight, {}).items():
                if k not in tables.spec:
                    scalars[k] = _scalar_to_json(k, v)
        meta = {"format": 1, "num_embeddings": tables.num_rows, "embedding_dim": tables.dim,
                "dtype": str(tables.dtype).removeprefix("torch."), "padding_idx": padding_idx,
                "optimizer": type(opt).__name__ if opt is not None else None,
                "row_state": sorted(tables.spec) if opt is not None else [], "scalars": scalars}
        with checkpoint_files.saving(path, markers=(_META,)) as writer:
            writer.write("weight.npy", lambda f: _npy.write_array(tables.weight.data, f))
            for k, t in tables.states.items():
                writer.write(f"state.{k}.npy", lambda f, t=t: _npy.write_array(t.data, f))
            writer.write_json(_META, meta)

    def load(self, path: str | os.PathLike, weight: Tensor, *, engine, mmap_mode: str | None = "c",
             pin: bool | None = None, verify_checksums: bool = True) -> torch.optim.Optimizer | None:
        """:meth:`OffloadedEmbedding.load <offload.OffloadedEmbedding.load>`: the checkpoint in ``path`` in
        place of the tables (new tables made with ``engine``, on ``weight``'s device). The attached optimizer
        is detached and its state for ``weight`` dropped; it is returned when the checkpoint holds optimizer
        state, for the embedding to attach it again (which resumes that state), else ``None``."""
        files, meta = _open(path, mmap_mode, verify_checksums)
        tables = self.tables
        dtype = getattr(torch, meta["dtype"])
        if (meta["num_embeddings"], meta["embedding_dim"]) != (tables.num_rows, tables.dim):
            raise ValueError(f"{files.path} holds a ({meta['num_embeddings']}, {meta['embedding_dim']}) table; "
                             f"this module has ({tables.num_rows}, {tables.dim})")
        if dtype != tables.dtype:
            raise ValueError(f"{files.path} holds a {dtype} table; this module's is {tables.dtype}")
        table = _table(files, "weight.npy", meta, mmap_mode=mmap_mode, device=weight.device, pin=pin, engine=engine)
        try:
            loaded = resumable(files, meta, mmap_mode=mmap_mode, device=table.device, pin=pin, engine=engine)
            files.check_unchanged()  # never the tables of two saves
        except BaseException:
            table.close()
            raise
        old_table, tables.weight = tables.weight, table
        old_table.close()
        self.cache.drop()
        self.prefetcher.clear()
        tables.set_states({}, {})
        opt = self.optim.optimizer
        self.optim.optimizer = None
        self.optim.loaded = loaded
        if opt is None:
            return None
        opt.state.pop(weight, None)
        return opt if loaded is not None else None


def _open(path: str | os.PathLike, mmap_mode: str | None, verify_checksums: bool
          ) -> tuple[checkpoint_files.CheckpointFiles, dict]:
    files = checkpoint_files.open_checkpoint(path, verify_checksums=verify_checksums)
    meta = files.read_json(_META)
    expected = {"num_embeddings", "embedding_dim", "dtype", "padding_idx", "optimizer", "row_state", "scalars"}
    if not isinstance(meta, dict) or not expected <= set(meta):
        raise checkpoint_files.DamagedFileError(
            f"{files.file(_META)} is not an OffloadedEmbedding checkpoint's meta.json: it lacks "
            f"{sorted(expected - set(meta)) if isinstance(meta, dict) else 'everything'}")
    names = ["weight.npy"]
    if meta["optimizer"] is not None:
        names += [f"state.{k}.npy" for k in meta["row_state"]]
    for name in names:
        files.file(name)  # every file checked before anything changes
    if mmap_mode == "r+":
        files.forget_checksums(names)  # training in place will change them
    return files, meta


def _table(files: checkpoint_files.CheckpointFiles, name: str, meta: dict, *, mmap_mode, device, pin,
           engine) -> HostTable:
    dtype = getattr(torch, meta["dtype"])
    table = HostTable.from_npy(files.file(name), mmap_mode=mmap_mode, dtype=dtype, device=device, pin=pin,
                               engine=engine)
    shape = (meta["num_embeddings"], meta["embedding_dim"])
    if tuple(table.shape) != shape:
        table.close()
        raise checkpoint_files.DamagedFileError(
            f"{files.file(name)} holds a {tuple(table.shape)} table where the checkpoint's meta.json says {shape}")
    return table


def open_checkpoint(path: str | os.PathLike, *, mmap_mode: str | None, verify_checksums: bool, device, pin,
                    engine) -> tuple[HostTable, dict, checkpoint_files.CheckpointFiles]:
    """:meth:`OffloadedEmbedding.from_checkpoint <offload.OffloadedEmbedding.from_checkpoint>`'s reading:
    ``(the weight's table, meta.json, the checkpoint's files)``, every file checked (see :func:`resumable`
    for the optimizer state, and ``check_unchanged`` of the files once it is opened)."""
    files, meta = _open(path, mmap_mode, verify_checksums)
    table = _table(files, "weight.npy", meta, mmap_mode=mmap_mode, device=device, pin=pin, engine=engine)
    return table, meta, files


def resumable(files: checkpoint_files.CheckpointFiles, meta: dict, *, mmap_mode: str | None, device, pin,
              engine) -> dict | None:
    """What :func:`resume_state` needs, the state tables opened now: a later save to the same path cannot
    change what this load resumes."""
    if meta["optimizer"] is None:
        return None
    tables = {k: _table(files, f"state.{k}.npy", meta, mmap_mode=mmap_mode, device=device, pin=pin,
                        engine=engine) for k in meta["row_state"]}
    return {"path": files.path, "optimizer": meta["optimizer"], "row_state": meta["row_state"],
            "scalars": meta["scalars"], "tables": tables}


def resume_state(weight: Tensor, optimizer: torch.optim.Optimizer, spec: dict[str, float],
                 loaded: dict) -> dict[str, HostTable]:
    """The per-row state tables of a loaded checkpoint (``loaded``, kept by :meth:`Checkpoints.load` until
    the next :func:`~offload.attach`) for ``optimizer``, whose state for ``weight`` becomes the checkpoint's
    scalars.
    Refuses an optimizer of another class or other per-row state."""
    if loaded["optimizer"] != type(optimizer).__name__ or sorted(loaded["row_state"]) != sorted(spec):
        raise ValueError(f"the checkpoint holds state of {loaded['optimizer']} "
                         f"({sorted(loaded['row_state'])}); cannot resume it with "
                         f"{type(optimizer).__name__} ({sorted(spec)})")
    state = optimizer.state[weight]
    state.clear()
    for k, v in loaded["scalars"].items():
        state[k] = _scalar_from_json(v, weight.device)
    return dict(loaded["tables"])


def _scalar_to_json(key: str, v) -> dict:
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise RuntimeError(f"optimizer state {key!r} is neither per-row nor a scalar: shape {tuple(v.shape)}")
        return {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch."), "device": v.device.type,
                "shape": list(v.shape)}
    if isinstance(v, (int, float, bool)):
        return {"value": v}
    raise RuntimeError(f"optimizer state {key!r} of type {type(v).__name__} cannot be saved by offload")


def _scalar_from_json(d: dict, device: torch.device):
    if "dtype" not in d:
        return d["value"]
    dev = device if d["device"] != "cpu" else torch.device("cpu")
    return torch.tensor(d["value"], dtype=getattr(torch, d["dtype"]), device=dev).reshape(d["shape"])
