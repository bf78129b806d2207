"""Import torchvision's model definitions where its compiled operators cannot load.

PyPI's torchvision wheel is built against the CUDA build of torch; beside the CPU build of torch that CI
installs, ``import torchvision`` stops at ``operator torchvision::nms does not exist``. The model definitions
are pure Python and need none of those operators: :func:`import_torchvision` declares them without kernels
first (``torchmb.integrations._torchvision``, which lets Lightning and transformers import there too).
"""

from __future__ import annotations

import importlib.util
import types

from torchmb.integrations._torchvision import declare_unloadable_torchvision_ops

__all__ = ["import_torchvision"]


def import_torchvision() -> types.ModuleType:
    """``import torchvision``, declaring its compiled operators first where their library cannot load."""
    if importlib.util.find_spec("torchvision") is None:
        raise ImportError("torchvision is not installed (it comes with torchmb's 'test' extra)")
    declare_unloadable_torchvision_ops()
    import torchvision

    return torchvision
