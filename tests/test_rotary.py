"""Rotary embeddings, JAX side, up the ladder: reference vs kernel (interpret mode) for apply_rotary, its backward,
fused per-head RMSNorm + RoPE and cos/sin from positions; gradients; bad input; TPU export; deviceless compile for
v5e / v6e / v7x at the benchmark shapes (Qwen3-30B-A3B and Gemma 4 attention, decode and prefill)."""

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest

from benchmarks.shapes import ROTARY_DECODE_BATCHES, ROTARY_MODELS, ROTARY_PREFILL_SEQS
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.rotary import api, frequencies, reference, tuning

F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.fixture(params=["tuned_blocks", "small_blocks"])
def block_regime(request, monkeypatch):
    """Tuned blocks, and tiny ones so grids of many steps and ragged last blocks are covered at test sizes."""
    if request.param == "small_blocks":
        monkeypatch.setattr(tuning, "TARGET_BLOCK_BYTES", {g: 1 for g in tuning.TARGET_BLOCK_BYTES})
        monkeypatch.setattr(tuning, "MIN_BLOCK_BYTES", 1)
    return request.param


def _shapes(layout, batch, seq, hq, hk, head_dim):
    if layout == "bhsd":
        return (batch, hq, seq, head_dim), (batch, hk, seq, head_dim)
    return (batch, seq, hq, head_dim), (batch, seq, hk, head_dim)


# (id, layout, batch, seq, q heads, k heads, head_dim, rotary_dim, interleaved, dtype, cos dtype, cos batch)
CASES = [
    ("qwen3-like", "bhsd", 2, 24, 4, 2, 128, 128, False, BF16, BF16, 1),
    ("bshd-f32-cos", "bshd", 3, 17, 4, 1, 128, 128, False, BF16, F32, 3),
    ("decode-bhsd", "bhsd", 5, 1, 8, 2, 128, 128, False, BF16, BF16, 5),
    ("interleaved", "bhsd", 2, 20, 3, 3, 128, 128, True, F32, F32, 2),
    ("interleaved-bshd-d64", "bshd", 2, 9, 2, 4, 64, 64, True, BF16, BF16, 1),
    ("partial-aligned", "bshd", 2, 12, 4, 2, 512, 128, False, BF16, BF16, 1),  # Gemma-4-full-like prefix
    ("partial-padded", "bhsd", 2, 16, 2, 1, 128, 64, False, F32, F32, 2),  # GPT-NeoX-like rotary_pct 0.5
    ("partial-interleaved", "bhsd", 1, 8, 2, 2, 128, 32, True, F32, BF16, 1),
]
# Multi-step grids with ragged last blocks: these cases run again with tiny blocks.
SMALL_BLOCK_CASES = ("bshd-f32-cos", "partial-padded")


REGIME_CASES = [(c, "tuned_blocks") for c in CASES] + [(c, "small_blocks") for c in CASES if c[0] in SMALL_BLOCK_CASES]


@pytest.mark.parametrize(
    "case,block_regime", REGIME_CASES, ids=[f"{c[0]}-{r}" for c, r in REGIME_CASES], indirect=["block_regime"]
)
def test_apply_rotary_matches_reference(rand, block_regime, case):
    _, layout, batch, seq, hq, hk, head_dim, rotary_dim, interleaved, dtype, cos_dtype, cos_batch = case
    q_shape, k_shape = _shapes(layout, batch, seq, hq, hk, head_dim)
    q, k = rand.normal(q_shape, dtype, scale=2.0), rand.normal(k_shape, dtype)
    cos, sin = (
        rand.normal((cos_batch, seq, rotary_dim), cos_dtype),
        rand.normal((cos_batch, seq, rotary_dim), cos_dtype),
    )
    kw = dict(interleaved=interleaved, layout=layout)
    ladder.check_against_reference(
        lambda q, k, c, s: tk.apply_rotary(q, k, c, s, **kw),
        jax.jit(lambda q, k, c, s: reference.apply_rotary_reference(q, k, c, s, **kw)),
        (q, k, cos, sin),
        dtype=dtype,
        rand=rand,
        names=["q", "k"],
    )


def test_transformers_tables_rotate_as_the_formula(rand):
    """With transformers' own tables (cat(freqs, freqs)) the result is a rotation of each pair: norms are kept.
    Also: k may be None."""
    q = rand.normal((1, 2, 8, 128))
    cos, sin = api.rope_cos_sin(rand.integers(0, 5000, (1, 8)), head_dim=128, theta=1e6)
    out, out_k = ladder.run_interpreted(tk.apply_rotary, q, None, cos, sin)
    assert out_k is None
    ladder.assert_close(out, reference.rotate_reference(q, cos, sin), dtype=F32)
    pairs = lambda x: x[..., :64] ** 2 + x[..., 64:] ** 2  # noqa: E731
    ladder.assert_close(pairs(out), pairs(q), dtype=F32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [CASES[6]], ids=lambda c: c[0])
def test_apply_rotary_gradients(rand, case):
    _, layout, batch, seq, hq, hk, head_dim, rotary_dim, interleaved, dtype, cos_dtype, cos_batch = case
    q_shape, k_shape = _shapes(layout, batch, seq, hq, hk, head_dim)
    args = (
        rand.normal(q_shape, dtype),
        rand.normal(k_shape, dtype),
        rand.normal((cos_batch, seq, rotary_dim), cos_dtype),
        rand.normal((cos_batch, seq, rotary_dim), cos_dtype),
    )
    kw = dict(interleaved=interleaved, layout=layout)
    cot = rand.cotangents(lambda *a: reference.apply_rotary_reference(*a, **kw), *args)
    kernel_grad = jax.grad(lambda *a: ladder.vjp_loss(tk.apply_rotary(*a, **kw), cot), argnums=(0, 1, 2, 3))
    ref_grad = jax.grad(
        lambda *a: ladder.vjp_loss(reference.apply_rotary_reference(*a, **kw), cot), argnums=(0, 1, 2, 3)
    )
    actual = ladder.run_interpreted(jax.jit(kernel_grad), *args)
    expected = ref_grad(*args)
    # cos/sin gradients sum over heads (and the shared batch): a bf16 input carries its rounding into that sum.
    for name, a, e in zip(["d q", "d k", "d cos", "d sin"], actual, expected):
        ladder.assert_close(a, e, dtype=dtype, atol=6e-2 if dtype == BF16 else 1e-4, what=name, context=repr(rand))


@pytest.mark.parametrize("interleaved", [True])
def test_backward_is_the_rotation_by_minus_sin(rand, interleaved):
    """RoPE is linear; for tables whose pair halves agree (all transformers tables) its transpose is the rotation by
    -sin. apply_rotary_backward computes grad * cos - R(grad * sin), which is that."""
    gq, gk = rand.normal((2, 4, 24, 128)), rand.normal((2, 2, 24, 128))
    cos, sin = api.rope_cos_sin(rand.integers(0, 100000, (2, 24)), head_dim=128, theta=1e4, interleaved=interleaved)
    actual = ladder.run_interpreted(lambda *a: tk.apply_rotary_backward(*a, interleaved=interleaved), gq, gk, cos, sin)
    expected = reference.apply_rotary_reference(gq, gk, cos, -sin, interleaved=interleaved)
    for a, e in zip(actual, expected):
        ladder.assert_close(a, e, dtype=F32, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ fused RMSNorm + RoPE
NORM_CASES = [
    ("qwen3-bhsd-bf16", "bhsd", 2, 24, 4, 2, 128, 128, BF16, 0.0),
    ("gemma4-sliding-bshd-f32", "bshd", 2, 9, 4, 2, 256, 256, F32, 0.0),
    ("gemma4-full-partial", "bshd", 1, 5, 2, 1, 512, 128, BF16, 0.0),
    ("decode-offset", "bhsd", 7, 1, 4, 2, 128, 128, F32, 1.0),
    # bf16 at head_dim 128 with whole sublane groups of heads: q's row sums on the MXU, k's (2 heads) cross-lane.
    ("decode-bf16-mxu", "bhsd", 6, 1, 8, 2, 128, 128, BF16, 1.0),
    ("partial-padded-bf16", "bhsd", 1, 16, 2, 1, 128, 64, BF16, 0.0),  # lanes >= 64 pass through, normalised
]


@pytest.mark.parametrize("case", NORM_CASES, ids=[c[0] for c in NORM_CASES])
def test_rms_norm_rope_matches_reference(rand, case):
    _, layout, batch, seq, hq, hk, head_dim, rotary_dim, dtype, offset = case
    q_shape, k_shape = _shapes(layout, batch, seq, hq, hk, head_dim)
    q, k = rand.normal(q_shape, dtype, scale=3.0, offset=0.5), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((head_dim,), dtype), rand.normal((head_dim,), F32)
    cos, sin = api.rope_cos_sin(rand.integers(0, 40000, (1, seq)), head_dim=head_dim, theta=1e6, rotary_dim=rotary_dim)
    cos, sin = cos.astype(dtype), sin.astype(dtype)
    kw = dict(eps=1e-6, weight_offset=offset, layout=layout)
    ladder.check_against_reference(
        lambda *a: tk.rms_norm_rope(*a, **kw),
        jax.jit(lambda *a: reference.rms_norm_rope_reference(*a, **kw)),
        (q, k, qw, kw_, cos, sin),
        dtype=dtype,
        rand=rand,
        names=["q", "k"],
    )


@pytest.mark.parametrize("dtype", [F32], ids=lambda d: jnp.dtype(d).name)
def test_rms_norm_rope_gradients(rand, dtype):
    q, k = rand.normal((2, 4, 16, 128), dtype, scale=2.0), rand.normal((2, 2, 16, 128), dtype)
    qw, kw_ = rand.normal((128,), dtype), rand.normal((128,), dtype)
    cos, sin = rand.normal((1, 16, 128), dtype), rand.normal((1, 16, 128), dtype)
    args = (q, k, qw, kw_, cos, sin)
    cot = rand.cotangents(lambda *a: reference.rms_norm_rope_reference(*a, eps=1e-5), *args)
    kernel_grad = jax.grad(lambda *a: ladder.vjp_loss(tk.rms_norm_rope(*a, eps=1e-5), cot), argnums=tuple(range(6)))
    ref_grad = jax.grad(
        lambda *a: ladder.vjp_loss(reference.rms_norm_rope_reference(*a, eps=1e-5), cot), argnums=tuple(range(6))
    )
    actual = ladder.run_interpreted(jax.jit(kernel_grad), *args)
    expected = ref_grad(*args)
    for name, a, e in zip(["d q", "d k", "d q_weight", "d k_weight", "d cos", "d sin"], actual, expected):
        atol = 1e-1 if dtype == BF16 else 2e-4
        if name.endswith("_weight") and dtype != BF16:
            # A sum over every token and head of terms up to ~100: f32 rounding in a different summation order is
            # relative to the terms, not to a small (cancelled) sum (seed 2787238278: 4e-4 off at 1.26, terms ~69).
            atol += 2e-5 * float(jnp.max(jnp.abs(e)))
        ladder.assert_close(
            a, e, dtype=dtype, atol=atol, rtol=5e-2 if dtype == BF16 else 1e-4, what=name, context=repr(rand)
        )


# --------------------------------------------------------------------------------------------- cos/sin in-kernel
SCALINGS = [
    ("default", None, 128),
    (
        "llama3",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        128,
    ),
    (
        "yarn-partial",
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "beta_fast": 16},
        64,
    ),
    ("proportional", {"rope_type": "proportional", "partial_rotary_factor": 0.25}, None),
]


@pytest.mark.parametrize("case", SCALINGS, ids=[c[0] for c in SCALINGS])
def test_apply_rotary_from_positions_matches_reference(rand, case):
    _, scaling, rotary_dim = case
    head_dim, theta = 128, 1e6
    q, k = rand.normal((2, 4, 16, head_dim)), rand.normal((2, 2, 16, head_dim))
    positions = rand.integers(0, 60000, (2, 16))
    kw = dict(theta=theta, rotary_dim=rotary_dim, scaling=scaling)
    cos, sin = api.rope_cos_sin(positions, head_dim=head_dim, **kw)
    # Angles are the same f32 products; the kernel's cos/sin implementation may differ from XLA's in the last bits,
    # amplified by angles up to ~6e4 rad.
    ladder.check_against_reference(
        lambda q, k, p: tk.apply_rotary_from_positions(q, k, p, **kw),
        lambda q, k, p: reference.apply_rotary_reference(q, k, cos, sin),
        (q, k, positions),
        dtype=F32,
        rand=rand,
        rtol=1e-4,
        atol=1e-4,
        names=["q", "k"],
    )


@pytest.mark.parametrize("factor,angle_lanes", [(0.25, 128), (0.75, 256)])
def test_proportional_zero_frequencies_skip_transcendentals(rand, monkeypatch, factor, angle_lanes):
    """Gemma 4's full layers (head_dim 512, proportional partial rotary): frequencies past partial_rotary_factor are 0,
    so the kernel evaluates cos/sin only on the lanes that hold a nonzero one (cos 1, sin 0 past them); decode and
    prefill, fused norm and plain rope, against the reference on XLA's tables, and the lanes it evaluated."""
    kernel, seen = api.kernel, []
    original = kernel._cos_sin
    monkeypatch.setattr(
        kernel,
        "_cos_sin",
        lambda pos, inv, cfg, packing: (
            seen.append((packing, cfg.angle_lanes, inv.shape[-1])) or original(pos, inv, cfg, packing)
        ),
    )
    jax.clear_caches()
    opts = dict(theta=1e6, scaling={"rope_type": "proportional", "partial_rotary_factor": factor})
    for batch, seq in ((12, 1), (1, 40)):
        q, k = rand.normal((batch, 4, seq, 512), F32), rand.normal((batch, 2, seq, 512), F32)
        qw, kw_ = rand.normal((512,), F32), rand.normal((512,), F32)
        positions = rand.integers(0, 40000, (batch, seq) if seq == 1 else (1, seq))
        cos, sin = api.rope_cos_sin(positions, head_dim=512, **opts)
        tol = dict(rtol=1e-4, atol=1e-3)  # f32 angles up to 4e4 rad: cos/sin implementations differ in the last bits
        ladder.check_against_reference(
            lambda *a: tk.rms_norm_rope_from_positions(*a, eps=1e-6, **opts),
            lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(q, k, qw, kw_, cos, sin, eps=1e-6),
            (q, k, qw, kw_, positions),
            dtype=F32,
            rand=rand,
            names=["q", "k"],
            **tol,
        )
        ladder.check_against_reference(
            lambda q, k, p: tk.apply_rotary_from_positions(q, k, p, **opts),
            lambda q, k, p: reference.apply_rotary_reference(q, k, cos, sin),
            (q, k, positions),
            dtype=F32,
            rand=rand,
            names=["q", "k"],
            **tol,
        )
    jax.clear_caches()
    assert seen and set(seen) == {("lanes", angle_lanes, 512)}, f"(packing, angle lanes, table width): {seen}"
    if factor != 0.25:
        return
    for generation in ladder.GENERATIONS:  # rung 3, Gemma 4 full's decode batch
        ladder.compile_for_tpu(
            lambda q, k, w, p: api.rms_norm_rope_from_positions(q, k, w, w, p, **opts),
            generation,
            ((256, 16, 1, 512), BF16),
            ((256, 2, 1, 512), BF16),
            ((512,), BF16),
            ((256, 1), jnp.int32),
            label="proportional zero-frequency tail",
        )


@pytest.mark.parametrize("layout,interleaved,dtype", [("bshd", True, BF16)])
def test_from_positions_layouts_norm_and_gradients(rand, layout, interleaved, dtype):
    q_shape, k_shape = _shapes(layout, 3, 8, 4, 2, 256)
    q, k = rand.normal(q_shape, dtype), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((256,), F32), rand.normal((256,), F32)
    positions = rand.integers(0, 1000, (1, 8))
    opts = dict(theta=1e4, interleaved=interleaved, layout=layout)
    cos, sin = api.rope_cos_sin(positions, head_dim=256, theta=1e4, interleaved=interleaved)
    ladder.check_against_reference(
        lambda *a: tk.rms_norm_rope_from_positions(*a, eps=1e-6, **opts),
        lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(
            q, k, qw, kw_, cos, sin, eps=1e-6, interleaved=interleaved, layout=layout
        ),
        (q, k, qw, kw_, positions),
        dtype=dtype,
        rand=rand,
        names=["q", "k"],
    )

    def rotated(q, k):
        return reference.apply_rotary_reference(q, k, cos, sin, interleaved=interleaved, layout=layout)

    cot = rand.cotangents(rotated, q, k)
    grad = jax.grad(
        lambda q, k: ladder.vjp_loss(tk.apply_rotary_from_positions(q, k, positions, **opts), cot), argnums=(0, 1)
    )
    ref = jax.grad(lambda q, k: ladder.vjp_loss(rotated(q, k), cot), argnums=(0, 1))
    for name, a, e in zip(["d q", "d k"], ladder.run_interpreted(jax.jit(grad), q, k), ref(q, k)):
        ladder.assert_close(a, e, dtype=dtype, atol=5e-2 if dtype == BF16 else 1e-4, what=name, context=repr(rand))


# Token-major blocks (bshd, and every decode batch) take their per-token factor rows by broadcast loads from VMEM up to
# kernel.BROADCAST_LOAD_MAX_TOKENS tokens a block, in registers above it: both paths, forced, on the cases that
# stress them (blocks of several sequences with their own or a shared table, a lane-aligned rotary prefix, q's row
# sums on the MXU, ragged multi-step grids).
# (id, op, layout, batch, seq, q heads, k heads, head_dim, rotary_dim, dtype, small blocks)
FACTOR_ROW_CASES = [
    ("apply-per-sequence-table", "apply", "bshd", 3, 9, 2, 4, 128, 128, F32, False),
    ("norm-partial-prefix", "norm", "bshd", 2, 5, 2, 1, 512, 128, BF16, False),
    ("positions-decode-mxu", "positions", "bhsd", 6, 1, 8, 2, 128, 128, BF16, False),
    ("positions-ragged-steps", "positions", "bshd", 1, 40, 4, 2, 256, 256, F32, True),
]


@pytest.mark.parametrize("factor_rows", ["broadcast_loads", "in_registers"])
@pytest.mark.parametrize("case", FACTOR_ROW_CASES, ids=[c[0] for c in FACTOR_ROW_CASES])
def test_token_major_factor_rows(rand, monkeypatch, case, factor_rows):
    _, op, layout, batch, seq, hq, hk, head_dim, rotary_dim, dtype, small_blocks = case
    kernel = api.kernel
    monkeypatch.setattr(kernel, "BROADCAST_LOAD_MAX_TOKENS", 1 << 20 if factor_rows == "broadcast_loads" else 0)
    seen = _record_results(monkeypatch, kernel, "uses_broadcast_loads")
    if small_blocks:
        monkeypatch.setattr(tuning, "TARGET_BLOCK_BYTES", {g: 1 for g in tuning.TARGET_BLOCK_BYTES})
        monkeypatch.setattr(tuning, "MIN_BLOCK_BYTES", 1)
    jax.clear_caches()  # the path is chosen at trace time
    q_shape, k_shape = _shapes(layout, batch, seq, hq, hk, head_dim)
    q, k = rand.normal(q_shape, dtype, scale=2.0, offset=0.5), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((head_dim,), dtype), rand.normal((head_dim,), F32)
    positions = rand.integers(0, 40000, (batch, seq) if seq == 1 else (1, seq))
    cos, sin = api.rope_cos_sin(positions, head_dim=head_dim, theta=1e4, rotary_dim=rotary_dim)
    ref_kw = dict(layout=layout)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == F32 else {}
    if op == "apply":
        cos, sin = rand.normal((batch, seq, rotary_dim), dtype), rand.normal((batch, seq, rotary_dim), dtype)
        ladder.check_against_reference(
            lambda q, k, c, s: tk.apply_rotary(q, k, c, s, layout=layout),
            lambda q, k, c, s: reference.apply_rotary_reference(q, k, c, s, **ref_kw),
            (q, k, cos, sin),
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
            **tol,
        )
    elif op == "norm":
        cos, sin = cos.astype(dtype), sin.astype(dtype)
        ladder.check_against_reference(
            lambda *a: tk.rms_norm_rope(*a, eps=1e-6, layout=layout),
            lambda *a: reference.rms_norm_rope_reference(*a, eps=1e-6, **ref_kw),
            (q, k, qw, kw_, cos, sin),
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
        )
    else:
        ladder.check_against_reference(
            lambda *a: tk.rms_norm_rope_from_positions(*a, eps=1e-6, theta=1e4, rotary_dim=rotary_dim, layout=layout),
            lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(q, k, qw, kw_, cos, sin, eps=1e-6, **ref_kw),
            (q, k, qw, kw_, positions),
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
            **tol,
        )
    jax.clear_caches()
    assert seen and set(seen) == {factor_rows == "broadcast_loads"}, f"broadcast loads used: {seen}"


@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_token_major_factor_rows_compile_for_tpu(monkeypatch, generation):
    """Rung 3 for both factor-row paths: Qwen3's fused norm + rope from positions in bshd at prefill (128-token
    blocks: the unrolled broadcast-load body at its benchmark size) and at a 256-token decode batch."""
    kernel = api.kernel
    seen = _record_results(monkeypatch, kernel, "uses_broadcast_loads")
    w, op = ((128,), BF16), lambda q, k, w, p: api.rms_norm_rope_from_positions(q, k, w, w, p, theta=1e6, layout="bshd")
    for limit in (kernel.BROADCAST_LOAD_MAX_TOKENS, 0):
        monkeypatch.setattr(kernel, "BROADCAST_LOAD_MAX_TOKENS", limit)
        for batch, seq in ((1, 2048), (256, 1)):
            jax.clear_caches()
            seen.clear()
            q, k = ((batch, seq, 32, 128), BF16), ((batch, seq, 4, 128), BF16)
            ladder.compile_for_tpu(
                op,
                generation,
                q,
                k,
                w,
                ((batch, seq) if seq > 1 else (batch, 1), jnp.int32),
                label=f"factor rows {'broadcast loads' if limit else 'in registers'}",
            )
            assert seen == [bool(limit)], f"broadcast loads used at {(batch, seq)} with limit {limit}: {seen}"
    jax.clear_caches()


# How the kernel reads positions and packs cos/sin (kernel.PositionsLayout): each case forces a token block and asserts
# the layout it reached, so a tuning change cannot silently stop covering one.
# (id, layout, batch, seq, positions rows, head_dim, rotary_dim, interleaved, norm, dtype, block_seq, mode, packing)
POSITION_LAYOUTS = [
    ("row-blocks-rows-ragged", "bhsd", 1, 320, 1, 128, None, False, True, BF16, 128, "row_blocks", "rows"),
    ("row-select-chunks-decode", "bhsd", 256, 1, 256, 128, None, False, True, BF16, 32, "row_select", "none"),
    ("row-select-rows-decode", "bhsd", 256, 1, 256, 128, None, False, True, BF16, 64, "row_select", "rows"),
    ("row-select-lanes-decode", "bshd", 128, 1, 128, 256, None, False, False, F32, 64, "row_select", "lanes"),
    ("row-blocks-interleaved", "bshd", 1, 256, 1, 128, None, True, False, F32, 128, "row_blocks", "none"),
    ("row-blocks-lanes-whole-seq", "bhsd", 2, 128, 1, 256, None, False, True, F32, 128, "row_blocks", "lanes"),
    ("column-rows-per-sequence", "bshd", 2, 128, 2, 128, None, False, True, F32, 128, "column", "rows"),
    ("row-select-partial-rotary", "bhsd", 1, 48, 1, 128, 64, False, False, F32, 16, "row_select", "none"),
    ("row-select-decode-ragged", "bhsd", 200, 1, 200, 128, None, False, False, F32, 32, "row_select", "none"),
    ("row-select-decode-one-step", "bshd", 8, 1, 8, 256, None, True, True, BF16, 8, "row_select", "none"),
    ("column-long-ragged", "bshd", 1, 600, 1, 128, None, False, False, F32, 32, "column", "none"),
    ("row-blocks-rows-proportional", "bhsd", 1, 256, 1, 512, 128, False, True, BF16, 128, "row_blocks", "rows"),
]


def _force_positions_blocks(monkeypatch, block_seq):
    """Token blocks of block_seq (one sequence each) for the next kernel calls; returns the PositionsLayouts they
    reach (appended as each call traces)."""
    original_blocks = tuning.choose_blocks

    def forced_blocks(**kwargs):
        blocks = original_blocks(**kwargs)
        return tuning.RotaryBlocks(block_batch=1, block_seq=block_seq, vmem_limit_bytes=blocks.vmem_limit_bytes)

    monkeypatch.setattr(tuning, "choose_blocks", forced_blocks)
    return _record_results(monkeypatch, api.kernel, "positions_layout")


def _record_results(monkeypatch, module, name):
    """Wrap module.name for this test; returns the list of its results, appended as each call traces."""
    seen, original = [], getattr(module, name)

    def recording(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(module, name, recording)
    return seen


def _position_layout_op(norm, layout, rotary_dim, interleaved):
    opts = dict(theta=1e4, interleaved=interleaved, rotary_dim=rotary_dim, layout=layout)
    if norm:
        return lambda q, k, qw, kw_, p: api.rms_norm_rope_from_positions(q, k, qw, kw_, p, eps=1e-6, **opts)
    return lambda q, k, p: api.apply_rotary_from_positions(q, k, p, **opts)


@pytest.mark.parametrize("case", POSITION_LAYOUTS, ids=[c[0] for c in POSITION_LAYOUTS])
def test_positions_layouts_and_cos_sin_packing(rand, monkeypatch, case):
    _, layout, batch, seq, rows, head_dim, rotary_dim, interleaved, norm, dtype, ts, mode, packing = case
    seen = _force_positions_blocks(monkeypatch, ts)
    q_shape, k_shape = _shapes(layout, batch, seq, 4, 2, head_dim)
    q, k = rand.normal(q_shape, dtype), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((head_dim,), F32), rand.normal((head_dim,), F32)
    positions = rand.integers(0, 40000, (rows, seq) if seq > 1 else (rows, 1))
    cos, sin = api.rope_cos_sin(positions, head_dim=head_dim, theta=1e4, interleaved=interleaved, rotary_dim=rotary_dim)
    ref_kw = dict(interleaved=interleaved, layout=layout)
    op = _position_layout_op(norm, layout, rotary_dim, interleaved)
    if norm:
        ladder.check_against_reference(
            op,
            lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(q, k, qw, kw_, cos, sin, eps=1e-6, **ref_kw),
            (q, k, qw, kw_, positions),
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
            **(dict(rtol=1e-4, atol=1e-3) if dtype == F32 else {}),
        )
    else:
        ladder.check_against_reference(
            op,
            lambda q, k, p: reference.apply_rotary_reference(q, k, cos, sin, **ref_kw),
            (q, k, positions),
            dtype=dtype,
            rand=rand,
            rtol=1e-4,
            atol=1e-4,
            names=["q", "k"],
        )
    assert seen and {(s.mode, s.packing) for s in seen} == {(mode, packing)}, f"layouts reached: {seen}"


@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_positions_layouts_compile_for_tpu(monkeypatch, generation):
    """Rung 3 for every positions layout and cos/sin packing (row transposes, lane selects, packed rows), each at
    its forced block, on every generation."""
    for (
        _,
        layout,
        batch,
        seq,
        rows,
        head_dim,
        rotary_dim,
        interleaved,
        norm,
        dtype,
        ts,
        mode,
        packing,
    ) in POSITION_LAYOUTS:
        seen = _force_positions_blocks(monkeypatch, ts)
        q_shape, k_shape = _shapes(layout, batch, seq, 4, 2, head_dim)
        args = [(q_shape, dtype), (k_shape, dtype)] + ([((head_dim,), F32)] * 2 if norm else [])
        args.append(((rows, seq) if seq > 1 else (rows, 1), jnp.int32))
        ladder.compile_for_tpu(
            _position_layout_op(norm, layout, rotary_dim, interleaved),
            generation,
            *args,
            label=f"positions {mode}/{packing}",
        )
        assert {(s.mode, s.packing) for s in seen} == {(mode, packing)}, f"layouts reached: {seen}"
        monkeypatch.undo()


# ------------------------------------------------------------------------------------------------------ bad input
def _base(r):
    return dict(
        q=r.normal((2, 4, 8, 128)), k=r.normal((2, 2, 8, 128)), cos=r.normal((1, 8, 128)), sin=r.normal((1, 8, 128))
    )


BAD_INPUTS = [
    ("q rank", lambda r: dict(q=r.normal((2, 4, 128))), ValueError, "q: expected 4 dimensions"),
    ("q int", lambda r: dict(q=r.integers(0, 3, (2, 4, 8, 128))), TypeError, "q: expected dtype"),
    ("q float16", lambda r: dict(q=r.normal((2, 4, 8, 128), jnp.float16)), TypeError, "q: expected dtype"),
    ("q a list", lambda r: dict(q=[[1.0]]), TypeError, "q: expected a jax array, got list"),
    ("k dtype", lambda r: dict(k=r.normal((2, 2, 8, 128), BF16)), TypeError, "k: expected dtype"),
    ("k seq", lambda r: dict(k=r.normal((2, 2, 9, 128))), ValueError, "k: expected the batch, seq and head_dim of q"),
    ("k head_dim", lambda r: dict(k=r.normal((2, 2, 8, 64))), ValueError, "k: expected the batch, seq and head_dim"),
    (
        "odd rotary dim",
        lambda r: dict(cos=r.normal((1, 8, 65)), sin=r.normal((1, 8, 65))),
        ValueError,
        "rotary_dim (cos.shape[-1]): expected an even number > 0",
    ),
    (
        "rotary_dim > head_dim",
        lambda r: dict(cos=r.normal((1, 8, 256)), sin=r.normal((1, 8, 256))),
        ValueError,
        "rotary_dim (cos.shape[-1]): expected at most head_dim = 128, got 256",
    ),
    ("rotary_dim != cos", lambda r: dict(rotary_dim=64), ValueError, "rotary_dim: expected the width of cos and sin"),
    (
        "cos seq mismatch",
        lambda r: dict(cos=r.normal((1, 7, 128)), sin=r.normal((1, 7, 128))),
        ValueError,
        "cos: expected shape (2 or 1, 8, rotary_dim)",
    ),
    (
        "cos batch mismatch",
        lambda r: dict(cos=r.normal((3, 8, 128)), sin=r.normal((3, 8, 128))),
        ValueError,
        "cos: expected shape (2 or 1, 8, rotary_dim)",
    ),
    ("cos rank", lambda r: dict(cos=r.normal((8, 128))), ValueError, "cos: expected 3 dimensions"),
    ("sin shape", lambda r: dict(sin=r.normal((1, 8, 64))), ValueError, "sin: expected the shape of cos (1, 8, 128)"),
    ("sin dtype", lambda r: dict(sin=r.normal((1, 8, 128), BF16)), TypeError, "sin: expected dtype"),
    ("layout", lambda r: dict(layout="sbhd"), ValueError, "layout: expected 'bhsd' or 'bshd', got 'sbhd'"),
    ("interleaved", lambda r: dict(interleaved="yes"), TypeError, "interleaved: expected a bool"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_clear_error(rand, case):
    _, make, error, message = case
    args = _base(rand)
    args.update(make(rand))
    with pytest.raises(error) as info:
        tk.apply_rotary(args.pop("q"), args.pop("k"), args.pop("cos"), args.pop("sin"), **args)
    assert message in str(info.value)


BAD_NORM_INPUTS = [
    ("q_weight shape", dict(q_weight=(64,)), ValueError, "q_weight: expected shape (128,)"),
    ("k_weight missing", dict(k_weight=None), ValueError, "k_weight: expected a [128] norm weight, got None"),
    ("eps negative", dict(eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
]


@pytest.mark.parametrize("case", BAD_NORM_INPUTS, ids=[c[0] for c in BAD_NORM_INPUTS])
def test_bad_norm_input_is_a_clear_error(rand, case):
    _, change, error, message = case
    a = _base(rand)
    weights = dict(q_weight=rand.normal((128,)), k_weight=rand.normal((128,)))
    eps = change.pop("eps", 1e-6) if "eps" in change else 1e-6
    for name, value in change.items():
        weights[name] = None if value is None else rand.normal(value)
    with pytest.raises(error, match=None) as info:
        tk.rms_norm_rope(a["q"], a["k"], weights["q_weight"], weights["k_weight"], a["cos"], a["sin"], eps=eps)
    assert message in str(info.value)


BAD_POSITION_INPUTS = [
    (
        "positions beyond float32's exact range",
        lambda r: dict(positions=jnp.full((2, 8), 1 << 24, jnp.int32)),
        ValueError,
        "positions: expected values in [0, 16777216)",
    ),
    (
        "negative positions",
        lambda r: dict(positions=jnp.full((1, 8), -1, jnp.int32)),
        ValueError,
        "positions: expected values in [0, 16777216)",
    ),
    ("positions float", lambda r: dict(positions=r.normal((2, 8))), TypeError, "positions: expected dtype in (int32)"),
    (
        "positions shape",
        lambda r: dict(positions=r.integers(0, 9, (2, 9))),
        ValueError,
        "positions: expected shape (2 or 1, 8)",
    ),
    ("odd rotary_dim", lambda r: dict(rotary_dim=63), ValueError, "rotary_dim: expected an even number > 0"),
    ("rotary_dim > head_dim", lambda r: dict(rotary_dim=130), ValueError, "rotary_dim: expected at most head_dim"),
    ("theta", lambda r: dict(theta=float("nan")), ValueError, "theta: expected a finite number"),
    ("scaling type", lambda r: dict(scaling={"rope_type": "longrope"}), ValueError, "scaling['rope_type']"),
    (
        "scaling missing key",
        lambda r: dict(scaling={"rope_type": "llama3", "factor": 8.0}),
        ValueError,
        "scaling: rope_type 'llama3' needs",
    ),
    (
        "scaling unknown key",
        lambda r: dict(scaling={"rope_type": "linear", "factor": 2.0, "beta": 1}),
        ValueError,
        "unexpected key(s) ['beta']",
    ),
    (
        "scaling factor",
        lambda r: dict(scaling={"rope_type": "linear", "factor": -2.0}),
        ValueError,
        "scaling['factor']: expected a number > 0",
    ),
]


@pytest.mark.parametrize("case", BAD_POSITION_INPUTS, ids=[c[0] for c in BAD_POSITION_INPUTS])
def test_bad_position_input_is_a_clear_error(rand, case):
    _, make, error, message = case
    a = _base(rand)
    args = dict(positions=rand.integers(0, 100, (2, 8)), theta=1e4)
    args.update(make(rand))
    with pytest.raises(error) as info:
        tk.apply_rotary_from_positions(a["q"], a["k"], args.pop("positions"), **args)
    assert message in str(info.value)


def test_head_too_large_for_vmem_is_a_clear_error():
    q = jax.ShapeDtypeStruct((1, 4096, 8, 8192), F32)
    cos = jax.ShapeDtypeStruct((1, 8, 8192), F32)
    with pytest.raises(ValueError, match="q: heads .* too large"):
        jax.eval_shape(tk.apply_rotary, q, q, cos, cos)


# ------------------------------------------------------------------------------------------------ rungs 2 and 3
def test_export_for_tpu():
    q, k = jax.ShapeDtypeStruct((2, 32, 64, 128), BF16), jax.ShapeDtypeStruct((2, 4, 64, 128), BF16)
    cos, w = jax.ShapeDtypeStruct((1, 64, 128), BF16), jax.ShapeDtypeStruct((128,), BF16)
    pos = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    ladder.export_for_tpu(api.apply_rotary, q, k, cos, cos)
    ladder.export_for_tpu(api.apply_rotary_backward, q, k, cos, cos, interleaved=True)
    ladder.export_for_tpu(api.rms_norm_rope, q, k, w, w, cos, cos)
    ladder.export_for_tpu(api.apply_rotary_from_positions, q, k, pos, theta=1e6)
    # Shared positions rows, read lane-major: a decode batch (row select) and a prefill (128-token row blocks).
    dq, dk = jax.ShapeDtypeStruct((256, 32, 1, 128), BF16), jax.ShapeDtypeStruct((256, 4, 1, 128), BF16)
    ladder.export_for_tpu(
        api.rms_norm_rope_from_positions, dq, dk, w, w, jax.ShapeDtypeStruct((256, 1), jnp.int32), theta=1e6
    )
    pq, pk = jax.ShapeDtypeStruct((1, 32, 2048, 128), BF16), jax.ShapeDtypeStruct((1, 4, 2048, 128), BF16)
    ladder.export_for_tpu(
        api.rms_norm_rope_from_positions, pq, pk, w, w, jax.ShapeDtypeStruct((1, 2048), jnp.int32), theta=1e6
    )
    grad = jax.grad(lambda q, k, w, c: ladder.vjp_loss(api.rms_norm_rope(q, k, w, w, c, c)), argnums=(0, 1, 2))
    ladder.export_for_tpu(grad, q, k, w, cos)


# The benchmark shapes, declared once in benchmarks/shapes.py: (name, q heads, kv heads, head_dim, rotary_dim), and
# (batch, seq) per phase (decode: one position per sequence; prefill: one sequence).
MODELS = [(name, d["q_heads"], d["kv_heads"], d["head_dim"], d["rotary_dim"]) for name, d in ROTARY_MODELS.items()]
MODELS.append(("gemma4-full-prefix", 16, 2, 512, 128))  # the same layer with an aligned rotary prefix instead
BENCH_SHAPES = [(b, 1) for b in ROTARY_DECODE_BATCHES] + [(1, s) for s in ROTARY_PREFILL_SEQS]
# v6e (the benchmarks' target) compiles every shape; v5e and v7x the largest decode batch and the longest prefill.
SHAPES_BY_GENERATION = {"v6e": BENCH_SHAPES, "v5e": [(256, 1), (1, 32768)], "v7x": [(256, 1), (1, 32768)]}


@pytest.mark.parametrize("generation", ladder.GENERATIONS)
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_compiles_for_tpu_at_benchmark_shapes(generation, model):
    """apply_rotary at the benchmark shapes (transformers' bhsd layout, bf16 q/k and tables); the fused norm + rope
    and the fused norm + rope from positions (what the benchmarks compare) at the largest decode batch and the longest
    prefill."""
    _, hq, hk, head_dim, rotary_dim = model
    for batch, seq in SHAPES_BY_GENERATION[generation]:
        q, k = ((batch, hq, seq, head_dim), BF16), ((batch, hk, seq, head_dim), BF16)
        table = ((1, seq, rotary_dim), BF16)
        if model[0] == "gemma4-full-prefix" and (batch, seq) not in SHAPES_BY_GENERATION["v5e"]:
            continue
        ladder.compile_for_tpu(api.apply_rotary, generation, q, k, table, table, label="apply_rotary")
        if generation == "v6e" and (batch, seq) in ((256, 1), (1, 32768)) and model[0] != "gemma4-full":
            w, pos = ((head_dim,), BF16), ((batch, seq), jnp.int32)
            ladder.compile_for_tpu(api.rms_norm_rope, generation, q, k, w, w, table, table, label="rms_norm_rope")
            ladder.compile_for_tpu(
                lambda q, k, w, p: api.rms_norm_rope_from_positions(q, k, w, w, p, theta=1e6, rotary_dim=rotary_dim),
                generation,
                q,
                k,
                w,
                pos,
                label="rms_norm_rope_from_positions",
            )


@pytest.mark.parametrize("generation", ["v6e"])
def test_compiles_for_tpu_other_variants(generation):
    """Layouts, dtypes and conventions beyond the benchmark's: bshd, f32, interleaved, padded partial rotary,
    head_dim 64, the backward and yarn from positions.

    (The gradient of the fused op is exported in test_export_for_tpu.)"""
    bshd_q, bshd_k = ((4, 512, 32, 128), BF16), ((4, 512, 4, 128), BF16)
    table = ((4, 512, 128), F32)
    ladder.compile_for_tpu(
        functools_partial(api.apply_rotary, layout="bshd", interleaved=True),
        generation,
        bshd_q,
        bshd_k,
        table,
        table,
        label="apply_rotary_bshd_interleaved",
    )
    q64, k64, t64 = ((2, 16, 256, 64), F32), ((2, 16, 256, 64), F32), ((1, 256, 32), F32)
    ladder.compile_for_tpu(api.apply_rotary, generation, q64, k64, t64, t64, label="apply_rotary_d64_partial")
    ladder.compile_for_tpu(
        api.apply_rotary_backward,
        generation,
        bshd_q,
        bshd_k,
        table,
        table,
        label="apply_rotary_backward",
        layout="bshd",
    )
    q, k = ((8, 32, 256, 128), BF16), ((8, 4, 256, 128), BF16)
    ladder.compile_for_tpu(
        lambda q, k, p: api.apply_rotary_from_positions(
            q, k, p, theta=5e5, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
        ),
        generation,
        q,
        k,
        ((8, 256), jnp.int32),
        label="apply_rotary_from_positions_yarn",
    )


def functools_partial(fn, **kw):
    return lambda *a: fn(*a, **kw)


def test_tuning_follows_the_traced_generation():
    """The block choice reads the chip being compiled for: v5e gets fewer tokens per step than v6e."""
    blocks = {}
    for generation in ("v5e", "v6e"):
        with jax.default_device(ladder.tpu_device(generation)):
            info = api.chip.current_tpu_info()
        blocks[generation] = tuning.choose_blocks(
            batch=1,
            seq=32768,
            heads=(32, 4),
            head_dim=128,
            dtype=BF16,
            table_width=128,
            table_dtypes=(BF16, BF16),
            seq_major=False,
            info=info,
        ).block_seq
    assert blocks["v5e"] < blocks["v6e"], blocks


def test_inverse_frequencies_default_formula():
    inv, scale, r = frequencies.inverse_frequencies(128, 1e6, 128)
    np.testing.assert_allclose(inv, 1.0 / (1e6 ** (np.arange(0, 128, 2) / 128)), rtol=1e-6)
    assert scale == 1.0 and r == 128
