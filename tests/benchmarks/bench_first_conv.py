"""LeNet's first convolution batched over B models (GPU): one input channel per model, so PyTorch runs the
grouped convolution with its depthwise kernel. Forward + backward against the same layer padded to two input
channels per model (cuDNN's grouped kernels then), channels-last, and the plain model's dense convolution
over the same B*n images (the limit's work). n=128, 28x28 images, 5x5 kernels, 6 output channels.

    PYTHONPATH=. python3 tests/benchmarks/bench_first_conv.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _timing import cuda_ms

SAMPLES, OUT, SIZE, KERNEL = 128, 6, 28, 5


def runs(batch: int, dev: torch.device) -> dict:
    """name -> one forward + backward of the layer, for ``batch`` models."""
    n, side = SAMPLES, SIZE - KERNEL + 1
    x = torch.randn(n, batch, SIZE, SIZE, device=dev, requires_grad=True)
    w = torch.randn(batch * OUT, 1, KERNEL, KERNEL, device=dev, requires_grad=True)
    b = torch.randn(batch * OUT, device=dev, requires_grad=True)
    grad = torch.randn(n, batch * OUT, side, side, device=dev)
    padded_x = F.pad(x.detach().unsqueeze(2), (0, 0, 0, 0, 0, 1)).view(n, 2 * batch, SIZE, SIZE).requires_grad_()
    padded_w = F.pad(w.detach(), (0, 0, 0, 0, 0, 1)).requires_grad_()
    last_x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    dense_x = torch.randn(n * batch, 1, SIZE, SIZE, device=dev, requires_grad=True)
    dense_w = torch.randn(OUT, 1, KERNEL, KERNEL, device=dev, requires_grad=True)
    dense_b = torch.randn(OUT, device=dev, requires_grad=True)
    dense_grad = torch.randn(n * batch, OUT, side, side, device=dev)
    return {
        "grouped (depthwise kernel)": lambda: F.conv2d(x, w, b, groups=batch).backward(grad),
        "padded to 2 channels": lambda: F.conv2d(padded_x, padded_w, b, groups=batch).backward(grad),
        "channels-last": lambda: F.conv2d(last_x, w, b, groups=batch).backward(grad),
        "dense, one model (limit)": lambda: F.conv2d(dense_x, dense_w, dense_b).backward(dense_grad),
    }


def main() -> None:
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}: ms per forward + backward (median of CUDA-event timings)")
    for batch in (16, 64, 256):
        timed = {name: cuda_ms(fn, warmup=5, iters=50) for name, fn in runs(batch, dev).items()}
        print(f"B={batch}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in timed.items()))


if __name__ == "__main__":
    main()
