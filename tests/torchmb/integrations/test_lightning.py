"""torchmb.integrations.lightning against B plain torch models trained the same way, on Lightning's CPU loop."""

from __future__ import annotations

import csv
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from support.models import MLP
from support.torchvision_ops import import_torchvision

if importlib.util.find_spec("torchvision"):  # lightning's torchmetrics imports it: see tests/support/torchvision_ops.py
    import_torchvision()
pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor as LightningLRMonitor
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

import torchmb
from torchmb.integrations.lightning import BatchLightningModule, LearningRateMonitor

pytestmark = [  # Lightning's own: a hint about data-loader workers, and its use of a pytree name torch deprecated
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]

BATCHES, SAMPLES = 4, 16
GENERATOR = torch.Generator().manual_seed(0)
X = torch.randn(BATCHES * SAMPLES, 12, generator=GENERATOR, dtype=torch.float64) * 3
Y = torch.randint(0, 5, (BATCHES * SAMPLES,), generator=GENERATOR)


class Sweep(BatchLightningModule):
    def __init__(self, lrs: list[float], reduction=None, clip_per_model=None) -> None:
        super().__init__()
        self.models = torchmb.BatchModule(MLP().double(), len(lrs), init="independent", seed=0)
        self.lrs = lrs
        self.per_model_reduction = reduction
        self.clip_per_model = clip_per_model

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = torchmb.batch_loss(self.models(x, shared_input=True), y)
        self.log("loss", losses, on_step=True, on_epoch=False)
        return losses.sum()

    def configure_optimizers(self):
        optimizer = torchmb.optim.SGD(self.models.parameters(), lr=self.lrs, momentum=0.9)
        scheduler = torchmb.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.clip_per_model is None:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        else:
            self.clip_gradients(optimizer, torch.tensor(self.clip_per_model, dtype=torch.float64), "norm")


def loader() -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=SAMPLES)


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )
    return pl.Trainer(**{**options, **kwargs})


def plain_run(module: Sweep, epochs: int, clip=None, algorithm="norm") -> tuple[list[dict], list[list[float]]]:
    """Each model trained alone by plain torch as Lightning steps it: its final weights and its losses."""
    states, losses = [], []
    for i, (state, lr) in enumerate(zip(module.models.state_dicts(), module.lrs)):
        model = MLP().double()
        model.load_state_dict(state)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        mine = []
        for _ in range(epochs):
            for x, y in loader():
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                bound = clip[i] if isinstance(clip, list) else clip
                if bound and algorithm == "norm":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), bound)
                elif bound:
                    torch.nn.utils.clip_grad_value_(model.parameters(), bound)
                optimizer.step()
                scheduler.step()
                mine.append(loss.item())
        states.append(model.state_dict())
        losses.append(mine)
    return states, losses


def assert_models_equal(module: Sweep, states: list[dict]) -> None:
    for i, state in enumerate(states):
        for key, value in module.models.state_dict_of(i).items():
            torch.testing.assert_close(value, state[key], rtol=1e-10, atol=1e-12, msg=f"model {i}: {key}")


@pytest.mark.parametrize(("clip", "algorithm"), [(None, None), (0.5, "norm"), (0.02, "value")])
def test_fit_trains_each_model_as_plain_torch_would(tmp_path, clip, algorithm) -> None:
    module = Sweep([0.3, 0.1, 0.03, 0.01])
    states, _ = plain_run(module, 2, clip, algorithm or "norm")
    kwargs = {} if clip is None else {"gradient_clip_val": clip, "gradient_clip_algorithm": algorithm}
    trainer(tmp_path, **kwargs).fit(module, loader())
    assert_models_equal(module, states)
    unclipped, _ = plain_run(module, 2)
    if clip is not None:  # the bound was reached, so clipping changed the result
        assert not torch.allclose(states[0]["layers.0.weight"], unclipped[0]["layers.0.weight"])


def test_per_model_clip_bounds(tmp_path) -> None:
    module = Sweep([0.3, 0.1, 0.03, 0.01], clip_per_model=[0.1, 0.5, 1.0, 100.0])
    states, _ = plain_run(module, 2, [0.1, 0.5, 1.0, 100.0])
    trainer(tmp_path).fit(module, loader())
    assert_models_equal(module, states)


def test_changing_one_models_lr_leaves_the_others_bit_identical(tmp_path) -> None:
    # Lightning's own clipping (one norm over every model) moved model 0 when model 3's lr changed
    finals = []
    for lr3 in (0.01, 5.0):
        module = Sweep([0.3, 0.1, 0.03, lr3])
        trainer(tmp_path, gradient_clip_val=0.5).fit(module, loader())
        finals.append(module.models.state_dicts())
    for i in range(3):
        assert all(torch.equal(finals[0][i][k], finals[1][i][k]) for k in finals[0][i])
    assert not torch.equal(finals[0][3]["layers.0.weight"], finals[1][3]["layers.0.weight"])


def read_csv(path) -> list[dict]:
    with open(path) as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize("reduction", [None, "mean"])
def test_per_model_losses_and_learning_rates_are_logged(tmp_path, reduction) -> None:
    module = Sweep([0.3, 0.1, 0.03, 0.01], reduction=reduction)
    _, losses = plain_run(module, 2)
    logger = CSVLogger(tmp_path, name="run")
    trainer(tmp_path, logger=logger, log_every_n_steps=1, callbacks=[LearningRateMonitor()]).fit(module, loader())
    rows = read_csv(f"{logger.log_dir}/metrics.csv")
    loss_rows = [r for r in rows if r.get("loss/model_0") or r.get("loss")]
    lr_rows = [r for r in rows if r.get("lr-SGD/model_0")]
    assert len(loss_rows) == len(lr_rows) == 2 * BATCHES
    for step, row in enumerate(loss_rows):
        expected = [model_losses[step] for model_losses in losses]
        if reduction is None:
            logged = [float(row[f"loss/model_{i}"]) for i in range(4)]
            assert logged == pytest.approx(expected, rel=1e-6)
        else:
            assert float(row["loss"]) == pytest.approx(sum(expected) / 4, rel=1e-6)
    for step, row in enumerate(lr_rows):  # the lr each step trained with: StepLR, halved every 3 steps
        expected = [lr * 0.5 ** (step // 3) for lr in module.lrs]
        assert [float(row[f"lr-SGD/model_{i}"]) for i in range(4)] == pytest.approx(expected, rel=1e-6)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")  # resumed into it
def test_checkpoint_and_resume_reproduce_an_uninterrupted_run(tmp_path) -> None:
    whole = Sweep([0.3, 0.1, 0.03, 0.01])
    trainer(tmp_path, max_epochs=3).fit(whole, loader())
    first = Sweep([0.3, 0.1, 0.03, 0.01])
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint]).fit(first, loader())
    resumed = Sweep([1.0, 1.0, 1.0, 1.0])  # the checkpoint's learning rates and schedule replace these
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    resuming = trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[checkpoint])
    resuming.fit(resumed, loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    for i, state in enumerate(whole.models.state_dicts()):
        assert all(torch.equal(resumed.models.state_dict_of(i)[k], v) for k, v in state.items()), f"model {i}"


def test_what_would_couple_the_models_is_refused(tmp_path) -> None:
    with pytest.raises(TypeError, match=r"use torchmb\.integrations\.lightning\.LearningRateMonitor"):
        trainer(tmp_path, logger=CSVLogger(tmp_path), callbacks=[LightningLRMonitor()]).fit(Sweep([0.1, 0.2]), loader())
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match=r"precision='16-mixed'\) .* torchmb\.amp\.GradScaler"):
        trainer(tmp_path, plugins=[scaler]).fit(Sweep([0.1, 0.2]), loader())
    with pytest.raises(ValueError, match=r"reduction must be None .* one of"):
        Sweep([0.1, 0.2]).log_per_model("loss", torch.ones(2), "average")
    module = Sweep([0.1, 0.2])
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    with pytest.raises(ValueError, match="StepLR takes no metric; remove 'monitor'"):
        module.lr_scheduler_step(scheduler, torch.tensor(0.5))


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
def test_resume_on_a_gpu_keeps_the_optimizers_step_counts_on_the_host(tmp_path) -> None:
    # Lightning moves a restored optimizer's state to the GPU (all but "step"); SGD's momentum_started too
    options = dict(accelerator="gpu", devices=1, enable_checkpointing=True)
    whole = Sweep([0.3, 0.1, 0.03, 0.01])
    trainer(tmp_path, max_epochs=3, accelerator="gpu", devices=1).fit(whole, loader())
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, max_epochs=1, callbacks=[checkpoint], **options).fit(Sweep([0.3, 0.1, 0.03, 0.01]), loader())
    resumed = Sweep([1.0, 1.0, 1.0, 1.0])
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    resuming = trainer(tmp_path, max_epochs=3, callbacks=[checkpoint], **options)
    resuming.fit(resumed, loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    for state in resuming.optimizers[0].state.values():
        assert all(state[key].device.type == "cpu" for key in ("step", "momentum_started") if key in state)
    for i, state in enumerate(whole.models.state_dicts()):
        assert all(torch.equal(resumed.models.state_dict_of(i)[k], v) for k, v in state.items()), f"model {i}"
