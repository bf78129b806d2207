"""Operators that compute per SGD step, ``BatchModule`` of B=4 models against the plain model on the same
4*n samples, for every model of the test zoo (``tests/support/zoo.py``'s tiny torchvision and timm models),
on the CPU: issue 24's host-cost target (at most 1.2x) over the whole zoo.

    PYTHONPATH=.:tests python tests/benchmarks/launch_survey.py survey.tsv [--models resnet18,alexnet]

Writes one line per model (name, torchmb's count, the plain model's, their ratio; or the error) as it goes,
then prints the median ratio and how many models are at or below 1.2x. The count is
:mod:`support.launches`'s (``tests/torchmb/test_launches.py``); ``launch_diff.py`` names the operators.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
from support.launches import count_launches
from support.zoo import TIMM_MODELS, TORCHVISION_MODELS, without_randomness
from torch import nn

import torchmb

B, N = 4, 2


def square_loss_step(model: nn.Module, x: torch.Tensor):
    """One SGD step on the mean squared logits (every zoo model's head, whatever its classes); called once
    here, since the first step creates state."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        (out if isinstance(out, torch.Tensor) else out[0]).square().mean().backward()  # GoogLeNet: a tuple
        optimizer.step()

    step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--models", default="", help="comma-separated names (all when empty)")
    args = parser.parse_args()
    wanted = set(filter(None, args.models.split(",")))
    ratios = []
    with open(args.output, "w") as out:
        for entry in TORCHVISION_MODELS + TIMM_MODELS:
            if entry.xfail or (wanted and entry.name not in wanted):
                continue
            torch.manual_seed(0)
            x = torch.randn(B, N, 3, entry.size, entry.size)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # mostly generic models warn so at conversion
                    batched = torchmb.BatchModule(without_randomness(entry.build()), B)
                    ours = sum(count_launches(square_loss_step(batched, x)).values())
                    plain = without_randomness(entry.build())
                    theirs = sum(count_launches(square_loss_step(plain, x.reshape(B * N, *x.shape[2:]))).values())
            except Exception as error:  # a survey: one model's failure is a line of its own
                print(f"{entry.name}\terror\t{type(error).__name__}: {str(error)[:80]}", file=out, flush=True)
                continue
            ratios.append(ours / theirs)
            print(f"{entry.name}\t{ours}\t{theirs}\t{ours / theirs:.3f}", file=out, flush=True)
    within = sum(ratio <= 1.2 for ratio in ratios)
    print(f"{len(ratios)} models: median {statistics.median(ratios):.2f}x, {within} at or below 1.2x")


if __name__ == "__main__":
    main()
