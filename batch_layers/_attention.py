"""Batched :class:`torch.nn.MultiheadAttention`: B models' projections as batched products, one attention call.

Only the four projections (query, key, value, output) hold weights, so they run as ``bmm`` over the model
axis; scaled dot-product attention itself is per sample and runs once on the merged ``B*N`` batch (with
``F.scaled_dot_product_attention`` when the weights are not needed, so its fused kernels apply).

``nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` / ``nn.Transformer`` are not registered: the
converter walks into them and swaps their ``MultiheadAttention``, ``Linear`` and ``LayerNorm`` children.
``TransformerEncoderLayer.forward`` has a fused inference path (``torch._transformer_encoder_layer_fwd``,
taken in eval mode without gradients) that reads ``self_attn``'s weights directly and cannot take a model
axis. Torch skips it whenever any submodule carries a forward hook, so this module registers a no-op
forward pre-hook (``_skip_fused_transformer_path``); the layer then runs its plain Python path, which
calls this module.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from . import functional
from ._base import AbstractBatchModule, current_forward, stack_copies
from ._linear import LinearWeights

__all__ = ["MultiheadAttention"]


def _skip_fused_transformer_path(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook: its presence makes torch's Transformer layers skip their fused kernels."""
    return None


class MultiheadAttention(AbstractBatchModule):
    r"""``batch`` independent :class:`torch.nn.MultiheadAttention` layers as one module.

    Takes torch's constructor arguments and ``forward`` arguments; every per-sample tensor carries the
    model axis merged into its batch dim (models-major: sample ``i`` of model ``b`` is ``b * N + i``).

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first: as
            :class:`torch.nn.MultiheadAttention`.
        batch: number of models B.

    Shape:
        - query: ``(B*N, L, E)`` if ``batch_first`` else ``(L, B*N, E)``; unbatched models (one
          ``(L, E)`` query each) give ``(B*L, E)``. Inside a shared-input ``BatchModule`` forward, the
          shared ``(N, L, E)`` (or ``(L, N, E)``) tensor is accepted and seen by every model.
        - key, value: like query, with source length ``S`` and ``kdim`` / ``vdim`` features.
        - key_padding_mask: ``(B*N, S)`` (per model), or ``(N, S)``: one mask for every model.
          Unbatched: ``(B*S,)`` or ``(S,)``.
        - attn_mask: ``(L, S)`` shared by every model and sample, ``(B*L, S)`` one per model,
          ``(N*num_heads, L, S)`` shared by the models, or ``(B*N*num_heads, L, S)`` per model and
          sample (the merged batch of ``B*N`` rows, each with its ``num_heads`` masks).
        - Output: attention output in the query's layout; attention weights (``need_weights=True``)
          ``(B*N, L, S)`` or, with ``average_attn_weights=False``, ``(B*N, num_heads, L, S)``.

    Attributes:
        in_proj_weight: ``(B, 3*embed_dim, embed_dim)`` (when ``kdim == vdim == embed_dim``), else
            ``q_proj_weight`` ``(B, E, E)``, ``k_proj_weight`` ``(B, E, kdim)``, ``v_proj_weight``
            ``(B, E, vdim)``.
        in_proj_bias: ``(B, 3*embed_dim)``; ``out_proj.weight`` ``(B, E, E)``, ``out_proj.bias`` ``(B, E)``;
        bias_k, bias_v: ``(B, 1, 1, E)`` with ``add_bias_kv``.

    Dropout on the attention weights draws independent masks for every model and sample.

    Examples::

        >>> mha = MultiheadAttention(16, 4, batch_first=True, batch=3)
        >>> x = torch.randn(3 * 2, 5, 16)
        >>> out, weights = mha(x, x, x)
        >>> out.shape, weights.shape
        (torch.Size([6, 5, 16]), torch.Size([6, 5, 5]))
    """

    base_class: ClassVar[type[nn.Module]] = nn.MultiheadAttention
    merged_order = "models"

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        *,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and num_heads={num_heads}"
            )
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        super().__init__(batch)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(batch, 3 * embed_dim, embed_dim, **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(batch, embed_dim, embed_dim, **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty(batch, embed_dim, self.kdim, **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty(batch, embed_dim, self.vdim, **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(batch, 3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = LinearWeights(batch, embed_dim, embed_dim, bias, factory_kwargs)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(batch, 1, 1, embed_dim, **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty(batch, 1, 1, embed_dim, **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.register_forward_pre_hook(_skip_fused_transformer_path)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every model's slice as building ``nn.MultiheadAttention`` does, model after model."""
        for i in range(self.batch):
            # nn.MultiheadAttention first builds out_proj (an nn.Linear), then calls _reset_parameters.
            nn.init.kaiming_uniform_(self.out_proj.weight[i], a=math.sqrt(5))
            if self.out_proj.bias is not None:
                bound = 1 / math.sqrt(self.embed_dim)
                nn.init.uniform_(self.out_proj.bias[i], -bound, bound)
            if self._qkv_same_embed_dim:
                nn.init.xavier_uniform_(self.in_proj_weight[i])
            else:
                nn.init.xavier_uniform_(self.q_proj_weight[i])
                nn.init.xavier_uniform_(self.k_proj_weight[i])
                nn.init.xavier_uniform_(self.v_proj_weight[i])
            if self.in_proj_bias is not None:
                nn.init.constant_(self.in_proj_bias[i], 0.0)
                nn.init.constant_(self.out_proj.bias[i], 0.0)
            if self.bias_k is not None:
                nn.init.xavier_normal_(self.bias_k[i])
                nn.init.xavier_normal_(self.bias_v[i])

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention, batch: int) -> MultiheadAttention:
        reference = module.out_proj.weight
        layer = cls(
            module.embed_dim,
            module.num_heads,
            module.dropout,
            module.in_proj_bias is not None,
            module.bias_k is not None,
            module.add_zero_attn,
            module.kdim,
            module.vdim,
            module.batch_first,
            batch=batch,
            device=reference.device,
            dtype=reference.dtype,
        )
        with torch.no_grad():
            for name, target in layer.named_parameters():
                source = module.get_parameter(name)
                target.copy_(stack_copies(source, batch).view(target.shape))
        return layer

    def _check_rows(self, x: Tensor, batched: bool, what: str) -> bool:
        """Refuse a query/key/value whose merged dim cannot hold B models' samples; whether it is shared."""
        if not batched:
            if x.dim() != 2:
                raise ValueError(f"{type(self).__name__}: expected a 2-D unbatched {what}, got shape {tuple(x.shape)}")
            if self.is_shared(x):
                return True
            if x.shape[0] % self.batch:
                raise ValueError(
                    f"{type(self).__name__}: expected the unbatched {what}'s dim 0 to be a multiple of B = "
                    f"{self.batch} (models' sequences one after another), got shape {tuple(x.shape)}"
                )
            return False
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected a 3-D {what}, got shape {tuple(x.shape)}")
        rows = x if self.batch_first else x.transpose(0, 1)
        if self.is_shared(rows):
            return True
        context = current_forward()
        step = self.batch * (context.samples if context is not None else 1)
        if rows.shape[0] % step:
            dim = 0 if self.batch_first else 1
            where = f"B * n = {self.batch} * {context.samples}" if context is not None else f"B = {self.batch}"
            raise ValueError(
                f"{type(self).__name__}: expected {what} dim {dim} (batch_first={self.batch_first}) to be a multiple "
                f"of {where} (the merged model axis), got shape {tuple(x.shape)}; a sequence-first model must "
                "take batch-first inputs at the BatchModule boundary and transpose them itself"
            )
        return False

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        for what, tensor in (("query", query), ("key", key), ("value", value)):
            if tensor.is_nested:
                raise ValueError(
                    f"{type(self).__name__}: got a nested tensor as {what}. nn.TransformerEncoder converts its input "
                    "to a nested tensor in eval mode without gradients when given src_key_padding_mask; set "
                    "`encoder.use_nested_tensor = False` on the model before batching it"
                )
        batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"{type(self).__name__}: query, key and value must all be batched (3-D) or unbatched (2-D), got "
                f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        for what, tensor, features in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if tensor.shape[-1] != features:
                raise ValueError(
                    f"{type(self).__name__}: expected {what} with {features} features, got shape {tuple(tensor.shape)}"
                )
        shared_query = self._check_rows(query, batched, "query")
        shared_key = shared_query if key is query else self._check_rows(key, batched, "key")
        if value is key or value is query:
            shared_value = shared_key if value is key else shared_query
        else:
            shared_value = self._check_rows(value, batched, "value")
        return functional.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias, self.bias_k,
            self.bias_v, self.add_zero_attn, self.dropout, self.out_proj.weight, self.out_proj.bias, self.training,
            key_padding_mask, need_weights, attn_mask, not self._qkv_same_embed_dim, self.q_proj_weight,
            self.k_proj_weight, self.v_proj_weight, average_attn_weights=average_attn_weights, is_causal=is_causal,
            layout=self.layout, batch_first=self.batch_first, shared=(shared_query, shared_key, shared_value),
        )  # fmt: skip

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if not self._qkv_same_embed_dim:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.in_proj_bias is None:
            parts.append("bias=False")
        if self.bias_k is not None:
            parts.append("add_bias_kv=True")
        if self.add_zero_attn:
            parts.append("add_zero_attn=True")
        if self.batch_first:
            parts.append("batch_first=True")
        parts.append(f"batch={self.batch}")
        return ", ".join(parts)
