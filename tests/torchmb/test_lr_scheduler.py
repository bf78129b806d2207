"""torchmb.lr_scheduler against B torch schedulers, each driving its own torch optimizer."""

from __future__ import annotations

import io
import math

import pytest
import torch

import torchmb.lr_scheduler as ms
import torchmb.optim as mo

B = 4
LRS = [0.1, 0.05, 0.2, 0.01]

# name: (batched class, torch class, per-model arguments, shared arguments, optimizer kind, steps)
CASES = {
    "step": (ms.StepLR, torch.optim.lr_scheduler.StepLR, dict(step_size=[2, 3, 1, 5], gamma=[0.1, 0.5, 0.9, 0.3]),
             {}, "sgd", 12),
    "multistep": (ms.MultiStepLR, torch.optim.lr_scheduler.MultiStepLR,
                  dict(milestones=[[2, 5], [1, 1, 7], [3], []], gamma=[0.1, 0.5, 0.9, 0.3]), {}, "sgd", 12),
    "multistep_shared": (ms.MultiStepLR, torch.optim.lr_scheduler.MultiStepLR, dict(gamma=[0.1, 0.5, 0.9, 0.3]),
                         dict(milestones=[2, 4, 4]), "sgd", 8),
    "exponential": (ms.ExponentialLR, torch.optim.lr_scheduler.ExponentialLR, dict(gamma=[0.9, 0.5, 0.99, 1.0]),
                    {}, "adam", 10),
    "linear": (ms.LinearLR, torch.optim.lr_scheduler.LinearLR,
               dict(start_factor=[0.1, 0.5, 1.0, 0.25], end_factor=[1.0, 0.2, 0.5, 1.0], total_iters=[4, 2, 6, 0]),
               {}, "sgd", 10),
    "cosine": (ms.CosineAnnealingLR, torch.optim.lr_scheduler.CosineAnnealingLR,
               dict(T_max=[3, 5, 10, 2], eta_min=[0.0, 0.001, 0.01, 0.005]), {}, "adam", 25),
    "onecycle_sgd": (ms.OneCycleLR, torch.optim.lr_scheduler.OneCycleLR,
                     dict(max_lr=[1.0, 0.5, 0.1, 2.0], base_momentum=[0.8, 0.85, 0.7, 0.6],
                          max_momentum=[0.9, 0.95, 0.99, 0.9], div_factor=[25.0, 10.0, 5.0, 100.0],
                          final_div_factor=[1e4, 1e2, 10.0, 1e3]), dict(total_steps=20), "sgd_momentum", 20),
    "onecycle_adam_linear_three_phase": (ms.OneCycleLR, torch.optim.lr_scheduler.OneCycleLR,
                                         dict(max_lr=[1.0, 0.5, 0.1, 2.0], max_momentum=[0.9, 0.95, 0.99, 0.9]),
                                         dict(epochs=3, steps_per_epoch=5, anneal_strategy="linear",
                                              three_phase=True, pct_start=0.25), "adam", 15),
}


def make_optimizer(kind: str, params, lr):
    if kind == "sgd":
        return (mo.SGD(params, lr=lr) if isinstance(lr, list) else torch.optim.SGD(params, lr=lr))
    if kind == "sgd_momentum":
        return (mo.SGD(params, lr=lr, momentum=0.9) if isinstance(lr, list)
                else torch.optim.SGD(params, lr=lr, momentum=0.9))
    return mo.Adam(params, lr=lr) if isinstance(lr, list) else torch.optim.Adam(params, lr=lr)


def build(case: str, batch: int = B):
    cls, tcls, per_model, shared, kind, steps = CASES[case]
    weight = torch.zeros(batch, 3, requires_grad=True)
    opt = make_optimizer(kind, [weight], LRS[:batch])
    sched = cls(opt, **per_model, **shared)
    refs = []
    for i in range(batch):
        own = torch.zeros(3, requires_grad=True)
        ref_opt = make_optimizer(kind, [own], LRS[i])
        refs.append((ref_opt, tcls(ref_opt, **{k: v[i] for k, v in per_model.items()}, **shared)))
    return weight, opt, sched, refs, steps


def momentum_of(group):
    return group["betas"][0] if "betas" in group else group["momentum"]


def assert_same_schedule(opt, refs) -> None:
    got = opt.param_groups[0]["lr"]
    want = torch.tensor([ref_opt.param_groups[0]["lr"] for ref_opt, _ in refs], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    group = opt.param_groups[0]
    if "betas" in group or bool((group["momentum"] != 0).any()):
        want_m = torch.tensor([float(momentum_of(r.param_groups[0])) for r, _ in refs], dtype=torch.float64)
        torch.testing.assert_close(momentum_of(group), want_m, rtol=1e-12, atol=1e-15)


def train_step(weight, opt, sched, refs) -> None:
    weight.grad = torch.ones_like(weight)
    opt.step()
    sched.step()
    for ref_opt, ref_sched in refs:
        p = ref_opt.param_groups[0]["params"][0]
        p.grad = torch.ones_like(p)
        ref_opt.step()
        ref_sched.step()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_b_torch_schedulers(case: str) -> None:
    weight, opt, sched, refs, steps = build(case)
    assert_same_schedule(opt, refs)
    for _ in range(steps):
        train_step(weight, opt, sched, refs)
        assert_same_schedule(opt, refs)
        torch.testing.assert_close(sched.get_last_lr()[0], opt.param_groups[0]["lr"], rtol=0, atol=0)
    # the schedule drove the optimizer: every model's weight moved by its own lrs
    for i, (ref_opt, _) in enumerate(refs):
        torch.testing.assert_close(weight.detach()[i], ref_opt.param_groups[0]["params"][0].detach(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_select_keeps_survivors_schedules(case: str) -> None:
    weight, opt, sched, _, steps = build(case)
    full_weight, full_opt, full_sched, _, _ = build(case)
    keep = [2, 0]
    history = []
    for t in range(steps):
        if t == steps // 2:
            weight.data = weight.data[keep]
            opt.select(keep)
            sched.select(keep)
        weight.grad = torch.ones_like(weight)
        opt.step()
        sched.step()
        full_weight.grad = torch.ones_like(full_weight)
        full_opt.step()
        full_sched.step()
        history.append((opt.param_groups[0]["lr"].clone(), full_opt.param_groups[0]["lr"].clone()))
    for t, (got, want) in enumerate(history):
        assert torch.equal(got, want[keep] if t >= steps // 2 else want)
    assert torch.equal(weight.detach(), full_weight.detach()[keep])


@pytest.mark.parametrize("case", ["step", "multistep", "cosine", "onecycle_sgd", "linear"])
def test_state_dict_round_trip(case: str) -> None:
    weight, opt, sched, refs, steps = build(case)
    for _ in range(steps // 2):
        train_step(weight, opt, sched, refs)
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    weight2, opt2, sched2, _, _ = build(case)
    weight2.data.copy_(weight.data)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    for _ in range(steps - steps // 2):
        train_step(weight, opt, sched, refs)
        weight2.grad = torch.ones_like(weight2)
        opt2.step()
        sched2.step()
        assert torch.equal(opt2.param_groups[0]["lr"], opt.param_groups[0]["lr"])
    assert torch.equal(weight2, weight)


def test_lambda_lr_per_model_functions_and_one_vector_function() -> None:
    weight = torch.zeros(B, 2, requires_grad=True)
    opt = mo.SGD([weight], lr=LRS)
    factors = [lambda e: 0.9**e, lambda e: 1.0 / (e + 1), lambda e: math.cos(e / 10), lambda e: 1.0]
    sched = ms.LambdaLR(opt, factors)
    opt2 = mo.SGD([torch.zeros(B, 2, requires_grad=True)], lr=LRS)
    gammas = torch.tensor([0.5, 0.6, 0.7, 0.8], dtype=torch.float64)
    sched2 = ms.LambdaLR(opt2, lambda e: gammas**e)
    refs, refs2 = [], []
    for i in range(B):
        o = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=LRS[i])
        refs.append((o, torch.optim.lr_scheduler.LambdaLR(o, factors[i])))
        o2 = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=LRS[i])
        refs2.append((o2, torch.optim.lr_scheduler.LambdaLR(o2, lambda e, g=float(gammas[i]): g**e)))
    for _ in range(8):
        train_step(weight, opt, sched, refs)
        opt2.param_groups[0]["params"][0].grad = torch.ones(B, 2)
        opt2.step()
        sched2.step()
        for o, s in refs2:
            o.step()
            s.step()
        assert_same_schedule(opt, refs)
        assert_same_schedule(opt2, refs2)
    sched.select([3, 1])
    opt.select([3, 1])
    assert sched.lr_lambdas[0] is factors[3]
    sched2.select([1])
    assert sched2.lr_lambdas[0].__name__ == "<lambda>"
    assert "lr_lambdas" in sched.state_dict() and sched.state_dict()["lr_lambdas"] == [None, None]


def test_several_parameter_groups_are_scheduled_separately() -> None:
    a, b = torch.zeros(B, 2, requires_grad=True), torch.zeros(B, 3, requires_grad=True)
    opt = mo.SGD([{"params": [a]}, {"params": [b], "lr": [1.0, 2.0, 3.0, 4.0]}], lr=LRS)
    sched = ms.StepLR(opt, step_size=[1, 2, 3, 4], gamma=0.5)
    for _ in range(5):
        sched.step()
    steps = torch.tensor([5 // s for s in (1, 2, 3, 4)], dtype=torch.float64)
    torch.testing.assert_close(opt.param_groups[0]["lr"], torch.tensor(LRS, dtype=torch.float64) * 0.5**steps)
    torch.testing.assert_close(opt.param_groups[1]["lr"], torch.tensor([1.0, 2.0, 3.0, 4.0],
                                                                       dtype=torch.float64) * 0.5**steps)


def test_bad_arguments_are_refused() -> None:
    opt = mo.SGD([torch.zeros(B, 2, requires_grad=True)], lr=LRS)
    with pytest.raises(TypeError, match=r"needs a torchmb\.optim optimizer"):
        ms.StepLR(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), step_size=1)
    with pytest.raises(ValueError, match=r"step_size: expected a number or 4 values"):
        ms.StepLR(opt, step_size=[1, 2])
    with pytest.raises(ValueError, match="step_size: expected integers"):
        ms.StepLR(opt, step_size=[1, 2.5, 1, 1])
    with pytest.raises(ValueError, match=r"Invalid T_max.*models \[1\]"):
        ms.CosineAnnealingLR(opt, T_max=[3, 0, 3, 3])
    with pytest.raises(ValueError, match="milestones: expected one list per model"):
        ms.MultiStepLR(opt, milestones=[[1], [2]])
    with pytest.raises(ValueError, match="one function per model"):
        ms.LambdaLR(opt, [lambda e: 1.0])
    with pytest.raises(ValueError, match=r"Invalid start_factor"):
        ms.LinearLR(opt, start_factor=[0.0, 0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="cycle_momentum"):
        ms.OneCycleLR(mo.Adagrad([torch.zeros(B, 2, requires_grad=True)]), max_lr=0.1, total_steps=3)
    sched = ms.OneCycleLR(opt, max_lr=0.1, total_steps=2, cycle_momentum=False)
    sched.step()
    sched.step()
    with pytest.raises(ValueError, match="Tried to step 3 times"):
        sched.step()
