"""One-call checkpoints of a training run in one process: the ``BatchModule``, its optimizer, scheduler,
loss scaler, sweep state, the random number generators and anything else, saved atomically and resumed
bit for bit.

:func:`save_checkpoint` writes a directory (``checkpoint.json`` listing what it holds, one ``.pt`` file per
object: each object's own ``state_dict()``, so nothing is converted and resuming is exact) through
:mod:`offload.checkpoint_files`: the new version is written completely beside the old one with a manifest
of sizes and CRC-32s and switched in with one atomic step, so a process killed at any moment leaves the old
checkpoint or the new one, complete. :func:`load_checkpoint` checks every file it reads against the
manifest, and checks that the checkpoint holds what it is asked to load (the objects, their classes and
number of models) before it changes anything.

Several processes sharding the models (``torch.distributed``) save with
:func:`torchmb.distributed.save_checkpoint`, whose files are per model and independent of the world size.
"""

from __future__ import annotations

import io
import os
import random
from typing import Any, Protocol

import torch
from torch import nn

from offload import checkpoint_files

__all__ = ["CHECKPOINT_FORMAT", "Stateful", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FORMAT = "torchmb.checkpoint/1"
"""The ``format`` entry of a checkpoint's ``checkpoint.json``."""

_CONTENTS = "checkpoint.json"
_OBJECTS = ("models", "optimizer", "scheduler", "scaler", "sweep")


class Stateful(Protocol):
    """What :func:`save_checkpoint` saves: an object with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> dict[str, Any]:
        """The object's whole state, as ``torch.load(weights_only=True)`` can read it back."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Restore what :meth:`state_dict` returned."""
        ...


def _stateful(name: str, obj: Any) -> None:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"{name} must have state_dict() and load_state_dict() methods; got {type(obj).__name__}")


def _batch_of(obj: Any) -> int | None:
    batch = getattr(obj, "batch", None)
    return batch if isinstance(batch, int) and not isinstance(batch, bool) else None


def _serialized(name: str, value: Any) -> bytes:
    """``value`` as ``torch.save`` writes it, refused now if ``torch.load(weights_only=True)`` could not read
    it back (an arbitrary class), rather than at the load that resumes the run."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # torch raises UnpicklingError or RuntimeError naming the class
        raise TypeError(f"save_checkpoint: {name} holds something torch.load(weights_only=True) cannot read "
                        "back; keep to tensors, numbers, strings, None and lists, tuples and dicts of them "
                        f"({type(err).__name__}: {str(err).splitlines()[0]})") from err
    return data


def _rng_state() -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike[str],
    models: nn.Module,
    optimizer: Stateful | None = None,
    scheduler: Stateful | None = None,
    *,
    scaler: Stateful | None = None,
    sweep: Stateful | None = None,
    extra: Any = None,
    rng: bool = True,
) -> None:
    """Save a training run to the directory ``path``, atomically: a kill at any moment leaves the previous
    checkpoint or this one at ``path``, complete, never a mix.

    Args:
        path: the checkpoint directory; an existing one is replaced, any other existing path is refused.
        models: the ``BatchModule`` (any ``nn.Module``: its ``state_dict()`` is saved).
        optimizer, scheduler: a ``torchmb.optim`` optimizer and ``torchmb.lr_scheduler`` scheduler (any
            object with ``state_dict()`` / ``load_state_dict()``).
        scaler: a ``torchmb.amp.GradScaler``.
        sweep: the sweep's state, any object with ``state_dict()`` / ``load_state_dict()``.
        extra: anything else ``torch.load(weights_only=True)`` reads back (the step number, a data loader's
            ``torch.Generator().get_state()``, metrics); :func:`load_checkpoint` returns it.
        rng: also save the global random states (torch's CPU and CUDA generators, Python's ``random``,
            NumPy's), so dropout and data order resume as they would have gone on.
    """
    if not isinstance(models, nn.Module):
        raise TypeError(f"save_checkpoint expects a torchmb.BatchModule (an nn.Module), got {type(models).__name__}")
    objects = {"models": models, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "sweep": sweep}
    batch = _batch_of(models)
    for name, obj in objects.items():
        if obj is None or name == "models":
            continue
        _stateful(name, obj)
        if batch is not None and _batch_of(obj) not in (None, batch):
            raise ValueError(f"save_checkpoint: the {name} holds {_batch_of(obj)} models but the BatchModule {batch}")
    contents = {"format": CHECKPOINT_FORMAT, "batch": batch,
                "objects": {name: type(obj).__name__ for name, obj in objects.items() if obj is not None},
                "extra": extra is not None, "rng": rng}
    with checkpoint_files.saving(path, markers=(_CONTENTS,)) as writer:
        writer.torch_save("models.pt", models.state_dict())
        if optimizer is not None:
            writer.torch_save("optimizer.pt", optimizer.state_dict())
        for name in ("scheduler", "scaler", "sweep"):
            if objects[name] is not None:
                writer.write_bytes(f"{name}.pt", _serialized(f"the {name}'s state_dict()", objects[name].state_dict()))
        if extra is not None:
            writer.write_bytes("extra.pt", _serialized("extra", extra))
        if rng:
            writer.torch_save("rng.pt", _rng_state())
        writer.write_json(_CONTENTS, contents)


def load_checkpoint(
    path: str | os.PathLike[str],
    models: nn.Module | None = None,
    optimizer: Stateful | None = None,
    scheduler: Stateful | None = None,
    *,
    scaler: Stateful | None = None,
    sweep: Stateful | None = None,
    rng: bool = True,
    verify_checksums: bool = True,
    map_location: Any = None,
) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into the objects given, and return its ``extra``.

    Build the objects as for the saved run (the same model, B, optimizer class and parameter groups), then
    load: training goes on bit for bit as the saved run would have (with ``rng=True``, the default, the
    global random states come back too). Every object given must be in the checkpoint, of the saved class
    and number of models, and every file must match the checkpoint's manifest (sizes, and CRC-32s unless
    ``verify_checksums=False``); all of that is checked before anything is changed. A damaged file raises
    :class:`offload.checkpoint_files.DamagedFileError` naming it.

    Args:
        path: the checkpoint directory.
        models, optimizer, scheduler, scaler, sweep: the objects to load into (``None``: not loaded).
        rng: restore the global random states saved with the checkpoint.
        verify_checksums: check each file's CRC-32 (a full read; sizes are always checked).
        map_location: as ``torch.load``'s, for the saved tensors (``load_state_dict`` then copies them
            onto the objects' devices).

    Returns:
        The ``extra`` saved with the checkpoint (``None`` if none).
    """
    files, contents = open_with_contents(path, _CONTENTS, CHECKPOINT_FORMAT, "a torchmb checkpoint", verify_checksums)
    objects = {"models": models, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "sweep": sweep}
    saved = contents["objects"]
    states: dict[str, Any] = {}
    for name, obj in objects.items():
        if obj is None:
            continue
        if name != "models":
            _stateful(name, obj)
        if name not in saved:
            raise ValueError(f"load_checkpoint: {files.path} holds no {name} (it holds {sorted(saved)})")
        if type(obj).__name__ != saved[name]:
            raise TypeError(f"load_checkpoint: {files.path} holds the state of a {saved[name]} as {name}; "
                            f"this is a {type(obj).__name__}")
        if contents["batch"] is not None and _batch_of(obj) not in (None, contents["batch"]):
            raise ValueError(f"load_checkpoint: {files.path} holds {contents['batch']} models; the {name} holds "
                             f"{_batch_of(obj)} (build it with batch={contents['batch']}, or select() after)")
        states[name] = files.torch_load(f"{name}.pt", map_location=map_location)
    extra = files.torch_load("extra.pt", map_location=map_location) if contents["extra"] else None
    rng_state = files.torch_load("rng.pt") if rng and contents["rng"] else None
    files.check_unchanged()  # never the files of two saves
    for name, state in states.items():
        objects[name].load_state_dict(state)
    if rng_state is not None:
        _set_rng_state(rng_state)
    return extra


def open_with_contents(
    path: str | os.PathLike[str], contents_name: str, expected_format: str, what: str, verify_checksums: bool
) -> tuple[checkpoint_files.CheckpointFiles, dict[str, Any]]:
    """Open the checkpoint directory ``path`` and read its JSON file ``contents_name``, which must name
    ``expected_format`` (``what`` names the kind of checkpoint in the errors)."""
    files = checkpoint_files.open_checkpoint(path, verify_checksums=verify_checksums)
    contents_file = os.path.join(files.path, contents_name)
    if not files.verified and not os.path.isfile(contents_file):
        raise FileNotFoundError(f"{contents_file} does not exist: not {what} directory")
    contents = files.read_json(contents_name)
    if not isinstance(contents, dict) or contents.get("format") != expected_format:
        got = contents.get("format") if isinstance(contents, dict) else contents
        raise ValueError(f"{contents_file}: expected format {expected_format!r}, got {got!r}")
    return files, contents
