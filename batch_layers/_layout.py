"""The layout of B models' tensors on one merged dim 0, as a value.

Between layers, a tensor that belongs to all B models has the model axis merged into dim 0, in one of two
orders: **models-major** (row ``b * n + i`` is sample ``i`` of model ``b``: ``x.view(B, -1, ...)`` recovers
the model axis for free) or **samples-major** (row ``i * B + b``: the grouped ``(n, B*C, H, W)`` layout of
convolutions and batch norms is then a free view). ``BatchModule`` decides the order once and gives every
batched layer its :class:`Layout`; the functions of ``batch_layers.functional`` take it as an argument and
read it from nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "Layout",
    "MergedOrder",
    "expand_shared",
    "from_grouped",
    "is_channels_last",
    "reshape_unread",
    "shared_to_grouped",
    "to_grouped",
]

MergedOrder = Literal["models", "samples"]


@dataclass(frozen=True)
class Layout:
    """How B models' tensors share dim 0.

    Attributes:
        batch: the number of models B.
        order: ``"models"`` (row ``b * n + i``) or ``"samples"`` (row ``i * B + b``).
    """

    batch: int
    order: MergedOrder = "models"

    def split(self, x: Tensor) -> Tensor:
        """View a merged ``(B*m, ...)`` tensor as ``(B, m, ...)`` (samples-major: a strided view)."""
        if self.order == "models":
            return x.view(self.batch, -1, *x.shape[1:])
        return x.view(-1, self.batch, *x.shape[1:]).transpose(0, 1)

    def merge(self, y: Tensor, unread: bool = False) -> Tensor:
        """Inverse of :meth:`split`: ``(B, m, ...)`` to the merged ``(B*m, ...)`` (samples-major: a copy, unless
        ``y`` is laid out samples-major already). ``unread``: no backward reads ``y`` (see
        :func:`reshape_unread`)."""
        rows = y if self.order == "models" else y.transpose(0, 1)
        shape = (-1, *y.shape[2:])
        return reshape_unread(rows, shape) if unread else rows.reshape(shape)


def reshape_unread(y: Tensor, shape: Sequence[int]) -> Tensor:
    """``y.reshape(shape)`` for a ``y`` that no backward reads (a layer's fresh result: a batch norm's, a
    product's or sum's, a batched Linear's): where that would be a view, a tensor of its own on ``y``'s
    memory instead (``aten::_unsafe_view``, as ``matmul`` returns its reshaped product). An in-place op on a
    layer's output (``ReLU(inplace=True)``, a residual ``+=``) then costs backward no copies of the gradient
    (``CopySlices``, ``AsStridedBackward0``), as on the plain layer's output. A view would share ``y``'s
    version counter, which nothing needs where nothing reads ``y``."""
    return torch.ops.aten._unsafe_view(y, shape) if y.is_contiguous() else y.reshape(shape)


def split_dim(x: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:
    """``x.unflatten(dim, sizes)`` as a view of its own: ``Tensor.unflatten`` is Python that calls ``super()``,
    which dynamo (torch 2.11) cannot trace while a torch-function mode is active (timm's ViT under torchmb's
    attention choice broke its compiled graph there)."""
    return x.view(*x.shape[:dim], *sizes, *x.shape[dim + 1 :])


def is_channels_last(x: Tensor) -> bool:
    """Whether a 4-D tensor is stored channels-last (and not also plainly contiguous, as when C == 1)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def to_grouped(x: Tensor, batch: int, order: MergedOrder = "models", keep_channels_last: bool = True) -> Tensor:
    """``(B*n, C, *S)`` in the merged ``order`` to ``(n, B*C, *S)``: the models become channel groups.

    Samples-major, this is a view of a contiguous input. A channels-last input gives a channels-last
    result, ``(n, H, W, B*C)`` in memory, so cuDNN runs its NHWC kernels, unless ``keep_channels_last`` is
    false; any other gives a contiguous one.
    """
    n = x.shape[0] // batch
    if keep_channels_last and is_channels_last(x):
        channels, height, width = x.shape[1:]
        if order == "models":
            grouped = x.view(batch, n, channels, height, width).permute(1, 3, 4, 0, 2).contiguous()
        else:
            grouped = x.view(n, batch, channels, height, width).permute(0, 3, 4, 1, 2).contiguous()
        return grouped.view(n, height, width, batch * channels).permute(0, 3, 1, 2)
    if order == "samples":
        if torch.compiler.is_compiling() and x.is_contiguous():
            return split_dim(x, 0, (n, batch)).flatten(1, 2)  # see _regrouped_for_inductor
        return x.reshape(n, batch * x.shape[1], *x.shape[2:])
    return x.reshape(batch, n, *x.shape[1:]).transpose(0, 1).reshape(n, batch * x.shape[1], *x.shape[2:])


def shared_to_grouped(x: Tensor, batch: int) -> Tensor:
    """A shared ``(n, C, *S)`` input as the grouped ``(n, B*C, *S)`` input of B models (one copy), keeping a
    channels-last layout."""
    if is_channels_last(x):
        n, channels, height, width = x.shape
        rows = x.permute(0, 2, 3, 1).unsqueeze(3).expand(n, height, width, batch, channels)
        return rows.reshape(n, height, width, batch * channels).permute(0, 3, 1, 2)
    return x.unsqueeze(1).expand(x.shape[0], batch, *x.shape[1:]).reshape(x.shape[0], batch * x.shape[1], *x.shape[2:])


def from_grouped(
    y: Tensor, batch: int, order: MergedOrder = "models", channels_last: bool = False, unread: bool = False
) -> Tensor:
    """``(n, B*C, *S)`` back to the merged ``(B*n, C, *S)`` in ``order``, keeping a channels-last layout
    (and giving a 4-D result one where ``channels_last`` asks for it, in the same single copy).

    ``unread`` says that no backward reads ``y`` (batch norm's output: its backward reads the input and the
    statistics): the samples-major result of a contiguous ``y`` is then a tensor of its own
    (:func:`reshape_unread`), not a view.
    """
    n = y.shape[0]
    if is_channels_last(y) or (channels_last and y.dim() == 4):
        height, width = y.shape[2:]
        channels = y.shape[1] // batch
        groups = split_dim(y, 1, (batch, channels))  # (n, B, C, H, W), whatever y's storage
        if order == "models":
            merged = groups.permute(1, 0, 3, 4, 2).contiguous()
        else:
            merged = groups.permute(0, 1, 3, 4, 2).contiguous()
        return merged.view(batch * n, height, width, channels).permute(0, 3, 1, 2)
    if order == "samples":
        if torch.compiler.is_compiling() and y.is_contiguous():
            return _regrouped_for_inductor(y, batch)
        shape = (n * batch, y.shape[1] // batch, *y.shape[2:])
        return reshape_unread(y, shape) if unread else y.reshape(shape)
    y = y.view(n, batch, y.shape[1] // batch, *y.shape[2:]).transpose(0, 1)
    return y.reshape(batch * n, *y.shape[2:])


def _regrouped_for_inductor(y: Tensor, batch: int) -> Tensor:
    """The samples-major ``(n, B*C, *S)`` to ``(n*B, C, *S)`` as two views, a split of dim 1, then a merge of
    dims 0 and 1 (:func:`to_grouped` does the reverse so), where dynamo traces it.

    Inductor indexes one view that changes both dims through the flattened index, in modular expressions of
    it, and fuses a network's layers so that those expressions nest one into the next: its scheduler then
    spent most of a compile simplifying them (MobileNetV3 at B=16: 74 of 188 seconds, against its plain
    model's 8). Split and merged apart, each index stays a dim's own (``i // C``, ``i % C``). In a graph an
    in-place op on a view costs no copies, so the plain view serves where eager takes
    :func:`reshape_unread`."""
    return split_dim(y, 1, (batch, y.shape[1] // batch)).flatten(0, 1)


def expand_shared(x: Tensor, layout: Layout) -> Tensor:
    """A shared ``(n, ...)`` input as the merged ``(B*n, ...)`` tensor of B models (a copy) in ``layout``'s
    order; a channels-last input gives a channels-last result."""
    channels_last = is_channels_last(x)
    if channels_last:
        x = x.permute(0, 2, 3, 1)
    if layout.order == "models":
        merged = x.expand(layout.batch, *x.shape).reshape(-1, *x.shape[1:])
    else:
        merged = x.unsqueeze(1).expand(x.shape[0], layout.batch, *x.shape[1:]).reshape(-1, *x.shape[1:])
    return merged.permute(0, 3, 1, 2) if channels_last else merged
