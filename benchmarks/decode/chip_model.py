"""The one-chip decode step modeled for the v5e beside its measurement: the error bar of the modeled v6e-8 table.

    python -m benchmarks.decode.chip_model [--points FILE] [--out DIR] [--workers N]

The v6e-8 table (compose.py) adds the performance model's figures for the programs of one step: per layer the glue,
the KV write, the attention at the context and the experts, then the head. This module composes the same programs the
same way for the step measured on the v5e test chip (chip_step.py; the points in benchmarks/calibration/
decode_v5e.json): the layers measured there (their kinds in the model's order, or one kind's alone), every expert on
the one chip (the seeded random routing over all of them, as the v6e-8 table routes over a chip's share), the context
measured. Each implementation's measured / modeled ratio is then how far the composition and the model are off for
that implementation, on the same generation's measurement: what to read the v6e-8 figures with. Qwen3-30B-A3B and
Gemma 4 26B-A4B only (the v6e-8 table's models; gpt-oss's step has programs of its own).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

from . import compose, programs
from .chip_step import kind_view, layer_kinds
from .models import MODELS, Model

GEN = "v5e"
POINTS = pathlib.Path(__file__).resolve().parents[1] / "calibration" / "decode_v5e.json"
IMPLS = ("default", "experts", "ours")  # chip_step's, named as the v6e-8 table names them (compose.PARTS)
CACHE_FILE = "decode-chip-model-cache.json"


def measured_kinds(model: Model, layers: int, kind: str | None = None) -> list:
    """The layer kinds a point measured: the model's pattern cut to `layers`, or `layers` of one kind alone."""
    return layer_kinds(model if kind is None else kind_view(model, kind), layers)


def items_for(model: Model, layers: int, batch: int, context: int, kind: str | None = None) -> dict:
    """{(part, model, kind or "", batch, context or 0, variant): (fn, args)}: the programs of one measured point."""
    out = {}
    kinds = set(measured_kinds(model, layers, kind))
    for variant in programs.IMPLS:
        out[("experts1", model.name, "", batch, 0, variant)] = programs.experts_item(
            model, batch, variant, one_chip=True
        )
        out[("head", model.name, "", batch, 0, variant)] = programs.head_item(model, batch, variant)
        for kind in kinds:
            out[("glue", model.name, kind.name, batch, 0, variant)] = programs.glue_item(model, kind, batch, variant)
            out[("attention", model.name, kind.name, batch, context, variant)] = programs.attention_item(
                kind, batch, context, variant
            )
    for kind in kinds:
        out[("kv_write", model.name, kind.name, batch, 0, "default")] = programs.kv_write_item(kind, batch)
    return out


def modeled_step_s(
    model: Model, layers: int, batch: int, context: int, impl: str, figures: dict, kind: str | None = None
) -> dict:
    """The step of `layers` layers (of `kind` alone if given) and the head as the v6e-8 table adds it
    (compose.step_parts_s; no all-reduce: one chip, every expert on it): seconds by part."""
    kinds = measured_kinds(model, layers, kind)
    counts = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    return compose.step_parts_s(model, counts, batch, context, impl, figures, experts="experts1")


def side_by_side(points: list[dict], figures: dict) -> list[dict]:
    """Per measured point of a modeled model: the measured µs, the modeled v5e µs (by part) and measured / modeled."""
    rows = []
    for p in points:
        if p["model"] not in MODELS:
            continue
        model = MODELS[p["model"]]
        row = {k: p[k] for k in ("model", "batch", "context", "layers", "impl")} | {"measured_us": p["step_us"]}
        row["kind"] = p.get("kind")
        try:
            parts = modeled_step_s(model, p["layers"], p["batch"], p["context"], p["impl"], figures, p.get("kind"))
        except RuntimeError as e:
            row["error"] = str(e)
        else:
            modeled = sum(parts.values())
            row |= {
                "modeled_us": modeled * 1e6,
                "parts_us": {k: v * 1e6 for k, v in parts.items()},
                "measured_over_modeled": p["step_us"] / (modeled * 1e6),
            }
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per implementation: the median and the range of measured / modeled over the points."""
    out = {}
    for impl in IMPLS:
        ratios = [r["measured_over_modeled"] for r in rows if r["impl"] == impl and "measured_over_modeled" in r]
        if ratios:
            out[impl] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
    return out


NAMES = {"default": "XLA's path", "ours": "all ours", "experts": "experts only"}


def markdown(rows: list[dict]) -> list[str]:
    lines = [
        "| model | batch | context | layers | implementation | measured v5e µs | modeled v5e µs | measured / modeled |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["model"], r["context"], r["batch"], IMPLS.index(r["impl"]))):
        modeled = f"{r['modeled_us']:,.1f}" if "modeled_us" in r else r.get("error", "—")
        ratio = f"{r['measured_over_modeled']:.2f}" if "measured_over_modeled" in r else "—"
        kind = f" {r['kind']}" if r.get("kind") else ""
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['context']} | {r['layers']}{kind} | {NAMES[r['impl']]} | "
            f"{r['measured_us']:,.1f} | "
            f"{modeled} | {ratio} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode.chip_model", description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=pathlib.Path, default=POINTS, help="measured one-chip steps (JSON)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"))
    parser.add_argument("--workers", type=int, default=None, help="parallel compile chunks (default 2)")
    args = parser.parse_args(argv)
    points = json.loads(args.points.read_text())["points"]
    items = {}
    for p in points:
        if p["model"] in MODELS:
            items |= items_for(MODELS[p["model"]], p["layers"], p["batch"], p["context"], p.get("kind"))
    args.out.mkdir(parents=True, exist_ok=True)
    figures = compose.model_items(items, args.out / CACHE_FILE, workers=args.workers, gen=GEN)
    rows = side_by_side(points, figures)
    ratios = summary(rows)
    text = [
        f"One-chip decode step: measured on the TPU v5e ({args.points.name}) beside the same programs composed from "
        f"the performance model (modeled {GEN}, excludes host dispatch)",
        "",
        *markdown(rows),
        "",
        *(
            f"{NAMES[impl]}: measured / modeled median {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}, "
            f"{s['n']} points)"
            for impl, s in ratios.items()
        ),
    ]
    (args.out / "decode_chip_model.json").write_text(json.dumps({"rows": rows, "summary": ratios}, indent=1))
    (args.out / "decode_chip_model.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
