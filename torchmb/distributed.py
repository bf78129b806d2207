"""Several GPUs or processes: the model axis sharded across the ranks of a ``torch.distributed`` group.

The B models of a ``BatchModule`` are independent, so a sweep too large for one device splits along the
model axis: rank ``r`` of ``world`` keeps a contiguous slice of the models (:func:`shard_slices`; the first
``B % world`` ranks hold one model more), with their optimizer state and per-model hyperparameters, and
trains it exactly as a single process would. Nothing is communicated inside a training step; the ranks
meet only to gather per-model metrics (:func:`gather_models`, in global model order) and to save or load
a checkpoint (:func:`save_checkpoint`: B plain per-model files, whatever the world size).

Start the processes with ``torchrun``; NCCL on GPUs, gloo on CPU. Every function here also works without
an initialised process group, as rank 0 of a world of 1, so one script runs alone or under ``torchrun``.

Typical script::

    device = torchmb.distributed.init_from_env("cuda")       # torchrun's env; one GPU per rank
    lrs = torch.logspace(-4, 0, 2048, dtype=torch.float64)     # the whole grid, on every rank
    models = torchmb.distributed.local_batch_module(Net(), 2048, init="independent", seed=0).to(device)
    optimizer = torchmb.optim.SGD(models.parameters(), lr=torchmb.distributed.shard_values(lrs))
    gen = torch.Generator().manual_seed(0)                     # same seed: same batches on every rank
    for step in range(steps):
        ...train the local models on shared batches; no communication...
    accuracy = torchmb.distributed.gather_models(local_accuracy)   # (2048,), on every rank
    torchmb.distributed.save_checkpoint("ckpt", models, optimizer)
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

import torchmb_config
from offload import checkpoint_files

from ._module import BatchModule
from .checkpoint import open_with_contents
from .lr_scheduler import BatchLRScheduler
from .optim import BatchOptimizer

if TYPE_CHECKING:
    import optuna

__all__ = [
    "CHECKPOINT_FORMAT",
    "checkpoint_batch",
    "create_study",
    "gather_models",
    "init_from_env",
    "load_checkpoint",
    "local_batch_module",
    "rank_and_world_size",
    "save_checkpoint",
    "shard",
    "shard_slice",
    "shard_slices",
    "shard_values",
]

CHECKPOINT_FORMAT = "torchmb.distributed.checkpoint/1"
"""The ``format`` entry of a checkpoint's ``index.json``."""

_INDEX = "index.json"


# ---- the process group -------------------------------------------------------------------------
def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` (the default group when ``None``) and the group's size.

    Without an initialised process group: ``(0, 1)``.
    """
    if not _initialised():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def init_from_env(device: str | torch.device = "cpu", *, backend: str | None = None) -> torch.device:
    """Join the process group that ``torchrun`` describes in the environment, and pick this rank's device.

    Under ``torchrun`` (``WORLD_SIZE`` and ``RANK`` set) the default process group is initialised if it is
    not yet: NCCL for a CUDA ``device``, gloo otherwise (or ``backend``). A CUDA device without an index
    becomes ``cuda:LOCAL_RANK``, made current. Outside ``torchrun`` nothing is initialised and the device
    is returned as it is, so the same script runs alone.

    Args:
        device: ``"cpu"``, ``"cuda"`` or a specific device.
        backend: the ``torch.distributed`` backend; ``None`` chooses from the device.

    Returns:
        The device this rank trains on.
    """
    device = torch.device(device)
    launched = torchmb_config.launcher_environment()
    if launched.world_size is None:
        return device
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE is set (torchrun?) but this torch build has no torch.distributed")
    if device.type == "cuda" and device.index is None:
        local_rank = launched.local_rank
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this machine shows {torch.cuda.device_count()} CUDA "
                "devices; start at most one process per GPU (torchrun --nproc-per-node)"
            )
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    return device


# ---- which rank owns which models --------------------------------------------------------------
def shard_slices(batch: int, world_size: int) -> list[slice]:
    """The contiguous slice of models each rank owns: ``world_size`` slices covering ``range(batch)``.

    The first ``batch % world_size`` ranks hold one model more than the others (as ``numpy.array_split``).

    Examples::

        >>> shard_slices(10, 4)
        [slice(0, 3, None), slice(3, 6, None), slice(6, 8, None), slice(8, 10, None)]
    """
    for name, value in (("batch", batch), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if batch < world_size:
        raise ValueError(
            f"cannot shard {batch} models over {world_size} ranks: every rank needs at least one "
            f"model (use at most {batch} processes, or more models)"
        )
    size, extra = divmod(batch, world_size)
    slices, start = [], 0
    for rank in range(world_size):
        stop = start + size + (rank < extra)
        slices.append(slice(start, stop))
        start = stop
    return slices


def shard_slice(batch: int, *, rank: int | None = None, world_size: int | None = None, group: Any = None) -> slice:
    """The slice of the ``batch`` models that ``rank`` owns (this process's rank in ``group`` by default)."""
    own_rank, own_world = rank_and_world_size(group)
    rank = own_rank if rank is None else rank
    world_size = own_world if world_size is None else world_size
    slices = shard_slices(batch, world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise IndexError(f"rank must lie in [0, {world_size}), got {rank!r}")
    return slices[rank]


def shard_values(values: Any, batch: int | None = None, *, group: Any = None) -> Any:
    """This rank's rows of a per-model value: ``values[shard_slice(B)]`` for a ``(B, ...)`` tensor or sequence.

    A number (shared by all models) is returned as it is, so hyperparameters pass through one call
    whether they are per model or not. ``batch`` (B) is checked against ``len(values)`` when given.
    """
    if isinstance(values, (int, float)) or (isinstance(values, Tensor) and values.dim() == 0):
        return values
    if not isinstance(values, Tensor):
        inferred = torch.as_tensor(values)
        # Python floats are doubles: keep every digit of a hyperparameter (torch would infer float32)
        values = torch.as_tensor(values, dtype=torch.float64) if inferred.is_floating_point() else inferred
    total = int(values.shape[0])
    if batch is not None and total != batch:
        raise ValueError(
            f"expected {batch} per-model values (one per model), got {total} (shape {tuple(values.shape)})"
        )
    return values[shard_slice(total, group=group)]


def local_batch_module(
    model: torch.nn.Module,
    batch: int,
    *,
    init: str = "copy",
    seed: int | None = None,
    group: Any = None,
) -> BatchModule:
    """This rank's models of ``BatchModule(model, batch, init=init, seed=seed)``, without building the others.

    With ``init="independent"`` model ``i`` of the whole sweep is seeded with ``seed + i`` on whichever
    rank owns it, so rank ``r``'s models equal rows ``shard_slice(batch)`` of the single-process module, bit
    for bit. A seed is required then: every rank must agree on it.
    """
    if init == "independent" and seed is None:
        raise ValueError("local_batch_module(init='independent') needs a seed shared by every rank")
    owned = shard_slice(batch, group=group)
    return BatchModule(model, owned.stop - owned.start, init=init, seed=None if seed is None else seed + owned.start)


def shard(models: BatchModule, *objects: Any, group: Any = None) -> slice:
    """Keep only this rank's models in ``models`` and every object beside it (optimizer, scheduler, scaler).

    Every rank must hold the same B models (built with the same seed); each keeps its contiguous slice,
    in place, through ``select``: parameters keep their identity, and the optimizer keeps its state and
    per-model hyperparameters for the models it keeps.

    Returns:
        The slice of the global model indices this rank now holds.
    """
    if not isinstance(models, BatchModule):
        raise TypeError(f"shard expects a torchmb.BatchModule first, got {type(models).__name__}")
    for obj in objects:
        if not callable(getattr(obj, "select", None)):
            raise TypeError(f"{type(obj).__name__} has no select(keep) method")
        batch = getattr(obj, "batch", models.batch)
        if batch != models.batch:
            raise ValueError(f"{type(obj).__name__} holds {batch} models but the BatchModule {models.batch}")
    batches = _all_gather_object(models.batch, group)
    if len(set(batches)) != 1:
        raise ValueError(f"every rank must hold the same models before sharding; the ranks hold {batches}")
    owned = shard_slice(models.batch, group=group)
    if owned.stop - owned.start == models.batch:
        return owned
    keep = list(range(owned.start, owned.stop))
    models.select(keep)
    for obj in objects:
        obj.select(keep)
    return owned


# ---- metrics --------------------------------------------------------------------------------------
def _all_gather_object(value: Any, group: Any) -> list[Any]:
    if not _initialised():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _comm_device(group: Any, fallback: torch.device) -> torch.device:
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return fallback


def gather_models(values: Tensor | Sequence[float], *, dst: int | None = None, group: Any = None) -> Tensor | None:
    """Concatenate every rank's per-model values ``(b_rank, ...)`` in rank order: ``(B, ...)``, global model order.

    Each rank may hold any number of models (uneven shards, or different survivors after pruning); the
    trailing shape and the dtype must agree. ``dst=None`` returns the result on every rank;
    ``dst=k`` only on rank ``k`` (the others get ``None``). The result is on ``values``' device. Call it
    from every rank of the group, outside the training step (it is a collective).
    """
    values = torch.as_tensor(values)
    if values.dim() == 0:
        raise ValueError("gather_models expects per-model values of shape (models, ...), got a scalar")
    rank, world = rank_and_world_size(group)
    if dst is not None and not (isinstance(dst, int) and 0 <= dst < world):
        raise IndexError(f"dst must be a rank in [0, {world}) or None, got {dst!r}")
    if world == 1:
        return values.detach().clone()
    meta = _all_gather_object((int(values.shape[0]), tuple(values.shape[1:]), str(values.dtype)), group)
    if len({(shape, dtype) for _, shape, dtype in meta}) != 1:
        described = ", ".join(f"rank {r}: {(n, *shape)} {dtype}" for r, (n, shape, dtype) in enumerate(meta))
        raise ValueError(f"gather_models: every rank must give the same trailing shape and dtype; got {described}")
    sizes = [n for n, _, _ in meta]
    device = _comm_device(group, values.device)
    local = values.detach().to(device)
    if local.dtype == torch.bool:  # not every backend reduces bools
        local = local.to(torch.uint8)
    padded = local.new_zeros((max(max(sizes), 1), *local.shape[1:]))
    padded[: local.shape[0]] = local
    if dst is None:
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
    else:
        global_dst = dst if group is None else dist.get_global_rank(group, dst)
        parts = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
        dist.gather(padded, parts, dst=global_dst, group=group)
        if rank != dst:
            return None
    assert parts is not None
    out = torch.cat([part[:n] for part, n in zip(parts, sizes)])
    return out.to(values.device, values.dtype)


# ---- checkpoints ----------------------------------------------------------------------------------
def _optimizer_rows(optimizer: BatchOptimizer) -> list[dict[str, Any]]:
    """Model ``j``'s part of the optimizer: its hyperparameters (numbers), its state rows, the shared rest."""
    batch = optimizer.batch
    packed = optimizer.state_dict()
    host = {  # one device-to-host copy per state tensor, then rows
        index: {key: value.detach().cpu() if isinstance(value, Tensor) else value for key, value in entries.items()}
        for index, entries in packed["state"].items()
    }
    per_model = [optimizer.per_model_hyperparameters(group) for group in optimizer.param_groups]
    rows = []
    for j in range(batch):
        groups = []
        for group, names in zip(packed["param_groups"], per_model):
            row = {}
            for key, value in group.items():
                if key in names:
                    row[key] = tuple(float(v[j]) for v in value) if isinstance(value, tuple) else float(value[j])
                else:
                    row[key] = list(value) if key == "params" else value
            groups.append(row)
        state = {}
        for index, entries in host.items():
            state[index] = {
                key: (
                    value[j].clone()
                    if isinstance(value, Tensor) and value.dim() and value.shape[0] == batch
                    else value.clone()
                    if isinstance(value, Tensor)
                    else value
                )
                for key, value in entries.items()
            }
        rows.append({"type": type(optimizer).__name__, "param_groups": groups, "per_model": per_model, "state": state})
    return rows


def _load_optimizer_rows(optimizer: BatchOptimizer, rows: list[dict[str, Any]], what: str) -> None:
    batch = optimizer.batch
    if len(rows) != batch:
        raise ValueError(f"{what}: {len(rows)} models in the checkpoint slice but the optimizer holds {batch}")
    kinds = {row["type"] for row in rows}
    if kinds != {type(optimizer).__name__}:
        raise TypeError(
            f"{what}: the checkpoint holds {sorted(kinds)} optimizer state, this is a {type(optimizer).__name__}"
        )
    if any(len(row["param_groups"]) != len(optimizer.param_groups) for row in rows):
        raise ValueError(
            f"{what}: the checkpoint has {len(rows[0]['param_groups'])} parameter groups, the "
            f"optimizer {len(optimizer.param_groups)}"
        )
    params: list[tuple[Tensor, dict[str, Any]]] = []
    for g, group in enumerate(optimizer.param_groups):
        saved = [row["param_groups"][g] for row in rows]
        names = set(rows[0]["per_model"][g])
        if len(saved[0]["params"]) != len(group["params"]):
            raise ValueError(
                f"{what}: parameter group {g} holds {len(saved[0]['params'])} parameters in the "
                f"checkpoint and {len(group['params'])} in the optimizer"
            )
        for key in saved[0]:
            if key == "params":
                continue
            values = [s[key] for s in saved]
            if key in names:
                if isinstance(values[0], tuple):
                    value: Any = tuple(
                        torch.tensor([v[i] for v in values], dtype=torch.float64) for i in range(len(values[0]))
                    )
                else:
                    value = torch.tensor(values, dtype=torch.float64)
                if key in optimizer.per_model:
                    optimizer.set_hyperparameter(key, value, group=g)
                else:  # e.g. a scheduler's initial_lr
                    group[key] = value
                continue
            if any(not _same(v, values[0]) for v in values[1:]):
                raise ValueError(
                    f"{what}: param_groups[{g}][{key!r}] is shared by all models but the checkpoint's "
                    f"models disagree on it: {values}"
                )
            if key in group and not _same(group[key], values[0]):
                raise ValueError(
                    f"{what}: param_groups[{g}][{key!r}] is {values[0]!r} in the checkpoint and "
                    f"{group[key]!r} in this optimizer"
                )
            group[key] = values[0]
        params.extend((p, group) for p in group["params"])
    for index, (p, group) in enumerate(params):
        saved_state = [row["state"].get(index) for row in rows]
        optimizer.state.pop(p, None)
        if all(not s for s in saved_state):
            continue
        state = optimizer.state_for(p, group)  # fresh state for the models whose files hold none
        keys = dict.fromkeys(key for s in saved_state if s for key in s)
        for key in keys:
            present = [(j, s[key]) for j, s in enumerate(saved_state) if s and key in s]
            first = present[0][1]
            per_model = (
                key in state
                and isinstance(state[key], Tensor)
                and state[key].dim() > 0
                and state[key].shape[0] == batch
                and isinstance(first, Tensor)
            )
            if key not in state and len(present) == batch and isinstance(first, Tensor):
                state[key] = torch.stack([v for _, v in present]).to(p.device)
                continue
            if not per_model:
                if key not in state and len(present) != batch:
                    raise ValueError(f"{what}: state entry {key!r} of parameter {index} is held by only some models")
                state[key] = first
                continue
            target = state[key]
            rows_at = torch.tensor([j for j, _ in present], dtype=torch.int64)
            stacked = torch.stack([v for _, v in present])
            if tuple(stacked.shape[1:]) != tuple(target.shape[1:]):
                raise ValueError(
                    f"{what}: state entry {key!r} of parameter {index} has per-model shape "
                    f"{tuple(stacked.shape[1:])} in the checkpoint and {tuple(target.shape[1:])} here"
                )
            if key in optimizer.cpu_state:  # bookkeeping vectors may be shared: never in place
                state[key] = target.index_copy(0, rows_at, stacked.to(target.dtype))
            else:
                target.index_copy_(0, rows_at.to(target.device), stacked.to(target.device, target.dtype))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _scheduler_rows(scheduler: BatchLRScheduler) -> list[dict[str, Any]]:
    batch = scheduler.batch
    packed = scheduler.state_dict()
    per_model = set(scheduler.per_model_state())
    rows = []
    for j in range(batch):
        row: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        for key, value in packed.items():
            if key in ("base_lrs", "_last_lr"):
                row[key], kinds[key] = [float(v[j]) for v in value], "groups"
            elif key in per_model and isinstance(value, Tensor):
                row[key], kinds[key] = value[j].clone(), "tensor"
            elif key in per_model:
                row[key], kinds[key] = value[j], "list"
            else:
                row[key] = value
        rows.append({"type": type(scheduler).__name__, "state": row, "per_model": kinds})
    return rows


def _load_scheduler_rows(scheduler: BatchLRScheduler, rows: list[dict[str, Any]], what: str) -> None:
    if len(rows) != scheduler.batch:
        raise ValueError(
            f"{what}: {len(rows)} models in the checkpoint slice but the scheduler holds {scheduler.batch}"
        )
    kinds = {row["type"] for row in rows}
    if kinds != {type(scheduler).__name__}:
        raise TypeError(
            f"{what}: the checkpoint holds {sorted(kinds)} scheduler state, this is a {type(scheduler).__name__}"
        )
    per_model = rows[0]["per_model"]
    state: dict[str, Any] = {}
    for key, value in rows[0]["state"].items():
        kind = per_model.get(key)
        column = [row["state"][key] for row in rows]
        if kind == "groups":
            state[key] = [torch.tensor([v[g] for v in column], dtype=torch.float64) for g in range(len(value))]
        elif kind == "tensor":
            state[key] = torch.stack(column)
        elif kind == "list":
            state[key] = column
        else:
            if isinstance(value, (int, float, str, bool)) and any(v != value for v in column[1:]):
                raise ValueError(
                    f"{what}: scheduler entry {key!r} is shared by all models but the checkpoint's "
                    f"models disagree on it: {column}"
                )
            state[key] = value
    scheduler.load_state_dict(state)


def save_checkpoint(
    path: str | os.PathLike[str],
    models: BatchModule,
    optimizer: BatchOptimizer | None = None,
    scheduler: BatchLRScheduler | None = None,
    *,
    group: Any = None,
) -> int:
    """Save every rank's models as one checkpoint of B plain per-model files, whatever the world size.

    ``path`` is a directory (on storage every rank can reach) holding ``model-000000.pt`` ... one file
    per model in global model order (rank 0's models first), each a dict with the model's plain state
    dict (CPU tensors) under ``"model"`` (``torch.load(f)["model"]`` loads into the original ``nn.Module``), and, when
    given, its optimizer state (its hyperparameters as numbers and its state rows) and its scheduler
    state; plus ``index.json`` naming the files and ``manifest.json`` (every file's size and CRC-32). Each
    rank writes the files of its own models into a temporary directory beside ``path``; rank 0 then writes
    the index and the manifest and switches the new version in with one atomic step
    (:mod:`offload.checkpoint_files`), so a process killed at any moment leaves the old checkpoint or the
    new one at ``path``, complete, never a mix. An existing ``path`` that is not a checkpoint is refused.
    Call it from every rank (it is a collective); an error on any rank raises on every rank and leaves
    the checkpoint as it was.

    Returns:
        B, the number of models in the checkpoint.
    """
    if not isinstance(models, BatchModule):
        raise TypeError(f"save_checkpoint expects a torchmb.BatchModule, got {type(models).__name__}")
    for obj, cls, name in ((optimizer, BatchOptimizer, "optimizer"), (scheduler, BatchLRScheduler, "scheduler")):
        if obj is not None and not isinstance(obj, cls):
            raise TypeError(f"{name} must be a torchmb {cls.__name__}, got {type(obj).__name__}")
        if obj is not None and obj.batch != models.batch:
            raise ValueError(f"the {name} holds {obj.batch} models but the BatchModule {models.batch}")
    rank, _ = rank_and_world_size(group)
    sizes = _all_gather_object(models.batch, group)
    start, total = sum(sizes[:rank]), sum(sizes)
    failure: BaseException | None = None
    writer = None
    if rank == 0:
        try:
            writer = checkpoint_files.begin_save(path, markers=(_INDEX,))
        except Exception as err:
            failure = err
    directory, error = _all_gather_object(
        (None if writer is None else writer.directory, None if failure is None else repr(failure)), group)[0]
    _raise_first_failure(failure, [error], None)
    if writer is None:  # every rank writes its files into rank 0's temporary directory
        writer = checkpoint_files.CheckpointWriter(os.path.abspath(path), directory)
    try:
        optimizer_rows = _optimizer_rows(optimizer) if optimizer is not None else None
        scheduler_rows = _scheduler_rows(scheduler) if scheduler is not None else None
        for j in range(models.batch):
            plain = OrderedDict((key, value.cpu()) for key, value in models.state_dict_of(j).items())
            entry: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "index": start + j, "model": plain}
            if optimizer_rows is not None:
                entry["optimizer"] = optimizer_rows[j]
            if scheduler_rows is not None:
                entry["scheduler"] = scheduler_rows[j]
            writer.torch_save(_file_name(start + j), entry)
    except Exception as err:  # the others must hear of it, or they would wait for this rank forever
        failure = err
    written = _all_gather_object((writer.records, None if failure is None else repr(failure)), group)
    _raise_first_failure(failure, [error for _, error in written], writer if rank == 0 else None)
    if rank == 0:
        try:
            records = {name: record for part, _ in written for name, record in part.items()}
            index = {
                "format": CHECKPOINT_FORMAT,
                "batch": total,
                "files": [_file_name(i) for i in range(total)],
                "optimizer": optimizer is not None,
                "scheduler": scheduler is not None,
                "saved_by_world_size": len(sizes),
            }
            records[_INDEX] = writer.write_json(_INDEX, index)
            writer.commit(records)
        except Exception as err:
            failure = err
    committed = _all_gather_object(None if failure is None else repr(failure), group)[0]
    _raise_first_failure(failure, [committed], writer if rank == 0 else None)
    return total


def _raise_first_failure(own: BaseException | None, errors: list[str | None],
                         writer: checkpoint_files.CheckpointWriter | None) -> None:
    """After a save's collective: raise this rank's error, or another rank's; the temporary directory goes."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if writer is not None:
        writer.abort()
    if own is not None:
        raise own
    rank, error = failed[0]
    raise RuntimeError(f"save_checkpoint failed on rank {rank} ({error}); the checkpoint was left as it was")


def _file_name(index: int) -> str:
    return f"model-{index:06d}.pt"


def _barrier(group: Any) -> None:
    if _initialised():
        dist.barrier(group=group)


def _read_index(path: str | os.PathLike[str], verify_checksums: bool = True
                ) -> tuple[checkpoint_files.CheckpointFiles, dict[str, Any]]:
    return open_with_contents(path, _INDEX, CHECKPOINT_FORMAT, "a torchmb.distributed checkpoint", verify_checksums)


def checkpoint_batch(path: str | os.PathLike[str]) -> int:
    """The number of models B in the checkpoint at ``path`` (to build this rank's ``BatchModule``)."""
    return int(_read_index(path)[1]["batch"])


def load_checkpoint(
    path: str | os.PathLike[str],
    models: BatchModule,
    optimizer: BatchOptimizer | None = None,
    scheduler: BatchLRScheduler | None = None,
    *,
    group: Any = None,
    verify_checksums: bool = True,
) -> slice:
    """Load this rank's models (``shard_slice(B)`` of the current world) from a :func:`save_checkpoint` directory.

    The checkpoint may come from any world size. ``models`` (and ``optimizer`` / ``scheduler``, built on
    its parameters the same way as when saving) must hold exactly this rank's share: with
    ``owned = shard_slice(checkpoint_batch(path))``, build them with ``batch = owned.stop - owned.start``
    (or with :func:`local_batch_module`).
    Parameters keep their identity; the optimizer gets back every model's hyperparameters and state.
    Each rank checks the files it reads against the checkpoint's manifest first (sizes, and CRC-32s unless
    ``verify_checksums=False``): a missing, truncated or altered file raises
    :class:`offload.checkpoint_files.DamagedFileError` naming it, before anything is loaded.

    Returns:
        The slice of the global model indices loaded on this rank.
    """
    if not isinstance(models, BatchModule):
        raise TypeError(f"load_checkpoint expects a torchmb.BatchModule, got {type(models).__name__}")
    files, index = _read_index(path, verify_checksums)
    total = int(index["batch"])
    rank, world = rank_and_world_size(group)
    owned = shard_slice(total, group=group)
    count = owned.stop - owned.start
    what = f"load_checkpoint({str(path)!r}) on rank {rank} of {world}"
    if models.batch != count:
        raise ValueError(
            f"{what}: this rank loads models {owned.start}..{owned.stop - 1} of B={total} ({count} "
            f"models) but the BatchModule holds {models.batch}; build it with batch={count}"
        )
    if optimizer is not None and not index["optimizer"]:
        raise ValueError(f"{what}: the checkpoint holds no optimizer state")
    if scheduler is not None and not index["scheduler"]:
        raise ValueError(f"{what}: the checkpoint holds no scheduler state")
    entries = []
    for i in range(owned.start, owned.stop):
        entry = files.torch_load(index["files"][i], map_location="cpu")
        if not isinstance(entry, dict) or entry.get("format") != CHECKPOINT_FORMAT or entry.get("index") != i:
            raise ValueError(f"{what}: {index['files'][i]} is not model {i} of this checkpoint")
        entries.append(entry)
    files.check_unchanged()  # never the files of two saves
    models.load_state_dicts([entry["model"] for entry in entries])
    if optimizer is not None:
        _load_optimizer_rows(optimizer, [entry["optimizer"] for entry in entries], what)
    if scheduler is not None:
        _load_scheduler_rows(scheduler, [entry["scheduler"] for entry in entries], what)
    return owned


# ---- sweeps ---------------------------------------------------------------------------------------
def create_study(study_name: str, *, group: Any = None, **kwargs: Any) -> optuna.Study:
    """``torchmb.sweep.create_study`` from every rank: rank 0 creates the study, then the others join it.

    Creating the storage's tables from several processes at once can race (SQLite in particular);
    this orders it. Keyword arguments go to :func:`torchmb.sweep.create_study`; give each rank its own
    sampler seed (``seed + rank``) so the ranks do not ask for the same hyperparameters. Every rank then
    asks its own :class:`torchmb.sweep.TrialBatch` of the study.
    """
    from . import sweep

    rank, _ = rank_and_world_size(group)
    study = sweep.create_study(study_name, **kwargs) if rank == 0 else None
    _barrier(group)
    if rank != 0:
        study = sweep.create_study(study_name, **{**kwargs, "load_if_exists": True})
    _barrier(group)
    return study
