"""Checkpoints of an :class:`~offload.OffloadedEmbedding`: a directory of ``.npy`` tables (the weight and
each per-row optimizer state) and ``meta.json`` (shape, dtype, padding, the optimizer's class and scalar
state), written atomically and loaded memory-mapped; the optimizer state is resumed at the next
:func:`~offload.attach` (:func:`resume_state`)."""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import _gpu_cache
from ._table import HostTable

if TYPE_CHECKING:
    from ._embedding import OffloadedEmbedding


def save(emb: OffloadedEmbedding, path: str | os.PathLike) -> None:
    """:meth:`OffloadedEmbedding.save <offload.OffloadedEmbedding.save>`: the checkpoint of ``emb`` in the
    directory ``path``, atomically."""
    emb._require_idle("save")
    _gpu_cache.flush(emb)
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        emb.table.save_npy(os.path.join(tmp, "weight.npy"))
        for k, t in emb._state_tables.items():
            t.save_npy(os.path.join(tmp, f"state.{k}.npy"))
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
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load(emb: OffloadedEmbedding, path: str | os.PathLike, *, mmap_mode: str | None = "c",
         pin: bool | None = None) -> None:
    """:meth:`OffloadedEmbedding.load <offload.OffloadedEmbedding.load>`: the checkpoint in ``path`` into ``emb``."""
    emb._require_idle("load")
    path = os.fspath(path)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    dtype = getattr(torch, meta["dtype"])
    if (meta["num_embeddings"], meta["embedding_dim"]) != (emb.num_embeddings, emb.embedding_dim):
        raise ValueError(f"{path} holds a ({meta['num_embeddings']}, {meta['embedding_dim']}) table; this "
                         f"module has ({emb.num_embeddings}, {emb.embedding_dim})")
    if dtype != emb.table.dtype:
        raise ValueError(f"{path} holds a {dtype} table; this module's is {emb.table.dtype}")
    table = HostTable.from_npy(os.path.join(path, "weight.npy"), mmap_mode=mmap_mode, dtype=dtype,
                               device=emb.weight.device, pin=pin, engine=emb._engine)
    emb.table.close()
    emb.table = table
    emb._drop_cache()
    emb._state_tables = {}
    emb._spec = {}
    emb._pending = None
    opt = emb._optimizer() if emb._optimizer is not None else None
    emb._optimizer = None
    emb._loaded = None
    if meta["optimizer"] is not None:
        emb._loaded = {"path": path, "mmap_mode": mmap_mode, "pin": pin, "optimizer": meta["optimizer"],
                        "row_state": meta["row_state"], "scalars": meta["scalars"]}
    if opt is not None:
        opt.state.pop(emb.weight, None)
        if emb._loaded is not None:
            emb._attach(opt)


def from_checkpoint(cls: type[OffloadedEmbedding], path: str | os.PathLike, *, mmap_mode: str | None = "c",
                    device=None, pin: bool | None = None, engine=None, **kwargs) -> OffloadedEmbedding:
    """:meth:`OffloadedEmbedding.from_checkpoint <offload.OffloadedEmbedding.from_checkpoint>`."""
    path = os.fspath(path)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    dtype = getattr(torch, meta["dtype"])
    table = HostTable.from_npy(os.path.join(path, "weight.npy"), mmap_mode=mmap_mode, dtype=dtype,
                               device=device, pin=pin, engine=engine)
    kwargs.setdefault("padding_idx", meta["padding_idx"])
    emb = cls(meta["num_embeddings"], meta["embedding_dim"], device=device, dtype=dtype, table=table,
              pin=pin, engine=engine, **kwargs)
    if meta["optimizer"] is not None:
        emb._loaded = {"path": path, "mmap_mode": mmap_mode, "pin": pin, "optimizer": meta["optimizer"],
                       "row_state": meta["row_state"], "scalars": meta["scalars"]}
    return emb


def resume_state(emb: OffloadedEmbedding, optimizer: torch.optim.Optimizer, spec: dict[str, float],
                 loaded: dict) -> dict[str, HostTable]:
    """The per-row state tables of a loaded checkpoint (``loaded``, kept by :func:`load` until the next
    :func:`~offload.attach`) for ``optimizer``, whose state for the weight becomes the checkpoint's scalars.
    Refuses an optimizer of another class or other per-row state."""
    tables: dict[str, HostTable] = {}
    if loaded["optimizer"] != type(optimizer).__name__ or sorted(loaded["row_state"]) != sorted(spec):
        raise ValueError(f"the checkpoint holds state of {loaded['optimizer']} "
                         f"({sorted(loaded['row_state'])}); cannot resume it with "
                         f"{type(optimizer).__name__} ({sorted(spec)})")
    for k in spec:
        tables[k] = HostTable.from_npy(os.path.join(loaded["path"], f"state.{k}.npy"),
                                       mmap_mode=loaded["mmap_mode"], dtype=emb.table.dtype,
                                       device=emb.table.device, pin=loaded["pin"], engine=emb._engine)
    state = optimizer.state[emb.weight]
    state.clear()
    for k, v in loaded["scalars"].items():
        state[k] = _scalar_from_json(v, emb.weight.device)
    return tables


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
