"""The ratios and tables of ``python -m torchmb bench``: each row against eager vmap, the vmap of its mode
and the limit of its mode, in speed, memory and launches; the full table of rows, and the summary of
torchmb's rows in the form issue 24's tables take."""

from __future__ import annotations

from .bench_steps import limit_for

__all__ = ["add_ratios", "summary", "table", "vmap_for"]


def vmap_for(impl: str) -> str:
    """The vmap ensemble an implementation's memory is compared with, and its compiled speed: compiled with
    compiled, every other with eager vmap."""
    return "vmap+compile" if impl.endswith("+compile") else "vmap"


def add_ratios(rows: list[dict]) -> None:
    """Each timed row's ratios of model-steps per second: to eager vmap (``vs_vmap``), to vmap+compile for a
    compiled row (``vs_vmap_compile``) and to its kind of limit (``vs_limit``, named in ``limit``), each
    with ``_range`` (from the two rows' ranges) and ``_tie`` (the ranges overlap). Where measured, peak
    memory to the vmap of its mode (``peak_vs_vmap``, ``first_step_peak_vs_vmap``) and launches and ATen
    operators per step to its limit (``launches_vs_limit``, ``aten_ops_vs_limit``)."""
    by_key = {(r["workload"], r["B"], r.get("precision"), r["impl"]): r for r in rows if "model_steps_per_s" in r}
    for row in rows:
        if "model_steps_per_s" not in row:
            continue
        key = (row["workload"], row["B"], row.get("precision"))
        speed = [("vmap", "vs_vmap"), (limit_for(row["impl"]), "vs_limit")]
        if row["impl"].endswith("+compile"):
            speed.append(("vmap+compile", "vs_vmap_compile"))
        for anchor, name in speed:
            reference = by_key.get((*key, anchor))
            if reference is None or reference is row:
                continue
            low, high = row["model_steps_per_s_range"]
            ref_low, ref_high = reference["model_steps_per_s_range"]
            row[name] = row["model_steps_per_s"] / reference["model_steps_per_s"]
            row[f"{name}_range"] = [low / ref_high, high / ref_low]
            row[f"{name}_tie"] = low <= ref_high and ref_low <= high
            if name == "vs_limit":
                row["limit"] = anchor
        counts = [(vmap_for(row["impl"]), "peak_mib", "peak_vs_vmap"),
                  (vmap_for(row["impl"]), "first_step_peak_mib", "first_step_peak_vs_vmap"),
                  (limit_for(row["impl"]), "launches_per_step", "launches_vs_limit"),
                  (limit_for(row["impl"]), "aten_ops_per_step", "aten_ops_vs_limit")]
        for anchor, measured, name in counts:
            reference = by_key.get((*key, anchor))
            if reference is not None and reference is not row and row.get(measured) and reference.get(measured):
                row[name] = row[measured] / reference[measured]


def _ratio_cell(row: dict, key: str) -> str:
    if key not in row:
        return ""
    low, high = row[f"{key}_range"]
    tie = " tie" if row[f"{key}_tie"] else ""
    return f"{row[key]:.2f} ({low:.2f}-{high:.2f}){tie}"


def _count_cell(row: dict, measured: str, ratio: str, digits: int = 0) -> str:
    if measured not in row:
        return ""
    cell = f"{row[measured]:,.{digits}f}"
    return f"{cell} ({row[ratio]:.2f})" if ratio in row else cell


def _launches_cell(row: dict) -> str:
    if "launches_error" in row:
        return f"not counted: {row['launches_error']}"
    if "launches_per_step" in row:
        return _count_cell(row, "launches_per_step", "launches_vs_limit")
    if "aten_ops_per_step" in row:
        return _count_cell(row, "aten_ops_per_step", "aten_ops_vs_limit") + " ATen ops"
    return ""


def _failure(row: dict) -> str | None:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return row.get("error")


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table: model-steps per second, the ratios to eager vmap, to vmap+compile and
    to the limit, peak memory (steady and first step, each with its ratio to the vmap of the row's mode),
    compile time and launches per step (with the ratio to the limit; ATen operators on the CPU). A row that
    did not run says why in its speed cell."""
    lines = [
        "| workload | B | precision | impl | model-steps/s (range) | vs eager vmap | vs vmap+compile | vs limit "
        "| limit | peak MiB (vs vmap) | first-step peak MiB (vs vmap) | compile s | launches/step (vs limit) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        impl = f"{r['impl']} ({r['note']})" if "note" in r else r["impl"]
        lead = f"| {r['workload']} | {r['B']} | {r.get('precision', '')} | {impl} | "
        failure = _failure(r)
        if failure is not None:
            lines.append(lead + failure + " |" + " |" * 8)
            continue
        low, high = r["model_steps_per_s_range"]
        cells = [
            f"{r['model_steps_per_s']:,.0f} ({low:,.0f}-{high:,.0f})",
            _ratio_cell(r, "vs_vmap"),
            _ratio_cell(r, "vs_vmap_compile"),
            _ratio_cell(r, "vs_limit"),
            r.get("limit", ""),
            _count_cell(r, "peak_mib", "peak_vs_vmap"),
            _count_cell(r, "first_step_peak_mib", "first_step_peak_vs_vmap"),
            f"{r['compile_s']:.1f}" if "compile_s" in r else "",
            _launches_cell(r),
        ]
        lines.append(lead + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short_failure(row: dict) -> str | None:
    if "skipped" in row:
        return "skipped"
    if row.get("out_of_memory"):
        return "out of memory"
    return "error" if "error" in row else None


def _ratio(by_impl: dict[str, dict], impl: str, key: str) -> str:
    row = by_impl.get(impl)
    if row is None:
        return ""
    failure = _short_failure(row)
    if failure is not None:
        return failure
    if key not in row:
        return ""
    return f"{row[key]:.2f}" + (" tie" if row.get(f"{key}_tie") else "")


def _launch_ratio(row: dict) -> str:
    if "launches_vs_limit" in row:
        return f"{row['launches_vs_limit']:.2f}"
    return f"{row['aten_ops_vs_limit']:.2f} ATen ops" if "aten_ops_vs_limit" in row else ""


def summary(rows: list[dict]) -> str:
    """torchmb's rows in the form of issue 24's tables, one line per workload, B and precision: torchmb
    against eager vmap and the eager limit, torchmb+compile against vmap+compile and the compiled limit,
    launches per step against the limit's (eager, compiled), and peak memory against vmap's (steady and
    first step, eager). A row that did not run shows why in short."""
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["B"], row.get("precision", "")), {})[row["impl"]] = row
    lines = [
        "| model | B | precision | torchmb / eager vmap | torchmb / limit | torchmb+compile / vmap+compile "
        "| torchmb+compile / limit+compile | launches / limit's (eager / compiled) "
        "| peak / vmap's (steady, first step) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, batch, precision), by_impl in groups.items():
        if "torchmb" not in by_impl and "torchmb+compile" not in by_impl:
            continue
        launch_ratios = [_launch_ratio(by_impl.get(impl, {})) or "-" for impl in ("torchmb", "torchmb+compile")]
        launches = " / ".join(launch_ratios) if launch_ratios != ["-", "-"] else ""
        eager = by_impl.get("torchmb", {})
        peaks = ", ".join(f"{eager[key]:.2f}" for key in ("peak_vs_vmap", "first_step_peak_vs_vmap") if key in eager)
        cells = [
            _ratio(by_impl, "torchmb", "vs_vmap"),
            _ratio(by_impl, "torchmb", "vs_limit"),
            _ratio(by_impl, "torchmb+compile", "vs_vmap_compile"),
            _ratio(by_impl, "torchmb+compile", "vs_limit"),
            launches,
            peaks,
        ]
        lines.append(f"| {workload} | {batch} | {precision} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
