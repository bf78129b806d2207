"""Let Lightning and transformers import beside a torchvision whose compiled operators cannot load.

Both frameworks import torchvision whenever it is installed (Lightning through torchmetrics' image metrics,
transformers through its image utilities), and PyPI's torchvision wheel is built against the CUDA build of
torch: beside a CPU build its ``_C.so`` fails to load, and ``import torchvision`` then stops at its fake-tensor
registrations with ``operator torchvision::nms does not exist``, taking the framework's import with it.
Neither framework nor torchmb calls those operators (they serve detection: ``nms``, ``roi_align``,
``deform_conv2d``, ...).

:func:`declare_unloadable_torchvision_ops` declares each ``torchvision::`` operator that torchvision's Python
side registers fake kernels or autograd formulas for, with its schema (as torchvision's C++ sources declare
it) and without a kernel. Calling one of them raises torch's "no kernel" error; nothing else changes. Where
``_C.so`` loads, or torchvision is not installed, nothing is declared.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["declare_unloadable_torchvision_ops"]

_ROI = "Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width"
_GRAD_SIZES = "SymInt batch_size, SymInt channels, SymInt height, SymInt width"
_DEFORM = (
    "Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, "
    "SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, "
    "bool use_mask"
)
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    f"roi_align(Tensor input, {_ROI}, int sampling_ratio, bool aligned) -> Tensor",
    f"_roi_align_backward(Tensor grad, {_ROI}, {_GRAD_SIZES}, int sampling_ratio, bool aligned) -> Tensor",
    f"roi_pool(Tensor input, {_ROI}) -> (Tensor, Tensor)",
    f"_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    f"SymInt pooled_width, {_GRAD_SIZES}) -> Tensor",
    f"ps_roi_align(Tensor input, {_ROI}, int sampling_ratio) -> (Tensor, Tensor)",
    f"_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    f"SymInt pooled_height, SymInt pooled_width, int sampling_ratio, {_GRAD_SIZES}) -> Tensor",
    f"ps_roi_pool(Tensor input, {_ROI}) -> (Tensor, Tensor)",
    f"_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    f"SymInt pooled_height, SymInt pooled_width, {_GRAD_SIZES}) -> Tensor",
    f"deform_conv2d({_DEFORM}) -> Tensor",
    f"_deform_conv2d_backward(Tensor grad, {_DEFORM}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_LIBRARY: list[torch.library.Library] = []  # kept alive: a Library's definitions go with it


def _compiled_ops_load(extension: Path) -> bool:
    try:
        torch.ops.load_library(str(extension))
    except (OSError, RuntimeError):
        return False
    return True


def declare_unloadable_torchvision_ops() -> None:
    """Declare torchvision's compiled operators, without kernels, where its ``_C.so`` is installed but cannot
    load (once per process)."""
    spec = importlib.util.find_spec("torchvision")
    if _LIBRARY or spec is None or spec.origin is None:
        return
    extension = Path(spec.origin).parent / "_C.so"
    if extension.exists() and not _compiled_ops_load(extension):
        library = torch.library.Library("torchvision", "DEF")
        for schema in SCHEMAS:
            library.define(schema)
        _LIBRARY.append(library)
