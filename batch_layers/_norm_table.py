"""The kernel table of per-sample norms with a per-model affine (layer norm, RMS norm): which implementation
runs them, on what conditions and with what measurement behind it, as the convolutions' table
(:mod:`batch_layers._kernel_table`) says it for theirs, with the same :class:`~batch_layers._kernel_table.Candidate`.

The functional core (``batch_layers/functional/_norm.py``) asks :func:`runs_fused_norm`;
:func:`explain_norm_kernels` says why for a shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

import torchmb_config

from . import _kernel_table
from ._kernel_table import Candidate, explain
from ._norm_triton import MAX_FEATURES

__all__ = ["NORM_OPS", "TRITON_NORM", "NormCall", "explain_norm_kernels", "runs_fused_norm"]

_TRITON_SWITCH = torchmb_config.SWITCHES["triton"]
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class NormCall:
    """What the choice depends on, as plain values: whether the input is a CUDA tensor (``cuda``), its
    ``dtype`` (the one the norm computes in: float32 under autocast), the number of normalised ``features``
    (the product of the normalised shape), and whether ``torch.compile`` is tracing it (``compiling``) or a
    ``torch.func`` transform or forward-mode AD (``torch.autograd.forward_ad``) is active (``transformed``),
    whether the input is ``contiguous``, and whether it is an RMS norm (``rms``) under autocast
    (``autocast``)."""

    cuda: bool
    dtype: torch.dtype
    features: int
    compiling: bool = False
    transformed: bool = False
    contiguous: bool = True
    rms: bool = False
    autocast: bool = False

    @classmethod
    def of(cls, x: torch.Tensor, features: int, rms: bool) -> NormCall:
        """The call of a (with ``rms``, an RMS) norm of ``x``'s rows of ``features``, now."""
        compiling = torch.compiler.is_compiling()  # (then the transforms are not asked: dynamo cannot trace it)
        transformed = not compiling and (torch._C._are_functorch_transforms_active()
                                         or forward_ad._current_level >= 0)
        return cls(x.is_cuda, x.dtype, features, compiling, transformed, x.is_contiguous(), rms,
                   torch.is_autocast_enabled(x.device.type))


TRITON_NORM: Candidate[NormCall] = Candidate(
    "triton-norm-affine",
    (("a CUDA tensor", lambda lim, c: c.cuda),
     ("float32, float16 or bfloat16", lambda lim, c: c.dtype in _FLOATS),
     ("at most {max_features} normalised features", lambda lim, c: 0 < c.features <= lim["max_features"]),
     ("a contiguous input (H200: timm's LayerNorm2d, whose input is a permuted view, made ConvNeXt-atto slower "
      "fused, 0.87 against 1.03 of the limit at B=64)", lambda lim, c: c.contiguous),
     ("not an RMS norm under autocast (torch 2.11's rms_norm keeps the input's dtype there, the kernels would "
      "return float32)", lambda lim, c: not (c.rms and c.autocast)),
     ("not traced by torch.compile (Inductor fuses the composite itself)", lambda lim, c: not c.compiling),
     ("no torch.func transform or forward-mode AD active (the kernels have no batching rule and no jvp)",
      lambda lim, c: not c.transformed),
     ("Triton installed and the 'triton' switch on (TORCHMB_TRITON)",
      lambda lim, c: _kernel_table.TRITON_INSTALLED and _TRITON_SWITCH.get())),
    {"max_features": MAX_FEATURES},
    "the normalisation, each model's weight and bias, and all three gradients in three launches "
    "(batch_layers/_norm_triton.py), in place of torch's norm without affine plus six activation-sized "
    "operators (forward mul and add; backward three mul and two sum). H200, ViT-Tiny's norms (D=192, n=128): "
    "forward and backward 2.3x (B=16) to 3.5x (B=64) faster than that composite; ViT-Tiny 0.85 -> 0.97 of "
    "the limit at B=64; ConvNeXt-atto (n=128) 1,166 against 1,086 model-steps/s at B=64 (ranges overlapping), "
    "a tie at B=16")
"""The fused kernels of ``_norm_triton.py``: forward, and input, weight and bias gradients."""

_COMPOSITE: Candidate[NormCall] = Candidate(
    "aten", measured="torch's norm kernel without affine, then each model's weight and bias as a broadcast "
    "product and sum on the (B, n, ...) view (autograd's backward)")

NORM_OPS: dict[str, tuple[Candidate[NormCall], ...]] = {
    "layer or RMS norm with a per-model affine": (TRITON_NORM, _COMPOSITE),
}
"""op -> its candidates in order of preference (the last always applies)."""


def runs_fused_norm(x: torch.Tensor, features: int, rms: bool) -> bool:
    """Whether a per-model-affine (with ``rms``, RMS) norm of ``x``'s rows of ``features`` runs on the fused
    kernels (the table's :data:`TRITON_NORM` says when, and why)."""
    return TRITON_NORM.applies(NormCall.of(x, features, rms))


def explain_norm_kernels(*, cuda: bool, dtype: torch.dtype, features: int, compiling: bool = False,
                         transformed: bool = False, contiguous: bool = True, rms: bool = False,
                         autocast: bool = False) -> str:
    """For a layer or RMS norm with a per-model affine, described by its values (see :class:`NormCall`): which
    kernel runs it and why not those preferred before it."""
    call = NormCall(cuda, dtype, features, compiling, transformed, contiguous, rms, autocast)
    return explain(call, NORM_OPS)

