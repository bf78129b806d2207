"""Input checks of batched layers that name, in the user's terms, what a layer expected: the feature or
channel size it was built for, the model axis B and the samples n merged into dim 0, the dtype of its
weights. They read shapes and dtypes only (no device synchronisation; ``torch.compile`` traces them away)."""

from __future__ import annotations

from torch import Tensor

from ._base import UNBATCHED, autocast_dtype, current_forward

__all__ = ["check_conv_input", "check_input_dtype", "check_input_size"]


def _merged_rows(x: Tensor, batch: int) -> str:
    """What dim 0 of ``x`` holds, in the user's terms."""
    context = current_forward()
    if context is None:
        return f"dim 0 merges the model axis B = {batch} with each model's samples"
    if context.shared:
        return f"dim 0 holds the n = {context.samples} samples shared by the B = {batch} models"
    return f"dim 0 merges the model axis B = {batch} with each model's n = {context.samples} samples"


def check_input_size(owner: str, x: Tensor, dim: int, expected: int, name: str, batch: int) -> None:
    """Refuse an input whose size in ``dim`` (the features, the channels) is not the ``expected`` ``name``."""
    if x.dim() > (dim if dim >= 0 else -dim - 1) and x.shape[dim] == expected:
        return
    got = x.shape[dim] if x.dim() > (dim if dim >= 0 else -dim - 1) else "nothing"
    where = "last dim" if dim == -1 else f"dim {dim}"
    raise RuntimeError(
        f"{owner}: expected an input with {name} = {expected} in its {where}, got {got}: input of shape "
        f"{tuple(x.shape)}, whose {_merged_rows(x, batch)}"
    )


def check_input_dtype(owner: str, x: Tensor, weight: Tensor) -> None:
    """Refuse an input whose dtype is not the weights' (outside autocast, which casts both), as torch does."""
    if x.dtype != weight.dtype and autocast_dtype(x.device.type) is None:
        raise RuntimeError(
            f"{owner}: expected an input of dtype {weight.dtype} (the layer's weights), got {x.dtype}; convert the "
            f"input (x.to({weight.dtype})) or the model (BatchModule.to({x.dtype}))"
        )


def check_conv_input(owner: str, x: Tensor, spatial_dims: int, in_channels: int, batch: int) -> None:
    """Refuse a convolution input that is not ``(rows, in_channels, *spatial)`` with ``spatial_dims`` spatial dims."""
    if x.dim() != spatial_dims + 2:
        layout = ", ".join(["C", *"DHW"[3 - spatial_dims :]]) if spatial_dims <= 3 else "C, ..."
        raise RuntimeError(
            f"{owner}: expected a {spatial_dims + 2}-d input (B*n, {layout}) with C = in_channels = {in_channels}, "
            f"got shape {tuple(x.shape)}, whose {_merged_rows(x, batch)}; each model's input is (n, {layout})"
            + (f"; {UNBATCHED}" if x.dim() == spatial_dims + 1 else "")
        )
    check_input_size(owner, x, 1, in_channels, "in_channels", batch)
