"""Ragged paged attention, JAX side, up the ladder: kernel vs the plain-jnp reference (interpret mode with race
detection) on mixed prefill + decode batches over shuffled, non-contiguous page tables, with every feature; caches
poisoned with NaN wherever no sequence's context lies (unused pages, the tails of last pages), so a read past a
context shows; the visit lists vs a brute-force enumeration; metadata that breaks the contract on the device; bad
input; TPU export; deviceless compile for v5e / v6e / v7x, with no copy of the caches in the compiled program."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tpu_kernels_jax import api as tk
from tpu_kernels_jax.common import chip
from tpu_kernels_jax.paged_attention import kernel, schedule, tuning
from tpu_kernels_jax.paged_attention.reference import ragged_paged_attention_reference

F32_TOL = dict(rtol=1e-4, atol=2e-5)
# bf16 with a softcap and sinks: the kernel rounds the scaled queries and the probabilities to bf16 (as flash
# attention does for its matmuls), and where a sink takes most of a row's weight the output is a small sum of such
# rounded terms: one element in 44k of one seed (1733328466) was 0.021 off against the f32 reference, past the
# default bf16 bound of 0.016 + 1.6 %
BF16_FEATURES_TOL = dict(rtol=1.6e-2, atol=3e-2)
FP8 = jnp.float8_e4m3fn


class Batch:
    """A ragged batch over a paged cache: each sequence's pages drawn at random from a shuffled pool, the cache random
    where a context lies and NaN everywhere else."""

    def __init__(
        self,
        rand,
        q_lens,
        kv_lens,
        *,
        hq=8,
        hkv=2,
        d=128,
        dv=None,
        page=16,
        pages_per_seq=None,
        padding=3,
        dtype=jnp.float32,
        cache_dtype=None,
        spare_pages=5,
    ):
        dv = d if dv is None else dv
        self.q_lens, self.kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
        n = len(q_lens)
        needed = -(-self.kv_lens // page)
        self.pages_per_seq = pages_per_seq or max(1, int(needed.max()) + 1)
        num_pages = int(needed.sum()) + spare_pages
        pool = rand.rng.permutation(num_pages)
        table = rand.rng.integers(0, num_pages, (n, self.pages_per_seq))  # unused entries: any page, even reused
        at = 0
        for s in range(n):
            table[s, : needed[s]] = pool[at : at + needed[s]]
            at += needed[s]
        self.page_indices = jnp.asarray(table, jnp.int32)
        self.cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(self.q_lens)]), jnp.int32)
        self.q = rand.normal((int(self.q_lens.sum()) + padding, hq, d), dtype)
        cache_dtype = cache_dtype or dtype
        self.k_cache = self._cache(rand, num_pages, page, hkv, d, table, needed, cache_dtype)
        self.v_cache = self._cache(rand, num_pages, page, hkv, dv, table, needed, cache_dtype)

    def _cache(self, rand, num_pages, page, heads, dim, table, needed, dtype):
        values = np.full((num_pages, page, heads, dim), np.nan, np.float32)
        for s, kv_len in enumerate(self.kv_lens):
            for i in range(needed[s]):
                rows = min(page, kv_len - i * page)
                values[table[s, i], :rows] = rand.rng.standard_normal((rows, heads, dim))
        if dtype == FP8:  # stored = value / scale, with scale 0.5: the values occupy e4m3's range up to ~8
            values = values / 0.5
        return jnp.asarray(values, dtype)

    @property
    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            jnp.asarray(self.kv_lens, jnp.int32),
            self.page_indices,
            self.cu_q_lens,
        )


def _jit(fn):
    """The interpreted kernel's call as one jitted program: one XLA:CPU compile instead of one per op around it."""
    return jax.jit(fn)


def _check(rand, batch, *, dtype=jnp.float32, tol=None, blocks=None, **options):
    """The kernel against the reference over the batch (on the chip over redrawn queries and caches too, their NaN
    poison kept)."""
    kernel = _jit(functools.partial(tk.ragged_paged_attention, blocks=blocks, **options))
    reference = functools.partial(ragged_paged_attention_reference, **options)
    return ladder.check_against_reference(
        kernel, reference, batch.args, dtype=dtype, rand=rand, names=["out"], **(tol or {})
    )


# A mixed batch: decodes, prefill chunks longer than a query block, a query block shared by several sequences, a
# sequence with no new token, an empty sequence, contexts not a multiple of the page, padding rows at the end. With
# 8-token query blocks: rows 16-23 hold sequences 1, 2 and 4; the longest context spans several key blocks past the
# windows below, so visits are skipped on both sides.
Q_LENS = [1, 21, 1, 0, 5, 1, 0, 11]
KV_LENS = [45, 21, 1, 23, 40, 50, 0, 75]
BLOCKS = tk.PagedAttentionBlocks(queries_per_block=8, pages_per_block=2)
# Two visits a grid step (the decode default, tuning.resolve_blocks): a step's visits each their own page slots, the
# masked and unmasked ones mixed, a query block's last step filled up with a visit that computes nothing.
PAIRED = dataclasses.replace(BLOCKS, visits_per_step=2)

# Plain causal attention (no option) over this batch: test_bfloat16, test_float8_cache_with_scales and
# test_page_sizes_and_default_blocks.
FEATURES = {
    "window_both_sides_not_causal": dict(causal=False, window_size=(9, 4)),
    "scale_one": dict(softmax_scale=1.0),
    "everything": dict(window_size=(33, 0), softcap=5.0, sinks=True, softmax_scale=0.2),
}


# The separate-heads path at scale 1 (large logits) and with every feature (two visits a step); a window on both sides
# without causal masking is test_every_head_at_once's (one mask function, _keep, serves both paths) and the visit
# lists'.
@pytest.mark.parametrize("feature", ["scale_one", "everything"])
def test_mixed_batch_matches_reference(rand, feature):
    options = dict(FEATURES[feature])
    batch = Batch(rand, Q_LENS, KV_LENS, hq=8, hkv=2, d=64)
    if options.pop("sinks", False):
        options["sinks"] = rand.normal((8,), scale=2.0)
    tol = dict(F32_TOL, atol=1e-4) if feature == "scale_one" else F32_TOL
    _check(rand, batch, blocks=PAIRED if feature == "everything" else BLOCKS, tol=tol, **options)


# The merged path's two ways to rows: the caches passed as rows (head dim 128 with 2 kv heads, "everything"; 8 kv
# heads x 256, a window on both sides) and the page buffer loaded as it lies and reshaped in the kernel (2 kv heads x
# 256, "everything", in query blocks of 40 tokens: 80 rows a head, which only 2 kv heads take at once; 4 kv heads x
# 128 in blocks of 40 tokens: taken in pairs). Two visits a grid step in the first and third.
@pytest.mark.parametrize(
    "hkv,d,queries,feature,per_step",
    [
        (2, 128, 4, "everything", 2),
        (8, 256, 4, "window_both_sides_not_causal", 1),
        (2, 256, 40, "everything", 2),
        (4, 128, 40, "window_both_sides_not_causal", 1),
    ],
)
def test_every_head_at_once(rand, feature, hkv, d, queries, per_step):
    """A visit takes every kv head in one matmul over the page buffer (kernel.merges_heads), the cross-head scores
    masked. Sequence 5's decode at position 63 sees the whole key block 32-63 even under the window of "everything"
    while sharing its query block with sequence 7: an unmasked visit that must leave the other sequence's rows
    alone."""
    options = dict(FEATURES[feature])
    hq = 2 * hkv
    merged = kernel.merges_heads(hkv=hkv, head_dim=d, v_head_dim=d, block_rows=queries * 2, cache_itemsize=4)
    assert merged == (2 if queries * hkv > 64 else hkv), (hkv, queries, merged)
    view = merged == hkv and kernel.merged_cache_view(hkv=hkv, head_dim=d, v_head_dim=d, cache_itemsize=4)
    assert view == (merged == hkv and (d == 128 or hkv == 8)), (hkv, d, view)
    kv_lens = list(KV_LENS)
    kv_lens[5] = 64
    batch = Batch(rand, Q_LENS, kv_lens, hq=hq, hkv=hkv, d=d)
    if options.pop("sinks", False):
        options["sinks"] = rand.normal((hq,), scale=2.0)
    blocks = tk.PagedAttentionBlocks(queries_per_block=queries, pages_per_block=2, visits_per_step=per_step)
    _check(rand, batch, blocks=blocks, tol=F32_TOL, **options)


@pytest.mark.parametrize(
    "hkv,d,queries,feature,per_step",
    [
        (4, 128, 40, "everything", 2),
        (8, 128, 16, "window_both_sides_not_causal", 1),
        (8, 256, 16, "everything", 1),
        (2, 128, 40, "everything", 2),
        (2, 256, 40, "window_both_sides_not_causal", 1),
    ],
)
def test_prefill_blocks_read_each_head_by_strided_loads(rand, hkv, d, queries, feature, per_step):
    """bf16 caches: blocks with more query rows than a merged visit takes read one kv head at a time out of 32-bit
    words holding a token's pair of heads (kernel.strided_head_rows; the other half of a word fails this). 4 or 8 kv
    heads of 128 passed as rows: a head's rows by strided loads from either page buffer slot, a head dim of 256 from
    each lane tile's own page buffer (Gemma 4 sliding's 8 x 256). 2 kv heads: the whole buffer's rows as words, passed
    as rows at head dim 128, as the cache lies at 256 (Gemma 4 full's 2 x 512). Masked and unmasked visits, a query
    block shared by several sequences, padding rows, two visits a step in some."""
    options = dict(FEATURES[feature])
    hq = 2 * hkv
    heads = kernel.visit_heads(
        hkv=hkv, head_dim=d, v_head_dim=d, block_rows=queries * 2, page_size=16, cache_dtype=jnp.bfloat16
    )
    assert heads == (0, hkv > 2 or d == 128, True), heads
    batch = Batch(rand, Q_LENS, KV_LENS, hq=hq, hkv=hkv, d=d, dtype=jnp.bfloat16)
    if options.pop("sinks", False):
        options["sinks"] = rand.normal((hq,), scale=2.0)
    blocks = tk.PagedAttentionBlocks(queries_per_block=queries, pages_per_block=2, visits_per_step=per_step)
    tol = BF16_FEATURES_TOL if feature == "everything" else None
    _check(rand, batch, dtype=jnp.bfloat16, blocks=blocks, tol=tol, **options)


@pytest.mark.parametrize("hkv,hq,queries", [(2, 12, 16), (4, 32, 8)], ids=["pair_words_group6", "strided_group8"])
def test_narrow_visits_compute_only_their_rows_window(rand, hkv, hq, queries):
    """Prefill-sized query blocks of a mixed batch: a visit whose sequence's rows lie in one aligned window of
    kernel.NARROW_ROWS rows computes that window only (rows of other sequences in it keep their statistics), else the
    whole block. Group 6: token 2's rows 12-17 cross a window's edge (the whole block), tokens 0, 1, 3 and 4 do not
    (narrow); group 8: every decode token narrow, beside a prefill chunk's whole-block visits. Masked and unmasked
    visits (contexts of several key blocks), two decodes in one window, the block's last window."""
    q_lens = [1, 1, 1, 1, 1, 19, 1, 0, 1]
    kv_lens = [40, 33, 70, 5, 64, 60, 50, 9, 37]
    layout = kernel.Layout(
        tokens=32,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=128,
        v_head_dim=128,
        page_size=16,
        pages_per_seq=5,
        pages_per_block=2,
        block_q=queries,
        softmax_scale=1.0,
        softcap=0.0,
        window_size=(-1, 0),
        strided_heads=True,
    )
    assert kernel.narrow_visits(layout)
    batch = Batch(rand, q_lens, kv_lens, hq=hq, hkv=hkv, d=128, dtype=jnp.bfloat16, padding=32 - sum(q_lens))
    blocks = tk.PagedAttentionBlocks(queries_per_block=queries, pages_per_block=2)
    _check(rand, batch, dtype=jnp.bfloat16, blocks=blocks)


# (D, Dv, Hq, Hkv): head dims 64 to 512, GQA 1, 2 and 8 (MQA), a V head dim other than Q/K's (head dim 128: the
# mixed-batch tests).
HEAD_LAYOUTS = [(64, 64, 2, 2), (256, 128, 8, 1), (512, 512, 2, 1)]


@pytest.mark.parametrize("layout", HEAD_LAYOUTS, ids=lambda t: "d{}_dv{}_hq{}_hkv{}".format(*t))
def test_head_dims_and_gqa(rand, layout):
    d, dv, hq, hkv = layout
    batch = Batch(rand, [3, 1, 12], [40, 17, 12], hq=hq, hkv=hkv, d=d, dv=dv)
    _check(rand, batch, blocks=tk.PagedAttentionBlocks(pages_per_block=2), window_size=(25, 0), tol=F32_TOL)


@pytest.mark.parametrize("pages", [(16,), (64, 256)], ids=["p16", "p64_p256"])
def test_page_sizes_and_default_blocks(rand, pages):
    """The tuning table's blocks (one block of 512 keys holds every page of these contexts) at the page sizes of the
    benchmarks, 16 to 256. At 256 the last sequence's context crosses into a second, partial page."""
    for page in pages:
        batch = Batch(rand, [1, 6, 1, 2], [70, 6, 33, 300 if page == 256 else 90], page=page, hq=8, hkv=2, d=128)
        _check(rand, batch, tol=F32_TOL)


def test_bfloat16(rand):
    batch = Batch(rand, Q_LENS, KV_LENS, hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    _check(rand, batch, dtype=jnp.bfloat16, blocks=tk.PagedAttentionBlocks(queries_per_block=8, pages_per_block=3))


@pytest.mark.parametrize(
    "page,hkv", [(16, 2), (32, 2), (16, 4)], ids=["p16_rows", "p32_head_major", "p16_four_heads_split"]
)
def test_float8_cache_with_scales(rand, page, hkv):
    """An e4m3 cache holding value / scale: the kernel folds k_scale into the query scale and v_scale into the output;
    Python floats, which the kernel takes as constants (traced float32 [1] scales, an SMEM operand, are the torch
    op's test's: torch passes tensors). Pages of 16: every head at once, the buffer reshaped to rows; of 32: the
    caches passed head-major (XLA's own layout of 2 float8 kv heads), one head at a time, two visits a step; 4 kv
    heads as rows (Qwen3's layout): each head split from the buffer's 32-bit words (kernel.splits_words), its keys
    in the split's order, the poisoned rows past a context zeroed as words before the split, two visits a step."""
    assert kernel.head_major_cache(hkv=hkv, page_size=page, cache_itemsize=1) == (page == 32)
    split = kernel.splits_words(merged=hkv, merged_view=True, cache_itemsize=1, block_kv=2 * page)
    assert split == (hkv == 4), (hkv, split)
    batch = Batch(rand, Q_LENS, KV_LENS, hq=8, hkv=hkv, d=128, page=page, dtype=jnp.bfloat16, cache_dtype=FP8)
    blocks = PAIRED if page == 32 or hkv == 4 else BLOCKS
    attention = functools.partial(tk.ragged_paged_attention, blocks=blocks, k_scale=0.5, v_scale=0.25)
    out = ladder.run_kernel(_jit(attention), *batch.args)
    expected = ragged_paged_attention_reference(*batch.args, k_scale=0.5, v_scale=0.25)
    ladder.assert_close(out, expected, dtype=jnp.bfloat16, what="out", context=repr(rand))


def test_float8_prefill_blocks_split_rows_per_head(rand):
    """A float8 cache of 4 kv heads as rows at pages of whole 32-token chunks: prefill-sized query blocks (64 rows a
    head) split each head from the buffer's words too (kernel.splits_rows_at_any_block), one head's scores at a time,
    their decode tokens' visits narrowed to their rows' window; masked and unmasked visits, a query block shared by
    several sequences, poisoned rows past each context."""
    heads = kernel.visit_heads(hkv=4, head_dim=128, v_head_dim=128, block_rows=64, page_size=32, cache_dtype=FP8)
    assert heads == (4, True, False), heads
    q_lens, kv_lens = [1, 1, 19, 1, 0, 6, 1], [40, 70, 60, 33, 9, 64, 90]
    batch = Batch(rand, q_lens, kv_lens, hq=32, hkv=4, d=128, page=32, dtype=jnp.bfloat16, cache_dtype=FP8)
    blocks = tk.PagedAttentionBlocks(queries_per_block=8, pages_per_block=2)
    attention = functools.partial(tk.ragged_paged_attention, blocks=blocks, k_scale=0.5, v_scale=0.25)
    out = ladder.run_kernel(_jit(attention), *batch.args)
    expected = ragged_paged_attention_reference(*batch.args, k_scale=0.5, v_scale=0.25)
    ladder.assert_close(out, expected, dtype=jnp.bfloat16, what="out", context=repr(rand))


@pytest.mark.parametrize(
    "page,hkv", [(16, 2), (32, 2), (16, 4), (16, 8)], ids=["p16_rows", "p32_head_major", "p16_split", "p16_eight_heads"]
)
def test_float8_blocks_into_the_matmuls_as_stored(rand, page, hkv):
    """PagedAttentionBlocks(float8_operands=True): float8 K and V blocks go into bf16 x float8 matmuls as stored (no
    widening in the visit): every head at once with 2 kv heads (V widened there: its unfetched rows are zeroed as
    32-bit words of whole tokens, which 2 float8 heads do not fill) and with 8 (V as stored), head-major one head at a
    time (V widened: zeroed by rows), 4 heads split from their words (both as stored); poisoned rows past each
    context."""
    batch = Batch(rand, Q_LENS, KV_LENS, hq=2 * hkv, hkv=hkv, d=128, page=page, dtype=jnp.bfloat16, cache_dtype=FP8)
    blocks = dataclasses.replace(PAIRED, float8_operands=True)
    attention = functools.partial(tk.ragged_paged_attention, blocks=blocks, k_scale=0.5, v_scale=0.25)
    out = ladder.run_kernel(_jit(attention), *batch.args)
    expected = ragged_paged_attention_reference(*batch.args, k_scale=0.5, v_scale=0.25)
    ladder.assert_close(out, expected, dtype=jnp.bfloat16, what="out", context=repr(rand))


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    "label,generation",
    [
        ("qwen3_mixed_p64_fp8", "v5e"),
        ("qwen3_mixed_p64_fp8", "v6e"),
        ("qwen3_mixed_p64_fp8", "v7x"),
        ("gemma4_full_decode_p64_fp8", "v5e"),
        ("gemma4_sliding_decode_fp8", "v5e"),
    ],
)
def test_float8_operands_compile_for_tpu(monkeypatch, label, generation):
    """Float8 blocks as stored in bf16 x float8 matmuls compile, as the table sets them (tuning.FLOAT8_OPERANDS on):
    on the v5e (the generation they are meant for) Qwen3's mixed batch (split heads, and pairs of heads in its
    prefill visits), Gemma 4 full's head-major decode, Gemma 4 sliding's decode (8 heads at once, V as stored); the
    first on v6e and v7x too (a caller may ask for them anywhere)."""
    monkeypatch.setattr(tuning, "FLOAT8_OPERANDS", dict.fromkeys(tuning.FLOAT8_OPERANDS, True))
    v5e = chip.tpu_info_for("v5e")
    assert tuning.float8_operands(cache_dtype=FP8, compute_dtype=jnp.bfloat16, info=v5e)
    assert not tuning.float8_operands(cache_dtype=FP8, compute_dtype=jnp.float32, info=v5e)
    assert not tuning.float8_operands(cache_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16, info=v5e)
    cases = {case[0]: case for case in COMPILE_CASES}
    cases["gemma4_sliding_decode_fp8"] = (
        "gemma4_sliding_decode_fp8", 64, 64, 16, 8, 256, 64, 64, FP8, dict(window_size=(1023, 0))
    )  # fmt: skip
    _, tokens, seqs, hq, hkv, d, page, pps, cache_dtype, options = cases[label]
    ladder.compile_for_tpu(
        functools.partial(_attention, **options),
        generation,
        *_specs(tokens, seqs, hq, hkv, d, page, pps, cache_dtype),
        None,
        ((1,), jnp.float32),
        ((1,), jnp.float32),
        label=f"paged_attention {label} float8 operands {generation}",
    )


def _widened_codes(codes_ref, bf16_ref, f32_ref):
    for ref in (bf16_ref, f32_ref):
        ref[...] = kernel.widen(codes_ref[...], ref.dtype)


def test_float8_widening_is_exact_for_every_code(monkeypatch):
    """All 256 float8_e4m3fn codes through the kernel's widening as v6e traces it (the bytes read as e4m3b11, the -0
    and NaN codes put right; on the chip as the chip's generation does), in a kernel, to bf16 and to f32, times
    widen_factor: XLA's conversion bit for bit (-0 included, subnormals too), NaN exactly where it gives NaN. v7x
    and v5e cast the block as it is."""
    if not ladder.ON_CHIP:  # the generation comes from TPU_KERNELS_TARGET only where no TPU is the default device
        monkeypatch.setenv("TPU_KERNELS_TARGET", "v7x")
        assert kernel.widen_factor(FP8) == 1.0
        monkeypatch.setenv("TPU_KERNELS_TARGET", "v6e")
        assert kernel.widen_factor(FP8) == 16.0
    assert kernel.widen_factor(jnp.bfloat16) == 1.0
    factor = np.float32(kernel.widen_factor(FP8))
    codes = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8).reshape(8, 32), FP8)
    out = [jax.ShapeDtypeStruct(codes.shape, dt) for dt in (jnp.bfloat16, jnp.float32)]
    widened = ladder.run_kernel(jax.jit(lambda c: pl.pallas_call(_widened_codes, out_shape=out)(c)), codes)
    expected = np.asarray(codes.astype(jnp.float32))
    nan = np.isnan(expected)
    assert int(nan.sum()) == 2 and int((expected == 0).sum()) == 2 and int(np.signbit(expected[expected == 0]).sum())
    for got in widened:
        got = np.asarray(got.astype(jnp.float32)) * factor  # a power of two: exact, -0 stays -0
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def test_run_time_num_seqs_ignores_the_rest(rand):
    """num_seqs as a run-time int32 [1]: sequences past it are ignored whatever their metadata holds (here lengths
    and pages far out of range), and their rows come out as zeros like padding."""
    batch = Batch(rand, [2, 1, 4, 3], [9, 30, 4, 12], hq=4, hkv=1, d=128)
    q, k, v, kv_lens, pages, cu = batch.args
    kv_bad = kv_lens.at[2:].set(10**6)
    pages_bad = pages.at[2:].set(-7)
    kernel = _jit(functools.partial(tk.ragged_paged_attention, blocks=BLOCKS))
    out = ladder.run_kernel(kernel, q, k, v, kv_bad, pages_bad, cu, jnp.asarray([2], jnp.int32))
    expected = ladder.run_reference(ragged_paged_attention_reference, q, k, v, kv_lens, pages, cu, 2)
    ladder.assert_close(out, expected, dtype=jnp.float32, what="out", context=repr(rand), **F32_TOL)
    assert not np.asarray(out[3:]).any(), "rows of ignored sequences must be zeros"


def test_broken_device_metadata_stays_in_bounds(rand):
    """Traced metadata that breaks the contract (pages past the cache, negative pages, a context longer than the page
    table) is clamped: the kernel runs with out-of-bounds reads raising, and a sequence whose metadata is sound and
    whose query block the broken one does not share still matches the reference (rows in a block with the broken
    sequence may be wrong: its values meet theirs in one matmul)."""
    batch = Batch(rand, [1, 3, 2], [20, 3, 40], hq=4, hkv=2, d=64)
    q, k, v, kv_lens, pages, cu = batch.args
    pages_bad = pages.at[1, 0].set(k.shape[0] + 5).at[1, 1:].set(-3)
    kv_bad = kv_lens.at[1].set(10**6)
    blocks = tk.PagedAttentionBlocks(queries_per_block=4, pages_per_block=2)  # rows 0-3 (broken), 4-7 (sound)
    kernel = _jit(functools.partial(tk.ragged_paged_attention, blocks=blocks))
    out = ladder.run_kernel(kernel, q, k, v, kv_bad, pages_bad, cu)
    expected = ladder.run_reference(ragged_paged_attention_reference, q, k, v, kv_lens, pages, cu)
    ladder.assert_close(out[4:6], expected[4:6], dtype=jnp.float32, what="sound rows", context=repr(rand), **F32_TOL)


@ladder.random_draws
def test_random_draw(rand, draw):
    """A ragged batch (decodes, prefill chunks, sequences with no new token, empty ones, padding rows) over a page
    size, heads (GQA 1 to 8), head dims, dtype (a float8 cache with scales), mask (causal, windows one- and
    two-sided, longer than the contexts), softcap, sinks, scale and tiling drawn at random, against the reference."""
    dtype = rand.draw("dtype", [jnp.float32, jnp.bfloat16])
    fp8 = dtype == jnp.bfloat16 and rand.draw("float8_cache", [False, True])
    seqs = rand.draw("sequences", [1, 2, 4, 8])
    q_lens = [rand.draw(f"q_len_{s}", [0, 1, 1, 3, 12, 21]) for s in range(seqs)]
    kv_lens = [q + rand.draw(f"context_{s}", [0, 1, 9, 40, 75]) for s, q in enumerate(q_lens)]
    hkv, group = rand.draw("kv_heads", [1, 2, 4, 8]), rand.draw("gqa_group", [1, 2, 4, 8])
    d = rand.draw("head_dim", [64, 128, 256])
    dv = rand.draw("v_head_dim", [d, 128])
    if d == 256:  # the interpreter's time grows with the heads a visit
        hkv, group = min(hkv, 2), min(group, 4)
    batch = Batch(
        rand,
        q_lens,
        kv_lens,
        hq=hkv * group,
        hkv=hkv,
        d=d,
        dv=dv,
        page=rand.draw("page_size", [16, 32, 64]),
        padding=rand.draw("padding_rows", [0, 3]),
        dtype=dtype,
        cache_dtype=FP8 if fp8 else None,
    )
    # bfloat16 at the default scale only: the kernel rounds q times the scale to bfloat16 before its matmul, so the
    # scores' error grows with the scale (as flash attention's forward)
    options = dict(
        causal=rand.draw("causal", [True, False]),
        window_size=rand.draw("window_size", [(-1, -1), (33, 0), (9, 4), (1000, 0)]),
        softcap=rand.draw("softcap", [0.0, 5.0]),
        softmax_scale=rand.draw("softmax_scale", [None] if dtype == jnp.bfloat16 else [None, 0.2, 1.0]),
    )
    if rand.draw("sinks", [False, True]):
        options["sinks"] = rand.normal((hkv * group,), scale=2.0)
    if fp8:
        options.update(k_scale=0.5, v_scale=0.25)
    blocks = None
    if rand.draw("blocks", ["table", "drawn"]) == "drawn":
        sublane = 8 if dtype == jnp.float32 else 16  # a block's rows (queries x group) fill whole sublane tiles
        blocks = tk.PagedAttentionBlocks(
            queries_per_block=rand.draw("queries_per_block", [q for q in (4, 8, 16) if q * group % sublane == 0]),
            pages_per_block=rand.draw("pages_per_block", [1, 2, 3]),
            visits_per_step=rand.draw("visits_per_step", [1, 2]),
        )
    tol = dict(F32_TOL, atol=1e-4 if options["softmax_scale"] == 1.0 else F32_TOL["atol"])
    _check(rand, batch, dtype=dtype, tol=tol if dtype == jnp.float32 else None, blocks=blocks, **options)


def _brute_force_visits(kv_lens, cu_q, *, tokens, block_q, block_kv, page, max_context, causal, window):
    """The (query block, sequence, key block) triples with a kept score -> (every key of the block kept for every row
    of the sequence?, first key row to fetch, end of the rows to fetch), from the dense mask of every (row, key): the
    fetch runs over whole pages from the one holding the pair's first kept key of the block to the one holding its
    last, cut at the context's end."""
    left, right = window
    if causal:
        right = 0
    needed = {}
    for s in range(len(kv_lens)):
        q_len, kv_len = cu_q[s + 1] - cu_q[s], kv_lens[s]
        for i in range(q_len):
            row, pos = cu_q[s] + i, kv_len - q_len + i
            keys = np.arange(kv_len)
            keep = np.ones(kv_len, bool)
            if left >= 0:
                keep &= keys >= pos - left
            if right >= 0:
                keep &= keys <= pos + right
            for b in set((keys[keep] // block_kv).tolist()):
                key = (row // block_q, s, b)
                block_keys = np.arange(b * block_kv, (b + 1) * block_kv)
                whole = block_keys.max() < kv_len and keep[block_keys[block_keys < kv_len]].all()
                kept = keys[keep & (keys // block_kv == b)] - b * block_kv
                needed.setdefault(key, []).append((whole, kept.min(), kept.max(), kv_len - b * block_kv))
    full = {}
    for (qb, s, b), per_row in needed.items():
        first = min(r[1] for r in per_row) // page * page
        end = min((max(r[2] for r in per_row) // page + 1) * page, per_row[0][3])
        full[(qb, s, b)] = (all(r[0] for r in per_row), first, end)
    return full


@pytest.mark.parametrize("window,causal,parts", [((-1, -1), True, 1), ((10, 0), True, 2), ((6, 3), False, 2)])
def test_visit_lists_match_brute_force(rand, window, causal, parts):
    q_lens = rand.rng.integers(0, 12, 9)
    q_lens[rand.rng.integers(0, 9, 3)] = 1
    kv_lens = q_lens + rand.rng.integers(0, 60, 9)
    tokens, block_q, page, ppb, pps = int(q_lens.sum()) + 5, 4, 8, 2, 10
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    block_kv, bps = page * ppb, -(-pps // ppb)
    size = schedule.visit_bound(
        tokens=tokens,
        num_q_blocks=-(-tokens // block_q),
        num_seqs=9,
        block_q=block_q,
        block_kv=block_kv,
        blocks_per_seq=bps,
        window_size=window,
        causal=causal,
        parts=parts,
    )
    build = functools.partial(
        schedule.visits,
        tokens=tokens,
        padded=-(-tokens // block_q) * block_q,
        block_q=block_q,
        page_size=page,
        pages_per_block=ppb,
        blocks_per_seq=bps,
        max_context=pps * page,
        causal=causal,
        window_size=window,
        size=size,
        parts=parts,
    )
    out = ladder.run_kernel(_jit(build), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu), jnp.asarray([9], jnp.int32))
    words, kv_blocks, rows, status = (np.asarray(a) for a in out[:4])
    count = int(status[0]) * parts  # grid steps of `parts` visits
    assert status[1] == 0, "the visit lists overflowed their bound"
    np.testing.assert_array_equal(out[4], kv_lens, err_msg="the builder's clamped kv_lens")
    np.testing.assert_array_equal(out[5], cu, err_msg="the builder's clamped cu_q_lens")
    expected = _brute_force_visits(
        kv_lens,
        cu,
        tokens=tokens,
        block_q=block_q,
        block_kv=block_kv,
        page=page,
        max_context=pps * page,
        causal=causal,
        window=window,
    )
    got = {}
    for w, j, r in zip(words[:count], kv_blocks[:count], rows[:count]):
        if w & schedule.COMPUTE:
            fetch = (int(r & schedule.ROW_MASK), int(r >> schedule.ROW_BITS))
            got[(int(w & schedule.QUERY_BLOCK_MASK), int(j // bps), int(j % bps))] = (not (w & schedule.MASKED), *fetch)
    assert got == expected, f"{rand!r}"
    # every query block is visited, in order, with one FIRST and one LAST visit
    q_blocks = words[:count] & schedule.QUERY_BLOCK_MASK
    assert (np.diff(q_blocks) >= 0).all() and set(q_blocks) == set(range(-(-tokens // block_q)))
    change = np.diff(q_blocks) != 0
    np.testing.assert_array_equal((words[:count] & schedule.FIRST) != 0, np.concatenate([[True], change]))
    np.testing.assert_array_equal((words[:count] & schedule.LAST) != 0, np.concatenate([change, [True]]))
    # a step's visits are one query block's (its last step filled up with visits that compute nothing and fetch nothing)
    assert (q_blocks.reshape(-1, parts) == q_blocks[::parts, None]).all(), q_blocks
    assert not rows[:count][(words[:count] & schedule.COMPUTE) == 0].any()


@pytest.mark.cpu_only
@pytest.mark.parametrize("window,pages", [((127, 0), 8), ((1023, 0), 24), ((-1, 0), 24), ((9, 4), 1)])
def test_decode_blocks_span_the_window(window, pages):
    """At decode a visit takes 1024 keys, or the power of two that holds a token's window (gpt-oss's 128), in at most
    24 pages (of 16 here: 384 keys, the step's page copies kept few); a prefill-heavy batch takes 512 whatever the
    window."""
    shape = dict(num_seqs=64, group=8, page_size=16, pages_per_seq=256, kv_heads=8, head_dim=64, v_head_dim=64)
    shape.update(q_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16, info=chip.tpu_info_for("v6e"), window_size=window)
    decode, prefill = (tuning.resolve_blocks(None, tokens=tokens, **shape) for tokens in (64, 2108))
    assert (decode.pages_per_block, prefill.pages_per_block) == (pages, 32)
    assert (decode.visits_per_step, prefill.visits_per_step) == (2, 1)


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    "page,window,dtype,hkv,blocks",
    [
        (64, (-1, 0), jnp.bfloat16, 4, (32, 16)),  # strided visits, no window: 256 rows x 1024 keys
        (16, (-1, 0), jnp.bfloat16, 4, (32, 48)),  # ... in at most 48 pages (two copies each, one visit a step)
        (64, (1023, 0), jnp.bfloat16, 4, (32, 8)),  # a window: 256 rows x the table's 512 keys
        (64, (-1, 0), jnp.bfloat16, 2, (64, 16)),  # 2 kv heads, the whole buffer split to pair words: 512 rows
        (64, (-1, 0), FP8, 4, (32, 16)),  # float8 rows split per head from their words: as the strided visits
        (16, (-1, 0), FP8, 4, (16, 32)),  # ... at pages of whole 32-token chunks only: else the table's 128 rows
    ],
)
def test_prefill_blocks_by_how_visits_read_heads(page, window, dtype, hkv, blocks):
    """A mixed batch (4 prefill chunks of 512 + 60 decodes; kv heads of 128, 8 query heads each): prefill visits that
    read each head out of pair words take more rows, and more keys where no window bounds them."""
    resolved = tuning.resolve_blocks(
        None, tokens=2108, num_seqs=64, group=8, page_size=page, pages_per_seq=4096 // page, kv_heads=hkv,
        head_dim=128, v_head_dim=128, q_dtype=jnp.bfloat16, cache_dtype=dtype, window_size=window,
        info=chip.tpu_info_for("v5e"),
    )  # fmt: skip
    assert (resolved.queries_per_block, resolved.pages_per_block, resolved.visits_per_step) == (*blocks, 1), resolved


@pytest.mark.cpu_only
@pytest.mark.parametrize("tokens", [64, 2108], ids=["decode", "mixed"])
def test_candidate_blocks_vary_pages_and_prefill_query_blocks(tokens):
    """tuning.candidate_blocks (what --sweep times): the table's choice first, distinct blocks each as resolve_blocks
    gives them (so legal), pages a block around the table's; query blocks varied for a prefill-heavy batch only. The
    benchmark's op asks for them with the arguments the api resolves its own blocks from (its first is the api's)."""
    from benchmarks.ops import paged_attention as bench

    info = chip.tpu_info_for("v5e")
    shape = dict(tokens=tokens, num_seqs=64, group=8, page_size=16, pages_per_seq=256, kv_heads=4, head_dim=128)
    shape.update(v_head_dim=128, q_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16, window_size=(-1, 0))
    candidates = tuning.candidate_blocks(info=info, **shape)
    table = candidates[0]
    assert table == tuning.resolve_blocks(None, info=info, **shape)
    assert len(set(candidates)) == len(candidates) >= 5, candidates
    for blocks in candidates:
        assert tuning.resolve_blocks(blocks, info=info, **shape) == blocks
    assert {b.pages_per_block for b in candidates} > {table.pages_per_block}
    queries = {b.queries_per_block for b in candidates}
    assert queries == {table.queries_per_block} if tokens == 64 else len(queries) == 3, candidates
    # the benchmark's op: Qwen3's quick shape of the same phase, its first candidate the api's own choice there
    phase = "decode" if tokens == 64 else "mixed"
    case = next(s for s in bench.SUITE.quick_shapes if s["model"] == "qwen3-30b-a3b" and s["phase"] == phase)
    cfg = bench.config(case)
    first = bench.SUITE.ops[0].candidates(case, "v5e")[0]
    api_choice = tuning.resolve_blocks(
        None, tokens=cfg.tokens, num_seqs=len(cfg.q_lens), group=8, page_size=cfg.page_size,
        pages_per_seq=cfg.pages_per_seq, kv_heads=4, head_dim=128, v_head_dim=128, q_dtype=jnp.bfloat16,
        cache_dtype=jnp.dtype(cfg.cache_dtype), window_size=(-1, 0), info=info,
    )  # fmt: skip
    assert first == api_choice, (first, api_choice)
    # a float8 cache: the table's choice with float8_operands the other way comes second
    fp8 = tuning.candidate_blocks(info=info, **{**shape, "cache_dtype": FP8})
    assert fp8[1] == dataclasses.replace(fp8[0], float8_operands=not fp8[0].float8_operands), fp8[:2]
    assert all(b.float8_operands is False for b in candidates)


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ["v5e", "v6e", "v7x"])
@pytest.mark.parametrize("seqs,visits,allocated_mib", [(1, 1, 28.27), (64, 2, 36.34)])
def test_vmem_limit_covers_a_head_dim_short_of_a_lane_tile(generation, seqs, visits, allocated_mib):
    """gpt-oss's full layer decoding 1 or 64 sequences (8 kv heads of 64, pages of 256, 4096 keys): what the v5e
    test chip allocated of scoped VMEM for the kernel, each token's [8, 64] slab of a page buffer taking a whole
    16 x 128 tile, plus Mosaic's own scratch; the blocks' limit must cover that (24.94 MiB ran out at both), within
    3/4 of the generation's VMEM."""
    info = chip.tpu_info_for(generation)
    blocks = tuning.resolve_blocks(
        None, tokens=seqs, num_seqs=seqs, group=8, page_size=256, pages_per_seq=17, kv_heads=8, head_dim=64,
        v_head_dim=64, q_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16, window_size=(-1, 0), info=info,
    )  # fmt: skip
    assert (blocks.pages_per_block, blocks.visits_per_step) == (4, visits), blocks
    assert allocated_mib * 2**20 < blocks.vmem_limit_bytes <= info.vmem_capacity_bytes * 3 // 4, blocks


# ---------------------------------------------------------------------------------------------------------- bad input
def _good(rand):
    batch = Batch(rand, [1, 2], [5, 9], hq=4, hkv=2, d=128)
    q, k, v, kv_lens, pages, cu = batch.args
    return dict(q=q, k_cache=k, v_cache=v, kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu)


BAD = [
    ladder.BadInput("q_rank", lambda r: {"q": r.normal((6, 4))}, ValueError, "q: expected 3 dimensions"),
    ladder.BadInput("q_int", lambda r: {"q": jnp.ones((6, 4, 128), jnp.int32)}, TypeError, "q: expected dtype"),
    ladder.BadInput("heads_not_multiple", lambda r: {"q": r.normal((6, 3, 128))}, ValueError, "multiple of"),
    ladder.BadInput(
        "head_dim_mismatch", lambda r: {"q": r.normal((6, 4, 64))}, ValueError, "k_cache: expected the head dim"
    ),
    ladder.BadInput(
        "cache_dtype",
        lambda r: {"k_cache": r.normal((4, 16, 2, 128), jnp.bfloat16)},
        TypeError,
        "k_cache: expected dtype",
    ),
    ladder.BadInput(
        "v_cache_pages", lambda r: {"v_cache": r.normal((3, 16, 2, 128))}, ValueError, "v_cache: expected the pages"
    ),
    ladder.BadInput(
        "page_size",
        lambda r: {"k_cache": r.normal((4, 12, 2, 128)), "v_cache": r.normal((4, 12, 2, 128))},
        ValueError,
        "multiple of 16",
    ),
    ladder.BadInput("kv_lens_int64", lambda r: {"kv_lens": np.asarray([5, 9], np.int64)}, TypeError, "kv_lens"),
    ladder.BadInput(
        "cu_not_increasing",
        {"cu_q_lens": jnp.asarray([0, 2, 1], jnp.int32)},
        ValueError,
        "cu_q_lens: expected non-decreasing",
    ),
    ladder.BadInput(
        "cu_past_tokens",
        {"cu_q_lens": jnp.asarray([0, 1, 90], jnp.int32)},
        ValueError,
        "cu_q_lens: expected offsets up to",
    ),
    ladder.BadInput(
        "query_longer_than_context",
        {"kv_lens": jnp.asarray([5, 1], jnp.int32)},
        ValueError,
        "cannot be longer than its context",
    ),
    ladder.BadInput(
        "context_past_page_table",
        {"kv_lens": jnp.asarray([5, 400], jnp.int32)},
        ValueError,
        "kv_lens: expected lengths from 0 to",
    ),
    ladder.BadInput(
        "page_out_of_range",
        {"page_indices": jnp.asarray([[0, 1], [99, 2]], jnp.int32)},
        ValueError,
        "page_indices: expected pages from 0 to",
    ),
    ladder.BadInput(
        "page_table_rows",
        {"page_indices": jnp.zeros((3, 2), jnp.int32)},
        ValueError,
        "page_indices: expected shape (2,",
    ),
    ladder.BadInput("num_seqs_range", {"num_seqs": 3}, ValueError, "num_seqs: expected 0 to 2"),
    ladder.BadInput("window", {"window_size": (-2, 0)}, ValueError, "window_size"),
    ladder.BadInput("scale", {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
    ladder.BadInput("sinks_shape", lambda r: {"sinks": r.normal((3,))}, ValueError, "sinks: expected shape (4,)"),
    ladder.BadInput(
        "fp8_without_scale",
        lambda r: {"k_cache": r.normal((4, 16, 2, 128)).astype(FP8), "v_cache": r.normal((4, 16, 2, 128)).astype(FP8)},
        ValueError,
        "k_scale: expected a scale for the float8_e4m3fn cache",
    ),
    ladder.BadInput("scale_shape", {"k_scale": jnp.ones((2,), jnp.float32)}, ValueError, "k_scale: expected shape"),
    ladder.BadInput("blocks_type", {"blocks": (8, 2)}, TypeError, "blocks: expected a PagedAttentionBlocks"),
    ladder.BadInput(
        "blocks_per_step",
        {"blocks": tk.PagedAttentionBlocks(visits_per_step=3)},
        ValueError,
        "PagedAttentionBlocks.visits_per_step: expected 1 or 2, got 3",
    ),
    ladder.BadInput(
        "blocks_rows",
        {"blocks": tk.PagedAttentionBlocks(queries_per_block=3)},
        ValueError,
        "PagedAttentionBlocks.queries_per_block",
    ),
    ladder.BadInput(
        "float8_operands_of_bf16",
        {"blocks": tk.PagedAttentionBlocks(float8_operands=True)},
        ValueError,
        "PagedAttentionBlocks.float8_operands: True needs a float8_e4m3fn cache and bfloat16 queries, got a",
    ),
    ladder.BadInput(
        "float8_operands_type",
        {"blocks": tk.PagedAttentionBlocks(float8_operands="no")},
        TypeError,
        "PagedAttentionBlocks.float8_operands: expected a bool or None, got str",
    ),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD)
def test_bad_input_is_a_clear_error(rand, case):
    ladder.assert_clear_error(case, lambda a: tk.ragged_paged_attention(**a), _good(rand), rand)


# ---------------------------------------------------------------------------------------------------------- rungs 2-3
def _specs(tokens, seqs, hq, hkv, d, page, pages_per_seq, cache_dtype, q_dtype=jnp.bfloat16):
    num_pages = seqs * pages_per_seq
    return [
        ((tokens, hq, d), q_dtype),
        ((num_pages, page, hkv, d), cache_dtype),
        ((num_pages, page, hkv, d), cache_dtype),
        ((seqs,), jnp.int32),
        ((seqs, pages_per_seq), jnp.int32),
        ((seqs + 1,), jnp.int32),
        ((1,), jnp.int32),
    ]


def _attention(q, k, v, kv_lens, pages, cu, num_seqs, sinks=None, k_scale=None, v_scale=None, **options):
    return tk.ragged_paged_attention(
        q, k, v, kv_lens, pages, cu, num_seqs, sinks=sinks, k_scale=k_scale, v_scale=v_scale, **options
    )


@pytest.mark.cpu_only
@pytest.mark.parametrize("hkv", [2, 4], ids=["pair_words", "strided"])
def test_exports_for_tpu(hkv):
    """A mixed batch of bf16 caches: its prefill visits read each kv head out of words holding a pair of heads, with 2
    kv heads the buffer's whole rows, with 4 by strided loads (kernel.strided_head_rows)."""
    assert kernel.visit_heads(
        hkv=hkv, head_dim=128, v_head_dim=128, block_rows=128, page_size=16, cache_dtype=jnp.bfloat16
    )[2]
    specs = [jax.ShapeDtypeStruct(*sd) for sd in _specs(40, 8, 16, hkv, 128, 16, 8, jnp.bfloat16)]
    ladder.export_for_tpu(_attention, *specs, window_size=(63, 0), softcap=10.0)


# Each model's layers at a decode batch and a mixed batch (4 prefill chunks of 512 + 60 decodes), page 64 bf16 and
# page 16 fp8: (label, tokens, seqs, hq, hkv, d, page, pages per seq, cache dtype, options).
COMPILE_CASES = [
    # Qwen3 decode at the decode table's page (64, two visits a step) with the largest page table kept in SMEM at the
    # benchmarks' sizes: 256 sequences x 128 pages (there 32k tokens of page 256; pages of 256 compile in Gemma 4
    # full's mixed batch)
    ("qwen3_decode_p64_256_seqs_128_pages", 256, 256, 32, 4, 128, 64, 128, jnp.bfloat16, {}),
    ("qwen3_mixed_p64_fp8", 2108, 64, 32, 4, 128, 64, 64, FP8, {}),
    # bf16: the prefill visits read each kv head's rows by strided loads (kernel.strided_head_rows), per buffer slot
    ("qwen3_mixed_p64", 2108, 64, 32, 4, 128, 64, 64, jnp.bfloat16, {}),
    # and at head dim 256, each lane tile of a page its own DMA and page buffer
    ("gemma4_sliding_mixed_p64", 2108, 64, 16, 8, 256, 64, 64, jnp.bfloat16, dict(window_size=(1023, 0))),
    ("gemma4_sliding_decode_p64", 64, 64, 16, 8, 256, 64, 64, jnp.bfloat16, dict(window_size=(1023, 0))),
    ("gemma4_full_mixed_p256", 2108, 64, 16, 2, 512, 256, 16, jnp.bfloat16, dict(softmax_scale=1.0)),
    # float8 with 2 kv heads: XLA lays the caches out head-major, read so, one head at a time (kernel.head_major_cache)
    ("gemma4_full_decode_p64_fp8", 8, 8, 16, 2, 512, 64, 64, FP8, dict(softmax_scale=1.0)),
    ("gpt_oss_sinks_decode_p16", 64, 64, 64, 8, 64, 16, 64, jnp.bfloat16, dict(window_size=(127, 0), sinks=True)),
    # gpt-oss's full layers at pages of 256 (4 a block, two visits a step): head dim 64 pads to 128 lanes in VMEM, which
    # the working set once left out (16.2 MiB against the 16 MiB limit it set, on v5e)
    ("gpt_oss_sinks_decode_p256", 64, 64, 64, 8, 64, 256, 17, jnp.bfloat16, dict(sinks=True)),
    # the same with the head dim padded to 128 (the recipe in docs/paged_attention.md): the caches read in place
    ("gpt_oss_padded_decode_p256", 64, 64, 64, 8, 128, 256, 17, jnp.bfloat16, dict(sinks=True, softmax_scale=0.125)),
]

# Deduplicated by kernel body. The body is fixed by the blocks (query tokens per block, pages per block), the head
# layout (Hq, Hkv, D), page size, dtypes, options and the VMEM limit; the tuning table gives every case above the same
# blocks on v5e, v6e and v7x and the same VMEM limit (16 MiB, each working set under 2/3 of it) except Gemma 4's decodes
# (sliding's visits take every kv head at once, 8 heads' rows against 8 heads' keys: 60.9 MiB, 48 on v7x, 3/4 of its
# VMEM; full's float8 keeps every head's widened K / V of both branches: 43.0 MiB) and gpt-oss's at pages of 256 (a
# token's 8 heads of 64 take a whole 16 x 128 tile, Mosaic's scratch beside: 65.3 MiB, compiled on v5e), and sliding's
# decode takes two visits a step on v5e and v6e but one on v7x (twice its page buffers would pass 3/4 of v7x's VMEM; its
# v6e body is the one benchmarks/ops/paged_attention.py models); and the token, sequence and page counts only size the
# grid, the visit lists and the SMEM page table. So each case compiles on one generation: on v6e (the benchmarks'
# generation) Qwen3 decode at the end of the SMEM budget, Gemma 4 full's float8 decode and gpt-oss (head dim 64, sinks);
# on v5e (the least scoped VMEM) and v7x (the least VMEM) the widest working sets, the fp8 mixed batch, Gemma 4 full's
# head dim 512 and Gemma 4 sliding's decode (its VMEM limit is the lowest there).
COMPILE_ELSEWHERE = {
    "qwen3_mixed_p64_fp8": "v5e",
    "qwen3_mixed_p64": "v5e",
    "gemma4_sliding_mixed_p64": "v5e",
    "gemma4_full_mixed_p256": "v7x",
    "gemma4_sliding_decode_p64": "v7x",
}
COMPILE_ELSEWHERE["gpt_oss_sinks_decode_p256"] = COMPILE_ELSEWHERE["gpt_oss_padded_decode_p256"] = "v5e"
COMPILES = [(case, COMPILE_ELSEWHERE.get(case[0], "v6e")) for case in COMPILE_CASES]


@pytest.mark.cpu_only
@pytest.mark.parametrize("case,generation", COMPILES, ids=lambda c: c if isinstance(c, str) else c[0])
def test_compiles_for_tpu(case, generation):
    label, tokens, seqs, hq, hkv, d, page, pps, cache_dtype, options = case
    options = dict(options)
    fp8 = cache_dtype == FP8
    extra = [((hq,), jnp.float32) if options.pop("sinks", False) else None]
    extra += [((1,), jnp.float32), ((1,), jnp.float32)] if fp8 else [None, None]
    stats = ladder.compile_for_tpu(
        functools.partial(_attention, **options),
        generation,
        *_specs(tokens, seqs, hq, hkv, d, page, pps, cache_dtype),
        *extra,
        label=f"paged_attention {label}",
    )
    cache_bytes = seqs * pps * page * hkv * d * jnp.dtype(cache_dtype).itemsize
    # the caches are read in place: no relayout copy of them in the program (XLA's default layout is not row-major
    # for head dim 64, so the gpt-oss case is exempt; Gemma 4 full's float8 caches are head-major, which the kernel
    # reads as they lie; see docs/paged_attention.md)
    if d >= 128:
        assert stats["temp_bytes"] < cache_bytes / 4, f"{label}: {stats['temp_bytes']} temp bytes (a cache copy?)"
