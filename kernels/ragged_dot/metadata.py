"""The forward kernel's visit list, built by a scalar Pallas kernel in SMEM.

`forward_metadata_reference` defines the visit list in plain JAX; XLA compiles it to about twenty small ops (a cumsum,
a searchsorted loop, gathers, a concatenation), each costing about a microsecond of fixed overhead on the TPU, which
at decode is as much as the grouped matmul's own weight stream. This kernel writes the same list in one launch: a
walk over the groups and the visit slots on the scalar unit (static loops: groups + visits iterations). Its output
equals `forward_metadata_reference`'s element for element (tests/test_ragged_dot.py checks it).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.index_math import div_nonnegative as _div
from ..common.manual_axes import out_struct

# Fields of the forward metadata, each a run of V int32 in one flat SMEM array.
F_TILE, F_FETCH_TILE, F_GROUP, F_KPIN, F_LO, F_HI, F_FIRST, F_WSLOT, F_NEXT_GROUP = range(9)
NUM_FIELDS = 9
# F_WSLOT and F_NEXT_GROUP serve the forward kernel's own weight prefetch (kernel.py): consecutive visits with the same
# F_GROUP form a *run*; F_WSLOT is the parity of the visit's run (the weight buffer its group's block sits in) and
# F_NEXT_GROUP the F_GROUP of the next run, or -1 after the last.


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


def local_group_of_rows(group_sizes, m, group_offset, num_local_groups):
    """Local group index of each of the m rows, num_local_groups for rows outside the window (and rows past the
    groups), with the row ranges of group_bounds (so negative traced sizes count as zero, as in the kernels)."""
    gs, ge = group_bounds(group_sizes, m, group_offset, num_local_groups)
    rows = jnp.arange(m, dtype=jnp.int32)
    # Empty groups have ge == gs, so the first local group whose end is past the row is the row's own.
    local = jnp.searchsorted(ge, rows, side="right").astype(jnp.int32)
    in_window = (rows >= gs[0]) & (rows < ge[-1])
    return jnp.where(in_window, local, num_local_groups)


def forward_visits_bound(m: int, tm: int, num_local_groups: int) -> int:
    # Local groups cover one contiguous row range, so the visits of real groups number at most
    # (tiles they cover) + (groups with rows - 1), and every other tile gets exactly one zero visit. At most m groups
    # have rows: at decode (m = tokens x top_k rows over many experts) that bound is the tighter one.
    return pl.cdiv(m, tm) + max(min(num_local_groups, m), 1) - 1


def forward_metadata_reference(
    group_sizes, *, m, tm, tiles_k, group_offset, num_local_groups, rhs_group_base, rhs_groups
):
    """Visit list for the forward kernel. Returns (flat int32 metadata [NUM_FIELDS * V + 1], visit count, V).

    rhs_group_base: added to the local group index to get rhs's group index (group_offset when rhs holds every
    group, 0 when it holds only the window). The last metadata element is the visit count.
    """
    tiles_m = pl.cdiv(m, tm)
    n_local = num_local_groups
    V = forward_visits_bound(m, tm, n_local)
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
    group_field = fields[F_GROUP]
    changes = jnp.concatenate([jnp.zeros((1,), jnp.int32), (group_field[1:] != group_field[:-1]).astype(jnp.int32)])
    run = jnp.cumsum(changes)
    run_group = jnp.zeros((V + 1,), jnp.int32).at[run].set(group_field)
    fields[F_WSLOT] = run % 2
    fields[F_NEXT_GROUP] = jnp.where(run + 1 <= run[-1], run_group[jnp.minimum(run + 1, V)], -1)
    meta = jnp.concatenate([f.astype(jnp.int32) for f in fields] + [nv.reshape(1).astype(jnp.int32)])
    return meta, nv.astype(jnp.int32), V


def _metadata_kernel(
    sizes_ref,
    offsets_ref,
    meta_ref,
    count_ref,
    ne_group_ref,
    ne_start_ref,
    ne_end_ref,
    *,
    m,
    tm,
    tiles_k,
    n_local,
    num_groups,
    rhs_groups,
    V,
):
    # Both loops have a static trip count (groups, visit slots), so the cost is fixed and visible in the compiled
    # schedule; the loop bodies are branch-free (scalar branches cost pipeline slots on every iteration).
    tiles_m = pl.cdiv(m, tm)
    i32 = jnp.int32

    offset = offsets_ref[0]  # first local group
    base = offsets_ref[1]  # rhs group index of local group 0

    # One pass over the groups: row ranges (ends = min(cumsum(max(size, 0)), m), as group_bounds) and, for the
    # local groups with rows, a compacted list (index, row range) plus what the visit list needs of them. Groups
    # of the window outside [0, num_groups) have no rows, so walking the real groups covers every local one.
    def summarize(g, carry):
        running, n_ne, total, lo, hi, j_first, j_last = carry
        gs = jnp.minimum(running, m)
        running = running + jnp.maximum(sizes_ref[g], 0)
        ge = jnp.minimum(running, m)
        j = g - offset
        has = jnp.logical_and(ge > gs, jnp.logical_and(j >= 0, j < n_local))
        slot = jnp.where(has, n_ne, n_local)  # groups without local rows write to a spare last slot
        ne_group_ref[slot] = j
        ne_start_ref[slot] = gs
        ne_end_ref[slot] = ge
        cnt = jnp.where(has, _div(ge - 1, tm) - _div(gs, tm) + 1, 0)
        return (
            running,
            n_ne + has.astype(i32),
            total + cnt,
            jnp.where(has, jnp.minimum(lo, gs), lo),
            jnp.where(has, jnp.maximum(hi, ge), hi),
            jnp.where(jnp.logical_and(has, j_first < 0), j, j_first),
            jnp.where(has, j, j_last),
        )

    _, _, total, lo, hi, j_first, j_last = jax.lax.fori_loop(
        0, num_groups, summarize, (i32(0), i32(0), i32(0), i32(m), i32(0), i32(-1), i32(-1))
    )
    any_rows = total > 0
    j_first = jnp.maximum(j_first, 0)
    j_last = jnp.where(any_rows, j_last, 0)
    n_prefix = jnp.where(any_rows, _div(lo, tm), tiles_m)  # zero visits for tiles 0 .. n_prefix-1
    last_cov = jnp.where(any_rows, _div(hi - 1, tm), tiles_m - 1)
    nv = n_prefix + total + (tiles_m - 1 - last_cov)
    # Zero visits fetch what the adjacent real visit fetches: the first one's blocks at k = 0 before it, the last
    # one's at the last k after it.
    first_real_tile = jnp.where(any_rows, n_prefix, 0)
    suffix_fetch = jnp.where(any_rows, last_cov, 0)
    suffix_kpin = jnp.where(any_rows, tiles_k - 1, 0)

    def visit(s, carry):
        # prev: the last real visit's fields (a slot past the visit count repeats it); (k, u): the group visits'
        # position, compacted group k and its u-th tile.
        prev, k, u = carry
        real = s < nv
        is_pre = s < n_prefix
        is_grp = jnp.logical_and(s >= n_prefix, s < n_prefix + total)
        kc = jnp.minimum(k, n_local - 1)
        gs, ge = ne_start_ref[kc], ne_end_ref[kc]
        g_tile = _div(gs, tm) + u
        tile = jnp.where(is_pre, s, jnp.where(is_grp, g_tile, last_cov + 1 + (s - n_prefix - total)))
        visit_fields = {
            F_TILE: tile,
            F_FETCH_TILE: jnp.where(is_pre, first_real_tile, jnp.where(is_grp, tile, suffix_fetch)),
            F_GROUP: jnp.clip(
                jnp.where(is_pre, j_first, jnp.where(is_grp, ne_group_ref[kc], j_last)) + base, 0, rhs_groups - 1
            ),  # never a DMA outside rhs
            F_LO: jnp.where(is_grp, jnp.maximum(gs, tile * tm), 0),
            F_HI: jnp.where(is_grp, jnp.minimum(ge, tile * tm + tm), 0),
        }
        # Past the visit count: the last visit again at the last k (no DMA; skipped by a static grid).
        fields = {f: jnp.where(real, value, prev[f]) for f, value in visit_fields.items()}
        fields[F_KPIN] = jnp.where(real, jnp.where(is_grp, -1, jnp.where(is_pre, 0, suffix_kpin)), tiles_k - 1)
        fields[F_FIRST] = jnp.logical_and(real, tile != prev[F_TILE]).astype(i32)
        new_run = jnp.logical_and(s > 0, fields[F_GROUP] != prev[F_GROUP])
        fields[F_WSLOT] = jnp.where(new_run, 1 - prev[F_WSLOT], prev[F_WSLOT])
        for f, value in fields.items():  # stores only: no branch in the loop body
            meta_ref[f * V + s] = value
        step = jnp.logical_and(real, is_grp)
        group_done = _div(gs, tm) + u + 1 > _div(ge - 1, tm)
        k = jnp.where(jnp.logical_and(step, group_done), k + 1, k)
        u = jnp.where(step, jnp.where(group_done, 0, u + 1), u)
        return {f: fields[f] for f in (*visit_fields, F_WSLOT)}, k, u

    start = {f: i32(-1 if f == F_TILE else 0) for f in (F_TILE, F_FETCH_TILE, F_GROUP, F_LO, F_HI, F_WSLOT)}
    jax.lax.fori_loop(0, V, visit, (start, i32(0), i32(0)))

    def next_run(r, carry):  # backwards: the group of the run after each visit's
        later_group, later_next = carry
        s = V - 1 - r
        group = meta_ref[F_GROUP * V + s]
        nxt = jnp.where(group != later_group, later_group, later_next)
        meta_ref[F_NEXT_GROUP * V + s] = nxt
        return group, nxt

    last = meta_ref[F_GROUP * V + V - 1]
    jax.lax.fori_loop(0, V, next_run, (last, i32(-1)))
    meta_ref[NUM_FIELDS * V] = nv
    count_ref[0] = nv


def forward_metadata(group_sizes, *, m, tm, tiles_k, group_offset, num_local_groups, rhs_group_base, rhs_groups):
    """As forward_metadata_reference (same arguments and result), computed by one scalar Pallas kernel."""
    num_groups = group_sizes.shape[0]
    V = forward_visits_bound(m, tm, num_local_groups)
    offsets = jnp.stack(
        [jnp.asarray(group_offset, jnp.int32).reshape(()), jnp.asarray(rhs_group_base, jnp.int32).reshape(())]
    )
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    kernel = functools.partial(
        _metadata_kernel,
        m=m,
        tm=tm,
        tiles_k=tiles_k,
        n_local=num_local_groups,
        num_groups=num_groups,
        rhs_groups=rhs_groups,
        V=V,
    )
    meta, count = pl.pallas_call(
        kernel,
        out_shape=(
            out_struct((NUM_FIELDS * V + 1,), jnp.int32, group_sizes, offsets),
            out_struct((1,), jnp.int32, group_sizes),
        ),
        in_specs=[smem, smem],
        out_specs=(smem, smem),
        scratch_shapes=[pltpu.SMEM((num_local_groups + 1,), jnp.int32)] * 3,
        name="ragged_dot_metadata",
    )(group_sizes.astype(jnp.int32), offsets)
    return meta, count.reshape(()), V
