"""The kernel table of batched convolutions: for each op, the candidate implementations in order of
preference, each with its conditions and the measured thresholds behind them, in one place.

A batched convolution runs as one grouped convolution (the models are groups, see ``_conv.py``). For each
op below the first candidate whose conditions all hold runs; the last candidate of each op has none.
:func:`choose` answers for a shape, :func:`explain` says why for every op (``python -m torchmb kernels``).
The functional core (``batch_layers/functional/_conv.py``) asks through
:func:`~batch_layers._conv_triton.runs_on_triton`, :func:`~batch_layers._depthwise_triton.runs_depthwise_grad`
and :func:`~batch_layers.functional._conv.keeps_channels_last`.

Adding a kernel: its module beside the layer (the kernel and its launch), plus one :class:`Candidate` in
:data:`OPS` before the op's fallback, with its conditions and the measurement behind its thresholds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

import torch

import torchmb_config

__all__ = ["INDEX_LIMIT", "OPS", "Candidate", "ConvCall", "choose", "explain", "explain_kernels"]

INDEX_LIMIT = 2**31 - 1
"""Elements one convolution kernel may address (cuDNN and ATen index with 32 bits): a layer whose grouped
convolution would reach further splits its models over several calls."""

# looked up once, without importing Triton: the checks run inside traced forwards (no imports there)
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
_TRITON_SWITCH = torchmb_config.SWITCHES["triton"]  # TORCHMB_TRITON=0 keeps every convolution on cuDNN/ATen
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_HALVES = (torch.float16, torch.bfloat16)


def _prod(sizes: Sequence[int]) -> int:
    out = 1
    for size in sizes:  # (plain Python: the checks run inside traced forwards)
        out *= size
    return out


class ConvCall(NamedTuple):
    """What the choice depends on, as plain values (so a shape can be asked about without tensors): the
    grouped convolution's input (``cuda``, ``dims``, ``dtype``, its ``channels``), its stacked weight's ``weight_shape``
    (``(B*O, C/g, *k)``; ``(B*C, O/g, *k)`` transposed), ``groups`` (``B * g``), ``transposed``, ``stride`` and
    ``dilation``, and the input's spatial ``size`` and ``padding`` (empty where the caller does not know them:
    only the candidates that read them need them). A named tuple: every batched convolution builds a few per
    call, and a frozen dataclass took three times as long to build (``tests/benchmarks/host_time.py``)."""

    cuda: bool
    dims: int
    dtype: torch.dtype
    channels: int
    weight_shape: tuple[int, ...]
    groups: int
    transposed: bool = False
    stride: tuple[int, ...] = (1, 1)
    dilation: tuple[int, ...] = (1, 1)
    size: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()

    @classmethod
    def of(cls, x: torch.Tensor, weight: torch.Tensor, groups: int, transposed: bool = False,
           stride: Sequence[int] = (1, 1), dilation: Sequence[int] = (1, 1), padding: Sequence[int] = ()) -> ConvCall:
        """The call of a grouped convolution of ``x`` (its channels all groups') with the stacked ``weight``."""
        return cls(x.is_cuda, x.dim(), x.dtype, x.shape[1], tuple(weight.shape), groups, transposed, tuple(stride),
                   tuple(dilation), tuple(x.shape[2:]), tuple(padding))

    @classmethod
    def of_merged(cls, x: torch.Tensor, weight: torch.Tensor, batch: int, groups: int, stride: Sequence[int],
                  padding: Sequence[int], dilation: Sequence[int]) -> ConvCall:
        """The call of B models' convolution of the merged ``(B*n, C, *S)`` ``x`` (one model's channels) with the
        stacked ``weight`` (or B models' ``(B, O, C/g, *k)``), ``groups`` counting ``B * g``; not transposed. Its
        ``dtype`` is the one the convolution computes in: autocast's, where autocast casts a float32 ``x``."""
        shape = tuple(weight.shape)
        if len(shape) == x.dim() + 1:
            shape = (shape[0] * shape[1], *shape[2:])
        dtype = x.dtype
        if dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):  # it computes in autocast's dtype
            dtype = torch.get_autocast_dtype(x.device.type)
        return cls(x.is_cuda, x.dim(), dtype, batch * x.shape[1], shape, groups, False, tuple(stride),
                   tuple(dilation), tuple(x.shape[2:]), tuple(padding))


Call = TypeVar("Call")
"""What a table's checks read of one call: :class:`ConvCall` here, the norm table's ``NormCall``."""


@dataclass
class Candidate(Generic[Call]):
    """One implementation of an op: ``name``, the ``conditions`` under which it runs (a description, formatted
    with ``limits``, and a check of ``(limits, call)``), its thresholds (``limits``, read at every check: tests
    and benchmarks may change them) and the measurement that set them (``measured``)."""

    name: str
    conditions: tuple[tuple[str, Callable[[dict[str, int], Call], bool]], ...] = ()
    limits: dict[str, int] = field(default_factory=dict)
    measured: str = ""

    def applies(self, call: Call) -> bool:
        """Whether every condition holds for ``call``."""
        # (a loop of plain calls: it runs inside traced forwards)
        for _, check in self.conditions:
            if not check(self.limits, call):
                return False
        return True

    def unmet(self, call: Call) -> list[str]:
        """The descriptions of the conditions ``call`` does not meet (none: this candidate runs it)."""
        return [text.format(**self.limits) for text, check in self.conditions if not check(self.limits, call)]


_CUDA = ("a CUDA tensor", lambda lim, c: c.cuda)
_TWO_D = ("a 2-D convolution", lambda lim, c: c.dims == 4)
_NOT_TRANSPOSED = ("not transposed", lambda lim, c: not c.transposed)
_FLOAT = ("float32, float16 or bfloat16", lambda lim, c: c.dtype in _FLOATS)
_TRITON = ("Triton installed and the 'triton' switch on (TORCHMB_TRITON)",
           lambda lim, c: TRITON_INSTALLED and _TRITON_SWITCH.get())

_GROUPED_LIMITS = {"min_groups": 128, "min_groups_compiled": 64, "max_out_per_group": 32, "max_patch": 512}
_GROUPED = (
    _CUDA, _TWO_D, _NOT_TRANSPOSED, _FLOAT,
    ("at least {min_groups} groups ({min_groups_compiled} under torch.compile, where a launch costs no Python)",
     lambda lim, c: c.groups >= lim["min_groups"]
     or (c.groups >= lim["min_groups_compiled"] and torch.compiler.is_compiling())),
    ("at most {max_out_per_group} output channels per group",
     lambda lim, c: c.weight_shape[0] // c.groups <= lim["max_out_per_group"]),
    ("not pure depthwise (one input and one output channel per group: ATen's depthwise kernels keep up)",
     lambda lim, c: max(c.weight_shape[1], c.weight_shape[0] // c.groups) >= 2),
    ("at most {max_patch} patch elements per group (input channels x kernel height x width)",
     lambda lim, c: _prod(c.weight_shape[1:]) <= lim["max_patch"]),
    _TRITON,
)
_GROUPED_MEASURED = (
    "H100, TF32 as torch's default: LeNet's second convolution at B=256 3.6 against 7.4 ms forward and "
    "backward (tests/benchmarks/bench_conv_forms.py), the compiled LeNet step 1.46x faster; at B=64 the "
    "convolution ties and the compiled step ran 0.94x as fast as with cuDNN; at B=16 cuDNN is twice as fast. "
    "Compiled, where cuDNN's grouped kernels launch per group: LeNet at B=64 (64 groups) 24,400-26,700 against "
    "14,800-15,300 model-steps/s (H100) and 20,800-24,400 against 21,200 (H200), 40 launches a step against "
    "169, eager 13,400-13,500 against 14,600-17,300 (H100); at B=16 a tie; timm's EfficientNet-B0 at B=64 "
    "(its stem and 1x1 layers of 16 outputs) 1,076 against 1,070 (H200), 1,187 launches against 1,320"
)


def _limit(lim: dict[str, int], name: str) -> int:
    """The threshold ``name`` of a candidate's limits, or its ``<name>_compiled`` under torch.compile."""
    return lim[name + "_compiled" if torch.compiler.is_compiling() else name]


def read_window(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> tuple[int, int]:
    """Along one spatial dim of a convolution: the input rows ``[first, stop)`` that some output row reads."""
    return max(0, -pad), min(size, (out - 1) * stride - pad + (kernel - 1) * dilation + 1)


def _pixels(c: ConvCall) -> tuple[int, int]:
    """The output pixels and the input pixels some output reads, of a convolution whose image size is known."""
    out_pixels, read_pixels = 1, 1
    for size, k, step, pad, dil in zip(c.size, c.weight_shape[2:], c.stride, c.padding, c.dilation):
        out = (size + 2 * pad - dil * (k - 1) - 1) // step + 1
        first, stop = read_window(size, out, k, step, pad, dil)
        out_pixels, read_pixels = out_pixels * out, read_pixels * max(stop - first, 0)
    return out_pixels, read_pixels


MATMUL: Candidate[ConvCall] = Candidate(
    "matmul",
    (_CUDA, _TWO_D, _NOT_TRANSPOSED, _FLOAT,
     ("the image's size and padding known", lambda lim, c: len(c.size) == len(c.padding) == 2),
     ("at least {min_channels} input and output channels per group ({min_channels_one_pixel} in bfloat16 or float16, "
      "autocast's included, for a 1x1 kernel of one output pixel: a squeeze-excitation layer, which cuDNN's grouped "
      "16-bit kernels run once per model; in float32 its one kernel launches fewer than the product)",
      lambda lim, c: min(c.weight_shape[1], c.weight_shape[0] // c.groups) >= lim[
          "min_channels_one_pixel" if c.dtype in _HALVES and c.weight_shape[2:] == (1, 1) and _pixels(c)[0] == 1
          else "min_channels"]),
     ("at most {max_pairs} pixel pairs (output pixels x input pixels read)",
      lambda lim, c: _prod(_pixels(c)) <= lim["max_pairs"]),
     # its filters hold a block per pixel pair, most of them zeros for a 1x1 kernel
     ("a kernel of several taps, or one output pixel (POINTWISE multiplies 1x1 kernels without a block per pair)",
      lambda lim, c: _prod(c.weight_shape[2:]) > 1 or _pixels(c)[0] == 1)),
    {"min_channels": 16, "min_channels_one_pixel": 1, "max_pairs": 16},
    "H200, B=64, n=128, forward and backward (tests/benchmarks/bench_conv_choices.py --max-pairs 1100): a 3x3 "
    "convolution of a 1x1 image (1 pair) 2.1 against cuDNN's grouped 5.7 ms in fp32 (TF32) and 2.0 against 5.8 in "
    "bf16; 2x2 to 1x1 with stride 2 (4 pairs) 2.0 against 4.5 and 1.7 against 5.2. Above 9 pairs it lost or "
    "won by little: 2x2 images with stride 1 (16 pairs) 2.3 against 3.1 ms in fp32 but 2.4 against 1.8 in bf16, "
    "4x4 to 2x2 with stride 2 (64 pairs) 5.1 against 4.2, larger images 6-12x cuDNN's time; the whole "
    "ResNet-18 at B=64 ran at 0.80 of the limit with 64 pairs against 0.87 with one output pixel. Compiled, "
    "ResNet-18's 2x2 layers of stride 1 (16 pairs) join its strided layers as products and its wide stride-1 "
    "layers channels-last (PATCHES, WIDE_CHANNELS_LAST): 2,158 against 1,578 model-steps/s at B=64 (H200). "
    "Eager whole ResNet-18 (bench --zoo --launches, H200, n=128), 16 pairs against 9: in fp32 at B=64 1,343 "
    "against 1,245-1,314 model-steps/s with 1,074 launches a step against 2,016-2,144 (cuDNN's grouped kernels "
    "launch once per model there), at B=16 a tie (730 against 735-757) with 607 launches against 752-976; in "
    "bf16 ties (1,537 against 1,519-1,641 at B=64, 593 against 586-597 at B=16). 1x1 "
    "kernels of several output pixels are left to POINTWISE: compiled ConvNeXt-atto at B=16, whose MLP layers on "
    "2x2 images this product took with 16 pairs, peaked at 1,728 MiB against 4,210 (H200), at the same speed. "
    "Squeeze-excitation layers (1x1 kernels of one output pixel) of fewer channels: cuDNN's grouped bf16 kernels ran "
    "EfficientNet-B0's once per model at B=64 (144 -> 6: 406 kernels a step, 3.68 ms forward and backward, against "
    "20 and 0.96 as the product; in fp32 16 against 14 kernels, 1.02 against 0.81 ms; every such layer of "
    "EfficientNet-B0 and MobileNetV3 at B=16 and 64, fp32 and bf16, took 0.59-1.40 ms as the product against 0.86-4.76 "
    "on cuDNN, faster but for 16 -> 8 at B=16 in bf16, 1.35 against 1.18; H200, n=128, forward and backward). Whole "
    "torchvision EfficientNet-B0 in bf16 (bench --zoo --launches, processes taking turns): 2.57 and 2.73 of the limit "
    "against 2.33 and 2.04 at B=64, with 1.04x the limit's launches against 2.24x; ties at B=16. In fp32 the whole "
    "models lost with them as products: timm's EfficientNet-B0 0.67 and 0.67 of the limit against 0.79 and 0.82 at "
    "B=16, both EfficientNets 1.43-1.51x the limit's launches at B=64 against 1.14-1.21. float16 as bf16 (H200, B=64, "
    "float16 autocast): cuDNN's grouped kernels launched 26-406 a layer (144 -> 6: 406, 3.88 ms), the product 20-21, "
    "and the product was faster on each of the ten layers timed, 1.05-1.42 against 1.44-3.88 ms")
"""A convolution of a few pixels as one batched matrix product (``_conv_matmul.py``), forward and both
gradients (autograd's), so it heads all three ops."""

POINTWISE: Candidate[ConvCall] = Candidate(
    "pointwise-matmul",
    (_CUDA, _TWO_D, _NOT_TRANSPOSED, _FLOAT,
     ("a 1x1 kernel without padding", lambda lim, c: tuple(c.weight_shape[2:]) == (1, 1) and set(c.padding) == {0}),
     ("at least {min_channels} input and output channels per group ({min_channels_compiled} under torch.compile)",
      lambda lim, c: min(c.weight_shape[1], c.weight_shape[0] // c.groups) >= _limit(lim, "min_channels")),
     ("at most {max_pixels} pixels per image ({max_pixels_compiled} under torch.compile, where Inductor fuses the "
      "product's layout copies into the element-wise kernels around it)",
      lambda lim, c: len(c.size) == 2 and _prod(c.size) <= _limit(lim, "max_pixels"))),
    {"min_channels": 16, "max_pixels": 64, "min_channels_compiled": 1, "max_pixels_compiled": 256},
    "H200, n=128, forward and backward (tests/benchmarks/bench_conv_choices.py), MobileNetV3's and "
    "EfficientNet-B0's pointwise layers and ResNet-18's downsampling on 32x32 images: 8x8 and smaller images "
    "1.3-4.6x faster than cuDNN's grouped convolution at B=64 (e.g. 240 -> 40 channels on 4x4 images 0.80 "
    "against 3.17 ms in fp32), at B=16 mostly faster too; 16 -> 96 channels on 16x16 images 3.8 against 3.3 ms "
    "(fp32, B=64). Whole models at B=64 (fp32): MobileNetV3-small 944 -> 1,978 model-steps/s, EfficientNet-B0 "
    "473 -> 594, RegNetX-400MF 655 -> 925. Compiled (tests/benchmarks/bench_conv_compiled.py, H200, a "
    "convolution, batch norm and SiLU, forward and backward): 0.65-0.86x the time of the grouped convolution "
    "(cuDNN's, or Triton's from 64 groups) on EfficientNet-B0's and RegNetX-400MF's 1x1 layers of 16x16 images "
    "(16-96 channels, stride 1 and 2) and on squeeze-excitation layers of 4 channels, at B=64 and 16")
"""A pointwise convolution as one batched matrix product of pixels (``_conv_pointwise.py``), forward and both
gradients (autograd's)."""


def _stem(lim: dict[str, int], c: ConvCall, max_patch_per_output: int) -> bool:
    in_per_group = c.weight_shape[1]
    return (in_per_group <= lim["max_in_per_group"]
            and _prod(c.weight_shape[1:]) <= max_patch_per_output * (c.weight_shape[0] // c.groups))


def _wide_strided(lim: dict[str, int], c: ConvCall) -> bool:
    return c.weight_shape[1] >= lim["min_in_per_group_strided"] and max(c.stride) > 1


def _patchify(c: ConvCall) -> bool:
    """A convolution whose kernel is its stride, of more than one pixel, without padding (a ConvNeXt's stem and
    downsampling layers, a ViT's patch embedding): its patches are its input, rearranged."""
    return (c.weight_shape[2:] == c.stride and max(c.stride) > 1 and len(c.padding) == 2 and set(c.padding) == {0}
            and set(c.dilation) == {1})


def _takes_patches(lim: dict[str, int], c: ConvCall) -> bool:
    if torch.compiler.is_compiling():
        return _stem(lim, c, lim["max_patch_per_output"]) or _wide_strided(lim, c)
    if c.groups >= lim["min_groups_eager"] and max(c.stride) > 1 and (
            _stem(lim, c, lim["max_patch_per_output_eager"]) or _patchify(c)):
        return True
    return c.groups >= lim["min_groups_eager_wide"] and _wide_strided(lim, c)


PATCHES: Candidate[ConvCall] = Candidate(
    "patches-matmul",
    # first: every other convolution no product takes asks, and its checks read only a few numbers
    (("under torch.compile (Inductor gathers the patches in one kernel, fused with the layout's copies) a stem (at "
      "most {max_in_per_group} input channels per group, and patches of at most {max_patch_per_output} elements per "
      "output channel of a group: input channels x kernel height x width) or a strided layer of at least "
      "{min_in_per_group_strided} input channels per group (whose 3x3 patches are 2.25x its input); eagerly, from "
      "{min_groups_eager} groups (models), a strided stem of patches of at most {max_patch_per_output_eager} "
      "elements per output channel (autograd keeps them for backward) or a layer whose kernel is its stride, without "
      "padding (its patches are its input), and from {min_groups_eager_wide} groups a wide "
      "strided layer too (cuDNN's grouped kernels launch once per model on all of these; with fewer models the "
      "host's time for the operators the patches add outweighs it)",
      _takes_patches),
     _CUDA, _TWO_D, _NOT_TRANSPOSED, _FLOAT,
     ("the image's size and padding known", lambda lim, c: len(c.size) == len(c.padding) == 2)),
    {"max_in_per_group": 3, "max_patch_per_output": 3, "max_patch_per_output_eager": 2, "min_in_per_group_strided": 64,
     "min_groups_eager": 16, "min_groups_eager_wide": 64},
    "H200, compiled, forward and backward of a convolution, batch norm and SiLU on 32x32 images, n=128 "
    "(tests/benchmarks/bench_conv_compiled.py), against the grouped convolution the table chose before: "
    "MobileNetV3's stem (3 -> 16 channels, 3x3, stride 2) 0.71x the time at B=64 (against Triton's grouped "
    "kernel), a tie at B=16; EfficientNet-B0's (3 -> 32) a tie at B=64, 0.79x at B=16 (against cuDNN); "
    "ResNet-18's 7x7 stem (147 per pixel for 64 channels) 1.06x and 1.23x alone, but in the whole model, which it "
    "then leaves without a grouped kernel launched once per model, no slower (below). LeNet's first layer (25 for 6 "
    "channels, 28x28) lost, 1.19x at B=64 against Triton's kernel. Whole ResNet-18 compiled (H200, n=128, fp32 with "
    "TF32; python -m torchmb bench --zoo --workloads tv-resnet18 --impls torchmb+compile), with its strided layers "
    "as products, its stride-1 layers of 64 and 128 channels channels-last (WIDE_CHANNELS_LAST) and its 2x2 layers "
    "as MATMUL's products: 2,158 model-steps/s at B=64 with its stem a product too (318 launches a step), 2,132 "
    "with the stem grouped (439), 1,578 before (2,272); every 3x3 layer as a product of patches lost (1,414): the "
    "patches of a stride-1 3x3 layer are 9x its input. Eager (bench --zoo --launches, H200, n=128, MATMUL at 16 "
    "pairs), ResNet-18's strided layers as products: at B=64 in fp32 1,416 against 1,343 model-steps/s, 530 "
    "launches a step against 1,074, steady peak 10,116 MiB against 9,684 (eager vmap's 10,775), first step 10,709 "
    "against 16,447; in bf16 1,610 against 1,537, 804 launches against 1,044; at B=16 in fp32 631 against 730 "
    "(the host's extra operators), in bf16 605 against 593. ConvNeXt-atto in fp32 at B=64 988 against 921 "
    "(683 launches against 1,194), at B=16 335 against 295. With its stem a product too, eager ResNet-18 at B=64 "
    "held 11,196 MiB steady, above eager vmap's (its 7x7 patches are 2.3x the stem's output), and alone its stem took "
    "5.6 against cuDNN's 4.9 ms forward and backward: it stays cuDNN's eagerly. Eager stems and patchify layers "
    "(bench --zoo --impls torchmb,limit --launches, H200, fp32, n=128; cuDNN ran them once per model at B=64; the "
    "wheel measured gathered the 3x3 stems' patches again in backward, a slower form than this one): "
    "ConvNeXt-atto 424 against 283 model-steps/s at B=16 (481 launches against 660) and 1,406 against 935 at B=64 "
    "(488 against 683); MobileNetV3 368 against 307 and 1,088 against 1,051 (616 launches against 733 at B=64); "
    "torchvision's EfficientNet-B0 221 against 178 and 609 against 636, a tie (1,147 against 1,264); RegNetX-400MF "
    "at B=64 969 and 1,083 against 985 and 1,102 in processes taking turns (1,108 launches against 1,227). Alone, the "
    "3x3 stems of stride 2 took 0.84 against 0.99 ms at B=16 and 2.0 against 1.4 at B=64; ConvNeXt's 4x4 stem 0.61 "
    "against 1.56 and its 2x2 downsampling of 40 channels 0.80 against 2.11 at B=64. RegNetX's 1x1 layer of stride 2 "
    "on 16x16 images as a product read 697-812 model-steps/s at B=64 in three processes: it stays cuDNN's")
"""A convolution of few input channels (a network's stem), a strided one of many, or one whose kernel is its stride,
as one batched matrix product of each output pixel's patch (``_conv_patches.py``), forward and both gradients
(autograd's): under ``torch.compile`` the stems and the wide strided layers; eagerly, from 16 models on, the strided
stems of small patches and the patchify layers, and from 64 models on the wide strided layers."""

_ATEN: Candidate[ConvCall] = Candidate("aten", measured="cuDNN or ATen's kernels (torch.convolution and its backward)")

TRITON_GROUPED: Candidate[ConvCall] = Candidate("triton-grouped", _GROUPED, _GROUPED_LIMITS, _GROUPED_MEASURED)
TRITON_GROUPED_INPUT_GRAD: Candidate[ConvCall] = Candidate(
    "triton-grouped",
    (("stride 1", lambda lim, c: set(c.stride) == {1}),
     ("dilation 1", lambda lim, c: set(c.dilation) == {1}), *_GROUPED),
    _GROUPED_LIMITS, _GROUPED_MEASURED + "; the input gradient is the same kernel on the flipped filters")
TRITON_STEM: Candidate[ConvCall] = Candidate(
    "triton-stem",
    # first: what most convolutions fail, in a few numbers
    (("at most {max_in_per_group} input channels per group (a network's stem)",
      lambda lim, c: c.weight_shape[1] <= lim["max_in_per_group"]),
     ("stride 2 or more", lambda lim, c: max(c.stride) > 1),
     ("at least {min_groups} groups", lambda lim, c: c.groups >= lim["min_groups"]),
     ("eager (compiled steps take stems as products of patches: PATCHES)",
      lambda lim, c: not torch.compiler.is_compiling()),
     _CUDA, _TWO_D, _NOT_TRANSPOSED, _FLOAT,
     ("{min_out_per_group} to {max_out_per_group} output channels per group",
      lambda lim, c: lim["min_out_per_group"] <= c.weight_shape[0] // c.groups <= lim["max_out_per_group"]),
     ("at most {max_patch} patch elements per group (input channels x kernel height x width)",
      lambda lim, c: _prod(c.weight_shape[1:]) <= lim["max_patch"]),
     _TRITON),
    {"min_groups": 16, "max_in_per_group": 3, "min_out_per_group": 8, "max_out_per_group": 64, "max_patch": 256},
    "H200, n=128, 32x32 images, ResNet's 7x7 stem (3 -> 64, stride 2), the grouped convolution alone "
    "(a throw-away script, forward and weight gradient): fp32 with TF32 0.53 against cuDNN's 1.14 ms "
    "at B=16 and 2.34 against 3.95 at B=64, bf16 0.39 against 1.29 and 1.54 against 4.44 (before the blocks were "
    "tuned: forward 128 positions a program, 0.48 against 0.93 ms at B=64 in fp32; weight gradient 32 patch elements "
    "a block in fp32, 64 and 8 programs a multiprocessor in bf16). As a batched layer, forward and backward: 1.37 "
    "against 1.92 ms at B=16 and 4.35 against 7.14 at B=64 (fp32), 1.60 against 1.94 and 4.31 against 8.06 (bf16). "
    "Whole eager ResNet-18 (bench --zoo --impls torchmb,limit --launches, fp32, the wheels before and after in "
    "processes taking turns): 0.67 and 0.70 of the limit against 0.49 and 0.47 at B=16, 1.00 and 1.03 against 0.97 "
    "and 1.02 at B=64 with 1.12-1.13x the limit's launches against 1.50x. The 3x3 stems of EfficientNet-B0 and "
    "MobileNetV3 ran faster here than as PATCHES's product at B=64 (1.99 against 2.72 ms and 1.40 against 1.72 in "
    "fp32) and slower at B=16 (1.39 against 1.04, 1.33 against 0.82): under 1% of those models' steps at B=64, so "
    "PATCHES keeps them; ConvNeXt's 4x4 stem of stride 4 is faster as the product at both (0.80 against 1.40 at B=64)")
"""A strided stem that PATCHES does not take (ResNet's 7x7: patches 2.3x its output), forward on the grouped
kernel and weight gradient on its own kernel (``_conv_triton.py``): cuDNN runs both once per model."""

TRITON_DEPTHWISE_GRAD: Candidate[ConvCall] = Candidate(
    "triton-depthwise",
    (_CUDA, _TWO_D, _NOT_TRANSPOSED,
     ("one input channel per group", lambda lim, c: c.weight_shape[1] == 1),
     ("as many groups as input channels: a depthwise convolution",
      lambda lim, c: c.groups == c.channels),
     ("at least {min_channels} output channels", lambda lim, c:
      c.weight_shape[0] >= lim["min_channels"]),
     ("at most {max_taps} filter taps (7x7 and smaller)", lambda lim, c:
      _prod(c.weight_shape[2:]) <= lim["max_taps"]),
     _FLOAT, _TRITON),
    {"min_channels": 128, "max_taps": 64},
    "H100: a ConvNeXt 7x7 depthwise layer at B=64 2.7 against 3.8 ms forward and backward (ATen reads the "
    "whole output gradient once per filter tap; fewer channels leave the GPU mostly idle either way). H200, "
    "whole steps at B=16, n=128: ConvNeXt-atto 12.4 against 28.0 GPU ms, MobileNetV3 7.0 against 17.0, timm's "
    "EfficientNet-B0 27.1 against 59.1; ConvNeXt-atto at B=64 1,166 against 636 model-steps/s")

CHANNELS_LAST: Candidate[ConvCall] = Candidate(
    "channels-last",
    (("at least {min_in_per_group} input channels per group",
      lambda lim, c: (c.weight_shape[0] // c.groups if c.transposed else c.weight_shape[1])
      >= lim["min_in_per_group"]),),
    {"min_in_per_group": 64},
    "H100: below it cuDNN runs grouped NHWC convolutions slice by slice (a copy kernel per group, forward and "
    "backward) and depthwise ones in its NHWC engine instead of ATen's depthwise kernels: 1.3-2x slower than "
    "NCHW for LeNet's 1-16 channels per model; from 64 on NHWC was 4% faster (tests/benchmarks/"
    "bench_conv_forms.py)")
# the compiled layouts' conditions; compiled first: every eager convolution a product does not take asks, and
# fails there at once
_LAYOUT_COMPILED = ("under torch.compile (Inductor fuses the layout's copies into the element-wise kernels around it)",
                    lambda lim, c: torch.compiler.is_compiling())
_MIN_PIXELS = ("at least {min_pixels} pixels per input image",
               lambda lim, c: len(c.size) == 2 and _prod(c.size) >= lim["min_pixels"])
CONTIGUOUS: Candidate[ConvCall] = Candidate("contiguous", measured="the grouped layout in memory order (NCHW)")
DEPTHWISE_CHANNELS_LAST: Candidate[ConvCall] = Candidate(
    "channels-last",
    (_LAYOUT_COMPILED, _CUDA, _TWO_D, _NOT_TRANSPOSED, _FLOAT,
     ("one input and one output channel per group: a depthwise convolution",
      lambda lim, c: c.weight_shape[1] == 1 and c.weight_shape[0] == c.groups == c.channels),
     _MIN_PIXELS),
    {"min_pixels": 16},
    "H200, compiled, forward and backward of a batch norm, SiLU, depthwise convolution, batch norm, SiLU block "
    "(tests/benchmarks/bench_depthwise_compiled.py), n=128: 9-20% faster than the contiguous "
    "grouped layout from 4x4 images up at B=16 and 64; on 2x2 images 24% slower at B=64 (672 channels). timm's "
    "EfficientNet-B0 at B=64 compiled: 1,182 against 1,076 model-steps/s")

WIDE_CHANNELS_LAST: Candidate[ConvCall] = Candidate(
    "channels-last (wide groups)",
    (_LAYOUT_COMPILED, _CUDA, _TWO_D, _NOT_TRANSPOSED, _FLOAT,
     ("at least {min_in_per_group} input channels per group",
      lambda lim, c: c.weight_shape[1] >= lim["min_in_per_group"]),
     ("stride 1 (cuDNN's grouped NHWC kernels lose on strided layers; PATCHES takes those)",
      lambda lim, c: set(c.stride) == {1}),
     _MIN_PIXELS),
    {"min_in_per_group": 64, "min_pixels": 16},
    "H100, eager layers of ResNet-18 on 32x32 images (tests/benchmarks/bench_grouped_layouts.py, B=64): stride-1 "
    "grouped convolutions of 64 channels on 8x8 images 1.08 ms forward and backward channels-last against 1.68 "
    "contiguous (cuDNN converts each group's slice of a contiguous input; the dense limit 0.98), 128 channels on "
    "4x4 images 0.33 against 0.77 (bf16); strided ones lost channels-last (3.46 against 2.81). Eager, the copies "
    "into the layout cost more than that. Compiled, with PATCHES's strided layers, ResNet-18 at B=64: 2,158 against "
    "1,578 model-steps/s (H200)")

OPS: dict[str, tuple[Candidate[ConvCall], ...]] = {
    "forward": (MATMUL, POINTWISE, PATCHES, TRITON_GROUPED, TRITON_STEM, _ATEN),
    "input grad": (MATMUL, POINTWISE, PATCHES, TRITON_GROUPED_INPUT_GRAD, _ATEN),
    "weight grad": (MATMUL, POINTWISE, PATCHES, TRITON_DEPTHWISE_GRAD, TRITON_STEM, _ATEN),
    "layout of a channels-last input": (CHANNELS_LAST, CONTIGUOUS),
    "layout of a compiled convolution's contiguous input": (DEPTHWISE_CHANNELS_LAST, WIDE_CHANNELS_LAST, CONTIGUOUS),
}
"""op -> its candidates in order of preference (the last always applies)."""


def choose(op: str, call: Call, ops: dict[str, tuple[Candidate[Call], ...]]) -> Candidate[Call]:
    """The candidate that runs ``op`` for ``call`` in the table ``ops`` (:data:`OPS`: the convolutions')."""
    return next(c for c in ops[op] if c.applies(call))


def explain(call: Call, ops: dict[str, tuple[Candidate[Call], ...]]) -> str:
    """For every op of the table ``ops`` (:data:`OPS`: the convolutions'): the candidate that runs ``call``
    and, for each one preferred before it, why not."""
    lines = []
    for op, candidates in ops.items():
        chosen = choose(op, call, ops)
        lines.append(f"{op}: {chosen.name} ({chosen.measured})" if chosen.conditions else f"{op}: {chosen.name}")
        for c in candidates[: candidates.index(chosen)]:
            lines.append(f"    not {c.name}: needs " + "; ".join(c.unmet(call)))
    return "\n".join(lines)


def explain_kernels(*, cuda: bool, dims: int, dtype: torch.dtype, channels: int, weight_shape: Sequence[int],
                    groups: int, transposed: bool = False, stride: Sequence[int] = (1, 1),
                    dilation: Sequence[int] = (1, 1), size: Sequence[int] = (),
                    padding: Sequence[int] = ()) -> str:
    """:func:`explain` for a grouped convolution described by its values (see :class:`ConvCall`; without the
    image ``size`` and ``padding``, the candidates that need them do not apply): for every op, which kernel
    runs and why not those preferred before it."""
    return explain(ConvCall(cuda, dims, dtype, channels, tuple(weight_shape), groups, transposed, tuple(stride),
                            tuple(dilation), tuple(size), tuple(padding)), OPS)
