"""The benchmarks' baselines and inputs, checked on the CPU: every baseline of every suite traces at one small shape
it applies to (as for a v5e), megablox's wrapper computes the grouped matmul, a baseline whose package is missing
says so instead of raising, the inputs are made on the device and differ from seed to seed; and, where the
tpu-inference wheel is installed (scripts/tpu_wheels.sh), vLLM's wrappers feed its kernels our cases in its layouts
(checked with the kernel call stood in for by tpu-inference's own reference: its Pallas kernels do not run in jax's
TPU interpret mode, which cannot follow their ref reshapes and bitcasts)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest

from benchmarks import inputs, shapes, suite
from benchmarks.ops import _vllm

SEED_A, SEED_B = 3, 4

# One small shape per suite with baselines, at which every baseline applies (vLLM's when installed).
MOE_DIMS = (("experts", 8), ("top_k", 2), ("hidden", 512), ("intermediate", 256), ("activation", "silu"))
SMALL = {
    "ragged_dot": shapes.Shape("tokens", 64, (("phase", "decode"), ("model", "tiny"), *MOE_DIMS), "bfloat16"),
    "moe": shapes.Shape("tokens", 64, (("phase", "decode"), ("model", "tiny"), *MOE_DIMS), "bfloat16"),
    "paged_attention": shapes.Shape(
        "batch",
        2,
        (
            ("model", "qwen3-30b-a3b"),
            ("phase", "decode"),
            ("context", 256),
            ("page", 16),
            ("q_heads", 4),
            ("kv_heads", 2),
            ("head_dim", 128),
            ("window", -1),
        ),
        "bfloat16",
    ),
    "flash_attention": shapes.Shape(
        "seq",
        1024,
        (
            ("model", "qwen3-30b-a3b"),
            ("mask", "causal"),
            ("layout", "dense"),
            ("q_heads", 4),
            ("kv_heads", 2),
            ("head_dim", 128),
            ("window", -1),
        ),
        "bfloat16",
    ),
    "kv_cache": shapes.Shape(
        "tokens",
        8,
        (("model", "qwen3-30b-a3b"), ("phase", "decode"), ("q_heads", 4), ("kv_heads", 2), ("head_dim", 128)),
        "bfloat16",
    ),
}
# Baselines that apply to another phase than their suite's small shape: (kernel, baseline) -> its shape there.
SMALL_FOR = {
    ("paged_attention", "parts"): shapes.Shape(
        "tokens",
        shapes.PAGED_ATTENTION_MIXED_TOKENS,
        (*((k, v) for k, v in SMALL["paged_attention"].params if k != "phase"), ("phase", "mixed")),
        "bfloat16",
    ),
}
BASELINES = [
    (kernel, op.name, b.name)
    for kernel in sorted(SMALL)
    for op in suite.get(kernel).ops
    for b in op.baselines
    if not (kernel == "flash_attention" and op.name == "backward")  # the backward's vjps trace in test_benchmarks
]
# tpu-inference and tokamax are in the main environment (pyproject.toml: the bench extra, and tpu-inference without
# its dependencies), so every baseline is checked here; a missing one fails with the reason it gives.


def _trace_device():
    from benchmarks import perf_model

    device = perf_model.trace_device("v5e")
    return jax.default_device(device) if device is not None else contextlib.nullcontext()


@pytest.mark.parametrize("kernel, op_name, baseline", BASELINES, ids=["-".join(b) for b in BASELINES])
def test_every_baseline_traces_where_it_applies(kernel, op_name, baseline):
    """Each baseline applies at its suite's small shape (or reports a missing package) and traces there, for a v5e,
    to an output of the shapes the kernel's has."""
    op = next(op for op in suite.get(kernel).ops if op.name == op_name)
    s = SMALL_FOR.get((kernel, baseline), SMALL[kernel])
    why_not = op.impls(s)[suite.BASELINE_PREFIX + baseline]
    assert why_not is None, f"{baseline} does not apply at its small shape: {why_not}"
    args = op.model_args(s) if op.model_args else op.specs(s)
    with _trace_device():
        got = jax.eval_shape(op.function(suite.BASELINE_PREFIX + baseline, s), *args)
        want = jax.eval_shape(op.function("default", s), *args)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(lambda x: (x.shape, x.dtype), want)


def test_megablox_baseline_is_the_grouped_matmul():
    """megablox.gmm on transformers' rhs layout ([E, N, K], transpose_rhs) computes the grouped matmul (the ragged
    dot suite's down projection) in interpret mode, with experts that get no rows and a row tile of all M rows."""
    from benchmarks.ops import ragged_dot
    from tpu_kernels_jax.common.interpret import interpret_on_cpu
    from tpu_kernels_jax.ragged_dot.reference import ragged_dot_reference

    dims = (("experts", 16), ("top_k", 2), ("hidden", 256), ("intermediate", 128), ("activation", "silu"))
    s = shapes.Shape("tokens", 8, (("phase", "decode"), ("model", "tiny"), *dims), "bfloat16")
    op = next(op for op in ragged_dot.SUITE.ops if op.name == "down")
    lhs, rhs, group_sizes = op.arrays(s, SEED_A)
    assert int((group_sizes == 0).sum()) > 0 and int(group_sizes.sum()) == 16  # M = 8 tokens x top 2
    with interpret_on_cpu():
        got = jax.jit(op.function("baseline:megablox", s))(lhs, rhs, group_sizes)
    want = ragged_dot_reference(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, rhs_transposed=True)
    assert got.shape == want.shape == (16, 256) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-2, rtol=1e-2)


def test_a_missing_package_is_a_reason(monkeypatch):
    """Without tpu-inference, vLLM's baselines say "not installed: tpu-inference" (nothing raises), and the MoE
    case's arguments carry no vLLM layouts."""
    from benchmarks.ops import moe, paged_attention

    def forget():
        _vllm._location.cache_clear()
        moe._vllm_unsupported.cache_clear()

    forget()
    monkeypatch.setattr(_vllm, "PACKAGE", "tpu_inference_absent_for_this_test")
    try:
        assert _vllm.missing() == "not installed: tpu-inference"
        with pytest.raises(ImportError, match="not installed: tpu-inference"):
            _vllm.kernel_module("kernels.fused_moe.v1.kernel_absent_for_this_test")
        paged = paged_attention.SUITE.ops[0].impls(SMALL["paged_attention"])
        assert paged["baseline:vllm_rpa"] == "not installed: tpu-inference" and paged["baseline:jax_rpa"] is None
        op = moe.SUITE.ops[0]
        assert op.impls(SMALL["moe"])["baseline:vllm"] == "not installed: tpu-inference"
        assert not any(isinstance(x, dict) for x in op.specs(SMALL["moe"]))
    finally:
        monkeypatch.undo()
        forget()


@pytest.mark.cpu_only
def test_jax_ragged_paged_attention_gets_the_scoped_vmem_our_kernels_may_take():
    """JAX's ragged paged attention at Qwen3's pages of 64 (B = 64, context 4096: a quick shape) ran out of VMEM at its
    default scoped limit on the v5e with its tuned blocks; given the ceiling our kernels may ask for, it compiles
    (deviceless, v5e) and the column has a figure to compare with."""
    from benchmarks.ops import paged_attention

    shape = next(
        s
        for s in paged_attention.SUITE.quick_shapes
        if s["model"] == "qwen3-30b-a3b" and s.batch == 64 and s["page"] == 64 and s.dtype == "bfloat16"
    )
    op = paged_attention.SUITE.ops[0]
    args = op.model_args(shape)  # concrete page tables and lengths, made on this host
    with jax.default_device(ladder.tpu_device("v5e")):
        assert paged_attention._scoped_vmem_ceiling() == 96 << 20
        jax.jit(op.function("baseline:jax_rpa", shape)).lower(*args).compile()  # raised CompileTimeScopedVmemOom


@pytest.mark.cpu_only
def test_jax_ragged_paged_attention_default_blocks_are_capped_where_its_table_has_none():
    """Where JAX's tuned table has no entry (here: the CPU's kind), its default of 128 pages a block is capped to
    RPA_DEFAULT_BLOCK_KEY_ELEMENTS keys x head dim: Gemma 4's full layers (head dim 512) take 32 pages of 64 (at 64,
    one compile took minutes), Qwen3's (head dim 128) all 64 of a 4096-token sequence, as JAX's default gives."""
    from benchmarks.ops import paged_attention as pa_ops

    def blocks(head_dim, q_heads, kv_heads, dtype):
        q = jax.ShapeDtypeStruct((8, q_heads, head_dim), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((600, 64, 2 * kv_heads, head_dim), dtype)
        return pa_ops._rpa_blocks(q, pages, jax.ShapeDtypeStruct((8, 64), jnp.int32))

    assert blocks(512, 16, 2, jnp.float8_e4m3fn) == (32, 8)
    assert blocks(128, 32, 4, jnp.float8_e4m3fn) == (64, 8)
    assert blocks(256, 16, 8, jnp.bfloat16) == (64, 8)


def test_large_inputs_are_drawn_in_chunks_whose_bits_bound_the_temporaries(monkeypatch):
    """An array of more than inputs.CHUNK_ELEMENTS is drawn in chunks of leading rows, each with a key of its own (the
    rbg PRNG's bits are written out whole: a 1.5 GiB bf16 cache held 3 GiB of temporaries compiled for the v5e, and the
    paged attention suite's largest inputs failed to allocate on the chip). Here with small chunks: the values are
    the seed's, the chunks differ, and rows that divide no chunk evenly (a prime count) are drawn a row at a time;
    deviceless for the v5e, a 1.5 GiB array's temporaries stay within a chunk's bits."""
    monkeypatch.setattr(inputs, "CHUNK_ELEMENTS", 1024)
    inputs._normal.clear_cache()
    try:
        a = np.asarray(inputs.normal(SEED_A, (64, 4, 128), jnp.float32))  # 32768 elements: 32 chunks of 2 rows
        assert a.shape == (64, 4, 128) and np.array_equal(a, np.asarray(inputs.normal(SEED_A, (64, 4, 128))))
        assert not np.array_equal(a[:2], a[2:4])
        assert abs(float(a.std()) - 1.0) < 0.05
        odd = np.asarray(inputs.uniform(SEED_B, (13, 3, 512), -1.0, 1.0))  # 13 rows of 1536 elements: one a chunk
        assert odd.shape == (13, 3, 512) and -1.0 <= odd.min() and odd.max() < 1.0
        assert not np.array_equal(odd[0], odd[1])
    finally:
        inputs._normal.clear_cache()
        inputs._uniform.clear_cache()
    monkeypatch.undo()
    with jax.default_device(ladder.tpu_device("v5e")):
        compiled = jax.jit(lambda: inputs.normal(SEED_A, (12288, 64, 8, 128), jnp.bfloat16)).lower().compile()
    memory = compiled.memory_analysis()
    assert memory.output_size_in_bytes == 12288 * 64 * 8 * 128 * 2
    # a chunk's u32 bits (and the loop's keys): not the array's (3 GiB unchunked)
    assert memory.temp_size_in_bytes <= inputs.CHUNK_ELEMENTS * 4 + (1 << 20), memory.temp_size_in_bytes


def test_inputs_are_made_on_the_device_and_follow_the_seed():
    a = inputs.normal(SEED_A, (64, 128), jnp.bfloat16)
    assert isinstance(a, jax.Array) and a.dtype == jnp.bfloat16 and a.shape == (64, 128)
    assert bool((a == inputs.normal(SEED_A, (64, 128), jnp.bfloat16)).all())
    assert not bool((a == inputs.normal(SEED_B, (64, 128), jnp.bfloat16)).all())
    assert float(jnp.abs(a.astype(jnp.float32)).mean()) == pytest.approx(0.8, abs=0.1)  # |N(0, 1)|: not zeros
    k1, k2 = inputs.keys(SEED_A, 2)
    assert not bool((inputs.normal(k1, (8,)) == inputs.normal(k2, (8,))).all())
    scaled = inputs.normal(SEED_A, (64, 128), jnp.float32, scale=0.25)
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(inputs.normal(SEED_A, (64, 128))) * 0.25, rtol=1e-6)
    ints = np.asarray(inputs.integers(SEED_A, (4096,), -100, 101, jnp.int8))
    assert ints.dtype == np.int8 and ints.min() == -100 and ints.max() == 100
    u = np.asarray(inputs.uniform(SEED_A, (4096,), 0.5, 1.5))
    assert 0.5 <= u.min() < 0.51 and 1.49 < u.max() < 1.5


@pytest.mark.parametrize("kernel", ["ragged_dot", "moe", "paged_attention", "kv_cache"])
def test_case_arrays_are_device_arrays_that_follow_the_seed(kernel):
    """Each op's concrete inputs at its small shape: jax arrays (never numpy), laid out as its specs say, the same
    for the same seed, the large floating ones new with each seed (the routing and what follows it is fixed by
    design: its seed is the routing's own)."""
    s = SMALL[kernel]
    for op in suite.get(kernel).ops:
        a, b, again = (op.arrays(s, seed) for seed in (SEED_A, SEED_B, SEED_A))
        leaves = jax.tree.leaves(a)
        assert all(isinstance(x, jax.Array) for x in leaves)
        specs = jax.tree.leaves(op.specs(s))
        assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype) for x in specs]
        for x, y, z in zip(leaves, jax.tree.leaves(b), jax.tree.leaves(again)):
            assert bool((x == z).all())
            if jnp.issubdtype(x.dtype, jnp.floating) and x.size >= 1024:
                assert not bool((x == y).all())


def test_vllm_cache_is_the_interleaved_bytes():
    """vLLM's RPA v3 cache holds JAX's interleaved layout's bytes (each kv head's K, then its V), in groups of 32
    bits: 2 bf16 or 4 fp8 values."""
    from benchmarks.ops import paged_attention

    for dtype, packing in ((jnp.bfloat16, 2), (jnp.float8_e4m3fn, 4)):
        k, v = (inputs.normal(seed, (3, 16, 4, 128), dtype) for seed in (SEED_A, SEED_B))
        cache = paged_attention.to_vllm_cache(k, v)
        assert cache.shape == (3, 16, 8 // packing, packing, 128) and cache.dtype == dtype
        assert bool((cache.reshape(-1) == paged_attention.to_interleaved(k, v).reshape(-1)).all())
        assert bool((cache.reshape(3, 16, 8, 128)[:, :, 2] == k[:, :, 1]).all())  # kv head 1's K ...
        assert bool((cache.reshape(3, 16, 8, 128)[:, :, 3] == v[:, :, 1]).all())  # ... then its V


def _ragged_step(rand, fields):
    """A paged attention suite Config (4 / 2 heads x 128, pages of 16, 4 a sequence; `fields` over it) and a step over
    it: q, random flash-layout caches, shuffled page tables, kv_lens, cu_q_lens."""
    from benchmarks.ops import paged_attention

    base = dict(page_size=16, pages_per_seq=4, q_heads=4, kv_heads=2, head_dim=128, scale=None, window=-1)
    cfg = paged_attention.Config(**{**base, "cache_dtype": "bfloat16", **fields})
    n = len(cfg.q_lens)
    dtype = jnp.dtype(cfg.cache_dtype)
    k, v = (rand.normal((cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)).astype(dtype) for _ in range(2))
    q = rand.normal((cfg.tokens, cfg.q_heads, cfg.head_dim), jnp.bfloat16)
    pages = jnp.asarray(rand.rng.permutation(cfg.num_pages)[: n * cfg.pages_per_seq].reshape(n, -1), jnp.int32)
    kv_lens = jnp.asarray(cfg.contexts, jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(cfg.q_lens)]), jnp.int32)
    return cfg, q, k, v, pages, kv_lens, cu


@pytest.mark.parametrize(
    "options",
    [{}, {"window": 20, "cache_dtype": "float8_e4m3fn", "scale": 1.0}],
    ids=["causal", "window_fp8"],
)
def test_vllm_rpa_wrapper_reads_our_cache_in_its_layout(rand, monkeypatch, options):
    """vllm_rpa_on_cache on flash-attn caches converted to vLLM's layout computes our reference, on a ragged batch of
    shuffled pages (decodes first, then prefill chunks), with the kernel call stood in for by tpu-inference's
    reference: its cache layout, its distribution, page table, scale, window and fp8 scales as the wrapper passes
    them. The stand-in writes the step's new K/V (from our caches) into its cache as the kernel would with
    update_kv_cache; the wrapper asks for none, and reading the same values back is a no-op."""
    from benchmarks.ops import paged_attention

    rpa = _vllm.kernel_module(paged_attention.VLLM_RPA)
    cfg, q, k, v, pages, kv_lens, cu = _ragged_step(
        rand, dict(q_lens=(1, 1, 1, 7, 16), contexts=(40, 17, 33, 64, 30), num_pages=24, **options)
    )
    # the step's new K/V rows as they lie in our caches: token t of sequence i at position kv_len - q_len + t
    slots = [
        int(pages[i, p // cfg.page_size]) * cfg.page_size + p % cfg.page_size
        for i, (q_len, kv_len) in enumerate(zip(cfg.q_lens, cfg.contexts))
        for p in range(kv_len - q_len, kv_len)
    ]
    new_k, new_v = (c.reshape(-1, cfg.kv_heads, cfg.head_dim)[jnp.asarray(slots)] for c in (k, v))
    calls = []

    def kernel_stand_in(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, **options):
        calls.append(options)
        assert options.pop("update_kv_cache") is False and options.pop("vmem_limit_bytes") > 0
        assert keys.shape == new_k.shape and keys.dtype == kv_cache.dtype
        out, _ = rpa.ref_ragged_paged_attention(
            queries, new_k, new_v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, **options
        )
        return out, kv_cache

    monkeypatch.setattr(rpa, "ragged_paged_attention", kernel_stand_in)
    got = paged_attention.vllm_rpa_on_cache(q, paged_attention.to_vllm_cache(k, v), kv_lens, pages, cu, cfg=cfg)
    assert len(calls) == 1
    want = paged_attention.reference_attention(q, k, v, kv_lens, pages, cu, cfg=cfg)
    assert got.shape == want.shape and bool(jnp.isfinite(got.astype(jnp.float32)).all())
    # tpu-inference's reference rounds the scores to bf16 and the probabilities to the cache dtype (fp8: 3 mantissa
    # bits), ours keeps them in f32: ~0.007 apart on average with an fp8 cache (outputs ~0.3); K and V swapped, 0.46
    error = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert error.max() < 0.25 and error.mean() < 0.03, (error.max(), error.mean())


@pytest.mark.parametrize("options", [{}, {"window": 24, "cache_dtype": "float8_e4m3fn"}], ids=["causal", "window_fp8"])
def test_parts_baseline_is_the_mixed_step_in_two_calls(rand, options):
    """The paged attention suite's parts baseline (the decodes through ragged_paged_attention, the prefill chunks
    through flash_attention_varlen over their contexts laid out contiguously) computes the mixed step's reference, on
    shuffled pages; a decode batch has no prefill part."""
    from benchmarks.ops import paged_attention

    cfg, q, k, v, pages, kv_lens, cu = _ragged_step(
        rand, dict(q_lens=(1, 1, 7, 16), contexts=(40, 17, 64, 30), num_pages=20, **options)
    )
    n = len(cfg.q_lens)
    contiguous = tuple(paged_attention._contiguous(x, pages, cfg) for x in (k, v))
    assert contiguous[0].shape == (64 + 30, 2, 128)
    caches = {"flash": (k, v), "contiguous": contiguous}
    parts = jax.jit(functools.partial(paged_attention.parts_attention, cfg=cfg))
    got = ladder.run_kernel(parts, q, caches, kv_lens, pages, cu, jnp.asarray([n], jnp.int32))
    want = paged_attention.reference_attention(q, k, v, kv_lens, pages, cu, cfg=cfg)
    ladder.assert_close(got, want, dtype=jnp.bfloat16, what="parts", context=repr(rand))
    decode = paged_attention.Config(**dict(cfg.__dict__, q_lens=(1,) * n))
    assert paged_attention._parts_problem(decode) == "a decode batch has no prefill part"


@pytest.mark.parametrize(
    "tokens, hidden, intermediate, activation, gate_layout",
    [(3, 384, 128, "silu", "concatenated"), (4, 512, 256, "clamped_swiglu", "interleaved")],
    ids=["odd-padded-silu", "gpt-oss-gating"],
)
def test_vllm_fused_moe_wrapper_takes_our_weights_and_routing(
    monkeypatch, tokens, hidden, intermediate, activation, gate_layout
):
    """vllm_fused_experts on the case's arrays (weights converted to vLLM's w1 / w2, padded to 256; the routing as
    logits) computes the dense masked MoE (our reference's function), with the kernel stood in for by
    tpu-inference's reference (its top-k of the logits' softmax, its activations, its gate / up halves of w1): an odd
    token count (padded with the last token's routing) and hidden / intermediate sizes vLLM pads."""
    from benchmarks.ops import moe

    fused = _vllm.kernel_module(moe.VLLM_MOE)
    dims = (("experts", 8), ("top_k", 2), ("hidden", hidden), ("intermediate", intermediate))
    s = shapes.Shape(
        "tokens",
        tokens,
        (("phase", "decode"), ("model", "tiny"), *dims, ("activation", activation), ("gate_layout", gate_layout)),
        "bfloat16",
    )
    assert moe._vllm_unsupported(s) is None
    args = moe._case_arrays(s, SEED_A)
    w1, w2, logits = args[-1]["vllm"]
    assert w1.shape == (8, 2, 512, 256) and w2.shape == (8, 256, 512) and logits.shape == (tokens, 8)

    def kernel_stand_in(mesh, x, w1, w2, gating, top_k, *, act_fn):
        assert mesh.devices.size == 1 and x.shape[0] % moe.VLLM_TOKEN_PACKING == 0
        return fused.ref_moe(x, w1, w2, gating, top_k, act_fn=act_fn)

    monkeypatch.setattr(fused, "fused_ep_moe", kernel_stand_in)
    got = moe.vllm_fused_experts(*args, activation=activation, gate_layout=gate_layout)
    want = moe.dense_masked_experts(*args[:-1], activation=activation, gate_layout=gate_layout)
    assert got.shape == want.shape == (tokens, hidden)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
    assert float(jnp.abs(want.astype(jnp.float32)).max()) > 0


def test_vllm_column_drops_nothing_the_others_need():
    """The MoE suite's columns other than vLLM's take the case's arguments with vLLM's layouts at the end and call
    their function without them."""
    from benchmarks.ops import moe

    seen = []
    column = functools.partial(moe._column, lambda *args, **kw: seen.append((len(args), kw)))
    column(1, 2, 3, 4, 5, {"vllm": ()}, activation="silu")
    column(1, 2, 3, 4, 5, 6, 7, activation="silu")
    assert seen == [(5, {"activation": "silu"}), (7, {"activation": "silu"})]
