"""Each public JAX kernel (each pallas_call) inside jax.shard_map with its default checks (check_vma=True), on the
8-device host mesh (conftest), in strict interpret mode: data-parallel over the batch / tokens, heads split for
attention and the KV cache, each equal to its unsharded reference; gradients under shard_map for the kernels with
backward kernels of their own (RMSNorm, the ragged dot, flash attention; a replicated weight's gradient is the sum over
the shards); the expert-parallel experts_forward equal to the one-device result on both paths; and sharded programs
compiled deviceless for v6e:2x4.

One check per kernel: what shard_map checks is each pallas_call's varying-axes declaration, so an entry point that
runs the same pallas_calls as a checked one adds nothing here. Not repeated: flash_attention_varlen (the dense
kernels, its visit list from replicated cu_seqlens like the dense one's constant list), the MoE gradient (the
ragged dot's forward and backward kernels, checked sharded in test_ragged_dot_sharded), the rotary gradient (the
forward's kernel transposed, the tables' gradients summed in XLA as RMSNorm's weight's is), the rotary kernel's
table + norm and positions-only modes (its tables mode and its positions + norm mode are checked), and write_kv_cache
(rope_and_write_kv_cache's pallas_call without the query)."""

import functools

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_kernels_jax import api as tk
from tpu_kernels_jax.flash_attention.reference import attention_reference
from tpu_kernels_jax.kv_cache.reference import rope_and_write_kv_cache_reference
from tpu_kernels_jax.moe.reference import experts_forward_reference
from tpu_kernels_jax.moe.tuning import SMALL_BATCH_MAX_TOKENS
from tpu_kernels_jax.paged_attention.reference import ragged_paged_attention_reference
from tpu_kernels_jax.ragged_dot.reference import ragged_dot_reference
from tpu_kernels_jax.rms_norm.reference import fused_add_rms_norm_reference, rms_norm_reference
from tpu_kernels_jax.rotary.reference import apply_rotary_reference, rms_norm_rope_reference

AXIS = "x"
DEVICES = 8


@functools.cache
def mesh():
    assert len(jax.devices()) >= DEVICES, (
        f"test_sharded.py needs {DEVICES} host CPU devices, this process has {len(jax.devices())}: run it without "
        "TPU_KERNELS_HOST_DEVICES=1 (conftest's default is 8; make test runs this file in a process of its own)"
    )
    return jax.make_mesh((DEVICES,), (AXIS,))


def place(args, specs):
    """args put on the mesh as specs say (shard_map's inputs must carry the shardings of its in_specs)."""
    return [jax.device_put(a, NamedSharding(mesh(), s)) for a, s in zip(args, specs)]


def run_sharded(fn, args, in_specs, out_specs):
    """jit(shard_map(fn)) with the default check_vma=True, in strict interpret mode."""
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh(), in_specs=in_specs, out_specs=out_specs))
    return ladder.run_kernel(mapped, *place(args, in_specs))


def grads_sharded(fn, args, argnums, cotangents, in_specs, cotangent_specs):
    """Inside shard_map: the gradient of <fn(*args), cotangents> per shard w.r.t. args[argnums]; each gradient has
    its argument's sharding (a replicated argument's is summed over the shards by the kernels' VJPs, which
    out_specs P() then asserts: check_vma refuses a value that still varies)."""

    def body(*all_args):
        args, cts = all_args[: len(in_specs)], all_args[len(in_specs) :]
        return jax.grad(lambda *a: ladder.vjp_loss(fn(*a), list(cts)), argnums=argnums)(*args)

    out_specs = tuple(in_specs[i] for i in argnums)
    return run_sharded(body, [*args, *cotangents], (*in_specs, *cotangent_specs), out_specs)


def reference_grads(fn, args, argnums, cotangents):
    return jax.grad(lambda *a: ladder.vjp_loss(fn(*a), cotangents), argnums=argnums)(*args)


def assert_all_close(actual, expected, names, rand, **tolerances):
    for name, a, e in zip(names, actual, expected, strict=True):
        ladder.assert_close(a, e, dtype=e.dtype, what=name, context=repr(rand), **tolerances)


# ------------------------------------------------------------------------------------------------------- rms norm
def test_rms_norm_sharded(rand):
    """Tokens split: the forward, the fused add, and the gradients (d weight summed over the shards)."""
    x, residual = rand.normal((32, 256)), rand.normal((32, 256))
    weight = rand.normal((256,), offset=1.0)
    rows, rep = P(AXIS), P()
    out = run_sharded(tk.rms_norm, [x, weight], (rows, rep), rows)
    ladder.assert_close(out, rms_norm_reference(x, weight), what="rms_norm", context=repr(rand))
    fused = run_sharded(tk.fused_add_rms_norm, [x, residual, weight], (rows, rows, rep), (rows, rows))
    assert_all_close(fused, fused_add_rms_norm_reference(x, residual, weight), ["out", "sum"], rand)

    cts = [rand.normal((32, 256)), rand.normal((32, 256))]
    actual = grads_sharded(tk.fused_add_rms_norm, [x, residual, weight], (0, 1, 2), cts, (rows, rows, rep), (rows,) * 2)
    expected = reference_grads(fused_add_rms_norm_reference, [x, residual, weight], (0, 1, 2), cts)
    assert_all_close(actual, expected, ["d x", "d residual", "d weight"], rand, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------------- ragged dot
def test_ragged_dot_sharded(rand):
    """Tokens split, each shard with its own group sizes over its rows; the weights replicated (d rhs summed)."""
    groups, rows, k, n = 3, 8, 128, 128
    lhs, rhs = rand.normal((DEVICES * rows, k)), rand.normal((groups, k, n), scale=0.1)
    sizes = np.stack([np.bincount(rand.rng.integers(0, groups, rows), minlength=groups) for _ in range(DEVICES)])
    sizes = jnp.asarray(sizes.reshape(-1), jnp.int32)  # [devices * groups]: shard d holds its rows' sizes
    specs = (P(AXIS), P(), P(AXIS))
    out = run_sharded(tk.ragged_dot, [lhs, rhs, sizes], specs, P(AXIS))

    def per_shard_reference(lhs, rhs, sizes):
        parts = zip(jnp.split(lhs, DEVICES), jnp.split(sizes, DEVICES))
        return jnp.concatenate([ragged_dot_reference(part, rhs, s) for part, s in parts])

    ladder.assert_close(out, per_shard_reference(lhs, rhs, sizes), what="ragged_dot", context=repr(rand))
    cts = [rand.normal(out.shape)]
    actual = grads_sharded(tk.ragged_dot, [lhs, rhs, sizes], (0, 1), cts, specs, (P(AXIS),))
    expected = reference_grads(per_shard_reference, [lhs, rhs, sizes], (0, 1), cts)
    assert_all_close(actual, expected, ["d lhs", "d rhs"], rand, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------------- MoE experts
def _moe_inputs(rand, *, tokens, experts=16, top_k=2, hidden=128, intermediate=128):
    index = np.stack([rand.rng.permutation(experts)[:top_k] for _ in range(tokens)])
    return dict(
        hidden_states=rand.normal((tokens, hidden)),
        top_k_index=jnp.asarray(index, jnp.int32),
        top_k_weights=rand.uniform((tokens, top_k), 0.1, 1.0),
        gate_up_proj=rand.normal((experts, 2 * intermediate, hidden), scale=0.1),
        down_proj=rand.normal((experts, hidden, intermediate), scale=0.1),
    )


def test_experts_forward_sharded(rand):
    """Tokens split (data parallel), every expert on every device. (Its gradient runs the ragged dot's kernels.)"""
    inputs = _moe_inputs(rand, tokens=DEVICES, experts=8)
    args = list(inputs.values())
    specs = (P(AXIS), P(AXIS), P(AXIS), P(), P())
    out = run_sharded(tk.experts_forward, args, specs, P(AXIS))
    ladder.assert_close(out, experts_forward_reference(*args), what="experts_forward", context=repr(rand))


def test_expert_parallel_experts_forward(rand):
    """Experts split over the 8 devices (2 each), tokens everywhere: the one-device experts_forward's result, on each
    path: the small-batch kernel (a decode batch's choice) and the grouped path's ragged dots, where each device's
    sentinel rows sort past its experts; each against the one device's run at its table's path (the small-batch kernel
    at 12 tokens) and the reference. The grouped path is forced by blocks at the decode batch: a batch past the
    small-batch limit (over 256 tokens) runs the same code at several times the interpret-mode cost."""
    args = list(_moe_inputs(rand, tokens=12).values())
    specs = (P(), P(), P(), P(AXIS), P(AXIS))
    one_device = ladder.run_kernel(jax.jit(tk.experts_forward), *args)
    expected = experts_forward_reference(*args)
    for path in ladder.MOE_PATHS:
        fn = jax.jit(
            functools.partial(tk.expert_parallel_experts_forward, mesh(), AXIS, blocks=tk.ExpertsBlocks(path=path))
        )
        ladder.assert_moe_path(fn, place(args, specs), path)
        out = ladder.run_kernel(fn, *place(args, specs))
        ladder.assert_close(out, one_device, what=f"expert parallel ({path}) vs one device", context=repr(rand))
        ladder.assert_close(out, expected, what=f"expert parallel ({path})", context=repr(rand))


def test_expert_parallel_checks_the_expert_count(rand):
    args = list(_moe_inputs(rand, tokens=4, experts=12).values())
    with pytest.raises(ValueError, match="gate_up_proj: expected a number of experts divisible by the 8 devices"):
        tk.expert_parallel_experts_forward(mesh(), AXIS, *args)
    with pytest.raises(ValueError, match="axis: expected one of the mesh's axes"):
        tk.expert_parallel_experts_forward(mesh(), "experts", *args)


# ------------------------------------------------------------------------------------------------------- rotary
def test_rotary_sharded(rand):
    """Batch split: the table op with the cos/sin tables shared by the batch ([1, S, D], replicated), and the
    from-positions op with the norm (weights replicated, positions split with the batch)."""
    q, k = rand.normal((DEVICES, 4, 8, 128)), rand.normal((DEVICES, 2, 8, 128))
    cos, sin = rand.normal((1, 8, 128)), rand.normal((1, 8, 128))
    qw, kw = rand.normal((128,), offset=1.0), rand.normal((128,), offset=1.0)
    batch, rep = P(AXIS), P()
    out = run_sharded(tk.apply_rotary, [q, k, cos, sin], (batch, batch, rep, rep), (batch, batch))
    assert_all_close(out, apply_rotary_reference(q, k, cos, sin), ["q", "k"], rand)

    # from positions: the kernel's own tables, against the reference on those tables
    positions = rand.integers(0, 1000, (DEVICES, 8))
    theta = 1e6
    inv_freq = 1.0 / theta ** (np.arange(0, 128, 2, dtype=np.float32) / 128)
    freqs = np.asarray(positions, np.float32)[..., None] * inv_freq
    tables = [jnp.asarray(f(np.concatenate([freqs, freqs], axis=-1))) for f in (np.cos, np.sin)]
    norm_from_positions = functools.partial(tk.rms_norm_rope_from_positions, theta=theta, eps=1e-6)
    out = run_sharded(norm_from_positions, [q, k, qw, kw, positions], (batch, batch, rep, rep, batch), (batch, batch))
    expected = rms_norm_rope_reference(q, k, qw, kw, *tables)
    assert_all_close(out, expected, ["q", "k"], rand, rtol=2e-4, atol=2e-4)


# ------------------------------------------------------------------------------------------------------- attention
def test_flash_attention_sharded(rand):
    """Heads split (16 query heads over 8 kv heads, one kv head per device) with sinks; the gradients of q, k, v
    and the sinks."""
    q, k, v = rand.normal((1, 32, 16, 128)), rand.normal((1, 32, 8, 128)), rand.normal((1, 32, 8, 128))
    sinks = rand.normal((16,))
    heads = P(None, None, AXIS)
    specs = (heads, heads, heads, P(AXIS))
    options = dict(causal=True, window_size=(15, 0))

    def attention(q, k, v, sinks):
        return tk.flash_attention(q, k, v, sinks=sinks, **options)

    def reference(q, k, v, sinks):
        return attention_reference(q, k, v, sinks=sinks, **options)

    out = run_sharded(attention, [q, k, v, sinks], specs, heads)
    ladder.assert_close(out, reference(q, k, v, sinks), what="flash_attention", context=repr(rand))
    cts = [rand.normal(out.shape)]
    actual = grads_sharded(attention, [q, k, v, sinks], (0, 1, 2, 3), cts, specs, (heads,))
    expected = reference_grads(reference, [q, k, v, sinks], (0, 1, 2, 3), cts)
    assert_all_close(actual, expected, ["d q", "d k", "d v", "d sinks"], rand, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------------- KV cache
def _paged_caches(rand, pages, page, heads, d):
    return rand.normal((pages, page, heads, d), jnp.bfloat16), rand.normal((pages, page, heads, d), jnp.bfloat16)


def test_kv_cache_writes_sharded(rand):
    """Heads split: each device rotates its query and key heads and writes its kv heads' rows into its share of the
    caches (slots and positions replicated)."""
    tokens, page, heads, d = 12, 16, 8, 128
    k_cache, v_cache = _paged_caches(rand, 4, page, heads, d)
    key, value = rand.normal((tokens, heads, d), jnp.bfloat16), rand.normal((tokens, heads, d), jnp.bfloat16)
    slots = jnp.asarray(rand.rng.permutation(4 * page)[:tokens], jnp.int32)
    cache_heads, row_heads = P(None, None, AXIS), P(None, AXIS)
    query = rand.normal((tokens, 2 * heads, d), jnp.bfloat16)
    positions = rand.integers(0, 500, (tokens,))
    fused = functools.partial(tk.rope_and_write_kv_cache, theta=1e4)
    specs = (row_heads, row_heads, row_heads, cache_heads, cache_heads, P(), P())
    args = [query, key, value, k_cache, v_cache, slots, positions]
    out = run_sharded(fused, args, specs, (row_heads, cache_heads, cache_heads))
    expected = rope_and_write_kv_cache_reference(*args, theta=1e4)
    assert_all_close(out, expected, ["query", "k cache", "v cache"], rand)


def test_ragged_paged_attention_sharded(rand):
    """A mixed batch (a 3-token prefill chunk and a decode) with heads split over the paged caches; unused cache
    pages poisoned with NaN."""
    page, heads, d = 16, 8, 128
    k_cache, v_cache = _paged_caches(rand, 6, page, heads, d)
    unused = jnp.asarray([4, 5])
    k_cache, v_cache = (c.at[unused].set(jnp.nan) for c in (k_cache, v_cache))
    kv_lens = jnp.asarray([20, 9], jnp.int32)
    page_indices = jnp.asarray([[2, 0], [3, 1]], jnp.int32)
    cu_q_lens = jnp.asarray([0, 3, 4], jnp.int32)
    q = rand.normal((4, 2 * heads, d), jnp.bfloat16)
    cache_heads, rep = P(None, None, AXIS), P()
    specs = (P(None, AXIS), cache_heads, cache_heads, rep, rep, rep)
    args = [q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens]
    out = run_sharded(tk.ragged_paged_attention, args, specs, P(None, AXIS))
    ladder.assert_close(out, ragged_paged_attention_reference(*args), what="ragged_paged_attention", context=repr(rand))


# ------------------------------------------------------------------------------------------------------- rung 3
def test_sharded_program_compiles_for_v6e_2x4():
    """Deviceless compile for a v6e 2x4 slice (8 chips) of one sharded program: a data-parallel RMSNorm (tokens split)
    feeding the expert-parallel experts_forward (Qwen3-30B-A3B's layer at a decode batch: 128 experts, 16 per chip)."""
    mesh_v6e = ladder.tpu_mesh("v6e:2x4", (AXIS,))
    experts, hidden, intermediate, tokens, top_k = 128, 2048, 768, 64, 8
    bf16 = jnp.bfloat16

    def layer(x, norm_weight, top_k_index, top_k_weights, gate_up_proj, down_proj):
        normed = jax.shard_map(tk.rms_norm, mesh=mesh_v6e, in_specs=(P(AXIS), P()), out_specs=P(AXIS))(x, norm_weight)
        normed = jax.lax.with_sharding_constraint(normed, NamedSharding(mesh_v6e, P()))  # every token on every chip
        return tk.expert_parallel_experts_forward(
            mesh_v6e, AXIS, normed, top_k_index, top_k_weights, gate_up_proj, down_proj
        )

    ladder.compile_sharded_for_tpu(
        layer,
        mesh_v6e,
        [
            ((tokens, hidden), bf16, P(AXIS)),
            ((hidden,), bf16, P()),
            ((tokens, top_k), jnp.int32, P()),
            ((tokens, top_k), bf16, P()),
            ((experts, 2 * intermediate, hidden), bf16, P(AXIS)),
            ((experts, hidden, intermediate), bf16, P(AXIS)),
        ],
        label="rms_norm + expert_parallel_experts_forward v6e:2x4",
        min_kernels=2,
    )


def test_attention_and_grouped_experts_program_compiles_for_v6e_2x4():
    """Deviceless compile for a v6e 2x4 slice of one sharded program holding the kernels the RMSNorm + small-batch
    experts program above does not: heads split (one kv head, two query heads a chip), rotary feeding flash attention
    with sinks, forward and backward; the fused rotary + KV cache write feeding ragged paged attention over the
    written caches; and the expert-parallel experts_forward on its grouped path (the ragged dot's grouped matmuls: more
    tokens than v6e's small-batch limit). Small shapes: what is checked is that each kernel lowers and compiles inside
    shard_map for the slice, not its tiling at a model's shapes."""
    mesh_v6e = ladder.tpu_mesh("v6e:2x4", (AXIS,))
    batch, seq, kv_heads, d = 1, 128, DEVICES, 128
    pages, page, tokens = 8, 16, 8
    experts, hidden, intermediate, top_k = 16, 128, 128, 2
    moe_tokens = SMALL_BATCH_MAX_TOKENS["v6e"] + 8
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    heads, rows = P(None, None, AXIS), P(None, AXIS)
    training_specs = (heads, heads, heads, P(AXIS), P(), P(), heads)
    paged_specs = (rows, rows, rows, heads, heads, P(), P(), P(), P(), P())

    def training_attention(q, k, v, sinks, cos, sin, cotangent):
        def loss(q, k, v, sinks):
            q, k = tk.apply_rotary(q, k, cos, sin, layout="bshd")
            out = tk.flash_attention(q, k, v, sinks=sinks, causal=True)
            return jnp.sum(out.astype(f32) * cotangent)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    def paged_decode(query, key, value, k_cache, v_cache, slots, positions, kv_lens, page_indices, cu_q_lens):
        query, k_cache, v_cache = tk.rope_and_write_kv_cache(
            query, key, value, k_cache, v_cache, slots, positions, theta=1e6
        )
        return tk.ragged_paged_attention(query, k_cache, v_cache, kv_lens, page_indices, cu_q_lens)

    def program(*args):
        training, paged, moe = args[:7], args[7:17], args[17:]
        grads = jax.shard_map(training_attention, mesh=mesh_v6e, in_specs=training_specs, out_specs=training_specs[:4])
        decode = jax.shard_map(paged_decode, mesh=mesh_v6e, in_specs=paged_specs, out_specs=rows)
        return grads(*training), decode(*paged), tk.expert_parallel_experts_forward(mesh_v6e, AXIS, *moe)

    q_shape, kv_shape = (batch, seq, 2 * kv_heads, d), (batch, seq, kv_heads, d)
    cache_shape = (pages, page, kv_heads, d)
    ladder.compile_sharded_for_tpu(
        program,
        mesh_v6e,
        [
            # rotary + flash attention, forward and backward
            (q_shape, bf16, heads),
            (kv_shape, bf16, heads),
            (kv_shape, bf16, heads),
            ((2 * kv_heads,), f32, P(AXIS)),
            ((1, seq, d), f32, P()),
            ((1, seq, d), f32, P()),
            (q_shape, f32, heads),
            # rotary + KV cache write, ragged paged attention
            ((tokens, 2 * kv_heads, d), bf16, rows),
            ((tokens, kv_heads, d), bf16, rows),
            ((tokens, kv_heads, d), bf16, rows),
            (cache_shape, bf16, heads),
            (cache_shape, bf16, heads),
            ((tokens,), i32, P()),
            ((tokens,), i32, P()),
            ((tokens,), i32, P()),
            ((tokens, pages), i32, P()),
            ((tokens + 1,), i32, P()),
            # expert-parallel experts_forward, grouped path
            ((moe_tokens, hidden), bf16, P()),
            ((moe_tokens, top_k), i32, P()),
            ((moe_tokens, top_k), bf16, P()),
            ((experts, 2 * intermediate, hidden), bf16, P(AXIS)),
            ((experts, hidden, intermediate), bf16, P(AXIS)),
        ],
        label="rotary + flash attention fwd/bwd, kv cache write + ragged paged attention, grouped experts v6e:2x4",
        # rope, flash_attention_fwd, _delta, _dkv, _dq_sum, rope_bwd, rope_and_write_kv_cache, paged_attention_visits,
        # ragged_paged_attention, and per grouped matmul ragged_dot_metadata + ragged_dot_fwd (the small-batch path
        # would be one kernel)
        min_kernels=13,
    )
