"""Convolution, norm and activation layers: forward+backward time of the batched layer vs ``torch.func.vmap``
vs a loop of B layers.

For B models of each layer family, each fed ``n`` samples per model, times one training step's forward and
backward (input gradient included; CUDA events, median of repeats after warm-up, TF32 off):

- ``batched``: the ``batch_layers`` class on the merged ``(B*n, ...)`` input;
- ``vmap``: ``torch.func.vmap`` over ``functional_call`` of the original layer with stacked parameters;
- ``loop``: B plain layers called one after another;
- ``one``: one plain layer on all ``B*n`` samples, the speed limit (same work, one weight set).

For GroupNorm and InstanceNorm2d an ``alt`` column times the other way to batch them (the models' channels
side by side, ``(n, B*C, ...)``, through one norm with B*G groups and the flattened affine, two transposing
copies), which ``batch_layers`` does not use; it is measured so the choice stays checked.

Ratios ``vmap / batched`` and ``loop / batched`` above 1 mean the batched layer is faster.

    python tests/benchmarks/bench_layers_norm_conv.py [--batches 16 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F
from _timing import cuda_ms
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from torchmb import lookup_batch_module


def step_fn(run, params, inputs):
    """One forward + backward through ``run(*inputs)``; gradients are dropped between steps."""
    inputs = [x.detach().requires_grad_() for x in inputs]

    def step() -> None:
        for t in (*params, *inputs):
            t.grad = None
        run(*inputs).sum().backward()

    return step


LAYERS = {
    # name: (plain layer factory, per-model input shapes (n, ...))
    "Linear 256->256": (lambda: nn.Linear(256, 256), [(64, 256)]),
    "Conv2d 32->32 k3 16x16": (lambda: nn.Conv2d(32, 32, 3, padding=1), [(16, 32, 16, 16)]),
    "ConvTranspose2d 32->16 k2 s2 16x16": (lambda: nn.ConvTranspose2d(32, 16, 2, stride=2), [(16, 32, 16, 16)]),
    "ConvTranspose2d 16->16 k3 s1 16x16": (lambda: nn.ConvTranspose2d(16, 16, 3, padding=1), [(16, 16, 16, 16)]),
    "BatchNorm2d 32 16x16": (lambda: nn.BatchNorm2d(32), [(16, 32, 16, 16)]),
    "LayerNorm 256 (32 tokens)": (lambda: nn.LayerNorm(256), [(16, 32, 256)]),
    "RMSNorm 256 (32 tokens)": (lambda: nn.RMSNorm(256), [(16, 32, 256)]),
    "GroupNorm 8x32 16x16": (lambda: nn.GroupNorm(8, 32), [(16, 32, 16, 16)]),
    "InstanceNorm2d 32 affine 16x16": (lambda: nn.InstanceNorm2d(32, affine=True), [(16, 32, 16, 16)]),
    "PReLU 32 16x16": (lambda: nn.PReLU(32), [(16, 32, 16, 16)]),
    "PReLU 1 (256 features)": (lambda: nn.PReLU(), [(64, 256)]),
    "Bilinear 64x64->64": (lambda: nn.Bilinear(64, 64, 64), [(64, 64), (64, 64)]),
}


def alternative(layer: nn.Module, batch: int):
    """Channels-side-by-side batching for GroupNorm / InstanceNorm2d (see the module docstring), or None."""
    if isinstance(layer, nn.GroupNorm):

        def norm(x, weight, bias):
            return F.group_norm(x, batch * layer.num_groups, weight, bias, layer.eps)
    elif isinstance(layer, nn.InstanceNorm2d):

        def norm(x, weight, bias):
            return F.instance_norm(x, weight=weight, bias=bias, eps=layer.eps)
    else:
        return None

    def run(weight, bias, x):
        models = x.view(batch, -1, *x.shape[1:])
        n, channels = models.shape[1], models.shape[2]
        wide = models.transpose(0, 1).reshape(n, batch * channels, *x.shape[2:])
        y = norm(wide, weight.reshape(-1), bias.reshape(-1))
        return y.view(n, batch, channels, *x.shape[2:]).transpose(0, 1).reshape(x.shape)

    return run


def measure(name: str, batch: int, device: torch.device) -> dict:
    make, shapes = LAYERS[name]
    torch.manual_seed(0)
    plain = [make().to(device) for _ in range(batch)]
    for layer in plain:
        layer.train()
    inputs = [torch.randn(batch, *shape, device=device) for shape in shapes]
    merged = [x.reshape(-1, *x.shape[2:]) for x in inputs]
    row: dict = {"layer": name, "B": batch, "n": shapes[0][0]}

    batched = lookup_batch_module(type(plain[0])).from_module(plain[0], batch).to(device)
    batched.load_state_dict({k: torch.stack([p.state_dict()[k] for p in plain]) for k in batched.state_dict()})
    row["batched"] = cuda_ms(step_fn(batched, list(batched.parameters()), merged))

    params, buffers = stack_module_state(plain)
    base = copy.deepcopy(plain[0]).to("meta")

    def one_model(p, b, *xs):
        return functional_call(base, {**p, **b}, xs)

    try:
        vmapped = vmap(one_model, in_dims=(0, 0, *([0] * len(inputs))), randomness="different")
        row["vmap"] = cuda_ms(step_fn(lambda *xs: vmapped(params, buffers, *xs), list(params.values()), inputs))
    except Exception as error:  # a layer that vmap cannot run is a result, reported as such
        row["vmap"] = None
        row["vmap_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"

    loop_params = [p for layer in plain for p in layer.parameters()]
    row["loop"] = cuda_ms(
        step_fn(lambda *xs: torch.stack([m(*(x[i] for x in xs)) for i, m in enumerate(plain)]), loop_params, inputs),
        iters=5 if batch > 32 else 10,
    )
    single = plain[0]
    row["one"] = cuda_ms(step_fn(single, list(single.parameters()), merged))

    alt = alternative(single, batch)
    if alt is not None:
        weight = torch.stack([p.weight for p in plain]).detach().requires_grad_()
        bias = torch.stack([p.bias for p in plain]).detach().requires_grad_()
        row["alt"] = cuda_ms(step_fn(lambda x: alt(weight, bias, x), [weight, bias], merged))
        row["alt/batched"] = row["alt"] / row["batched"]
    row["vmap/batched"] = None if row["vmap"] is None else row["vmap"] / row["batched"]
    row["loop/batched"] = row["loop"] / row["batched"]
    row["batched/one"] = row["batched"] / row["one"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--layers", nargs="*", default=list(LAYERS))
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    rows = []
    for name in args.layers:
        for batch in args.batches:
            row = measure(name, batch, device)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\ndevice: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| layer | B | batched ms | vmap ms | loop ms | one ms | vmap/batched | loop/batched | alt/batched |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def fmt(value, digits=3):
        return "n/a" if value is None else f"{value:.{digits}f}"

    for r in rows:
        print(
            f"| {r['layer']} | {r['B']} | {fmt(r['batched'])} | {fmt(r['vmap'])} | {fmt(r['loop'])} | "
            f"{fmt(r['one'])} | {fmt(r['vmap/batched'], 2)} | {fmt(r['loop/batched'], 2)} | "
            f"{fmt(r.get('alt/batched'), 2)} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
