"""`python -m benchmarks --kernel K --sweep`: is the tuning table's tiling the best one the model knows of?

For every op of a suite that lists candidate tilings (`Op.candidates`: its tuning module's `candidate_blocks`, the
table's choice first) and every sweep shape, each candidate is modeled through the same path as the benchmark's kernel
column (`modeled.run_items`, the static performance model) on each generation asked for, and the report puts the
table's choice and its modeled time beside the fastest candidate and its time. gain = table's time / best time: 1.00x
where the table's choice is the best (ties go to the table), above where another tiling is faster in the model.

Elsewhere than on a TPU every figure is modeled (labeled "modeled <gen>"): the sweep says where the table and the
model disagree, which is where a measurement on the chip is worth taking. On a TPU (`run_measured_sweep`) each
candidate is compiled and timed on the chip instead, by its device time (benchmarks/device_timing.py, the kernel alone
at each tiling), and labeled "measured <device>": the sweep then says which tiling the chip prefers. `--shape` picks
the shapes (e.g. `--shape head_dim=512`), as each candidate is a compile of seconds there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import types

import jax

from . import modeled, perf_model
from . import suite as _suite


def blocks_dict(blocks) -> dict:
    return dataclasses.asdict(blocks) if dataclasses.is_dataclass(blocks) else {"blocks": repr(blocks)}


def blocks_label(blocks) -> str:
    """The tile sizes of a tiling, e.g. "block_rows=512", "forward(tm=64 tk=2048 tn=768)" (parts left None and the
    derived VMEM limit left out: they follow the tiles)."""
    return _fields_label(blocks_dict(blocks)) or "table default"


def _fields_label(fields: dict) -> str:
    parts = []
    for name, value in fields.items():
        if value is None or name == "vmem_limit_bytes":
            continue
        parts.append(f"{name}({_fields_label(value)})" if isinstance(value, dict) else f"{name}={value}")
    return " ".join(parts)


def sweep_shapes(suite: _suite.Suite, full: bool):
    if full:
        return suite.shapes
    return suite.sweep_shapes or suite.quick_shapes or suite.shapes


def run_sweep(kernel: str, gens, *, full: bool = False, shapes=None, workers=None, bar=None) -> dict:
    """Model every candidate tiling of every op of `kernel` at each shape, on each generation in `gens`. Returns a
    JSON-ready result; `format_sweep` prints it."""
    suite = _suite.get(kernel)
    shapes = tuple(shapes) if shapes is not None else sweep_shapes(suite, full)
    swept_ops = [op for op in suite.ops if op.candidates is not None]
    result = {
        "kernel": kernel,
        "generations": list(gens),
        "modeled_labels": [f"modeled {g}" for g in gens],
        "full": full,
        "missing": [op.name for op in suite.ops if op.candidates is None],
        "rows": [],
    }
    for gen in gens:
        plans = []  # (op, shape, [blocks] or the Exception listing them raised)
        device = perf_model.trace_device(gen)
        # Under gen's device, candidate lists that ask the traced-for chip (tuning modules do) answer for gen.
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            for op in swept_ops:
                for shape in shapes:
                    try:
                        plans.append((op, shape, list(op.candidates(shape, gen))))
                    except Exception as e:  # noqa: BLE001 - a shape the kernel cannot tile is reported, not fatal
                        plans.append((op, shape, e))
        items = []
        for op, shape, cands in plans:
            if isinstance(cands, Exception):
                continue
            case = _suite.Case(op, shape)
            for i, blocks in enumerate(cands):
                tiling = _suite.Case(variant(op, i, blocks), shape)  # the kernel and its inputs at that tiling
                items.append(((case.id, i), lambda tiling=tiling: modeled.case_item(tiling, "kernel")))
        if bar is not None:
            bar.total = (bar.total or 0) + len(items)
            bar.set_description(f"{kernel}: sweeping ({gen})")
            bar.refresh()
        models = modeled.run_items(items, gen, bar=bar, workers=workers)
        for op, shape, cands in plans:
            result["rows"].append(_row(op, shape, gen, cands, models))
    return result


def variant(op: _suite.Op, index: int, blocks) -> _suite.Op:
    """The op as a measured sweep times it at its `index`-th candidate tiling: its kernel at `blocks`, nothing else
    (named "<op> #<index> [<tiling>]": the id names the tiling, so a process that rebuilds the case from its id
    (variant_case) and finds another tiling at that index fails instead of timing it under this one's label)."""
    inputs = {}
    if op.tiling_inputs:  # its inputs built for the kernel alone at this tiling (a backward's residuals)
        bound = dict(blocks=blocks, impls=("kernel",))
        inputs = dict(
            specs=functools.partial(op.specs, **bound),
            arrays=op.arrays and functools.partial(op.arrays, **bound),
            model_args=op.model_args and functools.partial(op.model_args, **bound),
        )
    return dataclasses.replace(
        op,
        name=f"{op.name} #{index} [{blocks_label(blocks)}]",
        kernel=functools.partial(op.kernel, blocks=blocks),
        default=None,
        baselines=(),
        **inputs,
    )


def variant_case(suite: _suite.Suite, case_id: str, generation: str) -> _suite.Case | None:
    """The measured sweep's case of that id ("<op> #<index> [<tiling>] <shape id>"), rebuilt from the op's candidates
    at the shape for `generation` (candidates are a function of the two: how a tracing worker finds the case; call it
    under the generation's device, which the tuning tables read); None if the suite has none of that id, or if the
    candidate at that index is another tiling."""
    for shape in dict.fromkeys((*suite.shapes, *(suite.quick_shapes or ()), *(suite.sweep_shapes or ()))):
        suffix = f" {shape.id}"
        name, _, rest = case_id.removesuffix(suffix).rpartition(" #")
        index = rest.split(" ", 1)[0]
        if not case_id.endswith(suffix) or not index.isdigit():
            continue
        for op in suite.ops:
            if op.name == name and op.candidates is not None:
                cands = list(op.candidates(shape, generation))
                if int(index) < len(cands):
                    case = _suite.Case(variant(op, int(index), cands[int(index)]), shape)
                    if case.id == case_id:
                        return case
    return None


def run_measured_sweep(
    kernel: str,
    dev,
    *,
    full: bool = False,
    shapes=None,
    calls=None,
    compile_workers=None,
    bar=None,
    deadline=None,
    lower_workers: int | None = None,
    exporter=None,
) -> dict:
    """Time every candidate tiling of every op of `kernel` at each shape on the chip that is present (`dev`, a TPU):
    the kernel alone at each tiling, by its device time. The result has run_sweep's form, its figures labeled
    measured; ops that update state in place (the KV cache write) are not swept here. The tilings' programs are
    traced in worker processes as the benchmarks' are (benchmarks/lowering.py: `lower_workers`, default
    lowering.default_workers; or the `exporter` pool given), which rebuild each tiling's case (variant_case)."""
    from . import device_timing, lowering, measured

    compile_workers = compile_workers or device_timing.COMPILE_WORKERS
    if exporter is None:
        workers = lowering.default_workers(compile_workers) if lower_workers is None else lower_workers
        exporter = lowering.shared(dev.generation, workers)

    suite = _suite.get(kernel)
    shapes = tuple(shapes) if shapes is not None else sweep_shapes(suite, full)
    label = dev.kernel_label
    result = {
        "kernel": kernel,
        "generations": [dev.generation],
        "measured": True,
        "full": full,
        "missing": [op.name for op in suite.ops if op.candidates is None or op.in_place is not None],
        "rows": [],
    }
    swept = [op for op in suite.ops if op.name not in result["missing"]]
    plans, cases = [], []
    # a tiling's case -> its op's at the shape: the tilings take the same inputs, built by one program (unless the
    # op's inputs follow the tiling: each its own)
    inputs_of = {}
    for op in swept:
        for shape in shapes:
            try:
                cands = list(op.candidates(shape, dev.generation))
            except Exception as e:  # noqa: BLE001 - a shape the kernel cannot tile is reported, not fatal
                plans.append((op, shape, e, []))
                continue
            # one variant of the op per tiling: its kernel at that tiling, nothing else timed beside it
            variants = [variant(op, i, b) for i, b in enumerate(cands)]
            plans.append((op, shape, cands, variants))
            cases += [_suite.Case(v, shape) for v in variants]
            shared = None if op.tiling_inputs else _suite.Case(op, shape).id
            inputs_of.update({_suite.Case(v, shape).id: shared or _suite.Case(v, shape).id for v in variants})
    if bar is not None:
        bar.total = (bar.total or 0) + len(cases)
        bar.set_description(f"{kernel}: sweeping ({label})")
        bar.refresh()
    stats = device_timing.run(
        cases,
        measured.case_arrays,
        kernel_label=label,
        default_label=label,
        calls=calls or device_timing.CALLS,
        compile_workers=compile_workers,
        bar=bar,
        deadline=deadline,
        kernel=kernel,
        exporter=exporter,
        inputs_of=lambda case: inputs_of[case.id],
    )
    for op, shape, cands, variants in plans:
        times = {}
        for i, v in enumerate(variants):
            entry = stats.get((_suite.Case(v, shape).id, "kernel"), {"error": "not timed"})
            times[(_suite.Case(op, shape).id, i)] = (
                types.SimpleNamespace(modeled_us=entry["median_s"] * 1e6, warnings=())
                if "median_s" in entry
                else RuntimeError(entry.get("error") or entry.get("na"))
            )
        result["rows"].append(_row(op, shape, dev.generation, cands, times, label=label))
    return result


def _row(op, shape, gen, cands, models, *, label: str | None = None) -> dict:
    case = _suite.Case(op, shape)
    row = {"op": op.name, "case": case.id, "shape": shape.as_dict(), "generation": gen}
    row["label"] = label or f"modeled {gen}"
    if isinstance(cands, Exception):
        return row | {"error": f"candidates: {type(cands).__name__}: {cands}"}
    entries = []
    for i, blocks in enumerate(cands):
        m = models[(case.id, i)]
        entry = {"blocks": blocks_dict(blocks), "label": blocks_label(blocks), "table_choice": i == 0}
        if isinstance(m, Exception):
            text = str(m).strip().splitlines()[-1] if str(m).strip() else ""
            entry["error"] = text if isinstance(m, RuntimeError) and label else f"{type(m).__name__}: {text}"
        else:
            entry["us"] = m.modeled_us
            entry["warnings"] = list(m.warnings)
        entries.append(entry)
    row["candidates"] = entries
    timed = [(e["us"], i) for i, e in enumerate(entries) if "us" in e]
    if not timed or "us" not in entries[0]:
        return row | {"error": "the table's choice has no modeled time" if timed else "no candidate modeled"}
    best_us, best = min(timed)  # ties: the lower index, the table's choice first
    row["choice"] = {"label": entries[0]["label"], "us": entries[0]["us"], "blocks": entries[0]["blocks"]}
    row["best"] = {"label": entries[best]["label"], "us": best_us, "blocks": entries[best]["blocks"]}
    row["gain"] = entries[0]["us"] / best_us
    row["table_is_best"] = best == 0
    return row


# Below this gain the table's choice counts as the best: differences of a fraction of a percent are within what the
# model's cycle counts resolve (a bundle or two per step).
TIE_GAIN = 1.005


def format_sweep(result: dict) -> str:
    lines = []
    measured = result.get("measured", False)
    for gen in result["generations"]:
        rows = [r for r in result["rows"] if r["generation"] == gen]
        label = rows[0]["label"] if rows else f"modeled {gen}"
        for op in dict.fromkeys(r["op"] for r in rows):
            op_rows = [r for r in rows if r["op"] == op]
            head = ["shape", "table's choice", f"{label} µs", "best candidate", f"{label} µs", "gain", "candidates"]
            cells = []
            for r in op_rows:
                shape = " ".join(f"{k}={v}" for k, v in r["shape"].items() if k != "dtype")
                if "gain" not in r:
                    cells.append([shape, r.get("error", "error"), "", "", "", "", str(len(r.get("candidates", [])))])
                    continue
                best = "(the table's)" if r["table_is_best"] else r["best"]["label"]
                cells.append(
                    [
                        shape,
                        r["choice"]["label"],
                        f"{r['choice']['us']:,.2f}",
                        best,
                        f"{r['best']['us']:,.2f}",
                        f"{r['gain']:.3f}x",
                        str(len(r["candidates"])),
                    ]
                )
            widths = [max(len(head[i]), *(len(c[i]) for c in cells)) for i in range(len(head))]

            def fmt(c, widths=widths):
                return (
                    "| "
                    + " | ".join(
                        x.ljust(w) if i < 2 or i == 3 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))
                    )
                    + " |"
                )

            how = (
                "every candidate tiling timed on the chip"
                if measured
                else "every candidate tiling modeled; none measured"
            )
            lines += [f"\nsweep {result['kernel']} / {op} — {label} ({how})"]
            lines += [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
            lines += [fmt(c) for c in cells]
            lines.append(_summary(op_rows, label))
    if result["missing"]:
        lines.append(f"not swept (no candidate tilings): {', '.join(result['missing'])}")
    lines.append(
        f"gain = the table's {'measured device' if measured else 'modeled'} time / the best candidate's: 1.000x where "
        f"the table's choice is the fastest (ties go to the table); under {TIE_GAIN:.3f}x counts as a tie."
    )
    return "\n".join(lines)


def _summary(rows, label) -> str:
    done = [r for r in rows if "gain" in r]
    if not done:
        return f"{label}: no shape modeled"
    losses = [r for r in done if r["gain"] >= TIE_GAIN]
    ties = len(done) - len(losses)
    text = f"{label}: the table's choice is the best (or within {TIE_GAIN - 1:.1%}) at {ties} of {len(done)} shapes"
    if losses:
        worst = max(losses, key=lambda r: r["gain"])
        text += (
            f"; it loses at {len(losses)}, most at {worst['case']}: {worst['best']['label']} "
            f"{worst['best']['us']:,.2f} µs vs {worst['choice']['us']:,.2f} µs ({worst['gain']:.3f}x)"
        )
    errors = [r for r in rows if "gain" not in r]
    if errors:
        text += f"; {len(errors)} shape(s) not modeled"
    return text


def write_sweep_json(result: dict, out: pathlib.Path) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['kernel']}.sweep.json"
    path.write_text(json.dumps(result, indent=1))
    return path
