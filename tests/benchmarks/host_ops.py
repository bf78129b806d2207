"""Host microseconds per call of the operators a batched convolution enqueues on a GPU, beside the plain
layer's (issue 24: at B=16 the zoo's steps wait on the host, not on the GPU).

    PYTHONPATH=. python tests/benchmarks/host_ops.py

Each line is the best of five runs of 200 calls of the host time to enqueue one call (nothing waits for the
GPU inside a run, as in a training step; ``profile_step.py --host``'s "enqueue ms" is the same measure for a
whole step). ``torch.profiler`` adds tens of microseconds to every operator it records, so its CPU times
overstate cheap operators (views) against expensive ones; these do not. The shapes are a MobileNetV3-small
depthwise layer and a pointwise layer at B=16, n=128 on 32x32 images; the host time barely depends on them.
"""

from __future__ import annotations

import torch
from _timing import enqueue_seconds

from batch_layers._depthwise_triton import depthwise_weight_grad


def main() -> None:
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    models, samples = 16, 128
    # a depthwise 3x3 layer with stride 2 (16 channels per model): grouped input, output gradient, weight
    grouped = torch.randn(samples, models * 16, 16, 16, device=device)
    grad = torch.randn(samples, models * 16, 8, 8, device=device)
    depthwise = torch.randn(models * 16, 1, 3, 3, device=device)
    grad_args = (grad, grouped, list(depthwise.shape), [2, 2], [1, 1], [1, 1])
    body = depthwise_weight_grad._init_fn  # the custom operator's Python body, without its dispatch
    # a pointwise layer, 16 -> 64 channels per model on 8x8 images: as a product, grouped, and the plain one's
    filters, pixels = torch.randn(models, 64, 16, device=device), torch.randn(models, 16, samples * 64, device=device)
    merged = torch.randn(samples, models * 16, 8, 8, device=device)
    stacked = torch.randn(models * 64, 16, 1, 1, device=device)
    plain_input = torch.randn(models * samples, 16, 8, 8, device=device)
    plain_weight = torch.randn(64, 16, 1, 1, device=device)
    tracked = grouped.clone().requires_grad_()
    rows = {
        "depthwise weight gradient, Triton (torchmb::depthwise_weight_grad)": lambda: depthwise_weight_grad(*grad_args),
        "  the same, its Python body without the custom operator's dispatch": lambda: body(*grad_args),
        "depthwise weight gradient, ATen (aten::convolution_backward)": lambda: torch.ops.aten.convolution_backward(
            grad, grouped, depthwise, None, [2, 2], [1, 1], [1, 1], False, [0, 0], models * 16, [False, True, False]),
        "pointwise layer as a batched product (aten::bmm)": lambda: torch.bmm(filters, pixels),
        "pointwise layer as cuDNN's grouped convolution": lambda: torch.convolution(
            merged, stacked, None, [1, 1], [0, 0], [1, 1], False, [0, 0], models),
        "the plain model's pointwise layer (cuDNN, dense)": lambda: torch.convolution(
            plain_input, plain_weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        "a view": lambda: grouped.view(samples, models, 16, 16, 16),
        "a view that autograd records": lambda: tracked.view(samples, models, 16, 16, 16),
        "an element-wise add": lambda: torch.add(grad, grad),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: host microseconds per call")
    for name, call in rows.items():
        print(f"{enqueue_seconds(call, calls=200, runs=5, warmup=20) * 1e6:8.1f}  {name}")


if __name__ == "__main__":
    main()
