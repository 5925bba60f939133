"""The benchmark of one kernel, end to end: measure (device time on a TPU, pytest-benchmark on a CPU), model
(perf_model), roofline, targets.

`run_kernel` returns a JSON-ready result; `benchmarks.report` turns it into the table, the JSON file and the chart.
Every figure carries its label: "measured <device>" (device time from the profiler on a TPU; "cpu interpret" /
"cpu XLA" on a CPU, never a TPU figure), "modeled <gen>" or "roofline <gen>". Measured TPU rows get their own
roofline, efficiency and speedups, on the measured chip's generation.
"""

from __future__ import annotations

import dataclasses
import pathlib

from . import device as _device
from . import measured, modeled, perf_model, report, roofline
from . import suite as _suite

NOTES = (
    "modeled = static performance model (benchmarks/perf_model): the compiled kernel's bundle schedule and its HBM "
    "traffic, never a run on a TPU, calibrated against measured v5e timings (docs/perf_model.md): reads at 0.92 and "
    "writes at 0.708 of the table HBM bandwidth, 0.14 us per pipeline step, an assumed 1 us launch per kernel; v6e "
    "and v7x use the same constants. It ignores DMA contention, DMA shape effects, clock throttling and "
    "data-dependent stalls.",
    "roofline = max(minimum HBM bytes / HBM bandwidth, matmul flops / bf16 peak) for the generation's chip.",
    "efficiency = roofline / modeled kernel time; speedup = modeled default time / modeled kernel time.",
    "default = the plain JAX path of the same operation (the kernel's reference), compiled by XLA.",
    "A default/baseline holding a kernel whose run time and HBM traffic the model can only bound from below (a grid "
    "sized at run time inside XLA with nothing in the program to size it: XLA's own ragged dot kernel where the group "
    "sizes are not known; see the model notes) is floored at the roofline where its modeled time is below it (marked "
    "* in the table): a lower bound that favours the baseline.",
)


@dataclasses.dataclass
class Config:
    gen: str = "v6e"
    full: bool = False
    out: pathlib.Path = pathlib.Path("bench-results")
    measure: bool = True
    workers: int | None = None
    model: bool = True  # False: no performance model (--no-model; on a TPU host the measured figures stand alone)
    calls: int | None = None  # timed executions per program on a TPU (default: device_timing.CALLS)
    compile_workers: int | None = None  # compile threads on a TPU (default: device_timing.COMPILE_WORKERS)
    lower_workers: int | None = None  # tracing processes on a TPU (default: lowering.default_workers; 0: none)
    deadline: float | None = None  # time.monotonic() after which no case starts measuring (on a TPU; see __main__)
    shape_filters: tuple[str, ...] = ()  # only the shapes whose id holds every one of these (--shape)


def _us(seconds):
    return None if seconds is None else seconds * 1e6


def _measured_entry(stats: dict, case: _suite.Case, units: int, hbm_bytes: int):
    """{impl: timing} for every impl timed for this case ("kernel", "default", each "baseline:<name>" on a TPU, and
    any other a suite times); an impl that could not run keeps its {"na": why} / {"error": why}."""
    timed = {impl: s for (case_id, impl), s in stats.items() if case_id == case.id}
    if not timed:
        return None
    entry = {}
    for impl, s in timed.items():
        if "median_s" not in s:
            entry[impl] = dict(s)
            continue
        t = s["median_s"]
        entry[impl] = {
            "label": s["label"],
            "us": _us(t),
            "rounds": s["rounds"],
            "stddev_us": _us(s["stddev_s"]),
            "units_per_s": units / t,
            "gbps": hbm_bytes / t / 1e9,
        }
        for key in ("compile_s", "compile_workers", "timing", "in_place"):
            if key in s:
                entry[impl][key] = s[key]
    return entry


def _measured_figures(row: dict, measured_chip) -> dict:
    """Roofline, efficiency, % of MXU peak and speedups of the measured kernel, on the measured chip."""
    measured = row["measured"] or {}
    kernel_us = (measured.get("kernel") or {}).get("us")
    out = {"measured_roofline": None, "measured_efficiency": None, "measured_mxu_fraction": None}
    if measured_chip is not None:
        roof_s = roofline.roofline_s(row["hbm_bytes"], row["mxu_flops"], measured_chip)
        out["measured_roofline"] = {
            "label": f"roofline {measured_chip.gen}",
            "us": _us(roof_s),
            "bound": roofline.bound(row["hbm_bytes"], row["mxu_flops"], measured_chip),
        }
        if kernel_us:
            out["measured_efficiency"] = _us(roof_s) / kernel_us
            out["measured_mxu_fraction"] = row["mxu_flops"] / measured_chip.bf16_flops_per_s / (kernel_us * 1e-6)
    out["measured_speedups"] = {
        impl: e["us"] / kernel_us for impl, e in measured.items() if impl != "kernel" and kernel_us and "us" in e
    }
    return out


def _modeled_entry(model):
    if model is None:
        return {"skipped": "not modeled (--no-model)"}
    if isinstance(model, Exception):
        return {"error": f"{type(model).__name__}: {model}"}
    out = {
        "label": model.label,
        "us": model.modeled_us,
        "warnings": list(model.warnings),
        "notes": list(model.notes),
        "xla_ops_us": sum(x.modeled_s for x in model.xla_ops) * 1e6,
    }
    if model.kernels:
        out["kernels"] = [
            {
                "name": k.kernel_name,
                "grid": list(k.grid),
                "bound": k.bound,
                "hbm_bytes": k.hbm_bytes,
                "hbm_bytes_bound": k.hbm_bytes_bound,
                "compute_us": k.compute_s * 1e6,
                "hbm_us": k.hbm_s * 1e6,
                "us": k.modeled_s * 1e6,
            }
            for k in model.kernels
        ]
    return out


def build_row(case: _suite.Case, chip, models: dict, stats: dict, batch_unit: str, measured_chip=None) -> dict:
    shape, op = case.shape, case.op
    hbm_bytes, flops = int(op.hbm_bytes(shape)), int(op.mxu_flops(shape))
    roof_s = roofline.roofline_s(hbm_bytes, flops, chip)
    kernel = _modeled_entry(models.get((case.id, "kernel")))
    default = _modeled_entry(models.get((case.id, "default")))
    baselines = {}
    for impl, why_not in op.impls(shape).items():
        if impl.startswith(_suite.BASELINE_PREFIX):
            name = impl[len(_suite.BASELINE_PREFIX) :]
            baselines[name] = {"na": why_not} if why_not else _modeled_entry(models.get((case.id, impl)))
    row = {
        "op": op.name,
        "case": case.id,
        "shape": shape.as_dict(),
        "shape_id": shape.id,
        "series": shape.series,
        "batch": shape.batch,
        "batch_unit": batch_unit,
        "hbm_bytes": hbm_bytes,
        "mxu_flops": flops,
        "roofline": {
            "label": f"roofline {chip.gen}",
            "us": _us(roof_s),
            "bound": roofline.bound(hbm_bytes, flops, chip),
        },
        "modeled_kernel": kernel,
        "modeled_default": default,
        "default_name": op.default_name,
        "modeled_baselines": baselines,
        "speedups": {},
        "mxu_fraction": None,  # matmul flops / bf16 peak / modeled kernel time
        "efficiency": None,
        "speedup": None,
        "measured": _measured_entry(stats, case, shape.batch, hbm_bytes),
    }
    # A kernel whose loops are sized at run time with nothing in the program to size them (XLA's own Mosaic kernels
    # for lax.ragged_dot) is modeled with each loop once: its time and HBM bytes are lower bounds. Such an
    # implementation is floored at the op's roofline (as if it moved the minimum bytes at full bandwidth), a lower
    # bound that favours it.
    for entry in (default, *baselines.values()):
        partial = any(k["hbm_bytes_bound"] in ("lower", "approximate") for k in entry.get("kernels", []))
        if "us" in entry and partial and entry["us"] < _us(roof_s):
            entry["unfloored_us"], entry["us"] = entry["us"], _us(roof_s)
            entry["floored_at_roofline"] = True
    for entry in (kernel, default, *baselines.values()):
        if "us" in entry:
            t = entry["us"] * 1e-6
            entry["units_per_s"] = shape.batch / t
            entry["gbps"] = hbm_bytes / t / 1e9
    if "us" in kernel:
        row["efficiency"] = row["roofline"]["us"] / kernel["us"]
        row["mxu_fraction"] = flops / chip.bf16_flops_per_s / (kernel["us"] * 1e-6)
        if "us" in default:
            row["speedup"] = default["us"] / kernel["us"]
        row["speedups"] = {name: b["us"] / kernel["us"] for name, b in baselines.items() if "us" in b}
    row.update(_measured_figures(row, measured_chip))
    return row


def check_targets(targets: _suite.Targets, rows: list[dict], *, measured: bool = False) -> list[dict]:
    """Each target: what it asks, whether the figures meet it, and the worst case. The modeled figures by default;
    with `measured`, the measured ones (efficiency on the measured chip's roofline, speedup over the measured
    default; a suite's custom targets read modeled fields and are checked on the model only)."""
    efficiency = (lambda r: r.get("measured_efficiency")) if measured else (lambda r: r["efficiency"])
    speedup_of = (lambda r: (r.get("measured_speedups") or {}).get("default")) if measured else (lambda r: r["speedup"])
    rows = [r for r in rows if efficiency(r) is not None] if measured else rows
    out = []
    if targets.min_efficiency is not None:
        sel = [r for r in rows if r["batch"] >= targets.min_efficiency_from_batch]
        worst = min(sel, key=lambda r: efficiency(r) if efficiency(r) is not None else -1.0, default=None)
        eff = None if worst is None else efficiency(worst)
        out.append(
            {
                "target": f"efficiency >= {targets.min_efficiency:.0%} of the roofline at "
                f"{rows[0]['batch_unit'] if rows else 'batch'} >= {targets.min_efficiency_from_batch}",
                "met": eff is not None and eff >= targets.min_efficiency,
                "worst": None if worst is None else {"case": worst["case"], "efficiency": eff},
            }
        )
    if targets.beats_default:
        # measured, a row whose default did not run (its program out of memory, say) has nothing to compare: it is
        # named apart, not counted as the worst
        not_compared = [r["case"] for r in rows if measured and speedup_of(r) is None]
        compared = [r for r in rows if r["case"] not in not_compared]
        worst = min(compared, key=lambda r: speedup_of(r) if speedup_of(r) is not None else -1.0, default=None)
        speedup = None if worst is None else speedup_of(worst)
        out.append(
            {
                "target": "faster than the default implementation at every shape",
                "met": speedup is not None and speedup > 1.0,
                "worst": None if worst is None else {"case": worst["case"], "speedup": speedup},
                **({"not_compared": not_compared} if not_compared else {}),
            }
        )
    if targets.custom is not None and not measured:
        out += targets.custom(rows)
    return out


def kernel_cases(kernel: str, config: Config, dev: _device.Device, shapes=None) -> tuple[list, list]:
    """(every case of the kernel's run, the ones timed on `dev` in the order they are measured): `shapes` default
    to the suite's (benchmarks/shapes.py), quick unless config.full, filtered by config.shape_filters."""
    suite = _suite.get(kernel)
    if shapes is None and not config.full and suite.quick_shapes is not None:
        shapes = suite.quick_shapes
    if config.shape_filters:
        shapes = _suite.select_shapes(suite.shapes if shapes is None else shapes, config.shape_filters)
    cases = suite.cases(None if shapes is None else tuple(shapes))
    timed = [c for c in cases if dev.times(c.op.hbm_bytes(c.shape), config.full)] if config.measure else []
    # measured shape by shape, every op of a shape in turn (forward, then backward, ...): a run stopped by its time
    # budget has each op at its first shapes rather than one op alone
    position = {shape: i for i, shape in enumerate(dict.fromkeys(c.shape for c in cases))}
    timed.sort(key=lambda c: position[c.shape])
    return cases, timed


def run_kernel(
    kernel: str, config: Config, *, dev: _device.Device, shapes=None, bar=None, then: str | None = None
) -> dict:
    """Benchmark one kernel: `shapes` default to the suite's (benchmarks/shapes.py); `then`: the kernel measured
    next, whose programs the tracing workers start on once this kernel's are queued (on a TPU)."""
    suite = _suite.get(kernel)
    cases, timed = kernel_cases(kernel, config, dev, shapes)
    chip = perf_model.get_chip(config.gen)
    measured_chip = perf_model.get_chip(dev.generation) if dev.is_tpu and dev.generation else None
    config.out.mkdir(parents=True, exist_ok=True)
    if bar is not None:
        n_models = sum(why_not is None for c in cases for why_not in c.op.impls(c.shape).values())
        # one step per timed case on a TPU (all its implementations at once), per timed test with pytest-benchmark
        steps = len(timed) if dev.is_tpu else 2 * len(timed)
        bar.total = (bar.total or 0) + (n_models if config.model else 0) + steps
        bar.refresh()
    stats, measure_error, phases = {}, None, {}
    if timed:
        if bar is not None:
            bar.set_description(f"{kernel}: measuring ({dev.kernel_label})")
        unmodeled = dataclasses.replace(config, model=False)
        stats, measure_error = measured.run(
            kernel,
            timed,
            json_path=config.out / f"{kernel}.pytest-benchmark.json",
            log_path=config.out / f"{kernel}.pytest.log",
            full=config.full,
            bar=bar,
            dev=dev,
            calls=config.calls,
            compile_workers=config.compile_workers,
            lower_workers=config.lower_workers,
            then=(then, kernel_cases(then, config, dev)[1]) if then and dev.is_tpu else None,
            phases=phases,
            deadline=config.deadline,
            # each timed case lands in <kernel>.json at once (unmodeled, marked partial): a run stopped midway keeps
            # what it measured
            on_case=lambda done: report.write_json(
                _result(kernel, unmodeled, dev, suite, cases, chip, measured_chip, {}, done, None, phases)
                | {"partial": f"{len({c for c, _ in done})} of {len(timed)} timed cases so far"},
                config.out,
            ),
        )
    models = {}
    if config.model:
        if bar is not None:
            bar.set_description(f"{kernel}: modeling ({chip.gen})")
        models = modeled.run(cases, chip.gen, bar=bar, workers=config.workers)
    return _result(kernel, config, dev, suite, cases, chip, measured_chip, models, stats, measure_error, phases)


def _result(kernel, config, dev, suite, cases, chip, measured_chip, models, stats, measure_error, phases) -> dict:
    rows = [build_row(c, chip, models, stats, suite.batch_unit, measured_chip) for c in cases]
    measured_tpu = dev.is_tpu and bool(stats)
    return {
        "kernel": kernel,
        "generation": chip.gen,
        "modeled": config.model,
        "modeled_label": f"modeled {chip.gen}",
        "roofline_label": f"roofline {chip.gen}",
        "chip": chip.as_dict(),
        "measured_chip": None if measured_chip is None else measured_chip.as_dict(),
        "device": dev.as_dict(),
        "provenance": _device.provenance() if stats else None,
        "measured_label": dev.kernel_label,
        "measured_default_label": dev.default_label,
        "measure_error": measure_error,
        "host_phases": phases,  # on a TPU: {case id: host seconds by phase} (benchmarks/device_timing.py)
        "full": config.full,
        "batch_unit": suite.batch_unit,
        "flops_columns": suite.flops_columns,
        "goal": suite.targets.goal,
        "targets": check_targets(suite.targets, rows) if config.model else [],
        "measured_targets": check_targets(suite.targets, rows, measured=True) if measured_tpu else [],
        "notes": list(NOTES) if config.model else [NOTES[1]],
        "rows": rows,
    }
