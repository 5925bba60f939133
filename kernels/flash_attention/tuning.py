"""Tile sizes of the flash attention kernels, per TPU generation.

A grid step multiplies a (block_q, D) query block by a (block_kv, D) key block per head and keeps a (block_q, Dv)
f32 accumulator per head of the step, so the blocks set both the MXU work per step (which must hide the ~0.14 us
cost of a step and the K/V block's DMA) and the VMEM working set. Key blocks are whole multiples of 128 lanes (they
are the lane dimension of the scores) and so are query blocks (the dk/dv kernel keeps per-row statistics as lane
rows); either may instead cover all rows. Every entry is proven by the deviceless compile test at the benchmark
shapes on v5e, v6e and v7x.
"""

import dataclasses

import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import LANES, check_block_dim, check_tile, check_vmem_fit
from .geometry import min_kv_heads_per_step

# (block_q, block_kv) by generation and head dim (the widest of Q/K's and V's), chosen with the performance model
# (`python -m benchmarks --kernel flash_attention --sweep`): the pair with the least modeled forward + backward time
# over the benchmark's seq 4096 shapes (causal and not); under 0.5 % counts as a tie, kept at 512 x 512. v6e head dim
# 128: 1024 x 1024, forward -9 / -22 % (causal / not), backward +1 / -9 %; over Qwen3's causal shapes -4 % in all
# (seq 32768: -23 % forward, -8 % backward), but slower at seq 1024 (+7 % / +15 %; a 1024 block is one causal
# triangle, half masked) and packed sequences (+4..38 %): a choice by sequence length would take both. Head dim 512:
# 512 x 1024 on v6e (-16 % against 512 x 256), 256 x 512 on v7x (-16 % against 256 x 256; the dq kernel overflows its
# 48 MiB at 512 x 256). v5e's 128-wide MXUs gain nothing from larger blocks. Head dim 64 has no benchmark shape.
# Not keyed on the mask: at v6e head dim 128, Qwen3 causal seq 4096, 512 x 1024 models slower than 1024 x 1024 in
# both directions (forward 4819 against 4398 us, backward 10113 against 9866), 1024 x 2048 slower forward (5215 us).
TABLE = {
    "v5e": {64: (512, 512), 128: (512, 512), 256: (512, 512), 512: (512, 512)},
    "v6e": {64: (512, 512), 128: (1024, 1024), 256: (512, 512), 512: (512, 1024)},
    "v7x": {64: (512, 512), 128: (1024, 512), 256: (512, 512), 512: (256, 512)},
}
# Whether the backward fuses dq into the dk/dv kernel, by generation and head dim (docs/flash_attention.md,
# "Backward"). v6e: fused at every benchmark shape (seq 4096, modeled program: Qwen3 -19 % causal and unmasked, Gemma 4
# sliding -8 %, full -4 / -6 %). v5e and v7x, Qwen3 unmasked seq 4096, the backward alone (modeled): v5e 42306 ->
# 37343 us (eight slots of 512 keys), v7x 15046 -> 12028 us; both compiled at the benchmark shapes.
FUSED_DQ = {
    "v5e": {64: True, 128: True, 256: True, 512: True},
    "v6e": {64: True, 128: True, 256: True, 512: True},
    "v7x": {64: True, 128: True, 256: True, 512: True},
}
# The fused backward keeps, per query block, one f32 dq block of HBM for each key block it needs (the most any
# query block needs; for traced cu_seqlens a bound, schedule.visit_bound); beyond this many the table's fused choice
# falls back to unfused (long sequences, packed batches whose query blocks may hold many sequences), so that the
# slots take at most this many f32 copies of dq.
MAX_DQ_SLOTS = 8
# Never ask for more than this share of the core's VMEM.
VMEM_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class FlashAttentionBlocks:
    """Tile sizes of the flash attention kernels (forward, dq and dk/dv): the `blocks=` of flash_attention and
    flash_attention_varlen.

    block_q: query rows per grid step, a multiple of 128, or at least the query rows (one block). None: the table's.
    block_kv: key rows per grid step, a multiple of 128, or at least the key rows. None: the table's.
    kv_heads_per_step: kv heads per grid step, each with its query heads; must divide the kv heads, and its lane
        blocks must be whole multiples of 128 lanes (at head dim 64: an even count) or cover all heads. None: the
        fewest that are legal.
    vmem_limit_bytes: the scoped VMEM the kernels may use; None: derived from the working set.
    fused_backward: True: the dk/dv kernel also computes dq (per key block partials, summed in XLA); False: a
        separate dq kernel recomputes the scores; None: the tuning table's choice (unfused where a query block may
        need more than MAX_DQ_SLOTS key blocks: long sequences, loosely bounded packed batches).
    """

    block_q: int | None = None
    block_kv: int | None = None
    kv_heads_per_step: int | None = None
    vmem_limit_bytes: int | None = None
    fused_backward: bool | None = None


def check_blocks_type(blocks):
    if blocks is not None and not isinstance(blocks, FlashAttentionBlocks):
        raise TypeError(f"blocks: expected a FlashAttentionBlocks or None, got {type(blocks).__name__}")


def working_set(block_q, block_kv, kv_heads_per_step, group, head_dim, v_head_dim, itemsize, fused=False) -> int:
    """VMEM of the widest of the kernels: double-buffered blocks, scratch, and the f32 temporaries of the
    (block_q, block_kv) score tiles (8 of them: Mosaic keeps several heads' tiles alive in the unrolled head loop;
    fewer underestimates what a head dim 512 forward needs). fused: the dk/dv kernel also writes an f32 dq block
    (and has no dq kernel beside it)."""
    heads = kv_heads_per_step * group
    row_block = block_q * LANES * 4  # a (block_q, up to 128) f32 / int32 block: lanes padded to 128
    stat = heads * block_q * LANES * 4  # lane-replicated per-row statistics of every head of the step
    q = block_q * heads * head_dim * itemsize
    o = block_q * heads * v_head_dim * itemsize
    k = block_kv * kv_heads_per_step * head_dim * itemsize
    v = block_kv * kv_heads_per_step * v_head_dim * itemsize
    temporaries = 8 * block_q * block_kv * 4
    forward = 2 * (q + o + k + v + 2 * row_block) + q + 2 * stat + heads * block_q * v_head_dim * 4
    dq = 2 * (2 * q + o + k + v + 5 * row_block) + q + 2 * stat + heads * block_q * head_dim * 4
    dkv = (
        2 * (q + o + 2 * k + 2 * v + 3 * 8 * block_q * 4)
        + k
        + kv_heads_per_step * block_kv * (head_dim + v_head_dim) * 4
    )
    if fused:
        return max(forward, dkv + 2 * heads * block_q * head_dim * 4) + temporaries
    return max(forward, dq, dkv) + temporaries


def _table_entry(generation: str, head_dim: int, table=TABLE):
    table = table.get(generation, table["v6e"])
    for dim in sorted(table):
        if head_dim <= dim:
            return table[dim]
    return table[max(table)]


def resolve_blocks(
    blocks: FlashAttentionBlocks | None,
    *,
    q_rows: int,
    kv_rows: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    itemsize: int,
    info: pltpu.TpuInfo | None = None,
) -> FlashAttentionBlocks:
    """The blocks the kernels run with: the table's for None and for fields left None, else the caller's, checked
    (TypeError/ValueError naming the field)."""
    check_blocks_type(blocks)
    info = info or chip.current_tpu_info()
    blocks = blocks or FlashAttentionBlocks()
    table_q, table_kv = _table_entry(chip.generation_name(info), max(head_dim, v_head_dim))
    why = "the lane tile: 128"
    block_q = check_block_dim(
        "blocks",
        "block_q",
        table_q if blocks.block_q is None else blocks.block_q,
        dim=q_rows,
        multiple=LANES,
        why=why,
        dim_name="the query rows",
    )
    block_kv = check_block_dim(
        "blocks",
        "block_kv",
        table_kv if blocks.block_kv is None else blocks.block_kv,
        dim=kv_rows,
        multiple=LANES,
        why=why,
        dim_name="the key rows",
    )
    group = q_heads // kv_heads
    fewest = min_kv_heads_per_step(kv_heads, head_dim, v_head_dim, group)
    if blocks.kv_heads_per_step is None:
        per_step = fewest
    else:
        per_step = check_tile("blocks", "kv_heads_per_step", blocks.kv_heads_per_step, at_most=kv_heads)
        if kv_heads % per_step:
            raise ValueError(f"blocks.kv_heads_per_step: expected a divisor of the {kv_heads} kv heads, got {per_step}")
        if per_step != kv_heads and (per_step * head_dim % LANES or per_step * v_head_dim % LANES):
            raise ValueError(
                f"blocks.kv_heads_per_step: expected a count whose K/V lane blocks ({per_step} x {head_dim} and "
                f"{per_step} x {v_head_dim}) are multiples of 128 lanes, or all {kv_heads} kv heads, got {per_step}"
            )
    fused = blocks.fused_backward
    if fused is None:
        fused = _table_entry(chip.generation_name(info), max(head_dim, v_head_dim), FUSED_DQ)
    elif not isinstance(fused, (bool, np.bool_)):
        raise TypeError(f"blocks.fused_backward: expected a bool or None, got {type(fused).__name__} {fused!r}")
    need = working_set(block_q, block_kv, per_step, group, head_dim, v_head_dim, itemsize, bool(fused))
    vmem_limit = blocks.vmem_limit_bytes
    if vmem_limit is None:
        vmem_limit = min(int(info.vmem_capacity_bytes * VMEM_SHARE), chip.scoped_vmem_limit(info, need))
    check_vmem_fit("blocks", need, vmem_limit, info)
    return FlashAttentionBlocks(
        block_q=block_q,
        block_kv=block_kv,
        kv_heads_per_step=per_step,
        vmem_limit_bytes=int(vmem_limit),
        fused_backward=bool(fused),
    )


# Tile sizes `candidate_blocks` tries for each of block_q and block_kv (benchmarks' --sweep models every legal pair).
CANDIDATE_TILES = (256, 512, 1024)


def candidate_blocks(*, info: pltpu.TpuInfo | None = None, **shape) -> list[FlashAttentionBlocks]:
    """Legal blocks worth modeling at a shape (resolve_blocks' keywords: q_rows, kv_rows, q_heads, kv_heads,
    head_dim, v_head_dim, itemsize): the table's choice first, then every (block_q, block_kv) pair of CANDIDATE_TILES
    that fits this generation's VMEM (resolve_blocks checks it), distinct after clipping to the rows."""
    info = info or chip.current_tpu_info()
    candidates = [resolve_blocks(None, **shape, info=info)]
    for block_q in CANDIDATE_TILES:
        for block_kv in CANDIDATE_TILES:
            try:
                blocks = resolve_blocks(FlashAttentionBlocks(block_q=block_q, block_kv=block_kv), **shape, info=info)
            except ValueError:  # too large for the VMEM limit
                continue
            if all((blocks.block_q, blocks.block_kv) != (c.block_q, c.block_kv) for c in candidates):
                candidates.append(blocks)
    return candidates
