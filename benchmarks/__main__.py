"""python -m benchmarks [--gen v5e|v6e|v7x] [--full] [--kernel NAME ...] [--out DIR] [--no-measure]

For each kernel: times it on the device that is present (a TPU, or the CPU in interpret mode for small shapes), models
it and its default implementation for one TPU generation, prints a table and writes <out>/<kernel>.json and
<out>/<kernel>.png. `make bench` runs this (BENCH_ARGS=... passes options).
"""

from benchmarks import device

device.prepare_environment()  # before jax is imported

import argparse  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def parse_args(argv=None):
    from benchmarks import suite

    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    p.add_argument("--gen", default="v6e", choices=["v5e", "v6e", "v7x"], help="TPU generation to model (v6e)")
    p.add_argument(
        "--full",
        action="store_true",
        help="every shape: model the suites' full shape lists (default: their quick subsets) "
        "and, on a CPU, also time mid-size shapes (slower)",
    )
    p.add_argument(
        "--kernel", action="append", choices=suite.available(), help="kernel to benchmark (repeatable; default: all)"
    )
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"), help="output directory")
    p.add_argument("--no-measure", action="store_true", help="model only; time nothing")
    p.add_argument("--workers", type=int, default=None, help="parallel model chunks (default 2)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    from benchmarks import harness, report, suite

    start = time.monotonic()
    config = harness.Config(
        gen=args.gen, full=args.full, out=args.out, measure=not args.no_measure, workers=args.workers
    )
    dev = device.detect()
    kernels = args.kernel or suite.available()
    results = []
    with tqdm(total=0, unit="step", dynamic_ncols=True, file=sys.stderr) as bar:
        for kernel in kernels:
            result = harness.run_kernel(kernel, config, dev=dev, bar=bar)
            report.write_json(result, config.out)
            report.write_chart(result, config.out)
            results.append(result)
    for result in results:
        print(report.format_table(result))
        print(f"wrote {config.out / (result['kernel'] + '.json')} and {config.out / (result['kernel'] + '.png')}")
    print(
        f"\nbenchmarks done in {time.monotonic() - start:.0f} s (measured on: {dev.kernel_label}; modeled: {args.gen})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
