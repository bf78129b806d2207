"""Every switch and environment variable of torchmb, batch_layers and offload, in one place.

The three packages import one way (``torchmb -> batch_layers -> offload``); this small package sits below
all of them (it imports none), so each reads its switches here. A switch has a getter, a setter that
returns the old value, and a context manager that restores it (:func:`get`, :func:`set`, :func:`use`); its
starting value comes from its environment variable, read once, when the switch is created (at import), so
that reading a switch never changes it (``torch.compile`` cannot trace a change inside an autograd function);
a variable with a bad value raises its ``ValueError`` at the switch's first use. The packages'
own switch functions (``batch_layers.set_backend``, ``offload.set_engine``, ...) are thin over these.

- ``backend`` (``TORCHMB_BACKEND``, default ``auto``): the kernels of batched layers and fused optimizers:
  ``auto`` (CuPy where it applies), ``cupy`` (required for CUDA tensors), ``torch`` (reference path).
- ``triton`` (``TORCHMB_TRITON``, default ``1``): convolutions and per-model-affine norms may take the Triton
  kernels where their kernel tables say they are faster; ``0``: cuDNN/ATen for every convolution and norm.
- ``offload_engine`` (``TORCHMB_OFFLOAD_ENGINE``, default ``auto``): the default copy engine of
  ``offload.HostTable``: ``auto`` (measured), ``uva``, ``cpu``, ``hybrid`` (offload validates the name).
- ``offload_cache_kernels`` (``TORCHMB_OFFLOAD_KERNELS``, default ``1``): CuPy kernels keep the books of an
  offloaded embedding's GPU cache where they can run; ``0``: torch operations.
- ``offload_huge_pages`` (``TORCHMB_OFFLOAD_HUGE_PAGES``, default ``1``): host tables of 32 MiB and more are
  anonymous maps advised for transparent huge pages.

:func:`describe` prints them with their values now (``python -m torchmb config``).
torchrun's ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` are read by :func:`launcher_environment`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SWITCHES", "LauncherEnvironment", "Switch", "describe", "get", "launcher_environment", "register", "set",
           "use"]


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


@dataclass
class Switch:
    """One switch: its ``name``, environment variable ``env``, ``default`` (the value when the variable is
    unset or empty), ``parse`` (the variable's text to a value, raising ``ValueError`` on bad text),
    ``check`` (a value given to :func:`set`, validated and normalised) and what it does (``doc``)."""

    name: str
    env: str
    default: Any
    doc: str
    parse: Callable[[str], Any]
    check: Callable[[Any], Any]
    _value: Any = field(default=None, repr=False)
    _bad_environment: ValueError | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            self._value = self.from_env()
        except ValueError as err:  # raised where the switch is used, not where torchmb is imported
            self._bad_environment = err

    def from_env(self) -> Any:
        """The value the environment asks for (the default when the variable is unset or empty)."""
        text = os.environ.get(self.env)
        if text is None or text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as err:
            raise ValueError(f"environment variable {self.env}={text!r} is not valid for the {self.name!r} "
                             f"switch: {err}") from err

    def get(self) -> Any:
        if self._bad_environment is not None:
            raise self._bad_environment
        return self._value

    def set(self, value: Any) -> Any:
        """Set the value (a bad environment variable's error is then forgotten); returns the old one."""
        old = self._value
        self._value, self._bad_environment = self.check(value), None
        return old

    @contextlib.contextmanager
    def use(self, value: Any) -> Iterator[Any]:
        saved = self._value, self._bad_environment
        self.set(value)
        try:
            yield self._value
        finally:
            self._value, self._bad_environment = saved


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value.lower()

    return check


def _bool(value: Any) -> bool:
    return bool(value)


SWITCHES: dict[str, Switch] = {}


def register(switch: Switch) -> Switch:
    """Add ``switch`` to :data:`SWITCHES`; refuses a name taken already."""
    if switch.name in SWITCHES:
        raise ValueError(f"a switch named {switch.name!r} exists already")
    SWITCHES[switch.name] = switch
    return switch


_backend = _choice("backend", ("auto", "cupy", "torch"))
register(Switch("backend", "TORCHMB_BACKEND", "auto",
                "which implementation batched layers with a fast path and the fused optimizers use: 'auto' (the "
                "CuPy kernels where they apply), 'cupy' (required for CUDA tensors), 'torch' (reference path)",
                _backend, _backend))
register(Switch("triton", "TORCHMB_TRITON", True,
                "whether convolutions and per-model-affine norms may take the Triton kernels where their tables "
                "say they are faster (off: cuDNN/ATen for every convolution and norm)", _flag, _bool))
register(Switch("offload_engine", "TORCHMB_OFFLOAD_ENGINE", "auto",
                "the default copy engine of offload.HostTable: 'auto' (measured), 'uva', 'cpu' or 'hybrid'",
                str, str))
register(Switch("offload_cache_kernels", "TORCHMB_OFFLOAD_KERNELS", True,
                "whether the GPU cache of an offloaded embedding keeps its books with CuPy kernels where they "
                "can run (off: torch operations)", lambda t: t != "0", _bool))
register(Switch("offload_huge_pages", "TORCHMB_OFFLOAD_HUGE_PAGES", True,
                "whether host tables of 32 MiB and more are anonymous maps advised for transparent huge pages",
                lambda t: t != "0", _bool))


def _switch(name: str) -> Switch:
    got = SWITCHES.get(name)
    if got is None:
        raise KeyError(f"no switch named {name!r}; the switches are {sorted(SWITCHES)}")
    return got


def get(name: str) -> Any:
    """The value of switch ``name`` now."""
    return _switch(name).get()


def set(name: str, value: Any) -> Any:
    """Set switch ``name`` for the whole process; returns the previous value."""
    return _switch(name).set(value)


def use(name: str, value: Any) -> contextlib.AbstractContextManager[Any]:
    """``with use(name, value):`` sets switch ``name`` inside the block and restores it after."""
    return _switch(name).use(value)


@dataclass(frozen=True)
class LauncherEnvironment:
    """What a launcher such as torchrun told this process: ``world_size`` and ``rank`` (``None`` when not
    started by one) and ``local_rank`` (0 unless set)."""

    world_size: int | None
    rank: int | None
    local_rank: int


def launcher_environment() -> LauncherEnvironment:
    """torchrun's ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``, read now (they are set per process)."""
    world, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    started = world is not None and rank is not None
    return LauncherEnvironment(int(world) if started else None, int(rank) if started else None,
                               int(os.environ.get("LOCAL_RANK", "0")))


def describe() -> str:
    """A table of every switch: name, environment variable, value now and what it does."""
    rows = [(s.name, s.env, repr(s.get()), s.doc) for s in SWITCHES.values()]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c:<{width[2]}}  {d}" for a, b, c, d in rows)
