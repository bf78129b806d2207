"""torchmb.distributed: the model axis sharded across gloo ranks on CPU, against one process and plain torch.

The multi-process tests start this file under ``torchrun`` (``python -m torch.distributed.run``); its
``__main__`` part holds the worker scenarios. The references are computed here, in the test process:
the same B models trained by one process (bit for bit) and B plain ``nn.Module`` + ``torch.optim``
models (fp32 tolerances).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.models import MLP
from torch import nn

import torchmb
from torchmb import BatchModule, lr_scheduler, optim
from torchmb import distributed as tmd
from torchmb.cli import demo as _demo

ROOT = Path(__file__).resolve().parents[2]

# The sweep: B models with per-model lr / momentum / weight decay; model 3 diverges (its lr is huge).
B, N, STEPS, SAVE_AT, SEED = 5, 6, 8, 4, 7
LRS = torch.tensor([0.05, 0.1, 0.02, 1e6, 0.08], dtype=torch.float64)
MOMENTA = torch.tensor([0.9, 0.0, 0.5, 0.0, 0.0], dtype=torch.float64)  # rank 1 of 2 keeps no momentum state
DECAYS = torch.tensor([0.0, 1e-3, 1e-2, 0.0, 1e-4], dtype=torch.float64)
DIVERGING = 3


def data(step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Step ``step``'s batch, the same on every rank (one seed): shared input on even steps, per-model on odd."""
    g = torch.Generator().manual_seed(1000 + step)
    if step % 2 == 0:
        return torch.randn(N, 12, generator=g), torch.randint(0, 5, (N,), generator=g), True
    return torch.randn(B, N, 12, generator=g), torch.randint(0, 5, (B, N), generator=g), False


def build(owned: slice = slice(0, B)):
    models = BatchModule(MLP(), owned.stop - owned.start, init="independent", seed=SEED + owned.start)
    optimizer = optim.SGD(models.parameters(), lr=LRS[owned], momentum=MOMENTA[owned], weight_decay=DECAYS[owned])
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    return models, optimizer, scheduler


def train(models, optimizer, scheduler, steps: range, owned: slice = slice(0, B)) -> torch.Tensor:
    """Train; each rank feeds its rows of per-model data. Returns the losses, (models, steps)."""
    history = []
    for step in steps:
        x, y, shared = data(step)
        if not shared:
            x, y = x[owned], y[owned]
        losses = torchmb.batch_loss(models(x, shared_input=shared), y)
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
        scheduler.step()
        history.append(losses.detach())
    return torch.stack(history, 1)


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal, NaN where the other is NaN (their payloads may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0)) and torch.equal(a.isinf(), b.isinf())


def flat_parameters(models: BatchModule) -> torch.Tensor:
    return torch.cat([p.detach().flatten(1) for p in models.parameters()], 1)


@contextlib.contextmanager
def one_thread():
    """The workers run with OMP_NUM_THREADS=1; so does the reference, so every kernel takes the same path."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def torchrun(nproc: int, *args: str, timeout: float = 120) -> None:
    # PYTHONFAULTHANDLER: a worker that aborts (SIGABRT) still prints where each of its threads was.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        __file__,
        *args,
    ]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"


# ---- single-process pieces ---------------------------------------------------------------------
def test_shard_slices_cover_the_models_contiguously_first_ranks_take_the_rest() -> None:
    assert tmd.shard_slices(10, 4) == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]
    assert tmd.shard_slices(4, 4) == [slice(i, i + 1) for i in range(4)]
    for batch in range(1, 12):
        for world in range(1, batch + 1):
            slices = tmd.shard_slices(batch, world)
            sizes = [s.stop - s.start for s in slices]
            assert [i for s in slices for i in range(s.start, s.stop)] == list(range(batch))
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert tmd.shard_slice(10, rank=3, world_size=4) == slice(8, 10)
    assert tmd.shard_slice(10) == slice(0, 10), "no process group: rank 0 of 1"


def test_bad_shards_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot shard 3 models over 4 ranks"):
        tmd.shard_slices(3, 4)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        tmd.shard_slices(3, 0)
    with pytest.raises(IndexError, match=r"rank must lie in \[0, 2\)"):
        tmd.shard_slice(4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="expected 4 per-model values"):
        tmd.shard_values(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="needs a seed shared by every rank"):
        tmd.local_batch_module(MLP(), 4, init="independent")
    with pytest.raises(ValueError, match="got a scalar"):
        tmd.gather_models(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"expects a torchmb\.BatchModule"):
        tmd.shard(MLP())
    models, optimizer, _ = build()
    optimizer.select([0, 1])
    with pytest.raises(ValueError, match="holds 2 models but the BatchModule 5"):
        tmd.shard(models, optimizer)


def test_local_module_equals_the_rows_of_the_full_one() -> None:
    full = BatchModule(MLP(), 7, init="independent", seed=3)
    for rank, owned in enumerate(tmd.shard_slices(7, 3)):
        with mock_rank(rank, 3):
            local = tmd.local_batch_module(MLP(), 7, init="independent", seed=3)
            lrs = tmd.shard_values(torch.arange(7.0), 7)
        assert local.batch == owned.stop - owned.start
        assert lrs.tolist() == list(range(7))[owned]
        for mine, theirs in zip(local.parameters(), full.parameters()):
            assert torch.equal(mine, theirs[owned])
    assert tmd.shard_values(0.1, 7) == 0.1, "a shared number passes through"
    with mock_rank(1, 2):
        rows = tmd.shard_values([0.1, 0.2, 0.3], 3)
    assert rows.dtype == torch.float64 and rows.tolist() == [0.3], "Python floats keep double precision"


@contextlib.contextmanager
def mock_rank(rank: int, world: int):
    """Pretend to be ``rank`` of ``world`` for the functions that only ask for the rank (no collective)."""
    saved = tmd.rank_and_world_size
    tmd.rank_and_world_size = lambda group=None: (rank, world)
    try:
        yield
    finally:
        tmd.rank_and_world_size = saved


@pytest.fixture
def single_process_group(tmp_path: Path):
    """A real gloo group of one process (world_size=1), torn down afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("grouped", [False, True], ids=["no-group", "gloo-world-1"])
def test_world_of_one_gathers_and_shards_to_itself(grouped: bool, request: pytest.FixtureRequest) -> None:
    if grouped:
        request.getfixturevalue("single_process_group")
    values = torch.arange(10.0).view(5, 2)
    assert torch.equal(tmd.gather_models(values), values)
    assert torch.equal(tmd.gather_models(values, dst=0), values)
    models, optimizer, scheduler = build()
    before = flat_parameters(models)
    assert tmd.shard(models, optimizer, scheduler) == slice(0, B)
    assert models.batch == optimizer.batch == scheduler.batch == B
    assert torch.equal(flat_parameters(models), before)


def test_checkpoint_restores_per_model_adam_betas_and_state(tmp_path: Path) -> None:
    lrs, beta1 = torch.tensor([0.01, 0.02, 0.03]), torch.tensor([0.8, 0.9, 0.95])

    def adam(models, **kwargs):
        return optim.Adam(models.parameters(), **{"lr": lrs, "betas": (beta1, 0.99), "amsgrad": True, **kwargs})

    def steps(models, optimizer, count):
        g = torch.Generator().manual_seed(count)
        for _ in range(count):
            x, y = torch.randn(3, 4, 12, generator=g), torch.randint(0, 5, (3, 4), generator=g)
            losses = torchmb.batch_loss(models(x), y)
            optimizer.zero_grad()
            losses.sum().backward()
            optimizer.step()

    reference = BatchModule(MLP(), 3, init="independent", seed=1)
    reference_opt = adam(reference)
    steps(reference, reference_opt, 3)
    assert tmd.save_checkpoint(tmp_path / "ckpt", reference, reference_opt) == 3
    models = BatchModule(MLP(), 3)
    optimizer = adam(models, lr=1.0, betas=(0.5, 0.5))  # the checkpoint brings each model's own values back
    tmd.load_checkpoint(tmp_path / "ckpt", models, optimizer)
    assert torch.equal(optimizer.get_hyperparameter("betas")[0], beta1.double())
    assert torch.equal(optimizer.step_counts(), torch.full((3,), 3.0, dtype=torch.float64))
    steps(reference, reference_opt, 2)
    steps(models, optimizer, 2)
    assert identical(flat_parameters(models), flat_parameters(reference))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\] is True in the checkpoint and False"):
        tmd.load_checkpoint(tmp_path / "ckpt", models, adam(models, amsgrad=False))


# ---- several processes -----------------------------------------------------------------------------
def reference_run(steps: range):
    """The same B models, optimizer and scheduler trained by one process."""
    with one_thread():
        models, optimizer, scheduler = build()
        losses = train(models, optimizer, scheduler, steps)
    return models, optimizer, scheduler, losses


def _has_optuna() -> bool:
    try:
        import optuna  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun launch of 2 gloo workers: the sharded training scenarios, then the Optuna one."""
    out = tmp_path_factory.mktemp("sharded")
    storage = f"sqlite:///{out / 'study.db'}" if _has_optuna() else "none"
    torchrun(2, "train", str(out), storage)
    return out


@pytest.mark.parametrize("how", ["select", "local"])
def test_sharded_training_equals_one_process_bit_for_bit(sharded_run: Path, how: str) -> None:
    models, optimizer, _, losses = reference_run(range(STEPS))
    parameters = flat_parameters(models)
    for rank, owned in enumerate(tmd.shard_slices(B, 2)):
        result = torch.load(sharded_run / f"{how}-rank{rank}.pt", weights_only=True)
        assert result["slice"] == (owned.start, owned.stop)
        assert identical(result["parameters"], parameters[owned])
        assert torch.equal(result["lr"], optimizer.get_hyperparameter("lr")[owned])
        assert identical(result["losses"], losses[owned])
        # every rank gathered every model's losses, in global model order; rank 0 also got them alone
        assert identical(result["gathered"], losses)
        if rank == 0:
            assert identical(result["gathered_to_0"], losses)
        else:
            assert result["gathered_to_0"] is None


def test_sharded_training_matches_plain_torch_and_the_diverged_model_stops_no_one(sharded_run: Path) -> None:
    plain = []
    with one_thread():
        full = BatchModule(MLP(), B, init="independent", seed=SEED)
        for i in range(B):
            net = MLP()
            net.load_state_dict(full.state_dict_of(i))
            opt = torch.optim.SGD(
                net.parameters(), lr=float(LRS[i]), momentum=float(MOMENTA[i]), weight_decay=float(DECAYS[i])
            )
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
            for step in range(STEPS):
                x, y, shared = data(step)
                loss = nn.functional.cross_entropy(net(x if shared else x[i]), y if shared else y[i])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
            plain.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
    plain = torch.stack(plain)
    assert not torch.isfinite(plain[DIVERGING]).all(), "the reference model with lr=1e6 must diverge"
    results = [torch.load(sharded_run / f"local-rank{rank}.pt", weights_only=True) for rank in range(2)]
    sharded = torch.cat([result["parameters"] for result in results])
    assert not torch.isfinite(sharded[DIVERGING]).all()
    finite = [i for i in range(B) if i != DIVERGING]
    torch.testing.assert_close(sharded[finite], plain[finite], rtol=1e-5, atol=1e-6)
    gathered = torch.load(sharded_run / "local-rank0.pt", weights_only=True)["gathered"]
    assert torch.isfinite(gathered[finite]).all() and not torch.isfinite(gathered[DIVERGING]).all()


def test_gather_refuses_ranks_that_disagree_and_keeps_bools(sharded_run: Path) -> None:
    for rank in range(2):
        result = torch.load(sharded_run / f"local-rank{rank}.pt", weights_only=True)
        assert "rank 0: (2, 1) torch.float32, rank 1: (2, 2) torch.float32" in result["refused"]
        assert result["flags"].dtype == torch.bool and result["flags"].tolist() == [True, False, True]


def test_checkpoint_saved_on_two_ranks_loads_on_one(sharded_run: Path) -> None:
    checkpoint = sharded_run / "checkpoint"
    index = json.loads((checkpoint / "index.json").read_text())
    assert index["batch"] == B and index["saved_by_world_size"] == 2 and len(index["files"]) == B
    assert tmd.checkpoint_batch(checkpoint) == B
    # each file is a plain per-model state dict that loads into the original model
    first = torch.load(checkpoint / index["files"][0], weights_only=True)
    net = MLP()
    net.load_state_dict(first["model"])
    held = [torch.load(checkpoint / name, weights_only=True)["optimizer"]["state"][0] for name in index["files"]]
    assert ["momentum_buffer" in state for state in held] == [True, True, True, False, False], (
        "rank 1 (models 3, 4, momentum 0) kept no momentum buffers: loading must fill them in"
    )
    assert first["optimizer"]["param_groups"][0]["lr"] == pytest.approx(
        float(torch.load(sharded_run / "local-rank0.pt", weights_only=True)["lr_at_save"][0]), rel=1e-15
    )

    saved, _, _, _ = reference_run(range(SAVE_AT))
    with one_thread():
        models, optimizer, scheduler = build()
        assert tmd.load_checkpoint(checkpoint, models, optimizer, scheduler) == slice(0, B)
        assert identical(flat_parameters(models), flat_parameters(saved))
        train(models, optimizer, scheduler, range(SAVE_AT, STEPS))
    reference, reference_opt, _, _ = reference_run(range(STEPS))
    assert identical(flat_parameters(models), flat_parameters(reference))
    for p, q in zip(optimizer.param_groups[0]["params"], reference_opt.param_groups[0]["params"]):
        assert identical(optimizer.state[p]["momentum_buffer"], reference_opt.state[q]["momentum_buffer"])


def test_checkpoint_saved_on_two_ranks_loads_on_four(sharded_run: Path, tmp_path: Path) -> None:
    torchrun(4, "resume", str(sharded_run / "checkpoint"), str(tmp_path))
    reference, *_ = reference_run(range(STEPS))
    parameters = flat_parameters(reference)
    slices = tmd.shard_slices(B, 4)
    assert [s.stop - s.start for s in slices] == [2, 1, 1, 1]
    for rank, owned in enumerate(slices):
        result = torch.load(tmp_path / f"resume-rank{rank}.pt", weights_only=True)
        assert identical(result["parameters"], parameters[owned])


def test_checkpoint_refuses_a_module_of_the_wrong_size(sharded_run: Path, tmp_path: Path) -> None:
    models, optimizer, _ = build(slice(0, 3))
    with pytest.raises(ValueError, match=r"loads models 0..4 of B=5 \(5 models\) but the BatchModule holds 3"):
        tmd.load_checkpoint(sharded_run / "checkpoint", models, optimizer)
    with pytest.raises(FileNotFoundError, match=r"not a torchmb\.distributed checkpoint"):
        tmd.load_checkpoint(tmp_path, models)
    other = BatchModule(MLP(), B)
    tmd.save_checkpoint(tmp_path / "models-only", other)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        tmd.load_checkpoint(tmp_path / "models-only", other, optim.SGD(other.parameters(), lr=0.1))
    adam = optim.Adam(other.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"holds \['SGD'\] optimizer state, this is a Adam"):
        tmd.load_checkpoint(sharded_run / "checkpoint", other, adam)


def test_optuna_sweep_across_two_processes_fills_one_study(sharded_run: Path) -> None:
    optuna = pytest.importorskip("optuna", reason="the [sweep] extra (Optuna) is not installed")
    storage = f"sqlite:///{sharded_run / 'study.db'}"
    tmp_path = sharded_run
    study = optuna.load_study(study_name="sharded", storage=storage)
    trials = study.get_trials()
    assert len(trials) == 7, "rank 0 asked for 4 trials, rank 1 for 3: one study holds them all"
    numbers = [json.loads((tmp_path / f"optuna-rank{rank}.json").read_text()) for rank in range(2)]
    assert sorted(numbers[0]["numbers"] + numbers[1]["numbers"]) == list(range(7))
    assert numbers[0]["all_values"] == numbers[1]["all_values"], "every rank gathered the same values"
    by_number = {t.number: t for t in trials}
    for number, value in zip(numbers[0]["all_numbers"], numbers[0]["all_values"]):
        assert by_number[number].state == optuna.trial.TrialState.COMPLETE
        assert by_number[number].value == pytest.approx(value)
    assert len({t.params["lr"] for t in trials}) == 7, "the ranks' samplers asked for different lrs"


def test_demo_under_torchrun_on_two_processes(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    arguments = ["demo", "--lr-values", "3", "--wd-values", "2", "--steps", "40", "--samples", "32", "--device", "cpu"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "-m",
        "torchmb",
        *arguments,
        "--out",
        str(tmp_path / "sharded"),
    ]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    with one_thread():
        single = _demo.run(3, 2, 40, 32, "cpu", tmp_path / "single", 0)
    sharded = json.loads((tmp_path / "sharded" / "results.json").read_text())
    assert [row["model"] for row in sharded["leaderboard"]] == [row["model"] for row in single["leaderboard"]]
    for mine, theirs in zip(sharded["leaderboard"], single["leaderboard"]):
        assert mine["val_accuracy"] == pytest.approx(theirs["val_accuracy"], abs=0, nan_ok=True)
    best = torch.load(tmp_path / "sharded" / "best_state_dict.pt", weights_only=True)
    reference = torch.load(tmp_path / "single" / "best_state_dict.pt", weights_only=True)
    assert best.keys() == reference.keys() and all(torch.equal(best[k], reference[k]) for k in best)
    assert "6 models x 40 steps" in result.stdout and "on 2 ranks (cpu)" in result.stdout
    assert result.stdout.count("wrote") == 1, "only rank 0 writes and reports"


# ---- the torchrun workers --------------------------------------------------------------------------
def _worker_train(out: Path) -> None:
    rank = dist.get_rank()
    # (a) every rank builds all B models, trains one step, then keeps its own (state carried over)
    models, optimizer, scheduler = build()
    first = train(models, optimizer, scheduler, range(1))
    owned = tmd.shard(models, optimizer, scheduler)
    rest = train(models, optimizer, scheduler, range(1, STEPS), owned)
    _record(out / f"select-rank{rank}.pt", models, optimizer, torch.cat([first[owned], rest], 1), owned)
    # (b) every rank builds only its models; checkpoint half-way
    owned = tmd.shard_slice(B)
    models = tmd.local_batch_module(MLP(), B, init="independent", seed=SEED)
    optimizer = optim.SGD(
        models.parameters(),
        lr=tmd.shard_values(LRS, B),
        momentum=tmd.shard_values(MOMENTA, B),
        weight_decay=tmd.shard_values(DECAYS, B),
    )
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    head = train(models, optimizer, scheduler, range(SAVE_AT), owned)
    lr_at_save = optimizer.get_hyperparameter("lr")
    assert tmd.save_checkpoint(out / "checkpoint", models, optimizer, scheduler) == B
    tail = train(models, optimizer, scheduler, range(SAVE_AT, STEPS), owned)
    try:
        tmd.gather_models(torch.zeros(2, rank + 1))
    except ValueError as error:
        refused = str(error)
    flags = tmd.gather_models(torch.tensor([True, False]) if rank == 0 else torch.tensor([True]))
    _record(
        out / f"local-rank{rank}.pt",
        models,
        optimizer,
        torch.cat([head, tail], 1),
        owned,
        lr_at_save=lr_at_save,
        refused=refused,
        flags=flags,
    )


def _record(path: Path, models, optimizer, losses, owned: slice, **extra) -> None:
    gathered = tmd.gather_models(losses)
    gathered_to_0 = tmd.gather_models(losses, dst=0)
    torch.save(
        {
            "slice": (owned.start, owned.stop),
            "parameters": flat_parameters(models),
            "losses": losses,
            "lr": optimizer.get_hyperparameter("lr"),
            "gathered": gathered,
            "gathered_to_0": gathered_to_0,
            **extra,
        },
        path,
    )


def _worker_resume(checkpoint: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    owned = tmd.shard_slice(tmd.checkpoint_batch(checkpoint))
    models, optimizer, scheduler = build(owned)
    assert tmd.load_checkpoint(checkpoint, models, optimizer, scheduler) == owned
    train(models, optimizer, scheduler, range(SAVE_AT, STEPS), owned)
    torch.save({"parameters": flat_parameters(models)}, out / f"resume-rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _worker_optuna(storage: str, out: Path) -> None:
    import optuna
    from optuna.distributions import FloatDistribution

    from torchmb import sweep

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rank = dist.get_rank()
    study = tmd.create_study("sharded", storage=storage, sampler=optuna.samplers.RandomSampler(seed=rank))
    trials = sweep.TrialBatch(study, 4 - rank, {"lr": FloatDistribution(1e-3, 1e-1, log=True)})
    models = BatchModule(MLP(), trials.batch, init="independent", seed=SEED)
    optimizer = optim.SGD(models.parameters(), lr=trials.values("lr"))
    g = torch.Generator().manual_seed(0)  # the same batches on every rank
    for _ in range(3):
        x, y = torch.randn(N, 12, generator=g), torch.randint(0, 5, (N,), generator=g)
        losses = torchmb.batch_loss(models(x, shared_input=True), y)
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
    numbers = trials.numbers
    values = (-losses.detach()).double()
    trials.tell(values)
    all_numbers = tmd.gather_models(torch.tensor(numbers)).tolist()
    all_values = tmd.gather_models(values).tolist()
    (out / f"optuna-rank{rank}.json").write_text(
        json.dumps({"numbers": numbers, "all_numbers": all_numbers, "all_values": all_values})
    )


if __name__ == "__main__":
    scenario, *arguments = sys.argv[1:]
    if scenario == "train":
        dist.init_process_group("gloo")
        _worker_train(Path(arguments[0]))
        if arguments[1] != "none":
            _worker_optuna(arguments[1], Path(arguments[0]))
        dist.barrier()  # no rank tears its connections down while a peer still reads from them
        dist.destroy_process_group()
    elif scenario == "resume":
        _worker_resume(Path(arguments[0]), Path(arguments[1]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    # Every result is on disk. Leave without running C++ static destructors: in 2 of about 10 fresh-clone
    # CI runs a worker aborted at exit ("terminate called without an active exception"), after its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
