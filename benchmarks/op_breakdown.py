"""Where one benchmark case spends its device time, XLA op by XLA op: `python -m benchmarks.op_breakdown --kernel moe
--shape rows=32768 --shape qwen3` (on a TPU host, as `make bench-tpu`).

The case's program (the kernel, the default or a baseline) runs `--calls` times inside one profiler trace; each `XLA
Ops` event on the chip is counted in the program execution that holds it, and the costliest ops are printed with
their share of the median execution: the routing glue around a grouped matmul, a layout copy before a kernel, the
kernels themselves (custom-calls). Device time only, as the benchmarks' tables.
"""

from benchmarks import device

device.prepare_environment()  # before jax is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

from benchmarks import measured, profiler, suite  # noqa: E402


def breakdown(case: suite.Case, impl: str, calls: int) -> tuple[float, list[tuple[str, float]]]:
    """(median device µs of an execution, [(XLA op, µs per execution)], costliest first) of `impl` at `case`."""
    import jax

    args = measured.case_arrays(case)
    if isinstance(args, suite.PartialInputs):
        if impl in args.failed:
            raise RuntimeError(f"{impl}'s inputs: {args.failed[impl]}")
        args = args.args
    name = profiler.program_name(0)
    compiled = jax.jit(profiler.named(case.op.function(impl, case.shape), name)).lower(*args).compile()
    jax.block_until_ready(compiled(*args))

    program = profiler.Program(name, compiled, args)
    runs, totals = profiler.traced(
        lambda: jax.block_until_ready(profiler.run_calls(program, calls)), lambda p: profiler.op_times(p, name)
    )
    if len(runs) != calls:
        raise RuntimeError(f"the trace holds {len(runs)} executions of jit_{name}, expected {calls}")
    ops = sorted(((op, ns / calls / 1e3) for op, ns in totals.items()), key=lambda item: -item[1])
    return statistics.median(runs) / 1e3, ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.op_breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", required=True, choices=suite.available())
    p.add_argument("--shape", action="append", help="only the shapes whose id holds TEXT (repeatable: all of them)")
    p.add_argument("--op", help="the op (default: every op of the suite)")
    p.add_argument("--impl", default="kernel", help="kernel (default), default, or baseline:<name>")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--top", type=int, default=15, help="ops printed per case")
    args = p.parse_args(argv)
    import jax

    if jax.default_backend() != "tpu":
        p.error("needs a TPU: the breakdown is the chip's own record of each op's device time")
    s = suite.get(args.kernel)
    shapes = suite.select_shapes(s.shapes, args.shape)
    cases = [c for c in s.cases(shapes) if args.op in (None, c.op.name)]
    if not cases:
        p.error(f"no case of {args.kernel} matches --shape {args.shape} --op {args.op}")
    for case in cases:
        why_not = case.op.impls(case.shape).get(args.impl, f"no implementation {args.impl!r}")
        if why_not is not None:
            print(f"## {case.id} ({args.impl}): {why_not}")
            continue
        total, ops = breakdown(case, args.impl, args.calls)
        print(f"## {case.id} ({args.impl}): median {total:,.1f} µs a call (measured, device time)")
        for op, us in ops[: args.top]:
            print(f"{us:10,.1f} µs {100 * us / total:5.1f} %  {op[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
