"""Real model definitions from torchvision and timm, built at tiny sizes for the model-zoo tests.

Every classification builder of ``torchvision.models`` has an entry (the test fails when torchvision adds
one that has none): the builder's own model class and block types, with fewer and narrower stages so that
a float64 step on a CPU takes a fraction of a second. Builders that differ only in widths or depths (the
ResNets, the EfficientNets) share a tiny configuration but keep their own block type, groups and
stochastic-depth or dropout rates. The timm entries span its families at the smallest sizes its
builders or model classes allow.

Each entry builds the model with its randomness on (dropout, stochastic depth, drop path at the rates the
builder uses or small ones where timm's default is 0); :func:`without_randomness` switches it off for
comparisons with plain copies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .torchvision_ops import import_torchvision

__all__ = ["TIMM_MODELS", "TORCHVISION_MODELS", "ZooModel", "float64", "is_random", "without_randomness"]


@dataclass(frozen=True)
class ZooModel:
    """One zoo model.

    Attributes:
        name: the torchvision builder or timm architecture it stands for.
        build: makes the tiny model, randomness on, in float32.
        size: input height and width.
        samples: samples per model in the comparison with plain copies; more where batch norms over 1x1
            maps at the end of the network amplify float64 rounding with few samples (the mismatch
            vanishes with more).
        generic: how many modules go through the ``torch.func`` path.
        why_generic: the reason, where ``generic`` is not 0.
        mostly_generic: most of its parameters go through ``torch.func``, so converting it warns.
        slow: run only in ``make test-all`` (the default run covers the family through another entry).
        xfail: where torchmb cannot batch the model yet, the exact limitation; its tests are strict expected
            failures, so that they fail once the limitation is lifted.
    """

    name: str
    build: Callable[[], nn.Module]
    size: int = 32
    samples: int = 4
    generic: int = 0
    why_generic: str = ""
    mostly_generic: bool = False
    slow: bool = False
    xfail: str = ""


def _random_draws(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Each (module, attribute) whose probability makes ``model`` random in training: dropout, torchvision's
    stochastic depth, timm's drop path and drop block, the ``drop_rate`` timm's heads pass to F.dropout, and
    the ``dropout`` and ``attention_dropout`` torchvision's Swin attention passes to it."""
    draws = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) or type(module).__name__ == "StochasticDepth":
            draws.append((module, "p"))
        elif isinstance(getattr(module, "drop_prob", None), float):
            draws.append((module, "drop_prob"))
        for attribute in ("drop_rate", "dropout", "attention_dropout"):  # the last two: torchvision's Swin
            if isinstance(getattr(module, attribute, None), float):
                draws.append((module, attribute))
    return draws


def without_randomness(model: nn.Module) -> nn.Module:
    """Switch off every random draw of :func:`_random_draws` in ``model`` (in place), keeping the modules."""
    for module, attribute in _random_draws(model):
        setattr(module, attribute, 0.0)
    return model


def is_random(model: nn.Module) -> bool:
    """Whether ``model`` draws random numbers in training."""
    return any(getattr(module, attribute) > 0 for module, attribute in _random_draws(model))


# Modules that own parameters (or are made of nothing else) go through torch.func for those parameters
# alone; every layer below them stays registered. These are the generic modules the zoo expects.
_OWN = "own parameters through torch.func, the layers below them registered"
_SWIN = f"each shifted-window attention owns its relative position bias table: {_OWN}"
_MAXVIT = f"each relative-position attention owns its bias table: {_OWN}"
_RELPOS_MLP = (
    "each RelPosAttention calls its RelPosMlp's get_bias() rather than its forward, and get_bias runs the "
    "registered Mlp on a constant coordinate table: both run per model, the layers below them registered"
)


def _own(which: str) -> str:
    return f"{which}: {_OWN}"


# -- torchvision ------------------------------------------------------------------------------------
def _tv():
    return import_torchvision().models


def _alexnet() -> nn.Module:
    model = _tv().alexnet(num_classes=10)
    model.classifier = nn.Sequential(  # the builder's head, 32 wide instead of 4096
        nn.Dropout(0.5),
        nn.Linear(256 * 6 * 6, 32),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(32, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 10),
    )
    return model


def _convnext(stochastic_depth: float) -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    stages = [CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)]
    return ConvNeXt(stages, stochastic_depth_prob=stochastic_depth, num_classes=10)


def _densenet(growth_rate: int) -> nn.Module:
    return _tv().DenseNet(growth_rate=growth_rate, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=10)


def _efficientnet(dropout: float) -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    stages = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(6, 3, 2, 8, 16, 2)]
    return EfficientNet(stages, dropout, stochastic_depth_prob=0.2, num_classes=10)


def _efficientnet_v2(dropout: float) -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig

    stages = [
        FusedMBConvConfig(1, 3, 1, 8, 8, 1),
        FusedMBConvConfig(4, 3, 2, 8, 16, 1),
        MBConvConfig(4, 3, 2, 16, 24, 1),
    ]
    norm = functools.partial(nn.BatchNorm2d, eps=1e-3)
    return EfficientNet(stages, dropout, stochastic_depth_prob=0.2, num_classes=10, norm_layer=norm, last_channel=64)


def _maxvit() -> nn.Module:
    from torchvision.models.maxvit import MaxVit

    return MaxVit(
        input_size=(32, 32),
        stem_channels=8,
        partition_size=2,
        block_channels=[16, 32],
        block_layers=[1, 1],
        head_dim=8,
        stochastic_depth_prob=0.2,
        num_classes=10,
    )


def _mobilenet_v2() -> nn.Module:
    return _tv().MobileNetV2(num_classes=10, inverted_residual_setting=[[1, 8, 1, 1], [6, 16, 2, 2]])


def _mobilenet_v3() -> nn.Module:
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

    stages = [
        InvertedResidualConfig(16, 3, 16, 16, True, "RE", 2, 1, 0.5),
        InvertedResidualConfig(16, 3, 64, 24, False, "HS", 2, 1, 0.5),
    ]
    return MobileNetV3(stages, last_channel=64, num_classes=10)


def _regnet(squeeze_excitation: bool) -> nn.Module:
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams.from_init_params(
        depth=3, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25 if squeeze_excitation else None
    )
    return RegNet(params, num_classes=10, stem_width=8)


def _resnet(bottleneck: bool, groups: int = 1, width_per_group: int = 64) -> nn.Module:
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    block = Bottleneck if bottleneck else BasicBlock
    return ResNet(block, [1, 1, 1, 1], num_classes=10, groups=groups, width_per_group=width_per_group)


def _shufflenet() -> nn.Module:
    return _tv().ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 64], num_classes=10)


def _swin(v2: bool) -> nn.Module:
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    extra = {"block": SwinTransformerBlockV2, "downsample_layer": PatchMergingV2} if v2 else {}
    return SwinTransformer(
        patch_size=[2, 2],
        embed_dim=8,
        depths=[1, 1],
        num_heads=[1, 2],
        window_size=[2, 2],
        stochastic_depth_prob=0.2,
        dropout=0.1,  # with stochastic depth alone (0 and 0.2 in two blocks), 4 samples of 2 models often agree
        num_classes=10,
        **extra,
    )


def _vgg(layers: list, batch_norm: bool) -> nn.Module:
    from torchvision.models.vgg import VGG, make_layers

    model = VGG(make_layers(layers, batch_norm=batch_norm), num_classes=10)
    model.classifier = nn.Sequential(  # the builder's head, 32 wide instead of 4096
        nn.Linear(layers[-2] * 7 * 7, 32),
        nn.ReLU(True),
        nn.Dropout(0.5),
        nn.Linear(32, 32),
        nn.ReLU(True),
        nn.Dropout(0.5),
        nn.Linear(32, 10),
    )
    return model


def _vit(patch_size: int, image_size: int = 32) -> nn.Module:
    return _tv().VisionTransformer(
        image_size=image_size,
        patch_size=patch_size,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        dropout=0.1,
        num_classes=10,
    )


_VGG_LAYERS = {
    "vgg11": [8, "M", 16, "M"],
    "vgg13": [8, 8, "M", 16, "M"],
    "vgg16": [8, 8, "M", 16, 16, "M"],
    "vgg19": [8, 8, "M", 16, 16, 16, "M"],
}


def _torchvision_models() -> list[ZooModel]:
    tv = _tv()
    entries = [
        ZooModel("alexnet", _alexnet, size=63),
        *(
            ZooModel(f"convnext_{s}", functools.partial(_convnext, p))
            for s, p in (("tiny", 0.1), ("small", 0.4), ("base", 0.5), ("large", 0.5))
        ),
        *(
            ZooModel(f"densenet{d}", functools.partial(_densenet, g))
            for d, g in (("121", 4), ("161", 6), ("169", 4), ("201", 4))
        ),
        *(
            ZooModel(f"efficientnet_b{i}", functools.partial(_efficientnet, p))
            for i, p in enumerate((0.2, 0.2, 0.3, 0.3, 0.4, 0.4, 0.5, 0.5))
        ),
        *(
            ZooModel(f"efficientnet_v2_{s}", functools.partial(_efficientnet_v2, p))
            for s, p in (("s", 0.2), ("m", 0.3), ("l", 0.4))
        ),
        ZooModel("googlenet", lambda: tv.googlenet(num_classes=10, aux_logits=True, init_weights=True), size=64),
        ZooModel(
            "inception_v3",
            lambda: tv.inception_v3(num_classes=10, aux_logits=False, init_weights=True),
            size=75,
            slow=True,
        ),
        ZooModel("maxvit_t", _maxvit, generic=4, why_generic=_MAXVIT),
        *(
            ZooModel(f"mnasnet{a}", functools.partial(getattr(tv, f"mnasnet{a}"), num_classes=10), slow=a != "0_5")
            for a in ("0_5", "0_75", "1_0", "1_3")
        ),
        ZooModel("mobilenet_v2", _mobilenet_v2),
        ZooModel("mobilenet_v3_large", _mobilenet_v3),
        ZooModel("mobilenet_v3_small", _mobilenet_v3),
        *(
            ZooModel(f"regnet_{kind}_{flops}", functools.partial(_regnet, kind == "y"))
            for kind in ("x", "y")
            for flops in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")
        ),
        ZooModel("regnet_y_128gf", functools.partial(_regnet, True)),
        ZooModel("resnet18", functools.partial(_resnet, False)),
        ZooModel("resnet34", functools.partial(_resnet, False)),
        *(ZooModel(f"resnet{d}", functools.partial(_resnet, True)) for d in ("50", "101", "152")),
        ZooModel("resnext50_32x4d", functools.partial(_resnet, True, 32, 4)),
        ZooModel("resnext101_32x8d", functools.partial(_resnet, True, 32, 8)),
        ZooModel("resnext101_64x4d", functools.partial(_resnet, True, 64, 4), slow=True),
        ZooModel("wide_resnet50_2", functools.partial(_resnet, True, 1, 128), slow=True),
        ZooModel("wide_resnet101_2", functools.partial(_resnet, True, 1, 128), slow=True),
        *(ZooModel(f"shufflenet_v2_x{w}", _shufflenet) for w in ("0_5", "1_0", "1_5", "2_0")),
        ZooModel("squeezenet1_0", lambda: tv.squeezenet1_0(num_classes=10), size=48),
        ZooModel("squeezenet1_1", lambda: tv.squeezenet1_1(num_classes=10), size=48),
        *(
            ZooModel(f"swin_{s}", functools.partial(_swin, False), size=16, generic=2, why_generic=_SWIN)
            for s in ("t", "s", "b")
        ),
        *(
            ZooModel(f"swin_v2_{s}", functools.partial(_swin, True), size=16, generic=2, why_generic=_SWIN)
            for s in ("t", "s", "b")
        ),
        *(ZooModel(name, functools.partial(_vgg, layers, False)) for name, layers in _VGG_LAYERS.items()),
        *(ZooModel(f"{name}_bn", functools.partial(_vgg, layers, True)) for name, layers in _VGG_LAYERS.items()),
        ZooModel("vit_b_16", functools.partial(_vit, 8)),
        ZooModel("vit_b_32", functools.partial(_vit, 16)),
        ZooModel("vit_h_14", functools.partial(_vit, 14, 28), size=28),
        ZooModel("vit_l_16", functools.partial(_vit, 8)),
        ZooModel("vit_l_32", functools.partial(_vit, 16)),
    ]
    return entries


TORCHVISION_MODELS: list[ZooModel] = _torchvision_models()


# -- timm -------------------------------------------------------------------------------------------
def _timm(name: str, drop_path: bool = True, **kwargs) -> Callable[[], nn.Module]:
    """A timm builder with randomness on: timm's drop rates default to 0, so small ones are set here
    (``drop_path=False`` for the architectures that have no drop path)."""

    def build() -> nn.Module:
        import_torchvision()  # timm imports torchvision
        import timm

        options = {"num_classes": 10, "drop_rate": 0.1, **({"drop_path_rate": 0.1} if drop_path else {}), **kwargs}
        return timm.create_model(name, **options)

    return build


def _timm_class(make: Callable[..., nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import_torchvision()
        return make()

    return build


def _mixer(residual: bool) -> nn.Module:
    from timm.models import mlp_mixer

    extra = {"block_layer": functools.partial(mlp_mixer.ResBlock, init_values=1e-4), "norm_layer": mlp_mixer.Affine}
    return mlp_mixer.MlpMixer(
        num_classes=10,
        img_size=32,
        patch_size=8,
        num_blocks=2,
        embed_dim=32,
        drop_path_rate=0.1,
        **({"mlp_ratio": 4, **extra} if residual else {}),
    )


def _poolformer() -> nn.Module:
    from timm.layers import GroupNorm1
    from timm.models.metaformer import MetaFormer

    return MetaFormer(
        depths=(1, 1, 1, 1),
        dims=(8, 16, 24, 32),
        downsample_norm=None,
        mlp_act=nn.GELU,
        mlp_bias=True,
        norm_layers=GroupNorm1,
        layer_scale_init_values=1e-5,
        res_scale_init_values=None,
        use_mlp_head=False,
        drop_path_rate=0.1,
        num_classes=10,
    )


def _convmixer() -> nn.Module:
    from timm.models.convmixer import ConvMixer

    return ConvMixer(dim=32, depth=2, kernel_size=3, patch_size=4, num_classes=10)


def _timm_vgg() -> nn.Module:
    from timm.models.vgg import VGG

    return VGG(cfg=[8, "M", 16, "M"], num_classes=10, mlp_ratio=0.25)


_VIT_TINY = {"img_size": 32, "patch_size": 8, "depth": 2}

TIMM_MODELS: list[ZooModel] = [
    ZooModel("resnet18", _timm("resnet18", layers=(1, 1, 1, 1))),
    ZooModel("resnet10t", _timm("resnet10t")),
    ZooModel("resnetv2_18", _timm("resnetv2_18", layers=(1, 1, 1, 1))),
    # the builder fixes the depths; the narrowest widths its 32-group norms allow
    ZooModel("resnetv2_50x1_bit", _timm("resnetv2_50x1_bit", channels=(128, 256, 512, 1024), stem_chs=32)),
    ZooModel("seresnext26d_32x4d", _timm("seresnext26d_32x4d", layers=(1, 1, 1, 1))),
    ZooModel("resnest14d", _timm("resnest14d")),
    ZooModel("skresnet18", _timm("skresnet18", layers=(1, 1, 1, 1))),
    ZooModel("res2net50_14w_8s", _timm("res2net50_14w_8s", layers=(1, 1, 1, 1))),
    ZooModel("nf_regnet_b0", _timm("nf_regnet_b0")),
    ZooModel(
        "dm_nfnet_f0",  # timm's test_nfnet widths
        _timm("dm_nfnet_f0", depths=(1, 1, 1, 1), channels=(32, 64, 96, 128), stem_chs=16, group_size=8),
    ),
    ZooModel("efficientnet_b0", _timm("efficientnet_b0"), samples=8, slow=True),
    ZooModel("tf_efficientnet_b0", _timm("tf_efficientnet_b0"), samples=8),
    ZooModel("mixnet_s", _timm("mixnet_s"), slow=True),
    ZooModel("mobilenetv3_small_050", _timm("mobilenetv3_small_050")),
    ZooModel("mobilenetv2_050", _timm("mobilenetv2_050")),
    ZooModel("mobilenetv4_conv_small", _timm("mobilenetv4_conv_small")),
    ZooModel("lcnet_050", _timm("lcnet_050")),
    ZooModel("tinynet_e", _timm("tinynet_e"), slow=True),
    ZooModel("fbnetc_100", _timm("fbnetc_100"), slow=True),
    ZooModel("ghostnet_050", _timm("ghostnet_050", drop_path=False)),
    ZooModel("ghostnetv2_100", _timm("ghostnetv2_100", drop_path=False), size=64, slow=True),
    ZooModel("rexnet_100", _timm("rexnet_100")),
    ZooModel("regnetx_002", _timm("regnetx_002")),
    ZooModel("regnety_002", _timm("regnety_002")),
    ZooModel("regnetz_005", _timm("regnetz_005"), slow=True),
    ZooModel("convnext_atto", _timm("convnext_atto")),
    ZooModel("convnextv2_atto", _timm("convnextv2_atto")),
    ZooModel("vit_tiny_patch16_224", _timm("vit_tiny_patch16_224", **_VIT_TINY)),
    ZooModel("deit_tiny_patch16_224", _timm("deit_tiny_patch16_224", **_VIT_TINY)),
    ZooModel("deit_tiny_distilled_patch16_224", _timm("deit_tiny_distilled_patch16_224", **_VIT_TINY)),
    ZooModel("deit3_small_patch16_224", _timm("deit3_small_patch16_224", **_VIT_TINY)),
    ZooModel(
        "vit_relpos_small_patch16_224",
        _timm("vit_relpos_small_patch16_224", **_VIT_TINY),
        generic=4,
        why_generic=_RELPOS_MLP,
    ),
    ZooModel(
        "eva02_tiny_patch14_224",
        _timm("eva02_tiny_patch14_224", img_size=28, patch_size=14, depth=2),
        size=28,
        generic=2,
        why_generic=_own("each attention owns q_bias and v_bias"),
    ),
    ZooModel(
        "beit_base_patch16_224",
        _timm("beit_base_patch16_224", embed_dim=32, num_heads=2, **_VIT_TINY),
        generic=2,
        why_generic=_own("each attention owns its biases and table"),
    ),
    ZooModel("cait_xxs24_224", _timm("cait_xxs24_224", depth_token_only=1, **_VIT_TINY)),
    ZooModel(
        "xcit_nano_12_p16_224",
        _timm("xcit_nano_12_p16_224", img_size=32, depth=2),
        generic=1,
        why_generic="the root calls its position encoding on sizes alone (self.pos_embed(B, Hp, Wp)): its code "
        "runs per model",
    ),
    ZooModel(
        "swin_tiny_patch4_window7_224",
        _timm(
            "swin_tiny_patch4_window7_224", img_size=32, window_size=2, embed_dim=16, depths=(1, 1), num_heads=(1, 2)
        ),
        generic=2,
        why_generic=_own("each window attention owns relative_position_bias_table"),
    ),
    ZooModel(
        "swinv2_tiny_window8_256",
        _timm("swinv2_tiny_window8_256", img_size=32, window_size=2, embed_dim=16, depths=(1, 1), num_heads=(1, 2)),
        generic=2,
        why_generic=_own("each window attention owns logit_scale, q_bias and v_bias"),
    ),
    ZooModel("mixer_s16_224", _timm_class(functools.partial(_mixer, False))),
    ZooModel(
        "resmlp_12_224",
        _timm_class(functools.partial(_mixer, True)),
    ),
    ZooModel(
        "poolformer_s12", _timm_class(_poolformer)
    ),
    ZooModel("convmixer_768_32", _timm_class(_convmixer)),
    ZooModel("vgg11", _timm_class(_timm_vgg)),
    ZooModel(
        "coatnet_nano_rw_224",
        _timm("coatnet_nano_rw_224", img_size=64),
        size=64,
        generic=18,
        why_generic="each transformer block's RelPosBias owns relative_position_bias_table (the whole module "
        "through torch.func), and its attention, calling the RelPosBias's get_bias() rather than its forward, runs "
        "per model (the attention's layers registered)",
    ),
    ZooModel(
        "levit_128s",
        _timm("levit_128s", img_size=64),
        size=64,
        generic=11,
        why_generic=_own("each attention owns attention_biases"),
    ),
    ZooModel(
        "pit_ti_224",
        _timm("pit_ti_224", img_size=64),
        size=64,
    ),
    ZooModel(
        "twins_svt_small",
        _timm("twins_svt_small", img_size=32, depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 4, 4)),
    ),
    ZooModel("pvt_v2_b0", _timm("pvt_v2_b0")),
    ZooModel("mobilevit_xxs", _timm("mobilevit_xxs", img_size=64), size=64),
    ZooModel(
        "edgenext_xx_small",
        _timm("edgenext_xx_small"),
        generic=1,
        why_generic="a SplitTransposeBlock calls its position encoding on sizes alone: its code runs per model",
    ),
    ZooModel("fastvit_t8", _timm("fastvit_t8")),
    ZooModel("repvit_m1", _timm("repvit_m1", drop_path=False)),
    ZooModel("mobileone_s0", _timm("mobileone_s0")),
    ZooModel("densenet121", _timm("densenet121", drop_path=False, block_config=(2, 2))),
    ZooModel("dla46_c", _timm("dla46_c", drop_path=False)),
    ZooModel("cs3darknet_focus_s", _timm("cs3darknet_focus_s")),
    ZooModel("ese_vovnet19b_dw", _timm("ese_vovnet19b_dw")),
    ZooModel("hgnetv2_b0", _timm("hgnetv2_b0")),
    ZooModel("sequencer2d_s", _timm("sequencer2d_s", layers=(1, 1, 1, 1))),
    ZooModel(
        "davit_tiny",
        _timm("davit_tiny", depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 4, 4)),
    ),
    ZooModel("starnet_s1", _timm("starnet_s1")),
    ZooModel("mambaout_femto", _timm("mambaout_femto")),
    ZooModel("inception_next_atto", _timm("inception_next_atto")),
]


def float64(model: nn.Module) -> nn.Module:
    """``model`` in float64 (the zoo tests compare with plain copies at float64 tolerances)."""
    return model.to(torch.float64)
