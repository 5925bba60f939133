"""Pallas TPU flash attention backward: a dq kernel and a dk/dv kernel, both recomputing the probabilities from the
forward's log-sum-exp (flash-attn 2's split); the sinks' gradient is a small XLA sum over the statistics.

With p = exp(s - lse), dp = do v^T and delta = rowsum(o * do) (minus the lse cotangent, when the lse output is
differentiated): ds = p * (dp - delta), times 1 - tanh^2 under a softcap; dq = ds k * scale, dk = ds^T q * scale,
dv = p^T do. A sink s_h adds -sum_rows exp(s_h - lse) * delta to its own gradient.

The dq kernel runs first and walks the forward's visit list (query-block order) in the forward's orientation; at a
query block's first visit it computes delta from the o and do blocks it holds (no separate pass over them) and
writes it out for the dk/dv kernel, and keeps delta and lse as lane-replicated (bq, 128) statistics. The dk/dv
kernel walks the column-major list (key-block order) and computes the transposed scores s^T = k q^T (bk, bq), so
that every matmul takes its operands as stored (no transposes): dv += p^T do, dp^T = v do^T, dk += ds^T q, with the
per-row statistics as (1, bq) lane rows. K/V heads accumulate over their query heads (GQA)
in f32 scratch and are written at the key block's last visit. Where the forward takes K and V as they lie
(forward.kv_heads_in_place), the fused dk/dv kernel does too: [bk, Hkv, D] blocks merged into lanes in registers at
a key block's first visit (its K/V block stays for all its visits), dk and dv split back at its last. The fused
kernel computes a DIAGONAL visit (schedule.diagonal_pairs) by chunks of the MXU's width, only the parts on and below
the causal diagonal (accumulate_diagonal).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import LANES
from ..common.manual_axes import out_struct
from . import forward, fused_dq, schedule
from .geometry import (
    LOG2_E,
    Geometry,
    dot_nn,
    dot_nt,
    dot_tn,
    keep_mask,
    lanes,
    query_scale,
    row_stat,
    sanitize_rows,
)


def _softcap_grad(ds, t):
    return ds if t is None else ds * (1.0 - t * t)


def _log2_scores(raw, g: Geometry):
    """(log2-unit logits, tanh) from the product of a query_scale-scaled operand and the other."""
    if g.softcap > 0:
        t = jnp.tanh(raw)
        return t * (g.softcap * LOG2_E), t
    return raw, None


def _dq_kernel(visits_ref, status_ref, *refs, geometry: Geometry, has_dlse: bool):
    qinfo_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, *refs = refs
    dlse_ref = None
    if has_dlse:
        dlse_ref, *refs = refs
    dq_ref, delta_out_ref, q_scaled_ref, lse_s_ref, delta_s_ref, acc_ref = refs
    g = geometry
    word = visits_ref[pl.program_id(1)]
    _, kv_block = schedule.unpack(word)
    d, dv = g.head_dim, g.v_head_dim

    @pl.when((word & schedule.FIRST) != 0)
    def _init():
        # once per query block: the scaled q, and per head its log-sum-exp (log2 units) and delta = rowsum(o * do)
        # (minus the lse cotangent) as lane-replicated statistics; delta is also written out for the dk/dv kernel
        q_scaled_ref[...] = (q_ref[...].astype(jnp.float32) * query_scale(g)).astype(q_scaled_ref.dtype)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        for h in range(g.heads_per_step):
            delta = fused_dq.delta_column(o_ref, do_ref, dlse_ref, h, dv)
            delta_out_ref[:, h : h + 1] = delta
            delta_s_ref[h] = row_stat(delta)
            lse_s_ref[h] = row_stat(lse_ref[:, h : h + 1] * LOG2_E)

    def accumulate(masked: bool):
        keep = keep_mask(qinfo_ref[:, 0:1], qinfo_ref[:, 1:2], kv_block, g.block_kv) if masked else None
        for j in range(g.kv_heads_per_step):
            k = sanitize_rows(k_ref[:, j * d : (j + 1) * d], kv_block, g.block_kv, g.kv_rows)
            v = sanitize_rows(v_ref[:, j * dv : (j + 1) * dv], kv_block, g.block_kv, g.kv_rows)
            for i in range(g.group):
                h = j * g.group + i
                s, t = _log2_scores(dot_nt(q_scaled_ref[:, h * d : (h + 1) * d], k), g)
                if masked:
                    s = jnp.where(keep, s, -jnp.inf)  # exp2(-inf - lse) = 0: the one select a masked score needs
                p = jnp.exp2(s - lanes(lse_s_ref[h], g.block_kv))
                dp = dot_nt(do_ref[:, h * dv : (h + 1) * dv], v)
                ds = _softcap_grad(p * (dp - lanes(delta_s_ref[h], g.block_kv)), t)
                acc_ref[h] += dot_nn(ds.astype(k.dtype), k)

    schedule.run_visit(word, accumulate)

    @pl.when((word & schedule.LAST) != 0)
    def _finalize():
        scale = jnp.where(status_ref[0] != 0, jnp.nan, g.softmax_scale)
        for h in range(g.heads_per_step):
            dq_ref[:, h * d : (h + 1) * d] = (acc_ref[h] * scale).astype(dq_ref.dtype)


def _dkv_kernel(visits_ref, status_ref, *refs, geometry: Geometry, fused: bool, chunk: int = 0):
    if fused:
        _, *refs = refs  # the dq slots: read by the index maps only
    qinfo_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *refs = refs
    if fused:
        dq_ref, *refs = refs
    k_scaled_ref, dk_acc_ref, dv_acc_ref, *refs = refs
    v_merged_ref = refs[0] if refs else v_ref  # V merged into lanes at the key block's first visit when it lies as is
    in_place = len(k_ref.shape) == 3
    g = geometry
    word = visits_ref[pl.program_id(1)]
    q_block, kv_block = schedule.unpack(word)
    d, dv = g.head_dim, g.v_head_dim

    @pl.when((word & schedule.FIRST) != 0)
    def _init():
        # K rows past the array are stale VMEM: zeroed, as the fused dq sums over key rows (ds^T k)
        k = k_ref[...]
        if in_place:
            k = k.reshape(g.block_kv, g.kv_heads_per_step * d)
            v_merged_ref[...] = v_ref[...].reshape(v_merged_ref.shape)
        k = sanitize_rows(k, kv_block, g.block_kv, g.kv_rows)
        k_scaled_ref[...] = (k.astype(jnp.float32) * query_scale(g)).astype(k_scaled_ref.dtype)
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    def accumulate(masked: bool):
        keep = None
        if masked:
            keep = keep_mask(qinfo_ref[0:1, :], qinfo_ref[1:2, :], kv_block, g.block_kv, transposed=True)
        for j in range(g.kv_heads_per_step):
            k_scaled = k_scaled_ref[:, j * d : (j + 1) * d]
            v = v_merged_ref[:, j * dv : (j + 1) * dv]
            if fused:  # stale V rows would make NaN ds^T rows, which dq sums over
                v = sanitize_rows(v, kv_block, g.block_kv, g.kv_rows)
            for i in range(g.group):
                h = j * g.group + i
                # q and do rows past the array are stale VMEM: zeroed, as their zero probabilities would not
                # cancel a NaN in the sums over rows
                q = sanitize_rows(q_ref[:, h * d : (h + 1) * d], q_block, g.block_q, g.q_rows)
                do = sanitize_rows(do_ref[:, h * dv : (h + 1) * dv], q_block, g.block_q, g.q_rows)
                s_t, t_t = _log2_scores(dot_nt(k_scaled, q), g)
                if masked:
                    s_t = jnp.where(keep, s_t, -jnp.inf)
                p_t = jnp.exp2(s_t - lse_ref[h : h + 1, :])
                dv_acc_ref[j] += dot_nn(p_t.astype(do.dtype), do)
                dp_t = dot_nt(v, do)
                ds_t = _softcap_grad(p_t * (dp_t - delta_ref[h : h + 1, :]), t_t).astype(q.dtype)
                dk_acc_ref[j] += dot_nn(ds_t, q)
                if fused:
                    # this key block's share of dq (against the scaled k: backward() undoes the scale)
                    dq_ref[:, h * d : (h + 1) * d] = dot_tn(ds_t, k_scaled)

    def accumulate_diagonal():
        # A DIAGONAL visit keeps key - first key <= row - first row: in s^T (keys down, rows across) query chunk r
        # (`chunk` rows, the MXU's width) needs the key rows of chunks 0..r only, its last chunk of them masked by a
        # static triangle; key chunks at or past the query block's rows are needed by no row (their dk / dv rows
        # are left as they are). The matmuls whose MXU weights are q or do (s^T, dp^T: q and do transposed; dv, dk:
        # do and q) go by query chunk, each chunk's weights pushed once and streamed past the key rows that need
        # it; dq, whose weights are k, goes by key chunk, streamed past the rows from that chunk on. A DIAGONAL pair
        # is two whole blocks (schedule.diagonal_pairs): no stale rows to zero.
        row_chunks, key_chunks = g.block_q // chunk, min(g.block_q, g.block_kv) // chunk
        keys = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        triangle = keys <= jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        for j in range(g.kv_heads_per_step):
            k_scaled = k_scaled_ref[:, j * d : (j + 1) * d]
            dk_acc = [dk_acc_ref[j, c * chunk : (c + 1) * chunk] for c in range(key_chunks)]
            dv_acc = [dv_acc_ref[j, c * chunk : (c + 1) * chunk] for c in range(key_chunks)]
            for i in range(g.group):
                h = j * g.group + i
                ds_tiles = {}  # (key chunk, query chunk) -> ds^T
                for r in range(row_chunks):
                    cols = slice(r * chunk, (r + 1) * chunk)
                    n = min(r + 1, key_chunks)  # the key chunks query chunk r needs
                    q = q_ref[cols, h * d : (h + 1) * d]
                    do = do_ref[cols, h * dv : (h + 1) * dv]
                    s_t, t_t = _log2_scores(dot_nt(k_scaled_ref[: n * chunk, j * d : (j + 1) * d], q), g)
                    if r < key_chunks:
                        last = jnp.where(triangle, s_t[r * chunk :], -jnp.inf)
                        s_t = last if r == 0 else jnp.concatenate([s_t[: r * chunk], last], axis=0)
                    p_t = jnp.exp2(s_t - lse_ref[h : h + 1, cols])
                    pv = dot_nn(p_t.astype(do.dtype), do)
                    dp_t = dot_nt(v_merged_ref[: n * chunk, j * dv : (j + 1) * dv], do)
                    ds_t = _softcap_grad(p_t * (dp_t - delta_ref[h : h + 1, cols]), t_t).astype(q.dtype)
                    dsq = dot_nn(ds_t, q)
                    for c in range(n):
                        dv_acc[c] = dv_acc[c] + pv[c * chunk : (c + 1) * chunk]
                        dk_acc[c] = dk_acc[c] + dsq[c * chunk : (c + 1) * chunk]
                        ds_tiles[c, r] = ds_t[c * chunk : (c + 1) * chunk]
                # this key block's share of dq (the path runs fused only) by key chunk c: rows from c * chunk on
                dq = [None] * row_chunks
                for c in range(key_chunks):
                    ds_c = jnp.concatenate([ds_tiles[c, r] for r in range(c, row_chunks)], axis=1)
                    part = dot_tn(ds_c, k_scaled[c * chunk : (c + 1) * chunk])
                    for r in range(c, row_chunks):
                        tile = part[(r - c) * chunk : (r - c + 1) * chunk]
                        dq[r] = tile if dq[r] is None else dq[r] + tile
                dq_ref[:, h * d : (h + 1) * d] = jnp.concatenate(dq, axis=0)
            dk_acc_ref[j, : key_chunks * chunk] = jnp.concatenate(dk_acc, axis=0)
            dv_acc_ref[j, : key_chunks * chunk] = jnp.concatenate(dv_acc, axis=0)

    schedule.run_visit(word, accumulate, diagonal=accumulate_diagonal if chunk else None)

    @pl.when((word & schedule.LAST) != 0)
    def _finalize():
        poison = jnp.where(status_ref[0] != 0, jnp.nan, 1.0)
        dks = [(dk_acc_ref[j] * (poison * g.softmax_scale)).astype(dk_ref.dtype) for j in range(g.kv_heads_per_step)]
        dvs = [(dv_acc_ref[j] * poison).astype(dv_ref.dtype) for j in range(g.kv_heads_per_step)]
        if in_place:
            # the heads merged in lanes, then split to [bk, Hkv, D] in registers: the arrays as flash-attn lays them
            dk_ref[...] = jnp.concatenate(dks, axis=1).reshape(dk_ref.shape)
            dv_ref[...] = jnp.concatenate(dvs, axis=1).reshape(dv_ref.shape)
        else:
            for j in range(g.kv_heads_per_step):
                dk_ref[:, j * d : (j + 1) * d] = dks[j]
                dv_ref[:, j * dv : (j + 1) * dv] = dvs[j]


def diagonal_chunk(geometry: Geometry, fused: bool) -> int:
    """The chunk width of the fused dk/dv kernel's DIAGONAL visits (forward.diagonal_chunk's rule, the MXU's width,
    at the backward's blocks), or 0 where it takes the masked path: the unfused backward (neither its dq kernel nor
    its dk/dv kernel computes by chunks)."""
    return forward.diagonal_chunk(geometry, chip.current_tpu_info()) if fused else 0


def _specs(g: Geometry, rows_layout: bool, kv_in_place: bool = False):
    """BlockSpecs of (row ranges, q, k, v, do, lse, delta) for a kernel over visit words; k and v as [Tk, Hkv, D]
    blocks of every kv head where kv_in_place, else merged."""
    hs, d, dv, bq, bk = g.heads_per_step, g.head_dim, g.v_head_dim, g.block_q, g.block_kv

    def q_map(group, v, visits_ref, *_):
        return schedule.unpack(visits_ref[v])[0], group

    def kv_map(group, v, visits_ref, *_):
        return schedule.unpack(visits_ref[v])[1], group

    if rows_layout:

        def info_map(group, v, visits_ref, *_):
            return 0, schedule.unpack(visits_ref[v])[0]

        def stats_map(group, v, visits_ref, *_):
            return group, 0, schedule.unpack(visits_ref[v])[0]

        info_spec, stats_spec = pl.BlockSpec((2, bq), info_map), pl.BlockSpec((None, hs, bq), stats_map)
    else:

        def info_map(group, v, visits_ref, *_):
            return schedule.unpack(visits_ref[v])[0], 0

        def stats_map(group, v, visits_ref, *_):
            return group, schedule.unpack(visits_ref[v])[0], 0

        info_spec, stats_spec = pl.BlockSpec((bq, 2), info_map), pl.BlockSpec((None, bq, hs), stats_map)
    q_spec = pl.BlockSpec((bq, hs * d), q_map)
    if kv_in_place:

        def kv3_map(group, v, visits_ref, *_):
            return schedule.unpack(visits_ref[v])[1], 0, 0  # every kv head: one head group

        kv_map = kv3_map
        k_spec, v_spec = pl.BlockSpec((bk, g.kv_heads, d), kv_map), pl.BlockSpec((bk, g.kv_heads, dv), kv_map)
    else:
        k_spec = pl.BlockSpec((bk, g.kv_heads_per_step * d), kv_map)
        v_spec = pl.BlockSpec((bk, g.kv_heads_per_step * dv), kv_map)
    do_spec = pl.BlockSpec((bq, hs * dv), q_map)
    return [info_spec, q_spec, k_spec, v_spec, do_spec, stats_spec, stats_spec], q_map, kv_map


def _pad_rows(x, rows, value):
    """Pad the last axis of a statistics array to `rows` with a finite or +inf value (rows past the array must give
    zero probabilities and zero deltas in the dk/dv kernel, whose sums run over rows)."""
    pad = rows - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=value)


def backward(
    q2d, k3d, v3d, sinks, out, lse, d_out, d_lse, plan, static_counts, *, geometry, vmem_limit_bytes, dq_slots=0
):
    """(dq, dk, dv, dsinks) of the forward's (out, lse). out [Tq, Hq, Dv] or [Tq, Hq * Dv] (either is taken),
    d_out [Tq, Hq, Dv]; lse [head groups, Tq, heads per step] f32; d_lse None or in lse's layout. dq_slots 0: the dq
    kernel runs first (it also computes delta, which the dk/dv kernel reads); else the fused backward: a delta kernel
    first, the dk/dv kernel also writes each visit's dq contribution to one of dq_slots slots of its query block
    (plan's slot per visit), summed by a third kernel. Where a step's heads allow it (forward.heads_in_place), the
    fused backward takes out and d_out as they lie (the delta kernel merges do for the dk/dv kernel) and returns dq
    as [Tq, Hq, D]: no XLA relayout copies; else dq is [Tq, Hq * D]. k3d [Tk, Hkv, D], v3d [Tk, Hkv, Dv]: taken as
    they lie where the forward takes them so (forward.kv_heads_in_place), dk and dv then returned so too; else merged,
    [Tk, Hkv * D]."""
    g = geometry
    hs = g.heads_per_step
    qinfo, qinfo_rows, q_visits, kv_visits, q_count, kv_count, status, visit_slots, filled = plan
    if static_counts is not None:
        q_count, kv_count = static_counts
    fused = dq_slots > 0
    in_place = fused and forward.heads_in_place(g)
    kv_in_place = fused and forward.kv_heads_in_place(g)
    k_in = k3d if kv_in_place else k3d.reshape(g.kv_rows, g.kv_heads * g.head_dim)
    v_in = v3d if kv_in_place else v3d.reshape(g.kv_rows, g.kv_heads * g.v_head_dim)
    d_out = d_out.astype(q2d.dtype)
    if in_place:
        out = out.reshape(g.q_rows, g.q_heads, g.v_head_dim)
    else:
        out = out.reshape(g.q_rows, g.q_heads * g.v_head_dim)
        d_out = d_out.reshape(out.shape)

    def params_for(semantics):
        return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)

    params = params_for(("parallel", "arbitrary"))
    flops_per_visit = 2 * g.q_heads * g.block_q * g.block_kv * (2 * g.head_dim + 2 * g.v_head_dim)

    if fused:
        delta, d_out = fused_dq.delta(out, d_out, d_lse, lse.shape, geometry=g, params_for=params_for)
    else:
        dq, delta = _dq_call(q2d, k_in, v_in, out, lse, d_out, d_lse, qinfo, q_visits, q_count, status, g, params)

    padded_rows = g.num_q_blocks * g.block_q
    dsinks = None
    if sinks is not None:
        lse_heads = lse.transpose(1, 0, 2).reshape(g.q_rows, g.q_heads)
        delta_heads = delta.transpose(1, 0, 2).reshape(g.q_rows, g.q_heads)
        dsinks = -jnp.sum(jnp.exp(sinks[None, :] - lse_heads) * delta_heads, axis=0)
    # the dk/dv kernel takes its statistics as lane rows, the log-sum-exp in log2 units
    lse_rows = _pad_rows((lse * LOG2_E).transpose(0, 2, 1), padded_rows, jnp.inf)
    delta_rows = _pad_rows(delta.transpose(0, 2, 1), padded_rows, 0.0)

    in_specs, q_map, kv_map = _specs(g, rows_layout=True, kv_in_place=kv_in_place)
    operands = (kv_visits, status, qinfo_rows, q2d, k_in, v_in, d_out, lse_rows, delta_rows)
    out_shape = [out_struct(k_in.shape, k_in.dtype, operands), out_struct(v_in.shape, v_in.dtype, operands)]
    out_specs = in_specs[2:4]  # dk and dv in k's and v's layout and blocks
    v_merged = [pltpu.VMEM((g.block_kv, g.kv_heads * g.v_head_dim), v_in.dtype)] if kv_in_place else []
    prefetch = [kv_visits, status]
    parts_bytes = 0
    if fused:
        unread = dq_slots * g.num_q_blocks

        def slot_map(group, v, visits_ref, status_ref, slots_ref):
            slot = slots_ref[v]
            block = slot * g.num_q_blocks + schedule.unpack(visits_ref[v])[0]
            return jnp.where(slot < dq_slots, block, unread), 0, group

        # slot r of query block i is block r * (query blocks) + i; the last block takes the visits that compute nothing
        # (slot dq_slots, whatever their query block: schedule.dq_slots)
        parts_shape = (dq_slots * g.num_q_blocks + 1, g.block_q, q2d.shape[1])
        out_shape.append(out_struct(parts_shape, jnp.float32, operands, visit_slots))
        out_specs.append(pl.BlockSpec((None, g.block_q, hs * g.head_dim), slot_map))
        prefetch.append(visit_slots)
        parts_bytes = kv_visits.shape[0] * g.head_groups * g.block_q * hs * g.head_dim * 4
    results = pl.pallas_call(
        functools.partial(_dkv_kernel, geometry=g, fused=fused, chunk=diagonal_chunk(g, fused)),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(g.head_groups, kv_count),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((g.block_kv, g.kv_heads_per_step * g.head_dim), k_in.dtype),
                pltpu.VMEM((g.kv_heads_per_step, g.block_kv, g.head_dim), jnp.float32),
                pltpu.VMEM((g.kv_heads_per_step, g.block_kv, g.v_head_dim), jnp.float32),
                *v_merged,
            ],
        ),
        compiler_params=params,
        cost_estimate=pl.CostEstimate(
            flops=flops_per_visit * kv_visits.shape[0] * (5 if fused else 4) // 4,
            transcendentals=g.q_heads * g.block_q * g.block_kv * kv_visits.shape[0],
            bytes_accessed=(q2d.size + 2 * k_in.size + 2 * v_in.size + d_out.size) * q2d.dtype.itemsize + parts_bytes,
        ),
        name="flash_attention_dkv",
    )(*prefetch, qinfo_rows, q2d, k_in, v_in, d_out, lse_rows, delta_rows)
    dk, dv = results[:2]
    if fused:
        # the kernel multiplied ds by the scaled k (query_scale): dq = ds k * softmax_scale
        scale = g.softmax_scale / query_scale(g)
        dq = fused_dq.sum_slots(
            results[2],
            filled,
            status,
            geometry=g,
            scale=scale,
            dtype=q2d.dtype,
            params_for=params_for,
            split=in_place,
        )
    return dq, dk, dv, dsinks


def _dq_call(q2d, k2d, v2d, out, lse, d_out, d_lse, qinfo, q_visits, q_count, status, g: Geometry, params):
    """The unfused backward's dq kernel: (dq, delta in lse's layout)."""
    hs = g.heads_per_step
    flops_per_visit = 2 * g.q_heads * g.block_q * g.block_kv * (2 * g.head_dim + 2 * g.v_head_dim)
    in_specs, q_map, _ = _specs(g, rows_layout=False)
    stats_spec = in_specs[-1]
    in_specs = in_specs[:-1] + [pl.BlockSpec((g.block_q, hs * g.v_head_dim), q_map)]
    # the lse cotangent only when the lse output is differentiated
    in_specs += [] if d_lse is None else [stats_spec]
    operands = (q_visits, status, qinfo, q2d, k2d, v2d, d_out, lse, out, d_lse)
    return pl.pallas_call(
        functools.partial(_dq_kernel, geometry=g, has_dlse=d_lse is not None),
        out_shape=[out_struct(q2d.shape, q2d.dtype, operands), out_struct(lse.shape, jnp.float32, operands)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(g.head_groups, q_count),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((g.block_q, hs * g.head_dim), q_map), stats_spec],
            scratch_shapes=[
                pltpu.VMEM((g.block_q, hs * g.head_dim), q2d.dtype),
                pltpu.VMEM((hs, g.block_q, LANES), jnp.float32),
                pltpu.VMEM((hs, g.block_q, LANES), jnp.float32),
                pltpu.VMEM((hs, g.block_q, g.head_dim), jnp.float32),
            ],
        ),
        compiler_params=params,
        cost_estimate=pl.CostEstimate(
            flops=flops_per_visit * q_visits.shape[0] * 3 // 4,
            transcendentals=g.q_heads * g.block_q * g.block_kv * q_visits.shape[0],
            bytes_accessed=(2 * q2d.size + k2d.size + v2d.size + 2 * d_out.size) * q2d.dtype.itemsize,
        ),
        name="flash_attention_dq",
    )(q_visits, status, qinfo, q2d, k2d, v2d, d_out, lse, out, *([] if d_lse is None else [d_lse]))
