"""Which (query block, key block) pairs the paged attention kernel visits, built on the device from the ragged batch's
metadata by a small scalar Pallas kernel (kv_lens, cu_q_lens, num_seqs are run-time values: one compiled program serves
every batch composition, and the lists cost one kernel launch rather than dozens of XLA ops).

Query rows are cut into blocks of `block_q` tokens over the packed batch, so a block may hold rows of several
sequences (many one-token decodes share a block). A key block is `block_kv` consecutive context positions of one
sequence (pages_per_block whole pages). A query row of sequence s at context position `pos` sees the keys [lo, hi] of
its own sequence: lo = max(pos - left, 0) (0 without a left window), hi = min(pos + right, kv_len - 1) (kv_len - 1
without a right window; right = 0 when causal).

A (query block, sequence) pair is a sequence with rows in the block; each pair visits the key blocks its rows need
(a contiguous run: lo and hi grow with the row within a sequence). Per visit, three int32 words for SMEM:
- `words`: the query block, and the flags FIRST / LAST (the block's first / last visit: initialise / finalise),
  COMPUTE (some key is kept) and MASKED (some key of the block is hidden from some row of the sequence; else the
  kernel skips the per-score mask and keeps the sequence's rows by a per-row select of their statistics);
- `kv_blocks`: sequence * blocks_per_seq + key block within the sequence;
- `rows`: the block's key rows to fetch, first | end << 16 (whole pages from the first needed one; `end` stops at
  the context's length, so rows past it are zeroed in V, never read as values).
A query block with no row to compute (padding past the last sequence) gets one visit that only writes zeros.

A grid step of the attention kernel takes `parts` consecutive visits (1 or 2): a query block's visits are grouped in
steps, its last step filled up with visits that compute and fetch nothing, so a step's visits are one query block's
(at decode, the 2 sequences of a block of 2 tokens in one step). FIRST is on a block's first visit (a step's first),
LAST on its last (a step's last); the count is the grid's steps.

The builder also returns the metadata it used, clamped so that device metadata that breaks the contract can never
address memory outside q, the pages or the lists: lengths within the page table, sequences past num_seqs emptied,
offsets non-decreasing and within the tokens. The attention kernel masks from these (its rows' ranges follow from a
visit's sequence), so nothing per row is built outside the kernels.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.index_math import div_nonnegative as _div
from ..common.manual_axes import out_struct

FIRST = 1 << 26
LAST = 1 << 27
COMPUTE = 1 << 28
MASKED = 1 << 29
QUERY_BLOCK_MASK = (1 << 26) - 1
ROW_BITS = 16
ROW_MASK = (1 << ROW_BITS) - 1


def visit_bound(
    *,
    tokens: int,
    num_q_blocks: int,
    num_seqs: int,
    block_q: int,
    block_kv: int,
    blocks_per_seq: int,
    window_size,
    causal: bool,
    parts: int = 1,
) -> int:
    """At most how many visits a call can need (list entries: whole steps of `parts` visits). A (query block, sequence)
    pair holds at least one query row, so there are at most min(query blocks + sequences, tokens) pairs, each visiting
    at most the key blocks of a whole context (or those its window spans); a query block without rows adds one visit,
    and each query block's last step at most parts - 1 empty ones."""
    left, right = window_size
    if causal:
        right = 0
    per_pair = blocks_per_seq
    if left >= 0 and right >= 0:
        per_pair = min(per_pair, -(-(block_q + left + right) // block_kv) + 1)
    entries = max(1, min(num_q_blocks + num_seqs, tokens) * per_pair + num_q_blocks) + (parts - 1) * num_q_blocks
    return -(-entries // parts) * parts


def _builder(
    kv_in,
    cu_in,
    num_in,
    words_ref,
    kv_blocks_ref,
    rows_ref,
    count_ref,
    kv_ref,
    cu_ref,
    *,
    tokens: int,
    padded: int,
    block_q: int,
    page_size: int,
    block_kv: int,
    blocks_per_seq: int,
    max_context: int,
    left: int,
    right: int,
    parts: int,
):
    n = kv_in.shape[0]
    size = words_ref.shape[0]
    num = jnp.clip(num_in[0], 0, n)

    # ---- the clamped metadata, one loop: offsets a running max of the clamped ones, frozen past num_seqs; lengths
    # within the page table, 0 past num_seqs
    def clamp(s, run):
        run = jnp.where(s + 1 <= num, jnp.maximum(run, jnp.clip(cu_in[s + 1], 0, tokens)), run)
        cu_ref[s + 1] = run
        kv_ref[s] = jnp.where(s < num, jnp.clip(kv_in[s], 0, max_context), 0)
        return run

    first = jnp.clip(cu_in[0], 0, tokens)
    cu_ref[0] = first
    jax.lax.fori_loop(0, n, clamp, first)
    total = cu_ref[n]

    def seq_of(s, t):
        """The last sequence (from s on, at most n - 1) whose rows start at or before row t."""
        return jax.lax.while_loop(lambda s: (s + 1 < n) & (cu_ref[jnp.minimum(s + 1, n)] <= t), lambda s: s + 1, s)

    def put(v, word, kv_block, rows):
        @pl.when(v < size)
        def _():
            at = jnp.minimum(v, size - 1)
            words_ref[at] = word
            kv_blocks_ref[at] = kv_block
            rows_ref[at] = rows

    def lo_hi(pos, kv_len):
        lo = jnp.maximum(pos - left, 0) if left >= 0 else jnp.int32(0)
        hi = jnp.minimum(pos + right, kv_len - 1) if right >= 0 else kv_len - 1
        return lo, hi

    def query_block(qb, carry):
        s_start, v = carry
        first_row = qb * block_q
        block_end = jnp.minimum(first_row + block_q, total)
        has_rows = first_row < total
        s_first = seq_of(s_start, first_row)
        block_v = v

        def pair(s, v):
            q_start, q_end, kv_len = cu_ref[s], cu_ref[s + 1], kv_ref[s]
            r0 = jnp.maximum(first_row, q_start)
            r1 = jnp.minimum(jnp.minimum(first_row + block_q, q_end), total)
            lo0, hi0 = lo_hi(r0 + kv_len - q_end, kv_len)  # the pair's first row (its position in the context)
            lo1, hi1 = lo_hi(r1 - 1 + kv_len - q_end, kv_len)  # and last row: lo and hi grow with the row
            compute = has_rows & (r1 > r0) & (lo0 <= hi0) & (lo1 <= hi1) & (lo0 <= hi1)
            first_b = _div(jnp.maximum(lo0, 0), block_kv)
            visits = jnp.where(compute, _div(jnp.maximum(hi1, 0), block_kv) - first_b + 1, 0)

            def visit(j, v):
                kv_block = jnp.minimum(first_b + j, blocks_per_seq - 1)
                start = kv_block * block_kv
                need_lo = jnp.maximum(lo0, start) - start
                need_hi = jnp.minimum(hi1, start + block_kv - 1) - start
                first = _div(need_lo, page_size) * page_size
                end = jnp.minimum((_div(need_hi, page_size) + 1) * page_size, kv_len - start)
                end = jnp.clip(end, first, block_kv)
                full = (lo1 <= start) & (hi0 >= start + block_kv - 1) & (first == 0)
                word = qb | COMPUTE | jnp.where(full, 0, MASKED) | jnp.where(v == block_v, FIRST, 0)
                put(v, word, s * blocks_per_seq + kv_block, first | (end << ROW_BITS))
                return v + 1

            return jax.lax.fori_loop(0, visits, visit, v)

        def more(carry):  # the block's sequences: from s_first, those whose rows start before the block's end
            s, _ = carry
            return (s < n) & (cu_ref[jnp.minimum(s, n)] < block_end)

        s_end, v = jax.lax.while_loop(more, lambda carry: (carry[0] + 1, pair(*carry)), (s_first, v))

        # a query block with nothing to compute keeps one visit that writes its zeros; its last step is filled up with
        # visits that compute nothing (the next block's start on a step of its own); the block's last visit: LAST
        @pl.when(v == block_v)
        def _():
            put(v, qb | FIRST, s_first * blocks_per_seq, 0)

        v = jnp.maximum(v, block_v + 1)
        if parts > 1:
            end = _div(v + parts - 1, parts) * parts
            for k in range(parts - 1):
                pl.when(v + k < end)(lambda k=k: put(v + k, qb, s_first * blocks_per_seq, 0))
            v = end

        @pl.when(v <= size)
        def _():
            at = jnp.clip(v - 1, 0, size - 1)
            words_ref[at] = words_ref[at] | LAST

        return jnp.maximum(s_end - 1, s_first), v  # the block's last sequence may go on in the next block

    _, count = jax.lax.fori_loop(0, -(-padded // block_q), query_block, (jnp.int32(0), jnp.int32(0)))
    count_ref[0] = _div(jnp.minimum(count, size), parts)  # grid steps
    count_ref[1] = (count > size).astype(jnp.int32)  # cannot happen under visit_bound: the lists would be cut


def visits(
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    tokens: int,
    padded: int,
    block_q: int,
    page_size: int,
    pages_per_block: int,
    blocks_per_seq: int,
    max_context: int,
    causal: bool,
    window_size: tuple[int, int],
    size: int,
    parts: int = 1,
):
    """(words, kv_blocks, rows, count, kv_lens, cu_q_lens): the visit lists ([size] int32 each; `size` from
    visit_bound, which no batch can exceed once the metadata is clamped), int32 [2] (the number of grid steps, each
    `parts` consecutive visits of one query block, and 1 if the lists overflowed `size`), and the clamped metadata
    (int32 [N], [N + 1]) the lists were built from.
    kv_lens int32 [N], cu_q_lens int32 [N + 1], num_seqs int32 [1]; tokens: the real query tokens, padded: tokens
    rounded up to whole query blocks."""
    left, right = window_size
    if causal:
        right = 0
    n = kv_lens.shape[0]
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    i32 = jnp.int32
    kernel = functools.partial(
        _builder,
        tokens=tokens,
        padded=padded,
        block_q=block_q,
        page_size=page_size,
        block_kv=page_size * pages_per_block,
        blocks_per_seq=blocks_per_seq,
        max_context=max_context,
        left=left,
        right=right,
        parts=parts,
    )
    operands = (kv_lens.astype(i32), cu_q_lens.astype(i32), jnp.asarray(num_seqs, i32).reshape(1))
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_struct(shape, i32, operands) for shape in ((size,),) * 3 + ((2,), (n,), (n + 1,))),
        in_specs=[smem, smem, smem],
        out_specs=(smem, smem, smem, smem, smem, smem),
        name="paged_attention_visits",
    )(*operands)
