"""The sweep loop end to end: BatchModule + batched optimizer, scheduler, clipping, select and PBT copies.

The reference is B plain torch models, each with its own torch.optim optimizer and scheduler.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import torchmb
import torchmb.lr_scheduler as ms
import torchmb.optim as mo
from torchmb.clip import clip_grad_norm_

B = 4
LRS = [0.2, 0.1, 0.05, 0.3]
MOMENTA = [0.9, 0.0, 0.5, 0.8]
STEPS = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 5, 6, generator=g), torch.randn(B, 5, 3, generator=g)


def batched_run(select_at: int | None = None, keep: list[int] | None = None):
    bm = torchmb.BatchModule(make_model(), B)
    opt = mo.SGD(bm.parameters(), lr=LRS, momentum=MOMENTA, weight_decay=1e-3)
    sched = ms.StepLR(opt, step_size=[1, 2, 3, 4], gamma=0.7)
    rows = list(range(B))
    for t in range(STEPS):
        if t == select_at:
            bm.select(keep)
            opt.select(keep)
            sched.select(keep)
            rows = keep
        x, y = data(t)
        out = bm(x[rows])
        losses = ((out - y[rows]) ** 2).mean(dim=(1, 2))
        opt.zero_grad()
        losses.sum().backward()
        clip_grad_norm_(list(bm.parameters()), 0.5)
        opt.step()
        sched.step()
    return bm, opt


def test_training_loop_matches_b_plain_models() -> None:
    bm, _ = batched_run()
    for i in range(B):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LRS[i], momentum=MOMENTA[i], weight_decay=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=i + 1, gamma=0.7)
        for t in range(STEPS):
            x, y = data(t)
            loss = ((model(x[i]) - y[i]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(bm.state_dict_of(i)[key], value, rtol=1e-5, atol=1e-6)


def test_select_mid_training_keeps_survivors_bit_identical() -> None:
    full, _ = batched_run()
    keep = [3, 1]
    part, opt = batched_run(select_at=4, keep=keep)
    assert opt.batch == 2
    for j, i in enumerate(keep):
        for key, value in full.state_dict_of(i).items():
            assert torch.equal(part.state_dict_of(j)[key], value), key


def test_exploit_copies_weights_and_optimizer_state_into_a_slot() -> None:
    bm = torchmb.BatchModule(make_model(), B)
    opt = mo.Adam(bm.parameters(), lr=LRS)
    for t in range(3):
        x, y = data(t)
        opt.zero_grad()
        ((bm(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    bm.load_state_dicts([bm.state_dict_of(2)], slots=[0])
    opt.load_model_state(0, src=2)
    twin = copy.deepcopy(bm.unbatch(2))
    for t in range(3, 6):
        x, y = data(t)
        x[0], y[0] = x[2], y[2]
        opt.zero_grad()
        ((bm(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    for key, value in bm.state_dict_of(2).items():
        assert torch.equal(bm.state_dict_of(0)[key], value), key
    assert not all(torch.equal(bm.state_dict_of(2)[k], v) for k, v in twin.state_dict().items())
