"""Pallas TPU kernel for rotary position embeddings (RoPE), optionally fused with a per-head RMSNorm.

One pallas_call rotates q and k (any head counts) together, so the per-token cos/sin rows (or positions) are read
once for all heads of both. Layouts, as seen by the kernel:
  seq_major ("bshd"): x [B, S, H, D], block (block_batch, block_seq, H, D): each token's heads form a (H, D) tile;
  head_major ("bhsd"): x [B, H, S, D], block (block_batch, H, block_seq, D): each head is a (block_seq, D) slab.
Tables are per token: cos/sin [Bc, S, W] (Bc = 1 broadcasts over the batch), a block (block_batch or 1, block_seq,
W) broadcast over heads in the kernel; or positions [Bp, S] with the inverse frequencies [1, W], read as
PositionsLayout says (lane-major rows where XLA stores them so) and turned into cos/sin in the kernel.

The rotation works on the last (lane) axis of width W (the head dim, or the first W lanes when only an aligned
prefix rotates). rotate_half pairs lane j with j + r/2 (j < r/2); the interleaved (GPT-J) convention pairs 2i with
2i+1. The partner lanes come from two lane rotations (`pltpu.roll`); which of the two holds lane j's partner is
decided by rolling a lane iota the same way, so the kernel does not depend on the rotation direction convention.
The result is x * cos + R(x) * sin with R(x)[j] = -x[p(j)] for the first lane of a pair and +x[p(j)] for the
second; the transpose (the backward, since RoPE is linear in x) is g * cos - R(g * sin). Lanes at or past
`rotary_dim` pass through unchanged.

Token blocks are independent ("parallel" on both grid axes), which lets a multi-core chip split the grid. A ragged
last block computes on padding rows whose writes Pallas drops; nothing reduces across rows.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.manual_axes import out_struct
from .tuning import RotaryBlocks


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Static facts of one kernel call."""

    rotary_dim: int  # lanes [0, rotary_dim) of the table width rotate; the rest pass through
    interleaved: bool
    seq_major: bool  # x is [B, S, H, D] ("bshd"), else [B, H, S, D] ("bhsd")
    transpose: bool = False  # apply the transpose rotation (the gradient)
    from_positions: bool = False  # tables are positions + inverse frequencies, not cos/sin
    attention_scaling: float = 1.0  # cos and sin are scaled by this (yarn); positions mode only
    # positions mode: lanes [0, angle_lanes) of the distinct frequencies hold every nonzero one (a multiple of 128;
    # None: all). Past them the angle is 0 (proportional rope's zero tail): cos 1 and sin 0 without transcendentals.
    angle_lanes: int | None = None
    norm: bool = False  # per-head RMSNorm over D before the rotation
    eps: float = 1e-6
    weight_offset: float = 0.0


# Token-major blocks that read their per-token factor rows by broadcast loads (RotaryBlocks.broadcast_loads; the
# tuning table's rule is tuning.BROADCAST_LOAD_MAX_TOKENS) process them in groups of tokens whose factor rows take at
# most this many vregs (one vreg a token costs no more in the model, but unrolling per token multiplies the kernel's
# size, its compile and its interpret-mode time).
GROUP_FACTOR_VREGS = 8

# "rows" packing of cos/sin (see _cos_sin) from blocks of this many tokens (a multiple of it): modeled v6e, Qwen3
# decode at 256 tokens in 64-token blocks 1434 cycles a step packed vs 1523 unpacked; at 32-token blocks it costs
# more than it saves.
ROWS_PACKING_MIN_TOKENS = 64

# Rows up to this many positions are read whole by "row_select" when they are not a multiple of 128 (each step then
# selects over all of them: ceil(S / 128) vregs per 8 tokens).
ROW_SELECT_MAX_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class PositionsLayout:
    """How the kernel reads positions [Bp, Sp] (Sp = S, or 1 for one position shared by every token).

    mode: "row_blocks": lane-major blocks (1, 1, ts) of the row (Bp = 1, ts % 128 == 0);
          "row_select": the whole row (1, 1, S), fetched once (Bp = 1; S % 128 == 0 with ts dividing 128, or
          S <= ROW_SELECT_MAX_TOKENS: every decode batch up to that);
          "column": a [Bp, Sp, 1] copy made by XLA, (b, ts, 1) blocks: per-sequence positions, long ragged rows.
    packing: "none", "lanes" or "rows" (see _cos_sin).
    """

    mode: str
    packing: str
    block_seq: int


def positions_layout(positions_shape, *, seq: int, cfg: RopeConfig, width: int, blocks: RotaryBlocks):
    """The PositionsLayout for positions of `positions_shape`, x of `seq` tokens per sequence and a `width`-lane
    table (the inverse frequencies as the API builds them: [f, f] when not interleaved and rotary_dim == width)."""
    rows, row_len = positions_shape
    ts = blocks.block_seq
    mode = "column"
    if rows == 1 and row_len == seq > 1:
        if ts % 128 == 0:
            mode = "row_blocks"
        elif (128 % ts == 0 and seq % 128 == 0) or seq <= ROW_SELECT_MAX_TOKENS:
            mode = "row_select"
    packing = "none"
    if not cfg.interleaved and cfg.rotary_dim == width:
        if (width // 2) % 128 == 0:
            packing = "lanes"
        elif (
            width == 128
            and ts % ROWS_PACKING_MIN_TOKENS == 0
            and (rows == 1 or blocks.block_batch == 1)
            and row_len == seq
        ):
            packing = "rows"
    return PositionsLayout(mode=mode, packing=packing, block_seq=ts)


def uses_broadcast_loads(cfg: RopeConfig, blocks: RotaryBlocks) -> bool:
    """Whether token-major blocks take their per-token factor rows by broadcast loads (see _kernel): as the blocks
    say (resolved by tuning.resolve_blocks, which also refuses them for head-major blocks)."""
    if blocks.broadcast_loads is None:
        raise ValueError("rope: blocks.broadcast_loads must be resolved (tuning.resolve_blocks) before the kernel")
    return cfg.seq_major and blocks.broadcast_loads


def _pairs(width, cfg: RopeConfig):
    """(lane ids (1, W), first (1, W): lane j is the first of its pair, partner ids (1, W), roll shift)."""
    lane2d = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    if cfg.interleaved:
        first = lane2d % 2 == 0
        return lane2d, first, jnp.where(first, lane2d + 1, lane2d - 1), 1
    half = cfg.rotary_dim // 2
    first = lane2d < half
    return lane2d, first, jnp.where(first, lane2d + half, lane2d - half), half


def _first_lanes(y, cfg: RopeConfig):
    """A mask broadcastable to y: lane j is the first of its pair."""
    return _pairs(y.shape[-1], cfg)[1].reshape((1,) * (y.ndim - 1) + (y.shape[-1],))


def _partner_lanes(y, cfg: RopeConfig):
    """partner[..., j] = y[..., p(j)] for lanes j < rotary_dim."""
    width = y.shape[-1]
    axis = y.ndim - 1
    lane2d, _, partner_idx, shift = _pairs(width, cfg)
    a = pltpu.roll(y, shift, axis)
    other = (width - shift) % width
    if other == shift:  # rotating by half the width: both directions agree
        return a
    # Where lane j of `a` came from, found by rolling the lane ids the same way.
    source = pltpu.roll(lane2d, shift, 1)
    pick_a = (source == partner_idx).reshape((1,) * (y.ndim - 1) + (width,))
    return jnp.where(pick_a, a, pltpu.roll(y, other, axis))


def _lane_factors(cos, sin, w, cfg: RopeConfig):
    """(a, b), per token and lane, with rotated = x * a + partner(x) * b, for cos/sin (..., W) f32 and the norm
    weight w (1, W) f32 (offset included) or None. Folding the pair signs, the transpose's partner sin and the norm
    weight into these per-token rows (shared by every head) leaves two multiplies and an add per element.

    rotate_half / interleaved: out[j] = y[j] cos[j] - y[p(j)] sin[j] (first lane of a pair), + y[p(j)] sin[j]
    (second), y = x * w; transpose: out[j] = g[j] cos[j] + g[p(j)] sin[p(j)] (first), - g[p(j)] sin[p(j)] (second).
    """
    first = _first_lanes(sin, cfg)
    if cfg.transpose:
        partner_sin = _partner_lanes(sin, cfg)
        return cos, jnp.where(first, partner_sin, -partner_sin)
    signed_sin = jnp.where(first, -sin, sin)
    if w is None:
        return cos, signed_sin
    return cos * w, signed_sin * _partner_lanes(w, cfg)


def _rotate(x, a, b, cfg: RopeConfig, passthrough=None):
    """x * a + partner(x) * b over the last axis (f32); lanes at or past rotary_dim get passthrough (x if None)."""
    out = x * a + _partner_lanes(x, cfg) * b
    width = x.shape[-1]
    if cfg.rotary_dim < width:
        lane = jax.lax.broadcasted_iota(jnp.int32, (1,) * (x.ndim - 1) + (width,), x.ndim - 1)
        out = jnp.where(lane < cfg.rotary_dim, out, x if passthrough is None else passthrough)
    return out


def _mean_square(x, in_dtype):
    """mean(x * x) over the last (head) axis of f32 x: (..., 128) (the mean in every lane) or (..., 1).

    At head_dim 128 with bf16 inputs the row sums run on the MXU, otherwise idle, instead of a cross-lane (XLU)
    reduction per 128-wide row, which with the rotation's lane roll makes the fused op compute-bound (modeled v6e,
    Qwen3 prefill S=2048: ~2200 cycles per 128-token step on the MXU vs ~2700 cross-lane). x * x of a bf16 x is
    exact in f32 and splits exactly into two bf16 parts, hi + lo, so [hi | lo] @ [1/128; 1/128] (f32 accumulation;
    1/128 is exact) is the f32 mean. Wider heads (256, 512) model faster with the cross-lane reduction (one per
    several vregs of work), as do f32 inputs (whose squares do not split exactly) and head tiles that are not whole
    sublane groups.
    """
    x2 = x * x
    if jnp.dtype(in_dtype) != jnp.dtype(jnp.bfloat16) or x.shape[-1] != 128 or x.shape[-2] % 8:
        return jnp.mean(x2, axis=-1, keepdims=True)
    x2 = x2.reshape(-1, 128)
    hi = x2.astype(jnp.bfloat16)
    lo = (x2 - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    ones = jnp.full((256, 128), 1.0 / 128, jnp.bfloat16)
    ms = jnp.dot(jnp.concatenate([hi, lo], axis=-1), ones, preferred_element_type=jnp.float32)
    return ms.reshape(x.shape)


def _positions_column(table_a, layout: PositionsLayout):
    """This step's positions as f32 (b, ts, 1): token on sublanes, as the angles broadcast over lanes.

    XLA keeps a row of positions lane-major in HBM; a (ts, 1) column block of it costs an XLA relayout copy before
    the kernel (1.26 us at 256 decode tokens, modeled v6e), so rows are read as they lie and moved to sublanes
    here (positions < 2**24 are exact in f32)."""
    if layout.mode == "column":  # table_a: (b, ts, 1) int32
        return table_a[...].astype(jnp.float32)
    ts = layout.block_seq
    if layout.mode == "row_blocks":  # table_a: (1, 1, ts), ts % 128 == 0: one (8, 128) transpose per 128 tokens
        row = table_a[0].astype(jnp.float32)
        return jnp.transpose(jnp.broadcast_to(row, (8, ts)))[None, :, 0:1]
    # "row_select": table_a is the whole row (1, 1, S). Token t's position is the one lane of its sublane-broadcast
    # row that a diagonal mask keeps, summed across lanes (exact: one nonzero term); the window is the 128-token chunk
    # holding this step's tokens when S is a multiple of 128 that ts divides, else the whole (short) row. Modeled v6e
    # this costs 7-28 cycles a step where a transpose of the chunk into scratch cost 116-200.
    step = pl.program_id(1)
    row_length = table_a.shape[-1]
    if row_length % 128 == 0 and 128 % ts == 0:
        # 128 // ts steps per chunk, a power of two: shifts and masks, as integer `//` and `%` of a traced value
        # lower through a TPU-info query that fails when exporting on a CPU host (what rung 2 does).
        steps_per_chunk = 128 // ts
        chunk = jax.lax.shift_right_logical(step, steps_per_chunk.bit_length() - 1)
        window = table_a[0, :, pl.ds(pl.multiple_of(chunk * 128, 128), 128)]
        offset = jnp.bitwise_and(step, steps_per_chunk - 1) * ts
    else:
        window, offset = table_a[0], step * ts
    shape = (ts, window.shape[-1])
    token = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + offset
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    picked = jnp.where(token == lane, jnp.broadcast_to(window.astype(jnp.float32), shape), 0.0)
    return jnp.sum(picked, axis=-1, keepdims=True)[None]


def _cos_sin(pos, inv, cfg: RopeConfig, packing: str):
    """cos/sin (b, ts, W) f32 of the angles pos * inv (the f32 product transformers forms), for pos (b, ts, 1) and
    the inverse frequencies inv (1, W).

    Without interleaving, a fully rotating table repeats its frequencies in its two halves, so half the angles are
    distinct and the transcendentals (the bulk of the kernel's compute at head_dim 128) run on half the vregs:
      "lanes" (W/2 a multiple of 128): the first W/2 lanes (only the first cfg.angle_lanes of them when the rest
      have frequency 0), then both halves as whole vregs;
      "rows" (W = 128, b = 1, ts a multiple of ROWS_PACKING_MIN_TOKENS): tokens t and t + ts/2 share a row (lanes
      < 64 and >= 64), then one lane rotation by 64 and two selects give each token its [f, f] row (modeled v6e,
      Qwen3 prefill: -217 cycles a 128-token step; at 32-token decode steps the unpacking costs more than it saves).
    Every angle is the same f32 product either way.
    """
    if packing == "lanes":
        half = inv.shape[-1] // 2
        live = min(half, cfg.angle_lanes or half)
        angle = pos * inv[:, :live][None]
        c, s = jnp.cos(angle), jnp.sin(angle)
        if live < half:  # zero frequencies: the angle is exactly 0 there
            tail = c.shape[:-1] + (half - live,)
            c = jnp.concatenate([c, jnp.ones(tail, c.dtype)], axis=-1)
            s = jnp.concatenate([s, jnp.zeros(tail, s.dtype)], axis=-1)
        cos, sin = jnp.concatenate([c, c], axis=-1), jnp.concatenate([s, s], axis=-1)
    elif packing == "rows":
        p = pos[0]
        half = p.shape[0] // 2
        low_lanes = jax.lax.broadcasted_iota(jnp.int32, (1, 128), 1) < 64
        angle = jnp.where(low_lanes, p[:half], p[half:]) * inv

        def unpack(t):  # (ts/2, 128) packed -> (1, ts, 128): tokens [0, ts/2) from lanes < 64, the rest from >= 64
            swapped = pltpu.roll(t, 64, 1)
            return jnp.concatenate([jnp.where(low_lanes, t, swapped), jnp.where(low_lanes, swapped, t)], axis=0)[None]

        cos, sin = unpack(jnp.cos(angle)), unpack(jnp.sin(angle))
    else:
        angle = pos * inv[None]
        cos, sin = jnp.cos(angle), jnp.sin(angle)
    if cfg.attention_scaling != 1.0:
        cos, sin = cos * cfg.attention_scaling, sin * cfg.attention_scaling
    return cos, sin


def _normed_rotation(x, a, b, w, scale, cfg: RopeConfig):
    """The output (f32, full head width) for f32 x (..., D): x rotated by the lane factors a, b (broadcastable to x's
    first `width` lanes; the norm weight folded in), then times the norm's scale; lanes past the table width pass
    through (times w and the scale under the norm)."""
    width = a.shape[-1]
    head = x[..., :width]
    if not cfg.norm:
        rotated = _rotate(head, a, b, cfg)
    else:
        rotated = _rotate(head, a, b, cfg, passthrough=head * w[:, :width])
        rotated = rotated * (scale if scale.shape[-1] == 1 else scale[..., :width])
    if width == x.shape[-1]:
        return rotated
    # An aligned prefix of the lanes rotates (width % 128 == 0); the rest is copied (normalised).
    rest = x[..., width:]
    if cfg.norm:
        rest = rest * w[:, width:] * (scale if scale.shape[-1] == 1 else scale[..., width:])
    return jnp.concatenate([rotated, rest], axis=-1)


def _kernel(*refs, n, cfg: RopeConfig, positions: PositionsLayout | None, broadcast_loads: bool):
    x_refs = refs[:n]
    table_a, table_b = refs[n], refs[n + 1]
    w_refs = refs[n + 2 : 2 * n + 2] if cfg.norm else ()
    factor_ref = refs[-1] if broadcast_loads else None
    out_refs = refs[len(refs) - n - (1 if broadcast_loads else 0) : len(refs) - (1 if broadcast_loads else 0)]

    if cfg.from_positions:
        # table_a: positions (see PositionsLayout); table_b: inverse frequencies (1, W) f32.
        cos, sin = _cos_sin(_positions_column(table_a, positions), table_b[...], cfg, positions.packing)
    else:
        cos, sin = table_a[...].astype(jnp.float32), table_b[...].astype(jnp.float32)
    width = cos.shape[-1]

    # Norm weights (1, D) f32, offset included ((D // 128, 128) in VMEM). Each x has its own lane factors under the
    # norm (its weight is folded in); without it one pair serves every x.
    weights = [w_ref[...].astype(jnp.float32).reshape(1, -1) + cfg.weight_offset for w_ref in w_refs]
    factor_sets = (
        [_lane_factors(cos, sin, w[:, :width], cfg) for w in weights]
        if cfg.norm
        else [_lane_factors(cos, sin, None, cfg)]
    )
    if broadcast_loads:
        # seq_major: each token's (H, D) tile needs its own factor rows on every sublane. Broadcasting a row of a
        # value costs a sublane permute per vreg column (XLU); parked in VMEM, the rows come back by sublane-
        # broadcast loads (stride 0), which the otherwise lightly used load slots absorb (modeled v6e, decode at
        # 256 tokens: Qwen3 888 cycles a step vs 958 with register broadcasts, Gemma 4 full 816 vs 946).
        for f, (a, b) in enumerate(factor_sets):
            factor_ref[2 * f] = jnp.broadcast_to(a, factor_ref.shape[1:])
            factor_ref[2 * f + 1] = jnp.broadcast_to(b, factor_ref.shape[1:])

    for i in range(n):
        x_in = x_refs[i][...]
        x = x_in.astype(jnp.float32)
        scale = jax.lax.rsqrt(_mean_square(x, x_in.dtype) + cfg.eps) if cfg.norm else None
        w = weights[i] if cfg.norm else None
        f = i if cfg.norm else 0
        if broadcast_loads:
            heads = x.shape[2]

            # Tokens in groups whose factor rows fill at most GROUP_FACTOR_VREGS vregs (a token's: ceil(H / 8)
            # sublane groups x W / 128 lanes), so the rows stay in registers between their load and their use.
            tokens = x.shape[1]
            group = max(1, min(tokens, GROUP_FACTOR_VREGS // (-(-heads // 8) * -(-width // 128))))

            def factor_rows(ref_index, bi, t0, t1):  # (t1 - t0, H, W)
                return jnp.stack(
                    [jnp.broadcast_to(factor_ref[ref_index, bi, pl.ds(t, 1), :], (heads, width)) for t in range(t0, t1)]
                )

            def rotated_group(bi, t0):
                t1 = min(t0 + group, tokens)
                a, b = factor_rows(2 * f, bi, t0, t1), factor_rows(2 * f + 1, bi, t0, t1)
                return _normed_rotation(x[bi, t0:t1], a, b, w, None if scale is None else scale[bi, t0:t1], cfg)

            out = jnp.stack(
                [jnp.concatenate([rotated_group(bi, t0) for t0 in range(0, tokens, group)]) for bi in range(x.shape[0])]
            )
        else:
            # Per-token rows broadcast over heads: (b, ts, 1, W) in bshd, (b, 1, ts, W) in bhsd.
            a, b = (t[:, :, None, :] if cfg.seq_major else t[:, None, :, :] for t in factor_sets[f])
            out = _normed_rotation(x, a, b, w, scale, cfg)
        out_refs[i][...] = out.astype(out_refs[i].dtype)


def rope(xs, table_a, table_b, weights, *, cfg: RopeConfig, blocks: RotaryBlocks):
    """Rotate every array of `xs` (same B, S, D; any head count) with one pallas_call.

    xs: 4D arrays in the layout cfg.seq_major says. Tables: cos/sin [Bc, S, W] (Bc in {1, B}), or, with
    cfg.from_positions, positions [Bp, S] int32 (Bp in {1, B}) and inverse frequencies [1, W] f32 (repeating in
    its halves when not interleaved and rotary_dim == W, as the API builds them); a table with one position
    (S = 1) serves every token. weights: per x its norm weight when cfg.norm, (D // 128, 128) or (1, D) (whichever
    is a bitcast of the caller's [D] in XLA's layouts: no copy), else (). Returns a list of outputs like xs.
    """
    n = len(xs)
    x0 = xs[0]
    batch, seq, head_dim = x0.shape[0], (x0.shape[1] if cfg.seq_major else x0.shape[2]), x0.shape[3]
    bb, ts = blocks.block_batch, blocks.block_seq
    grid = (pl.cdiv(batch, bb), pl.cdiv(seq, ts))

    def x_spec(x):
        if cfg.seq_major:
            return pl.BlockSpec((bb, ts, x.shape[2], head_dim), lambda i, j: (i, j, 0, 0))
        return pl.BlockSpec((bb, x.shape[1], ts, head_dim), lambda i, j: (i, 0, j, 0))

    def per_token_spec(t):
        if t.shape[1] == 1 and seq != 1:
            return fixed_spec(t)  # one token's row shared by every token (a decode batch with a shared table)
        if t.shape[0] == batch and batch != 1:
            return pl.BlockSpec((bb, ts, t.shape[2]), lambda i, j: (i, j, 0))
        return pl.BlockSpec((1, ts, t.shape[2]), lambda i, j: (0, j, 0))  # one row shared by the whole batch

    def fixed_spec(t):
        return pl.BlockSpec(t.shape, lambda i, j: (0,) * t.ndim)  # same block every step: fetched once

    positions = None
    if cfg.from_positions:
        positions = positions_layout(table_a.shape, seq=seq, cfg=cfg, width=table_b.shape[-1], blocks=blocks)
        if positions.mode == "column":
            table_a = table_a.reshape(table_a.shape + (1,))
            pos_spec = per_token_spec(table_a)
        else:  # [1, S] -> [1, 1, S] is a bitcast
            table_a = table_a.reshape(1, 1, table_a.shape[1])
            if positions.mode == "row_blocks":
                pos_spec = pl.BlockSpec((1, 1, ts), lambda i, j: (0, 0, j))
            else:
                pos_spec = fixed_spec(table_a)
        table_specs = [pos_spec, fixed_spec(table_b)]
    else:
        table_specs = [per_token_spec(table_a), per_token_spec(table_b)]
    in_specs = [x_spec(x) for x in xs] + table_specs + ([fixed_spec(w) for w in weights] if cfg.norm else [])
    operands = list(xs) + [table_a, table_b] + (list(weights) if cfg.norm else [])

    elements = sum(x.size for x in xs)
    width = table_b.shape[-1]
    tokens = batch * seq
    cost = pl.CostEstimate(
        flops=(10 if cfg.norm else 6) * elements,
        transcendentals=(
            2 * tokens * width // (1 if positions is None or positions.packing == "none" else 2)
            if cfg.from_positions
            else 0
        )
        + (tokens * n if cfg.norm else 0),
        bytes_accessed=2 * sum(x.size * x.dtype.itemsize for x in xs)
        + table_a.size * table_a.dtype.itemsize
        + table_b.size * table_b.dtype.itemsize,
    )
    broadcast_loads = uses_broadcast_loads(cfg, blocks)
    n_factor_sets = n if cfg.norm else 1  # (a, b) per x under the norm (its weight folded in), else one shared pair
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, cfg=cfg, positions=positions, broadcast_loads=broadcast_loads),
        out_shape=[out_struct(x.shape, x.dtype, operands) for x in xs],
        grid=grid,
        scratch_shapes=[pltpu.VMEM((2 * n_factor_sets, bb, ts, width), jnp.float32)] if broadcast_loads else [],
        in_specs=in_specs,
        out_specs=[x_spec(x) for x in xs],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=blocks.vmem_limit_bytes
        ),
        cost_estimate=cost,
        name=("rms_norm_rope" if cfg.norm else "rope") + ("_bwd" if cfg.transpose else ""),
    )(*operands)
    return list(outs)
