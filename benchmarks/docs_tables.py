"""The measured tables of a TPU run written into the kernels' docs: `python -m benchmarks.docs_tables bench-results/`.

Each docs/<kernel>.md holds one block between `<!-- measured tables begin -->` and `<!-- measured tables end -->`
(placed right under its title: the measured figures lead); the block is replaced by the run's measured table of each
op (device time of the kernel, the default and every baseline, from benchmarks/report.py), its footnotes, and the
run's provenance. A doc without the block gets one under its first heading. `--rows-from DIR` takes the rows a later
run measured (`--shape`, after a change to those cases alone) in place of the same cases' rows, recomputes the targets
and says in the provenance which rows are whose.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import textwrap

from . import report

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOOTNOTES = ("n/a:", "error:", "measured:", "host time", "goal", "target")
BEGIN, END = "<!-- measured tables begin -->", "<!-- measured tables end -->"


def block(result: dict) -> str:
    prov = result["provenance"]
    lines = [
        BEGIN,
        f"## Measured on {prov['device_kind']} ({result['device'].get('generation')})",
        "",
        *textwrap.wrap(
            f"Device time from the profiler, {prov['date']}, jax {prov['jax']}, "
            f"{prov['platform_version'] or 'libtpu'}: "
            f'`make bench-tpu BENCH_ARGS="--kernel {result["kernel"]}"` on one chip (the quick shapes). Every '
            "implementation ran in the same process on the same inputs; vs X = X's device time / ours (> 1: ours is "
            "faster)."
            + (
                f" **A partial run** ({result['partial']}, stopped before its end): the shapes without figures were "
                "not measured."
                if result.get("partial")
                else ""
            )
            + "".join(
                f" The rows of {'; '.join(shapes)} are from a later run ({date}, with `--shape`)."
                for date, shapes in result.get("later_rows", {}).items()
            ),
            width=120,
            break_on_hyphens=False,
        ),
    ]
    lines += [line.replace("\n", "") if line.startswith("\n") else line for line in report.format_measured(result)]
    # a blank line around each table; the footnotes and targets as a wrapped list
    out = []
    for line in lines:
        if line.startswith(f"{result['kernel']} / "):
            out += ["", f"**{line}**", ""]
        elif line.startswith(FOOTNOTES):
            out += ([""] if not out[-1].startswith(("- ", "  ")) else []) + textwrap.wrap(
                line, width=120, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False
            )
        else:
            out.append(line)
    return "\n".join([*out, "", END])


def write(doc: pathlib.Path, text: str) -> None:
    source = doc.read_text()
    if BEGIN in source and END in source:
        head, rest = source.split(BEGIN, 1)
        source = head + text + rest.split(END, 1)[1]
    else:
        title, _, rest = source.partition("\n")
        source = f"{title}\n\n{text}\n{rest}"
    doc.write_text(source)


def merge(result: dict, later: dict) -> dict:
    """`result` with the rows `later` (a run of the same kernel on the same chip, of some of its cases) measured in
    place of those cases' rows, their host time likewise, the measured targets recomputed over the rows, and
    `later_rows` {date: [those cases' shape ids]} for the provenance."""
    from . import harness
    from . import suite as _suite

    if later["kernel"] != result["kernel"] or later["device"] != result["device"]:
        raise ValueError(
            f"--rows-from: {later['kernel']} measured on {later['device']} cannot stand in rows of "
            f"{result['kernel']} measured on {result['device']}"
        )
    newer = {r["case"]: r for r in later["rows"]}
    missing = sorted(set(newer) - {r["case"] for r in result["rows"]})
    if missing:
        raise ValueError(f"--rows-from: cases the run being updated does not have: {', '.join(missing)}")
    rows = [newer.get(r["case"], r) for r in result["rows"]]
    phases = {**(result.get("host_phases") or {}), **(later.get("host_phases") or {})}
    shapes = list(dict.fromkeys(r["shape_id"] for r in later["rows"]))
    later_rows = {**result.get("later_rows", {})}
    later_rows[later["provenance"]["date"]] = [*later_rows.get(later["provenance"]["date"], []), *shapes]
    targets = harness.check_targets(_suite.get(result["kernel"]).targets, rows, measured=True)
    return result | {"rows": rows, "host_phases": phases, "measured_targets": targets, "later_rows": later_rows}


def _is_measured(result: dict) -> bool:
    return "rows" in result and result["device"]["platform"] == "tpu" and bool(result.get("provenance"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.docs_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=pathlib.Path, help="a python -m benchmarks output directory of a TPU run")
    p.add_argument("--docs", type=pathlib.Path, default=ROOT / "docs")
    p.add_argument(
        "--rows-from",
        type=pathlib.Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a later TPU run's output directory (repeatable, in order): its rows replace the same cases' rows",
    )
    args = p.parse_args(argv)
    written = 0
    for f in sorted(args.results.glob("*.json")):
        result = json.loads(f.read_text())
        if not _is_measured(result):
            continue
        for later_dir in args.rows_from:
            later = json.loads((later_dir / f.name).read_text()) if (later_dir / f.name).exists() else {}
            if _is_measured(later):
                try:
                    result = merge(result, later)
                except ValueError as e:
                    p.error(str(e))
        doc = args.docs / f"{result['kernel']}.md"
        if doc.exists():
            write(doc, block(result))
            written += 1
            print(f"{doc}: measured tables of {result['kernel']}")
    if not written:
        p.error(f"no TPU-measured <kernel>.json in {args.results} with a matching doc in {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
