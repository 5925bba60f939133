"""Tile sizes of the ragged paged attention kernel, per TPU generation.

A visit multiplies one query block (queries_per_block tokens x the group's query heads, per kv head) by one key block
(pages_per_block pages, every kv head) gathered into VMEM. The key block sets the DMA per visit, which must hide the
~0.14 us cost of a grid step and the page copies' issue: 512 keys a visit (2 pages of 256, 32 of 16) is the default,
1024 at decode, where a visit's few query rows leave its fixed cost (the online-softmax chain) exposed, but no more
than a decode token's window spans (gpt-oss's 128: blocks of 128 keys, not 1024 of which the window keeps 128), and in
few enough pages that a step issues at most about 96 page copies. The query block sets the vector work per visit:
decode batches (about one token per sequence) take the fewest tokens whose rows fill a sublane tile, so that a visit's
scores stay a few vregs; prefill-heavy batches take blocks of about 128 rows, more where their visits read each kv head
out of words (256 rows, 512 with 2 kv heads; 1024 keys with no window: each query block reads the context again).
Every entry is proven by the deviceless compile test on v5e, v6e and v7x.
"""

import dataclasses
import functools

import jax.numpy as jnp

from ..common import chip
from ..common.blocks import check_tile, check_vmem_fit, sublane_multiple
from .kernel import head_major_cache, splits_rows_at_any_block, splits_words, strided_head_rows, visit_heads

KEYS_PER_BLOCK = {"v5e": 512, "v6e": 512, "v7x": 512}
# Decode-like batches: a visit's fixed cost (the online-softmax chain, the grid step) is a large part of a block of few
# query rows, so their visits take twice the keys (modeled v6e, Qwen3 decode B = 8 at 4096, page 64: 162.9 -> 79.7 us).
# Every decode path takes 1024 (Gemma 4's decode visits, every head at once, are then bound by their pages' DMA).
# Under a window the block is the window's span: gpt-oss decode (window 128, page 16) B = 8 at 4096, modeled v6e:
# kernel 172.1 us at 1024 keys, 56.5 at 256, 41.0 at 128.
DECODE_KEYS_PER_BLOCK = {"v5e": 1024, "v6e": 1024, "v7x": 1024}
# Blocks take at most PAGE_COPIES_PER_STEP / 4 pages at decode, / 2 otherwise: each page is two copies (K, V), a decode
# step takes two visits, and more copies a step than about 96 cost more than they hide. Measured on the v5e (device
# time), bf16 decode at context 4096, pages of 16, pages a block 64 (1024 keys) -> 24: Qwen3 B = 8 119.4 -> 97.6 us,
# B = 64 929.9 -> 755.7, B = 256 3,708.6 -> 3,030.4; Gemma 4 sliding B = 64 984.6 -> 731.0; Gemma 4 full B = 64
# 2,132.6 -> 1,557.7 (Qwen3 B = 64 at 16, 20, 28, 32 pages: 832.5, 791.0, 839.9, 799.6). Pages of 64 keep 16 (at 8:
# 734.3 against 728.2 us). Measured with a visit's copies of a whole block unconditioned and waited once, not kept
# (1.6 % at 64 pages of 16: 945.4 -> 929.9 us).
PAGE_COPIES_PER_STEP = 96
PREFILL_ROWS = {"v5e": 128, "v6e": 128, "v7x": 128}
# Prefill visits that read each kv head out of words (pairs of bf16 heads, kernel.strided_head_rows; float8 rows split
# per head, kernel.splits_rows_at_any_block) take more rows: each query block reads its sequence's context again, and
# such a visit's cost beyond its matmuls is per key (its pages' DMA and the split of the words), so more rows a block
# read the context fewer times; with no window also more keys. Measured on the v5e (device time), mixed batches of 4
# prefill chunks of 512 + 60 decodes at context 4096, pages of 64, query tokens x pages a block (`python -m benchmarks
# --sweep`, visits narrowed to a decode token's rows): Qwen3 (4 kv heads, 8 query heads each) 32 x 16 1,740 us,
# 64 x 16 1,730, 32 x 32 1,739, 32 x 8 1,833, 16 x 16 2,198; Gemma 4 full (2 kv heads: the whole buffer split, 8 query
# heads each) 32 x 16 3,895, 64 x 16 3,533, 64 x 8 3,638, 16 x 16 4,975; under a window, Gemma 4 sliding (window 1024,
# 2 query heads a kv head) 64 x 8 1,351, 128 x 8 1,251, 128 x 4 1,220 (one shape: the table keeps the default keys).
# Qwen3's float8 mixed batch, modeled v5e: 16 x 8 2,447 us, 32 x 16 1,553.
STRIDED_PREFILL_ROWS = {"v5e": 256, "v6e": 256, "v7x": 256}
PAIR_WORDS_PREFILL_ROWS = {"v5e": 512, "v6e": 512, "v7x": 512}  # 2 kv heads
STRIDED_PREFILL_KEYS = {"v5e": 1024, "v6e": 1024, "v7x": 1024}  # with no window
# Decode steps take 2 visits (a block of 2 tokens: both sequences' pages) where the grid steps that saves pay for the
# last step's one more visit computed unhidden: half the sequences x the key blocks a sequence visits, each step's cost
# (0.14 us in the model, about 160 KiB of page DMA at its rate), against half a visit's pages' DMA (a decode visit's
# compute). Modeled v6e, whole program, one visit a step -> two: Qwen3 bf16 decode at context 768 B = 64 98.3 -> 94.6,
# B = 256 383.2 -> 365.9 (B = 8, 8 visits of 1.5 MiB: 15.2 -> 15.5, not paired); at 4096 B = 8 62.5 -> 61.3, B = 64
# 475.2 -> 458.2; Gemma 4 full bf16 B = 8 (32 visits of 4 MiB) 114.1 -> 113.2; Gemma 4 sliding bf16 B = 8 (8 visits of
# 8 MiB) 58.7 -> 61.0, not paired; B = 64 (64 visits) 431.3 -> 429.8.
STEP_COST_BYTES = 160 << 10
# Float8 caches' K and V go into the matmuls as stored (kernel.Layout.float8_operands) on these generations: Mosaic
# takes a float8 operand of a bf16 dot and widens it on its way into the MXU, where the visit otherwise widens every
# block in the vector unit first (the v5e has no float8 arithmetic: Mosaic's e4m3fn conversion is about 7 vector ops a
# float32 vreg, and Qwen3's float8 decode visits, modeled v5e, are bound by it: 5,900 cycles a step against 4,200 of
# page DMA). Deviceless v5e compile of a toy decode visit (16 query rows, 1024 keys, head dim 128): 236 bundles as
# stored, 620 widened first; vLLM's RPA v3 feeds its float8 K and V so. Measured on the v5e (device time, float8
# decode at context 4096, pages of 64, B = 64, widened first -> as stored): Qwen3 548.8 -> 373.4 us, Gemma 4 sliding
# 513.1 -> 462.9, Gemma 4 full 931.1 -> 730.9. v6e and v7x: not measured, left widening first.
FLOAT8_OPERANDS = {"v5e": True, "v6e": False, "v7x": False}
# Visit lists (three int32 words a visit) and the page table live in SMEM; beyond this, larger blocks are needed.
SMEM_BUDGET_BYTES = 512 * 1024


def takes_float8_operands(*, cache_dtype, compute_dtype) -> bool:
    """Whether a call can take float8 blocks into its matmuls as stored: an e4m3fn cache and bf16 queries."""
    return jnp.dtype(cache_dtype) == jnp.float8_e4m3fn and jnp.dtype(compute_dtype) == jnp.bfloat16


def float8_operands(*, cache_dtype, compute_dtype, info=None) -> bool:
    """Whether visits take a float8 (e4m3fn) cache's blocks into bf16 matmuls as stored (FLOAT8_OPERANDS)."""
    info = info or chip.current_tpu_info()
    return takes_float8_operands(cache_dtype=cache_dtype, compute_dtype=compute_dtype) and FLOAT8_OPERANDS.get(
        chip.generation_name(info), False
    )


@dataclasses.dataclass(frozen=True)
class PagedAttentionBlocks:
    """Tile sizes of the ragged paged attention kernel: the `blocks=` of ragged_paged_attention.

    queries_per_block: query tokens per block; times the query heads per kv head it must be a multiple of the sublane
        tile (16 rows for 16-bit queries, 8 for float32) unless it covers all tokens. None: the table's.
    pages_per_block: KV pages gathered per visit (at most the page table's width). None: about 512 keys (1024 for a
        decode-like batch, at most 2 tokens a sequence, in at most 24 pages; 1024 for prefill visits that read
        heads by strided loads with no window, in at most 48 pages; under a window the power of two that holds it).
    vmem_limit_bytes: the scoped VMEM the kernel may use; None: derived from the working set.
    visits_per_step: 1 or 2 (query block, key block) visits of one query block a grid step takes, each into page
        buffers of its own. None: 2 for a decode-like batch (a decode block of 2 tokens is 2 sequences: one step fetches
        both sequences' pages) where the working set stays within 3/4 of the core's VMEM, else 1.
    float8_operands: with a float8 (e4m3fn) cache and bf16 queries, whether its K / V blocks go into bf16 x float8
        matmuls as stored (Mosaic widens them on the way into the MXU) rather than widened in the vector unit first.
        None: the table's (FLOAT8_OPERANDS); False for any other cache.
    """

    queries_per_block: int | None = None
    pages_per_block: int | None = None
    vmem_limit_bytes: int | None = None
    visits_per_step: int | None = None
    float8_operands: bool | None = None


def check_blocks_type(blocks):
    if blocks is not None and not isinstance(blocks, PagedAttentionBlocks):
        raise TypeError(f"blocks: expected a PagedAttentionBlocks or None, got {type(blocks).__name__}")


def min_queries_per_block(group: int, dtype) -> int:
    """The fewest tokens whose rows (tokens x group) are a whole number of sublane tiles."""
    sub = sublane_multiple(dtype)
    tokens = 1
    while (tokens * group) % sub:
        tokens += 1
    return tokens


def working_set(
    *,
    queries_per_block,
    pages_per_block,
    page_size,
    kv_heads,
    group,
    head_dim,
    v_head_dim,
    q_itemsize,
    cache_dtype,
    visits_per_step=1,
) -> int:
    cache_itemsize = jnp.dtype(cache_dtype).itemsize
    rows = queries_per_block * group
    keys = pages_per_block * page_size
    # a token's kv heads are the second-minor dim of the page buffer: Mosaic tiles 8-bit rows in fours and 16-bit rows
    # in pairs (one 32-bit sublane), so 2 float8 kv heads would take the room of 4; a head-major buffer's
    # second-minor dim is the page (head_major_cache), whole tiles
    head_major = head_major_cache(hkv=kv_heads, page_size=page_size, cache_itemsize=cache_itemsize)
    # With a head dim short of a lane tile, a token's [kv_heads, D] slab takes a whole sublane tile: on the v5e test
    # chip (libtpu 0.0.42) gpt-oss's 8 bf16 heads of 64 (16 x 128 per token) allocated 36.3 MiB where whole pairs
    # counted 16.6 MiB, and the compile ran out of its scoped limit (a newer libtpu packs them tighter).
    lane_short = head_dim % 128 or v_head_dim % 128
    rows_tile = 8 * (4 // cache_itemsize) if lane_short else 4 // cache_itemsize  # a whole tile, or a 32-bit sublane
    packed_heads = kv_heads if head_major else -(-kv_heads // rows_tile) * rows_tile
    # a page buffer's minor dim is the head dim (whichever view), padded to whole 128-lane tiles in VMEM: gpt-oss's
    # 64 takes 128 (compiled for the v5e, its blocks needed twice the bytes they were counted at)
    dk, dv = (-(-d // 128) * 128 for d in (head_dim, v_head_dim))
    buffers = 2 * visits_per_step * keys * packed_heads * (dk + dv) * cache_itemsize
    # A float8 block is widened in registers (float8 -> float32 -> the compute dtype) and Mosaic keeps the widened K and
    # V of both visit branches (masked, unmasked) in its internal scratch: counted for every head unless the caches are
    # passed as rows (an upper bound with more heads: Mosaic reuses some of the room). Every head at once multiplies the
    # score temporaries by kv_heads squared (every head's rows against every head's keys).
    merged, view, strided = visit_heads(
        hkv=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        block_rows=rows,
        page_size=page_size,
        cache_dtype=cache_dtype,
    )
    widened = 0
    if cache_itemsize == 1:
        widened = keys * (head_dim + v_head_dim) * (4 + q_itemsize) * (1 if view else 2 * kv_heads)
    if strided and kv_heads == 2:  # the whole buffer's K and V loaded as rows and as words (head_pair_words)
        widened = keys * (head_dim + v_head_dim) * (2 * cache_itemsize + 4)
    q = kv_heads * rows * head_dim * q_itemsize
    out = kv_heads * rows * v_head_dim * q_itemsize
    stats = 2 * kv_heads * rows * 128 * 4
    acc = kv_heads * rows * v_head_dim * 4
    rinfo = 2 * rows * 128 * 4
    temporaries = 6 * rows * keys * 4
    if merged and not splits_words(merged=merged, merged_view=view, cache_itemsize=cache_itemsize, block_kv=keys):
        temporaries *= merged * merged  # every head's rows (of a pair, or all) against every head's keys
    return buffers + widened + 3 * q + 2 * out + stats + acc + rinfo + temporaries


def resolve_blocks(
    blocks,
    *,
    tokens,
    num_seqs,
    group,
    page_size,
    pages_per_seq,
    kv_heads,
    head_dim,
    v_head_dim,
    q_dtype,
    cache_dtype,
    window_size=(-1, -1),
    info=None,
) -> PagedAttentionBlocks:
    """The blocks to use: the caller's, checked (fields named), with None fields from the table. window_size: the
    (left, right) window as the kernel applies it (right 0 when causal)."""
    info = info or chip.current_tpu_info()
    generation = chip.generation_name(info)
    blocks = blocks or PagedAttentionBlocks()
    owner = "PagedAttentionBlocks"
    min_q = min_queries_per_block(group, q_dtype)
    decode = tokens <= 2 * num_seqs
    left, right = window_size
    heads = dict(hkv=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, cache_dtype=cache_dtype)
    # prefill visits that read one head at a time out of words (pairs of bf16 heads, or float8 rows split per head)
    strided_prefill = not decode and (
        strided_head_rows(**heads) or splits_rows_at_any_block(**heads, page_size=page_size)
    )
    if blocks.queries_per_block is None:
        table = PREFILL_ROWS
        if strided_prefill:
            table = PAIR_WORDS_PREFILL_ROWS if kv_heads == 2 else STRIDED_PREFILL_ROWS
        rows = table.get(generation, 128)
        target = min_q if decode else max(min_q, rows // group)
        queries = -(-target // min_q) * min_q
    else:
        queries = check_tile(owner, "queries_per_block", blocks.queries_per_block)
        if queries < tokens and (queries * group) % sublane_multiple(q_dtype):
            raise ValueError(
                f"{owner}.queries_per_block: expected a multiple of {min_q} (its {group} query heads per kv head make "
                f"rows that must fill {sublane_multiple(q_dtype)}-row sublane tiles of {jnp.dtype(q_dtype)}) or at "
                f"least the {tokens} query tokens, got {queries}"
            )
    queries = min(queries, -(-tokens // min_q) * min_q)
    if blocks.pages_per_block is None:
        table = KEYS_PER_BLOCK
        if decode or strided_prefill and left < 0:
            table = DECODE_KEYS_PER_BLOCK if decode else STRIDED_PREFILL_KEYS
        keys = table.get(generation, 512)
        if decode and left >= 0 and right >= 0:  # a decode token sees its window's keys: no larger blocks
            keys = min(keys, 1 << (left + right).bit_length())  # the power of two >= left + right + 1
        pages = max(1, keys // page_size)
        pages = min(pages, PAGE_COPIES_PER_STEP // (4 if decode else 2))
    else:
        pages = check_tile(owner, "pages_per_block", blocks.pages_per_block)
    pages = min(pages, pages_per_seq)
    if pages * page_size >= 1 << 15:
        raise ValueError(
            f"{owner}.pages_per_block: expected fewer than {(1 << 15) // page_size} pages of "
            f"{page_size} keys (a visit addresses its key rows in 15 bits), got {pages}"
        )
    need = functools.partial(
        working_set,
        queries_per_block=queries,
        pages_per_block=pages,
        page_size=page_size,
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        q_itemsize=jnp.dtype(q_dtype).itemsize,
        cache_dtype=cache_dtype,
    )
    per_step = blocks.visits_per_step
    if per_step is None:
        keys = pages * page_size
        visit_bytes = keys * kv_heads * (head_dim + v_head_dim) * jnp.dtype(cache_dtype).itemsize
        per_seq = -(-pages_per_seq // pages)  # the key blocks a sequence visits at most (its window's span)
        left, right = window_size
        if left >= 0 and right >= 0:
            per_seq = min(per_seq, -(-(queries + left + right) // keys) + 1)
        pair = decode and num_seqs * per_seq * STEP_COST_BYTES >= visit_bytes
        per_step = 2 if pair and need(visits_per_step=2) <= info.vmem_capacity_bytes * 3 // 4 else 1
    elif per_step not in (1, 2):
        raise ValueError(f"{owner}.visits_per_step: expected 1 or 2, got {per_step}")
    need = need(visits_per_step=per_step)
    limit = blocks.vmem_limit_bytes
    check_vmem_fit(owner, need, limit, info)
    if limit is None:
        # With a head dim short of a lane tile, Mosaic's own scratch for reading one head out of a page buffer is
        # more than the working set models: on the v5e test chip gpt-oss's full layer allocated 12.3 MiB beyond its
        # page buffers with one visit a step (one sequence), 4.3 MiB with two (64): half the working set again.
        short = head_dim % 128 or v_head_dim % 128
        limit = chip.scoped_vmem_limit(info, need, slack_bytes=need // 2 if short else 0)
    operands = blocks.float8_operands
    if operands is None:
        operands = float8_operands(cache_dtype=cache_dtype, compute_dtype=q_dtype, info=info)
    elif not isinstance(operands, bool):
        raise TypeError(f"{owner}.float8_operands: expected a bool or None, got {type(operands).__name__}")
    elif operands and not takes_float8_operands(cache_dtype=cache_dtype, compute_dtype=q_dtype):
        raise ValueError(
            f"{owner}.float8_operands: True needs a float8_e4m3fn cache and bfloat16 queries, got a "
            f"{jnp.dtype(cache_dtype).name} cache and {jnp.dtype(q_dtype).name} queries"
        )
    return PagedAttentionBlocks(
        queries_per_block=queries,
        pages_per_block=pages,
        vmem_limit_bytes=limit,
        visits_per_step=per_step,
        float8_operands=operands,
    )


# `candidate_blocks`' variations of the table's choice: pages a block scaled by these (whole pages, within the page
# table), and for prefill-heavy batches query tokens a block halved and doubled (whole sublane tiles of rows).
CANDIDATE_PAGE_FACTORS = (0.25, 0.5, 0.75, 1.5, 2.0)
CANDIDATE_QUERY_FACTORS = (0.5, 2.0)


def candidate_blocks(*, info=None, **shape) -> list[PagedAttentionBlocks]:
    """Legal blocks worth timing at this call's shape (resolve_blocks' keyword arguments but `blocks`): the table's
    choice first, then its pages a block times CANDIDATE_PAGE_FACTORS, and for a prefill-heavy batch its query tokens
    a block times CANDIDATE_QUERY_FACTORS (with the table's pages, half and twice as many), and for a float8 cache the
    table's choice with float8_operands the other way; each resolved for this
    generation (visits a step and the VMEM limit as the table would set them); blocks that do not fit its VMEM are
    left out. What `python -m benchmarks --sweep --kernel paged_attention` times on a TPU."""
    info = info or chip.current_tpu_info()
    choice = resolve_blocks(None, info=info, **shape)
    min_q = min_queries_per_block(shape["group"], shape["q_dtype"])

    def scaled(factor):  # the table's pages a block times factor: whole pages, within the page table
        return min(shape["pages_per_seq"], max(1, round(choice.pages_per_block * factor)))

    pages = [choice.pages_per_block] + sorted({scaled(factor) for factor in CANDIDATE_PAGE_FACTORS})
    queries = [choice.queries_per_block]
    if shape["tokens"] > 2 * shape["num_seqs"]:  # prefill-heavy: the query block is the table's choice too
        for factor in CANDIDATE_QUERY_FACTORS:
            tokens = max(min_q, int(choice.queries_per_block * factor) // min_q * min_q)
            if tokens not in queries:
                queries.append(tokens)
    candidates = [choice]
    for q in queries:
        for p in pages if q == choice.queries_per_block else (choice.pages_per_block, scaled(0.5), scaled(2.0)):
            try:
                blocks = resolve_blocks(
                    PagedAttentionBlocks(queries_per_block=q, pages_per_block=p), info=info, **shape
                )
            except ValueError:  # past the scoped VMEM this generation gives
                continue
            if blocks not in candidates:
                candidates.append(blocks)
    if takes_float8_operands(cache_dtype=shape["cache_dtype"], compute_dtype=shape["q_dtype"]):
        flipped = dataclasses.replace(choice, float8_operands=not choice.float8_operands)
        candidates.insert(1, resolve_blocks(flipped, info=info, **shape))  # float8 widened first, or not
    return candidates
