"""A kernel's benchmark result as a table (text), as JSON (`<out>/<kernel>.json`) and as a chart (`<out>/<kernel>.png`).

Column headers and chart labels carry every figure's label: "measured <device>" / "cpu interpret", "modeled <gen>",
"roofline <gen>".
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


def _time_cell(entry) -> str:
    if not entry:
        return DASH
    if "na" in entry:
        return "n/a"
    if "error" in entry:
        return "error"
    return _fmt(_us(entry), ",.2f") + ("*" if entry.get("floored_at_roofline") else "")


def table_rows(result: dict) -> list[tuple[str, list[list[str]]]]:
    """[(op, rows of cells)] in column order (see `columns(result, rows)`)."""
    by_op: dict[str, list[dict]] = {}
    for r in result["rows"]:
        by_op.setdefault(r["op"], []).append(r)
    flops = result.get("flops_columns", False)
    out = []
    for op, rows in by_op.items():
        names = _baseline_names(rows)
        cells_list = []
        for r in rows:
            kernel, default = r["modeled_kernel"], r["modeled_default"]
            measured = (r["measured"] or {}).get("kernel")
            shape = " ".join(f"{k}={v}" for k, v in r["shape"].items() if k != "dtype")
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


def format_table(result: dict) -> str:
    dtypes = sorted({r["shape"].get("dtype", "") for r in result["rows"]})
    lines = []
    for op, rows in table_rows(result):
        head = columns(result, [r for r in result["rows"] if r["op"] == op])
        widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]

        def fmt_row(cells, widths=widths):
            aligned = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            return "| " + " | ".join(aligned) + " |"

        sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
        lines += [f"\n{result['kernel']} / {op} ({', '.join(dtypes)})", fmt_row(head), sep]
        lines += [fmt_row(r) for r in rows]
    na = sorted(
        {
            f"{name}: {b['na']}"
            for r in result["rows"]
            for name, b in r.get("modeled_baselines", {}).items()
            if "na" in b
        }
    )
    lines += [f"n/a = {reason}" for reason in na]
    lines += _extra_measured_lines(result)
    if result.get("flops_columns"):
        lines.append(
            f"TFLOP/s = the op's matmul flops (those the roofline counts) / the modeled kernel time; % MXU peak = that "
            f"over the {result['generation']} bf16 MXU peak ({result['chip']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s)"
        )
    if result.get("goal"):
        lines.append(f"goal ({result['modeled_label']}): {result['goal']}")
    for t in result["targets"]:
        worst = t["worst"] or {}
        detail = t.get("detail") or ", ".join(
            f"{k} {v:.1%}" if k == "efficiency" else f"{k} {v:.2f}x" if k == "speedup" else f"{k}: {v}"
            for k, v in worst.items()
            if k != "case"
        )
        lines.append(
            f"target ({result['modeled_label']}): {t['target']}: "
            f"{'MET' if t['met'] else 'NOT MET'} (worst: {worst.get('case', DASH)}, {detail})"
        )
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
    return "\n".join(lines)


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
                    ax.plot(*zip(*xy), style, color=color, label=f"{name}, {labels[series]}")
            if not flops:  # in TFLOP/s the roofline of a matmul-bound row is the peak line drawn once below
                roof = [(r["batch"], r["batch"] / (r["roofline"]["us"] * 1e-6)) for r in pts]
                ax.plot(*zip(*roof), ":", color=color, alpha=0.6, label=f"{result['roofline_label']}, {labels[series]}")
            if result["device"]["platform"] == "tpu":  # measured points only when they are TPU figures
                xy = [
                    (r["batch"], y_of(r, r["measured"]["kernel"]))
                    for r in pts
                    if r["measured"] and "kernel" in r["measured"]
                ]
                if xy:
                    ax.plot(
                        *zip(*xy),
                        "x",
                        color=color,
                        markersize=9,
                        label=f"kernel, {labels[series]} ({result['measured_label']})",
                    )
        if flops:
            peak = result["chip"]["bf16_flops_per_s"] / 1e12
            ax.axhline(peak, color="black", linestyle=":", label=f"bf16 MXU peak, {result['generation']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(unit)
        ax.set_ylabel(f"TFLOP/s ({modeled}; the flops the roofline counts)" if flops else f"{unit}/s ({modeled})")
        title = f"{result['kernel']}: {op} — {modeled}"
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
