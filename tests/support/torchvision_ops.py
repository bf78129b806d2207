"""Import torchvision's model definitions where its compiled operators cannot load.

PyPI's torchvision wheel is built against the CUDA build of torch. Beside the CPU build of torch that CI
installs, its ``_C.so`` fails to load, and ``import torchvision`` then stops at its fake-tensor registrations
with ``operator torchvision::nms does not exist``. The model definitions are pure Python and need none of
those operators (they serve detection: ``nms``, ``roi_align``, ``deform_conv2d``, ...).

:func:`import_torchvision` declares each ``torchvision::`` operator that torchvision's Python side registers
fake kernels or autograd formulas for, with its schema (as torchvision's C++ sources declare it) and
without a kernel,
then imports torchvision. Calling one of those operators raises torch's "no kernel" error; nothing else
changes. Where ``_C.so`` loads (a CUDA build of torch), nothing is declared.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import torch

__all__ = ["import_torchvision"]

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


def import_torchvision() -> types.ModuleType:
    """``import torchvision``, declaring its compiled operators first where their library cannot load."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        raise ImportError("torchvision is not installed (it comes with torchmb's 'test' extra)")
    extension = Path(spec.origin).parent / "_C.so"
    if not _LIBRARY and extension.exists() and not _compiled_ops_load(extension):
        library = torch.library.Library("torchvision", "DEF")
        for schema in SCHEMAS:
            library.define(schema)
        _LIBRARY.append(library)
    import torchvision

    return torchvision
