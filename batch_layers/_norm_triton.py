"""Triton kernels for layer and RMS norms whose weight and bias differ per model.

B models' per-sample norms normalise the merged ``(B*n, ..., D)`` rows with torch's kernel and apply each
model's affine as a broadcast product and sum on the ``(B, n, ...)`` view: six activation-sized operators
per norm (forward ``mul`` and ``add``; backward three ``mul`` and two ``sum``) that the plain model's
``native_layer_norm`` does inside its own kernels. Here the forward normalises each row and applies its
model's weight and bias in one launch (saving each row's mean and inverse standard deviation, as torch's
kernel does), and the backward computes the input gradient and every program's partial sums of its model's
weight and bias gradients in one launch, which one more launch adds up per model (as in Triton's layer-norm
tutorial, with a model's rows in place of all rows).

Row ``r`` of the flattened ``(rows, D)`` input belongs to merged index ``r // inner`` of dim 0 (``inner``: the
rows one dim-0 entry holds, e.g. a sequence's tokens) and so to model ``index // n`` (models-major) or
``index % B`` (samples-major).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from ._layout import Layout

__all__ = ["MAX_FEATURES", "norm_affine_backward", "norm_affine_forward"]

MAX_FEATURES = 8192
"""The most features one program normalises (a row is held in registers)."""
FORWARD_TILE, BACKWARD_TILE = 4096, 2048
"""Elements one program holds per step where rows are short (the backward keeps two float32 accumulator
tiles besides its operands, so it takes fewer rows at a time)."""
FORWARD_PER_THREAD, BACKWARD_PER_THREAD = 8, 4
"""Elements of a tile per thread: for 192 features (tiles of 16 and 8 rows of 256), ptxas gives the forward 64
and the backward 59 registers on sm_90, where 16 elements per thread took 115 and 154 (fewer programs
resident to keep loads in flight): chosen by register counts; ``tests/benchmarks/bench_norm_affine.py --tune``
times the others."""
PROGRAMS_PER_SM = 8
"""Backward programs per multiprocessor: each streams its model's rows in order and keeps its partial sums of
the weight and bias gradients, so more programs mean more partial sums but more loads in flight."""


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(
        x, w, b, y, mean, rstd,
        ROWS, D, INNER, PER_MODEL, BATCH, eps,
        SAMPLES_MAJOR: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < ROWS
        inside = row_ok[:, None] & (cols < D)[None, :]
        offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
        xs = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        if RMS:
            centred = xs
        else:
            mu = tl.sum(xs, axis=1) / D
            centred = tl.where(inside, xs - mu[:, None], 0.0)
            tl.store(mean + rows, mu, mask=row_ok)
        inverse = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + eps)
        tl.store(rstd + rows, inverse, mask=row_ok)
        out = centred * inverse[:, None]
        index = rows // INNER
        if SAMPLES_MAJOR:
            model = index % BATCH
        else:
            model = index // PER_MODEL
        params = model.to(tl.int64)[:, None] * D + cols[None, :]
        if HAS_W:
            out = out * tl.load(w + params, mask=inside, other=0.0).to(tl.float32)
        if HAS_B:
            out = out + tl.load(b + params, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + offsets, out.to(y.dtype.element_ty), mask=inside)

    @triton.jit
    def backward(
        x, w, dy, mean, rstd, dx, partial_w, partial_b,
        D, INNER, PER_MODEL, BATCH, CHUNK,
        SAMPLES_MAJOR: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr,
        NEEDS_DX: tl.constexpr, NEEDS_DW: tl.constexpr, NEEDS_DB: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        model = tl.program_id(0)
        split = tl.program_id(1)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        if HAS_W:
            weight = tl.load(w + model * D + cols, mask=col_ok, other=0.0).to(tl.float32)
        model_rows = PER_MODEL * INNER
        stop = tl.minimum(split * CHUNK + CHUNK, model_rows)
        acc_w = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)  # summed across rows once, at the end
        acc_b = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for start in range(split * CHUNK, stop, BLOCK_R):
            j = start + tl.arange(0, BLOCK_R)  # the model's own rows, in order
            row_ok = j < stop
            if SAMPLES_MAJOR:
                rows = ((j // INNER) * BATCH + model).to(tl.int64) * INNER + j % INNER
            else:
                rows = model.to(tl.int64) * model_rows + j
            inside = row_ok[:, None] & col_ok[None, :]
            offsets = rows[:, None] * D + cols[None, :]
            xs = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
            inverse = tl.load(rstd + rows, mask=row_ok, other=0.0)
            if RMS:
                normalised = xs * inverse[:, None]
            else:
                mu = tl.load(mean + rows, mask=row_ok, other=0.0)
                normalised = tl.where(inside, (xs - mu[:, None]) * inverse[:, None], 0.0)
            if NEEDS_DX:
                if HAS_W:
                    scaled = g * weight[None, :]
                else:
                    scaled = g
                c1 = tl.sum(normalised * scaled, axis=1) / D
                if RMS:
                    grad = (scaled - normalised * c1[:, None]) * inverse[:, None]
                else:
                    c2 = tl.sum(scaled, axis=1) / D
                    grad = (scaled - normalised * c1[:, None] - c2[:, None]) * inverse[:, None]
                tl.store(dx + offsets, grad.to(dx.dtype.element_ty), mask=inside)
            if NEEDS_DW:
                acc_w += g * normalised
            if NEEDS_DB:
                acc_b += g
        partial = (split * BATCH + model) * D + cols
        if NEEDS_DW:
            tl.store(partial_w + partial, tl.sum(acc_w, axis=0), mask=col_ok)
        if NEEDS_DB:
            tl.store(partial_b + partial, tl.sum(acc_b, axis=0), mask=col_ok)

    @triton.jit
    def add_partials(
        partial_w, partial_b, dw, db, SIZE, SPLITS,
        NEEDS_DW: tl.constexpr, NEEDS_DB: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < SIZE
        sum_w = tl.zeros((BLOCK,), dtype=tl.float32)
        sum_b = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in range(0, SPLITS):
            if NEEDS_DW:
                sum_w += tl.load(partial_w + split * SIZE + i, mask=ok, other=0.0)
            if NEEDS_DB:
                sum_b += tl.load(partial_b + split * SIZE + i, mask=ok, other=0.0)
        if NEEDS_DW:
            tl.store(dw + i, sum_w.to(dw.dtype.element_ty), mask=ok)
        if NEEDS_DB:
            tl.store(db + i, sum_b.to(db.dtype.element_ty), mask=ok)

    return forward, backward, add_partials


def _on_device(x: Tensor):
    """Triton launches on the current CUDA device: make it ``x``'s (nothing to do for a CPU tensor, which
    only Triton's interpreter runs)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _blocks(features: int, tile: int, per_thread: int) -> tuple[int, int, int]:
    """Features and rows per program (a ``tile`` of elements where rows are short), and warps (``per_thread``
    elements of a tile each, at most 16 warps), for rows of ``features``."""
    import triton

    block_d = triton.next_power_of_2(features)
    block_r = max(1, min(32, tile // block_d))
    return block_r, block_d, max(4, min(16, block_r * block_d // (32 * per_thread)))


def norm_affine_forward(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, features: int, eps: float, layout: Layout, rms: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """The normalised rows of ``features`` of the contiguous merged ``(B*n, ...)`` input ``x``, in ``out_dtype``,
    each with its model's ``(B, features)`` ``weight`` and ``bias`` applied (either may be None; contiguous),
    and each row's mean (empty for an RMS norm) and inverse standard deviation (``(rows,)``, float32)."""
    rows = x.numel() // features
    batch, samples_major = layout.batch, layout.order == "samples"
    # (new_empty: a forward that tracks which tensors hold the models' data sees the results come from x)
    y = x.new_empty(x.shape, dtype=out_dtype)
    mean = x.new_empty(0 if rms else rows, dtype=torch.float32)
    rstd = x.new_empty(rows, dtype=torch.float32)
    if rows == 0:
        return y, mean, rstd
    import triton

    block_r, block_d, warps = _blocks(features, FORWARD_TILE, FORWARD_PER_THREAD)
    with _on_device(x):
        _kernels()[0][(triton.cdiv(rows, block_r),)](
            x, x if weight is None else weight, x if bias is None else bias, y, mean if not rms else rstd, rstd,
            rows, features, rows // x.shape[0], x.shape[0] // batch, batch, eps,
            SAMPLES_MAJOR=samples_major, RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
    return y, mean, rstd


def _splits(device: torch.device, batch: int, model_rows: int, block_r: int) -> int:
    """How many programs share one model's rows in the backward: :data:`PROGRAMS_PER_SM` per multiprocessor
    over all models, each with at least a few blocks of rows (fewer partial sums to add up)."""
    import triton

    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    programs = PROGRAMS_PER_SM * multiprocessors
    return max(1, min(triton.cdiv(programs, batch), triton.cdiv(model_rows, 4 * block_r)))


def norm_affine_backward(
    grad: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, features: int, layout: Layout,
    rms: bool, needs: tuple[bool, bool, bool], param_dtype: torch.dtype,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """From the gradient ``grad`` of :func:`norm_affine_forward`'s output, the gradients of the input (as
    ``x``), the weight and the bias (``(B, features)`` in ``param_dtype``), each only where ``needs`` asks."""
    needs_dx, needs_dw, needs_db = needs
    batch, samples_major = layout.batch, layout.order == "samples"
    rows = x.numel() // features
    if rows == 0:
        zeros = x.new_zeros(batch, features, dtype=param_dtype)
        return torch.empty_like(x) if needs_dx else None, zeros if needs_dw else None, zeros if needs_db else None
    import triton

    inner = rows // x.shape[0]
    per_model = x.shape[0] // batch
    block_r, block_d, warps = _blocks(features, BACKWARD_TILE, BACKWARD_PER_THREAD)
    splits = _splits(x.device, batch, per_model * inner, block_r)
    chunk = triton.cdiv(triton.cdiv(per_model * inner, splits), block_r) * block_r
    splits = triton.cdiv(per_model * inner, chunk)
    grad = grad.contiguous()
    dx = torch.empty_like(x) if needs_dx else None
    # every program writes its partial sums of every feature: nothing to zero
    partial_w = x.new_empty(splits, batch, features, dtype=torch.float32) if needs_dw else None
    partial_b = x.new_empty(splits, batch, features, dtype=torch.float32) if needs_db else None
    dw = x.new_empty(batch, features, dtype=param_dtype) if needs_dw else None
    db = x.new_empty(batch, features, dtype=param_dtype) if needs_db else None
    _, backward, add_partials = _kernels()
    with _on_device(x):
        backward[(batch, splits)](
            x, x if weight is None else weight, grad, mean if not rms else rstd, rstd,
            x if dx is None else dx, x if partial_w is None else partial_w, x if partial_b is None else partial_b,
            features, inner, per_model, batch, chunk,
            SAMPLES_MAJOR=samples_major, RMS=rms, HAS_W=weight is not None,
            NEEDS_DX=needs_dx, NEEDS_DW=needs_dw, NEEDS_DB=needs_db,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
        if needs_dw or needs_db:
            size = batch * features
            add_partials[(triton.cdiv(size, 1024),)](
                x if partial_w is None else partial_w, x if partial_b is None else partial_b,
                x if dw is None else dw, x if db is None else db, size, splits,
                NEEDS_DW=needs_dw, NEEDS_DB=needs_db, BLOCK=1024,
            )  # fmt: skip
    return dx, dw, db
