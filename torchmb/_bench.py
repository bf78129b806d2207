"""``python -m torchmb bench``: training B models at once, torchmb against the ways people do it today.

For each workload and number of models B, in one process and on one device:

- ``torchmb``: ``BatchModule`` (and, where asked, its shared-input path); ``torchmb-models``: the same
  with the models-major merged order forced (``auto`` takes samples-major for convolutional models);
- ``vmap``: a ``torch.func`` ensemble (``stack_module_state`` + ``functional_call`` + ``vmap``), eager,
  and ``vmap+compile`` under ``torch.compile`` (compile time reported separately);
- ``loop``: a Python loop over B separate models, each with its own optimizer (up to B=64);
- ``limit``: one plain model trained on the same B*n samples, the practical upper limit.

Every implementation takes a full SGD training step (forward, the same summed cross-entropy, backward,
optimizer step) on n samples per model. Reported: model-steps per second, ratios to eager vmap and to
the limit, peak device memory.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _bench_models as models
from ._module import BatchModule
from .graphs import CapturedStep
from .memory import largest_fitting, max_batch


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[], nn.Module]
    make_input: Callable[[tuple[int, ...], torch.device], torch.Tensor]
    classes: int = 10
    attention: bool = False


def _images(channels: int, size: int) -> Callable[[tuple[int, ...], torch.device], torch.Tensor]:
    return lambda lead, device: torch.randn(*lead, channels, size, size, device=device)


def _tokens(lead: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.randint(0, 1000, (*lead, 64), device=device)


WORKLOADS = {
    "mlp": Workload("mlp", models.MLP, _images(1, 28)),
    "lenet": Workload("lenet", models.LeNet5, _images(1, 28)),
    "resnet18": Workload("resnet18", models.ResNet18, _images(3, 32)),
    "transformer": Workload("transformer", models.TransformerClassifier, _tokens, attention=True),
    "mobilenetv2": Workload("mobilenetv2", models.MobileNetV2, _images(3, 32)),
    "wide-mlp": Workload("wide-mlp", lambda: models.MLP((784, 1024, 1024, 1024, 1024, 10)), _images(1, 28)),
}

IMPLEMENTATIONS = (
    "torchmb",
    "torchmb-models",
    "torchmb-shared",
    "torchmb+graph",
    "vmap",
    "vmap-shared",
    "vmap+compile",
    "loop",
    "limit",
    "limit+graph",
)
GRAPHED = ("torchmb+graph", "limit+graph")  # CUDA only


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds_per_call(self, fn: Callable[[], object], warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - start) / iters


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, samples: int) -> torch.Tensor:
    """Sum over models of each model's mean cross-entropy (one reduction, the same for every method)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / samples


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """``(*lead, C, H, W)`` images with each image stored channels-last (the view keeps its shape)."""
    images = x.reshape(-1, *x.shape[-3:]).contiguous(memory_format=torch.channels_last)
    return images.view(x.shape)


def _step_functions(
    workload: Workload,
    batch: int,
    samples: int,
    device: torch.device,
    implementations: tuple[str, ...],
    precision: str = "fp32",
    channels_last: bool = False,
):
    """name -> step callable for every implementation that applies.

    ``precision="bf16"`` runs every forward and loss under bf16 autocast; ``channels_last`` stores the
    images and the plain models' convolution weights channels-last (image workloads only).
    """
    x_models = workload.make_input((batch, samples), device)
    x_shared = workload.make_input((samples,), device)
    channels_last = channels_last and x_models.dim() == 5
    if channels_last:
        x_models, x_shared = _channels_last(x_models), _channels_last(x_shared)
    y = torch.randint(0, workload.classes, (batch, samples), device=device)

    def make() -> nn.Module:
        model = workload.make().to(device)
        return model.to(memory_format=torch.channels_last) if channels_last else model

    def amp() -> contextlib.AbstractContextManager:
        if precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    plain = [make() for _ in range(batch)]
    steps: dict[str, Callable[[], object]] = {}

    batched = BatchModule(make(), batch)
    batched.load_state_dicts([m.state_dict() for m in plain])
    batched_opt = torch.optim.SGD(batched.parameters(), lr=0.01)

    def torchmb_step(shared_input: bool = False) -> None:
        batched_opt.zero_grad(set_to_none=True)
        with amp():
            out = batched(x_shared if shared_input else x_models, shared_input=shared_input)
            loss = _summed_cross_entropy(out, y, samples)
        loss.backward()
        batched_opt.step()

    steps["torchmb"] = torchmb_step
    if "torchmb-models" in implementations:
        models_major = BatchModule(make(), batch, merged_order="models")
        models_major.load_state_dicts([m.state_dict() for m in plain])
        models_major_opt = torch.optim.SGD(models_major.parameters(), lr=0.01)

        def models_major_step() -> None:
            models_major_opt.zero_grad(set_to_none=True)
            with amp():
                loss = _summed_cross_entropy(models_major(x_models), y, samples)
            loss.backward()
            models_major_opt.step()

        steps["torchmb-models"] = models_major_step

    def torchmb_body(x, targets):
        with amp():
            loss = _summed_cross_entropy(batched(x), targets, samples)
        loss.backward()
        batched_opt.step()
        return loss

    if "torchmb+graph" in implementations and device.type == "cuda":
        steps["torchmb+graph"] = _graphed(torchmb_body, (x_models, y), batched_opt)
    shared = any("shared" in impl for impl in implementations)
    if shared:
        steps["torchmb-shared"] = lambda: torchmb_step(True)

    params, buffers = stack_module_state(plain)
    base = copy.deepcopy(plain[0]).to("meta")
    vmap_opt = torch.optim.SGD(list(params.values()), lr=0.01)

    def one_model(p, b, x):
        return functional_call(base, (p, b), (x,))

    def vmap_loss(p, b, x, shared_input):
        out = vmap(one_model, in_dims=(0, 0, None if shared_input else 0), randomness="different")(p, b, x)
        return _summed_cross_entropy(out, y, samples)

    def vmap_step(shared_input: bool = False, loss_fn=vmap_loss) -> None:
        vmap_opt.zero_grad(set_to_none=True)
        with amp(), _vmap_attention(workload, device):
            loss = loss_fn(params, buffers, x_shared if shared_input else x_models, shared_input)
        loss.backward()
        vmap_opt.step()

    steps["vmap"] = vmap_step
    if shared:
        steps["vmap-shared"] = lambda: vmap_step(True)
    if "vmap+compile" in implementations:
        compiled = torch.compile(vmap_loss)
        steps["vmap+compile"] = lambda: vmap_step(False, compiled)

    if batch <= 64:
        loop_opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in plain]

        def loop_step() -> None:
            for i, (model, opt) in enumerate(zip(plain, loop_opts)):
                opt.zero_grad(set_to_none=True)
                with amp():
                    loss = F.cross_entropy(model(x_models[i]), y[i])
                loss.backward()
                opt.step()

        steps["loop"] = loop_step

    one = make()
    one_opt = torch.optim.SGD(one.parameters(), lr=0.01)
    x_flat, y_flat = x_models.reshape(-1, *x_models.shape[2:]), y.reshape(-1)

    def limit_step() -> None:
        one_opt.zero_grad(set_to_none=True)
        with amp():
            loss = F.cross_entropy(one(x_flat), y_flat)
        loss.backward()
        one_opt.step()

    steps["limit"] = limit_step

    def limit_body(x, targets):
        with amp():
            loss = F.cross_entropy(one(x), targets)
        loss.backward()
        one_opt.step()
        return loss

    if "limit+graph" in implementations and device.type == "cuda":
        steps["limit+graph"] = _graphed(limit_body, (x_flat, y_flat), one_opt)
    return steps


def _vmap_attention(workload: Workload, device: torch.device) -> contextlib.AbstractContextManager:
    """The attention backend the vmap ensemble runs with: on CUDA the math one, since the fused kernels'
    batching rules fail under vmap (torch 2.11: "LSE is not correctly aligned"); elsewhere the default."""
    if workload.attention and device.type == "cuda":
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _graphed(
    body: Callable, inputs: tuple[torch.Tensor, ...], optimizer: torch.optim.Optimizer
) -> Callable[[], object]:
    """A step that captures ``body`` in a CUDA graph on first use (inside the timed warm-up), then replays it."""
    captured: list[CapturedStep] = []

    def step() -> object:
        if not captured:
            captured.append(CapturedStep(body, *inputs, optimizers=[optimizer]))
        return captured[0](*inputs)

    return step


def run(
    workloads: list[str],
    batches: list[int],
    samples: int,
    device: torch.device,
    implementations: tuple[str, ...] = IMPLEMENTATIONS,
    iters: int = 20,
    warmup: int = 3,
    log: Callable[[str], None] = print,
    precision: str = "fp32",
    channels_last: bool = False,
) -> list[dict]:
    """Time every implementation; peak memory is the steady state's (a first step, which compiles,
    captures or autotunes cuDNN, runs before the peak is reset and is reported on its own)."""
    timer = Timer(device)
    rows: list[dict] = []
    for name in workloads:
        workload = WORKLOADS[name]
        for batch in batches:
            torch.manual_seed(0)
            steps = _step_functions(workload, batch, samples, device, implementations, precision, channels_last)
            for impl in implementations:
                if impl not in steps:
                    continue
                row = {"workload": name, "B": batch, "n": samples, "impl": impl, "precision": precision,
                       "channels_last": channels_last}
                if impl.startswith("vmap") and workload.attention and device.type == "cuda":
                    row["attention"] = "math"
                try:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    start = time.perf_counter()
                    steps[impl]()
                    timer.sync()
                    if impl == "vmap+compile":
                        row["compile_s"] = time.perf_counter() - start
                    if device.type == "cuda":
                        row["first_step_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
                        torch.cuda.reset_peak_memory_stats(device)
                    seconds = timer.seconds_per_call(steps[impl], warmup, iters)
                    row.update(ms_per_step=seconds * 1e3, model_steps_per_s=batch / seconds)
                    if device.type == "cuda":
                        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
                except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # report, go on with the rest
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                rows.append(row)
                log(json.dumps(row))
            del steps
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _add_ratios(rows)
    return rows


def largest_batches(workloads: list[str], samples: int, device: torch.device, upper: int) -> list[dict]:
    """Per workload, the largest B whose SGD training step fits on ``device``: torchmb and vmap."""
    rows = []
    for name in workloads:
        workload = WORKLOADS[name]
        model = workload.make().to(device)
        x_one = workload.make_input((samples,), device)
        y_one = torch.randint(0, workload.classes, (samples,), device=device)
        largest = max_batch(
            model,
            x_one,
            device=device,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
            loss_fn=lambda out, y_one=y_one: _summed_cross_entropy(out, y_one.expand(out.shape[0], -1), samples),
            upper=upper,
        )
        rows.append({"workload": name, "impl": "torchmb", "n": samples, "largest_B": largest})
        print(json.dumps(rows[-1]), flush=True)
        base = copy.deepcopy(model).to("meta")

        refusals: list[str] = []

        def vmap_step(batch: int, model=model, base=base, x_one=x_one, y_one=y_one, refusals=refusals) -> None:
            try:
                _vmap_step(batch, model, base, x_one, y_one)
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as error:  # a kernel refusing B models (32-bit indexing, cuDNN limits): no step
                refusals.append(f"B={batch}: {str(error).splitlines()[0][:160]}")
                raise torch.cuda.OutOfMemoryError(f"vmap at B={batch}: {error}") from error

        def _vmap_step(batch: int, model, base, x_one, y_one, workload=workload) -> None:
            params = {
                k: v.detach().unsqueeze(0).repeat(batch, *[1] * v.dim()).requires_grad_()
                for k, v in model.named_parameters()
            }
            buffers = {k: v.unsqueeze(0).repeat(batch, *[1] * v.dim()) for k, v in model.named_buffers()}
            opt = torch.optim.SGD(list(params.values()), lr=0.01)
            x = x_one.unsqueeze(0).expand(batch, *x_one.shape).contiguous()
            with _vmap_attention(workload, device):
                out = vmap(lambda p, b, xi: functional_call(base, (p, b), (xi,)), randomness="different")(
                    params, buffers, x
                )
                _summed_cross_entropy(out, y_one.expand(batch, -1), samples).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        rows.append(
            {
                "workload": name,
                "impl": "vmap",
                "n": samples,
                "largest_B": largest_fitting(vmap_step, upper=upper, device=device),
                "refused": refusals,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    by_key = {(r["workload"], r["B"], r["impl"]): r for r in rows if "model_steps_per_s" in r}
    for row in rows:
        if "model_steps_per_s" not in row:
            continue
        for anchor, key in (("vmap", "vs_vmap"), ("limit", "vs_limit")):
            reference = by_key.get((row["workload"], row["B"], anchor))
            if reference is not None:
                row[key] = row["model_steps_per_s"] / reference["model_steps_per_s"]


def table(rows: list[dict]) -> str:
    lines = [
        "| workload | B | impl | model-steps/s | vs eager vmap | vs limit | peak MiB | first-step peak MiB "
        "| compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['B']} | {r['impl']} | {r['error']} | | | | | |")
            continue
        cells = [
            f"{r['model_steps_per_s']:,.0f}",
            f"{r['vs_vmap']:.2f}" if "vs_vmap" in r else "",
            f"{r['vs_limit']:.2f}" if "vs_limit" in r else "",
            f"{r['peak_mib']:,.0f}" if "peak_mib" in r else "",
            f"{r['first_step_peak_mib']:,.0f}" if "first_step_peak_mib" in r else "",
            f"{r['compile_s']:.1f}" if "compile_s" in r else "",
        ]
        lines.append(f"| {r['workload']} | {r['B']} | {r['impl']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="MLP and LeNet, B in {1, 4}, n=16: a smoke run")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated, from " + ", ".join(WORKLOADS)
    )
    parser.add_argument("--batches", default="1,16,64,256", help="numbers of models B (default 1,16,64,256)")
    parser.add_argument("--samples", type=int, default=128, help="samples per model n (default 128)")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="comma-separated subset of implementations")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: forward and loss under bf16 autocast"
    )
    parser.add_argument(
        "--channels-last", action="store_true", help="images and plain conv weights stored channels-last"
    )
    parser.add_argument("--json", help="write the rows and the environment to this file")
    parser.add_argument(
        "--max-batch",
        type=int,
        metavar="UPPER",
        help="instead: the largest B that trains, torchmb and vmap, up to UPPER",
    )


def main(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    impls = tuple(i for i in args.impls.split(",") if i)
    unknown += sorted(set(impls) - set(IMPLEMENTATIONS))
    if unknown:
        raise SystemExit(f"unknown workload or implementation: {', '.join(unknown)}")
    batches = [int(b) for b in args.batches.split(",")]
    samples, iters = args.samples, args.iters
    if args.max_batch:
        if device.type != "cuda":
            raise SystemExit("--max-batch measures device memory: it needs --device cuda")
        rows = largest_batches(workloads, samples, device, args.max_batch)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"environment": {"torch": torch.__version__, "device": _device_name(device)}, "rows": rows}, f
                )
        return rows
    if device.type == "cuda":  # timed runs autotune cuDNN; the search above does not (each B is a new shape)
        torch.backends.cudnn.benchmark = True
    if args.quick:
        workloads = [w for w in workloads if w in ("mlp", "lenet")] or ["mlp"]
        batches, samples, iters = [1, 4], 16, 3
        impls = tuple(i for i in impls if i != "vmap+compile")
    rows = run(
        workloads, batches, samples, device, impls, iters=iters, warmup=1 if args.quick else 3,
        precision=args.precision, channels_last=args.channels_last,
    )
    print(table(rows))
    if args.json:
        environment = {"torch": torch.__version__, "device": _device_name(device)}
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "rows": rows}, f, indent=1)
    return rows


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
