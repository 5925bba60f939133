"""A kernel's benchmark result as a table (text), as JSON (`<out>/<kernel>.json`) and as a chart (`<out>/<kernel>.png`).

Column headers and chart labels carry every figure's label: "measured <device>" / "cpu interpret", "modeled <gen>",
"roofline <gen>". Measured on a TPU, the measured table comes first (device time of the kernel, the default and every
baseline, compile time apart, roofline and speedups on the measured chip); the modeled table follows when modeled.
"""

from __future__ import annotations

import json
import pathlib

DASH = "—"


def _fmt(value, spec: str) -> str:
    return DASH if value is None else format(value, spec)


def _us(entry) -> float | None:
    return None if not entry or "us" not in entry else entry["us"]


def columns(result: dict, rows: list[dict] | None = None) -> list[str]:
    """Column headers; with `rows` (one op's rows), the default is named after its implementation and every
    baseline of those rows gets a time and a speedup column."""
    gen = result["generation"]
    default_name = (rows[0].get("default_name") if rows else None) or "XLA default"
    default = "default" if default_name == "XLA default" else default_name
    head = [
        "shape",
        f"{result['measured_label']} µs",
        f"modeled {gen} µs kernel",
        f"roofline {gen} µs",
        "efficiency",
        *(_flops_headers(gen) if result.get("flops_columns") else []),
        f"modeled {gen} µs {default}",
        "speedup" if default == "default" else f"vs {default}",
    ]
    for name in _baseline_names(rows or []):
        head += [f"modeled {gen} µs {name}", f"vs {name}"]
    return head + [f"GB/s modeled {gen}"]


def _flops_headers(gen: str) -> list[str]:
    return [f"TFLOP/s modeled {gen}", f"% MXU peak modeled {gen}"]


def _tflops(row: dict, entry) -> float | None:
    """The row's matmul flops (mxu_flops: what the roofline counts) over the entry's modeled time, in TFLOP/s."""
    us = _us(entry)
    return None if us is None else row["mxu_flops"] / (us * 1e-6) / 1e12


def _baseline_names(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(n for r in rows for n in r.get("modeled_baselines", {})))


def _time_cell(entry, spec: str = ",.2f") -> str:
    if not entry:
        return DASH
    if "na" in entry:
        return "n/a"
    if "error" in entry:
        return "error"
    return _fmt(_us(entry), spec) + ("*" if entry.get("floored_at_roofline") else "")


def table_rows(result: dict) -> list[tuple[str, list[list[str]]]]:
    """[(op, rows of cells)] in column order (see `columns(result, rows)`)."""
    by_op: dict[str, list[dict]] = {}
    for r in result["rows"]:
        by_op.setdefault(r["op"], []).append(r)
    flops = result.get("flops_columns", False)
    out = []
    for op, rows in by_op.items():
        names = _baseline_names(rows)
        mixed = len({r["shape"].get("dtype") for r in rows}) > 1
        cells_list = []
        for r in rows:
            kernel, default = r["modeled_kernel"], r["modeled_default"]
            measured = (r["measured"] or {}).get("kernel")
            shape = " ".join(f"{k}={v}" for k, v in r["shape"].items() if mixed or k != "dtype")
            cells = [
                shape,
                _fmt(_us(measured), ",.1f"),
                _time_cell(kernel),
                _fmt(r["roofline"]["us"], ",.2f"),
                _fmt(r["efficiency"], ".1%"),
                *([_fmt(_tflops(r, kernel), ",.1f"), _fmt(r["mxu_fraction"], ".1%")] if flops else []),
                _time_cell(default),
                DASH if r["speedup"] is None else f"{r['speedup']:.2f}x",
            ]
            for name in names:
                b = r.get("modeled_baselines", {}).get(name)
                speedup = r.get("speedups", {}).get(name)
                cells += [_time_cell(b), DASH if speedup is None else f"{speedup:.2f}x"]
            cells.append(_fmt(kernel.get("gbps"), ",.0f"))
            cells_list.append(cells)
        out.append((op, cells_list))
    return out


def _measured_impls(rows: list[dict]) -> list[str]:
    """The measured implementations beside the kernel, in order: default, then the baselines."""
    impls = dict.fromkeys(i for r in rows for i in (r["measured"] or {}) if i != "kernel")
    return sorted(impls, key=lambda i: (i != "default", list(impls).index(i)))


def _impl_name(impl: str, rows: list[dict]) -> str:
    if impl == "default":
        return (rows[0].get("default_name") if rows else None) or "XLA default"
    return impl.split(":", 1)[-1]


def measured_columns(result: dict, rows: list[dict]) -> list[str]:
    chip = result.get("measured_chip") or {}
    gen = chip.get("gen", "?")
    head = [
        "shape",
        f"{result['measured_label']} µs kernel",
        "compile s",
        f"roofline {gen} µs",
        "% of roofline",
        *(["TFLOP/s", "% MXU peak"] if result.get("flops_columns") else []),
    ]
    for impl in _measured_impls(rows):
        name = _impl_name(impl, rows)
        head += [f"µs {name}", f"vs {name}"]
    return head


def _measured_cell(entry) -> str:
    return _time_cell(entry, ",.1f")


def measured_table_rows(result: dict) -> list[tuple[str, list[dict], list[list[str]]]]:
    """[(op, its rows, rows of cells)] of the measured table (see `measured_columns`), rows that were timed only."""
    out = []
    for op in dict.fromkeys(r["op"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["op"] == op and r["measured"]]
        if not rows:
            continue
        impls = _measured_impls(rows)
        mixed = len({r["shape"].get("dtype") for r in rows}) > 1  # a table of several dtypes: each row names its own
        cells_list = []
        for r in rows:
            m = r["measured"]
            kernel = m.get("kernel") or {}
            us = kernel.get("us")
            cells = [
                " ".join(f"{k}={v}" for k, v in r["shape"].items() if mixed or k != "dtype"),
                _measured_cell(kernel),
                _fmt(kernel.get("compile_s"), ".1f"),
                _fmt((r.get("measured_roofline") or {}).get("us"), ",.1f"),
                _fmt(r.get("measured_efficiency"), ".1%"),
            ]
            if result.get("flops_columns"):
                cells += [
                    _fmt(None if not us else r["mxu_flops"] / (us * 1e-6) / 1e12, ",.1f"),
                    _fmt(r.get("measured_mxu_fraction"), ".1%"),
                ]
            for impl in impls:
                speedup = (r.get("measured_speedups") or {}).get(impl)
                cells += [_measured_cell(m.get(impl)), DASH if speedup is None else f"{speedup:.2f}x"]
            cells_list.append(cells)
        out.append((op, rows, cells_list))
    return out


def _markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]

    def fmt_row(cells):
        aligned = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "| " + " | ".join(aligned) + " |"

    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return [fmt_row(head), sep, *(fmt_row(r) for r in rows)]


def why_not_timed(result: dict) -> list[str]:
    """One footnote per (n/a or error, implementation, reason): the shapes it applies to (up to 3 by name), "every
    measured shape" only where it is every one of more."""
    why = {}
    for r in result["rows"]:
        for impl, e in (r["measured"] or {}).items():
            for kind in ("na", "error"):
                if kind in e:
                    why.setdefault((kind, _impl_name(impl, [r]), e[kind]), []).append(r["shape_id"])
    lines, total = [], sum(1 for r in result["rows"] if r["measured"])
    for (kind, name, text), shape_ids in sorted(why.items()):
        if len(shape_ids) <= 3:
            where = "; ".join(shape_ids)
        elif len(shape_ids) == total:
            where = "every measured shape"
        else:
            where = f"{len(shape_ids)} of the {total} shapes ({'; '.join(shape_ids)})"
        lines.append(f"{'n/a' if kind == 'na' else 'error'}: {name} at {where}: {text}")
    return lines


def format_measured(result: dict) -> list[str]:
    """The measured (TPU) table of each op, its footnotes (why an implementation did not run) and targets."""
    dtypes = sorted({r["shape"].get("dtype", "") for r in result["rows"]})
    lines = []
    for op, rows, cells in measured_table_rows(result):
        lines += [f"\n{result['kernel']} / {op} ({', '.join(dtypes)}) — {result['measured_label']}, device time"]
        lines += _markdown(measured_columns(result, rows), cells)
    lines += why_not_timed(result)
    timed = [e for r in result["rows"] for e in (r["measured"] or {}).values() if "us" in e]
    if timed:
        rounds = sorted({e["rounds"] for e in timed})
        workers = sorted({e.get("compile_workers") for e in timed if e.get("compile_workers")})
        lines.append(
            f"measured: {result['measured_label']} = median device time of {'/'.join(map(str, rounds))} calls "
            "(the profiler's XLA Modules events on the chip), every implementation in the same process on inputs "
            "built on the device; compile s = the first call's trace + lower + compile on the host"
            + (f" (compiled on {workers[-1]} threads, overlapping the runs)" if workers else "")
            + "; % of roofline and % MXU peak on the measured chip's "
            + f"{(result.get('measured_chip') or {}).get('gen', '?')} figures."
        )
    if any(e.get("in_place") for e in timed):
        lines.append(
            "in place: the state the op updates (the caches) given to each implementation, donated, each call's "
            "returned state the next call's, as a server runs it"
        )
    phases = result.get("host_phases") or {}
    if phases:
        total = {k: sum(p.get(k, 0.0) for p in phases.values()) for k in next(iter(phases.values()))}
        lines.append(
            f"host time of the {len(phases)} cases: "
            + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s" for k, v in total.items())
            + " (compiles run ahead on threads: only the wait for them counts here; lower = tracing and lowering on"
            " the chip's thread, or waiting on a worker's export and taking it in; export = the worker processes'"
            " tracing, in parallel)"
        )
    if result.get("goal") and result.get("measured_targets"):
        lines.append(f"goal ({result['measured_label']}): {result['goal']}")
    for t in result.get("measured_targets", []):
        lines.append(_target_line(t, result["measured_label"]))
    return lines


def _target_line(t: dict, label: str) -> str:
    worst = t["worst"] or {}
    detail = t.get("detail") or ", ".join(
        f"{k} n/a"
        if v is None
        else f"{k} {v:.1%}"
        if k == "efficiency"
        else f"{k} {v:.2f}x"
        if k == "speedup"
        else f"{k}: {v}"
        for k, v in worst.items()
        if k != "case"
    )
    if t.get("not_compared"):
        detail += f"; not compared (the default did not run): {', '.join(t['not_compared'])}"
    return (
        f"target ({label}): {t['target']}: {'MET' if t['met'] else 'NOT MET'} "
        f"(worst: {worst.get('case', DASH)}, {detail})"
    )


def format_table(result: dict) -> str:
    if result["device"]["platform"] != "tpu":  # the CPU's timings sit in the modeled table's measured column
        return "\n".join(format_modeled(result))
    lines = format_measured(result)
    if result.get("modeled", True):
        lines += format_modeled(result)
    else:
        lines += [f"measurement: {result['measure_error']}"] if result.get("measure_error") else []
        lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def format_modeled(result: dict) -> list[str]:
    dtypes = sorted({r["shape"].get("dtype", "") for r in result["rows"]})
    lines = []
    for op, rows in table_rows(result):
        head = columns(result, [r for r in result["rows"] if r["op"] == op])
        lines += [f"\n{result['kernel']} / {op} ({', '.join(dtypes)})", *_markdown(head, rows)]
    na = sorted(
        {
            f"{name}: {b['na']}"
            for r in result["rows"]
            for name, b in r.get("modeled_baselines", {}).items()
            if "na" in b
        }
    )
    lines += [f"n/a = {reason}" for reason in na]
    if result["device"]["platform"] != "tpu":  # on a TPU every measured implementation is in the measured table
        lines += _extra_measured_lines(result)
    if result.get("flops_columns"):
        lines.append(
            f"TFLOP/s = the op's matmul flops (those the roofline counts) / the modeled kernel time; % MXU peak = that "
            f"over the {result['generation']} bf16 MXU peak ({result['chip']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s)"
        )
    if result.get("goal"):
        lines.append(f"goal ({result['modeled_label']}): {result['goal']}")
    for t in result["targets"]:
        lines.append(_target_line(t, result["modeled_label"]))
    if result.get("measure_error"):
        lines.append(f"measurement: {result['measure_error']}")
    if not result["device"]["platform"] == "tpu":
        lines.append(
            f"measured: {result['measured_label']} = the Pallas kernel in TPU interpret mode on this CPU "
            f"({result['device']['kind']}); not a TPU figure. {DASH} = not timed on a CPU "
            "(--full times more)."
        )
    warned = sorted(
        {
            w
            for r in result["rows"]
            for e in (r["modeled_kernel"], r["modeled_default"], *r.get("modeled_baselines", {}).values())
            for w in e.get("warnings", [])
        }
    )
    lines += [f"model warning: {w}" for w in warned]
    noted = sorted(
        {
            n
            for r in result["rows"]
            for e in (r["modeled_kernel"], r["modeled_default"], *r.get("modeled_baselines", {}).values())
            for n in e.get("notes", [])
        }
    )
    lines += [f"model note: {n}" for n in noted]
    lines += [f"note: {n}" for n in result["notes"]]
    return lines


def _extra_measured_lines(result: dict) -> list[str]:
    """Timings of impls beyond kernel/default (e.g. the MoE suite's torch paths on a TPU), one line per case."""
    lines = []
    for r in result["rows"]:
        extra = {k: v for k, v in (r["measured"] or {}).items() if k not in ("kernel", "default")}
        if extra:
            lines.append(
                f"{r['op']} {r['shape_id']}: "
                + ", ".join(f"{k} {v['us']:,.1f} µs ({v['label']})" for k, v in sorted(extra.items()))
            )
    return lines


def write_json(result: dict, out: pathlib.Path) -> pathlib.Path:
    path = out / f"{result['kernel']}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def write_chart(result: dict, out: pathlib.Path) -> pathlib.Path:
    """Throughput vs batch, kernel (solid) vs default (dashed), per op, one colour per series; roofline dotted. A suite
    with flops_columns plots TFLOP/s instead, with the chip's bf16 MXU peak as one dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def short_labels(series_list):
        """Only the key=value parts that differ between the series (the common ones go in the title)."""
        parts = [s.split() for s in series_list]
        common = set(parts[0]).intersection(*parts[1:]) if parts else set()
        return {s: " ".join(x for x in p if x not in common) or s for s, p in zip(series_list, parts)}, common

    ops = list(dict.fromkeys(r["op"] for r in result["rows"]))
    measured_chip = result.get("measured_chip") if result["device"]["platform"] == "tpu" else None
    roof_label = {
        "roofline": result["roofline_label"],
        "measured_roofline": f"roofline {(measured_chip or {}).get('gen')}",
    }
    unit = result["batch_unit"]
    modeled = result["modeled_label"]
    flops = result.get("flops_columns", False)

    def y_of(r, entry):
        """The plotted figure of a row's modeled or measured entry: TFLOP/s, or batch units per second."""
        return _tflops(r, entry) if flops else entry["units_per_s"]

    fig, axes = plt.subplots(1, len(ops), figsize=(6.5 * len(ops), 4.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in result["rows"] if r["op"] == op]
        labels, common = short_labels(list(dict.fromkeys(r["series"] for r in rows)))
        for i, series in enumerate(labels):
            pts = sorted((r for r in rows if r["series"] == series), key=lambda r: r["batch"])
            color = f"C{i}"
            for key, style, name in (("modeled_kernel", "-o", "kernel"), ("modeled_default", "--s", "XLA default")):
                xy = [(r["batch"], y_of(r, r[key])) for r in pts if "units_per_s" in r[key]]
                if xy:
                    ax.plot(*zip(*xy), style, color=color, label=f"{name}, {labels[series]} ({modeled})")
            if not flops:  # in TFLOP/s the roofline of a matmul-bound row is the peak line drawn once below
                for key in ("roofline", "measured_roofline") if measured_chip else ("roofline",):
                    roof = [(r["batch"], r["batch"] / (r[key]["us"] * 1e-6)) for r in pts if r.get(key)]
                    if roof and (key == "measured_roofline" or result.get("modeled", True)):
                        ax.plot(*zip(*roof), ":", color=color, alpha=0.6, label=f"{roof_label[key]}, {labels[series]}")
            if result["device"]["platform"] == "tpu":  # measured lines only when they are TPU figures
                measured_impls = _measured_impls(pts)
                for j, impl in enumerate(["kernel", *measured_impls]):
                    xy = [
                        (r["batch"], y_of(r, r["measured"][impl]))
                        for r in pts
                        if r["measured"] and "us" in r["measured"].get(impl, {})
                    ]
                    if xy:
                        style = "-x" if impl == "kernel" else ("--+" if impl == "default" else ":^")
                        ax.plot(
                            *zip(*xy),
                            style,
                            color=color,
                            markersize=8,
                            alpha=1.0 if impl == "kernel" else 0.5 + 0.4 / (j + 1),
                            label=f"{'kernel' if impl == 'kernel' else _impl_name(impl, pts)}, {labels[series]} "
                            f"({result['measured_label']})",
                        )
        if flops:
            for chip, style in ((result["chip"], ":"), (measured_chip, "-.")):
                if chip and (chip is measured_chip or result.get("modeled", True)):
                    peak = chip["bf16_flops_per_s"] / 1e12
                    ax.axhline(peak, color="black", linestyle=style, label=f"bf16 MXU peak, {chip['gen']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(unit)
        sources = ([result["measured_label"]] if result["device"]["platform"] == "tpu" else []) + (
            [modeled] if result.get("modeled", True) else []
        )
        source = ", ".join(sources)
        ax.set_ylabel(f"TFLOP/s ({source}; the flops the roofline counts)" if flops else f"{unit}/s ({source})")
        title = f"{result['kernel']}: {op} — {source}"
        if common:
            title += "\n" + " ".join(sorted(common))
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    # The legends hang below the axes; savefig's tight bounding box takes them in (tight_layout would shrink the axes).
    fig.subplots_adjust(wspace=0.55)
    path = out / f"{result['kernel']}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
