"""Pallas TPU flash attention forward for small sliding windows: each query block in one grid step, over the band of
key blocks its rows can see, with no statistics carried between steps.

Under a window of a few hundred keys (gpt-oss's sliding layers: 128) a query block of BAND_BLOCK rows sees keys of
its own block and of at most `reach` blocks before it, known when the call's row ranges are constants of the program
(dense batches: `band_reach`). The visit kernel (forward.py) spends most of such a visit on what it carries between
visits, the running max, sum and output of every head, read from and written to VMEM scratch at each one, and on the
finalisation step; here a step takes its query block and the `reach + 1` key blocks as separate inputs (index maps
clamped to the array), computes each head's scores over all of them at once, and writes the normalised output and the
log-sum-exp directly: one softmax, no rescaling. Masking is the visit kernel's: lo <= key row <= hi, with key rows
counted from the unclamped block index, so a clamped block's keys are never kept. The layouts of q, the output and
the log-sum-exp are the visit kernel's (the backward reads them as it does after forward.forward).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.blocks import LANES
from ..common.manual_axes import out_struct
from . import forward
from .geometry import LN_2, LOG2_E, Geometry, dot_nn, dot_nt, log2_scores, query_scale, sanitize_rows

# Rows of a query block and of each key block: the MXU's width on the v5e; a window of w keys then spans
# ceil((w - 1) / 128) blocks before a row's own.
BAND_BLOCK = LANES
# The most key blocks before its own one query block may reach (a band of at most 3 x 128 keys): past it the score
# tile of a head outgrows what the step can hold in registers, and the visit kernel's skipping pays.
MAX_REACH = 2


def band_reach(lo: np.ndarray, hi: np.ndarray, q_rows: int, kv_rows: int) -> int | None:
    """How many key blocks before its own (BAND_BLOCK rows each, the same blocking as the query rows) the rows of any
    query block see, from constant row ranges lo, hi [>= q_rows] (schedule.key_ranges), or None where some row sees a
    key past its own block's last row or more than MAX_REACH blocks back (the band kernel does not apply)."""
    rows = np.arange(q_rows)
    lo, hi = np.asarray(lo)[:q_rows], np.asarray(hi)[:q_rows]
    seen = lo <= hi
    if not seen.any():
        return 0
    block = rows[seen] // BAND_BLOCK
    if (hi[seen] >= np.minimum((block + 1) * BAND_BLOCK, kv_rows)).any():
        return None
    reach = int((block - lo[seen] // BAND_BLOCK).max())
    return reach if reach <= MAX_REACH else None


def _band_kernel(*refs, geometry: Geometry, reach: int, has_sinks: bool, with_lse: bool):
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    qinfo_ref, q_ref, *refs = refs
    parts = reach + 1
    k_refs, v_refs = refs[:parts], refs[parts : 2 * parts]
    out_ref, *rest = refs[2 * parts :]
    lse_ref = rest[0] if with_lse else None
    g = geometry
    d, dv, bq, bk = g.head_dim, g.v_head_dim, BAND_BLOCK, BAND_BLOCK
    group_index, q_block = pl.program_id(0), pl.program_id(1)
    last_kv_block = g.num_kv_blocks - 1

    # the band's key rows, block j of the band being key block q_block - reach + j (unclamped: a block before the
    # first or past the last holds no key any row sees)
    first = (q_block - reach) * bk
    keys = first + jax.lax.broadcasted_iota(jnp.int32, (1, parts * bk), 1)
    keep = (keys >= qinfo_ref[:, 0:1]) & (keys <= qinfo_ref[:, 1:2])

    q = q_ref[...]
    if q.ndim == 3:
        q = q.reshape(bq, g.heads_per_step * d)  # [bq, heads, D] as the array lies, merged into lanes
    q = (q.astype(jnp.float32) * query_scale(g)).astype(q.dtype)

    def band_rows(refs, width):
        """The band's key blocks, read once a step with heads merged in lanes and stacked: (parts * bk, kv heads a
        step * width), stale rows past the array zeroed."""
        blocks = []
        for part, ref in enumerate(refs):
            block = jnp.clip(q_block - reach + part, 0, last_kv_block)  # the block the index map fetched
            x = ref[...]
            if x.ndim == 3:
                x = x.reshape(bk, g.kv_heads_per_step * width)
            blocks.append(sanitize_rows(x, block, bk, g.kv_rows))
        return jnp.concatenate(blocks, axis=0) if parts > 1 else blocks[0]

    k_all, v_all = band_rows(k_refs, d), band_rows(v_refs, dv)
    outs = []
    for j in range(g.kv_heads_per_step):
        k, v = k_all[:, j * d : (j + 1) * d], v_all[:, j * dv : (j + 1) * dv]
        for i in range(g.group):
            h = j * g.group + i
            s = jnp.where(keep, log2_scores(dot_nt(q[:, h * d : (h + 1) * d], k), g), -jnp.inf)
            m = jnp.max(s, axis=1, keepdims=True)
            if sinks_ref is not None:
                sink = sinks_ref[group_index * g.heads_per_step + h] * LOG2_E
                m = jnp.maximum(m, sink)
            # a row that sees no key (and has no sink) has m = -inf: its scores are taken from 0, all exp2(-inf) = 0
            m = jnp.where(m == -jnp.inf, 0.0, m)
            p = jnp.exp2(s - m)
            l = jnp.sum(p, axis=1, keepdims=True)
            if sinks_ref is not None:
                l = l + jnp.exp2(sink - m)
            nonzero = l > 0
            inv = jnp.where(nonzero, 1.0 / jnp.where(nonzero, l, 1.0), 0.0)
            out = (dot_nn(p.astype(v.dtype), v) * inv).astype(out_ref.dtype)
            if len(out_ref.shape) == 3:
                outs.append(out)
            else:
                out_ref[:, h * dv : (h + 1) * dv] = out
            if with_lse:
                lse = jnp.where(nonzero, (m + jnp.log2(jnp.where(nonzero, l, 1.0))) * LN_2, jnp.inf)
                lse_ref[:, h : h + 1] = lse
    if outs:
        out_ref[...] = jnp.concatenate(outs, axis=1).reshape(out_ref.shape)


def band_forward(q3d, k3d, v3d, qinfo, sinks, *, geometry: Geometry, reach: int, with_lse: bool, vmem_limit_bytes):
    """forward.forward's out [Tq, Hq, Dv] (and lse [head groups, Tq, heads per step] f32) where every query block's
    rows see keys of its own block and of at most `reach` blocks before it (band_reach), BAND_BLOCK rows a block.
    qinfo [Tq padded to BAND_BLOCK rows at least, 2] int32 (lo, hi); sinks None or [Hq] f32. geometry's blocks are not
    used; its kv heads a step are."""
    g = dataclasses.replace(geometry, block_q=BAND_BLOCK, block_kv=BAND_BLOCK)
    hs, d, dv, b = g.heads_per_step, g.head_dim, g.v_head_dim, BAND_BLOCK
    in_place = forward.heads_in_place(g)
    kv_in_place = forward.kv_heads_in_place(g)
    q = q3d if in_place else q3d.reshape(g.q_rows, g.q_heads * d)
    k = k3d if kv_in_place else k3d.reshape(g.kv_rows, g.kv_heads * d)
    v = v3d if kv_in_place else v3d.reshape(g.kv_rows, g.kv_heads * dv)
    last_kv_block = g.num_kv_blocks - 1

    def kv_spec(width, part):
        def index(group, q_block):
            block = jnp.clip(q_block - reach + part, 0, last_kv_block)
            return (block, 0, 0) if kv_in_place else (block, group)

        shape = (b, g.kv_heads, width) if kv_in_place else (b, g.kv_heads_per_step * width)
        return pl.BlockSpec(shape, index)

    in_specs = [
        pl.BlockSpec((b, 2), lambda group, q_block: (q_block, 0)),
        pl.BlockSpec((b, hs, d), lambda group, q_block: (q_block, group, 0))
        if in_place
        else pl.BlockSpec((b, hs * d), lambda group, q_block: (q_block, group)),
        *(kv_spec(d, part) for part in range(reach + 1)),
        *(kv_spec(dv, part) for part in range(reach + 1)),
    ]
    operands = [qinfo, q, *([k] * (reach + 1)), *([v] * (reach + 1))]
    if sinks is not None:
        in_specs.insert(0, pl.BlockSpec(memory_space=pltpu.SMEM))
        operands.insert(0, sinks)
    if in_place:
        out_spec = pl.BlockSpec((b, hs, dv), lambda group, q_block: (q_block, group, 0))
        out_shape = [out_struct((g.q_rows, g.q_heads, dv), q.dtype, *operands)]
    else:
        out_spec = pl.BlockSpec((b, hs * dv), lambda group, q_block: (q_block, group))
        out_shape = [out_struct((g.q_rows, g.q_heads * dv), q.dtype, *operands)]
    out_specs = [out_spec]
    if with_lse:
        out_shape.append(out_struct((g.head_groups, g.q_rows, hs), jnp.float32, *operands))
        out_specs.append(pl.BlockSpec((None, b, hs), lambda group, q_block: (group, q_block, 0)))
    kernel = functools.partial(_band_kernel, geometry=g, reach=reach, has_sinks=sinks is not None, with_lse=with_lse)
    keys = (reach + 1) * b
    cost = pl.CostEstimate(
        flops=2 * g.q_heads * (d + dv) * keys * g.num_q_blocks * b,
        transcendentals=g.q_heads * keys * g.num_q_blocks * b,
        bytes_accessed=q.size * q.dtype.itemsize * 2 + (reach + 1) * (k.size + v.size) * k.dtype.itemsize,
    )
    results = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(g.head_groups, g.num_q_blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=cost,
        name="flash_attention_band_fwd",
    )(*operands)
    out = results[0].reshape(g.q_rows, g.q_heads, dv)
    return out, (results[1] if with_lse else None)
