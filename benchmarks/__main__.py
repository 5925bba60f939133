"""python -m benchmarks [--gen v5e|v6e|v7x|all] [--full] [--kernel NAME ...] [--out DIR] [--no-measure] [--no-model]
[--sweep]

For each kernel: times it on the device that is present (on a TPU: the device time of the kernel, the default XLA path
and every baseline, from the profiler; on a CPU: the kernel in interpret mode, small shapes only), models it and its
default implementation for one TPU generation, prints a table and writes <out>/<kernel>.json and <out>/<kernel>.png.
`make bench` runs this (BENCH_ARGS=... passes options); on a TPU host with jax installed, `make bench-tpu` runs it with
that host's own Python and installs nothing.

With --sweep, instead: models every candidate tiling of each kernel's ops (its tuning module's candidate_blocks) at a
few shapes (--full: every shape), on each --gen given (all: v5e, v6e and v7x, the generations of the tuning tables),
prints the table's choice beside the best candidate and writes <out>/<kernel>.sweep.json. On a TPU each candidate is
compiled and timed on the chip instead (device time; --no-measure: modeled as elsewhere); pick shapes with --shape.
"""

from benchmarks import device

device.prepare_environment()  # before jax is imported

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def parse_args(argv=None):
    from benchmarks import suite

    p = argparse.ArgumentParser(prog="python -m benchmarks", description=" ".join(__doc__.split("\n\n")[1:3]))
    p.add_argument(
        "--gen",
        action="append",
        choices=[*GENERATIONS, "all"],
        help="TPU generation to model (default v6e); with --sweep repeatable, and all = every generation",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="every shape: model the suites' full shape lists (default: their quick subsets) "
        "and, on a CPU, also time mid-size shapes (slower)",
    )
    p.add_argument(
        "--kernel", action="append", choices=suite.available(), help="kernel to benchmark (repeatable; default: all)"
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="TEXT",
        help="only the shapes whose id holds TEXT (repeatable: all of them), e.g. --shape head_dim=512; from the "
        "quick shapes, or with --full from all",
    )
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"), help="output directory")
    p.add_argument("--no-measure", action="store_true", help="model only; time nothing")
    p.add_argument("--no-model", action="store_true", help="measure only; no performance model")
    p.add_argument("--calls", type=int, default=None, help="on a TPU: timed calls per program (default 20)")
    p.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="on a TPU: compile threads (default: half the cores, at most 8)",
    )
    p.add_argument(
        "--lower-workers",
        type=int,
        default=None,
        help="on a TPU: processes that trace and lower the programs beside the one running the chip (default: the "
        "cores less the compile threads and one; 0: lower everything in the chip's process)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="on a TPU: seconds of measuring for all the kernels together, shared out kernel by kernel by their "
        "cases' expected host cost, the cheapest first (time one leaves passes to the rest); cases left when a "
        f"kernel's share is spent say so in its table (default "
        f"{BUDGET_S['quick']:.0f}, --full {BUDGET_S['full']:.0f}; 0: none)",
    )
    p.add_argument("--workers", type=int, default=None, help="parallel model chunks (default 2)")
    p.add_argument(
        "--profile-host",
        type=pathlib.Path,
        default=None,
        metavar="FILE",
        help="profile the run's main thread (lowering, inputs, traces: where a slow run's host time goes) with "
        "cProfile into FILE and print its costliest calls",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="model the candidate tilings per shape and report the best beside the tuning table's choice",
    )
    args = p.parse_args(argv)
    gens = args.gen or ["v6e"]
    args.gens = list(GENERATIONS) if "all" in gens else list(dict.fromkeys(gens))
    if not args.sweep and len(args.gens) > 1:
        p.error("--gen: one generation per benchmark run (several only with --sweep)")
    if args.no_measure and args.no_model:
        p.error("--no-measure and --no-model together leave nothing to do")
    if args.budget_s is not None and args.budget_s < 0:
        p.error(f"--budget-s: expected seconds >= 0 (0: no budget), got {args.budget_s}")
    if args.calls is not None and args.calls < 1:
        p.error(f"--calls: expected a positive number of calls, got {args.calls}")
    if args.shape:
        # the filters combine (a shape must hold every one); a kernel without such a shape would take the chip for
        # an empty table: one named with --kernel is an error, one of all the kernels is left out
        matching = [k for k in args.kernel or suite.available() if _shapes_matching(suite.get(k), args)]
        for kernel in args.kernel or ():
            if kernel not in matching:
                of = suite.get(kernel)
                p.error(
                    f"--shape: no {'' if args.full else 'quick '}shape of {kernel} holds every one of "
                    f"{', '.join(map(repr, args.shape))} (repeated filters must all match; run one filter a command "
                    f"to take several); its shapes are like {shape_pool(of, args.full)[0].id!r}"
                )
        if not matching:
            p.error(f"--shape: no kernel has a shape holding every one of {', '.join(map(repr, args.shape))}")
        args.kernel = matching
    args.gen = args.gens[0]
    return args


GENERATIONS = ("v5e", "v6e", "v7x")
# Measuring time on a TPU by default: the quick suite of every kernel within a 10-minute command, --full within 40
# (the rest of each: starting, writing tables and charts).
BUDGET_S = {"quick": 540.0, "full": 2340.0}
# Host seconds one case of a kernel's suite took on the v5e test machine, 2026-12-07: the quick suite, all 158 cases
# timed in 431 s, each kernel's seconds over its cases. A flash attention backward's programs are compiled ahead like
# any other's since its inputs build as one program (before, 17 s a case, and its last cases went untimed). The budget
# is shared out by what each kernel's cases are expected to cost, the cheap kernels first, so that what one leaves
# passes to the dear ones; the first kernel's share also holds the run's start (STARTUP_S: worker processes, the first
# compiles).
HOST_S_PER_CASE = {
    "flash_attention": 8.4,
    "paged_attention": 5.5,
    "moe": 3.2,
    "ragged_dot": 1.9,
    "kv_cache": 1.3,
    "rms_norm": 0.8,
    "rotary": 0.8,
}
STARTUP_S = 8.0
DEFAULT_HOST_S_PER_CASE = 10.0


def measuring_order(kernels) -> list[str]:
    """The kernels, the cheapest cases first (ties in the order given)."""
    return sorted(kernels, key=lambda k: HOST_S_PER_CASE.get(k, DEFAULT_HOST_S_PER_CASE))


def expected_cost_s(kernel: str, cases: int) -> float:
    return cases * HOST_S_PER_CASE.get(kernel, DEFAULT_HOST_S_PER_CASE)


def expected_costs_s(kernels, cases) -> list[float]:
    """Each kernel's expected host seconds in measuring order, the run's start charged to the first."""
    costs = [expected_cost_s(k, n) for k, n in zip(kernels, cases)]
    if costs:
        costs[0] += STARTUP_S
    return costs


def share_s(left_s: float, costs: list[float]) -> float:
    """The seconds of `left_s` that the first of the kernels still to run gets: its share of their expected costs."""
    total = sum(costs)
    return max(0.0, left_s) * (costs[0] / total if total > 0 else 1.0 / len(costs))


def budget_line(budget_s: float, expected_s: float) -> str:
    """What the run can expect of its measuring budget, said before it starts."""
    if expected_s <= budget_s:
        return f"measuring budget {budget_s:.0f} s; the cases are expected to take about {expected_s:.0f} s"
    return (
        f"measuring budget {budget_s:.0f} s; the cases are expected to take about {expected_s:.0f} s of host time "
        f"(the v5e host's seconds a case, HOST_S_PER_CASE): about {budget_s / expected_s:.0%} of them will be timed, "
        f"the rest say so in their tables (--budget-s 0: no budget)"
    )


def shape_pool(of, full: bool):
    """The shapes a run of suite `of` picks from: its quick subset, or with --full every shape."""
    return of.shapes if full or of.quick_shapes is None else of.quick_shapes


def _shapes_matching(of, args):
    from benchmarks import suite

    return suite.select_shapes(shape_pool(of, args.full), args.shape)


def case_count(kernel: str, full: bool, filters=()) -> int:
    """The cases a run of `kernel` times (every op at every shape it takes)."""
    from benchmarks import suite

    of = suite.get(kernel)
    shapes = shape_pool(of, full)
    if filters:
        shapes = suite.select_shapes(shapes, filters)
    return len(of.cases(tuple(shapes)))


def sweep(args) -> int:
    from benchmarks import progress, suite
    from benchmarks import sweep as _sweep

    start = time.monotonic()
    kernels = measuring_order(args.kernel or suite.available())
    dev = device.detect()
    on_chip = dev.is_tpu and not args.no_measure  # each candidate timed on the chip, not modeled
    budget = args.budget_s if args.budget_s is not None else BUDGET_S["full" if args.full else "quick"]
    costs = expected_costs_s(kernels, [len(_sweep.sweep_shapes(suite.get(k), args.full)) for k in kernels])
    results = []
    with progress.bar(total=0, unit="model", dynamic_ncols=True, file=sys.stderr) as bar:
        for index, kernel in enumerate(kernels):
            shapes = _sweep.sweep_shapes(suite.get(kernel), args.full)
            if args.shape:
                of = suite.get(kernel)  # a filter picks among the quick shapes (--full: all), as the benchmarks do
                shapes = suite.select_shapes(shape_pool(of, args.full), args.shape)
            if on_chip:
                left = budget - (time.monotonic() - start)
                deadline = time.monotonic() + share_s(left, costs[index:]) if budget else None
                result = _sweep.run_measured_sweep(
                    kernel,
                    dev,
                    shapes=shapes,
                    calls=args.calls,
                    compile_workers=args.compile_workers,
                    bar=bar,
                    deadline=deadline,
                    lower_workers=args.lower_workers,
                )
            else:
                result = _sweep.run_sweep(kernel, args.gens, shapes=shapes, workers=args.workers, bar=bar)
            result["json"] = str(_sweep.write_sweep_json(result, args.out))
            results.append(result)
    for result in results:
        print(_sweep.format_sweep(result))
        print(f"wrote {result['json']}")
    how = f"measured on: {dev.kernel_label}" if on_chip else f"modeled: {', '.join(args.gens)}; nothing measured"
    print(f"\nsweep done in {time.monotonic() - start:.0f} s ({how})")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.profile_host is None:
        return sweep(args) if args.sweep else benchmark(args)
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        return sweep(args) if args.sweep else benchmark(args)
    finally:
        profile.disable()
        args.profile_host.parent.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(args.profile_host)
        print(f"host profile (main thread) written to {args.profile_host}; its costliest calls:", file=sys.stderr)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(30)


def benchmark(args) -> int:
    from benchmarks import harness, progress, report, suite

    start = time.monotonic()
    config = harness.Config(
        gen=args.gen,
        full=args.full,
        out=args.out,
        measure=not args.no_measure,
        workers=args.workers,
        model=not args.no_model,
        calls=args.calls,
        compile_workers=args.compile_workers,
        lower_workers=args.lower_workers,
        shape_filters=tuple(args.shape),
    )
    dev = device.detect()
    kernels = measuring_order(args.kernel or suite.available())
    results = []
    charts = importlib.util.find_spec("matplotlib") is not None
    budget = args.budget_s if args.budget_s is not None else BUDGET_S["full" if args.full else "quick"]
    costs = expected_costs_s(kernels, [case_count(k, args.full, tuple(args.shape)) for k in kernels])
    if budget and dev.is_tpu and config.measure:
        print(budget_line(budget, sum(costs)), file=sys.stderr, flush=True)
    with progress.bar(total=0, unit="step", dynamic_ncols=True, file=sys.stderr) as bar:
        for index, kernel in enumerate(kernels):
            if budget and dev.is_tpu and config.measure:  # this kernel's share of what is left
                left = budget - (time.monotonic() - start)
                config.deadline = time.monotonic() + share_s(left, costs[index:])
            following = kernels[index + 1] if index + 1 < len(kernels) else None
            result = harness.run_kernel(kernel, config, dev=dev, bar=bar, then=following)
            report.write_json(result, config.out)
            if charts:
                report.write_chart(result, config.out)
            results.append(result)
            print(report.format_table(result), flush=True)  # each kernel's table as soon as it is done
    for result in results:
        wrote = [config.out / (result["kernel"] + ".json")] + (
            [config.out / (result["kernel"] + ".png")] if charts else []
        )
        print(f"wrote {' and '.join(map(str, wrote))}")
    if not charts:
        print("no charts: matplotlib is not installed")
    measured = dev.kernel_label if config.measure else "nothing"
    modeled = args.gen if config.model else "nothing"
    print(f"\nbenchmarks done in {time.monotonic() - start:.0f} s (measured on: {measured}; modeled: {modeled})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
