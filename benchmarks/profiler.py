"""Device time of compiled programs, read from the JAX profiler's trace.

Wall-clock time around a blocked call measures the host (dispatch plus `block_until_ready`: a 0.8 µs kernel reads as
~550 µs that way). The device's own record is the profiler's: on the plane of the chip (`/device:TPU:0`) the line
`XLA Modules` holds one event per executed program, its `duration_ns` the program's time on the chip.

`device_times` runs each program `calls` times inside one trace and returns each one's per-call device times. Every
program is told apart by its module name, which jax takes from the jitted function's name: `named(fn, name)` gives
a function that name (`program_name(i)`: fixed width, so that no name is a prefix of another).

The trace records the device alone (`LEAN_OPTIONS`): jax's defaults add the host tracer and the Python tracer, which
record every Python call and every compiler pass of every thread, and the benchmarks compile later programs on other
threads while a trace runs; the device's `XLA Modules` line needs neither. Where a profiler gives no device plane
under those options, the trace is taken again with jax's defaults.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Callable, Sequence

DEVICE_PLANE = "/device:TPU:0"
MODULES_LINE = "XLA Modules"
OPS_LINE = "XLA Ops"
PREFIX = "tkbench_"


def program_name(index: int) -> str:
    return f"{PREFIX}{index:06d}"


def named(fn: Callable, name: str) -> Callable:
    """fn under `name`: jax.jit(named(fn, name)) compiles a module called jit_<name>."""

    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


@dataclasses.dataclass
class Program:
    name: str  # the jitted function's name (program_name(i))
    call: Callable  # the compiled executable
    args: Sequence
    state: int = 0  # the first `state` arguments are donated state: each call's first outputs are the next call's


def run_calls(p: Program, calls: int):
    """p called `calls` times, its state (if any) carried from each call to the next; the last outputs. p.args keeps
    the state the last call returned (the donated buffers it was given are gone)."""
    out = None
    for _ in range(calls):
        out = p.call(*p.args)
        if p.state:
            p.args = (*out[: p.state], *p.args[p.state :])
    return out


# A module event is named after its HLO module, jit_<function name>, with jax's/XLA's decorations around it at times
# (a "(program id)" suffix, a ".N" clone suffix): the function name is looked for as a whole word.
def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape('jit_' + name)}(?![A-Za-z0-9_])")


def module_events(profile, *, plane: str = DEVICE_PLANE, line: str = MODULES_LINE) -> list:
    """Every event of `line` on `plane`, in start order, from a jax.profiler.ProfileData (or any object with the same
    planes / lines / events). Raises if the plane or its line is missing."""
    planes = [p for p in profile.planes if p.name == plane]
    if not planes:
        raise RuntimeError(f"the profile has no plane {plane!r} (planes: {sorted(p.name for p in profile.planes)})")
    events = [e for p in planes for ln in p.lines if ln.name == line for e in ln.events]
    if not events and not any(ln.name == line for p in planes for ln in p.lines):
        raise RuntimeError(f"the plane {plane!r} has no line {line!r}")
    return sorted(events, key=lambda e: e.start_ns)


def module_durations(profile, names: Sequence[str], *, plane: str = DEVICE_PLANE, line: str = MODULES_LINE) -> dict:
    """{name: [duration_ns of each execution, in start order]} of the programs named (module_events)."""
    patterns = {name: _pattern(name) for name in names}
    out = {name: [] for name in names}
    for e in module_events(profile, plane=plane, line=line):
        for name, pattern in patterns.items():
            if pattern.search(e.name):
                out[name].append(float(e.duration_ns))
                break
    return out


def op_times(profile, name: str, *, plane: str = DEVICE_PLANE) -> tuple[list[float], dict[str, float]]:
    """Where the executions of program jit_<name> spent their device time: ([duration_ns of each execution],
    {XLA op: total duration_ns over them}), each `XLA Ops` event of `plane` counted in the execution whose
    `XLA Modules` event holds its start."""
    pattern = _pattern(name)
    runs = [
        (e.start_ns, e.start_ns + e.duration_ns) for e in module_events(profile, plane=plane) if pattern.search(e.name)
    ]
    totals: dict[str, float] = {}
    for e in module_events(profile, plane=plane, line=OPS_LINE):
        if any(start <= e.start_ns < end for start, end in runs):
            totals[e.name] = totals.get(e.name, 0.0) + float(e.duration_ns)
    return [float(end - start) for start, end in runs], totals


def lean_options():
    """jax.profiler.ProfileOptions recording the device only: no host tracer, no Python tracer, no HLO protos."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 0
    options.python_tracer_level = 0
    if hasattr(options, "enable_hlo_proto"):
        options.enable_hlo_proto = False
    return options


_LEAN = {"works": True}  # set False for the process once a lean trace held no device plane


def traced(run, analyse, options=None):
    """analyse(profile) of one profiler trace taken while `run()` runs (`options`: jax.profiler.ProfileOptions, None for
    jax's defaults); the profile is read from the trace's one .xplane.pb, in a directory removed afterwards."""
    import jax

    with tempfile.TemporaryDirectory(prefix="tpu-kernels-trace-") as trace_dir:
        jax.profiler.start_trace(trace_dir, profiler_options=options)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if len(files) != 1:
            raise RuntimeError(f"expected one .xplane.pb under the trace directory, found {len(files)}")
        return analyse(jax.profiler.ProfileData.from_file(files[0]))


def _trace(run, names: Sequence[str], options) -> dict[str, list[float]]:
    return traced(run, lambda profile: module_durations(profile, names), options)


def module_times(names: Sequence[str], run) -> dict[str, list[float]]:
    """{name: [device seconds of each execution of module jit_<name>, in order]} while `run()` runs, from one trace
    of the device alone (LEAN: with jax's defaults where that gives no device plane, `run()` then running again)."""
    durations = None
    if _LEAN["works"]:
        try:
            durations = _trace(run, names, lean_options())
        except RuntimeError as e:
            if "has no plane" not in str(e) and "has no line" not in str(e):
                raise
            _LEAN["works"] = False
    if durations is None:
        durations = _trace(run, names, None)
    return {name: [t * 1e-9 for t in ns] for name, ns in durations.items()}


def device_times(programs: Sequence[Program], calls: int) -> dict[str, list[float]]:
    """{program name: [device seconds of each of its `calls` executions]}, all programs in one profiler trace.

    Each program must already have run once (compiled and warm). A program whose executions the trace does not hold
    exactly `calls` times (a function that runs several programs, a dropped event) raises rather than guess."""
    import jax

    def run():
        for p in programs:
            jax.block_until_ready(run_calls(p, calls))

    durations = module_times([p.name for p in programs], run)
    for name, times in durations.items():
        if len(times) != calls:
            raise RuntimeError(f"the trace holds {len(times)} executions of jit_{name}, expected {calls}")
    return durations
