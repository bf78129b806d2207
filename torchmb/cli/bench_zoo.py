"""The model-zoo workloads of ``python -m torchmb bench --zoo``: torchvision's and timm's own model
definitions at CIFAR size (3x32x32 images, 10 classes), as a researcher would take them off the shelf.

Neither library is a dependency of torchmb: each builder imports its library when called.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["ZOO_MODELS"]


def _torchvision(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10, **kwargs)

    return build


def _timm(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, num_classes=10, **kwargs)

    return build


#: The zoo of ``bench --zoo``: name -> (builder of the plain model, whether it holds attention), each family
#: through its library's own code path (torchvision's in-place activations and stochastic depth, timm's
#: norm-act layers and layer scales).
ZOO_MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "tv-resnet18": (_torchvision("resnet18"), False),
    "tv-mobilenet_v3_small": (_torchvision("mobilenet_v3_small"), False),
    "tv-efficientnet_b0": (_torchvision("efficientnet_b0"), False),
    "tv-regnet_x_400mf": (_torchvision("regnet_x_400mf"), False),
    "timm-efficientnet_b0": (_timm("efficientnet_b0"), False),
    "timm-convnext_atto": (_timm("convnext_atto"), False),
    "timm-vit_tiny": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=4), True),
}
