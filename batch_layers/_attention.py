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
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import AbstractBatchModule, current_forward, stack_copies

__all__ = ["MultiheadAttention"]


def _skip_fused_transformer_path(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook: its presence makes torch's Transformer layers skip their fused kernels."""
    return None


class _Projection(nn.Module):
    """``(B, out, in)`` weight and ``(B, out)`` bias of a projection whose owner draws its initial values."""

    def __init__(self, batch: int, out_features: int, in_features: int, bias: bool, factory_kwargs: dict) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(batch, out_features, in_features, **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(batch, out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _project(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``(B, m, in) @ (B, out, in)^T + (B, out)`` as one batched product."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


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
        self.out_proj = _Projection(batch, embed_dim, embed_dim, bias, factory_kwargs)
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

    # -- layout helpers ---------------------------------------------------------------------------
    def _by_model(self, x: Tensor, batched: bool, what: str) -> Tensor:
        """``(B, N, T, F)`` (a view where possible) from a merged query/key/value in this layer's layout."""
        if not batched:
            if x.dim() != 2:
                raise ValueError(f"{type(self).__name__}: expected a 2-D unbatched {what}, got shape {tuple(x.shape)}")
            if self.is_shared(x):
                return x.expand(self.batch, 1, *x.shape)
            if x.shape[0] % self.batch:
                raise ValueError(
                    f"{type(self).__name__}: expected the unbatched {what}'s dim 0 to be a multiple of B = "
                    f"{self.batch} (models' sequences one after another), got shape {tuple(x.shape)}"
                )
            return x.view(self.batch, 1, -1, x.shape[-1])
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected a 3-D {what}, got shape {tuple(x.shape)}")
        if not self.batch_first:
            x = x.transpose(0, 1)
        if self.is_shared(x):
            return x.expand(self.batch, *x.shape)
        context = current_forward()
        step = self.batch * (context.samples if context is not None else 1)
        if x.shape[0] % step:
            dim = 0 if self.batch_first else 1
            where = f"B * n = {self.batch} * {context.samples}" if context is not None else f"B = {self.batch}"
            raise ValueError(
                f"{type(self).__name__}: expected {what} dim {dim} (batch_first={self.batch_first}) to be a multiple "
                f"of {where} (the merged model axis), got shape {tuple(x.shape)}; a sequence-first model must "
                "take batch-first inputs at the BatchModule boundary and transpose them itself"
            )
        return x.reshape(self.batch, -1, *x.shape[1:])

    def _padding_mask(self, mask: Tensor, per_model: int, src_len: int) -> Tensor:
        """A key padding mask as ``(B*N, S)`` (or broadcastable ``(1, S)`` rows when one mask serves all)."""
        if mask.dim() == 1:  # unbatched models: (B*S,) or (S,)
            if mask.shape[0] == src_len:
                return mask.unsqueeze(0).expand(self.batch, src_len)
            if mask.shape[0] == self.batch * src_len:
                return mask.view(self.batch, src_len)
        elif mask.dim() == 2 and mask.shape[1] == src_len:
            if mask.shape[0] == self.batch * per_model:
                return mask
            if mask.shape[0] == per_model:
                return mask.unsqueeze(0).expand(self.batch, *mask.shape).reshape(-1, src_len)
        expected = f"({self.batch * per_model}, {src_len}) or ({per_model}, {src_len})"
        if per_model == 1:
            expected += f" (or ({self.batch * src_len},) / ({src_len},) for unbatched models)"
        raise ValueError(
            f"{type(self).__name__}: expected key_padding_mask of shape {expected}, got {tuple(mask.shape)}"
        )

    def _attention_mask(self, mask: Tensor, per_model: int, tgt_len: int, src_len: int, batched: bool) -> Tensor:
        """An attention mask broadcastable to ``(B*N, num_heads, L, S)``."""
        heads = self.num_heads
        if mask.dim() == 2:
            if mask.shape == (tgt_len, src_len):
                return mask.view(1, 1, tgt_len, src_len)
            if mask.shape == (self.batch * tgt_len, src_len):
                mask = mask.view(self.batch, 1, 1, tgt_len, src_len).expand(-1, per_model, -1, -1, -1)
                return mask.reshape(self.batch * per_model, 1, tgt_len, src_len)
        elif mask.dim() == 3 and mask.shape[1:] == (tgt_len, src_len):
            if mask.shape[0] == self.batch * per_model * heads:
                return mask.view(self.batch * per_model, heads, tgt_len, src_len)
            if mask.shape[0] == per_model * heads:
                mask = mask.view(1, per_model, heads, tgt_len, src_len).expand(self.batch, -1, -1, -1, -1)
                return mask.reshape(self.batch * per_model, heads, tgt_len, src_len)
        n = "" if not batched else f"{per_model}*"
        raise ValueError(
            f"{type(self).__name__}: expected attn_mask of shape ({tgt_len}, {src_len}) (shared), "
            f"({self.batch}*{tgt_len}, {src_len}) (one per model), ({n}{heads}, {tgt_len}, {src_len}) (shared) or "
            f"({self.batch}*{n}{heads}, {tgt_len}, {src_len}) (per model), got {tuple(mask.shape)}"
        )

    # -- forward ----------------------------------------------------------------------------------
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
        self_attention = query is key and key is value
        q_in = self._by_model(query, batched, "query")  # (B, N, L, E)
        k_in = q_in if key is query else self._by_model(key, batched, "key")
        v_in = k_in if value is key else q_in if value is query else self._by_model(value, batched, "value")
        if k_in.shape[:2] != q_in.shape[:2] or v_in.shape[:3] != k_in.shape[:3]:
            raise ValueError(
                f"{type(self).__name__}: query, key and value disagree on batch or key/value on source length: "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        batch, per_model, tgt_len, _ = q_in.shape
        src_len = k_in.shape[2]
        rows = batch * per_model

        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask."
            )
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None
        else:
            attn_mask = F._canonical_mask(
                mask=attn_mask,
                mask_name="attn_mask",
                other_type=None,
                other_name="",
                target_type=query.dtype,
                check_other=False,
            )
            if key_padding_mask is not None:
                is_causal = False

        q, k, v = self._in_projection(q_in, k_in, v_in, self_attention)  # (B, N*T, E) each
        heads, head_dim = self.num_heads, self.head_dim
        q = q.view(rows, tgt_len, heads, head_dim).transpose(1, 2)
        k = k.view(rows, src_len, heads, head_dim).transpose(1, 2)
        v = v.view(rows, src_len, heads, head_dim).transpose(1, 2)

        if attn_mask is not None:
            attn_mask = self._attention_mask(attn_mask, per_model, tgt_len, src_len, batched)
        if key_padding_mask is not None:
            key_padding_mask = self._padding_mask(key_padding_mask, per_model, src_len)
        extra = 0
        if self.bias_k is not None:
            bias_k = self.bias_k.view(batch, 1, heads, 1, head_dim).expand(-1, per_model, -1, -1, -1)
            bias_v = self.bias_v.view(batch, 1, heads, 1, head_dim).expand(-1, per_model, -1, -1, -1)
            k = torch.cat([k, bias_k.reshape(rows, heads, 1, head_dim)], dim=2)
            v = torch.cat([v, bias_v.reshape(rows, heads, 1, head_dim)], dim=2)
            extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(rows, heads, 1, head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(rows, heads, 1, head_dim)], dim=2)
            extra += 1
        if extra:
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, extra))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, extra))
        if key_padding_mask is not None:
            padding = key_padding_mask.view(-1, 1, 1, src_len + extra)
            attn_mask = padding if attn_mask is None else attn_mask + padding
        dropout_p = self.dropout if self.training else 0.0

        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
            if attn_mask is not None:
                scores = scores + attn_mask
            weights = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            attended = torch.matmul(weights, v)
        else:
            weights = None
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)

        attended = attended.transpose(1, 2).reshape(batch, per_model * tgt_len, self.embed_dim)
        out = _project(attended, self.out_proj.weight, self.out_proj.bias)
        out = self._to_layout(out.view(rows, tgt_len, self.embed_dim), batched)
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:  # unbatched models: (B*L, S) or (B*heads, L, S)
                weights = (
                    weights.reshape(batch * weights.shape[-2], -1) if average_attn_weights else weights.flatten(0, 1)
                )
        return out, weights

    def _in_projection(self, q_in: Tensor, k_in: Tensor, v_in: Tensor, self_attention: bool) -> tuple[Tensor, ...]:
        batch, embed = self.batch, self.embed_dim
        bias_q = bias_k = bias_v = None
        if self.in_proj_bias is not None:
            bias_q, bias_k, bias_v = self.in_proj_bias.chunk(3, dim=1)
        flat = [t.reshape(batch, -1, t.shape[-1]) for t in (q_in, k_in, v_in)]
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3, dim=1)
            if self_attention:
                return _project(flat[0], self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
            q = _project(flat[0], w_q, bias_q)
            if k_in is v_in:
                kv = _project(
                    flat[1], self.in_proj_weight[:, embed:], None if bias_k is None else self.in_proj_bias[:, embed:]
                )
                k, v = kv.chunk(2, dim=-1)
            else:
                k, v = _project(flat[1], w_k, bias_k), _project(flat[2], w_v, bias_v)
            return q, k, v
        return (
            _project(flat[0], self.q_proj_weight, bias_q),
            _project(flat[1], self.k_proj_weight, bias_k),
            _project(flat[2], self.v_proj_weight, bias_v),
        )

    def _to_layout(self, out: Tensor, batched: bool) -> Tensor:
        """``(B*N, L, E)`` to the layout of the query: seq-first, batch-first or unbatched ``(B*L, E)``.

        Sequence-first, torch's layer returns a contiguous ``(L, N, E)``; so does this one (a copy: the
        per-model output projection writes the rows model by model), so that code viewing the output as
        torch's keeps working."""
        if not batched:
            return out.reshape(-1, self.embed_dim)
        return out if self.batch_first else out.transpose(0, 1).contiguous()

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
