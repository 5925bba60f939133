"""Pallas TPU ragged paged attention: online softmax over the visits of each query block (schedule.py), with the key
and value pages gathered from the paged cache by the kernel's own DMAs.

Layouts. The caches stay where they are, flash-attn's [pages, page_size, kv_heads, head_dim], in HBM (`pl.ANY`),
in the layout XLA gave them (any reshape of a cache would be a relayout copy of the whole cache on every call: XLA
tiles its two minor dims, kv heads x head dim). A visit copies the pages of its key block, each page one contiguous
DMA holding every kv head, into a (pages_per_block, page_size, kv_heads, head_dim) VMEM buffer; two buffers, so the
next visit's pages arrive while this one computes. A grid step takes `parts` visits of one query block, each into its
own pages_per_block page slots of the buffer (at decode both sequences of a block of 2 tokens: half the grid steps,
each a fixed cost). Decode-like blocks (few query rows) read the whole buffer as rows, token-major with the kv heads
minor, and take every head in one matmul (merges_heads), except a float8 buffer of 4 kv heads as rows, whose heads are
split from its 32-bit words (splits_words); prefill blocks take pairs of heads so, except bf16 buffers of 2 kv heads
or of 4 or 8 as rows, which read one head at a time out of 32-bit words holding a pair of heads (strided_head_rows);
head dims that are not whole lane tiles read one kv head as a sublane-strided load of the buffer.

Queries come as they are, [tokens, q_heads, head_dim], a block of tokens with every head, and the output leaves so
(no transposes in XLA around the kernel); a query block's first visit lays each kv head's rows out in VMEM as
[tokens * group, head_dim]: the query heads of one kv head are consecutive rows of one token (GQA folded into the
rows), so one matmul per kv head serves the whole group. At decode a token's group of heads fills the MXU rows that
one query row would leave idle.

Statistics follow the flash attention forward (scores in log2 units, a finite running-max start, -inf for masked
scores, lane-replicated per-row statistics). Visits that mask: rows of other sequences (a query block may hold many
sequences), causality and the window, and value rows past the fetched pages or the context (zeroed: their VMEM is
stale, and zero weight times NaN is NaN). A float8 cache is widened in VMEM (`widen`, exact up to a power of two);
its scales, times that power of two, are folded into the query scale (k_scale) and the output's normaliser (v_scale).
Where Layout.float8_operands, its blocks go into bf16 x float8 matmuls as stored instead (Mosaic widens them on the
way into the MXU), except V blocks whose unfetched rows must be zeroed by rows.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import LANES
from ..common.interpret import interpret_mode_forced
from ..common.manual_axes import out_struct
from ..flash_attention.geometry import LOG2_E, MAX_INIT, dot_nn, dot_nt, lanes, row_stat
from . import schedule


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static shape of one call as the kernel sees it."""

    tokens: int  # query tokens, padded to whole query blocks
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int
    pages_per_seq: int
    pages_per_block: int
    block_q: int  # query tokens per block
    softmax_scale: float
    softcap: float
    window_size: tuple[int, int]  # (left, right), -1 unbounded; right = 0 when causal
    merged: int = 0  # kv heads a matmul takes at once (merges_heads); 0: one at a time
    merged_view: bool = False  # caches passed as [pages, page_size * kv_heads, head_dim] (merged_cache_view)
    head_major: bool = False  # caches passed as [pages, kv_heads, page_size, head_dim] (head_major_cache)
    strided_heads: bool = False  # one head at a time, its rows by strided loads of the rows buffer (strided_head_rows)
    scales: tuple[float, float] | None = (1.0, 1.0)  # static (k, v) cache scales; None: a traced operand
    parts: int = 1  # visits a grid step takes (consecutive list entries of one query block, each its own page slots)
    # float8 K / V blocks go into the matmuls as they are, bf16 x float8 dots that Mosaic widens on the way into the
    # MXU, rather than widened by the vector unit first (float8_operands)
    float8_operands: bool = False

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def block_rows(self) -> int:
        """Query rows per block: tokens x the query heads of one kv head."""
        return self.block_q * self.group

    @property
    def block_kv(self) -> int:
        return self.page_size * self.pages_per_block

    @property
    def strided_loads(self) -> bool:
        """Whether a visit reads a head's pair words by strided loads (strided_head_rows with 4 or 8 kv heads; with 2,
        every word row is the pair's)."""
        return self.strided_heads and self.kv_heads > 2

    @property
    def pair_word_pages(self) -> bool:
        """Whether the page buffers hold the caches' 32-bit pair words, [pages, D / 128, page_size, 128] uint32, each
        lane tile of a page apart: 2 bf16 kv heads not passed as rows (a head dim of several lane tiles, Gemma 4
        full's 2 x 512). XLA tiles such a cache's [page_size, 2, D] page (2, 128): a token's lane tile is one 32-bit
        row, both heads' values in each word. So each lane tile of a page is one DMA from a uint32 view of the cache
        (the same bytes, no copy), and a head's block is its halves of plain rows of words (loaded whole, the buffer
        as it lies would need a relayout into rows in registers first). TPU interpret mode cannot bitcast a ref:
        there the buffer holds the lane tiles in bf16, [pages, D / 128, page_size, 2, 128], and the words are packed
        from the two heads' rows."""
        return self.strided_heads and self.kv_heads == 2 and not self.merged_view

    @property
    def lane_chunks(self) -> int:
        """Lane tiles of the head dim a page buffer holds apart ([pages, chunks, rows, 128]: a strided load needs rows
        of one lane tile; pair words are loaded whole only so); 0 for the other buffers ([pages, ...] as the cache is
        passed)."""
        return self.head_dim // LANES if self.strided_loads or self.pair_word_pages else 0

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.pages_per_seq // self.pages_per_block)

    @property
    def max_context(self) -> int:
        return self.pages_per_seq * self.page_size


MERGED_TOKENS = 1024  # tokens of a key block per chunk of a visit that takes every head at once
MERGED_ROWS = 128  # score rows (kv heads x query rows per head) up to which a visit takes every head at once
# with 2 kv heads of a cache that is not bf16 (bf16 reads them out of pair words: strided_head_rows), up to a prefill
# block's 128 query rows a head: the cross-head waste is only 2x (Gemma 4 full's mixed batch in bf16 before pair words,
# modeled v6e: 19504.8 -> 4646.5 us against one head at a time by a gather)
MERGED_PAIR_ROWS = 256
# A visit whose sequence's rows in its query block lie within one aligned window of NARROW_ROWS rows (a decode token's
# group of rows in a mixed batch's prefill-sized block) computes those rows only: the block's other rows would be
# computed and discarded (modeled v5e, Gemma 4 full's mixed batch, 4 prefill chunks of 512 + 60 decodes in blocks of
# 256 rows: every visit ~12,200 cycles, the decodes' 240 of them included). A whole bf16 sublane tile, a power of two.
NARROW_ROWS = 16


def merged_cache_view(*, hkv: int, head_dim: int, v_head_dim: int, cache_itemsize: int) -> bool:
    """Whether caches [pages, page_size, kv_heads, D] hold the same bytes as [pages, page_size * kv_heads, D], so the
    api passes them so reshaped (no copy in the program) and a visit's page buffer is already token-major rows. XLA
    tiles the two minor dims: with one lane tile of head dim, the tiles of kv_heads rows of consecutive tokens are the
    tiles of the merged rows (2 or 4 kv heads); and a 16- or 32-bit cache with 8 kv heads is tiled (8, 128), one token
    a row of tiles, whatever the head dim (Gemma 4 sliding's 8 x 256)."""
    if head_dim == v_head_dim == LANES and hkv in (2, 4):
        return True
    return hkv == 8 and cache_itemsize in (2, 4) and head_dim % LANES == 0 and v_head_dim % LANES == 0


def head_major_cache(*, hkv: int, page_size: int, cache_itemsize: int) -> bool:
    """Whether XLA lays caches [pages, page_size, kv_heads, D] out head-major, `{3,1,2,0}`: each kv head's page a
    contiguous (page_size, D) block, the page offset second-minor (float8 with 1 or 2 kv heads, whose rows of 1 or 2
    heads would fill a quarter or half of a float8 tile). The api then passes them as [pages, kv_heads, page_size, D],
    the same bytes (no copy in the program), and a visit reads each head's keys as plain rows of its page buffer. Only
    for whole float8 tiles of the page (32 rows), which Mosaic merges into a head's key rows for free."""
    return cache_itemsize == 1 and hkv <= 2 and page_size % 32 == 0


def merges_heads(*, hkv: int, head_dim: int, v_head_dim: int, block_rows: int, cache_itemsize: int) -> int:
    """How many kv heads a visit takes in one matmul (0: one at a time): the page buffer's rows (token-major, kv heads
    minor) against those heads' query rows, the cross-head scores masked. Needs 2, 4 or 8 kv heads and few score rows
    (the cross-head scores are wasted vector work, kv_heads times the useful, which pays where reading one head's rows
    out of the buffer dominates: a head is every kv_heads-th row, a sublane-strided gather, while the whole buffer loads
    plainly): decode blocks, and with 2 kv heads prefill blocks too (visit_heads sends bf16 prefill blocks to pair
    words instead: strided_head_rows). The buffer is either already rows (merged_cache_view) or loaded as it lies,
    [pages, page_size, kv_heads, D], and reshaped to rows in registers, which Mosaic does with sublane-shuffled loads
    for head dims that are whole lane tiles (Gemma 4 full's 2 x 512, float8 too). Blocks with more rows (prefill) and
    4 or 8 kv heads take them in pairs: each pair's rows reshaped from the buffer as it lies, the cross-head waste
    2x."""
    if hkv not in (2, 4, 8):
        return 0
    lanes_whole = head_dim % LANES == 0 and v_head_dim % LANES == 0
    view = merged_cache_view(hkv=hkv, head_dim=head_dim, v_head_dim=v_head_dim, cache_itemsize=cache_itemsize)
    if hkv * block_rows <= (MERGED_PAIR_ROWS if hkv == 2 else MERGED_ROWS) and (view or lanes_whole):
        return hkv
    return 2 if lanes_whole and 2 * block_rows <= MERGED_PAIR_ROWS else 0


def strided_head_rows(*, hkv: int, head_dim: int, v_head_dim: int, cache_dtype) -> bool:
    """Whether visits that take one kv head at a time read its keys and values out of 32-bit words that each hold a
    token's pair of heads (bf16 caches, head dims whole lane tiles). In a cache of 4 or 8 kv heads passed as rows
    (merged_cache_view: token-major, the kv heads minor) head h's rows are every kv_heads-th row, which the load unit
    reads with a stride. Mosaic strided-loads 32-bit rows of one lane tile only: the buffer is read as 32-bit words,
    each a token's pair of heads, and the pair's halves split in registers (head_pair_words); a wider head dim's page
    buffer holds each lane tile apart (one DMA a page and lane tile), and the strided loads take the page buffer's slot
    as a static index (such visits are compiled once per slot). With 2 kv heads every word is a token's pair, no
    stride: a buffer of rows (merged_cache_view) is bitcast whole to words in registers, and others hold the pages'
    words as copied (Layout.pair_word_pages).
    Otherwise a head's rows are a sublane gather, which the merged visits avoid by computing every head's (or each
    pair's) scores against all of its heads' keys, the cross-head part wasted. Measured v5e, the mixed batch (4
    prefill chunks of 512 + 60 decodes, context 4096, page 64): Qwen3 10,146 us in pairs, 2,571 us by strided loads;
    Gemma 4 sliding 5,185 -> 1,360 us; Gemma 4 full (2 kv heads) 6,595 us merged, 3,492 out of pair words."""
    if jnp.dtype(cache_dtype) != jnp.bfloat16 or head_dim != v_head_dim or head_dim % LANES:
        return False
    if hkv == 2:
        return True
    return hkv in (4, 8) and merged_cache_view(hkv=hkv, head_dim=head_dim, v_head_dim=v_head_dim, cache_itemsize=2)


def splits_rows_at_any_block(*, hkv: int, head_dim: int, v_head_dim: int, page_size: int, cache_dtype) -> bool:
    """Whether every visit, prefill blocks' too, takes a float8 buffer of 4 kv heads as rows split per head from its
    32-bit words (splits_words; pages of whole 32-token chunks): one head at a time, no cross-head scores, where
    prefill blocks would otherwise take the heads in pairs (measured v5e, Qwen3's float8 mixed batch in pairs:
    6,064 us, against vLLM's 1,582)."""
    view = merged_cache_view(
        hkv=hkv, head_dim=head_dim, v_head_dim=v_head_dim, cache_itemsize=jnp.dtype(cache_dtype).itemsize
    )
    return hkv == 4 and view and jnp.dtype(cache_dtype).itemsize == 1 and page_size % _SPLIT_CHUNK == 0


def visit_heads(*, hkv: int, head_dim: int, v_head_dim: int, block_rows: int, page_size: int, cache_dtype):
    """How a call's visits take the kv heads: (merged, merged_view, strided_heads), the Layout fields. Head-major
    caches one head at a time as rows; else every head (or each pair) at once where merges_heads says so, except that
    blocks with more rows (prefill) read one head at a time by strided loads where strided_head_rows says they can."""
    itemsize = jnp.dtype(cache_dtype).itemsize
    if head_major_cache(hkv=hkv, page_size=page_size, cache_itemsize=itemsize):
        return 0, False, False
    if splits_rows_at_any_block(
        hkv=hkv, head_dim=head_dim, v_head_dim=v_head_dim, page_size=page_size, cache_dtype=cache_dtype
    ):
        return hkv, True, False
    strided = hkv * block_rows > MERGED_ROWS and strided_head_rows(
        hkv=hkv, head_dim=head_dim, v_head_dim=v_head_dim, cache_dtype=cache_dtype
    )
    merged = 0
    if not strided:
        merged = merges_heads(
            hkv=hkv, head_dim=head_dim, v_head_dim=v_head_dim, block_rows=block_rows, cache_itemsize=itemsize
        )
    view = (merged == hkv or strided) and merged_cache_view(
        hkv=hkv, head_dim=head_dim, v_head_dim=v_head_dim, cache_itemsize=itemsize
    )
    return merged, view, strided


_E4M3FN = jnp.dtype(jnp.float8_e4m3fn)
# The bf16 bits, sign masked off, that e4m3fn's NaN codes (0x7F / 0xFF) take read as e4m3b11fnuz: +-30 = 1.875 * 2^4.
# No other code reaches it so read (e4m3fn's largest finite, 448, reads as 28).
_NAN_CODES_AS_B11 = 0x41F0
_BF16_NAN, _BF16_NEGATIVE_ZERO = 0x7FC0, -0x8000  # int16 bit patterns


def _via_b11(dtype) -> bool:
    """Whether `widen` reads a cache of `dtype` as e4m3b11: float8_e4m3fn on v6e (the generation being traced for)."""
    return jnp.dtype(dtype) == _E4M3FN and chip.generation_name(chip.current_tpu_info()) == "v6e"


def widen_factor(cache_dtype) -> float:
    """What `widen`'s output times gives the cache's values: 2^4 where e4m3fn is read as e4m3b11, else 1."""
    return 16.0 if _via_b11(cache_dtype) else 1.0


def widen(x, dtype):
    """A block of the cache in `dtype` (the queries'), exactly, divided by `widen_factor(x.dtype)`.

    v6e's vector unit unpacks its native float8, e4m3b11 (jax's float8_e4m3b11fnuz: exponent bias 11, no infinities,
    no -0, its one NaN the code 0x80), to float32 in one op a quarter of a vreg. e4m3fn has the same sign / 4 exponent
    / 3 mantissa fields with bias 7, so its byte read as e4m3b11 is its value times 2^-4, subnormals included, except
    two codes: -0 (0x80) reads as NaN and the NaN codes (0x7F / 0xFF) as +-30. Those are put right on the bf16 bits,
    five 16-bit ops a bf16 vreg (a mask, two compares, two selects): -0 stays -0 and NaN NaN, bit for bit. Mosaic's
    own e4m3fn conversion is the same unpack then about six float32 ops a float32 vreg (the 2^4 and the special
    codes), which made the decode visit compute-bound (modeled v6e, Qwen3 fp8 decode B = 8 at 4096: 13394 -> 10200
    bundles in the kernel body). v5e emulates 16-bit integer ops (each unpacked to 32 bits: slower than Mosaic's
    conversion, 1163 against 1093 bundles for a toy block), and v7x converts e4m3fn natively: there, and for any other
    dtype, the block is cast as it is."""
    if x.dtype == dtype:
        return x
    if not _via_b11(x.dtype):
        return x.astype(dtype)
    b11 = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3b11fnuz).astype(jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(b11, jnp.int16)
    magnitude = bits & jnp.int16(0x7FFF)
    bits = jnp.where(magnitude > 0x7F80, jnp.int16(_BF16_NEGATIVE_ZERO), bits)  # e4m3fn's -0, read as NaN
    bits = jnp.where(magnitude == _NAN_CODES_AS_B11, jnp.int16(_BF16_NAN), bits)  # its NaN codes, read as +-30
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dtype)


def _zero_unfetched(v, first_token: int, rows, hkv: int):
    """v [tokens * hkv, Dv] (rows token-major, heads minor) with the rows of tokens outside the visit's fetched range
    zeroed: their VMEM is stale or past the context, and zero weight times NaN is NaN. A 16-bit v is selected as 32-bit
    words (two rows of one token: hkv is even), which needs no mask packing."""
    packing = 4 // v.dtype.itemsize
    words = pltpu.bitcast(v, jnp.uint32) if packing > 1 else v
    per_token = hkv // packing
    assert per_token & (per_token - 1) == 0 and per_token >= 1, (hkv, packing)
    token = first_token + (jax.lax.broadcasted_iota(jnp.int32, (words.shape[0], 1), 0) >> (per_token.bit_length() - 1))
    fetched = (token >= (rows & schedule.ROW_MASK)) & (token < (rows >> schedule.ROW_BITS))
    words = jnp.where(fetched, words, jnp.zeros_like(words))
    return pltpu.bitcast(words, v.dtype) if packing > 1 else words


_SPLIT_CHUNK = 32  # tokens a byte transpose of `_split_heads` takes: four vregs of 8 words (tokens) a lane


def splits_words(*, merged: int, merged_view: bool, cache_itemsize: int, block_kv: int) -> bool:
    """Whether a visit that takes every kv head at once splits them per head from the page buffer's 32-bit words
    instead (`_split_heads`): a float8 buffer of 4 kv heads as rows (merged_cache_view: head dim 128), where each word
    holds one token's 4 heads at one lane, in key blocks of whole 32-token chunks. Each head's keys then go through
    their own matmul and softmax (no cross-head scores: a quarter of the merged visit's vector work on scores) at the
    cost of a byte transpose of the words (four 32-bit ops a float8 vreg: two shifts, two bit selects)."""
    return merged == 4 and merged_view and cache_itemsize == 1 and block_kv % _SPLIT_CHUNK == 0


def _split_heads(x):
    """x [tokens * 4, D] float8, rows token-major with 4 kv heads minor -> 4 arrays [tokens, D] float8, head h's rows,
    the tokens of each chunk of 32 in `_split_order`. A 32-bit word of x (pltpu.bitcast: rows 4t .. 4t + 3, byte h
    head h) is one token's 4 heads at one lane; four vregs of words (tokens 8i + s of a chunk, i = 0 .. 3) are
    transposed bytewise, 16-bit halves then bytes, so that head h's word holds byte i = token 8i + s's head h."""
    tokens, d = x.shape[0] // 4, x.shape[1]
    words = pltpu.bitcast(x, jnp.uint32).reshape(tokens // _SPLIT_CHUNK, 4, _SPLIT_CHUNK // 4, d)
    a, b, c, e = (words[:, i] for i in range(4))

    def bits(mask, x, y):  # x's bits where mask is set, else y's: one select
        return (x & mask) | (y & ~mask)

    low, even = jnp.uint32(0x0000FFFF), jnp.uint32(0x00FF00FF)
    ac = (bits(low, a, c << 16), bits(low, a >> 16, c))  # bytes (a_h, a_h+1, c_h, c_h+1) for h = 0, 2
    be = (bits(low, b, e << 16), bits(low, b >> 16, e))
    heads = []
    for h in range(4):
        x0, x1 = ac[h // 2], be[h // 2]
        head = bits(even, x0, x1 << 8) if h % 2 == 0 else bits(even, x0 >> 8, x1)
        heads.append(pltpu.bitcast(head.reshape(tokens // 4, d), x.dtype))
    return heads


def _split_order(shape, dimension: int):
    """The token (within the key block) of each row of `_split_heads`' output: row 32q + 4s + i is token 32q + 8i +
    s. An int32 iota of `shape` along `dimension` so mapped."""
    r = jax.lax.broadcasted_iota(jnp.int32, shape, dimension)
    return (r & ~(_SPLIT_CHUNK - 1)) | ((r & 3) << 3) | ((r >> 2) & 7)


def _split_block(block, layout: Layout):
    """(sequence, key block within it) of a visit's key block. Truncating division: the values are >= 0, and Python's
    floor division on scalars lowers through `sign`, which needs a chip to lower (a TPU export on a CPU host has
    none)."""
    return jax.lax.div(block, layout.blocks_per_seq), jax.lax.rem(block, layout.blocks_per_seq)


def _fetched(i: int, rows, layout: Layout):
    """Whether page slot i of a visit's key block holds rows it fetches (rows: the visit's packed row range)."""
    first, end = rows & schedule.ROW_MASK, rows >> schedule.ROW_BITS
    return (i * layout.page_size + layout.page_size > first) & (i * layout.page_size < end)


def _start(step, slot, refs, layout: Layout):
    """Start the copies of the pages the step's visits fetch, K and V one DMA a page, visit p's pages into page slots
    p * pages_per_block on. A visit's fetched rows end at its sequence's (clamped) context, so a fetched page lies
    within the sequence's page table: an entry is read only for a page that is fetched."""
    kv_blocks_ref, rows_ref, pages_ref, k_hbm, v_hbm, k_buf, v_buf, sems = refs
    k_hbm, v_hbm = _cache_view(k_hbm, layout), _cache_view(v_hbm, layout)
    last_page = k_hbm.shape[0] - 1
    for part in range(layout.parts):
        visit = step * layout.parts + part
        seq, block_in_seq = _split_block(kv_blocks_ref[visit], layout)
        rows = rows_ref[visit]
        base = seq * layout.pages_per_seq + block_in_seq * layout.pages_per_block
        for i in range(layout.pages_per_block):

            @pl.when(_fetched(i, rows, layout))
            def _():
                page = jnp.clip(pages_ref[base + i], 0, last_page)  # device page tables are not checked
                at = part * layout.pages_per_block + i
                for src, dst in _page_copies(k_hbm.at[page], k_buf.at[slot, at], layout):
                    pltpu.make_async_copy(src, dst, sems.at[slot, 0]).start()
                for src, dst in _page_copies(v_hbm.at[page], v_buf.at[slot, at], layout):
                    pltpu.make_async_copy(src, dst, sems.at[slot, 1]).start()


def _wait(step, slot, refs, layout: Layout):
    """A wait needs the copy's size and semaphore, not its source: every page's copy has the same. A visit that
    computes nothing fetches no rows (its rows word is 0), so it waits on nothing: no condition around the page waits,
    whose regions the compiler predicates (a `pl.when(compute)` around them kept a branch region of the kernel's that
    the schedule did not have, and the performance model then counted both visit branches at every step)."""
    _, rows_ref, _, k_hbm, v_hbm, k_buf, v_buf, sems = refs
    k_hbm, v_hbm = _cache_view(k_hbm, layout), _cache_view(v_hbm, layout)
    for part in range(layout.parts):
        rows = rows_ref[step * layout.parts + part]
        for i in range(layout.pages_per_block):
            at = part * layout.pages_per_block + i

            @pl.when(_fetched(i, rows, layout))
            def _():
                for src, dst in _page_copies(k_hbm.at[0], k_buf.at[slot, at], layout):
                    pltpu.make_async_copy(src, dst, sems.at[slot, 0]).wait()
                for src, dst in _page_copies(v_hbm.at[0], v_buf.at[slot, at], layout):
                    pltpu.make_async_copy(src, dst, sems.at[slot, 1]).wait()


def _pair_words_in_place(layout: Layout) -> bool:
    """Whether the caches are read through a uint32 view of their HBM refs (Layout.pair_word_pages, on the chip)."""
    return layout.pair_word_pages and not interpret_mode_forced()


def _cache_view(hbm, layout: Layout):
    """A cache's HBM ref as its pages are copied: [pages, page_size, 1, D] uint32 pair words where
    _pair_words_in_place (a token's two bf16 heads one 32-bit word a lane: the same bytes), else as passed."""
    return hbm.bitcast(jnp.uint32) if _pair_words_in_place(layout) else hbm


def _page_dtype(cache_dtype, layout: Layout):
    return jnp.dtype(jnp.uint32) if _pair_words_in_place(layout) else jnp.dtype(cache_dtype)


def _page_copies(page, slot, layout: Layout):
    """(source, destination) of the DMAs of one page (of _cache_view) into its page slot: the page whole, or each lane
    tile of the head dim apart where the buffer holds them apart (Layout.lane_chunks)."""
    if not layout.lane_chunks:
        return [(page, slot)]
    lanes = [pl.ds(c * LANES, LANES) for c in range(layout.lane_chunks)]
    if _pair_words_in_place(layout):  # [page_size, 1, D] words
        return [(page.at[:, 0, at], slot.at[c]) for c, at in enumerate(lanes)]
    if layout.pair_word_pages:  # interpret mode: [page_size, 2, D] bf16
        return [(page.at[:, :, at], slot.at[c]) for c, at in enumerate(lanes)]
    return [(page.at[:, at], slot.at[c]) for c, at in enumerate(lanes)]


def _packed(x, axis: int):
    """bf16 x's two rows along `axis` (of size 2) as 32-bit words, the first in the low halves."""
    low, high = (
        jax.lax.bitcast_convert_type(jax.lax.index_in_dim(x, h, axis, keepdims=False), jnp.uint16).astype(jnp.uint32)
        for h in (0, 1)
    )
    return low | (high << 16)


def _rows_of_sequence(word, block, cu_ref, lay: Layout, row):
    """Which rows of the query block (row: int32 [R, 1], each row's row within the block) hold the visit's sequence:
    row r is token first_token + r // group, multiplied through by the group (no vector division)."""
    seq, _ = _split_block(block, lay)
    first_token = (word & schedule.QUERY_BLOCK_MASK) * lay.block_q
    return (row >= lay.group * (cu_ref[seq] - first_token)) & (row < lay.group * (cu_ref[seq + 1] - first_token))


def narrow_visits(lay: Layout) -> bool:
    """Whether the visits that take one kv head at a time are also compiled for a narrow window of rows (NARROW_ROWS):
    prefill-sized query blocks, in which a decode token's rows are a few of many."""
    return lay.block_rows >= 4 * NARROW_ROWS and lay.block_rows % NARROW_ROWS == 0


def _narrow_window(word, block, cu_ref, lay: Layout):
    """(fits, first row): whether the visit's sequence's rows in its query block lie within the aligned window of
    NARROW_ROWS rows that starts at `first row`."""
    seq, _ = _split_block(block, lay)
    first_token = (word & schedule.QUERY_BLOCK_MASK) * lay.block_q
    start = lay.group * jnp.maximum(cu_ref[seq] - first_token, 0)
    end = lay.group * jnp.minimum(cu_ref[seq + 1] - first_token, lay.block_q)
    first_row = jnp.minimum(start & -NARROW_ROWS, lay.block_rows - NARROW_ROWS)  # aligned down (a power of two)
    return end <= first_row + NARROW_ROWS, first_row


def _keep(word, block, kv_lens_ref, cu_ref, lay: Layout, row, key):
    """The kept scores of a masked visit, [block rows, block keys]: rows of the visit's sequence, keys within the row's
    causal / window range and the context. Row r is token first_token + r // group at context position token +
    kv_len - q_end; the bounds are multiplied through by the group so that no vector division is needed:
    token <= X  <=>  r < group * (X - first_token + 1)  and  token >= Y  <=>  r >= group * (Y - first_token).
    row: int32 [R, 1], each score row's row within the query block; key: int32 [1, K], each score column's key within
    the key block."""
    left, right = lay.window_size
    g, bk = lay.group, lay.block_kv
    seq, block_in_seq = _split_block(block, lay)
    q_end, kv_len = cu_ref[seq + 1], kv_lens_ref[seq]
    first_token = (word & schedule.QUERY_BLOCK_MASK) * lay.block_q
    first_key = block_in_seq * bk
    shift = kv_len - q_end  # a row's position minus its token index
    keep = _rows_of_sequence(word, block, cu_ref, lay, row)
    diagonal = row - g * key
    if left >= 0:  # key >= position - left  <=>  token <= key - shift + left
        keep = keep & (diagonal < g * (first_key - shift + left - first_token + 1))
    if right >= 0:  # key <= position + right  <=>  token >= key - shift - right
        keep = keep & (diagonal >= g * (first_key - shift - right - first_token))
    if right != 0:  # key < kv_len (implied by the causal bound for rows of the sequence)
        keep = keep & (key < kv_len - first_key)
    return keep


def _kernel(
    words_ref,
    kv_blocks_ref,
    rows_ref,
    pages_ref,
    count_ref,
    kv_lens_ref,
    cu_ref,
    *refs,
    layout: Layout,
    compute_dtype,
    has_sinks: bool,
):
    if layout.scales is None:  # traced scales: an SMEM operand; static ones are constants
        scales_ref, q_ref, *refs = refs
        k_scale, v_scale = scales_ref[0], scales_ref[1]
    else:
        (k_scale, v_scale), (q_ref, *refs) = layout.scales, refs
    if has_sinks:
        sinks_ref, *refs = refs
    k_hbm, v_hbm, out_ref, k_buf, v_buf, sems, q_scaled_ref, m_ref, l_ref, acc_ref = refs
    if widen_factor(k_buf.dtype) != 1.0 and not layout.float8_operands:  # widened K and V are the values over it, a
        # power of two: the scales take it
        k_scale, v_scale = k_scale * widen_factor(k_buf.dtype), v_scale * widen_factor(v_buf.dtype)
    lay = layout
    d, dv, bk = lay.head_dim, lay.v_head_dim, lay.block_kv
    step = pl.program_id(0)  # the step's visits: list entries step * parts + part
    count = count_ref[0]
    slot = step & 1
    dma_refs = (kv_blocks_ref, rows_ref, pages_ref, k_hbm, v_hbm, k_buf, v_buf, sems)

    def computes(step):
        return functools.reduce(
            jnp.logical_or, [(words_ref[step * lay.parts + p] & schedule.COMPUTE) != 0 for p in range(lay.parts)]
        )

    # The first step fetches its own pages; every step fetches the next one's, which then arrive during this one.
    pl.when((step == 0) & computes(step))(lambda: _start(step, slot, dma_refs, lay))
    following = jnp.minimum(step + 1, words_ref.shape[0] // lay.parts - 1)
    pl.when((step + 1 < count) & computes(following))(lambda: _start(following, 1 - slot, dma_refs, lay))

    @pl.when((words_ref[step * lay.parts] & schedule.FIRST) != 0)
    def _init():
        # scores in log2 units: q scaled once per query block by softmax_scale * k_scale * log2(e) (by
        # softmax_scale * k_scale / softcap under a softcap, whose tanh comes first)
        factor = lay.softmax_scale / lay.softcap if lay.softcap > 0 else lay.softmax_scale * LOG2_E
        for j in range(lay.kv_heads):  # the group's query heads of one token are consecutive rows
            q = q_ref[:, pl.ds(j * lay.group, lay.group), :].astype(jnp.float32).reshape(lay.block_rows, d)
            q_scaled_ref[j] = (q * (factor * k_scale)).astype(q_scaled_ref.dtype)
        m_ref[...] = jnp.full(m_ref.shape, MAX_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    _wait(step, slot, dma_refs, lay)

    def to_compute(x):
        """A block in the compute dtype: widened (`widen`), or where float8 blocks mostly stay as stored, the few that
        do not cast as they are (no e4m3b11 reading: its power of two is not in the scales then)."""
        return x.astype(compute_dtype) if lay.float8_operands else widen(x, compute_dtype)

    def block_of(buf, pages, j, width, *, as_stored=False):
        x = buf[slot, pages, j] if lay.head_major else buf[slot, pages, :, j, :]
        return (x if as_stored else to_compute(x)).reshape(bk, width)

    def head_pair_words(buf, buffer_slot: int, part, pair: int):
        """Kv heads 2 pair and 2 pair + 1 of the visit's page buffer (rows, token-major, kv heads minor) as 32-bit words
        [block_kv, head_dim], head 2 pair in the low halves. Mosaic strided-loads 32-bit rows only, so the buffer is
        read through a uint32 view (a word holds rows 2i and 2i + 1, the even row in its low half): every
        (kv_heads / 2)-th word row is one token's pair, a sublane-strided load (from a static page buffer slot, as
        Mosaic lowers them). TPU interpret mode cannot read through a ref bitcast: there the same words are packed from
        the two heads' bf16 rows, each read with a stride. With 2 kv heads every word is a token's pair: the buffer's
        rows bitcast whole in registers (passed as rows), or its words loaded as they lie (Layout.pair_word_pages)."""
        pages = pl.ds(part * lay.pages_per_block, lay.pages_per_block)
        if lay.kv_heads == 2 and not lay.pair_word_pages:  # rows passed as rows: the buffer bitcast whole to words
            return pltpu.bitcast(buf[slot, pages].reshape(2 * bk, buf.shape[-1]), jnp.uint32)

        def tile(c):
            if lay.pair_word_pages:  # plain rows of words, one a token (interpret mode: packed from both heads)
                words = buf[slot, pages, c] if _pair_words_in_place(lay) else _packed(buf[slot, pages, c], axis=2)
            elif interpret_mode_forced():
                halves = [
                    buf[buffer_slot, pages, c, pl.ds(2 * pair + h, lay.page_size, stride=lay.kv_heads), :]
                    for h in (0, 1)
                ]
                words = _packed(jnp.stack(halves, axis=2), axis=2)
            else:
                rows = pl.ds(pair, lay.page_size, stride=lay.kv_heads // 2)
                words = buf.bitcast(jnp.uint32)[buffer_slot, pages, c, rows, :]
            return words.reshape(bk, LANES)

        tiles = [tile(c) for c in range(lay.lane_chunks)]
        return tiles[0] if len(tiles) == 1 else jnp.concatenate(tiles, axis=1)  # the lane tiles side by side

    def word_half(words, j: int):
        """Head j's bf16 values out of its pair's words (head_pair_words), exact, as compute_dtype."""
        bits = words & jnp.uint32(0xFFFF0000) if j % 2 else words << 16
        return pltpu.bitcast(bits, jnp.float32).astype(compute_dtype)

    split = splits_words(
        merged=lay.merged,
        merged_view=lay.merged_view,
        cache_itemsize=max(k_buf.dtype.itemsize, v_buf.dtype.itemsize),
        block_kv=bk,
    )

    # a decode-like block's few rows a head: every head's scores live at once is the merged visit's score rows at most
    scores_first = (split or lay.head_major) and lay.kv_heads * lay.block_rows <= MERGED_ROWS

    def accumulate(masked: bool, visit, word, part: int, buffer_slot: int | None = None, narrow: bool = False):
        """One visit, one kv head at a time: every row of the query block, or (narrow) the NARROW_ROWS rows of the
        aligned window that holds the visit's sequence's rows."""
        n_rows, first_row = lay.block_rows, 0
        if narrow:
            n_rows = NARROW_ROWS
            first_row = pl.multiple_of(_narrow_window(word, kv_blocks_ref[visit], cu_ref, lay)[1], NARROW_ROWS)
        at = pl.ds(first_row, n_rows)
        row = first_row + jax.lax.broadcasted_iota(jnp.int32, (n_rows, 1), 0)
        pages = pl.ds(part * lay.pages_per_block, lay.pages_per_block)
        if split:  # every head's rows at once, split per head from their words (their keys in _split_order)
            v_rows = v_buf[slot, pages].reshape(bk * lay.kv_heads, dv)
            if masked:  # as words, one token each, before the split
                v_rows = _zero_unfetched(v_rows, 0, rows_ref[visit], lay.kv_heads)
            k_heads = _split_heads(k_buf[slot, pages].reshape(bk * lay.kv_heads, d))
            v_heads = _split_heads(v_rows)
            key = _split_order((1, bk), 1)
        else:
            key = jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        if masked:
            keep = _keep(word, kv_blocks_ref[visit], kv_lens_ref, cu_ref, lay, row, key)
            rows = rows_ref[visit]
            key_rows = jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            fetched = (key_rows >= (rows & schedule.ROW_MASK)) & (key_rows < (rows >> schedule.ROW_BITS))
        else:  # every key kept for the sequence's rows; other sequences' rows keep their statistics
            ours = _rows_of_sequence(word, kv_blocks_ref[visit], cu_ref, lay, row)

        pair_words = []  # the strided visits' words of the current pair of heads, K and V

        def scores_of(j):
            if split:
                k, v = k_heads[j], v_heads[j]  # their unfetched rows zeroed as words, before the split
                if not lay.float8_operands:
                    k, v = to_compute(k), to_compute(v)
            elif lay.strided_heads:
                # a pair's words serve both of its heads; pair words loaded as they lie are loaded again for the
                # second (plain loads: cheaper than keeping the visit's words in VMEM for it)
                if j % 2 == 0 or lay.pair_word_pages:
                    pair_words[:] = [head_pair_words(buf, buffer_slot, part, j // 2) for buf in (k_buf, v_buf)]
                k, v = (word_half(words, j) for words in pair_words)
                if masked:
                    v = jnp.where(fetched, v, jnp.zeros_like(v))
            else:
                k = block_of(k_buf, pages, j, d, as_stored=lay.float8_operands)
                v = block_of(v_buf, pages, j, dv)  # widened: its unfetched rows are zeroed by rows
                if masked:
                    v = jnp.where(fetched, v, jnp.zeros_like(v))
            s = dot_nt(q_scaled_ref[j, at], k)
            if lay.softcap > 0:
                s = jnp.tanh(s) * (lay.softcap * LOG2_E)
            if masked:
                s = jnp.where(keep, s, -jnp.inf)
            return s, v

        def update(j, s, v):
            m_prev, l_prev, acc_prev = m_ref[j, at], l_ref[j, at], acc_ref[j, at]
            m_new = jnp.maximum(m_prev, row_stat(jnp.max(s, axis=1, keepdims=True)))
            p = jnp.exp2(s - lanes(m_new, bk))
            alpha = jnp.exp2(m_prev - m_new)
            l_new = alpha * l_prev + row_stat(jnp.sum(p, axis=1, keepdims=True))
            acc_new = acc_prev * lanes(alpha, dv) + dot_nn(p.astype(compute_dtype), v)
            if not masked:
                m_new = jnp.where(ours, m_new, m_prev)
                l_new = jnp.where(ours, l_new, l_prev)
                acc_new = jnp.where(ours, acc_new, acc_prev)
            m_ref[j, at], l_ref[j, at], acc_ref[j, at] = m_new, l_new, acc_new

        if scores_first:  # every head's scores, then every head's softmax and P V: the MXU takes the next head's
            # keys while the vector units reduce this head's scores (head by head, each head's chain waits on the last)
            for j, (s, v) in enumerate([scores_of(j) for j in range(lay.kv_heads)]):
                update(j, s, v)
        else:  # one head's scores live at a time (prefill blocks: kv_heads x their rows x the key block)
            for j in range(lay.kv_heads):
                update(j, *scores_of(j))

    def accumulate_merged(masked: bool, visit, word, part: int):
        # Every kv head at once: score row (head h, row r) against key column (token t, head h') is kept only where
        # h' == h, so the cross-head scores cost vector work but the page buffer is read whole (no per-head sublane
        # gathers: rows of a merged_view buffer, or [pages, page_size, kv_heads, D] reshaped to rows in registers)
        # and K / V pass through the MXU once. A key block of up to MERGED_TOKENS tokens is one piece
        # (one online-softmax step; chunks of 256 tokens with the statistics carried across them model slower: the
        # chain of dependent steps is the visit's time), a larger one goes in chunks.
        hkv, rows_per_head = lay.merged, lay.block_rows  # kv heads a piece: all, or pairs
        n_rows = hkv * rows_per_head
        if bk <= MERGED_TOKENS:
            tokens = bk  # one piece
        else:
            tokens = MERGED_TOKENS if bk % MERGED_TOKENS == 0 else min(MERGED_TOKENS, lay.page_size)
        row = jax.lax.broadcasted_iota(jnp.int32, (n_rows, 1), 0)
        row_head = sum((row >= h * rows_per_head).astype(jnp.int32) for h in range(1, hkv))
        col = jax.lax.broadcasted_iota(jnp.int32, (1, tokens * hkv), 1)
        same_head = row_head == (col & (hkv - 1))
        for g in range(lay.kv_heads // hkv):
            merged_piece(masked, visit, word, part, pl.ds(g * hkv, hkv), hkv, tokens, row, row_head, col, same_head)

    def merged_piece(masked, visit, word, part, heads, hkv, tokens, row, row_head, col, same_head):
        """One online-softmax step of the query rows of `heads` (hkv consecutive kv heads) against their keys."""
        rows_per_head, cols, shift = lay.block_rows, tokens * hkv, hkv.bit_length() - 1
        n_rows = hkv * rows_per_head
        rows, block = rows_ref[visit], kv_blocks_ref[visit]
        q = q_scaled_ref[heads].reshape(n_rows, d)
        m0 = m = m_ref[heads].reshape(n_rows, LANES)
        l0 = l = l_ref[heads].reshape(n_rows, LANES)
        acc0 = acc = acc_ref[heads].reshape(n_rows, dv)
        for c in range(bk // tokens):
            first = c * tokens
            page = part * lay.pages_per_block + first // lay.page_size  # the visit's page slots
            if tokens >= lay.page_size:
                at = (slot, pl.ds(page, tokens // lay.page_size), slice(None))
            elif lay.merged_view:
                at = (slot, page, pl.ds((first % lay.page_size) * hkv, cols))
            else:
                at = (slot, page, pl.ds(first % lay.page_size, tokens))
            if hkv < lay.kv_heads:  # a pair of the buffer's heads, [pages, page_size, kv_heads, D] as it lies
                at = (*at, heads)
            k = k_buf[at].reshape(cols, d)
            v = v_buf[at].reshape(cols, dv)
            # float8 operands stay as stored where V's unfetched rows can be zeroed as 32-bit words (whole tokens)
            v_as_stored = lay.float8_operands and hkv % (4 // v.dtype.itemsize) == 0
            if not lay.float8_operands:
                k = to_compute(k)
            if not v_as_stored:
                v = to_compute(v)
            keep = same_head
            if masked:
                key = first + (col >> shift)
                keep = keep & _keep(word, block, kv_lens_ref, cu_ref, lay, row - row_head * rows_per_head, key)
                v = _zero_unfetched(v, first, rows, hkv)
            s = dot_nt(q, k)
            if lay.softcap > 0:
                s = jnp.tanh(s) * (lay.softcap * LOG2_E)
            s = jnp.where(keep, s, -jnp.inf)
            m_new = jnp.maximum(m, row_stat(jnp.max(s, axis=1, keepdims=True)))
            p = jnp.exp2(s - lanes(m_new, cols))
            alpha = jnp.exp2(m - m_new)
            l = alpha * l + row_stat(jnp.sum(p, axis=1, keepdims=True))
            acc = acc * lanes(alpha, dv) + dot_nn(p.astype(compute_dtype), v)
            m = m_new
        if not masked:  # every key kept for the sequence's rows; other sequences' rows keep their statistics
            ours = _rows_of_sequence(word, block, cu_ref, lay, row - row_head * rows_per_head)
            m, l, acc = jnp.where(ours, m, m0), jnp.where(ours, l, l0), jnp.where(ours, acc, acc0)
        m_ref[heads] = m.reshape(hkv, rows_per_head, LANES)
        l_ref[heads] = l.reshape(hkv, rows_per_head, LANES)
        acc_ref[heads] = acc.reshape(hkv, rows_per_head, dv)

    accumulate_visit = accumulate_merged if lay.merged and not split else accumulate
    # then each visit runs narrow where its rows fit the window, else whole
    narrow_too = narrow_visits(lay) and accumulate_visit is accumulate
    for part in range(lay.parts):  # the step's visits in order (one query block's; a visit updates its rows)
        visit = step * lay.parts + part
        word = words_ref[visit]
        compute, masked = (word & schedule.COMPUTE) != 0, (word & schedule.MASKED) != 0
        fits = _narrow_window(word, kv_blocks_ref[visit], cu_ref, lay)[0] if narrow_too else None
        # each head's strided load from a static page buffer slot: the visit compiled per slot
        for buffer_slot in (0, 1) if lay.strided_loads else (None,):
            on_slot = compute if buffer_slot is None else compute & (slot == buffer_slot)
            for narrow in (False, True) if narrow_too else (False,):
                runs = on_slot & (fits if narrow else ~fits) if narrow_too else on_slot
                options = {} if accumulate_visit is accumulate_merged else dict(buffer_slot=buffer_slot, narrow=narrow)
                pl.when(runs & masked)(functools.partial(accumulate_visit, True, visit, word, part, **options))
                pl.when(runs & ~masked)(functools.partial(accumulate_visit, False, visit, word, part, **options))

    @pl.when((words_ref[step * lay.parts + lay.parts - 1] & schedule.LAST) != 0)
    def _finalize():
        for j in range(lay.kv_heads):
            m, l = m_ref[j], l_ref[j]
            if has_sinks:
                sink = sinks_ref[j] * LOG2_E
                m_final = jnp.maximum(m, sink)
                rescale = jnp.exp2(m - m_final)
                l = l * rescale + jnp.exp2(sink - m_final)
            else:
                rescale = 1.0
            nonzero = l > 0
            inv = jnp.where(nonzero, rescale * v_scale / jnp.where(nonzero, l, 1.0), 0.0)
            out = acc_ref[j] * lanes(inv, dv)
            out_ref[:, pl.ds(j * lay.group, lay.group), :] = out.reshape(lay.block_q, lay.group, dv).astype(
                out_ref.dtype
            )


def _page_slot(page_shape, layout: Layout) -> tuple:
    """The shape of one page slot of a page buffer: the page's, or [lane tiles, rows, 128] (Layout.lane_chunks;
    pair words: [lane tiles, page_size, 128] words, in interpret mode [lane tiles, page_size, 2, 128] bf16)."""
    if not layout.lane_chunks:
        return tuple(page_shape)
    if layout.pair_word_pages:
        rows, heads, width = page_shape
        return (width // LANES, rows, LANES) if _pair_words_in_place(layout) else (width // LANES, rows, heads, LANES)
    rows, width = page_shape
    return (width // LANES, rows, LANES)


def paged_attention(
    q_rows,
    k_pages,
    v_pages,
    words,
    kv_blocks,
    rows,
    pages,
    count,
    kv_lens,
    cu_q_lens,
    scales,
    sinks,
    *,
    layout,
    vmem_limit_bytes,
):
    """out [tokens, q_heads, Dv] in q's dtype. q_rows [tokens, q_heads, D] (tokens padded to whole blocks); k_pages /
    v_pages [pages, page_size, kv_heads, D / Dv] ([pages, kv_heads, page_size, D / Dv] where layout.head_major);
    words, kv_blocks, rows: the visit lists, count int32 [>= 1] their length, kv_lens [N] / cu_q_lens [N + 1] the
    clamped metadata they were built from (schedule.visits); pages [seqs * pages_per_seq] int32; scales [2] f32 (k, v)
    where layout.scales is None (traced scales), else None; sinks None or [kv_heads, block_q * group, 128] f32 (the
    sink logit of each row of a query block, lane-replicated)."""
    lay = layout
    hkv, rows_per_block = lay.kv_heads, lay.block_rows
    compute_dtype = q_rows.dtype

    def q_map(step, words_ref, *_):
        return words_ref[step * lay.parts] & schedule.QUERY_BLOCK_MASK, 0, 0

    in_specs = [pl.BlockSpec((lay.block_q, lay.q_heads, lay.head_dim), q_map)]
    operands = [q_rows]
    if lay.scales is None:  # traced scales
        in_specs.insert(0, pl.BlockSpec(memory_space=pltpu.SMEM))
        operands.insert(0, scales)
    if sinks is not None:  # the same pattern of heads in every query block
        in_specs.append(pl.BlockSpec((hkv, rows_per_block, LANES), lambda v, *_: (0, 0, 0)))
        operands.append(sinks)
    in_specs += [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    operands += [k_pages, v_pages]
    kernel = functools.partial(_kernel, layout=lay, compute_dtype=compute_dtype, has_sinks=sinks is not None)
    size = words.shape[0]
    kv_bytes = (lay.head_dim + lay.v_head_dim) * hkv * lay.block_kv * k_pages.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * lay.q_heads * lay.block_q * lay.block_kv * (lay.head_dim + lay.v_head_dim) * size,
        transcendentals=lay.q_heads * lay.block_q * lay.block_kv * size,
        bytes_accessed=kv_bytes * size + 2 * q_rows.size * q_rows.dtype.itemsize,
    )
    prefetch = (words, kv_blocks, rows, pages, count, kv_lens, cu_q_lens)
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((lay.tokens, lay.q_heads, lay.v_head_dim), q_rows.dtype, prefetch, operands),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(count[0],),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((lay.block_q, lay.q_heads, lay.v_head_dim), q_map),
            scratch_shapes=[
                pltpu.VMEM(
                    (2, lay.parts * lay.pages_per_block, *_page_slot(k_pages.shape[1:], lay)),
                    _page_dtype(k_pages.dtype, lay),
                ),
                pltpu.VMEM(
                    (2, lay.parts * lay.pages_per_block, *_page_slot(v_pages.shape[1:], lay)),
                    _page_dtype(v_pages.dtype, lay),
                ),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((hkv, rows_per_block, lay.head_dim), compute_dtype),
                pltpu.VMEM((hkv, rows_per_block, LANES), jnp.float32),
                pltpu.VMEM((hkv, rows_per_block, LANES), jnp.float32),
                pltpu.VMEM((hkv, rows_per_block, lay.v_head_dim), jnp.float32),
            ],
        ),
        # Every access is in bounds by construction (page indices clamped to the cache, table entries read only for
        # fetched pages, slots 0 / 1): Mosaic's runtime checks of each page DMA were a quarter of a decode visit.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit_bytes, disable_bounds_checks=True
        ),
        cost_estimate=cost,
        name="ragged_paged_attention",
    )(*prefetch, *operands)
