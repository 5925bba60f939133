"""The decode table of every mode (modeled, cpu smoke, device): markdown, JSON and a PNG chart in the --out directory.

A result is {"mode", "label", "impls", "models": {name: {"series": [{"context", "rows"}, optionally "execution"]}},
"notes", "targets", ...}; a row is {"batch", "impls": {impl: {"ms", "tokens_per_s"} or {"error"}}, optionally
"ceiling", "skipped", "tokens_match"}. Every header and the chart carry the result's label.
"""

from __future__ import annotations

import json
import pathlib

DASH = "—"
IMPL_NAMES = {
    "default": "transformers default",
    "experts": "our experts_forward",
    "ours_xla_attention": "ours, XLA attention",
    "ours": "all ours",
}


def _cell(entry, key, spec):
    if not entry or key not in entry:
        return DASH
    return format(entry[key], spec)


def _ratio(a, b):
    if not a or not b or "ms" not in a or "ms" not in b:
        return DASH
    return f"{a['ms'] / b['ms']:.2f}x"


def series_table(result: dict, series: dict) -> list[str]:
    """Markdown lines of one series (one model at one context): per implementation ms/step and tokens/s, the HBM
    ceiling when there is one, and per implementation other than the default its share of the ceiling and its
    speedup over the default."""
    impls = result["impls"]
    others = [i for i in impls if i != "default"]
    rows = series["rows"]
    has_ceiling = any("ceiling" in r for r in rows)
    has_match = any("tokens_match" in r for r in rows)
    head = ["batch"]
    for impl in impls:
        head += [f"{IMPL_NAMES.get(impl, impl)} ms/step", "tokens/s"]
    if has_ceiling:
        head += ["HBM ceiling ms/step", "tokens/s"] + [f"{IMPL_NAMES.get(i, i)} % of ceiling" for i in others]
    head += [f"{IMPL_NAMES.get(i, i)} vs default" for i in others]
    if has_match:
        head += ["greedy tokens equal"]
    lines = [f"| {' | '.join(head)} |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [str(r["batch"])]
        if "skipped" in r:
            cells += [DASH] * (len(head) - 2) + [r["skipped"]]
            lines.append(f"| {' | '.join(cells)} |")
            continue
        for impl in impls:
            e = r["impls"].get(impl, {})
            cells += ["error", DASH] if "error" in e else [_cell(e, "ms", ",.2f"), _cell(e, "tokens_per_s", ",.1f")]
        if has_ceiling:
            c = r.get("ceiling")
            cells += [_cell(c, "ms", ",.2f"), _cell(c, "tokens_per_s", ",.1f")]
            for impl in others:
                e = r["impls"].get(impl, {})
                cells.append(f"{c['ms'] / e['ms']:.1%}" if c and "ms" in e else DASH)
        cells += [_ratio(r["impls"].get("default"), r["impls"].get(impl)) for impl in others]
        if has_match:
            cells.append({True: "yes", False: "NO"}.get(r.get("tokens_match"), DASH))
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def format_markdown(result: dict) -> str:
    out = [f"## Decode, {result['label']}", ""]
    for name, model in result["models"].items():
        for series in model["series"]:
            context = f", context {series['context']}" if series.get("context") else ""
            execution = f", {series['execution']}" if series.get("execution") else ""
            out += [f"### {name}{context}{execution} ({result['label']})", ""]
            out += series_table(result, series) + [""]
    for t in result.get("targets", []):
        out.append(f"- target: {t['target']}: **{'MET' if t['met'] else 'NOT MET'}** ({t['detail']})")
    if result.get("targets"):
        out.append("")
    for note in result.get("notes", []):
        out.append(f"- {note}")
    return "\n".join(out).rstrip() + "\n"


def write(result: dict, out: pathlib.Path, stem: str) -> dict:
    """<out>/<stem>.md, .json and .png; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{stem}.md", "json": out / f"{stem}.json", "png": out / f"{stem}.png"}
    paths["md"].write_text(format_markdown(result))
    paths["json"].write_text(json.dumps(result, indent=1, default=str))
    write_chart(result, paths["png"])
    return {k: str(v) for k, v in paths.items()}


def write_chart(result: dict, path: pathlib.Path) -> None:
    """tokens/s vs batch, one panel per model at its first context (the published setup's 768 when modeled) or
    execution (compiled, when measured), a line per implementation and the ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"].items())
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, (name, model) in zip(axes[0], models):
        for series in model["series"][:1]:
            suffix = f", ctx {series['context']}" if series.get("context") else ""
            suffix += f", {series['execution']}" if series.get("execution") else ""
            rows = [r for r in series["rows"] if "skipped" not in r]
            for impl in result["impls"]:
                pts = [(r["batch"], r["impls"][impl]["tokens_per_s"]) for r in rows if "ms" in r["impls"].get(impl, {})]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{IMPL_NAMES.get(impl, impl)}{suffix}")
            pts = [(r["batch"], r["ceiling"]["tokens_per_s"]) for r in rows if "ceiling" in r]
            if pts:
                ax.plot(*zip(*pts), linestyle="--", color="gray", label=f"HBM ceiling{suffix}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel(f"tokens/s ({result['label']})")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(f"decode tokens/s, {result['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
