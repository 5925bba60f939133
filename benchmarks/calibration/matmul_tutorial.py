"""The JAX Pallas TPU matmul tutorial's timings (TPU v5e), rebuilt as measured points.

The tutorial times bf16 m = k = n matmuls: a blocked Pallas kernel (f32 VMEM accumulator over the k axis of the grid)
with the right-hand side in its usual (k, n) layout, in the transposed physical layout (n, k), and with a relu fused
before the output cast; and XLA's `jnp.matmul`. Each figure is `timeit` over 100 calls of
`jax.block_until_ready(f(x, y))`, so host dispatch is in it: at 1024³ the kernel is a small part of the figure.
The kernels here are written for this module from the tutorial's description (grid, blocks, accumulator, `pl.when`
conditions), with the tile sizes it timed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .points import MeasuredPoint

URL = "https://docs.jax.dev/en/latest/pallas/tpu/matmul.html"
HOW = "executed on TPU v5e, timeit of 100 calls including dispatch"
GEN = "v5e"
SIZES = (1024, 4096, 8192)
SMALL_TILES = (128, 128, 128)  # (bm, bk, bn)
LARGE_TILES = (512, 1024, 1024)
DISPATCH_NOTE = "dispatch-dominated (the kernel is ~10 µs of ~120-300 µs measured)"


def _accumulate_kernel(x_ref, y_ref, o_ref, acc_ref, *, nsteps, rhs_transposed, relu):
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    # Contract x's dim 1 with y's k dim: dim 0 of a (bk, bn) block, dim 1 of a (bn, bk) block.
    contracting = ((1,), (1,)) if rhs_transposed else ((1,), (0,))
    acc_ref[...] += jax.lax.dot_general(
        x_ref[...], y_ref[...], (contracting, ((), ())), preferred_element_type=jnp.float32
    )

    @pl.when(k_step == nsteps - 1)
    def _():
        acc = acc_ref[...]
        if relu:
            acc = jax.nn.relu(acc)
        o_ref[...] = acc.astype(o_ref.dtype)


def pallas_matmul(x, y, *, bm, bk, bn, rhs_transposed=False, relu=False):
    """x (m, k) @ y (k, n); with `rhs_transposed`, y is given as logical (k, n) and handed to the kernel as (n, k)."""
    if rhs_transposed:
        y = jnp.swapaxes(y, 0, 1)
        y_spec = pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk))
        n = y.shape[0]
    else:
        y_spec = pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))
        n = y.shape[1]
    m, k = x.shape
    kernel = functools.partial(_accumulate_kernel, nsteps=k // bk, rhs_transposed=rhs_transposed, relu=relu)
    return pl.pallas_call(
        kernel,
        grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), y_spec],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, y)


def pallas_matmul_rhs_nk(x, y_nk, *, bm, bk, bn):
    """x @ y_nk.T with y_nk in the (n, k) layout, as the tutorial times it: the two swaps cancel under jit, so the
    kernel reads y_nk as it lies in HBM (no relayout is timed)."""
    return pallas_matmul(x, jnp.swapaxes(y_nk, 0, 1), bm=bm, bk=bk, bn=bn, rhs_transposed=True)


def pallas_matmul_relu(x, y, *, bm, bk, bn):
    return pallas_matmul(x, y, bm=bm, bk=bk, bn=bn, relu=True)


def xla_matmul(x, y):
    return jnp.matmul(x, y)


# Seconds per call as the tutorial prints them, by size. Keys: variant, (bm, bk, bn); None for XLA.
MEASURED_S = {
    ("pallas", SMALL_TILES): (0.00029766598949208854, 0.011771515250438824, 0.09183577066054567),
    ("pallas", LARGE_TILES): (0.00012708659982308746, 0.00088908776990138, 0.006099433819763363),
    ("pallas_rhs_nk", SMALL_TILES): (0.0003029372810851783, 0.012017967159627005, 0.09500920018996112),
    ("pallas_rhs_nk", LARGE_TILES): (0.00012131539988331496, 0.0008790623804088682, 0.006107717020204291),
    ("pallas_relu", SMALL_TILES): (0.00030103540048003196, 0.011807117109419778, 0.09181861146935262),
    ("pallas_relu", LARGE_TILES): (0.00012622540001757442, 0.000896632740041241, 0.006130605939542875),
    ("xla", None): (0.00011943008983507753, 0.0008272899803705514, 0.006047147869830951),
}

_FUNCTIONS = {"pallas": pallas_matmul, "pallas_rhs_nk": pallas_matmul_rhs_nk, "pallas_relu": pallas_matmul_relu}
# Where in the tutorial each variant's figures are printed.
_SECTIONS = {
    "pallas": "first timing cells (bm=%d, bk=%d, bn=%d)",
    "pallas_rhs_nk": "'Fused right-hand-side transpose' (bm=%d, bk=%d, bn=%d, transpose_rhs=True)",
    "pallas_relu": "'Fused activation function' (bm=%d, bk=%d, bn=%d, activation=jax.nn.relu)",
    "xla": "'XLA matmul' cell (jnp.matmul)",
}


def _point(variant: str, tiles, size: int, seconds: float) -> MeasuredPoint:
    x = jax.ShapeDtypeStruct((size, size), jnp.bfloat16)
    y = x  # square: (k, n) and (n, k) have the same shape
    if tiles is None:
        family, fn, config, section = "xla_matmul", xla_matmul, "", _SECTIONS[variant]
    else:
        bm, bk, bn = tiles
        family, config, section = "pallas_matmul", f" {bm}x{bk}x{bn}", _SECTIONS[variant] % tiles
        fn = functools.partial(_FUNCTIONS[variant], bm=bm, bk=bk, bn=bn)
    small = size == SIZES[0]
    return MeasuredPoint(
        family=family,
        name=f"{variant}{config} {size}^3",
        gen=GEN,
        measured_s=seconds,
        source=f"{URL}: {section}, {size}x{size}x{size} bf16; {HOW}",
        fn=fn,
        args=(x, y),
        in_fit=not small,
        dispatch_included=True,
        timing=HOW,
        note=DISPATCH_NOTE if small else "",
    )


# The test suite's subset: every variant at 4096^3 (in the fit) and one dispatch-dominated 1024^3 point; the 8192^3
# programs (up to 64^3 grid steps to evaluate) take most of the full set's modeling time.
QUICK = {(variant, 4096) for variant in MEASURED_S} | {(("pallas", SMALL_TILES), 1024)}


def points(*, quick: bool = False) -> list[MeasuredPoint]:
    return [
        _point(variant, tiles, size, seconds)
        for (variant, tiles), figures in MEASURED_S.items()
        for size, seconds in zip(SIZES, figures)
        if not quick or ((variant, tiles), size) in QUICK
    ]
