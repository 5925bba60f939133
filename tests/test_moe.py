"""MoE experts_forward, JAX side, up the ladder: both kernel paths — grouped (route, gate/up grouped matmul with the
fused epilogue, down grouped matmul, weighted combine) and small-batch (touched experts over all tokens in one
kernel), each forced through blocks= — vs the dense masked reference in strict interpret mode (both weight layouts,
gated concatenated / interleaved and ungated experts, gpt-oss's clamped SwiGLU, biases, expert-parallel sentinels, T
in {1, 7, 64}, bf16 and f32); gradients; blocks= reaching every kernel, the table's choice and its candidates; bad
input (blocks= included); TPU export; deviceless compile of the whole experts_forward (v6e: every decode benchmark
shape; v5e and v7x: the smallest and largest batch) (its backward is exported here and the grouped matmul backward
compiled in test_ragged_dot.py). The torch side (transformers' experts interface, tiny models) is
tests/test_moe_torch.py."""

import functools

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest
from jax.experimental import pallas as pl

from benchmarks.shapes import (
    MOE_EXPERTS,
    MOE_MODELS,
    MOE_TOP_K,
    RAGGED_DOT_DECODE_TOKENS,
    RAGGED_DOT_QUICK_TOKENS,
)
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.api import ExpertsBlocks, MatmulBlocks, RaggedDotBlocks, TransposedMatmulBlocks
from tpu_kernels_jax.common import mxfp4, quantization
from tpu_kernels_jax.common.activation import ClampedSwiGLU
from tpu_kernels_jax.moe import api, touched
from tpu_kernels_jax.moe import combine as moe_combine
from tpu_kernels_jax.moe import routing as row_routing
from tpu_kernels_jax.moe import tuning as moe_tuning
from tpu_kernels_jax.moe.reference import experts_forward_reference, gate_and_up
from tpu_kernels_jax.ragged_dot.reference import gating_reference

F32, BF16 = jnp.float32, jnp.bfloat16
# gpt-oss's gating with a limit the test pre-activations (std ~1.1 plus biases) cross on both sides of both clamps.
GPT_OSS_GATE = ClampedSwiGLU(limit=0.75, alpha=1.702)
# Its alpha = 1, up_offset = 0 form: SiLU(clamped gate) * clamped up (DeepSeek-V4's experts).
CLAMPED_SILU_GATE = ClampedSwiGLU(limit=0.75, alpha=1.0, up_offset=0.0)


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
    # gpt-oss's layout: [E, H, 2I] interleaved with biases, its clamped SwiGLU; I = 192 is one and a half of the
    # de-interleave's 128-column pieces.
    ("t7-gpt-oss-i192-f32", 7, 6, 2, 128, 192, F32, "interleaved", True, True, GPT_OSS_GATE, 3),
    ("t16-gpt-oss-bf16", 16, 8, 4, 128, 128, BF16, "interleaved", True, True, GPT_OSS_GATE, 0),
    ("t7-concat-clamped-silu-bf16", 7, 6, 2, 128, 128, BF16, "concatenated", False, True, CLAMPED_SILU_GATE, 0),
    # Nemotron-H's experts: no gate, ReLU squared.
    ("t7-ungated-relu2-f32", 7, 6, 2, 128, 128, F32, None, False, False, "relu2", 0),
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


# Cases run on one path only (the suite's time budget): the interleaved silu / gelu ones on the grouped path (the
# small-batch kernel's interleaved read is the same whatever the activation: the gpt-oss cases take it there); the
# gpt-oss ones on the small-batch path (the quantized fp8 gpt-oss case runs the clamped SwiGLU interleaved on the
# grouped path, at a partial last tile: the weights are dequantized in VMEM before the same epilogue); the clamped silu
# (up_offset 0) on the small-batch path (the grouped path's clamped gating: the same apply_gating, in that quantized
# case); ReLU squared on the small-batch path (an elementwise activation like the others, tied to its reference in
# test_ragged_dot.py). The grouped path's ungated epilogue with biases and sentinels: test_experts_forward_gradients
# (its d top_k_weights is each routed expert's output against the cotangent); its 64-token, multi-tile run with
# sentinels: the t64 interleaved case and test_sentinels_contribute_nothing; one token on the grouped path is two
# rows of the grouped matmuls (fewer than a sublane tile: the m7 tail case in test_ragged_dot.py), so the t1 case
# takes the path the table gives one token; the unfused I = 96
# gate/up exists on the grouped path only (the small-batch kernel's I = 96: the stored-swapped case).
ONE_PATH = {
    "t1-concat-silu-bf16": "small_batch",
    "t64-concat-silu-bias-bf16-sentinels": "small_batch",
    "t7-interleaved-silu-bias-f32": "grouped",
    "t64-interleaved-gelu-bf16-transposed": "grouped",
    "t7-ungated-gelu-bias-bf16-transposed": "small_batch",
    "t7-concat-i96-unfused-f32-transposed": "grouped",
    "t7-gpt-oss-i192-f32": "small_batch",
    "t16-gpt-oss-bf16": "small_batch",
    "t7-concat-clamped-silu-bf16": "small_batch",
    "t7-ungated-relu2-f32": "small_batch",
}
# The f32 concatenated gelu case with biases (CASES[1]) runs against the reference on both paths in
# test_sentinels_contribute_nothing, whose sentinel checks reuse that compiled program; gpt-oss's I = 192 case
# (CASES[8]) on the small-batch path in test_experts_forward_gradients, in the program of its gradients.
PATH_CASES = [
    (c, p) for c in CASES[:1] + CASES[2:8] + CASES[9:] for p in ladder.MOE_PATHS if ONE_PATH.get(c[0], p) == p
]


def forced_blocks(path, args, kw):
    """blocks= forcing `path` for the arguments of experts_forward (ladder.moe_blocks)."""
    _, _, _, gate_up, down, gate_up_bias, _ = args
    return ladder.moe_blocks(
        path,
        gate_up,
        down,
        gate_up_bias,
        gate_layout=kw.get("gate_layout", "concatenated"),
        weights_transposed=kw.get("weights_transposed", False),
    )


def assert_clamps_bite(args, kw):
    """A ClampedSwiGLU case must exercise its clamps: routed pre-activations beyond the limit and inside it, for the
    gate (clamped above) and for up (clamped on both sides)."""
    activation = kw["activation"]
    if not isinstance(activation, ClampedSwiGLU):
        return
    x, index, _, gate_up, _, gate_up_bias, _ = args
    w = np.asarray(gate_up, np.float32)
    w = w if kw["weights_transposed"] else np.swapaxes(w, 1, 2)  # [E, H, 2I]
    routed = np.clip(np.asarray(index), 0, w.shape[0] - 1)
    h = np.einsum("th,tkhn->tkn", np.asarray(x, np.float32), w[routed])
    if gate_up_bias is not None:
        h = h + np.asarray(gate_up_bias, np.float32)[routed]
    half = h.shape[-1] // 2
    gate, up = (h[..., 0::2], h[..., 1::2]) if kw["gate_layout"] == "interleaved" else (h[..., :half], h[..., half:])
    limit = activation.limit
    assert (gate > limit).any() and (gate < limit).any(), "the gate clamp is not exercised"
    assert (up > limit).any() and (up < -limit).any() and (abs(up) < limit).any(), "the up clamp is not exercised"


@pytest.mark.parametrize("case,path", PATH_CASES, ids=[f"{c[0]}-{p}" for c, p in PATH_CASES])
def test_experts_forward_matches_reference(rand, case, path):
    args, kw = _case_args(rand, case)
    assert_clamps_bite(args, kw)
    dtype = case[6]
    fn = functools.partial(tk.experts_forward, blocks=forced_blocks(path, args, kw), **kw)
    ladder.assert_moe_path(fn, args, path)
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
    [(1, 128, 8, 0), (7, 8, 8, 5), (64, 160, 8, 100), (256, 128, 8, 300), (3, 6, 2, 6)],
)
def test_touched_experts(rand, tokens, experts, top_k, sentinels):
    """The small-batch kernel's visit list: the distinct valid ids ascending, zeros after; sentinels skipped (the
    last case makes every id a sentinel: count 0). One token (1, 128), fewer experts than a lane tile (8 and 6,
    every expert chosen in the first), a lane-ragged count (160), the largest decode batch."""
    index, _ = routing(rand, tokens, experts, top_k, sentinels=sentinels)
    listed, count = ladder.run_kernel(functools.partial(touched.touched_experts, num_experts=experts), index)
    expected = touched.touched_experts_reference(index, experts)
    listed, count = np.asarray(listed), int(count)
    assert listed.shape == (experts,) and count == len(expected), (count, expected)
    assert listed[:count].tolist() == expected
    assert (listed[count:] == 0).all()


@pytest.mark.cpu_only
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
    ladder.assert_moe_path(api.experts_forward, args(1, 128), "small_batch")
    ladder.assert_moe_path(api.experts_forward, args(limit, 128), "small_batch")
    ladder.assert_moe_path(api.experts_forward, args(limit + 1, 128), "grouped")
    ladder.assert_moe_path(api.experts_forward, args(4, moe_tuning.SMALL_BATCH_MAX_EXPERTS + 1), "grouped")


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_touched_experts_compiles_for_tpu(generation):
    """The gridless touched-experts kernel: on v6e one token, a lane-ragged expert count (160) and the VMEM-heaviest
    shape (its [E, E] matrices at the most experts the small-batch path takes, the largest batch); on v5e and v7x,
    whose VMEM differs, the VMEM-heaviest (the others are the same kernel at smaller static sizes)."""
    shapes = ((1, 128), (16, 160)) if generation == "v6e" else ()
    for tokens, experts in (*shapes, (256, moe_tuning.SMALL_BATCH_MAX_EXPERTS)):
        ladder.compile_for_tpu(
            touched.touched_experts,
            generation,
            ((tokens, 8), jnp.int32),
            label=f"touched_experts E={experts}",
            num_experts=experts,
        )


@pytest.mark.parametrize("path", ladder.MOE_PATHS)
def test_mixed_weight_dtypes(rand, path):
    """bf16 activations and gate/up weights with an f32 down_proj: each matmul runs in its operands' promoted dtype."""
    x = rand.normal((6, 128), BF16)
    index, w = routing(rand, 6, 8, 2)
    gate_up, _, _, _ = weights(rand, 8, 128, 128, gated=True, transposed=False, bias=False, dtype=BF16)
    _, down, _, _ = weights(rand, 8, 128, 128, gated=True, transposed=False, bias=False, dtype=F32)
    args = (x, index, w.astype(BF16), gate_up, down, None, None)
    fn = functools.partial(tk.experts_forward, activation="silu", blocks=forced_blocks(path, args, {}))
    ladder.assert_moe_path(fn, args, path)
    reference = functools.partial(experts_forward_reference, activation="silu")
    ladder.check_against_reference(jax.jit(fn), jax.jit(reference), args, dtype=BF16, rand=rand)


@pytest.mark.parametrize("path", ladder.MOE_PATHS)
def test_sentinels_contribute_nothing(rand, path):
    """The f32 concatenated gelu case with biases and transposed weights (CASES[1]) against the reference; then,
    through the same compiled program, replacing some routing ids by sentinels (>= E) gives the result of dropping
    those slots (weight zero), and a shard that holds none of the routed experts gives exactly zero, biases
    included."""
    args, kw = _case_args(rand, CASES[1])
    x, index, w, gate_up, down, gate_up_bias, down_bias = args
    experts = gate_up.shape[0]
    fn = jax.jit(functools.partial(tk.experts_forward, blocks=forced_blocks(path, args, kw), **kw))
    ladder.assert_moe_path(fn, args, path)
    out = ladder.check_against_reference(
        fn, jax.jit(functools.partial(experts_forward_reference, **kw)), args, dtype=F32, rand=rand, **F32_TOL
    )
    assert out.shape == x.shape and out.dtype == F32
    drop = jnp.asarray(rand.rng.random(index.shape) < 0.4)
    with_sentinels = jnp.where(drop, experts + 5, index)
    without = jnp.where(drop, 0.0, w)  # same expert ids, the dropped slots weighted zero
    out_sentinel = ladder.run_kernel(fn, x, with_sentinels, w, gate_up, down, gate_up_bias, down_bias)
    out_zero_weight = ladder.run_kernel(fn, x, index, without, gate_up, down, gate_up_bias, down_bias)
    ladder.assert_close(out_sentinel, out_zero_weight, dtype=F32, **F32_TOL, context=repr(rand))
    sentinels = jnp.full_like(index, experts) + jnp.asarray(rand.rng.integers(0, 5, index.shape), jnp.int32)
    out = ladder.run_kernel(fn, x, sentinels, w, gate_up, down, gate_up_bias, down_bias)
    assert out.shape == x.shape and bool(jnp.all(out == 0)), "sentinel-only routing produced nonzero output"


def test_no_tokens(rand):
    x = rand.normal((0, 128), BF16)
    index, w = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), BF16)
    gate_up, down, _, _ = weights(rand, 4, 128, 128, gated=True, transposed=False, bias=False, dtype=BF16)
    out = ladder.run_kernel(tk.experts_forward, x, index, w, gate_up, down)
    assert out.shape == (0, 128) and out.dtype == BF16


# ------------------------------------------------------------------------------------------------ gradients
# Each path once: bf16 ungated + biases + sentinels on the grouped path; gpt-oss's clamped SwiGLU, interleaved with
# biases (f32, transposed weights, through the small-batch path's forward and its custom_vjp, which is the grouped
# kernels' backward): no gradient where a clamp bites. The concatenated layout's backward is the same grouped-matmul
# backward with gated="concatenated" passed through (experts_forward has no layout-specific backward code): its
# kernels' gradients, with biases, in f32 and bf16, are checked in test_ragged_dot.py.
GRAD_PATH_CASES = [(CASES[5], "grouped"), (CASES[8], "small_batch")]
assert {p for _, p in GRAD_PATH_CASES} == set(ladder.MOE_PATHS)
GRAD_NAMES = ["d hidden_states", "d top_k_weights", "d gate_up_proj", "d down_proj", "d gate_up_bias", "d down_bias"]


@pytest.mark.parametrize("case,path", GRAD_PATH_CASES, ids=[f"{c[0]}-{p}" for c, p in GRAD_PATH_CASES])
def test_experts_forward_gradients(rand, case, path):
    """The output, and d hidden_states, d top_k_weights, d gate_up_proj, d down_proj (and d biases) vs jax.grad of
    the reference, in one program."""
    args, kw = _case_args(rand, case)
    assert_clamps_bite(args, kw)
    dtype = case[6]
    has_bias = args[5] is not None
    # bf16: the reference rounds the intermediate once as the kernel does, but its backward stays in f32 where the
    # kernel's rounds each grouped matmul's result to bf16; weight gradients sum over tokens.
    tol = dict(rtol=3e-2, atol=5e-2) if dtype == BF16 else dict(rtol=1e-4, atol=1e-4)
    fn = functools.partial(tk.experts_forward, blocks=forced_blocks(path, args, kw), **kw)
    ladder.assert_moe_path(fn, args, path)
    out = ladder.check_forward_and_gradients(
        fn,
        functools.partial(experts_forward_reference, **kw),
        args,
        argnums=(0, 2, 3, 4, 5, 6) if has_bias else (0, 2, 3, 4),
        names=GRAD_NAMES if has_bias else GRAD_NAMES[:4],
        rand=rand,
        dtype=dtype,
        out_tolerance=F32_TOL if dtype == F32 else {},
        grad_tolerance=tol,
    )
    assert out.shape == args[0].shape and out.dtype == dtype


@pytest.mark.parametrize(
    "tokens,top_k,hidden,dtype,block",
    [(37, 8, 256, BF16, 16), (21, 1, 384, F32, 8), (6, 1, 128, BF16, 32), (40, 6, 2880, BF16, 16)],
)
def test_combine_rows(rand, tokens, top_k, hidden, dtype, block):
    """The grouped path's combine kernel against a numpy gather and f32 sum: rows in a random order, a last token
    block past T (37 of 16, 21 of 8, 40 of 16), fewer tokens than a block (6), top-1 and top-6, a hidden size off the
    lane tile (2880)."""
    rows = rand.normal((tokens * top_k, hidden), dtype)
    position = jnp.asarray(rand.rng.permutation(tokens * top_k), jnp.int32)
    out = ladder.run_kernel(
        functools.partial(moe_combine.combine_rows, top_k=top_k, tokens_per_block=block), rows, position
    )
    expected = np.asarray(rows, np.float32)[np.asarray(position)].reshape(tokens, top_k, hidden).sum(axis=1)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    ladder.assert_close(out, expected, dtype=dtype, what="combined rows")


def test_combine_rows_never_reads_outside_its_rows(rand):
    """Positions outside [0, R) (which the grouped path's permutation never gives) read the last row instead: the
    kernel runs without Mosaic's bounds checks, and its copies still read nothing outside the array."""
    tokens, top_k, hidden = 16, 4, 256
    rows = rand.normal((tokens * top_k, hidden), BF16)
    position = np.asarray(rand.rng.permutation(tokens * top_k), np.int32)
    position[[3, 17, 40]] = [-5, tokens * top_k, 1 << 30]
    out = ladder.run_kernel(functools.partial(moe_combine.combine_rows, top_k=top_k), rows, jnp.asarray(position))
    last = tokens * top_k - 1
    read = np.where((position < 0) | (position > last), last, position)
    expected = np.asarray(rows, np.float32)[read].reshape(tokens, top_k, hidden).sum(axis=1)
    ladder.assert_close(out, expected, dtype=BF16, what="combined rows, the last row for positions outside")


@pytest.mark.cpu_only
def test_combine_rows_block_must_be_whole_sublane_tiles():
    rows = jax.ShapeDtypeStruct((64, 256), BF16)
    position = jax.ShapeDtypeStruct((64,), jnp.int32)
    with pytest.raises(ValueError, match=r"tokens_per_block: expected a multiple of 16 .* got 8"):
        jax.eval_shape(functools.partial(moe_combine.combine_rows, top_k=2, tokens_per_block=8), rows, position)


@pytest.mark.cpu_only
def test_combine_choice_serves_only_what_the_kernel_reads(monkeypatch):
    """The table takes the kernel for float32 and bfloat16 rows past COMBINE_KERNEL_MIN_BYTES (an even count of
    bfloat16 rows: read as word pairs) and XLA's gather otherwise; asked for where it cannot serve, the kernel is a
    clear error. float16 rows are no truncated float32, so the shift that widens bfloat16 would give wrong values."""
    monkeypatch.setitem(moe_tuning.COMBINE, "v6e", "kernel")
    big, grouped = 32768, ExpertsBlocks()
    with jax.default_device(jax.devices("cpu")[0]):
        assert moe_tuning.combine_choice(grouped, big, 2048, BF16) == "kernel"
        assert moe_tuning.combine_choice(grouped, big, 2048, F32) == "kernel"
        assert moe_tuning.combine_choice(grouped, 4096, 2048, BF16) == "gather"  # 16 MiB: XLA's
        assert moe_tuning.combine_choice(grouped, big, 2048, jnp.float16) == "gather"
        assert moe_tuning.combine_choice(grouped, big + 1, 2048, BF16) == "gather"
        forced = ExpertsBlocks(combine="kernel")
        assert moe_tuning.combine_choice(forced, 8, 128, BF16) == "kernel"
        with pytest.raises(ValueError, match=r"blocks.combine: 'kernel' cannot serve these inputs: rows of float16"):
            moe_tuning.combine_choice(forced, big, 2048, jnp.float16)
        with pytest.raises(ValueError, match=r"blocks.combine: 'kernel' cannot serve these inputs: 7 bfloat16 rows"):
            moe_tuning.combine_choice(forced, 7, 128, BF16)
    with pytest.raises(ValueError, match=r"rows: rows of float16"):
        jax.eval_shape(
            functools.partial(moe_combine.combine_rows, top_k=2),
            jax.ShapeDtypeStruct((64, 128), jnp.float16),
            jax.ShapeDtypeStruct((64,), jnp.int32),
        )


@pytest.mark.parametrize("combine", moe_tuning.COMBINES)
def test_grouped_combines_agree(rand, combine):
    """The grouped path with either combine against the reference, forward and every gradient (the kernel's custom
    gradient gives each row its token's cotangent); sentinel slots included."""
    tokens, experts, top_k, hidden, inter = 40, 8, 2, 256, 128
    index, weights = routing(rand, tokens, experts, top_k, sentinels=6)
    args = (
        rand.normal((tokens, hidden)),
        index,
        weights,
        rand.normal((experts, 2 * inter, hidden), scale=0.05),
        rand.normal((experts, hidden, inter), scale=0.05),
        None,
        None,
    )
    fn = functools.partial(tk.experts_forward, blocks=ExpertsBlocks(path="grouped", combine=combine))
    text = str(jax.make_jaxpr(fn)(*args))
    assert ("moe_combine_rows" in text) == (combine == "kernel"), f"combine={combine!r} not taken"
    ladder.check_forward_and_gradients(
        fn,
        experts_forward_reference,
        args,
        argnums=(0, 2, 3, 4),
        names=GRAD_NAMES[:4],
        rand=rand,
        dtype=F32,
        out_tolerance=F32_TOL,
        grad_tolerance=dict(rtol=1e-4, atol=1e-4),
    )


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_combine_rows_compiles_for_tpu(generation):
    """Qwen3's 4096-token prefill (32,768 rows of 2048, bf16: read as 32-bit words on a chip), gpt-oss's 2880-wide
    rows at top-4 (f32 rows: copied as they are) and DeepSeek-V3's 7168-wide rows at top-8 (one bf16 tile of 16
    tokens a step, row buffers of 7 MiB: the scoped limit asked covers them)."""
    assert moe_combine.default_tokens_per_block(8, 2048, BF16) == 32
    assert moe_combine.default_tokens_per_block(8, 7168, BF16) == 16
    for label, top_k, rows, hidden, dtype in (
        ("qwen3", 8, 32768, 2048, BF16),
        ("gpt-oss", 4, 4096, 2880, F32),
        ("deepseek-v3", 8, 65536, 7168, BF16),
    ):
        ladder.compile_for_tpu(
            functools.partial(moe_combine.combine_rows, top_k=top_k),
            generation,
            ((rows, hidden), dtype),
            ((rows,), jnp.int32),
            label=f"combine {label}",
        )


def test_row_layout_groups_pairs_by_expert_in_token_order(rand):
    """row_layout against a stable sort by expert: each expert's pairs in token order, sentinels (ids past the
    experts or negative) after every expert, an empty expert, pairs over several of the rank matmul's chunks and not a
    whole number of them; `pair` inverts `position`."""
    tokens, top_k, experts = 75, 8, 16
    pairs = tokens * top_k
    assert pairs > 2 * row_routing.RANK_CHUNK and pairs % row_routing.RANK_CHUNK
    flat = rand.rng.integers(0, experts, pairs)
    flat[flat == 3] = 4  # an empty expert
    flat[rand.rng.random(pairs) < 0.05] = experts + 3
    flat[rand.rng.random(pairs) < 0.02] = -1
    layout = row_routing.row_layout(jnp.asarray(flat.reshape(tokens, top_k), jnp.int32), experts)
    position, pair, sizes = (np.asarray(a) for a in layout)
    valid = (flat >= 0) & (flat < experts)
    np.testing.assert_array_equal(sizes, np.bincount(flat[valid], minlength=experts))
    expected = np.argsort(np.where(valid, flat, experts), kind="stable")  # the pair at each row
    np.testing.assert_array_equal(pair, expected)
    np.testing.assert_array_equal(position[expected], np.arange(pairs))


@ladder.random_draws
def test_random_draw(rand, draw):
    """Tokens (one token, several sublane tiles), experts (most of them empty at few tokens), top-k, sizes, dtype,
    quantized weights (int8 / fp8 with per-channel scales), the gate layout, activation, weight layout, biases,
    expert-parallel sentinels and the path drawn at random; the forward, or forward and gradients, against the dense
    reference (on the dequantized weights)."""
    dtype = rand.draw("dtype", [F32, BF16])
    quantized = rand.draw("weight_dtype", [None, None, jnp.int8, jnp.float8_e4m3fn])
    gradients = quantized is None and rand.draw("gradients", [False, True])
    tokens = rand.draw("tokens", [1, 2, 7, 16, 33, 64])
    experts = rand.draw("experts", [1, 4, 6, 8, 16])
    top_k = rand.draw("top_k", range(1, min(experts, 4) + 1))
    hidden, inter = rand.draw("hidden", [128, 256]), rand.draw("intermediate", [64, 96, 128, 192, 256])
    layout = rand.draw("gate_layout", ["concatenated", "interleaved"] + ([] if quantized else [None]))
    clamped = [GPT_OSS_GATE, CLAMPED_SILU_GATE] if layout else []
    activation = rand.draw("activation", ["silu", "gelu", "gelu_tanh", "relu2"] + clamped)
    transposed, bias = rand.draw("weights_transposed", [False, True]), rand.draw("biases", [False, True])
    sentinels = rand.draw("sentinel_slots", [0, 0, 2, tokens * top_k // 2])
    path = rand.draw("path", ladder.MOE_PATHS)
    kw = dict(activation=activation, gate_layout=layout, weights_transposed=transposed)

    x = rand.normal((tokens, hidden), dtype)
    index, w = routing(rand, tokens, experts, top_k, sentinels=sentinels)
    gate_up, down, gate_up_bias, down_bias = weights(
        rand, experts, hidden, inter, gated=layout is not None, transposed=transposed, bias=bias, dtype=dtype
    )
    scales = ()
    if quantized:
        out_axis = 2 if transposed else 1
        (gate_up, gate_up_scale), (down, down_scale) = (quantize(a, quantized, out_axis) for a in (gate_up, down))
        scales = (gate_up_scale, down_scale)
    blocks = ladder.moe_blocks(
        path, gate_up, down, gate_up_bias, gate_layout=layout, weights_transposed=transposed, fallback=True
    )
    args = (x, index, w.astype(dtype), gate_up, down, *scales, gate_up_bias, down_bias)
    if quantized:
        fn, reference = functools.partial(quantized_experts, blocks=blocks, **kw), _quantized_reference(kw)
    else:
        fn = functools.partial(tk.experts_forward, blocks=blocks, **kw)
        reference = functools.partial(experts_forward_reference, **kw)
    ladder.assert_moe_path(fn, args, blocks.path)
    # the intermediate (relu2 squares it) is rounded to the dtype once and summed again through down_proj: one
    # rounding step of it moves an output by its share of the largest intermediate's
    atol, largest = (F32_TOL["atol"], 1e-5) if dtype == F32 else (ladder.TOLERANCES[jnp.dtype(dtype)][1], 2**-8)
    tol = dict(F32_TOL if dtype == F32 else {}, atol=ladder.relative_to_largest(atol, largest))
    if not gradients:
        out = ladder.check_against_reference(jax.jit(fn), jax.jit(reference), args, dtype=dtype, rand=rand, **tol)
        assert out.shape == x.shape and out.dtype == dtype
        return
    argnums, names = ladder.differentiated(args, dict(zip((0, 2, 3, 4, 5, 6), GRAD_NAMES)))
    ladder.check_forward_and_gradients(
        fn,
        reference,
        args,
        argnums=argnums,
        names=names,
        rand=rand,
        dtype=dtype,
        out_tolerance=tol,
        grad_tolerance=dict(rtol=3e-2, atol=5e-2) if dtype == BF16 else dict(rtol=1e-4, atol=1e-4),
    )


# ------------------------------------------------------------------------------------------------ blocks=
def _qwen3_decode_specs(tokens):
    return [jax.ShapeDtypeStruct(*sd) for sd in _decode_specs("qwen3-30b-a3b", tokens)]


@pytest.mark.cpu_only
def test_blocks_reach_every_kernel():
    """The small-batch chunk and VMEM limit reach its kernel; gate_up and down reach the grouped matmuls, forward
    (grouped path) and backward (both paths: the small-batch gradient is the grouped path's). Each part carries a
    distinct vmem_limit_bytes, found in the traced program's kernels."""
    marks = iter((100 << 20) + 4096 * i for i in range(1, 20))  # above any working set here, below 128 MiB

    def ragged(with_backward):
        parts = dict(forward=MatmulBlocks(vmem_limit_bytes=next(marks)))
        if with_backward:
            parts.update(
                recompute=MatmulBlocks(vmem_limit_bytes=next(marks)),
                lhs_grad=MatmulBlocks(vmem_limit_bytes=next(marks)),
                rhs_grad=TransposedMatmulBlocks(vmem_limit_bytes=next(marks)),
            )
        return RaggedDotBlocks(**parts)

    specs = _qwen3_decode_specs(8)
    for path in ladder.MOE_PATHS:
        gate_up, down = ragged(True), ragged(True)
        small = dict(chunk=384, vmem_limit_bytes=next(marks)) if path == "small_batch" else {}
        blocks = ExpertsBlocks(path=path, gate_up=gate_up, down=down, **small)
        forward = functools.partial(api.experts_forward, activation="silu", blocks=blocks)
        text = str(jax.make_jaxpr(forward)(*specs))
        grad_text = str(jax.make_jaxpr(jax.grad(lambda *a: ladder.vjp_loss(forward(*a)), argnums=(0, 2, 3, 4)))(*specs))
        expected = {"gate_up.lhs_grad": gate_up.lhs_grad, "gate_up.rhs_grad": gate_up.rhs_grad}
        expected.update({"down.recompute": down.recompute, "down.lhs_grad": down.lhs_grad})
        expected.update({"down.rhs_grad": down.rhs_grad, "gate_up.recompute": gate_up.recompute})
        for name, part in expected.items():
            assert f"vmem_limit_bytes={part.vmem_limit_bytes}" in grad_text, f"{path}: blocks.{name} unused"
        in_forward = {"gate_up.forward": gate_up.forward, "down.forward": down.forward}
        for name, part in in_forward.items():
            found = f"vmem_limit_bytes={part.vmem_limit_bytes}" in text
            assert found == (path == "grouped"), f"{path}: blocks.{name} {'unused' if not found else 'ran'}"
        if path == "small_batch":
            assert f"vmem_limit_bytes={blocks.vmem_limit_bytes}" in text, "blocks.vmem_limit_bytes unused"


# 64 tokens: the small-batch path on every generation (v7x's limit); 256: v6e's limit, the grouped path on v5e and
# v7x; 1024: past every limit. One token takes the path 64 does (test_path_choice).
@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
@pytest.mark.parametrize("tokens", [64, 256, 1024])
def test_choose_and_candidate_blocks(generation, tokens):
    """tuning.choose_blocks names the path the table takes (and its chunk), candidate_blocks lists it first, then the
    other path and small-batch chunks next to it, all distinct; experts_forward takes each as blocks= and traces
    the kernels of its path."""
    specs = _qwen3_decode_specs(tokens)
    dims = MOE_MODELS["qwen3-30b-a3b"]
    kwargs = dict(
        gate_up_shape=specs[3].shape,
        down_shape=specs[4].shape,
        weights_transposed=False,
        gate_layout="concatenated",
        has_gate_up_bias=False,
        hidden_dtype=BF16,
        weight_dtype=BF16,
    )
    with jax.default_device(ladder.tpu_device(generation)):
        table = moe_tuning.choose_blocks(tokens, dims["hidden"], dims["intermediate"], **kwargs)
        small = tokens <= moe_tuning.SMALL_BATCH_MAX_TOKENS[generation]
        assert table.path == ("small_batch" if small else "grouped"), table
        ladder.assert_moe_path(functools.partial(api.experts_forward, activation="silu"), specs, table.path)
        candidates = moe_tuning.candidate_blocks(tokens, dims["hidden"], dims["intermediate"], **kwargs)
        assert candidates[0] == table and len(set(candidates)) == len(candidates), candidates
        try:  # the small-batch kernel at this batch, whatever the threshold says
            moe_tuning.plan_small_batch(
                tokens, dims["hidden"], dims["intermediate"], blocks=ExpertsBlocks(path="small_batch"), **kwargs
            )
            paths = set(ladder.MOE_PATHS)
        except ValueError:  # its working set [T, H] does not fit this generation's VMEM
            paths = {"grouped"}
        assert {c.path for c in candidates} == paths, candidates
        for candidate in candidates:
            fn = functools.partial(api.experts_forward, activation="silu", blocks=candidate)
            ladder.assert_moe_path(fn, specs, candidate.path)


def _gpt_oss_mxfp4_shapes(tokens):
    """experts_forward's arguments at gpt-oss-20b's shapes (H = I = 2880, 32 experts, top-4) with MXFP4 weights as
    prepare_mxfp4_experts lays them out, (shape, dtype) pairs, scales positional (quantized_experts)."""
    e, h, i = 32, 2880, 2880
    rows = mxfp4.scale_rows(h)
    return [
        ((tokens, h), BF16),
        ((tokens, 4), jnp.int32),
        ((tokens, 4), BF16),
        ((e, h // 2, 2 * i), jnp.uint8),
        ((e, i // 2, h), jnp.uint8),
        ((e, rows, 2 * i), jnp.uint8),
        ((e, rows, h), jnp.uint8),
    ]


@pytest.mark.cpu_only
def test_mxfp4_candidate_blocks_are_both_paths():
    """For MXFP4 weights (prepared, gpt-oss-20b's shapes at 8 tokens, v6e) candidate_blocks lists the table's
    choice first (the small-batch kernel, chunks of 960), then the other path, grouped tilings of the output width a
    step and the neighbouring small-batch chunks, all distinct; experts_forward traces each through blocks=."""
    h = i = 2880
    tokens = 8
    specs = [jax.ShapeDtypeStruct(*sd) for sd in _gpt_oss_mxfp4_shapes(tokens)]
    kwargs = dict(
        gate_up_shape=specs[3].shape,
        down_shape=specs[4].shape,
        weights_transposed=True,
        gate_layout="interleaved",
        has_gate_up_bias=False,
        hidden_dtype=BF16,
        weight_dtype=jnp.uint8,
    )
    with jax.default_device(ladder.tpu_device("v6e")):
        candidates = moe_tuning.candidate_blocks(tokens, h, i, **kwargs)
        assert candidates[0] == moe_tuning.choose_blocks(tokens, h, i, **kwargs), candidates
        # the table: the small-batch kernel in chunks of 960 (modeled v6e the faster path at B = 1 / 8 / 64)
        assert candidates[0] == ExpertsBlocks(path="small_batch", chunk=960), candidates
        assert len(set(candidates)) == len(candidates) >= 3, candidates
        assert {c.path for c in candidates} == {"grouped", "small_batch"}, candidates
        for candidate in candidates:
            fn = functools.partial(
                quantized_experts,
                activation=ClampedSwiGLU(limit=7.0, alpha=1.702),
                gate_layout="interleaved",
                weights_transposed=True,
                blocks=candidate,
            )
            assert jax.eval_shape(fn, *specs).shape == (tokens, h)


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


def _mxfp4_down(rand, scale_blocks=2):
    """MXFP4 down_proj for _good's shapes (I = 64: 32 bytes, 2 scales a row) with `scale_blocks` scales a row."""
    return dict(
        down_proj=rand.integers(0, 256, (4, 128, 32), jnp.uint8),
        down_scale=rand.integers(120, 124, (4, 128, scale_blocks), jnp.uint8),
    )


BAD_INPUTS = [
    ladder.BadInput(
        "negative routing id",
        dict(top_k_index=jnp.asarray([[0, 1], [2, -1], [0, 3], [1, 2], [3, 0]], jnp.int32)),
        ValueError,
        "top_k_index: expected expert ids >= 0 (ids >= num_experts = 4 are expert-parallel sentinels), "
        "got top_k_index[1, 1] = -1",
    ),
    ladder.BadInput("routing ids float", dict(top_k_index=jnp.zeros((5, 2))), TypeError, "top_k_index: expected dtype"),
    ladder.BadInput(
        "routing ids int64",
        dict(top_k_index=np.zeros((5, 2), np.int64)),
        TypeError,
        "top_k_index: expected dtype in (int32), got int64",
    ),
    ladder.BadInput(
        "routing shapes differ",
        dict(top_k_weights=jnp.ones((5, 3))),
        ValueError,
        "top_k_index / top_k_weights: expected the same shape [T=5, k]",
    ),
    ladder.BadInput(
        "routing tokens",
        dict(top_k_index=jnp.zeros((4, 2), jnp.int32), top_k_weights=jnp.ones((4, 2))),
        ValueError,
        "top_k_index / top_k_weights: expected the same shape [T=5, k]",
    ),
    ladder.BadInput(
        "hidden_states int",
        dict(hidden_states=jnp.zeros((5, 128), jnp.int32)),
        TypeError,
        "hidden_states: expected dtype",
    ),
    ladder.BadInput(
        "hidden_states rank",
        dict(hidden_states=jnp.zeros((1, 5, 128))),
        ValueError,
        "hidden_states: expected 2 dimensions",
    ),
    ladder.BadInput(
        "top_k_weights int", dict(top_k_weights=jnp.ones((5, 2), jnp.int32)), TypeError, "top_k_weights: expected dtype"
    ),
    ladder.BadInput(
        "gate_up_proj hidden",
        dict(gate_up_proj=jnp.zeros((4, 128, 96))),
        ValueError,
        "gate_up_proj: expected layout [E, N, H] with H = 128 (hidden_states' size), got shape (4, 128, 96)",
    ),
    ladder.BadInput(
        "gate_up_proj rank", dict(gate_up_proj=jnp.zeros((128, 128))), ValueError, "gate_up_proj: expected 3 dimensions"
    ),
    ladder.BadInput(
        "gate_up_proj odd",
        dict(gate_up_proj=jnp.zeros((4, 127, 128))),
        ValueError,
        "gate_up_proj: a gated layout needs an even 2*I, got 127",
    ),
    ladder.BadInput(
        "down_proj shape",
        dict(down_proj=jnp.zeros((4, 128, 32))),
        ValueError,
        "down_proj: expected shape (4, 128, 64), got (4, 128, 32)",
    ),
    ladder.BadInput(
        "down_proj experts",
        dict(down_proj=jnp.zeros((3, 128, 64))),
        ValueError,
        "down_proj: expected shape (4, 128, 64)",
    ),
    ladder.BadInput(
        "down_proj int", dict(down_proj=jnp.zeros((4, 128, 64), jnp.int32)), TypeError, "down_proj: expected dtype"
    ),
    ladder.BadInput(
        "gate_up_bias shape",
        dict(gate_up_bias=jnp.zeros((4, 64))),
        ValueError,
        "gate_up_bias: expected shape (4, 128), got (4, 64)",
    ),
    ladder.BadInput(
        "down_bias shape", dict(down_bias=jnp.zeros((5, 128))), ValueError, "down_bias: expected shape (4, 128)"
    ),
    ladder.BadInput(
        "activation",
        dict(activation="relu"),
        ValueError,
        "activation: expected one of ('silu', 'gelu', 'gelu_tanh', 'relu2')",
    ),
    ladder.BadInput("gate_layout", dict(gate_layout="stacked"), ValueError, "gate_layout: expected one of"),
    ladder.BadInput(
        "weights_transposed not a bool",
        dict(weights_transposed="no"),
        TypeError,
        "weights_transposed: expected a bool, got str 'no'",
    ),
    ladder.BadInput(
        "clamped swiglu without a gate",
        dict(activation=GPT_OSS_GATE, gate_layout=None),
        ValueError,
        "activation: ClampedSwiGLU(limit=0.75, alpha=1.702, up_offset=1.0) gates the up projection with the gate, so "
        "it needs a gated layout",
    ),
    # blocks=: the structure, the path's fit to the inputs, the small-batch chunk and VMEM, the grouped matmuls' tiles.
    ladder.BadInput(
        "blocks type",
        dict(blocks=RaggedDotBlocks()),
        TypeError,
        "blocks: expected an ExpertsBlocks or None, got RaggedDotBlocks",
    ),
    ladder.BadInput(
        "blocks path",
        dict(blocks=ExpertsBlocks(path="fast")),
        ValueError,
        "blocks.path: expected None or one of ('small_batch', 'grouped'), got 'fast'",
    ),
    ladder.BadInput(
        "blocks combine",
        dict(blocks=ExpertsBlocks(combine="scatter")),
        ValueError,
        "blocks.combine: expected None or one of ('kernel', 'gather'), got 'scatter'",
    ),
    ladder.BadInput(
        "blocks chunk without the small-batch path",
        dict(blocks=ExpertsBlocks(chunk=8)),
        ValueError,
        "blocks.chunk: a tile of the small-batch kernel, so it needs path='small_batch', got path=None",
    ),
    ladder.BadInput(
        "blocks vmem limit on the grouped path",
        dict(blocks=ExpertsBlocks(path="grouped", vmem_limit_bytes=16 << 20)),
        ValueError,
        "blocks.vmem_limit_bytes: a tile of the small-batch kernel, so it needs path='small_batch', got path='grouped'",
    ),
    ladder.BadInput(
        "blocks small batch too many experts",
        dict(
            gate_up_proj=jax.ShapeDtypeStruct((1025, 128, 128), F32),
            down_proj=jax.ShapeDtypeStruct((1025, 128, 64), F32),
            gate_up_bias=None,
            down_bias=None,
            blocks=ExpertsBlocks(path="small_batch"),
        ),
        ValueError,
        "blocks.path: 'small_batch' cannot serve these inputs: 1025 experts",
    ),
    ladder.BadInput(
        "blocks small batch no legal chunk",  # the gate/up bias is cut on lanes: 128 columns, more than I = 64
        dict(blocks=ExpertsBlocks(path="small_batch")),
        ValueError,
        "blocks.path: 'small_batch' cannot serve these inputs: no divisor of I = 64 is whole layout tiles",
    ),
    ladder.BadInput(
        "blocks chunk not legal",
        dict(gate_up_bias=None, blocks=ExpertsBlocks(path="small_batch", chunk=12)),
        ValueError,
        "blocks.chunk: expected a divisor of I = 64 that is whole layout tiles of the blocks it cuts (128 lanes or "
        "8 sublanes, by the weights' stored orientation): one of [64, 32, 16, 8], got 12",
    ),
    ladder.BadInput(
        "blocks chunk float",
        dict(gate_up_bias=None, blocks=ExpertsBlocks(path="small_batch", chunk=8.0)),
        TypeError,
        "blocks.chunk: expected a positive int, got float 8.0",
    ),
    ladder.BadInput(
        "blocks small batch vmem limit below its working set",
        dict(gate_up_bias=None, blocks=ExpertsBlocks(path="small_batch", vmem_limit_bytes=4096)),
        ValueError,
        "blocks: these blocks need",
    ),
    ladder.BadInput(
        "blocks gate_up part type",
        dict(blocks=ExpertsBlocks(gate_up=MatmulBlocks())),
        TypeError,
        "blocks.gate_up: expected a RaggedDotBlocks or None, got MatmulBlocks",
    ),
    ladder.BadInput(
        "blocks gate_up tile",
        dict(blocks=ExpertsBlocks(gate_up=RaggedDotBlocks(forward=MatmulBlocks(tk=100)))),
        ValueError,
        "blocks.gate_up.forward.tk: expected a multiple of 128 (lanes) or at least K = 128, got 100",
    ),
    ladder.BadInput(
        "blocks down backward tile",
        dict(blocks=ExpertsBlocks(path="small_batch", down=RaggedDotBlocks(rhs_grad=TransposedMatmulBlocks(tp=64)))),
        ValueError,
        "blocks.down.rhs_grad.tp: expected a multiple of 128 (lanes) or at least P = 128, got 64",
    ),
    ladder.BadInput(
        "scale with float weights",
        lambda rand: dict(gate_up_scale=rand.uniform((4, 128), 0.01, 0.02)),
        ValueError,
        "gate_up_scale: a scale goes with quantized weights (int8 / float8_e4m3fn), got gate_up_proj in float32",
    ),
    ladder.BadInput(
        "quantized weights without their scale",
        lambda rand: dict(gate_up_proj=rand.integers(-127, 128, (4, 128, 128), jnp.int8)),
        ValueError,
        "gate_up_scale: gate_up_proj is int8 (quantized), so its per-output-channel scale (E, 2I) float32 is "
        "required, got None",
    ),
    ladder.BadInput(
        "scale shape",
        lambda rand: dict(
            down_proj=rand.normal((4, 128, 64)).astype(jnp.float8_e4m3fn), down_scale=rand.uniform((4, 64), 0.01, 1)
        ),
        ValueError,
        "down_scale: expected shape (4, 128) (E, H), got (4, 64)",
    ),
    ladder.BadInput(
        "scale dtype",
        lambda rand: dict(
            down_proj=rand.integers(-127, 128, (4, 128, 64), jnp.int8),
            down_scale=rand.uniform((4, 128), 0.01, 1, jnp.bfloat16),
        ),
        TypeError,
        "down_scale: expected dtype in (float32), got bfloat16",
    ),
    ladder.BadInput(
        "mxfp4 blocks without their scales",
        lambda rand: dict(gate_up_proj=rand.integers(0, 256, (4, 128, 64), jnp.uint8)),
        ValueError,
        "gate_up_scale: gate_up_proj is uint8 (MXFP4 blocks), so its e8m0 block scales uint8 (4, 128, 4) are "
        "required, got None",
    ),
    ladder.BadInput(
        "mxfp4 scales dtype",
        lambda rand: dict(
            gate_up_proj=rand.integers(0, 256, (4, 128, 64), jnp.uint8),
            gate_up_scale=rand.uniform((4, 128, 4), 0.5, 1.0),
        ),
        TypeError,
        "gate_up_scale: expected dtype in (uint8), got float32",
    ),
    ladder.BadInput(
        "mxfp4 scales shape",
        lambda rand: _mxfp4_down(rand, scale_blocks=1),
        ValueError,
        "down_scale: expected shape (4, 128, 2) (one scale per 32 contraction elements of down_proj (4, 128, 32)), "
        "got (4, 128, 1)",
    ),
    ladder.BadInput(
        "mxfp4 blocks shape",
        lambda rand: dict(gate_up_proj=rand.integers(0, 256, (4, 128, 128), jnp.uint8)),
        ValueError,
        "gate_up_proj: expected layout [E, N, H / 2] (MXFP4 blocks) with H = 128 (hidden_states' size), got shape "
        "(4, 128, 128)",
    ),
    ladder.BadInput(
        "mxfp4 intermediate not whole blocks",
        lambda rand: dict(
            gate_up_proj=rand.normal((4, 96, 128)),
            gate_up_bias=None,
            down_proj=rand.integers(0, 256, (4, 128, 24), jnp.uint8),
        ),
        ValueError,
        "down_proj: MXFP4 blocks need the intermediate size (its contraction dimension) to be a multiple of 32, "
        "got I = 48",
    ),
    ladder.BadInput(
        "mxfp4 prepared scales shape",
        lambda rand: dict(
            gate_up_proj=rand.integers(0, 256, (4, 64, 128), jnp.uint8),
            gate_up_scale=rand.integers(120, 124, (4, 8, 128), jnp.uint8),
            down_proj=rand.normal((4, 64, 128)),
            weights_transposed=True,
        ),
        ValueError,
        "gate_up_scale: expected shape (4, 4, 128) or (4, 32, 128) (one scale per 32 contraction elements of "
        "gate_up_proj (4, 64, 128)), got (4, 8, 128)",
    ),
    ladder.BadInput(
        "mxfp4 in one projection on the small-batch path",
        lambda rand: dict(_mxfp4_down(rand), blocks=ExpertsBlocks(path="small_batch")),
        ValueError,
        "blocks.path: 'small_batch' cannot serve these inputs: MXFP4 weights in one projection only",
    ),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_INPUTS)
def test_bad_input_is_a_clear_error(rand, case):
    ladder.assert_clear_error(case, lambda arguments: tk.experts_forward(**arguments), _good(rand), rand)


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(limit=0.0), "activation.limit: expected a number > 0"),
        (dict(limit=float("inf")), "activation.limit: expected a finite real number, got inf"),
        (dict(limit=7.0, alpha=float("nan")), "activation.alpha: expected a finite real number, got nan"),
        (dict(limit=7.0, up_offset="1"), "activation.up_offset: expected a finite real number, got '1'"),
        (dict(limit=True), "activation.limit: expected a finite real number, got True"),
    ],
    ids=["limit zero", "limit inf", "alpha nan", "up_offset str", "limit bool"],
)
def test_clamped_swiglu_bad_parameters(fields, message):
    with pytest.raises(ValueError) as info:
        ClampedSwiGLU(**fields)
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------------ quantized weights
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize(w, dtype, out_axis):
    """Symmetric per-output-channel quantization of f32 weights [E, ., .] whose output channels are on `out_axis`:
    (q, scale [E, N] f32), w ~ q * scale."""
    w = np.asarray(w, np.float32)
    dtype = jnp.dtype(dtype)
    scale = np.abs(w).max(axis=3 - out_axis) / QUANT_MAX[dtype]
    ratio = w / np.expand_dims(scale, 3 - out_axis)
    q = np.clip(np.round(ratio), -127, 127) if dtype == jnp.int8 else ratio
    return jnp.asarray(q).astype(dtype), jnp.asarray(scale, F32)


def dequantize(q, scale, out_axis):
    """The reference's weights: q * scale in f32 (exact up to f32 rounding of one product)."""
    return q.astype(F32) * jnp.expand_dims(scale, 3 - out_axis)


def quantized_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, gate_up_scale, down_scale, *b, **kw):
    """experts_forward with the scales positional (for jit specs and compile_for_tpu)."""
    return api.experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        *b,
        gate_up_scale=gate_up_scale,
        down_scale=down_scale,
        **kw,
    )


# (id, weight dtype, activation dtype, weights_transposed, biases, I, gate layout, activation). bf16 activations:
# the reference runs on the dequantized weights in f32 and rounds what every implementation rounds (the bf16
# intermediate and output), so the kernels may differ from it by bf16 rounding only (ladder's bf16 tolerance); f32
# activations: to f32 rounding.
QUANT_CASES = [
    # I = 256: the small-batch kernel's smallest chunk is 128 (down_proj holds I on lanes), two a gate/up stream.
    ("int8-bf16-i256", jnp.int8, BF16, False, False, 256, "concatenated", "silu"),
    # gpt-oss's layout (interleaved, transposed, biases, its clamped SwiGLU) at I = 192: small-batch chunks of 64 (3
    # steps); on the grouped path an output tile that does not divide I (tn = 128, forced): the last tile's weight
    # block runs past N, and its columns there (NaN in strict interpret mode) must not reach the de-interleave's
    # selection matmuls.
    ("fp8-f32-gpt-oss-i192", jnp.float8_e4m3fn, F32, True, True, 192, "interleaved", GPT_OSS_GATE),
]
# The int8 case on the small-batch path only (its grouped matmuls' dequantization: test_ragged_dot.py, with k steps).
QUANT_PATH_CASES = [(c, p) for c in QUANT_CASES for p in ladder.MOE_PATHS if (c[0], p) != ("int8-bf16-i256", "grouped")]


def _quantized_case(rand, case, tokens=7):
    """(kernel args, kernel keywords): T tokens, top-2 of 6 experts (2 sentinel slots), H = 128."""
    _, weight_dtype, dtype, transposed, bias, inter, gate_layout, activation = case
    x = rand.normal((tokens, 128), dtype)
    index, w = routing(rand, tokens, 6, 2, sentinels=2)
    gate_up, down, gate_up_bias, down_bias = weights(
        rand, 6, 128, inter, gated=True, transposed=transposed, bias=bias, dtype=dtype
    )
    out_axis = 2 if transposed else 1
    (gate_up_q, gate_up_scale), (down_q, down_scale) = (quantize(a, weight_dtype, out_axis) for a in (gate_up, down))
    kw = dict(activation=activation, gate_layout=gate_layout, weights_transposed=transposed)
    return (x, index, w.astype(dtype), gate_up_q, down_q, gate_up_scale, down_scale, gate_up_bias, down_bias), kw


def _quantized_reference(kw):
    """The dense reference on the dequantized weights, taking the kernel's arguments (scales in place)."""

    def reference(x, index, w, gate_up_q, down_q, gate_up_scale, down_scale, gate_up_bias, down_bias):
        out_axis = 2 if kw["weights_transposed"] else 1
        gate_up = dequantize(gate_up_q, gate_up_scale, out_axis)
        down = dequantize(down_q, down_scale, out_axis)
        return experts_forward_reference(x, index, w, gate_up, down, gate_up_bias, down_bias, **kw)

    return reference


@pytest.mark.parametrize("path", ladder.MOE_PATHS)
def test_traced_expert_ids_out_of_range_stay_in_bounds(rand, path):
    """Traced top_k_index cannot be checked on the host: negative ids and ids far past the experts (beyond the
    expert-parallel sentinels' range too) must keep both paths' kernels inside every buffer (strict interpret mode
    raises on an out-of-bounds block), with a finite result."""
    x = rand.normal((7, 128), BF16)
    gate_up, down, _, _ = weights(rand, 6, 128, 256, gated=True, transposed=False, bias=False, dtype=BF16)
    _, w = routing(rand, 7, 6, 2)
    fn = jax.jit(functools.partial(tk.experts_forward, blocks=ExpertsBlocks(path=path)))
    for ids in ([-3, 1], [0, 100], [2**30, -(2**30)]):
        index = jnp.asarray([ids] * 7, jnp.int32)
        out = ladder.run_kernel(fn, x, index, w.astype(BF16), gate_up, down)
        assert np.isfinite(np.asarray(out, np.float32)).all(), f"{path} {ids}: not finite ({rand})"


@pytest.mark.parametrize("case,path", QUANT_PATH_CASES, ids=[f"{c[0]}-{p}" for c, p in QUANT_PATH_CASES])
def test_quantized_experts_match_dequantized_reference(rand, case, path):
    """int8 / fp8 weights with per-output-channel scales, dequantized in VMEM by both paths' kernels, against the
    dense reference on the dequantized weights."""
    args, kw = _quantized_case(rand, case)
    x, index, w, gate_up_q, down_q, gate_up_scale, down_scale, gate_up_bias, down_bias = args
    out_axis = 2 if kw["weights_transposed"] else 1
    dequantized = (dequantize(gate_up_q, gate_up_scale, out_axis), dequantize(down_q, down_scale, out_axis))
    assert_clamps_bite((x, index, w, *dequantized, gate_up_bias, down_bias), kw)
    dtype = case[2]
    blocks = ladder.moe_blocks(
        path,
        gate_up_q,
        down_q,
        gate_up_bias,
        gate_layout=kw["gate_layout"],
        weights_transposed=kw["weights_transposed"],
    )
    if path == "grouped":  # a gate/up output tile that does not divide I (QUANT_CASES)
        blocks = ExpertsBlocks(path="grouped", gate_up=RaggedDotBlocks(forward=MatmulBlocks(tn=128)))
    fn = functools.partial(quantized_experts, blocks=blocks, **kw)
    ladder.assert_moe_path(fn, args, path)
    out = ladder.check_against_reference(
        jax.jit(fn),
        jax.jit(_quantized_reference(kw)),
        args,
        dtype=dtype,
        rand=rand,
        **(F32_TOL if dtype == F32 else {}),
    )
    assert out.shape == args[0].shape and out.dtype == dtype


def _widened_codes(codes_ref, bf16_ref, f32_ref):
    for ref in (bf16_ref, f32_ref):
        ref[...] = quantization.widen(codes_ref[...], ref.dtype).astype(F32) * quantization.widen_factor(
            codes_ref.dtype
        )


# e4m3fn read as e4m3b11 (v5e / v6e), cast as it is (v7x); on the chip its own generation's way
@pytest.mark.parametrize("generation", ladder.traced_generations(["v6e", "v7x"]))
def test_fp8_widening_is_exact_for_every_code(generation, monkeypatch):
    """Every one of the 256 float8_e4m3fn codes (subnormals, both zeros, both NaNs) widened in a kernel to bf16 and
    to f32, times widen_factor: XLA's conversion of the same codes, NaN exactly where it gives NaN."""
    monkeypatch.setenv("TPU_KERNELS_TARGET", generation)
    assert quantization.widen_factor(jnp.float8_e4m3fn) == (16.0 if generation in ("v5e", "v6e") else 1.0)
    codes = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8).reshape(8, 32), jnp.float8_e4m3fn)
    out = jax.ShapeDtypeStruct(codes.shape, F32)
    widened = ladder.run_kernel(jax.jit(lambda c: pl.pallas_call(_widened_codes, out_shape=(out, out))(c)), codes)
    expected = np.asarray(codes.astype(F32))
    assert int(np.isnan(expected).sum()) == 2 and int((expected == 0).sum()) == 2
    for got in widened:
        got = np.asarray(got)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_array_equal(got[~np.isnan(got)], expected[~np.isnan(expected)])


# Each weight dtype on v6e (int8 at Qwen3-30B-A3B's B = 64, fp8 at Gemma 4's, whose 352-column chunks select
# unaligned columns of the scale row), fp8 on v5e (no fp8 MXU there: the kernel's VPU cast compiles), int8 on v7x:
# the small-batch kernel. The grouped matmuls: test_quantized_grouped_matmuls_compile_for_tpu.
QUANT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QUANT_COMPILES = [("v6e", "int8", "qwen3-30b-a3b"), ("v6e", "fp8", "gemma4-26b-a4b"), ("v5e", "fp8", "qwen3-30b-a3b")]
QUANT_COMPILES += [("v7x", "fp8", "qwen3-30b-a3b")]


def _quantized_specs(model, weights, tokens):
    dims = MOE_MODELS[model]
    specs = _decode_specs(model, tokens)
    specs[3], specs[4] = (specs[3][0], QUANT_DTYPES[weights]), (specs[4][0], QUANT_DTYPES[weights])
    return specs + [((MOE_EXPERTS, 2 * dims["intermediate"]), F32), ((MOE_EXPERTS, dims["hidden"]), F32)]


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation,weights,model", QUANT_COMPILES, ids=[f"{g}-{w}-{m}" for g, w, m in QUANT_COMPILES])
def test_quantized_experts_compile_for_tpu(generation, weights, model):
    activation = MOE_MODELS[model]["activation"]
    specs = _quantized_specs(model, weights, 64)
    with jax.default_device(ladder.tpu_device(generation)):
        fn = functools.partial(quantized_experts, activation=activation)
        ladder.assert_moe_path(fn, [jax.ShapeDtypeStruct(*sd) for sd in specs], "small_batch")
    ladder.compile_for_tpu(
        quantized_experts,
        generation,
        *specs,
        min_kernels=2,
        label=f"experts_forward {model} {weights}",
        activation=activation,
    )


def _grouped_matmuls(x, int8_gate_up, gate_up_scale, fp8_down, down_scale, sizes):
    h = tk.ragged_dot(
        x, int8_gate_up, sizes, rhs_transposed=True, rhs_scale=gate_up_scale, gated="concatenated", activation="silu"
    )
    return tk.ragged_dot(h, fp8_down, sizes, rhs_transposed=True, rhs_scale=down_scale, row_scale=x[:, 0])


@pytest.mark.cpu_only
def test_quantized_grouped_matmuls_compile_for_tpu():
    """The grouped path's two matmuls at Qwen3-30B-A3B's 512 tokens x top-8 rows on v6e, int8 gate/up with the fused
    SiLU gating and fp8 down with the row scale (the whole grouped experts_forward compiles as the bf16 one does)."""
    dims = MOE_MODELS["qwen3-30b-a3b"]
    h, i, rows = dims["hidden"], dims["intermediate"], 512 * MOE_TOP_K
    ladder.compile_for_tpu(
        _grouped_matmuls,
        "v6e",
        ((rows, h), BF16),
        ((MOE_EXPERTS, 2 * i, h), jnp.int8),
        ((MOE_EXPERTS, 2 * i), F32),
        ((MOE_EXPERTS, h, i), jnp.float8_e4m3fn),
        ((MOE_EXPERTS, h), F32),
        ((MOE_EXPERTS,), jnp.int32),
        min_kernels=2,
        label="quantized grouped matmuls qwen3",
    )


# ------------------------------------------------------------------------------------------------ MXFP4 weights
def _mxfp4_weights(rand, experts, out, contraction):
    """Random MXFP4 blocks (every e2m1 code, -0 included) as transformers stores them, [E, out, K / 32, 16], and
    e8m0 scales around 2^-6."""
    blocks = rand.integers(0, 256, (experts, out, contraction // 32, 16), jnp.uint8)
    return blocks, rand.integers(118, 125, (experts, out, contraction // 32), jnp.uint8)


def test_mxfp4_experts_match_dequantized_reference(rand):
    """gpt-oss's experts (interleaved gate/up, biases, its clamped SwiGLU) on MXFP4 weights laid out by
    prepare_mxfp4_experts from gate/up in transformers' 4-D blocks and down packed 3-D, on both paths (both widen
    the blocks in VMEM; the small-batch kernel in two chunks of 64 intermediate columns, so that the second chunk's
    gate/up columns, their scale columns and down_proj's scale rows are the ones it selects), against the dense
    reference on the checkpoint's weights dequantized to f32. (The checkpoint's layout, converted on every call:
    test_ragged_dot.py and test_moe_torch.py.)"""
    tokens, experts, hidden, inter = 5, 4, 128, 128
    x = rand.normal((tokens, hidden), BF16)
    index, w = routing(rand, tokens, experts, 2, sentinels=2)
    (up_blocks, up_scales), (down_blocks, down_scales) = (
        _mxfp4_weights(rand, experts, *dims) for dims in ((2 * inter, hidden), (hidden, inter))
    )
    down_blocks = down_blocks.reshape(experts, hidden, inter // 2)
    biases = rand.normal((experts, 2 * inter), BF16), rand.normal((experts, hidden), BF16)
    kw = dict(activation=ClampedSwiGLU(limit=7.0, alpha=1.702), gate_layout="interleaved")
    prepared = tk.prepare_mxfp4_experts(up_blocks, up_scales, down_blocks, down_scales)
    assert [p.shape for p in prepared] == [(4, 64, 256), (4, 32, 256), (4, 64, 128), (4, 32, 128)]
    args = (x, index, w.astype(BF16), prepared[0], prepared[2], prepared[1], prepared[3], *biases)

    def reference(x, index, w, up_blocks, down_blocks, up_scales, down_scales, up_bias, down_bias):
        up, down = (mxfp4.dequantize_prepared(b, c) for b, c in ((up_blocks, up_scales), (down_blocks, down_scales)))
        out = experts_forward_reference(x, index, w, up, down, up_bias, down_bias, weights_transposed=False, **kw)
        return out, out

    assert bool(
        jnp.all(mxfp4.dequantize_prepared(prepared[2], prepared[3]) == mxfp4.dequantize(down_blocks, down_scales))
    )
    paths = {
        path: functools.partial(quantized_experts, weights_transposed=True, blocks=blocks, **kw)
        for path, blocks in (
            ("grouped", ExpertsBlocks(path="grouped")),
            ("small_batch", ExpertsBlocks(path="small_batch", chunk=64)),
        )
    }
    for path, fn in paths.items():
        ladder.assert_moe_path(fn, args, path)

    def both(*args):
        return tuple(fn(*args) for fn in paths.values())

    # Kernel and reference both round the clamped SwiGLU's intermediate (up to 56 in magnitude) to bf16, but from f32
    # sums in different orders: one that lands on the other side of a rounding boundary moves by a bf16 ulp (<= 2^-7 of
    # it) through its down_proj weights (seed 3175825721: one of 640 outputs 0.031 against 0.014). So bf16's tolerance
    # holds for all but 1 % of the outputs, and every output is within it plus one such flip of the largest
    # intermediate through the largest down_proj weight.
    up_f32, down_f32 = (
        mxfp4.dequantize_prepared(b, c) for b, c in ((prepared[0], prepared[1]), (prepared[2], prepared[3]))
    )
    h = jnp.einsum("th,eih->eti", x.astype(jnp.float32), up_f32) + biases[0].astype(jnp.float32)[:, None]
    act = gating_reference(*gate_and_up(h, "interleaved"), kw["activation"])
    flip = 2.0**-7 * float(jnp.max(jnp.abs(act))) * float(jnp.max(jnp.abs(down_f32)))
    actual = ladder.run_kernel(jax.jit(both), *args)
    expected = ladder.run_reference(jax.jit(reference), *args)[0]
    for path, out in zip(paths, actual):
        ladder.assert_close(out, expected, dtype=BF16, atol=0.016 + flip, what=path, context=repr(rand))
        error = np.abs(np.asarray(out, np.float32) - np.asarray(expected, np.float32))
        outside = np.mean(error > 0.016 + 0.016 * np.abs(np.asarray(expected, np.float32)))
        assert outside <= 0.01, (path, f"{outside:.2%} of outputs outside bf16's tolerance", rand)


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_mxfp4_experts_compile_for_tpu(generation):
    """gpt-oss-20b's experts (H = I = 2880, 32 experts, top-4) on MXFP4 weights as prepare_mxfp4_experts lays them
    out, at 64 tokens on every generation (v5e's 128-wide MXUs lower the widened blocks' matmuls differently, v7x
    has the least VMEM), on both paths in one program (one compile): the grouped matmuls, their blocks widened whole
    along K (2880 codes, 90 scales a column), and the small-batch kernel (chunks of down_proj's packed rows, the
    expert's 96 scale rows whole); at the table's tiling on v7x, whose VMEM bounds it (the grouped path's output
    width a step, MXFP4_TN, and the small-batch chunk), and at 256 columns / a chunk of 64 on v5e / v6e (the same
    code at a fraction of the compile time: their 128 MiB of VMEM fit what v7x's 64 fit). No copy of the weights in
    the program: XLA's cost analysis has it access under 3x the bytes its arguments hold, for two reads of them
    (a copy of the blocks would add twice their bytes: 1.9x a path). XLA's memory-space assignment prefetches the
    grouped path's scales into VMEM before the kernels, and its cost analysis counts that and the activations'
    relayout into the planes' column order: 1.47x for the grouped path alone on v6e."""
    shapes = _gpt_oss_mxfp4_shapes(64)
    narrow = RaggedDotBlocks(forward=MatmulBlocks(tn=256))
    grouped = (
        ExpertsBlocks(path="grouped")
        if generation == "v7x"
        else ExpertsBlocks(path="grouped", gate_up=narrow, down=narrow)
    )
    small = ExpertsBlocks(path="small_batch", chunk=None if generation == "v7x" else 64)
    kw = dict(activation=ClampedSwiGLU(limit=7.0, alpha=1.702), gate_layout="interleaved", weights_transposed=True)

    def fn(*args):
        return tuple(quantized_experts(*args, blocks=b, **kw) for b in (grouped, small))

    with jax.default_device(ladder.tpu_device(generation)):
        lowered = jax.jit(fn).lower(*(ladder.tpu_spec(generation, *sd) for sd in shapes))
        compiled = lowered.compile()
    text = lowered.as_text()
    assert text.count("tpu_custom_call") >= 4 and all(k in text for k in ladder.MOE_PATH_KERNELS.values())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    arguments = compiled.memory_analysis().argument_size_in_bytes
    assert cost["bytes accessed"] < 3 * arguments, f"{cost['bytes accessed']} bytes for {arguments}: a copy?"


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


@pytest.mark.cpu_only
def test_export_for_tpu():
    spec = jax.ShapeDtypeStruct
    args = [spec(*sd) for sd in _decode_specs("qwen3-30b-a3b", 64)]
    ladder.export_for_tpu(api.experts_forward, *args, activation="silu")
    ladder.export_for_tpu(api.experts_forward, *args, activation="gelu_tanh", gate_layout="interleaved")
    biases = (spec((MOE_EXPERTS, 2 * 768), BF16), spec((MOE_EXPERTS, 2048), BF16))
    ladder.export_for_tpu(api.experts_forward, *args, *biases, activation="silu")
    grad = jax.grad(lambda *a: ladder.vjp_loss(api.experts_forward(*a, activation="silu")), argnums=(0, 2, 3, 4))
    ladder.export_for_tpu(grad, *args)
    # the grouped path with the combine kernel, forward and gradient
    combined = functools.partial(api.experts_forward, blocks=ExpertsBlocks(path="grouped", combine="kernel"))
    ladder.export_for_tpu(combined, *args)
    ladder.export_for_tpu(jax.grad(lambda *a: ladder.vjp_loss(combined(*a)), argnums=(0, 2)), *args)


# gpt-oss-20b's experts: hidden 2880, intermediate 2880 (not a multiple of 128: the grouped path's gate/up output
# tile is the whole width), 32 experts, top-4, [E, H, 2I] interleaved with biases, the clamped SwiGLU.
GPT_OSS_20B = dict(hidden=2880, intermediate=2880, experts=32, top_k=4)


def _gpt_oss_specs(tokens):
    h, i, e, k = (GPT_OSS_20B[f] for f in ("hidden", "intermediate", "experts", "top_k"))
    return [
        ((tokens, h), BF16),
        ((tokens, k), jnp.int32),
        ((tokens, k), BF16),
        ((e, h, 2 * i), BF16),
        ((e, i, h), BF16),
        ((e, 2 * i), BF16),
        ((e, h), BF16),
    ]


GPT_OSS_KW = dict(activation=ClampedSwiGLU(limit=7.0, alpha=1.702), gate_layout="interleaved", weights_transposed=True)


@pytest.mark.cpu_only
@pytest.mark.parametrize("tokens,path", [(8, "small_batch"), (512, "grouped")])
def test_gpt_oss_experts_compile_for_tpu(tokens, path):
    """gpt-oss-20b's experts on v6e, the table's path at a decode batch (the small-batch kernel) and at 512 tokens
    (the grouped matmuls): the de-interleave and the clamped SwiGLU in both kernels' epilogues compile with Mosaic."""
    specs = [jax.ShapeDtypeStruct(*sd) for sd in _gpt_oss_specs(tokens)]
    with jax.default_device(ladder.tpu_device("v6e")):
        ladder.assert_moe_path(functools.partial(api.experts_forward, **GPT_OSS_KW), specs, path)
    ladder.compile_for_tpu(
        api.experts_forward,
        "v6e",
        *_gpt_oss_specs(tokens),
        min_kernels=2,
        label="experts_forward gpt-oss-20b",
        **GPT_OSS_KW,
    )


@pytest.mark.cpu_only
def test_gpt_oss_experts_backward_exports_for_tpu():
    """The gradient of gpt-oss's experts (the grouped kernels' backward through the clamped SwiGLU) for the TPU."""
    grad = jax.grad(lambda *a: ladder.vjp_loss(api.experts_forward(*a, **GPT_OSS_KW)), argnums=(0, 2, 3, 4, 5, 6))
    ladder.export_for_tpu(grad, *[jax.ShapeDtypeStruct(*sd) for sd in _gpt_oss_specs(8)])


# ------------------------------------------------------------------------------------------------ rung 3
# The quick benchmark's decode batches on v6e (the generation the benchmarks model: 1, 8, 64, 256; the batches between
# take the same path and kernels); on v5e and v7x the smallest batch (the small-batch kernel, whose chunk follows the
# model) for both models and the largest (the grouped path there: past their thresholds) for Qwen3 only: Gemma 4's
# grouped matmuls compile on v5e and v7x at their VMEM-heaviest tile in test_ragged_dot.py's prefill shapes, and the
# XLA routing and combine around them are the same ops at other sizes.
DECODE = [
    (generation, model, tokens)
    for generation in ladder.GENERATIONS
    for model in MOE_MODELS
    for tokens in RAGGED_DOT_DECODE_TOKENS
    if (generation == "v6e" and tokens in RAGGED_DOT_QUICK_TOKENS)
    or tokens == min(RAGGED_DOT_DECODE_TOKENS)
    or (tokens == max(RAGGED_DOT_DECODE_TOKENS) and model == "qwen3-30b-a3b")
]


@pytest.mark.cpu_only
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
