"""tokamax 0.0.12's autotuning measurements on TPU v5e (v5 lite), rebuilt as measured points.

tokamax ships the times its autotuner measured, per device kind, in `tokamax/data/autotuning/<device>/<op>.json`. Two
files of `tpu_v5_lite` are ragged dots:

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

`points()` gives one MeasuredPoint per measured entry (entries with an empty config dict were not measured and are
not in tokamax_v5e.json). `QUICK_POINTS` names a subset that compiles fast enough for the test suite.
`verify_against_tokamax()` binds every point's arguments as the rebuilt calls pass them and finds each in tokamax's own
autotuning cache (same key, config and median): the rebuilt calls are keyed exactly as the measurements.
`python -m benchmarks.calibration.tokamax_ragged_dot --write-json` rebuilds tokamax_v5e.json from the installed
tokamax files.
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

# lax.ragged_dot_general dimension numbers by direction: (contracting lhs, rhs), lhs_ragged, rhs_group.
DIRECTIONS = {
    "fwd": ((([1], [1]), ([], [])), [0], [0]),
    "dlhs": ((([1], [2]), ([], [])), [0], [0]),
    "drhs": ((([0], [0]), ([], [])), [0], []),
}

# A subset for the test suite: forward (with and without residuals), dlhs, drhs (input_buffer_count=4: emit_pipeline's
# lookahead loops) and the base op in each direction plus a decode-like memory-bound one. Every point here compiles
# deviceless in 3-13 s on the 2-core host (each measured alone, one model_function call apiece: tokamax's 7-21 s,
# the base op's 3-5 s); together, in one model_functions call, they take well under two minutes.
QUICK_POINTS = (
    "tokamax_fwd_m4096_k4096_n4096_g8",
    "tokamax_fwd_m4096_k4096_n4096_g8_res",
    "tokamax_dlhs_m131072_k2048_n768_g128",
    "tokamax_drhs_m131072_k2048_n768_g128",
    "xla_fwd_m4096_k4096_n4096_g8",
    "xla_fwd_m8_k4096_n4096_g8",
    "xla_dlhs_m131072_k2048_n768_g128",
    "xla_drhs_m131072_k2048_n768_g128",
)


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


def _group_sizes(group_sizes, constant_group_sizes):
    """tokamax's timed group sizes: a RaggedDotGroupSizes whose value is the constant (numpy) representative
    value, as tokamax deserialises it from the cache key; or, without a constant, the traced argument itself."""
    if constant_group_sizes is None:
        return group_sizes
    tokamax = _tokamax()
    value = np.asarray(constant_group_sizes, np.int32)
    if tuple(group_sizes.shape) != value.shape:
        raise ValueError(f"group sizes {group_sizes.shape} do not match the constant {value.shape}")
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
        group_sizes=_group_sizes(group_sizes, constant_group_sizes),
        ragged_dot_dimension_numbers=_dimension_numbers(direction),
        precision=None,
        preferred_element_type=None,
        return_residuals=return_residuals,
        activation=None,
    )


def xla_ragged_dot(lhs, rhs, group_sizes, *, direction: str, return_residuals: bool, constant_group_sizes=None):
    """tokamax's base RaggedDot op (config {}): jax.lax.ragged_dot_general with f32 accumulation, cast to bf16."""
    _tokamax()
    from tokamax._src.ops.ragged_dot import base

    return base.RaggedDot()(
        lhs,
        rhs,
        group_sizes=_group_sizes(group_sizes, constant_group_sizes),
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


def _point_name(kind: str, direction: str, problem: dict, residuals: bool) -> str:
    p = problem
    prefix = "tokamax" if kind == "pallas" else "xla"
    return f"{prefix}_{direction}_m{p['m']}_k{p['k']}_n{p['n']}_g{p['g']}" + ("_res" if residuals else "")


def build_data(site_packages: str | pathlib.Path | None = None) -> dict:
    """tokamax_v5e.json's content, read from the installed tokamax's autotuning files."""
    if site_packages is None:
        import importlib.util

        site_packages = pathlib.Path(importlib.util.find_spec("tokamax").origin).parents[1]
    site_packages = pathlib.Path(site_packages)
    provenance = {
        kind: f"tokamax {TOKAMAX_VERSION} (PyPI package tokamax), file {DEVICE_DIR}/{name}"
        for kind, name in FILES.items()
    }
    out_points = []
    for kind, name in FILES.items():
        data = json.loads((site_packages / DEVICE_DIR / name).read_text())
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
            group_sizes = key["group_sizes"]
            problem = _problem(direction, lhs, rhs, len(group_sizes))
            times = result["evaluation_times_ms"]
            out_points.append(
                {
                    "name": _point_name(kind, direction, problem, key["return_residuals"]),
                    "family": FAMILIES[kind],
                    "file": name,
                    "direction": direction,
                    "problem": problem,
                    "lhs": {"shape": lhs, "dtype": lhs_dtype},
                    "rhs": {"shape": rhs, "dtype": rhs_dtype},
                    "group_sizes": group_sizes,
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
        p["quick"] = p["name"] in QUICK_POINTS
    return {
        "provenance": provenance,
        "timing": TIMING,
        "common": {
            "precision": ["DEFAULT", "DEFAULT"],
            "preferred_element_type": None,
            "activation": None,
            "device_kind": "TPU v5 lite",
        },
        "points": out_points,
    }


def dumps(data: dict) -> str:
    """JSON with one key per line, lists of numbers (and lists of them) on one line."""
    text = json.dumps(data, indent=1)
    number_list = re.compile(r"\[[\s\d.,\-\[\]]*\]")
    return number_list.sub(lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text) + "\n"


@functools.cache
def load() -> dict:
    return json.loads(DATA.read_text())


def _measured_point(entry: dict, provenance: dict, constant_group_sizes: bool = True) -> MeasuredPoint:
    kind = "pallas" if entry["family"] == FAMILIES["pallas"] else "xla"
    lhs = jax.ShapeDtypeStruct(tuple(entry["lhs"]["shape"]), jnp.dtype(entry["lhs"]["dtype"]))
    rhs = jax.ShapeDtypeStruct(tuple(entry["rhs"]["shape"]), jnp.dtype(entry["rhs"]["dtype"]))
    group_sizes = np.asarray(entry["group_sizes"], np.int32)
    const = tuple(entry["group_sizes"]) if constant_group_sizes else None
    residuals = entry["return_residuals"]
    if kind == "pallas":
        fn = functools.partial(
            pallas_ragged_dot,
            direction=entry["direction"],
            return_residuals=residuals,
            constant_group_sizes=const,
            **entry["config"],
        )
        config = " config " + json.dumps(entry["config"], separators=(",", ":"))
    else:
        fn = functools.partial(
            xla_ragged_dot, direction=entry["direction"], return_residuals=residuals, constant_group_sizes=const
        )
        config = " config {}"
    key = f"lhs {entry['lhs']['dtype']}{entry['lhs']['shape']}, rhs {entry['rhs']['dtype']}{entry['rhs']['shape']}"
    source = (
        f"{provenance[kind]}: key {entry['direction']} {key}, {len(entry['group_sizes'])} groups, return_residuals="
        f"{residuals};{config}; {TIMING}"
    )
    note = ""
    if residuals:
        note = "return_residuals=True: the program returns the output twice (out, residuals = out)"
    in_fit = kind == "pallas"
    if not in_fit:
        note = XLA_RAGGED_DOT_INVISIBLE
    return MeasuredPoint(
        family=entry["family"],
        name=entry["name"],
        gen=GEN,
        measured_s=entry["median_ms"] * 1e-3,
        source=source,
        fn=fn,
        args=(lhs, rhs, group_sizes),
        in_fit=in_fit,
        dispatch_included=False,
        timing=TIMING,
        note=note,
    )


def verify_against_tokamax(device_kind: str = "TPU v5 lite") -> list[str]:
    """Bind every point's arguments as `pallas_ragged_dot` / `xla_ragged_dot` pass them and look the bound arguments
    up in the installed tokamax's own autotuning cache: each must find its entry, with the same config and median.
    Returns the mismatches (empty: every rebuilt call is keyed exactly as tokamax's measurement)."""
    _tokamax()
    from tokamax._src.ops.ragged_dot import base, pallas_mosaic_tpu

    problems = []
    for e in load()["points"]:
        pallas = e["family"] == FAMILIES["pallas"]
        op = pallas_mosaic_tpu.PallasMosaicTpuRaggedDot() if pallas else base.RaggedDot()
        lhs = jax.ShapeDtypeStruct(tuple(e["lhs"]["shape"]), jnp.dtype(e["lhs"]["dtype"]))
        rhs = jax.ShapeDtypeStruct(tuple(e["rhs"]["shape"]), jnp.dtype(e["rhs"]["dtype"]))
        gs = np.asarray(e["group_sizes"], np.int32)
        bound = op.bind(
            lhs,
            rhs,
            group_sizes=_group_sizes(gs, tuple(e["group_sizes"])),
            ragged_dot_dimension_numbers=_dimension_numbers(e["direction"]),
            precision=None,
            preferred_element_type=None,
            return_residuals=e["return_residuals"],
            activation=None,
        )
        data = op.get_autotuning_cache(device_kind).get(bound.autotuning_cache_key)
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
    """The measured points (those named in `names`, or the QUICK_POINTS with `quick`). With constant_group_sizes
    (default) the group sizes are a compile-time constant of the program, as tokamax timed it."""
    data = load()
    wanted = set(QUICK_POINTS) if quick else (set(names) if names is not None else None)
    return [
        _measured_point(e, data["provenance"], constant_group_sizes)
        for e in data["points"]
        if wanted is None or e["name"] in wanted
    ]


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-json"]:
        DATA.write_text(dumps(build_data()))
        print(f"wrote {DATA}")
    else:
        print(__doc__)
