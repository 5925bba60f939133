"""Public JAX API of flash attention: flash_attention ([B, S, H, D]) and flash_attention_varlen (packed sequences,
cu_seqlens), input validation, block choice, the visit lists, and the custom_vjp wiring of the forward, dq and
dk/dv kernels. Semantics are flash-attn 2's (see reference.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..common import chip
from ..common.interpret import interpret_eager_cpu_calls
from ..common.manual_axes import cotangent_like
from . import backward, band, checks, forward, schedule, tuning
from .geometry import Geometry
from .tuning import FlashAttentionBlocks

# Visit lists live in SMEM (one int32 a visit, forward and dk/dv lists; the fused dk/dv kernel also one dq slot a
# visit); beyond this, larger blocks are needed.
MAX_VISITS = 32768

# Query and key rows below this are padded up to it (padded query rows see no key, padded keys no query: the key
# ranges of schedule.key_ranges end at the last sequence). A one-row block against a wider one trips Pallas's
# matmul lowering (jax 0.10.2: "'vector.broadcast' op failed to verify that source operand and result have same
# element type"), e.g. one key row under seven query rows; a sublane tile of rows is the smallest block either takes.
MIN_ROWS = 8


def _padded(x, *, rows: int, width: int):
    """x [R, ..., D] with zero rows appended up to `rows` (MIN_ROWS) and zero lanes up to `width`
    (tuning.run_head_dims: zero q / K lanes add nothing to the scores, zero V lanes give output lanes that are sliced
    off); x itself when it has as many."""
    pads = [(0, max(0, rows - x.shape[0]))] + [(0, 0)] * (x.ndim - 2) + [(0, max(0, width - x.shape[-1]))]
    return jnp.pad(x, pads) if any(after for _, after in pads) else x


def _planner(qkv, options, *, q_rows: int, kv_rows: int, **sequences):
    """(setup_for(blocks) -> _Setup, D, Dv the kernels run at) for a call whose checks.check_qkv and
    checks.check_options gave `qkv` and `options`: the head dims tuning.run_head_dims picks (head dim 64 runs as 128
    but under a small window), and the window's reach for the tables (small windows: their own blocks).
    sequences: longest_sequence (packed) or sequence_rows (equal lengths)."""
    dtype, hq, hkv, d, dv = qkv
    scale, causal, window, softcap = options
    window_keys = schedule.window_keys(causal=causal, window_size=window)
    d_run, dv_run = tuning.run_head_dims(d, dv, window_keys=window_keys)
    setup_for = functools.partial(
        _setup,
        q_rows=q_rows,
        kv_rows=kv_rows,
        hq=hq,
        hkv=hkv,
        d=d_run,
        dv=dv_run,
        dtype=dtype,
        scale=scale,
        softcap=softcap,
        window_keys=window_keys,
        **sequences,
    )
    return setup_for, d_run, dv_run


# ---------------------------------------------------------------------------------------------------- the kernels
@dataclasses.dataclass(frozen=True)
class _Setup:
    """The static choices of one call: each direction's geometry (the same but for their blocks and kv heads a step),
    the scoped VMEM limit of every kernel, and whether the backward fuses dq."""

    forward: Geometry
    backward: Geometry
    vmem_limit: int
    fused: bool
    # a small window's forward on the table's choice may run as one band of key blocks per query block (band.py),
    # where the call's row ranges are constants that allow it; band_reach is then its key blocks before a row's own
    small_window: bool = False
    band_reach: int | None = None


def _setup(blocks, *, q_rows, kv_rows, hq, hkv, d, dv, dtype, scale, softcap, **sequences) -> _Setup:
    caller_blocks = blocks
    blocks = tuning.resolve_blocks(
        blocks,
        q_rows=q_rows,
        kv_rows=kv_rows,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        itemsize=jnp.dtype(dtype).itemsize,
        info=chip.current_tpu_info(),
        **sequences,  # longest_sequence (packed) or sequence_rows (equal lengths): tuning's caps on its blocks
    )
    forward_geometry = Geometry(
        q_rows=q_rows,
        kv_rows=kv_rows,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        block_q=blocks.block_q,
        block_kv=blocks.block_kv,
        kv_heads_per_step=blocks.kv_heads_per_step,
        softmax_scale=scale,
        softcap=softcap,
    )
    backward_geometry = dataclasses.replace(
        forward_geometry,
        block_q=blocks.backward_block_q,
        block_kv=blocks.backward_block_kv,
        kv_heads_per_step=blocks.backward_kv_heads_per_step,
    )
    for g in (forward_geometry, backward_geometry):
        if max(g.num_q_blocks, g.num_kv_blocks) > schedule.MAX_BLOCKS:
            raise ValueError(
                f"blocks: {g.num_q_blocks} query blocks and {g.num_kv_blocks} key blocks, more than the "
                f"{schedule.MAX_BLOCKS} a visit can address; use larger blocks"
            )
    window_keys = sequences.get("window_keys")
    tables_forward = caller_blocks is None or (
        caller_blocks.block_q is None and caller_blocks.block_kv is None and caller_blocks.kv_heads_per_step is None
    )
    small_window = tables_forward and window_keys is not None and window_keys <= tuning.SMALL_WINDOW_KEYS
    return _Setup(forward_geometry, backward_geometry, blocks.vmem_limit_bytes, blocks.fused_backward, small_window)


def _choose_backward(blocks, setup_for, setup: _Setup, slots_of, dq_bytes: int) -> _Setup:
    """The setup where the tuning table chose the fused backward (`setup`), kept unless its dq slots (f32 dq blocks of
    HBM per query block of the backward: the most key blocks one needs, or their bound for traced cu_seqlens;
    slots_of(setup)) would be more than tuning.max_dq_slots (MAX_DQ_SLOTS, fewer where the slots, dq_bytes each,
    would take too much of the chip's HBM) and the caller left fused_backward to the table. Then the fused backward on
    the long-sequence table's blocks (tuning.LONG_BACKWARD_TABLE: wider key blocks, fewer slots) where they differ and
    their slots are within the limit, else the unfused backward."""
    limit = tuning.max_dq_slots(dq_bytes, chip.current_tpu_info())
    if slots_of(setup) <= limit or (blocks is not None and blocks.fused_backward is not None):
        return setup
    long = setup_for(blocks, long_sequences=True)
    if long.backward != setup.backward and slots_of(long) <= limit:
        return long
    return setup_for(dataclasses.replace(blocks or FlashAttentionBlocks(), fused_backward=False))


def _plan(geometry, lo, hi, xp, size=None, *, fused: bool, slot_bound: int | None = None, forward_list: bool = True):
    """What the kernels need beyond q, k, v: (arrays, static_counts, dq_slots). arrays: the row ranges in two layouts
    ([Tq padded, 2] for column blocks, [2, Tq padded] for row blocks), the forward / dq and the dk/dv visit lists,
    their run-time counts (int32 scalars), an overflow status [1], and for the fused backward each dk/dv visit's dq
    slot and each query block's filled slots (else placeholders). static_counts: (forward, dk/dv) visit counts as
    ints when the lists are constants (numpy), else None (the grids take the run-time counts). dq_slots: the fused
    backward's slots per query block (the most key blocks one needs; slot_bound when traced), 0 when unfused.
    forward_list: whether the forward walks this plan's query-ordered list (its DIAGONAL flags are then set; the dq
    kernel ignores them). The dk/dv list's are set where the fused dk/dv kernel computes them
    (backward.diagonal_chunk)."""
    g = geometry
    needed, full = schedule.block_pairs(lo, hi, block_q=g.block_q, block_kv=g.block_kv, kv_rows=g.kv_rows, xp=xp)
    diagonal = None
    if forward_list and forward.diagonal_chunk(g, chip.current_tpu_info()):
        diagonal = schedule.diagonal_pairs(lo, hi, block_q=g.block_q, block_kv=g.block_kv, kv_rows=g.kv_rows, xp=xp)
    q_visits, q_count = schedule.visits(needed, full, by="q", size=size, diagonal=diagonal, xp=xp)
    kv_diagonal = None
    if backward.diagonal_chunk(g, fused):
        kv_diagonal = diagonal
        if kv_diagonal is None:
            kv_diagonal = schedule.diagonal_pairs(
                lo, hi, block_q=g.block_q, block_kv=g.block_kv, kv_rows=g.kv_rows, xp=xp
            )
    kv_visits, kv_count = schedule.visits(needed, full, by="kv", size=size, diagonal=kv_diagonal, xp=xp)
    pad = g.num_q_blocks * g.block_q - g.q_rows
    lo = xp.concatenate([lo, xp.full((pad,), schedule.EMPTY_LO, xp.int32)])
    hi = xp.concatenate([hi, xp.full((pad,), schedule.EMPTY_HI, xp.int32)])
    dq_slots, visit_slots, filled = 0, xp.zeros((1,), xp.int32), xp.zeros((1,), xp.int32)
    if fused:
        dq_slots = max(int(needed.sum(axis=1).max()), 1) if xp is np else slot_bound
        visit_slots, filled = schedule.dq_slots(needed, kv_visits, slots=dq_slots, xp=xp)
    if xp is np:
        static_counts = (int(q_count), int(kv_count))
        status = np.zeros((1,), np.int32)
    else:
        static_counts = None
        # a list longer than its static size was cut short: the kernels then write NaN (never a silent result)
        overflow = (q_count > size) | (kv_count > size)
        if fused:
            overflow |= filled.max() > dq_slots
            filled = jnp.minimum(filled, dq_slots)  # the sum of the slots reads none past the buffer (NaN follows)
        status = overflow.astype(jnp.int32).reshape(1)
    arrays = (
        xp.stack([lo, hi], axis=1),
        xp.stack([lo, hi], axis=0),
        q_visits,
        kv_visits,
        xp.minimum(q_count, q_visits.shape[0]).astype(xp.int32),
        xp.minimum(kv_count, kv_visits.shape[0]).astype(xp.int32),
        status,
        visit_slots,
        filled,
    )
    return tuple(jnp.asarray(a) for a in arrays), static_counts, dq_slots


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(setup, with_lse, static_counts, dq_slots, q3d, k3d, v3d, sinks, plans):
    return _attention_fwd(setup, with_lse, static_counts, dq_slots, q3d, k3d, v3d, sinks, plans)[0]


def _attention_fwd(setup, with_lse, static_counts, dq_slots, q3d, k3d, v3d, sinks, plans):
    """plans, static_counts: the forward's and the backward's (_plan at each direction's geometry)."""
    g = setup.forward
    qinfo, _, q_visits, _, q_count, _, status, _, _ = plans[0]
    count = q_count if static_counts[0] is None else static_counts[0][0]
    if setup.band_reach is not None:
        out, lse = band.band_forward(
            q3d,
            k3d,
            v3d,
            qinfo,
            sinks,
            geometry=g,
            reach=setup.band_reach,
            with_lse=True,
            vmem_limit_bytes=setup.vmem_limit,
        )
    else:
        out, lse = forward.forward(
            q3d,
            k3d,
            v3d,
            qinfo,
            q_visits,
            count,
            status,
            sinks,
            geometry=g,
            with_lse=True,
            vmem_limit_bytes=setup.vmem_limit,
        )
    result = (out, lse) if with_lse else (out, None)
    # the dk/dv kernel streams q with heads merged into lanes; merged here (an XLA relayout where the forward took q
    # as it lies), which inference, not differentiating, never runs. k and v are saved as they lie (the backward
    # merges them, or its dk/dv kernel takes them so where the forward does). out is saved in the layout the backward
    # reads it in: as it lies where the fused backward's delta kernel takes it so (backward.backward), else merged.
    # Both and lse are per row, whatever the backward's blocks; where the backward takes another count of kv heads a
    # step, it regroups lse and merges out itself (_regrouped, backward.backward), so its figure counts them.
    q2d = q3d.reshape(g.q_rows, g.q_heads * g.head_dim)
    if not (dq_slots > 0 and forward.heads_in_place(g)):
        out = out.reshape(g.q_rows, g.q_heads * g.v_head_dim)
    return result, (q2d, k3d, v3d, sinks, plans[1], out, lse)


def _regrouped(stat, geometry: Geometry):
    """A per-row statistic [head groups, Tq, heads per step] (the lse, or its cotangent) in `geometry`'s head groups:
    the forward's where the backward takes another count of kv heads a step (head h is group h // heads per step,
    place h % heads per step in both)."""
    if stat is None or stat.shape[0] == geometry.head_groups:
        return stat
    by_head = stat.transpose(1, 0, 2).reshape(stat.shape[1], geometry.q_heads)
    return by_head.reshape(stat.shape[1], geometry.head_groups, geometry.heads_per_step).transpose(1, 0, 2)


def _attention_bwd(setup, with_lse, static_counts, dq_slots, residuals, cotangents):
    q2d, k3d, v3d, sinks, plan, out, lse = residuals
    d_out, d_lse = cotangents
    g = setup.backward
    lse, d_lse = _regrouped(lse, g), _regrouped(d_lse, g)
    d_out = d_out.reshape(g.q_rows, g.q_heads, g.v_head_dim)
    dq, dk, dv, dsinks = backward.backward(
        q2d,
        k3d,
        v3d,
        sinks,
        out,
        lse,
        d_out,
        d_lse if with_lse else None,
        plan,
        static_counts[1],
        geometry=g,
        vmem_limit_bytes=setup.vmem_limit,
        dq_slots=dq_slots,
    )
    plans_cotangents = (tuple(None for _ in plan),) * 2  # the forward's plan has the backward's structure
    if static_counts[1] is None:
        # Lists built at run time may overflow (cu_seqlens past max_seqlen): the kernels then stay inside their
        # buffers, but a query block whose last visit was cut is never finalized, so every gradient is made NaN here
        # (status is the overflow flag, plan's 7th array; one select a gradient, on traced metadata only).
        overflow = plan[6][0] != 0
        dq, dk, dv = (jnp.where(overflow, jnp.nan, x) for x in (dq, dk, dv))
        dsinks = None if dsinks is None else jnp.where(overflow, jnp.nan, dsinks)
    dq = dq.reshape(g.q_rows, g.q_heads, g.head_dim)
    dk = dk.reshape(g.kv_rows, g.kv_heads, g.head_dim)
    dv = dv.reshape(g.kv_rows, g.kv_heads, g.v_head_dim)
    return dq, dk, dv, cotangent_like(dsinks, sinks), plans_cotangents


_attention.defvjp(_attention_fwd, _attention_bwd)


def _call(q3d, k3d, v3d, sinks, lo, hi, xp, sizes, *, setup, with_lse, slot_bound=None):
    """q3d [Tq, Hq, D], k3d [Tk, Hkv, D], v3d [Tk, Hkv, Dv] -> out [Tq, Hq, Dv], lse [Hq, Tq] or None. sizes: the
    (forward, backward) visit lists' static sizes (None, None for constant lists)."""
    g = setup.forward
    if setup.small_window and xp is np:
        setup = dataclasses.replace(setup, band_reach=band.band_reach(lo, hi, g.q_rows, g.kv_rows))
    compute_dtype = jnp.float32 if q3d.dtype == jnp.float16 else q3d.dtype  # float16 runs as float32 on TPU
    q = q3d.astype(compute_dtype)
    k = k3d.astype(compute_dtype)
    v = v3d.astype(compute_dtype)
    sinks32 = None if sinks is None else sinks.astype(jnp.float32)
    backward_plan, backward_counts, dq_slots = _plan(
        setup.backward,
        lo,
        hi,
        xp,
        sizes[1],
        fused=setup.fused,
        slot_bound=slot_bound,
        forward_list=setup.forward == setup.backward,
    )
    if setup.forward == setup.backward or setup.band_reach is not None:
        # the band forward reads only the row ranges, which the backward's plan holds: no visit list of its own
        forward_plan, forward_counts = backward_plan, backward_counts
    else:
        forward_plan, forward_counts, _ = _plan(g, lo, hi, xp, sizes[0], fused=False)
    out, lse = _attention(
        setup,
        with_lse,
        (forward_counts, backward_counts),
        dq_slots,
        q,
        k,
        v,
        sinks32,
        (forward_plan, backward_plan),
    )
    out = out.astype(q3d.dtype)
    if with_lse:
        lse = lse.transpose(0, 2, 1).reshape(g.q_heads, g.q_rows)
    return out, lse


def _empty_result(q_rows, hq, dv, dtype, sinks, with_lse, q_dtype):
    out = jnp.zeros((q_rows, hq, dv), q_dtype)
    lse = None
    if with_lse:
        fill = jnp.full((hq, 1), jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32)[:, None]
        lse = jnp.broadcast_to(fill, (hq, q_rows))
    return out, lse


@interpret_eager_cpu_calls
def flash_attention(
    q,
    k,
    v,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks=None,
    return_lse: bool = False,
    blocks: FlashAttentionBlocks | None = None,
):
    """Attention over a batch of equal-length sequences, flash-attn 2's `flash_attn_func` semantics.

    q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] (Hq a multiple of Hkv: GQA / MQA, K/V not repeated);
    float32, bfloat16 or float16 (run as float32). softmax_scale: None for D ** -0.5. causal: bottom-right aligned
    when Sq != Sk. window_size (left, right): keys i + Sk - Sq - left .. i + Sk - Sq + right, -1 unbounded. softcap:
    > 0 for softcap * tanh(scores / softcap). sinks: None or [Hq] logits that join each row's softmax (gpt-oss).
    -> out [B, Sq, Hq, Dv] in q's dtype, and with return_lse the softmax log-sum-exp [B, Hq, Sq] float32 (+inf for
    a row that sees no key). Differentiable in q, k, v and sinks.
    """
    dtype, hq, hkv, d, dv = checks.check_qkv(q, k, v, 4)
    scale, causal, window, softcap = checks.check_options(softmax_scale, causal, window_size, softcap, d)
    sinks = checks.check_sinks(sinks, hq)
    return_lse = checks.check_bool("return_lse", return_lse)
    tuning.check_blocks_type(blocks)
    batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if batch * sq == 0 or batch * sk == 0:
        out, lse = _empty_result(batch * sq, hq, dv, dtype, sinks, return_lse, q.dtype)
    else:
        setup_for, d_run, dv_run = _planner(
            (dtype, hq, hkv, d, dv),
            (scale, causal, window, softcap),
            q_rows=max(batch * sq, MIN_ROWS),
            kv_rows=max(batch * sk, MIN_ROWS),
            sequence_rows=(sq, sk),  # no table block spans two sequences (tuning.sequence_block_cap)
        )
        setup = setup_for(blocks)
        cu_q, cu_k = np.arange(batch + 1) * sq, np.arange(batch + 1) * sk
        rows = max(batch * sq, MIN_ROWS)  # rows past batch * sq (MIN_ROWS' padding) see no key
        lo, hi = schedule.key_ranges(cu_q, cu_k, rows, causal=causal, window_size=window, xp=np)

        def slots_of(setup):
            g = setup.backward
            needed, _ = schedule.block_pairs(lo, hi, block_q=g.block_q, block_kv=g.block_kv, kv_rows=g.kv_rows, xp=np)
            return int(needed.sum(axis=1).max())

        if setup.fused:
            setup = _choose_backward(blocks, setup_for, setup, slots_of, rows * hq * d_run * 4)
        out, lse = _call(
            _padded(q.reshape(batch * sq, hq, d), rows=MIN_ROWS, width=d_run),
            _padded(k.reshape(batch * sk, hkv, d), rows=MIN_ROWS, width=d_run),
            _padded(v.reshape(batch * sk, hkv, dv), rows=MIN_ROWS, width=dv_run),
            sinks,
            lo,
            hi,
            np,
            (None, None),
            setup=setup,
            with_lse=return_lse,
        )
        out, lse = out[: batch * sq, :, :dv], None if lse is None else lse[:, : batch * sq]
    out = out.reshape(batch, sq, hq, dv)
    if not return_lse:
        return out
    return out, lse.reshape(hq, batch, sq).transpose(1, 0, 2)


@interpret_eager_cpu_calls
def flash_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks=None,
    return_lse: bool = False,
    blocks: FlashAttentionBlocks | None = None,
):
    """Attention over packed sequences of different lengths, flash-attn 2's `flash_attn_varlen_func` semantics.

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]; sequence s is query rows cu_seqlens_q[s]:cu_seqlens_q[s + 1]
    and key rows cu_seqlens_k[s]:cu_seqlens_k[s + 1] (int32 [N + 1], from 0 to the token count, non-decreasing;
    empty sequences allowed). max_seqlen_q / max_seqlen_k: Python ints, at least every sequence's length (they size
    the visit list; concrete cu_seqlens are checked against them; traced ones that exceed them give, forward and
    backward, every output NaN where a visit list overflows its static size, else the right result: never a wrong
    one, and no kernel reads or writes outside its buffers). Other arguments as flash_attention. -> out [Tq, Hq, Dv]
    (and lse [Hq, Tq] float32).
    """
    dtype, hq, hkv, d, dv = checks.check_qkv(q, k, v, 3)
    scale, causal, window, softcap = checks.check_options(softmax_scale, causal, window_size, softcap, d)
    sinks = checks.check_sinks(sinks, hq)
    return_lse = checks.check_bool("return_lse", return_lse)
    tuning.check_blocks_type(blocks)
    q_rows, kv_rows = q.shape[0], k.shape[0]
    actual_q = checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q_rows)
    actual_k = checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, kv_rows)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            f"cu_seqlens_k: expected the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)} (one entry per sequence "
            f"+ 1), got {tuple(cu_seqlens_k.shape)}"
        )
    max_q = checks.check_max_seqlen("max_seqlen_q", max_seqlen_q, actual_q)
    max_k = checks.check_max_seqlen("max_seqlen_k", max_seqlen_k, actual_k)
    if q_rows == 0 or kv_rows == 0:
        return _finish_varlen(*_empty_result(q_rows, hq, dv, dtype, sinks, return_lse, q.dtype), return_lse)
    given_q_rows, q_rows, kv_rows = q_rows, max(q_rows, MIN_ROWS), max(kv_rows, MIN_ROWS)
    # a packed batch: the table's blocks are capped by its longest sequence (tuning.packed_block_cap)
    setup_for, d_run, dv_run = _planner(
        (dtype, hq, hkv, d, dv),
        (scale, causal, window, softcap),
        q_rows=q_rows,
        kv_rows=kv_rows,
        longest_sequence=max(max_q, max_k),
    )
    num_seqs = cu_seqlens_q.shape[0] - 1

    def bounds(g):
        """(visits, dq slots): the list size and slot bound at a direction's blocks (schedule.visit_bound)."""
        size, slot_bound = schedule.visit_bound(
            g.num_q_blocks,
            g.num_kv_blocks,
            num_seqs=num_seqs,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            block_q=g.block_q,
            block_kv=g.block_kv,
            window_size=window,
            causal=causal,
        )
        if size > MAX_VISITS:
            raise ValueError(
                f"blocks: these sequences may need up to {size} (query block, key block) visits, more than the "
                f"{MAX_VISITS} the kernels keep in SMEM; use larger blocks"
            )
        return size, slot_bound

    setup = setup_for(blocks)
    forward_size, _ = bounds(setup.forward)
    backward_size, slot_bound = bounds(setup.backward)
    if setup.fused:
        setup = _choose_backward(
            blocks, setup_for, setup, lambda setup: bounds(setup.backward)[1], q_rows * hq * d_run * 4
        )
        # the chosen backward's blocks may differ (tuning.LONG_BACKWARD_TABLE, UNFUSED_BACKWARD_TABLE)
        backward_size, slot_bound = bounds(setup.backward)
    lo, hi = schedule.key_ranges(cu_seqlens_q, cu_seqlens_k, q_rows, causal=causal, window_size=window)
    out, lse = _call(
        _padded(q, rows=MIN_ROWS, width=d_run),
        _padded(k, rows=MIN_ROWS, width=d_run),
        _padded(v, rows=MIN_ROWS, width=dv_run),
        sinks,
        lo,
        hi,
        jnp,
        (forward_size, backward_size),
        setup=setup,
        with_lse=return_lse,
        slot_bound=slot_bound,
    )
    out, lse = out[:given_q_rows, :, :dv], None if lse is None else lse[:, :given_q_rows]
    return _finish_varlen(out, lse, return_lse)


def _finish_varlen(out, lse, return_lse):
    return (out, lse) if return_lse else out
