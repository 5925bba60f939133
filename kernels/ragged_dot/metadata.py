"""The forward kernel's visit list, built by a scalar Pallas kernel in SMEM.

`forward_metadata_reference` defines the visit list in plain JAX; XLA compiles it to about twenty small ops (a cumsum,
a searchsorted loop, gathers, a concatenation), each costing about a microsecond of fixed overhead on the TPU, which
at decode is as much as the grouped matmul's own weight stream. This kernel writes the same list in one launch: a
walk over the groups on the scalar unit (a few hundred scalar stores at most). Its output equals
`forward_metadata_reference`'s element for element (tests/test_ragged_dot.py checks it).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Fields of the forward metadata, each a run of V int32 in one flat SMEM array.
F_TILE, F_FETCH_TILE, F_GROUP, F_KPIN, F_LO, F_HI, F_FIRST = range(7)
NUM_FIELDS = 7


def _cdiv(a, b):
    return -(-a // b)


def group_bounds(group_sizes, m, group_offset, num_local_groups):
    """Row range [gs, ge) of each local group, sanitized so that no index can leave [0, m].

    Negative sizes count as zero and rows past m are dropped (concrete inputs are rejected for these in api.py;
    traced ones cannot be checked, so they are made safe here).
    """
    num_groups = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    gidx = jnp.asarray(group_offset, jnp.int32) + jnp.arange(num_local_groups, dtype=jnp.int32)
    valid = (gidx >= 0) & (gidx < num_groups)
    gidx = jnp.clip(gidx, 0, num_groups - 1)
    gs = starts[gidx]
    ge = jnp.where(valid, ends[gidx], gs)
    return gs, ge


def forward_visits_bound(tiles_m: int, num_local_groups: int) -> int:
    # Local groups cover one contiguous row range, so the visits of real groups number at most
    # (tiles they cover) + (groups - 1), and every other tile gets exactly one zero visit.
    return tiles_m + max(num_local_groups, 1) - 1


def forward_metadata_reference(group_sizes, *, m, tm, tiles_k, group_offset, num_local_groups, rhs_group_base, rhs_groups):
    """Visit list for the forward kernel. Returns (flat int32 metadata [NUM_FIELDS * V + 1], visit count, V).

    rhs_group_base: added to the local group index to get rhs's group index (group_offset when rhs holds every
    group, 0 when it holds only the window). The last metadata element is the visit count.
    """
    tiles_m = _cdiv(m, tm)
    n_local = num_local_groups
    V = forward_visits_bound(tiles_m, n_local)
    gs, ge = group_bounds(group_sizes, m, group_offset, n_local)
    nonempty = ge > gs
    first_t = gs // tm
    cnt = jnp.where(nonempty, (ge - 1) // tm - first_t + 1, 0)
    total = cnt.sum()
    any_rows = total > 0
    lo = jnp.min(jnp.where(nonempty, gs, m))
    hi = jnp.max(jnp.where(nonempty, ge, 0))
    prefix = jnp.where(any_rows, lo // tm, tiles_m)  # zero visits for tiles 0 .. prefix-1
    last_cov = jnp.where(any_rows, (hi - 1) // tm, tiles_m - 1)
    suffix = tiles_m - 1 - last_cov  # zero visits for tiles last_cov+1 .. tiles_m-1
    nv = prefix + total + suffix
    j_first = jnp.argmax(nonempty).astype(jnp.int32)
    j_last = (n_local - 1 - jnp.argmax(nonempty[::-1])).astype(jnp.int32)

    v = jnp.minimum(jnp.arange(V, dtype=jnp.int32), nv - 1)  # surplus entries repeat the last visit
    csum = jnp.cumsum(cnt)
    u = v - prefix
    j = jnp.clip(jnp.searchsorted(csum, u, side="right"), 0, n_local - 1).astype(jnp.int32)
    g_tile = first_t[j] + u - (csum[j] - cnt[j])
    is_pre = v < prefix
    is_grp = (v >= prefix) & (v < prefix + total)
    tile = jnp.where(is_pre, v, jnp.where(is_grp, g_tile, last_cov + 1 + (v - prefix - total)))
    row_lo = jnp.where(is_grp, jnp.maximum(gs[j], g_tile * tm), 0)
    row_hi = jnp.where(is_grp, jnp.minimum(ge[j], g_tile * tm + tm), 0)
    # Zero visits fetch what the adjacent real visit fetches: the first one's blocks at k = 0 before it, the last
    # one's at k = last after it (all zeros when there is no real visit).
    first_real_tile = jnp.where(any_rows, prefix, 0)
    fetch_tile = jnp.where(is_pre, first_real_tile, jnp.where(is_grp, tile, jnp.where(any_rows, last_cov, 0)))
    group = jnp.where(is_pre, j_first, jnp.where(is_grp, j, jnp.where(any_rows, j_last, 0)))
    kpin = jnp.where(is_grp, -1, jnp.where(is_pre | ~any_rows, 0, tiles_k - 1))
    surplus = jnp.arange(V, dtype=jnp.int32) >= nv
    kpin = jnp.where(surplus, tiles_k - 1, kpin)
    prev_tile = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])
    first = (tile != prev_tile).astype(jnp.int32)
    fields = [None] * NUM_FIELDS
    fields[F_TILE] = tile
    fields[F_FETCH_TILE] = fetch_tile
    fields[F_GROUP] = jnp.clip(group + rhs_group_base, 0, rhs_groups - 1)  # never a DMA outside rhs
    fields[F_KPIN] = kpin
    fields[F_LO] = row_lo
    fields[F_HI] = row_hi
    fields[F_FIRST] = first
    meta = jnp.concatenate([f.astype(jnp.int32) for f in fields] + [nv.reshape(1).astype(jnp.int32)])
    return meta, nv.astype(jnp.int32), V


def _div(a, b):
    # Truncating division: the operands are >= 0 wherever the result is used, and Mosaic lowers floor division of
    # integers through a sign op that needs to know the chip (export for TPU on a CPU host would fail).
    return jax.lax.div(a, jnp.int32(b))


def _metadata_kernel(sizes_ref, offsets_ref, meta_ref, count_ref, starts_ref, ends_ref, *, m, tm, tiles_k, n_local,
                     num_groups, rhs_groups, V):
    tiles_m = _cdiv(m, tm)
    i32 = jnp.int32

    # Row range of every group: ends = min(cumsum(max(size, 0)), m), as kernel._group_bounds.
    def prefix(g, running):
        starts_ref[g] = jnp.minimum(running, m)
        running = running + jnp.maximum(sizes_ref[g], 0)
        ends_ref[g] = jnp.minimum(running, m)
        return running

    jax.lax.fori_loop(0, num_groups, prefix, i32(0))
    offset = offsets_ref[0]  # first local group
    base = offsets_ref[1]  # rhs group index of local group 0

    def bounds(j):
        gidx = offset + j
        valid = jnp.logical_and(gidx >= 0, gidx < num_groups)
        g = jnp.clip(gidx, 0, num_groups - 1)
        gs = starts_ref[g]
        return gs, jnp.where(valid, ends_ref[g], gs)

    # Summary of the local groups with rows: tiles they cover, lowest/highest row, first/last such group.
    def summarize(j, carry):
        total, lo, hi, j_first, j_last = carry
        gs, ge = bounds(j)
        has = ge > gs
        cnt = jnp.where(has, _div(ge - 1, tm) - _div(gs, tm) + 1, 0)
        return (total + cnt, jnp.where(has, jnp.minimum(lo, gs), lo), jnp.where(has, jnp.maximum(hi, ge), hi),
                jnp.where(jnp.logical_and(has, j_first < 0), j, j_first), jnp.where(has, j, j_last))

    total, lo, hi, j_first, j_last = jax.lax.fori_loop(
        0, n_local, summarize, (i32(0), i32(m), i32(0), i32(-1), i32(-1)))
    any_rows = total > 0
    j_first = jnp.maximum(j_first, 0)
    j_last = jnp.where(any_rows, j_last, 0)
    n_prefix = jnp.where(any_rows, _div(lo, tm), tiles_m)
    last_cov = jnp.where(any_rows, _div(hi - 1, tm), tiles_m - 1)
    n_suffix = tiles_m - 1 - last_cov
    nv = n_prefix + total + n_suffix

    def write(v, tile, fetch_tile, group, kpin, row_lo, row_hi, prev_tile):
        meta_ref[F_TILE * V + v] = tile
        meta_ref[F_FETCH_TILE * V + v] = fetch_tile
        meta_ref[F_GROUP * V + v] = jnp.clip(group + base, 0, rhs_groups - 1)  # never a DMA outside rhs
        meta_ref[F_KPIN * V + v] = kpin
        meta_ref[F_LO * V + v] = row_lo
        meta_ref[F_HI * V + v] = row_hi
        meta_ref[F_FIRST * V + v] = (tile != prev_tile).astype(i32)
        return tile

    # Zero visits before the first covered tile fetch what the first real visit fetches (its blocks at k = 0).
    first_real_tile = jnp.where(any_rows, n_prefix, 0)

    def pre(v, prev):
        return write(v, v, first_real_tile, j_first, i32(0), i32(0), i32(0), prev)

    prev = jax.lax.fori_loop(0, n_prefix, pre, i32(-1))

    # One visit per (tile, group) pair that shares rows, in tile order.
    def group_visits(j, carry):
        v, prev = carry
        gs, ge = bounds(j)
        cnt = jnp.where(ge > gs, _div(ge - 1, tm) - _div(gs, tm) + 1, 0)

        def one(u, carry):
            v, prev = carry
            tile = _div(gs, tm) + u
            prev = write(v, tile, tile, j, i32(-1), jnp.maximum(gs, tile * tm), jnp.minimum(ge, tile * tm + tm), prev)
            return v + 1, prev

        return jax.lax.fori_loop(0, cnt, one, (v, prev))

    v, prev = jax.lax.fori_loop(0, n_local, group_visits, (n_prefix, prev))

    # Zero visits after the last covered tile fetch what the last real visit fetched (its blocks at the last k).
    suffix_fetch = jnp.where(any_rows, last_cov, 0)
    suffix_kpin = jnp.where(any_rows, tiles_k - 1, 0)

    def post(i, carry):
        v, prev = carry
        return v + 1, write(v, last_cov + 1 + i, suffix_fetch, j_last, suffix_kpin, i32(0), i32(0), prev)

    v, prev = jax.lax.fori_loop(0, n_suffix, post, (v, prev))

    # Entries past the visit count repeat the last visit at the last k (no DMA; skipped by a static grid).
    last = nv - 1

    def surplus(s, carry):
        for f in range(NUM_FIELDS):
            meta_ref[f * V + s] = meta_ref[f * V + last]
        meta_ref[F_KPIN * V + s] = i32(tiles_k - 1)
        meta_ref[F_FIRST * V + s] = i32(0)
        return carry

    jax.lax.fori_loop(nv, V, surplus, i32(0))
    meta_ref[NUM_FIELDS * V] = nv
    count_ref[0] = nv


def forward_metadata(group_sizes, *, m, tm, tiles_k, group_offset, num_local_groups, rhs_group_base, rhs_groups):
    """As forward_metadata_reference (same arguments and result), computed by one scalar Pallas kernel."""
    num_groups = group_sizes.shape[0]
    V = forward_visits_bound(_cdiv(m, tm), num_local_groups)
    offsets = jnp.stack([jnp.asarray(group_offset, jnp.int32).reshape(()),
                         jnp.asarray(rhs_group_base, jnp.int32).reshape(())])
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    kernel = functools.partial(
        _metadata_kernel, m=m, tm=tm, tiles_k=tiles_k, n_local=num_local_groups, num_groups=num_groups,
        rhs_groups=rhs_groups, V=V)
    meta, count = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((NUM_FIELDS * V + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)),
        in_specs=[smem, smem],
        out_specs=(smem, smem),
        scratch_shapes=[pltpu.SMEM((num_groups,), jnp.int32), pltpu.SMEM((num_groups,), jnp.int32)],
        name="ragged_dot_metadata",
    )(group_sizes.astype(jnp.int32), offsets)
    return meta, count.reshape(()), V
