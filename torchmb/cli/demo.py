"""``python -m torchmb demo``: a learning-rate x weight-decay sweep of small CNNs as one batched model.

The data is scikit-learn's bundled handwritten digits (8x8 images, no download). Every model sees the
same mini-batches (the shared-input path), with its own learning rate and weight decay, a cosine
schedule, and is checked for divergence. At the end: a leaderboard, a PNG plot of validation accuracy
against the hyperparameters, and the best model exported as a plain checkpoint that loads without
torchmb (``torch.export``), next to its plain state dict.

Under ``torchrun --nproc-per-node N`` the same command shards the grid: each rank trains its contiguous
slice of the models (same seeds, same mini-batches), the validation accuracies are gathered in grid
order, and rank 0 writes the outputs; every rank returns the same results.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import distributed, lr_scheduler, optim
from ..clip import diverged
from ..functional import batch_accuracy, batch_loss


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digit images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (N, 1, 8, 8) floats in [0, 1]; 80% train, 20% validation."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise ImportError("the demo needs scikit-learn: pip install 'torchmb[sweep]'") from error
    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    return images[order[:cut]], labels[order[:cut]], images[order[cut:]], labels[order[cut:]]


def sweep_grid(lr_values: int, wd_values: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-model (lr, weight decay): a log-spaced grid, lr in [1e-3, 1], weight decay in [1e-5, 1e-1]."""
    lrs = torch.logspace(-3, 0, lr_values, dtype=torch.float64)
    wds = torch.logspace(-5, -1, wd_values, dtype=torch.float64)
    grid_lr, grid_wd = torch.meshgrid(lrs, wds, indexing="ij")
    return grid_lr.flatten(), grid_wd.flatten()


def run(
    lr_values: int = 8,
    wd_values: int = 8,
    steps: int = 300,
    samples: int = 64,
    device: str = "cpu",
    out: Path = Path("demo-output"),
    seed: int = 0,
) -> dict:
    """Train the sweep; write the leaderboard, plot and best checkpoint to ``out``; return the results.

    Under ``torchrun`` (or in an initialised process group) each rank trains its slice of the grid and
    rank 0 writes the outputs; every rank returns the same results.
    """
    joined = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    device = distributed.init_from_env(device)
    joined = joined and torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        results = _run(lr_values, wd_values, steps, samples, device, out, seed)
        if joined:  # no rank tears its connections down while a peer still reads from them
            torch.distributed.barrier()
        return results
    finally:
        if joined:  # the group this call started
            torch.distributed.destroy_process_group()


def _run(lr_values, wd_values, steps, samples, device, out, seed) -> dict:
    rank, world = distributed.rank_and_world_size()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    train_x, train_y, val_x, val_y = load_digits(seed)
    train_x, train_y, val_x, val_y = (t.to(device) for t in (train_x, train_y, val_x, val_y))
    lrs, wds = sweep_grid(lr_values, wd_values)
    batch = len(lrs)
    owned = distributed.shard_slice(batch)  # everything when alone
    models = distributed.local_batch_module(DigitsCNN(), batch, init="independent", seed=seed).to(device)
    optimizer = optim.SGD(models.parameters(), lr=lrs[owned], momentum=0.9, weight_decay=wds[owned])
    schedule = lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    generator = torch.Generator().manual_seed(seed)  # one seed: the same mini-batches on every rank
    alive = torch.ones(models.batch, dtype=torch.bool)
    started = time.perf_counter()
    progress = tqdm(range(steps), desc=f"sweep of {batch} CNNs", unit="step", mininterval=0.5, disable=rank != 0)
    for _ in progress:
        index = torch.randint(0, len(train_y), (samples,), generator=generator).to(device)
        losses = batch_loss(models(train_x[index], shared_input=True), train_y[index])
        optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        optimizer.step()
        schedule.step()
        alive &= ~diverged(losses).cpu()
        if rank == 0 and bool(alive.any()):
            progress.set_postfix(best_loss=f"{losses[alive.to(device)].min().item():.3f}", diverged=int((~alive).sum()))
    elapsed = time.perf_counter() - started
    models.eval()
    with torch.no_grad():
        accuracy = batch_accuracy(models(val_x, shared_input=True), val_y).cpu()
    accuracy[~alive] = float("nan")
    accuracy = distributed.gather_models(accuracy)  # grid order, on every rank
    elapsed = float(distributed.gather_models(torch.tensor([elapsed], dtype=torch.float64)).max())
    leaderboard = _leaderboard(lrs, wds, accuracy)
    best = _best_model(models, leaderboard[0]["model"], batch, rank, world)
    if rank == 0:
        _write_outputs(best, leaderboard, lrs, wds, accuracy, val_x[:4], out, lr_values, wd_values)
    rate = batch * steps / elapsed
    where = str(device) if world == 1 else f"{world} ranks ({device.type})"
    results = {"best": leaderboard[0], "leaderboard": leaderboard}
    results.update(seconds=elapsed, model_steps_per_second=rate, device=where)
    if rank == 0:
        print(f"{batch} models x {steps} steps in {elapsed:.1f} s on {where} ({rate:.0f} model-steps/s)")
        _print_leaderboard(leaderboard, int(accuracy.isnan().sum()))
        names = ("sweep.png", "leaderboard.csv", "results.json", "best_model.pt2", "best_state_dict.pt")
        print("wrote", ", ".join(str(out / name) for name in names))
    if world > 1:
        torch.distributed.barrier()  # every rank returns once rank 0 has written the outputs
    return results


def _leaderboard(lrs, wds, accuracy) -> list[dict]:
    ranking = sorted(range(len(accuracy)), key=lambda i: math.inf if math.isnan(accuracy[i]) else -float(accuracy[i]))
    return [
        {
            "rank": rank + 1,
            "model": i,
            "lr": float(lrs[i]),
            "weight_decay": float(wds[i]),
            "val_accuracy": float(accuracy[i]),
        }
        for rank, i in enumerate(ranking)
    ]


def _best_model(models, best: int, batch: int, rank: int, world: int) -> nn.Module | None:
    """The best model as a plain CPU module on rank 0 (sent there by the rank that trained it); None elsewhere."""
    slices = distributed.shard_slices(batch, world)
    owner = next(r for r, s in enumerate(slices) if s.start <= best < s.stop)
    plain = models.unbatch(best - slices[owner].start).eval().cpu() if rank == owner else None
    if world == 1:
        return plain
    payload = [plain.state_dict() if plain is not None else None]
    torch.distributed.broadcast_object_list(payload, src=owner)
    if rank != 0:
        return None
    if plain is not None:
        return plain
    plain = models.unbatch(0).eval().cpu()
    plain.load_state_dict(payload[0])
    return plain


def _write_outputs(plain, leaderboard, lrs, wds, accuracy, example, out, lr_values, wd_values) -> None:
    with open(out / "leaderboard.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(leaderboard[0]))
        writer.writeheader()
        writer.writerows(leaderboard)
    torch.save(plain.state_dict(), out / "best_state_dict.pt")
    exported = torch.export.export(plain, (example.cpu(),), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    torch.export.save(exported, out / "best_model.pt2")
    _plot(lrs, wds, accuracy, out / "sweep.png", lr_values, wd_values)
    (out / "results.json").write_text(json.dumps({"best": leaderboard[0], "leaderboard": leaderboard}, indent=1))


def _plot(lrs, wds, accuracy, path: Path, lr_values: int, wd_values: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = accuracy.view(lr_values, wd_values).numpy()
    fig, (heat, curves) = plt.subplots(1, 2, figsize=(11, 4.2))
    image = heat.imshow(grid.T, origin="lower", cmap="viridis", vmin=0, vmax=1, aspect="auto")
    heat.set_xticks(range(lr_values), [f"{v:.0e}" for v in lrs.view(lr_values, wd_values)[:, 0].tolist()], rotation=45)
    heat.set_yticks(range(wd_values), [f"{v:.0e}" for v in wds.view(lr_values, wd_values)[0].tolist()])
    heat.set_xlabel("learning rate")
    heat.set_ylabel("weight decay")
    heat.set_title("validation accuracy (blank: diverged)")
    fig.colorbar(image, ax=heat)
    for j in range(wd_values):
        curves.plot(lrs.view(lr_values, wd_values)[:, j], grid[:, j], marker="o", label=f"wd={float(wds[j]):.0e}")
    curves.set_xscale("log")
    curves.set_xlabel("learning rate")
    curves.set_ylabel("validation accuracy")
    curves.set_ylim(0, 1)
    curves.legend(fontsize=7)
    fig.suptitle(f"{lr_values * wd_values} DigitsCNN models trained as one torchmb.BatchModule")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_leaderboard(leaderboard: list[dict], diverged_count: int, top: int = 10) -> None:
    print(f"\n{'rank':>4}  {'model':>5}  {'lr':>9}  {'weight decay':>12}  {'val acc':>7}")
    for row in leaderboard[:top]:
        print(
            f"{row['rank']:>4}  {row['model']:>5}  {row['lr']:>9.2e}  {row['weight_decay']:>12.2e}  "
            f"{row['val_accuracy']:>7.3f}"
        )
    print(f"... {len(leaderboard) - top} more; {diverged_count} diverged (NaN/inf loss) without touching the others")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lr-values", type=int, default=8, help="learning rates in the grid (default 8)")
    parser.add_argument("--wd-values", type=int, default=8, help="weight decays in the grid (default 8)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--samples", type=int, default=64, help="mini-batch size, shared by all models (default 64)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to train on, e.g. cpu, cuda, cuda:1 (default: cuda where available, else cpu)")
    parser.add_argument("--out", type=Path, default=Path("demo-output"), help="output directory (default demo-output)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the models' initialisation and of the train/validation split (default 0)")


def main(args: argparse.Namespace) -> None:
    run(args.lr_values, args.wd_values, args.steps, args.samples, args.device, args.out, args.seed)
