"""RMSNorm, JAX side, up the ladder: reference vs kernel (interpret mode), gradients, bad input, TPU export,
deviceless compile for v5e / v6e / v7x at one benchmark shape per distinct kernel. Tilings other than the table's are
forced through `blocks=`."""

import contextlib

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest

from benchmarks.shapes import RMS_NORM_HIDDENS, RMS_NORM_TOKENS
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.common.blocks import sublane_multiple
from tpu_kernels_jax.rms_norm import api, tuning
from tpu_kernels_jax.rms_norm.reference import fused_add_rms_norm_reference, rms_norm_reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Hidden sizes from 64 to 16384, with sizes that are not multiples of 128 (200, 1000, 2816).
HIDDENS = [64, 200, 1000, 2048, 2816, 16384]
LEADING = [(1,), (7,), (3, 5), (130,)]
SMALL_SLAB_BYTES = 4096


def small_blocks(hidden, dtype) -> tk.RmsNormBlocks:
    """Row blocks of a 4 KiB slab (at least one sublane tile of rows, in the dtype the kernels run in: float16 runs
    as float32), so grids of many steps and a ragged last row block are exercised at small test shapes."""
    dtype = jnp.dtype(jnp.float32 if jnp.dtype(dtype) == jnp.float16 else dtype)
    multiple = sublane_multiple(dtype)
    return tk.RmsNormBlocks(
        block_rows=max(multiple, SMALL_SLAB_BYTES // (hidden * dtype.itemsize) // multiple * multiple)
    )


@pytest.fixture(params=["tuned_blocks", "small_blocks"])
def blocks_for(request):
    """blocks_for(hidden, dtype): None (the tuning table's) or small_blocks: each check runs with both."""
    return small_blocks if request.param == "small_blocks" else (lambda hidden, dtype: None)


WEIGHT_KINDS = ["weight", "no_weight", "offset_weight"]


def blocks_cases(hiddens, dtypes_of):
    """(blocks kind, hidden, dtype) cases: every hidden size with both tilings, each with the dtypes dtypes_of(index of
    the hidden size, 0 tuned / 1 small) names; ids as the full product's (blocks-hidden-dtype)."""
    return [
        pytest.param(kind, hidden, dtype, id=f"{kind}-{hidden}-{jnp.dtype(dtype).name}")
        for h, hidden in enumerate(hiddens)
        for b, kind in enumerate(("tuned_blocks", "small_blocks"))
        for dtype in dtypes_of(h, b)
    ]


# Each hidden size runs once per tiling (one block / many steps with a ragged last block), the dtype rotating so every
# dtype meets both tilings and, through the weight kind's rotation below, every weight kind: 12 cases instead of the
# 36 of the full product, which repeat these code paths.
@pytest.mark.parametrize(
    "blocks_for,hidden,dtype",
    blocks_cases(HIDDENS, lambda h, b: [DTYPES[(h + b + h // 3) % len(DTYPES)]]),
    indirect=["blocks_for"],
)
def test_rms_norm_matches_reference(rand, blocks_for, dtype, hidden):
    # The weight kind rotates with (hidden, dtype): with the dtype rotation above, every dtype meets every kind.
    weight_kind = WEIGHT_KINDS[(HIDDENS.index(hidden) + DTYPES.index(dtype)) % len(WEIGHT_KINDS)]
    leading = LEADING[HIDDENS.index(hidden) % len(LEADING)]  # 1 to 130 rows: one block, or many with small blocks
    x = rand.normal(leading + (hidden,), dtype, scale=3.0, offset=0.5)
    weight = None if weight_kind == "no_weight" else rand.normal((hidden,), dtype)
    offset = 1.0 if weight_kind == "offset_weight" else 0.0
    eps = float(rand.uniform((), 1e-6, 1e-2))
    blocks = blocks_for(hidden, dtype)
    ladder.check_against_reference(
        lambda x, w: tk.rms_norm(x, w, eps, weight_offset=offset, blocks=blocks),
        lambda x, w: rms_norm_reference(x, w, eps, weight_offset=offset),
        (x, weight),
        dtype=dtype,
        rand=rand,
        jit_kernel=True,
    )


# Each hidden size (under a lane tile, ragged lanes, many lane tiles) in one dtype of its own, with both tilings: every
# dtype and every hidden size meets both tilings.
@pytest.mark.parametrize(
    "blocks_for,hidden,dtype",
    blocks_cases([64, 200, 4096], lambda h, b: [DTYPES[h]]),
    indirect=["blocks_for"],
)
def test_fused_add_rms_norm_matches_reference(rand, blocks_for, dtype, hidden):
    x = rand.normal((37, hidden), dtype)
    residual = rand.normal((37, hidden), dtype, scale=2.0)
    weight = rand.normal((hidden,), jnp.float32)
    blocks = blocks_for(hidden, dtype)
    out, total = ladder.check_against_reference(
        lambda x, r, w: tk.fused_add_rms_norm(x, r, w, 1e-5, blocks=blocks),
        lambda x, r, w: fused_add_rms_norm_reference(x, r, w, 1e-5),
        (x, residual, weight),
        dtype=dtype,
        rand=rand,
        names=["normed", "sum"],
        jit_kernel=True,
    )
    # The sum output is exact: the f32 sum rounded once to x.dtype (the reference's formula, on the host: no eager XLA
    # compiles of the reference's ops).
    expected_total = (np.asarray(x).astype(np.float32) + np.asarray(residual).astype(np.float32)).astype(total.dtype)
    assert total.dtype == x.dtype and np.array_equal(np.asarray(total), expected_total), (
        f"sum output differs from x + residual ({rand})"
    )


@pytest.mark.parametrize("fn", ["rms_norm", "fused_add_rms_norm"])
def test_zero_rows_give_an_empty_result(rand, fn):
    x = rand.normal((0, 256), jnp.bfloat16)
    weight = rand.normal((256,), jnp.bfloat16)
    if fn == "rms_norm":
        outs = [ladder.run_kernel(tk.rms_norm, x, weight)]
    else:
        outs = ladder.run_kernel(tk.fused_add_rms_norm, x, x, weight)
    for out in outs:
        assert out.shape == (0, 256) and out.dtype == jnp.bfloat16


# Each dtype meets each tiling and both weight options once (4 of the 8 combinations).
@pytest.mark.parametrize(
    "blocks_for,with_weight,dtype",
    [
        pytest.param("small_blocks", True, jnp.float32, id="small_blocks-True-float32"),
        pytest.param("small_blocks", False, jnp.bfloat16, id="small_blocks-False-bfloat16"),
        pytest.param("tuned_blocks", True, jnp.bfloat16, id="tuned_blocks-True-bfloat16"),
        pytest.param("tuned_blocks", False, jnp.float32, id="tuned_blocks-False-float32"),
    ],
    indirect=["blocks_for"],
)
def test_rms_norm_gradients(rand, blocks_for, dtype, with_weight):
    x = rand.normal((45, 384), dtype, scale=2.0)
    weight = rand.normal((384,), dtype) if with_weight else None
    blocks = blocks_for(384, dtype)
    # The weight gradient sums over every row: bf16 inputs carry their rounding into a long f32 sum.
    ladder.check_gradients(
        lambda x, w: tk.rms_norm(x, w, 1e-5, weight_offset=0.5, blocks=blocks),
        lambda x, w: rms_norm_reference(x, w, 1e-5, weight_offset=0.5),
        (x, weight),
        argnums=(0, 1) if with_weight else (0,),
        names=["d x", "d weight"] if with_weight else ["d x"],
        rand=rand,
        dtype=dtype,
        atol=5e-2 if dtype == jnp.bfloat16 else 1e-4,
    )


# Each dtype once, each tiling once.
@pytest.mark.parametrize(
    "blocks_for,dtype",
    [
        pytest.param("small_blocks", jnp.float32, id="small_blocks-float32"),
        pytest.param("tuned_blocks", jnp.bfloat16, id="tuned_blocks-bfloat16"),
    ],
    indirect=["blocks_for"],
)
def test_fused_add_rms_norm_gradients(rand, blocks_for, dtype):
    x = rand.normal((33, 256), dtype)
    residual = rand.normal((33, 256), dtype)
    weight = rand.normal((256,), jnp.float32)
    blocks = blocks_for(256, dtype)
    ladder.check_gradients(
        lambda x, r, w: tk.fused_add_rms_norm(x, r, w, blocks=blocks),
        fused_add_rms_norm_reference,
        (x, residual, weight),
        argnums=(0, 1, 2),
        names=["d x", "d residual", "d weight"],
        rand=rand,
        dtype=dtype,
        atol=5e-2 if dtype == jnp.bfloat16 else 1e-4,
    )


# ------------------------------------------------------------------------------------------------- random draws
@ladder.random_draws
def test_random_draw(rand, draw):
    """Sizes (a single row, lanes under a tile, ragged lanes, many row blocks), dtype, weight kind, the residual and
    the tiling drawn at random; the forward, or the gradients (float32 and bfloat16, up to 33 rows), against the
    reference."""
    dtype = rand.draw("dtype", DTYPES)
    gradients = dtype != jnp.float16 and rand.draw("gradients", [False, True])
    hidden = rand.draw("hidden", [1, 64, 100, 128, 200, 384, 1000, 2048, 2816])
    leading = rand.draw("leading", [(1,), (7,), (3, 5), (33,)] + ([] if gradients else [(130,), (2, 1, 9)]))
    weight_kind = rand.draw("weight", WEIGHT_KINDS)
    fused = rand.draw("fused_add", [False, True])
    blocks = rand.draw("blocks", ["tuned_blocks", "small_blocks"])
    blocks = small_blocks(hidden, dtype) if blocks == "small_blocks" else None
    x = rand.normal(leading + (hidden,), dtype, scale=3.0, offset=0.5)
    residual = rand.normal(leading + (hidden,), dtype, scale=2.0)
    weight = (
        None if weight_kind == "no_weight" else rand.normal((hidden,), rand.draw("weight_dtype", [dtype, jnp.float32]))
    )
    offset = 1.0 if weight_kind == "offset_weight" else 0.0
    if fused:
        kernel = lambda x, r, w: tk.fused_add_rms_norm(x, r, w, 1e-5, weight_offset=offset, blocks=blocks)  # noqa: E731
        reference = lambda x, r, w: fused_add_rms_norm_reference(x, r, w, 1e-5, weight_offset=offset)  # noqa: E731
        args, names = (x, residual, weight), {0: "d x", 1: "d residual", 2: "d weight"}
    else:
        kernel = lambda x, w: tk.rms_norm(x, w, 1e-5, weight_offset=offset, blocks=blocks)  # noqa: E731
        reference = lambda x, w: rms_norm_reference(x, w, 1e-5, weight_offset=offset)  # noqa: E731
        args, names = (x, weight), {0: "d x", 1: "d weight"}
    if not gradients:
        ladder.check_against_reference(kernel, reference, args, dtype=dtype, rand=rand, jit_kernel=True)
        return
    argnums, names = ladder.differentiated(args, names)
    atol = 5e-2 if dtype == jnp.bfloat16 else 1e-4
    ladder.check_gradients(kernel, reference, args, argnums=argnums, names=names, rand=rand, dtype=dtype, atol=atol)


@pytest.mark.cpu_only
@pytest.mark.parametrize("fn", ["rms_norm", "fused_add_rms_norm"])
def test_blocks_reach_the_forward_and_backward_kernels(fn):
    """A gradient runs the backward kernel with the blocks its forward was given (the custom_vjp's static blocks);
    vmem_limit_bytes left None is derived from the blocks, a given one is passed through."""
    x, w = jax.ShapeDtypeStruct((100, 256), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.float32)
    for blocks, limit in ((tk.RmsNormBlocks(block_rows=16), 16 << 20), (tk.RmsNormBlocks(24, 20 << 20), 20 << 20)):
        if fn == "rms_norm":
            op = lambda x, w: tk.rms_norm(x, w, blocks=blocks)  # noqa: E731
        else:
            op = lambda x, w: tk.fused_add_rms_norm(x, x, w, blocks=blocks)  # noqa: E731
        calls = ladder.pallas_calls(jax.grad(lambda x, w: ladder.vjp_loss(op(x, w)), argnums=(0, 1)), x, w)
        steps = -(-100 // blocks.block_rows)
        assert [(c.name, c.grid, c.vmem_limit_bytes) for c in calls] == [
            ("rms_norm_fwd", (steps,), limit),
            ("rms_norm_bwd", (steps,), limit),
        ], calls
    # The table's choice is what blocks=None and RmsNormBlocks() run with.
    table = tuning.choose_blocks(100, 256, jnp.float32, streams=api.STREAMS)
    for blocks in (None, tk.RmsNormBlocks()):
        calls = ladder.pallas_calls(lambda x, w: tk.rms_norm(x, w, blocks=blocks), x, w)
        assert [(c.grid, c.vmem_limit_bytes) for c in calls] == [((1,), table.vmem_limit_bytes)], calls


# ------------------------------------------------------------------------------------------------------ bad input
BadInput = ladder.BadInput
# A working set of 256 rows of 8192 f32 (88 MiB with the 4 row streams double-buffered and the f32 temporaries): more
# than a v7x core's 64 MiB of VMEM, within the 96 MiB a v6e kernel may ask for.
BIG_X = jax.ShapeDtypeStruct((4096, 8192), jnp.float32)
BAD_INPUTS = [
    BadInput("x scalar", lambda r: dict(x=r.normal((), jnp.float32)), ValueError, "x: expected at least 1 dimension"),
    BadInput("x empty hidden", lambda r: dict(x=r.normal((4, 0))), ValueError, "x: expected a non-empty last"),
    BadInput("x int", lambda r: dict(x=r.integers(0, 9, (4, 128))), TypeError, "x: expected dtype"),
    BadInput("x float64", dict(x=jax.ShapeDtypeStruct((4, 128), jnp.float64)), TypeError, "got float64"),
    BadInput("x a list", dict(x=[[1.0, 2.0]]), TypeError, "x: expected a jax array, got list"),
    BadInput("weight length", lambda r: dict(weight=r.normal((127,))), ValueError, "weight: expected shape (128,)"),
    BadInput("weight rank", lambda r: dict(weight=r.normal((1, 128))), ValueError, "weight: expected 1 dimensions"),
    BadInput("weight int", lambda r: dict(weight=r.integers(0, 3, (128,))), TypeError, "weight: expected dtype"),
    BadInput("eps negative", dict(eps=-1e-6), ValueError, "eps: expected a finite number >= 0, got -1e-06"),
    BadInput("eps nan", dict(eps=float("nan")), ValueError, "eps: expected a finite number >= 0, got nan"),
    BadInput("eps inf", dict(eps=float("inf")), ValueError, "eps: expected a finite number >= 0, got inf"),
    BadInput("eps array", dict(eps=jnp.float32(1e-6)), TypeError, "eps: expected a Python float"),
    BadInput("offset nan", dict(weight_offset=float("nan")), ValueError, "weight_offset: expected a finite"),
    BadInput(
        "residual shape", lambda r: dict(residual=r.normal((4, 64))), ValueError, "residual: expected the shape of x"
    ),
    BadInput(
        "residual dtype",
        lambda r: dict(residual=r.normal((4, 128), jnp.bfloat16)),
        TypeError,
        "residual: expected dtype",
    ),
    BadInput("blocks a dict", dict(blocks={"block_rows": 8}), TypeError, "blocks: expected an RmsNormBlocks or None"),
    BadInput(
        "blocks of another kernel",
        dict(blocks=tk.RotaryBlocks(1, 8)),
        TypeError,
        "blocks: expected an RmsNormBlocks or None, got RotaryBlocks",
    ),
    BadInput(
        "block_rows a float",
        dict(blocks=tk.RmsNormBlocks(block_rows=8.0)),
        TypeError,
        "blocks.block_rows: expected a positive int, got float 8.0",
    ),
    BadInput(
        "block_rows 0", dict(blocks=tk.RmsNormBlocks(0)), ValueError, "blocks.block_rows: expected a positive int"
    ),
    BadInput(
        "block_rows not a sublane multiple",
        lambda r: dict(x=r.normal((40, 128)), blocks=tk.RmsNormBlocks(12)),
        ValueError,
        "blocks.block_rows: expected a multiple of 8 (the sublane tile of float32 rows",
    ),
    BadInput(
        "block_rows not a bf16 sublane multiple",
        lambda r: dict(x=r.normal((40, 128), jnp.bfloat16), blocks=tk.RmsNormBlocks(8)),
        ValueError,
        "blocks.block_rows: expected a multiple of 16 (the sublane tile of bfloat16 rows",
    ),
    BadInput(
        "residual call block_rows not a sublane multiple",
        lambda r: dict(x=r.normal((40, 128)), residual=r.normal((40, 128)), blocks=tk.RmsNormBlocks(20)),
        ValueError,
        "blocks.block_rows: expected a multiple of 8",
    ),
    BadInput(
        "vmem_limit_bytes over the core's VMEM",
        dict(blocks=tk.RmsNormBlocks(8, 1 << 40)),
        ValueError,
        "blocks.vmem_limit_bytes: expected 1 to 134217728 bytes (the VMEM of a v6e core)",
    ),
    BadInput(
        "vmem_limit_bytes a float",
        dict(blocks=tk.RmsNormBlocks(8, 16e6)),
        TypeError,
        "blocks.vmem_limit_bytes: expected a positive int",
    ),
    BadInput(
        "blocks too large for v7x VMEM",
        dict(x=BIG_X, weight=None, blocks=tk.RmsNormBlocks(256), generation="v7x"),
        ValueError,
        "blocks: these blocks need 88.1 MiB of VMEM, more than the 64 MiB of a v7x core",
    ),
    BadInput(
        "blocks over the vmem limit given",
        dict(x=BIG_X, weight=None, blocks=tk.RmsNormBlocks(256, 64 << 20), generation="v6e"),
        ValueError,
        "blocks: these blocks need 88.1 MiB of VMEM, more than the vmem_limit_bytes of 64.0 MiB on v6e",
    ),
]


def _call_rms_norm(args):
    """rms_norm, or fused_add_rms_norm when a residual is given; traced for `generation` when given (else the
    CPU host's default target, v6e)."""
    args = dict(args)
    generation, residual = args.pop("generation", None), args.pop("residual", None)
    x, weight, eps = args.pop("x"), args.pop("weight"), args.pop("eps")
    with jax.default_device(ladder.tpu_device(generation)) if generation else contextlib.nullcontext():
        if residual is None:
            return tk.rms_norm(x, weight, eps, **args)
        return tk.fused_add_rms_norm(x, residual, weight, eps, **args)


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_INPUTS)
def test_bad_input_is_a_clear_error(rand, case):
    good = dict(x=rand.normal((4, 128)), weight=rand.normal((128,)), eps=1e-6, weight_offset=0.0)
    ladder.assert_clear_error(case, _call_rms_norm, good, rand)


@pytest.mark.cpu_only
@pytest.mark.parametrize("fn", ["rms_norm_backward", "fused_add_rms_norm_gradient"])
def test_bad_blocks_of_the_backward_are_a_clear_error(rand, fn):
    x = rand.normal((40, 128), jnp.bfloat16)
    bad = tk.RmsNormBlocks(block_rows=24)
    with pytest.raises(ValueError, match=r"blocks\.block_rows: expected a multiple of 16"):
        if fn == "rms_norm_backward":
            tk.rms_norm_backward(x, x, None, blocks=bad)
        else:
            jax.grad(lambda x: ladder.vjp_loss(tk.fused_add_rms_norm(x, x, blocks=bad)))(x)


@pytest.mark.cpu_only
def test_blocks_fit_is_judged_per_generation():
    """The blocks too large for a v7x core fit a v6e one: the VMEM check reads the generation being traced for."""
    blocks = tk.RmsNormBlocks(block_rows=256)
    with jax.default_device(ladder.tpu_device("v6e")):
        calls = ladder.pallas_calls(lambda x: tk.rms_norm(x, blocks=blocks), BIG_X)
    assert [c.grid for c in calls] == [(16,)], calls
    assert 88 << 20 < calls[0].vmem_limit_bytes <= 96 << 20, calls  # derived: the working set fits under it


@pytest.mark.cpu_only
def test_hidden_too_large_for_vmem_is_a_clear_error(rand):
    with pytest.raises(ValueError, match="x: hidden size .* too large"):
        jax.eval_shape(tk.rms_norm, jax.ShapeDtypeStruct((64, 1 << 24), jnp.float32))


# ------------------------------------------------------------------------------------------------ rungs 2 and 3
@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_export_for_tpu(dtype):
    x = jax.ShapeDtypeStruct((64, 2048), dtype)
    w = jax.ShapeDtypeStruct((2048,), dtype)
    ladder.export_for_tpu(api.rms_norm, x, w)
    ladder.export_for_tpu(api.rms_norm, x, None)
    ladder.export_for_tpu(api.fused_add_rms_norm, x, x, w)
    ladder.export_for_tpu(api.rms_norm_backward, x, x, w)
    grad = jax.grad(lambda x, r, w: ladder.vjp_loss(api.fused_add_rms_norm(x, r, w)), argnums=(0, 1, 2))
    ladder.export_for_tpu(grad, x, x, w)


BENCH_TOKENS = list(RMS_NORM_TOKENS)  # the benchmark shapes, declared once in benchmarks/shapes.py
BENCH_HIDDENS = list(RMS_NORM_HIDDENS)


# One benchmark shape per distinct Mosaic kernel: the kernel body depends on the block table's entry (block_rows,
# vmem_limit_bytes), the hidden size and the dtype, not on the grid size. On v6e (the generation the benchmarks model)
# the table gives block_rows = tokens for 1 to 64 tokens (one block; 1 and 8 rows both under a bf16 sublane tile, so
# 1 stands for 8; 64 rows at one hidden size), 512 rows at 512 x 2048, and one entry per hidden size from 4096 tokens
# up (1024 rows at 2048, 512 rows and 84 MiB at 4096, also 512 x 4096's): 32768 tokens stands for 4096 (same entry,
# the most grid steps) and is the VMEM-heaviest. v5e and v7x at 32768 tokens, where their entries differ from v6e's
# (256 / 512 rows on v5e, 288 / 576 rows and a 47 MiB limit on v7x); at 1 token they share v6e's entry.
BENCH_COMPILES = [("v6e", t, h) for t, h in ((1, 2048), (1, 4096), (64, 4096), (512, 2048))] + [
    (g, BENCH_TOKENS[-1], h) for g in ladder.GENERATIONS for h in BENCH_HIDDENS
]


# The candidates' compile (test_candidate_blocks_compile_for_tpu) runs at the largest shape, 32768 x 4096, on v6e and
# v7x: its first candidate, the table's entry, is that shape's fused_add_rms_norm (forward and backward) there.
CANDIDATE_GENERATIONS = ("v6e", "v7x")
CANDIDATE_SHAPE = (BENCH_TOKENS[-1], 4096)


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation,tokens,hidden", BENCH_COMPILES)
def test_compiles_for_tpu_at_benchmark_shapes(generation, tokens, hidden):
    x = ((tokens, hidden), jnp.bfloat16)
    w = ((hidden,), jnp.bfloat16)
    ladder.compile_for_tpu(api.rms_norm, generation, x, w, label="rms_norm")
    if generation not in CANDIDATE_GENERATIONS or (tokens, hidden) != CANDIDATE_SHAPE:
        ladder.compile_for_tpu(api.fused_add_rms_norm, generation, x, x, w, label="fused_add_rms_norm")


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    "shape,dtype,generation",
    [pytest.param((4096, 16384), jnp.float32, g, id=f"16384xf32-{g}") for g in ladder.GENERATIONS]
    + [
        pytest.param((1000, 200), jnp.bfloat16, "v5e", id="200xbf16-v5e"),
        pytest.param((9, 64), jnp.float16, "v7x", id="64xf16-v7x"),
    ],
)
def test_compiles_for_tpu_across_sizes_and_backward(generation, shape, dtype):
    """Forward (with and without weight) and both backwards compile. The VMEM-heaviest shape (16384 f32: the fewest
    rows per block, table entries that differ per generation) on every generation. Ragged lanes in bf16 (200 wide,
    one 1000-row block: the same entry on every generation) on v5e, whose missing bf16 VPU makes its lowering the one
    that differs; float16 (runs as float32; 9 rows, one block, the same entry everywhere) on one generation. A 2816-wide
    f32 shape was the 16384 one's path (128-multiple lanes, f32, many row blocks) with another block count."""
    x = (shape, dtype)
    w = ((shape[-1],), dtype)
    ladder.compile_for_tpu(api.rms_norm, generation, x, w, label="rms_norm")
    ladder.compile_for_tpu(api.rms_norm, generation, x, None, label="rms_norm_no_weight")
    ladder.compile_for_tpu(api.rms_norm_backward, generation, x, x, w, label="rms_norm_backward")
    ladder.compile_for_tpu(
        lambda g, s, gs, w: api.rms_norm_backward(g, s, w, grad_sum=gs),
        generation,
        x,
        x,
        x,
        w,
        label="fused_add_rms_norm_backward",
    )


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", CANDIDATE_GENERATIONS)
def test_candidate_blocks_compile_for_tpu(generation):
    """The sweep's candidates (the table's choice first) are legal tilings at the largest benchmark shape. They differ
    only in their row block (whole sublane tiles, asserted), so the kernel's body is the same and only VMEM grows
    with the block: the table's choice (also that shape's fused_add_rms_norm compile) and the largest candidate (often
    the same: the table takes the largest block that fits) compile, forward and backward, and bound every other one."""
    x = (CANDIDATE_SHAPE, jnp.bfloat16)
    w = ((CANDIDATE_SHAPE[1],), jnp.bfloat16)
    with jax.default_device(ladder.tpu_device(generation)):
        candidates = tuning.candidate_blocks(**api.tuning_arguments(jax.ShapeDtypeStruct(*x)))
    table = tuning.choose_blocks(*CANDIDATE_SHAPE, jnp.bfloat16, streams=4, info=api.chip.tpu_info_for(generation))
    assert candidates[0] == table and len(candidates) >= 3, candidates
    assert len({c.block_rows for c in candidates}) == len(candidates), candidates
    multiple = tuning.sublane_multiple(jnp.bfloat16)
    assert all(c.block_rows % multiple == 0 for c in candidates), candidates
    largest = max(candidates, key=lambda c: c.block_rows)
    for blocks in dict.fromkeys((candidates[0], largest)):
        ladder.compile_for_tpu(
            jax.grad(lambda x, w: ladder.vjp_loss(api.fused_add_rms_norm(x, x, w, blocks=blocks)), argnums=(0, 1)),
            generation,
            x,
            w,
            label=f"fused_add_rms_norm gradient, {blocks.block_rows}-row blocks",
            min_kernels=2,
        )


@pytest.mark.cpu_only
def test_tuning_follows_the_traced_generation():
    """The block choice reads the chip being compiled for: v5e gets smaller slabs than v6e."""
    blocks = {}
    for generation in ("v5e", "v6e"):
        with jax.default_device(ladder.tpu_device(generation)):
            info = api.chip.current_tpu_info()
        blocks[generation] = tuning.choose_blocks(32768, 4096, jnp.bfloat16, streams=4, info=info).block_rows
    assert blocks["v5e"] < blocks["v6e"], blocks
