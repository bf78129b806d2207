"""Vision Transformers under BatchModule hand ``F.scaled_dot_product_attention`` the query, key and value
layout of the plain model, so its fused kernels (flash, memory-efficient) run, forward and backward.

Every block runs on registered layers, also where the root owns ``cls_token`` / ``pos_embed`` (timm's
default, torchvision's): only the root's own parameters go through ``torch.func`` (torchmb/_generic.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.torchvision_ops import import_torchvision
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import batch_layers
from torchmb import BatchModule
from torchmb.testing import assert_equivalent

try:
    torchvision = import_torchvision()
    import timm
except ImportError as error:  # the test extra brings both
    pytest.skip(f"needs timm and torchvision: {error}", allow_module_level=True)

BATCH, SAMPLES = 3, 2


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
