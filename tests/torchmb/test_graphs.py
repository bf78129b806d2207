from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import BatchNormCNN

from torchmb import BatchModule
from torchmb.graphs import CapturedStep


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_capture_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="CapturedStep needs CUDA"):
        CapturedStep(lambda x: x, torch.zeros(1), optimizers=[])


@pytest.mark.cuda
def test_captured_steps_train_exactly_like_eager_steps() -> None:
    torch.manual_seed(0)
    eager = BatchModule(BatchNormCNN(), 4, init="independent", seed=0).cuda()
    graphed = copy.deepcopy(eager)
    inputs = [(torch.randn(4, 8, 3, 8, 8, device="cuda"), torch.randint(0, 4, (4, 8), device="cuda")) for _ in range(3)]

    def make_step(model, optimizer):
        def step(x, y):
            losses = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(4, 8).mean(1)
            losses.sum().backward()
            optimizer.step()
            return losses

        return step

    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    graphed_opt = torch.optim.SGD(graphed.parameters(), lr=0.1, momentum=0.9)
    eager_step = make_step(eager, eager_opt)
    captured = CapturedStep(make_step(graphed, graphed_opt), *inputs[0], optimizers=[graphed_opt], warmup=3)
    for _ in range(3):  # the warm-up steps are real steps on the example inputs
        eager_opt.zero_grad(set_to_none=True)
        eager_step(*inputs[0])
    for x, y in inputs[1:]:
        eager_opt.zero_grad(set_to_none=True)
        expected = eager_step(x, y)
        got = captured(x, y)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match=r"captured as \(4, 8, 3, 8, 8\)"):
        captured(torch.zeros(2, 8, 3, 8, 8, device="cuda"), inputs[0][1])
