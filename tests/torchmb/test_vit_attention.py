"""Vision Transformers under BatchModule hand ``F.scaled_dot_product_attention`` the query, key and value
layout of the plain model, so its fused kernels (flash, memory-efficient) run, forward and backward.

Every block runs on registered layers, also where the root owns ``cls_token`` / ``pos_embed`` (timm's
default, torchvision's): only the root's own parameters go through ``torch.func`` (torchmb/_generic.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from support.compiled import DYNAMO_WARNINGS, fresh_dynamo  # noqa: F401 (a fixture)
from support.torchvision_ops import import_torchvision
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import batch_layers
from batch_layers import _attention_table
from torchmb import BatchModule
from torchmb.testing import assert_equivalent

try:
    torchvision = import_torchvision()
    import timm
except ImportError as error:  # the test extra brings both
    pytest.skip(f"needs timm and torchvision: {error}", allow_module_level=True)

BATCH, SAMPLES = 3, 2
pytestmark = DYNAMO_WARNINGS  # (the compiled tests')


def timm_vit(root_parameters: bool) -> nn.Module:
    """A ViT-Tiny-like timm model: 32x32 images, 8x8 patches, 2 blocks of width 64 with 2 heads."""
    options = {} if root_parameters else {"class_token": False, "pos_embed": "none", "global_pool": "avg"}
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, num_classes=10, embed_dim=64, depth=2, num_heads=2, **options
    )


def torchvision_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=10
    )


MODELS = {
    "timm-vit-root-without-parameters": lambda: timm_vit(root_parameters=False),
    "timm-vit": lambda: timm_vit(root_parameters=True),
    "torchvision-vit": torchvision_vit,
}


def assert_blocks_are_batched(batched: BatchModule) -> None:
    """The blocks' layers are registered batched layers, whatever the root owns."""
    linears = [m for m in batched.modules() if isinstance(m, (batch_layers.Linear, batch_layers.MultiheadAttention))]
    assert linears, "the blocks went through torch.func"


class AttentionInputs(TorchFunctionMode):
    """Records the query, key and value strides of every ``F.scaled_dot_product_attention`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.strides: list[tuple[tuple[int, ...], ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.strides.append(tuple(t.stride()[1:] for t in args[:3]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", [name for name in MODELS if name.startswith("timm")])
def test_attention_sees_the_plain_models_layout(name: str) -> None:
    """timm's attention calls SDPA on views of a batched Linear's output. (torchvision's calls it inside
    ``nn.MultiheadAttention``, which the batched class replaces: the layout there is the batched class's own,
    last dim contiguous as the fused kernels need, and the CUDA test below runs them.)"""
    torch.manual_seed(0)
    plain = MODELS[name]().eval()
    batched = BatchModule(plain, BATCH).eval()
    assert_blocks_are_batched(batched)
    x = torch.randn(BATCH, SAMPLES, 3, 32, 32)
    batched(x)  # the first forward runs its checks (and may run again where a module goes per model)
    with AttentionInputs() as seen_batched:
        batched(x)
    with AttentionInputs() as seen_plain:
        plain(x[0])
    assert seen_plain.strides, "the plain model calls no scaled_dot_product_attention"
    assert seen_batched.strides == seen_plain.strides


@pytest.mark.parametrize("name", list(MODELS))
def test_vit_trains_as_plain_copies(name: str) -> None:
    batched = BatchModule(MODELS[name](), BATCH)
    assert_blocks_are_batched(batched)
    assert not [m for m in batched.generic_modules if "blocks" in m or "layers" in m]
    torch.manual_seed(0)
    make = lambda: MODELS[name]().double()  # noqa: E731
    assert_equivalent(make, BATCH, torch.randn(BATCH, SAMPLES, 3, 32, 32, dtype=torch.float64), steps=2)


def _relative_error(got: Tensor, want: Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_vit_training_step_with_fused_attention_on_cuda(name: str, dtype: torch.dtype, backend: SDPBackend) -> None:
    """Only ``backend`` may run (``sdpa_kernel``): SDPA raises where it cannot, so passing proves it ran."""
    torch.manual_seed(0)
    references = [MODELS[name]().cuda() for _ in range(BATCH)]
    batched = BatchModule(MODELS[name](), BATCH).cuda()
    assert_blocks_are_batched(batched)
    batched.load_state_dicts([r.state_dict() for r in references])
    x = torch.randn(BATCH, 4, 3, 32, 32, device="cuda")
    with sdpa_kernel([backend]), torch.autocast("cuda", dtype=dtype):
        out = batched(x)
        out.float().square().mean(dim=(1, 2)).sum().backward()
        expected = []
        for i, reference in enumerate(references):
            expected.append(reference(x[i]))
            expected[-1].float().square().mean().backward()
    params = dict(batched.module.named_parameters())
    for i, reference in enumerate(references):
        assert _relative_error(out[i], expected[i]) < 2e-2
        for key, param in reference.named_parameters():
            assert _relative_error(params[key].grad[i], param.grad) < 5e-2, key


def _attention_kernels(call) -> set[str]:
    """The attention operators ``call()`` runs (torch's profiler, whose warning about its own cycles is not the
    code's under test)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            call()
    return {e.key for e in profile.key_averages() if "attention" in e.key and e.key.startswith("aten::_")}


CPU_FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", list(MODELS))
def test_a_compiled_model_runs_attention_on_the_tables_kernel(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """timm's own attention code (through ``BatchModule``'s mode) and torchvision's ``nn.MultiheadAttention``
    (the batched layer asks the table) run the table's math path under ``torch.compile`` (its CUDA condition
    dropped on this CPU, where torch's own choice is its flash kernel; Inductor decomposes the math path into
    products), and match the plain models. Inductor's attention pattern matcher
    fuses torchvision's decomposed math graph back into a call of torch's choice (on CUDA where TF32 is
    allowed), so for it the matcher is off here: what this test checks is the table's routing."""
    candidate = _attention_table.MATH_ATTENTION
    monkeypatch.setattr(candidate, "conditions", [c for c in candidate.conditions if c[0] != "a CUDA tensor"])
    monkeypatch.setitem(candidate.limits, "min_scores", 0)
    if name == "torchvision-vit":
        monkeypatch.setattr("torch._inductor.config.pattern_matcher", False)
    torch.manual_seed(0)
    plains = [MODELS[name]().eval() for _ in range(BATCH)]
    batched = BatchModule(plains[0], BATCH).eval()
    batched.load_state_dicts([plain.state_dict() for plain in plains])
    compiled = torch.compile(batched)
    x = torch.randn(BATCH, SAMPLES, 3, 32, 32)
    with torch.no_grad():
        assert _attention_kernels(lambda: batched(x)) == {CPU_FLASH}  # eager: torch's choice
        compiled(x)
        outputs = []
        assert _attention_kernels(lambda: outputs.append(compiled(x))) == set()
        expected = torch.stack([plain(x[i]) for i, plain in enumerate(plains)])
    torch.testing.assert_close(outputs[0], expected, rtol=1e-4, atol=1e-5)


def _modes_inside(batched: BatchModule, x: Tensor) -> int:
    """How many torch-function modes are active while the model's first Linear runs, in a later forward."""
    batched(x)  # the first forward: tracked
    seen = []
    linear = next(m for m in batched.modules() if isinstance(m, (batch_layers.Linear, batch_layers.MultiheadAttention)))
    handle = linear.register_forward_hook(lambda *_: seen.append(torch._C._len_torch_function_stack()))
    try:
        batched(x)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_an_eager_forward_runs_without_the_mode(name: str) -> None:
    """The mode routes every op of the forward through Python, and the table keeps torch's choice eager."""
    assert _modes_inside(BatchModule(MODELS[name](), BATCH), torch.randn(BATCH, SAMPLES, 3, 32, 32)) == 0


@pytest.mark.cuda
@pytest.mark.usefixtures("fresh_dynamo")
# (Inductor's attention pattern matcher says that TF32 is off: this test's setting)
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_float32_step_on_cuda_runs_math_attention_compiled_and_matches_plain_copies(
    name: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 without TF32 (torch's default): the plain models run torch's memory-efficient kernel, the
    batched one too when eager, and the table's math path (decomposed by Inductor) when compiled; all agree."""
    monkeypatch.setitem(_attention_table.MATH_ATTENTION.limits, "min_scores", 0)  # this test's small shapes too
    kept = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        references = [MODELS[name]().cuda() for _ in range(BATCH)]
        batched = BatchModule(MODELS[name](), BATCH).cuda()
        batched.load_state_dicts([r.state_dict() for r in references])
        run = torch.compile(batched) if compiled else batched
        x = torch.randn(BATCH, 4, 3, 32, 32, device="cuda")
        run(x)  # the first forward (and the compilation)
        outputs = []

        def step() -> None:
            outputs.append(run(x))
            outputs[-1].square().mean(dim=(1, 2)).sum().backward()

        efficient = "aten::_scaled_dot_product_efficient_attention"
        assert (efficient in _attention_kernels(step)) is not compiled
        expected = []

        def plain_steps() -> None:
            for i, reference in enumerate(references):
                expected.append(reference(x[i]))
                expected[-1].square().mean().backward()

        assert efficient in _attention_kernels(plain_steps)
        params = dict(batched.module.named_parameters())
        for i, reference in enumerate(references):
            assert _relative_error(outputs[0][i], expected[i]) < 1e-4
            for key, param in reference.named_parameters():
                assert _relative_error(params[key].grad[i], param.grad) < 1e-3, key
    finally:
        torch.backends.cuda.matmul.allow_tf32 = kept
