"""torchmb.distributed.save_checkpoint killed mid-save leaves the old or the new checkpoint, whole, and
load_checkpoint names the damaged file of a torn, truncated or altered checkpoint (one process, a world of
1: the multi-rank saves are in test_distributed.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.killed_saves import kill_during_saves
from torch import nn

from offload.checkpoint_files import DamagedFileError
from torchmb import BatchModule, optim
from torchmb import distributed as tmd


def run(seed: int, batch: int = 3, width: int = 8):
    models = BatchModule(nn.Linear(width, width), batch, init="independent", seed=seed)
    optimizer = optim.SGD(models.parameters(), lr=0.1, momentum=0.9)
    models(torch.randn(batch, 2, width)).sum().backward()
    optimizer.step()
    return models, optimizer


def fingerprint(models: BatchModule, optimizer: optim.SGD) -> str:
    h = hashlib.sha256()
    for p in models.parameters():
        h.update(p.detach().numpy().tobytes())
        h.update(optimizer.state[p]["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()


def loaded(path: Path, batch: int = 3, width: int = 8) -> str:
    models = BatchModule(nn.Linear(width, width), batch)
    optimizer = optim.SGD(models.parameters(), lr=0.1, momentum=0.9)
    tmd.load_checkpoint(path, models, optimizer)
    return fingerprint(models, optimizer)


def test_save_killed_at_random_moments_leaves_old_or_new(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    runs = [run(seed, batch=8, width=160) for seed in (0, 1)]  # 8 files of 0.2 MB
    versions = [fingerprint(*r) for r in runs]
    cut_off = kill_during_saves(path, lambda v: tmd.save_checkpoint(path, *runs[v]),
                                lambda: loaded(path, batch=8, width=160), versions, seed=2)
    assert cut_off > 0


def test_a_checkpoint_mixing_two_saves_is_refused(tmp_path: Path) -> None:
    """Issue 27: files of two versions in one directory loaded without a word."""
    tmd.save_checkpoint(tmp_path / "a", *run(0))
    tmd.save_checkpoint(tmp_path / "b", *run(1))
    (tmp_path / "a" / "model-000001.pt").write_bytes((tmp_path / "b" / "model-000001.pt").read_bytes())
    with pytest.raises(DamagedFileError, match=r"a/model-000001\.pt is damaged: its CRC-32 is"):
        loaded(tmp_path / "a")


def test_damaged_files_are_named(tmp_path: Path) -> None:
    models, optimizer = run(0)
    tmd.save_checkpoint(tmp_path / "ckpt", models, optimizer)
    os.truncate(tmp_path / "ckpt" / "model-000002.pt", 200)
    with pytest.raises(DamagedFileError, match=r"ckpt/model-000002\.pt is damaged: 200 bytes where"):
        loaded(tmp_path / "ckpt")
    os.truncate(tmp_path / "ckpt" / "index.json", 10)
    with pytest.raises(DamagedFileError, match=r"ckpt/index\.json is damaged: 10 bytes where"):
        tmd.checkpoint_batch(tmp_path / "ckpt")


def test_damaged_files_of_a_checkpoint_without_manifest_are_named(tmp_path: Path) -> None:
    """Checkpoints saved before manifests load unverified; what torch or json cannot read is still named."""
    models, optimizer = run(0)
    tmd.save_checkpoint(tmp_path / "ckpt", models, optimizer)
    (tmp_path / "ckpt" / "manifest.json").unlink()
    assert loaded(tmp_path / "ckpt") == fingerprint(models, optimizer)
    os.truncate(tmp_path / "ckpt" / "model-000001.pt", 300)
    with pytest.raises(DamagedFileError, match=r"ckpt/model-000001\.pt is damaged: torch cannot read it"):
        loaded(tmp_path / "ckpt")
    os.truncate(tmp_path / "ckpt" / "index.json", 10)
    with pytest.raises(DamagedFileError, match=r"ckpt/index\.json is damaged: not valid JSON"):
        loaded(tmp_path / "ckpt")


def test_saving_over_a_directory_of_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"is a directory of other files \(no manifest\.json, index\.json\)"):
        tmd.save_checkpoint(tmp_path, *run(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_save_that_fails_midway_leaves_the_checkpoint_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    models, optimizer = run(0)
    tmd.save_checkpoint(tmp_path / "ckpt", models, optimizer)
    expected = fingerprint(models, optimizer)
    other = run(1)
    calls = []

    def failing(index: int):
        calls.append(index)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return BatchModule.state_dict_of(other[0], index)

    monkeypatch.setattr(other[0], "state_dict_of", failing)
    with pytest.raises(OSError, match="No space left on device"):
        tmd.save_checkpoint(tmp_path / "ckpt", *other)
    assert loaded(tmp_path / "ckpt") == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def two_rank_save(path: Path, runs: list, version: int, store: Path) -> None:
    """``save_checkpoint`` of ``runs[version]`` (one (models, optimizer) per rank) by two gloo ranks: forked
    processes, so the test process never joins a process group."""
    store.unlink(missing_ok=True)
    ranks = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                dist.init_process_group("gloo", store=dist.FileStore(str(store), 2), rank=rank, world_size=2)
                tmd.save_checkpoint(path, *runs[version][rank])
                dist.destroy_process_group()
                code = 0
            finally:
                os._exit(code)
        ranks.append(pid)
    for pid in ranks:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


# Slow, and on a loaded 2-core machine its kills can all miss the save (it once saw none land mid-save in
# CI's conditions); the single-process and one-rank kill tests stay in the default run.
@pytest.mark.slow
def test_two_rank_save_killed_at_random_moments_leaves_old_or_new(tmp_path: Path) -> None:
    path, store = tmp_path / "out" / "ckpt", tmp_path / "store"
    path.parent.mkdir()
    runs, versions = [], []
    for seed in (0, 1):
        models, optimizer = run(seed, batch=8, width=160)
        versions.append(fingerprint(models, optimizer))
        shards = []
        for owned in tmd.shard_slices(8, 2):
            local, local_opt = run(0, batch=owned.stop - owned.start, width=160)
            local.load_state_dicts(models.state_dicts()[owned])
            local_opt.load_model_state(list(range(owned.stop - owned.start)), optimizer,
                                       list(range(owned.start, owned.stop)))
            shards.append((local, local_opt))
        runs.append(shards)
    cut_off = kill_during_saves(path, lambda v: two_rank_save(path, runs, v, store),
                                lambda: loaded(path, batch=8, width=160), versions, seed=4, kills=4)
    assert cut_off > 0
