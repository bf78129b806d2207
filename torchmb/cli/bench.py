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
``torch.optim.SGD`` step) on n samples per model, in fp32 on TF32 tensor cores (``--no-tf32``: without) or
under bf16 autocast (``--precision bf16``). Each is built, measured and freed on its own, so its peak memory
is its own. Its first step (which compiles, captures or autotunes cuDNN: ``compile_s``,
``first_step_peak_mib``) is untimed; then ``repeats`` timings of ``iters`` steps each give the median
model-steps per second and its range. Ratios are to eager vmap, to vmap+compile (compiled rows) and to the
limit of the same kind (eager, compiled or graphed), each with the range the two ranges allow; where the
ranges overlap the ratio is a tie (``"tie": true``). Peak memory is compared with the vmap of the row's
mode, launches per step (``--launches``) with the limit's.

The run fits the machine: a B whose estimated memory (:mod:`torchmb.cli.bench_memory`) exceeds the free
memory is skipped with a note, an out-of-memory that happens all the same is caught and marked, any other
error (a compile's) is reported in its row, a row past ``--row-timeout`` is stopped, and past ``--budget``
the rows left are skipped: the run always ends with its table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from collections.abc import Callable, Iterator

import torch
from torch.func import functional_call, vmap
from tqdm import tqdm

from ..memory import largest_fitting, max_batch
from . import bench_lora  # noqa: F401  (registers the LoRA workloads)
from .bench_measure import RowTimeout, Timer, first_line, free, is_out_of_memory, measure, time_limit
from .bench_memory import Footprint, estimated_need, free_memory, one_model_footprint
from .bench_report import add_ratios, summary, table
from .bench_steps import (
    COMPILED,
    IMPLEMENTATIONS,
    WORKLOADS,
    Steps,
    Workload,
    summed_cross_entropy,
    vmap_attention,
)
from .bench_zoo import ZOO_MODELS

__all__ = [
    "DEFAULT_IMPLEMENTATIONS",
    "IMPLEMENTATIONS",
    "WORKLOADS",
    "add_ratios",
    "default_implementations",
    "largest_batches",
    "main",
    "run",
    "summary",
    "table",
]

#: The implementations the full run (``--full``) times, in this order: torchmb, vmap and the limit, eager
#: and compiled.
DEFAULT_IMPLEMENTATIONS = ("torchmb", "torchmb+compile", "vmap", "vmap+compile", "limit", "limit+compile")
EAGER_IMPLEMENTATIONS = ("torchmb", "vmap", "limit")
DEFAULT_WORKLOADS = ("mlp", "lenet", "transformer", "resnet18")  # the quickest to compile first
ZOO_IMPLEMENTATIONS = DEFAULT_IMPLEMENTATIONS
COMPILED_BATCH = 64  # the default run compiles the small models at this B only (issue 17's comparison point)
DEFAULT_BUDGET_S = 150.0


def default_implementations(workload: Workload, batch: int, full: bool = False) -> tuple[str, ...]:
    """What a run without ``--impls`` times of a workload at ``batch`` models. A workload's own set where it
    has one (the LoRA ones); with ``full``, :data:`DEFAULT_IMPLEMENTATIONS`. Otherwise the default run's,
    which ends within its budget on one GPU, where compiling takes most of the time: torchmb, vmap and the
    limit eager, and for the small models (MLP, LeNet) compiled too at B=64."""
    if workload.implementations:
        return workload.implementations
    if full or (workload.compile_all and batch == COMPILED_BATCH):
        return DEFAULT_IMPLEMENTATIONS
    return EAGER_IMPLEMENTATIONS


def warm_up_compiler(device: torch.device) -> float:
    """Seconds of a first, tiny ``torch.compile`` on ``device``: Inductor's one-time start (importing
    Triton, starting its compile workers), which would otherwise count as compile time of whichever
    implementation the run compiles first."""
    start = time.perf_counter()
    x = torch.ones(8, device=device)
    torch.compile(lambda t: (t * 2).relu().sum())(x)
    torch._dynamo.reset()
    return time.perf_counter() - start


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """fp32 matrix products and convolutions on TF32 tensor cores (or not) in the block; restores the
    switches after."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _footprint(workload: Workload, samples: int, device: torch.device, precision: str,
               channels_last: bool, log: Callable[[str], None]) -> Footprint | None:
    if workload.steps is not None:  # its own steps (LoRA: one shared decoder): no per-model estimate
        return None
    try:
        return one_model_footprint(workload, samples, device, precision, channels_last)
    except Exception as error:  # no estimate: the row runs, an out-of-memory is still caught
        log(f"no memory estimate for {workload.name}: {first_line(error)}")
        return None
    finally:
        free(device)


def _memory_skip(impl: str, batch: int, samples: int, footprint: Footprint | None, available: int | None) -> str | None:
    """Why ``impl`` at ``batch`` models is skipped by the memory estimate; None where it may run."""
    if footprint is None or available is None:
        return None
    need = estimated_need(impl, batch, footprint, samples)
    if need <= available:
        return None
    return f"needs about {need / 2**30:,.1f} GiB by the memory estimate, {available / 2**30:,.1f} GiB free"


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
    full: bool = False,
    row_timeout_s: float | None = None,
    launches: bool = False,
    memory_check: bool = True,
    allow_tf32: bool = True,
) -> list[dict]:
    """Time every implementation (``None``: each workload's default numbers of models and
    :func:`default_implementations`, with ``full`` the full set). With ``progress``, a progress bar (tqdm,
    on stderr) counts the timings, naming the one running; give ``log=tqdm.write`` then, so that the rows
    print above it.

    fp32 runs on TF32 tensor cores unless ``allow_tf32`` is False; ``precision="bf16"`` runs the forward and
    loss under bf16 autocast. Peak memory is the steady state's and the first step's, with only the inputs
    and that implementation alive. With ``memory_check`` (on a device that reports its free memory), a row
    whose estimated need (:mod:`torchmb.cli.bench_memory`) exceeds the free memory is skipped with a note;
    a row that runs out of memory all the same is marked ``"out_of_memory"``, its memory freed, and larger
    B of that workload and implementation are skipped. Any other error, a compile's included, is reported
    in its row (its first line) and the run goes on; so does a row past ``row_timeout_s`` seconds. Past
    ``budget_s`` seconds, everything left is skipped with a note. With ``launches``, each row counts one
    steady step's kernel launches (:mod:`torchmb.cli.bench_measure`).
    """
    with tf32(allow_tf32):
        rows = _run(workloads, batches, samples, device, implementations, iters, repeats, warmup, log, precision,
                    channels_last, budget_s, progress, full, row_timeout_s, launches, memory_check)
    for row in rows:
        row["tf32"] = allow_tf32
    add_ratios(rows)
    return rows


def _run(workloads, batches, samples, device, implementations, iters, repeats, warmup, log, precision,
         channels_last, budget_s, progress, full, row_timeout_s, launches, memory_check) -> list[dict]:
    timer = Timer(device)
    rows: list[dict] = []
    out_of_memory: dict[tuple[str, str], int] = {}
    began = time.perf_counter()
    total = sum(len(implementations or default_implementations(WORKLOADS[name], batch, full))
                for name in workloads for batch in batches or WORKLOADS[name].batches)
    bar = tqdm(total=total, desc="bench", unit="timing", disable=not progress, dynamic_ncols=True)

    def finish(row: dict) -> None:
        rows.append(row)
        log(json.dumps(row))
        bar.update()

    for name in workloads:
        workload = WORKLOADS[name]
        footprint = None
        if memory_check and free_memory(device) is not None:  # a device that says how much memory is free
            footprint = _footprint(workload, samples, device, precision, channels_last, log)
        for batch in batches or workload.batches:
            pending = []
            available = free_memory(device) if footprint is not None else None  # before this B's inputs
            for impl in implementations or default_implementations(workload, batch, full):
                row = {"workload": name, "B": batch, "n": samples, "impl": impl, "precision": precision,
                       "channels_last": channels_last}
                if impl.startswith("vmap") and workload.attention:
                    row["attention"] = "math"
                failed_at = out_of_memory.get((name, impl))
                if failed_at is not None and batch > failed_at:
                    row["skipped"] = f"B={failed_at} ran out of memory"
                elif budget_s is not None and time.perf_counter() - began > budget_s:
                    row["skipped"] = f"past the time budget of {budget_s:.0f} s"
                elif (reason := _memory_skip(impl, batch, samples, footprint, available)) is not None:
                    row["skipped"] = reason
                pending.append(row)
            if all("skipped" in row for row in pending):  # nothing to make the B models and their inputs for
                for row in pending:
                    finish(row)
                continue
            torch.manual_seed(0)
            try:
                steps = (workload.steps or Steps)(workload, batch, samples, device, precision, channels_last)
                builders = steps.builders()
            except Exception as error:  # the inputs or the B plain models do not fit: no row of this B runs
                failure, memory = first_line(error), is_out_of_memory(error)
                for row in pending:
                    if "skipped" not in row:
                        row["error"] = f"making the inputs: {failure}"
                        row["out_of_memory"] = memory
                        if memory:
                            out_of_memory[(name, row["impl"])] = batch
                    finish(row)
                free(device)
                continue
            for row in pending:
                impl = row["impl"]
                bar.set_postfix_str(f"{name} B={batch} {impl}", refresh=False)
                if impl not in builders:
                    bar.update()
                    continue
                if "skipped" not in row and budget_s is not None and time.perf_counter() - began > budget_s:
                    row["skipped"] = f"past the time budget of {budget_s:.0f} s"
                if "skipped" not in row:
                    free(device)
                    if _measure_row(row, builders[impl], timer, batch, repeats, iters, warmup, row_timeout_s,
                                    launches):
                        out_of_memory[(name, impl)] = batch
                finish(row)
            del steps, builders
            free(device)
    bar.close()
    return rows


def _measure_row(row: dict, build: Callable, timer: Timer, batch: int, repeats: int, iters: int, warmup: int,
                 row_timeout_s: float | None, launches: bool) -> bool:
    """Measure one row into ``row``, reporting a failure in it; returns whether it ran out of memory."""
    compiled = row["impl"] in COMPILED
    # a compiled row that hits dynamo's recompile limit would run on in eager mode: make that an error instead
    compile_config = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True) if compiled \
        else contextlib.nullcontext()
    try:
        with compile_config, time_limit(row_timeout_s):
            measure(row, build, timer, batch, repeats, iters, warmup, compiled=compiled, launches=launches)
        return False
    except RowTimeout as timeout:
        if "model_steps_per_s" in row:
            where = "counting launches"
        elif "first_step_s" in row:
            where = "timing"
        else:
            where = "compiling" if compiled else "building or in the first step"
        row["error"] = f"{timeout} (while {where})"
        return False
    except Exception as error:  # report it in the row and go on with the rest
        if is_out_of_memory(error):
            row["out_of_memory"] = True
            row["error"] = f"out of memory: {first_line(error)}"
            return True
        row["error"] = first_line(error)
        return False
    finally:
        if compiled:
            torch._dynamo.reset()  # the compiled code holds the implementation's tensors


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to measure on, e.g. cpu, cuda, cuda:1 (default: cuda where available, else cpu)")
    parser.add_argument(
        "--quick", action="store_true", help="MLP and LeNet, B in {1, 4}, n=16, nothing compiled: a smoke run"
    )
    parser.add_argument(
        "--zoo",
        action="store_true",
        help=f"the model-zoo workloads ({', '.join(ZOO_MODELS)}; torchvision and timm) at B=16 and 64 with "
        f"{','.join(ZOO_IMPLEMENTATIONS)} (other --impls if given; --workloads picks among them)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"every default workload at its default B with {','.join(DEFAULT_IMPLEMENTATIONS)} and no time "
        "budget (unless --budget): what the default run leaves out (with --zoo: the loop too)",
    )
    parser.add_argument(
        "--workloads",
        help=f"comma-separated, from {', '.join(WORKLOADS)} "
        f"(default {','.join(DEFAULT_WORKLOADS)}; with --zoo, the zoo)",
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
        help=f"comma-separated, from {', '.join(IMPLEMENTATIONS)} (default: {','.join(EAGER_IMPLEMENTATIONS)}, "
        f"and for mlp and lenet at B={COMPILED_BATCH} the compiled ones too; --full and --zoo: "
        f"{','.join(DEFAULT_IMPLEMENTATIONS)})",
    )
    parser.add_argument("--iters", type=int, default=200, help="at most this many steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per implementation (median and range)")
    parser.add_argument(
        "--budget",
        type=float,
        help=f"seconds (the compiler's warm-up included) after which the rows left are skipped with a note "
        f"(default {DEFAULT_BUDGET_S:.0f} for the default run: with the process's start, about three minutes; "
        "none with --full or --zoo)",
    )
    parser.add_argument(
        "--row-timeout",
        type=float,
        default=300.0,
        help="seconds one row (building, compiling, timing) may take before it is reported as past its time "
        "limit and the run goes on (default 300; 0: no limit)",
    )
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32",
        help="fp32 (on TF32 tensor cores unless --no-tf32; the default) or bf16: forward and loss under bf16 autocast",
    )
    parser.add_argument("--no-tf32", dest="tf32", action="store_false",
                        help="fp32 matrix products and convolutions in full fp32, not on TF32 tensor cores")
    parser.add_argument(
        "--launches",
        action="store_true",
        help="count one steady step's kernel launches per row with torch.profiler, and the ratio to the limit's "
        "(on the CPU: ATen operators)",
    )
    parser.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                        help="run every row, even one that the memory estimate says does not fit")
    parser.add_argument(
        "--channels-last", action="store_true", help="images and plain conv weights stored channels-last"
    )
    parser.add_argument("--json", help="write the rows and the environment to this file")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="instead: print the table and the summary of rows saved by earlier runs' --json")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (it counts the timings on stderr)")
    parser.add_argument(
        "--max-batch",
        type=int,
        metavar="UPPER",
        help="instead: the largest B that trains, torchmb and vmap, up to UPPER",
    )


def _report(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)["rows"]
    print(table(rows))
    print()
    print(summary(rows))
    return rows


def main(args: argparse.Namespace) -> list[dict]:
    """``python -m torchmb bench`` with its parsed ``args``: time the rows, print the table and the summary,
    return the rows."""
    if args.report:
        return _report(args.report)
    device = torch.device(args.device)
    default_workloads = ZOO_MODELS if args.zoo else DEFAULT_WORKLOADS
    workloads = [w for w in args.workloads.split(",") if w] if args.workloads else list(default_workloads)
    unknown = sorted(set(workloads) - set(WORKLOADS))
    impls = tuple(i for i in args.impls.split(",") if i) if args.impls else None
    if args.zoo and impls is None:
        impls = (*ZOO_IMPLEMENTATIONS, "loop") if args.full else ZOO_IMPLEMENTATIONS
    unknown += sorted(set(impls or ()) - set(IMPLEMENTATIONS))
    if unknown:
        raise SystemExit(f"unknown workload or implementation: {', '.join(unknown)}")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    samples, iters, repeats = args.samples, args.iters, args.repeats
    environment = {"torch": torch.__version__, "device": _device_name(device), "tf32": args.tf32}
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
        impls = tuple(i for i in impls or EAGER_IMPLEMENTATIONS if i not in COMPILED)
    budget_s = args.budget
    if budget_s is None and not (args.full or args.zoo):
        budget_s = DEFAULT_BUDGET_S
    compiles = any(
        impl in COMPILED
        for name in workloads
        for batch in batches or WORKLOADS[name].batches
        for impl in impls or default_implementations(WORKLOADS[name], batch, args.full)
    )
    if compiles:
        warm_up_s = environment["compiler_warm_up_s"] = round(warm_up_compiler(device), 2)
        print(f"compiler warm-up (counted as no implementation's compile time): {warm_up_s} s")
        if budget_s is not None:
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
        full=args.full,
        row_timeout_s=args.row_timeout or None,
        launches=args.launches,
        memory_check=args.memory_check,
        allow_tf32=args.tf32,
    )
    print(table(rows))
    print()
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "rows": rows}, f, indent=1)
    return rows


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
