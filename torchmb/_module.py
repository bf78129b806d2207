from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from batch_layers import (
    AbstractBatchModule,
    ForwardContext,
    OffloadedBatchEmbedding,
    SamplesOrderError,
    SamplesOrderProbe,
    constant_under_compile,
    forward_context,
    recognise_shared_by,
)

from ._attention_choice import AttentionKernelChoice
from ._convert import ConversionEntry, convert, run_per_model, stacked_state, warn_if_mostly_generic
from ._generic import is_generic
from ._inductor_fixes import keep_scatter_order_in_inductor
from ._init import build_with_seed, random_state_kept, reset_uncovered, reset_with_seed
from ._late_parameters import watch_late_parameters
from ._order import set_order, start_order
from ._repr import tagged_repr
from ._select import commit_survivors, gather_survivors, survivor_index
from ._shared import SharedMarksKept, SharedSpec, copy_sharing, shared_keys, shared_names, shared_summary
from ._state_dicts import is_per_model, load_plain_states, loading_plan, model_index, plain_model
from ._tracking import Kind, ModelDataTracker, PerModelCodeFound, checking_decisions

__all__ = ["BatchModule"]

logger = logging.getLogger("torchmb")

StateDict = Mapping[str, Any]


class BatchModule(SharedMarksKept, nn.Module):
    """``batch`` independent copies of ``model`` trained as one module.

    Every submodule whose type is registered (see :func:`register_batch_module`) is swapped for its
    grouped-weight batched class. An unregistered module that owns parameters or persistent buffers
    is batched through ``torch.func``: only its own state when registered layers lie below it (they keep
    their fast paths), its whole subtree otherwise; parametrized modules too. Modules without per-model
    state run unchanged on the merged model axis. :meth:`conversion_report` says which path each module
    took and why (the generic ones are listed in :attr:`generic_modules` and the ``repr``; a
    ``UserWarning`` says when most parameters went generic). Tied parameters stay one batched parameter.
    Nothing is traced, so Python control flow in ``forward`` works.

    Args:
        model: the plain model. It is copied, never modified.
        batch: number of models B.
        init: ``"copy"`` starts every model from ``model``'s weights. ``"independent"`` re-initialises
            model ``i`` by seeding torch with ``seed + i`` and calling ``reset_parameters()`` (else
            ``_reset_parameters()``) on each of its submodules in ``model.modules()`` order: torch.nn's
            default initialisation of each layer, not the model's own. Initialisation done in the
            model's ``__init__`` (``normal_(std=0.02)``, zero biases, ``self.apply(_init_weights)``) is
            replaced by those defaults, and a parameter of a module with neither method (a bare
            ``nn.Parameter``) stays identical in all models, with a warning naming it.
            :meth:`from_factory` initialises each model exactly as its own plain construction would;
            prefer it.
        seed: base seed for ``init="independent"``; drawn from torch's generator when ``None``.
        merged_order: the order of the merged model axis between layers. ``"models"`` (row ``b*n + i``)
            keeps every reshape that merges dims into dim 0 correct; ``"samples"`` (row ``i*B + b``)
            makes the grouped layout of convolutions and batch norms a free view, saving two layout
            copies per such layer forward and three backward, but refuses (with an error) a layer input
            whose dim 0 is not exactly ``B*n``. ``"auto"`` runs the first forward models-major and, when
            every batched layer supports ``"samples"`` and one is a convolution or batch norm, switches to
            ``"samples"`` for good after it, unless a layer met such an input (or an output had such rows)
            in that forward. The order in use is :attr:`merged_order`; it is internal: inputs and outputs
            are ``(B, n, ...)`` either way.
        shared: the frozen parameters all models share, stored once without a model axis (a pretrained
            backbone): ``None`` (default) those with ``requires_grad=False``; or a function ``(name,
            parameter) -> bool``, or their names; ``()`` shares none. A module whose parameters are all
            shared runs as the plain module over all B*n samples; :mod:`torchmb.optim` skips shared ones;
            ``load_state_dicts`` refuses other values for them (the fine-tuning tutorial has the details).

    Shape:
        - Input: every tensor argument ``(B, n, *)``; with ``shared_input=True`` every tensor argument is
          ``(n, *)`` and is fed to all models without being copied B times.
        - Output: each tensor of the model's output (tensors, tuples, lists, dicts) as ``(B, n, *)``.

    Examples::

        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> models = BatchModule(net, batch=16, init="independent", seed=0)
        >>> models(torch.randn(16, 32, 4)).shape
        torch.Size([16, 32, 2])
        >>> models(torch.randn(32, 4), shared_input=True).shape
        torch.Size([16, 32, 2])
        >>> BatchModule.from_factory(lambda: nn.Linear(4, 2), batch=16, seed=0)(torch.randn(16, 32, 4)).shape
        torch.Size([16, 32, 2])
    """

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        *,
        init: Literal["copy", "independent"] = "copy",
        seed: int | None = None,
        merged_order: Literal["auto", "models", "samples"] = "auto",
        shared: SharedSpec = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            hint = "; to build each model from its own call, use BatchModule.from_factory" if callable(model) else ""
            raise TypeError(f"BatchModule expects an nn.Module, got {type(model).__name__}{hint}")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive int (the number of models), got {batch!r}")
        if init not in ("copy", "independent"):
            raise ValueError(f"init must be 'copy' or 'independent', got {init!r}")
        if merged_order not in ("auto", "models", "samples"):
            raise ValueError(f"merged_order must be 'auto', 'models' or 'samples', got {merged_order!r}")
        self.batch = batch
        self._first_forward = True  # checked for Python decisions on several models' data
        # and the first shared-input one: code reading one model's sample count from the shared input
        self._shared_checked = False
        self._dry_run = False  # the first forward's eager run before torch.compile traces one
        self._calls_attention = False  # its own code calls F.scaled_dot_product_attention (torchmb._attention_choice)
        # A pristine copy to build plain models from (unbatch), kept out of the module tree on purpose; it and
        # the batched module hold the shared parameters as one tensor each, so a backbone is held once.
        template, model_copy = copy_sharing(model, shared_names(model, shared))
        object.__setattr__(self, "_template", template)
        self.module, self._conversion = convert(model_copy, batch)  # first: refuses what can't batch
        watch_late_parameters(self.module)
        self.shared_keys = shared_keys(self.module)
        self.generic_modules: list[str] = [e.name or e.type for e in self._conversion if e.generic]
        self.merged_order, self._samples_major_pending = start_order(self.module, merged_order, self.generic_modules)
        self._plain_shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        if self.generic_modules:
            logger.info(
                "torchmb: batched through torch.func (no registered layer): %s", ", ".join(self.generic_modules)
            )
            warn_if_mostly_generic(self._conversion)
        if init == "copy":
            self.load_state_dicts(model.state_dict())
        else:
            self._initialise_independently(seed)

    def conversion_report(self) -> list[ConversionEntry]:
        """How each module of the plain model was batched: one entry per module, in ``named_modules`` order
        (registered batched class, ``torch.func`` for its own state or its whole subtree, or unchanged), with
        the reason and the parameters per model that the path batches."""
        return list(self._conversion)

    @classmethod
    def from_factory(
        cls,
        make_model: Callable[[], nn.Module],
        batch: int,
        *,
        seed: int | None = None,
        merged_order: Literal["auto", "models", "samples"] = "auto",
        shared: SharedSpec = None,
    ) -> BatchModule:
        """``batch`` models, model ``i`` built by ``make_model()`` after ``torch.manual_seed(seed + i)``.

        Each model is exactly what ``torch.manual_seed(seed + i); make_model()`` gives, whatever its
        ``__init__`` does (custom initialisation, ``self.apply(_init_weights)``, bare ``nn.Parameter`` attributes).
        The models are built and copied in one at a time, so this needs about one plain model of memory
        besides the batched one. torch's random state is restored afterwards.

        Args:
            make_model: builds one plain model (a class or any function of no arguments).
            batch: number of models B.
            seed: model ``i``'s seed is ``seed + i``; drawn from torch's generator when ``None``.
            merged_order, shared: as in :class:`BatchModule` (every model's shared parameters must be equal).

        Examples::

            >>> models = BatchModule.from_factory(lambda: nn.Linear(4, 2), batch=3, seed=0)
            >>> _ = torch.manual_seed(2)
            >>> torch.equal(models.state_dict_of(2)["weight"], nn.Linear(4, 2).weight)
            True
        """
        if isinstance(make_model, nn.Module) or not callable(make_model):
            raise TypeError(
                f"from_factory expects a callable that builds one model (a class, a lambda), got a "
                f"{type(make_model).__name__} instance"
            )
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        with random_state_kept():  # conversion initialises batched layers before copying weights into them
            batched = cls(build_with_seed(make_model, seed), batch, merged_order=merged_order, shared=shared)
        for i in range(1, batch):
            batched.load_state_dicts(build_with_seed(make_model, seed + i).state_dict(), slots=[i])
        return batched

    def _initialise_independently(self, seed: int | None) -> None:
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        uncovered = reset_uncovered(self._template)
        if uncovered:
            warnings.warn(
                "init='independent' re-initialises only what reset_parameters() covers; these parameters stay "
                f"identical in all {self.batch} models: {', '.join(uncovered)}. BatchModule.from_factory"
                "(make_model, batch, seed=...) initialises each model as its own construction would",
                stacklevel=3,
            )
        shared = {key: value for key, value in self.module.state_dict().items() if key in self.shared_keys}
        for i in range(self.batch):
            model = reset_with_seed(copy.deepcopy(self._template), seed + i)
            self.load_state_dicts({**model.state_dict(), **shared}, slots=[i])  # shared parameters stay as given

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, *args: Any, shared_input: bool = False, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Dynamo runs _settled_order eagerly while it traces (the first forward's checks, which settle
            # the order too) and traces the forward in the order it returns: once, never retraced.
            self._settled_order(shared_input, *args, **kwargs)
            return self._forward(args, shared_input, kwargs)
        if not self._samples_major_pending:
            return self._forward(args, shared_input, kwargs)
        probe = SamplesOrderProbe()
        out = self._forward(args, shared_input, kwargs, probe)
        self._settle_order(probe)
        return out

    def _settle_order(self, probe: SamplesOrderProbe) -> None:
        """After ``"auto"``'s first forward (models-major): samples-major from now on, for good, if it would
        have run that forward; nothing is undone or run again."""
        self._samples_major_pending = False
        refusal = probe.refusal
        if refusal is None and self.generic_modules:  # the first forward found code that runs per model
            refusal = f"{self.generic_modules[-1]} runs per model through torch.func, which splits models-major"
        if refusal is None:
            self.merged_order = set_order(self.module, "samples")
        else:
            logger.info("torchmb: keeping the models-major order, which samples-major cannot replace: %s", refusal)

    @constant_under_compile
    def _settled_order(self, shared_input: bool, *args: Any, **kwargs: Any) -> str:
        """The merged order, settled by the first forward's checks first. Dynamo calls this while tracing,
        with the module and the real inputs (a method, and the tensors as arguments of their own: what every
        torch >= 2.5 accepts there), and traces its result as a constant."""
        keep_scatter_order_in_inductor()  # before Inductor compiles what dynamo traces (torchmb._inductor_fixes)
        return self._dry_first_forward(args, shared_input, kwargs)

    def _dry_first_forward(self, args: tuple, shared_input: bool, kwargs: dict) -> str:
        """The first forward's checks as a dry run (torch.compile traces the forward afterwards, untracked): a
        forward without gradients whose effects on buffers and the random state are undone. Under ``"auto"``
        it settles the order as an eager first forward does."""
        if self._first_forward or self._samples_major_pending or self._shared_unchecked(shared_input):
            probe = SamplesOrderProbe() if self._samples_major_pending else None
            self._dry_run = True  # tracked although dynamo is compiling: this runs eagerly
            try:
                with _state_restored(self, always=True), torch.no_grad():
                    self._forward(args, shared_input, kwargs, probe)
            finally:
                self._dry_run = False
            if probe is not None:
                self._settle_order(probe)
        return self.merged_order

    def _forward(self, args: tuple, shared_input: bool, kwargs: dict, probe: SamplesOrderProbe | None = None) -> Any:
        """The forward in the order in use; ``probe`` notes what the samples-major order would refuse."""
        if len(args) == 1 and not kwargs and type(args[0]) is Tensor:  # the common call: no pytree walk
            (x,) = args
            samples = self._samples([x], shared_input)
            out, labels = self._run(samples, shared_input, probe, x if shared_input else self._merge_input(x))
        else:
            leaves, spec = tree_flatten((args, kwargs))
            tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
            samples = self._samples(tensors, shared_input)
            if not shared_input:
                leaves = [self._merge_input(leaf) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
            call_args, call_kwargs = tree_unflatten(leaves, spec)
            out, labels = self._run(samples, shared_input, probe, *call_args, **call_kwargs)
        if shared_input and labels is not None:
            return tree_map(lambda value: self._split_shared_output(value, samples, labels, probe), out)
        if type(out) is Tensor:
            return split_output(out, self.batch, samples, self.merged_order, probe)
        return tree_map(lambda value: split_output(value, self.batch, samples, self.merged_order, probe), out)

    def _merge_input(self, x: Tensor) -> Tensor:
        """``(B, n, ...)`` to the merged ``(B*n, ...)`` in this module's order (samples-major: a copy)."""
        if self.merged_order == "models":
            return x.reshape(-1, *x.shape[2:])
        return x.transpose(0, 1).reshape(-1, *x.shape[2:])

    def _samples(self, tensors: list[Tensor], shared_input: bool) -> int:
        """n, the samples per model, after checking every tensor argument's leading dims."""
        if not tensors:
            raise ValueError("BatchModule expects at least one tensor argument")
        if shared_input:
            if tensors[0].dim() == 0:
                raise ValueError("shared_input=True expects tensors of shape (n, ...), got a scalar")
            return tensors[0].shape[0]
        for tensor in tensors:
            if tensor.dim() < 2 or tensor.shape[0] != self.batch:
                raise ValueError(
                    f"BatchModule(batch={self.batch}) expects every tensor argument as (B={self.batch}, n, ...), "
                    f"got shape {tuple(tensor.shape)}; pass shared_input=True for one (n, ...) input shared "
                    "by all models"
                )
        return tensors[0].shape[1]

    def _run(
        self, samples: int, shared_input: bool, probe: SamplesOrderProbe | None, *args: Any, **kwargs: Any
    ) -> tuple[Any, ModelDataTracker | None]:
        """The model's merged output, and the tracker that labelled its tensors (if tracked)."""
        with forward_context(ForwardContext(self.batch, samples, shared_input, self.merged_order, probe)):
            if self._dry_run or not torch.compiler.is_compiling():  # compiled code is not tracked (Python modes)
                check_decisions = self._first_forward or checking_decisions() or self._shared_unchecked(shared_input)
                if shared_input or check_decisions:
                    return self._run_tracked(shared_input, check_decisions, args, kwargs)
            if self._calls_attention and torch.compiler.is_compiling():  # (eager, the table keeps torch's choice)
                with AttentionKernelChoice():
                    return self.module(*args, **kwargs), None
            return self.module(*args, **kwargs), None

    def _run_tracked(
        self, shared_input: bool, check_decisions: bool, args: tuple, kwargs: dict
    ) -> tuple[Any, ModelDataTracker]:
        """Run the model labelling its tensors (see ``torchmb._tracking``): the shared input and what is
        computed from it are recognised by identity, and a Python decision on several models' data is
        refused in the first forward and under ``torchmb.testing``."""
        while True:
            try:
                out, tracker = _tracked_forward(self, shared_input, check_decisions, args, kwargs)
            except PerModelCodeFound as found:  # run that module per model, and the forward again
                _run_per_model(self, found)
                continue
            self._first_forward = False
            self._shared_checked = self._shared_checked or shared_input
            self._calls_attention = self._calls_attention or tracker.calls_attention
            return out, tracker

    def _shared_unchecked(self, shared_input: bool) -> bool:
        """Whether this is the first shared-input forward: checked like a first forward, since code that reads
        the sample count from the shared input (``n = x.shape[0]``) sizes merged tensors by one model's count."""
        return shared_input and not self._shared_checked

    def _split_shared_output(
        self, value: Any, samples: int, labels: ModelDataTracker, probe: SamplesOrderProbe | None
    ) -> Any:
        """A shared-input forward's output: one computed without any model's state is every model's (a view)."""
        if isinstance(value, Tensor) and labels.kind(value) is not Kind.PER_MODEL:
            return value.expand(self.batch, *value.shape)
        return split_output(value, self.batch, samples, self.merged_order, probe)

    # -- per-model state --------------------------------------------------------------------------
    def _is_per_model(self, key: str, value: Tensor) -> bool:
        return is_per_model(key, value, self.batch, self._plain_shapes)

    def per_model_keys(self) -> set[str]:
        """The keys of the plain model's state dict whose tensors here carry the model axis, ``(B, *shape)``;
        the others (shared parameters, constant buffers) are stored once for all models."""
        return {key for key, value in self.module.state_dict().items() if self._is_per_model(key, value)}

    def state_dict_of(self, index: int) -> OrderedDict[str, Tensor]:
        """Model ``index``'s plain state dict (cloned tensors), loadable into the original model."""
        index = self._check_index(index)
        return OrderedDict(
            (key, (value[index] if self._is_per_model(key, value) else value).detach().clone())
            for key, value in self.module.state_dict().items()
        )

    def state_dicts(self) -> list[OrderedDict[str, Tensor]]:
        """B plain state dicts, model ``i``'s at position ``i``, each loadable into the original model."""
        return [self.state_dict_of(i) for i in range(self.batch)]

    def load_state_dicts(
        self, state_dicts: StateDict | Sequence[StateDict], *, slots: Sequence[int] | None = None
    ) -> None:
        """Load plain state dicts: one for every model, or a list with one per model (or per slot).

        Args:
            state_dicts: a single plain state dict (loaded into every model or slot) or a sequence of them.
            slots: which models to load into, in order; all B models when ``None``. Parameters keep their
                identity, so optimizers holding them stay valid.
        """
        slots, state_dicts = loading_plan(state_dicts, slots, self.batch)
        targets = self.module.state_dict(keep_vars=True)
        load_plain_states(targets, list(state_dicts), slots, self.batch, self._plain_shapes, self.shared_keys)

    def unbatch(self, index: int) -> nn.Module:
        """A fresh instance of the original model class holding model ``index``'s parameters and buffers."""
        model = plain_model(copy.deepcopy(self._template), self.state_dict_of(index))
        devices = [p.device for p in self.module.parameters()]
        # An offloaded embedding's table lives on the host while the model computes on the GPU.
        device = next((d for d in devices if d.type != "cpu"), devices[0] if devices else None)
        return model.to(device) if device is not None else model

    def select(self, keep: Sequence[int] | Tensor) -> BatchModule:
        """Keep only the models ``keep`` (indices or a boolean mask of length B), in that order; in place.

        Parameters keep their identity (their data shrinks), so an optimizer's ``select(keep)`` with the
        same ``keep`` continues the survivors exactly. Graphs built before (a validation loss computed
        without ``torch.no_grad()``) stay alive and valid for the B models they were built from, but a
        backward through one raises, since it would accumulate into parameters that no longer have
        those models. Atomic: every survivor's tensor is gathered before the first is swapped in, so an
        error leaves the module as it was.
        """
        index = survivor_index(keep, self.batch)
        instead = "build a new BatchModule from the survivors' state_dicts"
        refuse_offloaded(self.module, "select() cannot shrink", instead)
        survivors = gather_survivors(self.module.state_dict(keep_vars=True), index, self._is_per_model)
        commit_survivors(survivors)
        self.batch = len(index)
        for module in self.module.modules():
            if isinstance(module, AbstractBatchModule):
                module.batch = self.batch
            elif is_generic(module):
                module._torchmb_batch = self.batch
        return self

    def _check_index(self, index: int) -> int:
        return model_index(index, self.batch)

    def __repr__(self) -> str:
        """torch's module tree, each converted module's line naming its path (see :meth:`conversion_report`)."""
        modules = dict(self.module.named_modules())
        paths = [(modules.get(entry.name), entry.path) for entry in self._conversion if entry.path != "passthrough"]
        return tagged_repr(self, {id(module): path for module, path in paths if module is not None})

    def extra_repr(self) -> str:
        names = self.generic_modules
        listed = ", ".join(names[:5]) + (f", ... ({len(names)} in all, see conversion_report())" if names[5:] else "")
        generic = f", torch.func path: {listed}" if names else ""
        shared = f", {shared_summary(self.module)}" if self.shared_keys else ""
        return f"batch={self.batch}, merged_order={self.merged_order!r}{shared}{generic}"




def refuse_offloaded(model: nn.Module, action: str, instead: str) -> None:
    """Operations on slices of the model axis cannot reach an offloaded embedding's host table."""
    for name, module in model.named_modules():
        if isinstance(module, OffloadedBatchEmbedding):
            raise NotImplementedError(
                f"{action} {name or 'the model'}: an offloaded embedding keeps all B tables in one host "
                f"table; {instead} instead"
            )


def _tracked_forward(
    batched: BatchModule, shared_input: bool, check_decisions: bool, args: tuple, kwargs: dict
) -> tuple[Any, ModelDataTracker]:
    """One forward under a :class:`ModelDataTracker`, and the tracker that labelled its tensors. Where it checks
    decisions, buffers and the random state are restored if it raises (:class:`PerModelCodeFound` runs it
    again); a shared-input forward that does not check copies no buffer (20% of a ResNet-18 step's kernels)."""
    stacked = stacked_state(batched.module) if check_decisions else None
    tracker = ModelDataTracker(check_decisions=check_decisions, stacked=stacked)
    tracker.mark(tree_flatten((args, kwargs))[0], Kind.SHARED if shared_input else Kind.PER_MODEL)
    restored = _state_restored(batched, always=False) if check_decisions else contextlib.nullcontext()
    with restored, tracker, recognise_shared_by(tracker.is_shared):
        out = batched.module(*args, **kwargs)
    return out, tracker


def _run_per_model(batched: BatchModule, found: PerModelCodeFound) -> None:
    """Make the module the first forward found mixing the models run per model (``torchmb._tracking``)."""
    entry = run_per_model(batched.module, found.module, batched.batch, found.reason, batched._conversion)
    batched.generic_modules.append(entry.name or entry.type)
    logger.info("torchmb: %s runs per model: %s", entry.name or entry.type, found.reason)
    if batched.merged_order != "models":  # the inputs were merged samples-major: merge them again
        raise SamplesOrderError(
            f"{entry.name or entry.type} runs per model through torch.func, which splits the merged axis "
            "models-major: build the BatchModule with merged_order='models'"
        )


@contextlib.contextmanager
def _state_restored(module: nn.Module, *, always: bool) -> Iterator[None]:
    """Restore ``module``'s buffers and the random state after the block if it raises, or ``always``."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    devices = sorted({t.device.index or 0 for t in module.parameters() if t.is_cuda})
    capturing = bool(devices) and torch.cuda.is_current_stream_capturing()
    cpu_rng = torch.get_rng_state()
    cuda_rng = [] if capturing else [torch.cuda.get_rng_state(d) for d in devices]

    def restore() -> None:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        for device, state in zip(devices, cuda_rng):
            torch.cuda.set_rng_state(state, device)

    try:
        yield
    except BaseException:
        restore()
        raise
    if always:
        restore()


def split_output(
    value: Any, batch: int, samples: int, merged_order: str, probe: SamplesOrderProbe | None = None
) -> Any:
    """An output tensor of the merged forward as ``(B, n, ...)``: other values pass through unchanged;
    ``probe`` notes a models-major output that samples-major would refuse."""
    if not isinstance(value, Tensor):
        return value
    if value.shape == (batch,) and samples != 1:  # cannot be B * n rows: one number per model
        return value  # (a loss with per-model class weights, computed per model by the torch.func path)
    if value.dim() == 0 or value.shape[0] % batch:
        raise ValueError(
            f"the model returned a tensor of shape {tuple(value.shape)} whose dim 0 is not a multiple of "
            f"batch={batch}; outputs must keep the merged (B*n) axis in dim 0. A loss reduced in the "
            "model's forward (transformers' labels=) is one value for all models' samples: compute each "
            "model's loss from its outputs with torchmb.batch_loss"
        )
    if merged_order == "models":
        if probe is not None and value.shape[0] != batch * samples:
            probe.note("the model", "output", tuple(value.shape), batch, samples)
        return value.view(batch, -1, *value.shape[1:])
    if value.shape[0] != batch * samples:
        raise SamplesOrderError(
            f"the model returned a tensor of shape {tuple(value.shape)}; in the samples-major merged order "
            f"outputs must have exactly B * n = {batch} * {samples} rows in dim 0 (build the "
            "BatchModule with merged_order='models' for a model that merges other dims into dim 0)"
        )
    return value.view(samples, batch, *value.shape[1:]).transpose(0, 1).contiguous()
