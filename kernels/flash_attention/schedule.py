"""Which (query block, key block) pairs the attention kernels visit, and which of them need a mask.

Every call is seen as packed sequences: a dense batch [B, S, H, D] is B sequences of S rows (flash_attn_func), a
varlen batch is its cu_seqlens (flash_attn_varlen_func). Sequence s holds query rows cu_q[s]:cu_q[s+1] and key rows
cu_k[s]:cu_k[s+1], so the keys one query row may see (its own sequence's, cut by causality and the window) are one
contiguous range of packed key rows, [lo, hi]. The kernels need nothing else to mask: a score is kept iff
lo <= key row <= hi. A row that may see no key has lo > hi (EMPTY_LO, EMPTY_HI).

From the ranges, per (query block i, key block j): `needed` when some row of block i sees some key of block j, and
`full` when every row of block i sees every key of block j (the kernel then skips the mask). The kernels walk a list
of visits, the needed pairs in row-major order (the forward and the dq kernel) or column-major (the dk/dv kernel),
each packed in one int32 for SMEM: the query block, the key block and flags. A query block that needs no key block
still gets one visit that computes nothing, so that its output (zeros) is written; likewise a key block in the dk/dv
list. The list has a static length (the arrays' size) and a run-time count (the kernels' grid length).

The same code builds the list from numpy arrays at trace time (dense batches: shapes are static, so the list is a
constant of the program) and from traced cu_seqlens (varlen).
"""

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

EMPTY_LO = 2**30
EMPTY_HI = -1

# Packed visit word: bits 0-12 query block, 13-25 key block, then the flags.
BLOCK_BITS = 13
MAX_BLOCKS = 1 << BLOCK_BITS
FIRST = 1 << 26  # the first visit of its output block (initialise the accumulators)
LAST = 1 << 27  # the last visit of its output block (finalise and write)
COMPUTE = 1 << 28  # some score of the pair is kept (else the visit only initialises / finalises)
MASKED = 1 << 29  # some score of the pair is masked
# a masked pair whose kept scores are exactly the triangle key - first key <= row - first row (the causal diagonal
# through both blocks' first corner), every row seeing the key block's first key: the forward computes only the
# sub-tiles on and below it (forward.diagonal_chunk)
DIAGONAL = 1 << 30
BLOCK_MASK = MAX_BLOCKS - 1


def run_visit(word, accumulate, diagonal=None):
    """In a kernel body: `accumulate(masked)` for a visit that computes, traced twice (with and without the mask) so
    that wholly kept pairs run no mask code; a visit without COMPUTE runs neither. With `diagonal` given, a DIAGONAL
    visit runs `diagonal()` instead of the masked body (kernels without one ignore the flag: its pairs are MASKED)."""
    compute = (word & COMPUTE) != 0
    masked = (word & MASKED) != 0
    if diagonal is None:
        pl.when(compute & masked)(lambda: accumulate(True))
    else:
        on_diagonal = (word & DIAGONAL) != 0
        pl.when(compute & masked & on_diagonal)(diagonal)
        pl.when(compute & masked & ~on_diagonal)(lambda: accumulate(True))
    pl.when(compute & ~masked)(lambda: accumulate(False))


def unpack(word):
    """(query block, key block) of a visit word."""
    return word & BLOCK_MASK, (word >> BLOCK_BITS) & BLOCK_MASK


def window_keys(*, causal: bool, window_size: tuple[int, int]) -> int | None:
    """The most keys one query row may see under the window (left + right + 1, causal forcing right = 0), None where
    either side is unbounded."""
    left, right = window_size
    if causal:
        right = 0
    return left + right + 1 if left >= 0 and right >= 0 else None


def key_ranges(cu_q, cu_k, rows: int, *, causal: bool, window_size: tuple[int, int], xp=jnp):
    """[rows] int32 lo, hi: the packed key rows query row r may see (rows past cu_q[-1] see none).

    Within sequence s a query at local position p sees local keys [p + off - left, p + off + right] clipped to
    [0, sk - 1], off = sk - sq (bottom-right aligned causal diagonal); causal forces right = 0, -1 is unbounded."""
    left, right = window_size
    if causal:
        right = 0
    cu_q = xp.asarray(cu_q, dtype=xp.int32)
    cu_k = xp.asarray(cu_k, dtype=xp.int32)
    r = xp.arange(rows, dtype=xp.int32)
    # the sequence of each row: the last s with cu_q[s] <= r (empty sequences are skipped over)
    seq = xp.clip(xp.searchsorted(cu_q, r, side="right").astype(xp.int32) - 1, 0, cu_q.shape[0] - 2)
    q_start, q_end = cu_q[seq], cu_q[seq + 1]
    k_start, k_end = cu_k[seq], cu_k[seq + 1]
    diagonal = (r - q_start) + (k_end - k_start) - (q_end - q_start)  # local key position of the diagonal
    lo_local = xp.maximum(diagonal - left, 0) if left >= 0 else xp.zeros_like(r)
    hi_local = xp.minimum(diagonal + right, k_end - k_start - 1) if right >= 0 else k_end - k_start - 1
    empty = (lo_local > hi_local) | (r >= q_end) | (r < q_start)
    lo = xp.where(empty, EMPTY_LO, k_start + lo_local).astype(xp.int32)
    hi = xp.where(empty, EMPTY_HI, k_start + hi_local).astype(xp.int32)
    return lo, hi


def block_pairs(lo, hi, *, block_q: int, block_kv: int, kv_rows: int, xp=jnp):
    """(needed, full): [nq, nk] bool over (query block, key block) pairs, from the rows' key ranges (padded to
    whole query blocks with empty rows)."""
    rows = lo.shape[0]
    nq, nk = -(-rows // block_q), -(-kv_rows // block_kv)
    pad = nq * block_q - rows
    lo = xp.concatenate([lo, xp.full((pad,), EMPTY_LO, xp.int32)]).reshape(nq, block_q)
    hi = xp.concatenate([hi, xp.full((pad,), EMPTY_HI, xp.int32)]).reshape(nq, block_q)
    j = xp.arange(nk, dtype=xp.int32)
    first_block = (lo // block_kv)[:, :, None]
    last_block = (hi // block_kv)[:, :, None]
    needed = xp.any((first_block <= j) & (j <= last_block), axis=1)
    key_start = j * block_kv
    key_end = xp.minimum(key_start + block_kv, kv_rows) - 1
    whole_block = key_start + block_kv <= kv_rows  # a ragged last key block always needs its padding masked
    full = needed & (lo.max(axis=1)[:, None] <= key_start) & (hi.min(axis=1)[:, None] >= key_end) & whole_block
    return needed, full


def diagonal_pairs(lo, hi, *, block_q: int, block_kv: int, kv_rows: int, xp=jnp):
    """[nq, nk] bool: the pairs whose kept scores are exactly key - first key <= row - first row (DIAGONAL), from the
    rows' key ranges: every row of the query block sees the key block's first key, and row r's last kept key in the
    block is the r-th (or the block's last)."""
    rows = lo.shape[0]
    nq, nk = -(-rows // block_q), -(-kv_rows // block_kv)
    pad = nq * block_q - rows
    lo = xp.concatenate([lo, xp.full((pad,), EMPTY_LO, xp.int32)]).reshape(nq, block_q, 1)
    hi = xp.concatenate([hi, xp.full((pad,), EMPTY_HI, xp.int32)]).reshape(nq, block_q, 1)
    key_start = xp.arange(nk, dtype=xp.int32) * block_kv
    key_last = (key_start + block_kv - 1)[None, None, :]
    triangle = xp.minimum(key_start[None, None, :] + xp.arange(block_q, dtype=xp.int32)[None, :, None], key_last)
    exact = (lo <= key_start[None, None, :]) & (xp.minimum(hi, key_last) == triangle)
    whole_block = key_start + block_kv <= kv_rows  # (row 0 sees one key of the block: such a pair is never full)
    return xp.all(exact, axis=1) & whole_block[None, :]


def visit_bound(
    num_q_blocks: int,
    num_kv_blocks: int,
    *,
    num_seqs: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_q: int,
    block_kv: int,
    window_size: tuple[int, int],
    causal: bool,
) -> tuple[int, int]:
    """(visits, dq slots): at most how many visits a varlen call can need, and how many key blocks one query block
    can need (the fused backward's dq slots). Each (query block, sequence) pair that shares rows needs at most the
    key blocks its sequence's keys span (or its window spans), plus one; there are at most num_q_blocks + num_seqs
    such pairs, and at most min(num_seqs, block_q) of them in one query block."""
    left, right = window_size
    if causal:
        right = 0
    per_pair = -(-max(max_seqlen_k, 1) // block_kv) + 1
    if left >= 0 and right >= 0:
        per_pair = min(per_pair, -(-(min(block_q, max(max_seqlen_q, 1)) + left + right) // block_kv) + 1)
    pairs = num_q_blocks + num_seqs
    # + one visit per key block that no query needs (the dk/dv list's zero visits); never more than every pair
    visits = min(num_q_blocks * num_kv_blocks, pairs * per_pair + num_kv_blocks)
    return visits, max(1, min(num_kv_blocks, min(num_seqs, block_q) * per_pair))


def dq_slots(needed, kv_words, *, slots: int, xp=jnp):
    """(slot per visit, filled slots per query block) for the fused backward, which writes each visit's dq
    contribution to its own (slot, query block) block and sums the slots afterwards. A computing visit of (query
    block i, key block j) takes slot r = how many key blocks before j block i needs, so that block i fills slots
    0 .. n_i - 1 (n_i = the key blocks it needs); a visit that computes nothing takes slot `slots`, which is never
    read. kv_words: the dk/dv list (padding included) -> ([len(kv_words)] int32, [num query blocks] int32).

    Traced metadata may need more slots than `slots` (cu_seqlens holding a sequence longer than max_seqlen): a visit
    past the last slot goes to the unread one too, and the filled count is capped at `slots`, so that nothing is
    written or read outside the dq buffer; the caller flags the overflow (filled > slots, before the cap), which makes
    every output NaN."""
    needed = needed.astype(xp.int32)
    rank = xp.cumsum(needed, axis=1) - needed
    q_block, kv_block = unpack(kv_words)
    visit_rank = rank[q_block, kv_block]
    slot = xp.where(((kv_words & COMPUTE) != 0) & (visit_rank < slots), visit_rank, slots)
    return slot.astype(xp.int32), needed.sum(axis=1).astype(xp.int32)


def visits(needed, full, *, by: str, size: int | None = None, diagonal=None, xp=jnp):
    """(words, count): the visit list over the needed pairs, `by` "q" (row-major: forward, dq) or "kv" (column-major:
    dk/dv), padded to `size` entries by repeating the last visit's blocks with no flags (padding is never run when
    the grid is sized by count, and would cause no DMA if it were). size None: exactly count (numpy only).
    diagonal: None, or diagonal_pairs' [nq, nk] to flag those visits DIAGONAL."""
    if by == "kv":
        needed, full = needed.T, full.T
        diagonal = None if diagonal is None else diagonal.T
    outer, inner = needed.shape
    # every output block gets at least one visit: a block that needs none visits its first partner, computing nothing
    lonely = ~xp.any(needed, axis=1)
    visit = needed | (lonely[:, None] & (xp.arange(inner) == 0)[None, :])
    flat = visit.reshape(-1)
    count = flat.sum().astype(xp.int32)
    if xp is np:
        size = int(count) if size is None else size
        index = np.nonzero(flat)[0]
        index = np.concatenate([index, np.full(size - index.shape[0], index[-1])]).astype(np.int32)
    else:
        index = jnp.nonzero(flat, size=size, fill_value=0)[0].astype(jnp.int32)
        index = jnp.where(jnp.arange(size) < count, index, index[jnp.maximum(count - 1, 0)])
    o, i = index // inner, index % inner
    live = xp.arange(size) < count
    prev_o = xp.concatenate([xp.full((1,), -1, xp.int32), o[:-1].astype(xp.int32)])
    next_o = xp.concatenate([o[1:].astype(xp.int32), xp.full((1,), -1, xp.int32)])
    first = live & (o != prev_o)
    last = live & ((o != next_o) | (xp.arange(size) == count - 1))
    compute = live & needed.reshape(-1)[index]
    masked = compute & ~full.reshape(-1)[index]
    on_diagonal = masked & diagonal.reshape(-1)[index] if diagonal is not None else xp.zeros_like(masked)
    q_block, kv_block = (o, i) if by == "q" else (i, o)
    word = (
        q_block
        | (kv_block << BLOCK_BITS)
        | xp.where(first, FIRST, 0)
        | xp.where(last, LAST, 0)
        | xp.where(compute, COMPUTE, 0)
        | xp.where(masked, MASKED, 0)
        | xp.where(on_diagonal, DIAGONAL, 0)
    )
    return word.astype(xp.int32), count
