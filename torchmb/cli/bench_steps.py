"""The training steps ``python -m torchmb bench`` times: one builder per implementation.

A builder makes its implementation's state (models, optimizer, compiled functions) when called and
returns the step; nothing else is held, so that each implementation's peak memory is its own and is
freed before the next one is built. Every implementation starts from the same B plain models' weights
(kept on the host) and trains on the same data.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._module import BatchModule
from ..graphs import CapturedStep
from . import bench_models as models
from .bench_zoo import ZOO_MODELS

Step = Callable[[], object]


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[], nn.Module]
    make_input: Callable[[tuple[int, ...], torch.device], torch.Tensor]
    batches: tuple[int, ...]  # the default numbers of models: what one H200's default run holds and times
    classes: int = 10
    attention: bool = False
    compile_all: bool = False  # whether the default run compiles vmap and the limit too (small models: it is quick)
    steps: Callable[..., Steps] | None = None  # builds the implementations' steps (``Steps`` when None)
    implementations: tuple[str, ...] = ()  # what the default run times (``default_implementations`` when empty)


def _images(channels: int, size: int) -> Callable[[tuple[int, ...], torch.device], torch.Tensor]:
    return lambda lead, device: torch.randn(*lead, channels, size, size, device=device)


def _tokens(lead: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.randint(0, 1000, (*lead, 64), device=device)


#: Every workload ``--workloads`` accepts, by name (:func:`register_workload` adds one).
WORKLOADS = {
    "mlp": Workload("mlp", models.MLP, _images(1, 28), (16, 64, 256), compile_all=True),
    "lenet": Workload("lenet", models.LeNet5, _images(1, 28), (16, 64, 256), compile_all=True),
    "resnet18": Workload("resnet18", models.ResNet18, _images(3, 32), (16,)),
    "transformer": Workload("transformer", models.TransformerClassifier, _tokens, (16,), attention=True),
    "mobilenetv2": Workload("mobilenetv2", models.MobileNetV2, _images(3, 32), (16,)),
    "wide-mlp": Workload("wide-mlp", lambda: models.MLP((784, 1024, 1024, 1024, 1024, 10)), _images(1, 28), (16, 64)),
    **{
        name: Workload(name, make, _images(3, 32), (16, 64), attention=attention)
        for name, (make, attention) in ZOO_MODELS.items()
    },
}


def register_workload(workload: Workload) -> Workload:
    """Add ``workload`` to :data:`WORKLOADS` under its name (``bench --workloads`` then accepts it); refuses a
    name taken already."""
    if workload.name in WORKLOADS:
        raise ValueError(f"a bench workload named {workload.name!r} exists already")
    WORKLOADS[workload.name] = workload
    return workload


#: Every implementation ``--impls`` accepts.
IMPLEMENTATIONS = (
    "torchmb",
    "torchmb+compile",
    "torchmb-models",
    "torchmb-shared",
    "torchmb+graph",
    "vmap",
    "vmap+compile",
    "vmap-shared",
    "loop",
    "limit",
    "limit+compile",
    "limit+graph",
)
GRAPHED = ("torchmb+graph", "limit+graph")  # CUDA only
COMPILED = ("torchmb+compile", "vmap+compile", "limit+compile")


def limit_for(impl: str) -> str:
    """The single-model limit an implementation is compared with: graphed with graphed, compiled with
    compiled, eager with eager."""
    if impl.endswith("+graph"):
        return "limit+graph"
    if impl.endswith("+compile"):
        return "limit+compile"
    return "limit"


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, samples: int) -> torch.Tensor:
    """Sum over models of each model's mean cross-entropy (one reduction, the same for every method)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / samples


def channels_last_images(x: torch.Tensor) -> torch.Tensor:
    """``(*lead, C, H, W)`` images with each image stored channels-last (the view keeps its shape)."""
    images = x.reshape(-1, *x.shape[-3:]).contiguous(memory_format=torch.channels_last)
    return images.view(x.shape)


def vmap_attention(workload: Workload) -> contextlib.AbstractContextManager:
    """The attention backend the vmap ensemble runs with: the math one, since the fused kernels' batching
    rules fail under vmap on CUDA (torch 2.11: "LSE is not correctly aligned") and have none on the CPU
    (vmap falls back to a loop over the models there)."""
    if workload.attention:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


class Steps:
    """Builders of every implementation's step for one workload and B (see :meth:`builders`).

    ``precision="bf16"`` runs every forward and loss under bf16 autocast; ``channels_last`` stores the
    images and the plain models' convolution weights channels-last (image workloads only).
    """

    def __init__(
        self,
        workload: Workload,
        batch: int,
        samples: int,
        device: torch.device,
        precision: str = "fp32",
        channels_last: bool = False,
    ) -> None:
        self.workload, self.batch, self.samples, self.device = workload, batch, samples, device
        self.precision = precision
        self.x = workload.make_input((batch, samples), device)
        self.x_shared = workload.make_input((samples,), device)
        self.channels_last = channels_last and self.x.dim() == 5
        if self.channels_last:
            self.x, self.x_shared = channels_last_images(self.x), channels_last_images(self.x_shared)
        self.y = torch.randint(0, workload.classes, (batch, samples), device=device)
        self.states = [workload.make().state_dict() for _ in range(batch)]  # on the host until a builder runs

    def builders(self) -> dict[str, Callable[[], Step]]:
        """name -> a function that builds that implementation and returns its step (CUDA-graph rows on
        CUDA only, the loop up to B=64)."""
        builders: dict[str, Callable[[], Step]] = {
            "torchmb": lambda: self._torchmb(),
            "torchmb+compile": lambda: self._torchmb(compiled=True),
            "torchmb-models": lambda: self._torchmb(merged_order="models"),
            "torchmb-shared": lambda: self._torchmb(shared_input=True),
            "vmap": lambda: self._vmap(),
            "vmap+compile": lambda: self._vmap(compiled=True),
            "vmap-shared": lambda: self._vmap(shared_input=True),
            "limit": lambda: self._limit(),
            "limit+compile": lambda: self._limit(compiled=True),
        }
        if self.device.type == "cuda":
            builders["torchmb+graph"] = lambda: self._torchmb(graphed=True)
            builders["limit+graph"] = lambda: self._limit(graphed=True)
        if self.batch <= 64:
            builders["loop"] = self._loop
        return builders

    def _make(self, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        model = self.workload.make()
        if state is not None:
            model.load_state_dict(state)
        model = model.to(self.device)
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def _amp(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _torchmb(
        self, merged_order: str = "auto", shared_input: bool = False, compiled: bool = False, graphed: bool = False
    ) -> Step:
        batched = BatchModule(self._make(), self.batch, merged_order=merged_order)
        batched.load_state_dicts(self.states)
        optimizer = torch.optim.SGD(batched.parameters(), lr=0.01)
        samples = self.samples
        x = self.x_shared if shared_input else self.x

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self._amp():
                return summed_cross_entropy(batched(x, shared_input=shared_input), y, samples)

        if graphed:
            return _graphed(_body(loss_of, optimizer), (x, self.y), optimizer)
        return _step(torch.compile(loss_of) if compiled else loss_of, optimizer, x, self.y)

    def _vmap(self, shared_input: bool = False, compiled: bool = False) -> Step:
        base = self.workload.make().to("meta")
        states = [{k: v.to(self.device) for k, v in s.items()} for s in self.states]
        parameters = {
            name: torch.stack([s[name] for s in states]).requires_grad_() for name, _ in base.named_parameters()
        }
        buffers = {name: torch.stack([s[name] for s in states]) for name, _ in base.named_buffers()}
        del states
        optimizer = torch.optim.SGD(list(parameters.values()), lr=0.01)
        samples, workload = self.samples, self.workload

        def one_model(p, b, x):
            return functional_call(base, (p, b), (x,))

        def loss_of(x: torch.Tensor, y: torch.Tensor, randomness: str = "different") -> torch.Tensor:
            with self._amp(), vmap_attention(workload):
                ensemble = vmap(one_model, in_dims=(0, 0, None if shared_input else 0), randomness=randomness)
                return summed_cross_entropy(ensemble(parameters, buffers, x), y, samples)

        x = self.x_shared if shared_input else self.x
        try:
            with torch.no_grad():
                loss_of(x, self.y)
        except RuntimeError as error:
            if "randomness" not in str(error):
                raise
            # torchvision's stochastic depth draws in place into a tensor it creates, which vmap's different
            # randomness refuses: time the same arithmetic with one draw for all models, and say so
            loss_of = functools.partial(loss_of, randomness="same")
            step = _step(torch.compile(loss_of) if compiled else loss_of, optimizer, x, self.y)
            step.note = "randomness='same' (vmap refuses 'different' for this model)"
            return step
        return _step(torch.compile(loss_of) if compiled else loss_of, optimizer, x, self.y)

    def _loop(self) -> Step:
        plain = [self._make(state) for state in self.states]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in plain]

        def step() -> None:
            for i, (model, optimizer) in enumerate(zip(plain, optimizers)):
                optimizer.zero_grad(set_to_none=True)
                with self._amp():
                    loss = F.cross_entropy(model(self.x[i]), self.y[i])
                loss.backward()
                optimizer.step()

        return step

    def _limit(self, compiled: bool = False, graphed: bool = False) -> Step:
        one = self._make(self.states[0])
        optimizer = torch.optim.SGD(one.parameters(), lr=0.01)
        x, y = self.x.reshape(-1, *self.x.shape[2:]), self.y.reshape(-1)

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self._amp():
                return F.cross_entropy(one(x), y)

        if graphed:
            return _graphed(_body(loss_of, optimizer), (x, y), optimizer)
        return _step(torch.compile(loss_of) if compiled else loss_of, optimizer, x, y)


def _step(loss_of: Callable, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Step:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of(x, y).backward()
        optimizer.step()

    return step


def _body(loss_of: Callable, optimizer: torch.optim.Optimizer) -> Callable:
    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(x, y)
        loss.backward()
        optimizer.step()
        return loss

    return body


def _graphed(body: Callable, inputs: tuple[torch.Tensor, ...], optimizer: torch.optim.Optimizer) -> Step:
    """A step that captures ``body`` in a CUDA graph on first use (the first, untimed step), then replays it."""
    captured: list[CapturedStep] = []

    def step() -> object:
        if not captured:
            captured.append(CapturedStep(body, *inputs, optimizers=[optimizer]))
        return captured[0](*inputs)

    return step
