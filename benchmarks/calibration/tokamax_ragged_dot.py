"""tokamax 0.0.12's autotuning measurements on TPU v5e (v5 lite) and TPU7x (v7x), rebuilt as measured points.

tokamax ships the times its autotuner measured, per device kind, in `tokamax/data/autotuning/<device>/<op>.json`. Two
files of `tpu_v5_lite` (and the same two of `tpu7x`, see below) are ragged dots:

* `pallas_mosaic_tpu_ragged_dot.json`: `PallasMosaicTpuRaggedDot` (tokamax/_src/ops/ragged_dot/pallas_mosaic_tpu.py),
  the Megablox kernels `gmm` (forward, and with `transpose_rhs` the dlhs layout) and `tgmm` (drhs) of
  pallas_mosaic_tpu_kernel.py, one tuned `Config(tile_m, tile_k, tile_n, input_buffer_count, combine_scopes)` per
  problem (the fastest one; the file keeps only it);
* `ragged_dot.json`: the base op `RaggedDot` (ragged_dot/base.py) with its null config `{}`: its `_fwd` is
  `jax.lax.ragged_dot_general(..., preferred_element_type=float32).astype(bfloat16)`, i.e. XLA's ragged dot.

How tokamax timed them (tokamax/_src/autotuning/autotuner.py, tokamax/_src/benchmarking.py): the autotuner calls
`benchmarking.standardize_function(op.replace(config=c), *bound_args, mode="forward")`, jits it, and on TPU times it
with the `hermetic_xprof` timer: per evaluation one warm-up call, then one call inside a profiler session; the figure
is the span of the device's XLA op events (first start to last end). Device time only: no host dispatch, but every XLA
op of the program is in it (the kernel, XLA's small group-metadata ops if any are left, the output copy of
return_residuals=True). Five evaluations; tokamax takes their median, and so do we.

What the timed program is, exactly:
* lhs and rhs are random bf16 arrays (the key's ShapeDtypeStructs, initialised by tokamax); the group sizes are the
  key's representative values as a numpy array, which `standardize_function` does not count as an array argument:
  they are a compile-time constant of the timed program. `pallas_ragged_dot` / `xla_ragged_dot` do the same by
  default (`constant_group_sizes`): the group sizes passed as the third argument are then only checked against the
  constant (the model still gets them concretely, as `points()` passes them).
* `return_residuals=True`: the op returns `(out, residuals)` with residuals = out (no activation in these files), so
  the program has two outputs holding the same value; rebuilt the same way.
* precision `DEFAULT` (tokamax's canonical form of None), preferred_element_type None (bf16 out), activation None in
  every entry of both files.

Dimension numbers (lax.ragged_dot_general's, rhs dimensions counted with the group dimension):
* forward `(([1], [1]), ([], []))`, lhs_ragged [0], rhs_group [0]: lhs [M, K] x rhs [G, K, N] -> [M, N] (`gmm`);
* dlhs `(([1], [2]), ([], []))`, lhs_ragged [0], rhs_group [0]: lhs (dout) [M, N] x rhs [G, K, N] contracting N ->
  [M, K] (`gmm(transpose_rhs=True)`);
* drhs `(([0], [0]), ([], []))`, lhs_ragged [0], rhs_group []: lhs [M, K] x rhs (dout) [M, N] contracting the ragged
  M -> [G, K, N] (`tgmm`).

TPU7x (`tpu7x`, device kind "TPU7x"; points of gen "v7x", names prefixed "v7x ", data in tokamax_v7x.json): the same
two ops, the same key fields and the same five Config fields (no more), timed by the same autotuner. It differs in:
* the group sizes: every key holds `{"num_groups": G, "total_size": M}` instead of a list. tokamax commit c24a9b8
  ("Switch ragged dot arg specs to use default group sizes", 2026-03-18; github.com/openxla/tokamax, whose data files
  at that commit are byte for byte the ones in tokamax 0.0.12) rewrote the keys of the tpu7x files from lists to that
  form and left every measurement as it was: each entry (times, compile and lower times, peak memory) is identical to
  the entry of the parent commit whose key listed the group sizes. Those lists are the benchmark arg specs' of the
  time (`_arg_specs_group_sizes` reproduces all 190 of them, and every list of the v5e keys): the TPU7x times were
  measured with them, not with what tokamax 0.0.12 deserialises the new keys to (`generate_group_sizes(m, G)`, M rows
  drawn uniformly into G groups). That matters: with those, the 8-group problems would straddle a group boundary in
  almost every m tile, and the 4096^3 forward would need 1.33x its measured time at one TensorCore's peak. So the
  points are rebuilt with the lists (`group_sizes`; `group_sizes_key` keeps the key's form), passed as
  RaggedDotGroupSizes(list, M) so the rebuilt calls are keyed as tokamax 0.0.12's entries.
* `ragged_dot.json` is not valid JSON as shipped: the group_sizes objects inside its (JSON-string) keys are not
  escaped, and tokamax's own loader rejects the file ("Failed to parse autotuning cache file"), so tokamax 0.0.12 has
  no TPU7x entries for XLA's ragged dot. The keys are read here with those quotes escaped (`_read_autotuning_file`),
  and verified against the cache tokamax's own parser builds from the repaired text.
* the device: TPU7x has two TensorCores a chip and no Megacore; jax exposes each TensorCore as one device
  (`pltpu.get_tpu_info_for_chip(ChipVersion.TPU_7X, n)` accepts only n = 1), tokamax times on one device and its
  kernel (a grid-less pallas_call running emit_pipeline, no core_map) cannot spread over two. The data agree: XLA's
  memory-bound ragged dot (m = 8, 268 MB of rhs) streams at 2.8 TB/s, 0.76 of the 3.7 TB/s of one TensorCore (0.38
  of a chip's), and the 4096^3 forward runs at 0.82 PFLOP/s, 0.71 of one TensorCore's 1155 TFLOP/s. So the figures
  are one TensorCore's, as the model's v7x (one TensorCore of tpu7x:2x2x1) is.

Validation on TPU7x (`python -m benchmarks.calibration --gen v7x`, perf model at 9971c46, libtpu 0.0.50.1; nothing
fitted to it): over tokamax's 77 points the v5e-fitted model gives a median 0.851 of measured (0.615-1.530; 26
points outside 0.8-1.25), outside the tests' bounds, so they are out of the fit (`VALIDATION_ONLY`). By mechanism:
* compute-bound gmm (forward with 256-row tiles or more, dlhs; 35 points): 0.67-0.89. The kernel's schedule at the
  model's 2.203 GHz (jax's 1155 TFLOP/s a TensorCore) is 0.60-0.83 of the measured time (median 0.76); at the 1.900
  GHz XLA's own v7x cost model implies (996 TFLOP/s, see perf_model/chips.py) it would be 0.70-0.96 (median 0.88).
* drhs (tgmm) with input_buffer_count 3 or 4 (16 points): 0.95-1.09: the same shortfall (schedule 0.72-0.82 of
  measured) offset by the step cost, 0.14 us for each of their 358-26,815 pipeline steps (16-24 % of the figure).
* forward with 128-row tiles, and the points HBM-bound in the model (9 points): 0.66-0.84. Compute and DMA are near
  balance in the model (131072 x 7168 x 1024: 2,255 us of schedule, 1,822 us of DMA); measured is 0.71-0.93 of their
  sum, 1.39-1.67x their max: the rhs block loaded at each group change (14.7 MB with 7168 x 1024 tiles)
  overlaps the steps around it less than the per-step max assumes.
* return_residuals=True (15 points): 0.71-1.53. On v7x the duplicate output is an XLA copy in the program, costed by
  XLA's estimate: 2.1-2.3x the measured increment over the point without residuals (3.76 GB out: +5,385 us modeled,
  +2,394 us measured; its bytes read and written at the model's DMA rate would be +2,539 us).
* k = n = 2880 (dlhs, drhs): 0.618, 0.615. 2944-wide tiles past the 2880 edge (masked): measured at 0.36-0.39 of
  the peak, the schedule at 0.82-0.91, plus two relayout copies (2.6-2.7 ms modeled). Not explained by the notes.

`points()` gives one MeasuredPoint per measured entry of each generation (entries with an empty config dict were not
measured and are not in the JSON files). `QUICK` names, per generation, a subset that compiles fast enough for the test
suite (`QUICK_POINTS` is v5e's). `verify_against_tokamax(gen)` binds every point's arguments as the rebuilt calls pass
them and finds each in tokamax's own autotuning cache (same key, config and median): the rebuilt calls are keyed
exactly as the measurements. `python -m benchmarks.calibration.tokamax_ragged_dot --write-json` rebuilds
tokamax_v5e.json and tokamax_v7x.json from the installed tokamax files.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from .points import MeasuredPoint

GEN = "v5e"
DATA = pathlib.Path(__file__).with_name("tokamax_v5e.json")
TOKAMAX_VERSION = "0.0.12"
DEVICE_DIR = "tokamax/data/autotuning/tpu_v5_lite"
# Per generation measured: the JSON built from tokamax's files, tokamax's directory of them, the device kind its
# cache is keyed by, and a prefix keeping point names unique across generations.
GENERATIONS = {
    GEN: {"data": DATA, "device_dir": DEVICE_DIR, "device_kind": "TPU v5 lite", "prefix": ""},
    "v7x": {
        "data": pathlib.Path(__file__).with_name("tokamax_v7x.json"),
        "device_dir": "tokamax/data/autotuning/tpu7x",
        "device_kind": "TPU7x",
        "prefix": "v7x ",
    },
}
FILES = {"pallas": "pallas_mosaic_tpu_ragged_dot.json", "xla": "ragged_dot.json"}
FAMILIES = {"pallas": "tokamax_ragged_dot", "xla": "xla_ragged_dot"}
TIMING = (
    "tokamax autotuner: median of 5 hermetic_xprof device-time evaluations (span of the program's XLA op events, no "
    "host dispatch)"
)

# Why XLA's ragged dot stays out of the fit: the model cannot see its work.
XLA_RAGGED_DOT_INVISIBLE = (
    "XLA's ragged dot is a Mosaic kernel XLA emits itself, with a grid sized at run time from the group sizes and no "
    "pallas_call in the program to evaluate: the model counts one grid step (its time and bytes are lower bounds)"
)

# Generations whose tokamax points only validate the model (out of the fit, whatever their ratio): the constants are
# v5e's, and on TPU7x the family is outside the test bounds (the module docstring says why, by mechanism).
VALIDATION_ONLY = {
    "v7x": (
        "validation only: the v5e-fitted model gives 0.62-1.53 of measured here (median 0.85 over the 77 points; "
        "0.67-0.89 for the compute-bound ones, 0.95-1.09 for drhs with input_buffer_count > 2); not fitted"
    ),
}

# lax.ragged_dot_general dimension numbers by direction: (contracting lhs, rhs), lhs_ragged, rhs_group.
DIRECTIONS = {
    "fwd": ((([1], [1]), ([], [])), [0], [0]),
    "dlhs": ((([1], [2]), ([], [])), [0], [0]),
    "drhs": ((([0], [0]), ([], [])), [0], []),
}

# A subset for the test suite: tokamax's forward and dlhs kernels (the dlhs with input_buffer_count=4: emit_pipeline's
# lookahead loops) and the base op in the same two directions. Together, in one model_functions call, they model in
# about half a minute on the 2-core host (tokamax's points 15-25 s alone, the base op's 10-14 s, mostly the
# subprocess's start).
QUICK_POINTS = (
    "tokamax_fwd_m4096_k4096_n4096_g8",
    "tokamax_dlhs_m131072_k2048_n768_g128",
    "xla_fwd_m4096_k4096_n4096_g8",
    "xla_dlhs_m131072_k2048_n768_g128",
)
# v7x's points are validation, not fit: the test suite's subset has none (the full calibration run models them).
QUICK_POINTS_V7X = ()
QUICK = {GEN: QUICK_POINTS, "v7x": QUICK_POINTS_V7X}


# ------------------------------------------------------------------------------------------------- the programs


def _tokamax():
    """Import tokamax (a benchmarks-only dependency) lazily; it reads absl flags, which must never parse our argv."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    return tokamax


def _dimension_numbers(direction: str) -> jax.lax.RaggedDotDimensionNumbers:
    dot, lhs_ragged, rhs_group = DIRECTIONS[direction]
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=tuple(tuple(list(d) for d in pair) for pair in dot),
        lhs_ragged_dimensions=list(lhs_ragged),
        rhs_group_dimensions=list(rhs_group),
    )


def _group_sizes(group_sizes, constant_group_sizes, total_size=None):
    """tokamax's timed group sizes: a RaggedDotGroupSizes whose value is the constant (numpy) representative
    value, as tokamax deserialises it from the cache key; or, without a constant, the traced argument itself. With
    `total_size` (a key holding {"num_groups", "total_size"}, TPU7x's) the constant is the list that key held before
    (`_timed_group_sizes`) and the RaggedDotGroupSizes carries the total, so it is keyed as tokamax 0.0.12's key."""
    if constant_group_sizes is None:
        return group_sizes
    tokamax = _tokamax()
    value = np.asarray(constant_group_sizes, np.int32)
    if tuple(group_sizes.shape) != value.shape:
        raise ValueError(f"group sizes {group_sizes.shape} do not match the constant {value.shape}")
    if total_size is not None:
        if int(value.sum()) != total_size:
            raise ValueError(f"group sizes sum to {int(value.sum())}, not to the key's total {total_size}")
        return tokamax.RaggedDotGroupSizes(value, int(total_size))
    return tokamax.RaggedDotGroupSizes(value, tuple(int(g) for g in constant_group_sizes))


def pallas_ragged_dot(
    lhs,
    rhs,
    group_sizes,
    *,
    direction: str,
    tile_m: int,
    tile_k: int,
    tile_n: int,
    input_buffer_count: int,
    combine_scopes: bool,
    return_residuals: bool,
    constant_group_sizes: tuple | None = None,
    total_size: int | None = None,
):
    """tokamax's PallasMosaicTpuRaggedDot with the measured Config, called as tokamax's autotuner called it."""
    _tokamax()
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

    config = pallas_mosaic_tpu.Config(
        tile_m=tile_m,
        tile_k=tile_k,
        tile_n=tile_n,
        input_buffer_count=input_buffer_count,
        combine_scopes=combine_scopes,
    )
    op = pallas_mosaic_tpu.PallasMosaicTpuRaggedDot().replace(config=config)
    return op(
        lhs,
        rhs,
        group_sizes=_group_sizes(group_sizes, constant_group_sizes, total_size),
        ragged_dot_dimension_numbers=_dimension_numbers(direction),
        precision=None,
        preferred_element_type=None,
        return_residuals=return_residuals,
        activation=None,
    )


def xla_ragged_dot(
    lhs, rhs, group_sizes, *, direction: str, return_residuals: bool, constant_group_sizes=None, total_size=None
):
    """tokamax's base RaggedDot op (config {}): jax.lax.ragged_dot_general with f32 accumulation, cast to bf16."""
    _tokamax()
    from tokamax._src.ops.ragged_dot import base

    return base.RaggedDot()(
        lhs,
        rhs,
        group_sizes=_group_sizes(group_sizes, constant_group_sizes, total_size),
        ragged_dot_dimension_numbers=_dimension_numbers(direction),
        precision=None,
        preferred_element_type=None,
        return_residuals=return_residuals,
    )


# ---------------------------------------------------------------------------------------------------- the data


def _parse_shape(text: str) -> tuple[str, list[int]]:
    """'bf16[4096,4096]' -> ('bfloat16', [4096, 4096])."""
    dtype, dims = text.rstrip("]").split("[")
    return jnp.dtype({"bf16": "bfloat16", "f32": "float32"}.get(dtype, dtype)).name, [int(d) for d in dims.split(",")]


def _direction(dims: dict) -> str:
    for name, (dot, lhs_ragged, rhs_group) in DIRECTIONS.items():
        got = (
            [list(map(list, pair)) for pair in dims["dot_dimension_numbers"]],
            dims["lhs_ragged_dimensions"],
            dims["rhs_group_dimensions"],
        )
        if got == ([list(map(list, pair)) for pair in dot], lhs_ragged, rhs_group):
            return name
    raise ValueError(f"unknown ragged dot dimension numbers {dims}")


def _problem(direction: str, lhs: list[int], rhs: list[int], groups: int) -> dict:
    """The kernel's (m, k, n, g): m the ragged rows, k the contraction (for drhs: the output's k), n the output's."""
    if direction == "fwd":
        return dict(m=lhs[0], k=lhs[1], n=rhs[2], g=groups)
    if direction == "dlhs":
        return dict(m=lhs[0], k=rhs[1], n=lhs[1], g=groups)  # dout [m, n] x rhs [g, k, n] -> [m, k]
    return dict(m=lhs[0], k=lhs[1], n=rhs[1], g=groups)  # lhs [m, k], dout [m, n] -> [g, k, n]


def _point_name(kind: str, direction: str, problem: dict, residuals: bool, gen: str = GEN) -> str:
    p = problem
    prefix = "tokamax" if kind == "pallas" else "xla"
    name = f"{prefix}_{direction}_m{p['m']}_k{p['k']}_n{p['n']}_g{p['g']}" + ("_res" if residuals else "")
    return GENERATIONS[gen]["prefix"] + name


# TPU7x's ragged_dot.json: `\"group_sizes\":{"num_groups":256,"total_size":131072}` inside a key, quotes unescaped.
_UNESCAPED_GROUP_SIZES = re.compile(r'\\"group_sizes\\":\{"num_groups":(\d+),"total_size":(\d+)\}')
REPAIRED = (
    "not valid JSON as shipped: the group_sizes objects inside its keys are not escaped, and tokamax's own loader "
    "rejects the file (tokamax has none of its entries); read here with those quotes escaped"
)


def _read_autotuning_file(path: pathlib.Path) -> tuple[dict, bool]:
    """A tokamax autotuning file's JSON, and whether it had to be repaired to parse (see REPAIRED)."""
    text = path.read_text()
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        fixed = _UNESCAPED_GROUP_SIZES.sub(
            lambda m: f'\\"group_sizes\\":{{\\"num_groups\\":{m[1]},\\"total_size\\":{m[2]}}}', text
        )
        return json.loads(fixed), True


def _arg_specs_group_sizes(num_groups: int, total_size: int) -> list[int]:
    """The group sizes tokamax's benchmark arg specs (tokamax/_src/ops/ragged_dot/arg_specs.py) gave a problem of
    `num_groups` groups and `total_size` rows before tokamax commit c24a9b8 ("Switch ragged dot arg specs to use default
    group sizes", 2026-03-18), with which TPU7x's entries were timed: `compute_bound` (8 groups, m 4096) [4096, 0, ...,
    0]; `memory_bound` and `8x7b` (8 groups) none given, so [m // 8] * 8; the maxtext problems (128 or 256 groups) its
    `generate_group_sizes(target_m, g)`, reproduced here (seed 0: uniform weights, ~10 % of groups zeroed)."""
    if (num_groups, total_size) == (8, 4096):
        return [4096] + [0] * 7
    if num_groups == 8:
        return [total_size // num_groups] * num_groups
    np.random.seed(0)
    weights = np.random.uniform(size=(num_groups,))
    weights = np.random.binomial(1, 0.9, (num_groups,)) * weights
    sizes = np.int32((weights / np.sum(weights)) * total_size)
    sizes[0] += total_size - np.sum(sizes)
    return [int(g) for g in sizes]


def _timed_group_sizes(key_group_sizes) -> list[int]:
    """The group sizes a key's entry was timed with: the key's list, or for {"num_groups", "total_size"} (TPU7x's
    keys, rewritten from lists by tokamax commit c24a9b8, times unchanged) the list the key held before."""
    if isinstance(key_group_sizes, list):
        return key_group_sizes
    return _arg_specs_group_sizes(key_group_sizes["num_groups"], key_group_sizes["total_size"])


def build_data(site_packages: str | pathlib.Path | None = None, gen: str = GEN) -> dict:
    """tokamax_<gen>.json's content, read from the installed tokamax's autotuning files."""
    if site_packages is None:
        import importlib.util

        site_packages = pathlib.Path(importlib.util.find_spec("tokamax").origin).parents[1]
    site_packages = pathlib.Path(site_packages)
    device_dir = GENERATIONS[gen]["device_dir"]
    provenance = {
        kind: f"tokamax {TOKAMAX_VERSION} (PyPI package tokamax), file {device_dir}/{name}"
        for kind, name in FILES.items()
    }
    out_points = []
    for kind, name in FILES.items():
        data, repaired = _read_autotuning_file(site_packages / device_dir / name)
        if repaired:
            provenance[kind] += f" ({REPAIRED})"
        for key_text, configs in data.items():
            if not configs:
                continue  # not measured
            key = json.loads(key_text)
            if key["precision"] != ["DEFAULT", "DEFAULT"] or key["preferred_element_type"] is not None:
                raise ValueError(f"unexpected precision / preferred_element_type in {key_text}")
            if key["activation"] is not None:
                raise ValueError(f"unexpected activation in {key_text}")
            (config_text, result), *more = configs.items()
            if more:
                raise ValueError(f"more than one config in {key_text}")
            lhs_dtype, lhs = _parse_shape(key["lhs"])
            rhs_dtype, rhs = _parse_shape(key["rhs"])
            dims = key["ragged_dot_dimension_numbers"]
            direction = _direction(dims)
            group_sizes = _timed_group_sizes(key["group_sizes"])
            problem = _problem(direction, lhs, rhs, len(group_sizes))
            times = result["evaluation_times_ms"]
            out_points.append(
                {
                    "name": _point_name(kind, direction, problem, key["return_residuals"], gen),
                    "family": FAMILIES[kind],
                    "file": name,
                    "direction": direction,
                    "problem": problem,
                    "lhs": {"shape": lhs, "dtype": lhs_dtype},
                    "rhs": {"shape": rhs, "dtype": rhs_dtype},
                    "group_sizes": group_sizes,
                    **({"group_sizes_key": key["group_sizes"]} if isinstance(key["group_sizes"], dict) else {}),
                    "ragged_dot_dimension_numbers": dims,
                    "return_residuals": key["return_residuals"],
                    "config": json.loads(config_text),
                    "evaluation_times_ms": times,
                    "median_ms": float(np.median(times)),
                    "quick": False,
                }
            )
    names = [p["name"] for p in out_points]
    if len(set(names)) != len(names):
        raise ValueError("point names are not unique")
    for p in out_points:
        p["quick"] = p["name"] in QUICK[gen]
    return {
        "provenance": provenance,
        "timing": TIMING,
        "common": {
            "precision": ["DEFAULT", "DEFAULT"],
            "preferred_element_type": None,
            "activation": None,
            "device_kind": GENERATIONS[gen]["device_kind"],
        },
        "points": out_points,
    }


def dumps(data: dict) -> str:
    """JSON with one key per line, lists of numbers (and lists of them) on one line."""
    text = json.dumps(data, indent=1)
    number_list = re.compile(r"\[[\s\d.,\-\[\]]*\]")
    return number_list.sub(lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text) + "\n"


@functools.cache
def load(gen: str = GEN) -> dict:
    return json.loads(GENERATIONS[gen]["data"].read_text())


def _measured_point(entry: dict, provenance: dict, constant_group_sizes: bool = True, gen: str = GEN) -> MeasuredPoint:
    kind = "pallas" if entry["family"] == FAMILIES["pallas"] else "xla"
    lhs = jax.ShapeDtypeStruct(tuple(entry["lhs"]["shape"]), jnp.dtype(entry["lhs"]["dtype"]))
    rhs = jax.ShapeDtypeStruct(tuple(entry["rhs"]["shape"]), jnp.dtype(entry["rhs"]["dtype"]))
    group_sizes = np.asarray(entry["group_sizes"], np.int32)
    const = tuple(entry["group_sizes"]) if constant_group_sizes else None
    # TPU7x's keys give the group sizes as {"num_groups", "total_size"}: keyed by the total (only with the constant).
    keyed_by_total = "group_sizes_key" in entry and constant_group_sizes
    total = {"total_size": entry["group_sizes_key"]["total_size"]} if keyed_by_total else {}
    residuals = entry["return_residuals"]
    if kind == "pallas":
        fn = functools.partial(
            pallas_ragged_dot,
            direction=entry["direction"],
            return_residuals=residuals,
            constant_group_sizes=const,
            **total,
            **entry["config"],
        )
        config = " config " + json.dumps(entry["config"], separators=(",", ":"))
    else:
        fn = functools.partial(
            xla_ragged_dot,
            direction=entry["direction"],
            return_residuals=residuals,
            constant_group_sizes=const,
            **total,
        )
        config = " config {}"
    key = f"lhs {entry['lhs']['dtype']}{entry['lhs']['shape']}, rhs {entry['rhs']['dtype']}{entry['rhs']['shape']}"
    groups = f"{len(entry['group_sizes'])} groups"
    if "group_sizes_key" in entry:
        gk = entry["group_sizes_key"]
        groups = (
            f"group_sizes {json.dumps(gk, separators=(',', ':'))} (timed with the list the key held before tokamax "
            f"commit c24a9b8: {entry['group_sizes'][:3]}...)"
        )
    source = (
        f"{provenance[kind]}: key {entry['direction']} {key}, {groups}, return_residuals={residuals};{config}; {TIMING}"
    )
    if gen != GEN:
        source += f"; device kind {GENERATIONS[gen]['device_kind']}: one TensorCore a JAX device"
    note = ""
    if residuals:
        note = "return_residuals=True: the program returns the output twice (out, residuals = out)"
    in_fit = kind == "pallas" and gen not in VALIDATION_ONLY
    if kind == "pallas" and not in_fit:
        note = VALIDATION_ONLY[gen]
    if kind == "xla":
        note = XLA_RAGGED_DOT_INVISIBLE
    return MeasuredPoint(
        family=entry["family"],
        name=entry["name"],
        gen=gen,
        measured_s=entry["median_ms"] * 1e-3,
        source=source,
        fn=fn,
        args=(lhs, rhs, group_sizes),
        in_fit=in_fit,
        dispatch_included=False,
        timing=TIMING,
        note=note,
    )


def _tokamax_cache(op, gen: str, file: str) -> dict:
    """tokamax's own autotuning cache of `op` for `gen`'s device kind; for a file tokamax cannot parse (REPAIRED), the
    cache tokamax's own parser builds from the repaired text (as its cache loader would from a valid file)."""
    cache = op.get_autotuning_cache(GENERATIONS[gen]["device_kind"])
    if cache:
        return cache
    import importlib.util

    from tokamax._src.autotuning import cache as cache_lib

    path = pathlib.Path(importlib.util.find_spec("tokamax").origin).parents[1] / GENERATIONS[gen]["device_dir"] / file
    data, repaired = _read_autotuning_file(path)
    if not repaired:
        return cache
    parsed = cache_lib._get_cache_adapter(op).validate_json(json.dumps(data))
    return {op.bind(**k).autotuning_cache_key: v for k, v in parsed.items()}


def verify_against_tokamax(gen: str = GEN) -> list[str]:
    """Bind every point's arguments as `pallas_ragged_dot` / `xla_ragged_dot` pass them and look the bound arguments
    up in the installed tokamax's own autotuning cache: each must find its entry, with the same config and median.
    For keys holding {"num_groups", "total_size"} the JSON's group sizes must sum to the total and be the list the v5e
    keys hold for the same groups and total, where they have one (all but 256 groups of 524288 rows).
    Returns the mismatches (empty: every rebuilt call is keyed exactly as tokamax's measurement)."""
    _tokamax()
    from tokamax._src.ops.ragged_dot import base, pallas_mosaic_tpu

    problems = []
    caches = {}
    # The v5e keys list their group sizes: those of a TPU7x key with the same (groups, total) must be the same list.
    v5e_lists = {(len(e["group_sizes"]), sum(e["group_sizes"])): e["group_sizes"] for e in load(GEN)["points"]}
    for e in load(gen)["points"]:
        pallas = e["family"] == FAMILIES["pallas"]
        op = pallas_mosaic_tpu.PallasMosaicTpuRaggedDot() if pallas else base.RaggedDot()
        if e["file"] not in caches:
            caches[e["file"]] = _tokamax_cache(op, gen, e["file"])
        lhs = jax.ShapeDtypeStruct(tuple(e["lhs"]["shape"]), jnp.dtype(e["lhs"]["dtype"]))
        rhs = jax.ShapeDtypeStruct(tuple(e["rhs"]["shape"]), jnp.dtype(e["rhs"]["dtype"]))
        gs = np.asarray(e["group_sizes"], np.int32)
        total = None
        if "group_sizes_key" in e:
            total = e["group_sizes_key"]["total_size"]
            listed = v5e_lists.get((len(e["group_sizes"]), total))
            if sum(e["group_sizes"]) != total or listed not in (None, e["group_sizes"]):
                problems.append(f"{e['name']}: group sizes {e['group_sizes'][:4]}... are not the v5e keys' list")
        bound = op.bind(
            lhs,
            rhs,
            group_sizes=_group_sizes(gs, tuple(e["group_sizes"]), total),
            ragged_dot_dimension_numbers=_dimension_numbers(e["direction"]),
            precision=None,
            preferred_element_type=None,
            return_residuals=e["return_residuals"],
            activation=None,
        )
        data = caches[e["file"]].get(bound.autotuning_cache_key)
        if data is None:
            problems.append(f"{e['name']}: not in tokamax's cache")
            continue
        config = data.fastest_config
        got = {k: getattr(config, k) for k in e["config"]} if pallas else {}
        median = data[config].median_evaluation_time_ms
        if got != e["config"] or abs(median - e["median_ms"]) > 1e-9:
            problems.append(
                f"{e['name']}: tokamax has {got} at {median} ms, the JSON {e['config']} at {e['median_ms']}"
            )
    return problems


def points(names=None, *, quick: bool = False, constant_group_sizes: bool = True) -> list[MeasuredPoint]:
    """The measured points of every generation (those named in `names`, or each generation's QUICK subset with
    `quick`). With constant_group_sizes (default) the group sizes are a compile-time constant of the program, as
    tokamax timed it."""
    out = []
    for gen in GENERATIONS:
        data = load(gen)
        wanted = set(QUICK[gen]) if quick else (set(names) if names is not None else None)
        out += [
            _measured_point(e, data["provenance"], constant_group_sizes, gen)
            for e in data["points"]
            if wanted is None or e["name"] in wanted
        ]
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-json"]:
        for gen, spec in GENERATIONS.items():
            spec["data"].write_text(dumps(build_data(gen=gen)))
            print(f"wrote {spec['data']}")
    else:
        print(__doc__)
