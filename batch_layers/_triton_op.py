"""Custom operators backed by Triton kernels, registered so that ``torch.compile`` sees into them.

An operator made with ``torch.library.custom_op`` is opaque to Inductor: every call in a compiled step goes
back through the dispatcher into the Python body, which computes the launch grid and launches through
Triton's Python launcher again (a compiled timm ConvNeXt-atto step at B=16 spent more host time in its 12
depthwise weight gradients than in any other operator). Here the operator also decomposes under AOTAutograd's
functionalisation into its body, whose launches are recorded as Triton kernel calls: Inductor computes the
grid once, at compile time, and launches the kernel from its generated code like its own kernels (this is
what ``torch.library.triton_op`` does; that one imports Triton when it registers, here at ``import torchmb``).
Eager calls run the body and launch the kernel directly. Where torch lacks ``torch.library.wrap_triton`` or
``torch.compiler.is_exporting`` (2.5, and releases before ``is_exporting``), the operators stay opaque.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

__all__ = ["DECOMPOSED", "launchable", "multiprocessors", "position_shares", "triton_custom_op"]

DECOMPOSED = hasattr(torch.library, "wrap_triton") and hasattr(torch.compiler, "is_exporting")
"""Whether this torch lets the operators decompose into their bodies under ``torch.compile``."""

_tracing = threading.local()  # .body: whether this thread runs an operator's body to record its launches


def triton_custom_op(name: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """A decorator that makes a function whose only launches are ``launchable(kernel)[grid](...)`` calls
    the custom operator ``name`` (no argument mutated) that Inductor sees into; ``fake`` gives its output's
    shape, dtype and device without computing it."""

    def register(body: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=())(body)
        op.register_fake(fake)
        if DECOMPOSED:
            op.register_torch_dispatch(FunctionalTensorMode, functools.partial(_decomposed, body))
        return op

    return register


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA ``device``: a kernel that splits a reduction sizes its grid by them."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def position_shares(positions: int, block: int, programs: int, parallel: int) -> tuple[int, int]:
    """How a weight-gradient kernel shares ``positions`` (at least one) among programs, ``parallel`` of which work
    on other sums beside each share: ``(shares, positions per share)``, enough shares for about ``programs``
    programs in all, each share a multiple of ``block`` and at least 8 blocks long where there are that many."""
    shares = max(1, min(_ceil_div(positions, 8 * block), _ceil_div(programs, parallel)))
    chunk = _ceil_div(_ceil_div(positions, shares), block) * block
    return _ceil_div(positions, chunk), chunk


def _ceil_div(numerator: int, denominator: int) -> int:
    return (numerator + denominator - 1) // denominator


def launchable(kernel: Any) -> Any:
    """``kernel`` (a ``triton.jit`` function) as a body of :func:`triton_custom_op` launches it: itself when
    the operator runs, wrapped so that the launch is recorded while the body is traced."""
    return torch.library.wrap_triton(kernel) if getattr(_tracing, "body", False) else kernel


def _decomposed(body, mode, op, types, args, kwargs):
    """The operator under functionalisation: its body traced, the launches recorded (kept whole for
    ``torch.export``, whose programs should not hold Triton source, and for tensor subclasses other than
    the tracing's own)."""
    if torch.compiler.is_exporting():
        return mode.__torch_dispatch__(op, types, args, kwargs)
    if any(t not in (torch.Tensor, FunctionalTensor) and not issubclass(t, FakeTensor) for t in types):
        return NotImplemented
    outer, _tracing.body = getattr(_tracing, "body", False), True
    try:
        with mode:
            return body(*args, **kwargs)
    finally:
        _tracing.body = outer
