"""offload.checkpoint_files and the saves built on it (OffloadedEmbedding.save, HostTable.save_npy): a kill
at any moment leaves the old or the new version, whole; loads refuse damaged files naming them; what killed
saves left is removed by the next save or load; modes follow the umask."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from support.killed_saves import kill_during_saves

import offload
from offload import checkpoint_files
from offload.checkpoint_files import DamagedFileError

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1" / "single" / "ckpt"


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def host() -> str:
    return "".join(c if c.isalnum() or c == "." else "_" for c in socket.gethostname())


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trained_embedding(seed: int, rows: int = 64, dim: int = 8) -> tuple[offload.OffloadedEmbedding, torch.optim.Adam]:
    torch.manual_seed(seed)
    emb = offload.OffloadedEmbedding(rows, dim)
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=0.1))
    for _ in range(2):
        emb(torch.randint(0, rows, (32,))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return emb, opt


def embedding_digest(emb: offload.OffloadedEmbedding, opt: torch.optim.Optimizer) -> str:
    emb.flush()
    tables = [emb.table.data] + [emb.state_tables[k].data for k in sorted(emb.state_tables)]
    return digest(*tables, opt.state[emb.weight]["step"].reshape(1))


def loaded_digest(path: Path) -> str:
    emb = offload.OffloadedEmbedding.from_checkpoint(path, mmap_mode=None)
    return embedding_digest(emb, offload.attach(torch.optim.Adam(emb.parameters(), lr=0.1)))


# ---- kills ---------------------------------------------------------------------------------------------
def test_embedding_save_killed_at_random_moments_leaves_old_or_new(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    runs = [trained_embedding(seed, rows=30_000, dim=32) for seed in (0, 1)]  # 3 tables of 4 MB each
    versions = [embedding_digest(*run) for run in runs]
    cut_off = kill_during_saves(path, lambda v: runs[v][0].save(path), lambda: loaded_digest(path), versions,
                                seed=0)
    assert cut_off > 0  # some kill landed mid-save
    runs[0][0].save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_host_table_save_killed_at_random_moments_leaves_old_or_new(tmp_path: Path) -> None:
    path = tmp_path / "table.npy"
    g = torch.Generator().manual_seed(0)
    tables = [offload.HostTable.from_tensor(torch.randn(100_000, 32, generator=g)) for _ in range(2)]  # 13 MB
    versions = [digest(t.data) for t in tables]
    cut_off = kill_during_saves(path, lambda v: tables[v].save_npy(path),
                                lambda: digest(offload.HostTable.from_npy(path, mmap_mode=None).data), versions, seed=1)
    assert cut_off > 0
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- the switch, recovery and leftovers -----------------------------------------------------------------
def write_version(path: Path, text: str) -> None:
    with checkpoint_files.saving(path) as writer:
        writer.write_bytes("data.txt", text.encode())


def read_version(path: Path) -> str:
    return checkpoint_files.open_checkpoint(path).read_bytes("data.txt").decode()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_save_replaces_the_whole_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    if not exchange:
        monkeypatch.setattr(checkpoint_files, "_exchange", lambda a, b: False)
    path = tmp_path / "ckpt"
    write_version(path, "one")
    (path / "stray.txt").write_text("from an older version")
    write_version(path, "two")
    assert read_version(path) == "two"
    assert sorted(p.name for p in path.iterdir()) == ["data.txt", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_save_killed_between_its_two_renames_is_recovered_by_the_next_load(tmp_path: Path) -> None:
    """Where the file system has no atomic exchange: the old version renamed aside, the new one complete
    beside it, nothing at the path. The load puts the new one back."""
    path = tmp_path / "ckpt"
    write_version(path, "old")
    pid = dead_pid()
    write_version(tmp_path / "new", "new")
    os.rename(path, tmp_path / f"ckpt.old-{host()}-{pid}-0badc0de")
    os.rename(tmp_path / "new", tmp_path / f"ckpt.tmp-{host()}-{pid}-0badc0de")
    assert read_version(path) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_checkpoint_the_old_offload_save_left_aside_is_recovered(tmp_path: Path) -> None:
    """Issue 27: the save before manifests, killed between its renames, left only ``<path>.old-<pid>``."""
    pid = dead_pid()
    shutil.copytree(FIXTURE, tmp_path / f"ckpt.old-{pid}")
    shutil.copytree(FIXTURE, tmp_path / f"ckpt.tmp-{pid}")  # its half-written next version
    emb = offload.OffloadedEmbedding.from_checkpoint(tmp_path / "ckpt")
    assert torch.equal(emb.table.data, offload.HostTable.from_npy(FIXTURE / "weight.npy", mmap_mode="r").data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_what_a_live_save_is_writing_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    write_version(path, "one")
    mine = tmp_path / f"ckpt.tmp-{host()}-{os.getpid()}-12345678"
    elsewhere = tmp_path / f"ckpt.tmp-otherhost-{dead_pid()}-12345678"
    orphan = tmp_path / f"ckpt.tmp-{host()}-{dead_pid()}-12345678"
    for d in (mine, elsewhere, orphan):
        d.mkdir()
    assert read_version(path) == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", mine.name, elsewhere.name])


def test_modes_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_version(tmp_path / "ckpt", "one")
        offload.HostTable.from_tensor(torch.zeros(4, 2)).save_npy(tmp_path / "t.npy")
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "ckpt" / "data.txt").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "t.npy").stat().st_mode & 0o777 == 0o640


def test_a_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"x")
    (tmp_path / "file").write_text("x")
    emb, _ = trained_embedding(0)
    with pytest.raises(FileExistsError, match=r"photos is a directory of other files \(no manifest.json, meta.json\)"):
        emb.save(tmp_path / "photos")
    with pytest.raises(FileExistsError, match=r"file exists and is not a checkpoint directory"):
        emb.save(tmp_path / "file")
    assert (tmp_path / "photos" / "a.jpg").read_bytes() == b"x"
    shutil.copytree(FIXTURE, tmp_path / "old")  # a checkpoint without a manifest is replaced
    emb.save(tmp_path / "old")
    assert (tmp_path / "old" / "manifest.json").is_file()


# ---- damaged files ------------------------------------------------------------------------------------
def test_damaged_files_of_a_saved_embedding_are_named(tmp_path: Path) -> None:
    emb, _opt = trained_embedding(0)  # the optimizer kept alive: its state is saved too
    emb.save(tmp_path / "ckpt")
    weight = tmp_path / "ckpt" / "weight.npy"
    data = bytearray(weight.read_bytes())
    data[-5] ^= 0x10
    weight.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match=r"ckpt/weight\.npy is damaged: its CRC-32 is"):
        offload.OffloadedEmbedding.from_checkpoint(tmp_path / "ckpt")
    before = emb.table.data.clone()
    with pytest.raises(DamagedFileError, match=r"ckpt/weight\.npy is damaged"):
        emb.load(tmp_path / "ckpt")
    assert torch.equal(emb.table.data, before)  # refused before anything changed
    altered = offload.OffloadedEmbedding.from_checkpoint(tmp_path / "ckpt", verify_checksums=False)
    assert not torch.equal(altered.table.data, before)  # the opt-out loads what is there
    os.truncate(tmp_path / "ckpt" / "state.exp_avg.npy", 1000)
    with pytest.raises(DamagedFileError, match=r"ckpt/state\.exp_avg\.npy is damaged: 1000 bytes where"):
        emb.load(tmp_path / "ckpt", verify_checksums=False)
    (tmp_path / "ckpt" / "manifest.json").write_text("{")
    with pytest.raises(DamagedFileError, match=r"ckpt/manifest\.json is damaged: not valid JSON"):
        emb.load(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt")
    emb.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "state.exp_avg_sq.npy").unlink()
    with pytest.raises(DamagedFileError, match=r"ckpt/state\.exp_avg_sq\.npy is missing"):
        emb.load(tmp_path / "ckpt")


@pytest.fixture
def old_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint written before manifests (the v1 fixture): loads are not verified, but damage is named."""
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_old_checkpoint_truncated_meta_json_is_named(old_checkpoint: Path) -> None:
    os.truncate(old_checkpoint / "meta.json", 30)
    with pytest.raises(DamagedFileError, match=r"ckpt/meta\.json is damaged: not valid JSON"):
        offload.OffloadedEmbedding.from_checkpoint(old_checkpoint)


def test_old_checkpoint_truncated_weight_is_named(old_checkpoint: Path) -> None:
    size = (old_checkpoint / "weight.npy").stat().st_size
    os.truncate(old_checkpoint / "weight.npy", size - 100)
    with pytest.raises(DamagedFileError, match=rf"ckpt/weight\.npy is damaged: {size - 100} bytes where its header"):
        offload.OffloadedEmbedding.from_checkpoint(old_checkpoint)
    os.truncate(old_checkpoint / "weight.npy", 5)
    with pytest.raises(DamagedFileError, match=r"ckpt/weight\.npy is damaged: not a readable \.npy file"):
        offload.OffloadedEmbedding.from_checkpoint(old_checkpoint)


def test_old_checkpoint_half_length_optimizer_state_is_named(old_checkpoint: Path) -> None:
    full = np.load(old_checkpoint / "state.exp_avg.npy")
    np.save(old_checkpoint / "state.exp_avg.npy", full[: len(full) // 2])
    meta = json.loads((old_checkpoint / "meta.json").read_text())
    emb = offload.OffloadedEmbedding(meta["num_embeddings"], meta["embedding_dim"])
    with pytest.raises(DamagedFileError, match=r"ckpt/state\.exp_avg\.npy holds a \(32, 8\) table where the "
                                               r"checkpoint's meta\.json says \(64, 8\)"):
        emb.load(old_checkpoint)


def test_a_truncated_npy_table_is_named(tmp_path: Path) -> None:
    offload.HostTable.from_tensor(torch.ones(100, 4)).save_npy(tmp_path / "t.npy")
    os.truncate(tmp_path / "t.npy", 1000)
    with pytest.raises(DamagedFileError, match=r"t\.npy is damaged: 1000 bytes where its header \(\(100, 4\) float32\)"
                       ):
        offload.HostTable.from_npy(tmp_path / "t.npy")


def test_training_in_place_drops_the_checksums_it_invalidates(tmp_path: Path) -> None:
    emb, _ = trained_embedding(0)
    emb.save(tmp_path / "ckpt")
    resumed = offload.OffloadedEmbedding.from_checkpoint(tmp_path / "ckpt", mmap_mode="r+")
    opt = offload.attach(torch.optim.Adam(resumed.parameters(), lr=0.1))
    resumed(torch.arange(10)).sum().backward()
    opt.step()
    resumed.flush()
    files = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"]
    assert "crc32" not in files["weight.npy"] and "crc32" in files["meta.json"]
    again = offload.OffloadedEmbedding.from_checkpoint(tmp_path / "ckpt", mmap_mode=None)
    assert torch.equal(again.table.data, resumed.table.data)


def test_a_load_never_combines_files_of_two_saves(tmp_path: Path) -> None:
    """A reader racing a writer (an evaluation process loading while training saves): the files it reads
    after a new version was switched in are refused, not mixed with those it read before."""
    path = tmp_path / "ckpt"
    write_version(path, "one")
    files = checkpoint_files.open_checkpoint(path)
    files.check_unchanged()
    write_version(path, "two")
    with pytest.raises(checkpoint_files.CheckpointReplacedError, match=r"ckpt was replaced by another save while"):
        files.read_bytes("data.txt")
    with pytest.raises(checkpoint_files.CheckpointReplacedError, match=r"load it again"):
        files.check_unchanged()
