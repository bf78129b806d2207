"""Sequence layers: forward+backward time of the batched layer vs ``torch.func.vmap`` vs a loop of B layers.

For B models of MultiheadAttention, LSTM, GRU and TransformerEncoderLayer, each fed ``n`` sequences per
model, times one training step's forward and backward (CUDA events, median of repeats after warm-up):

- ``batched``: the torchmb layer (``batch_layers.*``, or ``BatchModule`` for the Transformer layer, whose
  children are swapped);
- ``vmap``: ``torch.func.vmap`` over ``functional_call`` of the original layer with stacked parameters;
- ``loop``: B plain layers called one after another (cuDNN for the recurrent ones);
- ``one``: one plain layer on all ``B*n`` sequences, the speed limit (same work, one weight set).

Ratios ``vmap / batched`` and ``loop / batched`` above 1 mean the batched layer is faster.

    python tests/benchmarks/bench_layers_seq.py [--batches 16 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from _timing import cuda_ms as timed_ms
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import batch_layers
from torchmb import BatchModule


def cuda_ms(fn) -> float:
    """This benchmark times 15 steps a row (recurrent layers are slow)."""
    return timed_ms(fn, iters=15)


def first_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def step_fn(run, params, x):
    """One forward + backward through ``run(x)``; gradients are dropped between steps."""
    x = x.detach().requires_grad_()

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        first_tensor(run(x)).sum().backward()

    return step


LAYERS = {
    # name: (plain layer factory, per-model input shape (n, ...), call)
    "MultiheadAttention E=256 h=4 L=64": (
        lambda: nn.MultiheadAttention(256, 4, batch_first=True),
        (32, 64, 256),
        lambda layer, x: layer(x, x, x, need_weights=False),
    ),
    "LSTM 64->128 T=32": (lambda: nn.LSTM(64, 128, batch_first=True), (32, 32, 64), lambda layer, x: layer(x)),
    "LSTM 2 layers bidir 64->128 T=32": (
        lambda: nn.LSTM(64, 128, 2, batch_first=True, bidirectional=True),
        (32, 32, 64),
        lambda layer, x: layer(x),
    ),
    "GRU 64->128 T=32": (lambda: nn.GRU(64, 128, batch_first=True), (32, 32, 64), lambda layer, x: layer(x)),
    "TransformerEncoderLayer d=128 h=4 ff=512 L=64": (
        lambda: nn.TransformerEncoderLayer(128, 4, 512, 0.0, batch_first=True),
        (16, 64, 128),
        lambda layer, x: layer(x),
    ),
}


def measure(name: str, batch: int, device: torch.device) -> dict:
    make, shape, call = LAYERS[name]
    torch.manual_seed(0)
    plain = [make().to(device) for _ in range(batch)]
    x = torch.randn(batch, *shape, device=device)
    row: dict = {"layer": name, "B": batch, "n": shape[0]}

    if name.startswith("Transformer"):
        module = BatchModule(copy.deepcopy(plain[0]), batch).to(device)
        module.load_state_dicts([p.state_dict() for p in plain])
        row["batched"] = cuda_ms(step_fn(lambda x: module(x), list(module.parameters()), x))
    else:
        layer = batch_layers.__dict__[type(plain[0]).__name__].from_module(plain[0], batch).to(device)
        merged = x.reshape(-1, *shape[1:])
        row["batched"] = cuda_ms(step_fn(lambda x: call(layer, x), list(layer.parameters()), merged))

    params, buffers = stack_module_state(plain)
    base = copy.deepcopy(plain[0]).to("meta")

    def one_model(p, b, xi):
        return first_tensor(call(_Functional(base, p, b), xi))

    vmapped = vmap(one_model, randomness="different")
    vmap_step = step_fn(lambda x: vmapped(params, buffers, x), list(params.values()), x)
    row["vmap"] = None
    try:
        row["vmap"] = cuda_ms(vmap_step)
    except Exception as error:  # a layer that vmap cannot run is a result, reported as such
        row["vmap_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    if row["vmap"] is None:
        # The fused attention / cuDNN kernels have no batching rule; give vmap the plain-torch kernels.
        try:
            with sdpa_kernel(SDPBackend.MATH), torch.backends.cudnn.flags(enabled=False):
                row["vmap"] = cuda_ms(vmap_step)
            row["vmap_note"] = "math SDPA / no cuDNN (the fused kernels fail under vmap)"
        except Exception as error:
            row["vmap_error"] += f"; without fused kernels: {type(error).__name__}: {str(error).splitlines()[0][:120]}"

    loop_params = [p for layer in plain for p in layer.parameters()]
    row["loop"] = cuda_ms(
        step_fn(lambda x: torch.stack([first_tensor(call(m, x[i])) for i, m in enumerate(plain)]), loop_params, x),
        iters=5 if batch > 32 else 10,
    )
    single = plain[0]
    merged = x.reshape(-1, *shape[1:])
    row["one"] = cuda_ms(step_fn(lambda x: call(single, x), list(single.parameters()), merged))
    row["vmap/batched"] = None if row["vmap"] is None else row["vmap"] / row["batched"]
    row["loop/batched"] = row["loop"] / row["batched"]
    row["batched/one"] = row["batched"] / row["one"]
    return row


class _Functional:
    """Calls ``module`` (on the meta device) with one model's parameters through ``functional_call``."""

    def __init__(self, module: nn.Module, params: dict, buffers: dict) -> None:
        self.module, self.state = module, {**params, **buffers}

    def __call__(self, *args, **kwargs):
        return functional_call(self.module, self.state, args, kwargs)


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
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tf32": False}
    print(f"\n{meta['device']}, torch {meta['torch']}, fp32 (TF32 off), fwd+bwd ms (median)")
    print(f"{'layer':48} {'B':>4} {'batched':>8} {'vmap':>8} {'loop':>8} {'one':>7} {'vmap/b':>7} {'loop/b':>7}")
    for r in rows:
        vmap_ms = f"{r['vmap']:8.2f}" if r["vmap"] is not None else "   error"
        ratio = f"{r['vmap/batched']:7.2f}" if r["vmap"] is not None else "      -"
        print(
            f"{r['layer']:48} {r['B']:>4} {r['batched']:8.2f} {vmap_ms} {r['loop']:8.2f} {r['one']:7.2f} "
            f"{ratio} {r['loop/batched']:7.2f}"
        )
        if r.get("vmap_error"):
            print(f"    vmap: {r['vmap_error']}")
        if r.get("vmap_note"):
            print(f"    vmap: {r['vmap_note']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
