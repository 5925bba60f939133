"""Pallas TPU kernel writing new tokens' K/V rows into a paged KV cache in place, optionally with RoPE applied to the
new K (and Q; cos/sin from positions, or each token's cos/sin rows given) and fp8 quantisation on the way.

The caches stay in HBM (`memory_space=pl.ANY`) and are aliased input -> output, so the kernel never reads or copies
them: it only writes the named rows. The cache is seen flat, [num_pages * page_size, kv_heads, head_dim] (merging
the leading dims is a bitcast in XLA's layouts), so a slot is a row index and no page arithmetic runs in the kernel.
The slot mapping sits in SMEM (scalar prefetch). Grid: (1, token blocks); each step gets a block of new tokens' K/V
(and Q) in VMEM from Pallas' pipeline, stages the rows it transforms (RoPE, fp8) in VMEM scratch of the cache dtype,
then starts one DMA per token per cache from VMEM to the token's slot and waits for them before the step ends (the
block buffers are reused by the step after next). Tokens whose slot is negative or past the cache are skipped: the
kernel never writes outside the cache, whatever the slot values.

Float8 caches of 1 or 2 kv heads, which XLA lays out head-major (head_major_cache), are passed as
[pages, kv_heads, page_size, D] (the same bytes; unless the caller made them row-major, KVCacheBlocks): a row there
shares its 32-bit words with three other page offsets, so each token's word group is read, merged and written back
(_head_major_writes) instead of a row DMA.

The grid's first axis is a single step: the rotary kernel's positions helpers (reused here) read the token block
index from grid axis 1.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.index_math import div_nonnegative as _div
from ..common.index_math import rem_nonnegative as _rem
from ..common.manual_axes import out_struct
from ..rotary import kernel as rotary_kernel
from ..rotary.tuning import RotaryBlocks
from .tuning import KVCacheBlocks

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)


@dataclasses.dataclass(frozen=True)
class WriteConfig:
    """Static facts of one kernel call."""

    tokens: int  # new tokens T (rows of key / value / slot_mapping)
    num_slots: int  # rows of the flattened cache: num_pages * page_size
    quantize: tuple[bool, bool]  # (K, V): the cache is fp8, rows are scaled and rounded before their DMA
    # RoPE of K (and Q), fused: from positions (rope.from_positions) or from each token's cos/sin rows
    rope: rotary_kernel.RopeConfig | None = None
    positions: rotary_kernel.PositionsLayout | None = None
    rope_query: bool = True  # with rope: a query is rotated too (its own input and output)
    page_size: int = 0  # > 0: float8 caches passed head-major, [pages, kv_heads, page_size, D] (head_major_cache)


# A float8 cache's rows are packed four to a 32-bit word (XLA's tiling (4,1) of the page offset): the smallest unit
# a DMA writes, so a token's row is merged into its word group in VMEM (read-modify-write) in the head-major layout.
ROWS_PER_WORD = 4


# The flat layout's issue loop, unrolled this many tokens deep.
ISSUE_UNROLL = 8

# The head-major path's token blocks are whole float8 tiles of the staging buffer (32 rows).
HEAD_MAJOR_TOKENS = 32


def head_major_cache(*, hkv: int, page_size: int, cache_itemsize: int) -> bool:
    """Whether XLA lays caches [pages, page_size, kv_heads, D] out head-major, `{3,1,2,0}` (float8 with 1 or 2 kv
    heads, whose token rows would fill a quarter or half of a float8 tile): each head's page a contiguous
    (page_size, D) block, tiled (8 or 32, 128) with four page offsets packed in a 32-bit word. The api then passes them
    as [pages, kv_heads, page_size, D], the same bytes (no copy in the program). Pages of whole 8-row tiles."""
    return cache_itemsize == 1 and hkv <= 2 and page_size % 8 == 0


def _quantized(x, inv_scale):
    """x * (1 / scale), saturated to e4m3fn's largest finite value (an overflowing cast would be NaN), rounded."""
    return jnp.clip(x.astype(jnp.float32) * inv_scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def _head_major_writes(
    slots_ref, k_stage, v_stage, k_cache, v_cache, groups, byte_rows, table, lead, sems, *, cfg, bt, base
):
    """Each token's K and V rows (float8, staged head-major [H, bt, D]) merged into the word group of its slot (the
    four page offsets sharing its 32-bit words, the smallest unit a DMA writes) and written back. The groups are read
    from the caches, every head's in one strided DMA, into rows 4t..4t+3 of [H, 4 bt, D] buffers; each row's bytes
    (unpacked once a step into the low bits of 32-bit words, byte_rows) are merged into its group's word in VMEM; the
    groups are written back. Tokens of one group (consecutive slots) share the first one's buffer rows (its leader,
    found in a hash table of the step's groups in SMEM), so a group is read and written once a step and no two DMAs
    of a step race; the steps run in order (a group may span two blocks)."""
    page = cfg.page_size
    size = table.shape[0] // 2
    heads = k_stage.shape[0]
    caches = ((k_stage, k_cache, groups[0], 0), (v_stage, v_cache, groups[1], 1))
    tile = 8 * ROWS_PER_WORD  # float8 rows of a (8, 128) int32 tile

    def slot_of(t):
        token = base + t
        slot = slots_ref[jnp.minimum(token, cfg.tokens - 1)]
        return slot, (token < cfg.tokens) & (slot >= 0) & (slot < cfg.num_slots)

    def group_copies(t, reading):
        slot, _ = slot_of(t)
        p = _div(slot, page)
        first = pl.multiple_of(_div(_rem(slot, page), ROWS_PER_WORD) * ROWS_PER_WORD, ROWS_PER_WORD)
        row = pl.multiple_of(t * ROWS_PER_WORD, ROWS_PER_WORD)
        for _, hbm, buf, c in caches:  # every head's group in one (strided) DMA
            ends = (hbm.at[p, :, pl.ds(first, ROWS_PER_WORD)], buf.at[:, pl.ds(row, ROWS_PER_WORD)])
            yield pltpu.make_async_copy(*(ends if reading else ends[::-1]), sems.at[c])

    def clear(i, carry):
        table[i] = -1
        return carry

    jax.lax.fori_loop(0, size, clear, 0)

    def find(t, carry):
        slot, valid = slot_of(t)
        lead[t] = -1

        @pl.when(valid)
        def _():
            group = _div(slot, ROWS_PER_WORD)
            i = jax.lax.while_loop(
                lambda i: (table[i] != -1) & (table[i] != group), lambda i: _rem(i + 1, size), _rem(group, size)
            )

            @pl.when(table[i] == -1)
            def _():
                table[i] = group
                table[size + i] = t
                for copy in group_copies(t, True):
                    copy.start()

            lead[t] = table[size + i]

        return carry

    def each_leader(reading, method):
        def body(t, carry):
            @pl.when(lead[t] == t)
            def _():
                for copy in group_copies(t, reading):
                    getattr(copy, method)()

            return carry

        jax.lax.fori_loop(0, bt, body, 0)

    def words(ref, h, row):
        """The (8, 128)-tiled 32-bit words of the float8 tile holding `row` of ref[h], and that tile's first row."""
        start = pl.multiple_of(_div(row, tile) * tile, tile)
        return pltpu.bitcast(ref[h, pl.ds(start, tile)], jnp.int32), start

    def merge(t, carry):
        leader = lead[t]

        @pl.when(leader >= 0)
        def _():
            slot, _ = slot_of(t)
            into = _rem(slot, ROWS_PER_WORD) * 8
            mask = jnp.left_shift(jnp.int32(255), into)
            dest = leader * ROWS_PER_WORD  # the group's first row in the buffer
            for (_, _, buf, _), staged in zip(caches, byte_rows):
                for h in range(heads):
                    byte = staged[h, _rem(t, ROWS_PER_WORD), pl.ds(_div(t, ROWS_PER_WORD), 1)]
                    old, start = words(buf, h, dest)
                    sub = jax.lax.broadcasted_iota(jnp.int32, old.shape, 0)
                    merged = jnp.where(
                        sub == _div(_rem(dest, tile), ROWS_PER_WORD), (old & ~mask) | (byte << into), old
                    )
                    buf[h, pl.ds(start, tile)] = pltpu.bitcast(merged, buf.dtype)

        return carry

    jax.lax.fori_loop(0, bt, find, 0)
    # each token's row as bytes in the low bits of 32-bit words: byte_rows[c][h, k, i] holds token 4 i + k's row
    for stage, _, _, c in caches:
        for h in range(heads):
            packed = pltpu.bitcast(stage[h], jnp.int32)
            for k in range(ROWS_PER_WORD):
                byte_rows[c][h, k] = jnp.right_shift(packed, 8 * k) & 255
    each_leader(True, "wait")
    jax.lax.fori_loop(0, bt, merge, 0)
    each_leader(False, "start")
    each_leader(False, "wait")


def _kernel(slots_ref, *refs, cfg: WriteConfig, block_tokens: int):
    refs = list(refs)
    scales_ref = refs.pop(0) if any(cfg.quantize) else None
    rotates_query = cfg.rope is not None and cfg.rope_query
    if cfg.rope is not None:
        table_a, table_b = refs.pop(0), refs.pop(0)
        q_ref = refs.pop(0) if rotates_query else None
    k_ref, v_ref = refs.pop(0), refs.pop(0)
    refs.pop(0), refs.pop(0)  # the caches as inputs: aliased to the outputs, never read
    q_out_ref = refs.pop(0) if rotates_query else None
    k_cache, v_cache = refs.pop(0), refs.pop(0)
    k_stage = refs.pop(0) if (cfg.rope is not None or cfg.quantize[0]) else None
    v_stage = refs.pop(0) if cfg.quantize[1] else None
    if cfg.page_size:
        groups, byte_rows = (refs.pop(0), refs.pop(0)), (refs.pop(0), refs.pop(0))
        table, lead = refs.pop(0), refs.pop(0)
    sems = refs.pop(0)
    assert not refs

    key = None
    if cfg.rope is not None:
        rope = cfg.rope
        if rope.from_positions:  # table_a: positions (cfg.positions), table_b: inverse frequencies (1, W)
            pos = rotary_kernel._positions_column(table_a, cfg.positions)  # (1, bt, 1) f32
            cos, sin = rotary_kernel._cos_sin(pos, table_b[...], rope, cfg.positions.packing)
        else:  # each token's cos / sin rows, (1, bt, W)
            cos, sin = table_a[...].astype(jnp.float32), table_b[...].astype(jnp.float32)
        a, b = (t[:, :, None, :] for t in rotary_kernel._lane_factors(cos, sin, None, rope))  # (1, bt, 1, W)
        if rotates_query:
            q = q_ref[...][None].astype(jnp.float32)
            q_out_ref[...] = rotary_kernel._normed_rotation(q, a, b, None, None, rope)[0].astype(q_out_ref.dtype)
        # Rounded to the inputs' dtype first, as the unfused rope -> write would store it.
        key = rotary_kernel._normed_rotation(k_ref[...][None].astype(jnp.float32), a, b, None, None, rope)[0]
        key = key.astype(k_ref.dtype)
    base = pl.program_id(1) * block_tokens
    if cfg.page_size:  # head-major float8 caches: staged [H, bt, D], merged into word groups
        key = k_ref[...] if key is None else key
        value = v_ref[...]
        for h in range(k_stage.shape[0]):
            k_stage[h] = _quantized(key[:, h, :], scales_ref[0])
            v_stage[h] = _quantized(value[:, h, :], scales_ref[1])
        _head_major_writes(
            slots_ref,
            k_stage,
            v_stage,
            k_cache,
            v_cache,
            groups,
            byte_rows,
            table,
            lead,
            sems,
            cfg=cfg,
            bt=block_tokens,
            base=base,
        )
        return
    if cfg.quantize[0]:
        k_stage[...] = _quantized(k_ref[...] if key is None else key, scales_ref[0])
    elif key is not None:
        k_stage[...] = key.astype(k_stage.dtype)
    if cfg.quantize[1]:
        v_stage[...] = _quantized(v_ref[...], scales_ref[1])
    k_src = k_ref if k_stage is None else k_stage
    v_src = v_ref if v_stage is None else v_stage

    def copies(t, slot):
        return (
            pltpu.make_async_copy(k_src.at[t], k_cache.at[slot], sems.at[0]),
            pltpu.make_async_copy(v_src.at[t], v_cache.at[slot], sems.at[1]),
        )

    def slot_of(t):
        token = base + t
        slot = slots_ref[jnp.minimum(token, cfg.tokens - 1)]
        # Past the last token (a ragged last block), slot -1, or outside the cache: nothing is written.
        valid = (token < cfg.tokens) & (slot >= 0) & (slot < cfg.num_slots)
        return slot, valid

    def start(t, started):
        slot, valid = slot_of(t)

        @pl.when(valid)
        def _():
            for copy in copies(t, slot):
                copy.start()

        return started + valid.astype(jnp.int32)

    def wait(_, carry):
        # Every copy into one cache moves one row and signals that cache's semaphore, so any row's descriptor waits
        # for one of them: no slot is loaded or checked again here.
        for copy in copies(0, 0):
            copy.wait()
        return carry

    # Unrolled: the scalar unit overlaps one token's slot load (SMEM latency) with the checks and DMA issue of the
    # ones before it; the issue loop bounds the write (docs/kv_cache.md).
    started = jax.lax.fori_loop(0, block_tokens, start, jnp.int32(0), unroll=min(ISSUE_UNROLL, block_tokens))
    jax.lax.fori_loop(0, started, wait, 0)


def write(
    k_cache,
    v_cache,
    key,
    value,
    slot_mapping,
    inv_scales=None,
    *,
    cfg: WriteConfig,
    blocks: KVCacheBlocks,
    query=None,
    table_a=None,
    table_b=None,
):
    """One pallas_call: (query_rotated or None, k_cache, v_cache) with the rows written in place.

    k_cache / v_cache: flat [num_slots, kv_heads, D] / [num_slots, kv_heads, Dv]; key / value [T, kv_heads, D / Dv];
    slot_mapping [T] int32; inv_scales [2] f32 (1 / k_scale, 1 / v_scale) when a cache is fp8. With cfg.rope:
    query [T, Hq, D] (when cfg.rope_query) and the tables: from positions, table_a the positions as cfg.positions
    lays them out and table_b the inverse frequencies [1, W] f32 (the rotary kernel's); else table_a / table_b each
    token's cos / sin rows [1, T, W] (any float dtype, used in f32).
    """
    bt = blocks.block_tokens
    steps = pl.cdiv(cfg.tokens, bt)

    def token_block(x):
        return pl.BlockSpec((bt,) + x.shape[1:], lambda i, j, slots: (j, 0, 0))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i, j, slots: (0,) * x.ndim)

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    operands, in_specs = [], []
    if any(cfg.quantize):
        operands.append(inv_scales)
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    if cfg.rope is not None:
        if cfg.rope.from_positions:
            layout = cfg.positions
            if layout.mode == "column":
                pos_spec = pl.BlockSpec((1, bt, 1), lambda i, j, slots: (0, j, 0))
            elif layout.mode == "row_blocks":
                pos_spec = pl.BlockSpec((1, 1, bt), lambda i, j, slots: (0, 0, j))
            else:
                pos_spec = whole(table_a)
            table_specs = [pos_spec, whole(table_b)]
        else:
            rows = pl.BlockSpec((1, bt, table_a.shape[-1]), lambda i, j, slots: (0, j, 0))
            table_specs = [rows, rows]
        operands += [table_a, table_b]
        in_specs += table_specs
        if cfg.rope_query:
            operands.append(query)
            in_specs.append(token_block(query))
    operands += [key, value, k_cache, v_cache]
    in_specs += [token_block(key), token_block(value), hbm, hbm]
    cache_at = len(operands) - 2 + 1  # the scalar-prefetch slot mapping is operand 0

    out_shape, out_specs = [], []
    if cfg.rope is not None and cfg.rope_query:
        out_shape.append(out_struct(query.shape, query.dtype, slot_mapping, operands))
        out_specs.append(token_block(query))
    out_shape += [
        out_struct(k_cache.shape, k_cache.dtype, slot_mapping, operands),
        out_struct(v_cache.shape, v_cache.dtype, slot_mapping, operands),
    ]
    out_specs += [hbm, hbm]
    cache_out = len(out_shape) - 2

    scratch = []
    if cfg.page_size:
        heads, d, dv = k_cache.shape[1], k_cache.shape[3], v_cache.shape[3]
        scratch += [pltpu.VMEM((heads, bt, d), k_cache.dtype), pltpu.VMEM((heads, bt, dv), v_cache.dtype)]
        rows = ROWS_PER_WORD * bt  # each token's word group
        scratch += [pltpu.VMEM((heads, rows, d), k_cache.dtype), pltpu.VMEM((heads, rows, dv), v_cache.dtype)]
        quads = (heads, ROWS_PER_WORD, bt // ROWS_PER_WORD)
        scratch += [pltpu.VMEM(quads + (d,), jnp.int32), pltpu.VMEM(quads + (dv,), jnp.int32)]
        scratch += [pltpu.SMEM((2 * 2 * bt,), jnp.int32), pltpu.SMEM((bt,), jnp.int32)]  # hash table, leaders
    else:
        if cfg.rope is not None or cfg.quantize[0]:
            scratch.append(pltpu.VMEM((bt,) + k_cache.shape[1:], k_cache.dtype))
        if cfg.quantize[1]:
            scratch.append(pltpu.VMEM((bt,) + v_cache.shape[1:], v_cache.dtype))
    scratch.append(pltpu.SemaphoreType.DMA((2,)))

    row_bytes = sum(x.size * x.dtype.itemsize for x in (key, value))
    written = cfg.tokens * (key[0].size * k_cache.dtype.itemsize + value[0].size * v_cache.dtype.itemsize)
    if cfg.page_size:
        written *= 2 * ROWS_PER_WORD  # each row's word group read and written
    q_bytes = 0 if query is None else 2 * query.size * query.dtype.itemsize
    tables = cfg.rope is not None and not cfg.rope.from_positions
    table_bytes = 2 * table_a.size * table_a.dtype.itemsize if tables else 0
    cost = pl.CostEstimate(
        flops=0 if cfg.rope is None else 6 * (key.size + (0 if query is None else query.size)),
        transcendentals=0 if cfg.rope is None or tables else 2 * cfg.tokens * table_b.shape[-1],
        bytes_accessed=row_bytes + written + q_bytes + table_bytes + slot_mapping.size * 4,
    )
    outs = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, block_tokens=bt),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1, steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        input_output_aliases={cache_at: cache_out, cache_at + 1: cache_out + 1},
        compiler_params=pltpu.CompilerParams(
            # head-major: a word group may be shared by tokens of two blocks, so the blocks run in order
            dimension_semantics=("parallel", "arbitrary" if cfg.page_size else "parallel"),
            vmem_limit_bytes=blocks.vmem_limit_bytes,
            # The flat layout's copies run only under their token's validity (a token of the call, a slot in the
            # cache), so Mosaic's own check of each copy is redundant there, and it was most of the scalar unit's
            # work, which issues the copies and bounds the write (docs/kv_cache.md). The head-major layout keeps it.
            disable_bounds_checks=not cfg.page_size,
        ),
        cost_estimate=cost,
        name="rope_and_write_kv_cache" if cfg.rope is not None else "write_kv_cache",
    )(slot_mapping, *operands)
    if cfg.rope is not None and cfg.rope_query:
        return outs[0], outs[1], outs[2]
    return None, outs[0], outs[1]


def rope_blocks(blocks: KVCacheBlocks) -> RotaryBlocks:
    """The rotary kernel's view of a token block (what its positions helpers read)."""
    return RotaryBlocks(block_batch=1, block_seq=blocks.block_tokens, broadcast_loads=False)
