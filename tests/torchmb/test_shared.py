"""Frozen parameters shared by all models: stored once, run as the plain module, skipped by optimizers.

The reference is B plain models holding the same frozen backbone and their own trainable parts, each
trained by its own torch.optim optimizer.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import torchmb
import torchmb.optim as mo
from torchmb.clip import clip_grad_norm_

B = 4
LRS = [0.05, 0.01, 0.1, 0.02]
STEPS = 3


class Probe(nn.Module):
    """A frozen backbone (convolution, batch norm, MLP) and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def plain_probes() -> list[nn.Module]:
    """B models: one frozen backbone (equal in all), a head of their own."""
    torch.manual_seed(0)
    base = Probe().double()
    base.backbone.requires_grad_(False)
    models = []
    for i in range(B):
        model = copy.deepcopy(base)
        torch.manual_seed(10 + i)
        model.head.reset_parameters()
        models.append(model)
    return models


def data(step: int, features: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 5, features, generator=g, dtype=torch.float64), torch.randn(
        B, 5, 3, generator=g, dtype=torch.float64
    )


def train_plain(models: list[nn.Module], features: int = 6) -> None:
    for i, model in enumerate(models):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LRS[i], weight_decay=0.1)
        for t in range(STEPS):
            x, y = data(t, features)
            loss = ((model(x[i]) - y[i]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def train_batched(bm: torchmb.BatchModule, features: int = 6) -> None:
    opt = mo.AdamW(bm.parameters(), lr=LRS, weight_decay=0.1)  # bm.parameters() as it is, backbone included
    for t in range(STEPS):
        x, y = data(t, features)
        losses = ((bm(x) - y) ** 2).mean(dim=(1, 2))
        opt.zero_grad()
        losses.sum().backward()
        clip_grad_norm_(bm.parameters(), 1e6)  # skips the shared parameters too
        opt.step()


def assert_models_equal(bm: torchmb.BatchModule, models: list[nn.Module]) -> None:
    for i, model in enumerate(models):
        state = bm.state_dict_of(i)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=f"model {i}: {key}")


def test_linear_probes_on_a_frozen_backbone_match_b_plain_models() -> None:
    models = plain_probes()
    bm = torchmb.BatchModule(models[0], B)
    bm.load_state_dicts([m.state_dict() for m in models])
    x, _ = data(0)
    torch.testing.assert_close(bm(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))
    train_plain(models)
    train_batched(bm)
    assert_models_equal(bm, models)
    for i, model in enumerate(models):
        plain = bm.unbatch(i)
        assert type(plain) is Probe
        torch.testing.assert_close(plain(x[i]), model(x[i]), rtol=1e-10, atol=1e-12)


def test_shared_layers_run_as_the_plain_modules_and_are_stored_once() -> None:
    models = plain_probes()
    bm = torchmb.BatchModule(models[0], B)
    backbone = bm.module.backbone
    assert [type(m) for m in backbone] == [nn.Linear, nn.GELU, nn.Linear, nn.LayerNorm, nn.Tanh]
    assert backbone[0].weight.shape == (16, 6)
    assert bm.module.head.weight.shape == (B, 3, 16)
    assert bm.unbatch(0).backbone[0].weight.data_ptr() != backbone[0].weight.data_ptr()  # a plain model's own
    backbone_bytes = sum(p.numel() * p.element_size() for p in models[0].backbone.parameters())
    head_bytes = sum(p.numel() * p.element_size() for p in models[0].head.parameters())
    stored = sum(t.numel() * t.element_size() for t in [*bm.parameters(), *bm.buffers()])
    assert stored == backbone_bytes + B * head_bytes
    paths = {entry.name: entry.path for entry in bm.conversion_report()}
    assert paths["backbone"] == paths["backbone.0"] == paths["backbone.3"] == "shared"
    assert paths["head"] == "registered"
    shared = {entry.name: entry.shared for entry in bm.conversion_report()}
    assert shared["backbone.0"] == 16 * 6 + 16 and shared["head"] == 0
    assert "shared by all models: 6 parameters (416 elements)" in repr(bm)
    assert bm.shared_keys == {f"backbone.{i}.{n}" for i in (0, 2, 3) for n in ("weight", "bias")}


def test_the_shared_backbone_computes_each_shared_input_once() -> None:
    models = plain_probes()
    bm = torchmb.BatchModule(models[0], B)
    bm.load_state_dicts([m.state_dict() for m in models])
    seen = []
    bm.module.backbone[0].register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    x = torch.randn(5, 6, dtype=torch.float64)
    out = bm(x, shared_input=True)
    assert seen == [(5, 16)]  # one pass over the n samples, not B*n
    torch.testing.assert_close(out, torch.stack([m(x) for m in models]))


def test_bias_only_training_matches_b_plain_models() -> None:
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    for layer in (base[0], base[2]):
        layer.weight.requires_grad_(False)
    models = []
    for i in range(B):
        model = copy.deepcopy(base)
        with torch.no_grad():
            model[0].bias.normal_(generator=torch.Generator().manual_seed(i))
        models.append(model)
    with pytest.warns(UserWarning, match="batched through torch.func"):
        bm = torchmb.BatchModule(base, B)
    report = {entry.name: entry for entry in bm.conversion_report()}
    assert report["0"].path == "generic-whole" and "weight" in report["0"].reason
    assert report["0"].parameters == 8 and report["0"].shared == 48
    assert bm.module[0].weight.shape == (8, 6) and bm.module[0].bias.shape == (B, 8)
    bm.load_state_dicts([m.state_dict() for m in models])
    train_plain(models)
    train_batched(bm)
    assert_models_equal(bm, models)


def test_a_frozen_batch_norm_keeps_per_model_statistics() -> None:
    """Running statistics change in training: a frozen batch norm is not run on all models' samples at once."""
    torch.manual_seed(2)
    base = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    base[:2].requires_grad_(False)
    bm = torchmb.BatchModule(base, B)
    report = {entry.name: entry.path for entry in bm.conversion_report()}
    assert report["0"] == "shared" and report["1"] == "generic-whole"
    models = [copy.deepcopy(base) for _ in range(B)]
    train_plain(models)
    train_batched(bm)
    assert_models_equal(bm, models)  # running_mean, running_var, num_batches_tracked per model


def test_shared_filters() -> None:
    models = plain_probes()
    everything_per_model = torchmb.BatchModule(models[0], B, shared=())
    assert everything_per_model.module.backbone[0].weight.shape == (B, 16, 6)
    assert not everything_per_model.shared_keys
    by_name = torchmb.BatchModule(models[0], B, shared=["backbone.0.weight", "backbone.0.bias"])
    assert by_name.shared_keys == {"backbone.0.weight", "backbone.0.bias"}
    assert by_name.module.backbone[2].weight.shape == (B, 16, 16)
    by_function = torchmb.BatchModule(models[0], B, shared=lambda name, p: name.startswith("backbone.2"))
    assert by_function.shared_keys == {"backbone.2.weight", "backbone.2.bias"}
    with pytest.raises(KeyError, match=r"does not have: \['backbone.9.weight'\]"):
        torchmb.BatchModule(models[0], B, shared=["backbone.9.weight"])
    with pytest.raises(ValueError, match=r"must be frozen.*\['head.weight'\]"):
        torchmb.BatchModule(models[0], B, shared=["head.weight"])
    with pytest.raises(TypeError, match="got the string"):
        torchmb.BatchModule(models[0], B, shared="backbone")


def test_loading_refuses_other_shared_values() -> None:
    models = plain_probes()
    bm = torchmb.BatchModule(models[0], B)
    bm.load_state_dicts([m.state_dict() for m in models], slots=range(B))
    other = models[1].state_dict()
    other["backbone.2.weight"] = other["backbone.2.weight"] + 1
    before = bm.state_dicts()
    with pytest.raises(ValueError, match=r"'backbone.2.weight' is a parameter shared by all models"):
        bm.load_state_dicts([models[0].state_dict(), other, *[m.state_dict() for m in models[2:]]])
    for old, new in zip(before, bm.state_dicts()):  # nothing was written
        assert all(torch.equal(old[key], new[key]) for key in old)


def test_from_factory_and_independent_init_keep_the_shared_backbone() -> None:
    models = plain_probes()
    bm = torchmb.BatchModule(models[0], B, init="independent", seed=3)
    heads = [bm.state_dict_of(i)["head.weight"] for i in range(B)]
    assert not torch.equal(heads[0], heads[1])
    assert torch.equal(bm.state_dict_of(2)["backbone.0.weight"], models[0].backbone[0].weight)

    def random_backbone() -> nn.Module:
        model = Probe()
        model.backbone.requires_grad_(False)
        return model

    with pytest.raises(ValueError, match="shared by all models"):
        torchmb.BatchModule.from_factory(random_backbone, B, seed=0)  # each seed draws another backbone


def test_optimizers_skip_shared_parameters_and_refuse_trainable_ones() -> None:
    bm = torchmb.BatchModule(plain_probes()[0], B)
    opt = mo.SGD(bm.parameters(), lr=0.1)
    assert [tuple(p.shape) for p in opt.param_groups[0]["params"]] == [(B, 3, 16), (B, 3)]
    with pytest.raises(ValueError, match="no per-model parameter to optimise"):
        mo.Adam(bm.module.backbone.parameters(), lr=0.1)
    bm.module.backbone[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"shapes \[\(16, 6\)\] are shared by all models .* require grad"):
        mo.Adam(bm.parameters(), lr=0.1)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_backbone_shared(how: str) -> None:
    models = plain_probes()
    bm = torchmb.BatchModule(models[0], B)
    copied = copy.deepcopy(bm) if how == "deepcopy" else pickle.loads(pickle.dumps(bm))
    assert copied.shared_keys == bm.shared_keys
    opt = mo.SGD(copied.parameters(), lr=0.1)  # refused, were the copies no longer marked shared
    assert len(opt.param_groups[0]["params"]) == 2
    x, _ = data(0)
    torch.testing.assert_close(copied(x), bm(x))


def test_isolation_check_leaves_the_shared_backbone_alone() -> None:
    from torchmb.testing import assert_isolated

    bm = torchmb.BatchModule(plain_probes()[0], B)
    assert_isolated(bm, data(0)[0])  # would fail, were a shared weight's row "model 3's" to disturb
