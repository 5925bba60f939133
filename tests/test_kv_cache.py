"""The paged KV cache write, JAX side, up the ladder: the kernel in strict interpret mode against the reference on
poisoned caches (exactly the named slots change, every other element unchanged bit for bit), skipped and
out-of-range slots, fp8 round trips with traced scales, the fused RoPE against the rotary reference for every rope
type whose kernel path differs, flash-attn's block-table addressing, bad input, TPU export, deviceless compile for
v5e / v6e / v7x, and the compiled program's aliasing (a donated cache is never copied)."""

import functools
import re

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout

from tpu_kernels_jax.kv_cache import api, reference
from tpu_kernels_jax.kv_cache.tuning import KVCacheBlocks
from tpu_kernels_jax.rotary import api as rotary_api

FP8 = jnp.dtype(jnp.float8_e4m3fn)
SMALL = KVCacheBlocks(block_tokens=8)
# (kv_heads, head_dim, v_head_dim) of the models the benchmarks name: Qwen3-30B-A3B, Gemma 4 sliding and full.
MODELS = {"qwen3": (4, 128, 128), "gemma4_sliding": (8, 256, 256), "gemma4_full": (2, 512, 512)}


def _bits(x):
    """The raw bits of an array (NaN compares equal to itself bit for bit)."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _poisoned_cache(rand, shape, dtype, poison):
    if poison == "nan":
        return jnp.full(shape, jnp.nan, jnp.float32).astype(dtype)
    return rand.normal(shape, jnp.float32, scale=3.0).astype(dtype)


def _slots(rand, tokens, num_pages, page_size, *, skip=0):
    """Distinct slots across shuffled pages (pages in random order, random offsets), `skip` of them -1."""
    slots = rand.rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
    if skip:
        slots[rand.rng.choice(tokens, skip, replace=False)] = -1
    return jnp.asarray(slots)


def _assert_only_slots_changed(before, after, expected, slots, what, rand):
    """after == expected bit for bit; the rows of `slots` (>= 0, in range) hold new values, every other row keeps
    `before`'s bits."""
    flat_before = _bits(before).reshape((-1,) + before.shape[2:])
    flat_after = _bits(after).reshape(flat_before.shape)
    np.testing.assert_array_equal(flat_after, _bits(expected).reshape(flat_before.shape), err_msg=f"{what} {rand!r}")
    slots = np.asarray(slots)
    written = slots[(slots >= 0) & (slots < flat_before.shape[0])]
    untouched = np.setdiff1d(np.arange(flat_before.shape[0]), written)
    np.testing.assert_array_equal(flat_after[untouched], flat_before[untouched], err_msg=f"{what}: untouched rows")
    assert not np.isnan(np.asarray(after).astype(np.float32).reshape(flat_before.shape)[written]).any(), what


def _reference_write(k_cache, v_cache, key, value, slots, **kw):
    """The reference write as one jitted program (one XLA compile, not one per eager op)."""
    return ladder.run_reference(
        lambda *a: reference.write_kv_cache_reference(*a, **kw), k_cache, v_cache, key, value, slots
    )


# ------------------------------------------------------------------------------------------------------ rung 1
WRITE_CASES = {
    # (dtype, num_pages, page_size, kv_heads, head_dim, v_head_dim, tokens, skipped, poison)
    "bf16_page16": (jnp.bfloat16, 6, 16, 4, 128, 128, 21, 5, "nan"),
    "f32_page64_random_poison": (jnp.float32, 3, 64, 2, 64, 64, 19, 3, "random"),
    "bf16_head512_v256": (jnp.bfloat16, 6, 16, 2, 512, 256, 21, 2, "nan"),
    "f32_one_head_page256": (jnp.float32, 2, 256, 1, 128, 128, 24, 0, "nan"),  # blocks dividing the tokens
    "bf16_8_heads_256": (jnp.bfloat16, 4, 32, 8, 256, 256, 9, 9, "random"),  # every token skipped
}


@pytest.mark.parametrize("case", WRITE_CASES)
def test_write_changes_exactly_the_named_slots(rand, case):
    dtype, pages, page_size, heads, d, dv, tokens, skipped, poison = WRITE_CASES[case]
    k_cache = _poisoned_cache(rand, (pages, page_size, heads, d), dtype, poison)
    v_cache = _poisoned_cache(rand, (pages, page_size, heads, dv), dtype, poison)
    key, value = rand.normal((tokens, heads, d), dtype), rand.normal((tokens, heads, dv), dtype)
    slots = _slots(rand, tokens, pages, page_size, skip=skipped)

    # 8-token blocks: several steps and a ragged last one. Jitted: one program around the kernel (the api's checks of
    # concrete slot values run on the eager calls of test_block_sizes_agree and the split-call test).
    out = ladder.run_kernel(
        jax.jit(lambda *a: api.write_kv_cache(*a, blocks=SMALL)), k_cache, v_cache, key, value, slots
    )
    expected = _reference_write(k_cache, v_cache, key, value, slots)
    for name, before, after, exp in zip(("k_cache", "v_cache"), (k_cache, v_cache), out, expected):
        assert after.shape == before.shape and after.dtype == before.dtype
        _assert_only_slots_changed(before, after, exp, slots, name, rand)


@pytest.mark.parametrize("block_tokens", [24, 1000], ids=lambda b: f"block{b}")
def test_block_sizes_agree(rand, block_tokens):
    """Blocks dividing the tokens and one block larger than all tokens: the same cache (8-token blocks, dividing and
    ragged, are the write cases' SMALL blocks)."""
    k_cache = _poisoned_cache(rand, (8, 16, 4, 128), jnp.bfloat16, "nan")
    key, value = rand.normal((48, 4, 128), jnp.bfloat16), rand.normal((48, 4, 128), jnp.bfloat16)
    slots = _slots(rand, 48, 8, 16, skip=4)
    blocks = KVCacheBlocks(block_tokens=block_tokens)
    out = ladder.run_kernel(lambda *a: api.write_kv_cache(*a, blocks=blocks), k_cache, k_cache, key, value, slots)
    expected = _reference_write(k_cache, k_cache, key, value, slots)
    for before, after, exp in zip((k_cache, k_cache), out, expected):
        _assert_only_slots_changed(before, after, exp, slots, f"block_tokens={block_tokens}", rand)


def test_traced_slots_out_of_range_are_skipped(rand):
    """Under jit nothing checks the slot values: -1, other negatives and slots past the cache write nothing (and
    nothing outside the cache, which strict interpret mode would report as an out-of-bounds access)."""
    pages, page_size = 4, 16
    k_cache = _poisoned_cache(rand, (pages, page_size, 2, 128), jnp.float32, "nan")
    key, value = rand.normal((16, 2, 128)), rand.normal((16, 2, 128))
    slots = np.array(_slots(rand, 16, pages, page_size))
    slots[[1, 5, 9, 12]] = [-1, -7, pages * page_size, 10**6]
    fn = jax.jit(lambda *a: api.write_kv_cache(*a, blocks=SMALL))
    out = ladder.run_kernel(fn, k_cache, k_cache, key, value, jnp.asarray(slots))
    expected = _reference_write(k_cache, k_cache, key, value, jnp.asarray(slots))
    for after, exp in zip(out, expected):
        _assert_only_slots_changed(k_cache, after, exp, slots, "traced out-of-range slots", rand)


def test_long_calls_are_split_through_the_aliased_caches(rand, monkeypatch):
    """More tokens than one call's SMEM slot mapping holds: consecutive calls, each writing its own tokens."""
    monkeypatch.setattr(api, "MAX_TOKENS_PER_CALL", 16)
    k_cache = _poisoned_cache(rand, (3, 16, 2, 128), jnp.bfloat16, "nan")
    key, value = rand.normal((37, 2, 128), jnp.bfloat16), rand.normal((37, 2, 128), jnp.bfloat16)
    slots = _slots(rand, 37, 3, 16, skip=4)  # calls of 16, 16 and 5 tokens
    fn = lambda *a: api.write_kv_cache(*a, blocks=SMALL)  # noqa: E731
    assert len(ladder.pallas_calls(fn, k_cache, k_cache, key, value, slots)) == 3
    out = ladder.run_kernel(fn, k_cache, k_cache, key, value, slots)
    expected = _reference_write(k_cache, k_cache, key, value, slots)
    for after, exp in zip(out, expected):
        _assert_only_slots_changed(k_cache, after, exp, slots, "split calls", rand)


def test_no_tokens_leaves_the_caches(rand):
    k_cache = rand.normal((2, 16, 2, 128), jnp.bfloat16)
    empty = jnp.zeros((0, 2, 128), jnp.bfloat16)
    out = api.write_kv_cache(k_cache, k_cache, empty, empty, jnp.zeros((0,), jnp.int32))
    for after in out:
        np.testing.assert_array_equal(_bits(after), _bits(k_cache))


# ------------------------------------------------------------------------------------------------------- fp8
def _scale(rand, kind):
    value = float(rand.uniform((), 0.02, 0.2))
    return {"float": value, "array0": jnp.float32(value), "array1": jnp.full((1,), value, jnp.float32)}[kind]


# Each scale kind once (a static float, a traced [] and a traced [1] array), each input dtype at least once: the
# quantisation is the same code for every (dtype, scale kind) pair.
@pytest.mark.parametrize(
    "in_dtype,scale_kind",
    [(jnp.float32, "float"), (jnp.bfloat16, "array0"), (jnp.float32, "array1")],
    ids=lambda v: v if isinstance(v, str) else jnp.dtype(v).name,
)
def test_fp8_round_trip(rand, in_dtype, scale_kind):
    """stored = value / scale rounded to e4m3fn (saturated); stored * scale gives the value back to fp8's 3 mantissa
    bits. The scales are traced (jit arguments) when arrays, as the torch op passes them."""
    pages, page_size, heads, d = 6, 16, 4, 128
    k_cache = _poisoned_cache(rand, (pages, page_size, heads, d), FP8, "random")
    v_cache = _poisoned_cache(rand, (pages, page_size, heads, 256), FP8, "random")
    key, value = rand.normal((30, heads, d), in_dtype), rand.normal((30, heads, 256), in_dtype, scale=4.0)
    key = key.at[0, 0, :4].set(jnp.asarray([1e4, -1e4, 0.0, 1e-6], in_dtype))  # saturation and underflow
    slots = _slots(rand, 30, pages, page_size, skip=3)
    k_scale, v_scale = _scale(rand, scale_kind), _scale(rand, scale_kind)

    if scale_kind == "float":
        fn = jax.jit(lambda *a: api.write_kv_cache(*a, k_scale=k_scale, v_scale=v_scale, blocks=SMALL))
        out = ladder.run_kernel(fn, k_cache, v_cache, key, value, slots)
    else:
        fn = jax.jit(lambda kc, vc, k, v, s, ks, vs: api.write_kv_cache(kc, vc, k, v, s, k_scale=ks, v_scale=vs))
        out = ladder.run_kernel(fn, k_cache, v_cache, key, value, slots, k_scale, v_scale)
    expected = _reference_write(k_cache, v_cache, key, value, slots, k_scale=k_scale, v_scale=v_scale)
    live = np.asarray(slots) >= 0
    for name, before, after, exp, x, scale in zip(
        ("k_cache", "v_cache"), (k_cache, v_cache), out, expected, (key, value), (k_scale, v_scale)
    ):
        assert after.dtype == FP8
        # The kernel multiplies by 1 / scale where the reference divides: equal after rounding to fp8 except, rarely,
        # at a rounding tie; one fp8 step (2**-3 relative) bounds it.
        ladder.assert_close(after, exp, rtol=2**-3, atol=2**-9, what=name, context=repr(rand))
        flat_exp = _bits(exp).reshape((-1,) + exp.shape[2:])
        flat_after = _bits(after).reshape(flat_exp.shape)
        assert (flat_after == flat_exp).mean() > 0.99, f"{name}: most stored values equal the reference bit for bit"
        untouched = np.setdiff1d(np.arange(flat_exp.shape[0]), np.asarray(slots)[live])
        np.testing.assert_array_equal(flat_after[untouched], _bits(before).reshape(flat_exp.shape)[untouched])
        rows = np.asarray(ladder.run_reference(reference.dequantize_reference, after, scale))
        rows = rows.reshape(flat_exp.shape)[np.asarray(slots)[live]]
        original = np.asarray(x).astype(np.float32)[live]
        limit = reference.FP8_MAX * float(np.asarray(scale).reshape(()))
        inside = np.abs(original) <= limit
        np.testing.assert_allclose(rows[inside], original[inside], rtol=2**-4, atol=2**-9 * limit / 448 * 64)
        np.testing.assert_array_equal(np.abs(rows[~inside]), limit * np.ones_like(rows[~inside]))  # saturated


@pytest.mark.parametrize("pages,tokens", [(4, 45), (12, 150)])
def test_head_major_fp8_caches_are_written_by_word_groups(rand, pages, tokens):
    """float8 caches of 1 or 2 kv heads (head-major in XLA's layout): each row merged into the 32-bit words it shares
    with three other page offsets, at every token count (a decode batch, a prefill chunk of several blocks).
    Consecutive slots in shuffled token order (tokens sharing a word group, some in different blocks), slot -1,
    negative and past-the-cache traced slots: the written rows are the quantised rows, every other byte of the caches
    (random bits, NaNs among them) unchanged."""
    page_size, heads, d = 16, 2, 128
    k_cache, v_cache = (
        jax.lax.bitcast_convert_type(
            jnp.asarray(rand.rng.integers(0, 256, (pages, page_size, heads, d), np.uint8)), FP8
        )
        for _ in range(2)
    )
    key, value = rand.normal((tokens, heads, d), jnp.bfloat16), rand.normal((tokens, heads, d), jnp.bfloat16, scale=4.0)
    run = 2 * tokens // 3  # consecutive slots (a prefill chunk), then random ones
    start = int(rand.rng.integers(0, pages * page_size - run - 10))
    slots = np.concatenate(
        [np.arange(start, start + run), rand.rng.permutation(pages * page_size)[: tokens - run]]
    ).astype(np.int32)
    slots[np.flatnonzero(np.isin(slots[run:], slots[:run])) + run] = -1  # the random ones distinct from the run
    slots = slots[rand.rng.permutation(tokens)]
    slots[rand.rng.choice(tokens, 4, replace=False)] = [-1, -5, pages * page_size, 10**6]
    assert api.kernel.head_major_cache(hkv=heads, page_size=page_size, cache_itemsize=1)
    fn = jax.jit(lambda *a: api.write_kv_cache(*a, k_scale=0.5, v_scale=0.25, blocks=SMALL))
    out = ladder.run_kernel(fn, k_cache, v_cache, key, value, jnp.asarray(slots))
    live = slots[(slots >= 0) & (slots < pages * page_size)]
    expected = _reference_write(
        k_cache, v_cache, key, value, jnp.asarray(np.where(np.isin(slots, live), slots, -1)), k_scale=0.5, v_scale=0.25
    )
    for name, before, after, exp in zip(("k_cache", "v_cache"), (k_cache, v_cache), out, expected):
        flat = (pages * page_size, heads * d)
        got, want, old = (_bits(x).reshape(flat) for x in (after, exp, before))
        assert (got[live] == want[live]).mean() > 0.99, f"{name}: the written rows {rand!r}"  # rounding ties aside
        rows = [np.asarray(x).astype(np.float32).reshape(flat)[live] for x in (after, exp)]
        np.testing.assert_allclose(*rows, rtol=2**-3, atol=2**-9, err_msg=f"{name} {rand!r}")  # one fp8 step at a tie
        untouched = np.setdiff1d(np.arange(flat[0]), live)
        np.testing.assert_array_equal(got[untouched], old[untouched], err_msg=f"{name}: untouched rows {rand!r}")


# ----------------------------------------------------------------------------------------------------- RoPE
# The rope types whose kernel paths differ: default, a partial rotary prefix, interleaved pairs, yarn's attention
# scaling and the proportional zero-frequency tail. "linear" and "llama3" only change the numbers of the host-built
# inverse-frequency table the kernel reads (the default path, attention scaling 1); those numbers are
# test_inverse_frequencies_match_transformers' in test_rotary_torch.py (and rope_and_write_kv_cache takes them from the
# same frequencies.inverse_frequencies as the rotary ops).
ROPE_CASES = {
    "default": dict(theta=1e6),
    "partial_rotary": dict(theta=1e4, rotary_dim=64),
    "interleaved": dict(theta=1e4, interleaved=True),
    "yarn": dict(theta=1e4, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    "proportional_gemma4_full": dict(
        theta=1e6, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25}, heads=2, head_dim=512
    ),
}


# Each of those rope types in f32 (the tight tolerance); bf16 (the kernel's rounding of the rotated rows) at the head
# dim 512 proportional one (bf16 at head dim 256 with the default rope: the fp8 test below, whose inputs are bf16).
ROPE_DTYPE_CASES = [(case, jnp.float32) for case in ROPE_CASES] + [("proportional_gemma4_full", jnp.bfloat16)]


@pytest.mark.parametrize("case,dtype", ROPE_DTYPE_CASES, ids=[f"{c}-{jnp.dtype(d).name}" for c, d in ROPE_DTYPE_CASES])
def test_rope_and_write_matches_rotary_reference(rand, case, dtype):
    options = dict(ROPE_CASES[case])
    heads, head_dim = options.pop("heads", 4), options.pop("head_dim", 128)
    pages, page_size, tokens = 4, 16, 19  # 8-token blocks: two whole and a ragged one
    k_cache = _poisoned_cache(rand, (pages, page_size, heads, head_dim), dtype, "nan")
    v_cache = _poisoned_cache(rand, (pages, page_size, heads, head_dim), dtype, "nan")
    query = rand.normal((tokens, 4 * heads, head_dim), dtype)
    key, value = rand.normal((tokens, heads, head_dim), dtype), rand.normal((tokens, heads, head_dim), dtype)
    slots = _slots(rand, tokens, pages, page_size, skip=3)
    positions = rand.integers(0, 40000, (tokens,))

    def fused(q, k, v, kc, vc, s, p):
        return api.rope_and_write_kv_cache(q, k, v, kc, vc, s, p, blocks=SMALL, **options)

    args = (query, key, value, k_cache, v_cache, slots, positions)
    q_rot, k_out, v_out = ladder.run_kernel(fused, *args)
    q_ref, k_ref, v_ref = ladder.run_reference(
        lambda *a: reference.rope_and_write_kv_cache_reference(*a, **options), *args
    )
    tol = dict(rtol=1e-5, atol=3e-5) if dtype == jnp.float32 else {}
    ladder.assert_close(q_rot, q_ref, dtype=dtype, what="query_rotated", context=repr(rand), **tol)
    live = np.asarray(slots)[np.asarray(slots) >= 0]
    flat = lambda c: np.asarray(c).astype(np.float32).reshape((-1,) + c.shape[2:])  # noqa: E731 (on the host)
    ladder.assert_close(flat(k_out)[live], flat(k_ref)[live], dtype=dtype, what="k rows", context=repr(rand), **tol)
    _assert_only_slots_changed(v_cache, v_out, v_ref, slots, "v_cache", rand)  # V is not rotated: exact
    untouched = np.setdiff1d(np.arange(pages * page_size), live)
    np.testing.assert_array_equal(_bits(flat(k_out)[untouched]), _bits(flat(k_cache)[untouched]))
    if case in TABLE_CASES and dtype == jnp.float32:
        # The same kernel from each token's cos / sin rows (flash_attn_with_kvcache's tables): a partial rotary prefix
        # padded to the head dim with the query, interleaved pairs with the key alone (query None).
        with_query = TABLE_CASES[case]
        cos, sin = (
            t[0]
            for t in rotary_api.rope_cos_sin(
                positions[None],
                head_dim=head_dim,
                theta=options["theta"],
                rotary_dim=options.get("rotary_dim"),
                interleaved=options.get("interleaved", False),
            )
        )

        def from_tables(q, k, v, kc, vc, s, c, si):
            return api.rope_tables_and_write_kv_cache(
                q if with_query else None, k, v, kc, vc, s, c, si, interleaved=options.get("interleaved", False)
            )

        q_tab, k_tab, v_tab = ladder.run_kernel(from_tables, query, key, value, k_cache, v_cache, slots, cos, sin)
        assert (q_tab is None) == (not with_query)
        if with_query:
            ladder.assert_close(q_tab, q_ref, dtype=dtype, what="query (tables)", context=repr(rand), **tol)
        ladder.assert_close(
            flat(k_tab)[live], flat(k_ref)[live], dtype=dtype, what="k (tables)", context=repr(rand), **tol
        )
        np.testing.assert_array_equal(_bits(flat(k_tab)[untouched]), _bits(flat(k_cache)[untouched]))
        np.testing.assert_array_equal(_bits(v_tab), _bits(v_out))


# rope_tables_and_write_kv_cache checked inside those cases: {case: whether a query is rotated too}.
TABLE_CASES = {"partial_rotary": True, "interleaved": False}


@pytest.mark.parametrize("heads,tokens", [(8, 64), (2, 24)])  # 2: head-major caches, written by word groups
def test_rope_and_write_fp8_with_traced_scales_and_long_decode_rows(rand, heads, tokens):
    """fp8 cache, scales as traced arrays, decode tokens at one position each (row-select positions): the rotated,
    quantised K equals the reference's quantisation of the reference rotation to one fp8 step."""
    d = 256
    k_cache = _poisoned_cache(rand, (10, 16, heads, d), FP8, "random")
    query = rand.normal((tokens, 16, d), jnp.bfloat16)
    key, value = rand.normal((tokens, heads, d), jnp.bfloat16), rand.normal((tokens, heads, d), jnp.bfloat16)
    slots, positions = _slots(rand, tokens, 10, 16, skip=2), rand.integers(0, 2**20, (tokens,))
    scales = jnp.float32(0.05), jnp.full((1,), 0.03, jnp.float32)

    def fused(q, k, v, kc, vc, s, p, ks, vs):
        return api.rope_and_write_kv_cache(q, k, v, kc, vc, s, p, theta=1e4, k_scale=ks, v_scale=vs)

    out = ladder.run_kernel(jax.jit(fused), query, key, value, k_cache, k_cache, slots, positions, *scales)
    expected = ladder.run_reference(
        lambda *a: reference.rope_and_write_kv_cache_reference(*a, theta=1e4, k_scale=scales[0], v_scale=scales[1]),
        *(query, key, value, k_cache, k_cache, slots, positions),
    )
    ladder.assert_close(out[0], expected[0], dtype=jnp.bfloat16, what="query_rotated", context=repr(rand))
    for name, after, exp in zip(("k_cache", "v_cache"), out[1:], expected[1:]):
        ladder.assert_close(after, exp, rtol=2**-3, atol=2**-9, what=name, context=repr(rand))
        live = np.asarray(slots)[np.asarray(slots) >= 0]
        untouched = np.setdiff1d(np.arange(160), live)
        np.testing.assert_array_equal(
            _bits(after).reshape(160, heads, d)[untouched], _bits(k_cache).reshape(160, heads, d)[untouched]
        )


# ---------------------------------------------------------------------------------------------------- random draws
@ladder.random_draws
def test_random_draw(rand, draw):
    """The plain write or the fused RoPE (each rope type), the cache dtype (float8 with scales: one or two kv heads
    are head-major, written by word groups), page size, pages, heads, head dims, tokens, skipped and out-of-range
    traced slots, NaN or random caches and the tiling drawn at random; against the reference write: the named slots
    hold it (to one fp8 step), every other slot keeps its bits."""
    rope = rand.draw("rope", [None, *ROPE_CASES])
    options = dict(ROPE_CASES[rope]) if rope else {}
    cache_dtype = rand.draw("cache_dtype", [jnp.float32, jnp.bfloat16, FP8])
    in_dtype = rand.draw("input_dtype", [jnp.float32, jnp.bfloat16]) if cache_dtype == FP8 else cache_dtype
    page_size, pages = rand.draw("page_size", [16, 32, 64, 256]), rand.draw("pages", [1, 2, 3, 6])
    heads = options.pop("heads", None) or rand.draw("kv_heads", [1, 2, 4, 8])
    head_dim = options.pop("head_dim", None) or rand.draw("head_dim", [64, 128, 256, 512])
    v_head_dim = head_dim if rope else rand.draw("v_head_dim", [head_dim, 64, 128, 256])
    tokens = min(rand.draw("tokens", [1, 7, 19, 40]), pages * page_size)
    slots = np.array(_slots(rand, tokens, pages, page_size, skip=rand.draw("skipped", [0, 1, tokens // 3])))
    if tokens >= 3 and rand.draw("out_of_range_slots", [False, True]):
        slots[rand.rng.choice(tokens, 3, replace=False)] = [-7, pages * page_size, 10**6]
    poison = "random" if cache_dtype == FP8 else rand.draw("poison", ["nan", "random"])
    k_cache = _poisoned_cache(rand, (pages, page_size, heads, head_dim), cache_dtype, poison)
    v_cache = _poisoned_cache(rand, (pages, page_size, heads, v_head_dim), cache_dtype, poison)
    key, value = rand.normal((tokens, heads, head_dim), in_dtype), rand.normal((tokens, heads, v_head_dim), in_dtype)
    scales = dict(k_scale=_scale(rand, "float"), v_scale=_scale(rand, "float")) if cache_dtype == FP8 else {}
    blocks = rand.draw("blocks", [SMALL, None])
    slots = jnp.asarray(slots)
    tol = dict(rtol=1e-5, atol=3e-5) if in_dtype == jnp.float32 else {}  # a rotation's f32 rounding
    if rope:
        query = rand.normal((tokens, 4 * heads, head_dim), in_dtype)
        positions = rand.integers(0, 40000, (tokens,))
        args = (query, key, value, k_cache, v_cache, slots, positions)
        fused = jax.jit(lambda *a: api.rope_and_write_kv_cache(*a, blocks=blocks, **options, **scales))
        q_rot, *out = ladder.run_kernel(fused, *args)
        q_ref, *expected = ladder.run_reference(
            lambda *a: reference.rope_and_write_kv_cache_reference(*a, **options, **scales), *args
        )
        ladder.assert_close(q_rot, q_ref, dtype=in_dtype, what="query_rotated", context=repr(rand), **tol)
    else:
        write = jax.jit(lambda *a: api.write_kv_cache(*a, blocks=blocks, **scales))
        out = ladder.run_kernel(write, k_cache, v_cache, key, value, slots)
        expected = _reference_write(k_cache, v_cache, key, value, slots, **scales)
    rotated = {"k_cache": bool(rope), "v_cache": False}
    for name, before, after, exp in zip(("k_cache", "v_cache"), (k_cache, v_cache), out, expected):
        assert after.shape == before.shape and after.dtype == before.dtype
        if cache_dtype == FP8 or rotated[name]:
            _assert_written_rows_close(before, after, exp, slots, name, rand, dtype=in_dtype, **tol)
        else:
            _assert_only_slots_changed(before, after, exp, slots, name, rand)


def _assert_written_rows_close(before, after, expected, slots, what, rand, *, dtype, rtol=None, atol=None):
    """The rows the live slots name are the reference's (to one fp8 step in a float8 cache: the kernel multiplies by
    1 / scale where the reference divides; else to `dtype`'s rounding of a rotation), every other row keeps its bits."""
    rows = (-1,) + before.shape[2:]
    slots = np.asarray(slots)
    live = slots[(slots >= 0) & (slots < np.prod(before.shape[:2]))]
    got, want = (np.asarray(x).astype(np.float32).reshape(rows)[live] for x in (after, expected))
    if jnp.dtype(after.dtype) == FP8:
        ladder.assert_close(got, want, rtol=2**-3, atol=2**-9, what=what, context=repr(rand))
    else:
        ladder.assert_close(got, want, dtype=dtype, rtol=rtol, atol=atol, what=what, context=repr(rand))
    untouched = np.setdiff1d(np.arange(_bits(before).reshape(rows).shape[0]), live)
    np.testing.assert_array_equal(_bits(after).reshape(rows)[untouched], _bits(before).reshape(rows)[untouched])


# ----------------------------------------------------------------------------------------------- block tables
def test_block_table_slots_and_write(rand):
    """flash-attn's addressing: shuffled, non-contiguous pages; lengths not multiples of the page; an empty
    sequence; the new tokens written through the slots land at block_table[b, p // page] offset p % page."""
    page_size, batch, pages_per_seq, new = 16, 3, 4, 5
    num_pages = 20
    block_table = jnp.asarray(rand.rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, -1), jnp.int32)
    seqlens = jnp.asarray([0, 17, 59], jnp.int32)
    slots = api.block_table_slots(block_table, seqlens, new, page_size)
    np.testing.assert_array_equal(
        np.asarray(slots), np.asarray(reference.block_table_slots_reference(block_table, seqlens, new, page_size))
    )
    bt, lens, host_slots = np.asarray(block_table), np.asarray(seqlens), np.asarray(slots)  # indexed on the host
    for b in range(batch):
        for j in range(new):
            p = lens[b] + j
            assert host_slots[b * new + j] == bt[b, p // page_size] * page_size + p % page_size
    k_cache = _poisoned_cache(rand, (num_pages, page_size, 2, 128), jnp.bfloat16, "nan")
    key = rand.normal((batch * new, 2, 128), jnp.bfloat16)
    out = ladder.run_kernel(lambda *a: api.write_kv_cache(*a), k_cache, k_cache, key, key, slots)
    for after in out:
        after, host_key = np.asarray(after), np.asarray(key)
        for b in range(batch):
            for j in range(new):
                p = lens[b] + j
                np.testing.assert_array_equal(
                    _bits(after[bt[b, p // page_size], p % page_size]), _bits(host_key[b * new + j])
                )


@pytest.mark.cpu_only
def test_block_table_slots_traced_past_the_table_are_skipped():
    block_table = jnp.asarray([[3, 1], [0, 2]], jnp.int32)
    slots = jax.jit(lambda t, s: api.block_table_slots(t, s, 4, 16))(block_table, jnp.asarray([30, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(slots), [30, 31, -1, -1, 5, 6, 7, 8])
    # a missing page (-1 in the table): its tokens are skipped, never given a negative slot
    missing = jnp.asarray([[2, 0], [3, -1]], jnp.int32)
    slots = jax.jit(lambda t, s: api.block_table_slots(t, s, 3, 16))(missing, jnp.asarray([5, 16], jnp.int32))
    np.testing.assert_array_equal(np.asarray(slots), [37, 38, 39, -1, -1, -1])


# ---------------------------------------------------------------------------------------------------- bad input
def _good(rand):
    return dict(
        k_cache=rand.normal((4, 16, 2, 128), jnp.bfloat16),
        v_cache=rand.normal((4, 16, 2, 64), jnp.bfloat16),
        key=rand.normal((6, 2, 128), jnp.bfloat16),
        value=rand.normal((6, 2, 64), jnp.bfloat16),
        slot_mapping=jnp.asarray([0, 5, -1, 63, 17, 18], jnp.int32),
    )


def _fp8(rand, **extra):
    return (
        dict(k_cache=jnp.zeros((4, 16, 2, 128), FP8), v_cache=jnp.zeros((4, 16, 2, 64), FP8), k_scale=0.1, v_scale=0.1)
        | extra
    )


BAD_WRITES = [
    ladder.BadInput("cache_rank", lambda r: {"k_cache": r.normal((64, 2, 128), jnp.bfloat16)}, ValueError, "k_cache"),
    ladder.BadInput(
        "cache_dtype", lambda r: {"k_cache": jnp.zeros((4, 16, 2, 128), jnp.float16)}, TypeError, "k_cache"
    ),
    ladder.BadInput(
        "v_cache_dtype", lambda r: {"v_cache": jnp.zeros((4, 16, 2, 64), jnp.float32)}, TypeError, "v_cache"
    ),
    ladder.BadInput(
        "v_cache_pages", lambda r: {"v_cache": jnp.zeros((5, 16, 2, 64), jnp.bfloat16)}, ValueError, "v_cache"
    ),
    ladder.BadInput(
        "key_heads", lambda r: {"key": r.normal((6, 4, 128), jnp.bfloat16)}, ValueError, "key: expected [tokens, 2"
    ),
    ladder.BadInput(
        "key_head_dim", lambda r: {"key": r.normal((6, 2, 64), jnp.bfloat16)}, ValueError, "head dim of k_cache"
    ),
    ladder.BadInput(
        "value_head_dim", lambda r: {"value": r.normal((6, 2, 128), jnp.bfloat16)}, ValueError, "value: expected"
    ),
    ladder.BadInput("key_dtype", lambda r: {"key": r.normal((6, 2, 128))}, TypeError, "key: expected the cache dtype"),
    ladder.BadInput("value_dtype", lambda r: {"value": r.normal((6, 2, 64))}, TypeError, "value"),
    ladder.BadInput(
        "value_tokens", lambda r: {"value": r.normal((5, 2, 64), jnp.bfloat16)}, ValueError, "value: expected 6"
    ),
    ladder.BadInput(
        "slots_int64_as_float",
        {"slot_mapping": jnp.asarray([0, 1, 2, 3, 4, 5], jnp.float32)},
        TypeError,
        "slot_mapping",
    ),
    ladder.BadInput(
        "slots_uint32", {"slot_mapping": jnp.asarray([0, 1, 2, 3, 4, 5], jnp.uint32)}, TypeError, "slot_mapping"
    ),
    ladder.BadInput("slots_length", {"slot_mapping": jnp.asarray([0, 1, 2], jnp.int32)}, ValueError, "(6,)"),
    ladder.BadInput(
        "slot_past_cache", {"slot_mapping": jnp.asarray([0, 1, 64, 3, 4, 5], jnp.int32)}, ValueError, "[0, 64)"
    ),
    ladder.BadInput(
        "slot_below_minus_one", {"slot_mapping": jnp.asarray([0, 1, -2, 3, 4, 5], jnp.int32)}, ValueError, "got -2"
    ),
    ladder.BadInput(
        "duplicate_slots", {"slot_mapping": jnp.asarray([0, 1, 1, 3, -1, -1], jnp.int32)}, ValueError, "distinct"
    ),
    ladder.BadInput("fp8_without_scale", lambda r: _fp8(r, k_scale=None), ValueError, "k_scale: an fp8"),
    ladder.BadInput("fp8_without_v_scale", lambda r: _fp8(r, v_scale=None), ValueError, "v_scale: an fp8"),
    ladder.BadInput("scale_without_fp8", {"k_scale": 0.5}, ValueError, "k_scale: only an fp8"),
    ladder.BadInput("scale_zero", lambda r: _fp8(r, k_scale=0.0), ValueError, "k_scale: expected a finite scale"),
    ladder.BadInput("scale_nan", lambda r: _fp8(r, v_scale=float("nan")), ValueError, "v_scale"),
    ladder.BadInput(
        "scale_shape", lambda r: _fp8(r, k_scale=jnp.ones((2,), jnp.float32)), ValueError, "k_scale: expected a float32"
    ),
    ladder.BadInput("scale_dtype", lambda r: _fp8(r, k_scale=jnp.ones((), jnp.bfloat16)), TypeError, "k_scale"),
    ladder.BadInput("scale_negative_array", lambda r: _fp8(r, v_scale=jnp.float32(-1.0)), ValueError, "v_scale"),
    ladder.BadInput(
        "fp8_key_dtype", lambda r: _fp8(r, key=jnp.zeros((6, 2, 128), FP8)), TypeError, "bfloat16 or float32 for an fp8"
    ),
    ladder.BadInput("blocks_type", {"blocks": (8,)}, TypeError, "blocks: expected a KVCacheBlocks"),
    ladder.BadInput(
        "blocks_not_multiple", {"blocks": KVCacheBlocks(block_tokens=5)}, ValueError, "blocks.block_tokens"
    ),
    ladder.BadInput("blocks_zero", {"blocks": KVCacheBlocks(block_tokens=0)}, ValueError, "blocks.block_tokens"),
    ladder.BadInput("blocks_float", {"blocks": KVCacheBlocks(block_tokens=8.0)}, TypeError, "blocks.block_tokens"),
    ladder.BadInput(
        "blocks_vmem", {"blocks": KVCacheBlocks(block_tokens=8, vmem_limit_bytes=1 << 40)}, ValueError, "vmem_limit"
    ),
    ladder.BadInput(
        "blocks_row_major_not_bool",
        {"blocks": KVCacheBlocks(row_major_caches="no")},
        TypeError,
        "blocks.row_major_caches: expected a bool",
    ),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_WRITES)
def test_bad_write_input_is_a_clear_error(rand, case):
    def call(a):
        return api.write_kv_cache(
            a["k_cache"],
            a["v_cache"],
            a["key"],
            a["value"],
            a["slot_mapping"],
            k_scale=a.get("k_scale"),
            v_scale=a.get("v_scale"),
            blocks=a.get("blocks"),
        )

    ladder.assert_clear_error(case, call, _good(rand), rand)


BAD_ROPE = [
    ladder.BadInput(
        "positions_dtype", {"positions": jnp.arange(6, dtype=jnp.float32)}, TypeError, "positions: expected dtype"
    ),
    ladder.BadInput("positions_int64_as_uint", {"positions": jnp.arange(6, dtype=jnp.uint32)}, TypeError, "positions"),
    ladder.BadInput(
        "positions_length", {"positions": jnp.arange(5, dtype=jnp.int32)}, ValueError, "positions: expected"
    ),
    ladder.BadInput("positions_2d", {"positions": jnp.zeros((1, 6), jnp.int32)}, ValueError, "positions"),
    ladder.BadInput(
        "positions_negative", {"positions": jnp.asarray([0, 1, -3, 3, 4, 5], jnp.int32)}, ValueError, "positions"
    ),
    ladder.BadInput(
        "query_head_dim", lambda r: {"query": r.normal((6, 4, 64), jnp.bfloat16)}, ValueError, "query: expected"
    ),
    ladder.BadInput("query_dtype", lambda r: {"query": r.normal((6, 4, 128))}, TypeError, "query"),
    ladder.BadInput("theta", {"theta": 1.0}, ValueError, "theta"),
    ladder.BadInput("rotary_dim_odd", {"rotary_dim": 63}, ValueError, "rotary_dim"),
    ladder.BadInput("scaling_type", {"scaling": {"rope_type": "dynamic"}}, ValueError, "rope_type"),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_ROPE)
def test_bad_rope_input_is_a_clear_error(rand, case):
    good = _good(rand) | dict(
        query=rand.normal((6, 4, 128), jnp.bfloat16),
        positions=jnp.arange(6, dtype=jnp.int32),
        theta=1e4,
        rotary_dim=None,
        scaling=None,
    )
    good["v_cache"], good["value"] = good["k_cache"], good["key"]

    def call(a):
        return api.rope_and_write_kv_cache(
            a["query"],
            a["key"],
            a["value"],
            a["k_cache"],
            a["v_cache"],
            a["slot_mapping"],
            a["positions"],
            theta=a["theta"],
            rotary_dim=a["rotary_dim"],
            scaling=a["scaling"],
        )

    ladder.assert_clear_error(case, call, good, rand)


BAD_TABLES = [
    ladder.BadInput("table_dtype", {"block_table": np.zeros((2, 3), np.int64)}, TypeError, "block_table"),
    ladder.BadInput("table_rank", {"block_table": jnp.zeros((6,), jnp.int32)}, ValueError, "block_table"),
    ladder.BadInput("seqlens_length", {"cache_seqlens": jnp.zeros((3,), jnp.int32)}, ValueError, "cache_seqlens"),
    ladder.BadInput("seqlens_negative", {"cache_seqlens": jnp.asarray([0, -1], jnp.int32)}, ValueError, ">= 0"),
    ladder.BadInput("past_the_table", {"cache_seqlens": jnp.asarray([0, 46], jnp.int32)}, ValueError, "3 pages x 16"),
    ladder.BadInput("new_tokens_float", {"new_tokens": 2.0}, TypeError, "new_tokens"),
    ladder.BadInput("page_size_zero", {"page_size": 0}, ValueError, "page_size"),
    # sequence 1 at 40 tokens: its new tokens 40-42 land in page 2, whose entry says no page
    ladder.BadInput("missing_page", {"block_table": jnp.asarray([[0, 1, 2], [3, 4, -1]], jnp.int32)}, ValueError, "-1"),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_TABLES)
def test_bad_block_table_input_is_a_clear_error(rand, case):
    good = dict(
        block_table=jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32),
        cache_seqlens=jnp.asarray([0, 40], jnp.int32),
        new_tokens=3,
        page_size=16,
    )
    ladder.assert_clear_error(
        case,
        lambda a: api.block_table_slots(a["block_table"], a["cache_seqlens"], a["new_tokens"], a["page_size"]),
        good,
        rand,
    )


# ---------------------------------------------------------------------------------------------------- rungs 2, 3
def _specs(model, dtype, tokens, page_size, pages=64):
    heads, d, dv = MODELS[model]
    in_dtype = jnp.bfloat16 if jnp.dtype(dtype) == FP8 else dtype
    return (
        ((pages, page_size, heads, d), dtype),
        ((pages, page_size, heads, dv), dtype),
        ((tokens, heads, d), in_dtype),
        ((tokens, heads, dv), in_dtype),
        ((tokens,), jnp.int32),
    )


def _scales(dtype):
    return dict(k_scale=0.5, v_scale=0.25) if jnp.dtype(dtype) == FP8 else {}


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=lambda d: jnp.dtype(d).name)
def test_export_for_tpu(dtype):
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in _specs("qwen3", dtype, 33, 16)]
    ladder.export_for_tpu(lambda *a: api.write_kv_cache(*a, **_scales(dtype)), *specs)
    query, positions = jax.ShapeDtypeStruct((33, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((33,), jnp.int32)

    def fused(kc, vc, k, v, s, q, p, ks):
        scales = dict(k_scale=ks, v_scale=ks) if jnp.dtype(dtype) == FP8 else {}
        return api.rope_and_write_kv_cache(q, k, v, kc, vc, s, p, theta=1e6, **scales)

    ladder.export_for_tpu(fused, *specs, query, positions, jax.ShapeDtypeStruct((), jnp.float32))


# Deviceless compiles, deduplicated by kernel body. The body is fixed by the head layout (kv_heads, head_dim,
# v_head_dim), the cache dtype (bf16, or fp8 with its quantising staging), the variant (plain write or fused RoPE) and
# the tuning table's block (128 tokens on every generation); the token count and page count only set the grid and the
# slot mapping's length, and the page size only the cache's shape (a slot is one row of the flattened cache). On v6e
# test_donated_caches_are_written_in_place compiles the plain write and the fused RoPE of five of the six (model,
# dtype) bodies, and test_row_major_caches_... both of the sixth (Gemma 4 full, fp8) in the row-major cache layout it
# is written in place in (in XLA's default layout of that cache, XLA's relayout copies around the kernel take most of
# a 50 s compile); so this test compiles on v6e the prefill chunk (2048 tokens, 16 grid steps) at page 256 and head
# dim 64 in f32.
# v5e (least scoped VMEM) and v7x (least VMEM) compile the VMEM-heaviest blocks (Gemma 4 full, head dim 512) in bf16,
# both variants, and head dim 64. Together page sizes 16, 64 and 256 and every model in bf16 and fp8 compile on v6e.
# (model, dtype, page_size of the write (None: no write), page_size of the fused RoPE, tokens)
COMPILE_CASES = {
    "v6e": [("gemma4_full", jnp.bfloat16, 256, 64, 2048)],
    "v5e": [("gemma4_full", jnp.bfloat16, 16, 256, 256)],
    "v7x": [("gemma4_full", jnp.bfloat16, 16, 256, 256)],
}


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_compiles_for_tpu(generation):
    for model, dtype, page_size, rope_page_size, tokens in COMPILE_CASES[generation]:
        label = f"write_kv_cache {model} {jnp.dtype(dtype).name} page {page_size} tokens {tokens}"
        if page_size is not None:
            ladder.compile_for_tpu(
                lambda *a: api.write_kv_cache(*a, **_scales(dtype)),
                generation,
                *_specs(model, dtype, tokens, page_size),
                label=label,
            )
        heads, d, _ = MODELS[model]
        extra = (((tokens, 4 * heads, d), jnp.bfloat16), ((tokens,), jnp.int32))

        def fused(kc, vc, k, v, s, q, p):
            return api.rope_and_write_kv_cache(q, k, v, kc, vc, s, p, theta=1e6, **_scales(dtype))

        ladder.compile_for_tpu(
            fused,
            generation,
            *_specs(model, dtype, tokens, rope_page_size),
            *extra,
            label=f"rope_write_kv_cache {model} {jnp.dtype(dtype).name} page {rope_page_size} tokens {tokens}",
        )
    if generation != "v6e":  # the head-major float8 word-group write (v6e: test_row_major_caches_...)
        page_size = 16 if generation == "v5e" else 64
        ladder.compile_for_tpu(
            lambda *a: api.write_kv_cache(*a, **_scales(FP8)),
            generation,
            *_specs("gemma4_full", FP8, 8, page_size),
            label=f"write_kv_cache gemma4_full float8 head-major page {page_size} tokens 8",
        )
    # head dim 64 (gpt-oss), f32
    ladder.compile_for_tpu(
        lambda *a: api.write_kv_cache(*a),
        generation,
        ((64, 64, 8, 64), jnp.float32),
        ((64, 64, 8, 64), jnp.float32),
        ((100, 8, 64), jnp.float32),
        ((100, 8, 64), jnp.float32),
        ((100,), jnp.int32),
        label="write_kv_cache d64 f32",
    )


def _compiled_text(fn, specs, generation="v6e", *, donate=True, row_major=False):
    device = ladder.tpu_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    cache_sharding = Format(Layout(major_to_minor=(0, 1, 2, 3)), sharding) if row_major else sharding
    args = [
        jax.ShapeDtypeStruct(s, d, sharding=cache_sharding if i < 2 else sharding) for i, (s, d) in enumerate(specs)
    ]
    jit_kw = dict(donate_argnums=(0, 1) if donate else ())
    if row_major:
        jit_kw |= dict(in_shardings=(cache_sharding,) * 2 + (sharding,) * 3, out_shardings=(cache_sharding,) * 2)
    with jax.default_device(device):
        return jax.jit(fn, **jit_kw).lower(*args).compile().as_text()


def _cache_copies(text, specs):
    """HLO instructions that copy, scatter into or update a cache-sized buffer."""
    sizes = {int(np.prod(s)) for s, _ in specs[:2]}
    found = []
    for line in text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = \(?\w+\[([\d,]+)\]", line)
        if not match or not re.search(r"\b(copy|copy-start|scatter|dynamic-update-slice|fusion)\(", line):
            continue
        if int(np.prod([int(d) for d in match.group(1).split(",")])) in sizes:
            found.append(line[:160])
    return found


# Caches whose XLA default layout is the row-major tiled one the kernel writes (see docs/kv_cache.md).
IN_PLACE_CASES = [
    ("qwen3", jnp.bfloat16, 16),
    ("qwen3", FP8, 256),
    ("gemma4_sliding", jnp.bfloat16, 256),
    ("gemma4_sliding", FP8, 64),
    ("gemma4_full", jnp.bfloat16, 64),
]


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", IN_PLACE_CASES, ids=lambda c: f"{c[0]}_{jnp.dtype(c[1]).name}_page{c[2]}")
def test_donated_caches_are_written_in_place(case):
    """The compiled program of a jit that donates the caches aliases them to its outputs and holds no copy, scatter or
    update of a cache-sized buffer; without donation XLA must keep the caller's caches and copies them (the check sees
    copies when there are some; one case: the detector and XLA's copies do not depend on the body). These are also the
    v6e deviceless compiles of these (model, dtype) bodies, plain and fused (see COMPILE_CASES)."""
    model, dtype, page_size = case
    specs = _specs(model, dtype, 256, page_size, pages=512)

    def write(*a):
        return api.write_kv_cache(*a, **_scales(dtype))

    text = _compiled_text(write, specs)
    assert "tpu_custom_call" in text, "the compiled program holds no Mosaic kernel"  # the v6e compile of this body
    assert re.search(r"input_output_alias=\{ \{0\}: \(0, \{\}, may-alias\), \{1\}: \(1, \{\}, may-alias\) \}", text)
    assert not _cache_copies(text, specs), _cache_copies(text, specs)
    if case == IN_PLACE_CASES[0]:
        assert len(_cache_copies(_compiled_text(write, specs, donate=False), specs)) >= 2

    def fused(kc, vc, k, v, s):
        return api.rope_and_write_kv_cache(k, k, v, kc, vc, s, s, theta=1e4, **_scales(dtype))[1:]

    fused_text = _compiled_text(fused, specs)
    assert "tpu_custom_call" in fused_text, "the compiled program holds no Mosaic kernel"
    assert not _cache_copies(fused_text, specs)


@pytest.mark.cpu_only
def test_row_major_caches_are_written_in_place_where_xla_prefers_another_layout():
    """An fp8 cache of 2 kv heads (Gemma 4 full) defaults to a head-major layout in XLA, which the kernel cannot write
    row by row: it writes it in place by word groups (no copy, the caches aliased) at every token count, a decode
    batch (8) and a prefill chunk (256). A cache created in the row-major layout (major_to_minor (0, 1, 2, 3)) is
    written in place too, row by row, by the plain write and the fused RoPE (these are the v6e deviceless compiles of
    this (model, dtype) body, see COMPILE_CASES)."""

    def write(*a, blocks=None):
        return api.write_kv_cache(*a, **_scales(FP8), blocks=blocks)

    def fused(kc, vc, k, v, s, blocks=None):
        return api.rope_and_write_kv_cache(k, k, v, kc, vc, s, s, theta=1e6, **_scales(FP8), blocks=blocks)[1:]

    for tokens in (8, 256):
        specs = _specs("gemma4_full", FP8, tokens, 64, pages=512)
        for fn in (write, fused):
            text = _compiled_text(fn, specs)
            assert "tpu_custom_call" in text, "the compiled program holds no Mosaic kernel"
            assert re.search(
                r"input_output_alias=\{ \{0\}: \(0, \{\}, may-alias\), \{1\}: \(1, \{\}, may-alias\) \}", text
            )
            assert not _cache_copies(text, specs), (tokens, _cache_copies(text, specs))
    specs = _specs("gemma4_full", FP8, 256, 64, pages=512)
    row_major = KVCacheBlocks(row_major_caches=True)
    for fn in (functools.partial(write, blocks=row_major), functools.partial(fused, blocks=row_major)):
        text = _compiled_text(fn, specs, row_major=True)
        assert "tpu_custom_call" in text, "the compiled program holds no Mosaic kernel"
        assert not _cache_copies(text, specs), _cache_copies(text, specs)
