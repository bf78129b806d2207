from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import MLP, BatchNormCNN, ControlFlow, LeNet, WithCustom
from torch import Tensor, nn

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent, assert_isolated

B, N = 4, 6

MODEL_CASES = {
    "mlp": (MLP, (12,)),
    "lenet": (LeNet, (1, 28, 28)),
    "bn-cnn": (BatchNormCNN, (3, 8, 8)),
    "control-flow": (ControlFlow, (6,)),
    "custom-module": (WithCustom, (5,)),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", MODEL_CASES)
def test_equivalent_to_independent_models(name: str, train: bool) -> None:
    make, shape = MODEL_CASES[name]
    torch.manual_seed(0)
    report = assert_equivalent(make, B, torch.randn(B, N, *shape), steps=5, train=train)
    assert max(report.values()) <= 1e-5
    assert any(key.startswith("final") for key in report)


@pytest.mark.parametrize("name", MODEL_CASES)
def test_isolated(name: str) -> None:
    make, shape = MODEL_CASES[name]
    torch.manual_seed(0)
    batched = BatchModule.from_factory(make, B, seed=3)
    assert_isolated(batched, torch.randn(B, N, *shape), model=1)


@pytest.mark.parametrize("name", ["mlp", "lenet", "bn-cnn", "custom-module"])
def test_shared_input_equals_the_same_input_for_every_model(name: str) -> None:
    make, shape = MODEL_CASES[name]
    torch.manual_seed(0)
    batched = BatchModule.from_factory(make, B, seed=1)
    x = torch.randn(N, *shape)
    reference = copy.deepcopy(batched)  # stateful modules (FiLM counts calls) must start equal
    seen = []
    first = next(m for m in batched.module.modules() if isinstance(m, batch_layers.AbstractBatchModule))
    first.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape))
    shared = batched(x, shared_input=True)
    assert seen[0][0] == N, "the first batched layer must receive the (n, ...) input, not B copies"
    expected = reference(x.expand(B, *x.shape))
    torch.testing.assert_close(shared, expected, atol=1e-5, rtol=0)
    shared.square().sum().backward()
    expected.square().sum().backward()
    for got, want in zip(batched.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_shared_input_equivalent_and_isolated_under_training() -> None:
    torch.manual_seed(0)
    assert_equivalent(LeNet, B, torch.randn(N, 1, 28, 28), steps=3, shared_input=True)
    assert_isolated(BatchModule(LeNet(), B, init="independent", seed=0), torch.randn(N, 1, 28, 28), shared_input=True)


def test_independent_init_is_each_layers_own_reset_with_seed_plus_index() -> None:
    batched = BatchModule(LeNet(), 3, init="independent", seed=10)
    for i in range(3):
        torch.manual_seed(10 + i)
        reference = LeNet()
        torch.manual_seed(10 + i)
        for module in reference.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for key, value in reference.state_dict().items():
            assert torch.equal(batched.state_dict_of(i)[key], value), key
    again = BatchModule(LeNet(), 3, init="independent", seed=10)
    assert all(torch.equal(a, b) for a, b in zip(batched.parameters(), again.parameters()))
    assert not torch.equal(batched.module.conv1.weight[0], batched.module.conv1.weight[1])


def test_copy_init_starts_every_model_from_the_given_weights() -> None:
    model = MLP()
    batched = BatchModule(model, 3)
    for state in batched.state_dicts():
        for key, value in model.state_dict().items():
            assert torch.equal(state[key], value)


def test_model_is_not_modified() -> None:
    model = WithCustom()
    before = copy.deepcopy(model.state_dict())
    BatchModule(model, 3)
    assert type(model.film) is type(WithCustom().film)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_state_dicts_load_into_the_plain_model_and_unbatch_matches() -> None:
    torch.manual_seed(0)
    batched = BatchModule(BatchNormCNN(), 3, init="independent", seed=0)
    x = torch.randn(3, N, 3, 8, 8)
    batched.train()
    batched(x)  # moves running statistics
    batched.eval()
    out = batched(x)
    for i, state in enumerate(batched.state_dicts()):
        plain = BatchNormCNN()
        plain.load_state_dict(state)
        plain.eval()
        torch.testing.assert_close(plain(x[i]), out[i], atol=1e-5, rtol=0)
        unbatched = batched.unbatch(i)
        assert type(unbatched) is BatchNormCNN
        unbatched.eval()
        torch.testing.assert_close(unbatched(x[i]), out[i], atol=1e-5, rtol=0)


def test_load_state_dicts_list_and_slots() -> None:
    plain = [MLP() for _ in range(3)]
    batched = BatchModule(MLP(), 3)
    params = list(batched.parameters())
    batched.load_state_dicts([m.state_dict() for m in plain])
    assert all(p is q for p, q in zip(params, batched.parameters())), "parameters keep their identity"
    for i in range(3):
        assert all(torch.equal(batched.state_dict_of(i)[k], v) for k, v in plain[i].state_dict().items())
    batched.load_state_dicts(plain[0].state_dict(), slots=[2])
    assert all(torch.equal(batched.state_dict_of(2)[k], v) for k, v in plain[0].state_dict().items())
    assert all(torch.equal(batched.state_dict_of(1)[k], v) for k, v in plain[1].state_dict().items())


def test_load_state_dicts_refuses_bad_input() -> None:
    batched = BatchModule(MLP(), 3)
    good = MLP().state_dict()
    with pytest.raises(ValueError, match="expected 3 state dicts"):
        batched.load_state_dicts([good, good])
    bad_shape = dict(good)
    bad_shape["layers.0.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"'layers.0.weight' expected shape \(16, 12\), got \(2, 2\)"):
        batched.load_state_dicts([good, good, bad_shape])
    missing = dict(good)
    del missing["layers.1.bias"]
    with pytest.raises(KeyError, match="missing keys"):
        batched.load_state_dicts(missing)
    with pytest.raises(IndexError, match="model index 3 is out of range for batch=3"):
        batched.load_state_dicts(good, slots=[3])


def test_forward_refuses_input_without_model_axis() -> None:
    batched = BatchModule(MLP(), 3)
    with pytest.raises(ValueError, match=r"expects every tensor argument as \(B=3, n, ...\), got shape \(4, 6, 12\)"):
        batched(torch.randn(4, 6, 12))
    with pytest.raises(ValueError, match=r"expects every tensor argument as \(B=3, n, ...\), got shape \(4, 6, 12\)"):
        batched(x=torch.randn(4, 6, 12))  # the keyword path walks the arguments as a tree
    with pytest.raises(ValueError, match=r"shared_input=True expects tensors of shape \(n, ...\), got a scalar"):
        batched(torch.tensor(1.0), shared_input=True)


def test_single_tensor_and_keyword_calls_agree() -> None:
    torch.manual_seed(0)
    batched = BatchModule(MLP(), 3)
    x = torch.randn(3, 5, 12)
    torch.testing.assert_close(batched(x), batched(x=x), rtol=0, atol=0)
    shared = torch.randn(5, 12)
    torch.testing.assert_close(batched(shared, shared_input=True), batched(x=shared, shared_input=True), rtol=0, atol=0)


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # (n, seq, d) -> (seq, n, d): the sample axis leaves dim 0, as in seq-first models
        return self.fc(x.transpose(0, 1)).transpose(0, 1)


def test_sequence_first_layout_is_found_and_batched() -> None:
    torch.manual_seed(0)
    assert_equivalent(SeqFirst, 3, torch.randn(3, 2, 5, 4))
    assert_equivalent(SeqFirst, 3, torch.randn(3, 2, 7, 4))  # seq > B*n, not a multiple of it
    assert_isolated(BatchModule(SeqFirst(), 3, init="independent", seed=0), torch.randn(3, 2, 5, 4))


class Patches(nn.Module):
    """MobileViT's unfolding: every sample's map becomes ``P`` sequences of ``N`` tokens, merged into dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):  # (n, 4, 12, 2): P = 2 patches of N = 12 tokens
        n = x.shape[0]
        tokens = x.permute(0, 3, 2, 1).reshape(n * 2, 12, 4)
        return self.norm(self.fc(tokens)).reshape(n, 2, 12, 4).permute(0, 3, 2, 1)


def test_tokens_as_many_as_the_merged_axis_leave_the_models_in_dim_0() -> None:
    # B*n = 3*4 = 12 = N: dim 1 has exactly B*n entries, yet the models are in dim 0 (B*n*P rows).
    torch.manual_seed(0)
    x = torch.randn(3, 4, 4, 12, 2)
    assert_equivalent(Patches, 3, x)
    assert_isolated(BatchModule(Patches(), 3, init="independent", seed=0), x)


class SeqFirstEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)  # batch_first=False: (seq, N, d)

    def forward(self, x):
        return self.layer(x.transpose(0, 1)).transpose(0, 1)


class SeqFirstLM(nn.Module):
    """Token ids arrive (n, seq) and are turned sequence-first, as older language-model code does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.out = nn.Linear(8, 11)

    def forward(self, tokens):
        return self.out(self.embed(tokens.t())).transpose(0, 1)


def test_sequence_first_token_ids() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (3, 2, 5))
    assert_equivalent(SeqFirstLM, 3, tokens)
    assert_isolated(BatchModule(SeqFirstLM(), 3, init="independent", seed=0), tokens)


@pytest.mark.parametrize("seq", [5, 6], ids=["seq-differs", "seq-equals-B*n"])
def test_sequence_first_transformer_layer(seq: int) -> None:
    # B*n = 3*2 = 6: with seq == 6 the shapes cannot tell which dim holds the models; the converter
    # hands the layer's feed-forward and norms batch-first tensors.
    torch.manual_seed(0)
    assert_equivalent(SeqFirstEncoder, 3, torch.randn(3, 2, seq, 8))
    assert_isolated(BatchModule(SeqFirstEncoder(), 3, init="independent", seed=0), torch.randn(3, 2, seq, 8))
    assert BatchModule(SeqFirstEncoder(), 3).module.layer.linear1.sequence_first


def test_model_that_mixes_samples_across_models_is_refused() -> None:
    class PairedRows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):  # pairs up consecutive rows: on the merged axis, rows of different models
            return self.fc(x.reshape(-1, 8))

    batched = BatchModule(PairedRows(), 3)
    with pytest.raises(ValueError, match=r"multiple of B \* n = 3 \* 2 \(the merged model axis\), got shape \(3, 8\)"):
        batched(torch.randn(3, 2, 4))


class HardCodedSamples(nn.Module):
    """Reshapes to a sample count written in its code (2): on the merged axis, every model's rows in 2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.reshape(2, 8))


def test_a_reshape_to_one_models_sample_count_runs_the_module_per_model() -> None:
    batched = BatchModule(HardCodedSamples(), 3)
    batched(torch.randn(3, 2, 2, 4))
    assert batched.generic_modules == ["HardCodedSamples"]
    assert "reshape of dim 0 to 2 rows, one model's sample count n" in batched.conversion_report()[0].reason
    assert_equivalent(HardCodedSamples, 3, torch.randn(3, 2, 2, 4))


def test_tuple_dict_and_keyword_inputs_and_outputs() -> None:
    torch.manual_seed(0)
    plain = [ControlFlow() for _ in range(3)]
    batched = BatchModule(ControlFlow(), 3)
    batched.load_state_dicts([m.state_dict() for m in plain])
    x = torch.randn(3, N, 6)
    out = batched(x=x, gate=False)
    assert set(out) == {"logits", "hidden"}
    for i, model in enumerate(plain):
        expected = model(x[i], gate=False)
        torch.testing.assert_close(out["logits"][i], expected["logits"], atol=1e-6, rtol=0)
        torch.testing.assert_close(out["hidden"][i], expected["hidden"], atol=1e-6, rtol=0)


def test_generic_path_is_reported_and_keeps_state_keys() -> None:
    batched = BatchModule(WithCustom(), 3)
    assert batched.generic_modules == ["film"]
    assert "torch.func path: film" in repr(batched)
    assert "batched via torch.func" in repr(batched.module.film)
    assert set(batched.state_dicts()[0]) == set(WithCustom().state_dict())
    assert batched.module.film.scale.shape == (3, 8)
    assert isinstance(batched.module.fc, batch_layers.Linear)


def test_generic_path_dropout_masks_differ_between_models() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(64))

        def forward(self, x):
            return F.dropout(x @ torch.diag(self.w), 0.5, self.training)  # not element-wise: per model

    with pytest.warns(UserWarning, match="100% of the model's parameters are batched through torch.func"):
        batched = BatchModule(Noisy(), 4)
    out = batched(torch.ones(32, 64), shared_input=True)
    masks = out != 0
    assert all(not torch.equal(masks[0], masks[i]) for i in range(1, 4))


def test_registered_path_dropout_masks_differ_between_models() -> None:
    batched = BatchModule(nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)), 4)
    with torch.no_grad():
        batched.module[0].weight.fill_(0.1)
        batched.module[0].bias.fill_(1.0)
    masks = batched(torch.ones(32, 8), shared_input=True) != 0
    assert all(not torch.equal(masks[0], masks[i]) for i in range(1, 4))


def test_select_keeps_survivors_bit_identical() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, N, 12)
    full = BatchModule(MLP(), 5, init="independent", seed=0)
    survivors = copy.deepcopy(full)
    opt_full = torch.optim.SGD(full.parameters(), lr=0.1, momentum=0.9)
    opt_survivors = torch.optim.SGD(survivors.parameters(), lr=0.1, momentum=0.9)
    keep = [4, 1, 2]

    def step(model, opt, inputs):
        opt.zero_grad()
        model(inputs).square().mean(dim=(1, 2)).sum().backward()
        opt.step()

    step(full, opt_full, x)
    step(survivors, opt_survivors, x)
    survivors.select(keep)
    for state in opt_survivors.state.values():  # plain SGD's buffers: re-index them the same way
        state["momentum_buffer"] = state["momentum_buffer"][keep]
    assert survivors.batch == 3
    for _ in range(3):
        step(full, opt_full, x)
        step(survivors, opt_survivors, x[keep])
    for j, i in enumerate(keep):
        for key, value in full.state_dict_of(i).items():
            assert torch.equal(survivors.state_dict_of(j)[key], value), key


def test_select_while_an_earlier_graph_is_alive() -> None:
    batched = BatchModule(MLP(), 4, init="independent", seed=0)
    x = torch.randn(4, 3, 12)
    losses = batched(x).square().mean(dim=(1, 2))
    losses.sum().backward()  # `losses` keeps its graph, and autograd its accumulators, alive
    batched.select([2, 0])
    assert batched.module.layers[0].weight.grad.shape == (2, 16, 12)
    batched.zero_grad()
    batched(x[[2, 0]]).square().sum().backward()
    assert batched.module.layers[0].weight.grad.shape == (2, 16, 12)
    assert losses.shape == (4,)


def test_select_refuses_bad_keep() -> None:
    batched = BatchModule(MLP(), 3)
    with pytest.raises(ValueError, match="at least one model"):
        batched.select([])
    with pytest.raises(IndexError, match="out of range"):
        batched.select([0, 5])
    with pytest.raises(ValueError, match=r"boolean mask must have shape \(3,\)"):
        batched.select(torch.tensor([True, False]))


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="positive int"):
        BatchModule(MLP(), 0)
    with pytest.raises(ValueError, match="init must be"):
        BatchModule(MLP(), 2, init="random")
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        BatchModule(lambda x: x, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("name", MODEL_CASES)
def test_equivalent_and_isolated_cuda(name: str) -> None:
    make, shape = MODEL_CASES[name]
    torch.manual_seed(0)

    def make_cuda():
        return make().cuda()

    assert_equivalent(make_cuda, B, torch.randn(B, N, *shape, device="cuda"), steps=5)
    assert_isolated(BatchModule.from_factory(make_cuda, B, seed=0), torch.randn(B, N, *shape, device="cuda"))


class _OwnScale(nn.Module):
    """Owns a parameter above a registered layer, read other than element-wise (flipped): its own state goes
    through torch.func, its child stays fast."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale.flip(0)


class _OwnOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(4))
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x + self.offset.flip(0))


class _LayerScale(nn.Module):
    """Owns a parameter it only multiplies by: broadcast per model on the merged axis."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def test_repr_names_the_path_of_every_converted_module() -> None:
    """Each converted module's line says what runs it; the rest is torch's own repr of the same tree."""
    frozen = nn.Linear(4, 4).requires_grad_(False)
    blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)] + [nn.ReLU()])
    model = nn.Sequential(frozen, _OwnScale(), blocks, _OwnOnly(), nn.ReLU(), _LayerScale())
    batched = BatchModule(model, B)
    text = repr(batched)
    paths = {entry.name: entry.path for entry in batched.conversion_report()}
    assert paths == {
        "": "passthrough", "0": "shared", "1": "generic-own", "1.fc": "registered", "2": "passthrough",
        "2.0": "registered", "2.1": "registered", "2.2": "registered", "2.3": "passthrough", "3": "generic-whole",
        "4": "passthrough", "5": "broadcast-own",
    }
    lines = [line.strip() for line in text.splitlines()]
    assert "(0): [shared] Linear(in_features=4, out_features=4, bias=True)" in lines
    assert "(1): [generic-own] FuncBatched_OwnScale(" in lines
    assert f"(fc): [registered] Linear(in_features=4, out_features=4, bias=True, batch={B})" in lines
    assert f"(0-2): 3 x [registered] Linear(in_features=4, out_features=4, bias=True, batch={B})" in lines
    assert "(3): ReLU()" in lines and "(4): ReLU()" in lines and "(module): Sequential(" in lines
    assert "(3): [generic-whole] FuncBatched_OwnOnly(" in lines
    assert any(line.startswith("(5): [broadcast-own] ") for line in lines), lines
    for tag in ("[shared] ", "[generic-own] ", "[generic-whole] ", "[registered] ", "[broadcast-own] "):
        text = text.replace(tag, "")
    assert text == nn.Module.__repr__(batched)  # torch's text, tags aside
    assert list(batched.state_dict()) == [f"module.{key}" for key in model.state_dict()]
