"""More models than fit at once: the largest B a device holds, and training B models in chunks of models.

``max_batch`` finds, by a short dry run of real training steps, the largest number of models whose step
fits in device memory. ``step_in_chunks`` trains a ``BatchModule`` whose activations for all B models do
not fit: it runs forward and backward for a slice of the models at a time (the parameters, gradients and
optimizer state of all B stay where they are), which gives exactly the gradients of one full step, since
no model's computation depends on another's. Chunking the data axis instead would change batch-norm
statistics; chunking the model axis changes nothing.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from batch_layers import AbstractBatchModule

from ._generic import is_generic
from ._module import BatchModule, refuse_offloaded

__all__ = ["largest_fitting", "max_batch", "models_subset", "step_in_chunks"]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def largest_fitting(
    try_batch: Callable[[int], None], *, upper: int = 65536, device: torch.device | str = "cuda"
) -> int:
    """The largest ``B <= upper`` for which ``try_batch(B)`` runs without running out of device memory.

    Doubles B from 1 until a trial runs out of memory (or ``upper``), then bisects. Returns 0 if even one
    model does not fit. Each trial's memory is released before the next.
    """
    device = torch.device(device)

    def fits(batch: int) -> bool:
        try:
            try_batch(batch)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            _free(device)

    if upper < 1:
        raise ValueError(f"upper must be at least 1, got {upper}")
    if not fits(1):
        return 0
    good = 1
    while good < upper:
        trial = min(2 * good, upper)
        if not fits(trial):
            bad = trial
            break
        good = trial
    else:
        return good
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def max_batch(
    model: nn.Module,
    sample_input: Tensor,
    *,
    device: torch.device | str = "cuda",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[Any], Tensor] | None = None,
    upper: int = 65536,
) -> int:
    """The largest number of copies of ``model`` that train in one step on ``device``, by a dry run.

    Args:
        model: the plain model.
        sample_input: one model's input, ``(n, ...)``; every model gets a copy of it.
        device: where to measure.
        optimizer: builds the optimizer from the parameters (default SGD with momentum, whose state is
            one buffer per parameter); its state counts, so pass the one you will train with.
        loss_fn: maps the ``(B, n, ...)`` output to a scalar (default: mean square).
        upper: stop searching here.

    Returns:
        The largest B whose forward, backward and optimizer step fit; 0 if one model does not.
    """
    device = torch.device(device)
    make_optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9))
    loss = loss_fn or (lambda out: out.float().square().mean())

    def try_batch(batch: int) -> None:
        batched = BatchModule(model, batch).to(device)
        opt = make_optimizer(batched.parameters())
        x = sample_input.to(device)
        inputs = x.unsqueeze(0).expand(batch, *x.shape)
        loss(batched(inputs)).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return largest_fitting(try_batch, upper=upper, device=device)


def _batched_children(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, AbstractBatchModule) or is_generic(m)]


@contextlib.contextmanager
def models_subset(batched: BatchModule, start: int, stop: int) -> Iterator[BatchModule]:
    """Within the block, ``batched`` computes only models ``start .. stop-1``.

    Its parameters and per-model buffers are replaced by views of those models' rows, so gradients flow
    into the full parameters and buffer updates (batch-norm running statistics) land in the right rows.
    """
    if not 0 <= start < stop <= batched.batch:
        raise IndexError(f"models {start}..{stop - 1} are out of range for batch={batched.batch}")
    refuse_offloaded(batched.module, "models_subset cannot slice", "train it in one step")
    size = stop - start
    swapped: list[tuple[dict, str, Tensor]] = []
    owners = dict(batched.module.named_modules())
    per_model = batched.per_model_keys()
    saved_batches = [(m, m._torchmb_batch if is_generic(m) else m.batch) for m in _batched_children(batched.module)]
    full_batch = batched.batch
    try:
        for key in per_model:
            owner_name, _, attr = key.rpartition(".")
            owner = owners[owner_name]
            table = owner._parameters if attr in owner._parameters else owner._buffers
            full = table[attr]
            swapped.append((table, attr, full))
            table[attr] = full[start:stop]
        for module, _ in saved_batches:
            if is_generic(module):
                module._torchmb_batch = size
            else:
                module.batch = size
        batched.batch = size
        yield batched
    finally:
        for table, attr, full in swapped:
            table[attr] = full
        for module, batch in saved_batches:
            if is_generic(module):
                module._torchmb_batch = batch
            else:
                module.batch = batch
        batched.batch = full_batch


def step_in_chunks(
    batched: BatchModule,
    inputs: Tensor | Sequence[Tensor],
    loss_fn: Callable[[Any, slice], Tensor],
    models_per_chunk: int,
    *,
    shared_input: bool = False,
) -> Tensor:
    """Forward and backward of all B models, ``models_per_chunk`` models at a time; returns the (B,) losses.

    Gradients accumulate into the parameters exactly as one full step's would (call ``optimizer.step()``
    afterwards, as usual). Peak activation memory is that of ``models_per_chunk`` models.

    Args:
        batched: the models.
        inputs: a tensor or tuple of tensors, each ``(B, n, ...)``; with ``shared_input``, ``(n, ...)``.
        loss_fn: ``loss_fn(outputs, models)`` gives the ``(len(models),)`` losses of the models in the
            slice ``models`` from their outputs, e.g. ``lambda out, m: batch_loss(out, targets[m])``.
        models_per_chunk: models per forward/backward pass.
    """
    if models_per_chunk < 1:
        raise ValueError(f"models_per_chunk must be at least 1, got {models_per_chunk}")
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    losses = []
    for start in range(0, batched.batch, models_per_chunk):
        models = slice(start, min(start + models_per_chunk, batched.batch))
        chunk_inputs = inputs if shared_input else tuple(x[models] for x in inputs)
        with models_subset(batched, models.start, models.stop):
            chunk_losses = loss_fn(batched(*chunk_inputs, shared_input=shared_input), models)
        if chunk_losses.shape != (models.stop - models.start,):
            raise ValueError(
                f"loss_fn must return one loss per model of the chunk, shape ({models.stop - models.start},), "
                f"got {tuple(chunk_losses.shape)}"
            )
        chunk_losses.sum().backward()
        losses.append(chunk_losses.detach())
    return torch.cat(losses)
