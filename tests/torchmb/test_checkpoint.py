"""torchmb.save_checkpoint / load_checkpoint: a run saved mid-way and resumed into fresh objects continues
bit for bit as the run that went on (the reference), and what cannot be resumed is refused before anything
changes."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from support.killed_saves import kill_during_saves
from torch import nn

import torchmb
from offload import checkpoint_files
from offload.checkpoint_files import DamagedFileError

B = 4


class Counter:
    """A sweep-like object with state: what ``sweep=`` saves."""

    def __init__(self) -> None:
        self.reports: list[float] = []

    def state_dict(self) -> dict:
        return {"reports": list(self.reports)}

    def load_state_dict(self, state: dict) -> None:
        self.reports = list(state["reports"])


def build(seed: int):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    models = torchmb.BatchModule(net, B, init="independent", seed=seed)
    optimizer = torchmb.optim.Adam(models.parameters(), lr=torch.tensor([1e-3, 3e-3, 1e-2, 3e-2]))
    scheduler = torchmb.lr_scheduler.ExponentialLR(optimizer, gamma=torch.tensor([0.9, 0.8, 0.99, 0.5]))
    scaler = torchmb.amp.GradScaler("cpu", init_scale=torch.tensor([8.0, 16.0, 32.0, 64.0]), growth_interval=2,
                                    batch=B)
    return models, optimizer, scheduler, scaler, Counter()


def train(models, optimizer, scheduler, scaler, sweep, steps: int) -> None:
    """Data and dropout masks come from the global random states, which the checkpoint carries."""
    for _ in range(steps):
        x = torch.randn(B, 5, 6)
        y = torch.randint(0, 3, (B, 5))
        noise = float(np.random.rand()) + random.random()  # NumPy's and Python's generators feed the loss too
        loss = torchmb.batch_loss(models(x), y) * (1 + noise)
        optimizer.zero_grad()
        scaler.scale(loss).sum().backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        sweep.reports.append(float(loss.detach().sum()))


def assert_same_run(a, b) -> None:
    models_a, opt_a, sched_a, scaler_a, sweep_a = a
    models_b, opt_b, sched_b, scaler_b, sweep_b = b
    for (name, pa), pb in zip(models_a.state_dict().items(), models_b.state_dict().values()):
        assert torch.equal(pa, pb), name
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    for index, entries in state_a["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, state_b["state"][index][key]), (index, key)
    for ga, gb in zip(opt_a.param_groups, opt_b.param_groups):
        assert torch.equal(ga["lr"], gb["lr"])
    assert torch.equal(scaler_a.get_scale(), scaler_b.get_scale())
    assert sched_a.last_epoch == sched_b.last_epoch
    assert sweep_a.reports == sweep_b.reports


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_resumed_run_is_bit_identical_to_the_run_that_went_on(tmp_path: Path) -> None:
    seed_everything(0)
    reference = build(0)
    train(*reference, steps=3)
    torchmb.save_checkpoint(tmp_path / "ckpt", reference[0], reference[1], reference[2], scaler=reference[3],
                            sweep=reference[4], extra={"step": 3, "note": "half-way"})
    train(*reference, steps=3)

    seed_everything(123)  # other weights, other random states: the checkpoint must bring everything back
    resumed = build(1)
    extra = torchmb.load_checkpoint(tmp_path / "ckpt", resumed[0], resumed[1], resumed[2], scaler=resumed[3],
                                    sweep=resumed[4])
    assert extra == {"step": 3, "note": "half-way"}
    train(*resumed, steps=3)
    assert_same_run(reference, resumed)


def test_without_rng_the_global_states_are_left_alone(tmp_path: Path) -> None:
    models = build(0)[0]
    torchmb.save_checkpoint(tmp_path / "ckpt", models, rng=False)
    fresh = build(1)[0]
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    torchmb.load_checkpoint(tmp_path / "ckpt", fresh)
    assert torch.equal(torch.rand(3), expected)


def test_saving_again_replaces_the_checkpoint_whole(tmp_path: Path) -> None:
    models, optimizer, *_ = build(0)
    torchmb.save_checkpoint(tmp_path / "ckpt", models, optimizer)
    torchmb.save_checkpoint(tmp_path / "ckpt", models)  # no optimizer this time: its file must go
    assert not (tmp_path / "ckpt" / "optimizer.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left beside it
    with pytest.raises(ValueError, match=r"holds no optimizer \(it holds \['models'\]\)"):
        torchmb.load_checkpoint(tmp_path / "ckpt", models, optimizer)


def test_what_cannot_be_resumed_is_refused_before_anything_changes(tmp_path: Path) -> None:
    models, optimizer, scheduler, scaler, sweep = build(0)
    torchmb.save_checkpoint(tmp_path / "ckpt", models, optimizer, scheduler, scaler=scaler)
    fresh, fresh_opt, _, _, _ = build(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    small = torchmb.BatchModule(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)), 2)
    with pytest.raises(ValueError, match=r"holds 4 models; the models holds 2 \(build it with batch=4"):
        torchmb.load_checkpoint(tmp_path / "ckpt", small)
    with pytest.raises(TypeError, match=r"holds the state of a Adam as optimizer; this is a SGD"):
        torchmb.load_checkpoint(tmp_path / "ckpt", fresh, torchmb.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"holds no sweep"):
        torchmb.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt, sweep=sweep)
    with pytest.raises(TypeError, match=r"sweep must have state_dict\(\) and load_state_dict\(\)"):
        torchmb.load_checkpoint(tmp_path / "ckpt", fresh, sweep=object())
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(FileNotFoundError, match=r"no checkpoint there"):
        torchmb.load_checkpoint(tmp_path / "nothing", fresh)


def test_save_refuses_what_a_load_could_not_read_and_a_directory_of_other_files(tmp_path: Path) -> None:
    models = build(0)[0]
    with pytest.raises(TypeError, match=r"extra holds something torch.load\(weights_only=True\) cannot read"):
        torchmb.save_checkpoint(tmp_path / "ckpt", models, extra={"sweep": Counter()})
    assert not (tmp_path / "ckpt").exists() and list(tmp_path.iterdir()) == []  # the failed save left nothing
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"results is a directory of other files"):
        torchmb.save_checkpoint(tmp_path / "results", models)
    assert (tmp_path / "results" / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match=r"the scheduler holds 4 models but the BatchModule 2"):
        small = torchmb.BatchModule(nn.Linear(6, 3), 2)
        torchmb.save_checkpoint(tmp_path / "x", small, scheduler=build(0)[2])


def test_a_damaged_file_is_refused_naming_it(tmp_path: Path) -> None:
    models, optimizer, *_ = build(0)
    torchmb.save_checkpoint(tmp_path / "ckpt", models, optimizer)
    target = tmp_path / "ckpt" / "models.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    fresh = build(1)[0]
    with pytest.raises(DamagedFileError, match=r"ckpt/models\.pt is damaged: its CRC-32 is .*\(bytes were altered\)"):
        torchmb.load_checkpoint(tmp_path / "ckpt", fresh)
    os.truncate(tmp_path / "ckpt" / "optimizer.pt", 100)
    with pytest.raises(DamagedFileError, match=r"ckpt/optimizer\.pt is damaged: 100 bytes where .* says"):
        torchmb.load_checkpoint(tmp_path / "ckpt", fresh, build(1)[1], verify_checksums=False)
    (tmp_path / "ckpt" / "checkpoint.json").write_text('{"format": ')
    with pytest.raises(DamagedFileError, match=r"ckpt/checkpoint\.json is damaged"):
        torchmb.load_checkpoint(tmp_path / "ckpt", fresh)


def test_save_killed_at_random_moments_leaves_old_or_new(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"

    def run(seed: int):
        models = torchmb.BatchModule(nn.Linear(256, 256), 16)  # 4 MB of weights, 8 MB of Adam state
        with torch.no_grad():
            models.module.weight.copy_(torch.randn(models.module.weight.shape,
                                                   generator=torch.Generator().manual_seed(seed)))
        optimizer = torchmb.optim.Adam(models.parameters(), lr=1e-3)
        models(torch.randn(16, 2, 256)).sum().backward()
        optimizer.step()
        return models, optimizer

    def fingerprint(models, optimizer) -> tuple:
        state = optimizer.state[models.module.weight]
        return tuple(t.detach().numpy().tobytes() for t in (models.module.weight, state["exp_avg_sq"]))

    runs = [run(seed) for seed in (0, 1)]
    fresh = run(2)

    def load() -> tuple:
        torchmb.load_checkpoint(path, *fresh, rng=False)
        return fingerprint(*fresh)

    cut_off = kill_during_saves(path, lambda v: torchmb.save_checkpoint(path, *runs[v], rng=False), load,
                                [fingerprint(*r) for r in runs], seed=3)
    assert cut_off > 0


@pytest.mark.cuda
def test_resume_on_cuda_brings_back_the_cuda_generator(tmp_path: Path) -> None:
    """Dropout on the GPU draws from the CUDA generator, which the checkpoint saves and restores."""

    def build_cuda(seed: int):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3))
        models = torchmb.BatchModule(net, B, init="independent", seed=seed).cuda()
        return models, torchmb.optim.SGD(models.parameters(), lr=0.1, momentum=0.9)

    def steps(models, optimizer, count: int) -> None:
        for _ in range(count):
            x = torch.randn(B, 8, 6, device="cuda")
            optimizer.zero_grad()
            torchmb.batch_loss(models(x), torch.randint(0, 3, (B, 8), device="cuda")).sum().backward()
            optimizer.step()

    reference = build_cuda(0)
    steps(*reference, 2)
    torchmb.save_checkpoint(tmp_path / "ckpt", *reference)
    steps(*reference, 3)
    resumed = build_cuda(1)
    torch.cuda.manual_seed_all(77)
    torchmb.load_checkpoint(tmp_path / "ckpt", *resumed)
    steps(*resumed, 3)
    for a, b in zip(reference[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)


def test_a_save_switched_in_during_a_load_is_never_mixed_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = build(0), build(1)
    torchmb.save_checkpoint(tmp_path / "ckpt", first[0], first[1])
    read = checkpoint_files.CheckpointFiles.torch_load

    def read_then_save(self, name, **kwargs):
        state = read(self, name, **kwargs)
        if name == "models.pt":  # another process saves between the two files this load reads
            torchmb.save_checkpoint(tmp_path / "ckpt", second[0], second[1])
        return state

    monkeypatch.setattr(checkpoint_files.CheckpointFiles, "torch_load", read_then_save)
    fresh = build(2)
    before = [p.detach().clone() for p in fresh[0].parameters()]
    with pytest.raises(checkpoint_files.CheckpointReplacedError, match=r"ckpt was replaced by another save"):
        torchmb.load_checkpoint(tmp_path / "ckpt", fresh[0], fresh[1])
    assert all(torch.equal(a, b) for a, b in zip(before, fresh[0].parameters()))
