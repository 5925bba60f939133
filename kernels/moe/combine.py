"""The grouped path's combine as a Pallas kernel: out[t] = sum_j rows[position[t * k + j]], summed in f32.

`rows` [R, H] are the down projection's weighted rows in expert order (HBM, never copied); `position` [T * k] names
the row of each (token, slot) pair. XLA's gather of those rows runs at ~34 ns a row on the v5e (a scalar loop of
row copies: 1.12 ms for Qwen3's 32,768 rows at 4096 tokens, about 6x the bytes' time). Here each grid step takes a
block of tokens: one DMA per pair copies its row from HBM into VMEM, the next block's copies start before this
block's are waited for (two buffers), and the block's k rows a token are summed in f32. The copies are issued by the
scalar unit, one a row, which bounds the kernel: the row indices are clamped to the rows before the kernel (one XLA
elementwise op), the kernel runs without Mosaic's per-copy bounds check, and the buffer holds 8-row groups so that a
copy's destination is a static row (compiled for the v5e: 8 bundles a copy, against 26 with the check and the index
arithmetic of a dynamic row; measured 442 us against 878 for Qwen3's 32,768 rows, at 11 bundles a copy).

Rows of 16-bit dtypes are packed two to a 32-bit word in HBM (XLA's (2, 1) sublane packing: word row i holds rows 2i
and 2i + 1), and Mosaic slices such an array only at whole tiles. So on a chip the rows are read through a uint32
view of the array, one word row a pair (the row and its neighbour: twice the bytes), and the row's half is taken by a
shift (low half: the even row) into the high half of an f32 bit pattern, exact for bf16. TPU interpret mode cannot
read through a ref bitcast: there each row is copied as it is (no packing to respect), the same values. 32-bit rows
are copied as they are everywhere.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import sublane_multiple
from ..common.index_math import rem_nonnegative
from ..common.interpret import interpret_mode_forced
from ..common.manual_axes import out_struct


def unsupported(dtype, num_rows: int) -> str | None:
    """Why the kernel cannot combine `num_rows` rows of `dtype`, or None: 32-bit rows are copied as they are and
    bfloat16 rows as word rows (an even count); other 16-bit floats would need a widening the shift does not do."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 4:
        return None
    if dtype != jnp.bfloat16:
        return f"rows of {dtype}: the kernel combines float32 or bfloat16 rows"
    if num_rows % 2:
        return f"{num_rows} bfloat16 rows: read as pairs packed in 32-bit words, the count must be even"
    return None


# Tokens a grid step: as many as keep the two row buffers (2 x tokens x k rows of H words) within BUFFER_BYTES, at
# most TOKENS. Measured on the v5e (Qwen3, 32,768 rows of 2048 bf16): 1,001 / 908 / 878 us at 8 / 16 / 32 tokens a
# step (64 / 128 / 256 row copies): more copies in flight, fewer steps.
TOKENS = 32
BUFFER_BYTES = 4 << 20


def _combine_kernel(pos_ref, next_pos_ref, *refs, top_k, tokens, words, group):
    # words: the rows' shifts come before them ([1, 1, pairs]: 16 for an even row, the word's low half; 0 for an odd)
    shift_ref, rows_hbm, out_ref, buf, sem = refs if words else (None, *refs)
    block, blocks = pl.program_id(0), pl.num_programs(0)
    pairs = tokens * top_k
    src = rows_hbm.bitcast(jnp.uint32) if words else rows_hbm

    # group > 1: the buffer holds its rows in groups of a sublane tile of 32-bit rows, [2, pairs / group, group, H],
    # so a copy's destination is a static row of a group, whose address the scalar unit need not compute.
    def start(positions, slot):
        def copy_group(j, carry):
            for k in range(group):
                i = j * group + k
                # Positions come clamped to [0, R) (combine_rows): the kernel runs without Mosaic's own bounds check
                # of each copy (~11 of ~26 bundles a copy on the v5e) and still never reads outside the rows.
                r = positions[0, 0, i]
                row = jax.lax.shift_right_logical(r, jnp.int32(1)) if words else r
                dst = buf.at[slot, j, pl.ds(k, 1)] if group > 1 else buf.at[slot, pl.ds(i, 1)]
                pltpu.make_async_copy(src.at[pl.ds(row, 1)], dst, sem.at[slot]).start()
            return carry

        jax.lax.fori_loop(0, pairs // group, copy_group, 0, unroll=8 // group)

    @pl.when(block == 0)
    def _():
        start(pos_ref, 0)

    @pl.when(block + 1 < blocks)
    def _():
        start(next_pos_ref, rem_nonnegative(block + 1, 2))

    slot = rem_nonnegative(block, 2)
    # One wait for the whole buffer: the semaphore counts the bytes of every row copy into it (a descriptor of the
    # buffer's size; its source is not read).
    pltpu.make_async_copy(buf.at[slot], buf.at[slot], sem.at[slot]).wait()
    got = buf[slot].reshape(pairs, buf.shape[-1])
    if words:
        shift = jnp.broadcast_to(shift_ref[0], (8, pairs)).T[:, :1]  # as a column
        got = pltpu.bitcast(jnp.left_shift(got, shift.astype(jnp.uint32)) & jnp.uint32(0xFFFF0000), jnp.float32)
    else:
        got = got.astype(jnp.float32)
    out_ref[...] = got.reshape(tokens, top_k, got.shape[-1]).sum(axis=1).astype(out_ref.dtype)


def default_tokens_per_block(top_k: int, hidden: int, dtype) -> int:
    """The default token block: the largest multiple of the output's sublane tile up to TOKENS whose row buffers fit
    BUFFER_BYTES, at least one tile."""
    sub = sublane_multiple(dtype)
    fit = BUFFER_BYTES // (2 * top_k * hidden * 4)
    return max(sub, min(TOKENS, fit) // sub * sub)


def combine_rows(rows, position, top_k: int, *, tokens_per_block: int | None = None):
    """out [T, H] in rows' dtype: out[t] = sum over j < top_k of rows[position[t * top_k + j]] (f32 sum).

    rows [R, H] float32 or bfloat16 (R even; `unsupported` says why not); position [T * top_k] int32, every value in
    [0, R) (a permutation's, as the grouped path's layout gives: not checked; a value outside reads row R - 1, so
    the kernel never reads outside rows).
    tokens_per_block: tokens a grid step, a multiple of the output's sublane tile (8 rows of 32-bit, 16 of 16-bit)
    unless it covers all T tokens; None: default_tokens_per_block."""
    num_rows, hidden = rows.shape
    if why := unsupported(rows.dtype, num_rows):
        raise ValueError(f"rows: {why}")
    pairs_total = position.shape[0]
    tokens = pairs_total // top_k
    if tokens_per_block is None:
        tokens_per_block = default_tokens_per_block(top_k, hidden, rows.dtype)
    tb = min(tokens_per_block, tokens)
    if tb < tokens and tb % sublane_multiple(rows.dtype):
        raise ValueError(
            f"tokens_per_block: expected a multiple of {sublane_multiple(rows.dtype)} (the {rows.dtype} output's "
            f"sublane tile) or at least the {tokens} tokens, got {tokens_per_block}"
        )
    blocks = -(-tokens // tb)
    pairs = tb * top_k
    words = rows.dtype.itemsize == 2 and not interpret_mode_forced()
    # Token blocks past T read row 0 (their output rows fall outside the array and are dropped). The positions go
    # to SMEM a block at a time, [blocks, 1, pairs]: a rank-1 SMEM block would have to be a power of two >= 128.
    # Positions clamped to [0, R) (negatives, as unsigned, to the last row): the kernel copies without bounds checks,
    # and a word row's half is chosen from the row actually read.
    position = jnp.minimum(position.astype(jnp.uint32), jnp.uint32(num_rows - 1)).astype(jnp.int32)
    position = jnp.pad(position, (0, blocks * pairs - pairs_total)).reshape(blocks, 1, pairs)
    smem = functools.partial(pl.BlockSpec, memory_space=pltpu.SMEM)
    in_specs = [
        smem((1, 1, pairs), lambda b: (b, 0, 0)),
        smem((1, 1, pairs), lambda b: (jnp.minimum(b + 1, blocks - 1), 0, 0)),
    ]
    operands = [position, position]
    if words:
        in_specs.append(pl.BlockSpec((1, 1, pairs), lambda b: (b, 0, 0)))
        operands.append(jnp.where(position % 2 == 0, 16, 0).astype(jnp.int32))
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(rows)
    buffer_dtype = jnp.uint32 if words else rows.dtype
    tile = sublane_multiple(buffer_dtype)  # 8 rows of 32-bit words
    group = tile if jnp.dtype(buffer_dtype).itemsize == 4 and pairs % tile == 0 else 1
    buffer_shape = (2, pairs // group, group, hidden) if group > 1 else (2, pairs, hidden)
    # The two row buffers, the output block twice and the f32 rows of a step's sum.
    working_set = 2 * pairs * hidden * 4 + 2 * tb * hidden * rows.dtype.itemsize + pairs * hidden * 4
    return pl.pallas_call(
        functools.partial(_combine_kernel, top_k=top_k, tokens=tb, words=words, group=group),
        out_shape=out_struct((tokens, hidden), rows.dtype, rows, position),
        grid=(blocks,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tb, hidden), lambda b: (b, 0)),
        scratch_shapes=[pltpu.VMEM(buffer_shape, buffer_dtype), pltpu.SemaphoreType.DMA((2,))],
        # The next block's copies start in this step: the steps run in order on one core.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            # Each copy's row was clamped before the kernel; the other copies' indices are static or a slot in {0, 1}.
            # Mosaic's check of every copy cost the scalar unit, which issues the copies, ~40 % of its bundles.
            disable_bounds_checks=True,
            vmem_limit_bytes=chip.scoped_vmem_limit(chip.current_tpu_info(), working_set),
        ),
        name="moe_combine_rows",
    )(*operands)
