"""torch habits on a batched optimizer: hyperparameters written into ``param_groups`` by hand behave as on B torch
optimizers, and a ``torch.optim.lr_scheduler`` scheduler is refused with a pointer to ``torchmb.lr_scheduler``."""

from __future__ import annotations

import pytest
import torch

import torchmb.optim as mo

B = 4
LRS = [0.1, 0.05, 0.2, 0.01]


def grads(step: int) -> torch.Tensor:
    return torch.randn(B, 3, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def train(batched_kind, torch_kind, writes: dict[int, dict], steps: int = 5, **kwargs) -> None:
    """``steps`` steps of one batched optimizer and B torch ones on the same gradients, each writing ``writes[s]``
    (name: a value for all models, or one per model) into its first parameter group before step ``s``."""
    weight = torch.zeros(B, 3, dtype=torch.float64, requires_grad=True)
    batched = batched_kind([weight], lr=LRS, **kwargs)
    plain = [torch.zeros(3, dtype=torch.float64, requires_grad=True) for _ in range(B)]
    refs = [torch_kind([p], lr=lr, **kwargs) for p, lr in zip(plain, LRS)]
    for step in range(steps):
        for name, value in writes.get(step, {}).items():
            batched.param_groups[0][name] = value
            for i, ref in enumerate(refs):
                ref.param_groups[0][name] = value[i] if isinstance(value, list) else value
        weight.grad = grads(step)
        batched.step()
        for i, (p, ref) in enumerate(zip(plain, refs)):
            p.grad = grads(step)[i]
            ref.step()
    torch.testing.assert_close(weight.detach(), torch.stack(plain).detach(), rtol=1e-12, atol=1e-14)


def test_a_number_written_into_param_groups_is_every_models_value() -> None:
    train(mo.SGD, torch.optim.SGD, {2: {"lr": 0.05, "momentum": 0.9}, 4: {"lr": 0.3}})


def test_one_value_per_model_written_into_param_groups() -> None:
    train(mo.SGD, torch.optim.SGD, {1: {"lr": [0.3, 0.2, 0.1, 0.0]}}, momentum=0.5)


def test_betas_written_as_a_pair_of_numbers() -> None:
    train(mo.Adam, torch.optim.Adam, {2: {"betas": (0.8, 0.95), "lr": 0.02}})


def test_a_bad_written_value_is_refused_at_the_next_step_naming_it() -> None:
    weight = torch.zeros(B, 3, requires_grad=True)
    optimizer = mo.SGD([weight], lr=LRS)
    weight.grad = torch.ones(B, 3)
    optimizer.param_groups[0]["lr"] = -0.1
    with pytest.raises(ValueError, match=r"Invalid lr: expected values in \[0.0, inf\), got \[-0.1, "):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = [0.1, 0.2]
    with pytest.raises(ValueError, match=r"lr: expected a number or 4 values \(one per model\), got shape \(2,\)"):
        optimizer.step()
    assert torch.equal(weight, torch.zeros(B, 3))


@pytest.mark.parametrize("scheduler", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2),
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10),
], ids=["StepLR", "CosineAnnealingLR", "OneCycleLR"])
def test_a_torch_scheduler_is_refused_pointing_at_torchmb_lr_scheduler(scheduler) -> None:
    weight = torch.zeros(B, 3, requires_grad=True)
    optimizer = mo.SGD([weight], lr=LRS, momentum=0.9)
    with pytest.raises(TypeError, match=r"torchmb\.lr_scheduler.*set_hyperparameter\('lr', value\)"):
        scheduler(optimizer)
    assert optimizer.get_hyperparameter("lr").tolist() == LRS
    assert not hasattr(optimizer.step, "_wrapped_by_lr_sched")
    weight.grad = torch.ones(B, 3)
    optimizer.step()  # still steps as before
    torch.testing.assert_close(weight.detach(), -torch.tensor(LRS).unsqueeze(1).expand(B, 3))
