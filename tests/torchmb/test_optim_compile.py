"""torchmb.optim under ``torch.compile``: ``opt.step`` and a whole training step trace without graph breaks
and give the numbers of B independently held ``torch.optim`` optimizers (and of eager torchmb).

Compiling is slow on a CPU: the parameters are tiny, most tests use the ``aot_eager`` backend (dynamo and
AOTAutograd, which is where graph breaks and tracing errors show) and one uses Inductor; the whole step
under Inductor is ``slow``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from support.compiled import DYNAMO_WARNINGS, fresh_dynamo  # noqa: F401 (a fixture)
from support.models import MLP

import torchmb
import torchmb.lr_scheduler as ms
import torchmb.optim as mo
from torchmb import BatchModule

B = 3
SHAPES = [(3, 4), (5,)]
# (batched class, torch class, per-model hyperparameters, shared keyword arguments): between them every
# branch of a compiled step (weight decay for some models, a zero step size, momentum for some, AMSGrad, ...)
CASES = {
    "sgd": (mo.SGD, torch.optim.SGD, dict(lr=[0.1, 0.0, 0.2], weight_decay=[0.0, 0.1, 0.0]), {}),
    "sgd_momentum": (mo.SGD, torch.optim.SGD,
                     dict(lr=[0.1, 0.01, 0.2], momentum=[0.9, 0.0, 0.5], dampening=[0.1, 0.0, 0.3]), {}),
    "sgd_nesterov": (mo.SGD, torch.optim.SGD, dict(lr=[0.1, 0.01, 0.2], momentum=[0.9, 0.5, 0.1],
                                                   weight_decay=[0.0, 0.01, 0.1]), dict(nesterov=True, maximize=True)),
    "adam": (mo.Adam, torch.optim.Adam, dict(lr=[0.1, 0.0, 0.05], betas=([0.9, 0.8, 0.5], [0.999, 0.99, 0.9]),
                                             weight_decay=[0.0, 0.01, 0.1]), {}),
    "adamw_amsgrad": (mo.AdamW, torch.optim.AdamW, dict(lr=[0.1, 0.01, 0.0], weight_decay=[0.0, 0.01, 0.5]),
                      dict(amsgrad=True)),
    "rmsprop": (mo.RMSprop, torch.optim.RMSprop, dict(lr=[0.1, 0.0, 0.01], alpha=[0.9, 0.99, 0.5]), {}),
    "rmsprop_centered_momentum": (mo.RMSprop, torch.optim.RMSprop,
                                  dict(lr=[0.1, 0.01, 0.0], momentum=[0.0, 0.5, 0.9], weight_decay=[0.0, 0.1, 0.0]),
                                  dict(centered=True)),
    "adagrad": (mo.Adagrad, torch.optim.Adagrad,
                dict(lr=[0.1, 0.0, 0.2], lr_decay=[0.0, 0.1, 0.01], initial_accumulator_value=[0.0, 0.1, 1.0]),
                dict(maximize=True)),
}
pytestmark = [*DYNAMO_WARNINGS, pytest.mark.usefixtures("fresh_dynamo")]


def make_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, *s, generator=g).requires_grad_() for s in SHAPES]


def make_grads(steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(B, *s, generator=g) for s in SHAPES] for _ in range(steps)]


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def model_kwargs(per_model: dict, i: int) -> dict:
    return {k: (tuple(x[i] for x in v) if k == "betas" else v[i]) for k, v in per_model.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_matches_b_torch_optimizers(case: str) -> None:
    cls, tcls, per_model, shared = CASES[case]
    params = make_params()
    refs = []
    for i in range(B):
        own = [p.detach()[i].clone().requires_grad_() for p in params]
        refs.append((own, tcls(own, **model_kwargs(per_model, i), **shared, foreach=False)))
    opt = cls(params, **per_model, **shared)
    # a step that creates state is traced again once, as torch's compiled optimizers are; never after that
    frames = 1 if all(opt.state[p] for p in params) else 2
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(opt.step, backend=counter, fullgraph=True)
    for grads in make_grads(3):
        set_grads(params, grads)
        step()
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [g[i] for g in grads])
            ref.step()
    assert counter.frame_count == frames
    for i, (own, ref) in enumerate(refs):
        for p, q in zip(params, own, strict=True):
            torch.testing.assert_close(p.detach()[i], q.detach(), rtol=1e-5, atol=1e-6)
            for key, value in ref.state[q].items():
                torch.testing.assert_close(opt.state[p][key][i].to(value.dtype), value, rtol=1e-5, atol=1e-6)
    assert opt.step_counts().tolist() == [3.0] * B


def test_inductor_step_matches_eager() -> None:
    cls, _, per_model, shared = CASES["adamw_amsgrad"]
    params, eager_params = make_params(), make_params()
    opt, eager = cls(params, **per_model, **shared), cls(eager_params, **per_model, **shared)
    step = torch.compile(opt.step, backend="inductor", fullgraph=True)
    for grads in make_grads(3):
        set_grads(params, grads)
        step()
        set_grads(eager_params, grads)
        eager.step()
    for p, q in zip(params, eager_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_hyperparameter_changes_reach_a_compiled_step_without_recompiling() -> None:
    """A scheduler and set_hyperparameter replace the (B,) tensors; the graph reads them, it does not guard on them."""
    runs = []
    for compiled in (True, False):
        params = make_params()
        opt = mo.Adam(params, lr=[0.1, 0.05, 0.2], weight_decay=0.0)
        schedule = ms.StepLR(opt, step_size=1, gamma=[0.5, 0.9, 0.7])
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        step = torch.compile(opt.step, backend=counter, fullgraph=True) if compiled else opt.step
        for t, grads in enumerate(make_grads(5)):
            if t == 3:
                opt.set_hyperparameter("weight_decay", [0.0, 0.1, 0.2])
                opt.set_hyperparameter("beta1", [0.5, 0.6, 0.7])
            set_grads(params, grads)
            step()
            schedule.step()
        runs.append(params)
        if compiled:
            assert counter.frame_count == 2  # the first step creates the state
    for p, q in zip(*runs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_skip_mask_in_a_compiled_step() -> None:
    runs = []
    for compiled in (True, False):
        params = make_params()
        opt = mo.SGD(params, lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.0, 0.5])
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        for t, grads in enumerate(make_grads(4)):
            set_grads(params, grads)
            step(skip=torch.tensor([t == 1, False, t in (1, 2)]))
        runs.append((params, opt))
    (params, opt), (eager_params, eager) = runs
    for p, q in zip(params, eager_params, strict=True):
        torch.testing.assert_close(p, q)
        for key, value in eager.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value)
    assert opt.step_counts().tolist() == [3.0, 4.0, 2.0]


def test_momentum_buffers_exist_before_a_compiled_step_needs_them() -> None:
    params = make_params()
    opt = mo.SGD(params, lr=0.1)
    assert not any(opt.state[p] for p in params)  # no momentum: no buffers, as in torch.optim
    opt.set_hyperparameter("momentum", [0.0, 0.9, 0.0])
    assert all("momentum_buffer" in opt.state[p] for p in params)
    cycled_params = make_params()
    cycled = mo.SGD(cycled_params, lr=0.1)
    ms.OneCycleLR(cycled, max_lr=0.1, total_steps=4)  # cycles the momentum from 0.95 down
    assert all("momentum_buffer" in cycled.state[p] for p in cycled_params)
    copied_params = make_params()
    copied = mo.RMSprop(copied_params, lr=0.1)
    copied.load_model_state(0, mo.RMSprop(make_params(), lr=0.1, momentum=[0.0, 0.0, 0.5]), 2)
    assert all("momentum_buffer" in copied.state[p] for p in copied_params)


def test_momentum_written_into_param_groups_fails_loudly_when_compiled() -> None:
    params = make_params()
    opt = mo.SGD(params, lr=0.1)
    opt.param_groups[0]["momentum"] = torch.full((B,), 0.9, dtype=torch.float64)  # bypasses set_hyperparameter
    set_grads(params, make_grads(1)[0])
    with pytest.raises(RuntimeError, match="SGD momentum became non-zero without set_hyperparameter"):
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    opt.step()  # an eager step creates the buffers it finds missing
    assert all("momentum_buffer" in opt.state[p] for p in params)


def test_fused_kernels_are_refused_inside_a_graph() -> None:
    params = make_params()
    opt = mo.SGD(params, lr=0.1, fused=True)
    set_grads(params, make_grads(1)[0])
    with pytest.raises(RuntimeError, match=r"SGD\(fused=True\): the fused kernels cannot run inside torch.compile"):
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()


def _training_step(model: BatchModule, opt: mo.BatchOptimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    losses = torchmb.batch_loss(model(x), y, loss_fn=F.cross_entropy)
    losses.sum().backward()
    opt.step()
    opt.zero_grad()
    return losses.detach()


def _mlp_and_adam() -> tuple[BatchModule, mo.BatchOptimizer]:
    torch.manual_seed(0)
    model = BatchModule(MLP((4, 6, 3)), B, init="independent", seed=0)
    return model, mo.Adam(model.parameters(), lr=[0.1, 0.01, 0.05], weight_decay=[0.0, 0.1, 0.0])


def test_whole_training_step_breaks_only_at_backward() -> None:
    model, opt = _mlp_and_adam()
    explained = torch._dynamo.explain(_training_step)(model, opt, torch.randn(B, 5, 4), torch.randint(0, 3, (B, 5)))
    assert explained.graph_break_count == 1
    assert "backward" in explained.break_reasons[0].reason


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"), reason="torch too old to trace backward")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_whole_training_step_in_one_graph_matches_b_plain_models(backend: str) -> None:
    model, opt = _mlp_and_adam()
    plain = [model.unbatch(i) for i in range(B)]
    plain_opts = [torch.optim.Adam(m.parameters(), lr=lr, weight_decay=wd, foreach=False)
                  for m, lr, wd in zip(plain, [0.1, 0.01, 0.05], [0.0, 0.1, 0.0], strict=True)]
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        step = torch.compile(_training_step, backend=backend, fullgraph=True)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            x, y = torch.randn(B, 5, 4, generator=g), torch.randint(0, 3, (B, 5), generator=g)
            losses = step(model, opt, x, y)
            for i, (m, o) in enumerate(zip(plain, plain_opts, strict=True)):
                loss = F.cross_entropy(m(x[i]), y[i])
                loss.backward()
                o.step()
                o.zero_grad()
                torch.testing.assert_close(losses[i], loss.detach(), rtol=1e-5, atol=1e-6)
    for i, m in enumerate(plain):
        for p, q in zip(model.state_dict_of(i).values(), m.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert opt.step_counts().tolist() == [3.0] * B
