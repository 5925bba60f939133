"""Pallas TPU flash attention forward: online softmax over the visits of each query block, statistics in f32.

Grid (head groups, visits). The visit list (schedule.py) holds, in query-block order, every (query block, key block)
pair with a kept score; it reaches the kernel through scalar prefetch, where the index maps read it to pick the
blocks, and its run-time length is the grid's. The query and output blocks stay in VMEM across the visits of one
query block; the running max, sum and output accumulate in VMEM scratch and are finalised at its last visit. Visits
whose pair is wholly kept skip the mask; key blocks no row needs are never read. The running max starts at a finite
value (MAX_INIT) and masked scores are -inf, so that a row with nothing kept yet gets zero probabilities from exp2
itself; per-row statistics are kept lane-replicated, (bq, 128), so that they meet the scores as whole vregs.

Layout: q and the output are taken as they lie, [Tq, Hq, D] blocks of a step's query heads, where those are a
multiple of 8 or all heads (heads_in_place): merged into lanes in registers at the query block's first visit and split
back at its last, so that a [B, S, H, D] program input needs no relayout copy; otherwise merged, [Tq, Hq * D]. K and V
are taken as they lie too where a step also takes every kv head, a multiple of 8 (kv_heads_in_place), merged in
registers at every visit; otherwise merged, [Tk, Hkv * D].
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import LANES
from ..common.manual_axes import out_struct
from . import schedule
from .geometry import (
    LN_2,
    LOG2_E,
    MAX_INIT,
    Geometry,
    dot_nn,
    dot_nt,
    keep_mask,
    lanes,
    log2_scores,
    query_scale,
    row_stat,
    sanitize_rows,
)


def _forward_kernel(
    visits_ref,
    status_ref,
    *refs,
    geometry: Geometry,
    has_sinks: bool,
    with_lse: bool,
    sum_on_mxu: bool,
    chunk: int,
):
    if has_sinks:
        sinks_ref, *refs = refs
    qinfo_ref, q_ref, k_ref, v_ref, out_ref, *refs = refs
    if with_lse:
        lse_ref, *refs = refs
    q_scaled_ref, m_ref, l_ref, acc_ref = refs
    g = geometry
    group_index = pl.program_id(0)
    word = visits_ref[pl.program_id(1)]
    _, kv_block = schedule.unpack(word)
    d, dv = g.head_dim, g.v_head_dim

    @pl.when((word & schedule.FIRST) != 0)
    def _init():
        # Scores are taken in log2 units (exp2 is the EUP's native exponential): q is scaled once per query block by
        # softmax_scale * log2(e) (by softmax_scale / softcap under a softcap, whose tanh comes first).
        q = q_ref[...]
        if q.ndim == 3:
            # [bq, heads, D] as the array lies: merged into lanes in registers, once per query block
            q = q.reshape(g.block_q, g.heads_per_step * d)
        q_scaled_ref[...] = (q.astype(jnp.float32) * query_scale(g)).astype(q_scaled_ref.dtype)
        m_ref[...] = jnp.full(m_ref.shape, MAX_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Issuing a head's scores before the previous head's softmax pays where the MXU's work per score vreg is
    # large (head dim 256: -11 % a step, 512: -3 % a visit, modeled v6e); at 128 the extra live score tile costs more
    # than the overlap gains (+1 %).
    early_scores = d >= 2 * LANES

    def kv_blocks():
        """The step's K and V blocks with heads merged in lanes."""
        if len(k_ref.shape) == 3:
            # [bk, Hkv, D] as the arrays lie: merged into lanes in registers, once a visit (a K/V block serves one)
            return (
                k_ref[...].reshape(g.block_kv, g.kv_heads_per_step * d),
                v_ref[...].reshape(g.block_kv, g.kv_heads_per_step * dv),
            )
        return k_ref, v_ref

    def with_ones(v):
        # 128 columns of ones beside V fill the MXU tile's idle half: p @ [v | 1] gives the row sums, already
        # lane-replicated, for no extra MXU pass and no VPU adds or cross-lane reductions
        return jnp.concatenate([v, jnp.ones((v.shape[0], LANES), v.dtype)], axis=1) if sum_on_mxu else v

    def accumulate(masked: bool):
        keep = keep_mask(qinfo_ref[:, 0:1], qinfo_ref[:, 1:2], kv_block, g.block_kv) if masked else None
        k_all, v_all = kv_blocks()
        for j in range(g.kv_heads_per_step):
            k = sanitize_rows(k_all[:, j * d : (j + 1) * d], kv_block, g.block_kv, g.kv_rows)
            v = with_ones(sanitize_rows(v_all[:, j * dv : (j + 1) * dv], kv_block, g.block_kv, g.kv_rows))

            def scores(h):
                return log2_scores(dot_nt(q_scaled_ref[:, h * d : (h + 1) * d], k), g)

            s_next = scores(j * g.group)
            for i in range(g.group):
                h = j * g.group + i
                s = s_next if s_next is not None else scores(h)
                s_next = None
                if i + 1 < g.group and early_scores:
                    # the next head's q k^T is issued before this head's softmax: the MXU has work while the row
                    # max is reduced
                    s_next = scores(h + 1)
                if masked:
                    # -inf, not a finite mask value: exp2(-inf - m) is 0 for any finite running max, and the
                    # running max starts finite (MAX_INIT), so masked scores need no second select
                    s = jnp.where(keep, s, -jnp.inf)
                m_prev = m_ref[h]
                m_new = jnp.maximum(m_prev, row_stat(jnp.max(s, axis=1, keepdims=True)))
                p = jnp.exp2(s - lanes(m_new, g.block_kv))
                alpha = jnp.exp2(m_prev - m_new)
                pv = dot_nn(p.astype(v.dtype), v)
                if sum_on_mxu:
                    l_ref[h] = alpha * l_ref[h] + pv[:, dv:]
                    pv = pv[:, :dv]
                else:
                    l_ref[h] = alpha * l_ref[h] + row_stat(jnp.sum(p, axis=1, keepdims=True))
                m_ref[h] = m_new
                acc_ref[h] = acc_ref[h] * lanes(alpha, dv) + pv

    def accumulate_diagonal():
        # A DIAGONAL visit keeps key - first key <= row - first row: key chunk c (`chunk` keys, the MXU's width) is
        # needed by the rows from c * chunk on only, so its matmuls take those rows (q's rows stream past the chunk's
        # K weights once: no weight is pushed twice), the first `chunk` of them masked by a static triangle and the
        # rest kept; key chunks at or past the query block's rows are needed by none. Of a square block's chunk
        # pairs this computes (n + 1) / 2n, and masks one in n. The statistics go by row chunk: row chunk r takes
        # key chunks 0..r. A DIAGONAL pair is two whole blocks (schedule.diagonal_pairs): no stale rows to zero.
        row_chunks, key_chunks = g.block_q // chunk, min(g.block_q, g.block_kv) // chunk
        rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        triangle = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1) <= rows
        k_all, v_all = kv_blocks()
        for j in range(g.kv_heads_per_step):
            for i in range(g.group):
                h = j * g.group + i
                tiles = {}  # (row chunk, key chunk) -> scores
                for c in range(key_chunks):
                    keys = slice(c * chunk, (c + 1) * chunk)
                    q = q_scaled_ref[c * chunk :, h * d : (h + 1) * d]
                    s = log2_scores(dot_nt(q, k_all[keys, j * d : (j + 1) * d]), g)
                    for r in range(c, row_chunks):
                        tile = s[(r - c) * chunk : (r - c + 1) * chunk]
                        tiles[r, c] = jnp.where(triangle, tile, -jnp.inf) if r == c else tile
                m_prev = m_ref[h]
                m_new = []
                for r in range(row_chunks):
                    m_r = m_prev[r * chunk : (r + 1) * chunk]
                    for c in range(min(r + 1, key_chunks)):
                        m_r = jnp.maximum(m_r, row_stat(jnp.max(tiles[r, c], axis=1, keepdims=True)))
                    m_new.append(m_r)
                alpha = jnp.exp2(m_prev - jnp.concatenate(m_new, axis=0))
                acc, l = acc_ref[h] * lanes(alpha, dv), alpha * l_ref[h]
                acc = [acc[r * chunk : (r + 1) * chunk] for r in range(row_chunks)]
                l = [l[r * chunk : (r + 1) * chunk] for r in range(row_chunks)]
                for c in range(key_chunks):
                    v = with_ones(v_all[c * chunk : (c + 1) * chunk, j * dv : (j + 1) * dv])
                    p = [jnp.exp2(tiles[r, c] - lanes(m_new[r], chunk)) for r in range(c, row_chunks)]
                    pv = dot_nn(jnp.concatenate(p, axis=0).astype(v.dtype), v)
                    for r in range(c, row_chunks):
                        part = pv[(r - c) * chunk : (r - c + 1) * chunk]
                        acc[r] = acc[r] + part[:, :dv]
                        if sum_on_mxu:
                            l[r] = l[r] + part[:, dv:]
                        else:
                            l[r] = l[r] + row_stat(jnp.sum(p[r - c], axis=1, keepdims=True))
                m_ref[h] = jnp.concatenate(m_new, axis=0)
                l_ref[h] = jnp.concatenate(l, axis=0)
                acc_ref[h] = jnp.concatenate(acc, axis=0)

    schedule.run_visit(word, accumulate, diagonal=accumulate_diagonal if chunk else None)

    @pl.when((word & schedule.LAST) != 0)
    def _finalize():
        overflow = status_ref[0] != 0
        outs = []
        for h in range(g.heads_per_step):
            # the statistics stay lane-replicated, (bq, 128): the output's scaling takes whole vregs (no lane
            # broadcast), and the log-sum-exp is stored from lane h of its own vregs (no lane shift)
            m = m_ref[h]
            l = l_ref[h]
            if has_sinks:
                sink = sinks_ref[group_index * g.heads_per_step + h] * LOG2_E
                m_final = jnp.maximum(m, sink)
                rescale = jnp.exp2(m - m_final)
                l = l * rescale + jnp.exp2(sink - m_final)
            else:
                m_final, rescale = m, 1.0
            nonzero = l > 0
            inv = jnp.where(nonzero, rescale / jnp.where(nonzero, l, 1.0), 0.0)
            # a visit list that overflowed its static size (a varlen call whose max_seqlen understated a length)
            # must not pass for a result: every output is NaN
            inv = jnp.where(overflow, jnp.nan, inv)
            out = (acc_ref[h] * lanes(inv, dv)).astype(out_ref.dtype)
            if len(out_ref.shape) == 3:
                outs.append(out)
            else:
                out_ref[:, h * dv : (h + 1) * dv] = out
            if with_lse:
                lse = (m_final + jnp.log2(jnp.where(nonzero, l, 1.0))) * LN_2
                lse = jnp.where(overflow, jnp.nan, jnp.where(nonzero, lse, jnp.inf))
                lse_ref[:, h : h + 1] = lse[:, h % LANES : h % LANES + 1]
        if outs:
            # the heads merged in lanes, then split to [bq, heads, Dv] in registers: the array as flash-attn lays it
            out_ref[...] = jnp.concatenate(outs, axis=1).reshape(out_ref.shape)


def sums_on_mxu(geometry: Geometry, dtype, info) -> bool:
    """Whether the row sums ride on the p @ v matmul: V's head dim leaves exactly 128 columns of the MXU's last
    weight tile idle (head dim 128 on 256-wide MXUs: v6e, v7x), and the inputs are bfloat16 (float32's multi-pass
    matmuls would pay for the extra columns)."""
    dv = geometry.v_head_dim
    return dtype == jnp.bfloat16 and dv % LANES == 0 and (-dv) % info.mxu_column_size == LANES


def diagonal_chunk(geometry: Geometry, info) -> int:
    """The key-chunk width of the forward's DIAGONAL visits, the MXU's width (a narrower chunk would half-fill its
    weight tiles), or 0 where the blocks are not whole chunks or both are one chunk (nothing to skip): those visits
    then take the masked path."""
    chunk = info.mxu_column_size
    if geometry.block_q % chunk or geometry.block_kv % chunk or max(geometry.block_q, geometry.block_kv) < 2 * chunk:
        return 0
    return chunk


def heads_in_place(geometry: Geometry) -> bool:
    """Whether the forward takes q [Tq, Hq, D] and writes out [Tq, Hq, Dv] as they lie (heads second-minor, no
    relayout into the merged [Tq, Hq * D]): a step's query heads must be a multiple of 8 sublanes or all heads."""
    hs = geometry.heads_per_step
    return hs % 8 == 0 or hs == geometry.q_heads


def kv_heads_in_place(geometry: Geometry) -> bool:
    """Whether the forward also takes k [Tk, Hkv, D] and v [Tk, Hkv, Dv] as they lie: where it takes q so and a step
    takes every kv head, a multiple of 8 (the (bk, Hkv, D) block is then whole sublane tiles). Their merge into lanes
    is paid at every visit, not once per query block as q's, but where the GQA group is small K and V are as large as q
    and XLA's relayout copy of them costs more: Gemma 4 sliding (16 / 8 heads x 256, all 8 kv heads a step, seq
    4096, modeled v6e) step 17865 -> 19641 cycles, program 2154 -> 1915 us (409 us of copies gone)."""
    g = geometry
    return heads_in_place(g) and g.kv_heads_per_step == g.kv_heads and g.kv_heads % 8 == 0


def forward(
    q3d, k3d, v3d, qinfo, visits, count, status, sinks, *, geometry: Geometry, with_lse: bool, vmem_limit_bytes
):
    """out [Tq, Hq, Dv] (and lse [head groups, Tq, heads per step] f32). q3d [Tq, Hq, D]; k3d [Tk, Hkv, D], v3d
    [Tk, Hkv, Dv]; qinfo [Tq padded, 2] int32 (lo, hi); visits [V] int32 words; count: visits to run (int or int32
    scalar, at most V); status [1] int32 (1: overflow); sinks None or [Hq] f32."""
    g = geometry
    hs, d, dv = g.heads_per_step, g.head_dim, g.v_head_dim
    bq, bk = g.block_q, g.block_kv
    in_place = heads_in_place(g)
    q = q3d if in_place else q3d.reshape(g.q_rows, g.q_heads * d)
    kv_in_place = kv_heads_in_place(g)
    k = k3d if kv_in_place else k3d.reshape(g.kv_rows, g.kv_heads * d)
    v = v3d if kv_in_place else v3d.reshape(g.kv_rows, g.kv_heads * dv)

    def q_map(group, v, visits_ref, status_ref):
        return schedule.unpack(visits_ref[v])[0], group

    def q3_map(group, v, visits_ref, status_ref):
        return schedule.unpack(visits_ref[v])[0], group, 0

    def kv_map(group, v, visits_ref, status_ref):
        return schedule.unpack(visits_ref[v])[1], group

    def kv3_map(group, v, visits_ref, status_ref):
        return schedule.unpack(visits_ref[v])[1], 0, 0  # every kv head: one head group

    def qinfo_map(group, v, visits_ref, status_ref):
        return schedule.unpack(visits_ref[v])[0], 0

    def lse_map(group, v, visits_ref, status_ref):
        return group, schedule.unpack(visits_ref[v])[0], 0

    in_specs = [
        pl.BlockSpec((bq, 2), qinfo_map),
        pl.BlockSpec((bq, hs, d), q3_map) if in_place else pl.BlockSpec((bq, hs * d), q_map),
    ]
    if kv_in_place:
        in_specs += [pl.BlockSpec((bk, g.kv_heads, d), kv3_map), pl.BlockSpec((bk, g.kv_heads, dv), kv3_map)]
    else:
        in_specs += [
            pl.BlockSpec((bk, g.kv_heads_per_step * d), kv_map),
            pl.BlockSpec((bk, g.kv_heads_per_step * dv), kv_map),
        ]
    operands = [qinfo, q, k, v]
    if sinks is not None:
        in_specs.insert(0, pl.BlockSpec(memory_space=pltpu.SMEM))
        operands.insert(0, sinks)
    if in_place:
        out_shape = [out_struct((g.q_rows, g.q_heads, dv), q.dtype, visits, status, operands)]
        out_specs = [pl.BlockSpec((bq, hs, dv), q3_map)]
    else:
        out_shape = [out_struct((g.q_rows, g.q_heads * dv), q.dtype, visits, status, operands)]
        out_specs = [pl.BlockSpec((bq, hs * dv), q_map)]
    if with_lse:
        out_shape.append(out_struct((g.head_groups, g.q_rows, hs), jnp.float32, visits, status, operands))
        out_specs.append(pl.BlockSpec((None, bq, hs), lse_map))
    kernel = functools.partial(
        _forward_kernel,
        geometry=g,
        has_sinks=sinks is not None,
        with_lse=with_lse,
        sum_on_mxu=sums_on_mxu(g, v.dtype, chip.current_tpu_info()),
        chunk=diagonal_chunk(g, chip.current_tpu_info()),
    )
    flops = 2 * g.q_heads * (d + dv) * g.block_q * g.block_kv
    cost = pl.CostEstimate(
        flops=flops * visits.shape[0],
        transcendentals=g.q_heads * g.block_q * g.block_kv * visits.shape[0],
        bytes_accessed=q.size * q.dtype.itemsize * 2 + (k.size + v.size) * k.dtype.itemsize,
    )
    results = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(g.head_groups, count),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((bq, hs * d), q.dtype),
                pltpu.VMEM((hs, bq, LANES), jnp.float32),
                pltpu.VMEM((hs, bq, LANES), jnp.float32),
                pltpu.VMEM((hs, bq, dv), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=cost,
        name="flash_attention_fwd",
    )(visits, status, *operands)
    out = results[0].reshape(g.q_rows, g.q_heads, dv)
    return out, (results[1] if with_lse else None)
