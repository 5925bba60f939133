"""Pallas TPU kernels for the ragged dot (grouped matmul): forward (with an optional fused bias / activation / gated
epilogue) and the transposed grouped matmul used for the rhs gradient. The lhs gradient is the forward kernel with
rhs read transposed.

Visits. lhs rows are sorted by group, so an m tile of `tm` rows can hold rows of several groups. The forward walks a
list of *visits*, one per (m tile, group) pair that share rows, in m-tile order; a tile that straddles a group
boundary is visited once per group and each visit writes only its own rows (a row mask). Tiles holding no row of a
local group (rows past sum(group_sizes), rows of groups outside the local window) get one *zero visit* that writes
zeros and computes nothing. The list is built by a scalar kernel (metadata.py) and handed to the kernel through
scalar prefetch (SMEM), where the index maps read it to pick the lhs tile, the group's weight block and the output
tile of each grid step.

Grid (n tiles, visits, k tiles). The output block (tile, n) stays in VMEM while consecutive visits share the tile,
so the masked writes of several groups merge before one write-back. The weight block (group, k, n) stays in VMEM
while consecutive visits share the group and tk = K, so a group's weights are read once per n tile however many m
tiles it spans. With tk = K the kernel fetches those blocks itself instead of through the pipeline (unless a last,
narrower n tile is no whole number of 128-column tiles), a run of visits ahead: the first visit of each group starts
the next group's DMA into the other of two buffers, so the load overlaps all of the current group's visits, not one
grid step's (_prefetched_weights). Zero visits pin their lhs/weight block indices to those of the adjacent real
visit, so they cause no DMA. By default the visit axis is sized by the real visit count (a dynamic grid bound, read
from the metadata);
`static_grid=True` instead sizes it by the worst case (tiles_m + groups - 1), the surplus steps repeat the last
visit's block indices (no DMA) and skip all work under `pl.when`.

Accumulation is in f32: directly in registers when tk = K (one k step), else in a VMEM scratch over the k axis.

Row chunks (blocks.row_chunk, with tk = K): a visit to a tile it shares with other groups multiplies only the chunks
of row_chunk rows that hold its rows, so a tile straddling a boundary costs the MXU about its rows once, not the whole
tile once per group (under random routing most groups start and end inside a tile: 1.5x the useful MXU work at
groups of 256 rows and tm = 128, 2x at tm = 256). The tile's first visit zeroes the whole output block first.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import mxfp4, quantization
from ..common.activation import apply_activation, apply_gating, deinterleaved_gating
from ..common.index_math import div_nonnegative
from ..common.manual_axes import out_struct
from . import metadata
from .metadata import (
    F_FETCH_TILE,
    F_FIRST,
    F_GROUP,
    F_HI,
    F_KPIN,
    F_LO,
    F_NEXT_GROUP,
    F_TILE,
    F_WSLOT,
    NUM_FIELDS,
    group_bounds,
)

# Fields of the transposed-matmul metadata.
T_TILE, T_GROUP, T_LO, T_HI, T_FIRST, T_LAST = range(6)
NUM_T_FIELDS = 6


def transposed_visits_bound(tiles_m: int, num_local_groups: int) -> int:
    # Real visits as in the forward, plus one visit per empty group (its output block must still be zeroed).
    return tiles_m + 2 * max(num_local_groups, 1) - 1


def transposed_metadata(group_sizes, *, m, tm, group_offset, num_local_groups):
    """Visit list for the transposed grouped matmul: every local group in order, each over the m tiles it touches,
    an empty group once (to write its zero output). Returns (flat metadata [NUM_T_FIELDS * V + 1], count, V)."""
    tiles_m = pl.cdiv(m, tm)
    n_local = num_local_groups
    V = transposed_visits_bound(tiles_m, n_local)
    gs, ge = group_bounds(group_sizes, m, group_offset, n_local)
    nonempty = ge > gs
    first_t = gs // tm
    cnt = jnp.where(nonempty, (ge - 1) // tm - first_t + 1, 1)
    csum = jnp.cumsum(cnt)
    nv = csum[-1]
    v = jnp.minimum(jnp.arange(V, dtype=jnp.int32), nv - 1)
    j = jnp.clip(jnp.searchsorted(csum, v, side="right"), 0, n_local - 1).astype(jnp.int32)
    u = v - (csum[j] - cnt[j])
    tile = jnp.clip(first_t[j] + u, 0, tiles_m - 1)
    real = nonempty[j]
    row_lo = jnp.where(real, jnp.maximum(gs[j], tile * tm), 0)
    row_hi = jnp.where(real, jnp.minimum(ge[j], tile * tm + tm), 0)
    fields = [None] * NUM_T_FIELDS
    fields[T_TILE] = tile
    fields[T_GROUP] = j
    fields[T_LO] = row_lo
    fields[T_HI] = row_hi
    fields[T_FIRST] = (u == 0).astype(jnp.int32)
    fields[T_LAST] = (u == cnt[j] - 1).astype(jnp.int32)
    meta = jnp.concatenate([f.astype(jnp.int32) for f in fields] + [nv.reshape(1).astype(jnp.int32)])
    return meta, nv.astype(jnp.int32), V


def float16_through_float32(fn):
    """fn (a kernel wrapper taking arrays positionally and `out_dtype`) with no float16 reaching Mosaic, which neither
    packs nor unpacks it on v5e or v6e ("failed to legalize operation 'tpu.pack_subelements'"): float16 operands
    enter as float32, and a float16 result is written as float32 and rounded by XLA (one more pass over it)."""

    @functools.wraps(fn)
    def wrapper(*arrays, out_dtype, **kwargs):
        arrays = [a.astype(jnp.float32) if a.dtype == jnp.float16 else a for a in arrays]
        if jnp.dtype(out_dtype) != jnp.float16:
            return fn(*arrays, out_dtype=out_dtype, **kwargs)
        return fn(*arrays, out_dtype=jnp.float32, **kwargs).astype(jnp.float16)

    return wrapper


def matmul_precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _prefetched_weights(meta_ref, rhs_refs, scratch_refs, *, V, transposed, shifts, tiles_n, last_width):
    """The weight blocks of this visit's group, fetched by the kernel itself one run of visits ahead.

    Pallas' pipeline fetches a block one grid step ahead, so the next group's weights (MiBs a block) load during the
    current group's last visit alone; in prefill, where a group spans a few m tiles, that DMA outlasts one visit and
    the MXU waits (measured on the v5e: 128 groups of 256 rows at tm = 128, 1880 µs against 1348 at tm = 256, the
    same MXU work). Here the rhs streams stay in HBM and the first visit of each run of visits of one group (metadata
    F_WSLOT, F_NEXT_GROUP) starts the DMA of the next run's blocks (after an n tile's last run, the next n tile's
    first) into the other of two buffers, then waits for its own: the load overlaps every visit of the current
    group, and two DMAs are in flight at a run's start as in the pipeline (decode streams weights back to back). The
    buffer of a run alternates across n tiles too: (run parity + n * runs) mod 2, so the next n tile's first run
    never lands on the buffer in use. A last n tile narrower than the others (last_width columns: N not a whole
    number of blocks) is fetched at its own width into the buffer's first columns, as the pipeline fetches an edge
    block; the rest of the buffer holds an earlier block's columns, which reach only output columns past N (never
    written; the interleaved epilogue zeroes them first). Returns the refs to read this visit's blocks from.
    """
    n_streams = len(rhs_refs)
    buffers, sems = scratch_refs[:n_streams], scratch_refs[n_streams]
    n, v = pl.program_id(0), pl.program_id(1)
    wn = buffers[0].shape[1] if transposed else buffers[0].shape[2]
    group = meta_ref[F_GROUP * V + v]
    runs = meta_ref[F_WSLOT * V + meta_ref[NUM_FIELDS * V] - 1] + 1  # parity is all that counts
    slot = (meta_ref[F_WSLOT * V + v] + n * runs) % 2
    following = meta_ref[F_NEXT_GROUP * V + v]
    run_start = jnp.logical_or(v == 0, group != meta_ref[F_GROUP * V + jnp.maximum(v - 1, 0)])

    def transfer(action, g, tile_n, into):
        """start or wait the DMAs of group g's blocks at n tile tile_n into buffer `into`."""

        def at_width(width):
            for i, (src, buf) in enumerate(zip(rhs_refs, buffers)):
                # Offsets on the lanes (or sublanes) of a tiled HBM array: say they are whole tiles (tn is a multiple
                # of 128 whenever there are several n tiles; with one, the offset is static).
                start = shifts[i] * wn if tiles_n == 1 else pl.multiple_of((tile_n + shifts[i]) * wn, 128)
                cols, head = pl.ds(start, width), pl.ds(0, width)
                block = src.at[g, cols, :] if transposed else src.at[g, :, cols]
                dst = buf.at[into, head, :] if transposed else buf.at[into, :, head]
                getattr(pltpu.make_async_copy(block, dst, sems.at[i, into]), action)()

        if last_width == wn:
            at_width(wn)
            return
        is_last = tile_n == tiles_n - 1
        pl.when(is_last)(lambda: at_width(last_width))
        pl.when(jnp.logical_not(is_last))(lambda: at_width(wn))

    @pl.when(jnp.logical_and(v == 0, n == 0))  # the first run of all: nothing fetched it ahead
    def _():
        transfer("start", group, n, slot)

    @pl.when(run_start)
    def _():
        @pl.when(following >= 0)
        def _():
            transfer("start", jnp.maximum(following, 0), n, 1 - slot)

        if tiles_n > 1:

            @pl.when(jnp.logical_and(following < 0, n + 1 < tiles_n))
            def _():
                transfer("start", meta_ref[F_GROUP * V], n + 1, 1 - slot)

        transfer("wait", group, n, slot)

    return [buf.at[slot] for buf in buffers]


def _forward_kernel(
    meta_ref,
    lhs_ref,
    *refs,
    V,
    tm,
    tk,
    k,
    n_full,
    tiles_k,
    transposed,
    gated,
    activation,
    num_scale,
    num_bias,
    has_row_scale,
    compute_dtype,
    static_grid,
    rhs_factor=1.0,
    mxfp4_blocks=False,
    stream_shifts=None,
    tiles_n=1,
    last_width=None,
    row_chunk=0,
):
    n_rhs = 2 if gated == "concatenated" else 1  # interleaved: one stream of 2 * tn columns, gate and up alternating
    rhs_refs = refs[:n_rhs]
    refs = refs[n_rhs:]
    if mxfp4_blocks:  # each stream's e8m0 block scales
        block_scale_refs = refs[:n_rhs]
        refs = refs[n_rhs:]
    col_scale_refs = refs[:num_scale]
    bias_refs = refs[num_scale : num_scale + num_bias]
    scale_ref = refs[num_scale + num_bias] if has_row_scale else None
    out_ref = refs[num_scale + num_bias + has_row_scale]
    scratch_refs = refs[num_scale + num_bias + has_row_scale + 1 :]
    prefetch = stream_shifts is not None
    acc_refs = () if prefetch else scratch_refs
    v = pl.program_id(1)
    kk = pl.program_id(2)
    tile = meta_ref[F_TILE * V + v]
    lo = meta_ref[F_LO * V + v]
    hi = meta_ref[F_HI * V + v]
    first = meta_ref[F_FIRST * V + v] != 0
    active = v < meta_ref[NUM_FIELDS * V] if static_grid else True
    has_rows = jnp.logical_and(active, lo < hi)
    last_k = tiles_k - 1
    k_rem = k % tk
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))

    def mask_k(x, axis):
        # Only when tk does not divide K: columns of the last k block past K hold garbage.
        if k_rem == 0:
            return x
        valid = jnp.where(kk == last_k, k_rem, tk)
        ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
        return jnp.where(ids < valid, x, jnp.zeros_like(x))

    weight_refs = rhs_refs
    if prefetch:
        weight_refs = _prefetched_weights(
            meta_ref,
            rhs_refs,
            scratch_refs,
            V=V,
            transposed=transposed,
            shifts=stream_shifts,
            tiles_n=tiles_n,
            last_width=last_width,
        )

    def weights():
        return [r[...] for r in weight_refs]

    def lhs(rows):  # the tile's rows, or a row chunk's
        return lhs_ref[...] if rows is None else lhs_ref[rows, :]

    def mxfp4_dots(rows):
        # lhs arrives in the planes' column order (mxfp4.plane_order): plane p meets its K / 4 columns.
        x = lhs(rows).astype(compute_dtype)
        quarter = x.shape[1] // 4
        outs = []
        for w_ref, s_ref in zip(weight_refs, block_scale_refs):
            planes = mxfp4.widen(w_ref[...], s_ref[...], compute_dtype)
            outs.append(
                sum(
                    jax.lax.dot_general(
                        x[:, p * quarter : (p + 1) * quarter],
                        w,
                        dims,
                        preferred_element_type=jnp.float32,
                        precision=matmul_precision(compute_dtype),
                    )
                    for p, w in enumerate(planes)
                )
            )
        return outs

    def dots(rows=None):
        if mxfp4_blocks:
            return mxfp4_dots(rows)
        x = mask_k(lhs(rows).astype(compute_dtype), 1)
        outs = []
        for w in weights():
            # Quantized weights (int8 / e4m3) are widened here, in VMEM: exact in bf16 up to rhs_factor (a power of
            # two); their scale and that factor come in finalize.
            w = mask_k(quantization.widen(w, compute_dtype), 1 if transposed else 0)
            outs.append(
                jax.lax.dot_general(
                    x, w, dims, preferred_element_type=jnp.float32, precision=matmul_precision(compute_dtype)
                )
            )
        return outs

    def finalize(parts, rows=None, offset=0, count=tm):
        if num_scale:
            # Per-output-column scale of quantized weights, on the f32 result: one multiply per output element.
            parts = [p * (s[...] * rhs_factor if rhs_factor != 1.0 else s[...]) for p, s in zip(parts, col_scale_refs)]
        elif rhs_factor != 1.0:  # quantized rhs without a column scale here (the lhs gradient carries it)
            parts = [p * rhs_factor for p in parts]
        if num_bias:
            parts = [p + b[...].astype(jnp.float32) for p, b in zip(parts, bias_refs)]
        if gated is None:
            r = apply_activation(parts[0], activation)
        elif gated == "interleaved":
            h = parts[0]
            if n_full % h.shape[1]:
                # The last n tile's block runs past N: its garbage columns would reach every lane through the
                # de-interleave's selection matmuls (0 * NaN), so they are zeroed first.
                cols = pl.program_id(0) * h.shape[1] + jax.lax.broadcasted_iota(jnp.int32, h.shape, 1)
                h = jnp.where(cols < n_full, h, 0.0)
            r = deinterleaved_gating(h, activation)
        else:
            r = apply_gating(parts[0], parts[1], activation)
        if has_row_scale:
            r = r * (scale_ref[...] if rows is None else scale_ref[rows, :])  # (rows, 1) f32: the routing weight
        if rows is not None:
            # A partial visit over a window of the tile: the rows outside it are zeroed by the tile's first visit.
            win = tile * tm + offset + jax.lax.broadcasted_iota(jnp.int32, (count, 1), 0)
            mask = jnp.logical_and(win >= lo, win < hi)
            rc = r.astype(out_ref.dtype)

            @pl.when(first)
            def _():
                out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

            out_ref[rows, :] = jnp.where(mask, rc, out_ref[rows, :])
            return
        start = tile * tm
        whole = jnp.logical_and(lo <= start, hi >= start + tm)

        @pl.when(whole)
        def _():
            out_ref[...] = r.astype(out_ref.dtype)

        @pl.when(jnp.logical_not(whole))
        def _():
            rows = start + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
            mask = jnp.logical_and(rows >= lo, rows < hi)
            rc = r.astype(out_ref.dtype)

            @pl.when(first)
            def _():
                out_ref[...] = jnp.where(mask, rc, jnp.zeros_like(rc))

            @pl.when(jnp.logical_not(first))
            def _():
                out_ref[...] = jnp.where(mask, rc, out_ref[...])

    if tiles_k == 1 and 0 < row_chunk < tm:
        # A visit computes only the chunks of row_chunk rows of its tile that hold its rows, c0 .. c1 (exclusive): a
        # tile straddling groups costs each group's visit its own rows' MXU passes, not the whole tile's. One branch
        # per chunk count, each a matmul of static size at an aligned offset.
        base = tile * tm
        c0 = div_nonnegative(jnp.maximum(lo, base) - base, row_chunk)
        c1 = div_nonnegative(jnp.minimum(hi, base + tm) - base + row_chunk - 1, row_chunk)
        chunks = tm // row_chunk

        @pl.when(jnp.logical_and(has_rows, c1 - c0 == chunks))
        def _():
            finalize(dots())

        for count in range(1, chunks):

            @pl.when(jnp.logical_and(has_rows, c1 - c0 == count))
            def _(count=count):
                offset = pl.multiple_of(c0 * row_chunk, row_chunk)
                rows = pl.ds(offset, count * row_chunk)
                finalize(dots(rows), rows, offset, count * row_chunk)

    elif tiles_k == 1:

        @pl.when(has_rows)
        def _():
            finalize(dots())

    else:

        @pl.when(jnp.logical_and(has_rows, kk == 0))
        def _():
            for acc, d in zip(acc_refs, dots()):
                acc[...] = d

        @pl.when(jnp.logical_and(has_rows, jnp.logical_and(kk > 0, kk < last_k)))
        def _():
            for acc, d in zip(acc_refs, dots()):
                acc[...] += d

        @pl.when(jnp.logical_and(has_rows, kk == last_k))
        def _():
            finalize([acc[...] + d for acc, d in zip(acc_refs, dots())])

    @pl.when(jnp.logical_and(jnp.logical_and(active, lo >= hi), kk == last_k))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


@float16_through_float32
def ragged_dot_forward(
    lhs,
    rhs,
    group_sizes,
    *,
    out_dtype,
    blocks,
    rhs_transposed,
    group_offset,
    num_local_groups,
    rhs_group_base,
    bias=(),
    scale=(),
    gated=None,
    activation=None,
    row_scale=None,
    static_grid=False,
    block_scale=None,
):
    """out [M, n_out] = per-visit masked lhs @ rhs[group] (+ bias, epilogue) (x row_scale). Arguments are validated
    by api.py. row_scale: None or [M, 1] f32, multiplying each row's result last.

    rhs: [Gr, K, N] or [Gr, N, K] (rhs_transposed). gated None: n_out = N. gated "concatenated": n_out = N / 2, the
    gate is rhs columns [0, n_out) and up [n_out, N), read as two block streams of the same array (tn must divide
    n_out); the epilogue writes act(gate) * up (or the ClampedSwiGLU). gated "interleaved": gate and up alternate
    along N; output tile n reads the one block of rhs columns [2 n tn, 2 (n + 1) tn) (columns of a last partial block
    past N are zeroed before the de-interleave, whose selection matmuls would carry their garbage into every lane) and
    the epilogue de-interleaves the f32 result in VMEM (common.activation.deinterleaved_gating: Mosaic has no
    lane-strided slice, nor a strided load that splits a bf16 block's rows). bias: tuple of [Gr, 1, N'] arrays, one
    per block stream: the gate and up halves (concatenated), or the whole bias (interleaved, ungated). scale: () or,
    for quantized rhs (int8 / float8_e4m3fn, cast to lhs's dtype block by block in VMEM), one [Gr, 1, N'] f32 array
    per block stream like bias, multiplying the f32 result's columns before the bias and the epilogue. block_scale:
    None or, for MXFP4 rhs (uint8 [Gr, K / 2, N] packed e2m1 pairs, not rhs_transposed, tk = K), its e8m0 block
    scales uint8 [Gr, S, N] (S >= K / 32, mxfp4.prepare's layout and encoding); lhs then holds its columns in the
    weights' plane order (mxfp4.plane_order).
    """
    m, k = lhs.shape
    mx = block_scale is not None
    if mx and (rhs_transposed or blocks.tk != k or rhs.shape[1] * 2 != k):
        raise ValueError("MXFP4 rhs: the kernel reads it as [G, K / 2, N] (not rhs_transposed) with tk = K")
    n_full = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    n_out = n_full // 2 if gated else n_full
    tm, tk, tn = blocks.tm, blocks.tk, blocks.tn
    tiles_k = pl.cdiv(k, tk)
    tiles_n = pl.cdiv(n_out, tn)
    meta, nv, V = metadata.forward_metadata(
        group_sizes,
        m=m,
        tm=tm,
        tiles_k=tiles_k,
        group_offset=group_offset,
        num_local_groups=num_local_groups,
        rhs_group_base=rhs_group_base,
        rhs_groups=rhs.shape[0],
    )

    def k_index(v, kk, meta):
        pin = meta[F_KPIN * V + v]
        return jnp.where(pin < 0, kk, pin)

    def lhs_map(n, v, kk, meta):
        return meta[F_FETCH_TILE * V + v], k_index(v, kk, meta)

    def rhs_map(shift):
        def index(n, v, kk, meta):
            g = meta[F_GROUP * V + v]
            if rhs_transposed:
                return g, n + shift, k_index(v, kk, meta)
            return g, k_index(v, kk, meta), n + shift

        return index

    def bias_map(n, v, kk, meta):
        return meta[F_GROUP * V + v], 0, n

    def out_map(n, v, kk, meta):
        return meta[F_TILE * V + v], n

    if gated not in (None, "concatenated", "interleaved"):
        raise ValueError(f"gated: expected None, 'concatenated' or 'interleaved', got {gated!r}")
    in_specs = [pl.BlockSpec((tm, tk), lhs_map)]
    operands = [lhs]
    shifts = [0, n_out // tn] if gated == "concatenated" else [0]
    wn = 2 * tn if gated == "interleaved" else tn  # rhs columns per block: gate and up alternate within one block
    wshape = (None, wn, tk) if rhs_transposed else (None, tk // 2 if mx else tk, wn)
    # With all of K in one block, the kernel fetches each group's weight blocks itself, a run of visits ahead
    # (_prefetched_weights); a last n tile short of a whole block (N not a multiple of the block: only without the
    # concatenated layout, whose tn divides N / 2) is fetched at its width, which Mosaic slices in VMEM only in
    # whole 128-column tiles (else the pipeline fetches, as it does edge blocks).
    last_width = wn if gated == "concatenated" else n_full - (tiles_n - 1) * wn
    prefetch = tiles_k == 1 and (last_width == wn or last_width % 128 == 0)
    for s in shifts:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY) if prefetch else pl.BlockSpec(wshape, rhs_map(s)))
        operands.append(rhs)
    if mx:
        for s in shifts:
            in_specs.append(pl.BlockSpec((None, block_scale.shape[1], wn), rhs_map(s)))
            operands.append(block_scale)
    for c in scale:
        in_specs.append(pl.BlockSpec((None, 1, wn), bias_map))
        operands.append(c)
    for b in bias:
        in_specs.append(pl.BlockSpec((None, 1, wn), bias_map))
        operands.append(b)
    if row_scale is not None:
        in_specs.append(pl.BlockSpec((tm, 1), lambda n, v, kk, meta: (meta[F_TILE * V + v], 0)))
        operands.append(row_scale)
    scratch = [pltpu.VMEM((tm, wn), jnp.float32) for _ in shifts] if tiles_k > 1 else []
    if prefetch:
        scratch = [pltpu.VMEM((2, *wshape[1:]), rhs.dtype) for _ in shifts] + [
            pltpu.SemaphoreType.DMA((len(shifts), 2))
        ]
    compute_dtype = quantization.compute_dtype(lhs.dtype, rhs.dtype)
    kernel = functools.partial(
        _forward_kernel,
        V=V,
        tm=tm,
        tk=tk,
        k=k,
        n_full=n_full,
        tiles_k=tiles_k,
        transposed=rhs_transposed,
        gated=gated,
        activation=activation,
        num_scale=len(scale),
        num_bias=len(bias),
        has_row_scale=row_scale is not None,
        compute_dtype=compute_dtype,
        static_grid=static_grid,
        rhs_factor=quantization.widen_factor(rhs.dtype),
        mxfp4_blocks=mx,
        stream_shifts=tuple(shifts) if prefetch else None,
        tiles_n=tiles_n,
        last_width=last_width,
        row_chunk=blocks.row_chunk or 0,
    )
    grid_v = V if static_grid else nv
    rhs_bytes = num_local_groups * rhs.shape[1] * rhs.shape[2] * rhs.dtype.itemsize
    if mx:
        rhs_bytes += num_local_groups * n_full * block_scale.shape[1]
    cost = pl.CostEstimate(
        flops=2 * m * k * n_full,
        transcendentals=m * n_out if activation else 0,
        bytes_accessed=tiles_n * m * k * lhs.dtype.itemsize + rhs_bytes + m * n_out * jnp.dtype(out_dtype).itemsize,
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((m, n_out), out_dtype, meta, operands),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(tiles_n, grid_v, tiles_k),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            # The kernel's own weight prefetch runs on from one n tile into the next: n tiles in order, on one core.
            dimension_semantics=("arbitrary" if prefetch else "parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=blocks.vmem_limit_bytes,
        ),
        cost_estimate=cost,
        name="ragged_dot_fwd",
    )(meta, *operands)


def _transposed_kernel(meta_ref, a_ref, b_ref, out_ref, acc_ref, *, V, tm, compute_dtype, static_grid):
    v = pl.program_id(2)
    tile = meta_ref[T_TILE * V + v]
    lo = meta_ref[T_LO * V + v]
    hi = meta_ref[T_HI * V + v]
    active = v < meta_ref[NUM_T_FIELDS * V] if static_grid else True
    first = jnp.logical_and(active, meta_ref[T_FIRST * V + v] != 0)
    last = jnp.logical_and(active, meta_ref[T_LAST * V + v] != 0)

    @pl.when(first)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(jnp.logical_and(active, lo < hi))
    def _():
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mask = jnp.logical_and(rows >= lo, rows < hi)
        # Both operands masked: rows of other groups, and rows past M in a partial last tile, may hold anything.
        a = jnp.where(mask, a_ref[...].astype(jnp.float32), 0.0).astype(compute_dtype)
        b = jnp.where(mask, b_ref[...].astype(jnp.float32), 0.0).astype(compute_dtype)
        acc_ref[...] += jax.lax.dot_general(
            a.T,
            b,
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=matmul_precision(compute_dtype),
        )

    @pl.when(last)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@float16_through_float32
def transposed_ragged_dot(a, b, group_sizes, *, out_dtype, blocks, group_offset, num_local_groups, static_grid=False):
    """out [n_local, P, Q]: out[j] = a[rows of local group j]^T @ b[rows of local group j]; zero for empty groups.

    a [M, P], b [M, Q]. This is the rhs gradient: d rhs = transposed_ragged_dot(lhs, g) ([K, N] blocks), or
    transposed_ragged_dot(g, lhs) for a transposed rhs ([N, K] blocks).
    """
    m, p = a.shape
    q = b.shape[1]
    tm, tp, tq = blocks.tm, blocks.tp, blocks.tq
    meta, nv, V = transposed_metadata(
        group_sizes, m=m, tm=tm, group_offset=group_offset, num_local_groups=num_local_groups
    )
    compute_dtype = jnp.promote_types(a.dtype, b.dtype)
    kernel = functools.partial(_transposed_kernel, V=V, tm=tm, compute_dtype=compute_dtype, static_grid=static_grid)
    tiles_p, tiles_q = pl.cdiv(p, tp), pl.cdiv(q, tq)
    cost = pl.CostEstimate(
        flops=2 * m * p * q,
        transcendentals=0,
        bytes_accessed=tiles_q * m * p * a.dtype.itemsize
        + tiles_p * m * q * b.dtype.itemsize
        + num_local_groups * p * q * jnp.dtype(out_dtype).itemsize,
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((num_local_groups, p, q), out_dtype, meta, a, b),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(tiles_p, tiles_q, V if static_grid else nv),
            in_specs=[
                pl.BlockSpec((tm, tp), lambda i, jq, v, meta: (meta[T_TILE * V + v], i)),
                pl.BlockSpec((tm, tq), lambda i, jq, v, meta: (meta[T_TILE * V + v], jq)),
            ],
            out_specs=pl.BlockSpec((None, tp, tq), lambda i, jq, v, meta: (meta[T_GROUP * V + v], i, jq)),
            scratch_shapes=[pltpu.VMEM((tp, tq), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=blocks.vmem_limit_bytes
        ),
        cost_estimate=cost,
        name="ragged_dot_tgmm",
    )(meta, a, b)
