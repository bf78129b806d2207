"""torchmb.amp.GradScaler against B torch.amp.GradScaler-driven models (CPU, fp32 gradients)."""

from __future__ import annotations

import pytest
import torch

import torchmb.optim as mo
from torchmb.amp import GradScaler
from torchmb.clip import clip_grad_norm_

B = 3
STEPS = 9
# (step, model) pairs whose input holds an inf or NaN: that model's gradients overflow at that step
POISON = {(1, 1): float("inf"), (2, 1): float("nan"), (4, 0): float("inf"), (6, 2): float("-inf")}


def inputs(step: int) -> torch.Tensor:
    x = torch.randn(B, 5, 4, generator=torch.Generator().manual_seed(step))
    for (t, i), value in POISON.items():
        if t == step:
            x[i, 2, 1] = value
    return x


def per_model_losses(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = torch.einsum("bni,boi->bno", x, w) + b[:, None, :]
    return (y**2).mean(dim=(1, 2))


def run_reference(w0, b0, lrs, init_scale, clip: float | None = None):
    """B plain models, each with its own torch.optim.Adam and torch.amp.GradScaler."""
    models = []
    for i in range(B):
        w = w0[i].clone().requires_grad_()
        b = b0[i].clone().requires_grad_()
        opt = torch.optim.Adam([w, b], lr=lrs[i], foreach=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale[i], growth_interval=2)
        models.append((w, b, opt, scaler))
    history = []
    for t in range(STEPS):
        x = inputs(t)
        for i, (w, b, opt, scaler) in enumerate(models):
            opt.zero_grad()
            loss = per_model_losses(w[None], b[None], x[i : i + 1])[0]
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_([w, b], clip)
            scaler.step(opt)
            scaler.update()
        history.append(([float(m[3].get_scale()) for m in models], [int(m[3]._growth_tracker) for m in models]))
    return models, history


@pytest.mark.parametrize("clip", [None, 0.5])
def test_matches_b_torch_grad_scalers(clip: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(B, 3, 4, generator=g), torch.randn(B, 3, generator=g)
    lrs, init_scale = [0.1, 0.01, 0.05], [4.0, 1024.0, 2.0**16]
    models, history = run_reference(w0, b0, lrs, init_scale, clip)

    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = mo.Adam([w, b], lr=lrs)
    scaler = GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    for t in range(STEPS):
        opt.zero_grad()
        losses = per_model_losses(w, b, inputs(t))
        scaler.scale(losses).sum().backward()
        if clip is not None:
            scaler.unscale_(opt)
            clip_grad_norm_([w, b], clip)
        scaler.step(opt)
        skipped = [i for i in range(B) if (t, i) in POISON]
        assert scaler.last_skipped.nonzero().flatten().tolist() == skipped
        scaler.update()
        scales, trackers = history[t]
        assert scaler.get_scale().tolist() == scales
        assert scaler.get_growth_tracker().tolist() == trackers
    for i, (rw, rb, ropt, _) in enumerate(models):
        torch.testing.assert_close(w.detach()[i], rw.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.detach()[i], rb.detach(), rtol=1e-5, atol=1e-6)
        assert opt.state[w]["step"][i] == ropt.state[rw]["step"]
    assert torch.isfinite(w).all() and torch.isfinite(b).all()


def test_one_model_overflowing_does_not_change_the_others() -> None:
    g = torch.Generator().manual_seed(1)
    w0, b0 = torch.randn(B, 3, 4, generator=g), torch.randn(B, 3, generator=g)
    runs = []
    for poison in (False, True):
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        opt = mo.SGD([w, b], lr=0.1, momentum=0.9)
        scaler = GradScaler("cpu", init_scale=256.0, growth_interval=2)
        for t in range(5):
            opt.zero_grad()
            x = torch.randn(B, 5, 4, generator=torch.Generator().manual_seed(t))
            if poison and t == 2:
                x[1] = float("inf")
            scaler.scale(per_model_losses(w, b, x)).sum().backward()
            scaler.step(opt)
            scaler.update()
        runs.append((w.detach().clone(), b.detach().clone(), scaler.get_scale()))
    (w_clean, b_clean, s_clean), (w_dirty, b_dirty, s_dirty) = runs
    assert torch.equal(w_clean[[0, 2]], w_dirty[[0, 2]]) and torch.equal(b_clean[[0, 2]], b_dirty[[0, 2]])
    assert s_clean[[0, 2]].tolist() == s_dirty[[0, 2]].tolist()
    assert s_dirty[1] < s_clean[1]  # the overflowing model backed off alone
    assert torch.isfinite(w_dirty).all()  # its bad step was skipped, not taken


def test_select_state_dict_and_model_copy() -> None:
    w = torch.zeros(4, 2, requires_grad=True)
    opt = mo.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=[1.0, 2.0, 4.0, 8.0], growth_interval=3)
    scaler.scale(w.sum(1)).sum().backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_growth_tracker().tolist() == [1, 1, 1, 1]
    scaler.select([3, 0])
    assert scaler.get_scale().tolist() == [8.0, 1.0]
    other = GradScaler("cpu")
    other.load_state_dict(scaler.state_dict())
    assert other.get_scale().tolist() == [8.0, 1.0] and other.get_growth_tracker().tolist() == [1, 1]
    scaler.load_model_state(1, src=0)
    assert scaler.get_scale().tolist() == [8.0, 8.0]
    with pytest.raises(ValueError, match=r"expected a leading model axis of 2, got shape \(3,\)"):
        scaler.scale(torch.ones(3))


def test_misuse_is_refused() -> None:
    scaler = GradScaler("cpu")
    with pytest.raises(ValueError, match="got a 0-d tensor"):
        scaler.scale(torch.tensor(1.0))
    w = torch.zeros(2, 3, requires_grad=True)
    opt = mo.SGD([w], lr=0.1)
    with pytest.raises(RuntimeError, match=r"call scale\(losses\) first"):
        scaler.step(opt)
    scaler.scale(w.sum(1)).sum().backward()
    with pytest.raises(TypeError, match=r"needs a torchmb\.optim optimizer"):
        scaler.step(torch.optim.SGD([w], lr=0.1))
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(opt)
    disabled = GradScaler("cpu", enabled=False)
    losses = torch.ones(2)
    assert disabled.scale(losses) is losses
