"""The benchmark suites' programs timed on a TPU v5e chip (chip_v5e.json), rebuilt as measured points.

`chip_points.py` gathers every device-time figure of a `python -m benchmarks` run on a TPU into chip_<gen>.json: per
point the kernel, the op, the benchmark Shape (its dict), the implementation ("kernel": ours, "default": the XLA path,
"baseline:<name>": another library's) and the median of the profiler's per-call device times, with the run's
provenance (device kind, jax, libtpu build, date). Device time only: no host dispatch. Each point is rebuilt here from
the suite that timed it: the Case whose op and shape match, its function for that implementation and its model
arguments, exactly as `benchmarks.modeled` hands cases to the model.

Families group the programs whose modeled time comes from the same mechanisms: our Pallas kernels per kernel (their
schedule and DMAs), XLA's fused elementwise/reduction programs (norms, rotary: XLA's own cycle estimate), XLA's scatter
into a KV cache, XLA's ragged dot (a Mosaic kernel XLA emits itself, which the model cannot see into), and each
baseline library's kernels.
"""

from __future__ import annotations

import functools
import json
import pathlib

from .points import MeasuredPoint

GEN = "v5e"
DATA = pathlib.Path(__file__).with_name(f"chip_{GEN}.json")
TIMING = "python -m benchmarks on the chip: median of the profiler's per-call device times (no host dispatch)"

# Our Pallas kernels, one family per kernel; XLA's paths and the baselines by the mechanism their time rests on.
_KERNEL_FAMILIES = {
    "rms_norm": "chip_rms_norm_kernel",
    "rotary": "chip_rotary_kernel",
    "kv_cache": "chip_kv_cache_kernel",
    "ragged_dot": "chip_ragged_dot_kernel",
    "moe": "chip_moe_kernel",
}
_DEFAULT_FAMILIES = {
    "rms_norm": "chip_xla_fusion",
    "rotary": "chip_xla_fusion",
    "kv_cache": "chip_xla_scatter",
    "ragged_dot": "chip_xla_ragged_dot",
    "moe": "chip_xla_ragged_dot",
}
_BASELINE_FAMILIES = {
    "our rope + XLA scatter": "chip_xla_scatter",  # our rotary kernel, then XLA's scatter: the scatter dominates
    "megablox": "chip_megablox",
    "tokamax": "chip_tokamax_ragged_dot",
    "vllm": "chip_vllm_moe",
    "dense masked": "chip_xla_dense_moe",
}

# Families out of the fit, and why (measured ratio, the mechanism suspected).
OUT_OF_FIT: dict[str, str] = {}
# Single points out of the fit within an in-fit family: {name: why}.
OUT_OF_FIT_POINTS: dict[str, str] = {}

# The test suite's subset (names): a few points of every in-fit family, cheap to compile.
QUICK: tuple[str, ...] = ()


def family(kernel: str, impl: str) -> str:
    if impl == "kernel":
        return _KERNEL_FAMILIES[kernel]
    if impl == "default":
        return _DEFAULT_FAMILIES[kernel]
    return _BASELINE_FAMILIES[impl.removeprefix("baseline:")]


def key(entry: dict) -> str:
    """A point's key in the JSON file: kernel, op, implementation and shape."""
    shape = ", ".join(f"{k}={v}" for k, v in entry["shape"].items())
    return f"{entry['kernel']}/{entry['op']} {entry['impl']} ({shape})"


def name(entry: dict, shape_id: str) -> str:
    impl = entry["impl"].removeprefix("baseline:")
    return f"{entry['kernel']}/{entry['op']} {impl} {shape_id}"


@functools.cache
def load() -> tuple[dict, ...]:
    return tuple(json.loads(DATA.read_text()))


def _case(entry: dict):
    from benchmarks import suite

    for case in suite.get(entry["kernel"]).cases():
        if case.op.name == entry["op"] and case.shape.as_dict() == entry["shape"]:
            return case
    raise LookupError(f"no case of the {entry['kernel']} suite matches {key(entry)}")


def _point(entry: dict) -> MeasuredPoint:
    from benchmarks import modeled

    case = _case(entry)
    fn, args = modeled.case_item(case, entry["impl"])
    point_name = name(entry, case.shape.id)
    fam = family(entry["kernel"], entry["impl"])
    note = OUT_OF_FIT_POINTS.get(point_name) or OUT_OF_FIT.get(fam, "")
    return MeasuredPoint(
        family=fam,
        name=point_name,
        gen=GEN,
        measured_s=entry["device_us"] * 1e-6,
        source=(
            f"benchmarks/calibration/{DATA.name}: {key(entry)}; {entry['device_kind']}, jax {entry['jax']}, "
            f"{entry['platform_version']}, {entry['date']}"
        ),
        fn=fn,
        args=args,
        in_fit=not note,
        timing=TIMING,
        note=note,
    )


def _applies(entry: dict) -> bool:
    """Whether the entry's implementation can be built here: ours and XLA's always; a baseline only where its library
    is installed (tokamax, tpu-inference are benchmark extras)."""
    case = _case(entry)
    why_not = case.op.impls(case.shape).get(entry["impl"], "no such implementation")
    if why_not is not None and not entry["impl"].startswith("baseline:"):
        raise LookupError(f"{key(entry)}: {why_not}")
    return why_not is None


def points(*, quick: bool = False) -> list[MeasuredPoint]:
    """Every point of the file whose implementation can be built here, or with `quick` the test suite's subset."""
    wanted = set(QUICK) if quick else None
    return [_point(e) for e in load() if (wanted is None or name(e, _case(e).shape.id) in wanted) and _applies(e)]
