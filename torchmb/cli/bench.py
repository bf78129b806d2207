"""``python -m torchmb bench``: training B models at once, torchmb against the ways people do it today.

For each workload and number of models B, in one process and on one device:

- ``torchmb``: ``BatchModule``; ``torchmb+compile``: its forward and loss under ``torch.compile``;
  ``torchmb-models``: the models-major merged order forced (``auto`` takes samples-major for
  convolutional models); ``torchmb-shared``: one input batch shared by all models; ``torchmb+graph``:
  the step captured once in a CUDA graph;
- ``vmap``: a ``torch.func`` ensemble (``stack_module_state`` + ``functional_call`` + ``vmap``), eager,
  ``vmap+compile`` with its forward and loss under ``torch.compile``, ``vmap-shared``;
- ``loop``: a Python loop over B separate models, each with its own optimizer (up to B=64);
- ``limit``: one plain model trained on the same B*n samples, the practical upper limit, eager, compiled
  (``limit+compile``) and graph-captured (``limit+graph``).

Every implementation takes a full SGD training step (forward, the same summed cross-entropy, backward,
``torch.optim.SGD`` step) on n samples per model. Each is built, measured and freed on its own, so its
peak memory is its own. Its first step (which compiles, captures or autotunes cuDNN: ``compile_s``,
``first_step_peak_mib``) is untimed; then ``repeats`` timings of ``iters`` steps each give the median
model-steps per second and its range. Ratios are to eager vmap and to the limit of the same kind
(eager, compiled or graphed), each with the range the two ranges allow; where the ranges overlap the
ratio is a tie (``"tie": true``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.func import functional_call, vmap
from tqdm import tqdm

from ..memory import largest_fitting, max_batch
from . import bench_lora  # noqa: F401  (registers the LoRA workloads)
from .bench_steps import (
    COMPILED,
    IMPLEMENTATIONS,
    WORKLOADS,
    Steps,
    Workload,
    limit_for,
    summed_cross_entropy,
    vmap_attention,
)
from .bench_zoo import ZOO_MODELS

__all__ = ["DEFAULT_IMPLEMENTATIONS", "IMPLEMENTATIONS", "WORKLOADS", "largest_batches", "main", "run", "table"]

#: The implementations a default run times, in this order.
DEFAULT_IMPLEMENTATIONS = ("torchmb", "torchmb+compile", "vmap", "vmap+compile", "limit", "limit+compile")
DEFAULT_WORKLOADS = ("mlp", "lenet", "transformer", "resnet18")  # the quickest to compile first
ZOO_IMPLEMENTATIONS = ("torchmb", "vmap", "loop", "limit")
REPEAT_SECONDS = 0.1  # each timing lasts about this long (at least 2 steps, at most --iters)


def default_implementations(workload: Workload, batch: int) -> tuple[str, ...]:
    """What the default run times of a workload at ``batch`` models, to end within about three minutes on
    one GPU, where compiling takes most of the time: for the small models eager and compiled torchmb,
    vmap and the limit (the compiled limit from B=64, where issue 17 compares with it); for the larger
    ones torchmb eager and compiled and eager vmap (ResNet-18's compiled vmap took 38 s on the H100)."""
    if workload.implementations:
        return workload.implementations
    if not workload.compile_all:
        return ("torchmb", "torchmb+compile", "vmap")
    if batch < 64:
        return tuple(impl for impl in DEFAULT_IMPLEMENTATIONS if impl != "limit+compile")
    return DEFAULT_IMPLEMENTATIONS


def warm_up_compiler(device: torch.device) -> float:
    """Seconds of a first, tiny ``torch.compile`` on ``device``: Inductor's one-time start (importing
    Triton, starting its compile workers), which would otherwise count as compile time of whichever
    implementation the run compiles first."""
    start = time.perf_counter()
    x = torch.ones(8, device=device)
    torch.compile(lambda t: (t * 2).relu().sum())(x)
    torch._dynamo.reset()
    return time.perf_counter() - start


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds_per_call(self, fn: Callable[[], object], iters: int) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - start) / iters


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20


def _measure(row: dict, build: Callable, timer: Timer, batch: int, repeats: int, iters: int, warmup: int) -> None:
    """Build one implementation, time it into ``row`` and let it go."""
    device = timer.device
    step = build()
    if hasattr(step, "note"):
        row["note"] = step.note
    start = time.perf_counter()
    step()
    timer.sync()
    row["first_step_s"] = time.perf_counter() - start
    if row["impl"] in COMPILED:
        row["compile_s"] = row["first_step_s"]
    if device.type == "cuda":
        row["first_step_peak_mib"] = _mib(device)
        torch.cuda.reset_peak_memory_stats(device)
    one = timer.seconds_per_call(step, max(1, warmup))  # the warm-up steps estimate a step's time
    iters = max(2, min(iters, round(REPEAT_SECONDS / max(one, 1e-9))))
    seconds = sorted(timer.seconds_per_call(step, iters) for _ in range(repeats))
    median = statistics.median(seconds)
    row.update(
        ms_per_step=median * 1e3,
        model_steps_per_s=batch / median,
        model_steps_per_s_range=[batch / seconds[-1], batch / seconds[0]],
        repeats=repeats,
        iters=iters,
    )
    if device.type == "cuda":
        row["peak_mib"] = _mib(device)


def run(
    workloads: list[str],
    batches: list[int] | None,
    samples: int,
    device: torch.device,
    implementations: tuple[str, ...] | None = None,
    iters: int = 200,
    repeats: int = 5,
    warmup: int = 3,
    log: Callable[[str], None] = print,
    precision: str = "fp32",
    channels_last: bool = False,
    budget_s: float | None = None,
    progress: bool = False,
) -> list[dict]:
    """Time every implementation (``None``: each workload's default numbers of models and implementations).
    With ``progress``, a progress bar (tqdm, on stderr) counts the timings, naming the one running; give
    ``log=tqdm.write`` then, so that the rows print above it.

    Peak memory is the steady state's, with only the inputs and that implementation alive. Where a B runs
    out of memory, larger ones of that workload and implementation are skipped with a note; past
    ``budget_s`` seconds, everything left is skipped with a note.
    """
    timer = Timer(device)
    rows: list[dict] = []
    out_of_memory: dict[tuple[str, str], int] = {}
    began = time.perf_counter()
    total = sum(len(implementations or default_implementations(WORKLOADS[name], batch))
                for name in workloads for batch in batches or WORKLOADS[name].batches)
    bar = tqdm(total=total, desc="bench", unit="timing", disable=not progress, dynamic_ncols=True)
    for name in workloads:
        workload = WORKLOADS[name]
        for batch in batches or workload.batches:
            torch.manual_seed(0)
            steps = (workload.steps or Steps)(workload, batch, samples, device, precision, channels_last)
            builders = steps.builders()
            for impl in implementations or default_implementations(workload, batch):
                bar.set_postfix_str(f"{name} B={batch} {impl}", refresh=False)
                if impl not in builders:
                    bar.update()
                    continue
                row = {
                    "workload": name,
                    "B": batch,
                    "n": samples,
                    "impl": impl,
                    "precision": precision,
                    "channels_last": channels_last,
                }
                if impl.startswith("vmap") and workload.attention:
                    row["attention"] = "math"
                failed_at = out_of_memory.get((name, impl))
                if failed_at is not None and batch > failed_at:
                    row["skipped"] = f"B={failed_at} ran out of memory"
                elif budget_s is not None and time.perf_counter() - began > budget_s:
                    row["skipped"] = f"past the time budget of {budget_s:.0f} s"
                else:
                    _free(device)
                    try:
                        _measure(row, builders[impl], timer, batch, repeats, iters, warmup)
                    except torch.cuda.OutOfMemoryError as error:
                        out_of_memory[(name, impl)] = batch
                        row["error"] = f"OutOfMemoryError: {str(error).splitlines()[0][:200]}"
                    except RuntimeError as error:  # report, go on with the rest
                        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    if impl in COMPILED:
                        torch._dynamo.reset()  # the compiled code holds the implementation's tensors
                rows.append(row)
                log(json.dumps(row))
                bar.update()
            del steps, builders
            _free(device)
    bar.close()
    add_ratios(rows)
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
            loss_fn=lambda out, y_one=y_one: summed_cross_entropy(out, y_one.expand(out.shape[0], -1), samples),
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
            with vmap_attention(workload):
                out = vmap(lambda p, b, xi: functional_call(base, (p, b), (xi,)), randomness="different")(
                    params, buffers, x
                )
                summed_cross_entropy(out, y_one.expand(batch, -1), samples).backward()
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


def add_ratios(rows: list[dict]) -> None:
    """Each timed row's ratios to eager vmap (``vs_vmap``) and to its kind of limit (``vs_limit``, named
    in ``limit``), each with ``_range`` (from the two rows' ranges) and ``_tie`` (the ranges overlap)."""
    by_key = {(r["workload"], r["B"], r["impl"]): r for r in rows if "model_steps_per_s" in r}
    for row in rows:
        if "model_steps_per_s" not in row:
            continue
        for anchor, key in (("vmap", "vs_vmap"), (limit_for(row["impl"]), "vs_limit")):
            reference = by_key.get((row["workload"], row["B"], anchor))
            if reference is None or reference is row:
                continue
            low, high = row["model_steps_per_s_range"]
            ref_low, ref_high = reference["model_steps_per_s_range"]
            row[key] = row["model_steps_per_s"] / reference["model_steps_per_s"]
            row[f"{key}_range"] = [low / ref_high, high / ref_low]
            row[f"{key}_tie"] = low <= ref_high and ref_low <= high
            if key == "vs_limit":
                row["limit"] = anchor


def _ratio_cell(row: dict, key: str) -> str:
    if key not in row:
        return ""
    low, high = row[f"{key}_range"]
    tie = " tie" if row[f"{key}_tie"] else ""
    return f"{row[key]:.2f} ({low:.2f}-{high:.2f}){tie}"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table: model-steps per second, the ratios to eager vmap and to the limit, memory
    and compile time."""
    lines = [
        "| workload | B | impl | model-steps/s (range) | vs eager vmap | vs limit | limit | peak MiB "
        "| first-step peak MiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            note = r.get("error") or f"skipped: {r['skipped']}"
            lines.append(f"| {r['workload']} | {r['B']} | {r['impl']} | {note} | | | | | | |")
            continue
        low, high = r["model_steps_per_s_range"]
        cells = [
            f"{r['model_steps_per_s']:,.0f} ({low:,.0f}-{high:,.0f})",
            _ratio_cell(r, "vs_vmap"),
            _ratio_cell(r, "vs_limit"),
            r.get("limit", ""),
            f"{r['peak_mib']:,.0f}" if "peak_mib" in r else "",
            f"{r['first_step_peak_mib']:,.0f}" if "first_step_peak_mib" in r else "",
            f"{r['compile_s']:.1f}" if "compile_s" in r else "",
        ]
        impl = f"{r['impl']} ({r['note']})" if "note" in r else r["impl"]
        lines.append(f"| {r['workload']} | {r['B']} | {impl} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to measure on, e.g. cpu, cuda, cuda:1 (default: cuda where available, else cpu)")
    parser.add_argument(
        "--quick", action="store_true", help="MLP and LeNet, B in {1, 4}, n=16, nothing compiled: a smoke run"
    )
    parser.add_argument(
        "--zoo",
        action="store_true",
        help=f"the model-zoo workloads ({', '.join(ZOO_MODELS)}; torchvision and timm) at B=16 and 64 against "
        f"eager vmap, a loop and the limit (other --impls if given)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, from {', '.join(WORKLOADS)} "
        f"(default {','.join(DEFAULT_WORKLOADS)})",
    )
    parser.add_argument(
        "--batches",
        help="numbers of models B for every workload (default: each workload's own, "
        + "; ".join(f"{name} {','.join(map(str, w.batches))}" for name, w in WORKLOADS.items())
        + ")",
    )
    parser.add_argument("--samples", type=int, default=128, help="samples per model n (default 128)")
    parser.add_argument(
        "--impls",
        help=f"comma-separated, from {', '.join(IMPLEMENTATIONS)} (default {','.join(DEFAULT_IMPLEMENTATIONS)} "
        "for mlp and lenet, limit+compile from B=64; torchmb,torchmb+compile,vmap for the others)",
    )
    parser.add_argument("--iters", type=int, default=200, help="at most this many steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per implementation (median and range)")
    parser.add_argument(
        "--budget",
        type=float,
        default=150.0,
        help="seconds (the compiler's warm-up included) after which the rows left are skipped (default 150: with "
        "the process's start, about three minutes)",
    )
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: forward and loss under bf16 autocast"
    )
    parser.add_argument(
        "--channels-last", action="store_true", help="images and plain conv weights stored channels-last"
    )
    parser.add_argument("--json", help="write the rows and the environment to this file")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (it counts the timings on stderr)")
    parser.add_argument(
        "--max-batch",
        type=int,
        metavar="UPPER",
        help="instead: the largest B that trains, torchmb and vmap, up to UPPER",
    )


def main(args: argparse.Namespace) -> list[dict]:
    """``python -m torchmb bench`` with its parsed ``args``: time the rows, print the table, return the rows."""
    device = torch.device(args.device)
    workloads = list(ZOO_MODELS) if args.zoo else [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    impls = tuple(i for i in args.impls.split(",") if i) if args.impls else None
    if args.zoo and impls is None:
        impls = ZOO_IMPLEMENTATIONS
    unknown += sorted(set(impls or ()) - set(IMPLEMENTATIONS))
    if unknown:
        raise SystemExit(f"unknown workload or implementation: {', '.join(unknown)}")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    samples, iters, repeats = args.samples, args.iters, args.repeats
    environment = {"torch": torch.__version__, "device": _device_name(device)}
    if args.max_batch:
        if device.type != "cuda":
            raise SystemExit("--max-batch measures device memory: it needs --device cuda")
        rows = largest_batches(workloads, samples, device, args.max_batch)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": environment, "rows": rows}, f)
        return rows
    if device.type == "cuda":  # timed runs autotune cuDNN; the search above does not (each B is a new shape)
        torch.backends.cudnn.benchmark = True
    if args.quick:
        workloads = [w for w in workloads if w in ("mlp", "lenet")] or ["mlp"]
        batches, samples, iters, repeats = [1, 4], 16, 3, 2
        impls = tuple(i for i in impls or DEFAULT_IMPLEMENTATIONS if i not in COMPILED)
    compiles = impls is None or any(impl in COMPILED for impl in impls)
    budget_s = args.budget
    if compiles and not args.quick:
        warm_up_s = environment["compiler_warm_up_s"] = round(warm_up_compiler(device), 2)
        print(f"compiler warm-up (counted as no implementation's compile time): {warm_up_s} s")
        budget_s -= warm_up_s
    rows = run(
        workloads,
        batches,
        samples,
        device,
        impls,
        iters=iters,
        repeats=repeats,
        warmup=1 if args.quick else 3,
        precision=args.precision,
        channels_last=args.channels_last,
        budget_s=budget_s,
        log=tqdm.write if args.progress else print,
        progress=args.progress,
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "rows": rows}, f, indent=1)
    return rows


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
