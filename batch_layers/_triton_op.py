"""Custom operators backed by Triton kernels, registered so that ``torch.compile`` sees into them.

An operator made with ``torch.library.custom_op`` is opaque to Inductor: every call in a compiled step goes
back through the dispatcher into the Python body, which computes the launch grid and launches through
Triton's Python launcher again (a compiled timm ConvNeXt-atto step at B=16 spent more host time in its 12
depthwise weight gradients than in any other operator). ``torch.library.triton_op`` (torch >= 2.6) makes the
body traceable: Inductor computes the grid once, at compile time, and launches the kernel from its generated
code like its own kernels. torch 2.5 has no ``triton_op``; there, and without Triton (the operators cannot run
then), they are plain custom operators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._kernel_table import TRITON_INSTALLED

__all__ = ["launchable", "triton_custom_op"]


def triton_custom_op(name: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """A decorator that makes a function whose only launches are ``launchable(kernel)[grid](...)`` calls
    the custom operator ``name`` (no argument mutated), traceable by Inductor where torch supports it. ``fake``
    gives the output's shape, dtype and device for torch 2.5 (later versions trace the body for them)."""
    if TRITON_INSTALLED and hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton"):
        return torch.library.triton_op(name, mutates_args=())

    def register(body: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=())(body)
        op.register_fake(fake)
        return op

    return register


def launchable(kernel: Any) -> Any:
    """``kernel`` (a ``triton.jit`` function) as a body of :func:`triton_custom_op` launches it: wrapped so
    that tracing records the launch, and itself when the operator runs eagerly."""
    wrap = getattr(torch.library, "wrap_triton", None)
    return kernel if wrap is None else wrap(kernel)
