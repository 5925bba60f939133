"""Measured timings on a TPU: every implementation of every case by its device time (benchmarks/profiler.py).

For each case the inputs are built on the device, then every implementation that applies (the kernel, the default
XLA path and each baseline of the op) is run once and then `calls` times inside one profiler trace; its figure is the
median device time of those calls. The first call's compile time (trace, lower and compile, on the host) is reported
apart, never mixed into the device time.

Compiling is most of a run's host time (a flash attention backward or a baseline's kernel takes seconds), so every
program of the run is compiled ahead, on a pool of threads (XLA and Mosaic compile outside the GIL), from its inputs'
shapes alone (`jax.eval_shape` of the case's input builder): while one case runs on the chip the later ones compile.
Their tracing and lowering (Python, under the GIL) stay on the thread that runs the chip (_Plan).
Device times are unaffected (a program's device time does not depend on what the host does meanwhile); compile times
are host seconds under that concurrency, and the JSON says with how many threads. A case's inputs are built by a
program of their own, compiled on the pool with the rest (built eagerly, the new shapes' small compiles queued behind
the pool's took 35-56 s a case on the v5e host), run just before the case and freed after it, so one case's inputs
at a time sit in HBM.

An implementation that cannot run at a case shows why: "na" (the op says it does not apply, e.g. a baseline's
unsupported shape or a package that is not installed) or "error" (its compile or run raised: a VMEM OOM, say).
Where the host's time went (lowering, inputs, waiting on compiles, first runs, profiler traces) is returned per case
as well.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import threading
import time

from . import lowering, profiler
from . import suite as _suite

CALLS = 20  # timed executions per program (the median is stable to ~1 % from 20)
# Half the host's cores (at most 8) compile: on the v5e host's 13 cores, 12 compile threads (each compile using more
# than one core) starved the thread that runs the chip, whose own work (lowering, its inputs' small compiles) took
# several times its unloaded time. The compile threads also run at a lower priority (COMPILE_NICE) than it.
COMPILE_WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
COMPILE_NICE = 10
# Seconds a case waits for one implementation's compile before it goes on without it (reported as an error): a
# baseline whose compile runs for minutes (JAX's ragged paged attention at its default blocks and head dim 512 took
# ~2 min) would otherwise stall the whole run with no figure and no reason.
COMPILE_TIMEOUT_S = 180.0


def _lower_priority() -> None:
    """A compile thread's initializer: this thread's niceness raised by COMPILE_NICE (Linux, per thread), so that the
    thread that runs the chip is served first; nothing where the platform does not allow it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):
        pass


# Consecutive cases share one profiler trace (each trace costs ~0.5-1 s of the host's time: 0.7 s of stop_trace a case
# on the v5e host, about 110 s of the quick suite's 158 cases) while together they hold at most TRACE_GROUP_BYTES of
# inputs and state on the device (a case's are freed after its trace), and at most TRACE_GROUP_CASES of them.
TRACE_GROUP_CASES = 12
TRACE_GROUP_BYTES = 1 << 30

INPUTS = "inputs"  # the plan's key, beside the implementations', of a case's input builder
STATE = "state"  # and of the builder of its in-place implementations' initial state (each gets a fresh one)
BUILDERS = (INPUTS, STATE)

# A case's host seconds on the thread that runs the chip, by phase, and export_s: the worker processes' tracing of its
# programs, which ran in parallel (not this thread's time).
PHASES = ("lower_s", "inputs_s", "compile_wait_s", "first_run_s", "trace_s", "export_s")


def hbm_in_use() -> dict | None:
    """The chip's memory now: {"in_use_gib", "peak_gib", "limit_gib"} from the device's memory_stats (None where the
    device reports none, as the CPU does): what a case leaves held, and how near the chip's limit its peak came."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" not in stats:
        return None
    gib = 1 << 30
    return {
        "in_use_gib": stats["bytes_in_use"] / gib,
        "peak_gib": stats.get("peak_bytes_in_use", 0) / gib,
        "limit_gib": stats.get("bytes_limit", 0) / gib,
    }


def reason(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line for a table footnote: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _lower(fn, name: str, args, donate: int = 0):
    """(lowered, host seconds) of jax.jit(fn) under `name` for `args` (arrays or their ShapeDtypeStructs), its first
    `donate` arguments donated: the tracing and lowering, Python that holds the GIL, done on the thread that runs the
    chip."""
    import jax

    start = time.perf_counter()
    lowered = jax.jit(profiler.named(fn, name), donate_argnums=tuple(range(donate))).lower(*args)
    return lowered, time.perf_counter() - start


def _compile(lowered, name: str, lower_s: float, log: dict | None = None, key=None, submitted: float = 0.0):
    """(compiled, name, lower seconds, compile seconds): XLA's and Mosaic's compile, which releases the GIL. With
    `log`, log[key] = (seconds queued on the pool since `submitted` (perf_counter), seconds compiling)."""
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    if log is not None:
        log[key] = (start - submitted, seconds)
    return compiled, name, lower_s, seconds


def _input_specs(case, make_args):
    """The shapes of a case's inputs, from its builder traced abstractly (nothing is built on the device)."""
    import jax

    return jax.eval_shape(lambda: make_args(case))


def _donates(case, impl: str) -> bool:
    return case.op.in_place is not None and impl in case.op.in_place.functions


def _exportable(case, impls, specs):
    """(implementation, its argument specs) of every program of a case a worker may trace: the input builder (None,
    no arguments) and each of `impls` that donates nothing (a donating one's aliasing is its jit's own: lowered on
    the chip's thread)."""
    yield None, ()
    for impl in impls:
        if not _donates(case, impl):
            yield impl, specs


def prefetch(cases, make_args, kernel: str, exporter: lowering.Pool) -> None:
    """Start the worker exports of `kernel`'s cases ahead of its measuring run, which then takes them over
    (lowering.Pool.submit)."""
    for case in cases:
        try:
            specs = _input_specs(case, make_args)
        except Exception:  # noqa: BLE001 - such a case is lowered from its concrete inputs when it runs
            continue
        runnable = [impl for impl, why_not in case.op.impls(case.shape).items() if why_not is None]
        for impl, args in _exportable(case, runnable, specs):
            exporter.prefetch(kernel, case.id, impl, make_args, args)


class _Plan:
    """The programs of every runnable implementation of every case, lowered in case order on the calling thread and
    compiled on the pool: those of the case about to run first, then enough of the later cases' to keep every
    compile thread busy (`ahead` compiles in flight). Lowering stays off the compile threads: a thread tracing
    Python there would take the GIL from the one building inputs and running the chip at every switch interval, which
    made a case's inputs take 15-50 s instead of a fraction of one."""

    def __init__(self, cases, make_args, pool, ahead: int, exporter=None, kernel: str | None = None, inputs_of=None):
        import jax

        self.pool, self.ahead = pool, max(1, ahead)
        self.exports: dict[tuple[str, str], concurrent.futures.Future] = {}  # programs traced in worker processes
        self.lowered_by = {"workers": 0, "here": 0}  # programs lowered from a worker's export / on this thread
        self.worker_failures: dict[str, int] = {}  # why a worker's export failed (lowered here instead): count
        # why a case's input builder failed as one program (its inputs then built eagerly, op by op, each op's
        # small compile on this thread): count
        self.eager_inputs: dict[str, int] = {}
        # (case id, impl or INPUTS) -> (seconds queued on the pool, seconds compiling) of each finished compile
        self.compile_log: dict[tuple[str, str], tuple[float, float]] = {}
        self.compiles: dict[tuple[str, str], concurrent.futures.Future] = {}
        self.results: dict[tuple[str, str], dict] = {}
        self.functions: dict[tuple[str, str], object] = {}
        self.state: dict[tuple[str, str], int] = {}  # in-place implementations: their donated state arguments
        self.builders: dict[tuple[str, str], object] = {}  # (case id, INPUTS) -> the case's input builder
        # case id -> its input builder's key: (the id `inputs_of(case)` names, INPUTS), one builder for the cases
        # that name the same id (a sweep's tilings of one op at one shape), compiled once
        self.inputs_keys: dict[str, tuple[str, str]] = {}
        self.inputs_users: dict[tuple[str, str], int] = {}  # an input builder's key -> the cases still to take it
        self.input_bytes: dict[str, int] = {}  # case id -> its inputs' bytes, from their shapes
        self.queue: list[tuple[int, tuple[str, str], object]] = []  # (case index, key, input specs) to lower
        self.lower_s = 0.0  # this thread's lowering seconds since the last take_lower_s()
        self.export_s = 0.0  # the workers' tracing seconds of the programs taken in since then (run in parallel)
        self.next_index = 0
        for position, case in enumerate(cases):
            impls = case.op.impls(case.shape)
            runnable = []
            for impl, why_not in impls.items():
                if why_not is not None:
                    self.results[(case.id, impl)] = {"na": why_not}
                    continue
                try:
                    in_place = case.op.in_place
                    if _donates(case, impl):
                        self.functions[(case.id, impl)] = case.op.in_place_function(impl, case.shape)
                        self.state[(case.id, impl)] = in_place.n_state
                    else:
                        self.functions[(case.id, impl)] = case.op.function(impl, case.shape)
                    runnable.append(impl)
                except Exception as e:  # noqa: BLE001
                    self.results[(case.id, impl)] = {"error": reason(e)}
            state = ()  # the in-place implementations' state, ahead of their arguments
            try:  # the inputs' shapes only: nothing is built on the device here
                specs = _input_specs(case, make_args)
                self.input_bytes[case.id] = _device_bytes(specs)
                if any((case.id, impl) in self.state for impl in runnable):
                    state = jax.eval_shape(lambda case=case: case.op.in_place.state(case.shape, 0))
            except Exception:  # noqa: BLE001 - this case compiles on its concrete inputs when it runs
                continue
            # the case's inputs are built by a program of their own, compiled on the pool ahead of the case's
            # programs: built eagerly, each new input shape's small compile waited behind the pool's (35-56 s a
            # case on the v5e host)
            inputs_key = self.inputs_keys[case.id] = ((inputs_of or (lambda c: c.id))(case), INPUTS)
            self.inputs_users[inputs_key] = self.inputs_users.get(inputs_key, 0) + 1
            shared_inputs = inputs_key in self.builders
            if not shared_inputs:
                self.builders[inputs_key] = lambda case=case: make_args(case)
                self.queue.append((position, inputs_key, ()))
            if state:  # so is the in-place state (built eagerly, its compiles took 4.4 s a KV cache shape there)
                self.builders[(case.id, STATE)] = lambda case=case: case.op.in_place.state(case.shape, 0)
                self.queue.append((position, (case.id, STATE), ()))
            for impl in runnable:
                key = (case.id, impl)
                self.queue.append((position, key, (*state, *specs) if key in self.state else specs))
            if exporter is not None and kernel is not None:  # its tracing starts now on the workers, in case order
                for impl, args in _exportable(case, runnable, specs):
                    if impl is None and shared_inputs:
                        continue
                    key = inputs_key if impl is None else (case.id, impl)
                    self.exports[key] = exporter.submit(kernel, case.id, impl, make_args, args)

    def submit(self, key, args) -> None:
        """Lower one program here and hand its compile to the pool (a failure is kept as the future's)."""
        self.next_index += 1
        name = profiler.program_name(self.next_index)
        start = time.perf_counter()
        try:
            fn, worker_s = self._exported(key)
            if fn is None:
                fn = self.builders[key] if key in self.builders else self.functions[key]
                self.lowered_by["here"] += 1
            lowered, _ = _lower(fn, name, args, self.state.get(key, 0))
        except Exception as e:  # noqa: BLE001 - reported with the implementation, as a compile failure is
            future = concurrent.futures.Future()
            future.set_exception(e.with_traceback(None))  # its frames hold the arguments (arrays, where concrete)
            self.compiles[key] = future
            self.lower_s += time.perf_counter() - start
            return
        here = time.perf_counter() - start  # this thread's: waiting on the export, taking it in, or lowering it
        self.lower_s += here
        self.export_s += worker_s
        # the compile column's host seconds: tracing wherever it ran, then lowering and compiling
        self.compiles[key] = self.pool.submit(
            _compile, lowered, name, worker_s + here, self.compile_log, key, time.perf_counter()
        )

    def _exported(self, key) -> tuple[object, float]:
        """(the function running the program a worker exported, the worker's tracing seconds), or (None, 0) where
        no worker traced it or its export failed (it is lowered here then)."""
        future = self.exports.pop(key, None)
        if future is None:
            return None, 0.0
        try:
            blob, worker_s = future.result()
            fn = lowering.deserialized_call(blob)
        except Exception as e:  # noqa: BLE001 - the program is lowered here instead
            why = reason(e, 160)
            self.worker_failures[why] = self.worker_failures.get(why, 0) + 1
            return None, 0.0
        self.lowered_by["workers"] += 1
        return fn, worker_s

    def cancel(self) -> None:
        """Drop every queued compile and worker export (the budget is spent)."""
        self.queue.clear()
        for future in (*self.compiles.values(), *self.exports.values()):
            future.cancel()

    def submit_through(self, position: int) -> None:
        """Submit every program of the cases up to `position`, then later ones while fewer than `ahead` compiles
        are in flight."""
        in_flight = sum(not f.done() for f in self.compiles.values())
        while self.queue and (self.queue[0][0] <= position or in_flight < self.ahead):
            later, key, _ = self.queue[0]
            if later > position and key in self.exports and not self.exports[key].done():
                break  # a later case's program still being traced by a worker: never wait for it here
            _, key, specs = self.queue.pop(0)
            self.submit(key, specs)
            in_flight += 1

    def take_lower_s(self) -> tuple[float, float]:
        """(this thread's lowering seconds, the workers' tracing seconds) since the last call."""
        seconds = (self.lower_s, self.export_s)
        self.lower_s = self.export_s = 0.0
        return seconds


def _built(plan: _Plan, future, build_eagerly):
    """A builder's arrays: a call of its compiled program (new buffers each call), else (no program: shapes not taken
    abstractly; or it failed to compile, counted in the run's log) `build_eagerly()`."""
    if future is not None:
        try:
            return future.result()[0]()
        except Exception as e:  # noqa: BLE001 - built eagerly below, where a failure is told apart by implementation
            why = reason(e, 160)
            plan.eager_inputs[why] = plan.eager_inputs.get(why, 0) + 1
    return build_eagerly()


def _build_inputs(plan: _Plan, case, make_args):
    """The case's inputs, from its input builder (built eagerly, an op may report the implementations whose inputs
    failed: suite.PartialInputs, a baseline's forward that a backward's residuals come from, say)."""
    key = plan.inputs_keys.get(case.id, (case.id, INPUTS))
    # a shared builder stays until its last case has called it (each call gives new buffers)
    plan.inputs_users[key] = plan.inputs_users.get(key, 1) - 1
    future = plan.compiles.get(key) if plan.inputs_users[key] > 0 else plan.compiles.pop(key, None)
    return _built(plan, future, lambda: make_args(case))


def _initial_state(plan: _Plan, case) -> tuple:
    """Fresh initial state for one in-place implementation of the case, from its state builder (kept for the
    case's other in-place implementations)."""
    future = plan.compiles.get((case.id, STATE))
    return tuple(_built(plan, future, lambda: case.op.in_place.state(case.shape, 0)))


@dataclasses.dataclass
class _Prepared:
    """A case ready for its trace: its implementations' results so far (n/a, errors), its programs (compiled, run
    once) with their compile and lowering seconds, its host seconds by phase, and the bytes of device arrays it
    holds (inputs and in-place state) until its trace."""

    case: object
    results: dict
    phases: dict
    programs: dict = dataclasses.field(default_factory=dict)
    compile_s: dict = dataclasses.field(default_factory=dict)
    lower_s: dict = dataclasses.field(default_factory=dict)
    held_bytes: int = 0


def _device_bytes(tree) -> int:
    """The bytes of the arrays (or ShapeDtypeStructs) in `tree`; an extended dtype's (a PRNG key's) count as none."""
    import jax
    import numpy as np

    def nbytes(x):
        try:
            return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        except TypeError:
            return 0

    return sum(nbytes(x) for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _prepare_case(position, case, plan: _Plan, make_args) -> _Prepared:
    """The case's programs (and the next ones') lowered, its inputs built, its compiles waited on and each program
    run once: everything before its trace."""
    import jax

    results = {impl: entry for (case_id, impl), entry in plan.results.items() if case_id == case.id}
    phases = dict.fromkeys(PHASES, 0.0)
    ready = _Prepared(case, results, phases)
    runnable = [impl for (case_id, impl) in plan.functions if case_id == case.id]
    plan.submit_through(position)
    phases["lower_s"], phases["export_s"] = plan.take_lower_s()
    start = time.perf_counter()
    try:
        args = _build_inputs(plan, case, make_args)
        if isinstance(args, _suite.PartialInputs):  # some implementations' inputs did not build: those show why
            for impl, why in args.failed.items():
                results[impl] = {"error": f"inputs: {why}"}
            runnable = [impl for impl in runnable if impl not in args.failed]
            args = args.args
        jax.block_until_ready(args)
    except Exception as e:  # noqa: BLE001 - the case's inputs did not build: every impl shows why
        results.update({i: {"error": f"inputs: {reason(e)}"} for i in runnable})
        return ready
    phases["inputs_s"] = time.perf_counter() - start
    ready.held_bytes = _device_bytes(args)
    for impl in runnable:
        key = (case.id, impl)
        n_state = plan.state.get(key, 0)
        try:
            # an in-place implementation gets state of its own (it is donated, call to call)
            call_args = (*_initial_state(plan, case), *args) if n_state else args
            if key not in plan.compiles:  # its inputs' shapes could not be taken abstractly: the concrete ones
                plan.submit(key, call_args)
                here_s, export_s = plan.take_lower_s()
                phases["lower_s"] += here_s
                phases["export_s"] += export_s
            start = time.perf_counter()
            try:
                # a failed compile's exception taken, not raised: raised, it would keep this frame (the case's inputs)
                # in its traceback for as long as anything holds it (the HBM of a Gemma 4 paged attention case's
                # inputs stayed held through the next cases, which then ran out of it on the v5e)
                failure = plan.compiles[key].exception(timeout=COMPILE_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                # the compile thread cannot be stopped; the case goes on without this implementation
                raise TimeoutError(f"compile still running after {COMPILE_TIMEOUT_S:.0f} s: not timed") from None
            finally:  # a compile that fails counts too (an out-of-memory compile can take a minute to say so)
                phases["compile_wait_s"] += time.perf_counter() - start
            if failure is not None:
                results[impl] = {"error": reason(failure)}
                continue
            compiled, name, lowering, compiling = plan.compiles[key].result()
            start = time.perf_counter()
            program = profiler.Program(name, compiled, call_args, state=n_state)
            jax.block_until_ready(profiler.run_calls(program, 1))  # the first run, outside the trace
            phases["first_run_s"] += time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - one implementation failing must not lose the others
            results[impl] = {"error": reason(e)}
            continue
        ready.programs[impl] = program
        ready.held_bytes += _device_bytes(call_args[:n_state])
        ready.compile_s[impl], ready.lower_s[impl] = lowering + compiling, lowering
    return ready


def _trace_cases(group: list[_Prepared], calls: int, labels_of) -> None:
    """Every program of the prepared cases timed in one profiler trace (a trace costs ~0.5-1 s of the host's time,
    whatever it holds), their results filled in; the trace's seconds shared out by program. A failing trace is taken
    again case by case, and a case's failing trace program by program, so that one implementation's failure (XLA's
    attention out of HBM, say) stays its own. `labels_of(case)` -> {impl: column label}."""
    programs = [p for ready in group for p in ready.programs.values()]
    if not programs:
        return
    start = time.perf_counter()
    try:
        times = profiler.device_times(programs, calls)
    except Exception as e:  # noqa: BLE001
        if len(group) > 1:
            for ready in group:
                _trace_cases([ready], calls, labels_of)
        else:
            _trace_alone(group[0], calls, labels_of, reason(e))
        return
    per_program = (time.perf_counter() - start) / len(programs)
    for ready in group:
        labels = labels_of(ready.case)
        ready.phases["trace_s"] = per_program * len(ready.programs)
        for impl, p in ready.programs.items():
            ready.results[impl] = _timing(ready, impl, times[p.name], labels[impl], p.state)
        ready.programs = {}  # the inputs and state go with the programs' arguments


def _trace_alone(ready: _Prepared, calls: int, labels_of, why: str) -> None:
    """A case whose trace failed, each of its programs in a trace of its own (a lone program's failure is `why`)."""
    labels = labels_of(ready.case)
    start = time.perf_counter()
    alone = len(ready.programs) == 1
    for impl, p in ready.programs.items():
        if alone:  # the failed trace held this program alone: its failure is known
            ready.results[impl] = {"error": f"trace: {why}"}
            continue
        try:
            times = profiler.device_times([p], calls)
        except Exception as e:  # noqa: BLE001
            ready.results[impl] = {"error": f"trace: {reason(e)}"}
            continue
        ready.results[impl] = _timing(ready, impl, times[p.name], labels[impl], p.state)
    ready.phases["trace_s"] = time.perf_counter() - start
    ready.programs = {}


def _timing(ready: _Prepared, impl: str, t: list[float], label: str, state) -> dict:
    """One implementation's entry from its per-call device times."""
    return {
        "label": label,
        "median_s": statistics.median(t),
        "mean_s": statistics.fmean(t),
        "min_s": min(t),
        "stddev_s": statistics.pstdev(t),
        "rounds": len(t),
        "compile_s": ready.compile_s[impl],
        "lower_s": ready.lower_s[impl],
        "timing": "device time (profiler)",
        **({"in_place": "state donated, carried from call to call"} if state else {}),
    }


def case_line(case_id: str, phases: dict, results: dict, hbm: dict | None = None) -> str:
    """One log line for a timed case: its host seconds by phase and how many implementations ran, failed or did
    not apply; with `hbm` (hbm_in_use() after the case's trace), the chip's memory it left held and the run's peak."""
    ran = sum("median_s" in r for r in results.values())
    failed = sum("error" in r for r in results.values())
    na = sum("na" in r for r in results.values())
    spent = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for k, v in phases.items())
    line = f"  {case_id}: {ran} timed, {failed} failed, {na} n/a; host {spent}"
    if hbm is not None:
        line += (
            f"; HBM held after it {hbm['in_use_gib']:.2f} GiB (peak so far {hbm['peak_gib']:.2f} of "
            f"{hbm['limit_gib']:.2f})"
        )
    return line


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
    on_case=None,
    deadline: float | None = None,
    kernel: str | None = None,
    exporter: lowering.Pool | None = None,
    after_plan=None,
    inputs_of=None,
) -> dict:
    """{(case id, impl): entry} for every impl of every case: a timing (median_s, compile_s, ...), or {"na": why} /
    {"error": why}. `make_args(case)` builds the case's inputs on the device. `phases`, if given, receives
    {case id: host seconds by phase}; `on_case(stats)`, if given, is called with the stats so far after each
    case (the benchmarks write them out as they go). `deadline` (time.monotonic()): no case starts after it; the
    cases left show why they were not timed, and their queued compiles are dropped. `exporter` (with `kernel`, the
    suite's name): worker processes that trace and lower the programs (benchmarks/lowering.py); `after_plan()`, if
    given, is called once this run's exports are queued (the next kernel's prefetch goes behind them).
    `inputs_of(case)`, if given, names the case whose inputs a case takes (default its own): cases naming the same one
    share one compiled input builder, each still built fresh buffers."""
    stats = {}
    pool = concurrent.futures.ThreadPoolExecutor(max(1, compile_workers), initializer=_lower_priority)
    try:
        plan = _Plan(
            cases,
            make_args,
            pool,
            ahead=2 * max(1, compile_workers),
            exporter=exporter,
            kernel=kernel,
            inputs_of=inputs_of,
        )
        if after_plan is not None:
            after_plan()
        group: list[_Prepared] = []  # prepared cases waiting for their trace

        def labels_of(case):
            return {impl: kernel_label if impl == "kernel" else default_label for impl in case.op.impls(case.shape)}

        def trace_group():
            _trace_cases(group, calls, labels_of)
            hbm = hbm_in_use()  # the group's inputs and programs gone: what stays held is a leak
            for ready in group:
                for impl, entry in ready.results.items():
                    if "median_s" in entry:
                        entry["compile_workers"] = compile_workers
                    stats[(ready.case.id, impl)] = entry
                if phases is not None:
                    phases[ready.case.id] = ready.phases
                if bar is not None and hasattr(bar, "write"):  # where a slow run's host time goes, as it goes
                    bar.write(case_line(ready.case.id, ready.phases, ready.results, hbm))
                if on_case is not None:
                    on_case(dict(stats))
                if bar is not None:
                    bar.update(1)
            group.clear()

        for position, case in enumerate(cases):
            if deadline is not None and time.monotonic() > deadline:
                trace_group()
                why = f"not timed: the run's time budget was spent ({len(cases) - position} of {len(cases)} cases left)"
                for later in cases[position:]:
                    for impl, why_not in later.op.impls(later.shape).items():
                        stats[(later.id, impl)] = {"na": why_not or why}
                plan.cancel()
                break
            if sum(r.held_bytes for r in group) + plan.input_bytes.get(case.id, 0) > TRACE_GROUP_BYTES:
                trace_group()  # the group's inputs freed before a case whose own would take it past the bound
            ready = _prepare_case(position, case, plan, make_args)
            for impl in (*case.op.impls(case.shape), *BUILDERS):  # drop the case's executables: host memory
                plan.compiles.pop((case.id, impl), None)
            group.append(ready)
            held = sum(r.held_bytes for r in group)
            if len(group) >= TRACE_GROUP_CASES or held >= TRACE_GROUP_BYTES or position == len(cases) - 1:
                trace_group()
        plan.cancel()
    finally:
        # Compiles still running when the budget ended the run (a later case's) are not waited for: the next kernel
        # starts now (waiting for them took 5-10 s a kernel on the v5e host); their threads end when they finish.
        pool.shutdown(wait=False, cancel_futures=True)
    if bar is not None and hasattr(bar, "write"):
        if plan.compile_log:
            bar.write(compile_line(plan.compile_log))
        bar.write(lowering_line(plan))
    return stats


def lowering_line(plan: _Plan) -> str:
    """Where the run's programs were traced and lowered, and why a worker's export failed where one did."""
    line = (
        f"  programs lowered from the workers' exports: {plan.lowered_by['workers']}, here: {plan.lowered_by['here']}"
    )
    if plan.worker_failures:
        line += "; exports failed: " + "; ".join(f"{n}x {why}" for why, n in plan.worker_failures.items())
    if plan.eager_inputs:
        line += "; inputs built eagerly: " + "; ".join(f"{n}x {why}" for why, n in plan.eager_inputs.items())
    return line


def compile_line(log: dict) -> str:
    """The pool's compiles, the builders of inputs and in-place state apart ("input builders"): how many, seconds
    compiling and queued (median / max), the longest compile's implementation."""
    if not log:
        return ""

    def stats(entries):
        queued, compiling = [q for q, _ in entries.values()], [c for _, c in entries.values()]
        return (
            f"{len(entries)}, compiling {statistics.median(compiling):.1f} / {max(compiling):.1f} s, "
            f"queued {statistics.median(queued):.1f} / {max(queued):.1f} s"
        )

    inputs = {k: v for k, v in log.items() if k[1] in BUILDERS}
    programs = {k: v for k, v in log.items() if k[1] not in BUILDERS}
    parts = [f"programs {stats(programs)}"] if programs else []
    if inputs:
        parts.append(f"input builders {stats(inputs)}")
    longest = max(log, key=lambda k: log[k][1])
    return f"  compiles (median / max): {'; '.join(parts)}; longest: {longest[1]} ({log[longest][1]:.1f} s)"
