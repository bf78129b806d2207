"""Per-model clipping and divergence checks against torch.nn.utils on B separate models."""

from __future__ import annotations

import pytest
import torch

from torchmb.clip import clip_grad_norm_, clip_grad_value_, diverged, diverged_indices

B = 4
SHAPES = [(3, 5), (5,), (2, 3, 2)]


def batched_and_separate(scale: list[float], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(B, *s, generator=g).requires_grad_() for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * torch.tensor(scale).view(-1, *([1] * (p.dim() - 1)))
    separate = []
    for i in range(B):
        own = [p.detach()[i].clone().requires_grad_() for p in params]
        for q, p in zip(own, params):
            q.grad = p.grad[i].clone()
        separate.append(own)
    return params, separate


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf"), "inf"])
@pytest.mark.parametrize("max_norm", [1.0, [0.5, 100.0, 2.0, 0.0]])
def test_clip_grad_norm_matches_torch_per_model(norm_type, max_norm) -> None:
    params, separate = batched_and_separate([0.1, 10.0, 1.0, 3.0])
    norms = clip_grad_norm_(params, max_norm, norm_type=norm_type)
    assert norms.shape == (B,)
    for i, own in enumerate(separate):
        limit = max_norm[i] if isinstance(max_norm, list) else max_norm
        want = torch.nn.utils.clip_grad_norm_(own, limit, norm_type=norm_type, foreach=False)
        torch.testing.assert_close(norms[i], want)
        for p, q in zip(params, own):
            torch.testing.assert_close(p.grad[i], q.grad)


def test_clip_grad_norm_never_lets_one_model_clip_another() -> None:
    params, _ = batched_and_separate([1.0, 1.0, 1.0, 1.0])
    before = [p.grad.clone() for p in params]
    params[0].grad[1, 0, 0] = 1e6  # model 1 explodes
    params[1].grad[3, 0] = float("nan")  # model 3 is NaN
    norms = clip_grad_norm_(params, 1e9)
    assert norms[3].isnan() and norms[1] > 1e5
    for p, g in zip(params, before):  # models 0 and 2 are untouched by the others' norms
        assert torch.equal(p.grad[[0, 2]], g[[0, 2]])
    with pytest.raises(RuntimeError, match=r"gradients of models \[3\] is non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_clip_grad_value_per_model() -> None:
    params, separate = batched_and_separate([0.1, 10.0, 1.0, 3.0])
    clip_grad_value_(params, [0.05, 1.0, 0.5, 100.0])
    for i, own in enumerate(separate):
        torch.nn.utils.clip_grad_value_(own, [0.05, 1.0, 0.5, 100.0][i])
        for p, q in zip(params, own):
            assert torch.equal(p.grad[i], q.grad)
    clip_grad_value_(params, 0.01)
    assert all(p.grad.abs().max() <= 0.01 for p in params)
    with pytest.raises(ValueError, match="expected non-negative values"):
        clip_grad_value_(params, [0.1, -1.0, 0.1, 0.1])


def test_negative_bounds_are_refused_with_the_gradients_unchanged() -> None:
    params, _ = batched_and_separate([1.0, 2.0, 3.0, 4.0])
    grads = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match=r"max_norm: expected non-negative values, got \[-1.0\] for models \[1\]"):
        clip_grad_norm_(params, [1.0, -1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"max_norm: expected a non-negative number, got -1"):
        clip_grad_norm_(params, -1)
    with pytest.raises(ValueError, match=r"clip_value: expected a non-negative number, got -0.5"):
        clip_grad_value_(params, -0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def test_diverged_reports_models_with_non_finite_losses_or_parameters() -> None:
    params, _ = batched_and_separate([1.0] * B)
    losses = torch.tensor([0.5, float("inf"), 0.1, 0.2])
    assert diverged(losses).tolist() == [False, True, False, False]
    with torch.no_grad():
        params[2][3, 1, 1, 0] = float("nan")
    assert diverged_indices(losses, params) == [1, 3]
    params[0].grad[0, 0, 0] = float("inf")
    assert diverged_indices(parameters=params) == [3]
    assert diverged_indices(parameters=params, grads=True) == [0, 3]
    with pytest.raises(ValueError, match=r"same leading model axis B = 3, got shape \(4, 3, 5\)"):
        diverged(torch.ones(3), params)
    with pytest.raises(ValueError, match="give losses, parameters or both"):
        diverged()
