"""MoE experts_forward, JAX side, up the ladder: both kernel paths — grouped (route, gate/up grouped matmul with the
fused epilogue, down grouped matmul, weighted combine) and small-batch (touched experts over all tokens in one
kernel) — vs the dense masked reference in strict interpret mode (both weight layouts,
gated concatenated / interleaved and ungated experts, biases, expert-parallel sentinels, T in {1, 7, 64}, bf16 and
f32); gradients; bad input; TPU export; deviceless compile of the whole experts_forward (v6e: every decode benchmark
shape; v5e and v7x: the quick benchmark set) (its backward is exported here and the grouped matmul backward compiled in
test_ragged_dot.py). The torch side (transformers' experts interface, tiny models) is
tests/test_moe_torch.py."""

import functools

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest

from benchmarks.shapes import MOE_EXPERTS, MOE_MODELS, MOE_TOP_K, RAGGED_DOT_DECODE_TOKENS
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.moe import api, touched
from tpu_kernels_jax.moe import tuning as moe_tuning
from tpu_kernels_jax.moe.reference import experts_forward_reference

F32, BF16 = jnp.float32, jnp.bfloat16


def routing(rand, tokens, experts, top_k, *, sentinels=0):
    """top_k distinct experts per token (uniform), positive weights; `sentinels` random slots get ids >= experts
    (expert-parallel "not on this shard"), including every slot of the first token when there are any."""
    index = np.argsort(rand.rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    if sentinels:
        flat = index.reshape(-1)
        slots = rand.rng.choice(flat.size, size=min(sentinels, flat.size), replace=False)
        flat[slots] = experts + rand.rng.integers(0, 3, slots.size)
        index[0] = experts
    weights = rand.rng.random((tokens, top_k)).astype(np.float32) + 0.1
    return jnp.asarray(index), jnp.asarray(weights / weights.sum(axis=1, keepdims=True))


def weights(rand, experts, hidden, intermediate, *, gated, transposed, bias, dtype):
    """transformers' layout [E, 2I, H] / [E, H, I] (applied as x @ W.T), or [E, H, 2I] / [E, I, H] transposed."""
    up = 2 * intermediate if gated else intermediate
    gate_up = rand.normal((experts, hidden, up) if transposed else (experts, up, hidden), dtype, scale=0.1)
    down = rand.normal(
        (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate), dtype, scale=0.1
    )
    gate_up_bias = rand.normal((experts, up), dtype, scale=0.5) if bias else None
    down_bias = rand.normal((experts, hidden), dtype, scale=0.5) if bias else None
    return gate_up, down, gate_up_bias, down_bias


# (id, T, E, k, H, I, dtype, gate_layout, weights_transposed, biases, activation, sentinel slots)
CASES = [
    ("t1-concat-silu-bf16", 1, 8, 2, 128, 128, BF16, "concatenated", False, False, "silu", 0),
    ("t7-concat-gelu-bias-f32-transposed", 7, 6, 3, 128, 128, F32, "concatenated", True, True, "gelu_tanh", 0),
    ("t64-concat-silu-bias-bf16-sentinels", 64, 16, 4, 256, 128, BF16, "concatenated", False, True, "silu", 40),
    ("t7-interleaved-silu-bias-f32", 7, 6, 2, 128, 128, F32, "interleaved", False, True, "silu", 3),
    ("t64-interleaved-gelu-bf16-transposed", 64, 8, 2, 128, 128, BF16, "interleaved", True, False, "gelu_tanh", 0),
    ("t7-ungated-gelu-bias-bf16-transposed", 7, 5, 2, 128, 256, BF16, None, True, True, "gelu_tanh", 2),
    ("t7-concat-i96-unfused-f32-transposed", 7, 4, 2, 128, 96, F32, "concatenated", True, False, "silu", 0),
    # down_proj [E, 256, 96] is stored as [E, 96, 256] (96 pads the lanes): both paths read it that way round.
    ("t5-concat-i96-stored-swapped-bf16", 5, 6, 2, 256, 96, BF16, "concatenated", False, False, "gelu_tanh", 0),
]
F32_TOL = dict(rtol=1e-5, atol=5e-5)


def _case_args(rand, case):
    _, tokens, experts, top_k, hidden, inter, dtype, layout, transposed, bias, activation, sentinels = case
    x = rand.normal((tokens, hidden), dtype)
    index, w = routing(rand, tokens, experts, top_k, sentinels=sentinels)
    gate_up, down, gate_up_bias, down_bias = weights(
        rand, experts, hidden, inter, gated=layout is not None, transposed=transposed, bias=bias, dtype=dtype
    )
    kw = dict(activation=activation, gate_layout=layout, weights_transposed=transposed)
    return (x, index, w.astype(dtype), gate_up, down, gate_up_bias, down_bias), kw


# The small-batch kernel does not take an interleaved gate/up: it runs the grouped path whatever the batch. (The
# 96-wide intermediate, unfused on the grouped path, is fine here: its gate_up is stored with I on the sublanes.)
GROUPED_ONLY = {"t7-interleaved-silu-bias-f32", "t64-interleaved-gelu-bf16-transposed"}
SMALL_BATCH_KERNEL, GROUPED_KERNEL = "moe_experts_small_batch", "ragged_dot_fwd"


def assert_path(fn, args, path):
    """The traced program holds the kernels of `path` and not the other's."""
    text = str(jax.make_jaxpr(fn)(*args))
    want, other = (
        (SMALL_BATCH_KERNEL, GROUPED_KERNEL) if path == "small_batch" else (GROUPED_KERNEL, SMALL_BATCH_KERNEL)
    )
    assert want in text and other not in text, f"expected the {path} path ({want}, no {other})"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_experts_forward_matches_reference(rand, case, moe_path):
    args, kw = _case_args(rand, case)
    dtype = case[6]
    fn = functools.partial(tk.experts_forward, **kw)
    assert_path(fn, args, "grouped" if case[0] in GROUPED_ONLY else moe_path)
    out = ladder.check_against_reference(
        jax.jit(fn),
        jax.jit(functools.partial(experts_forward_reference, **kw)),
        args,
        dtype=dtype,
        rand=rand,
        **(F32_TOL if dtype == F32 else {}),
    )
    assert out.shape == args[0].shape and out.dtype == dtype


@pytest.mark.parametrize(
    "tokens,experts,top_k,sentinels",
    [(1, 8, 2, 0), (1, 128, 8, 0), (7, 8, 8, 5), (64, 160, 8, 100), (256, 128, 8, 300), (3, 6, 2, 6)],
)
def test_touched_experts(rand, tokens, experts, top_k, sentinels):
    """The small-batch kernel's visit list: the distinct valid ids ascending, zeros after; sentinels skipped (the
    last case makes every id a sentinel: count 0)."""
    index, _ = routing(rand, tokens, experts, top_k, sentinels=sentinels)
    listed, count = ladder.run_interpreted(functools.partial(touched.touched_experts, num_experts=experts), index)
    expected = touched.touched_experts_reference(index, experts)
    listed, count = np.asarray(listed), int(count)
    assert listed.shape == (experts,) and count == len(expected), (count, expected)
    assert listed[:count].tolist() == expected
    assert (listed[count:] == 0).all()


def test_path_choice():
    """Decode batches take the small-batch kernel; larger batches, and more experts than its touched-expert list
    handles, the grouped matmuls (traced only)."""
    spec = jax.ShapeDtypeStruct

    def args(tokens, experts):
        return (
            spec((tokens, 128), BF16),
            spec((tokens, 8), jnp.int32),
            spec((tokens, 8), BF16),
            spec((experts, 256, 128), BF16),
            spec((experts, 128, 128), BF16),
        )

    limit = moe_tuning.SMALL_BATCH_MAX_TOKENS["v6e"]
    assert_path(api.experts_forward, args(1, 128), "small_batch")
    assert_path(api.experts_forward, args(limit, 128), "small_batch")
    assert_path(api.experts_forward, args(limit + 1, 128), "grouped")
    assert_path(api.experts_forward, args(4, moe_tuning.SMALL_BATCH_MAX_EXPERTS + 1), "grouped")


@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_touched_experts_compiles_for_tpu(generation):
    for tokens, experts in ((1, 128), (256, 128), (16, 160), (64, 512), (256, moe_tuning.SMALL_BATCH_MAX_EXPERTS)):
        ladder.compile_for_tpu(
            touched.touched_experts,
            generation,
            ((tokens, 8), jnp.int32),
            label=f"touched_experts E={experts}",
            num_experts=experts,
        )


def test_mixed_weight_dtypes(rand, moe_path):
    """bf16 activations and gate/up weights with an f32 down_proj: each matmul runs in its operands' promoted dtype."""
    x = rand.normal((6, 128), BF16)
    index, w = routing(rand, 6, 8, 2)
    gate_up, _, _, _ = weights(rand, 8, 128, 128, gated=True, transposed=False, bias=False, dtype=BF16)
    _, down, _, _ = weights(rand, 8, 128, 128, gated=True, transposed=False, bias=False, dtype=F32)
    args = (x, index, w.astype(BF16), gate_up, down, None, None)
    fn = functools.partial(tk.experts_forward, activation="silu")
    assert_path(fn, args, moe_path)
    reference = functools.partial(experts_forward_reference, activation="silu")
    ladder.check_against_reference(jax.jit(fn), jax.jit(reference), args, dtype=BF16, rand=rand)


def test_sentinels_contribute_nothing(rand, moe_path):
    """Replacing some routing ids by sentinels (>= E) gives the result of dropping those slots (weight zero)."""
    args, kw = _case_args(rand, CASES[1])
    x, index, w, gate_up, down, gate_up_bias, down_bias = args
    experts = gate_up.shape[0]
    drop = jnp.asarray(rand.rng.random(index.shape) < 0.4)
    with_sentinels = jnp.where(drop, experts + 5, index)
    without = jnp.where(drop, 0.0, w)  # same expert ids, the dropped slots weighted zero
    fn = jax.jit(functools.partial(tk.experts_forward, **kw))
    out_sentinel = ladder.run_interpreted(fn, x, with_sentinels, w, gate_up, down, gate_up_bias, down_bias)
    out_zero_weight = ladder.run_interpreted(fn, x, index, without, gate_up, down, gate_up_bias, down_bias)
    ladder.assert_close(out_sentinel, out_zero_weight, dtype=F32, **F32_TOL, context=repr(rand))


def test_every_slot_a_sentinel_gives_zeros(rand, moe_path):
    """A shard that holds none of the routed experts: the output is exactly zero, biases included."""
    args, kw = _case_args(rand, CASES[1])
    x, index, w, gate_up, down, gate_up_bias, down_bias = args
    sentinels = jnp.full_like(index, gate_up.shape[0]) + jnp.asarray(rand.rng.integers(0, 5, index.shape), jnp.int32)
    fn = jax.jit(functools.partial(tk.experts_forward, **kw))
    out = ladder.run_interpreted(fn, x, sentinels, w, gate_up, down, gate_up_bias, down_bias)
    assert out.shape == x.shape and bool(jnp.all(out == 0)), "sentinel-only routing produced nonzero output"


def test_no_tokens(rand):
    x = rand.normal((0, 128), BF16)
    index, w = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), BF16)
    gate_up, down, _, _ = weights(rand, 4, 128, 128, gated=True, transposed=False, bias=False, dtype=BF16)
    out = ladder.run_interpreted(tk.experts_forward, x, index, w, gate_up, down)
    assert out.shape == (0, 128) and out.dtype == BF16


# ------------------------------------------------------------------------------------------------ gradients
GRAD_CASES = [CASES[1], CASES[5]]  # f32 concatenated + biases; bf16 ungated + biases + sentinels


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_experts_forward_gradients(rand, case, moe_path):
    """d hidden_states, d top_k_weights, d gate_up_proj, d down_proj (and d biases) vs jax.grad of the reference."""
    args, kw = _case_args(rand, case)
    dtype = case[6]
    has_bias = args[5] is not None
    argnums = (0, 2, 3, 4, 5, 6) if has_bias else (0, 2, 3, 4)
    cotangent = rand.normal(args[0].shape)
    kernel_grad = jax.grad(lambda *a: ladder.vjp_loss(tk.experts_forward(*a[:-1], **kw), a[-1]), argnums=argnums)
    ref_grad = jax.grad(lambda *a: ladder.vjp_loss(experts_forward_reference(*a[:-1], **kw), a[-1]), argnums=argnums)
    actual = ladder.run_interpreted(jax.jit(kernel_grad), *args, cotangent)
    expected = jax.jit(ref_grad)(*args, cotangent)
    names = ["d hidden_states", "d top_k_weights", "d gate_up_proj", "d down_proj", "d gate_up_bias", "d down_bias"]
    # bf16: the reference rounds the intermediate once as the kernel does, but its backward stays in f32 where the
    # kernel's rounds each grouped matmul's result to bf16; weight gradients sum over tokens.
    tol = dict(rtol=3e-2, atol=5e-2) if dtype == BF16 else dict(rtol=1e-4, atol=1e-4)
    for what, a, e in zip(names, actual, expected):
        assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
        ladder.assert_close(a, e, dtype=dtype, what=what, context=repr(rand), **tol)


# ------------------------------------------------------------------------------------------------ bad input
def _good(rand):
    gate_up, down, gate_up_bias, down_bias = weights(
        rand, 4, 128, 64, gated=True, transposed=False, bias=True, dtype=F32
    )
    index, w = routing(rand, 5, 4, 2)
    return dict(
        hidden_states=rand.normal((5, 128)),
        top_k_index=index,
        top_k_weights=w,
        gate_up_proj=gate_up,
        down_proj=down,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
    )


BAD_INPUTS = [
    (
        "negative routing id",
        dict(top_k_index=jnp.asarray([[0, 1], [2, -1], [0, 3], [1, 2], [3, 0]], jnp.int32)),
        ValueError,
        "top_k_index: expected expert ids >= 0 (ids >= num_experts = 4 are expert-parallel sentinels), "
        "got top_k_index[1, 1] = -1",
    ),
    ("routing ids float", dict(top_k_index=jnp.zeros((5, 2))), TypeError, "top_k_index: expected dtype"),
    (
        "routing ids int64",
        dict(top_k_index=np.zeros((5, 2), np.int64)),
        TypeError,
        "top_k_index: expected dtype in (int32), got int64",
    ),
    (
        "routing shapes differ",
        dict(top_k_weights=jnp.ones((5, 3))),
        ValueError,
        "top_k_index / top_k_weights: expected the same shape [T=5, k]",
    ),
    (
        "routing tokens",
        dict(top_k_index=jnp.zeros((4, 2), jnp.int32), top_k_weights=jnp.ones((4, 2))),
        ValueError,
        "top_k_index / top_k_weights: expected the same shape [T=5, k]",
    ),
    (
        "hidden_states int",
        dict(hidden_states=jnp.zeros((5, 128), jnp.int32)),
        TypeError,
        "hidden_states: expected dtype",
    ),
    (
        "hidden_states rank",
        dict(hidden_states=jnp.zeros((1, 5, 128))),
        ValueError,
        "hidden_states: expected 2 dimensions",
    ),
    ("top_k_weights int", dict(top_k_weights=jnp.ones((5, 2), jnp.int32)), TypeError, "top_k_weights: expected dtype"),
    (
        "gate_up_proj hidden",
        dict(gate_up_proj=jnp.zeros((4, 128, 96))),
        ValueError,
        "gate_up_proj: expected layout [E, N, H] with H = 128 (hidden_states' size), got shape (4, 128, 96)",
    ),
    ("gate_up_proj rank", dict(gate_up_proj=jnp.zeros((128, 128))), ValueError, "gate_up_proj: expected 3 dimensions"),
    (
        "gate_up_proj odd",
        dict(gate_up_proj=jnp.zeros((4, 127, 128))),
        ValueError,
        "gate_up_proj: a gated layout needs an even 2*I, got 127",
    ),
    (
        "down_proj shape",
        dict(down_proj=jnp.zeros((4, 128, 32))),
        ValueError,
        "down_proj: expected shape (4, 128, 64), got (4, 128, 32)",
    ),
    (
        "down_proj experts",
        dict(down_proj=jnp.zeros((3, 128, 64))),
        ValueError,
        "down_proj: expected shape (4, 128, 64)",
    ),
    ("down_proj int", dict(down_proj=jnp.zeros((4, 128, 64), jnp.int32)), TypeError, "down_proj: expected dtype"),
    (
        "gate_up_bias shape",
        dict(gate_up_bias=jnp.zeros((4, 64))),
        ValueError,
        "gate_up_bias: expected shape (4, 128), got (4, 64)",
    ),
    ("down_bias shape", dict(down_bias=jnp.zeros((5, 128))), ValueError, "down_bias: expected shape (4, 128)"),
    ("activation", dict(activation="relu"), ValueError, "activation: expected one of ('silu', 'gelu_tanh')"),
    ("gate_layout", dict(gate_layout="stacked"), ValueError, "gate_layout: expected one of"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_clear_error(rand, case):
    _, changes, error, message = case
    args = _good(rand)
    kw = {name: changes.pop(name) for name in ("activation", "gate_layout") if name in changes}
    args.update(changes)
    with pytest.raises(error) as info:
        tk.experts_forward(**args, **kw)
    assert message in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------------ rung 2
def _decode_specs(model, tokens, dtype=BF16):
    dims = MOE_MODELS[model]
    h, i = dims["hidden"], dims["intermediate"]
    return [
        ((tokens, h), dtype),
        ((tokens, MOE_TOP_K), jnp.int32),
        ((tokens, MOE_TOP_K), dtype),
        ((MOE_EXPERTS, 2 * i, h), dtype),
        ((MOE_EXPERTS, h, i), dtype),
    ]


def test_export_for_tpu():
    spec = jax.ShapeDtypeStruct
    args = [spec(*sd) for sd in _decode_specs("qwen3-30b-a3b", 64)]
    ladder.export_for_tpu(api.experts_forward, *args, activation="silu")
    ladder.export_for_tpu(api.experts_forward, *args, activation="gelu_tanh", gate_layout="interleaved")
    biases = (spec((MOE_EXPERTS, 2 * 768), BF16), spec((MOE_EXPERTS, 2048), BF16))
    ladder.export_for_tpu(api.experts_forward, *args, *biases, activation="silu")
    grad = jax.grad(lambda *a: ladder.vjp_loss(api.experts_forward(*a, activation="silu")), argnums=(0, 2, 3, 4))
    ladder.export_for_tpu(grad, *args)


# ------------------------------------------------------------------------------------------------ rung 3
# Every decode benchmark shape on every generation (about a second each).
DECODE = [
    (generation, model, tokens)
    for generation in ladder.GENERATIONS
    for model in MOE_MODELS
    for tokens in RAGGED_DOT_DECODE_TOKENS
]


@pytest.mark.parametrize("generation,model,tokens", DECODE, ids=[f"{g}-{m}-B={t}" for g, m, t in DECODE])
def test_experts_forward_compiles_for_tpu(generation, model, tokens):
    """The whole experts_forward (route, gate/up with the fused activation, down, combine: one program holding both
    grouped matmuls) at every decode benchmark shape: top-8 of 128 experts, bf16, transformers' weight layout."""
    ladder.compile_for_tpu(
        api.experts_forward,
        generation,
        *_decode_specs(model, tokens),
        min_kernels=2,
        label=f"experts_forward {model}",
        activation=MOE_MODELS[model]["activation"],
    )
