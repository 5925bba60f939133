"""RMSNorm, JAX side, up the ladder: reference vs kernel (interpret mode), gradients, bad input, TPU export,
deviceless compile for v5e / v6e / v7x at every benchmark shape."""

import jax
import jax.numpy as jnp
import ladder
import pytest

from benchmarks.shapes import RMS_NORM_HIDDENS, RMS_NORM_TOKENS
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.rms_norm import api, tuning
from tpu_kernels_jax.rms_norm.reference import fused_add_rms_norm_reference, rms_norm_reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Hidden sizes from 64 to 16384, with sizes that are not multiples of 128 (200, 1000, 2816).
HIDDENS = [64, 200, 1000, 2048, 2816, 16384]
LEADING = [(1,), (7,), (3, 5), (130,)]


@pytest.fixture(params=["tuned_blocks", "small_blocks"])
def block_regime(request, monkeypatch):
    """Run each check with the tuned blocks and with tiny ones, so grids of many steps and a ragged last row block
    (rows not a multiple of block_rows) are exercised even at small test shapes."""
    if request.param == "small_blocks":
        monkeypatch.setattr(tuning, "TARGET_SLAB_BYTES", {g: 4096 for g in tuning.TARGET_SLAB_BYTES})
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("weight_kind", ["weight", "no_weight", "offset_weight"])
def test_rms_norm_matches_reference(rand, block_regime, dtype, hidden, weight_kind):
    leading = LEADING[hidden % len(LEADING)]
    x = rand.normal(leading + (hidden,), dtype, scale=3.0, offset=0.5)
    weight = None if weight_kind == "no_weight" else rand.normal((hidden,), dtype)
    offset = 1.0 if weight_kind == "offset_weight" else 0.0
    eps = float(rand.uniform((), 1e-6, 1e-2))
    ladder.check_against_reference(
        lambda x, w: tk.rms_norm(x, w, eps, weight_offset=offset),
        lambda x, w: rms_norm_reference(x, w, eps, weight_offset=offset),
        (x, weight),
        dtype=dtype,
        rand=rand,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", [64, 200, 4096])
def test_fused_add_rms_norm_matches_reference(rand, block_regime, dtype, hidden):
    x = rand.normal((37, hidden), dtype)
    residual = rand.normal((37, hidden), dtype, scale=2.0)
    weight = rand.normal((hidden,), jnp.float32)
    out, total = ladder.check_against_reference(
        lambda x, r, w: tk.fused_add_rms_norm(x, r, w, 1e-5),
        lambda x, r, w: fused_add_rms_norm_reference(x, r, w, 1e-5),
        (x, residual, weight),
        dtype=dtype,
        rand=rand,
        names=["normed", "sum"],
    )
    # The sum output is exact: the f32 sum rounded once to x.dtype.
    _, expected_total = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert bool(jnp.all(total == expected_total)), f"sum output differs from x + residual ({rand})"


@pytest.mark.parametrize("fn", ["rms_norm", "fused_add_rms_norm"])
def test_zero_rows_give_an_empty_result(rand, fn):
    x = rand.normal((0, 256), jnp.bfloat16)
    weight = rand.normal((256,), jnp.bfloat16)
    if fn == "rms_norm":
        outs = [ladder.run_interpreted(tk.rms_norm, x, weight)]
    else:
        outs = ladder.run_interpreted(tk.fused_add_rms_norm, x, x, weight)
    for out in outs:
        assert out.shape == (0, 256) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_gradients(rand, block_regime, dtype, with_weight):
    x = rand.normal((45, 384), dtype, scale=2.0)
    weight = rand.normal((384,), dtype) if with_weight else None
    argnums = (0, 1) if with_weight else (0,)
    cot = rand.cotangents(lambda x, w: rms_norm_reference(x, w, 1e-5, weight_offset=0.5), x, weight)
    kernel_grad = jax.grad(
        lambda x, w: ladder.vjp_loss(tk.rms_norm(x, w, 1e-5, weight_offset=0.5), cot), argnums=argnums
    )
    ref_grad = jax.grad(
        lambda x, w: ladder.vjp_loss(rms_norm_reference(x, w, 1e-5, weight_offset=0.5), cot), argnums=argnums
    )
    actual = ladder.run_interpreted(jax.jit(kernel_grad), x, weight)
    expected = ref_grad(x, weight)
    # The weight gradient sums over every row: bf16 inputs carry their rounding into a long f32 sum.
    for name, a, e in zip(["d x", "d weight"], actual, expected):
        ladder.assert_close(
            a, e, dtype=dtype, atol=5e-2 if dtype == jnp.bfloat16 else 1e-4, what=name, context=repr(rand)
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_fused_add_rms_norm_gradients(rand, block_regime, dtype):
    x = rand.normal((33, 256), dtype)
    residual = rand.normal((33, 256), dtype)
    weight = rand.normal((256,), jnp.float32)
    cot = rand.cotangents(fused_add_rms_norm_reference, x, residual, weight)
    kernel_grad = jax.grad(lambda x, r, w: ladder.vjp_loss(tk.fused_add_rms_norm(x, r, w), cot), argnums=(0, 1, 2))
    ref_grad = jax.grad(lambda x, r, w: ladder.vjp_loss(fused_add_rms_norm_reference(x, r, w), cot), argnums=(0, 1, 2))
    actual = ladder.run_interpreted(jax.jit(kernel_grad), x, residual, weight)
    expected = ref_grad(x, residual, weight)
    for name, a, e in zip(["d x", "d residual", "d weight"], actual, expected):
        ladder.assert_close(
            a, e, dtype=dtype, atol=5e-2 if dtype == jnp.bfloat16 else 1e-4, what=name, context=repr(rand)
        )


# ------------------------------------------------------------------------------------------------------ bad input
BAD_INPUTS = [
    ("x scalar", lambda r: dict(x=r.normal((), jnp.float32)), ValueError, "x: expected at least 1 dimension"),
    ("x empty hidden", lambda r: dict(x=r.normal((4, 0))), ValueError, "x: expected a non-empty last"),
    ("x int", lambda r: dict(x=r.integers(0, 9, (4, 128))), TypeError, "x: expected dtype"),
    ("x float64", lambda r: dict(x=jax.ShapeDtypeStruct((4, 128), jnp.float64)), TypeError, "got float64"),
    ("x a list", lambda r: dict(x=[[1.0, 2.0]]), TypeError, "x: expected a jax array, got list"),
    ("weight length", lambda r: dict(weight=r.normal((127,))), ValueError, "weight: expected shape (128,)"),
    ("weight rank", lambda r: dict(weight=r.normal((1, 128))), ValueError, "weight: expected 1 dimensions"),
    ("weight int", lambda r: dict(weight=r.integers(0, 3, (128,))), TypeError, "weight: expected dtype"),
    ("eps negative", lambda r: dict(eps=-1e-6), ValueError, "eps: expected a finite number >= 0, got -1e-06"),
    ("eps nan", lambda r: dict(eps=float("nan")), ValueError, "eps: expected a finite number >= 0, got nan"),
    ("eps inf", lambda r: dict(eps=float("inf")), ValueError, "eps: expected a finite number >= 0, got inf"),
    ("eps array", lambda r: dict(eps=jnp.float32(1e-6)), TypeError, "eps: expected a Python float"),
    ("offset nan", lambda r: dict(weight_offset=float("nan")), ValueError, "weight_offset: expected a finite"),
    ("residual shape", lambda r: dict(residual=r.normal((4, 64))), ValueError, "residual: expected the shape of x"),
    (
        "residual dtype",
        lambda r: dict(residual=r.normal((4, 128), jnp.bfloat16)),
        TypeError,
        "residual: expected dtype",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_clear_error(rand, case):
    _, make, error, message = case
    args = dict(x=rand.normal((4, 128)), weight=rand.normal((128,)), eps=1e-6, weight_offset=0.0)
    args.update(make(rand))
    residual = args.pop("residual", None)
    with pytest.raises(error) as info:
        if residual is None:
            tk.rms_norm(args["x"], args["weight"], args["eps"], weight_offset=args["weight_offset"])
        else:
            tk.fused_add_rms_norm(args["x"], residual, args["weight"], args["eps"], weight_offset=args["weight_offset"])
    assert message in str(info.value)


def test_hidden_too_large_for_vmem_is_a_clear_error(rand):
    with pytest.raises(ValueError, match="x: hidden size .* too large"):
        jax.eval_shape(tk.rms_norm, jax.ShapeDtypeStruct((64, 1 << 24), jnp.float32))


# ------------------------------------------------------------------------------------------------ rungs 2 and 3
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


@pytest.mark.parametrize("generation", ladder.GENERATIONS)
@pytest.mark.parametrize("hidden", BENCH_HIDDENS)
@pytest.mark.parametrize("tokens", BENCH_TOKENS)
def test_compiles_for_tpu_at_benchmark_shapes(generation, tokens, hidden):
    x = ((tokens, hidden), jnp.bfloat16)
    w = ((hidden,), jnp.bfloat16)
    ladder.compile_for_tpu(api.rms_norm, generation, x, w, label="rms_norm")
    ladder.compile_for_tpu(api.fused_add_rms_norm, generation, x, x, w, label="fused_add_rms_norm")


@pytest.mark.parametrize("generation", ladder.GENERATIONS)
@pytest.mark.parametrize(
    "shape,dtype",
    [((4096, 16384), jnp.float32), ((1000, 200), jnp.bfloat16), ((9, 64), jnp.float16), ((4096, 2816), jnp.float32)],
    ids=["16384xf32", "200xbf16", "64xf16", "2816xf32"],
)
def test_compiles_for_tpu_across_sizes_and_backward(generation, shape, dtype):
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


def test_tuning_follows_the_traced_generation():
    """The block choice reads the chip being compiled for: v5e gets smaller slabs than v6e."""
    blocks = {}
    for generation in ("v5e", "v6e"):
        with jax.default_device(ladder.tpu_device(generation)):
            info = api.chip.current_tpu_info()
        blocks[generation] = tuning.choose_blocks(32768, 4096, jnp.bfloat16, streams=4, info=info).block_rows
    assert blocks["v5e"] < blocks["v6e"], blocks
