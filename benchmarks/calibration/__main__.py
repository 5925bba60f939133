"""python -m benchmarks.calibration [--gen GEN] [--only FAMILY,...] [--quick] [--out DIR] [--write]

Models every measured reference point (benchmarks/calibration/*.py) with the static performance model (chunks of
points per compile subprocess, two at a time), prints modeled against measured as a markdown table with a per-family
summary, and writes <out>/calibration.json (rows, summaries, versions).

With --write, also replaces the calibration table block of docs/perf_model.md with the table.
"""

from benchmarks import device

device.prepare_environment()  # before jax is imported

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from benchmarks.calibration import table  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "perf_model.md"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.calibration", description=__doc__.split("\n\n")[1])
    p.add_argument("--gen", help="only the points measured on this TPU generation (default: every one measured)")
    p.add_argument("--only", help="comma-separated families to model (default: all)")
    p.add_argument("--quick", action="store_true", help="the test suite's subset of each module's points")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"), help="output directory")
    p.add_argument("--write", action="store_true", help="replace the calibration table in docs/perf_model.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.calibration", *(sys.argv[1:] if argv is None else argv)])
    only = set(args.only.split(",")) if args.only else None
    points, skipped = table.collect_points(only, quick=args.quick)
    for note in skipped:
        print(f"note: {note}")
    gens = [args.gen] if args.gen else list(dict.fromkeys(p.gen for p in points))
    rows, compile_s = [], {}
    for gen in gens:
        start = time.monotonic()
        rows += table.model_points(points, gen)
        compile_s[gen] = time.monotonic() - start
    if not rows:
        print("no points to model", file=sys.stderr)
        return 1
    text = table.markdown(rows)
    print(text)
    for gen, seconds in compile_s.items():
        print(f"modeled {gen}: {sum(r['gen'] == gen for r in rows)} points in {seconds:.0f} s")

    generated = table.generated_line(command)
    summaries = {gen: table.family_summary([r for r in rows if r["gen"] == gen]) for gen in gens}
    result = {
        "command": command,
        "versions": table.versions(),
        "model_revision": table.model_revision(),
        "generated": generated,
        "model_seconds": compile_s,
        "skipped": skipped,
        "summary": summaries,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "calibration.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    if args.write:
        skipped_lines = "".join(f"\nSkipped: {note}" for note in skipped)
        DOC.write_text(table.replace_block(DOC.read_text(), f"{text}\n{generated}{skipped_lines}\n"))
        print(f"wrote the calibration table in {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
