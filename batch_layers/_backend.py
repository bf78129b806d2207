"""The kernel backend switch: which implementation batched layers with a fast path use.

``"auto"`` (the default) takes the CuPy kernels where they apply (CUDA tensors, CuPy importable) and
the plain-torch reference path elsewhere; ``"cupy"`` insists on the kernels for CUDA tensors and
raises an ``ImportError`` chained to the original one when CuPy cannot be imported; ``"torch"`` always
takes the reference path. CPU tensors always run the reference path (there is no CPU kernel to run).

The environment variable ``TORCHMB_BACKEND`` sets the starting value; :func:`set_backend` changes it
for the process, :func:`use_backend` (or :func:`use_cupy`, :func:`use_torch`) for a ``with`` block,
restoring the old value on exit. Layers read the switch at every call, so tests can flip it. The switch
itself is ``torchmb_config``'s ``"backend"`` (every switch of the packages is there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torchmb_config

__all__ = ["BACKENDS", "Backend", "get_backend", "set_backend", "use_backend", "use_cupy", "use_torch"]

Backend = Literal["auto", "cupy", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "cupy", "torch")
ENV_VAR = "TORCHMB_BACKEND"


_SWITCH = torchmb_config.SWITCHES["backend"]


def get_backend() -> Backend:
    """The backend in force: ``"auto"``, ``"cupy"`` or ``"torch"``."""
    return _SWITCH.get()


def set_backend(name: str) -> Backend:
    """Set the backend for the whole process; returns the previous value.

    Args:
        name: ``"auto"`` (kernels where they apply), ``"cupy"`` (kernels required for CUDA tensors)
            or ``"torch"`` (reference path always).
    """
    return _SWITCH.set(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Use ``name`` inside a ``with`` block, restoring the previous backend afterwards."""
    with _SWITCH.use(name) as value:
        yield value


def use_cupy() -> contextlib.AbstractContextManager[Backend]:
    """``with use_cupy():`` requires the CuPy kernels for CUDA tensors inside the block."""
    return use_backend("cupy")


def use_torch() -> contextlib.AbstractContextManager[Backend]:
    """``with use_torch():`` runs the plain-torch reference path inside the block."""
    return use_backend("torch")
