"""The base class of every batched layer and the layout of the merged model axis.

B models of one architecture run as one module. Between layers, a tensor that belongs to all B models
has the model axis merged into dim 0. By default **models-major**: row ``b * n + i`` is sample ``i`` of
model ``b``, so ``x.view(B, -1, ...)`` recovers the model axis for free, and every reshape that merges
dims to the right of dim 0 (``x.view(-1, d)`` on ``(B*n, seq, d)``) stays correct. A ``BatchModule``
whose layers all support it may run **samples-major** instead (row ``i * B + b``): there the grouped
``(n, B*C, H, W)`` layout of convolutions and batch norms is a free view of the merged tensor, and a
layer refuses any input whose dim 0 is not exactly ``B * n``. The measurements behind both are in
``docs/design.md``.

A forward started by ``torchmb.BatchModule`` records the number of samples per model and the order, so
layers can refuse a tensor whose dim 0 is not ``B * n * k`` (a model that moved the merged axis
elsewhere) instead of silently mixing models, and can recognise the *shared* input (one ``(n, ...)``
tensor that every model sees) without materialising B copies of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._layout import Layout, MergedOrder, expand_shared
from ._stacked_reads import check_stacked_read

__all__ = [
    "AbstractBatchModule",
    "ForwardContext",
    "SamplesOrderError",
    "SamplesOrderProbe",
    "check_merged_rows",
    "current_forward",
    "forward_context",
    "is_shared_input",
    "is_shared_parameter",
    "mark_shared_parameter",
    "recognise_shared_by",
]

@dataclass(frozen=True)
class ForwardContext:
    """What a batched forward knows about its inputs.

    Attributes:
        batch: the number of models B.
        samples: samples per model ``n`` at the model's input.
        shared: whether the input is one ``(n, ...)`` tensor shared by all models.
        order: the order of the merged model axis between layers.
    """

    batch: int
    samples: int
    shared: bool = False
    order: MergedOrder = "models"
    probe: SamplesOrderProbe | None = field(default=None, compare=False)


class SamplesOrderProbe:
    """Notes, through a forward in the models-major order, whether the samples-major order would have run it:
    whether every merged tensor a batched layer checked (:func:`check_merged_rows`) had exactly ``B * n``
    rows. ``BatchModule(merged_order="auto")`` gives one to its first forward and keeps the samples-major
    order afterwards only if :attr:`refusal` is still ``None``."""

    __slots__ = ("refusal",)

    def __init__(self) -> None:
        self.refusal: str | None = None  # the first tensor that samples-major would have refused

    def note(self, owner: str, what: str, shape: tuple[int, ...], batch: int, samples: int) -> None:
        """Note a merged tensor of ``shape`` whose dim 0 is not exactly ``batch * samples``."""
        if self.refusal is None:
            self.refusal = f"{owner}: its {what} of shape {shape} has not exactly B * n = {batch} * {samples} rows"


class SamplesOrderError(ValueError):
    """A tensor whose dim 0 holds more than ``B * n`` rows met a layer in the samples-major merged order,
    where only the models-major order keeps such rows apart by model."""


_FORWARD: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("torchmb_forward", default=None)
# torch.compile cannot trace ContextVar.get and .set (dynamo breaks the graph at each): code that dynamo
# traces keeps the context on this list instead, whose appends and pops it records as side effects.
_TRACED_FORWARD: list[ForwardContext] = []


def current_forward() -> ForwardContext | None:
    """The context of the batched forward in progress, or ``None`` outside one."""
    if torch.compiler.is_compiling():
        return _TRACED_FORWARD[-1] if _TRACED_FORWARD else None
    # Eager code that a compiled forward runs (past a graph break) finds the context on the list.
    return _FORWARD.get() or (_TRACED_FORWARD[-1] if _TRACED_FORWARD else None)


class _ForwardScope:
    """The context manager of :func:`forward_context` (a class: cheaper per forward than a generator).

    ``__enter__`` remembers which store it used, so that ``__exit__`` undoes that one: a scope entered
    eagerly may be left while dynamo compiles, or the reverse, across a graph break.
    """

    __slots__ = ("context", "token")

    def __init__(self, context: ForwardContext) -> None:
        self.context = context
        self.token: contextvars.Token[ForwardContext | None] | None = None  # None: entered on the traced list

    def __enter__(self) -> ForwardContext:
        if torch.compiler.is_compiling():
            _TRACED_FORWARD.append(self.context)
            self.token = None
        else:
            self.token = _FORWARD.set(self.context)
        return self.context

    def __exit__(self, *exc_info: object) -> None:
        if self.token is None:
            _TRACED_FORWARD.pop()
        else:
            _FORWARD.reset(self.token)


def forward_context(context: ForwardContext) -> _ForwardScope:
    """Run a block as a batched forward described by ``context`` (nests; restores the outer one)."""
    return _ForwardScope(context)


def mark_shared_parameter(parameter: Tensor) -> None:
    """Mark ``parameter`` as shared by all models: stored once, without a model axis, and frozen (a
    ``BatchModule``'s frozen backbone). Optimizers of per-model parameters skip it."""
    parameter.shared_across_models = True


def is_shared_parameter(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a parameter shared by all models (see :func:`mark_shared_parameter`)."""
    return getattr(tensor, "shared_across_models", False)


_SHARED_TENSORS: contextvars.ContextVar[Callable[[Tensor], bool] | None] = contextvars.ContextVar(
    "torchmb_shared_tensors", default=None
)


def is_shared_input(x: Tensor, batch: int) -> bool:
    """Whether ``x`` is the shared ``(n, ...)`` input of the shared-input forward in progress (or a tensor
    the model computed from it without any model's parameters).

    ``torchmb.BatchModule`` tracks the shared tensors and says so through :func:`recognise_shared_by`.
    Without it (a layer called in a hand-made :func:`forward_context`, or traced by ``torch.compile``)
    the sizes decide: a dim 0 that is a multiple of ``n`` but not of ``B * n``.
    """
    context = current_forward()
    if context is None or not context.shared or batch == 1:
        return False
    recognise = _SHARED_TENSORS.get()
    if recognise is not None:
        return recognise(x)
    rows = x.shape[0] if x.dim() else 0
    return rows % (batch * context.samples) != 0 and rows % context.samples == 0


@contextlib.contextmanager
def recognise_shared_by(recognise: Callable[[Tensor], bool]) -> Iterator[None]:
    """Let :func:`is_shared_input` ask ``recognise`` in this block instead of judging by sizes."""
    token = _SHARED_TENSORS.set(recognise)
    try:
        yield
    finally:
        _SHARED_TENSORS.reset(token)


def check_merged_rows(
    x: Tensor, batch: int, owner: str, what: str = "input", order: MergedOrder = "models"
) -> None:
    """Refuse a tensor whose dim 0 is not a multiple of ``B * n``, the merged model axis (exactly ``B * n``
    in the samples-major ``order``, where merging other dims into dim 0 would interleave models; in the
    models-major order, the forward's :class:`SamplesOrderProbe` notes such a tensor)."""
    context = current_forward()
    rows = x.shape[0] if x.dim() else 0
    step = batch * (context.samples if context is not None else 1)
    if context is not None and rows != step and x.dim() and context.probe is not None:
        context.probe.note(owner, what, tuple(x.shape), batch, context.samples)
    if order == "samples" and context is not None and rows != step and x.dim():
        raise SamplesOrderError(
            f"{owner}: expected the {what}'s dim 0 to be exactly B * n = {batch} * {context.samples} in the "
            f"samples-major merged order, got shape {tuple(x.shape)}; the model merged other dims into dim 0, "
            "which only the models-major order keeps correct: build the BatchModule with merged_order='models'"
        )
    if x.dim() == 0 or (rows % step != 0 if step else rows != 0):  # n = 0: no rows
        where = f"B * n = {batch} * {context.samples}" if context is not None else f"B = {batch}"
        raise ValueError(
            f"{owner}: expected the {what}'s dim 0 to be a multiple of {where} (the merged model axis), got shape "
            f"{tuple(x.shape)}; the model moved or reshaped the sample axis in a way that mixes models (check it "
            "with torchmb.testing.assert_isolated)"
        )


class AbstractBatchModule(nn.Module):
    """Base class of batched layers: ``batch`` independent copies of ``base_class`` as one module.

    Subclasses hold every parameter and per-model buffer with a leading model axis, ``(B, *shape)``, so
    that model ``i``'s tensor is ``p[i]``. Buffers identical for all models (constants) are stored once
    and named in ``shared_buffers``.

    ``merged_order`` says how ``forward`` wants the merged dim 0 of its inputs and outputs:
    ``"models"`` (torchmb's default layout) or ``"samples"`` (row ``i * B + b``, the layout torchmb 0.2
    handed to custom modules; ``BatchModule`` reorders around such a module). Code that goes through
    :meth:`split` and :meth:`merge` works with either. A class that runs in both lists them in
    ``merged_orders``; ``BatchModule`` then sets the instance's ``merged_order`` to its own.
    ``grouped_layout`` marks the classes that gain from the samples-major order (convolutions and batch
    norms, whose grouped layout is then a free view).

    Args:
        batch: number of models B.
    """

    base_class: ClassVar[type[nn.Module]] = nn.Module
    merged_order: ClassVar[MergedOrder] = "samples"
    merged_orders: ClassVar[tuple[MergedOrder, ...]] = ()  # () means (merged_order,)
    grouped_layout: ClassVar[bool] = False
    shared_buffers: ClassVar[tuple[str, ...]] = ()
    # Whether ``from_module`` keeps the module's parameters shared by all models (``mark_shared_parameter``)
    # once, as they are; otherwise a layer holding some is batched per model by its plain code.
    keeps_shared_parameters: ClassVar[bool] = False
    # The torch functionals (``F.linear``, ``F.layer_norm``, ...) this class computes for per-model weights,
    # each with the name of its method of the functional's signature: a plain subclass's own ``forward``
    # runs with them swapped in (batch_layers._subclass).
    functional_forms: ClassVar[dict[Callable, str]] = {}

    def __init__(self, batch: int) -> None:
        nn.Module.__init__(self)  # not super(): a class batching a plain subclass inherits that subclass next
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive int (the number of models), got {batch!r}")
        self.batch = batch

    def __getattr__(self, name: str) -> Any:
        # Parameters and buffers are read through here: refuse a read of the stacked tensors by code other
        # than the layer's own during a batched forward (batch_layers._stacked_reads).
        value = nn.Module.__getattr__(self, name)
        if isinstance(value, Tensor) and not torch.compiler.is_compiling() and _FORWARD.get() is not None:
            check_stacked_read(self, name, value, sys._getframe(1))
        return value

    def _own_state(self, name: str) -> Any:
        """``self.<name>`` for the layer's own forward: a parameter or buffer (or None) straight from its dicts,
        which skips ``__getattr__``'s stacked-read check (the layer's own code passes it anyway) at about a
        third of the host time, every forward; anything else (a parametrization's property) as usual."""
        parameters = self._parameters
        if name in parameters:
            return parameters[name]
        buffers = self._buffers
        if name in buffers:
            return buffers[name]
        return getattr(self, name)

    @classmethod
    def from_module(cls, module: nn.Module, batch: int) -> AbstractBatchModule:
        """A batched layer with ``module``'s hyperparameters; every model starts from its weights."""
        raise NotImplementedError(f"{cls.__name__} must implement from_module(module, batch)")

    @property
    def layout(self) -> Layout:
        """The layout of this layer's merged inputs and outputs: its ``batch`` and ``merged_order``."""
        return Layout(self.batch, self.merged_order)

    def is_shared(self, x: Tensor) -> bool:
        """Whether ``x`` is the shared ``(n, ...)`` input of a shared-input forward, not a merged tensor."""
        return is_shared_input(x, self.batch)

    def check_merged(self, x: Tensor, what: str = "input") -> None:
        """Refuse a tensor whose dim 0 cannot hold B models' samples."""
        check_merged_rows(x, self.batch, type(self).__name__, what, self.merged_order)

    @classmethod
    def runs_in(cls, order: MergedOrder) -> bool:
        """Whether this class's ``forward`` supports the merged ``order``."""
        return order in (cls.merged_orders or (cls.merged_order,))

    def expand_shared(self, x: Tensor) -> Tensor:
        """A shared ``(n, ...)`` input as the merged ``(B*n, ...)`` tensor of B models (a copy), in this
        module's order; a channels-last input gives a channels-last result."""
        return expand_shared(x, self.layout)

    def merged_dim(self, x: Tensor, feature_dims: int = 1) -> int:
        """The dim of ``x`` holding the merged model axis, for layers that take any leading dims.

        Dim 0 whenever its size is a multiple of ``B*n``: that is where the model axis stays through every
        reshape that merges other dims into dim 0 (patches, windows and partitions in vision transformers,
        ``(B*n*P, N, d)``, even where ``N`` happens to equal ``B*n``). Otherwise, inside a ``BatchModule``
        forward (which knows ``n``), the tensor is taken to be laid out sequence-first, ``(seq, B*n, ...)``:
        the first leading dim of exactly ``B*n`` holds the models, else the first multiple of it.
        ``feature_dims`` trailing dims are never candidates. Shapes cannot tell a sequence-first tensor whose
        ``seq`` is a multiple of ``B*n`` from a batch-first one: torch's sequence-first layers
        (``nn.Transformer*`` and ``nn.MultiheadAttention`` with ``batch_first=False``, the recurrent layers)
        say so themselves, and ``BatchModule`` hands their inner layers batch-first tensors.
        """
        if x.dim() - feature_dims <= 1:  # one leading dim (the common case) or none: nothing to search
            self.check_merged(x)
            return 0
        context = current_forward()
        if context is not None and not self.is_shared(x):
            step = self.batch * context.samples
            if x.shape[0] % step:
                leading = range(1, x.dim() - feature_dims)
                exact = [d for d in leading if x.shape[d] == step]
                multiples = [d for d in leading if x.shape[d] % step == 0]
                if exact or multiples:
                    return (exact or multiples)[0]
        self.check_merged(x)
        return 0

    def split(self, x: Tensor) -> Tensor:
        """View a merged ``(B*m, ...)`` tensor as ``(B, m, ...)``; a shared input becomes an expanded view."""
        if self.is_shared(x):
            return x.expand(self.batch, *x.shape)
        self.check_merged(x)
        return self.layout.split(x)

    def merge(self, y: Tensor) -> Tensor:
        """Inverse of :meth:`split`: ``(B, m, ...)`` to this module's merged ``(B*m, ...)`` layout."""
        if y.shape[0] != self.batch:
            raise ValueError(
                f"{type(self).__name__}: expected a leading model axis of {self.batch}, got {tuple(y.shape)}"
            )
        return self.layout.merge(y)

    def extra_repr(self) -> str:
        inner = self.base_class.extra_repr(self) if self.base_class is not nn.Module else ""
        return ", ".join(part for part in (inner, f"batch={self.batch}") if part)


UNBATCHED = (
    "an input without a batch dim (one sample, which torch accepts unbatched) is not supported here: give each "
    "model's input a batch dim of one sample"
)


def constant_under_compile(function: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing the compiler with torchmb (``torch._dynamo``
    and Inductor take about as long to import as torch itself): the mark dynamo reads when it traces a call,
    set as that decorator sets it (tests/torchmb/test_import.py checks that the two agree)."""
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast would compute in on ``device_type`` now, or None when autocast is off there."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def copy_into_every_model(layer: AbstractBatchModule, module: nn.Module) -> None:
    """Copy every parameter and buffer of the plain ``module`` into all of ``layer``'s model slots.

    The batched layer's state-dict names are the plain module's, each entry ``(B, *plain_shape)``.
    """
    source = module.state_dict()
    with torch.no_grad():
        for name, target in layer.state_dict(keep_vars=True).items():
            target.copy_(stack_copies(source[name], layer.batch))


def stack_copies(tensor: Tensor, batch: int) -> Tensor:
    """``(B, *tensor.shape)``: ``batch`` copies of one model's tensor (for ``from_module``)."""
    return tensor.detach().unsqueeze(0).repeat(batch, *([1] * tensor.dim())).clone()
