"""Ragged dot (grouped matmul), JAX side, up the ladder: kernel vs reference and vs `jax.lax.ragged_dot` in strict
interpret mode (random group sizes with zeros, M from 0 to 512, bf16 and f32, both rhs layouts, empty groups, one
group holding every row, tail rows past sum(group_sizes), local group windows, fused bias / activation / gated
epilogue, static grid), each with the table's blocks and, where tiling matters, tiny ones forced through blocks=;
gradients w.r.t. lhs, rhs, bias and row_scale; the kernels' activation against the reference's; bad input (blocks=
included); TPU export; deviceless compile of the prefill grouped matmuls at the benchmark shapes (each distinct
tiling on v6e, the largest on v5e / v7x; the decode ones compile inside experts_forward, in test_moe.py), of the
backward and of the tiny blocks.

Every interpret run is jitted (one XLA compile per shape instead of one per eager op), and shapes stay small: the
simulator costs about a second per call on this machine."""

import functools
import re

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest
from jax.experimental import pallas as pl

from benchmarks.shapes import MOE_EXPERTS, MOE_MODELS, RAGGED_DOT_PREFILL_ROWS
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.api import MatmulBlocks, RaggedDotBlocks, TransposedMatmulBlocks
from tpu_kernels_jax.common import activation as kernel_activation
from tpu_kernels_jax.common import mxfp4
from tpu_kernels_jax.common.blocks import sublane_multiple
from tpu_kernels_jax.ragged_dot import api, metadata, tuning
from tpu_kernels_jax.ragged_dot.reference import activation_reference, ragged_dot_reference

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# f32 sums of a few hundred products: CPU and kernel summation orders differ by a few ulps of the largest term.
F32_TOL = dict(rtol=1e-5, atol=1e-4)


def small_blocks(dtype) -> RaggedDotBlocks:
    """Tiny tiles for every kernel of the op (one sublane tile of rows, 128-wide k and n tiles; the rhs gradient's
    output blocks stay the table's), so multi-tile grids, k accumulation over several steps, a masked partial last k
    block, partial last n blocks and tiles shared by several groups are all exercised at test sizes."""
    tile = MatmulBlocks(tm=sublane_multiple(dtype), tk=128, tn=128)
    return RaggedDotBlocks(
        forward=tile, recompute=tile, lhs_grad=tile, rhs_grad=TransposedMatmulBlocks(tm=sublane_multiple(dtype))
    )


def row_chunk_blocks(dtype) -> RaggedDotBlocks:
    """Tiles of two row chunks of one sublane tile each, all of K in one step, for the forward, the recomputation and
    the lhs gradient (the forward kernel with rhs read the other way): at test sizes most tiles are shared by groups,
    so every visit runs a chunked branch."""
    sub = sublane_multiple(dtype)
    chunked = MatmulBlocks(tm=2 * sub, tn=128, row_chunk=sub)
    return RaggedDotBlocks(forward=chunked, recompute=chunked, lhs_grad=chunked)


# What each block regime passes as blocks=: the tuning table's choice, the tiny tiles, or tiles in row chunks.
BLOCK_REGIMES = {"tuned_blocks": lambda dtype: None, "small_blocks": small_blocks, "row_chunks": row_chunk_blocks}


def group_sizes(rand, groups, fill):
    """Random sizes summing to `fill`, with at least one empty group when there are two or more groups."""
    cuts = np.sort(rand.rng.integers(0, fill + 1, groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [fill]])).astype(np.int32)
    if groups > 1:
        empty = int(rand.rng.integers(0, groups))
        moved, sizes[empty] = sizes[empty], 0
        sizes[(empty + 1) % groups] += moved
    assert sizes.sum() == fill and (sizes >= 0).all()
    return jnp.asarray(sizes)


def rhs_shape(groups, k, n, transposed):
    return (groups, n, k) if transposed else (groups, k, n)


def kernel_fn(**kw):
    return jax.jit(functools.partial(tk.ragged_dot, **kw))


def reference_fn(**kw):
    return jax.jit(functools.partial(ragged_dot_reference, **kw))


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "out_dtype"))
def lax_ragged_dot(lhs, rhs, sizes, *, rhs_transposed, out_dtype):
    """XLA's ragged dot, f32 accumulation, rounded once to out_dtype (what the kernel does); one jitted program, not
    an XLA compile per eager op. Full precision for float32 operands only: bfloat16 products are exact in f32, and on
    the v5e chip XLA's own ragged-dot kernel fails to compile bfloat16 operands at HIGHEST ("Bad lhs type"). Its rows
    past sum(sizes) are unspecified (the v5e chip leaves values there): compare rows below it only."""
    w = jnp.swapaxes(rhs, 1, 2) if rhs_transposed else rhs
    precision = jax.lax.Precision.HIGHEST if jnp.promote_types(lhs.dtype, rhs.dtype) == F32 else None
    out = jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=F32, precision=precision)
    return out.astype(out_dtype)


def all_zero(x, rows=slice(None)) -> bool:
    """x[rows] is exactly zero (NaN is not), checked on the host: no XLA compile for a slice and a compare."""
    return bool(np.all(np.asarray(x)[rows] == 0))


def tolerance(out_dtype):
    return F32_TOL if jnp.dtype(out_dtype) == F32 else {}


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


# ------------------------------------------------------------------------------------------- forward, plain
# (id, M, K, N, groups, filled rows, input dtype, rhs_transposed, preferred_element_type)
CASES = [
    ("m0", 0, 128, 256, 4, 0, F32, False, None),
    ("m7-tail-bf16-t-to-f16", 7, 256, 128, 3, 5, BF16, True, F16),
    ("m8-f32-t-to-bf16", 8, 128, 128, 8, 8, F32, True, BF16),
    ("m64-k200-bf16-to-f32", 64, 200, 256, 6, 50, BF16, False, F32),
    ("m129-n200-f32", 129, 128, 200, 5, 129, F32, False, None),
    ("m512-bf16-t", 512, 256, 128, 16, 500, BF16, True, None),
]
# No larger M: the m512 case already takes several m tiles of the table's largest tm, the small-block cases many
# tiles with groups straddling them; more rows only repeat those visits. Fewer rows than one sublane tile (a decode
# step): m7 (and one token's rows in test_moe.py). Each output dtype once: f16 from bf16 (m7), bf16 from f32 (m8),
# f32 from bf16 (m64), the input's own (m129, m512).
# These run with tiny blocks only (multi-tile grids, masked partial k block, partial n block, groups straddling
# tiles); the table's whole-K block at K = 200 runs in test_weights_stored_swapped_give_the_same_result (the kernel
# reads that rhs as [E, K, N], the untransposed layout) and its whole-N block at N = 200 in
# test_fused_epilogue_matches_reference[concat-silu-n200-unfused].
SMALL_BLOCK_CASES = ("m64-k200-bf16-to-f32", "m129-n200-f32")
REGIME_CASES = [(c, "small_blocks" if c[0] in SMALL_BLOCK_CASES else "tuned_blocks") for c in CASES]


@pytest.mark.parametrize("case,regime", REGIME_CASES, ids=[f"{c[0]}-{r}" for c, r in REGIME_CASES])
def test_ragged_dot_matches_reference_and_lax(rand, regime, case):
    _, m, k, n, groups, fill, dtype, transposed, preferred = case
    lhs = rand.normal((m, k), dtype)
    rhs = rand.normal(rhs_shape(groups, k, n, transposed), dtype)
    sizes = group_sizes(rand, groups, fill)
    kw = dict(rhs_transposed=transposed, preferred_element_type=preferred)
    out_dtype = jnp.dtype(preferred or dtype)
    out = ladder.check_against_reference(
        kernel_fn(blocks=BLOCK_REGIMES[regime](dtype), **kw),
        reference_fn(**kw),
        (lhs, rhs, sizes),
        dtype=out_dtype,
        rand=rand,
        **tolerance(out_dtype),
    )
    assert out.shape == (m, n) and out.dtype == out_dtype
    expected = lax_ragged_dot(lhs, rhs, sizes, rhs_transposed=transposed, out_dtype=out_dtype)
    ladder.assert_close(
        out[:fill],
        expected[:fill],
        dtype=out_dtype,
        what="vs lax.ragged_dot",
        context=f"{sizes} {rand}",
        **tolerance(out_dtype),
    )
    assert all_zero(out, slice(fill, None)), f"rows past sum(group_sizes) = {fill} are not exactly zero ({rand})"


def _special_sizes(kind, groups, m):
    sizes = np.zeros(groups, np.int32)
    if kind == "one-group-holds-every-row":
        sizes[groups // 2] = m
    elif kind == "first-group-holds-every-row":
        sizes[0] = m
    elif kind == "last-group-holds-every-row":
        sizes[-1] = m
    elif kind == "every-group-empty":
        pass
    elif kind == "alternate-empty-and-single-rows":
        sizes[::2] = 1
    return jnp.asarray(sizes)


# (layout, static_grid): the grid sized by the real visit count, or by the worst case with surplus steps skipped.
SPECIAL = [
    ("one-group-holds-every-row", False),
    ("first-group-holds-every-row", True),
    ("last-group-holds-every-row", False),
    ("every-group-empty", True),
    ("alternate-empty-and-single-rows", True),
]


@pytest.mark.parametrize("sizes", [[40, 40, 40, 40], [-5, 30, 30, 9]], ids=["sum_past_m", "negative"])
def test_traced_group_sizes_that_break_the_contract_stay_in_bounds(rand, sizes):
    """Traced group sizes cannot be checked on the host: sizes summing past M, or a negative one, must still keep
    every kernel inside its buffers (strict interpret mode raises on an out-of-bounds block), forward and backward,
    with finite results (the rows are then split among the groups in some order; no value is promised)."""
    lhs, rhs = rand.normal((64, 128)), rand.normal((4, 128, 128))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = ladder.run_kernel(kernel_fn(), lhs, rhs, group_sizes)
    grads = ladder.run_kernel(
        jax.jit(jax.grad(lambda l, r, s: ladder.vjp_loss(api.ragged_dot(l, r, s)), argnums=(0, 1))),
        lhs,
        rhs,
        group_sizes,
    )
    for name, x in zip(["out", "d lhs", "d rhs"], [out, *grads]):
        assert np.isfinite(np.asarray(x)).all(), f"{name}: not finite ({sizes}, {rand})"


def test_special_group_layouts_and_static_grid(rand):
    """Each special layout on one of the two grids (sized by the real visit count, or by the worst case with the
    surplus steps skipped), and a random layout (an empty group, 5 tail rows) on both, which give bit-identical
    results; all against the reference and lax.ragged_dot. Tiny blocks (8-row f32 tiles, 128-wide k and n): 3 m
    tiles, 2 k and 2 n tiles, so surplus steps, k accumulation and tiles shared by groups all occur. One compiled
    program per grid (and one reference) serves every layout: the sizes are runtime values."""
    m, k, n, groups = 24, 256, 256, 7
    lhs, rhs = rand.normal((m, k)), rand.normal((groups, n, k))
    blocks = small_blocks(F32)
    grids = {static: kernel_fn(rhs_transposed=True, static_grid=static, blocks=blocks) for static in (False, True)}
    reference = reference_fn(rhs_transposed=True)
    random_sizes = group_sizes(rand, groups, m - 5)
    dynamic = ladder.run_kernel(grids[False], lhs, rhs, random_sizes)
    layouts = [(kind, static, _special_sizes(kind, groups, m)) for kind, static in SPECIAL]
    for kind, static, sizes in layouts + [("random", True, random_sizes)]:
        out = ladder.run_kernel(grids[static], lhs, rhs, sizes)
        context = f"{kind} {sizes} {rand}"
        ladder.assert_close(out, reference(lhs, rhs, sizes), dtype=F32, context=context, **F32_TOL)
        fill = int(sizes.sum())
        ladder.assert_close(
            out[:fill],
            lax_ragged_dot(lhs, rhs, sizes, rhs_transposed=True, out_dtype=F32)[:fill],
            dtype=F32,
            what="vs lax.ragged_dot",
            context=context,
            **F32_TOL,
        )
        assert all_zero(out, slice(fill, None)), f"{kind}: rows past the groups are not exactly zero"
    assert bool(np.all(np.asarray(dynamic) == np.asarray(out))), (
        f"static and dynamic grids differ ({random_sizes}, {rand})"
    )


# (gated, rhs_transposed, static_grid, group sizes): every layout of the weight streams the kernel's own prefetch
# reads; the window (groups 1-5) holds an even number of non-empty groups, then an odd one (the buffers' alternation
# across n tiles differs).
PREFETCH_CASES = [
    (None, True, False, (9, 0, 30, 5, 17, 4), 384, 128),
    ("concatenated", True, True, (9, 0, 30, 5, 17, 0), 384, 128),
    ("interleaved", False, False, (9, 3, 30, 0, 17, 4), 384, 128),
    # a last n tile narrower than the rest: 640 columns in blocks of 256 (interleaved: 2 x 320 in blocks of 256)
    (None, False, True, (9, 0, 30, 5, 17, 4), 640, 256),
    ("interleaved", True, False, (9, 3, 30, 0, 17, 0), 320, 128),
]


@pytest.mark.parametrize(
    "gated,transposed,static,sizes,n_out,tn", PREFETCH_CASES, ids=[str(c[:3] + c[4:]) for c in PREFETCH_CASES]
)
def test_weight_prefetch_across_groups_and_n_tiles(rand, gated, transposed, static, sizes, n_out, tn):
    """With all of K in one block the kernel fetches each group's weight blocks itself, a run of visits ahead and on
    into the next n tile (kernel._prefetched_weights, two buffers alternating): groups spanning several m tiles and
    sharing tiles, an empty group, rows past the groups and before the window (zero visits), three n tiles of one
    or two weight streams (the last one narrower where N is no whole number of blocks), against the reference. A
    block read from the wrong buffer, group or n tile, or a DMA left unwaited (strict interpret mode), fails here."""
    m, k, groups = 72, 128, 6
    n = 2 * n_out if gated else n_out
    lhs = rand.normal((m, k))
    rhs = rand.normal(rhs_shape(groups, k, n, transposed), scale=0.2)
    fill = sum(sizes)  # of 72 rows; tiles of 8 rows shared by groups
    sizes = jnp.asarray(sizes, jnp.int32)
    kw = dict(rhs_transposed=transposed, group_offset=1, num_local_groups=5)
    if gated:
        kw.update(gated=gated, activation="silu")
    blocks = RaggedDotBlocks(forward=MatmulBlocks(tm=8, tk=k, tn=tn))
    out = ladder.check_against_reference(
        jax.jit(lambda l, r, s: tk.ragged_dot(l, r, s, blocks=blocks, static_grid=static, **kw)),
        jax.jit(lambda l, r, s: ragged_dot_reference(l, r, s, **kw)),
        (lhs, rhs, sizes),
        dtype=F32,
        rand=rand,
        **F32_TOL,
    )
    assert out.shape == (m, n_out)
    assert all_zero(out, slice(0, 9)) and all_zero(out, slice(fill, None)), "rows outside the window are not zero"


ROW_CHUNK_CASES = [
    # gated, dtype, tm, row_chunk, sizes (of 160 rows): groups starting and ending inside tiles of 64, one within one
    # chunk, one over a whole tile, an empty one, rows past the groups
    ("concatenated", BF16, 64, 32, (5, 40, 0, 70, 3, 30)),
    (None, F32, 64, 16, (17, 1, 64, 0, 33, 20)),
]


@pytest.mark.parametrize("m", [1, 12])
def test_row_chunks_of_a_tile_cut_to_fewer_rows(rand, m):
    """A caller's tile of 16 rows in chunks of 8, at M = 1 or 12: the tile is cut to the M rows there are, which the
    chunks do not divide, and runs whole (no error: the caller's blocks fit every M)."""
    k, n, groups = 128, 384, 8
    lhs = rand.normal((m, k), F32)
    rhs = rand.normal(rhs_shape(groups, k, n, False), F32, scale=0.2)
    sizes = jnp.asarray([0, m] + [0] * (groups - 2), jnp.int32)
    blocks = row_chunk_blocks(F32)
    ladder.check_against_reference(
        jax.jit(lambda l, r, s: tk.ragged_dot(l, r, s, blocks=blocks)),
        jax.jit(lambda l, r, s: ragged_dot_reference(l, r, s)),
        (lhs, rhs, sizes),
        dtype=F32,
        rand=rand,
        **F32_TOL,
    )


@pytest.mark.parametrize("gated,dtype,tm,row_chunk,sizes", ROW_CHUNK_CASES, ids=[str(c[0]) for c in ROW_CHUNK_CASES])
def test_row_chunks_of_partial_visits(rand, gated, dtype, tm, row_chunk, sizes):
    """MatmulBlocks.row_chunk: visits to tiles shared by groups multiply only the chunks holding their rows (one
    branch per chunk count). Against the reference, with a row scale and biases: rows of other groups in a chunk
    masked, rows outside every visit's chunks zeroed by the tile's first visit, rows past the groups zero."""
    m, k, n_out, groups = 160, 128, 256, 6
    n = 2 * n_out if gated else n_out
    lhs = rand.normal((m, k), dtype)
    rhs = rand.normal(rhs_shape(groups, k, n, True), dtype, scale=0.2)
    bias = rand.normal((groups, n), dtype)
    row_scale = rand.uniform((m,), 0.5, 1.5)
    sizes = jnp.asarray(sizes, jnp.int32)
    kw = dict(rhs_transposed=True, bias=bias, row_scale=row_scale)
    if gated:
        kw.update(gated=gated, activation="silu")
    blocks = RaggedDotBlocks(forward=MatmulBlocks(tm=tm, tk=k, tn=128, row_chunk=row_chunk))
    fn = lambda l, r, s: tk.ragged_dot(l, r, s, blocks=blocks, **kw)  # noqa: E731
    # one chunk's lhs rows, read by the one-chunk branch: only a chunked kernel holds them
    text = str(jax.make_jaxpr(fn)(lhs, rhs, sizes))
    chunk_rows = f"{jnp.dtype(dtype).name.replace('float', 'f')}[{row_chunk},{k}]"
    assert chunk_rows in text, "row_chunk did not reach the kernel"
    out = ladder.check_against_reference(
        jax.jit(fn),
        jax.jit(lambda l, r, s: ragged_dot_reference(l, r, s, **kw)),
        (lhs, rhs, sizes),
        dtype=dtype,
        rand=rand,
        **(F32_TOL if dtype == F32 else {}),
    )
    assert out.shape == (m, n_out)
    assert all_zero(out, slice(int(sum(sizes)), None)), "rows past the groups are not zero"


def test_k_zero_gives_bias_or_zero(rand):
    lhs, rhs, sizes = rand.normal((10, 0)), rand.normal((3, 0, 128)), jnp.asarray([4, 0, 5], jnp.int32)
    bias = rand.normal((3, 128))
    out = ladder.run_kernel(kernel_fn(bias=bias), lhs, rhs, sizes)
    assert (
        bool(np.all(np.asarray(out)[:4] == np.asarray(bias)[0]))
        and bool(np.all(np.asarray(out)[4:9] == np.asarray(bias)[2]))
        and all_zero(out, slice(9, None))
    )


# ---------------------------------------------------------------------------------------------- local window
# rhs holding every group with a traced offset (the kernel reads the offset from SMEM either way; the rhs base
# differs). rhs holding only the window with a static offset: the fused epilogue's window-only-interleaved-bias case
# (the visit list and the rhs base do not depend on the epilogue; the reference it matches is zero outside the
# window) and the gradient's bf16-window-only-t.
@pytest.mark.parametrize("rhs_holds,offset_kind", [("every_group", "traced")])
def test_local_group_window(rand, rhs_holds, offset_kind):
    """Only groups [offset, offset + n) live here; rows of every other group (and the tail) come out exactly zero."""
    m, k, n, groups, offset, n_local = 72, 128, 128, 7, 2, 3
    lhs = rand.normal((m, k), BF16)
    full_rhs = rand.normal((groups, k, n), BF16)
    rhs = full_rhs[offset : offset + n_local] if rhs_holds == "window" else full_rhs
    sizes = group_sizes(rand, groups, 66)
    kw = dict(num_local_groups=n_local)
    group_offset = offset if offset_kind == "int" else jnp.asarray([offset], jnp.int32)
    # A traced offset (as inside shard_map) reaches the kernel as a jit argument, not a constant.
    kernel = jax.jit(lambda l, r, s, o: tk.ragged_dot(l, r, s, group_offset=o, **kw))
    out = (
        ladder.run_kernel(kernel, lhs, rhs, sizes, group_offset)
        if offset_kind == "traced"
        else (ladder.run_kernel(kernel_fn(group_offset=offset, **kw), lhs, rhs, sizes))
    )
    expected = reference_fn(group_offset=offset, **kw)(lhs, rhs, sizes)
    ladder.assert_close(out, expected, dtype=BF16, context=f"{sizes} {rand}")
    ends = np.cumsum(np.asarray(sizes))
    lo, hi = (int(ends[offset - 1]) if offset else 0), int(ends[offset + n_local - 1])
    full = lax_ragged_dot(lhs, full_rhs, sizes, rhs_transposed=False, out_dtype=BF16)
    ladder.assert_close(out[lo:hi], full[lo:hi], dtype=BF16, what="window rows vs lax.ragged_dot", context=repr(rand))
    assert all_zero(out, slice(None, lo)) and all_zero(out, slice(hi, None)), (
        f"rows outside the window [{lo}, {hi}) are not exactly zero ({sizes}, {rand})"
    )


# ------------------------------------------------------------------------------------------ fused epilogue
# (id, M, K, N, groups, dtype, rhs_transposed, bias, activation, gated, window (offset, n_local, rhs every group))
# Each activation, gate layout (none, concatenated, interleaved, unfused n), dtype, rhs layout and window kind at
# least once; bias with each layout. The ungated gelu with bias on f32, forward and backward: the gradient case
# f32-window-every-group-gelu-bias-static below. The ungated silu and the interleaved gelu of the same kernel are
# covered by it / window-only-interleaved-bias (the activation is one elementwise function: its own test below). The
# concatenated silu with bias on a transposed f32 problem: window-concat-silu-bias (bf16) and
# test_quantized_rhs_matches_dequantized_reference (f32, the int8 weights cast in VMEM before the same epilogue).
EPILOGUE_CASES = [
    ("concat-gelu-bias-bf16", 64, 128, 512, 5, BF16, False, True, "gelu_tanh", "concatenated", None),
    ("concat-silu-n200-unfused", 40, 128, 200, 4, BF16, False, True, "silu", "concatenated", None),
    ("interleaved-silu-bias-bf16-t", 40, 128, 256, 4, BF16, True, True, "silu", "interleaved", None),
    ("window-concat-silu-bias", 56, 128, 256, 6, BF16, True, True, "silu", "concatenated", (1, 3, True)),
    ("window-only-interleaved-bias", 56, 128, 256, 6, F32, False, True, "gelu_tanh", "interleaved", (3, 2, False)),
]
# Runs with tiny blocks only (its tuned-block concatenated epilogue: window-concat-silu-bias and
# test_row_scale_and_its_gradient's concat-gelu-bf16).
SMALL_BLOCK_EPILOGUE = ("concat-gelu-bias-bf16",)


def _epilogue_args(rand, case):
    _, m, k, n, groups, dtype, transposed, with_bias, activation, gated, window = case
    kw = dict(rhs_transposed=transposed, activation=activation, gated=gated)
    rhs_groups = groups
    if window is not None:
        offset, n_local, every = window
        kw.update(group_offset=offset, num_local_groups=n_local)
        rhs_groups = groups if every else n_local
    lhs = rand.normal((m, k), dtype)
    rhs = rand.normal(rhs_shape(rhs_groups, k, n, transposed), dtype, scale=0.2)
    bias = rand.normal((rhs_groups, n), dtype) if with_bias else None
    sizes = group_sizes(rand, groups, m - 3)
    return (lhs, rhs, sizes, bias), kw


EPILOGUE_REGIMES = [(c, "small_blocks" if c[0] in SMALL_BLOCK_EPILOGUE else "tuned_blocks") for c in EPILOGUE_CASES]


@pytest.mark.parametrize("case,regime", EPILOGUE_REGIMES, ids=[f"{c[0]}-{r}" for c, r in EPILOGUE_REGIMES])
def test_fused_epilogue_matches_reference(rand, regime, case):
    (lhs, rhs, sizes, bias), kw = _epilogue_args(rand, case)
    dtype = case[5]
    blocks = BLOCK_REGIMES[regime](dtype)
    out = ladder.check_against_reference(
        jax.jit(lambda l, r, s, b: tk.ragged_dot(l, r, s, bias=b, blocks=blocks, **kw)),
        jax.jit(lambda l, r, s, b: ragged_dot_reference(l, r, s, bias=b, **kw)),
        (lhs, rhs, sizes, bias),
        dtype=dtype,
        rand=rand,
        **tolerance(dtype),
    )
    n = case[3]
    assert out.shape == (lhs.shape[0], n // 2 if kw["gated"] else n)
    assert all_zero(out, slice(lhs.shape[0] - 3, None)), "tail rows are not exactly zero"


# ------------------------------------------------------------------------------------------------ gradients
# (id, M, K, N, groups, dtype, rhs_transposed, bias, activation, gated, window, static_grid)
# The plain kernel's gradients with bias (tiny blocks too) and the interleaved epilogue's are in
# test_row_scale_and_its_gradient (plain-bias-f32-small_blocks, interleaved-silu-bias-f32; a bf16 epilogue's backward:
# concat-gelu-bf16): the row scale is one more factor on the same backward kernels. f32 with bias and no row scale,
# the ungated gelu epilogue (its forward too: the fused epilogue test has no other ungated case), a window and the
# static grid: f32-window-every-group-gelu-bias-static. The concatenated f32 epilogue with bias on a transposed rhs:
# d lhs and d bias in test_quantized_rhs_matches_dequantized_reference (the same epilogue backward, the scale folded
# into the cotangent), d rhs of the concatenated epilogue in concat-gelu-bf16 and of a transposed rhs in
# plain-bias-f32 and bf16-window-only-t.
GRAD_CASES = [
    (
        "f32-window-every-group-gelu-bias-static",
        48,
        128,
        128,
        6,
        F32,
        False,
        True,
        "gelu_tanh",
        None,
        (2, 3, True),
        True,
    ),
    ("bf16-window-only-t", 48, 128, 128, 6, BF16, True, False, None, None, (1, 4, False), False),
]
GRAD_REGIMES = [(c, "tuned_blocks") for c in GRAD_CASES]


# d rhs and d bias sum over a group's rows: bf16 inputs carry their rounding into those sums.
GRAD_TOLERANCE = {jnp.dtype(BF16): dict(atol=5e-2), jnp.dtype(F32): dict(rtol=1e-5, atol=2e-4)}


@pytest.mark.parametrize("case,regime", GRAD_REGIMES, ids=[f"{c[0]}-{r}" for c, r in GRAD_REGIMES])
def test_gradients_match_reference(rand, regime, case):
    name, m, k, n, groups, dtype, transposed, with_bias, activation, gated, window, static_grid = case
    kw = dict(rhs_transposed=transposed, activation=activation, gated=gated)
    rhs_groups = groups
    if window is not None:
        kw.update(group_offset=window[0], num_local_groups=window[1])
        rhs_groups = groups if window[2] else window[1]
    lhs = rand.normal((m, k), dtype)
    rhs = rand.normal(rhs_shape(rhs_groups, k, n, transposed), dtype, scale=0.2)
    bias = rand.normal((rhs_groups, n), dtype) if with_bias else None
    sizes = group_sizes(rand, groups, m - 5)
    blocks = BLOCK_REGIMES[regime](dtype)
    # The forward output is checked too: it comes out of the gradient's program (no second compile).
    out, grads = ladder.check_forward_and_gradients(
        lambda l, r, s, b: tk.ragged_dot(l, r, s, bias=b, static_grid=static_grid, blocks=blocks, **kw),
        lambda l, r, s, b: ragged_dot_reference(l, r, s, bias=b, **kw),
        (lhs, rhs, sizes, bias),
        argnums=(0, 1, 3) if with_bias else (0, 1),
        names=["d lhs", "d rhs", "d bias"][: 3 if with_bias else 2],
        rand=rand,
        dtype=dtype,
        out_tolerance=tolerance(dtype),
        grad_tolerance=GRAD_TOLERANCE[jnp.dtype(dtype)],
        return_gradients=True,
    )
    assert all_zero(out, slice(m - 5, None)), "rows past the groups are not exactly zero"
    assert all_zero(grads[0], slice(m - 5, None)), "d lhs of rows past the groups is not exactly zero"


# ------------------------------------------------------------------------------------------------ row scale
# (id, M, K, N, groups, dtype, rhs_transposed, bias, activation, gated): the plain kernel, the fused epilogue, and
# the interleaved one, each with a per-row scale (the MoE routing weights) applied last.
ROW_SCALE_CASES = [
    ("plain-bias-f32", 24, 128, 256, 3, F32, True, True, None, None),
    ("concat-gelu-bf16", 48, 128, 256, 5, BF16, False, False, "gelu_tanh", "concatenated"),
    ("interleaved-silu-bias-f32", 40, 128, 256, 4, F32, False, True, "silu", "interleaved"),
]
# The plain kernel with small blocks (f32 8-row, 128-wide tiles: 3 m tiles, 2 n tiles, groups straddling tiles, one
# empty, 3 tail rows), the epilogue paths with the table's.
# Row chunks (the v5e table's choice at prefill sizes) in the forward and backward kernels: the bf16 epilogue and the
# f32 interleaved one.
ROW_SCALE_REGIMES = (
    [(ROW_SCALE_CASES[0], "small_blocks")]
    + [(c, "tuned_blocks") for c in ROW_SCALE_CASES[1:]]
    + [(c, "row_chunks") for c in ROW_SCALE_CASES[1:]]
)


@pytest.mark.parametrize("case,regime", ROW_SCALE_REGIMES, ids=[f"{c[0]}-{r}" for c, r in ROW_SCALE_REGIMES])
def test_row_scale_and_its_gradient(rand, regime, case):
    """out[r] = row_scale[r] * (epilogue of lhs[r] @ rhs[g(r)] + bias): forward, and every gradient including
    d row_scale, against the reference."""
    _, m, k, n, groups, dtype, transposed, with_bias, activation, gated = case
    kw = dict(rhs_transposed=transposed, activation=activation, gated=gated, blocks=BLOCK_REGIMES[regime](dtype))
    lhs = rand.normal((m, k), dtype)
    rhs = rand.normal(rhs_shape(groups, k, n, transposed), dtype, scale=0.2)
    bias = rand.normal((groups, n), dtype) if with_bias else None
    scale = rand.normal((m,), F32)
    sizes = group_sizes(rand, groups, m - 3)
    ref_kw = {key: value for key, value in kw.items() if key != "blocks"}

    def kernel(l, r, sz, b, sc):
        return tk.ragged_dot(l, r, sz, bias=b, row_scale=sc, **kw)

    def reference(l, r, sz, b, sc):
        return ragged_dot_reference(l, r, sz, bias=b, row_scale=sc, **ref_kw)

    args = (lhs, rhs, sizes, bias, scale)
    out = ladder.check_forward_and_gradients(
        kernel,
        reference,
        args,
        argnums=(0, 1, 3, 4) if with_bias else (0, 1, 4),
        names=["d lhs", "d rhs"] + (["d bias"] if with_bias else []) + ["d row_scale"],
        rand=rand,
        dtype=dtype,
        out_tolerance=tolerance(dtype),
        grad_tolerance=GRAD_TOLERANCE[jnp.dtype(dtype)],
    )
    assert all_zero(out, slice(m - 3, None)), "tail rows are not exactly zero"


# ------------------------------------------------------------------------------------------------ quantized rhs
def test_quantized_rhs_matches_dequantized_reference(rand):
    """int8 rhs with a per-column f32 scale, cast in VMEM, against the reference on the dequantized rhs (exact
    weights; f32 lhs, so to f32 rounding): the fused concatenated epilogue (the scale split into gate and up halves
    like the bias) with k accumulated over two steps (K = 200: a masked partial last block; the scale applies once,
    after the last), in a group window of an rhs holding every group; d lhs (the column scale moved onto the
    cotangent, per row by its group) and d bias. bf16 activations and fp8 weights: test_moe.py."""
    m, k, n, groups = 24, 200, 256, 5
    kw = dict(rhs_transposed=True, activation="silu", gated="concatenated", group_offset=1, num_local_groups=3)
    lhs = rand.normal((m, k))
    rhs = rand.integers(-127, 128, rhs_shape(groups, k, n, True), jnp.int8)
    scale = rand.uniform((groups, n), 0.001, 0.01)
    bias = rand.normal((groups, n))
    sizes = group_sizes(rand, groups, m - 3)
    blocks = RaggedDotBlocks(forward=MatmulBlocks(tk=128), recompute=MatmulBlocks(tk=128))

    def kernel(l, q, c, sz, b):
        return tk.ragged_dot(l, q, sz, rhs_scale=c, bias=b, blocks=blocks, **kw)

    def reference(l, q, c, sz, b):
        return ragged_dot_reference(l, q.astype(F32) * c[:, :, None], sz, bias=b, **kw)

    args = (lhs, rhs, scale, sizes, bias)
    out = ladder.check_forward_and_gradients(
        kernel,
        reference,
        args,
        argnums=(0, 4),
        names=["d lhs", "d bias"],
        rand=rand,
        dtype=F32,
        out_tolerance=F32_TOL,
        grad_tolerance=F32_TOL,
    )
    assert out.dtype == F32 and all_zero(out, slice(m - 3, None)), "tail rows are not exactly zero"


def test_mxfp4_widen_is_the_reference_bit_for_bit(rand):
    """mxfp4.widen, in a Pallas kernel (run_kernel), on blocks as mxfp4.prepare lays them out: every one of the 16
    e2m1 codes under every e8m0 scale 0..255 (each (column, 32-block) holds each code twice, at random positions;
    each scale 4 times) is the reference dequantization's value as bf16, bit for bit (zeros up to their sign; NaN
    exactly where the reference's is: scale 255), in the planes' order; and dequantize_prepared reads the prepared
    bytes back as the same values."""
    n, k = 128, 256
    offset = rand.rng.integers(0, 16, (n, 1))
    codes = (np.arange(k)[None, :] + offset) % 16
    blocks = jnp.asarray((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    scales = jnp.asarray(((np.arange(n * k // 32) + rand.rng.integers(0, 256)) % 256).reshape(n, k // 32), jnp.uint8)
    reference = jax.jit(mxfp4.dequantize)(blocks, scales).astype(BF16).astype(F32)
    prepared = jax.jit(mxfp4.prepare)(blocks, scales)

    def widen(b_ref, s_ref, *out_refs):
        for o, plane in zip(out_refs, mxfp4.widen(b_ref[...], s_ref[...], BF16)):
            o[...] = plane

    out_shape = [jax.ShapeDtypeStruct((k // 4, n), BF16)] * 4
    planes = ladder.run_kernel(jax.jit(lambda *p: pl.pallas_call(widen, out_shape=out_shape)(*p)), *prepared)
    got = np.asarray(jnp.concatenate(planes, axis=0).astype(F32))
    want = np.asarray(mxfp4.plane_order(reference)).T
    nan = np.isnan(want)
    assert nan.any() and (want == 0).any(), "the codes and scales do not cover NaN and zero"
    assert np.array_equal(np.isnan(got), nan), "NaN where the reference has none, or none where it has"
    same = (got.view(np.uint32) == want.view(np.uint32)) | ((got == 0) & (want == 0))
    assert same[~nan].all(), f"{int((~same[~nan]).sum())} values differ from the reference"
    back = np.asarray(jax.jit(mxfp4.dequantize_prepared)(*prepared))
    assert np.array_equal(back, np.asarray(reference), equal_nan=True)


@pytest.mark.parametrize("row_chunk", [None, 8])
def test_mxfp4_rhs_matches_dequantized_reference(rand, row_chunk):
    """MXFP4 rhs (transformers' [G, N, K / 32, 16] uint8 blocks, e8m0 scales), widened in VMEM whole along K, against
    the reference on the dequantized rhs: f32 lhs (to f32 rounding), no epilogue, in a group window of an rhs holding
    every group; rows outside the window and past the groups exactly zero; the table's tiles, and tiles of 16 rows
    in row chunks of 8. Its epilogue with biases: test_moe.py."""
    m, k, n, groups = 24, 128, 64, 4
    blocks = rand.integers(0, 256, (groups, n, k // 32, 16), jnp.uint8)
    scales = rand.integers(118, 125, (groups, n, k // 32), jnp.uint8)
    sizes = group_sizes(rand, groups, m - 3)
    kw = dict(rhs_transposed=True, group_offset=1, num_local_groups=2)
    tiles = RaggedDotBlocks(forward=MatmulBlocks(tm=16, row_chunk=row_chunk)) if row_chunk else None

    def kernel(lhs, blocks, scales, sizes):
        return tk.ragged_dot(lhs, blocks, sizes, rhs_scale=scales, blocks=tiles, **kw)

    def reference(lhs, blocks, scales, sizes):
        return ragged_dot_reference(lhs, mxfp4.dequantize(blocks, scales), sizes, **kw)

    args = (rand.normal((m, k)), blocks, scales, sizes)
    out = ladder.check_against_reference(jax.jit(kernel), jax.jit(reference), args, dtype=F32, rand=rand, **F32_TOL)
    outside = np.ones(m, bool)
    start = int(np.sum(np.asarray(sizes)[:1]))
    outside[start : start + int(np.sum(np.asarray(sizes)[1:3]))] = False
    assert out.dtype == F32 and all_zero(out, outside), "rows outside the window are not exactly zero"


# ------------------------------------------------------------------------------------------------ random draws
@ladder.random_draws
def test_random_draw(rand, draw):
    """Sizes (unaligned K and N, fewer rows than a sublane tile, tail rows past the groups, empty groups), dtypes,
    the rhs layout and dtype (int8 / fp8 with column scales), a group window, the epilogue (bias, activation,
    gating), a row scale, the grid and the tiling drawn at random; the forward, or forward and gradients, against the
    reference on the dequantized weights."""
    dtype = rand.draw("dtype", [F32, BF16])
    quantized = rand.draw("rhs_dtype", [None, None, jnp.int8, jnp.float8_e4m3fn])
    gradients = quantized is None and rand.draw("gradients", [False, True])
    m = rand.draw("m", [7, 24, 48, 64] if gradients else [1, 7, 8, 24, 64, 129, 200])
    k, n = rand.draw("k", [128, 200, 256]), rand.draw("n", [128, 200, 256, 384])
    groups = rand.draw("groups", [1, 2, 5, 8])
    fill = rand.draw("filled_rows", range(m + 1))
    transposed = rand.draw("rhs_transposed", [False, True])
    preferred = None if gradients else rand.draw("preferred_element_type", [None, F32, BF16])
    gated = rand.draw("gated", [None, "concatenated", "interleaved"])
    activation = rand.draw("activation", list(kernel_activation.ACTIVATIONS) + ([] if gated else [None]))
    kw = dict(rhs_transposed=transposed, activation=activation, gated=gated, preferred_element_type=preferred)
    window = rand.draw("window", [None, "every_group", "window_only"]) if groups > 1 else None
    rhs_groups = groups
    if window:
        offset = rand.draw("group_offset", range(groups))
        n_local = rand.draw("num_local_groups", range(1, groups - offset + 1))
        kw.update(group_offset=offset, num_local_groups=n_local)
        rhs_groups = groups if window == "every_group" else n_local
    out_dtype = jnp.dtype(preferred or dtype)
    # tiny tiles: a sublane tile of the narrower of the inputs' and the output's dtype, 128-wide n tiles (which must
    # divide the up half's width where the gate is concatenated)
    regimes = ["tuned_blocks"] if gated == "concatenated" and n // 2 % 128 else list(BLOCK_REGIMES)
    blocks = BLOCK_REGIMES[rand.draw("blocks", regimes)](min(dtype, out_dtype, key=_itemsize))
    static_grid = rand.draw("static_grid", [False, True])

    lhs = rand.normal((m, k), dtype)
    if quantized is None:
        rhs, rhs_scale = rand.normal(rhs_shape(rhs_groups, k, n, transposed), dtype, scale=0.2), None
    elif quantized == jnp.int8:
        rhs, rhs_scale = rand.integers(-127, 128, rhs_shape(rhs_groups, k, n, transposed), quantized), None
    else:
        rhs, rhs_scale = rand.normal(rhs_shape(rhs_groups, k, n, transposed), quantized, scale=4.0), None
    if quantized is not None:
        rhs_scale = rand.uniform((rhs_groups, n), 0.001, 0.01)
    bias = rand.normal((rhs_groups, n), dtype) if rand.draw("bias", [False, True]) else None
    row_scale = rand.normal((m,), F32) if rand.draw("row_scale", [False, True]) else None
    sizes = group_sizes(rand, groups, fill)
    args = (lhs, rhs, sizes, bias, row_scale, rhs_scale)
    # sums of K products, squared by relu2, rounded to bf16 and scaled by a row: rounding relative to the largest output
    atol, largest = (F32_TOL["atol"], 1e-5) if out_dtype == F32 else (ladder.TOLERANCES[out_dtype][1], 2**-8)
    out_tolerance = dict(tolerance(out_dtype), atol=ladder.relative_to_largest(atol, largest))

    def kernel(l, r, s, b, rs, sc):
        return tk.ragged_dot(l, r, s, bias=b, row_scale=rs, rhs_scale=sc, blocks=blocks, static_grid=static_grid, **kw)

    def reference(l, r, s, b, rs, sc):
        if sc is not None:  # the exact weights: each output column's scale
            r = r.astype(F32) * (sc[:, :, None] if transposed else sc[:, None, :])
        return ragged_dot_reference(l, r, s, bias=b, row_scale=rs, **dict(kw, preferred_element_type=out_dtype))

    if gradients:
        argnums, names = ladder.differentiated(args, {0: "d lhs", 1: "d rhs", 3: "d bias", 4: "d row_scale"})
        out = ladder.check_forward_and_gradients(
            kernel,
            reference,
            args,
            argnums=argnums,
            names=names,
            rand=rand,
            dtype=dtype,
            out_tolerance=out_tolerance,
            grad_tolerance=GRAD_TOLERANCE[jnp.dtype(dtype)],
        )
    else:
        out = ladder.check_against_reference(
            jax.jit(kernel), jax.jit(reference), args, dtype=out_dtype, rand=rand, **out_tolerance
        )
    assert all_zero(out, slice(fill, None)), f"rows past sum(group_sizes) = {fill} are not exactly zero ({rand})"


# ------------------------------------------------------------------------------------------------ activation
@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("activation", kernel_activation.ACTIVATIONS)
def test_kernel_activation_matches_the_reference(rand, activation, dtype):
    """The activation the kernels' epilogues apply (common/activation.py, its own formula) is the reference's
    (jax.nn's), in value and derivative (the backward differentiates the production one), over the range
    pre-activations take (normal, scale 4: deep into both tails)."""
    x = rand.normal((8, 1024), dtype, scale=4.0)
    derivative = jax.vmap(jax.grad(lambda v, f: f(v, activation).astype(F32)), in_axes=(0, None))

    @jax.jit  # one XLA compile for the four instead of one per eager op
    def values_and_derivatives(x):
        flat = x.reshape(-1)
        return (
            kernel_activation.apply_activation(x, activation),
            activation_reference(x, activation),
            derivative(flat, kernel_activation.apply_activation),
            derivative(flat, activation_reference),
        )

    kernel_value, reference_value, kernel_derivative, reference_derivative = values_and_derivatives(x)
    ladder.assert_close(
        kernel_value, reference_value, dtype=dtype, what=f"{activation} ({jnp.dtype(dtype)})", context=repr(rand)
    )
    ladder.assert_close(
        kernel_derivative,
        reference_derivative,
        dtype=dtype,
        what=f"d {activation} ({jnp.dtype(dtype)})",
        context=repr(rand),
    )
    assert kernel_activation.apply_activation(x, None) is x


# ------------------------------------------------------------------------------------------------ blocks=
def _window_epilogue_specs(dtype=BF16):
    spec = jax.ShapeDtypeStruct
    return spec((96, 256), dtype), spec((6, 512, 256), dtype), spec((6,), jnp.int32), spec((96,), F32)


@pytest.mark.cpu_only
def test_blocks_reach_every_kernel():
    """Each part of blocks= goes to its kernel, forward and backward: with a distinct vmem_limit_bytes per part, the
    traced gradient (gated epilogue and row scale: every one of the four kernels runs) holds each part's limit."""
    limits = {part: (20 << 20) + 4096 * (i + 1) for i, part in enumerate(("forward", "recompute", "lhs_grad"))}
    limits["rhs_grad"] = (20 << 20) + 4096 * 4
    blocks = RaggedDotBlocks(
        forward=MatmulBlocks(tm=32, vmem_limit_bytes=limits["forward"]),
        recompute=MatmulBlocks(tm=32, vmem_limit_bytes=limits["recompute"]),
        lhs_grad=MatmulBlocks(tm=32, vmem_limit_bytes=limits["lhs_grad"]),
        rhs_grad=TransposedMatmulBlocks(tm=32, vmem_limit_bytes=limits["rhs_grad"]),
    )

    def loss(lhs, rhs, sizes, scale):
        out = api.ragged_dot(
            lhs,
            rhs,
            sizes,
            rhs_transposed=True,
            activation="silu",
            gated="concatenated",
            row_scale=scale,
            blocks=blocks,
        )
        return ladder.vjp_loss(out)

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 3)))(*_window_epilogue_specs()))
    for part, limit in limits.items():
        assert f"vmem_limit_bytes={limit}" in text, f"blocks.{part} did not reach its kernel"


# (lhs, rhs, kwargs) shapes whose resolved blocks are compared: plain, fused gated, fused interleaved, row scale.
RESOLVE_CASES = [
    ((512, 2048), (128, 1536, 2048), dict(rhs_transposed=True, activation="silu", gated="concatenated")),
    ((4096, 768), (128, 2048, 768), dict(rhs_transposed=True)),
    ((64, 256), (8, 256, 512), dict(activation="gelu_tanh", gated="interleaved")),
    ((200, 704), (16, 2816, 704), dict(rhs_transposed=True, with_row_scale=True)),
]


def _resolved(lhs, rhs, kwargs, blocks):
    spec = jax.ShapeDtypeStruct
    kwargs = dict(kwargs)
    row_scale = spec((lhs[0],), F32) if kwargs.pop("with_row_scale", False) else None
    base = dict(preferred_element_type=BF16, rhs_transposed=False, group_offset=0, num_local_groups=None, bias=None)
    base.update(activation=None, gated=None)
    cfg, _, _ = api.check_inputs(
        spec(lhs, BF16),
        spec(rhs, BF16),
        spec((rhs[0],), jnp.int32),
        row_scale=row_scale,
        blocks=blocks,
        **{**base, **kwargs},
    )
    return cfg.kernels


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_blocks_none_is_the_table_and_candidates_are_legal(generation):
    """blocks=None and RaggedDotBlocks() resolve to the same kernels' blocks; the table's blocks passed back as
    blocks= resolve to themselves; tuning.candidate_blocks lists the table's choice first, then distinct legal
    blocks, each reproducing itself through blocks=."""
    with jax.default_device(ladder.tpu_device(generation)):
        for lhs, rhs, kwargs in RESOLVE_CASES:
            table = _resolved(lhs, rhs, kwargs, None)
            assert _resolved(lhs, rhs, kwargs, RaggedDotBlocks()) == table
            as_given = RaggedDotBlocks(
                forward=table.forward, recompute=table.recompute, lhs_grad=table.lhs_grad, rhs_grad=table.rhs_grad
            )
            assert _resolved(lhs, rhs, kwargs, as_given) == table
            spec_kwargs = {k: v for k, v in kwargs.items() if k != "with_row_scale"}
            candidates = api.candidate_blocks(
                jax.ShapeDtypeStruct(lhs, BF16),
                jax.ShapeDtypeStruct(rhs, BF16),
                jax.ShapeDtypeStruct((rhs[0],), jnp.int32),
                preferred_element_type=BF16,
                **spec_kwargs,
            )
            forwards = [c.forward for c in candidates]
            assert forwards[0] == table.forward, (lhs, rhs, kwargs)
            assert len(forwards) == len(set(forwards)) >= 2, forwards
            for candidate in candidates:
                assert _resolved(lhs, rhs, kwargs, candidate).forward == candidate.forward


@pytest.mark.cpu_only
def test_mxfp4_candidates_are_the_blocks_the_kernel_takes():
    """candidate_blocks for MXFP4 rhs tiles the forward kernel as it reads the weights (the prepared [G, K / 2, N],
    tk = K) whichever orientation the call gives them in: the table's choice first (tn = MXFP4_TN, or the gated
    N / 2 where narrower), then distinct blocks, each traced through ragged_dot's blocks= as it is (and
    checkpoint-oriented and prepared weights get the same list)."""
    spec = jax.ShapeDtypeStruct
    m, k, n, groups = 64, 256, 1024, 4
    lhs, sizes = spec((m, k), BF16), spec((groups,), jnp.int32)
    kw = dict(gated="interleaved", activation="silu", preferred_element_type=BF16)
    checkpoint = (spec((groups, n, k // 32, 16), jnp.uint8), spec((groups, n, k // 32), jnp.uint8))
    prepared = (spec((groups, k // 2, n), jnp.uint8), spec((groups, mxfp4.scale_rows(k), n), jnp.uint8))
    with jax.default_device(ladder.tpu_device("v6e")):
        candidates = api.candidate_blocks(lhs, checkpoint[0], sizes, rhs_scale=checkpoint[1], rhs_transposed=True, **kw)
        again = api.candidate_blocks(lhs, prepared[0], sizes, rhs_scale=prepared[1], **kw)
        forwards = [c.forward for c in candidates]
        assert forwards == [c.forward for c in again]
        assert len(forwards) == len(set(forwards)) >= 3, forwards
        assert forwards[0].tn == min(api.MXFP4_TN, n // 2) and all(f.tk == k for f in forwards), forwards
        for blocks in candidates:
            out = jax.eval_shape(
                functools.partial(tk.ragged_dot, rhs_transposed=True, blocks=blocks, **kw),
                lhs,
                checkpoint[0],
                sizes,
                rhs_scale=checkpoint[1],
            )
            assert out.shape == (m, n // 2)


SMALL_BLOCK_COMPILES = [
    ("f32-bias-row-scale", (56, 128), (5, 128, 256), F32, dict()),
    (
        "bf16-t-concat-gelu-bias-row-scale",
        (64, 128),
        (5, 512, 128),
        BF16,
        dict(rhs_transposed=True, gated="concatenated"),
    ),
    # a float16 result (and so a float16 cotangent in the backward): Mosaic packs no float16 on v5e or v6e
    ("bf16-t-to-f16", (7, 128), (5, 256, 128), BF16, dict(rhs_transposed=True, preferred_element_type=F16)),
]


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
@pytest.mark.parametrize("case", SMALL_BLOCK_COMPILES, ids=[c[0] for c in SMALL_BLOCK_COMPILES])
def test_small_blocks_compile_for_tpu(generation, case):
    """The tiny tilings the interpret tests force (one sublane tile of rows, 128-wide k and n) are legal Mosaic
    blocks on every generation: forward and backward, compiled (what blocks= validation promises)."""
    _, lhs, rhs, dtype, kwargs = case
    gated = kwargs.get("gated")
    n = rhs[1] if kwargs.get("rhs_transposed") else rhs[2]

    def loss(l, r, s, b, sc):
        out = api.ragged_dot(
            l,
            r,
            s,
            bias=b,
            row_scale=sc,
            activation="gelu_tanh" if gated else None,
            blocks=small_blocks(dtype),
            **kwargs,
        )
        return ladder.vjp_loss(out)

    ladder.compile_for_tpu(
        jax.grad(loss, argnums=(0, 1, 3, 4)),
        generation,
        (lhs, dtype),
        (rhs, dtype),
        ((rhs[0],), jnp.int32),
        ((rhs[0], n), dtype),
        ((lhs[0],), F32),
        label=f"ragged_dot small blocks {case[0]}",
    )


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_exact_gelu_epilogue_compiles_for_tpu(generation):
    """The exact (erf) GELU in the fused epilogue lowers with Mosaic on every generation (gated, the MoE gate/up)."""
    ladder.compile_for_tpu(
        lambda l, r, s: api.ragged_dot(l, r, s, activation="gelu", gated="concatenated"),
        generation,
        ((64, 128), BF16),
        ((4, 128, 512), BF16),
        ((4,), jnp.int32),
        label="ragged_dot gelu epilogue",
    )


# ------------------------------------------------------------------------------------------------ bad input
def _good_args(rand):
    return dict(
        lhs=rand.normal((16, 128)), rhs=rand.normal((4, 128, 256)), group_sizes=jnp.asarray([3, 0, 7, 2], jnp.int32)
    )


BAD_INPUTS = [
    ladder.BadInput(
        "rhs_transposed not a bool", dict(rhs_transposed="no"), TypeError, "rhs_transposed: expected a bool"
    ),
    ladder.BadInput("static_grid not a bool", dict(static_grid="no"), TypeError, "static_grid: expected a bool"),
    ladder.BadInput(
        "row_scale length",
        dict(row_scale=jnp.ones((15,))),
        ValueError,
        "row_scale: expected shape (16,) (lhs rows), got (15,)",
    ),
    ladder.BadInput(
        "row_scale int", dict(row_scale=jnp.ones((16,), jnp.int32)), TypeError, "row_scale: expected dtype"
    ),
    ladder.BadInput(
        "negative size",
        dict(group_sizes=jnp.asarray([3, -1, 7, 2], jnp.int32)),
        ValueError,
        "group_sizes: expected sizes >= 0, got group_sizes[1] = -1",
    ),
    ladder.BadInput(
        "sizes past M",
        dict(group_sizes=jnp.asarray([3, 9, 7, 2], jnp.int32)),
        ValueError,
        "group_sizes: the sizes sum to 21, more than lhs's 16 rows",
    ),
    ladder.BadInput(
        "contraction mismatch", dict(rhs=jnp.zeros((4, 64, 256))), ValueError, "rhs: contraction dimension 64"
    ),
    ladder.BadInput(
        "contraction mismatch transposed",
        dict(rhs=jnp.zeros((4, 128, 256)), rhs_transposed=True),
        ValueError,
        "rhs: contraction dimension 256 of rhs (4, 128, 256) (layout [G, N, K] (rhs_transposed=True))",
    ),
    ladder.BadInput("lhs int", dict(lhs=jnp.zeros((16, 128), jnp.int32)), TypeError, "lhs: expected dtype"),
    ladder.BadInput("lhs float16", dict(lhs=jnp.zeros((16, 128), F16)), TypeError, "lhs: expected dtype"),
    ladder.BadInput("rhs int", dict(rhs=jnp.zeros((4, 128, 256), jnp.int32)), TypeError, "rhs: expected dtype"),
    ladder.BadInput(
        "int8 rhs without its scale",
        lambda rand: dict(rhs=rand.integers(-127, 128, (4, 128, 256), jnp.int8)),
        ValueError,
        "rhs_scale: rhs is int8 (quantized), so its per-output-channel scale (rhs groups, N) float32 is required",
    ),
    ladder.BadInput(
        "group_sizes float",
        dict(group_sizes=jnp.asarray([3.0, 0, 7, 2])),
        TypeError,
        "group_sizes: expected dtype in (int32), got float32",
    ),
    ladder.BadInput(
        "group_sizes int64",
        dict(group_sizes=np.asarray([3, 0, 7, 2], np.int64)),
        TypeError,
        "group_sizes: expected dtype in (int32), got int64",
    ),
    ladder.BadInput("lhs rank 3", dict(lhs=jnp.zeros((2, 8, 128))), ValueError, "lhs: expected 2 dimensions"),
    ladder.BadInput("rhs rank 2", dict(rhs=jnp.zeros((128, 256))), ValueError, "rhs: expected 3 dimensions"),
    ladder.BadInput(
        "group_sizes rank 2",
        dict(group_sizes=jnp.zeros((1, 4), jnp.int32)),
        ValueError,
        "group_sizes: expected 1 dimensions",
    ),
    ladder.BadInput("lhs a list", dict(lhs=[[1.0]]), TypeError, "lhs: expected a jax array, got list"),
    ladder.BadInput(
        "rhs groups", dict(rhs=jnp.zeros((3, 128, 256))), ValueError, "rhs: expected 4 groups (len(group_sizes))"
    ),
    ladder.BadInput(
        "window too many groups",
        dict(num_local_groups=5),
        ValueError,
        "num_local_groups: expected 0 <= num_local_groups <= 4",
    ),
    ladder.BadInput(
        "window past the end",
        dict(rhs=jnp.zeros((2, 128, 256)), num_local_groups=2, group_offset=3),
        ValueError,
        "group_offset: the window [group_offset, group_offset + num_local_groups) = [3, 5)",
    ),
    ladder.BadInput(
        "window negative offset",
        dict(rhs=jnp.zeros((2, 128, 256)), num_local_groups=2, group_offset=-1),
        ValueError,
        "group_offset: the window",
    ),
    ladder.BadInput(
        "window rhs groups",
        dict(rhs=jnp.zeros((3, 128, 256)), num_local_groups=2, group_offset=1),
        ValueError,
        "rhs: expected 2 groups (the local window, num_local_groups) or 4",
    ),
    ladder.BadInput("window offset float", dict(group_offset=1.0), TypeError, "group_offset: expected an int"),
    ladder.BadInput(
        "window offset shape",
        dict(group_offset=jnp.zeros((2,), jnp.int32)),
        ValueError,
        "group_offset: expected shape () or (1,)",
    ),
    ladder.BadInput("window count float", dict(num_local_groups=2.0), TypeError, "num_local_groups: expected an int"),
    ladder.BadInput("activation", dict(activation="relu"), ValueError, "activation: expected one of"),
    ladder.BadInput("gated", dict(gated="split", activation="silu"), ValueError, "gated: expected one of"),
    ladder.BadInput(
        "gated odd N",
        dict(rhs=jnp.zeros((4, 128, 255)), gated="concatenated"),
        ValueError,
        "rhs: gated='concatenated' needs an even number of output columns N, got N = 255",
    ),
    ladder.BadInput("bias shape", dict(bias=jnp.zeros((4, 128))), ValueError, "bias: expected shape (4, 256)"),
    ladder.BadInput("bias int", dict(bias=jnp.zeros((4, 256), jnp.int32)), TypeError, "bias: expected dtype"),
    ladder.BadInput(
        "preferred_element_type int",
        dict(preferred_element_type=jnp.int32),
        TypeError,
        "preferred_element_type: expected one of",
    ),
    ladder.BadInput(
        "rhs_transposed not bool", dict(rhs_transposed="yes"), TypeError, "rhs_transposed: expected a bool"
    ),
    # blocks=: the structure, then each kernel's tiles against the layout and VMEM.
    ladder.BadInput(
        "blocks not RaggedDotBlocks",
        dict(blocks=MatmulBlocks(tm=8)),
        TypeError,
        "blocks: expected a RaggedDotBlocks or None, got MatmulBlocks",
    ),
    ladder.BadInput(
        "blocks part type",
        dict(blocks=RaggedDotBlocks(forward=TransposedMatmulBlocks())),
        TypeError,
        "blocks.forward: expected a MatmulBlocks or None, got TransposedMatmulBlocks",
    ),
    ladder.BadInput(
        "blocks tm sublanes f32",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(tm=12))),
        ValueError,
        "blocks.forward.tm: expected a multiple of 8 (the sublane tile of float32) or at least M = 16, got 12",
    ),
    ladder.BadInput(
        "blocks tm sublanes bf16",
        lambda rand: dict(
            lhs=rand.normal((32, 128), BF16),
            rhs=rand.normal((4, 128, 256), BF16),
            blocks=RaggedDotBlocks(forward=MatmulBlocks(tm=8)),
        ),
        ValueError,
        "blocks.forward.tm: expected a multiple of 16 (the sublane tile of bfloat16) or at least M = 32, got 8",
    ),
    ladder.BadInput(
        "blocks tm zero",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(tm=0))),
        ValueError,
        "blocks.forward.tm: expected a positive int, got 0",
    ),
    ladder.BadInput(
        "blocks row chunk not whole sublane tiles",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(tm=16, row_chunk=12))),
        ValueError,
        "blocks.forward.row_chunk: expected 0 or a divisor of tm = 16 that is a multiple of 8 (the sublane tile of "
        "float32), got 12",
    ),
    ladder.BadInput(
        "blocks row chunk with k split",
        lambda rand: dict(
            lhs=rand.normal((32, 256)),
            rhs=rand.normal((4, 256, 128)),
            blocks=RaggedDotBlocks(forward=MatmulBlocks(tm=16, tk=128, row_chunk=8)),
        ),
        ValueError,
        "blocks.forward.row_chunk: row chunks need all of K in one step (tk >= K = 256), got tk = 128",
    ),
    ladder.BadInput(
        "blocks row chunk bool",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(row_chunk=True))),
        TypeError,
        "blocks.forward.row_chunk: expected a non-negative int (0: whole tiles), got True",
    ),
    ladder.BadInput(
        "blocks tn float",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(tn=128.0))),
        TypeError,
        "blocks.forward.tn: expected a positive int, got float 128.0",
    ),
    ladder.BadInput(
        "blocks tk lanes",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(tk=64))),
        ValueError,
        "blocks.forward.tk: expected a multiple of 128 (lanes) or at least K = 128, got 64",
    ),
    ladder.BadInput(
        "blocks tn lanes",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(tn=100))),
        ValueError,
        "blocks.forward.tn: expected a multiple of 128 (lanes) or at least N = 256, got 100",
    ),
    ladder.BadInput(
        "blocks gated tn not a divisor",
        lambda rand: dict(
            rhs=rand.normal((4, 128, 768)),
            activation="silu",
            gated="concatenated",
            blocks=RaggedDotBlocks(forward=MatmulBlocks(tn=256)),
        ),
        ValueError,
        "blocks.forward.tn: expected a divisor of the gated output width 384",
    ),
    ladder.BadInput(
        "blocks recompute tm",
        dict(activation="silu", blocks=RaggedDotBlocks(recompute=MatmulBlocks(tm=3))),
        ValueError,
        "blocks.recompute.tm: expected a multiple of 8",
    ),
    ladder.BadInput(
        "blocks lhs_grad tk runs over N",
        dict(blocks=RaggedDotBlocks(lhs_grad=MatmulBlocks(tk=200))),
        ValueError,
        "blocks.lhs_grad.tk: expected a multiple of 128 (lanes) or at least K = 256, got 200",
    ),
    ladder.BadInput(
        "blocks rhs_grad tp",
        dict(blocks=RaggedDotBlocks(rhs_grad=TransposedMatmulBlocks(tp=64))),
        ValueError,
        "blocks.rhs_grad.tp: expected a multiple of 128 (lanes) or at least P = 128, got 64",
    ),
    ladder.BadInput(
        "blocks vmem limit past the core",
        dict(blocks=RaggedDotBlocks(forward=MatmulBlocks(vmem_limit_bytes=1 << 40))),
        ValueError,
        "blocks.forward.vmem_limit_bytes: expected 1 to",
    ),
    ladder.BadInput(
        "blocks vmem limit below the working set",
        dict(blocks=RaggedDotBlocks(rhs_grad=TransposedMatmulBlocks(vmem_limit_bytes=4096))),
        ValueError,
        "blocks.rhs_grad: these blocks need",
    ),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_INPUTS)
def test_bad_input_is_a_clear_error(rand, case):
    ladder.assert_clear_error(case, lambda arguments: tk.ragged_dot(**arguments), _good_args(rand), rand)


@pytest.mark.cpu_only
def test_bad_input_is_caught_before_tracing():
    """Shape and dtype errors come from placeholders too (what TorchTPU's export and the torch fake kernels pass)."""
    spec = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="rhs: contraction dimension"):
        jax.eval_shape(tk.ragged_dot, spec((8, 128), BF16), spec((2, 256, 64), BF16), spec((2,), jnp.int32))
    with pytest.raises(TypeError, match="group_sizes: expected dtype"):
        jax.eval_shape(tk.ragged_dot, spec((8, 128), BF16), spec((2, 128, 64), BF16), spec((2,), jnp.uint32))


# ------------------------------------------------------------------------------------------------ rung 2
@pytest.mark.cpu_only
def test_export_for_tpu():
    spec = jax.ShapeDtypeStruct
    lhs, sizes = spec((512, 2048), BF16), spec((128,), jnp.int32)
    rhs_t = spec((128, 1536, 2048), BF16)
    ladder.export_for_tpu(api.ragged_dot, lhs, spec((128, 2048, 768), BF16), sizes)
    ladder.export_for_tpu(api.ragged_dot, lhs, rhs_t, sizes, rhs_transposed=True, preferred_element_type=F32)
    ladder.export_for_tpu(
        api.ragged_dot,
        lhs,
        rhs_t,
        sizes,
        rhs_transposed=True,
        activation="silu",
        gated="concatenated",
        preferred_element_type=BF16,
    )
    ladder.export_for_tpu(
        api.ragged_dot, lhs, rhs_t, sizes, rhs_transposed=True, activation="gelu_tanh", gated="interleaved"
    )
    ladder.export_for_tpu(  # row chunks of partial visits
        functools.partial(_gate_up, activation="silu", blocks=RaggedDotBlocks(forward=MatmulBlocks(row_chunk=32))),
        lhs,
        rhs_t,
        sizes,
    )
    ladder.export_for_tpu(
        lambda l, r, s, o: api.ragged_dot(l, r, s, group_offset=o, num_local_groups=16),
        lhs,
        spec((16, 2048, 768), BF16),
        sizes,
        spec((), jnp.int32),
    )
    grad = jax.grad(
        lambda l, r, s, b: ladder.vjp_loss(
            api.ragged_dot(l, r, s, bias=b, rhs_transposed=True, activation="silu", gated="concatenated")
        ),
        argnums=(0, 1, 3),
    )
    ladder.export_for_tpu(grad, lhs, rhs_t, sizes, spec((128, 1536), BF16))


# ------------------------------------------------------------------------------------------------ rung 3
def _gate_up(lhs, rhs, sizes, *, activation, blocks=None):
    """The MoE gate/up grouped matmul as benchmarked: transformers' [E, 2I, H] weights, act(gate) * up fused."""
    return api.ragged_dot(
        lhs,
        rhs,
        sizes,
        rhs_transposed=True,
        activation=activation,
        gated="concatenated",
        preferred_element_type=BF16,
        blocks=blocks,
    )


def _down(lhs, rhs, sizes):
    """The MoE down grouped matmul as benchmarked: [E, H, I] weights, f32 output for the weighted combine."""
    return api.ragged_dot(lhs, rhs, sizes, rhs_transposed=True, preferred_element_type=F32)


def _down_weighted(lhs, rhs, sizes, scale, *, blocks=None):
    """The down grouped matmul as experts_forward's grouped path runs it: rows scaled by their routing weights in
    the epilogue, written in bf16."""
    return api.ragged_dot(
        lhs, rhs, sizes, rhs_transposed=True, row_scale=scale, preferred_element_type=BF16, blocks=blocks
    )


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_row_chunks_compile_for_tpu(generation):
    """Row chunks (MatmulBlocks.row_chunk = 32) at Qwen3's 4096-token prefill: gate/up with the fused SiLU gating and
    the weighted down projection, whose chunked visits slice the lhs, row scale and output blocks at offsets of whole
    bf16 tiles."""
    dims = MOE_MODELS["qwen3-30b-a3b"]
    h, i, rows = dims["hidden"], dims["intermediate"], 32768
    chunked = RaggedDotBlocks(forward=MatmulBlocks(row_chunk=32))
    sizes = ((MOE_EXPERTS,), jnp.int32)
    ladder.compile_for_tpu(
        functools.partial(_gate_up, blocks=chunked),
        generation,
        ((rows, h), BF16),
        ((MOE_EXPERTS, 2 * i, h), BF16),
        sizes,
        label="ragged_dot gate_up row chunks",
        activation=dims["activation"],
    )
    ladder.compile_for_tpu(
        functools.partial(_down_weighted, blocks=chunked),
        generation,
        ((rows, i), BF16),
        ((MOE_EXPERTS, h, i), BF16),
        sizes,
        ((rows,), F32),
        label="ragged_dot down row chunks",
    )


# The prefill benchmark shapes whose Mosaic kernels differ: the rows change only tm (tuning.choose_tm: M / (2 * 128
# experts) clamped to [TM_MIN_TRANSPOSED, TM_MAX], all three matmuls read transposed weights), the rest of the grid
# is its size. On v6e 4096 and 32768 rows both give the floor tm = 256 (the same kernels: 4096 stands for both) and
# 131072 the largest, tm = 512 (the VMEM-heaviest); on v5e and v7x, whose tables and VMEM differ, the largest.
PREFILL = [
    (generation, model, rows)
    for generation in ladder.GENERATIONS
    for model in MOE_MODELS
    for rows in RAGGED_DOT_PREFILL_ROWS
    if rows == max(RAGGED_DOT_PREFILL_ROWS) or (generation == "v6e" and rows == min(RAGGED_DOT_PREFILL_ROWS))
]


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation,model,rows", PREFILL, ids=[f"{m}-rows={r}-{g}" for g, m, r in PREFILL])
def test_prefill_grouped_matmuls_compile_for_tpu(generation, model, rows):
    """Both grouped matmuls of the MoE at every prefill benchmark shape (the decode shapes compile within the whole
    experts_forward, test_moe.py). Group sizes are placeholders: the compiled kernel serves any routing."""
    dims = MOE_MODELS[model]
    h, i = dims["hidden"], dims["intermediate"]
    sizes = ((MOE_EXPERTS,), jnp.int32)
    ladder.compile_for_tpu(
        _gate_up,
        generation,
        ((rows, h), BF16),
        ((MOE_EXPERTS, 2 * i, h), BF16),
        sizes,
        label=f"ragged_dot gate_up {model}",
        activation=dims["activation"],
    )
    ladder.compile_for_tpu(
        _down, generation, ((rows, i), BF16), ((MOE_EXPERTS, h, i), BF16), sizes, label=f"ragged_dot down {model}"
    )
    ladder.compile_for_tpu(
        _down_weighted,
        generation,
        ((rows, i), BF16),
        ((MOE_EXPERTS, h, i), BF16),
        sizes,
        ((rows,), F32),
        label=f"ragged_dot down with row scale {model}",
    )


def test_metadata_kernel_equals_the_jax_visit_list(rand):
    """The scalar Pallas kernel that builds the visit list writes exactly what metadata.forward_metadata_reference
    computes, for random group sizes (zeros, all-empty, windows, tail rows past the groups, several k tiles): two
    fresh draws a run, the first with every group empty (each a new static configuration, so a new interpret-mode
    compile of about four seconds; every run draws new configurations, so the runs together cover the space)."""
    for draw in range(2):
        groups = int(rand.rng.integers(1, 10))
        m = int(rand.rng.integers(1, 90))
        sizes = rand.rng.integers(0, 14, groups) * (rand.rng.random(groups) < 0.7)
        if draw == 0:  # every group empty
            sizes[:] = 0
        n_local = int(rand.rng.integers(1, groups + 1))
        offset = int(rand.rng.integers(0, groups - n_local + 1))
        kwargs = dict(
            m=m,
            tm=int(rand.rng.choice([8, 16, 32])),
            tiles_k=int(rand.rng.integers(1, 4)),
            group_offset=offset,
            num_local_groups=n_local,
            rhs_group_base=offset if rand.rng.random() < 0.5 else 0,
            rhs_groups=groups,
        )
        sizes = jnp.asarray(sizes, jnp.int32)
        expected, expected_count, _ = metadata.forward_metadata_reference(sizes, **kwargs)
        actual, count = ladder.run_kernel(lambda s: metadata.forward_metadata(s, **kwargs)[:2], sizes)
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=f"{kwargs} sizes={sizes}")
        assert int(count) == int(expected_count)
        # The weight prefetch's fields, against a plain walk over the visits' groups: runs of one group alternate
        # buffers, and each visit names the group of the run after its own (-1 after the last).
        V = (len(expected) - 1) // metadata.NUM_FIELDS
        field = lambda f: [int(x) for x in np.asarray(expected)[f * V : (f + 1) * V]]  # noqa: E731
        groups_of_visits, slots, nexts = field(metadata.F_GROUP), field(metadata.F_WSLOT), field(metadata.F_NEXT_GROUP)
        slot = 0
        for v in range(V):
            if v and groups_of_visits[v] != groups_of_visits[v - 1]:
                slot = 1 - slot
            later = [g for g in groups_of_visits[v:] if g != groups_of_visits[v]]
            assert slots[v] == slot and nexts[v] == (later[0] if later else -1), (v, groups_of_visits, slots, nexts)


# (E, rows, cols) weights: Gemma 4's down_proj, its transpose, and small shapes where one orientation pads less.
STORED_LAYOUT_SHAPES = [(128, 2816, 704), (128, 704, 2816), (4, 256, 200), (4, 96, 64), (4, 2048, 768), (16, 256, 8)]


def _entry_layout(compiled) -> str:
    """minor_to_major of the first parameter in the compiled program's entry layout, e.g. "2,1,0"."""
    return re.search(r"entry_computation_layout=\{\(\w+\[[\d,]*\]\{([\d,]+)", compiled.as_text()).group(1)


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_stored_orientation_rule_matches_the_compiler(generation):
    """tuning.stored_minor_to_major_swapped predicts the layout XLA gives a weight array (its default layout)."""
    for shape in STORED_LAYOUT_SHAPES:
        with jax.default_device(ladder.tpu_device(generation)):
            compiled = jax.jit(lambda w: w.sum()).lower(ladder.tpu_spec(generation, shape, BF16)).compile()
        swapped = _entry_layout(compiled) == "1,2,0"
        assert swapped == tuning.stored_minor_to_major_swapped(shape[1], shape[2]), (shape, _entry_layout(compiled))


@pytest.mark.cpu_only
def test_weights_stored_swapped_are_not_copied():
    """A transposed rhs [E, N, K] that XLA stores as [E, K, N] (K = 200 pads more on the lanes) reaches the kernel
    as a bitcast: no relayout copy of the weights in the compiled program (Gemma 4's down_proj cost 3 ms a call)."""
    shapes = (((64, 200), BF16), ((8, 256, 200), BF16), ((8,), jnp.int32))
    with jax.default_device(ladder.tpu_device("v6e")):
        compiled = jax.jit(_down).lower(*[ladder.tpu_spec("v6e", *sd) for sd in shapes]).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    copies = [
        line for line in text.splitlines() if " copy(" in line and ("[8,256,200]" in line or "[8,200,256]" in line)
    ]
    assert not copies, copies


def test_weights_stored_swapped_give_the_same_result(rand):
    """The swapped orientation (kernel reads [E, K, N]) computes the same grouped matmul."""
    lhs = rand.normal((40, 200), F32)
    rhs = rand.normal((8, 256, 200), F32)
    sizes = group_sizes(rand, 8, 37)  # 3 tail rows past the groups
    assert tuning.stored_minor_to_major_swapped(256, 200)
    ladder.check_against_reference(
        functools.partial(api.ragged_dot, rhs_transposed=True),
        functools.partial(ragged_dot_reference, rhs_transposed=True),
        (lhs, rhs, sizes),
        dtype=F32,
        rand=rand,
    )


# The backward: d lhs through the forward kernel, d rhs through the transposed grouped matmul, the epilogue
# recomputed.
# (generation, model, op, rows): gate/up (fused epilogue) at a decode shape (B = 64, top-8), down at a prefill one.
BACKWARD = [("v6e", "qwen3-30b-a3b", "gate_up", 512), ("v7x", "gemma4-26b-a4b", "down", RAGGED_DOT_PREFILL_ROWS[0])]


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation,model,op,rows", BACKWARD, ids=[f"{g}-{m}-{o}-rows={r}" for g, m, o, r in BACKWARD])
def test_backward_compiles_for_tpu(generation, model, op, rows):
    dims = MOE_MODELS[model]
    h, i = dims["hidden"], dims["intermediate"]
    if op == "gate_up":
        fn = lambda l, r, s: ladder.vjp_loss(_gate_up(l, r, s, activation=dims["activation"]))  # noqa: E731
        lhs, rhs = ((rows, h), BF16), ((MOE_EXPERTS, 2 * i, h), BF16)
    else:
        fn = lambda l, r, s: ladder.vjp_loss(_down(l, r, s))  # noqa: E731
        lhs, rhs = ((rows, i), BF16), ((MOE_EXPERTS, h, i), BF16)
    ladder.compile_for_tpu(
        jax.grad(fn, argnums=(0, 1)),
        generation,
        lhs,
        rhs,
        ((MOE_EXPERTS,), jnp.int32),
        label=f"ragged_dot {op} backward {model}",
    )


@pytest.mark.cpu_only
def test_mxfp4_rhs_gradient_is_refused():
    """MXFP4 rhs is for inference: a gradient through the ragged dot (here the lhs', which would need the widened
    rhs in the transposed matmul) raises NotImplementedError saying so, when the backward is traced (abstract
    inputs: nothing runs)."""
    m, k, n, groups = 24, 128, 64, 4
    specs = (
        jax.ShapeDtypeStruct((m, k), F32),
        jax.ShapeDtypeStruct((groups, n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((groups, n, k // 32), jnp.uint8),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    )

    def loss(lhs, blocks, scales, sizes):
        return tk.ragged_dot(lhs, blocks, sizes, rhs_scale=scales, rhs_transposed=True).sum()

    assert jax.eval_shape(loss, *specs).shape == ()  # the forward traces
    with pytest.raises(NotImplementedError, match="ragged_dot: MXFP4 rhs is for inference; no gradient flows"):
        jax.eval_shape(jax.grad(loss), *specs)
