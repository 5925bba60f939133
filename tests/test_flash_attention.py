"""Flash attention, JAX side, up the ladder: kernel vs the plain-jnp reference on every feature and combinations
(interpret mode with race detection), gradients vs jax.grad of the reference, packed variable lengths (empty
sequences, traced cu_seqlens), the visit lists vs a brute-force mask, bad input, TPU export, deviceless compile for
v5e / v6e / v7x at the benchmark shapes. Small blocks (128) are forced so that every test runs several query and key
blocks with ragged last blocks."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest

from benchmarks.ops.flash_attention import config as benchmark_config
from benchmarks.ops.flash_attention import sinks as benchmark_sinks
from benchmarks.shapes import FLASH_ATTENTION, FLASH_ATTENTION_MODELS
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.common import chip
from tpu_kernels_jax.flash_attention import schedule, tuning
from tpu_kernels_jax.flash_attention.reference import (
    allowed_keys,
    attention_reference,
    varlen_attention_reference,
)

# the backward's fused dq (the table's choice at the benchmark shapes) asked for explicitly, so that every gradient
# check below runs it; UNFUSED: the dq kernel's path, still selectable (and the default for loosely bounded varlen)
SMALL = tk.FlashAttentionBlocks(block_q=128, block_kv=128, fused_backward=True)
UNFUSED = tk.FlashAttentionBlocks(block_q=128, block_kv=128, fused_backward=False)
# the backward on blocks of its own (as the tuning table may give it): query blocks twice the forward's, so that its
# row ranges, visit lists and dq slots are built for other blocks than the forward's residuals were written in
OWN_BACKWARD = tk.FlashAttentionBlocks(block_q=128, block_kv=128, fused_backward=True, backward_block_q=256)
# the forward's kernels: the visit kernel (forward.py) and, under small windows, the band (band.py)
FORWARD_KERNELS = {"flash_attention_fwd", "flash_attention_band_fwd"}
# f32 kernel vs f32 reference: the online softmax sums in another order, and sharp softmaxes (scale 1.0, logits ~ 10)
# carry the rounding of exp(s - max) to ~1e-4 relative.
F32_TOL = dict(rtol=1e-4, atol=1e-5)


def _inputs(rand, batch, sq, sk, hq, hkv, d, dv=None, dtype=jnp.float32):
    dv = d if dv is None else dv
    return (
        rand.normal((batch, sq, hq, d), dtype),
        rand.normal((batch, sk, hkv, d), dtype),
        rand.normal((batch, sk, hkv, dv), dtype),
    )


def _check_f32_gradients(kernel_fn, reference_fn, args, *, names, rand):
    """float32 gradients of kernel_fn against reference_fn in the leading len(names) arguments (ladder.check_gradients
    at this module's float32 gradient tolerance, 1e-4 absolute and relative)."""
    ladder.check_gradients(
        kernel_fn,
        reference_fn,
        args,
        argnums=tuple(range(len(names))),
        rand=rand,
        dtype=jnp.float32,
        names=names,
        atol=1e-4,
        rtol=1e-4,
    )


def _check_default_call_with_sinks(rand, args, options, dtype=jnp.float32):
    """flash_attention on the table's blocks against the reference at args (q, k, v, sinks): its output, and in
    float32 its gradients in q, k, v and the sinks."""

    def kernel(q, k, v, sinks):
        return tk.flash_attention(q, k, v, sinks=sinks, **options)

    def reference(q, k, v, sinks):
        return attention_reference(q, k, v, sinks=sinks, **options)

    f32 = dtype == jnp.float32
    tol = F32_TOL if f32 else {}
    ladder.check_against_reference(kernel, reference, args, dtype=dtype, rand=rand, **tol, jit_kernel=True)
    if f32:
        _check_f32_gradients(kernel, reference, args, names=["dq", "dk", "dv", "dsinks"], rand=rand)


def _assert_lse_close(actual, expected, what, rand):
    """Log-sum-exps agree, and rows that see no key are +inf in both (flash-attn's convention)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert not np.isnan(actual).any(), f"{what}: NaN"
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected), err_msg=f"{what}: +inf rows {rand!r}")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-5, atol=1e-5, err_msg=f"{what} {rand!r}")


# Each mask shape alone, then every feature together; Sq != Sk everywhere (bottom-right alignment), neither a
# multiple of 128. Softcap, sinks, a non-default scale and causal's override of the window's right side are checked
# in "everything" (each changes its result); scale 1.0 alone (its sharp softmaxes take a looser tolerance). The
# kernels see a window only as each row's key range (schedule.key_ranges) and the visit list: a one-sided window is
# those ranges, which the brute-force visit test checks against the reference's mask, on the kernel path "window"
# runs; a window longer than both sequences (the unbounded ranges: test_causal_and_window_skip_blocks) runs through
# the kernels, forward and gradient, in "causal_more_queries_than_keys".
FEATURES = {
    "plain": dict(),
    # the first 100 rows see no key; the window's left side reaches past every key (its right side: causal's 0)
    "causal_more_queries_than_keys": dict(causal=True, window_size=(1000, 1000), sq=300, sk=200),
    "window": dict(window_size=(70, 20)),
    "scale_one": dict(softmax_scale=1.0),
    # causal forces the window's right side (7) to 0
    "everything": dict(causal=True, window_size=(90, 7), softcap=4.0, sinks=True, softmax_scale=0.3),
}


def _feature_call(rand, feature, dtype=jnp.float32, d=64, hq=4, hkv=2):
    options = dict(FEATURES[feature])
    sq, sk = options.pop("sq", 200), options.pop("sk", 300)
    # one batch row: the grid walks batch rows like head groups (test_low_precision_dtypes runs two)
    q, k, v = _inputs(rand, 1, sq, sk, hq, hkv, d, dtype=dtype)
    sinks = rand.normal((hq,), scale=2.0) if options.pop("sinks", False) else None
    return (q, k, v, sinks), options


@pytest.mark.parametrize("feature", FEATURES)
def test_forward_matches_reference(rand, feature):
    args, options = _feature_call(rand, feature)

    def kernel(q, k, v, sinks):
        return tk.flash_attention(q, k, v, sinks=sinks, return_lse=True, blocks=SMALL, **options)

    out, lse = ladder.run_kernel(jax.jit(kernel), *args)
    ref_out, ref_lse = ladder.run_reference(
        lambda q, k, v, sinks: attention_reference(q, k, v, sinks=sinks, return_lse=True, **options),
        *args,
    )
    # at scale 1.0 the logits are sqrt(D) = 8x the default scale's, and f32 exp rounding grows with the logit
    tol = dict(F32_TOL, atol=8 * F32_TOL["atol"]) if feature == "scale_one" else F32_TOL
    ladder.assert_close(out, ref_out, dtype=jnp.float32, what="out", context=repr(rand), **tol)
    _assert_lse_close(lse, ref_lse, "lse", rand)


# (D, Dv, Hq, Hkv): head dims 64 to 512, GQA ratios 1, 2 and 8, a V head dim wider and one narrower than Q/K's; at
# head dim 64 a step takes two kv heads (128 lanes), over two head groups; at 256 (Gemma 4 sliding's heads) all 8 kv
# heads (the table's on v6e), q, K and V taken as they lie.
HEAD_LAYOUTS = [(64, 64, 4, 4), (128, 256, 8, 1), (256, 128, 16, 8), (512, 512, 4, 2)]


@pytest.mark.parametrize("layout", HEAD_LAYOUTS, ids=lambda t: "d{}_dv{}_hq{}_hkv{}".format(*t))
def test_head_dims_and_gqa(rand, layout):
    d, dv, hq, hkv = layout
    q, k, v = _inputs(rand, 1, 136, 260, hq, hkv, d, dv)
    options = dict(causal=True, window_size=(150, 0))
    ladder.check_against_reference(
        lambda q, k, v: tk.flash_attention(q, k, v, blocks=SMALL, **options),
        lambda q, k, v: attention_reference(q, k, v, **options),
        (q, k, v),
        dtype=jnp.float32,
        rand=rand,
        **F32_TOL,
        jit_kernel=True,
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_low_precision_dtypes(rand, dtype):
    # two batch rows of one head group (GQA 2): the grid's walk over batch rows and groups is the same axis
    q, k, v = _inputs(rand, 2, 200, 300, 2, 1, 128, dtype=dtype)
    options = dict(causal=True, softcap=5.0)
    ladder.check_against_reference(
        lambda q, k, v: tk.flash_attention(q, k, v, blocks=SMALL, **options),
        lambda q, k, v: attention_reference(q, k, v, **options),
        (q, k, v),
        dtype=dtype,
        rand=rand,
        jit_kernel=True,
    )


def test_row_sums_on_the_mxu(rand):
    """bfloat16 at V head dim 128 takes the row sums from the p @ [v | 1] matmul on 256-wide MXUs (v6e, v7x, the
    interpret default): rows that see no key, sinks, a window and ragged blocks, with the log-sum-exp."""
    from tpu_kernels_jax.flash_attention import forward
    from tpu_kernels_jax.flash_attention.geometry import Geometry

    geometry = Geometry(300, 200, 4, 2, 128, 128, 128, 128, 1, 0.1, 0.0)
    assert not forward.sums_on_mxu(geometry, jnp.bfloat16, chip.tpu_info_for("v5e"))
    assert not forward.sums_on_mxu(geometry, jnp.float32, chip.tpu_info_for("v6e"))
    if not forward.sums_on_mxu(geometry, jnp.bfloat16, chip.current_tpu_info()):
        assert ladder.ON_CHIP, "the interpret default (v6e) takes the row sums on the MXU"
        pytest.skip(f"{ladder.chip_generation()}'s MXUs are 128 wide: no row sums on the MXU (the other checks' path)")
    q, k, v = _inputs(rand, 2, 300, 200, 4, 2, 128, dtype=jnp.bfloat16)
    sinks = rand.normal((4,), scale=2.0)
    options = dict(causal=True, window_size=(90, 0), sinks=sinks)
    out, lse = ladder.run_kernel(
        jax.jit(lambda q, k, v: tk.flash_attention(q, k, v, blocks=SMALL, return_lse=True, **options)),
        q,
        k,
        v,
    )
    ref_out, ref_lse = ladder.run_reference(
        lambda q, k, v: attention_reference(q, k, v, return_lse=True, **options),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    ladder.assert_close(out, ref_out, dtype=jnp.bfloat16, what="out", context=repr(rand))
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert not np.isnan(lse).any()
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-2, atol=2e-2, err_msg=f"lse {rand!r}")


def test_default_blocks_one_block_per_sequence(rand):
    """The tuning table's blocks (larger than these sequences: one block covers all rows) give the same result."""
    q, k, v = _inputs(rand, 3, 100, 77, 4, 4, 128)
    ladder.check_against_reference(
        lambda q, k, v: tk.flash_attention(q, k, v, causal=True),
        lambda q, k, v: attention_reference(q, k, v, causal=True),
        (q, k, v),
        dtype=jnp.float32,
        rand=rand,
        **F32_TOL,
        jit_kernel=True,
    )


# The backward's masks: rows that see no key and a window longer than the keys here; a causal mask in
# test_gradients_gqa_head_dims (head dim 128) and test_bfloat16_gradients, a two-sided window there (head dim 256);
# every feature at once (sinks, softcap, scale, causal window) in test_gradient_of_the_log_sum_exp (head dim 64),
# whose loss takes the output's gradient with the lse's.
GRADIENT_FEATURES = ["causal_more_queries_than_keys"]


@pytest.mark.parametrize("feature", GRADIENT_FEATURES)
def test_gradients_match_reference(rand, feature):
    """At head dim 512 with K = V, one array passed as both (Gemma 4's full layers): its gradient is dk + dv."""
    (q, kv, _, sinks), options = _feature_call(rand, feature, d=512)
    _check_f32_gradients(
        lambda q, kv, s: tk.flash_attention(q, kv, kv, sinks=s, blocks=SMALL, **options),
        lambda q, kv, s: attention_reference(q, kv, kv, sinks=s, **options),
        (q, kv, sinks),
        names=["dq", "dkv", "dsinks"] if sinks is not None else ["dq", "dkv"],
        rand=rand,
    )


# Small windows on the table's blocks: the forward takes each query block over the band of key blocks its rows see
# (band.py), where the row ranges are constants that allow it. Sequences not a multiple of the band's 128-row blocks,
# so that sequences start inside blocks and the last block is ragged.
BAND_CASES = {
    # gpt-oss's sliding layers in small: window 128 (one block back), sinks, GQA 8, head dim 64
    "gpt_oss_like": dict(batch=2, seq=300, hq=16, hkv=2, d=64, window=(127, 0), sinks=True, reach=1),
    # a window of 256 keys: two blocks back
    "two_blocks_back": dict(batch=1, seq=520, hq=4, hkv=1, d=64, window=(255, 0), reach=2),
    # windows longer than the sequences, a softcap, head dim 128, no GQA
    "window_past_the_sequence": dict(batch=3, seq=45, hq=4, hkv=4, d=128, window=(200, 0), softcap=5.0, reach=1),
    # 1-token sequences: every block its own keys only
    "one_token": dict(batch=5, seq=1, hq=2, hkv=1, d=64, window=(10, 0), sinks=True, reach=0),
    # every kv head a step (8): q, K and V taken as they lie, [T, H, D] blocks
    "heads_as_they_lie": dict(batch=1, seq=200, hq=16, hkv=8, d=256, window=(127, 0), reach=1),
    # V's head dim wider than Q/K's, q and the output as they lie, K and V merged
    "wider_v": dict(batch=2, seq=150, hq=16, hkv=2, d=64, dv=128, window=(63, 0), sinks=True, reach=1),
}


def _band_call(rand, case, dtype=jnp.float32):
    c = BAND_CASES[case]
    q, k, v = _inputs(rand, c["batch"], c["seq"], c["seq"], c["hq"], c["hkv"], c["d"], c.get("dv"), dtype=dtype)
    sinks = rand.normal((c["hq"],), scale=2.0) if c.get("sinks") else None
    options = dict(causal=True, window_size=c["window"], softcap=c.get("softcap", 0.0))
    return (q, k, v, sinks), options, c["reach"]


@pytest.fixture
def band_reaches(monkeypatch):
    """The reach of every band forward traced (band.band_forward spied on)."""
    from tpu_kernels_jax.flash_attention import api as attention_api

    reaches = []
    real = attention_api.band.band_forward

    def spy(*args, **kwargs):
        reaches.append(kwargs["reach"])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_api.band, "band_forward", spy)
    return reaches


@pytest.mark.parametrize("case", BAND_CASES)
def test_small_windows_run_as_a_band(rand, case, band_reaches):
    args, options, reach = _band_call(rand, case)

    def kernel(q, k, v, sinks):
        return tk.flash_attention(q, k, v, sinks=sinks, return_lse=True, **options)

    out, lse = ladder.run_kernel(jax.jit(kernel), *args)
    assert band_reaches == [reach]
    ref_out, ref_lse = ladder.run_reference(
        lambda q, k, v, sinks: attention_reference(q, k, v, sinks=sinks, return_lse=True, **options), *args
    )
    ladder.assert_close(out, ref_out, dtype=jnp.float32, what="out", context=repr(rand), **F32_TOL)
    _assert_lse_close(lse, ref_lse, "lse", rand)


def test_band_bfloat16_and_gradients(rand, band_reaches):
    """bfloat16 through the band; float32 gradients in q, k, v and the sinks, the backward (the visit kernels, at its
    own blocks) reading the band's output and log-sum-exp."""
    args, options, reach = _band_call(rand, "gpt_oss_like", dtype=jnp.bfloat16)
    _check_default_call_with_sinks(rand, args, options, dtype=jnp.bfloat16)
    args, options, _ = _band_call(rand, "gpt_oss_like")
    _check_default_call_with_sinks(rand, args, options)
    assert band_reaches and set(band_reaches) == {reach}


def test_band_only_where_every_row_fits_it(rand, band_reaches):
    """band_reach: the key blocks before a query block's own that its rows see, None where a row sees past its own
    block (bottom-right causal with more keys than queries) or too far back; a caller's blocks keep the visit kernel."""
    from tpu_kernels_jax.flash_attention import band

    def reach(rows, window, cu=None):
        cu = np.array([0, rows]) if cu is None else np.asarray(cu)
        lo, hi = schedule.key_ranges(cu, cu, rows, causal=True, window_size=(window, 0), xp=np)
        return band.band_reach(lo, hi, rows, rows)

    assert reach(4096, 127) == 1 and reach(4096, 128) == 1 and reach(4096, 129) == 2 and reach(4096, 256) == 2
    assert reach(4096, 257) is None  # three blocks back: past MAX_REACH
    assert reach(4096, 0) == 0  # each row its own key
    assert reach(4096, 4095) is None  # causal over the whole sequence
    # a sequence of 100 rows from row 60: its rows see back to row 60, one block
    assert reach(300, 1000, cu=[0, 60, 160, 300]) == 1
    q, k, v = _inputs(rand, 1, 200, 300, 2, 1, 64)  # bottom-right causal: rows see keys past their own block
    _check_default_call_with_sinks(rand, (q, k, v, rand.normal((2,))), dict(causal=True, window_size=(100, 0)))
    q, k, v = _inputs(rand, 1, 256, 256, 2, 1, 64)
    jax.block_until_ready(tk.flash_attention(q, k, v, causal=True, window_size=(127, 0), blocks=SMALL))
    assert band_reaches == []


# (Sq, Sk): fewer query or key rows than a sublane tile, against a wider other side (the api pads them: MIN_ROWS).
FEW_ROWS = [(7, 1), (1, 5), (130, 1)]


@pytest.mark.parametrize("sq,sk", FEW_ROWS, ids=[f"sq{a}_sk{b}" for a, b in FEW_ROWS])
def test_few_rows_on_either_side(rand, sq, sk):
    """One key under seven (or 130) query rows, one query row over five keys, bfloat16 with a window and sinks:
    forward and gradients against the reference, packed (varlen) too."""
    q, k, v = _inputs(rand, 1, sq, sk, 4, 2, 64, dtype=jnp.bfloat16)
    sinks = rand.normal((4,), scale=2.0)
    options = dict(window_size=(90, 0))
    bf16_tol = dict(atol=ladder.relative_to_largest(5e-2, 2**-8), rtol=5e-2)
    ladder.check_gradients(
        lambda q, k, v, s: tk.flash_attention(q, k, v, sinks=s, **options),
        lambda q, k, v, s: attention_reference(q, k, v, sinks=s, **options),
        (q, k, v, sinks),
        argnums=(0, 1, 2, 3),
        rand=rand,
        dtype=jnp.bfloat16,
        names=["dq", "dk", "dv", "dsinks"],
        **bf16_tol,
    )
    cu_q, cu_k = jnp.asarray([0, sq], jnp.int32), jnp.asarray([0, sk], jnp.int32)
    ladder.check_against_reference(
        lambda q, k, v, s: tk.flash_attention_varlen(q, k, v, cu_q, cu_k, sq, sk, sinks=s, **options),
        lambda q, k, v, s: varlen_attention_reference(q, k, v, cu_q, cu_k, sinks=s, **options),
        (q[0], k[0], v[0], sinks),
        dtype=jnp.bfloat16,
        rand=rand,
        jit_kernel=True,
    )


@pytest.mark.cpu_only
def test_few_rows_compile_for_tpu():
    """A one-row block against a wider one fails Pallas's matmul lowering (the api pads such sides to MIN_ROWS):
    the forward and the backward at one key under seven query rows, and one query row over five keys, on v5e."""
    for sq, sk in [(7, 1), (1, 5)]:
        q, kv = ((1, sq, 4, 64), jnp.bfloat16), ((1, sk, 2, 64), jnp.bfloat16)
        ladder.compile_for_tpu(_grad_fn(window_size=(90, 0)), "v5e", q, kv, kv, label=f"few rows {sq}x{sk}")


# (D, Dv, Hq, Hkv, options, blocks): GQA 8 with a narrower V head dim under a causal mask, the backward on blocks of
# its own (OWN_BACKWARD: one query block of 256 against the forward's two of 128, its heads as they lie); head dim
# 256 (Gemma 4 sliding's) with all 8 kv heads a step, as Gemma 4 sliding takes them (q, K, V, dq, dk and dv as they
# lie in both directions: forward.kv_heads_in_place; GQA 1, 8 query heads a step, for the compile time, which grows
# with them) and a V head dim half Q/K's, under a window open on both sides, without causal. Head dim 512 (K = V) is
# test_gradients_match_reference's.
GRADIENT_LAYOUTS = [
    (128, 64, 8, 1, dict(causal=True, softcap=3.0), OWN_BACKWARD),
    (256, 128, 8, 8, dict(window_size=(70, 20), softcap=3.0), dataclasses.replace(SMALL, kv_heads_per_step=8)),
]


@pytest.mark.parametrize("layout", GRADIENT_LAYOUTS, ids=lambda t: "d{}_dv{}_hq{}_hkv{}".format(*t))
def test_gradients_gqa_head_dims(rand, layout):
    d, dv, hq, hkv, options, blocks = layout
    q, k, v = _inputs(rand, 1, 136, 260, hq, hkv, d, dv)
    _check_f32_gradients(
        lambda q, k, v: tk.flash_attention(q, k, v, blocks=blocks, **options),
        lambda q, k, v: attention_reference(q, k, v, **options),
        (q, k, v),
        names=["dq", "dk", "dv"],
        rand=rand,
    )


@pytest.mark.parametrize("blocks", [SMALL, UNFUSED], ids=["fused", "unfused"])
def test_gradient_of_the_log_sum_exp(rand, blocks):
    """Differentiating the lse output too (ds gains p * d_lse; the sink's gradient likewise), with every feature, on
    both backward paths."""
    args, options = _feature_call(rand, "everything")
    _check_f32_gradients(
        lambda q, k, v, s: tk.flash_attention(q, k, v, sinks=s, blocks=blocks, return_lse=True, **options),
        lambda q, k, v, s: attention_reference(q, k, v, sinks=s, return_lse=True, **options),
        args,
        names=["dq", "dk", "dv", "dsinks"],
        rand=rand,
    )


def test_bfloat16_gradients(rand):
    q, k, v = _inputs(rand, 1, 200, 300, 4, 2, 128, dtype=jnp.bfloat16)
    ladder.check_gradients(
        lambda q, k, v: tk.flash_attention(q, k, v, causal=True, blocks=SMALL),
        lambda q, k, v: attention_reference(q, k, v, causal=True),
        (q, k, v),
        argnums=(0, 1, 2),
        rand=rand,
        dtype=jnp.bfloat16,
        names=["dq", "dk", "dv"],
        atol=5e-2,
        rtol=5e-2,
    )


# ---------------------------------------------------------------------------------------------------------- varlen
# Packed sequences (query length, key length): an empty sequence, one with no keys, more queries than keys, one
# longer than a block, one shorter than a block.
VARLEN_LENGTHS = [(5, 40), (0, 0), (130, 170), (3, 0), (60, 20), (1, 300), (0, 12)]


def _varlen_inputs(rand, hq=4, hkv=2, d=64, dtype=jnp.float32):
    lens_q, lens_k = np.array(VARLEN_LENGTHS).T
    cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32)
    cu_k = jnp.asarray(np.concatenate([[0], np.cumsum(lens_k)]), jnp.int32)
    q = rand.normal((int(lens_q.sum()), hq, d), dtype)
    k = rand.normal((int(lens_k.sum()), hkv, d), dtype)
    v = rand.normal((int(lens_k.sum()), hkv, d), dtype)
    return (q, k, v, cu_q, cu_k), int(lens_q.max()), int(lens_k.max())


# no mask, and every feature at once (causal, a window, softcap, sinks, scale); the traced cu_seqlens test below
# runs a causal window too
@pytest.mark.parametrize("feature", ["plain", "everything"])
def test_varlen_matches_reference(rand, feature):
    (q, k, v, cu_q, cu_k), max_q, max_k = _varlen_inputs(rand)
    options = {key: value for key, value in FEATURES[feature].items() if key not in ("sq", "sk")}
    sinks = rand.normal((4,)) if options.pop("sinks", False) else None

    def kernel(q, k, v, sinks):
        return tk.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, sinks=sinks, return_lse=True, blocks=SMALL, **options
        )

    # one jitted program with cu_seqlens closed over: constants of it, so that the host checks see their values (the
    # traced cu_seqlens are test_varlen_traced_cu_seqlens_and_gradients')
    out, lse = ladder.run_kernel(jax.jit(kernel), q, k, v, sinks)
    # the reference slices by concrete offsets: closed over, so that it runs as one jitted program
    ref_out, ref_lse = ladder.run_reference(
        lambda q, k, v, sinks: varlen_attention_reference(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True, **options),
        q,
        k,
        v,
        sinks,
    )
    ladder.assert_close(out, ref_out, dtype=jnp.float32, what="out", context=repr(rand), **F32_TOL)
    _assert_lse_close(lse, ref_lse, "lse", rand)


@pytest.mark.parametrize("blocks", [OWN_BACKWARD, UNFUSED], ids=["fused", "unfused"])
def test_varlen_traced_cu_seqlens_and_gradients(rand, blocks):
    """cu_seqlens as traced arguments (the visit lists and the fused backward's dq slots are built at run time),
    forward and gradients, on both backward paths (unfused is the default where the slot bound is loose); the fused
    one on blocks of its own (its lists, sized by their own bound, built beside the forward's)."""
    (q, k, v, cu_q, cu_k), max_q, max_k = _varlen_inputs(rand)
    options = dict(causal=True, window_size=(64, 0), softcap=3.0)
    _check_f32_gradients(
        lambda q, k, v, cu_q, cu_k: tk.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, blocks=blocks, **options
        ),
        # the reference slices by concrete offsets: the closed-over ones (the kernel gets them traced, under jit)
        lambda q, k, v, _cu_q, _cu_k: varlen_attention_reference(q, k, v, cu_q, cu_k, **options),
        (q, k, v, cu_q, cu_k),
        names=["dq", "dk", "dv"],
        rand=rand,
    )


def test_varlen_understated_max_seqlen_is_nan_not_wrong(rand):
    """Traced cu_seqlens cannot be checked on the host: when max_seqlen_k understates a length so much that the visit
    list overflows its static size, every output is NaN."""
    lens_q, lens_k = np.array([200, 200]), np.array([1, 1000])
    cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32) for x in (lens_q, lens_k))
    q = rand.normal((400, 1, 128))
    k = rand.normal((1001, 1, 128))
    fn = jax.jit(
        lambda q, k, v, a, b: tk.flash_attention_varlen(q, k, v, a, b, 200, 1, blocks=SMALL),
    )
    out = ladder.run_kernel(fn, q, k, k, cu_q, cu_k)
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("max_seqlen", [8, 200])
def test_varlen_understated_max_seqlen_gradients_are_nan_or_right_in_bounds(rand, fused, max_seqlen):
    """The backward under the same contract: one traced 512-row sequence against max_seqlen 8 or 200 (causal,
    blocks 128 x 128). No kernel indexes outside a buffer (strict interpret mode raises on an out-of-bounds block:
    the fused dk/dv kernel's dq slots did, past the last slot), and the gradients are every one NaN where a list
    overflowed (the fused backward's dq slots, sized by max_seqlen, always do here), else right: the unfused lists
    are bounded by the blocks too and may still hold every visit."""
    q, k, v = (rand.normal((512, 1, 64)) for _ in range(3))
    cu = jnp.asarray([0, 512], jnp.int32)
    blocks = dataclasses.replace(SMALL, fused_backward=fused)

    def loss(q, k, v, cu):
        out = tk.flash_attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, blocks=blocks)
        return jnp.sum(out)

    grads = ladder.run_kernel(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, cu)
    nan = [bool(np.isnan(np.asarray(g)).all()) for g in grads]
    assert nan in ([True] * 3, [False] * 3), f"some gradients NaN, some not: {nan} ({rand})"
    if fused:
        assert nan[0], f"the fused backward's dq slots overflowed, but the gradients are not NaN ({rand})"
    if not nan[0]:
        expected = ladder.run_reference(
            jax.grad(lambda q, k, v: jnp.sum(attention_reference(q[None], k[None], v[None], causal=True)), (0, 1, 2)),
            q,
            k,
            v,
        )
        for name, g, e in zip(["dq", "dk", "dv"], grads, expected):
            ladder.assert_close(g, e, dtype=jnp.float32, what=name, context=repr(rand), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------- random draws
RANDOM_BLOCKS = {
    "small": SMALL,
    "unfused": UNFUSED,
    "own_backward": OWN_BACKWARD,
    "wide_keys": tk.FlashAttentionBlocks(block_q=128, block_kv=256),
    "table": None,
}
RANDOM_LENGTHS = [1, 7, 100, 130, 200, 300]


@ladder.random_draws
def test_random_draw(rand, draw):
    """Dense or packed sequences, lengths (one token, unaligned, empty packed sequences), heads (GQA 1 to 8), head
    dims, V's head dim, dtype, mask (causal, windows one- and two-sided, longer than the sequences), softcap, sinks,
    scale and tiling drawn at random; the forward, or the gradients (float32 and bfloat16), against the reference."""
    varlen, dtype = rand.draw("varlen", [False, True]), rand.draw("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
    gradients = dtype != jnp.float16 and rand.draw("gradients", [False, True])
    lengths = [n for n in RANDOM_LENGTHS if n <= 200] if gradients else RANDOM_LENGTHS
    hkv, group = rand.draw("kv_heads", [1, 2, 4]), rand.draw("gqa_group", [1, 2, 4, 8])
    d = rand.draw("head_dim", [64, 128, 256])
    dv = rand.draw("v_head_dim", [d, 128, 256])
    if d == 256 or dv == 256:  # the interpreter's time grows with the heads a step
        hkv, group = min(hkv, 2), min(group, 4)
    hq = hkv * group
    # bfloat16 at the default scale only: the forward rounds q times the scale to bfloat16 before its matmul, so the
    # scores' error grows with the scale (at 1.0 and head dim 256 outputs move by up to 3 % of |v|)
    scales = [None] if dtype == jnp.bfloat16 else [None, 0.3, 1.0]
    options = dict(
        causal=rand.draw("causal", [False, True]),
        window_size=rand.draw("window_size", [(-1, -1), (70, 20), (90, 0), (0, -1), (5, 5), (1000, 1000)]),
        softcap=rand.draw("softcap", [0.0, 4.0]),
        softmax_scale=rand.draw("softmax_scale", scales),
    )
    blocks = RANDOM_BLOCKS[rand.draw("blocks", list(RANDOM_BLOCKS))]
    sinks = rand.normal((hq,), scale=2.0) if rand.draw("sinks", [False, True]) else None
    if varlen:
        seqs = rand.draw("sequences", [1, 2, 3, 4])
        lens_q = [rand.draw(f"q_len_{s}", [0] + lengths) for s in range(seqs)]
        lens_k = [rand.draw(f"k_len_{s}", [0] + lengths) for s in range(seqs)]
        lens_q[0], lens_k[0] = lens_q[0] or 1, lens_k[0] or 1  # some rows and keys
        cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(n)]), jnp.int32) for n in (lens_q, lens_k))
        q = rand.normal((sum(lens_q), hq, d), dtype)
        k, v = rand.normal((sum(lens_k), hkv, d), dtype), rand.normal((sum(lens_k), hkv, dv), dtype)
        max_q, max_k = max(lens_q), max(lens_k)

        def kernel(q, k, v, s):
            return tk.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, sinks=s, blocks=blocks, **options)

        def reference(q, k, v, s):
            return varlen_attention_reference(q, k, v, cu_q, cu_k, sinks=s, **options)
    else:
        batch, sq, sk = rand.draw("batch", [1, 2]), rand.draw("q_len", lengths), rand.draw("k_len", lengths)
        q, k, v = _inputs(rand, batch, sq, sk, hq, hkv, d, dv, dtype=dtype)

        def kernel(q, k, v, s):
            return tk.flash_attention(q, k, v, sinks=s, blocks=blocks, **options)

        def reference(q, k, v, s):
            return attention_reference(q, k, v, sinks=s, **options)

    sharp = 8 if options["softmax_scale"] == 1.0 else 1  # logits sqrt(D) times the default scale's: exp rounding grows
    args = (q, k, v, sinks)
    if not gradients:
        tol = dict(F32_TOL, atol=sharp * F32_TOL["atol"]) if dtype == jnp.float32 else {}
        ladder.check_against_reference(kernel, reference, args, dtype=dtype, rand=rand, jit_kernel=True, **tol)
        return
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    # dk / dv sum over every query row that sees the key (all of them, for a one-key sequence): the bfloat16
    # cotangent's rounding adds up with the rows, so the bound grows with the largest gradient
    bf16_tol = dict(atol=ladder.relative_to_largest(5e-2, 2**-8), rtol=5e-2)
    tol = dict(atol=sharp * 1e-4, rtol=1e-4) if dtype == jnp.float32 else bf16_tol
    ladder.check_gradients(
        kernel,
        reference,
        args,
        argnums=argnums,
        rand=rand,
        dtype=dtype,
        names=["dq", "dk", "dv", "dsinks"][: len(argnums)],
        **tol,
    )


# -------------------------------------------------------------------------------------------------------- schedule
@pytest.mark.cpu_only
@pytest.mark.parametrize("seed", range(6))
def test_visit_lists_match_brute_force_mask(seed):
    """Every (query block, key block) pair with a kept score is visited, exactly once per list; a pair is unmasked
    only when all its scores are kept; every query / key block gets at least one visit."""
    rng = np.random.default_rng(seed)
    lens_q = rng.integers(0, 300, 4)
    lens_k = lens_q + rng.integers(-50, 200, 4).clip(-lens_q, None)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    causal = bool(seed % 2)
    window = [(-1, -1), (100, 30), (0, -1)][seed % 3]
    tq, tk_rows = int(cu_q[-1]), int(cu_k[-1])
    mask = np.zeros((tq, tk_rows), bool)
    for s in range(4):
        mask[cu_q[s] : cu_q[s + 1], cu_k[s] : cu_k[s + 1]] = np.asarray(
            allowed_keys(int(lens_q[s]), int(lens_k[s]), causal=causal, window_size=window)
        )
    bq, bk = 128, 128
    lo, hi = schedule.key_ranges(cu_q, cu_k, tq, causal=causal, window_size=window, xp=np)
    # each row's key range (what the kernels mask by) is exactly its row of the mask
    seen = mask.any(axis=1)
    np.testing.assert_array_equal(mask.sum(axis=1)[seen], (hi - lo + 1)[seen])
    np.testing.assert_array_equal(lo[seen], mask.argmax(axis=1)[seen])
    assert (lo[~seen] > hi[~seen]).all()
    needed, full = schedule.block_pairs(lo, hi, block_q=bq, block_kv=bk, kv_rows=tk_rows, xp=np)
    nq, nk = needed.shape
    padded = np.zeros((nq * bq, nk * bk), bool)
    padded[:tq, :tk_rows] = mask
    blocks = padded.reshape(nq, bq, nk, bk)
    np.testing.assert_array_equal(needed, blocks.any(axis=(1, 3)))
    whole = np.zeros((nq * bq, nk * bk), bool)
    whole[:tq, :tk_rows] = True
    np.testing.assert_array_equal(
        full,
        (blocks | ~whole.reshape(nq, bq, nk, bk)).all(axis=(1, 3))
        & needed
        & (whole.reshape(nq, bq, nk, bk).all(axis=(1, 3))),
    )
    for by, outer in (("q", nq), ("kv", nk)):
        words, count = schedule.visits(needed, full, by=by, xp=np)
        q_block, kv_block = schedule.unpack(words)
        pairs = set(zip(q_block[(words & schedule.COMPUTE) != 0], kv_block[(words & schedule.COMPUTE) != 0]))
        assert pairs == set(zip(*np.nonzero(needed)))
        owner = q_block if by == "q" else kv_block
        assert set(owner) == set(range(outer))
        assert ((words & schedule.FIRST) != 0).sum() == outer == ((words & schedule.LAST) != 0).sum()
        # the traced builder gives the same list, padded
        bound, slot_bound = schedule.visit_bound(
            nq,
            nk,
            num_seqs=4,
            max_seqlen_q=int(lens_q.max()),
            max_seqlen_k=int(lens_k.max()),
            block_q=bq,
            block_kv=bk,
            window_size=window,
            causal=causal,
        )
        assert count <= bound
        assert needed.sum(axis=1).max() <= slot_bound
        # jitted: one XLA compile per list rather than one per jnp op on this seed's shapes
        traced_visits = jax.jit(lambda n, f, by=by, bound=bound: schedule.visits(n, f, by=by, size=bound))
        traced, traced_count = traced_visits(jnp.asarray(needed), jnp.asarray(full))
        assert int(traced_count) == count
        np.testing.assert_array_equal(np.asarray(traced)[:count], words)


@pytest.mark.cpu_only
def test_causal_and_window_skip_blocks():
    """Blocks wholly outside the mask are not visited: a causal square of 8 blocks visits 36 of 64 pairs, a window of
    one block about three per row of blocks."""

    def count(**options):
        lo, hi = schedule.key_ranges([0, 1024], [0, 1024], 1024, xp=np, **options)
        needed, full = schedule.block_pairs(lo, hi, block_q=128, block_kv=128, kv_rows=1024, xp=np)
        return int(needed.sum()), int(full.sum())

    assert count(causal=False, window_size=(-1, -1)) == (64, 64)
    assert count(causal=True, window_size=(-1, -1)) == (36, 28)
    assert count(causal=True, window_size=(127, 0)) == (15, 0)
    # a window longer than the sequence gives every row the unbounded window's key range (Sq != Sk)
    unbounded, longer = (
        schedule.key_ranges([0, 200], [0, 300], 200, causal=False, window_size=w, xp=np)
        for w in ((-1, -1), (5000, 5000))
    )
    np.testing.assert_array_equal(np.stack(longer), np.stack(unbounded))


@pytest.mark.cpu_only
@pytest.mark.parametrize("seed", range(3))
def test_diagonal_pairs_match_brute_force_mask(seed):
    """A pair is DIAGONAL exactly when its block of the mask is the triangle key - first key <= row - first row and
    its key block is whole: causal and windowed sequences of block-multiple lengths (where the diagonal meets the
    blocks' corners) and others (where it does not), query blocks equal to, half and twice the key blocks; the traced
    builder agrees, and the forward's list flags exactly those of its masked visits."""
    rng = np.random.default_rng(seed)
    # the first sequence has DIAGONAL pairs at every block shape; the others' lengths and offsets are drawn
    lens = np.concatenate([[1024], rng.choice([512, 1024, 300, 768], 2)])
    lens_k = lens + np.concatenate([[0], rng.choice([0, 256, 40], 2)])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens, lens_k))
    window = [(-1, -1), (700, 0), (256, -1)][seed]
    tq, tk_rows = int(cu_q[-1]), int(cu_k[-1])
    mask = np.zeros((tq, tk_rows), bool)
    for s in range(3):
        mask[cu_q[s] : cu_q[s + 1], cu_k[s] : cu_k[s + 1]] = np.asarray(
            allowed_keys(int(lens[s]), int(lens_k[s]), causal=True, window_size=window)
        )
    lo, hi = schedule.key_ranges(cu_q, cu_k, tq, causal=True, window_size=window, xp=np)
    flagged = 0
    for bq, bk in ((256, 256), (256, 512), (512, 256)):
        diagonal = schedule.diagonal_pairs(lo, hi, block_q=bq, block_kv=bk, kv_rows=tk_rows, xp=np)
        nq, nk = diagonal.shape
        padded = np.zeros((nq * bq, nk * bk), bool)
        padded[:tq, :tk_rows] = mask
        blocks = padded.reshape(nq, bq, nk, bk).transpose(0, 2, 1, 3)
        triangle = np.arange(bk)[None, :] <= np.arange(bq)[:, None]
        whole = (np.arange(nk) + 1) * bk <= tk_rows
        expected = (blocks == triangle).all(axis=(2, 3)) & whole[None, :]
        np.testing.assert_array_equal(diagonal, expected, err_msg=f"blocks {bq} x {bk}, seed {seed}")
        traced = jax.jit(
            lambda lo, hi, bq=bq, bk=bk: schedule.diagonal_pairs(lo, hi, block_q=bq, block_kv=bk, kv_rows=tk_rows)
        )(jnp.asarray(lo), jnp.asarray(hi))
        np.testing.assert_array_equal(np.asarray(traced), diagonal)
        needed, full = schedule.block_pairs(lo, hi, block_q=bq, block_kv=bk, kv_rows=tk_rows, xp=np)
        words, _ = schedule.visits(needed, full, by="q", diagonal=diagonal, xp=np)
        q_block, kv_block = schedule.unpack(words)
        on = (words & schedule.DIAGONAL) != 0
        assert ((words[on] & schedule.MASKED) != 0).all()
        assert set(zip(q_block[on], kv_block[on])) == set(zip(*np.nonzero(diagonal)))
        flagged += int(on.sum())
    assert flagged > 0


# Blocks of 512 and 1024 rows: the forward's DIAGONAL visits (key chunks of the MXU's width, 256 on the interpret
# default's v6e) run, next to masked and full ones.
DIAGONAL_CASES = {
    # square blocks, GQA 2, every option the kernel takes
    "square_f32_everything": dict(blocks=(512, 512), seq=1024, dtype=jnp.float32, softcap=4.0, sinks=True),
    # key blocks twice the query blocks: half the DIAGONAL pairs' key chunks needed by no row; row sums on the MXU
    "wide_keys_bf16": dict(blocks=(512, 1024), seq=1024, dtype=jnp.bfloat16),
    # query blocks twice the key blocks: rows past the key block see all of it; a causal window of 1100 (its pairs
    # on the diagonal are DIAGONAL ones: every row sees the first key; the window's far edge cuts the second row block)
    "tall_queries_bf16_window": dict(blocks=(1024, 512), seq=2048, dtype=jnp.bfloat16, window_size=(1100, 0)),
}


@pytest.mark.parametrize("case", DIAGONAL_CASES)
def test_forward_diagonal_visits(rand, case):
    options = dict(DIAGONAL_CASES[case])
    (bq, bk), seq, dtype = options.pop("blocks"), options.pop("seq"), options.pop("dtype")
    blocks = tk.FlashAttentionBlocks(block_q=bq, block_kv=bk)
    q, k, v = _inputs(rand, 1, seq, seq, 4, 2, 128, dtype=dtype)
    sinks = rand.normal((4,), scale=2.0) if options.pop("sinks", False) else None
    options.update(causal=True, sinks=sinks)
    out, lse = ladder.run_kernel(
        jax.jit(lambda q, k, v: tk.flash_attention(q, k, v, blocks=blocks, return_lse=True, **options)), q, k, v
    )
    ref_out, ref_lse = ladder.run_reference(
        lambda q, k, v: attention_reference(q, k, v, return_lse=True, **options),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    if dtype == jnp.float32:
        ladder.assert_close(out, ref_out, dtype=dtype, what="out", context=repr(rand), **F32_TOL)
        _assert_lse_close(lse, ref_lse, "lse", rand)
    else:
        ladder.assert_close(out, ref_out, dtype=dtype, what="out", context=repr(rand))
        lse = np.asarray(lse)
        assert not np.isnan(lse).any()
        np.testing.assert_allclose(lse, np.asarray(ref_lse), rtol=2e-2, atol=2e-2, err_msg=f"lse {rand!r}")


# The fused dk/dv kernel's DIAGONAL visits (the backward's blocks of 512 and 1024 rows: query chunks of the MXU's width,
# 256 on the interpret default's v6e, each over the key rows that need it), next to masked and full ones.
DKV_DIAGONAL_CASES = {
    # square blocks, GQA 2, softcap and sinks (their gradient too)
    "square_f32_softcap_sinks": dict(blocks=(512, 512), dtype=jnp.float32, softcap=4.0, sinks=True),
    # key blocks twice the query blocks: the DIAGONAL pairs' key chunks past the query block are needed by no row
    "wide_keys_bf16": dict(blocks=(512, 1024), dtype=jnp.bfloat16),
    # query blocks twice the key blocks: the query chunks past the key block see all of it, unmasked
    "tall_queries_bf16": dict(blocks=(1024, 512), dtype=jnp.bfloat16),
    # key blocks four times the query blocks (the v5e's table at head dim 128): four query blocks a key block, the
    # diagonals of the last three run through it as masked visits
    "wider_keys_f32": dict(blocks=(256, 1024), dtype=jnp.float32),
}


@pytest.mark.parametrize("case", DKV_DIAGONAL_CASES)
def test_backward_diagonal_visits(rand, case):
    options = dict(DKV_DIAGONAL_CASES[case])
    (bq, bk), dtype = options.pop("blocks"), options.pop("dtype")
    blocks = tk.FlashAttentionBlocks(block_q=bq, block_kv=bk, fused_backward=True)
    q, k, v = _inputs(rand, 1, 1024, 1024, 4, 2, 128, dtype=dtype)
    sinks = rand.normal((4,), scale=2.0) if options.pop("sinks", False) else None
    argnums, names = (
        ((0, 1, 2, 3), ["dq", "dk", "dv", "dsinks"]) if sinks is not None else ((0, 1, 2), ["dq", "dk", "dv"])
    )
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == jnp.float32 else dict(atol=5e-2, rtol=5e-2)
    ladder.check_gradients(
        lambda q, k, v, s: tk.flash_attention(q, k, v, causal=True, sinks=s, blocks=blocks, **options),
        lambda q, k, v, s: attention_reference(q, k, v, causal=True, sinks=s, **options),
        (q, k, v, sinks),
        argnums=argnums,
        rand=rand,
        dtype=dtype,
        names=names,
        **tolerance,
    )


# ------------------------------------------------------------------------------------------------------- bad input
BadInput = ladder.BadInput
BAD_INPUTS = [
    BadInput("q rank", lambda r: dict(q=r.normal((8, 4, 64))), ValueError, "q: expected 4 dimensions"),
    BadInput("q int", lambda r: dict(q=r.integers(0, 3, (1, 8, 4, 64))), TypeError, "q: expected dtype"),
    BadInput("k dtype", lambda r: dict(k=r.normal((1, 8, 2, 64), jnp.bfloat16)), TypeError, "k: expected dtype"),
    BadInput("heads not a multiple", lambda r: dict(q=r.normal((1, 8, 3, 64))), ValueError, "multiple of k's 2"),
    BadInput("head dim mismatch", lambda r: dict(k=r.normal((1, 8, 2, 32))), ValueError, "k: expected the head dim"),
    BadInput("v rows", lambda r: dict(v=r.normal((1, 9, 2, 64))), ValueError, "v: expected the leading"),
    BadInput(
        "batch mismatch",
        lambda r: dict(k=r.normal((2, 8, 2, 64)), v=r.normal((2, 8, 2, 64))),
        ValueError,
        "k: expected the batch size",
    ),
    BadInput(
        "head dim too large",
        lambda r: dict(q=r.normal((1, 8, 4, 640)), k=r.normal((1, 8, 2, 640))),
        ValueError,
        "head dim from 1 to 512",
    ),
    BadInput("window below -1", dict(window_size=(-2, 0)), ValueError, "window_size: expected -1"),
    BadInput("window not a pair", dict(window_size=(3,)), TypeError, "window_size: expected a pair"),
    BadInput("window float", dict(window_size=(3.0, 0)), TypeError, "window_size: expected ints"),
    BadInput("scale zero", dict(softmax_scale=0.0), ValueError, "softmax_scale: expected a finite number > 0"),
    BadInput("scale nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite"),
    BadInput("scale inf", dict(softmax_scale=float("inf")), ValueError, "softmax_scale: expected a finite"),
    BadInput("scale negative", dict(softmax_scale=-1.0), ValueError, "softmax_scale: expected a finite"),
    BadInput("softcap negative", dict(softcap=-1.0), ValueError, "softcap: expected a finite number >= 0"),
    BadInput("causal not bool", dict(causal=1), TypeError, "causal: expected a bool"),
    BadInput("sinks shape", lambda r: dict(sinks=r.normal((3,))), ValueError, "sinks: expected shape (4,)"),
    BadInput("blocks type", dict(blocks=(128, 128)), TypeError, "blocks: expected a FlashAttentionBlocks"),
    BadInput("block_q not lanes", dict(blocks=tk.FlashAttentionBlocks(block_q=4)), ValueError, "blocks.block_q"),
    BadInput(
        "backward_block_kv not lanes",
        dict(blocks=tk.FlashAttentionBlocks(backward_block_kv=4)),
        ValueError,
        "blocks.backward_block_kv: expected a multiple of 128",
    ),
    BadInput(
        "backward_block_q not an int",
        dict(blocks=tk.FlashAttentionBlocks(backward_block_q=256.0)),
        TypeError,
        "blocks.backward_block_q: expected a positive int",
    ),
    BadInput(
        "fused_backward not a bool",
        dict(blocks=tk.FlashAttentionBlocks(fused_backward=1)),
        TypeError,
        "blocks.fused_backward: expected a bool",
    ),
    BadInput(
        "kv_heads_per_step",
        dict(blocks=tk.FlashAttentionBlocks(kv_heads_per_step=3)),
        ValueError,
        "blocks.kv_heads_per_step",
    ),
]


def _dense_good(rand):
    q, k, v = _inputs(rand, 1, 8, 8, 4, 2, 64)
    return dict(q=q, k=k, v=v)


def _call_dense(arguments):
    arguments = dict(arguments)
    return tk.flash_attention(arguments.pop("q"), arguments.pop("k"), arguments.pop("v"), **arguments)


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_INPUTS)
def test_bad_input_is_a_clear_error(rand, case):
    ladder.assert_clear_error(case, _call_dense, _dense_good(rand), rand)


BAD_VARLEN = [
    BadInput("cu int64", dict(cu_seqlens_q=np.array([0, 4, 8], np.int64)), TypeError, "cu_seqlens_q: expected dtype"),
    BadInput(
        "cu not increasing",
        dict(cu_seqlens_q=jnp.array([0, 6, 4, 8], jnp.int32), cu_seqlens_k=jnp.array([0, 3, 5, 8], jnp.int32)),
        ValueError,
        "cu_seqlens_q: expected non-decreasing",
    ),
    BadInput(
        "cu wrong end",
        dict(cu_seqlens_k=jnp.array([0, 4, 7], jnp.int32)),
        ValueError,
        "cu_seqlens_k: expected to end at the token count 8",
    ),
    BadInput(
        "cu wrong start",
        dict(cu_seqlens_k=jnp.array([1, 4, 8], jnp.int32)),
        ValueError,
        "cu_seqlens_k: expected to start at 0",
    ),
    BadInput(
        "cu lengths differ",
        dict(cu_seqlens_k=jnp.array([0, 2, 4, 8], jnp.int32)),
        ValueError,
        "cu_seqlens_k: expected the shape of cu_seqlens_q",
    ),
    BadInput("max_seqlen too small", dict(max_seqlen_k=2), ValueError, "max_seqlen_k: expected at least"),
    BadInput("max_seqlen float", dict(max_seqlen_q=4.0), TypeError, "max_seqlen_q: expected a Python int"),
    BadInput("varlen q rank", lambda r: dict(q=r.normal((1, 8, 4, 64))), ValueError, "q: expected 3 dimensions"),
]


def _call_varlen(arguments):
    a = dict(arguments)
    return tk.flash_attention_varlen(
        a.pop("q"),
        a.pop("k"),
        a.pop("v"),
        a.pop("cu_seqlens_q"),
        a.pop("cu_seqlens_k"),
        a.pop("max_seqlen_q"),
        a.pop("max_seqlen_k"),
        **a,
    )


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_VARLEN)
def test_bad_varlen_input_is_a_clear_error(rand, case):
    good = dict(
        q=rand.normal((8, 4, 64)),
        k=rand.normal((8, 2, 64)),
        v=rand.normal((8, 2, 64)),
        cu_seqlens_q=jnp.array([0, 4, 8], jnp.int32),
        cu_seqlens_k=jnp.array([0, 4, 8], jnp.int32),
        max_seqlen_q=4,
        max_seqlen_k=4,
    )
    ladder.assert_clear_error(case, _call_varlen, good, rand)


@pytest.mark.cpu_only
def test_blocks_reach_the_kernels(rand):
    """blocks= sets the tiling: the forward's grid is (head groups, visits); the gradient adds the delta, dk/dv (with
    dq) and dq-sum kernels when fused (the sum's grid walks each query block's slots: at most 2 key blocks of 256
    under this causal mask), the dq and dk/dv kernels when not; a step takes one of the two kv heads (two head
    groups). Packed sequences whose query blocks may need many key blocks fall back to unfused unless asked."""
    q, k, v = _inputs(rand, 1, 512, 512, 8, 2, 128)
    blocks = tk.FlashAttentionBlocks(block_q=128, block_kv=256)
    fwd = ladder.pallas_calls(lambda q, k, v: tk.flash_attention(q, k, v, causal=True, blocks=blocks), q, k, v)
    assert [(c.name, c.grid) for c in fwd] == [("flash_attention_fwd", (2, 6))], fwd

    def grad_calls(fn, *args):
        return [(c.name, c.grid) for c in ladder.pallas_calls(jax.grad(fn, argnums=(0, 1, 2)), *args)]

    for fused, kernels in (
        (
            True,
            [("flash_attention_delta", (2, 4)), ("flash_attention_dkv", (2, 6)), ("flash_attention_dq_sum", (2, 4, 2))],
        ),
        (False, [("flash_attention_dq", (2, 6)), ("flash_attention_dkv", (2, 6))]),
    ):
        chosen = tk.FlashAttentionBlocks(block_q=128, block_kv=256, fused_backward=fused)
        calls = grad_calls(lambda q, k, v: tk.flash_attention(q, k, v, causal=True, blocks=chosen).sum(), q, k, v)
        assert calls == [("flash_attention_fwd", (2, 6))] + kernels, calls
    # the backward on blocks of its own, 256 x 128 (the forward's stay 128 x 256): 2 query blocks, the causal dk/dv
    # list's 2 + 4 visits, and 4 slots of the query block that needs 4 key blocks
    own = tk.FlashAttentionBlocks(block_q=128, block_kv=256, backward_block_q=256, backward_block_kv=128)
    calls = grad_calls(lambda q, k, v: tk.flash_attention(q, k, v, causal=True, blocks=own).sum(), q, k, v)
    assert calls == [
        ("flash_attention_fwd", (2, 6)),
        ("flash_attention_delta", (2, 2)),
        ("flash_attention_dkv", (2, 6)),
        ("flash_attention_dq_sum", (2, 2, 4)),
    ], calls
    # by default each direction takes its own table's blocks (Qwen3's benchmark shape on v6e; their kernels are
    # compiled in test_compiles_at_benchmark_shapes), a caller's forward blocks both unless the backward's are given
    shape = dict(q_rows=32768, kv_rows=32768, q_heads=32, kv_heads=4, head_dim=128, v_head_dim=128, itemsize=2)
    v6e = chip.tpu_info_for("v6e")
    table = tuning.resolve_blocks(None, **shape, info=v6e)
    assert (table.block_q, table.block_kv) == tuning.TABLE["v6e"][128], table
    assert (table.backward_block_q, table.backward_block_kv) == tuning.BACKWARD_TABLE["v6e"][128], table
    given = tuning.resolve_blocks(tk.FlashAttentionBlocks(block_q=256, block_kv=512), **shape, info=v6e)
    assert (given.backward_block_q, given.backward_block_kv) == (256, 512), given
    # kv heads a step (tuning.QUERY_HEADS_PER_STEP): Qwen3 the fewest legal (8 query heads); Gemma 4 sliding (16 / 8
    # heads x 256) all 8 on v5e and v6e, 4 on v7x (two head groups for its two cores), and fewer where a caller's
    # blocks or VMEM limit would not hold 8 (1024 x 1024 both ways: 148 MiB at 8, 90 MiB at 4; 40 MiB: 37 MiB at 4)
    assert table.kv_heads_per_step == 1, table
    sliding = dict(shape, q_heads=16, kv_heads=8, head_dim=256, v_head_dim=256)
    for generation, expected in (("v5e", 8), ("v6e", 8), ("v7x", 4)):
        chosen = tuning.resolve_blocks(None, **sliding, info=chip.tpu_info_for(generation))
        assert chosen.kv_heads_per_step == expected, (generation, chosen)
    for caller in (
        tk.FlashAttentionBlocks(block_q=1024, block_kv=1024),
        tk.FlashAttentionBlocks(vmem_limit_bytes=40 << 20),
    ):
        assert tuning.resolve_blocks(caller, **sliding, info=v6e).kv_heads_per_step == 4, caller
    # 1200 packed rows, key blocks of 128: a query block may meet 3 sequences of up to 1000 keys, bounded only by the
    # 10 key blocks, over the 8 slots the table takes
    cu = jnp.asarray([0, 100, 200, 1200], jnp.int32)
    q3, k3, v3 = _inputs(rand, 1, 1200, 1200, 8, 4, 64)
    q3, k3, v3 = q3[0], k3[0], v3[0]

    def varlen(blocks):
        return lambda q, k, v: tk.flash_attention_varlen(q, k, v, cu, cu, 1000, 1000, blocks=blocks).sum()

    assert "flash_attention_dq" in dict(grad_calls(varlen(tk.FlashAttentionBlocks(128, 128)), q3, k3, v3))
    assert "flash_attention_dq_sum" in dict(grad_calls(varlen(SMALL), q3, k3, v3))


@pytest.mark.cpu_only
def test_table_blocks_capped_by_the_sequences(monkeypatch):
    """A packed batch's table blocks are capped by its longest sequence (tuning.packed_block_cap: a quarter of it
    forward, an eighth backward, a power of two times 128, at least 512), an equal-length batch's by its sequences'
    query and key rows (tuning.sequence_block_cap: no block spans two sequences); a caller's blocks are kept.
    flash_attention_varlen passes the longest of max_seqlen_q / max_seqlen_k, flash_attention its sequence lengths:
    their kernels take the capped blocks' grids."""
    assert [tuning.packed_block_cap(n, "forward") for n in (100, 1722, 2048, 4096, 6893, 8192)] == [
        512,
        512,
        512,
        1024,
        1024,
        2048,
    ]
    assert [tuning.packed_block_cap(n, "backward") for n in (1722, 6893, 8192, 32768)] == [512, 512, 1024, 4096]
    shape = dict(q_rows=32768, kv_rows=32768, q_heads=32, kv_heads=4, head_dim=128, v_head_dim=128, itemsize=2)
    v6e = chip.tpu_info_for("v6e")
    fields = ("block_q", "block_kv", "backward_block_q", "backward_block_kv")

    def resolved(blocks=None, **kw):
        chosen = tuning.resolve_blocks(blocks, **shape, info=v6e, **kw)
        return tuple(getattr(chosen, f) for f in fields)

    assert resolved() == (1024, 1024, 1024, 2048)
    assert resolved(longest_sequence=1722) == (512, 512, 512, 512)
    assert resolved(longest_sequence=6893) == (1024, 1024, 512, 512)
    assert resolved(longest_sequence=32768) == (1024, 1024, 1024, 2048)
    caller = tk.FlashAttentionBlocks(block_q=1024, block_kv=1024)
    assert resolved(caller, longest_sequence=1722) == (1024, 1024, 1024, 1024)
    assert [tuning.sequence_block_cap(n) for n in (1, 100, 1024, 1500, 2048, 4096)] == [
        128,
        128,
        1024,
        1024,
        2048,
        4096,
    ]
    assert resolved(sequence_rows=(1024, 1024)) == (1024, 1024, 1024, 1024)
    assert resolved(sequence_rows=(4096, 4096)) == (1024, 1024, 1024, 2048)
    assert resolved(sequence_rows=(512, 1500)) == (512, 1024, 512, 1024)
    assert resolved(caller, sequence_rows=(512, 512)) == (1024, 1024, 1024, 1024)

    # end to end (traced only): the default call's kernels run the grids of explicit 512 x 512 blocks, not the
    # table's 1024 x 1024 (v6e, head dim 128, 4096 packed rows, max_seqlen_k 1600)
    monkeypatch.setenv("TPU_KERNELS_TARGET", "v6e")
    lengths = np.array([700, 1500, 96, 1300, 500])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    rows = int(lengths.sum())
    q = jax.ShapeDtypeStruct((rows, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((rows, 1, 128), jnp.bfloat16)

    def grids(blocks):
        def loss(q, k, v):
            out = tk.flash_attention_varlen(q, k, v, cu, cu, 1500, 1600, causal=True, blocks=blocks)
            return out.astype(jnp.float32).sum()

        return [(c.name, c.grid) for c in ladder.pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)]

    default, small, large = (
        grids(b) for b in (None, tk.FlashAttentionBlocks(512, 512), tk.FlashAttentionBlocks(1024, 1024))
    )
    assert default == small != large, (default, small, large)

    # 4 sequences of 1024 (v6e): the backward takes 1024 x 1024, not the table's 1024 x 2048
    q = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 1024, 1, 128), jnp.bfloat16)

    def dense_grids(blocks):
        def loss(q, k, v):
            return tk.flash_attention(q, k, v, causal=True, blocks=blocks).astype(jnp.float32).sum()

        # the grids match here (4 dk/dv visits either way); the VMEM limit follows the backward's blocks
        return [
            (c.name, c.grid, c.vmem_limit_bytes)
            for c in ladder.pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
        ]

    within = tk.FlashAttentionBlocks(1024, 1024, backward_block_q=1024, backward_block_kv=1024)
    spanning = tk.FlashAttentionBlocks(1024, 1024, backward_block_q=1024, backward_block_kv=2048)
    default, within, spanning = (dense_grids(b) for b in (None, within, spanning))
    assert default == within != spanning, (default, within, spanning)


@pytest.mark.cpu_only
def test_candidate_blocks_vary_the_tiles_and_the_heads_a_step():
    """tuning.candidate_blocks (the tilings --sweep times): the table's choice first, that direction's tiles, then
    the table's blocks at every other legal count of that direction's kv heads a step (Gemma 4 sliding on v5e: 1, 2
    and 4 beside the table's 8), all distinct."""
    shape = dict(q_rows=32768, kv_rows=32768, q_heads=16, kv_heads=8, head_dim=256, v_head_dim=256, itemsize=2)
    v5e = chip.tpu_info_for("v5e")
    fields = ("block_q", "block_kv", "backward_block_q", "backward_block_kv")
    for direction in ("forward", "backward"):
        candidates = tuning.candidate_blocks(direction=direction, info=v5e, **shape)
        table = candidates[0]
        assert table == tuning.resolve_blocks(None, **shape, info=v5e) and table.kv_heads_per_step == 8
        assert len(set(candidates)) == len(candidates) > 4
        at_table = [c for c in candidates if all(getattr(c, f) == getattr(table, f) for f in fields)]
        count = "kv_heads_per_step" if direction == "forward" else "backward_kv_heads_per_step"
        assert sorted(getattr(c, count) for c in at_table) == [1, 2, 4, 8], (direction, candidates)
        if direction == "backward":  # the forward's count stays the table's
            assert {c.kv_heads_per_step for c in at_table} == {8}


def test_small_windows_take_their_own_blocks(rand, monkeypatch):
    """A sliding window of at most tuning.SMALL_WINDOW_KEYS keys a row takes SMALL_WINDOW_TABLE's blocks in both
    directions where the generation has the head dim (gpt-oss: window 128, head dim 64); wider or unbounded windows
    and other head dims take the tables'. End to end: the default call's kernels run the small window's grids, and at
    the interpret default's blocks the result and gradients match the reference (sinks, a window of 100 keys)."""
    assert schedule.window_keys(causal=True, window_size=(127, 0)) == 128
    assert schedule.window_keys(causal=True, window_size=(127, 9)) == 128  # causal: the right side is 0
    assert schedule.window_keys(causal=False, window_size=(3, 4)) == 8
    assert schedule.window_keys(causal=True, window_size=(-1, 0)) is None
    assert schedule.window_keys(causal=False, window_size=(5, -1)) is None
    fields = ("block_q", "block_kv", "backward_block_q", "backward_block_kv")

    def resolved(head_dim=64, **kw):
        shape = dict(q_rows=32768, kv_rows=32768, q_heads=64, kv_heads=8, head_dim=head_dim, v_head_dim=head_dim)
        chosen = tuning.resolve_blocks(None, **shape, itemsize=2, info=chip.tpu_info_for("v5e"), **kw)
        return tuple(getattr(chosen, f) for f in fields)

    small = tuning.SMALL_WINDOW_TABLE["v5e"][64] * 2
    table = tuning.TABLE["v5e"][64] + tuning.BACKWARD_TABLE["v5e"][64]
    assert small != table
    assert resolved(window_keys=128) == resolved(window_keys=tuning.SMALL_WINDOW_KEYS) == small
    assert resolved(window_keys=tuning.SMALL_WINDOW_KEYS + 1) == resolved() == table
    assert resolved(head_dim=128, window_keys=128) == tuning.TABLE["v5e"][128] + tuning.BACKWARD_TABLE["v5e"][128]

    monkeypatch.setenv("TPU_KERNELS_TARGET", "v5e")
    q, kv = _spec((2, 2048, 16, 64)), _spec((2, 2048, 2, 64))

    def grids(blocks, window_size=(127, 0)):
        def loss(q, k, v):
            out = tk.flash_attention(q, k, v, causal=True, window_size=window_size, blocks=blocks)
            return out.astype(jnp.float32).sum()

        return [(c.name, c.grid) for c in ladder.pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)]

    given = tk.FlashAttentionBlocks(**dict(zip(fields, small)))

    def backward_grids(grids):
        return [g for g in grids if g[0] not in FORWARD_KERNELS]

    default = grids(None)
    assert backward_grids(default) == backward_grids(grids(given)) != backward_grids(grids(None, window_size=(511, 0)))
    # the default's forward is the band (each query block of 128 rows one step); the caller's blocks, the visits'
    assert [(name, grid[1]) for name, grid in default if name in FORWARD_KERNELS] == [("flash_attention_band_fwd", 32)]
    assert [name for name, _ in grids(given) if name in FORWARD_KERNELS] == ["flash_attention_fwd"]
    monkeypatch.delenv("TPU_KERNELS_TARGET")

    q, k, v = _inputs(rand, 1, 640, 640, 4, 2, 64)
    sinks = rand.normal((4,), scale=2.0)
    _check_default_call_with_sinks(rand, (q, k, v, sinks), dict(causal=True, window_size=(99, 0)))


def test_windows_up_to_window_keys_take_their_own_forward_blocks(monkeypatch):
    """A sliding window of more than SMALL_WINDOW_KEYS and at most WINDOW_KEYS keys a row takes WINDOW_TABLE's forward
    blocks where the generation has the head dim (Gemma 4 sliding on the v5e: window 1024, head dim 256, 256 x 256);
    the backward keeps BACKWARD_TABLE's, the kv heads a step stay the table's (16 query heads), and wider or
    unbounded windows and other generations take TABLE's. End to end: the default call's forward runs that grid."""
    fields = ("block_q", "block_kv", "backward_block_q", "backward_block_kv", "kv_heads_per_step")

    def resolved(generation="v5e", head_dim=256, **kw):
        shape = dict(q_rows=32768, kv_rows=32768, q_heads=16, kv_heads=8, head_dim=head_dim, v_head_dim=head_dim)
        chosen = tuning.resolve_blocks(None, **shape, itemsize=2, info=chip.tpu_info_for(generation), **kw)
        return tuple(getattr(chosen, f) for f in fields)

    window = tuning.WINDOW_TABLE["v5e"][256] + tuning.BACKWARD_TABLE["v5e"][256] + (8,)
    table = tuning.TABLE["v5e"][256] + tuning.BACKWARD_TABLE["v5e"][256] + (8,)
    assert window != table
    assert resolved(window_keys=1024) == resolved(window_keys=tuning.SMALL_WINDOW_KEYS + 1) == window
    assert resolved(window_keys=tuning.WINDOW_KEYS + 1) == resolved() == table
    assert resolved("v6e", window_keys=1024) == resolved("v6e")  # not measured there
    assert resolved(head_dim=128, window_keys=1024) == resolved(head_dim=128)

    monkeypatch.setenv("TPU_KERNELS_TARGET", "v5e")
    q, kv = _spec((1, 2048, 16, 256)), _spec((1, 2048, 8, 256))

    def forward_grids(window_size, blocks=None):
        def attend(q, k, v):
            return tk.flash_attention(q, k, v, causal=True, window_size=window_size, blocks=blocks)

        return [(c.name, c.grid) for c in ladder.pallas_calls(attend, q, kv, kv)]

    given = tk.FlashAttentionBlocks(block_q=256, block_kv=256)
    assert forward_grids((1023, 0)) == forward_grids((1023, 0), given) != forward_grids((-1, 0))


def test_the_backward_takes_its_own_kv_heads_a_step(rand):
    """blocks.backward_kv_heads_per_step: the backward's kernels take their own count of kv heads a step, the forward's
    lse regrouped for them (and the lse's cotangent): with a step's query heads in place on one side and merged on the
    other, fused and unfused, with sinks and a window, the gradients (q, k, v, sinks; lse returned and differentiated)
    match the reference. A count that is no divisor, or not lane-legal, is refused naming the field."""
    q, k, v = _inputs(rand, 1, 384, 384, 8, 4, 128)
    sinks = rand.normal((8,), scale=2.0)
    options = dict(causal=True, window_size=(200, 0))

    def with_lse(fn):
        def both(q, k, v, s):
            out, lse = fn(q, k, v, s)
            return out, jnp.where(jnp.isfinite(lse), lse, 0.0)

        return both

    reference = with_lse(lambda q, k, v, s: attention_reference(q, k, v, sinks=s, return_lse=True, **options))
    for forward_count, backward_count, fused in ((4, 1, True), (1, 4, True), (2, 1, False)):
        blocks = tk.FlashAttentionBlocks(
            block_q=128,
            block_kv=128,
            kv_heads_per_step=forward_count,
            backward_kv_heads_per_step=backward_count,
            fused_backward=fused,
        )
        kernel = with_lse(
            lambda q, k, v, s, blocks=blocks: tk.flash_attention(
                q, k, v, sinks=s, return_lse=True, blocks=blocks, **options
            )
        )
        _check_f32_gradients(kernel, reference, (q, k, v, sinks), names=("q", "k", "v", "sinks"), rand=rand)
    for bad, message in ((3, "expected a divisor of the 4 kv heads, got 3"), (0, "backward_kv_heads_per_step")):
        with pytest.raises(ValueError, match=message):
            tk.flash_attention(q, k, v, blocks=tk.FlashAttentionBlocks(backward_kv_heads_per_step=bad), **options)


def test_gemma4_sliding_backward_takes_its_own_heads_a_step_on_v5e():
    """Under a window of 257-1024 keys the v5e's backward takes WINDOW_BACKWARD_QUERY_HEADS' query heads a step
    (Gemma 4 sliding: 4, i.e. 2 kv heads; measured 14853 against 19156 us at the forward's 8), the forward keeping
    its own (8 kv heads); a caller's kv_heads_per_step serves both directions; elsewhere the two counts agree."""

    def resolved(generation="v5e", window_keys=1024, **given):
        shape = dict(q_rows=32768, kv_rows=32768, q_heads=16, kv_heads=8, head_dim=256, v_head_dim=256, itemsize=2)
        blocks = tk.FlashAttentionBlocks(**given) if given else None
        chosen = tuning.resolve_blocks(blocks, **shape, info=chip.tpu_info_for(generation), window_keys=window_keys)
        return chosen.kv_heads_per_step, chosen.backward_kv_heads_per_step

    assert tuning.WINDOW_BACKWARD_QUERY_HEADS["v5e"][256] == 4
    assert resolved() == (8, 2)
    assert resolved(kv_heads_per_step=4) == (4, 4)
    assert resolved(backward_kv_heads_per_step=8) == (8, 8)
    assert resolved(window_keys=None) == resolved(window_keys=2048) == (8, 8)
    assert resolved("v6e") == (8, 8)


def test_head_dim_64_runs_padded_to_128(rand, monkeypatch):
    """Head dim 64 (gpt-oss) runs as head dim 128, q / K / V zero-padded and the output sliced
    (tuning.PADDED_HEAD_DIMS), except under a small window, which keeps its own blocks at head dim 64; other head dims
    run as given. End to end: the kernels see 128 lanes a head, and the result, log-sum-exp and gradients (sinks
    included) match the reference at head dim 64, dense and packed."""
    v5e = chip.tpu_info_for("v5e")
    assert tuning.run_head_dims(64, 64, info=v5e) == (128, 128)
    assert tuning.run_head_dims(64, 64, window_keys=tuning.SMALL_WINDOW_KEYS + 1, info=v5e) == (128, 128)
    assert tuning.run_head_dims(64, 64, window_keys=128, info=v5e) == (64, 64)
    assert tuning.run_head_dims(64, 128, info=v5e) == (64, 128)
    assert tuning.run_head_dims(128, 128, info=v5e) == (128, 128)

    monkeypatch.setenv("TPU_KERNELS_TARGET", "v5e")
    q, kv = _spec((1, 1024, 16, 64)), _spec((1, 1024, 2, 64))

    def lanes(window_size):
        def loss(q, k, v):
            out = tk.flash_attention(q, k, v, causal=True, window_size=window_size)
            return out.astype(jnp.float32).sum()

        shapes = _kernel_shapes(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
        ((_, outputs),) = (shapes[name] for name in FORWARD_KERNELS if name in shapes)
        return outputs[0][-1]  # the output's lanes a head as the forward kernel writes it ([T, Hq, Dv])

    assert (lanes((-1, -1)), lanes((127, 0))) == (128, 64)
    monkeypatch.delenv("TPU_KERNELS_TARGET")

    q, k, v = _inputs(rand, 2, 300, 300, 4, 2, 64)
    sinks = rand.normal((4,), scale=2.0)
    options = dict(causal=True, sinks=sinks, return_lse=True)
    out, lse = ladder.check_against_reference(
        lambda q, k, v: tk.flash_attention(q, k, v, **options),
        lambda q, k, v: attention_reference(q, k, v, **options),
        (q, k, v),
        dtype=jnp.float32,
        rand=rand,
        **F32_TOL,
        jit_kernel=True,
    )
    assert out.shape == (2, 300, 4, 64) and lse.shape == (2, 4, 300)
    cu = jnp.asarray([0, 300, 600], jnp.int32)
    packed = [x.reshape(600, *x.shape[2:]) for x in (q, k, v)]
    _check_f32_gradients(
        lambda q, k, v, s: tk.flash_attention_varlen(q, k, v, cu, cu, 300, 300, causal=True, sinks=s),
        lambda q, k, v, s: attention_reference(
            *(x.reshape(2, 300, *x.shape[1:]) for x in (q, k, v)), causal=True, sinks=s
        ).reshape(600, 4, 64),
        (*packed, sinks),
        names=["dq", "dk", "dv", "dsinks"],
        rand=rand,
    )


def _benchmark_call(shape, blocks=None):
    """(loss of q, k, v, their specs) of a benchmark shape (its options and lengths: the benchmark's own config): the
    mean of flash attention's output, dense or packed."""
    cfg = benchmark_config(shape)
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    options = dict(causal=cfg.causal, window_size=cfg.window, softmax_scale=cfg.scale, blocks=blocks)
    if cfg.sinks:
        options["sinks"] = benchmark_sinks(hq)
    if cfg.layout == "dense":
        specs = [_spec((len(cfg.lengths), shape.batch, h, d)) for h in (hq, hkv, hkv)]
        attend = functools.partial(tk.flash_attention, **options)
    else:
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(cfg.lengths)]), jnp.int32)
        longest = cfg.max_seqlen
        specs = [_spec((sum(cfg.lengths), h, d)) for h in (hq, hkv, hkv)]
        attend = lambda q, k, v: tk.flash_attention_varlen(q, k, v, cu, cu, longest, longest, **options)  # noqa: E731
    return (lambda q, k, v: attend(q, k, v).astype(jnp.float32).mean()), specs


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ["v5e", "v6e", "v7x"])
def test_table_blocks_fit_every_benchmark_shape(generation, monkeypatch):
    """At every benchmark shape (dense seq 1024 to 32768, packed batches) the default call's forward and backward
    trace on each generation: the table's blocks, the backward the dq slots choose (fused on BACKWARD_TABLE's
    blocks, fused on LONG_BACKWARD_TABLE's, or unfused on UNFUSED_BACKWARD_TABLE's) and the heads a step all fit the
    VMEM limit and the visit lists' limits (a kernel's body depends on the model and the blocks, which the sequence
    lengths pick, so these are the choices the deviceless compiles prove, made at every shape)."""
    monkeypatch.setenv("TPU_KERNELS_TARGET", generation)
    backward = {}
    for shape in FLASH_ATTENTION:
        loss, specs = _benchmark_call(shape)
        names = {c.name for c in ladder.pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), *specs)}
        assert names & FORWARD_KERNELS and "flash_attention_dkv" in names, (shape.id, names)
        backward[shape.id] = "unfused" if "flash_attention_dq" in names else "fused"
    if generation == "v6e":
        # seq 32768: a query block needs 16 key blocks of 2048, over the 8 slots; Qwen3 (head dim 128) takes the fused
        # backward on 512 x 4096 (8 slots), Gemma 4 full (512) the unfused one (at 1024 x 2048 its fused backward would
        # need 97 MiB of VMEM unfused; Gemma 4's window needs 3 key blocks of 512)
        long = {s["model"]: s for s in FLASH_ATTENTION if s["layout"] == "dense" and s.batch == 32768}
        assert backward[long["qwen3-30b-a3b"].id] == "fused" and backward[long["gemma4-full"].id] == "unfused"
        assert backward[long["gemma4-sliding"].id] == "fused"
        wide = tk.FlashAttentionBlocks(fused_backward=True, backward_block_q=512, backward_block_kv=4096)
        default, specs = _benchmark_call(long["qwen3-30b-a3b"])
        given, _ = _benchmark_call(long["qwen3-30b-a3b"], wide)
        grads = (jax.grad(loss, argnums=(0, 1, 2)) for loss in (default, given))
        assert _kernel_shapes(next(grads), *specs) == _kernel_shapes(next(grads), *specs)
        # a packed batch that falls back to the unfused backward sizes its dk/dv list at the unfused blocks: two
        # sequences of 20000 (cap 2048 keys), fused 1024 x 2048 with 10 slots > 8, so unfused at 1024 x 1024
        cu = jnp.asarray([0, 20000, 40000], jnp.int32)
        q, kv = _spec((40000, 8, 128)), _spec((40000, 1, 128))

        def dkv_inputs(blocks):
            """The dk/dv kernel's input shapes: its visit list's length is the list size the bound gave."""

            def loss(q, k, v):
                out = tk.flash_attention_varlen(q, k, v, cu, cu, 20000, 20000, causal=True, blocks=blocks)
                return out.astype(jnp.float32).mean()

            return _kernel_shapes(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)["flash_attention_dkv"][0]

        unfused_table = tk.FlashAttentionBlocks(1024, 1024, fused_backward=False)
        other = tk.FlashAttentionBlocks(
            1024, 1024, fused_backward=False, backward_block_kv=2048, vmem_limit_bytes=2**27
        )
        default, table, other = dkv_inputs(None), dkv_inputs(unfused_table), dkv_inputs(other)
        assert default == table != other, (default, table, other)


def _kernel_shapes(fn, *args):
    """{kernel name: (input shapes, output shapes)} of the pallas_calls in fn's program (the last of a name)."""
    shapes = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                shapes[eqn.params.get("name")] = (
                    [tuple(x.aval.shape) for x in eqn.invars],
                    [tuple(x.aval.shape) for x in eqn.outvars],
                )
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


@pytest.mark.cpu_only
def test_forward_takes_heads_as_they_lie(rand):
    """The forward reads q [T, H, D] and writes out [T, H, Dv] as they lie (no relayout into merged heads) where a
    step's query heads are a multiple of 8 or all of them, and k, v [T, Hkv, D] as they lie where a step also takes
    every kv head, a multiple of 8; otherwise it takes them merged into lanes. Every path runs in the reference checks
    above (HEAD_LAYOUTS: 8 query heads a step in place with K/V merged, 16 with K/V in place, 2 of 4 merged)."""
    for (hq, hkv, d), expected, kv_expected in (
        ((8, 1, 128), (300, 8, 128), (200, 128)),
        ((8, 4, 128), (300, 8 * 128), (200, 4 * 128)),
        ((16, 8, 256), (300, 16, 256), (200, 8, 256)),
    ):
        q, k, v = _inputs(rand, 1, 300, 200, hq, hkv, d, dtype=jnp.bfloat16)
        shapes = _kernel_shapes(lambda q, k, v: tk.flash_attention(q, k, v, blocks=SMALL), q, k, v)
        inputs, outputs = shapes["flash_attention_fwd"]
        assert outputs[0] == expected and inputs[-2:] == [kv_expected] * 2, (hq, hkv, d, shapes)


@pytest.mark.cpu_only
def test_backward_takes_heads_as_they_lie(rand):
    """The fused backward reads out and do [T, H, Dv] as they lie (the delta kernel also writes do merged, for the
    dk/dv kernel) and writes dq [T, H, D] (the slot sum splits the heads), where the forward takes q as it lies;
    otherwise all merged; k and v [T, Hkv, D] as they lie, dk and dv written so, where the forward takes them so
    (every kv head a step, a multiple of 8). Every path runs in the gradient checks (test_gradients_gqa_head_dims: 8
    query heads a step in place, with K/V in place at head dim 256; test_bfloat16_gradients: 2 of 4, merged)."""
    for (hq, hkv, d), in_place in (((8, 1, 128), True), ((8, 4, 128), False), ((16, 8, 256), True)):
        q, k, v = _inputs(rand, 1, 300, 200, hq, hkv, d, dtype=jnp.bfloat16)
        loss = lambda q, k, v: tk.flash_attention(q, k, v, blocks=SMALL).astype(jnp.float32).sum()  # noqa: E731
        shapes = _kernel_shapes(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
        delta_in, delta_out = shapes["flash_attention_delta"]
        dq_out = shapes["flash_attention_dq_sum"][1]
        merged = (300, hq * d)
        if in_place:
            assert delta_in[:2] == [(300, hq, d)] * 2 and delta_out[1:] == [merged], shapes
            assert dq_out == [(300, hq, d)], shapes
        else:
            assert delta_in[:2] == [merged] * 2 and len(delta_out) == 1, shapes
            assert dq_out == [merged], shapes
        assert shapes["flash_attention_dkv"][0][-3] == merged, shapes  # do, merged, as the dk/dv kernel streams it
        kv = (200, hkv, d) if hkv == 8 else (200, hkv * d)
        assert shapes["flash_attention_dkv"][0][-5:-3] == [kv] * 2 and shapes["flash_attention_dkv"][1][:2] == [kv] * 2


def test_empty_inputs(rand):
    q, k, v = _inputs(rand, 2, 0, 5, 4, 2, 64)
    assert tk.flash_attention(q, k, v).shape == (2, 0, 4, 64)
    q, k, v = _inputs(rand, 1, 6, 0, 4, 2, 64)
    sinks = rand.normal((4,))
    out, lse = tk.flash_attention(q, k, v, sinks=sinks, return_lse=True)
    assert (np.asarray(out) == 0).all()
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(np.asarray(sinks)[None, :, None], (1, 4, 6)))


# ---------------------------------------------------------------------------------------------------- rungs 2 and 3
def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _grad_fn(**options):
    def fn(q, k, v):
        return jax.grad(lambda q, k, v: ladder.vjp_loss(tk.flash_attention(q, k, v, **options)), argnums=(0, 1, 2))(
            q, k, v
        )

    return fn


@pytest.mark.cpu_only
def test_exports_for_tpu():
    specs = (_spec((2, 1024, 8, 128)), _spec((2, 1024, 2, 128)), _spec((2, 1024, 2, 128)))
    ladder.export_for_tpu(lambda q, k, v: tk.flash_attention(q, k, v, causal=True), *specs)
    ladder.export_for_tpu(_grad_fn(causal=True, window_size=(256, 0), softcap=30.0), *specs)
    # a window of 128 keys: the band forward (band.py) and the backward's visit kernels
    ladder.export_for_tpu(_grad_fn(causal=True, window_size=(127, 0)), *specs)
    cu = _spec((5,), jnp.int32)
    ladder.export_for_tpu(
        lambda q, k, v, a, b: tk.flash_attention_varlen(q, k, v, a, b, 1024, 1024, causal=True),
        _spec((2048, 8, 128)),
        _spec((2048, 2, 128)),
        _spec((2048, 2, 128)),
        cu,
        cu,
    )


@pytest.mark.cpu_only
def test_compiles_for_tpu():
    """The varlen entry point (its visit list built at run time) at head dim 64 (two kv heads a step) lowers and fits
    VMEM on v6e; the features on every generation and each model's kernels are compiled in
    test_compiles_at_benchmark_shapes. A GQA group of 2 (4 query heads a step): the compile time grows with the
    query heads a step, and the larger groups' lowering is proven at the benchmark shapes (Qwen3, Gemma 4 full: 8)."""
    ladder.compile_for_tpu(
        lambda q, k, v, a, b: tk.flash_attention_varlen(q, k, v, a, b, 2048, 2048, causal=True),
        "v6e",
        ((8192, 8, 64), jnp.bfloat16),
        ((8192, 4, 64), jnp.bfloat16),
        ((8192, 4, 64), jnp.bfloat16),
        ((9,), jnp.int32),
        ((9,), jnp.int32),
        label="flash_attention_varlen d64",
    )


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ["v5e", "v6e", "v7x"])
def test_band_compiles_for_tpu(generation):
    """The band forward (a window of 256 keys: two key blocks back, sinks, GQA 8 at head dim 64; and head dim 256 with
    8 kv heads) lowers and fits VMEM on every generation; gpt-oss's sliding layers (one block back) compile in
    test_compiles_at_benchmark_shapes."""
    ladder.compile_for_tpu(
        lambda q, k, v, sinks: tk.flash_attention(q, k, v, causal=True, window_size=(255, 0), sinks=sinks),
        generation,
        ((2, 1024, 16, 64), jnp.bfloat16),
        ((2, 1024, 2, 64), jnp.bfloat16),
        ((2, 1024, 2, 64), jnp.bfloat16),
        ((16,), jnp.float32),
        label="flash_attention band",
    )
    # head dim 256 with 8 kv heads: every kv head a step where the table takes them (q, K and V as they lie)
    ladder.compile_for_tpu(
        lambda q, k, v: tk.flash_attention(q, k, v, causal=True, window_size=(127, 0)),
        generation,
        ((1, 1024, 16, 256), jnp.bfloat16),
        ((1, 1024, 8, 256), jnp.bfloat16),
        ((1, 1024, 8, 256), jnp.bfloat16),
        label="flash_attention band d256",
    )


@pytest.mark.cpu_only
@pytest.mark.slow
@pytest.mark.parametrize(
    "model, generation, fused",
    [("qwen3-30b-a3b", "v6e", True), ("qwen3-30b-a3b", "v6e", False), ("gemma4-full", "v6e", False)]
    + [("gemma4-full", "v7x", False)],
)
def test_compiles_long_sequence_backward_at_benchmark_blocks(model, generation, fused):
    """The backwards the default call takes where a query block would need more than MAX_DQ_SLOTS key blocks of
    BACKWARD_TABLE's (seq 32768 unmasked and causal): fused on LONG_BACKWARD_TABLE's blocks (v6e head dim 128: 512 x
    4096), else unfused (a dq kernel beside the dk/dv kernel) on UNFUSED_BACKWARD_TABLE's (v6e 1024 x 1024 at head
    dim 128, 512 x 2048 at 512; v7x 256 x 512, the least VMEM): the same kernel bodies as seq 32768's, compiled at
    seq 4096 where the visit lists are 64 times shorter. The gradient's forward kernel runs at 128 x 128 (the
    table's forward is test_compiles_at_benchmark_shapes'; at its blocks it was ~45 % of this compile's time), every
    backward field as the default call resolves it."""
    dims = FLASH_ATTENTION_MODELS[model]
    q = ((1, 4096, dims["q_heads"], dims["head_dim"]), jnp.bfloat16)
    k = ((1, 4096, dims["kv_heads"], dims["head_dim"]), jnp.bfloat16)
    table = tuning.LONG_BACKWARD_TABLE if fused else tuning.UNFUSED_BACKWARD_TABLE
    pair = table[generation][dims["head_dim"]]
    blocks = tk.FlashAttentionBlocks(fused_backward=fused, backward_block_q=pair[0], backward_block_kv=pair[1])
    with jax.default_device(ladder.tpu_device(generation)):
        resolved = tuning.resolve_blocks(
            blocks,
            q_rows=4096,
            kv_rows=4096,
            q_heads=dims["q_heads"],
            kv_heads=dims["kv_heads"],
            head_dim=dims["head_dim"],
            v_head_dim=dims["head_dim"],
            itemsize=2,
            sequence_rows=(4096, 4096),
        )
    assert (resolved.backward_block_q, resolved.backward_block_kv, resolved.fused_backward) == (*pair, fused)
    blocks = dataclasses.replace(resolved, block_q=128, block_kv=128)
    label = f"flash_attention {'fused' if fused else 'unfused'} long {model}"
    ladder.compile_for_tpu(_grad_fn(causal=True, blocks=blocks), generation, q, k, k, label=label, min_kernels=3)


def _benchmark_cases():
    """(shape, generation): the causal dense benchmark shapes at sequence 4096 of Qwen3 and Gemma 4's full layers on v6e
    (the tables' largest blocks, 8 query heads a step: at head dim 128 the forward's 1024 x 1024 and the backward's 1024
    x 2048; at 512 the forward's 512 x 1024 and the backward's 512 x 2048; packed batches take the tables' blocks or
    smaller ones, tuning.packed_block_cap), Gemma 4's full layers on v7x (head dim 512, the fused backward's f32 dq
    blocks of 512 lanes, on the generation with the least VMEM), and Gemma 4's sliding layers on v5e, whose lowering
    differs (128-wide MXUs). On v5e the tables take 512 x 512 or less at every head dim (the forward 256 x 512 at head
    dim 512), within v6e's head dim 512 blocks in the same 128 MiB of VMEM, so the v6e compile bounds v5e's largest
    working set; the v5e compile proves the generation's
    lowering of every feature. Gemma 4's sliding layers take all 8 kv heads (16 query heads; q, K, V and their gradients
    as they lie) a step and 512 x 512 blocks both ways on v5e and v6e (one body; 66 MiB, within Gemma 4 full's 90 MiB on
    v6e, so the Gemma 4 full compiles bound their fit), and 4 kv heads (8 query heads, K and V merged) on v7x (37 MiB,
    under its 48 MiB limit, as Qwen3's 40 MiB there); the v5e compile proves the 16-head body's lowering, and the v6e
    16-head and v7x 8-head sliding programs were compiled when the table took them (28 s and 22 s), not here for the
    suite's time. The v6e compiles prove the sliding layers' code paths (head dim 256 shares the head dim 512's: early
    scores, no row sums on the MXU); a window is the kernels' run-time key ranges and visit list, not their body. A
    kernel's body depends on the model (head dims, GQA group, the tuning table's blocks, which every benchmark sequence
    length fills) and on the backward's blocks and fusion (other at seq 32768: test_compiles_long_sequence_backward_
    at_benchmark_blocks), not on the sequence length or the mask (those set the grid and the visit list, which the
    kernels read at run time), so these prove the lowering and VMEM fit of every benchmark shape's kernels at a
    fraction of the longest shape's compile time (its visit lists are constants of the program). On v5e and v7x the
    program also takes every score feature (a causal window, softcap): one compile per generation proves the features'
    lowering with the generation's heaviest working set. gpt-oss's sliding layers (head dim 64, eight query heads a kv
    head, sinks) compile on v5e at their small window's blocks (tuning.SMALL_WINDOW_TABLE); its full layers run padded
    to head dim 128 (tuning.PADDED_HEAD_DIMS), Qwen3's body (8 query heads a kv head)."""
    shapes = [s for s in FLASH_ATTENTION if s["layout"] == "dense" and s["mask"] == "causal" and s.batch == 4096]
    assert {s["model"] for s in shapes} == set(FLASH_ATTENTION_MODELS)
    return (
        [(s, "v6e") for s in shapes if s["model"] in ("qwen3-30b-a3b", "gemma4-full")]
        + [(s, "v7x") for s in shapes if s["model"] == "gemma4-full"]
        + [(s, "v5e") for s in shapes if s["model"] in ("gemma4-sliding", "gpt-oss-sliding")]
    )


@pytest.mark.cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("case", _benchmark_cases(), ids=lambda c: f"{c[1]}-{c[0].id}")
def test_compiles_at_benchmark_shapes(case):
    shape, generation = case
    batch = 1  # the batch only sizes the grid: one sequence compiles the same kernel bodies as the benchmark's eight
    q = ((batch, shape.batch, shape["q_heads"], shape["head_dim"]), jnp.bfloat16)
    k = ((batch, shape.batch, shape["kv_heads"], shape["head_dim"]), jnp.bfloat16)
    window = shape["window"]
    options = dict(
        causal=shape["mask"] == "causal",
        window_size=(window - 1, 0) if window > 0 else (-1, -1),
        softmax_scale=1.0 if shape["model"].startswith("gemma") else None,
    )
    if benchmark_config(shape).sinks:
        options["sinks"] = benchmark_sinks(shape["q_heads"])
    if generation != "v6e":
        # a small window keeps its own (its blocks are SMALL_WINDOW_TABLE's); a wider one becomes 512 keys
        small = 0 < window <= tuning.SMALL_WINDOW_KEYS
        options.update(softcap=20.0, **({} if small else {"window_size": (511, 0)}))
    # the gradient's program holds the forward kernel as well as the dq and dk/dv kernels
    ladder.compile_for_tpu(
        _grad_fn(**options), generation, q, k, k, label=f"flash_attention grad {shape.id}", min_kernels=3
    )


@pytest.mark.cpu_only
def test_eager_calls_on_host_arrays_run_on_a_cpu(rand):
    """numpy q / k / v (and jax arrays on the CPU), called eagerly on a CPU host, run the kernels in interpret mode
    (numpy arrays go to the default device, here a CPU) and match the reference."""
    q, k, v = (np.asarray(x) for x in _inputs(rand, 1, 40, 40, 4, 2, 64))
    expected = attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True)
    for args in [(q, k, v), tuple(jnp.asarray(x) for x in (q, k, v))]:
        out = tk.flash_attention(*args, causal=True)
        ladder.assert_close(out, expected, dtype=jnp.float32, context=repr(rand), **F32_TOL)


def _backward_kernels(generation, q_shape, kv_shape, **options):
    """The Pallas kernels' names in the gradient's jaxpr, traced for `generation` (abstract inputs: nothing runs)."""
    specs = (_spec(q_shape), _spec(kv_shape), _spec(kv_shape))
    with jax.default_device(ladder.tpu_device(generation)):
        jaxpr = jax.make_jaxpr(_grad_fn(**options))(*specs)
    return set(re.findall(r"flash_attention_\w+", str(jaxpr)))


@pytest.mark.cpu_only
def test_fused_backward_keeps_its_dq_slots_within_a_share_of_the_chips_hbm():
    """The fused backward keeps one f32 copy of dq per slot in HBM. At Gemma 4 full's shape (8 x 4096 tokens, 16 heads
    x 512: dq 1 GiB in f32) its eight slots would take 8 GiB, half of a v5e: there the default call takes the unfused
    backward (a dq kernel, no slots); v6e's 32 GiB holds them (fused: delta, dk/dv with dq slots, the slots' sum).
    Qwen3's eight slots (512 MiB each) stay fused on the v5e."""
    assert (
        tuning.max_dq_slots(1 << 30, chip.tpu_info_for("v5e"))
        < 8
        <= tuning.max_dq_slots(1 << 30, chip.tpu_info_for("v6e"))
    )
    gemma = ((8, 4096, 16, 512), (8, 4096, 2, 512))
    assert "flash_attention_dq" in _backward_kernels("v5e", *gemma, causal=True)
    assert "flash_attention_dq_sum" not in _backward_kernels("v5e", *gemma, causal=True)
    assert "flash_attention_dq_sum" in _backward_kernels("v6e", *gemma, causal=True)
    qwen3 = ((8, 4096, 32, 128), (8, 4096, 4, 128))
    assert "flash_attention_dq_sum" in _backward_kernels("v5e", *qwen3, causal=False)
