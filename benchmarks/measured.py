"""Measured timings: by device time on a TPU (benchmarks/device_timing.py), through pytest-benchmark elsewhere.

On a TPU, `run()` times every implementation of each case (kernel, default and the op's baselines) from the
profiler's record of the chip. On a CPU the suites (`benchmarks/test_<kernel>.py`) time each case twice, the kernel
(in TPU interpret mode) and the default implementation, with pytest-benchmark's `benchmark` fixture: `run()` runs a
suite in this process through `pytest.main` with `--benchmark-json` and reads the timings back from that JSON. Which
cases a suite times is decided here (`plan`), so `python -m benchmarks` and a direct `pytest
benchmarks/test_<kernel>.py` time the same cases. (Run directly on a TPU, a pytest-benchmark suite times the host
around each blocked call, and its rows say so: never device time.)
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib

from . import device as _device
from . import suite as _suite

IMPLS = _suite.IMPLS
HERE = pathlib.Path(__file__).resolve().parent
# pytest-benchmark rounds (each one call, after one warm-up call that also compiles) per device.
ROUNDS = {"tpu": (20, 10), "cpu": (3, 1)}  # (rounds, iterations per round)

_PLANNED: dict[str, list[_suite.Case]] = {}


def plan(kernel: str, *, full: bool, dev: _device.Device | None = None) -> list[_suite.Case]:
    """The cases of `kernel` to time: those `run()` was given, else every case the device times."""
    if kernel in _PLANNED:
        return _PLANNED[kernel]
    dev = dev or _device.detect()
    return [c for c in _suite.get(kernel).cases() if dev.times(c.op.hbm_bytes(c.shape), full)]


def case_arrays(case: _suite.Case, seed: int = 0):
    """The case's concrete inputs, built on the default device: the op's own `arrays`, else random normal values
    of its specs."""
    import jax

    from . import inputs

    if case.op.arrays is not None:
        return case.op.arrays(case.shape, seed)
    specs = case.op.specs(case.shape)
    keys = iter(inputs.keys(seed, len(jax.tree.leaves(specs))))
    return jax.tree.map(lambda s: inputs.normal(next(keys), s.shape, s.dtype), specs)


def time_case(benchmark, case: _suite.Case, impl: str, dev: _device.Device) -> None:
    """Time one case with pytest-benchmark's `benchmark` fixture. On a CPU the kernel runs in TPU interpret mode."""
    import jax

    from tpu_kernels_jax.common.interpret import interpret_on_cpu

    fn = jax.jit(case.op.function(impl, case.shape))
    args = case_arrays(case)
    if isinstance(args, _suite.PartialInputs):
        if impl in args.failed:
            raise RuntimeError(f"{impl}'s inputs: {args.failed[impl]}")
        args = args.args
    interpret = impl == "kernel" and not dev.is_tpu
    context = interpret_on_cpu if interpret else contextlib.nullcontext

    def call():
        with context():
            jax.block_until_ready(fn(*args))

    call()  # compile outside the timed rounds
    rounds, iterations = ROUNDS["tpu" if dev.is_tpu else "cpu"]
    benchmark.extra_info.update(
        case_id=case.id,
        impl=impl,
        # pytest-benchmark times the host: around a blocked call on a TPU that is dispatch plus the wait, never the
        # chip's time (python -m benchmarks measures device time there).
        label=(
            f"host wall-clock, {dev.kind}"
            if dev.is_tpu
            else dev.kernel_label
            if impl == "kernel"
            else dev.default_label
        ),
        device_kind=dev.kind,
        batch=case.shape.batch,
        hbm_bytes=case.op.hbm_bytes(case.shape),
    )
    benchmark.pedantic(call, rounds=rounds, iterations=iterations, warmup_rounds=1)


class _Progress:
    """pytest plugin: one progress-bar step per finished test."""

    def __init__(self, bar):
        self.bar = bar

    def pytest_runtest_logfinish(self, nodeid, location):
        if self.bar is not None:
            self.bar.update(1)


def run(
    kernel: str,
    cases: list[_suite.Case],
    *,
    json_path: pathlib.Path,
    log_path: pathlib.Path,
    full: bool,
    bar=None,
    dev: _device.Device | None = None,
    calls: int | None = None,
    compile_workers: int | None = None,
    phases: dict | None = None,
    on_case=None,
    deadline: float | None = None,
    lower_workers: int | None = None,
    then: tuple[str, list[_suite.Case]] | None = None,
) -> tuple[dict, str | None]:
    """Time `cases` of `kernel`. Returns ({(case id, impl): stats}, error).

    On a TPU: device time of every implementation (kernel, default, baselines), see benchmarks/device_timing.py;
    `calls` timed executions each; `phases` receives where the host's time went, per case; `on_case(stats so far)` is
    called after each case; `deadline` (time.monotonic()): no case starts after it (on a TPU); `lower_workers`:
    processes that trace and lower the programs beside the chip's (benchmarks/lowering.py; None: the host's cores
    less the compile threads, 0: none); `then` (the kernel measured next, its cases): their exports start on the
    workers behind this kernel's. Elsewhere: through the
    kernel's pytest-benchmark suite (kernel and default), pytest's own output in `log_path`, timings in seconds from
    pytest-benchmark's JSON at `json_path`.
    """
    if not cases:
        return {}, None
    dev = dev or _device.detect()
    if dev.is_tpu:
        from . import device_timing, lowering

        compile_workers = compile_workers or device_timing.COMPILE_WORKERS
        if lower_workers is None:
            lower_workers = lowering.default_workers(compile_workers)
        exporter = lowering.shared(dev.generation, lower_workers)
        after_plan = None
        if exporter is not None and then is not None:
            after_plan = lambda: device_timing.prefetch(then[1], case_arrays, then[0], exporter)  # noqa: E731
        stats = device_timing.run(
            cases,
            case_arrays,
            kernel_label=dev.kernel_label,
            default_label=dev.default_label,
            calls=calls or device_timing.CALLS,
            compile_workers=compile_workers,
            bar=bar,
            phases=phases,
            on_case=on_case,
            deadline=deadline,
            kernel=kernel,
            exporter=exporter,
            after_plan=after_plan,
        )
        return stats, None
    import pytest

    test_file = HERE / f"test_{kernel}.py"
    if not test_file.exists():
        return {}, f"no pytest-benchmark suite {test_file.name}"
    json_path.unlink(missing_ok=True)
    _PLANNED[kernel] = list(cases)
    args = [
        str(test_file),
        f"--benchmark-json={json_path}",
        "-p",
        "no:cacheprovider",
        "-q",
        "--rootdir",
        str(HERE.parent),
    ] + (["--bench-full"] if full else [])
    # Run from a pytest-xdist worker (the test suite's), the nested session would read the worker's variable and
    # pytest-benchmark would disable itself as if under xdist; the nested session is a plain single-process one.
    xdist_worker = os.environ.pop("PYTEST_XDIST_WORKER", None)
    try:
        with open(log_path, "w") as log, contextlib.redirect_stdout(log):
            code = pytest.main([*args, "-p", "no:xdist"], plugins=[_Progress(bar)])
    finally:
        _PLANNED.pop(kernel, None)
        if xdist_worker is not None:
            os.environ["PYTEST_XDIST_WORKER"] = xdist_worker
    error = None if code == 0 else f"pytest exited with {int(code)}; see {log_path}"
    if not json_path.exists():
        return {}, error or f"pytest-benchmark wrote no {json_path}"
    stats = {}
    for b in json.loads(json_path.read_text())["benchmarks"]:
        info, s = b["extra_info"], b["stats"]
        stats[(info["case_id"], info["impl"])] = {
            "label": info["label"],
            "median_s": s["median"],
            "mean_s": s["mean"],
            "min_s": s["min"],
            "stddev_s": s["stddev"],
            "rounds": s["rounds"],
        }
    return stats, error
