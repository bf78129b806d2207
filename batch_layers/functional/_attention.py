"""Batched ``F.multi_head_attention_forward``: B models' projections as batched products, one attention call.

Only the four projections (query, key, value, output) hold weights, so they run as ``bmm`` over the model
axis; scaled dot-product attention itself is per sample and runs once on the merged ``B*N`` batch (with
``F.scaled_dot_product_attention`` when the weights are not needed, on the kernel the attention table
chooses, ``batch_layers._attention_table``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._attention_table import scaled_dot_product_attention
from .._layout import Layout

__all__ = ["multi_head_attention_forward"]

_OWNER = "MultiheadAttention"


def _project(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``(B, m, in) @ (B, out, in)^T + (B, out)`` as one batched product."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def _by_model(x: Tensor, batched: bool, batch_first: bool, shared: bool, layout: Layout, what: str) -> Tensor:
    """``(B, N, T, F)`` (a view where possible) from a merged query/key/value in ``layout``."""
    batch = layout.batch
    if not batched:  # unbatched models: (B*T, F), each model's sequence a block of the merged dim 0
        if shared:
            return x.expand(batch, 1, *x.shape)
        rows = x
    else:
        rows = x if batch_first else x.transpose(0, 1)
        if shared:
            return rows.expand(batch, *rows.shape)
    if rows.shape[0] % batch:
        raise ValueError(
            f"{_OWNER}: expected {what}'s merged dim to be a multiple of B = {batch} (the merged model axis), got "
            f"shape {tuple(x.shape)}"
        )
    per_model = layout.split(rows)
    return per_model if batched else per_model.unsqueeze(1)


def _padding_mask(mask: Tensor, batch: int, per_model: int, src_len: int, layout: Layout) -> Tensor:
    """A key padding mask as models-major ``(B*N, S)`` rows."""
    if mask.dim() == 1:  # unbatched models: (B*S,) or (S,)
        if mask.shape[0] == src_len:
            return mask.unsqueeze(0).expand(batch, src_len)
        if mask.shape[0] == batch * src_len:
            return layout.split(mask).reshape(batch, src_len)
    elif mask.dim() == 2 and mask.shape[1] == src_len:
        if mask.shape[0] == batch * per_model:
            return mask if layout.order == "models" else layout.split(mask).reshape(-1, src_len)
        if mask.shape[0] == per_model:
            return mask.unsqueeze(0).expand(batch, *mask.shape).reshape(-1, src_len)
    expected = f"({batch * per_model}, {src_len}) or ({per_model}, {src_len})"
    if per_model == 1:
        expected += f" (or ({batch * src_len},) / ({src_len},) for unbatched models)"
    raise ValueError(f"{_OWNER}: expected key_padding_mask of shape {expected}, got {tuple(mask.shape)}")


def _attention_mask(
    mask: Tensor, batch: int, heads: int, per_model: int, tgt_len: int, src_len: int, batched: bool, layout: Layout
) -> Tensor:
    """An attention mask broadcastable to models-major ``(B*N, num_heads, L, S)``."""
    if mask.dim() == 2:
        if mask.shape == (tgt_len, src_len):
            return mask.view(1, 1, tgt_len, src_len)
        if mask.shape == (batch * tgt_len, src_len):
            mask = layout.split(mask).view(batch, 1, 1, tgt_len, src_len).expand(-1, per_model, -1, -1, -1)
            return mask.reshape(batch * per_model, 1, tgt_len, src_len)
    elif mask.dim() == 3 and mask.shape[1:] == (tgt_len, src_len):
        if mask.shape[0] == batch * per_model * heads:
            return layout.split(mask).reshape(batch * per_model, heads, tgt_len, src_len)
        if mask.shape[0] == per_model * heads:
            mask = mask.view(1, per_model, heads, tgt_len, src_len).expand(batch, -1, -1, -1, -1)
            return mask.reshape(batch * per_model, heads, tgt_len, src_len)
    n = "" if not batched else f"{per_model}*"
    raise ValueError(
        f"{_OWNER}: expected attn_mask of shape ({tgt_len}, {src_len}) (shared), "
        f"({batch}*{tgt_len}, {src_len}) (one per model), ({n}{heads}, {tgt_len}, {src_len}) (shared) or "
        f"({batch}*{n}{heads}, {tgt_len}, {src_len}) (per model), got {tuple(mask.shape)}"
    )


def _in_projection(
    q_in: Tensor,
    k_in: Tensor,
    v_in: Tensor,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    separate: tuple[Tensor, Tensor, Tensor] | None,
) -> tuple[Tensor, ...]:
    """The query, key and value projections, ``(B, N*T, E)`` each; one product where inputs coincide."""
    batch = q_in.shape[0]
    bias_q = bias_k = bias_v = None
    if in_proj_bias is not None:
        bias_q, bias_k, bias_v = in_proj_bias.chunk(3, dim=1)
    flat = [t.reshape(batch, -1, t.shape[-1]) for t in (q_in, k_in, v_in)]
    if separate is not None:
        return tuple(_project(x, w, b) for x, w, b in zip(flat, separate, (bias_q, bias_k, bias_v)))
    embed = in_proj_weight.shape[1] // 3
    if q_in is k_in and k_in is v_in:
        return _project(flat[0], in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    w_q, w_k, w_v = in_proj_weight.chunk(3, dim=1)
    q = _project(flat[0], w_q, bias_q)
    if k_in is v_in:
        kv = _project(flat[1], in_proj_weight[:, embed:], None if bias_k is None else in_proj_bias[:, embed:])
        k, v = kv.chunk(2, dim=-1)
    else:
        k, v = _project(flat[1], w_k, bias_k), _project(flat[2], w_v, bias_v)
    return q, k, v


def multi_head_attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    static_k: Tensor | None = None,
    static_v: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    *,
    layout: Layout,
    batch_first: bool = False,
    shared: tuple[bool, bool, bool] = (False, False, False),
) -> tuple[Tensor, Tensor | None]:
    """``F.multi_head_attention_forward`` of B models: each model's projections, one attention call.

    Takes torch's arguments; every weight carries a leading model axis (``in_proj_weight``
    ``(B, 3E, E)``, ``in_proj_bias`` ``(B, 3E)``, ``bias_k``/``bias_v`` ``(B, 1, 1, E)``, ``out_proj_weight``
    ``(B, E, E)``, ``q/k/v_proj_weight`` ``(B, E, E/kdim/vdim)``), and every per-sample tensor carries the
    model axis merged into its batch dim in ``layout``'s order.

    Args:
        query, key, value: ``(L, B*N, E)`` (``(B*N, L, E)`` with ``batch_first``), or ``(B*L, E)`` for
            unbatched models; a shared one is ``(L, N, E)`` / ``(N, L, E)`` / ``(L, E)``.
        key_padding_mask: ``(B*N, S)`` (per model) or ``(N, S)`` (one for every model); unbatched ``(B*S,)``
            or ``(S,)``.
        attn_mask: ``(L, S)`` shared by every model and sample, ``(B*L, S)`` one per model,
            ``(N*num_heads, L, S)`` shared by the models, or ``(B*N*num_heads, L, S)`` per model and sample.
        static_k, static_v: not supported (``None``): torch's modules never pass them.
        layout: the number of models and the order of the merged batch dim.
        batch_first: whether batched inputs (and the output) are ``(B*N, L, E)`` rather than sequence-first.
        shared: whether ``query``, ``key``, ``value`` are each the input shared by all models.

    Returns:
        the attention output in the query's layout (sequence-first: contiguous, as torch's) and, with
        ``need_weights``, the weights ``(B*N, L, S)`` (``(B*N, num_heads, L, S)`` without averaging).
    """
    if static_k is not None or static_v is not None:
        raise ValueError(f"{_OWNER}: static_k and static_v are not supported by the batched attention; pass None")
    batch = layout.batch
    batched = query.dim() == 3
    if query.shape[-1] != embed_dim_to_check:
        raise ValueError(
            f"{_OWNER}: expected query with {embed_dim_to_check} features, got shape {tuple(query.shape)}"
        )
    q_in = _by_model(query, batched, batch_first, shared[0], layout, "query")  # (B, N, L, E)
    k_in = q_in if key is query else _by_model(key, batched, batch_first, shared[1], layout, "key")
    if value is key or value is query:
        v_in = k_in if value is key else q_in
    else:
        v_in = _by_model(value, batched, batch_first, shared[2], layout, "value")
    if k_in.shape[:2] != q_in.shape[:2] or v_in.shape[:3] != k_in.shape[:3]:
        raise ValueError(
            f"{_OWNER}: query, key and value disagree on batch or key/value on source length: "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    _, per_model, tgt_len, embed_dim = q_in.shape
    src_len = k_in.shape[2]
    rows = batch * per_model
    heads, head_dim = num_heads, embed_dim // num_heads

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

    separate = (q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight else None
    q, k, v = _in_projection(q_in, k_in, v_in, in_proj_weight, in_proj_bias, separate)  # (B, N*T, E) each
    q = q.view(rows, tgt_len, heads, head_dim).transpose(1, 2)
    k = k.view(rows, src_len, heads, head_dim).transpose(1, 2)
    v = v.view(rows, src_len, heads, head_dim).transpose(1, 2)

    if attn_mask is not None:
        attn_mask = _attention_mask(attn_mask, batch, heads, per_model, tgt_len, src_len, batched, layout)
    if key_padding_mask is not None:
        key_padding_mask = _padding_mask(key_padding_mask, batch, per_model, src_len, layout)
    extra = 0
    if bias_k is not None:
        bias_k = bias_k.view(batch, 1, heads, 1, head_dim).expand(-1, per_model, -1, -1, -1)
        bias_v = bias_v.view(batch, 1, heads, 1, head_dim).expand(-1, per_model, -1, -1, -1)
        k = torch.cat([k, bias_k.reshape(rows, heads, 1, head_dim)], dim=2)
        v = torch.cat([v, bias_v.reshape(rows, heads, 1, head_dim)], dim=2)
        extra += 1
    if add_zero_attn:
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
    dropout_p = dropout_p if training else 0.0

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
        attended = scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)

    attended = attended.transpose(1, 2).reshape(batch, per_model * tgt_len, embed_dim)
    out = _project(attended, out_proj_weight, out_proj_bias).view(batch, per_model, tgt_len, embed_dim)
    out = _to_layout(out, batched, batch_first, layout)
    if weights is not None:
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if batched:
            weights = layout.merge(weights.view(batch, per_model, *weights.shape[1:]))
        else:  # unbatched models: (B*L, S) or (B*heads, L, S)
            weights = layout.merge(weights.view(batch, *weights.shape[1:]))
    return out, weights


def _to_layout(out: Tensor, batched: bool, batch_first: bool, layout: Layout) -> Tensor:
    """``(B, N, L, E)`` to the layout of the query: sequence-first, batch-first or unbatched ``(B*L, E)``.

    Sequence-first, torch's layer returns a contiguous ``(L, N, E)``; so does this one (a copy: the
    per-model output projection writes the rows model by model), so that code viewing the output as
    torch's keeps working."""
    if not batched:
        return layout.merge(out.squeeze(1))
    merged = layout.merge(out)  # (B*N, L, E)
    return merged if batch_first else merged.transpose(0, 1).contiguous()
