"""Per-model losses and accuracies over ``(B, n, ...)`` outputs, and the merged-axis helpers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

__all__ = ["batch_accuracy", "batch_loss", "batch_topk", "merge_batch", "split_batch"]

Reduction = Literal["mean", "sum", "none"]


def merge_batch(x: Tensor) -> Tensor:
    """``(B, n, ...)`` to the merged ``(B*n, ...)`` layout (models-major) that batched layers take."""
    if x.dim() < 2:
        raise ValueError(f"merge_batch expects (B, n, ...), got shape {tuple(x.shape)}")
    return x.reshape(-1, *x.shape[2:])


def split_batch(x: Tensor, batch: int) -> Tensor:
    """The merged ``(B*n, ...)`` layout back to ``(B, n, ...)``."""
    if x.dim() == 0 or x.shape[0] % batch:
        raise ValueError(f"split_batch: dim 0 of shape {tuple(x.shape)} is not a multiple of batch={batch}")
    return x.view(batch, -1, *x.shape[1:])


def _legacy_batch(outputs: Tensor, args: tuple, name: str) -> tuple:
    """torchmb 0.2 passed the number of models as the third argument; check it and drop it."""
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        if args[0] != outputs.shape[0]:
            raise ValueError(
                f"{name}: batch={args[0]} but outputs have {outputs.shape[0]} models: {tuple(outputs.shape)}"
            )
        return args[1:]
    return args


def _check_targets(outputs: Tensor, targets: Tensor, name: str) -> int | None:
    """``in_dims`` for the targets: 0 for per-model ``(B, n, ...)``, None for shared ``(n, ...)``."""
    if outputs.dim() < 2:
        raise ValueError(f"{name} expects outputs of shape (B, n, ...), got {tuple(outputs.shape)}")
    if targets.dim() >= 1 and targets.shape[:2] == outputs.shape[:2]:
        return 0
    if targets.dim() >= 1 and targets.shape[0] == outputs.shape[1]:
        return None
    raise ValueError(
        f"{name}: targets of shape {tuple(targets.shape)} match neither the per-model (B, n, ...) = "
        f"{tuple(outputs.shape[:2])} nor a shared (n, ...) layout of outputs {tuple(outputs.shape)}"
    )


_CLASS_INDEX_LOSSES = (F.cross_entropy, F.nll_loss, F.multi_margin_loss)


def _check_class_target_shape(outputs: Tensor, targets: Tensor, name: str) -> None:
    """Class-index targets are the outputs' shape without the class dim 2: ``(B, n, ...)`` or shared ``(n, ...)``."""
    per_model = (*outputs.shape[:2], *outputs.shape[3:])
    if tuple(targets.shape) not in (per_model, per_model[1:]):
        raise ValueError(
            f"{name}: class-index targets must be (B, n, ...) = {per_model} (one row of n per model, the model axis "
            f"B first) or (n, ...) = {per_model[1:]} shared by all models, for outputs (B, n, C, ...) = "
            f"{tuple(outputs.shape)}; got {tuple(targets.shape)}"
        )


def _check_class_range(outputs: Tensor, targets: Tensor, name: str, ignore_index: int, error: Exception) -> None:
    """Raise naming the models whose class-index targets leave ``[0, C)`` (after ``error`` said something)."""
    classes = outputs.shape[2]
    bad = ((targets < 0) | (targets >= classes)) & (targets != ignore_index)
    if not bool(bad.any()):
        return
    per_model = bad.reshape(bad.shape[0], -1).any(1) if targets.dim() == outputs.dim() - 1 else bad.any().view(1)
    models = per_model.nonzero().flatten().tolist() if targets.dim() == outputs.dim() - 1 else "all (shared targets)"
    raise ValueError(
        f"{name}: class targets must lie in [0, C) = [0, {classes}) (outputs {tuple(outputs.shape)} have C = {classes} "
        f"classes in dim 2), got {targets[bad].unique().tolist()} for models {models}"
    ) from error


def _assert_classes_in_range(targets: Tensor, classes: int) -> None:
    """Refuse class targets outside ``[0, classes)``: on the host for CPU tensors; on the device otherwise (no
    synchronisation: a device-side assert, as torch's own indexing gives)."""
    in_range = ((targets >= 0) & (targets < classes)).all()
    message = f"batch_topk: class targets must lie in [0, C) = [0, {classes}) (C: the outputs' dim 2)"
    if targets.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(in_range, message)
    elif not bool(in_range):
        bad = targets[(targets < 0) | (targets >= classes)].unique().tolist()
        raise ValueError(f"{message}, got {bad}")


def batch_loss(
    outputs: Tensor,
    targets: Tensor,
    *args: Any,
    **loss_kwargs: Any,
) -> Tensor:
    """Each model's loss on its own outputs: ``loss_fn(outputs[i], targets[i], reduction=...)``.

    Call as ``batch_loss(outputs, targets, loss_fn=F.cross_entropy, reduction="mean")``; torchmb 0.2's
    ``batch_loss(outputs, targets, B, loss_fn, reduction)`` is accepted too. ``loss_fn`` is a functional
    loss that takes ``reduction=``; its exact per-model semantics are kept (``ignore_index``, class
    weights), because it is evaluated per model under ``torch.func.vmap``.

    Args:
        outputs: ``(B, n, ...)``.
        targets: ``(B, n, ...)``, or ``(n, ...)`` shared by all models.
        loss_fn: defaults to :func:`torch.nn.functional.cross_entropy`.
        reduction: ``"mean"`` or ``"sum"`` give ``(B,)``; ``"none"`` gives the per-sample ``(B, n, ...)``.
        **loss_kwargs: passed to ``loss_fn``.

    Returns:
        ``(B,)`` per-model losses (sum them for ``backward``: models do not interact).
    """
    args = _legacy_batch(outputs, args, "batch_loss")
    if len(args) > 2:
        raise TypeError(
            f"batch_loss takes (outputs, targets, loss_fn, reduction), got {2 + len(args)} positional arguments"
        )
    loss_fn: Callable[..., Tensor] = args[0] if args else loss_kwargs.pop("loss_fn", F.cross_entropy)
    reduction: Reduction = args[1] if len(args) > 1 else loss_kwargs.pop("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    target_dim = _check_targets(outputs, targets, "batch_loss")
    class_indices = loss_fn in _CLASS_INDEX_LOSSES and not targets.is_floating_point()
    if class_indices:
        _check_class_target_shape(outputs, targets, "batch_loss")
    try:
        return vmap(lambda o, t: loss_fn(o, t, reduction=reduction, **loss_kwargs), in_dims=(0, target_dim))(
            outputs, targets
        )
    except (RuntimeError, IndexError) as error:  # only on failure: say which targets are out of range
        if class_indices:
            _check_class_range(outputs, targets, "batch_loss", loss_kwargs.get("ignore_index", -100), error)
        raise


def batch_topk(outputs: Tensor, targets: Tensor, *args: Any, k: Sequence[int] | None = None) -> Tensor:
    """Per-model top-k accuracies, shape ``(len(k), B)``: row ``j`` is the top-``k[j]`` accuracy.

    Call as ``batch_topk(outputs, targets, k=(1, 5))`` (``k`` may also be the third positional argument);
    torchmb 0.2's ``batch_topk(outputs, targets, B, (1, 5))`` is accepted too.

    Args:
        outputs: ``(B, n, C, ...)`` scores; classes along dim 2.
        targets: ``(B, n, ...)`` class indices, or ``(n, ...)`` shared by all models.
        k: the cut-offs, default ``(1, 5)``.
    """
    args = _legacy_batch(outputs, args, "batch_topk")
    if args:
        if k is not None or len(args) > 1:
            raise TypeError("batch_topk takes (outputs, targets, k)")
        k = args[0]
    ks = (1, 5) if k is None else ((k,) if isinstance(k, int) else tuple(k))
    if outputs.dim() < 3:
        raise ValueError(f"batch_topk expects outputs of shape (B, n, C, ...), got {tuple(outputs.shape)}")
    classes = outputs.shape[2]
    if not ks or min(ks) < 1 or max(ks) > classes:
        raise ValueError(f"every k must be in 1..{classes} (the number of classes), got {ks}")
    if _check_targets(outputs, targets, "batch_topk") is None:
        targets = targets.expand(outputs.shape[0], *targets.shape)
    if targets.shape != (*outputs.shape[:2], *outputs.shape[3:]):
        raise ValueError(
            f"batch_topk: targets {tuple(targets.shape)} must be outputs {tuple(outputs.shape)} without the class dim"
        )
    _assert_classes_in_range(targets, classes)
    predicted = outputs.topk(max(ks), dim=2).indices
    hits = (predicted == targets.unsqueeze(2)).cumsum(2)
    index = torch.tensor([kk - 1 for kk in ks], device=outputs.device)
    hits = hits.index_select(2, index).movedim(2, 0)
    return hits.flatten(2).float().mean(2)


def batch_accuracy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-model top-1 accuracy, shape ``(B,)``."""
    return batch_topk(outputs, targets, k=(1,))[0]
