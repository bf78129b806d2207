"""Checkpoints of an :class:`~offload.OffloadedEmbedding`: a directory of ``.npy`` tables (the weight and
each per-row optimizer state) and ``meta.json`` (shape, dtype, padding, the optimizer's class and scalar
state), written and switched in atomically by :mod:`offload.checkpoint_files` (with a manifest of sizes and
CRC-32s) and loaded memory-mapped after checking it; the optimizer state is resumed at the next
:func:`~offload.attach` (:func:`resume_state`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import _gpu_cache, _npy, checkpoint_files
from ._table import HostTable

if TYPE_CHECKING:
    from ._embedding import OffloadedEmbedding

_META = "meta.json"


def save(emb: OffloadedEmbedding, path: str | os.PathLike) -> None:
    """:meth:`OffloadedEmbedding.save <offload.OffloadedEmbedding.save>`: the checkpoint of ``emb`` in the
    directory ``path``, atomically."""
    emb._require_idle("save")
    _gpu_cache.flush(emb)
    opt = emb._optimizer() if emb._optimizer is not None else None
    scalars = {}
    if opt is not None:
        for k, v in opt.state.get(emb.weight, {}).items():
            if k not in emb._spec:
                scalars[k] = _scalar_to_json(k, v)
    meta = {"format": 1, "num_embeddings": emb.num_embeddings, "embedding_dim": emb.embedding_dim,
            "dtype": str(emb.table.dtype).removeprefix("torch."), "padding_idx": emb.padding_idx,
            "optimizer": type(opt).__name__ if opt is not None else None,
            "row_state": sorted(emb._spec) if opt is not None else [], "scalars": scalars}
    with checkpoint_files.saving(path, markers=(_META,)) as writer:
        writer.write("weight.npy", lambda f: _npy.write_table(emb.table, f))
        for k, t in emb._state_tables.items():
            writer.write(f"state.{k}.npy", lambda f, t=t: _npy.write_table(t, f))
        writer.write_json(_META, meta)


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


def _resumable(emb: OffloadedEmbedding, files: checkpoint_files.CheckpointFiles, meta: dict,
               mmap_mode: str | None, pin: bool | None) -> dict | None:
    """What :func:`resume_state` needs, the state tables opened now: a later save to the same path cannot
    change what this load resumes."""
    if meta["optimizer"] is None:
        return None
    tables = {k: _table(files, f"state.{k}.npy", meta, mmap_mode=mmap_mode, device=emb.table.device, pin=pin,
                        engine=emb._engine) for k in meta["row_state"]}
    return {"path": files.path, "optimizer": meta["optimizer"], "row_state": meta["row_state"],
            "scalars": meta["scalars"], "tables": tables}


def load(emb: OffloadedEmbedding, path: str | os.PathLike, *, mmap_mode: str | None = "c",
         pin: bool | None = None, verify_checksums: bool = True) -> None:
    """:meth:`OffloadedEmbedding.load <offload.OffloadedEmbedding.load>`: the checkpoint in ``path`` into ``emb``."""
    emb._require_idle("load")
    files, meta = _open(path, mmap_mode, verify_checksums)
    dtype = getattr(torch, meta["dtype"])
    if (meta["num_embeddings"], meta["embedding_dim"]) != (emb.num_embeddings, emb.embedding_dim):
        raise ValueError(f"{files.path} holds a ({meta['num_embeddings']}, {meta['embedding_dim']}) table; this "
                         f"module has ({emb.num_embeddings}, {emb.embedding_dim})")
    if dtype != emb.table.dtype:
        raise ValueError(f"{files.path} holds a {dtype} table; this module's is {emb.table.dtype}")
    table = _table(files, "weight.npy", meta, mmap_mode=mmap_mode, device=emb.weight.device, pin=pin,
                   engine=emb._engine)
    old_table, emb.table = emb.table, table
    try:
        loaded = _resumable(emb, files, meta, mmap_mode, pin)
        files.check_unchanged()  # never the tables of two saves
    except BaseException:
        emb.table = old_table
        table.close()
        raise
    old_table.close()
    emb._drop_cache()
    emb._state_tables = {}
    emb._spec = {}
    emb._pending = None
    opt = emb._optimizer() if emb._optimizer is not None else None
    emb._optimizer = None
    emb._loaded = loaded
    if opt is not None:
        opt.state.pop(emb.weight, None)
        if emb._loaded is not None:
            emb._attach(opt)


def from_checkpoint(cls: type[OffloadedEmbedding], path: str | os.PathLike, *, mmap_mode: str | None = "c",
                    device=None, pin: bool | None = None, engine=None, verify_checksums: bool = True,
                    **kwargs) -> OffloadedEmbedding:
    """:meth:`OffloadedEmbedding.from_checkpoint <offload.OffloadedEmbedding.from_checkpoint>`."""
    files, meta = _open(path, mmap_mode, verify_checksums)
    table = _table(files, "weight.npy", meta, mmap_mode=mmap_mode, device=device, pin=pin, engine=engine)
    kwargs.setdefault("padding_idx", meta["padding_idx"])
    emb = cls(meta["num_embeddings"], meta["embedding_dim"], device=device, dtype=getattr(torch, meta["dtype"]),
              table=table, pin=pin, engine=engine, **kwargs)
    emb._loaded = _resumable(emb, files, meta, mmap_mode, pin)
    files.check_unchanged()  # never the tables of two saves
    return emb


def resume_state(emb: OffloadedEmbedding, optimizer: torch.optim.Optimizer, spec: dict[str, float],
                 loaded: dict) -> dict[str, HostTable]:
    """The per-row state tables of a loaded checkpoint (``loaded``, kept by :func:`load` until the next
    :func:`~offload.attach`) for ``optimizer``, whose state for the weight becomes the checkpoint's scalars.
    Refuses an optimizer of another class or other per-row state."""
    if loaded["optimizer"] != type(optimizer).__name__ or sorted(loaded["row_state"]) != sorted(spec):
        raise ValueError(f"the checkpoint holds state of {loaded['optimizer']} "
                         f"({sorted(loaded['row_state'])}); cannot resume it with "
                         f"{type(optimizer).__name__} ({sorted(spec)})")
    state = optimizer.state[emb.weight]
    state.clear()
    for k, v in loaded["scalars"].items():
        state[k] = _scalar_from_json(v, emb.weight.device)
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
