"""Measured timings on a TPU: every implementation of every case by its device time (benchmarks/profiler.py).

For each case the inputs are built on the device once, then every implementation that applies (the kernel, the
default XLA path and each baseline of the op) is compiled, run once, and run `calls` times inside one profiler trace;
its figure is the median device time of those calls. The first call's compile time (trace, lower and compile, on the
host) is reported apart, never mixed into the device time.

Compiles overlap the timing: while one case runs on the chip, the next case's inputs are built and its programs
compiled on a thread pool (XLA and Mosaic compile outside the GIL). Device times are unaffected (a program's device
time does not depend on what the host does meanwhile); compile times are host seconds under that concurrency, and the
JSON says with how many compile threads. Two cases' inputs then sit in HBM at once, so a case is prepared ahead only
while both stay within a quarter of the chip's memory each (`_fits_beside`); a larger one is built after the
previous case's inputs are freed.

An implementation that cannot run at a case shows why: "na" (the op says it does not apply, e.g. a baseline's
unsupported shape or a package that is not installed) or "error" (its compile or run raised: a VMEM OOM, say).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import time

from . import profiler
from . import suite as _suite

CALLS = 20  # timed executions per program (the median is stable to ~1 % from 20)
COMPILE_WORKERS = 4


def reason(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line for a table footnote: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclasses.dataclass
class _Prepared:
    case: _suite.Case
    args: tuple | None
    compiles: dict  # impl -> Future of (compiled, compile seconds)
    results: dict  # impl -> finished entry ({"na": ...} or {"error": ...})


class _Names:
    def __init__(self):
        self.next = 0

    def __call__(self) -> str:
        self.next += 1
        return profiler.program_name(self.next)


def _compile(fn, name: str, args):
    import jax

    start = time.perf_counter()
    compiled = jax.jit(profiler.named(fn, name)).lower(*args).compile()
    return compiled, name, time.perf_counter() - start


def _prepare(case: _suite.Case, make_args, pool, names: _Names) -> _Prepared:
    impls = case.op.impls(case.shape)
    results = {impl: {"na": why_not} for impl, why_not in impls.items() if why_not is not None}
    runnable = [impl for impl, why_not in impls.items() if why_not is None]
    try:
        args = make_args(case)
    except Exception as e:  # noqa: BLE001 - the case's inputs did not build: every impl shows why
        return _Prepared(case, None, {}, {**results, **{i: {"error": f"inputs: {reason(e)}"} for i in runnable}})
    compiles = {}
    for impl in runnable:
        try:
            fn = case.op.function(impl, case.shape)
        except Exception as e:  # noqa: BLE001
            results[impl] = {"error": reason(e)}
            continue
        compiles[impl] = pool.submit(_compile, fn, names(), args)
    return _Prepared(case, args, compiles, results)


def _time(prepared: _Prepared, calls: int, labels: dict) -> dict:
    """{impl: entry} for one prepared case: compile, warm up, then every warm program in one trace."""
    import jax

    results = dict(prepared.results)
    programs, compile_s = {}, {}
    for impl, future in prepared.compiles.items():
        try:
            compiled, name, seconds = future.result()
            jax.block_until_ready(compiled(*prepared.args))  # the first run, outside the trace
        except Exception as e:  # noqa: BLE001 - one implementation failing must not lose the others
            results[impl] = {"error": reason(e)}
            continue
        programs[impl] = profiler.Program(name, compiled, prepared.args)
        compile_s[impl] = seconds
    if programs:
        try:
            times = profiler.device_times(list(programs.values()), calls)
        except Exception as e:  # noqa: BLE001
            return {**results, **{impl: {"error": f"trace: {reason(e)}"} for impl in programs}}
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
    return results


def _input_bytes(args) -> int:
    import jax

    return sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(args))


def _memory_bytes() -> int:
    """The default device's memory (bytes_limit of its allocator), or 16 GiB where it does not say."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 16 << 30))


def _fits_beside(current: _Prepared | None, upcoming: _suite.Case, memory: int) -> bool:
    """Whether `upcoming`'s inputs may be built while `current`'s are alive: each within a quarter of the memory
    (current's measured, upcoming's by the bytes its op says one call moves, a lower bound of its inputs)."""
    if current is None or current.args is None:
        return True
    return max(_input_bytes(current.args), upcoming.op.hbm_bytes(upcoming.shape)) <= memory // 4


def run(
    cases: list[_suite.Case],
    make_args,
    *,
    kernel_label: str,
    default_label: str,
    calls: int = CALLS,
    compile_workers: int = COMPILE_WORKERS,
    bar=None,
) -> dict:
    """{(case id, impl): entry} for every impl of every case: a timing (median_s, compile_s, ...), or {"na": why} /
    {"error": why}. `make_args(case)` builds the case's inputs on the device."""
    names = _Names()
    stats = {}
    memory = _memory_bytes() if cases else 0
    with concurrent.futures.ThreadPoolExecutor(max(1, compile_workers)) as pool:
        upcoming = _prepare(cases[0], make_args, pool, names) if cases else None
        for i, case in enumerate(cases):
            current = upcoming or _prepare(case, make_args, pool, names)
            upcoming = None
            if i + 1 < len(cases) and _fits_beside(current, cases[i + 1], memory):
                upcoming = _prepare(cases[i + 1], make_args, pool, names)
            labels = {impl: kernel_label if impl == "kernel" else default_label for impl in case.op.impls(case.shape)}
            for impl, entry in _time(current, calls, labels).items():
                if "median_s" in entry:
                    entry["compile_workers"] = compile_workers
                stats[(case.id, impl)] = entry
            current.args = None  # free the case's device buffers before the next one is built
            if bar is not None:
                bar.update(1)
    return stats
