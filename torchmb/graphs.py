"""Whole training steps captured in a CUDA graph: one launch replays forward, backward and optimizer step.

With small models or few models the GPU waits on Python and kernel launches; replaying a captured step
removes both. Everything in torchmb's batched layers is capturable (no host synchronisation, shapes
fixed per step); so are ``torch.optim`` optimizers created with ``capturable=True`` where they have the
option (``SGD`` needs nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["CapturedStep"]


class CapturedStep:
    """Capture ``step(*inputs)`` once, then run it by copying new inputs in and replaying the graph.

    Args:
        step: one training step: forward, ``backward()``, ``optimizer.step()``; it must **not** zero the
            gradients (the replay overwrites them) and must not synchronise with the host.
        example_inputs: CUDA tensors with the shapes and dtypes every later call will use.
        optimizers: whose gradients are set to ``None`` before capture, so that backward writes fresh
            gradient tensors that every replay overwrites.
        warmup: steps run eagerly on a side stream before capture (cuDNN and cuBLAS pick their
            algorithms, optimizers create their state). They are real training steps on
            ``example_inputs``, as in PyTorch's own recipe.

    Calling the object copies the inputs into the captured ones, replays, and returns ``step``'s
    output tensors, which are overwritten by the next call (clone what you keep).

    Examples::

        step = CapturedStep(train_step, x, y, optimizers=[optimizer])
        for x, y in loader:
            losses = step(x, y)
    """

    def __init__(
        self,
        step: Callable[..., Any],
        *example_inputs: Tensor,
        optimizers: Iterable[torch.optim.Optimizer],
        warmup: int = 3,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CapturedStep needs CUDA: CUDA graphs capture GPU work only")
        for i, tensor in enumerate(example_inputs):
            if not isinstance(tensor, Tensor) or not tensor.is_cuda:
                raise TypeError(f"example input {i} must be a CUDA tensor, got {_describe(tensor)}")
        self.step = step
        self.optimizers = list(optimizers)
        self.inputs = tuple(t.detach().clone() for t in example_inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._zero_grad()
                step(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self._zero_grad()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = step(*self.inputs)

    def _zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def __call__(self, *inputs: Tensor) -> Any:
        if len(inputs) != len(self.inputs):
            raise TypeError(f"the captured step takes {len(self.inputs)} inputs, got {len(inputs)}")
        for i, (static, tensor) in enumerate(zip(self.inputs, inputs)):
            if tensor.shape != static.shape or tensor.dtype != static.dtype:
                raise ValueError(
                    f"input {i}: captured as {tuple(static.shape)} {static.dtype}, got {tuple(tensor.shape)} "
                    f"{tensor.dtype}; capture another step for other shapes"
                )
            static.copy_(tensor, non_blocking=True)
        self.graph.replay()
        return self.outputs


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor on {value.device}"
    return type(value).__name__
