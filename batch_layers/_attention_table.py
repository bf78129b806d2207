"""The kernel table of scaled dot-product attention: which of torch's implementations runs an attention call on
the merged axis, on what conditions and with what measurement behind it, as the convolutions' table
(:mod:`batch_layers._kernel_table`) says it for theirs, with the same :class:`~batch_layers._kernel_table.Candidate`.

Attention holds no weights, so B models' attention is one call on their merged rows, and torch picks its
kernel from the shapes. In float32 it picks its memory-efficient kernel, which computes in full float32
without tensor cores. Under ``torch.compile`` its math path (two batched products and a softmax, which
Inductor fuses with the copies around them) runs the products on TF32 where the user allows it, and for
short sequences the scores it keeps cost little memory: what ``vmap`` runs compiled, having no batching rule
for the fused kernels. :func:`scaled_dot_product_attention` is ``F.scaled_dot_product_attention`` with the
table's choice; :func:`explain_attention_kernels` says why for a shape.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._base import constant_under_compile
from ._kernel_table import Candidate, explain

__all__ = [
    "ATTENTION_OPS",
    "MATH_ATTENTION",
    "AttentionCall",
    "explain_attention_kernels",
    "scaled_dot_product_attention",
]


class AttentionCall(NamedTuple):
    """What the choice depends on, as plain values: whether the query is a dense CUDA tensor (``cuda``,
    ``nested``), its ``dtype``, the number of ``keys`` and the ``head_dim``, the number of attention
    ``scores`` (query rows x heads x queries x keys), whether ``torch.compile`` is tracing the call
    (``compiling``), whether autocast computes in a lower precision on the query's device (``autocast``), and
    whether all of torch's attention backends are enabled (``unrestricted``: the
    caller has not narrowed them with ``sdpa_kernel`` or ``torch.backends.cuda.enable_*_sdp``)."""

    cuda: bool
    dtype: torch.dtype
    keys: int
    head_dim: int
    scores: int
    compiling: bool = False
    autocast: bool = False
    nested: bool = False
    unrestricted: bool = True

    @classmethod
    def of(cls, query: Tensor, key: Tensor) -> AttentionCall:
        """The call of an attention of ``query`` ``(..., L, E)`` over ``key`` ``(..., S, E)``, now."""
        nested, device = query.is_nested, query.device.type
        keys = 0 if nested or key.dim() < 2 else key.shape[-2]
        scores = 0 if nested else math.prod(query.shape[:-1]) * keys  # (sizes: a tracked numel() is pooled)
        autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != torch.float32
        return cls(query.is_cuda, query.dtype, keys, query.shape[-1], scores, torch.compiler.is_compiling(), autocast,
                   nested, _backends_unrestricted())


@constant_under_compile  # (dynamo cannot trace these reads: a compiled model keeps the backends it was traced with)
def _backends_unrestricted() -> bool:
    """Whether all of torch's attention backends are enabled (none narrowed by ``sdpa_kernel``)."""
    backends = torch.backends.cuda
    return backends.flash_sdp_enabled() and backends.mem_efficient_sdp_enabled() and backends.math_sdp_enabled()


MATH_ATTENTION: Candidate[AttentionCall] = Candidate(
    "math",
    # compiled first: every eager call fails there at once (reading the call before it, in AttentionCall.of,
    # costs about 3 us on this VM: an eager attention call through the table 1-3 us over torch's own)
    (("under torch.compile (Inductor fuses the products' layout copies and the softmax into the kernels around "
      "them; eager, the copies ate the gain: timm's ViT-Tiny at B=16 165-175 against 172 model-steps/s)",
      lambda lim, c: c.compiling),
     ("a CUDA tensor", lambda lim, c: c.cuda),
     ("float32 and no autocast to a lower precision (flash attention wins there: bf16 at 65 keys 0.61 against "
      "2.38 ms)", lambda lim, c: c.dtype == torch.float32 and not c.autocast),
     ("a dense query (not nested)", lambda lim, c: not c.nested),
     ("torch's attention backends not narrowed by the caller", lambda lim, c: c.unrestricted),
     ("at most {max_head_dim} features per head", lambda lim, c: c.head_dim <= lim["max_head_dim"]),
     ("at most {max_keys} keys (the scores it keeps for the backward grow with their square)",
      lambda lim, c: 0 < c.keys <= lim["max_keys"]),
     ("at least {min_scores} attention scores (below, the fused kernel's single launch wins)",
      lambda lim, c: c.scores >= lim["min_scores"])),
    {"max_head_dim": 128, "max_keys": 256, "min_scores": 2**23},
    "forward and backward of float32 attention, 3 heads (tests/benchmarks/bench_attention.py --compiled), "
    "against torch's memory-efficient kernel, compiled, head dim 64, H100: with TF32 1.31-1.37x faster at 65 keys "
    "from 13M scores (1,024 query rows) up, 0.59-0.76x at 3.2M and fewer; 1.21-1.43x at 197-577 keys, 1.08x at "
    "1,025 with 3.2x its peak memory; without TF32 1.19-1.22x at 65 keys, 1.08x at 257, 0.95-0.97x at 401-577. "
    "Eager (H200), math was up to 1.68x faster at head dims 32-128 too, but in a model its layout copies ate "
    "that: timm's ViT-Tiny at B=16 165-175 against 172 model-steps/s. Compiled, that ViT ran 210.5 against "
    "184.7 model-steps/s (0.95 of the compiled limit; H200)")
"""Torch's math path (``sdpa_kernel(SDPBackend.MATH)``): batched products and a softmax, autograd's backward."""

_SDPA: Candidate[AttentionCall] = Candidate(
    "sdpa", measured="torch's own choice among its fused kernels (flash, memory-efficient, cuDNN) and math")

ATTENTION_OPS: dict[str, tuple[Candidate[AttentionCall], ...]] = {
    "scaled dot-product attention": (MATH_ATTENTION, _SDPA),
}
"""op -> its candidates in order of preference (the last always applies)."""


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention`` (the same arguments and result) on the kernel the table chooses."""
    if MATH_ATTENTION.applies(AttentionCall.of(query, key)):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(query, key, value, *args, **kwargs)
    return F.scaled_dot_product_attention(query, key, value, *args, **kwargs)


def explain_attention_kernels(*, cuda: bool, dtype: torch.dtype, keys: int, head_dim: int, scores: int,
                              compiling: bool = False, autocast: bool = False, nested: bool = False,
                              unrestricted: bool = True) -> str:
    """For a scaled dot-product attention described by its values (see :class:`AttentionCall`): which kernel
    runs it and why not those preferred before it."""
    call = AttentionCall(cuda, dtype, keys, head_dim, scores, compiling, autocast, nested, unrestricted)
    return explain(call, ATTENTION_OPS)
