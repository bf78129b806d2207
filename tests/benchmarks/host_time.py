"""Host time of one training step of the zoo's models, torchmb against the plain model on all B*n samples,
measured on a CPU (issue 24: at B=16 the zoo's steps are bound by the host).

    PYTHONPATH=.:tests python tests/benchmarks/host_time.py [--workloads tv-resnet18,...] [--batch 16]
        [--samples 2] [--size 8] [--counts] [--cuda-choices] [--profile tv-resnet18 [--impl limit]]

A step is ``bench``'s: forward, the summed cross-entropy divided by n (``torchmb.cli.bench_steps``), backward,
``torch.optim.SGD(foreach=True)`` (the optimizer a CUDA step runs). On a GPU the host only enqueues the
kernels, so a step's host time is Python, the dispatcher and autograd's bookkeeping. On a CPU the kernels
run inline, and for these models the parameter-sized ones (convolutions' weight gradients over B models'
filters, the SGD update) take 10-100x the host time. So this script replaces them, on the CPU, by stubs that
only allocate their results (:class:`AsyncKernels`: convolutions, batch norms, matrix products, their
gradients and ``aten::_foreach_add_``, each a few microseconds of Python, about what a launch costs the
host; a batch norm over B*C channels of a few pixels costs a CPU far more than over C), and feeds small
images (``--size``, 8x8 by default; ConvNeXt needs 32x32, ViT is built for the size) to keep the
element-wise kernels on activations small. What remains is host time plus a small compute floor that
both steps share. The numbers are garbage (the stubs leave memory uninitialised); the operators dispatched
are those of the real CPU step, since every kernel choice on a CPU reads shapes only.

A GPU step takes other paths: the kernel tables send some convolutions to batched matrix products, the
Triton kernels take depthwise weight gradients (through ``_GroupedConv``, a Python autograd function) and
layer norms. ``--cuda-choices`` (:class:`CudaChoices`) makes the tables answer for the CPU's tensors as they
would for CUDA ones with Triton installed, and stubs the Triton kernels as well: the step then dispatches the
operators a GPU step does, less the kernels' own launch code. The choices read the image size: ``--size 32``
gives those of ``bench --zoo``'s 32x32 images.

It prints per model: microseconds per step (this thread's CPU time: the fastest of
``torch.utils.benchmark``'s blocked timings over rounds that take turns) for torchmb and the plain model
and their ratio, and, with ``--counts``, the outermost ATen operators (``bench --launches``'s count), the
computing operators (:mod:`support.launches`) and the nodes of the backward graph
(:func:`support.graph.autograd_nodes`) of each.
``--profile NAME`` prints where torchmb's step (``--impl limit``: the plain model's) spends its host time
instead (cProfile, by own time). ``--layers NAME`` prints, for torchmb and the plain model, the host time of a
step's phases (forward with the loss, backward, the optimizer's step) and of the forward of each kind of leaf
module, summed over the model's modules of that kind (timed between forward hooks, which add the same few
microseconds to both models' layers).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import math
import pstats
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from support.graph import autograd_nodes
from support.launches import count_launches
from support.torchvision_ops import import_torchvision
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark

from torchmb import BatchModule
from torchmb.cli import bench_steps
from torchmb.cli.bench_measure import aten_op_names

ZOO = (
    "tv-resnet18",
    "tv-mobilenet_v3_small",
    "tv-regnet_x_400mf",
    "tv-efficientnet_b0",
    "timm-efficientnet_b0",
    "timm-convnext_atto",
    "timm-vit_tiny",
)
CPU = torch.device("cpu")
SMALLEST_SIZE = {"timm-convnext_atto": 32}  # its stages downsample by 32 without padding


def _conv_output(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _stub_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise NotImplementedError("the host-time stubs cover convolutions, not transposed ones")
    spatial = [
        _conv_output(size, k, s, p, d)
        for size, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    ]
    channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return x.new_empty((x.shape[0], weight.shape[0], *spatial)).contiguous(memory_format=fmt)


def _stub_convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                               groups, mask):
    grad_x = torch.empty_like(x) if mask[0] else x.new_empty(0)
    grad_weight = torch.empty_like(weight) if mask[1] else x.new_empty(0)
    grad_bias = x.new_empty(bias_sizes) if mask[2] and bias_sizes is not None else x.new_empty(0)
    return grad_x, grad_weight, grad_bias


def _stub_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    channels = x.shape[1]
    return torch.empty_like(x), x.new_empty(channels), x.new_empty(channels)


def _stub_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask):
    grad_x = torch.empty_like(x) if mask[0] else x.new_empty(0)
    grad_weight = torch.empty_like(weight) if mask[1] and weight is not None else x.new_empty(0)
    grad_bias = torch.empty_like(weight) if mask[2] and weight is not None else x.new_empty(0)
    return grad_x, grad_weight, grad_bias


def _stub_mm(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def _stub_addmm(start, a, b, beta=1, alpha=1):
    return a.new_empty((a.shape[0], b.shape[1]))


def _stub_bmm(a, b):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


def _stub_baddbmm(start, a, b, beta=1, alpha=1):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


def _stub_foreach_add_(tensors, others, alpha=1):
    return None


STUBS = {
    "convolution": _stub_convolution,
    "convolution_backward": _stub_convolution_backward,
    "native_batch_norm": _stub_batch_norm,
    "native_batch_norm_backward": _stub_batch_norm_backward,
    "mm": _stub_mm,
    "addmm": _stub_addmm,
    "bmm": _stub_bmm,
    "baddbmm": _stub_baddbmm,
    "_foreach_add_.List": _stub_foreach_add_,
}


class AsyncKernels:
    """Inside it, the CPU's convolutions, batch norms and matrix products, their gradients and the foreach
    update allocate their results and compute nothing (see the module's docstring); the kernels are restored on exit."""

    def __enter__(self) -> AsyncKernels:
        self.library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # that it overrides torch's kernels: it means to
            warnings.simplefilter("ignore", UserWarning)
            for name, stub in STUBS.items():
                self.library.impl(name, stub, "CPU")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.library._destroy()


def _stub_grouped_conv2d(x, weight, bias, stride, padding, dilation, groups):
    spatial = [_conv_output(size, k, s, p, d)
               for size, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)]
    return x.new_empty((x.shape[0], weight.shape[0], *spatial))


def _stub_weight_grad(grad, x, weight_shape, *config):
    """Either Triton weight-gradient operator (depthwise, stem): their first three arguments are alike."""
    return x.new_empty(weight_shape)


def _stub_norm_affine_forward(x, weight, bias, features, eps, layout, rms, out_dtype):
    rows = x.numel() // features
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(0 if rms else rows, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32))


def _stub_norm_affine_backward(grad, x, weight, mean, rstd, features, layout, rms, needs, param_dtype):
    needs_dx, needs_dw, needs_db = needs
    batch = layout.batch
    return (torch.empty_like(x) if needs_dx else None,
            x.new_empty(batch, features, dtype=param_dtype) if needs_dw else None,
            x.new_empty(batch, features, dtype=param_dtype) if needs_db else None)


_COPY = torch.ops.aten.copy_.default
_BELOW_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional)
LARGE = 1 << 16
"""Elements from which :class:`CudaChoices` copies and zeroes nothing (B models' weight gradients)."""


def _stub_large_copy_(self, src, non_blocking=False):
    if not isinstance(src, torch.Tensor):  # a number, as the boxed call hands it
        return self.fill_(src)
    if self.numel() >= LARGE:
        return self
    return _COPY.redispatch(_BELOW_CPU, self, src, non_blocking)


def _stub_large_zero_(self):
    return self if self.numel() >= LARGE else self.fill_(0)


_INDEX_SELECT = torch.ops.aten.index_select.default
_INDEX_ADD = torch.ops.aten.index_add_.default


def _stub_large_index_select(self, dim, index):
    shape = list(self.shape)
    shape[dim] = index.numel()
    if math.prod(shape) >= LARGE:
        return self.new_empty(shape)
    return _INDEX_SELECT.redispatch(_BELOW_CPU, self, dim, index)


def _stub_large_index_add_(self, dim, index, source, alpha=1):
    if self.numel() >= LARGE:
        return self
    return _INDEX_ADD.redispatch(_BELOW_CPU, self, dim, index, source, alpha=alpha)


class CudaChoices:
    """Inside it, the kernel tables of convolutions and norms answer for CPU tensors as for CUDA ones with
    Triton installed, and the Triton kernels they choose allocate their results only (``--cuda-choices``):
    a step takes the paths of a GPU step. Those paths copy, zero and gather weight-sized tensors (the matrix
    products' filters and their gradients), so copies, zeroings, ``index_select`` and ``index_add_`` of
    :data:`LARGE` elements or more do nothing here; the others
    run through a Python stub that costs about three times a CPU copy's host time (plain steps copy little).
    Everything is restored on exit."""

    def __enter__(self) -> CudaChoices:
        from batch_layers import _kernel_table, _norm_table
        from batch_layers.functional import _norm

        self.candidates = [c for op in (*_kernel_table.OPS.values(), *_norm_table.NORM_OPS.values()) for c in op]
        self.conditions = [c.conditions for c in self.candidates]
        for c in self.candidates:
            c.conditions = tuple((text, (lambda lim, call: True) if text == "a CUDA tensor" else check)
                                 for text, check in c.conditions)
        self.triton_installed, _kernel_table.TRITON_INSTALLED = _kernel_table.TRITON_INSTALLED, True
        self.norms = _norm.norm_affine_forward, _norm.norm_affine_backward
        _norm.norm_affine_forward, _norm.norm_affine_backward = _stub_norm_affine_forward, _stub_norm_affine_backward
        self.library = torch.library.Library("torchmb", "IMPL")
        self.library.impl("grouped_conv2d", _stub_grouped_conv2d, "CPU")
        self.library.impl("depthwise_weight_grad", _stub_weight_grad, "CPU")
        self.library.impl("grouped_weight_grad", _stub_weight_grad, "CPU")
        self.aten = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # that it overrides torch's kernels: it means to
            warnings.simplefilter("ignore", UserWarning)
            self.aten.impl("copy_", _stub_large_copy_, "CPU")
            self.aten.impl("zero_", _stub_large_zero_, "CPU")
            self.aten.impl("index_select", _stub_large_index_select, "CPU")
            self.aten.impl("index_add_", _stub_large_index_add_, "CPU")
        return self

    def __exit__(self, *exc_info: object) -> None:
        from batch_layers import _kernel_table
        from batch_layers.functional import _norm

        self.aten._destroy()
        self.library._destroy()
        _norm.norm_affine_forward, _norm.norm_affine_backward = self.norms
        _kernel_table.TRITON_INSTALLED = self.triton_installed
        for c, conditions in zip(self.candidates, self.conditions):
            c.conditions = conditions


LossOf = Callable[[], torch.Tensor]


def workload(name: str, size: int) -> bench_steps.Workload:
    """``bench``'s workload ``name`` on ``size`` x ``size`` images (ViT built for that size)."""
    work = bench_steps.WORKLOADS[name]
    size = max(size, SMALLEST_SIZE.get(name, 0))
    make = work.make
    if name == "timm-vit_tiny":

        def make():
            import timm

            return timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=size, patch_size=4)

    return dataclasses.replace(work, make=make, make_input=bench_steps._images(3, size))


def steps(name: str, batch: int, samples: int, size: int) -> dict[str, Callable[[], None]]:
    """The torchmb and plain ("limit") steps of ``bench``, with the foreach SGD a CUDA step runs."""
    return steps_of(losses(name, batch, samples, size))


def steps_of(built_losses: dict[str, tuple[LossOf, torch.nn.Module]]) -> dict[str, Callable[[], None]]:
    """A training step of each of :func:`losses`'s losses."""
    return {impl: _step(loss_of, model) for impl, (loss_of, model) in built_losses.items()}


def losses(
    name: str, batch: int, samples: int, size: int, device: torch.device = CPU
) -> dict[str, tuple[LossOf, torch.nn.Module]]:
    """The torchmb and plain ("limit") losses of ``bench``'s step, each with the model it trains."""
    work = workload(name, size)
    x = work.make_input((batch, samples), device)
    y = torch.randint(0, work.classes, (batch, samples), device=device)
    torch.manual_seed(0)
    batched = BatchModule(work.make().to(device), batch)
    plain = work.make().to(device)

    def torchmb_loss() -> torch.Tensor:
        return bench_steps.summed_cross_entropy(batched(x), y, samples)

    merged_x, merged_y = x.reshape(-1, *x.shape[2:]), y.reshape(-1)

    def plain_loss() -> torch.Tensor:
        return F.cross_entropy(plain(merged_x), merged_y)

    return {"torchmb": (torchmb_loss, batched), "limit": (plain_loss, plain)}


def _optimizer(model: torch.nn.Module) -> torch.optim.SGD:
    """``bench``'s SGD, as a CUDA step runs it (``foreach``)."""
    return torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)


def _step(loss_of, model: torch.nn.Module):
    optimizer = _optimizer(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of().backward()
        optimizer.step()

    step()  # the first step settles the merged order and creates the optimizer's state
    return step


def host_us(built: dict[str, Callable[[], None]], rounds: int, min_run_time: float) -> dict[str, float]:
    """Microseconds per step of each of ``built``'s steps: the fastest of ``torch.utils.benchmark``'s blocks
    over ``rounds`` rounds that take turns between the steps, each block timed in this thread's CPU time
    (``time.thread_time``: on a shared machine the time others' work takes the core away does not count)."""
    timers = {impl: benchmark.Timer("step()", globals={"step": step}, num_threads=1, timer=time.thread_time)
              for impl, step in built.items()}
    blocks = {impl: [] for impl in built}
    for _ in range(rounds):
        for impl, timer in timers.items():
            blocks[impl] += timer.blocked_autorange(min_run_time=min_run_time).times
    return {impl: min(times) * 1e6 for impl, times in blocks.items()}


def phases_and_layers_ms(loss_of: LossOf, model: torch.nn.Module, steps: int = 25) -> dict[str, float]:
    """Host milliseconds of a training step's phases (``"forward"`` with the loss, ``"backward"``,
    ``"optimizer"``) and of the forward of each leaf module class (``"Conv2d (52)"``: its modules' sum), each the
    fastest of ``steps`` steps after three (this thread's CPU time)."""
    optimizer = _optimizer(model)
    leaves = [module for module in model.modules() if module is not model and next(module.children(), None) is None]
    kinds = collections.Counter(type(module).__name__ for module in leaves)
    started: dict[int, float] = {}
    spent: collections.Counter[str] = collections.Counter()

    def start(module, args):
        started[id(module)] = time.thread_time()

    def stop(module, args, output):
        kind = type(module).__name__
        spent[f"{kind} ({kinds[kind]})"] += time.thread_time() - started.pop(id(module))

    handles = [handle for module in leaves
               for handle in (module.register_forward_pre_hook(start), module.register_forward_hook(stop))]
    best: dict[str, float] = {}
    try:
        for i in range(steps + 3):
            spent.clear()
            optimizer.zero_grad(set_to_none=True)
            t0 = time.thread_time()
            loss = loss_of()
            t1 = time.thread_time()
            loss.backward()
            t2 = time.thread_time()
            optimizer.step()
            t3 = time.thread_time()
            if i >= 3:
                for key, seconds in {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, **spent}.items():
                    best[key] = min(best.get(key, math.inf), seconds * 1e3)
    finally:
        for handle in handles:
            handle.remove()
    return best


def print_phases_and_layers(name: str, batch: int, samples: int, size: int) -> None:
    times = {impl: phases_and_layers_ms(loss_of, model)
             for impl, (loss_of, model) in losses(name, batch, samples, size).items()}
    print(f"{name} B={batch}: host ms, torchmb against the plain model")
    for key in sorted(times["torchmb"], key=lambda k: (k not in ("forward", "backward", "optimizer"),
                                                      -times["torchmb"][k])):
        print(f"  {key:32} {times['torchmb'][key]:8.2f} {times['limit'].get(key, math.nan):8.2f}")


def aten_ops(step) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    return sum(aten_op_names(profiler.events()).values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default=",".join(ZOO))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--size", type=int, default=8, help="image height and width (at least what a model needs)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of timing, taking turns between the steps")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds of each step's timing per round")
    parser.add_argument("--counts", action="store_true",
                        help="also count ATen and computing operators, and autograd nodes")
    parser.add_argument("--cuda-choices", action="store_true",
                        help="take the kernel tables' choices for CUDA tensors (the paths of a GPU step)")
    parser.add_argument("--profile", help="print where this workload's torchmb step spends its host time")
    parser.add_argument("--impl", default="torchmb", choices=("torchmb", "limit"), help="the step --profile profiles")
    parser.add_argument("--layers", help="print this workload's host time per phase and per kind of layer")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    import_torchvision()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    with AsyncKernels(), CudaChoices() if args.cuda_choices else contextlib.nullcontext():
        if args.profile:
            step = steps(args.profile, args.batch, args.samples, args.size)[args.impl]
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [step() for _ in range(5)])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)
            return
        if args.layers:
            print_phases_and_layers(args.layers, args.batch, args.samples, args.size)
            return
        header = f"{'model':24} {'torchmb us':>10} {'plain us':>9} {'ratio':>6}"
        print(header + ("  aten ops (torchmb/plain)  computing ops  autograd nodes" if args.counts else ""), flush=True)
        for name in args.workloads.split(","):
            built_losses = losses(name, args.batch, args.samples, args.size)
            built = steps_of(built_losses)
            times = host_us(built, args.rounds, args.min_run_time)
            line = f"{name:24} {times['torchmb']:10.0f} {times['limit']:9.0f} {times['torchmb'] / times['limit']:6.2f}"
            if args.counts:
                aten = {impl: aten_ops(step) for impl, step in built.items()}
                computing = {impl: sum(count_launches(step).values()) for impl, step in built.items()}
                line += (f"  {aten['torchmb']:5d}/{aten['limit']:<5d} {aten['torchmb'] / aten['limit']:.2f}x"
                         f"  {computing['torchmb']:5d}/{computing['limit']:<5d}"
                         f" {computing['torchmb'] / computing['limit']:.2f}x")
                nodes = {impl: len(autograd_nodes(loss_of())) for impl, (loss_of, _) in built_losses.items()}
                line += f"  {nodes['torchmb']:5d}/{nodes['limit']:<5d} {nodes['torchmb'] / nodes['limit']:.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
