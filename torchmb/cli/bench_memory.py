"""Whether a bench row fits in device memory, estimated before it runs (``python -m torchmb bench``).

One plain model's footprint is measured once per workload, on the bench's device, precision and layout:
its parameters with their gradients (``state_bytes``), and the tensors its forward on n samples saves for
backward (``activation_bytes``, counted through ``torch.autograd.graph.saved_tensors_hooks``, each storage
once, the parameters and the input left out). From it, each implementation's need at B models:

- B models' weights and B models' activations (torchmb and vmap, shared input or not): ``B * (state + act)``;
- the limit, one model on B*n samples: ``state + B * act``;
- the loop, B models of which one computes at a time: ``B * state + act``;

where ``act`` is ``activation_bytes`` times ``TRANSIENT``, 1.2, for what a step holds beside the saved
tensors (the activations' gradients during backward, cuDNN's workspaces): with it the estimate came within
0.88-1.05x of the steady peaks ``bench`` measured on an H100 (docs/performance.md: torchvision's ResNet-18,
timm's ConvNeXt-atto and ViT-Tiny at B=16, torchmb and vmap; the CIFAR ResNet-18 at B=16).

Each adds the B*n samples' inputs and targets. A row whose need exceeds the device's free memory (before
the inputs of its B are made) is skipped with a note instead of running into
out-of-memory. A row near the edge may still run out of memory: the bench catches that and goes on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .bench_steps import Workload, channels_last_images, summed_cross_entropy

__all__ = ["Footprint", "estimated_need", "free_memory", "one_model_footprint"]

TRANSIENT = 1.2


@dataclass(frozen=True)
class Footprint:
    """One plain model's memory in a training step on n samples, in bytes."""

    state_bytes: int  # parameters and their gradients (SGD without momentum keeps no state)
    activation_bytes: int  # tensors the forward saves for backward
    sample_bytes: int = 0  # one sample's input and target


def one_model_footprint(
    workload: Workload, samples: int, device: torch.device, precision: str = "fp32", channels_last: bool = False
) -> Footprint:
    """Measure one plain model of ``workload``: a forward and loss on ``samples`` samples, nothing trained."""
    model = workload.make().to(device)
    x = workload.make_input((1, samples), device)
    if channels_last and x.dim() == 5:
        x, model = channels_last_images(x), model.to(memory_format=torch.channels_last)
    x = x[0]
    y = torch.randint(0, workload.classes, (1, samples), device=device)
    parameters = list(model.parameters())
    left_out = {t.untyped_storage().data_ptr() for t in (*parameters, x)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in left_out and storage.device.type != "meta":
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        loss = summed_cross_entropy(model(x).unsqueeze(0), y, samples)
    del loss
    state = 2 * sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    state += sum(p.numel() * p.element_size() for p in parameters if not p.requires_grad)
    sample = (x.numel() * x.element_size() + y.numel() * y.element_size()) // samples
    return Footprint(state_bytes=state, activation_bytes=sum(saved.values()), sample_bytes=sample)


def estimated_need(impl: str, batch: int, footprint: Footprint, samples: int = 0) -> int:
    """Bytes ``impl`` needs for ``batch`` models (see the module's docstring), with the inputs and targets of
    ``samples`` samples per model."""
    state, activations = footprint.state_bytes, round(TRANSIENT * footprint.activation_bytes)
    inputs = batch * samples * footprint.sample_bytes
    if impl.startswith("limit"):
        return inputs + state + batch * activations
    if impl == "loop":
        return inputs + batch * state + activations
    return inputs + batch * (state + activations)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now (the caching allocator emptied first); None where it cannot say (CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]
