"""Layer and RMS norms with a per-model affine, forward + backward (input, weight and bias gradients), on
ViT-Tiny's shapes (192 features, 65 tokens, n samples per model): the fused Triton kernels
(``batch_layers/_norm_triton.py``) against the composite they replace (torch's norm without affine plus a
broadcast product and sum, the ``triton`` switch off) and against the limit (the plain model's norm with
its affine on all B*n rows, one weight set).

    PYTHONPATH=. python tests/benchmarks/bench_norm_affine.py [--batches 16,64] [--samples 128] [--device cuda]

``--tune`` instead times the fused kernels alone for each setting of their tile constants
(``batch_layers/_norm_triton.py``: elements per thread, backward programs per multiprocessor).

Prints milliseconds per forward + backward (``torch.utils.benchmark``'s median) and the ratios; a ``-`` where
the fused kernels do not apply (no CUDA, no Triton: ``--device cpu`` times the composite and the limit only).
The kernel table of norms (``batch_layers/_norm_table.py``) rests on these numbers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import torchmb_config
from batch_layers import Layout, _norm_triton, explain_norm_kernels
from batch_layers._norm_table import runs_fused_norm
from batch_layers.functional import layer_norm, rms_norm

FEATURES, TOKENS = 192, 65


def _step(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, layout: Layout | None):
    """One forward + backward of the norm; ``layout`` None: the plain norm with one weight set (the limit)."""
    if layout is None:
        y = F.rms_norm(x, (FEATURES,), weight) if kind == "rms" else F.layer_norm(x, (FEATURES,), weight, bias)
    elif kind == "rms":
        y = rms_norm(x, (FEATURES,), weight, layout=layout)
    else:
        y = layer_norm(x, (FEATURES,), weight, bias, layout=layout)
    params = (x, weight) if kind == "rms" else (x, weight, bias)
    torch.autograd.grad(y, params, torch.ones_like(y))
    return y


def _ms(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, layout: Layout | None) -> float:
    """Median milliseconds of one :func:`_step` (``torch.utils.benchmark`` synchronises CUDA)."""
    timer = benchmark.Timer("step(kind, x, weight, bias, layout)", globals={
        "step": _step, "kind": kind, "x": x, "weight": weight, "bias": bias, "layout": layout})
    return timer.blocked_autorange(min_run_time=0.5).median * 1e3


def _rows(kind: str, dtype: torch.dtype, batch: int, samples: int, device: torch.device, orders: list[str]):
    """The table's rows of one norm, dtype and B: one per merged order."""
    x = torch.randn(batch * samples, TOKENS, FEATURES, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(batch, FEATURES, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(batch, FEATURES, device=device, dtype=dtype, requires_grad=True)
    limit = _ms(kind, x, weight[0].detach().requires_grad_(), bias[0].detach().requires_grad_(), None)
    for order in orders:
        layout = Layout(batch, order)
        with torchmb_config.use("triton", False):
            composite = _ms(kind, x, weight, bias, layout)
        if type(_step(kind, x, weight, bias, layout).grad_fn).__name__ == "_FusedNormBackward":
            fused = _ms(kind, x, weight, bias, layout)
            cells = f"{fused:.3f}", f"{composite / fused:.2f}", f"{limit / fused:.2f}"
        else:  # the kernels do not apply here (see explain_norm_kernels)
            cells = "-", "-", "-"
        yield (f"| {kind} | {str(dtype).removeprefix('torch.')} | {batch} | {order} | {cells[0]} | "
               f"{composite:.3f} | {limit:.3f} | {cells[1]} | {cells[2]} |")


def _tune(batch: int, samples: int, device: torch.device) -> None:
    """The fused layer norm's milliseconds for each setting of the kernels' tile constants, fp32 and bf16."""
    probe = torch.randn(batch, FEATURES, device=device)
    if not runs_fused_norm(probe, FEATURES, rms=False):
        print(explain_norm_kernels(cuda=probe.is_cuda, dtype=probe.dtype, features=FEATURES))
        return
    print("| dtype | B | forward per thread | backward per thread | programs per SM | fused ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    layout = Layout(batch, "models")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(batch * samples, TOKENS, FEATURES, device=device, dtype=dtype, requires_grad=True)
        weight = torch.randn(batch, FEATURES, device=device, dtype=dtype, requires_grad=True)
        bias = torch.randn(batch, FEATURES, device=device, dtype=dtype, requires_grad=True)
        for forward, backward, programs in ((f, b, p) for f in (4, 8, 16) for b in (2, 4, 8) for p in (4, 8, 16)):
            _norm_triton.FORWARD_PER_THREAD, _norm_triton.BACKWARD_PER_THREAD = forward, backward
            _norm_triton.PROGRAMS_PER_SM = programs
            print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {forward} | {backward} | {programs} | "
                  f"{_ms('layer', x, weight, bias, layout):.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,64", help="comma-separated numbers of models B")
    parser.add_argument("--samples", type=int, default=128, help="samples per model n")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--orders", default="models,samples", help="comma-separated merged orders to time")
    parser.add_argument("--tune", action="store_true", help="time the fused kernels' tile constants instead "
                        "(the first of --batches)")
    args = parser.parse_args()
    if args.tune:
        _tune(int(args.batches.split(",")[0]), args.samples, torch.device(args.device))
        return
    print("| norm | dtype | B | order | fused ms | composite ms | limit ms | composite / fused | limit / fused |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("layer", "rms"):
        for dtype in (torch.float32, torch.bfloat16):
            for batch in (int(b) for b in args.batches.split(",")):
                for row in _rows(kind, dtype, batch, args.samples, torch.device(args.device), args.orders.split(",")):
                    print(row, flush=True)


if __name__ == "__main__":
    main()
