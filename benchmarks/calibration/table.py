"""Model the measured reference points and compare: rows, per-family summaries, the markdown table.

The caller sets up the deviceless environment before jax is imported (`benchmarks.device.prepare_environment()` or
the tests' conftest). Every modeled figure is labelled "modeled <gen>"; a measured figure that includes host dispatch
is compared as it stands against the model's `modeled_s`, which has no dispatch in it (the row says which).
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import pathlib
import statistics
import subprocess

from .points import MeasuredPoint

BEGIN = "<!-- calibration table: begin -->"
END = "<!-- calibration table: end -->"
# Modules holding points (each has `points()`); optional ones may be absent or need a library that fails to import.
MODULES = ("matmul_tutorial", "chip_measured")
OPTIONAL_MODULES = ("tokamax_ragged_dot",)


def collect_points(only: set[str] | None = None, *, quick: bool = False) -> tuple[list[MeasuredPoint], list[str]]:
    """Every module's points (of the families in `only`, if given), and a note per optional module skipped. With
    `quick`, a module whose `points` takes `quick` gives its subset for the test suite (the others give all)."""
    points, skipped = [], []
    for name in MODULES + OPTIONAL_MODULES:
        try:
            module = importlib.import_module(f"{__package__}.{name}")
            takes_quick = "quick" in inspect.signature(module.points).parameters
            found = module.points(quick=True) if quick and takes_quick else module.points()
        except Exception as e:  # noqa: BLE001  (an optional module's library may fail in any way)
            if name not in OPTIONAL_MODULES:
                raise
            if isinstance(e, ModuleNotFoundError) and e.name == f"{__package__}.{name}":
                skipped.append(f"{name}: no such module yet")
            else:
                skipped.append(f"{name}: skipped ({type(e).__name__}: {e})")
            continue
        points += [p for p in found if only is None or p.family in only]
    return points, skipped


def model_points(points: list[MeasuredPoint], gen: str, *, workers: int = 2) -> list[dict]:
    """Model the points measured on `gen`, a chunk of them per compile subprocess, `workers` chunks at a time.

    One row per point: name, family, gen, measured_s, modeled_s, ratio (modeled / measured), in_fit, notes and
    warnings (the model's), dispatch_included, gap_s (measured - modeled: what the model leaves out, dispatch
    included where the source timed it), source, note (the point's), error (modeling failed: modeled_s is None)."""
    from benchmarks import modeled

    chosen = [p for p in points if p.gen == gen]
    # In chunks on two threads (benchmarks.modeled): one chunk's host-side traffic analysis overlaps another's compile.
    found = modeled.run_items([(i, lambda p=p: (p.fn, p.args)) for i, p in enumerate(chosen)], gen, workers=workers)
    models = [found[i] for i in range(len(chosen))]
    rows = []
    for p, m in zip(chosen, models):
        failed = isinstance(m, Exception)
        modeled = None if failed else m.modeled_s
        rows.append(
            {
                "name": p.name,
                "family": p.family,
                "gen": gen,
                "label": f"modeled {gen}",
                "measured_s": p.measured_s,
                "modeled_s": modeled,
                "ratio": None if modeled is None else modeled / p.measured_s,
                "gap_s": None if modeled is None else p.measured_s - modeled,
                "in_fit": p.in_fit,
                "dispatch_included": p.dispatch_included,
                "notes": [] if failed else [str(n) for n in m.notes],
                "warnings": [] if failed else [str(w) for w in m.warnings],
                "error": f"{type(m).__name__}: {m}" if failed else None,
                "source": p.source,
                "timing": p.timing,
                "note": p.note,
                "dispatch_s": None,
                "compared_s": modeled,
            }
        )
    _add_dispatch(rows)
    return rows


def _add_dispatch(rows: list[dict]) -> None:
    """A figure timed with host dispatch in it is compared with modeled + dispatch. The dispatch of a timing method is
    what its dispatch-dominated points (out of the fit) measure beyond the model: the median of measured - modeled
    over them. It belongs to the timing, not to the kernel, so it is not a constant of the model."""
    by_timing: dict[str, list[float]] = {}
    for r in rows:
        if r["dispatch_included"] and not r["in_fit"] and r["gap_s"] is not None:
            by_timing.setdefault(r["timing"], []).append(r["gap_s"])
    for r in rows:
        gaps = by_timing.get(r["timing"])
        if not r["dispatch_included"] or r["modeled_s"] is None or not gaps:
            continue
        r["dispatch_s"] = statistics.median(gaps)
        r["compared_s"] = r["modeled_s"] + r["dispatch_s"]
        r["ratio"] = r["compared_s"] / r["measured_s"]
        r["gap_s"] = r["measured_s"] - r["compared_s"]


def family_summary(rows: list[dict]) -> dict[str, dict]:
    """Per family, over its in-fit rows that were modeled: median, min and max modeled/measured, and their count.
    Rows of one generation (a family is measured on one)."""
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if r["in_fit"] and r["ratio"] is not None:
            ratios.setdefault(r["family"], []).append(r["ratio"])
    return {
        family: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
        for family, v in ratios.items()
    }


def _us(seconds: float | None, spec: str = ",.1f") -> str:
    return "error" if seconds is None else format(seconds * 1e6, spec)


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _grid(head: list[str], body: list[list[str]], left: int) -> list[str]:
    """A markdown table; the first `left` columns left-aligned, the others right-aligned."""
    widths = [max(len(head[i]), *(len(r[i]) for r in body)) for i in range(len(head))]

    def line(cells):
        return (
            "| "
            + " | ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    sep = "|" + "|".join("-" * (w + 2) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return [line(head), sep, *(line(r) for r in body)]


def markdown(rows: list[dict]) -> str:
    """The comparison table and the per-family summary, one pair per generation."""
    out = []
    for gen in dict.fromkeys(r["gen"] for r in rows):
        gen_rows = [r for r in rows if r["gen"] == gen]
        head = [
            "family",
            "point",
            f"measured {gen} µs",
            f"modeled {gen} µs",
            "+ dispatch µs",
            "compared / measured",
            "measured − compared µs",
            "in fit",
            "model notes",
            "model warnings",
        ]
        body = [
            [
                r["family"],
                r["name"],
                _us(r["measured_s"]),
                _us(r["modeled_s"]),
                "—" if r["dispatch_s"] is None else _us(r["dispatch_s"]),
                _ratio(r["ratio"]),
                _us(r["gap_s"]),
                "yes" if r["in_fit"] else "no",
                str(len(r["notes"])),
                str(len(r["warnings"])),
            ]
            for r in gen_rows
        ]
        out += _grid(head, body, left=2)
        summary = family_summary(gen_rows)
        if summary:
            out += [""]
            out += _grid(
                ["family", "in-fit points", "median compared / measured", "min", "max"],
                [[f, str(s["n"]), _ratio(s["median"]), _ratio(s["min"]), _ratio(s["max"])] for f, s in summary.items()],
                left=1,
            )
        errors = [f"- {r['name']}: {r['error']}" for r in gen_rows if r["error"]]
        by_reason: dict[str, list[str]] = {}
        for r in gen_rows:
            if not r["in_fit"]:
                by_reason.setdefault(r["note"] or "no reason given", []).append(r["name"])
        excluded = [f"- {', '.join(names)}: {reason}" for reason, names in by_reason.items()]
        if excluded:
            out += ["", "Not in the fit:", *excluded]
        if errors:
            out += ["", "Modeling failed:", *errors]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def versions() -> dict[str, str]:
    from importlib import metadata

    import jax

    try:
        libtpu = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        libtpu = "not installed"
    return {"jax": jax.__version__, "libtpu": libtpu}


def replace_block(text: str, block: str) -> str:
    """`text` with what lies between the calibration markers replaced by `block`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the markers {BEGIN!r} ... {END!r} are missing")
    return text[: start + len(BEGIN)] + "\n" + block.rstrip("\n") + "\n" + text[end:]


def model_revision() -> str:
    """The commit the model's code is at, and whether it has changes not committed (the table would not be
    reproducible from the commit alone)."""
    root = pathlib.Path(__file__).resolve().parents[2]

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "benchmarks/perf_model")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} with uncommitted changes" if dirty else head


def generated_line(command: str, when: datetime.date | None = None) -> str:
    v = versions()
    when = when or datetime.date.today()
    return (
        f"Generated by `{command}` (perf model at {model_revision()}, jax {v['jax']}, libtpu {v['libtpu']}) "
        f"on {when.isoformat()}."
    )
