"""The fused backward's two streaming kernels around the dk/dv kernel (see backward.py).

The fused dk/dv kernel also produces dq: each visit (query block i, key block j) writes its share ds k of dq to its
own f32 block, slot r of query block i (r: how many key blocks before j block i needs; schedule.dq_slots), so that
nothing is accumulated across grid steps in HBM. Around it:

- `delta`: rowsum(o * do) minus the lse cotangent, per row and head, before the dk/dv kernel (the unfused backward's
  dq kernel computes it in passing; here it is one pass over o and do);
- `sum_slots`: dq of query block i is the sum of its first n_i slots, times the scale the kernel left out. The grid
  walks the slots of each block with the slot index clamped to n_i - 1, so that the pipeline fetches only filled
  slots (a repeated block index moves no data).
"""

import functools
import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.manual_axes import out_struct
from .geometry import Geometry


def delta_column(o_ref, do_ref, dlse_ref, h: int, v_head_dim: int):
    """(bq, 1) f32 delta of head h of the step: rowsum(o * do) - d_lse, from (bq, heads * Dv) o / do blocks (refs or
    values) and a (bq, heads) lse cotangent block (None: the lse output is not differentiated)."""
    o = o_ref[:, h * v_head_dim : (h + 1) * v_head_dim].astype(jnp.float32)
    do = do_ref[:, h * v_head_dim : (h + 1) * v_head_dim].astype(jnp.float32)
    delta = jnp.sum(o * do, axis=1, keepdims=True)
    return delta if dlse_ref is None else delta - dlse_ref[:, h : h + 1]


def _delta_kernel(o_ref, do_ref, *refs, geometry: Geometry, has_dlse: bool, merge: bool):
    dlse_ref = refs[0] if has_dlse else None
    delta_ref = refs[int(has_dlse)]
    g = geometry
    o, do = o_ref, do_ref
    if merge:
        # (bq, heads, Dv) blocks as the arrays lie: merged into lanes in registers; do is also written out merged,
        # the layout the dk/dv kernel streams it in (instead of an XLA relayout copy of do)
        width = g.heads_per_step * g.v_head_dim
        o = o_ref[...].reshape(g.block_q, width)
        do = do_ref[...].reshape(g.block_q, width)
        refs[-1][...] = do
    for h in range(g.heads_per_step):
        delta_ref[:, h : h + 1] = delta_column(o, do, dlse_ref, h, g.v_head_dim)


def delta(out, d_out, d_lse, lse_shape, *, geometry: Geometry, params_for):
    """(delta, do): delta [head groups, Tq, heads per step] f32 (lse's layout, lse_shape) from out, d_out and d_lse
    (lse's layout, or None); do [Tq, Hq * Dv], d_out merged. out and d_out either [Tq, Hq * Dv] (do is d_out) or
    [Tq, Hq, Dv] as they lie (forward.heads_in_place: the kernel also writes do merged). params_for(dimension
    semantics) -> the compiler params."""
    g = geometry
    hs = g.heads_per_step
    merge = out.ndim == 3
    if merge:
        row_spec = pl.BlockSpec((g.block_q, hs, g.v_head_dim), lambda group, i: (i, group, 0))
    else:
        row_spec = pl.BlockSpec((g.block_q, hs * g.v_head_dim), lambda group, i: (i, group))
    stats_spec = pl.BlockSpec((None, g.block_q, hs), lambda group, i: (group, i, 0))
    operands = [out, d_out] + ([] if d_lse is None else [d_lse])
    out_shape = [out_struct(lse_shape, jnp.float32, operands)]
    out_specs = [stats_spec]
    if merge:
        out_shape.append(out_struct((g.q_rows, g.q_heads * g.v_head_dim), d_out.dtype, operands))
        out_specs.append(pl.BlockSpec((g.block_q, hs * g.v_head_dim), lambda group, i: (i, group)))
    results = pl.pallas_call(
        functools.partial(_delta_kernel, geometry=g, has_dlse=d_lse is not None, merge=merge),
        out_shape=out_shape,
        grid=(g.head_groups, g.num_q_blocks),
        in_specs=[row_spec, row_spec] + [stats_spec] * (len(operands) - 2),
        out_specs=out_specs,
        compiler_params=params_for(("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(
            flops=2 * out.size,
            transcendentals=0,
            bytes_accessed=(2 + merge) * out.size * out.dtype.itemsize + 2 * math.prod(lse_shape) * 4,
        ),
        name="flash_attention_delta",
    )(*operands)
    return results[0], (results[1] if merge else d_out)


def _sum_kernel(filled_ref, status_ref, parts_ref, dq_ref, acc_ref, *, scale: float):
    block, slot = pl.program_id(1), pl.program_id(2)

    @pl.when(slot == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(slot < filled_ref[block])
    def _add():
        acc_ref[...] += parts_ref[...]

    @pl.when(slot == pl.num_programs(2) - 1)
    def _finalize():
        dq = (acc_ref[...] * jnp.where(status_ref[0] != 0, jnp.nan, scale)).astype(dq_ref.dtype)
        dq_ref[...] = dq.reshape(dq_ref.shape)


def sum_slots(parts, filled, status, *, geometry: Geometry, scale: float, dtype, params_for, split: bool = False):
    """dq [Tq, Hq * D] in dtype, or with split [Tq, Hq, D] as flash-attn lays it (the heads split from the lanes
    in registers; a step's heads a multiple of 8 or all heads, forward.heads_in_place): query block i's first
    filled[i] slots summed, times scale (NaN when status[0] != 0: the visit lists overflowed). parts [slots * query
    blocks + 1, block_q, Hq * D] f32: slot r of block i at r * (query blocks) + i."""
    g = geometry
    hs = g.heads_per_step
    slots = (parts.shape[0] - 1) // g.num_q_blocks

    def parts_map(group, i, slot, filled_ref, status_ref):
        # past the filled slots: the last filled one again (no DMA); a block with none reads slot 0, unused
        return jnp.minimum(slot, jnp.maximum(filled_ref[i] - 1, 0)) * g.num_q_blocks + i, 0, group

    width = hs * g.head_dim
    if split:
        out_shape = out_struct((g.q_rows, g.q_heads, g.head_dim), dtype, filled, status, parts)
        out_spec = pl.BlockSpec((g.block_q, hs, g.head_dim), lambda group, i, slot, *_: (i, group, 0))
    else:
        out_shape = out_struct((g.q_rows, g.q_heads * g.head_dim), dtype, filled, status, parts)
        out_spec = pl.BlockSpec((g.block_q, width), lambda group, i, slot, *_: (i, group))
    return pl.pallas_call(
        functools.partial(_sum_kernel, scale=scale),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(g.head_groups, g.num_q_blocks, slots),
            in_specs=[pl.BlockSpec((None, g.block_q, width), parts_map)],
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((g.block_q, width), jnp.float32)],
        ),
        compiler_params=params_for(("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=slots * g.q_rows * g.q_heads * g.head_dim,
            transcendentals=0,
            bytes_accessed=(slots * 4 + jnp.dtype(dtype).itemsize) * g.q_rows * g.q_heads * g.head_dim,
        ),
        name="flash_attention_dq_sum",
    )(filled, status, parts)
