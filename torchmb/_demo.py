"""``python -m torchmb demo``: many small CNNs, each from its own seed, trained at once on one device."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ._module import BatchModule
from .functional import batch_accuracy, batch_loss


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def synthetic_images(samples: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy 16x16 images of four classes: a horizontal, vertical, diagonal or anti-diagonal bar."""
    patterns = torch.zeros(4, 16, 16)
    patterns[0, 7:9, :] = 1
    patterns[1, :, 7:9] = 1
    patterns[2] = torch.eye(16)
    patterns[3] = torch.eye(16).flip(1)
    labels = torch.randint(0, 4, (samples,), generator=generator)
    images = torch.randn(samples, 1, 16, 16, generator=generator) + 1.5 * patterns[labels].unsqueeze(1)
    return images, labels


def run(models: int, steps: int, samples: int, device: str, seed: int) -> torch.Tensor:
    """Train ``models`` seeds of SmallCNN at once; returns each model's validation accuracy."""
    generator = torch.Generator().manual_seed(seed)
    train_x, train_y = synthetic_images(4096, generator)
    val_x, val_y = synthetic_images(1024, generator)
    batched = BatchModule(SmallCNN(), models, init="independent", seed=seed).to(device)
    optimizer = torch.optim.SGD(batched.parameters(), lr=0.05, momentum=0.9)
    started = time.perf_counter()
    progress = tqdm(range(steps), desc=f"training {models} CNNs", unit="step", mininterval=0.5)
    for _ in progress:
        # Every model draws its own mini-batch from the training set.
        index = torch.randint(0, len(train_x), (models, samples), generator=generator)
        x, y = train_x[index].to(device), train_y[index].to(device)
        losses = batch_loss(batched(x), y)
        optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        optimizer.step()
        progress.set_postfix(loss=f"{losses.mean().item():.3f}")
    elapsed = time.perf_counter() - started
    batched.eval()
    with torch.no_grad():
        accuracy = batch_accuracy(batched(val_x.to(device), shared_input=True), val_y.to(device)).cpu()
    rate = models * steps / elapsed
    print(f"{models} models x {steps} steps in {elapsed:.1f} s on {device} ({rate:.0f} model-steps/s)")
    print("validation accuracy per model:", " ".join(f"{a:.2f}" for a in accuracy.tolist()))
    print(f"best model {int(accuracy.argmax())}: {float(accuracy.max()):.3f}, worst {float(accuracy.min()):.3f}")
    return accuracy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=int, default=16, help="number of models trained at once (default 16)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    parser.add_argument("--samples", type=int, default=64, help="samples per model per step (default 64)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    run(args.models, args.steps, args.samples, args.device, args.seed)
