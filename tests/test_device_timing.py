"""The benchmarks' TPU measuring path without a TPU: the profiler trace's parsing on synthetic planes, and the
orchestration (inputs, compiles, warm-up, n/a and failing implementations, the measured table) with the profiler's
device times stood in for by known values, since this machine has no chip to trace."""

import concurrent.futures
import dataclasses
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import device, device_timing, harness, measured, profiler, report, shapes, suite


def _event(name, start, duration):
    return types.SimpleNamespace(name=name, start_ns=start, duration_ns=duration)


def _profile(events, plane=profiler.DEVICE_PLANE, line=profiler.MODULES_LINE):
    lines = [types.SimpleNamespace(name=line, events=events), types.SimpleNamespace(name="XLA Ops", events=events)]
    host = types.SimpleNamespace(name="/host:CPU", lines=[types.SimpleNamespace(name=line, events=events)])
    return types.SimpleNamespace(planes=[host, types.SimpleNamespace(name=plane, lines=lines)])


def test_module_durations_tell_programs_apart_by_whole_name():
    a, b = profiler.program_name(1), profiler.program_name(10)
    assert not b.startswith(a) and len(a) == len(b)
    events = [
        _event(f"jit_{b}(7)", 30, 5.0),
        _event(f"jit_{a}", 10, 1.0),
        _event(f"jit_{a}(3)", 20, 2.0),
        _event("jit_tkbench_0000011", 40, 9.0),  # another program whose name merely contains a's digits
        _event("jit_random_normal", 50, 4.0),
    ]
    out = profiler.module_durations(_profile(events), [a, b])
    assert out == {a: [1.0, 2.0], b: [5.0]}  # in start order, only the device plane's XLA Modules line


def test_module_durations_refuse_a_profile_without_the_chip():
    with pytest.raises(RuntimeError, match="no plane '/device:TPU:0'"):
        profiler.module_durations(_profile([], plane="/device:TPU:1"), ["x"])
    with pytest.raises(RuntimeError, match="no line 'XLA Modules'"):
        profiler.module_durations(_profile([], line="XLA Ops only"), ["x"])


def test_named_functions_compile_to_modules_of_that_name():
    name = profiler.program_name(42)
    lowered = jax.jit(profiler.named(lambda x: x * 2, name)).lower(jnp.ones(4))
    assert f"jit_{name}" in lowered.as_text()


def test_device_times_trace_the_device_alone_and_fall_back_to_the_defaults(monkeypatch):
    """The trace asks for no host or Python tracer (they would record every compile thread's calls); a profiler that
    gives no device plane under those options is traced again with jax's defaults, for the rest of the process."""
    options = profiler.lean_options()
    assert (options.host_tracer_level, options.python_tracer_level) == (0, 0)
    seen = []

    def trace(run, names, opts):
        seen.append(opts)
        if opts is not None:
            raise RuntimeError(f"the profile has no plane {profiler.DEVICE_PLANE!r} (planes: ['/host:CPU'])")
        return {name: [1000.0 * (i + 1)] * 3 for i, name in enumerate(names)}

    monkeypatch.setattr(profiler, "_trace", trace)
    monkeypatch.setattr(profiler, "_LEAN", {"works": True})
    programs = [profiler.Program(profiler.program_name(i), None, ()) for i in (1, 2)]
    times = profiler.device_times(programs, 3)  # (the stand-in trace runs nothing)
    assert list(times) == [p.name for p in programs]
    assert times[programs[0].name] == pytest.approx([1e-6] * 3) and times[programs[1].name] == pytest.approx([2e-6] * 3)
    assert profiler.device_times(programs, 3)[programs[1].name] == pytest.approx([2e-6] * 3)
    assert [o is None for o in seen] == [False, True, True]  # the lean trace tried once, then the defaults

    def broken(run, names, opts):
        raise RuntimeError("the trace holds 0 executions")

    monkeypatch.setattr(profiler, "_trace", broken)
    monkeypatch.setattr(profiler, "_LEAN", {"works": True})
    with pytest.raises(RuntimeError, match="0 executions"):  # any other failure is not taken for a missing plane
        profiler.device_times(programs, 3)


# A tiny suite of plain-XLA implementations (this machine compiles no Mosaic kernel to run): the kernel, the default,
# a baseline that fails to trace and one that does not apply.
def _kernel(x):
    return x * 2


def _default(x):
    return x + x


def _broken(x):
    raise ValueError("no kernel for this shape")


SHAPE = shapes.Shape("tokens", 64, (("hidden", 256),), "bfloat16")
OP = suite.Op(
    name="double",
    kernel=_kernel,
    default=_default,
    specs=lambda s: (jax.ShapeDtypeStruct((s["tokens"], s["hidden"]), jnp.bfloat16),),
    hbm_bytes=lambda s: 2 * s["tokens"] * s["hidden"] * 2,
    baselines=(
        suite.Baseline("broken", _broken),
        suite.Baseline("absent", _kernel, lambda s: "not installed: somepackage"),
    ),
)
SUITE = suite.Suite(kernel="double", ops=(OP,), shapes=(SHAPE,), targets=suite.Targets(beats_default=True))
TPU = device.Device("tpu", "TPU v5 lite", "measured TPU v5 lite", "measured TPU v5 lite", "v5e")


@pytest.fixture
def fake_chip(monkeypatch):
    """device_times stood in for: every program runs `calls` times for real, then reads a known device time (the
    i-th program of a trace i+1 µs, so the kernel is 1 µs and the default 2 µs: a trace per case, as
    test_small_cases_share_a_trace_within_their_bounds lifts)."""
    traced = []
    monkeypatch.setattr(device_timing, "TRACE_GROUP_CASES", 1)

    def device_times(programs, calls):
        for p in programs:
            jax.block_until_ready(profiler.run_calls(p, calls))
        traced.append([p.name for p in programs])
        return {p.name: [(i + 1) * 1e-6] * calls for i, p in enumerate(programs)}

    monkeypatch.setattr(profiler, "device_times", device_times)
    monkeypatch.setattr(suite, "get", lambda kernel: SUITE)
    return traced


def test_every_implementation_is_timed_or_says_why(fake_chip, tmp_path):
    config = harness.Config(gen="v6e", out=tmp_path, model=False, calls=3, compile_workers=2)
    result = harness.run_kernel("double", config, dev=TPU)
    assert len(fake_chip) == 1 and len(fake_chip[0]) == 2  # kernel and default in one trace
    (row,) = result["rows"]
    m = row["measured"]
    assert m["kernel"]["us"] == pytest.approx(1.0) and m["default"]["us"] == pytest.approx(2.0)
    assert m["kernel"]["rounds"] == 3 and m["kernel"]["compile_s"] > 0
    assert m["kernel"]["label"] == "measured TPU v5 lite" and m["kernel"]["timing"] == "device time (profiler)"
    assert m["baseline:absent"] == {"na": "not installed: somepackage"}
    assert m["baseline:broken"] == {"error": "ValueError: no kernel for this shape"}
    assert row["measured_speedups"] == {"default": pytest.approx(2.0)}
    # the roofline of the measured chip (v5e), not of the modeled generation (v6e)
    v5e_us = row["hbm_bytes"] / result["measured_chip"]["hbm_bytes_per_s"] * 1e6
    assert (
        row["measured_roofline"]["us"] == pytest.approx(v5e_us) and row["measured_roofline"]["label"] == "roofline v5e"
    )
    assert row["measured_efficiency"] == pytest.approx(v5e_us / 1.0)
    assert row["modeled_kernel"] == {"skipped": "not modeled (--no-model)"} and result["targets"] == []
    assert result["measured_targets"][0]["met"] and result["measured_targets"][0]["worst"]["speedup"] == 2.0
    table = report.format_table(result)
    assert "measured TPU v5 lite µs kernel" in table and "| vs XLA default |" in table.replace("  ", " ")
    assert "n/a: absent at tokens=64 hidden=256 bfloat16: not installed: somepackage" in table
    assert "error: broken at tokens=64 hidden=256 bfloat16: ValueError: no kernel for this shape" in table
    assert "modeled" not in table and "2.00x" in table
    assert "target (measured TPU v5 lite): faster than the default implementation at every shape: MET" in table
    assert report.write_chart(result, tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_a_run_stopped_midway_keeps_each_timed_case_in_the_json(fake_chip, monkeypatch, tmp_path):
    import json

    two = suite.Suite(
        kernel="double",
        ops=(OP,),
        shapes=(SHAPE, dataclasses.replace(SHAPE, batch=128)),
        targets=suite.Targets(beats_default=True),
    )
    monkeypatch.setattr(suite, "get", lambda kernel: two)
    calls = {"n": 0}
    real_device_times = profiler.device_times

    def stop_at_the_second_case(programs, n):  # the run killed while it times the second case
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_device_times(programs, n)

    monkeypatch.setattr(profiler, "device_times", stop_at_the_second_case)
    config = harness.Config(gen="v6e", out=tmp_path, calls=3, compile_workers=1)
    with pytest.raises(KeyboardInterrupt):
        harness.run_kernel("double", config, dev=TPU)
    written = json.loads((tmp_path / "double.json").read_text())
    assert written["partial"] == "1 of 2 timed cases so far" and not written["modeled"]
    first, second = written["rows"]
    assert first["measured"]["kernel"]["us"] == pytest.approx(1.0) and second["measured"] is None


def test_a_default_that_fails_leaves_its_row_out_of_the_measured_target(fake_chip, monkeypatch, tmp_path):
    broken_default = dataclasses.replace(OP, name="double_nodefault", default=_broken)
    both = suite.Suite(kernel="double", ops=(OP, broken_default), shapes=(SHAPE,), targets=SUITE.targets)
    monkeypatch.setattr(suite, "get", lambda kernel: both)
    result = harness.run_kernel("double", harness.Config(out=tmp_path, model=False, calls=3), dev=TPU)
    (target,) = result["measured_targets"]
    assert target["met"] and target["worst"]["speedup"] == pytest.approx(2.0)
    assert target["not_compared"] == [f"double_nodefault {SHAPE.id}"]
    line = [x for x in report.format_table(result).splitlines() if x.startswith("target (")][0]
    assert line.endswith(f"not compared (the default did not run): double_nodefault {SHAPE.id})")


def test_small_cases_share_a_trace_within_their_bounds(fake_chip, monkeypatch):
    """Consecutive cases share one profiler trace (each costs the host ~0.7 s on the v5e's) up to TRACE_GROUP_CASES
    cases and TRACE_GROUP_BYTES of inputs held; a case whose inputs would pass the bytes' bound is traced after the
    group before it is built; a failing shared trace is taken again case by case, its failure kept to its case."""
    sizes = [64, 64, 64, 64, 2048, 64]  # tokens; hidden 256, bf16: 32 KiB a case, the fifth 1 MiB
    cases = [suite.Case(OP, dataclasses.replace(SHAPE, batch=n)) for n in sizes]
    monkeypatch.setattr(device_timing, "TRACE_GROUP_CASES", 3)
    monkeypatch.setattr(device_timing, "TRACE_GROUP_BYTES", 512 << 10)
    stats = device_timing.run(cases, measured.case_arrays, kernel_label="k", default_label="d", calls=2)
    assert [len(names) // 2 for names in fake_chip] == [3, 1, 1, 1]  # two programs a case; the fifth alone
    assert all("median_s" in stats[(c.id, impl)] for c in cases for impl in ("kernel", "default"))
    fake_chip.clear()

    real = profiler.device_times
    traces = []

    def fails_with_the_second_case(programs, calls):
        traces.append(len(programs))
        if any(p.args[0].shape[0] == 128 for p in programs):
            raise RuntimeError("the trace holds 19 executions")
        return real(programs, calls)

    monkeypatch.setattr(profiler, "device_times", fails_with_the_second_case)
    three = [suite.Case(OP, dataclasses.replace(SHAPE, batch=n)) for n in (64, 128, 192)]
    failing = device_timing.run(three, measured.case_arrays, kernel_label="k", default_label="d", calls=2)
    assert "median_s" in failing[(three[0].id, "kernel")] and "median_s" in failing[(three[2].id, "default")]
    assert failing[(three[1].id, "kernel")] == {"error": "trace: RuntimeError: the trace holds 19 executions"}
    assert traces == [6, 2, 2, 1, 1, 2]  # the three together, then each case alone (the failing one program by program)

    # one implementation's failure (XLA's program out of HBM) leaves the case's others timed
    together = []

    def fails_with_the_second_program(programs, calls):
        if len(programs) > 1:
            together.extend(p.name for p in programs)
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
        if programs[0].name == together[-1]:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
        return real(programs, calls)

    monkeypatch.setattr(profiler, "device_times", fails_with_the_second_program)
    one = [suite.Case(OP, dataclasses.replace(SHAPE, batch=64))]
    alone = device_timing.run(one, measured.case_arrays, kernel_label="k", default_label="d", calls=2)
    assert len(together) == 2
    assert alone[(one[0].id, "kernel")]["median_s"] > 0
    assert alone[(one[0].id, "default")] == {
        "error": "trace: RuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM"
    }


def test_inputs_come_from_a_builder_compiled_ahead(fake_chip):
    built = []

    def make_args(case):
        args = measured.case_arrays(case)
        built.append("traced" if isinstance(args[0], jax.core.Tracer) else "eager")
        return args

    stats = device_timing.run(SUITE.cases(), make_args, kernel_label="k", default_label="d", calls=2)
    assert stats[(SUITE.cases()[0].id, "kernel")]["median_s"] > 0
    assert built and set(built) == {"traced"}  # its shapes, then its builder's program: never built eagerly


def test_implementations_whose_inputs_fail_show_why_and_the_others_run(fake_chip, monkeypatch):
    """A builder that does not compile as one program (a baseline's forward that a backward's residuals come from
    runs out of VMEM) is built eagerly, where the op names the implementations whose inputs failed."""
    compile_one = device_timing._compile

    def builders_fail(lowered, name, lower_s, *log_args):
        if not jax.tree.leaves(lowered.args_info):  # the input builder: a program of no arguments
            raise RuntimeError("RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom")
        return compile_one(lowered, name, lower_s, *log_args)

    monkeypatch.setattr(device_timing, "_compile", builders_fail)

    def make_args(case):
        args = measured.case_arrays(case)
        return suite.PartialInputs(args, {"default": "its forward (for the residuals): VMEM"})

    stats = device_timing.run(SUITE.cases(), make_args, kernel_label="k", default_label="d", calls=2)
    case_id = SUITE.cases()[0].id
    assert stats[(case_id, "default")] == {"error": "inputs: its forward (for the residuals): VMEM"}
    assert stats[(case_id, "kernel")]["median_s"] > 0
    assert fake_chip == [[n for n in fake_chip[0]]] and len(fake_chip[0]) == 1  # the kernel alone was traced


def test_an_implementation_whose_compile_outlasts_the_timeout_says_so_and_the_others_run(fake_chip, monkeypatch):
    """A compile still running after COMPILE_TIMEOUT_S (a baseline taking minutes) leaves its implementation out with
    the reason, and the case's other implementations are timed: the run is not stalled."""
    import threading

    compile_one = device_timing._compile
    release = threading.Event()

    def default_hangs(lowered, name, lower_s, log=None, key=None, submitted=0.0):
        if key is not None and key[1] == "default":
            release.wait(30)  # held until the test ends (a compile thread cannot be stopped)
        return compile_one(lowered, name, lower_s, log, key, submitted)

    monkeypatch.setattr(device_timing, "_compile", default_hangs)
    monkeypatch.setattr(device_timing, "COMPILE_TIMEOUT_S", 0.5)
    try:
        stats = device_timing.run(SUITE.cases(), measured.case_arrays, kernel_label="k", default_label="d", calls=2)
    finally:
        release.set()
    case_id = SUITE.cases()[0].id
    assert stats[(case_id, "default")] == {"error": "TimeoutError: compile still running after 0 s: not timed"}
    assert stats[(case_id, "kernel")]["median_s"] > 0


def test_the_run_says_which_input_builders_fell_back_to_eager_building(fake_chip, monkeypatch):
    """A case's input builder that fails to compile as one program: its inputs are built eagerly (each op's small
    compile on the chip's thread), and the run says so, with why."""
    compile_one = device_timing._compile

    def builders_fail(lowered, name, lower_s, *log_args):
        if not jax.tree.leaves(lowered.args_info):
            raise RuntimeError("RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom")
        return compile_one(lowered, name, lower_s, *log_args)

    monkeypatch.setattr(device_timing, "_compile", builders_fail)
    lines = []
    bar = types.SimpleNamespace(write=lines.append, update=lambda n: None)
    stats = device_timing.run(
        SUITE.cases(), measured.case_arrays, kernel_label="k", default_label="d", calls=2, bar=bar
    )
    assert stats[(SUITE.cases()[0].id, "kernel")]["median_s"] > 0
    assert lines[-1].endswith("; inputs built eagerly: 1x RuntimeError: RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom")


def test_no_case_starts_past_the_deadline_and_the_rest_say_why(fake_chip, monkeypatch):
    import time

    cases = [suite.Case(OP, SHAPE), suite.Case(OP, dataclasses.replace(SHAPE, batch=128))]
    clock = iter([0.0, 10.0])  # the first case starts before the deadline (5), the second after it
    monkeypatch.setattr(
        device_timing, "time", types.SimpleNamespace(monotonic=lambda: next(clock), perf_counter=time.perf_counter)
    )
    stats = device_timing.run(cases, measured.case_arrays, kernel_label="k", default_label="d", calls=2, deadline=5.0)
    assert stats[(cases[0].id, "kernel")]["median_s"] > 0 and len(fake_chip) == 1
    why = "not timed: the run's time budget was spent (1 of 2 cases left)"
    assert stats[(cases[1].id, "kernel")] == stats[(cases[1].id, "default")] == {"na": why}
    assert stats[(cases[1].id, "baseline:absent")] == {"na": "not installed: somepackage"}  # its own reason kept


def test_a_run_ended_by_its_deadline_does_not_wait_for_a_later_cases_compile(fake_chip, monkeypatch):
    """When the budget ends a kernel's run, compiles of cases that will not run are left to finish on their own: the
    next kernel starts at once."""
    import time

    cases = [suite.Case(OP, SHAPE), suite.Case(OP, dataclasses.replace(SHAPE, batch=128))]
    clock = iter([0.0, 10.0])
    monkeypatch.setattr(
        device_timing, "time", types.SimpleNamespace(monotonic=lambda: next(clock), perf_counter=time.perf_counter)
    )
    compile_one, release, finished = device_timing._compile, threading.Event(), threading.Event()

    def later_case_compiles_slowly(lowered, name, lower_s, log=None, key=None, submitted=0.0):
        if key is not None and key[0] == cases[1].id:
            release.wait(60)
            finished.set()
        return compile_one(lowered, name, lower_s, log, key, submitted)

    monkeypatch.setattr(device_timing, "_compile", later_case_compiles_slowly)
    try:
        stats = device_timing.run(
            cases, measured.case_arrays, kernel_label="k", default_label="d", calls=2, deadline=5.0, compile_workers=4
        )
        assert not finished.is_set(), "the run waited for a compile of a case it did not time"
        assert stats[(cases[0].id, "kernel")]["median_s"] > 0 and "na" in stats[(cases[1].id, "kernel")]
    finally:
        release.set()


def test_the_measuring_budget_is_shared_out_by_expected_cost_cheapest_first(monkeypatch, tmp_path):
    """The kernels run cheapest cases first; each gets the share of what is left that its cases' expected host cost
    is of the kernels still to run, so what a kernel leaves passes to the rest."""
    import time

    from benchmarks import __main__ as cli

    started, deadlines, starts, following = [], [], [], []

    def run_kernel(kernel, config, *, dev, bar, then=None):
        started.append(kernel)
        following.append(then)
        starts.append(time.monotonic())
        deadlines.append(config.deadline)
        time.sleep(0.2)  # this kernel's measuring
        return {"kernel": kernel}

    monkeypatch.setattr(harness, "run_kernel", run_kernel)
    monkeypatch.setattr(cli.device, "detect", lambda: TPU)
    monkeypatch.setattr(report, "write_json", lambda result, out: None)
    monkeypatch.setattr(report, "write_chart", lambda result, out: None)
    monkeypatch.setattr(report, "format_table", lambda result: "")
    kernels = ["flash_attention", "rms_norm", "kv_cache"]
    args = [a for k in kernels for a in ("--kernel", k)] + ["--no-model", "--budget-s", "30"]
    before = time.monotonic()
    assert cli.main([*args, "--out", str(tmp_path)]) == 0
    assert started == ["rms_norm", "kv_cache", "flash_attention"]
    assert following == ["kv_cache", "flash_attention", None]  # each kernel's run prefetches the next one's
    costs = cli.expected_costs_s(started, [cli.case_count(k, False) for k in started])
    assert (
        all(c > 0 for c in costs)
        and costs[2] / cli.case_count("flash_attention", False) == cli.HOST_S_PER_CASE["flash_attention"]
    )
    # the run's start is charged to the first kernel's share
    assert costs[0] == cli.expected_cost_s("rms_norm", cli.case_count("rms_norm", False)) + cli.STARTUP_S > 0
    # shares of what is left when each kernel starts, the budget counted from the run's start (between `before` and
    # the first kernel's start: the run's own set-up, which a loaded machine stretches, is the tolerance)
    slack = starts[0] - before + 0.05
    left = [30 - (t - before) for t in starts]
    assert deadlines[0] - starts[0] == pytest.approx(left[0] * costs[0] / sum(costs), abs=slack)
    assert deadlines[1] - starts[1] == pytest.approx(left[1] * costs[1] / sum(costs[1:]), abs=slack)
    assert deadlines[2] - before == pytest.approx(30, abs=slack)  # the last kernel: everything left
    assert starts[2] - starts[0] >= 0.4


def test_each_suite_is_expected_within_its_budget():
    """By the chip's measured host seconds a case (HOST_S_PER_CASE), the quick suites of all kernels fit the quick
    budget and the full ones the full budget (--full: within 40 minutes)."""
    from benchmarks import __main__ as cli

    kernels = cli.measuring_order(suite.available())
    for full, budget in ((False, cli.BUDGET_S["quick"]), (True, cli.BUDGET_S["full"])):
        expected = sum(cli.expected_costs_s(kernels, [cli.case_count(k, full) for k in kernels]))
        assert 0 < expected <= budget, (full, expected, budget)


def test_budget_shares():
    from benchmarks import __main__ as cli

    assert cli.share_s(100.0, [1.0, 3.0]) == 25.0
    assert cli.share_s(-5.0, [1.0, 3.0]) == 0.0  # the budget already spent: no time at all
    assert cli.share_s(90.0, [0.0, 0.0, 0.0]) == 30.0  # no costs known: equal shares
    assert cli.HOST_S_PER_CASE["rms_norm"] < cli.HOST_S_PER_CASE["moe"] < cli.DEFAULT_HOST_S_PER_CASE
    assert cli.measuring_order(["unknown", "moe", "rms_norm"]) == ["rms_norm", "moe", "unknown"]
    assert cli.measuring_order(["paged_attention", "flash_attention"]) == ["paged_attention", "flash_attention"]


def test_cases_are_measured_shape_by_shape_every_op_in_turn(fake_chip, monkeypatch, tmp_path):
    other, wide = dataclasses.replace(OP, name="other"), dataclasses.replace(SHAPE, batch=128)
    two = suite.Suite(kernel="double", ops=(OP, other), shapes=(SHAPE, wide), targets=SUITE.targets)
    monkeypatch.setattr(suite, "get", lambda kernel: two)
    result = harness.run_kernel("double", harness.Config(out=tmp_path, model=False, calls=2), dev=TPU)
    order = [f"{op.name} {shape.id}" for shape in (SHAPE, wide) for op in (OP, other)]
    assert list(result["host_phases"]) == order  # a budget-stopped run has both ops at the first shape
    assert [r["case"] for r in result["rows"]] == [f"{op.name} {sh.id}" for op in (OP, other) for sh in (SHAPE, wide)]


def _filled(x, *, blocks):
    if blocks == 3:
        raise ValueError("blocks=3 does not tile 256 columns")
    return jnp.full_like(x, blocks)


# An op with four candidate tilings whose program's output is its tiling (read as its device µs by
# _tiling_as_device_time); the third does not tile.
TILED = dataclasses.replace(OP, kernel=_filled, candidates=lambda shape, gen: [4, 2, 3, 8])


def _tiled_suite(kernel):
    """The test suite of the tiled op, as a worker process resolves it (picklable by reference)."""
    return dataclasses.replace(SUITE, ops=(TILED,))


def _tiling_as_device_time(programs, calls):
    return {p.name: [float(np.asarray(profiler.run_calls(p, calls)).ravel()[0]) * 1e-6] * calls for p in programs}


def _assert_sweep_row(result):
    (row,) = result["rows"]
    assert row["label"] == "measured TPU v5 lite" and row["generation"] == "v5e"
    assert [c.get("us") for c in row["candidates"]] == [pytest.approx(4), pytest.approx(2), None, pytest.approx(8)]
    assert row["candidates"][2]["error"] == "ValueError: blocks=3 does not tile 256 columns"
    assert row["choice"]["us"] == pytest.approx(4) and row["best"]["label"] == "blocks=2"
    assert row["gain"] == pytest.approx(2.0) and not row["table_is_best"]


def test_a_sweep_on_the_chip_times_each_tiling_and_names_the_fastest(monkeypatch, tmp_path):
    """On a TPU --sweep compiles and times the kernel alone at each candidate tiling (stand-in here: a program whose
    output is its tiling, read as its device µs), the table's choice first."""
    from benchmarks import sweep

    monkeypatch.setattr(profiler, "device_times", _tiling_as_device_time)
    monkeypatch.setattr(suite, "get", _tiled_suite)
    result = sweep.run_measured_sweep("double", TPU, shapes=[SHAPE], calls=2, lower_workers=0)
    _assert_sweep_row(result)
    table = sweep.format_sweep(result)
    assert "sweep double / double — measured TPU v5 lite (every candidate tiling timed on the chip)" in table
    assert "gain = the table's measured device time / the best candidate's" in table


def test_a_sweeps_tilings_are_traced_in_worker_processes(monkeypatch):
    """A measured sweep's programs are traced in the workers too: each rebuilds a tiling's case from its id
    (sweep.variant_case: the op's candidates at the shape for the chip's generation) and exports it (for the CPU
    here), with the figures of a sweep lowered in the chip's process; the tiling that does not trace fails there and
    again here, where its error is reported."""
    from benchmarks import lowering, sweep

    ids = [f"double #{i} [blocks={b}] {SHAPE.id}" for i, b in enumerate([4, 2, 3, 8])]
    assert [sweep.variant_case(_tiled_suite("double"), i, "v5e").id for i in ids] == ids
    assert sweep.variant_case(_tiled_suite("double"), f"double #4 [blocks=4] {SHAPE.id}", "v5e") is None  # no fifth
    assert sweep.variant_case(_tiled_suite("double"), f"other #0 [blocks=4] {SHAPE.id}", "v5e") is None
    # another tiling at that index (candidates asked of another chip) is not this case
    assert sweep.variant_case(_tiled_suite("double"), f"double #1 [blocks=4] {SHAPE.id}", "v5e") is None
    monkeypatch.setattr(profiler, "device_times", _tiling_as_device_time)
    monkeypatch.setattr(suite, "get", _tiled_suite)
    lines = []
    bar = types.SimpleNamespace(
        write=lines.append, update=lambda n: None, total=0, set_description=lambda d: None, refresh=lambda: None
    )
    pool = lowering.Pool("v5e", 1, platform="cpu", resolve=_tiled_suite)
    try:
        result = sweep.run_measured_sweep("double", TPU, shapes=[SHAPE], calls=2, exporter=pool, bar=bar)
    finally:
        pool.close()
    _assert_sweep_row(result)
    # one input builder (the four tilings share it: same op, same shape) and three tilings from the workers; the
    # fourth tiling's trace fails there and here
    assert any(line.startswith("  programs lowered from the workers' exports: 4, here: 1;") for line in lines), lines
    assert any("input builders 1," in line for line in lines), lines


def _chip_candidates(shape, gen):
    """Candidates as a tuning module lists them: read from the traced-for chip (a v5e lists other tilings)."""
    from tpu_kernels_jax.common import chip

    return [4, 2] if chip.current_tpu_info().chip_version.value == "v5e" else [8, 4]


def test_a_workers_program_keeps_only_the_arguments_it_uses_as_parameters():
    """An exported program called through deserialized_call, jitted as the chip's process runs it, has the parameters
    its module kept and no others (a flash attention backward's case passes every implementation's residuals, and
    the chip timed the fused backward 10 % slower with the unused ones as parameters), and computes the same."""
    from benchmarks import lowering

    def uses_one(x, residuals):
        return x * 2 + residuals["kernel"][0]

    key = iter(jax.random.split(jax.random.key(7), 4))
    x, mine = (jax.random.normal(next(key), (8, 128)) for _ in range(2))
    theirs = [jax.random.normal(next(key), (16, 256), jnp.bfloat16), jax.random.normal(next(key), (4,))]
    args = (x, {"kernel": [mine], "splash": theirs})
    blob = jax.export.export(jax.jit(uses_one), platforms=("cpu",))(*args).serialize()
    program = jax.jit(lowering.deserialized_call(blob))
    hlo = program.lower(*args).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :].split("\n}")[0]
    assert entry.count(" parameter(") == 2, entry  # x and the kernel's residual
    np.testing.assert_array_equal(np.asarray(program(*args)), np.asarray(x * 2 + mine))


def _chip_tiled_suite(kernel):
    return dataclasses.replace(SUITE, ops=(dataclasses.replace(TILED, candidates=_chip_candidates),))


def test_a_worker_rebuilds_a_sweeps_tiling_for_the_chip_it_traces_for():
    """A worker rebuilds a sweep's tiling from its id under the chip's device, where tuning modules read that chip
    (outside it, a worker's jax answers with the default generation's tables: the v5e's sweep then timed v6e tilings
    under the v5e's labels); the id names the tiling, so a rebuild that finds another one fails instead."""
    from benchmarks import lowering, sweep

    case_id = f"double #1 [blocks=2] {SHAPE.id}"
    pool = lowering.Pool("v5e", 1, platform="cpu", resolve=_chip_tiled_suite)
    try:
        blob, _ = pool.submit("double", case_id, "kernel", None, OP.specs(SHAPE)).result()
    finally:
        pool.close()
    x = jnp.ones((SHAPE["tokens"], SHAPE["hidden"]), jnp.bfloat16)
    assert float(np.asarray(lowering.deserialized_call(blob)(x)).ravel()[0]) == 2  # the v5e's second tiling
    assert sweep.variant_case(_chip_tiled_suite("double"), f"double #1 [blocks=8] {SHAPE.id}", "v5e") is None


def _tiling_inputs(s, seed=0, *, blocks=None, impls=None):
    """The inputs of an op whose inputs follow its tiling (a backward's residuals): x and the tiling it was made for
    (None: the table's), with the implementations asked for."""
    assert impls == ("kernel",), impls  # a sweep builds the kernel's inputs alone
    return jnp.ones((s["tokens"], s["hidden"]), jnp.bfloat16), jnp.full((), -1 if blocks is None else blocks)


def _tiling_input_specs(s, *, blocks=None, impls=None):
    return jax.eval_shape(lambda: _tiling_inputs(s, blocks=blocks, impls=impls))


def _made_for(x, made_for, *, blocks):
    """Its tiling where its inputs were made for it, else -1 (as a measured µs: 0 would not tell)."""
    return jnp.where(made_for == blocks, jnp.full_like(x, blocks), -jnp.ones_like(x))


# The tiled op whose inputs follow the tiling: each tiling's program reads as its tiling only on inputs made for it.
TILED_INPUTS = dataclasses.replace(
    OP,
    kernel=_made_for,
    specs=_tiling_input_specs,
    arrays=_tiling_inputs,
    candidates=lambda shape, gen: [4, 2, 8],
    tiling_inputs=True,
)


def test_a_sweeps_tilings_get_inputs_made_for_each_where_the_op_says_they_follow_it(monkeypatch):
    """Where an op's inputs follow the kernel's tiling (Op.tiling_inputs: a backward whose residuals come from the
    forward at that tiling) each tiling's inputs are built for it (one input builder each), the kernel's alone;
    elsewhere the tilings share one builder (the test above)."""
    from benchmarks import sweep

    monkeypatch.setattr(profiler, "device_times", _tiling_as_device_time)
    monkeypatch.setattr(suite, "get", lambda kernel: dataclasses.replace(SUITE, ops=(TILED_INPUTS,)))
    lines = []
    bar = types.SimpleNamespace(
        write=lines.append, update=lambda n: None, total=0, set_description=lambda d: None, refresh=lambda: None
    )
    result = sweep.run_measured_sweep("double", TPU, shapes=[SHAPE], calls=2, lower_workers=0, bar=bar)
    (row,) = result["rows"]
    assert [c.get("us") for c in row["candidates"]] == [pytest.approx(4), pytest.approx(2), pytest.approx(8)]
    assert any("input builders 3," in line for line in lines), lines
    # the modeled sweep's arguments: the same inputs, made for each tiling
    variant = sweep.variant(TILED_INPUTS, 2, 8)
    assert variant.specs(SHAPE)[1].shape == () and variant.arrays(SHAPE, 0)[1] == 8


def test_shape_filters_pick_the_shapes_whose_id_holds_each(fake_chip, monkeypatch, tmp_path):
    wide = dataclasses.replace(SHAPE, batch=128)
    assert suite.select_shapes((SHAPE, wide), ("tokens=128", "hidden=256")) == (wide,)
    assert suite.select_shapes((SHAPE, wide), ()) == (SHAPE, wide)
    monkeypatch.setattr(suite, "get", lambda kernel: dataclasses.replace(SUITE, shapes=(SHAPE, wide)))
    config = harness.Config(out=tmp_path, model=False, calls=2, shape_filters=("tokens=128",))
    result = harness.run_kernel("double", config, dev=TPU)
    assert [r["batch"] for r in result["rows"]] == [128]


def test_shape_filters_that_match_nothing_are_refused_before_anything_runs(capsys):
    """Repeated --shape filters must all hold: a named kernel with no such shape is an error naming the filters (an
    empty run would take the chip for an empty table), and of all the kernels only those with a match run."""
    from benchmarks import __main__ as cli

    argv = ["--kernel", "flash_attention", "--shape", "model=gemma4", "--shape", "model=gpt-oss-sliding"]
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    err = capsys.readouterr().err
    assert "--shape: no quick shape of flash_attention" in err and "'model=gpt-oss-sliding'" in err
    with pytest.raises(SystemExit):
        cli.parse_args(["--shape", "no-such-shape"])
    assert "no kernel has a shape holding every one of 'no-such-shape'" in capsys.readouterr().err
    picked = cli.parse_args(["--shape", "head_dim=512"]).kernel
    assert picked and set(picked) < set(suite.available())
    for kernel in picked:
        assert suite.select_shapes(suite.get(kernel).quick_shapes or suite.get(kernel).shapes, ("head_dim=512",))
    assert cli.parse_args(["--kernel", "flash_attention", "--shape", "model=gemma4"]).kernel == ["flash_attention"]


def test_inputs_that_fail_to_build_fail_every_implementation(fake_chip):
    def no_inputs(case):
        raise MemoryError("RESOURCE_EXHAUSTED: 20 GiB")

    stats = device_timing.run(SUITE.cases(), no_inputs, kernel_label="k", default_label="d")
    case_id = SUITE.cases()[0].id
    assert stats[(case_id, "kernel")] == {"error": "inputs: MemoryError: RESOURCE_EXHAUSTED: 20 GiB"}
    assert stats[(case_id, "baseline:absent")] == {"na": "not installed: somepackage"}
    assert not fake_chip  # nothing was traced


def test_chip_points_keep_device_times_with_their_provenance(fake_chip, tmp_path):
    import json

    from benchmarks.calibration import chip_points

    config = harness.Config(gen="v6e", out=tmp_path, model=False, calls=3, compile_workers=1)
    result = harness.run_kernel("double", config, dev=TPU)
    points = chip_points.points_of(result)
    assert sorted(p["impl"] for p in points) == ["default", "kernel"]  # n/a and failed implementations are no points
    kernel = next(p for p in points if p["impl"] == "kernel")
    assert kernel["device_us"] == pytest.approx(1.0) and kernel["calls"] == 3 and kernel["generation"] == "v5e"
    assert kernel["jax"] == jax.__version__ and kernel["date"] and kernel["shape"] == SHAPE.as_dict()
    newer = dict(kernel, device_us=0.5)
    merged = chip_points.merge(points, [newer])
    assert len(merged) == 2 and newer in merged and kernel not in merged
    (tmp_path / "double.json").write_text(json.dumps(result))
    out = tmp_path / "points.json"
    assert chip_points.main([str(tmp_path), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == sorted(points, key=lambda p: p["impl"])
    result["device"] = device.Device("cpu", "cpu", device.CPU_INTERPRET, device.CPU_XLA).as_dict()
    assert chip_points.points_of(result) == []  # a CPU timing is never a chip point


def test_docs_take_the_measured_tables_under_their_title(fake_chip, tmp_path):
    import json

    from benchmarks import docs_tables

    result = harness.run_kernel("double", harness.Config(out=tmp_path, model=False, calls=2), dev=TPU)
    (tmp_path / "double.json").write_text(json.dumps(result))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "double.md").write_text("# Double\n\nDesign text.\n")
    for _ in range(2):  # a second run replaces the block, never adds one
        assert docs_tables.main([str(tmp_path), "--docs", str(docs)]) == 0
    text = (docs / "double.md").read_text()
    assert text.startswith("# Double\n\n" + docs_tables.BEGIN) and text.count(docs_tables.BEGIN) == 1
    assert text.endswith(docs_tables.END + "\n\nDesign text.\n")
    assert "| measured TPU v5 lite µs kernel |" in text and "- n/a: absent at" in text
    assert max(len(line) for line in text.splitlines() if not line.startswith("|")) <= 120
    assert "partial" not in text
    # a run stopped midway (its JSON holds the cases timed so far) says so
    (tmp_path / "double.json").write_text(json.dumps(result | {"partial": "1 of 2 timed cases so far"}))
    assert docs_tables.main([str(tmp_path), "--docs", str(docs)]) == 0
    assert "**A partial run** (1 of 2 timed cases so far" in " ".join((docs / "double.md").read_text().split())


def test_docs_take_a_later_runs_rows_in_place_of_the_same_cases(fake_chip, tmp_path):
    """--rows-from: a later run's rows replace the same cases' (the targets recomputed over the rows, the provenance
    naming the rows it gave); a later case the run does not have is an error naming it."""
    import copy
    import json

    from benchmarks import docs_tables

    result = harness.run_kernel("double", harness.Config(out=tmp_path, model=False, calls=2), dev=TPU)
    assert result["measured_targets"][0]["met"]
    later = copy.deepcopy(result) | {"provenance": {**result["provenance"], "date": "2027-01-02"}}
    (row,) = later["rows"]
    row["measured"]["kernel"]["us"] = 4.0  # slower than the default's 2 µs now
    row["measured_speedups"]["default"] = 0.5
    runs = {name: tmp_path / name for name in ("base", "later")}
    for name, r in (("base", result), ("later", later)):
        runs[name].mkdir()
        (runs[name] / "double.json").write_text(json.dumps(r))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "double.md").write_text("# Double\n")
    assert docs_tables.main([str(runs["base"]), "--docs", str(docs), "--rows-from", str(runs["later"])]) == 0
    text = " ".join((docs / "double.md").read_text().split())
    assert "| 4.0 |" in text and "| 1.0 |" not in text
    assert f"The rows of {SHAPE.id} are from a later run (2027-01-02, with `--shape`)." in text
    assert "faster than the default implementation at every shape: NOT MET" in text
    row["case"] = "forward tokens=1"
    (runs["later"] / "double.json").write_text(json.dumps(later))
    with pytest.raises(SystemExit):
        docs_tables.main([str(runs["base"]), "--docs", str(docs), "--rows-from", str(runs["later"])])


def test_every_program_compiles_ahead_and_the_host_time_is_accounted(fake_chip, monkeypatch):
    """Programs are lowered on the calling thread (from the inputs' shapes), the run's first ones before the first
    case's inputs exist, and compiled on the pool, each case's input builder among them; the host's time is
    returned by phase."""
    from benchmarks import measured

    cases = [suite.Case(OP, SHAPE), suite.Case(OP, shapes.Shape("tokens", 128, (("hidden", 256),), "bfloat16"))]
    compiled, built = [], []
    lower = device_timing._lower
    caller = threading.get_ident()

    def counting_lower(fn, name, args, donate=0):
        assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(args)), "compiled from shapes"
        assert threading.get_ident() == caller, "lowered on the thread that runs the chip"
        compiled.append(name)
        return lower(fn, name, args, donate)

    def make_args(case):
        if not isinstance(jnp.zeros(()), jax.core.Tracer):  # a real build, not eval_shape's abstract one
            built.append((len(fake_chip), len(compiled)))
        return measured.case_arrays(case)

    monkeypatch.setattr(device_timing, "_lower", counting_lower)
    phases = {}
    stats = device_timing.run(cases, make_args, kernel_label="k", default_label="d", calls=2, phases=phases)
    # kernel, default, the broken baseline and the input builder of both cases
    assert len(compiled) == len(set(compiled)) == 8
    assert built == []  # each case's inputs from its builder's program, never built eagerly
    assert all(stats[(c.id, impl)]["median_s"] > 0 for c in cases for impl in ("kernel", "default"))
    assert set(phases) == {c.id for c in cases}
    assert all(set(p) == set(device_timing.PHASES) and p["trace_s"] >= 0 for p in phases.values())


def test_the_run_logs_its_compiles_queued_and_compiling_input_builders_apart(fake_chip):
    """Each kernel's run ends with its pool's compiles: how long they waited on the pool and compiled (median / max),
    the input builders apart, and which implementation compiled longest."""
    lines = []
    bar = types.SimpleNamespace(write=lines.append, update=lambda n: None)
    cases = [suite.Case(OP, SHAPE), suite.Case(OP, dataclasses.replace(SHAPE, batch=128))]
    device_timing.run(cases, measured.case_arrays, kernel_label="k", default_label="d", calls=2, bar=bar)
    (line,) = [ln for ln in lines if ln.startswith("  compiles (median / max): ")]
    assert "programs " in line and "; input builders 2, compiling " in line and "; longest: " in line
    log = {("c1", "kernel"): (0.5, 2.0), ("c1", "inputs"): (0.0, 0.25), ("c2", "kernel"): (1.5, 4.0)}
    assert device_timing.compile_line(log) == (
        "  compiles (median / max): programs 2, compiling 3.0 / 4.0 s, queued 1.0 / 1.5 s; "
        "input builders 1, compiling 0.2 / 0.2 s, queued 0.0 / 0.0 s; longest: kernel (4.0 s)"
    )
    assert device_timing.compile_line({}) == ""


def test_each_timed_case_logs_where_its_host_time_went():
    results = {"kernel": {"median_s": 1e-6}, "default": {"median_s": 2e-6}, "x": {"error": "oom"}, "y": {"na": "no"}}
    phases = {"inputs_s": 0.25, "compile_wait_s": 3.0, "first_run_s": 0.5, "trace_s": 1.25}
    line = device_timing.case_line("rms_norm tokens=8", phases, results)
    assert line == (
        "  rms_norm tokens=8: 2 timed, 1 failed, 1 n/a; host inputs 0.2 s, compile wait 3.0 s, first run 0.5 s, "
        "trace 1.2 s"
    )
    hbm = {"in_use_gib": 0.5, "peak_gib": 11.25, "limit_gib": 15.75}
    assert device_timing.case_line("rms_norm tokens=8", phases, results, hbm).endswith(
        "trace 1.2 s; HBM held after it 0.50 GiB (peak so far 11.25 of 15.75)"
    )
    assert device_timing.hbm_in_use() is None  # the CPU reports no memory stats: the line says nothing of HBM


def test_a_table_of_several_dtypes_names_each_rows_dtype(fake_chip, tmp_path):
    """Rows of one op in two dtypes would read as the same shape twice: then each shape cell names its dtype."""
    wide = shapes.Shape("tokens", 64, (("hidden", 256),), "float32")
    config = harness.Config(out=tmp_path, model=False, calls=2)
    mixed = harness.run_kernel("double", config, dev=TPU, shapes=[SHAPE, wide])
    ((_, _, cells),) = report.measured_table_rows(mixed)
    assert [row[0] for row in cells] == ["tokens=64 hidden=256 dtype=bfloat16", "tokens=64 hidden=256 dtype=float32"]
    single = harness.run_kernel("double", config, dev=TPU, shapes=[SHAPE])
    ((_, _, cells),) = report.measured_table_rows(single)
    assert [row[0] for row in cells] == ["tokens=64 hidden=256"]


def test_compile_threads_run_below_the_thread_that_runs_the_chip():
    """The pool's initializer raises its thread's niceness and leaves the calling thread's alone."""
    import os

    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with concurrent.futures.ThreadPoolExecutor(1, initializer=device_timing._lower_priority) as pool:
        theirs = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert theirs == min(me + device_timing.COMPILE_NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == me
    assert 1 <= device_timing.COMPILE_WORKERS <= 8


def test_donated_state_is_carried_from_call_to_call():
    """An in-place program's state is donated: each call's returned state is the next call's (the buffers it was
    given are gone), and the program keeps the last one."""
    step = jax.jit(lambda state, x: (state + x, jnp.sum(state)), donate_argnums=0)
    program = profiler.Program("p", step, (jnp.zeros(4), jnp.ones(4)), state=1)
    _, total = profiler.run_calls(program, 3)
    np.testing.assert_array_equal(np.asarray(program.args[0]), np.full(4, 3.0))
    assert float(total) == 8.0  # the third call saw the state the second one returned


def _write_into(state, x):
    return state.at[: x.shape[0]].set(x * 2), x


IN_PLACE_OP = dataclasses.replace(
    OP,
    name="double_in_place",
    baselines=(),
    in_place=suite.InPlace(
        {"kernel": _write_into, "default": _write_into}, lambda shape, seed: (jnp.ones((512, 256), jnp.bfloat16),), 1
    ),
)


def test_in_place_implementations_run_on_state_of_their_own(fake_chip, monkeypatch, tmp_path):
    """An op with in-place implementations is measured on donated state made for each implementation, its entry
    says so; the others run as they are. The state comes from a builder compiled on the pool (its function traced,
    never run op by op on the chip's thread), a fresh one for each implementation."""
    eager_builds = []

    def state(shape, seed):
        if not isinstance(jnp.zeros(()), jax.core.Tracer):  # a real build, not a trace of the builder
            eager_builds.append(shape)
        return (jnp.ones((512, 256), jnp.bfloat16),)

    op = dataclasses.replace(IN_PLACE_OP, in_place=dataclasses.replace(IN_PLACE_OP.in_place, state=state))
    monkeypatch.setattr(suite, "get", lambda kernel: dataclasses.replace(SUITE, ops=(op,)))
    result = harness.run_kernel("double", harness.Config(out=tmp_path, model=False, calls=3), dev=TPU)
    (row,) = result["rows"]
    for impl in ("kernel", "default"):
        assert row["measured"][impl]["in_place"] == "state donated, carried from call to call", impl
    assert any(line.startswith("in place: ") for line in report.format_measured(result))
    assert eager_builds == []


def test_each_in_place_implementation_gets_fresh_state_from_the_compiled_builder(fake_chip):
    """The compiled state builder makes new buffers at each call: donating one implementation's state leaves the
    next implementation's intact."""
    cases = [suite.Case(IN_PLACE_OP, SHAPE)]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        plan = device_timing._Plan(cases, measured.case_arrays, pool, ahead=4)
        plan.submit_through(0)
        first, second = device_timing._initial_state(plan, cases[0]), device_timing._initial_state(plan, cases[0])
    finally:
        pool.shutdown()
    assert (cases[0].id, device_timing.STATE) in plan.compile_log  # compiled on the pool, not built eagerly
    jax.jit(lambda s: s * 0, donate_argnums=0)(first[0])  # the first one donated
    np.testing.assert_array_equal(np.asarray(second[0], np.float32), 1.0)


def test_profile_host_writes_the_main_threads_profile(monkeypatch, tmp_path, capsys):
    """--profile-host FILE: the run's main thread profiled with cProfile into FILE, its costliest calls printed."""
    import pstats

    from benchmarks import __main__ as cli

    def run_kernel(kernel, config, *, dev, bar, then=None):
        sorted(range(100_000), key=lambda i: -i)  # this kernel's host work
        return {"kernel": kernel}

    monkeypatch.setattr(harness, "run_kernel", run_kernel)
    monkeypatch.setattr(report, "write_json", lambda result, out: None)
    monkeypatch.setattr(report, "write_chart", lambda result, out: None)
    monkeypatch.setattr(report, "format_table", lambda result: "")
    path = tmp_path / "host.prof"
    assert cli.main(["--kernel", "rms_norm", "--no-model", "--out", str(tmp_path), "--profile-host", str(path)]) == 0
    functions = {name for (_, _, name) in pstats.Stats(str(path)).stats}
    assert "run_kernel" in functions and "benchmark" in functions
    assert "costliest calls" in capsys.readouterr().err


def test_the_run_says_what_its_budget_will_time():
    from benchmarks import __main__ as cli

    assert cli.budget_line(540, 300) == "measuring budget 540 s; the cases are expected to take about 300 s"
    short = cli.budget_line(540, 1600)
    assert "about 1600 s of host time" in short and "about 34% of them will be timed" in short


SHAPE_128 = shapes.Shape("tokens", 128, (("hidden", 256),), "bfloat16")


def _double_suite(kernel):
    """The test suite, with both shapes, as a worker process resolves it (picklable by reference)."""
    return dataclasses.replace(SUITE, shapes=(SHAPE, SHAPE_128))


@pytest.fixture
def cpu_worker_pool():
    """One tracing worker exporting the test suite's programs for the CPU (this machine has no chip to run on)."""
    from benchmarks import lowering

    pool = lowering.Pool("v5e", 1, platform="cpu", resolve=_double_suite)
    yield pool
    pool.close()


def _run_through(pool, cases):
    """(stats, log lines) of a measuring run of `cases` whose programs come from `pool`'s exports."""
    lines = []
    bar = types.SimpleNamespace(write=lines.append, update=lambda n: None)
    stats = device_timing.run(
        cases,
        measured.case_arrays,
        kernel_label="k",
        default_label="d",
        calls=2,
        bar=bar,
        kernel="double",
        exporter=pool,
    )
    return stats, lines


def test_programs_traced_in_worker_processes_are_timed_as_those_lowered_here(fake_chip, cpu_worker_pool):
    """With workers, every program is traced and exported in another process and only compiled here (exported for
    the CPU here, which has no chip): the same figures as without, and the run says where each was lowered."""
    cases = [suite.Case(OP, SHAPE), suite.Case(OP, SHAPE_128)]
    stats, lines = _run_through(cpu_worker_pool, cases)
    for c in cases:
        assert stats[(c.id, "kernel")]["median_s"] == pytest.approx(1e-6)
        assert stats[(c.id, "default")]["median_s"] == pytest.approx(2e-6)
        assert "no kernel for this shape" in stats[(c.id, "baseline:broken")]["error"]
        assert stats[(c.id, "baseline:absent")] == {"na": "not installed: somepackage"}
    # kernel, default and the input builder of both cases from the workers; the broken baseline's trace fails there
    # and again here, where its error is reported
    assert lines[-1].startswith("  programs lowered from the workers' exports: 6, here: 2; exports failed: 2x ")


def test_every_quick_program_of_a_suite_exports_for_the_chip_from_a_worker():
    """The real suites trace in a worker for the chip's generation: every program of RMSNorm's quick cases exports
    for the TPU with its Pallas kernel lowered to Mosaic."""
    from benchmarks import lowering

    s = suite.get("rms_norm")
    cases = s.cases(s.quick_shapes)[:4]
    pool = lowering.Pool("v5e", 1)
    try:
        futures = {}
        for c in cases:
            specs = jax.eval_shape(lambda c=c: measured.case_arrays(c))
            futures[(c.id, None)] = pool.submit("rms_norm", c.id, None, measured.case_arrays, ())
            for impl in ("kernel", "default"):
                futures[(c.id, impl)] = pool.submit("rms_norm", c.id, impl, measured.case_arrays, specs)
        modules = {key: jax.export.deserialize(bytearray(f.result()[0])) for key, f in futures.items()}
    finally:
        pool.close()
    assert all(m.platforms == ("tpu",) for m in modules.values())
    for c in cases:
        assert "tpu_custom_call" in modules[(c.id, "kernel")].mlir_module()
        assert "tpu_custom_call" not in modules[(c.id, "default")].mlir_module()


def test_a_later_cases_program_still_being_traced_by_a_worker_is_not_waited_for():
    """The chip's thread takes in the current case's programs (here: exports that failed, lowered on the thread
    instead) and never blocks on a later case's export still running."""
    cases = [suite.Case(OP, SHAPE), suite.Case(OP, SHAPE_128)]
    pending = concurrent.futures.Future()  # a worker still tracing

    class Exporter:
        def submit(self, kernel, case_id, impl, make_args, specs):
            if case_id == cases[1].id:
                return pending
            failed = concurrent.futures.Future()
            failed.set_exception(RuntimeError("could not export"))
            return failed

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        plan = device_timing._Plan(cases, measured.case_arrays, pool, ahead=8, exporter=Exporter(), kernel="double")
        plan.submit_through(0)
        assert {key for key in plan.compiles} == {
            (cases[0].id, k) for k in ("inputs", "kernel", "default", "baseline:broken")
        }
        assert [key[0] for _, key, _ in plan.queue] == [cases[1].id] * 4
        assert plan.lowered_by == {"workers": 0, "here": 4}
        assert plan.worker_failures == {"RuntimeError: could not export": 4}
        plan.cancel()


def test_a_kernels_prefetched_exports_are_taken_over_by_its_run(fake_chip, cpu_worker_pool):
    """The next kernel's programs start on the workers while another is measured (prefetch); its run then takes
    each prefetched export over instead of tracing it again."""
    cases = [suite.Case(OP, SHAPE), suite.Case(OP, SHAPE_128)]
    device_timing.prefetch(cases, measured.case_arrays, "double", cpu_worker_pool)
    # per case its input builder, the kernel, the default and the broken baseline (the absent one is n/a)
    assert len(cpu_worker_pool.prefetched) == 8
    stats, lines = _run_through(cpu_worker_pool, cases)
    assert cpu_worker_pool.prefetched == {}
    assert all(stats[(c.id, "kernel")]["median_s"] == pytest.approx(1e-6) for c in cases)
    assert lines[-1].startswith("  programs lowered from the workers' exports: 6, here: 2")


def test_the_kernel_measured_next_is_prefetched_once_this_ones_exports_are_queued(
    fake_chip, cpu_worker_pool, monkeypatch, tmp_path
):
    from benchmarks import lowering

    pool = cpu_worker_pool
    monkeypatch.setattr(lowering, "shared", lambda generation, workers: pool)
    queued = []
    prefetch = pool.prefetch
    monkeypatch.setattr(pool, "prefetch", lambda *a: queued.append(a[:3]) or prefetch(*a))
    config = harness.Config(gen="v6e", out=tmp_path, model=False, calls=2, compile_workers=1)
    result = harness.run_kernel("double", config, dev=TPU, then="double")
    case_id = suite.Case(OP, SHAPE).id
    assert result["rows"][0]["measured"]["kernel"]["us"] > 0
    assert set(queued) == {("double", case_id, impl) for impl in (None, "kernel", "default", "baseline:broken")}


def test_a_footnote_says_every_shape_only_where_it_is_every_one():
    """An implementation failing at 4 of 6 shapes is footnoted with those 4, not as failing at every measured shape;
    one failing at all 6 is."""
    rows = []
    for i in range(6):
        measured = {"kernel": {"us": 1.0}, "baseline:peer": {"us": 2.0} if i < 2 else {"error": "no compile"}}
        measured["baseline:other"] = {"na": "decode only"}
        rows.append({"shape_id": f"batch={i}", "measured": measured})
    notes = report.why_not_timed({"rows": rows})
    assert notes == [
        "error: peer at 4 of the 6 shapes (batch=2; batch=3; batch=4; batch=5): no compile",
        "n/a: other at every measured shape: decode only",
    ]


def test_op_times_count_each_op_in_the_execution_that_holds_it():
    """XLA Ops events are summed per op over the executions of the named program only: ops of another program, or
    between executions, are left out."""
    a, other = profiler.program_name(3), profiler.program_name(4)
    modules = [_event(f"jit_{a}", 100, 50.0), _event(f"jit_{other}", 200, 50.0), _event(f"jit_{a}(2)", 300, 40.0)]
    ops = [
        _event("%fusion.1 = f32[8] fusion(...)", 100, 10.0),
        _event("%ragged_dot_fwd = custom-call(...)", 120, 30.0),
        _event("%fusion.1 = f32[8] fusion(...)", 210, 20.0),  # inside the other program
        _event("%copy = f32[8] copy(...)", 160, 1.0),  # between executions
        _event("%fusion.1 = f32[8] fusion(...)", 300, 12.0),
        _event("%ragged_dot_fwd = custom-call(...)", 315, 25.0),
    ]
    plane = types.SimpleNamespace(
        name=profiler.DEVICE_PLANE,
        lines=[
            types.SimpleNamespace(name=profiler.MODULES_LINE, events=modules),
            types.SimpleNamespace(name=profiler.OPS_LINE, events=ops),
        ],
    )
    runs, totals = profiler.op_times(types.SimpleNamespace(planes=[plane]), a)
    assert runs == [50.0, 40.0]
    assert totals == {"%fusion.1 = f32[8] fusion(...)": 22.0, "%ragged_dot_fwd = custom-call(...)": 55.0}


def test_op_breakdown_needs_a_tpu(capsys):
    from benchmarks import op_breakdown

    with pytest.raises(SystemExit):
        op_breakdown.main(["--kernel", "rms_norm"])
    assert "needs a TPU" in capsys.readouterr().err
