"""torchmb.optim against B independently held torch.optim optimizers (the reference)."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchmb.optim as mo
from torchmb.clip import diverged_indices

B = 4
SHAPES = [(3, 5), (5,), (2, 3, 2)]

# (batched class, torch class, per-model hyperparameters (B values each), shared keyword arguments)
CASES = {
    "sgd": (mo.SGD, torch.optim.SGD, dict(lr=[0.1, 0.01, 0.2, 0.05]), {}),
    "sgd_momentum": (mo.SGD, torch.optim.SGD,
                     dict(lr=[0.1, 0.01, 0.2, 0.0], momentum=[0.9, 0.0, 0.5, 0.8], dampening=[0.1, 0.2, 0.0, 0.3],
                          weight_decay=[0.0, 1e-2, 0.1, 0.0]), {}),
    "sgd_nesterov_maximize": (mo.SGD, torch.optim.SGD,
                              dict(lr=[0.1, 0.01, 0.2, 0.03], momentum=[0.9, 0.1, 0.5, 0.8],
                                   weight_decay=[0.0, 1e-2, 0.1, 0.0]), dict(nesterov=True, maximize=True)),
    "adam": (mo.Adam, torch.optim.Adam,
             dict(lr=[0.1, 0.01, 0.2, 0.0], betas=([0.9, 0.8, 0.5, 0.0], [0.999, 0.99, 0.9, 0.5]),
                  eps=[1e-8, 1e-3, 1e-6, 1e-8], weight_decay=[0.0, 1e-2, 0.1, 0.0]), {}),
    "adam_amsgrad_maximize": (mo.Adam, torch.optim.Adam,
                              dict(lr=[0.1, 0.01, 0.2, 0.3], betas=([0.9, 0.8, 0.5, 0.0], [0.999, 0.99, 0.9, 0.5])),
                              dict(amsgrad=True, maximize=True)),
    "adamw": (mo.AdamW, torch.optim.AdamW,
              dict(lr=[0.1, 0.01, 0.2, 0.0], weight_decay=[0.0, 1e-2, 0.1, 0.5], eps=[1e-8, 1e-6, 1e-4, 1e-8]), {}),
    "adamw_amsgrad": (mo.AdamW, torch.optim.AdamW,
                      dict(lr=[0.1, 0.01, 0.2, 0.02], weight_decay=[0.0, 1e-2, 0.1, 0.5]), dict(amsgrad=True)),
    "rmsprop": (mo.RMSprop, torch.optim.RMSprop,
                dict(lr=[0.1, 0.01, 0.2, 0.0], alpha=[0.9, 0.99, 0.5, 0.7], eps=[1e-8, 1e-6, 1e-3, 1e-8],
                     weight_decay=[0.0, 0.1, 0.0, 1e-2]), {}),
    "rmsprop_centered_momentum": (mo.RMSprop, torch.optim.RMSprop,
                                  dict(lr=[0.1, 0.01, 0.2, 0.0], alpha=[0.9, 0.99, 0.5, 0.7],
                                       momentum=[0.0, 0.5, 0.9, 0.1]), dict(centered=True, maximize=True)),
    "adagrad": (mo.Adagrad, torch.optim.Adagrad,
                dict(lr=[0.1, 0.01, 0.2, 0.0], lr_decay=[0.0, 0.1, 0.01, 0.5], eps=[1e-10, 1e-6, 1e-3, 1e-10],
                     initial_accumulator_value=[0.0, 0.1, 1.0, 2.0], weight_decay=[0.0, 0.1, 0.0, 0.01]),
                dict(maximize=True)),
}


def model_kwargs(per_model: dict, i: int) -> dict:
    return {k: (tuple(x[i] for x in v) if k == "betas" else v[i]) for k, v in per_model.items()}


def make_params(batch: int = B, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, *s, generator=g).to(device).requires_grad_() for s in SHAPES]


def make_grads(batch: int, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(batch, *s, generator=g) for s in SHAPES] for _ in range(steps)]


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.to(p.device).clone()


def references(params, tcls, per_model, shared):
    """B plain torch optimizers, model i's on clones of p[i]."""
    refs = []
    for i in range(params[0].shape[0]):
        own = [p.detach()[i].clone().requires_grad_() for p in params]
        refs.append((own, tcls(own, **model_kwargs(per_model, i), **shared, foreach=False)))
    return refs


def assert_matches_references(opt, params, refs, exact: bool = False) -> None:
    check = (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)) if exact else (
        lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6))
    for i, (own, ref) in enumerate(refs):
        for p, q in zip(params, own):
            check(p.detach()[i].cpu(), q.detach().cpu())
            for key, value in ref.state[q].items():
                if not isinstance(value, torch.Tensor):
                    continue
                ours = opt.state[p][key][i].cpu()
                check(ours.to(value.dtype), value.cpu())


@pytest.mark.parametrize("case", list(CASES))
def test_matches_b_torch_optimizers(case: str) -> None:
    cls, tcls, per_model, shared = CASES[case]
    params = make_params()
    refs = references(params, tcls, per_model, shared)
    opt = cls(params, **per_model, **shared)
    for grads in make_grads(B, 10):
        set_grads(params, grads)
        opt.step()
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [g[i] for g in grads])
            ref.step()
    assert_matches_references(opt, params, refs)
    assert opt.step_counts().tolist() == [10.0] * B


def test_scalar_hyperparameters_match_torch_and_param_groups() -> None:
    params = make_params()
    opt = mo.Adam([{"params": params[:2]}, {"params": params[2:], "lr": [0.3, 0.2, 0.1, 0.05]}], lr=0.01,
                  betas=(0.8, 0.99))
    refs = []
    for i in range(B):
        own = [p.detach()[i].clone().requires_grad_() for p in params]
        refs.append((own, torch.optim.Adam([{"params": own[:2]}, {"params": own[2:], "lr": [0.3, 0.2, 0.1, 0.05][i]}],
                                           lr=0.01, betas=(0.8, 0.99), foreach=False)))
    for grads in make_grads(B, 10):
        set_grads(params, grads)
        opt.step()
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [g[i] for g in grads])
            ref.step()
    assert_matches_references(opt, params, refs)
    assert opt.get_hyperparameter("lr", 0).tolist() == [0.01] * B
    assert opt.get_hyperparameter("lr", 1).tolist() == [0.3, 0.2, 0.1, 0.05]


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", list(CASES))
def test_launches_do_not_grow_with_batch(case: str) -> None:
    cls, _, per_model, shared = CASES[case]
    counts = []
    for batch in (4, 37):  # both hold every value of the case (a zero lr adds a fixed number of ops)
        params = make_params(batch)
        values = {k: (tuple(torch.tensor(x).repeat(batch)[:batch] for x in v) if k == "betas"
                      else torch.tensor(v).repeat(batch)[:batch]) for k, v in per_model.items()}
        opt = cls(params, **values, **shared)
        grads = make_grads(batch, 2)
        set_grads(params, grads[0])
        opt.step()
        set_grads(params, grads[1])
        with _OpCounter() as counter:
            opt.step()
        counts.append(counter.ops)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("case", ["sgd_momentum", "adam", "adamw_amsgrad", "rmsprop_centered_momentum", "adagrad"])
def test_select_keeps_survivors_bit_identical(case: str) -> None:
    cls, _, per_model, shared = CASES[case]
    grads = make_grads(B, 10)
    full = make_params()
    opt_full = cls(full, **per_model, **shared)
    for g in grads:
        set_grads(full, g)
        opt_full.step()

    keep = [3, 1, 2]
    part = make_params()
    opt = cls(part, **per_model, **shared)
    for t, g in enumerate(grads):
        if t == 5:
            for p in part:  # what BatchModule.select does: same Parameter objects, new leading size
                p.data = p.data[keep]
            opt.select(keep)
            assert opt.batch == 3
        set_grads(part, [x[keep] for x in g] if t >= 5 else g)
        opt.step()
    for p, q in zip(part, full):
        assert torch.equal(p.detach(), q.detach()[keep])
        for key, value in opt_full.state[q].items():
            assert torch.equal(opt.state[p][key], value[keep]), key
    for name in mo.Adam.per_model if cls in (mo.Adam, mo.AdamW) else cls.per_model:
        got, want = opt.get_hyperparameter(name), opt_full.get_hyperparameter(name)
        if isinstance(got, tuple):
            assert all(torch.equal(a, b[keep]) for a, b in zip(got, want))
        else:
            assert torch.equal(got, want[keep])


def test_select_with_mask_and_errors() -> None:
    params = make_params()
    opt = mo.SGD(params, lr=[0.1, 0.2, 0.3, 0.4], momentum=0.9)
    set_grads(params, make_grads(B, 1)[0])
    opt.step()
    with pytest.raises(IndexError, match=r"model indices must lie in \[0, 4\)"):
        opt.select([0, 4])
    with pytest.raises(ValueError, match=r"boolean mask must have shape \(4,\)"):
        opt.select(torch.tensor([True, False]))
    with pytest.raises(ValueError, match="keep at least one model"):
        opt.select(torch.zeros(4, dtype=torch.bool))
    opt.select(torch.tensor([False, True, False, True]))
    assert opt.get_hyperparameter("lr").tolist() == [0.2, 0.4]
    # the parameters were not shrunk with the optimizer: a clear error, not a silent broadcast
    with pytest.raises(ValueError, match=r"call optimizer\.select"):
        opt.step()


@pytest.mark.parametrize("case", ["sgd_momentum", "adam", "rmsprop_centered_momentum", "adagrad"])
def test_load_model_state_copies_one_model_into_another_slot(case: str) -> None:
    cls, _, per_model, shared = CASES[case]
    params = make_params()
    opt = cls(params, **per_model, **shared)
    grads = make_grads(B, 8)
    for g in grads[:4]:
        set_grads(params, g)
        opt.step()
    # exploit: model 2 replaces model 0 (weights by hand here, BatchModule does it in a sweep)
    for p in params:
        p.data[0] = p.data[2]
    opt.load_model_state(0, src=2)
    for g in grads[4:]:
        for x in g:
            x[0] = x[2]
        set_grads(params, g)
        opt.step()
    for p in params:
        assert torch.equal(p.detach()[0], p.detach()[2])
        for value in opt.state[p].values():
            assert torch.equal(value[0], value[2])
    for name in cls.per_model:
        value = opt.get_hyperparameter(name)
        for v in value if isinstance(value, tuple) else (value,):
            assert v[0] == v[2]


def test_load_model_state_from_another_optimizer_without_hyperparameters() -> None:
    src_params, dst_params = make_params(3, seed=5), make_params(B)
    src = mo.Adam(src_params, lr=[0.1, 0.2, 0.3])
    dst = mo.Adam(dst_params, lr=[0.01, 0.02, 0.03, 0.04])
    for g in make_grads(3, 3):
        set_grads(src_params, g)
        src.step()
    dst.load_model_state([1, 3], src, [2, 0], hyperparameters=False)
    for p, q in zip(dst_params, src_params):
        assert torch.equal(dst.state[p]["exp_avg"][1], src.state[q]["exp_avg"][2])
        assert torch.equal(dst.state[p]["exp_avg_sq"][3], src.state[q]["exp_avg_sq"][0])
        assert torch.count_nonzero(dst.state[p]["exp_avg"][[0, 2]]) == 0
        assert dst.state[p]["step"].tolist() == [0.0, 3.0, 0.0, 3.0]
    assert dst.get_hyperparameter("lr").tolist() == [0.01, 0.02, 0.03, 0.04]
    with pytest.raises(ValueError, match="as many models"):
        dst.load_model_state([0, 1], src, [0])
    with pytest.raises(TypeError, match="source must be a Adam"):
        dst.load_model_state(0, mo.SGD(make_params(B), lr=0.1), 0)


def test_load_model_state_keeps_per_parameter_step_counts() -> None:
    params = make_params(B)
    opt = mo.Adam(params, lr=0.1)
    for t, g in enumerate(make_grads(B, 3)):
        set_grads(params, g)
        if t == 1:
            params[1].grad = None  # this parameter skips a step: its counts fall behind the others'
        opt.step()
    opt.load_model_state([0, 3], src=[2, 2])
    assert opt.state[params[0]]["step"].tolist() == [3.0] * B
    assert opt.state[params[1]]["step"].tolist() == [2.0] * B
    fresh = mo.Adam(make_params(B), lr=0.1)
    fresh.load_model_state(1, opt, 2)
    steps = [fresh.state[p]["step"].tolist() for p in fresh.param_groups[0]["params"]]
    assert steps == [[0.0, 3.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]]


@pytest.mark.parametrize("case", ["sgd_momentum", "adam", "rmsprop_centered_momentum", "adagrad"])
def test_skip_leaves_skipped_models_untouched(case: str) -> None:
    cls, tcls, per_model, shared = CASES[case]
    params = make_params()
    refs = references(params, tcls, per_model, shared)
    opt = cls(params, **per_model, **shared)
    for t, grads in enumerate(make_grads(B, 6)):
        skip = [0, 2] if t in (0, 3) else None
        set_grads(params, grads)
        opt.step(skip=skip)
        for i, (own, ref) in enumerate(refs):
            if skip is None or i not in skip:
                set_grads(own, [g[i] for g in grads])
                ref.step()
    assert_matches_references(opt, params, refs)
    assert opt.step_counts().tolist() == [4.0, 6.0, 4.0, 6.0]


@pytest.mark.parametrize("case", list(CASES))
def test_nan_gradient_never_reaches_other_models(case: str) -> None:
    cls, _, per_model, shared = CASES[case]
    grads = make_grads(B, 6)
    clean = make_params()
    opt_clean = cls(clean, **per_model, **shared)
    dirty = make_params()
    opt_dirty = cls(dirty, **per_model, **shared)
    for t, g in enumerate(grads):
        set_grads(clean, g)
        opt_clean.step()
        bad = [x.clone() for x in g]
        if t == 2:
            bad[0][1, 0, 0] = float("nan")
            bad[1][1, 0] = float("inf")
        set_grads(dirty, bad)
        opt_dirty.step()
    others = [0, 2, 3]
    for p, q in zip(dirty, clean):
        assert torch.equal(p.detach()[others], q.detach()[others])
        for key, value in opt_clean.state[q].items():
            assert torch.equal(opt_dirty.state[p][key][others], value[others]), key
    if per_model["lr"][1] != 0:
        assert diverged_indices(parameters=dirty) == [1]


@pytest.mark.parametrize("case", ["sgd_momentum", "adamw_amsgrad", "rmsprop_centered_momentum", "adagrad"])
def test_state_dict_round_trip(case: str) -> None:
    cls, _, per_model, shared = CASES[case]
    grads = make_grads(B, 6)
    params = make_params()
    opt = cls(params, **per_model, **shared)
    for g in grads[:3]:
        set_grads(params, g)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    restored_params = [p.detach().clone().requires_grad_() for p in params]
    restored = cls(restored_params, lr=0.5, **shared)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for name in cls.per_model:
        got, want = restored.get_hyperparameter(name), opt.get_hyperparameter(name)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b) and a.dtype == torch.float64
    for g in grads[3:]:
        set_grads(params, g)
        opt.step()
        set_grads(restored_params, g)
        restored.step()
    for p, q in zip(params, restored_params):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(restored.state[q][key], value)
            assert restored.state[q][key].device == value.device


def test_state_dict_after_select_restores_the_smaller_population() -> None:
    params = make_params()
    opt = mo.SGD(params, lr=[0.1, 0.2, 0.3, 0.4], momentum=0.9)
    set_grads(params, make_grads(B, 1)[0])
    opt.step()
    for p in params:
        p.data = p.data[[2, 0]]
    opt.select([2, 0])
    saved = opt.state_dict()
    fresh_params = [p.detach().clone().requires_grad_() for p in params]
    fresh = mo.SGD(fresh_params, lr=0.1, momentum=0.9)
    fresh.load_state_dict(saved)
    assert fresh.batch == 2
    assert fresh.get_hyperparameter("lr").tolist() == [0.3, 0.1]


def test_hyperparameters_are_readable_and_settable() -> None:
    params = make_params()
    opt = mo.Adam(params, lr=0.1)
    opt.set_hyperparameter("lr", [0.1, 0.2, 0.3, 0.4])
    opt.set_hyperparameter("beta1", torch.tensor([0.5, 0.6, 0.7, 0.8], dtype=torch.float64))
    assert opt.get_hyperparameter("lr").tolist() == [0.1, 0.2, 0.3, 0.4]
    assert opt.param_groups[0]["betas"][0].tolist() == [0.5, 0.6, 0.7, 0.8]
    assert opt.param_groups[0]["betas"][1].tolist() == [0.999] * B
    # the values in use are the ones set: compare with torch after the change
    refs = references(params, torch.optim.Adam,
                      dict(lr=[0.1, 0.2, 0.3, 0.4], betas=([0.5, 0.6, 0.7, 0.8], [0.999] * B)), {})
    for grads in make_grads(B, 3):
        set_grads(params, grads)
        opt.step()
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [g[i] for g in grads])
            ref.step()
    assert_matches_references(opt, params, refs)
    with pytest.raises(ValueError, match=r"expected a number or 4 values \(one per model\), got shape \(3,\)"):
        opt.set_hyperparameter("lr", [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"Invalid lr: .* for models \[2\]"):
        opt.set_hyperparameter("lr", [0.1, 0.2, -0.3, 0.4])
    with pytest.raises(ValueError, match=r"beta parameter at index 0.*models \[0\]"):
        opt.set_hyperparameter("beta1", [1.0, 0.5, 0.5, 0.5])
    with pytest.raises(KeyError, match="no per-model hyperparameter 'momentum'"):
        opt.set_hyperparameter("momentum", 0.9)
    with pytest.raises(TypeError, match="got a bool"):
        opt.set_hyperparameter("lr", True)
    with pytest.raises(ValueError, match=r"must be finite.*models \[1\]"):
        opt.set_hyperparameter("lr", [0.1, float("nan"), 0.1, 0.1])


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match=r"same leading model axis B = 4, got a parameter of shape \(3, 2\)"):
        mo.SGD([torch.zeros(4, 2, requires_grad=True), torch.zeros(3, 2, requires_grad=True)], lr=0.1)
    with pytest.raises(ValueError, match="leading model axis"):
        mo.Adam([torch.zeros((), requires_grad=True)])
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        mo.SGD(make_params(), lr=0.1, momentum=[0.9, 0.0, 0.9, 0.9], nesterov=True)
    # checked where the values are set, not in step(); a refused value leaves every group as it was
    nesterov = mo.SGD([{"params": make_params()[:1]}, {"params": make_params()[1:]}], lr=0.1, momentum=0.9,
                      nesterov=True)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        nesterov.set_hyperparameter("dampening", [0.0, 0.0, 0.1, 0.0], group=1)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        nesterov.set_hyperparameter("momentum", [0.9, 0.0, 0.9, 0.9])
    assert all(g["momentum"].tolist() == [0.9] * B for g in nesterov.param_groups)
    p = torch.zeros(4, 3, requires_grad=True)
    opt = mo.SGD([p], lr=0.1)
    p.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_adam_with_lower_precision_parameters_tracks_torch() -> None:
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in make_params()]
    per_model = dict(lr=[0.01, 0.02, 0.03, 0.04], betas=([0.9, 0.8, 0.7, 0.6], 0.999))
    refs = []
    for i in range(B):
        own = [p.detach()[i].clone().requires_grad_() for p in params]
        refs.append((own, torch.optim.Adam(own, lr=per_model["lr"][i], betas=(per_model["betas"][0][i], 0.999),
                                           foreach=False)))
    opt = mo.Adam(params, **per_model)
    for grads in make_grads(B, 5):
        grads = [g.to(torch.bfloat16) for g in grads]
        set_grads(params, grads)
        opt.step()
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [g[i] for g in grads])
            ref.step()
    for i, (own, _) in enumerate(refs):
        for p, q in zip(params, own):
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(p.detach()[i].float(), q.detach().float(), rtol=2e-2, atol=2e-2)


FUSED_CASES = [c for c in CASES if CASES[c][0] in (mo.SGD, mo.Adam, mo.AdamW)]


def test_fused_is_refused_where_it_cannot_run() -> None:
    opt = mo.Adam(make_params(), lr=0.1, fused=True)
    set_grads(opt.param_groups[0]["params"], make_grads(B, 1)[0])
    with pytest.raises(RuntimeError, match=r"Adam\(fused=True\) cannot run the fused kernels"):
        opt.step()
    with pytest.raises(ValueError, match="fused must be None"):
        mo.SGD(make_params(), fused="yes")


def run_on(case: str, device: str, fused, skip_at: int | None = None, steps: int = 10):
    cls, tcls, per_model, shared = CASES[case]
    params = make_params(device=device)
    refs = references(params, tcls, per_model, shared)
    kwargs = {"fused": fused} if cls in (mo.SGD, mo.Adam, mo.AdamW) else {}
    opt = cls(params, **per_model, **shared, **kwargs)
    for t, grads in enumerate(make_grads(B, steps)):
        set_grads(params, grads)
        opt.step(skip=[1] if t == skip_at else None)
        for i, (own, ref) in enumerate(refs):
            if not (t == skip_at and i == 1):
                set_grads(own, [g[i] for g in grads])
                ref.step()
    return opt, params, refs


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
def test_reference_path_matches_torch_on_cuda(case: str) -> None:
    opt, params, refs = run_on(case, "cuda", fused=False, skip_at=4)
    assert_matches_references(opt, params, refs)
    assert opt.fused_steps == 0


@pytest.mark.cuda
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_kernels_match_torch_and_the_reference_path(case: str) -> None:
    pytest.importorskip("cupy")
    from torchmb.optim import _fused

    kernel = "torchmb_sgd" if CASES[case][0] is mo.SGD else "torchmb_adam"
    before = _fused.LAUNCHES[kernel]
    opt, params, refs = run_on(case, "cuda", fused=None, skip_at=4)
    assert opt.fused_steps == 10, "the default must take the fused kernels on CUDA with CuPy"
    assert _fused.LAUNCHES[kernel] - before == 10, "one launch per step for all the group's tensors"
    assert_matches_references(opt, params, refs)
    reference, ref_params, _ = run_on(case, "cuda", fused=False, skip_at=4)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key, value in reference.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_backend_switch_torch_turns_the_fused_kernels_off() -> None:
    pytest.importorskip("cupy")
    from batch_layers._backend import use_backend

    with use_backend("torch"):
        opt, _, _ = run_on("adam", "cuda", fused=None, steps=2)
    assert opt.fused_steps == 0


@pytest.mark.cuda
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_select_and_nan_isolation(case: str) -> None:
    pytest.importorskip("cupy")
    cls, _, per_model, shared = CASES[case]
    grads = make_grads(B, 8)
    full = make_params(device="cuda")
    opt_full = cls(full, **per_model, **shared, fused=True)
    part = make_params(device="cuda")
    opt = cls(part, **per_model, **shared, fused=True)
    keep = [3, 0, 2]
    for t, g in enumerate(grads):
        dirty = [x.clone() for x in g]
        if t == 2:
            dirty[0][1] = float("nan")  # model 1 diverges, then is dropped
        set_grads(full, g)
        opt_full.step()
        if t == 4:
            for p in part:
                p.data = p.data[keep]
            opt.select(keep)
        set_grads(part, [x[keep] for x in dirty] if t >= 4 else dirty)
        opt.step()
    for p, q in zip(part, full):
        assert torch.equal(p, q[keep])
        for key, value in opt_full.state[q].items():
            assert torch.equal(opt.state[p][key], value[keep])


@pytest.mark.cuda
def test_fused_sgd_step_replays_in_a_cuda_graph() -> None:
    """A captured batched SGD step (per-model lr, momentum, dampening, weight decay) replays like B torch
    optimizers. The gradients get new addresses just before capture, so the fused path builds its pointer
    table inside the capture; the hyperparameters stay as they were captured. Eager steps with other
    gradient tensors in between (more address sets than the table cache keeps) leave the graph intact."""
    pytest.importorskip("cupy")
    cls, tcls, per_model, shared = CASES["sgd_momentum"]
    params = make_params(device="cuda")
    refs = references(params, tcls, per_model, shared)
    opt = cls(params, **per_model, **shared, fused=True)
    grads = make_grads(B, 13)

    def reference_step(t: int) -> None:
        for i, (own, ref) in enumerate(refs):
            set_grads(own, [g[i] for g in grads[t]])
            ref.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up steps on a side stream, as in torch's recipe
        for t in range(2):
            set_grads(params, grads[t])
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for t in range(2):
        reference_step(t)
    static = [g.to("cuda") for g in grads[2]]
    for p, g in zip(params, static):
        p.grad = g
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    def replay(steps: range) -> None:
        for p, g in zip(params, static):
            p.grad = g
        for t in steps:
            for g, new in zip(static, grads[t]):
                g.copy_(new)
            graph.replay()
            reference_step(t)

    replay(range(2, 5))
    eager_grads = []  # kept alive: every eager step sees new gradient addresses, evicting cached tables
    for t in range(5, 11):
        eager_grads.append([g.to("cuda") for g in grads[t]])
        for p, g in zip(params, eager_grads[-1]):
            p.grad = g
        opt.step()
        reference_step(t)
    torch.cuda.empty_cache()
    torch.full((1 << 20,), -1, dtype=torch.int64, device="cuda")  # reuse freed memory with garbage
    replay(range(11, 13))
    torch.cuda.synchronize()
    assert opt.fused_steps == 3 + 6
    assert_matches_references(opt, params, refs)
