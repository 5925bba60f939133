"""Which (query block, key block) pairs the paged attention kernel visits, built on the device from the ragged batch's
metadata (kv_lens, cu_q_lens, num_seqs are run-time values: one compiled program serves every batch composition).

Query rows are cut into blocks of `block_q` tokens over the packed batch, so a block may hold rows of several
sequences (many one-token decodes share a block). Keys live in a virtual space where sequence s owns rows
[s * max_context, (s + 1) * max_context), max_context = pages_per_seq * page_size; a key block is `block_kv`
consecutive context positions of one sequence (pages_per_block whole pages). A query row of sequence s sees the
virtual keys [lo, hi] (its own context, cut by causality and the window), exactly as the flash attention kernels'
row ranges; rows of other sequences have disjoint ranges, so one mask serves mixed blocks.

A (query block, sequence) pair is a sequence with rows in the block; each pair visits the key blocks its rows need
(a contiguous run: lo and hi grow with the row within a sequence). Per visit, three int32 words for SMEM:
- `words`: the query block, and the flags FIRST / LAST (the block's first / last visit: initialise / finalise),
  COMPUTE (some key is kept) and MASKED (some score of the pair is masked; else the kernel skips the mask);
- `kv_blocks`: sequence * blocks_per_seq + key block within the sequence;
- `rows`: the block's key rows to fetch, first | end << 16 (whole pages from the first needed one; `end` stops at
  the context's length, so rows past it are zeroed in V, never read as values).
A query block with no row to compute (padding past the last sequence) gets one visit that only writes zeros.
"""

import jax
import jax.numpy as jnp

EMPTY_LO = 2**30
EMPTY_HI = -1

FIRST = 1 << 26
LAST = 1 << 27
COMPUTE = 1 << 28
MASKED = 1 << 29
QUERY_BLOCK_MASK = (1 << 26) - 1
ROW_BITS = 16
ROW_MASK = (1 << ROW_BITS) - 1


def effective_metadata(kv_lens, cu_q_lens, num_seqs, *, tokens: int, max_context: int):
    """kv_lens and cu_q_lens with sequences >= num_seqs emptied, and every value clamped into range, so that
    device metadata that breaks the contract can never address memory outside q, the pages or the visit lists."""
    n = kv_lens.shape[0]
    live = jnp.arange(n) < num_seqs
    kv_lens = jnp.where(live, jnp.clip(kv_lens, 0, max_context), 0).astype(jnp.int32)
    cu = jax.lax.cummax(jnp.clip(cu_q_lens.astype(jnp.int32), 0, tokens), axis=0)  # non-decreasing, in [0, tokens]
    cu = jnp.where(jnp.arange(n + 1) <= num_seqs, cu, cu[jnp.minimum(num_seqs, n)])
    return kv_lens, cu


def token_ranges(kv_lens, cu_q, *, tokens: int, max_context: int, causal: bool, window_size: tuple[int, int]):
    """Per query token: (seq, lo, hi) int32 [tokens]; lo / hi the virtual key rows it sees (EMPTY_LO / EMPTY_HI for a
    padding row or a row that sees nothing)."""
    left, right = window_size
    if causal:
        right = 0
    n = kv_lens.shape[0]
    t = jnp.arange(tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q, t, side="right").astype(jnp.int32) - 1, 0, n - 1)
    q_start, q_end = cu_q[seq], cu_q[seq + 1]
    kv_len = kv_lens[seq]
    position = kv_len - (q_end - q_start) + (t - q_start)  # the query's own position in its context
    lo = jnp.maximum(position - left, 0) if left >= 0 else jnp.zeros_like(t)
    hi = jnp.minimum(position + right, kv_len - 1) if right >= 0 else kv_len - 1
    empty = (t < q_start) | (t >= q_end) | (lo > hi)
    base = seq * max_context
    return seq, jnp.where(empty, EMPTY_LO, base + lo), jnp.where(empty, EMPTY_HI, base + hi)


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
) -> int:
    """At most how many visits a call can need. A (query block, sequence) pair holds at least one query row, so there
    are at most min(query blocks + sequences, tokens) pairs, each visiting at most the key blocks of a whole context (or
    those its window spans); a query block without rows adds one visit."""
    left, right = window_size
    if causal:
        right = 0
    per_pair = blocks_per_seq
    if left >= 0 and right >= 0:
        per_pair = min(per_pair, -(-(block_q + left + right) // block_kv) + 1)
    return max(1, min(num_q_blocks + num_seqs, tokens) * per_pair + num_q_blocks)


def visits(
    kv_lens,
    cu_q,
    *,
    tokens: int,
    block_q: int,
    page_size: int,
    pages_per_block: int,
    blocks_per_seq: int,
    max_context: int,
    causal: bool,
    window_size: tuple[int, int],
    size: int,
):
    """(words, kv_blocks, rows, count, lo, hi): the visit lists ([size] int32 each; `size` from visit_bound, which no
    batch can exceed once the metadata is clamped), the number of visits (int32 [1]) and the token ranges."""
    n = kv_lens.shape[0]
    block_kv = page_size * pages_per_block
    nq = -(-tokens // block_q)
    seq, lo, hi = token_ranges(
        kv_lens, cu_q, tokens=tokens, max_context=max_context, causal=causal, window_size=window_size
    )
    total = cu_q[n]

    # ---- pairs: per query block, the sequences whose rows it holds (a run from the first row's to the last row's)
    block = jnp.arange(nq, dtype=jnp.int32)
    first_row = block * block_q
    last_row = jnp.minimum(first_row + block_q, total) - 1
    has_rows = first_row < total
    seq_first = seq[jnp.clip(first_row, 0, tokens - 1)]
    seq_last = seq[jnp.clip(last_row, 0, tokens - 1)]
    pairs_per_block = jnp.where(has_rows, seq_last - seq_first + 1, 1)
    pair_end = jnp.cumsum(pairs_per_block)
    max_pairs = nq + n
    p = jnp.arange(max_pairs, dtype=jnp.int32)
    p_block = jnp.minimum(jnp.searchsorted(pair_end, p, side="right").astype(jnp.int32), nq - 1)
    p_live = p < pair_end[-1]
    p_seq = jnp.clip(seq_first[p_block] + p - (pair_end[p_block] - pairs_per_block[p_block]), 0, n - 1)
    r0 = jnp.maximum(p_block * block_q, cu_q[p_seq])
    r1 = jnp.minimum(jnp.minimum((p_block + 1) * block_q, cu_q[p_seq + 1]), total)
    p_rows = p_live & has_rows[p_block] & (r1 > r0)
    base = p_seq * max_context
    at0, at1 = jnp.clip(r0, 0, tokens - 1), jnp.clip(r1 - 1, 0, tokens - 1)
    lo_min, hi_min = lo[at0] - base, hi[at0] - base  # lo and hi grow with the row within a sequence
    lo_max, hi_max = lo[at1] - base, hi[at1] - base
    p_compute = p_rows & (lo_min <= hi_max) & (hi[at0] >= 0) & (lo[at1] < EMPTY_LO)
    first_b = jnp.where(p_compute, lo_min // block_kv, 0)
    last_b = jnp.where(p_compute, hi_max // block_kv, 0)
    p_visits = jnp.where(p_compute, last_b - first_b + 1, 0)
    # a query block with nothing to compute keeps one visit (on its first pair) that writes its zeros
    block_visits = jnp.zeros((nq,), jnp.int32).at[p_block].add(jnp.where(p_live, p_visits, 0))
    first_pair = p_live & (p == pair_end[p_block] - pairs_per_block[p_block])
    p_visits = p_visits + (first_pair & (block_visits[p_block] == 0)).astype(jnp.int32)
    whole_block = (r0 == p_block * block_q) & (r1 == (p_block + 1) * block_q)

    # ---- visits: the pairs' key blocks, pair after pair
    visit_end = jnp.cumsum(p_visits)
    count = visit_end[-1]
    v = jnp.arange(size, dtype=jnp.int32)
    live = v < count
    vp = jnp.minimum(
        jnp.searchsorted(visit_end, jnp.minimum(v, count - 1), side="right").astype(jnp.int32), max_pairs - 1
    )
    kv_block = first_b[vp] + v - (visit_end[vp] - p_visits[vp])
    kv_block = jnp.clip(kv_block, 0, blocks_per_seq - 1)
    q_block = p_block[vp]
    compute = live & p_compute[vp]
    start = kv_block * block_kv
    need_lo = jnp.maximum(lo_min[vp], start) - start
    need_hi = jnp.minimum(hi_max[vp], start + block_kv - 1) - start
    first_fetch = jnp.where(compute, (need_lo // page_size) * page_size, 0)
    end_fetch = jnp.minimum((need_hi // page_size + 1) * page_size, kv_lens[p_seq[vp]] - start)
    end_fetch = jnp.where(compute, jnp.clip(end_fetch, first_fetch, block_kv), 0)
    full = compute & whole_block[vp] & (lo_max[vp] <= start) & (hi_min[vp] >= start + block_kv - 1) & (first_fetch == 0)
    prev_q = jnp.concatenate([jnp.full((1,), -1, jnp.int32), q_block[:-1]])
    next_q = jnp.concatenate([q_block[1:], jnp.full((1,), -1, jnp.int32)])
    first = live & (q_block != prev_q)
    last = live & ((q_block != next_q) | (v == count - 1))
    words = (
        q_block
        | jnp.where(first, FIRST, 0)
        | jnp.where(last, LAST, 0)
        | jnp.where(compute, COMPUTE, 0)
        | jnp.where(compute & ~full, MASKED, 0)
    ).astype(jnp.int32)
    kv_blocks = (p_seq[vp] * blocks_per_seq + kv_block).astype(jnp.int32)
    rows = (first_fetch | (end_fetch << ROW_BITS)).astype(jnp.int32)
    return words, kv_blocks, rows, jnp.minimum(count, size).astype(jnp.int32).reshape(1), lo, hi
