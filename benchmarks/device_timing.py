"""Measured timings on a TPU: every implementation of every case by its device time (benchmarks/profiler.py).

For each case the inputs are built on the device, then every implementation that applies (the kernel, the default
XLA path and each baseline of the op) is run once and then `calls` times inside one profiler trace; its figure is the
median device time of those calls. The first call's compile time (trace, lower and compile, on the host) is reported
apart, never mixed into the device time.

Compiling is most of a run's host time (a flash attention backward or a baseline's kernel takes seconds), so every
program of the run is compiled ahead, on a pool of threads (XLA and Mosaic compile outside the GIL), from its inputs'
shapes alone (`jax.eval_shape` of the case's input builder): while one case runs on the chip the later ones compile.
Device times are unaffected (a program's device time does not depend on what the host does meanwhile); compile times
are host seconds under that concurrency, and the JSON says with how many threads. A case's inputs are built just
before it runs and freed after it, so one case's inputs at a time sit in HBM.

An implementation that cannot run at a case shows why: "na" (the op says it does not apply, e.g. a baseline's
unsupported shape or a package that is not installed) or "error" (its compile or run raised: a VMEM OOM, say).
Where the host's time went (inputs, waiting on compiles, first runs, profiler traces) is returned per case as well.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time

from . import profiler
from . import suite as _suite

CALLS = 20  # timed executions per program (the median is stable to ~1 % from 20)
COMPILE_WORKERS = max(1, min(12, (os.cpu_count() or 2) - 1))  # leave a core to the thread that runs the chip
PHASES = ("inputs_s", "compile_wait_s", "first_run_s", "trace_s")


def reason(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line for a table footnote: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _compile(fn, name: str, args):
    """(compiled, name, host seconds) of jax.jit(fn) under `name` for `args` (arrays or their ShapeDtypeStructs)."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(profiler.named(fn, name)).lower(*args).compile()
    return compiled, name, time.perf_counter() - start


class _Plan:
    """The compiles of every runnable implementation of every case, submitted up front."""

    def __init__(self, cases, make_args, pool):
        import jax

        self.compiles: dict[tuple[str, str], concurrent.futures.Future] = {}
        self.results: dict[tuple[str, str], dict] = {}
        self.functions: dict[tuple[str, str], object] = {}
        index = 0
        for case in cases:
            impls = case.op.impls(case.shape)
            runnable = []
            for impl, why_not in impls.items():
                if why_not is not None:
                    self.results[(case.id, impl)] = {"na": why_not}
                    continue
                try:
                    self.functions[(case.id, impl)] = case.op.function(impl, case.shape)
                    runnable.append(impl)
                except Exception as e:  # noqa: BLE001
                    self.results[(case.id, impl)] = {"error": reason(e)}
            try:  # the inputs' shapes only: nothing is built on the device here
                specs = jax.eval_shape(lambda case=case: make_args(case))
            except Exception:  # noqa: BLE001 - this case compiles on its concrete inputs when it runs
                continue
            for impl in runnable:
                index += 1
                fn = self.functions[(case.id, impl)]
                self.compiles[(case.id, impl)] = pool.submit(_compile, fn, profiler.program_name(index), specs)
        self.next_index = index


def _time_case(case, plan: _Plan, make_args, pool, calls: int, labels: dict) -> tuple[dict, dict]:
    """({impl: entry}, host seconds by phase) for one case: inputs, compiles, first runs, then one trace."""
    import jax

    phases = dict.fromkeys(PHASES, 0.0)
    results = {impl: entry for (case_id, impl), entry in plan.results.items() if case_id == case.id}
    runnable = [impl for (case_id, impl) in plan.functions if case_id == case.id]
    start = time.perf_counter()
    try:
        args = make_args(case)
        jax.block_until_ready(args)
    except Exception as e:  # noqa: BLE001 - the case's inputs did not build: every impl shows why
        return {**results, **{i: {"error": f"inputs: {reason(e)}"} for i in runnable}}, phases
    phases["inputs_s"] = time.perf_counter() - start
    programs, compile_s = {}, {}
    for impl in runnable:
        key = (case.id, impl)
        try:
            start = time.perf_counter()
            future = plan.compiles.get(key)
            if future is None:  # its inputs' shapes could not be taken abstractly: compile on the concrete ones
                plan.next_index += 1
                future = pool.submit(_compile, plan.functions[key], profiler.program_name(plan.next_index), args)
            compiled, name, seconds = future.result()
            phases["compile_wait_s"] += time.perf_counter() - start
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))  # the first run, outside the trace
            phases["first_run_s"] += time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - one implementation failing must not lose the others
            results[impl] = {"error": reason(e)}
            continue
        programs[impl] = profiler.Program(name, compiled, args)
        compile_s[impl] = seconds
    if programs:
        start = time.perf_counter()
        try:
            times = profiler.device_times(list(programs.values()), calls)
        except Exception as e:  # noqa: BLE001
            return {**results, **{impl: {"error": f"trace: {reason(e)}"} for impl in programs}}, phases
        phases["trace_s"] = time.perf_counter() - start
        for impl, p in programs.items():
            t = times[p.name]
            results[impl] = {
                "label": labels[impl],
                "median_s": statistics.median(t),
                "mean_s": statistics.fmean(t),
                "min_s": min(t),
                "stddev_s": statistics.pstdev(t),
                "rounds": len(t),
                "compile_s": compile_s[impl],
                "timing": "device time (profiler)",
            }
    return results, phases


def case_line(case_id: str, phases: dict, results: dict) -> str:
    """One log line for a timed case: its host seconds by phase and how many implementations ran, failed or did
    not apply."""
    ran = sum("median_s" in r for r in results.values())
    failed = sum("error" in r for r in results.values())
    na = sum("na" in r for r in results.values())
    spent = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for k, v in phases.items())
    return f"  {case_id}: {ran} timed, {failed} failed, {na} n/a; host {spent}"


def run(
    cases: list[_suite.Case],
    make_args,
    *,
    kernel_label: str,
    default_label: str,
    calls: int = CALLS,
    compile_workers: int = COMPILE_WORKERS,
    bar=None,
    phases: dict | None = None,
) -> dict:
    """{(case id, impl): entry} for every impl of every case: a timing (median_s, compile_s, ...), or {"na": why} /
    {"error": why}. `make_args(case)` builds the case's inputs on the device. `phases`, if given, receives
    {case id: host seconds by phase}."""
    stats = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, compile_workers)) as pool:
        plan = _Plan(cases, make_args, pool)
        for case in cases:
            labels = {impl: kernel_label if impl == "kernel" else default_label for impl in case.op.impls(case.shape)}
            results, case_phases = _time_case(case, plan, make_args, pool, calls, labels)
            for impl, entry in results.items():
                if "median_s" in entry:
                    entry["compile_workers"] = compile_workers
                stats[(case.id, impl)] = entry
            if phases is not None:
                phases[case.id] = case_phases
            if bar is not None and hasattr(bar, "write"):  # where a slow run's host time goes, as it goes
                bar.write(case_line(case.id, case_phases, results))
            for impl in case.op.impls(case.shape):  # drop the case's executables: their memory is the host's
                plan.compiles.pop((case.id, impl), None)
            if bar is not None:
                bar.update(1)
    return stats
