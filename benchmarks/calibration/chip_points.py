"""Measured points from the chip: every timed implementation of every case of a `python -m benchmarks` run on a TPU,
with its provenance, gathered from the run's <kernel>.json files into one file kept in the repository
(benchmarks/calibration/chip_<gen>.json), the record the performance model is held to.

    python -m benchmarks.calibration.chip_points bench-results/ [--out FILE]

A point: kernel, op, shape, implementation ("kernel", "default" or "baseline:<name>"), device µs (median of the
profiler's per-call device times), the number of calls, compile seconds, and the run's device kind, TPU generation,
jax / jaxlib / libtpu versions and date. Points of a later run replace those of the same (kernel, op, shape, impl).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def points_of(result: dict) -> list[dict]:
    """The measured device-time points of one kernel's benchmark result (nothing unless it was timed on a TPU)."""
    if result["device"]["platform"] != "tpu" or not result.get("provenance"):
        return []
    prov = result["provenance"]
    out = []
    for row in result["rows"]:
        for impl, entry in (row["measured"] or {}).items():
            if "us" not in entry or entry.get("timing") != "device time (profiler)":
                continue
            out.append(
                {
                    "kernel": result["kernel"],
                    "op": row["op"],
                    "shape": row["shape"],
                    "impl": impl,
                    "device_us": round(entry["us"], 3),
                    "calls": entry["rounds"],
                    "compile_s": round(entry.get("compile_s", 0.0), 2),
                    "hbm_bytes": row["hbm_bytes"],
                    "mxu_flops": row["mxu_flops"],
                    "generation": result["device"].get("generation"),
                    **{
                        k: " ".join(str(prov[k]).split())
                        for k in ("device_kind", "jax", "jaxlib", "platform_version", "date")
                    },
                }
            )
    return out


def _key(point: dict) -> tuple:
    return point["kernel"], point["op"], json.dumps(point["shape"], sort_keys=True), point["impl"]


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """old's points with new's replacing those of the same (kernel, op, shape, impl), sorted."""
    merged = {_key(p): p for p in old}
    merged.update({_key(p): p for p in new})
    return [merged[k] for k in sorted(merged)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.calibration.chip_points", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("results", type=pathlib.Path, help="a python -m benchmarks output directory (its <kernel>.json)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="default: benchmarks/calibration/chip_<gen>.json")
    args = p.parse_args(argv)
    new = [pt for f in sorted(args.results.glob("*.json")) for pt in points_of(json.loads(f.read_text()))]
    if not new:
        p.error(f"no device-time points in {args.results}/*.json (was it a run on a TPU?)")
    gens = {pt["generation"] for pt in new}
    if len(gens) != 1:
        p.error(f"points of several generations in one run: {sorted(map(str, gens))}")
    out = args.out or HERE / f"chip_{gens.pop()}.json"
    old = json.loads(out.read_text()) if out.exists() else []
    points = merge(old, new)
    out.write_text("[\n" + ",\n".join(json.dumps(pt) for pt in points) + "\n]\n")  # one point a line: diffs read well
    print(f"{len(new)} points from {args.results} -> {out} ({len(points)} in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
