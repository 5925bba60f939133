"""Rotary embeddings, JAX side, up the ladder: reference vs kernel (interpret mode) for apply_rotary, its backward,
fused per-head RMSNorm + RoPE and cos/sin from positions; gradients; bad input; TPU export; deviceless compile for
v5e / v6e / v7x at the benchmark shapes (Qwen3-30B-A3B and Gemma 4 attention, decode and prefill). Tilings and the
factor-row path other than the table's are forced through `blocks=`."""

import contextlib

import jax
import jax.numpy as jnp
import ladder
import numpy as np
import pytest

from benchmarks.shapes import ROTARY_DECODE_BATCHES, ROTARY_MODELS, ROTARY_PREFILL_SEQS
from tpu_kernels_jax import api as tk
from tpu_kernels_jax.rotary import api, frequencies, reference, tuning

F32, BF16 = jnp.float32, jnp.bfloat16
RotaryBlocks = tk.RotaryBlocks


def _reference_tables(positions, *, head_dim, theta, rotary_dim=None, scaling=None, interleaved=False):
    """cos/sin [B, S, r] from positions by the reference (transformers' rotary-embedding formula), on the inverse
    frequencies of transformers' rope init functions."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    inv_freq, attention_scaling, _ = frequencies.inverse_frequencies(head_dim, theta, rotary_dim, scaling)
    # Jitted: one XLA compile per call instead of one per eager op (multiply, concatenate, cos, sin, ...) and shape.
    return ladder.run_reference(
        lambda p: reference.cos_sin_from_positions(p, inv_freq, attention_scaling, interleaved=interleaved), positions
    )


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
    ("partial-aligned", "bshd", 1, 12, 4, 2, 512, 128, False, BF16, BF16, 1),  # Gemma-4-full-like prefix
    ("partial-padded", "bhsd", 2, 16, 2, 1, 128, 64, False, F32, F32, 2),  # GPT-NeoX-like rotary_pct 0.5
    ("partial-interleaved", "bhsd", 1, 8, 2, 2, 128, 32, True, F32, BF16, 1),
]
# Multi-step grids with ragged last blocks: these cases run with the smallest blocks (one sequence, one sublane tile of
# tokens of the q/k and table dtypes: 16 for bf16 q with f32 tables, 8 for f32) instead of the table's, whose one-block
# path every other case runs.
SMALL_BLOCKS = {"bshd-f32-cos": RotaryBlocks(block_batch=1, block_seq=16), "partial-padded": RotaryBlocks(1, 8)}
BLOCK_CASES = [(c, SMALL_BLOCKS.get(c[0])) for c in CASES]


@pytest.mark.parametrize(
    "case,blocks", BLOCK_CASES, ids=[f"{c[0]}-{'small' if b else 'tuned'}_blocks" for c, b in BLOCK_CASES]
)
def test_apply_rotary_matches_reference(rand, case, blocks):
    _, layout, batch, seq, hq, hk, head_dim, rotary_dim, interleaved, dtype, cos_dtype, cos_batch = case
    q_shape, k_shape = _shapes(layout, batch, seq, hq, hk, head_dim)
    q, k = rand.normal(q_shape, dtype, scale=2.0), rand.normal(k_shape, dtype)
    cos, sin = (
        rand.normal((cos_batch, seq, rotary_dim), cos_dtype),
        rand.normal((cos_batch, seq, rotary_dim), cos_dtype),
    )
    kw = dict(interleaved=interleaved, layout=layout)
    ladder.check_against_reference(
        lambda q, k, c, s: tk.apply_rotary(q, k, c, s, blocks=blocks, **kw),
        jax.jit(lambda q, k, c, s: reference.apply_rotary_reference(q, k, c, s, **kw)),
        (q, k, cos, sin),
        dtype=dtype,
        rand=rand,
        names=["q", "k"],
        jit_kernel=True,
    )


def test_transformers_tables_rotate_as_the_formula(rand):
    """With transformers' own tables (cat(freqs, freqs)) the result is a rotation of each pair: norms are kept.
    Also: k may be None."""
    q = rand.normal((1, 2, 8, 128))
    cos, sin = api.rope_cos_sin(rand.integers(0, 5000, (1, 8)), head_dim=128, theta=1e6)
    # Jitted, kernel and reference: one XLA compile each instead of one per eager op.
    out, out_k = ladder.run_kernel(jax.jit(lambda q, c, s: tk.apply_rotary(q, None, c, s)), q, cos, sin)
    assert out_k is None
    ladder.assert_close(out, ladder.run_reference(reference.rotate_reference, q, cos, sin), dtype=F32)
    pairs = lambda x: x[..., :64] ** 2 + x[..., 64:] ** 2  # noqa: E731
    ladder.assert_close(pairs(out), pairs(q), dtype=F32, rtol=1e-4, atol=1e-4)


# The cos/sin gradients are per-token sums over heads (api._table_gradients): per-sequence tables, a table shared by
# the batch, a decode batch's one shared row (summed over its tokens too), interleaved pairs in bshd, partial rotary.
GRADIENT_CASES = [
    CASES[6],
    ("decode-shared-row", "bhsd", 4, 1, 2, 1, 128, 128, False, F32, F32, 1),
    ("interleaved-bshd-shared", "bshd", 2, 9, 2, 1, 64, 64, True, F32, F32, 1),
]


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=lambda c: c[0])
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
    # cos/sin gradients sum over heads (and the shared batch): a bf16 input carries its rounding into that sum.
    ladder.check_gradients(
        lambda *a: tk.apply_rotary(*a, **kw),
        lambda *a: reference.apply_rotary_reference(*a, **kw),
        args,
        argnums=(0, 1, 2, 3),
        names=["d q", "d k", "d cos", "d sin"],
        rand=rand,
        dtype=dtype,
        atol=6e-2 if dtype == BF16 else 1e-4,
    )


@pytest.mark.parametrize("interleaved", [True])
def test_backward_is_the_rotation_by_minus_sin(rand, interleaved):
    """RoPE is linear; for tables whose pair halves agree (all transformers tables) its transpose is the rotation by
    -sin. apply_rotary_backward computes grad * cos - R(grad * sin), which is that."""
    gq, gk = rand.normal((1, 4, 24, 128)), rand.normal((1, 2, 24, 128))
    cos, sin = api.rope_cos_sin(rand.integers(0, 100000, (1, 24)), head_dim=128, theta=1e4, interleaved=interleaved)
    actual = ladder.run_kernel(
        jax.jit(lambda *a: tk.apply_rotary_backward(*a, interleaved=interleaved)), gq, gk, cos, sin
    )
    expected = ladder.run_reference(
        lambda q, k, c, s: reference.apply_rotary_reference(q, k, c, -s, interleaved=interleaved), gq, gk, cos, sin
    )
    for a, e in zip(actual, expected):
        ladder.assert_close(a, e, dtype=F32, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ fused RMSNorm + RoPE
NORM_CASES = [
    ("qwen3-bhsd-bf16", "bhsd", 2, 24, 4, 2, 128, 128, BF16, 0.0),
    ("gemma4-sliding-bshd-f32", "bshd", 2, 9, 4, 2, 256, 256, F32, 0.0),
    ("gemma4-full-partial", "bshd", 1, 5, 2, 1, 512, 128, BF16, 0.0),
    # bf16 at head_dim 128 with whole sublane groups of heads: q's row sums on the MXU, k's (2 heads) cross-lane; a
    # decode batch with the weight offset (f32 norms: gemma4-sliding-bshd-f32).
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
        jit_kernel=True,
    )


@pytest.mark.parametrize("dtype", [F32], ids=lambda d: jnp.dtype(d).name)
def test_rms_norm_rope_gradients(rand, dtype):
    q, k = rand.normal((2, 4, 16, 128), dtype, scale=2.0), rand.normal((2, 2, 16, 128), dtype)
    qw, kw_ = rand.normal((128,), dtype), rand.normal((128,), dtype)
    cos, sin = rand.normal((1, 16, 128), dtype), rand.normal((1, 16, 128), dtype)
    names = ["d q", "d k", "d q_weight", "d k_weight", "d cos", "d sin"]
    atol = 1e-1 if dtype == BF16 else 2e-4
    atols = {name: atol for name in names}
    if dtype != BF16:
        # A weight gradient sums over every token and head terms up to ~100: f32 rounding in a different summation
        # order is relative to the terms, not to a small (cancelled) sum (seed 2787238278: 4e-4 off at 1.26, terms
        # ~69).
        for name in ("d q_weight", "d k_weight"):
            atols[name] = lambda e: atol + 2e-5 * float(jnp.max(jnp.abs(e)))
    ladder.check_gradients(
        lambda *a: tk.rms_norm_rope(*a, eps=1e-5),
        lambda *a: reference.rms_norm_rope_reference(*a, eps=1e-5),
        (q, k, qw, kw_, cos, sin),
        argnums=tuple(range(6)),
        names=names,
        rand=rand,
        dtype=dtype,
        atol=atols,
        rtol=5e-2 if dtype == BF16 else 1e-4,
    )


@pytest.mark.cpu_only
def test_blocks_reach_the_forward_and_backward_kernels():
    """A gradient runs the transpose-rotation kernel with the blocks its forward was given (static in the
    custom_vjp); the per-head norm's gradient is an RMSNorm backward with the RMSNorm table's blocks."""
    q, k = jax.ShapeDtypeStruct((2, 4, 40, 128), F32), jax.ShapeDtypeStruct((2, 2, 40, 128), F32)
    w, table = jax.ShapeDtypeStruct((128,), F32), jax.ShapeDtypeStruct((1, 40, 128), F32)
    positions = jax.ShapeDtypeStruct((1, 40), jnp.int32)
    blocks = RotaryBlocks(block_batch=1, block_seq=16, vmem_limit_bytes=20 << 20)
    ops = {
        "tables": lambda q, k, w, t, p: tk.rms_norm_rope(q, k, w, w, t, t, blocks=blocks),
        "positions": lambda q, k, w, t, p: tk.rms_norm_rope_from_positions(q, k, w, w, p, theta=1e4, blocks=blocks),
    }
    for op in ops.values():
        grad = jax.grad(lambda *a, op=op: ladder.vjp_loss(op(*a)), argnums=(0, 1, 2))
        calls = ladder.pallas_calls(grad, q, k, w, table, positions)
        rotary = [(c.name, c.grid, c.vmem_limit_bytes) for c in calls if "rope" in c.name]
        assert rotary == [("rms_norm_rope", (2, 3), 20 << 20), ("rope_bwd", (2, 3), 20 << 20)], calls
        assert sorted(c.name for c in calls if "rope" not in c.name) == ["rms_norm_bwd"] * 2, calls


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


# llama3 only changes the numbers of the host-built inverse-frequency table the kernel reads (default's path; its
# frequencies: test_inverse_frequencies_match_transformers in test_rotary_torch.py); yarn adds the attention scaling,
# proportional the zero-frequency tail.
KERNEL_SCALINGS = [c for c in SCALINGS if c[0] != "llama3"]


@pytest.mark.parametrize("case", KERNEL_SCALINGS, ids=[c[0] for c in KERNEL_SCALINGS])
def test_apply_rotary_from_positions_matches_reference(rand, case):
    _, scaling, rotary_dim = case
    head_dim, theta = 128, 1e6
    q, k = rand.normal((2, 4, 16, head_dim)), rand.normal((2, 2, 16, head_dim))
    positions = rand.integers(0, 60000, (2, 16))
    kw = dict(theta=theta, rotary_dim=rotary_dim, scaling=scaling)
    cos, sin = _reference_tables(positions, head_dim=head_dim, **kw)
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
        jit_kernel=True,
    )


# A decode batch at factor 0.25 (128 angle lanes) through the fused norm, a prefill sequence at 0.75 (256 lanes)
# through the plain rope: both ops read the same in-kernel cos/sin (kernel._cos_sin, whose lanes are asserted), so each
# factor runs one of them (the plain rope's proportional tail at head_dim 128 also runs in
# test_apply_rotary_from_positions_matches_reference[proportional]).
@pytest.mark.parametrize("factor,angle_lanes,batch,seq,op", [(0.25, 128, 12, 1, "norm"), (0.75, 256, 1, 40, "plain")])
def test_proportional_zero_frequencies_skip_transcendentals(rand, monkeypatch, factor, angle_lanes, batch, seq, op):
    """Gemma 4's full layers (head_dim 512, proportional partial rotary): frequencies past partial_rotary_factor are 0,
    so the kernel evaluates cos/sin only on the lanes that hold a nonzero one (cos 1, sin 0 past them); fused norm or
    plain rope, against the reference on XLA's tables, and the lanes it evaluated."""
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
    q, k = rand.normal((batch, 4, seq, 512), F32), rand.normal((batch, 2, seq, 512), F32)
    qw, kw_ = rand.normal((512,), F32), rand.normal((512,), F32)
    positions = rand.integers(0, 40000, (batch, seq) if seq == 1 else (1, seq))
    cos, sin = _reference_tables(positions, head_dim=512, **opts)
    tol = dict(rtol=1e-4, atol=1e-3)  # f32 angles up to 4e4 rad: cos/sin implementations differ in the last bits
    checks = {
        "norm": (
            lambda *a: tk.rms_norm_rope_from_positions(*a, eps=1e-6, **opts),
            lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(q, k, qw, kw_, cos, sin, eps=1e-6),
            (q, k, qw, kw_, positions),
        ),
        "plain": (
            lambda q, k, p: tk.apply_rotary_from_positions(q, k, p, **opts),
            lambda q, k, p: reference.apply_rotary_reference(q, k, cos, sin),
            (q, k, positions),
        ),
    }
    kernel_op, reference_op, args = checks[op]
    ladder.check_against_reference(
        kernel_op, reference_op, args, dtype=F32, rand=rand, names=["q", "k"], **tol, jit_kernel=True
    )
    jax.clear_caches()
    assert seen and set(seen) == {("lanes", angle_lanes, 512)}, f"(packing, angle lanes, table width): {seen}"


@pytest.mark.cpu_only
def test_proportional_zero_frequency_tail_compiles_for_tpu():
    """Rung 3 of the fused norm's proportional zero-frequency tail on v6e, Gemma 4 full's decode batch (the other
    generations compile the same kernel at the benchmark shapes)."""
    opts = dict(theta=1e6, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25})
    ladder.compile_for_tpu(
        lambda q, k, w, p: api.rms_norm_rope_from_positions(q, k, w, w, p, **opts),
        "v6e",
        ((256, 16, 1, 512), BF16),
        ((256, 2, 1, 512), BF16),
        ((512,), BF16),
        ((256, 1), jnp.int32),
        label="proportional zero-frequency tail",
    )


@pytest.mark.parametrize("layout,interleaved,dtype", [("bshd", True, BF16)])
def test_from_positions_layouts_norm_and_gradients(rand, layout, interleaved, dtype):
    q_shape, k_shape = _shapes(layout, 2, 8, 4, 2, 256)
    q, k = rand.normal(q_shape, dtype), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((256,), F32), rand.normal((256,), F32)
    positions = rand.integers(0, 1000, (1, 8))
    opts = dict(theta=1e4, interleaved=interleaved, layout=layout)
    cos, sin = _reference_tables(positions, head_dim=256, theta=1e4, interleaved=interleaved)
    ladder.check_against_reference(
        lambda *a: tk.rms_norm_rope_from_positions(*a, eps=1e-6, **opts),
        lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(
            q, k, qw, kw_, cos, sin, eps=1e-6, interleaved=interleaved, layout=layout
        ),
        (q, k, qw, kw_, positions),
        dtype=dtype,
        rand=rand,
        names=["q", "k"],
        jit_kernel=True,
    )

    ladder.check_gradients(
        lambda q, k: tk.apply_rotary_from_positions(q, k, positions, **opts),
        lambda q, k: reference.apply_rotary_reference(q, k, cos, sin, interleaved=interleaved, layout=layout),
        (q, k),
        argnums=(0, 1),
        names=["d q", "d k"],
        rand=rand,
        dtype=dtype,
        atol=5e-2 if dtype == BF16 else 1e-4,
    )


# Token-major blocks (bshd, and every decode batch) take their per-token factor rows by broadcast loads from VMEM up to
# tuning.BROADCAST_LOAD_MAX_TOKENS tokens a block, in registers above it: both paths, forced by
# RotaryBlocks.broadcast_loads, on the cases that stress them (blocks of several sequences with their own or a shared
# table, a lane-aligned rotary prefix, q's row sums on the MXU, multi-step grids of one sublane tile a step). The path
# reached is read from the traced program: broadcast loads take one VMEM scratch operand.
# (id, op, layout, batch, seq, q heads, k heads, head_dim, rotary_dim, dtype, small blocks)
FACTOR_ROW_CASES = [
    ("apply-per-sequence-table", "apply", "bshd", 3, 9, 2, 4, 128, 128, F32, False),
    ("norm-partial-prefix", "norm", "bshd", 2, 5, 2, 1, 512, 128, BF16, False),
    ("positions-decode-mxu", "positions", "bhsd", 6, 1, 8, 2, 128, 128, BF16, False),
    ("positions-ragged-steps", "positions", "bshd", 1, 40, 4, 2, 256, 256, F32, True),
]


# Every case in registers (reached only when forced at these sizes); broadcast loads (the table's choice at these
# sizes, so also what the token-major cases of test_rms_norm_rope_matches_reference run: gemma4-full-partial is
# norm-partial-prefix, decode-bf16-mxu is positions-decode-mxu on tables) forced on the other two.
FACTOR_ROW_PARAMS = [
    pytest.param(c, path, id=f"{c[0]}-{path}")
    for c in FACTOR_ROW_CASES
    for path in ("broadcast_loads", "in_registers")
    if path == "in_registers" or c[0] in ("apply-per-sequence-table", "positions-ragged-steps")
]


@pytest.mark.parametrize("case,factor_rows", FACTOR_ROW_PARAMS)
def test_token_major_factor_rows(rand, case, factor_rows):
    _, op, layout, batch, seq, hq, hk, head_dim, rotary_dim, dtype, small_blocks = case
    sizes = dict(block_batch=1, block_seq=8) if small_blocks else {}  # 8: one sublane tile of f32 q/k and positions
    blocks = RotaryBlocks(**sizes, broadcast_loads=factor_rows == "broadcast_loads")
    q_shape, k_shape = _shapes(layout, batch, seq, hq, hk, head_dim)
    q, k = rand.normal(q_shape, dtype, scale=2.0, offset=0.5), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((head_dim,), dtype), rand.normal((head_dim,), F32)
    positions = rand.integers(0, 40000, (batch, seq) if seq == 1 else (1, seq))
    cos, sin = _reference_tables(positions, head_dim=head_dim, theta=1e4, rotary_dim=rotary_dim)
    ref_kw = dict(layout=layout)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == F32 else {}
    if op == "apply":
        cos, sin = rand.normal((batch, seq, rotary_dim), dtype), rand.normal((batch, seq, rotary_dim), dtype)
        kernel_fn, args = (
            (lambda q, k, c, s: tk.apply_rotary(q, k, c, s, layout=layout, blocks=blocks)),
            (q, k, cos, sin),
        )
        ladder.check_against_reference(
            kernel_fn,
            lambda q, k, c, s: reference.apply_rotary_reference(q, k, c, s, **ref_kw),
            (q, k, cos, sin),
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
            **tol,
            jit_kernel=True,
        )
    elif op == "norm":
        cos, sin = cos.astype(dtype), sin.astype(dtype)
        kernel_fn, args = (
            (lambda *a: tk.rms_norm_rope(*a, eps=1e-6, layout=layout, blocks=blocks)),
            (q, k, qw, kw_, cos, sin),
        )
        ladder.check_against_reference(
            kernel_fn,
            lambda *a: reference.rms_norm_rope_reference(*a, eps=1e-6, **ref_kw),
            (q, k, qw, kw_, cos, sin),
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
            jit_kernel=True,
        )
    else:
        kernel_fn, args = (
            lambda *a: tk.rms_norm_rope_from_positions(
                *a, eps=1e-6, theta=1e4, rotary_dim=rotary_dim, layout=layout, blocks=blocks
            ),
            (q, k, qw, kw_, positions),
        )
        ladder.check_against_reference(
            kernel_fn,
            lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(q, k, qw, kw_, cos, sin, eps=1e-6, **ref_kw),
            args,
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
            **tol,
            jit_kernel=True,
        )
    calls = ladder.pallas_calls(kernel_fn, *args)
    assert [c.scratch_operands for c in calls] == [int(blocks.broadcast_loads)], f"{factor_rows}: {calls}"
    if small_blocks:
        assert calls[0].grid == (1, seq // 8), calls


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ladder.GENERATIONS)
def test_token_major_factor_rows_compile_for_tpu(generation):
    """Rung 3 for both factor-row paths: Qwen3's fused norm + rope from positions in bshd at prefill (128-token
    blocks: the unrolled broadcast-load body at its benchmark size; positions by row blocks) and at a 256-token decode
    batch (row select). The table's blocks take broadcast loads at both; RotaryBlocks(broadcast_loads=False) keeps
    its sizes, in registers. v6e compiles all four; v5e and v7x the table's blocks at both shapes (their VMEM fit)
    and the in-register path (less VMEM: no scratch) at one each, crosswise: the positions read and the cos/sin
    packing are the same code on both paths."""
    w = ((128,), BF16)
    in_registers = RotaryBlocks(broadcast_loads=False)
    prefill, decode = (1, 2048), (256, 1)
    pairings = {
        "v6e": [(None, prefill), (None, decode), (in_registers, prefill), (in_registers, decode)],
        "v5e": [(None, prefill), (None, decode), (in_registers, decode)],
        "v7x": [(None, prefill), (None, decode), (in_registers, prefill)],
    }
    for blocks, (batch, seq) in pairings[generation]:

        def op(q, k, w, p, blocks=blocks):
            return api.rms_norm_rope_from_positions(q, k, w, w, p, theta=1e6, layout="bshd", blocks=blocks)

        q, k = ((batch, seq, 32, 128), BF16), ((batch, seq, 4, 128), BF16)
        pos = ((batch, seq) if seq > 1 else (batch, 1), jnp.int32)
        label = f"factor rows {'in registers' if blocks else 'broadcast loads'}"
        ladder.compile_for_tpu(op, generation, q, k, w, pos, label=label)
        with jax.default_device(ladder.tpu_device(generation)):
            calls = ladder.pallas_calls(op, *(jax.ShapeDtypeStruct(*a) for a in (q, k, w, pos)))
        assert [c.scratch_operands for c in calls] == [0 if blocks else 1], f"{label} at {(batch, seq)}: {calls}"


# How the kernel reads positions and packs cos/sin (kernel.PositionsLayout): each case forces a token block and asserts
# the layout it reached, so a tuning change cannot silently stop covering one. Sizes are the smallest that reach the
# layout with >= 2 steps: the multi-chunk row select needs 256 tokens, row blocks 128-token blocks, the column read of
# one long row more than ROW_SELECT_MAX_TOKENS (520: a ragged sixth 96-token block, 96 keeping the packing "none").
# Token-major blocks (bshd, decode batches) take their factor rows in registers here: the positions read and the
# cos/sin packing are the same code on both factor-row paths, and broadcast loads unroll a load per token of the block
# (a 96-token block: 4x this check's interpret time); both paths with positions are test_token_major_factor_rows'.
# (id, layout, batch, seq, positions rows, head_dim, rotary_dim, interleaved, norm, dtype, block_seq, mode, packing)
POSITION_LAYOUTS = [
    ("row-blocks-rows-ragged", "bhsd", 1, 320, 1, 128, None, False, True, BF16, 128, "row_blocks", "rows"),
    ("row-select-chunks-decode", "bhsd", 256, 1, 256, 128, None, False, False, BF16, 32, "row_select", "none"),
    ("row-select-rows-decode", "bhsd", 128, 1, 128, 128, None, False, True, BF16, 64, "row_select", "rows"),
    ("row-select-lanes-decode", "bshd", 16, 1, 16, 256, None, False, False, F32, 8, "row_select", "lanes"),
    ("row-blocks-interleaved", "bshd", 1, 256, 1, 128, None, True, False, F32, 128, "row_blocks", "none"),
    ("row-blocks-lanes-whole-seq", "bhsd", 2, 128, 1, 256, None, False, True, F32, 128, "row_blocks", "lanes"),
    ("column-rows-per-sequence", "bshd", 2, 64, 2, 128, None, False, True, F32, 64, "column", "rows"),
    ("row-select-partial-rotary", "bhsd", 1, 48, 1, 128, 64, False, False, F32, 16, "row_select", "none"),
    ("row-select-decode-ragged", "bhsd", 20, 1, 20, 128, None, False, False, F32, 8, "row_select", "none"),
    ("row-select-decode-one-step", "bshd", 8, 1, 8, 256, None, True, True, BF16, 8, "row_select", "none"),
    ("column-long-ragged", "bshd", 1, 520, 1, 128, None, False, False, F32, 96, "column", "none"),
    ("row-blocks-rows-proportional", "bhsd", 1, 256, 1, 512, 128, False, True, BF16, 128, "row_blocks", "rows"),
]


def _record_results(monkeypatch, module, name):
    """Wrap module.name for this test; returns the list of its results, appended as each call traces."""
    seen, original = [], getattr(module, name)

    def recording(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(module, name, recording)
    return seen


def _position_layout_op(norm, layout, rotary_dim, interleaved, block_seq):
    """The op of a POSITION_LAYOUTS case at its forced token block (one sequence a step), factor rows in
    registers."""
    opts = dict(
        theta=1e4,
        interleaved=interleaved,
        rotary_dim=rotary_dim,
        layout=layout,
        blocks=RotaryBlocks(block_batch=1, block_seq=block_seq, broadcast_loads=False),
    )
    if norm:
        return lambda q, k, qw, kw_, p: api.rms_norm_rope_from_positions(q, k, qw, kw_, p, eps=1e-6, **opts)
    return lambda q, k, p: api.apply_rotary_from_positions(q, k, p, **opts)


@pytest.mark.parametrize("case", POSITION_LAYOUTS, ids=[c[0] for c in POSITION_LAYOUTS])
def test_positions_layouts_and_cos_sin_packing(rand, monkeypatch, case):
    _, layout, batch, seq, rows, head_dim, rotary_dim, interleaved, norm, dtype, ts, mode, packing = case
    seen = _record_results(monkeypatch, api.kernel, "positions_layout")
    q_shape, k_shape = _shapes(layout, batch, seq, 4, 2, head_dim)
    q, k = rand.normal(q_shape, dtype), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((head_dim,), F32), rand.normal((head_dim,), F32)
    positions = rand.integers(0, 40000, (rows, seq) if seq > 1 else (rows, 1))
    cos, sin = _reference_tables(
        positions, head_dim=head_dim, theta=1e4, interleaved=interleaved, rotary_dim=rotary_dim
    )
    ref_kw = dict(interleaved=interleaved, layout=layout)
    op = _position_layout_op(norm, layout, rotary_dim, interleaved, ts)
    if norm:
        ladder.check_against_reference(
            op,
            lambda q, k, qw, kw_, p: reference.rms_norm_rope_reference(q, k, qw, kw_, cos, sin, eps=1e-6, **ref_kw),
            (q, k, qw, kw_, positions),
            dtype=dtype,
            rand=rand,
            names=["q", "k"],
            **(dict(rtol=1e-4, atol=1e-3) if dtype == F32 else {}),
            jit_kernel=True,
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
            jit_kernel=True,
        )
    assert seen and {(s.mode, s.packing) for s in seen} == {(mode, packing)}, f"layouts reached: {seen}"


@pytest.mark.cpu_only
@pytest.mark.parametrize("generation", ["v6e"])
def test_positions_layouts_compile_for_tpu(monkeypatch, generation):
    """Rung 3 for every positions layout and cos/sin packing (row transposes, lane selects, packed rows), each at
    its forced block. The blocks (and so the VMEM limit) are forced, the same on every generation, so one generation
    proves the layouts lower; v5e's and v7x's lowering of the positions path is compiled at their own table entries
    by test_token_major_factor_rows_compile_for_tpu (row blocks and row select, both factor-row paths)."""
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
        seen = _record_results(monkeypatch, api.kernel, "positions_layout")
        q_shape, k_shape = _shapes(layout, batch, seq, 4, 2, head_dim)
        args = [(q_shape, dtype), (k_shape, dtype)] + ([((head_dim,), F32)] * 2 if norm else [])
        args.append(((rows, seq) if seq > 1 else (rows, 1), jnp.int32))
        ladder.compile_for_tpu(
            _position_layout_op(norm, layout, rotary_dim, interleaved, ts),
            generation,
            *args,
            label=f"positions {mode}/{packing}",
        )
        assert {(s.mode, s.packing) for s in seen} == {(mode, packing)}, f"layouts reached: {seen}"
        monkeypatch.undo()


# ------------------------------------------------------------------------------------------------- random draws
RANDOM_SCALINGS = [None] + [c[1] for c in SCALINGS if c[1] is not None]
ROTARY_OPS = {
    # (from positions, with the per-head norm): the op
    (False, False): tk.apply_rotary,
    (False, True): tk.rms_norm_rope,
    (True, False): tk.apply_rotary_from_positions,
    (True, True): tk.rms_norm_rope_from_positions,
}


@ladder.random_draws
def test_random_draw(rand, draw):
    """The op (on cos/sin tables or from positions, with or without the per-head norm), layout, sizes (decode's one
    token, ragged token blocks, GQA and MQA heads, head dims 64 to 512, partial rotary prefixes), dtypes, pairs,
    scaling, weight offset and tiling drawn at random; the forward, or the gradients, against the reference."""
    from_positions = rand.draw("from_positions", [False, True])
    norm = rand.draw("rms_norm", [False, True])
    dtype = rand.draw("dtype", [F32, BF16])
    gradients = (dtype == F32 or not norm) and rand.draw("gradients", [False, True])
    layout, batch = rand.draw("layout", ["bhsd", "bshd"]), rand.draw("batch", [1, 2, 3])
    seq = rand.draw("seq", [1, 5, 16] + ([] if gradients else [40]))
    hq, hk = rand.draw("q_heads", [1, 2, 4, 8]), rand.draw("k_heads", [1, 2, 4])
    head_dim = rand.draw("head_dim", [64, 128, 256, 512])
    scaling = rand.draw("scaling", RANDOM_SCALINGS) if from_positions else None
    proportional = scaling is not None and scaling["rope_type"] == "proportional"
    interleaved = not proportional and rand.draw("interleaved", [False, True])
    rotary_dim = None if proportional else rand.draw("rotary_dim", [head_dim, head_dim // 2, 32])
    table_dtype = F32 if from_positions else rand.draw("table_dtype", [dtype, F32])
    q_shape, k_shape = _shapes(layout, batch, seq, hq, hk, head_dim)
    q, k = rand.normal(q_shape, dtype, scale=2.0, offset=0.5), rand.normal(k_shape, dtype)
    qw, kw_ = rand.normal((head_dim,), dtype), rand.normal((head_dim,), F32)
    sublane = 16 if BF16 in (dtype, table_dtype) else 8  # whole sublane tiles of every blocked array
    small = seq >= sublane and rand.draw("blocks", ["tuned", "small"]) == "small"
    blocks = RotaryBlocks(block_batch=1, block_seq=sublane) if small else None
    norm_kw = dict(eps=1e-6, weight_offset=rand.draw("weight_offset", [0.0, 1.0])) if norm else {}
    ref_kw = dict(interleaved=interleaved, layout=layout)
    if from_positions:
        positions = rand.integers(0, 40000, (rand.draw("position_rows", [1, batch]), seq))
        options = dict(theta=1e4, rotary_dim=rotary_dim, scaling=scaling, **ref_kw)
        cos, sin = _reference_tables(
            positions, head_dim=head_dim, theta=1e4, rotary_dim=rotary_dim, scaling=scaling, interleaved=interleaved
        )
        tables = (positions,)
        # f32 angles up to 4e4 rad: the kernel's cos/sin and XLA's differ in the last bits
        tol = dict(rtol=1e-4, atol=1e-3) if dtype == F32 else {}
    else:
        table_rows = rand.draw("table_batch", [1, batch])
        cos, sin = (rand.normal((table_rows, seq, rotary_dim), table_dtype) for _ in range(2))
        options, tables, tol = ref_kw, (cos, sin), {}

    def kernel_op(q, k, qw, kw_, *tables):
        weights = (qw, kw_) if norm else ()
        return ROTARY_OPS[from_positions, norm](q, k, *weights, *tables, **options, **norm_kw, blocks=blocks)

    def reference_op(q, k, qw, kw_, *tables):
        c, s = (cos, sin) if from_positions else tables
        if norm:
            return reference.rms_norm_rope_reference(q, k, qw, kw_, c, s, **norm_kw, **ref_kw)
        return reference.apply_rotary_reference(q, k, c, s, **ref_kw)

    args = (q, k, qw, kw_, *tables)
    if not gradients:
        ladder.check_against_reference(
            kernel_op, reference_op, args, dtype=dtype, rand=rand, names=["q", "k"], jit_kernel=True, **tol
        )
        return
    names = {0: "d q", 1: "d k"} | ({2: "d q_weight", 3: "d k_weight"} if norm else {})
    argnums, names = ladder.differentiated(args, names | ({} if from_positions else {4: "d cos", 5: "d sin"}))
    # the weights' and the tables' gradients sum over tokens and heads: bounded relative to the summed terms
    atol = 6e-2 if dtype == BF16 else 2e-4
    ladder.check_gradients(
        kernel_op,
        reference_op,
        args,
        argnums=argnums,
        names=names,
        rand=rand,
        dtype=dtype,
        atol=ladder.relative_to_largest(atol, 2e-5),
        rtol=1e-4 if dtype == F32 else None,
    )


# ------------------------------------------------------------------------------------------------------ bad input
BadInput = ladder.BadInput
# bhsd f32, 32 + 32 heads x 128, cos/sin f32: 194 KiB of VMEM a token (blocks double-buffered, f32 temporaries), so
# 384-token blocks need 72.8 MiB: more than a v7x core's 64 MiB, within the 96 MiB a v6e kernel may ask for.
BIG_QK = jax.ShapeDtypeStruct((1, 32, 4096, 128), F32)
BIG_TABLE = jax.ShapeDtypeStruct((1, 4096, 128), F32)
BIG = dict(q=BIG_QK, k=BIG_QK, cos=BIG_TABLE, sin=BIG_TABLE)


def _base(r, *, batch=2, seq=8, dtype=F32, table_batch=1):
    """q [batch, 4, seq, 128], k [batch, 2, seq, 128] in dtype; f32 cos/sin [table_batch, seq, 128]."""
    return dict(
        q=r.normal((batch, 4, seq, 128), dtype),
        k=r.normal((batch, 2, seq, 128), dtype),
        cos=r.normal((table_batch, seq, 128)),
        sin=r.normal((table_batch, seq, 128)),
    )


def _traced_for(generation):
    """Trace for `generation` (None: the CPU host's default target, v6e)."""
    return jax.default_device(ladder.tpu_device(generation)) if generation else contextlib.nullcontext()


def _call_apply_rotary(args):
    args = dict(args)
    with _traced_for(args.pop("generation", None)):
        return tk.apply_rotary(args.pop("q"), args.pop("k"), args.pop("cos"), args.pop("sin"), **args)


BAD_INPUTS = [
    BadInput("q rank", lambda r: dict(q=r.normal((2, 4, 128))), ValueError, "q: expected 4 dimensions"),
    BadInput("q int", lambda r: dict(q=r.integers(0, 3, (2, 4, 8, 128))), TypeError, "q: expected dtype"),
    BadInput("q float16", lambda r: dict(q=r.normal((2, 4, 8, 128), jnp.float16)), TypeError, "q: expected dtype"),
    BadInput("q a list", dict(q=[[1.0]]), TypeError, "q: expected a jax array, got list"),
    BadInput("k dtype", lambda r: dict(k=r.normal((2, 2, 8, 128), BF16)), TypeError, "k: expected dtype"),
    BadInput(
        "k seq", lambda r: dict(k=r.normal((2, 2, 9, 128))), ValueError, "k: expected the batch, seq and head_dim of q"
    ),
    BadInput(
        "k head_dim", lambda r: dict(k=r.normal((2, 2, 8, 64))), ValueError, "k: expected the batch, seq and head_dim"
    ),
    BadInput(
        "odd rotary dim",
        lambda r: dict(cos=r.normal((1, 8, 65)), sin=r.normal((1, 8, 65))),
        ValueError,
        "rotary_dim (cos.shape[-1]): expected an even number > 0",
    ),
    BadInput(
        "rotary_dim > head_dim",
        lambda r: dict(cos=r.normal((1, 8, 256)), sin=r.normal((1, 8, 256))),
        ValueError,
        "rotary_dim (cos.shape[-1]): expected at most head_dim = 128, got 256",
    ),
    BadInput("rotary_dim != cos", dict(rotary_dim=64), ValueError, "rotary_dim: expected the width of cos and sin"),
    BadInput(
        "cos seq mismatch",
        lambda r: dict(cos=r.normal((1, 7, 128)), sin=r.normal((1, 7, 128))),
        ValueError,
        "cos: expected shape (2 or 1, 8, rotary_dim)",
    ),
    BadInput(
        "cos batch mismatch",
        lambda r: dict(cos=r.normal((3, 8, 128)), sin=r.normal((3, 8, 128))),
        ValueError,
        "cos: expected shape (2 or 1, 8, rotary_dim)",
    ),
    BadInput("cos rank", lambda r: dict(cos=r.normal((8, 128))), ValueError, "cos: expected 3 dimensions"),
    BadInput(
        "sin shape", lambda r: dict(sin=r.normal((1, 8, 64))), ValueError, "sin: expected the shape of cos (1, 8, 128)"
    ),
    BadInput("sin dtype", lambda r: dict(sin=r.normal((1, 8, 128), BF16)), TypeError, "sin: expected dtype"),
    BadInput("layout", dict(layout="sbhd"), ValueError, "layout: expected 'bhsd' or 'bshd', got 'sbhd'"),
    BadInput("interleaved", dict(interleaved="yes"), TypeError, "interleaved: expected a bool"),
    BadInput("blocks a tuple", dict(blocks=(1, 8)), TypeError, "blocks: expected a RotaryBlocks or None, got tuple"),
    BadInput(
        "blocks of another kernel",
        dict(blocks=tk.RmsNormBlocks(8)),
        TypeError,
        "blocks: expected a RotaryBlocks or None, got RmsNormBlocks",
    ),
    BadInput(
        "block_seq not a sublane multiple",
        dict(blocks=RotaryBlocks(1, 4)),
        ValueError,
        "blocks.block_seq: expected a multiple of 8 (whole sublane tiles of the float32 blocks",
    ),
    BadInput(
        "block_seq not a multiple of bf16 q's sublane tile",
        lambda r: dict(_base(r, seq=24, dtype=BF16), blocks=RotaryBlocks(1, 8)),
        ValueError,
        "blocks.block_seq: expected a multiple of 16 (whole sublane tiles of the bfloat16 and float32 blocks",
    ),
    BadInput(
        "block_batch a float",
        dict(blocks=RotaryBlocks(1.0, 8)),
        TypeError,
        "blocks.block_batch: expected a positive int, got float 1.0",
    ),
    BadInput("block_batch 0", dict(blocks=RotaryBlocks(0, 8)), ValueError, "blocks.block_batch: expected a positive"),
    BadInput(
        "block_seq without block_batch",
        dict(blocks=RotaryBlocks(block_seq=8)),
        ValueError,
        "blocks: expected both block_batch and block_seq, or neither",
    ),
    BadInput(
        "broadcast loads for head-major blocks",
        dict(blocks=RotaryBlocks(broadcast_loads=True)),
        ValueError,
        "blocks.broadcast_loads: only token-major blocks (layout 'bshd', or a decode call)",
    ),
    BadInput(
        "broadcast_loads not a bool",
        dict(blocks=RotaryBlocks(broadcast_loads=1)),
        TypeError,
        "blocks.broadcast_loads: expected True, False or None, got int",
    ),
    BadInput(
        "decode block_batch",
        lambda r: dict(_base(r, batch=6, seq=1, table_batch=6), blocks=RotaryBlocks(2, 1)),
        ValueError,
        "blocks.block_batch: a decode call (seq 1) runs its 6 sequences as one sequence of 6 tokens",
    ),
    BadInput(
        "vmem_limit_bytes over the core's VMEM",
        dict(blocks=RotaryBlocks(1, 8, vmem_limit_bytes=1 << 40)),
        ValueError,
        "blocks.vmem_limit_bytes: expected 1 to 134217728 bytes (the VMEM of a v6e core)",
    ),
    BadInput(
        "blocks too large for v7x VMEM",
        dict(**BIG, blocks=RotaryBlocks(1, 384), generation="v7x"),
        ValueError,
        "blocks: these blocks need 72.8 MiB of VMEM, more than the 64 MiB of a v7x core",
    ),
    BadInput(
        "blocks over the vmem limit given",
        dict(**BIG, blocks=RotaryBlocks(1, 384, vmem_limit_bytes=32 << 20), generation="v6e"),
        ValueError,
        "blocks: these blocks need 72.8 MiB of VMEM, more than the vmem_limit_bytes of 32.0 MiB on v6e",
    ),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_INPUTS)
def test_bad_input_is_a_clear_error(rand, case):
    ladder.assert_clear_error(case, _call_apply_rotary, _base(rand), rand)


@pytest.mark.cpu_only
def test_blocks_fit_is_judged_per_generation():
    """The blocks too large for a v7x core fit a v6e one: the VMEM check reads the generation being traced for."""
    blocks = RotaryBlocks(1, 384)
    with _traced_for("v6e"):
        calls = ladder.pallas_calls(lambda *a: tk.apply_rotary(*a, blocks=blocks), *BIG.values())
    assert [c.grid for c in calls] == [(1, 11)], calls
    assert 72 << 20 < calls[0].vmem_limit_bytes <= 96 << 20, calls  # derived: the working set fits under it


def _call_rms_norm_rope(args):
    args = dict(args)
    positional = [args.pop(name) for name in ("q", "k", "q_weight", "k_weight", "cos", "sin")]
    return tk.rms_norm_rope(*positional, **args)


BAD_NORM_INPUTS = [
    BadInput("q_weight shape", lambda r: dict(q_weight=r.normal((64,))), ValueError, "q_weight: expected shape (128,)"),
    BadInput("k_weight missing", dict(k_weight=None), ValueError, "k_weight: expected a [128] norm weight, got None"),
    BadInput("eps negative", dict(eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
    BadInput(
        "block_seq not a sublane multiple",
        dict(blocks=RotaryBlocks(1, 4)),
        ValueError,
        "blocks.block_seq: expected a multiple of 8",
    ),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_NORM_INPUTS)
def test_bad_norm_input_is_a_clear_error(rand, case):
    good = dict(_base(rand), q_weight=rand.normal((128,)), k_weight=rand.normal((128,)), eps=1e-6)
    ladder.assert_clear_error(case, _call_rms_norm_rope, good, rand)


def _call_from_positions(args):
    args = dict(args)
    return tk.apply_rotary_from_positions(args.pop("q"), args.pop("k"), args.pop("positions"), **args)


BAD_POSITION_INPUTS = [
    BadInput(
        "positions beyond float32's exact range",
        dict(positions=jnp.full((2, 8), 1 << 24, jnp.int32)),
        ValueError,
        "positions: expected values in [0, 16777216)",
    ),
    BadInput(
        "negative positions",
        dict(positions=jnp.full((1, 8), -1, jnp.int32)),
        ValueError,
        "positions: expected values in [0, 16777216)",
    ),
    BadInput(
        "positions float", lambda r: dict(positions=r.normal((2, 8))), TypeError, "positions: expected dtype in (int32)"
    ),
    BadInput(
        "positions shape",
        lambda r: dict(positions=r.integers(0, 9, (2, 9))),
        ValueError,
        "positions: expected shape (2 or 1, 8)",
    ),
    BadInput("odd rotary_dim", dict(rotary_dim=63), ValueError, "rotary_dim: expected an even number > 0"),
    BadInput("rotary_dim > head_dim", dict(rotary_dim=130), ValueError, "rotary_dim: expected at most head_dim"),
    BadInput("theta", dict(theta=float("nan")), ValueError, "theta: expected a finite number"),
    BadInput("scaling type", dict(scaling={"rope_type": "longrope"}), ValueError, "scaling['rope_type']"),
    BadInput(
        "scaling missing key",
        dict(scaling={"rope_type": "llama3", "factor": 8.0}),
        ValueError,
        "scaling: rope_type 'llama3' needs",
    ),
    BadInput(
        "scaling unknown key",
        dict(scaling={"rope_type": "linear", "factor": 2.0, "beta": 1}),
        ValueError,
        "unexpected key(s) ['beta']",
    ),
    BadInput(
        "scaling factor",
        dict(scaling={"rope_type": "linear", "factor": -2.0}),
        ValueError,
        "scaling['factor']: expected a number > 0",
    ),
    BadInput(
        "block_seq not a sublane multiple of int32 positions",
        dict(blocks=RotaryBlocks(1, 4)),
        ValueError,
        "blocks.block_seq: expected a multiple of 8 (whole sublane tiles of the float32 and int32 blocks",
    ),
    BadInput("blocks a dict", dict(blocks={"block_seq": 8}), TypeError, "blocks: expected a RotaryBlocks or None"),
]


@pytest.mark.cpu_only
@ladder.bad_input_params(BAD_POSITION_INPUTS)
def test_bad_position_input_is_a_clear_error(rand, case):
    base = _base(rand)
    good = dict(q=base["q"], k=base["k"], positions=rand.integers(0, 100, (2, 8)), theta=1e4)
    ladder.assert_clear_error(case, _call_from_positions, good, rand)


@pytest.mark.cpu_only
def test_head_too_large_for_vmem_is_a_clear_error():
    q = jax.ShapeDtypeStruct((1, 4096, 8, 8192), F32)
    cos = jax.ShapeDtypeStruct((1, 8, 8192), F32)
    with pytest.raises(ValueError, match="q: heads .* too large"):
        jax.eval_shape(tk.apply_rotary, q, q, cos, cos)


# ------------------------------------------------------------------------------------------------ rungs 2 and 3
@pytest.mark.cpu_only
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
# v6e (the benchmarks' target) compiles one shape per distinct kernel: the body depends on the table's blocks
# (block_seq, broadcast loads, VMEM limit), heads and head_dim, not on the grid size. A decode batch runs as one
# sequence of its tokens in blocks of block_seq = batch up to 32 (Qwen3) or 16 (Gemma 4), then 32 / 64 (Qwen3: 32 at
# 64 and 128 tokens, 64 at 256) or 16 / 32 (Gemma 4: 16 at 32 and 64, 32 at 128 and 256). Batches 1, 8, 16, 32 and
# 256 reach every entry but the 2- and 4-token blocks, which lie between 1 and 8 (all under a bf16 sublane tile).
# v5e and v7x: the largest decode batch and the longest prefill.
BENCH_DECODE = [b for b in ROTARY_DECODE_BATCHES if b in (1, 8, 16, 32, 256)]
BENCH_SHAPES = [(b, 1) for b in BENCH_DECODE] + [(1, s) for s in ROTARY_PREFILL_SEQS]
SHAPES_BY_GENERATION = {"v6e": BENCH_SHAPES, "v5e": [(256, 1), (1, 32768)], "v7x": [(256, 1), (1, 32768)]}


@pytest.mark.cpu_only
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


@pytest.mark.cpu_only
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


@pytest.mark.cpu_only
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


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", SCALINGS, ids=[c[0] for c in SCALINGS])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_cos_sin_matches_reference(rand, case, interleaved):
    """The tables rope_cos_sin builds (one transcendental per distinct angle) are the reference's (each lane's)."""
    _, scaling, rotary_dim = case
    positions = rand.integers(0, 60000, (3, 20))
    kw = dict(head_dim=128, theta=1e6, rotary_dim=rotary_dim, scaling=scaling, interleaved=interleaved)
    for actual, expected in zip(api.rope_cos_sin(positions, **kw), _reference_tables(positions, **kw)):
        ladder.assert_close(actual, expected, dtype=F32, rtol=1e-6, atol=1e-6)


# The sweep's shapes here: Qwen3's bhsd prefill on cos/sin tables (head-major blocks) and its fused norm + rope from
# positions at a 256-token decode batch (token-major, broadcast loads unrolled up to 256 tokens).
CANDIDATE_SHAPES = [("apply_rotary-prefill", 1, 2048), ("rms_norm_rope_from_positions-decode", 256, 1)]


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", CANDIDATE_SHAPES, ids=[c[0] for c in CANDIDATE_SHAPES])
def test_candidate_blocks_compile_for_tpu(case):
    """The sweep's candidates are legal tilings, the table's choice first, and the choice is what the op runs with by
    default. The candidates differ only in their token block (whole sublane tiles, one sequence a step, one factor-row
    path: asserted), so the kernel body keeps its structure and only VMEM and the broadcast loads' unrolled length
    grow with the block: the smallest and the largest compile on v6e and bracket the rest. The table's choice traces
    to the kernel blocks=None runs (asserted), which test_compiles_for_tpu_at_benchmark_shapes[v6e-qwen3-30b-a3b]
    compiles at these shapes (apply_rotary at 2048 tokens, the fused norm + rope from positions at batch 256)."""
    name, batch, seq = case
    q = jax.ShapeDtypeStruct((batch, 32, seq, 128), BF16)
    k = jax.ShapeDtypeStruct((batch, 4, seq, 128), BF16)
    w, table = jax.ShapeDtypeStruct((128,), BF16), jax.ShapeDtypeStruct((1, seq, 128), BF16)
    positions = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    if name.startswith("apply_rotary"):
        arrays, tables = (q, k, table, table), (table, table)

        def op(q, k, c, s, blocks=None):
            return api.apply_rotary(q, k, c, s, blocks=blocks)
    else:
        arrays, tables = (q, k, w, positions), positions

        def op(q, k, w, p, blocks=None):
            return api.rms_norm_rope_from_positions(q, k, w, w, p, theta=1e6, blocks=blocks)

    with jax.default_device(ladder.tpu_device("v6e")):
        arguments = api.tuning_arguments(q, k, tables)
        candidates = tuning.candidate_blocks(**arguments)
        default = ladder.pallas_calls(op, *arrays)
        table_choice = ladder.pallas_calls(lambda *a: op(*a, blocks=candidates[0]), *arrays)
    assert table_choice == default, (table_choice, default)
    assert candidates[0] == tuning.choose_blocks(**arguments, info=api.chip.tpu_info_for("v6e")), candidates
    assert len(candidates) >= 4 and len({(c.block_batch, c.block_seq) for c in candidates}) == len(candidates)
    kernel_seq = seq if seq > 1 else batch  # a decode batch runs as one sequence of its tokens
    assert default[0].grid == (1, kernel_seq // candidates[0].block_seq), (default, candidates[0])
    multiple = tuning.sublane_multiple(BF16)
    assert all(c.block_batch == 1 and c.block_seq % multiple == 0 for c in candidates), candidates
    assert len({c.broadcast_loads for c in candidates}) == 1, candidates
    by_tokens = sorted(candidates, key=lambda c: c.block_seq)
    for blocks in (by_tokens[0], by_tokens[-1]):
        ladder.compile_for_tpu(
            lambda *a, blocks=blocks: op(*a, blocks=blocks),
            "v6e",
            *((a.shape, a.dtype) for a in arrays),
            label=f"{name}, {blocks.block_batch} x {blocks.block_seq}-token blocks",
        )


@pytest.mark.cpu_only
def test_inverse_frequencies_default_formula():
    inv, scale, r = frequencies.inverse_frequencies(128, 1e6, 128)
    np.testing.assert_allclose(inv, 1.0 / (1e6 ** (np.arange(0, 128, 2) / 128)), rtol=1e-6)
    assert scale == 1.0 and r == 128
