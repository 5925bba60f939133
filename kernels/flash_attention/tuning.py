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
from ..common.blocks import LANES, check_block_dim, check_tile, check_vmem_fit, pow2_floor
from .geometry import min_kv_heads_per_step

# (block_q, block_kv) by generation and head dim (the widest of Q/K's and V's), chosen with the performance model
# (`python -m benchmarks --kernel flash_attention --sweep`): the pair with the least modeled forward + backward time
# over the benchmark's seq 4096 shapes (causal and not); under 0.5 % counts as a tie, kept at 512 x 512. v6e head dim
# 128: 1024 x 1024, forward -9 / -22 % (causal / not), backward +1 / -9 %; over Qwen3's causal shapes -4 % in all
# (seq 32768: -23 % forward, -8 % backward), but slower at seq 1024 (+7 % / +15 %; a 1024 block is one causal
# triangle, half masked) and packed sequences (+4..38 %): a choice by sequence length would take both. Head dim 512:
# 512 x 1024 on v6e (-16 % against 512 x 256), 256 x 512 on v7x (-16 % against 256 x 256; the dq kernel overflows its
# 48 MiB at 512 x 256). v5e's 128-wide MXUs gain nothing from larger blocks, and at head dim 512 lose by them:
# measured on the v5e (Gemma 4 full, 8 x 4096 tokens, 16 / 2 heads, causal; device time, the forward alone at each
# tiling, `--sweep`), 512 x 512 28140 us, **256 x 512 13864**, 256 x 256 14010, 512 x 256 14509, 128 x 512 14727,
# 128 x 256 14884, 256 x 128 15480, 512 x 128 15735, 128 x 1024 15810, 128 x 128 16363, 256 x 1024 19721, 512 x 1024
# 22951, 1024 x 512 27407, 512 x 512 at 2 kv heads a step 24493. Head dim 64 has no benchmark shape.
# Head dim 128 on the v5e, measured likewise (Qwen3, 8 x 4096 tokens, 32 / 4 heads; causal / unmasked): **512 x 1024
# 8166 / 13459 us**, 512 x 512 8300 / 14193, 512 x 512 at 2 kv heads a step 8206 / 13939, 256 x 1024 8757 / 13930,
# 256 x 512 8458 / 14493, 1024 x 1024 18219 / 29733, 128-row or -key blocks 9688 and more / 15368 and more.
# Not keyed on the mask: at v6e head dim 128, Qwen3 causal seq 4096, the forward's 1024 x 1024 (3604 us, its DIAGONAL
# pairs by chunks) models faster than 512 x 1024 (4369), 512 x 512 (4898) and 1024 x 2048 (4043).
TABLE = {
    "v5e": {64: (512, 512), 128: (512, 1024), 256: (512, 512), 512: (256, 512)},
    "v6e": {64: (512, 512), 128: (1024, 1024), 256: (512, 512), 512: (512, 1024)},
    "v7x": {64: (512, 512), 128: (1024, 512), 256: (512, 512), 512: (256, 512)},
}
# The backward's (block_q, block_kv) by generation and head dim: its kernels read the forward's residuals (out, lse) per
# row, so its blocks are its own. Chosen as TABLE (least modeled backward program, causal + unmasked, seq 4096, v6e,
# whole programs; against the forward's blocks): key blocks of 2048 halve the fused backward's dq slots (the slot sum's
# f32 reads) but compute more of the causal diagonal (a key block's DIAGONAL pair covers only its first query block; the
# others' diagonals run through it further in and are masked visits). Head dim 512 (Gemma 4 full): 512 x 2048, unmasked
# 17394 -> 15545 us, causal 11697 -> 12267 (256 x 2048: 15748 / 12310), before DIAGONAL pairs. Head dim 256 (Gemma 4
# sliding, window 1024): 512 x 512 at 8 kv heads a step (QUERY_HEADS_PER_STEP), 4941 us (256 x 1024 4972, 256 x 512
# 5316, 512 x 256 8151; the fused backward's 1024 x 1024 does not fit VMEM at 8 kv heads); at 1 kv head 1024 x 1024 had
# won, 6301 -> 5981 us (512 x 1024 6356, 256 x 1024 7342), and at 4 kv heads 4947 us (512 x 512 5003, 256 x 1024 5205).
# Head dim 128 (Qwen3), with DIAGONAL pairs: 1024 x 2048, unmasked 14986 -> 13962 us, causal 8743 -> 8892 against 1024 x
# 1024 (-3.7 % together); 512 x 2048 14171 / 9978. v7x and head dim 64: not swept, the forward's. v5e head dim 128,
# measured on the chip (Qwen3, 8 x 4096 tokens, the fused backward alone at each tiling, `--sweep`; causal /
# unmasked): **256 x 1024 21239 / 33980 us** (-3.6 % together), 512 x 512 20793 / 36467, 256 x 512 22209 / 38036,
# 1024 x 2048 26536 / 42518, 512 x 1024 32550 / 55622; 2 or 4 kv heads a step 33151 us and more causal.
BACKWARD_TABLE = {
    "v5e": {64: (512, 512), 128: (256, 1024), 256: (512, 512), 512: (512, 512)},
    "v6e": {64: (512, 512), 128: (1024, 2048), 256: (512, 512), 512: (512, 2048)},
    "v7x": {64: (512, 512), 128: (1024, 512), 256: (512, 512), 512: (256, 512)},
}
# The fused backward's (block_q, block_kv) for long sequences, where BACKWARD_TABLE's would need more than MAX_DQ_SLOTS
# dq slots: wider key blocks, fewer slots, and narrower query blocks to keep the score tiles within VMEM; tried before
# the unfused backward (api), taken where their slots are within MAX_DQ_SLOTS. v6e head dim 128, Qwen3 seq 32768
# (whole backward programs, modeled v6e): 512 x 4096 fused (8 slots), causal / unmasked 57346 / 101887 us, against the
# unfused backward's 73919 / 141483 on 1024 x 1024. Head dim 512 has no such pair within VMEM (256 x 4096 would need
# about 100 MiB); other generations were not modeled.
LONG_BACKWARD_TABLE = {"v6e": {128: (512, 4096)}}
# The unfused backward's (block_q, block_kv) (a dq kernel beside the dk/dv kernel: long sequences and loosely bounded
# packed batches, MAX_DQ_SLOTS): BACKWARD_TABLE is the fused backward's, and the unfused dq kernel keeps more per query
# block (q, do, the statistics, an f32 dq accumulator): at head dim 128 on v6e, 1024 x 2048 would need 97 MiB of VMEM,
# over the 96 MiB limit, so it takes the forward's 1024 x 1024. Head dim 512 on v6e keeps 512 x 2048: Gemma 4 full,
# seq 32768, whole backward programs (modeled v6e), causal / unmasked 75276 / 139141 us against 512 x 1024's 74616 /
# 142223 (-1.1 % together). Elsewhere the two tables agree.
UNFUSED_BACKWARD_TABLE = {
    "v5e": BACKWARD_TABLE["v5e"],
    "v6e": {**BACKWARD_TABLE["v6e"], 128: TABLE["v6e"][128]},
    "v7x": BACKWARD_TABLE["v7x"],
}
# Blocks for sliding windows of at most SMALL_WINDOW_KEYS keys a row (gpt-oss's sliding layers: 128), by generation and
# head dim, in place of TABLE's and BACKWARD_TABLE's: a 512 x 512 visit computes 512 x 1024 scores across two key blocks
# for 512 x 128 kept ones. Measured on the v5e (forward, gpt-oss sliding: 8 x 4096 tokens, 64 / 8 heads, head dim 64,
# window 128, sinks; device time, the kernel alone at each tiling, `--sweep`): 512 x 512 22294 us, 128 x 256 10432,
# 256 x 512 10926, 256 x 256 11143, 128 x 128 11459, 128 x 512 11789, 256 x 128 13475. Modeled: v5e 11422 / 9242 us
# (512 x 512 / 128 x 256: the model undercounts the large blocks' cost at head dim 64 by half), v6e 6547 / 5779, v7x
# 4056 at 128 x 256. The backward (modeled v5e, the fused dk/dv kernel): 512 x 512 13699 us, 128 x 256 7668, 256 x 256
# 8783, 256 x 512 11353.
SMALL_WINDOW_KEYS = 256
SMALL_WINDOW_TABLE = {"v5e": {64: (128, 256)}, "v6e": {64: (128, 256)}, "v7x": {64: (128, 256)}}
# The forward's blocks for sliding windows of more than SMALL_WINDOW_KEYS and at most WINDOW_KEYS keys a row (Gemma 4's
# sliding layers: 1024), by generation and head dim, in place of TABLE's; the backward keeps BACKWARD_TABLE's. Measured
# on the v5e (Gemma 4 sliding: 8 x 4096 tokens, 16 / 8 heads, head dim 256, window 1024; device time, the kernel alone
# at each tiling, `--sweep`), forward: 512 x 512 9524 us, 256 x 256 4536, 256 x 512 4773, 512 x 1024 9146, 256 x 1024
# 10794, 512 x 256 12132; 512 x 512 at 4 kv heads a step 5020, at 2 6601, at 1 6922. Backward: 512 x 512 (the table's)
# 19149 us, 256 x 512 20331, 256 x 1024 22206. Other generations were not measured (the model, twice too optimistic on
# the v5e at this shape, cannot choose for them).
WINDOW_KEYS = 1024
WINDOW_TABLE = {"v5e": {256: (256, 256)}}
# The backward's query heads a step under such a window (in place of QUERY_HEADS_PER_STEP's), by generation and head
# dim. Measured on the v5e (the same Gemma 4 sliding shape, the backward alone at 512 x 512 on residuals of its own
# count, `--sweep`), kv heads a step 1: 15635 us, 2 (4 query heads): 14853, 4: 22933, 8 (the forward's): 19156; the
# forward at 256 x 256 keeps 8 (4536 us; 4: 5163, 2: 7069, 1: 7890).
WINDOW_BACKWARD_QUERY_HEADS = {"v5e": {256: 4}}
# Head dims the kernels run zero-padded to a wider one (q, K and V padded with zero lanes, the output's sliced off; the
# scores and the softmax are unchanged), by generation: (head dim, V head dim) -> the width both run at. At head dim
# 64 two kv heads share each 128-lane block and a kept score costs the kernels about 2.8 times what it costs at 128
# (measured v5e: Qwen3 causal 259 k kept scores a µs, gpt-oss full 92 k), so gpt-oss's full layers run faster as head
# dim 128 with half their MXU passes' lanes zero: measured v5e (8 x 4096 tokens, 64 / 8 heads, causal, sinks), forward
# 46636 -> 21476 us, backward 77695 -> 50556 us. Not where a small window takes its own blocks (SMALL_WINDOW_TABLE):
# there the head-dim-64 kernels on 128 x 256 blocks model faster (v5e 9242 us against 11763 padded).
PADDED_HEAD_DIMS = {gen: {(64, 64): 128} for gen in ("v5e", "v6e", "v7x")}
# Query heads a grid step takes at most, by generation and head dim: kv heads per step is the most that divides the kv
# heads, keeps its query heads within this (1: the fewest legal) and leaves MIN_HEAD_GROUPS head groups, among those
# whose working set at the resolved blocks fits the VMEM limit (fewer where a caller's blocks would not fit), never
# fewer than the fewest legal. More heads a step mean fewer, larger grid steps (the per-step cost and a masked visit's
# keep mask shared by more heads) and, at 8 or all query heads, q and the output taken as they lie (no relayout copies:
# forward.heads_in_place), at every kv head a step (a multiple of 8) K and V too (forward.kv_heads_in_place). Head dim
# 256, Gemma 4 sliding (16 / 8 heads, window 1024, causal, seq 4096; whole programs, forward + backward): v6e 8 kv heads
# (16 query heads, backward 512 x 512: BACKWARD_TABLE) 3669 + 5981 -> 1915 + 4542 us, against 2275 + 4947 at 4 kv
# heads (backward 1024 x 1024; 512 x 512 5003); v5e 8, 7747 + 16400 -> 4893 + 13555 us (4: 5707 + 14271); v7x 4 (its
# two cores split the head groups) 1989 + 3481 -> 1527 + 1599 us. All modeled.
# Head dims 128 and 512 (Qwen3, Gemma 4 full) take 8 query heads a step at the fewest legal kv heads already; 64 and
# other GQA ratios were not modeled (the fewest legal).
QUERY_HEADS_PER_STEP = {
    "v5e": {64: 1, 128: 1, 256: 16, 512: 1},
    "v6e": {64: 1, 128: 1, 256: 16, 512: 1},
    "v7x": {64: 1, 128: 1, 256: 8, 512: 1},
}
# Head groups the table's kv heads per step leave at least, where the kv heads allow: v7x's two TensorCores split the
# grid's "parallel" head-group axis, and one group would leave a core idle.
MIN_HEAD_GROUPS = {"v5e": 1, "v6e": 1, "v7x": 2}
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
# and the slots together take at most this share of the chip's HBM (pltpu.get_tpu_info): at Gemma 4 full's shape (16
# heads x 512, 32768 tokens) dq in f32 is 1 GiB, and eight slots made the backward's program need 8.8 GiB of
# temporaries (compiled for the v5e), which with its arguments left a 16 GiB v5e no room for the rest of a training
# step (the benchmarks' program ran out of HBM on the chip); Qwen3's eight (4 GiB) stay within it.
DQ_SLOTS_HBM_SHARE = 0.3


def max_dq_slots(dq_bytes: int, info) -> int:
    """The most dq slots the fused backward may take: MAX_DQ_SLOTS, fewer where dq_bytes (one f32 copy of dq) times
    the slots would pass DQ_SLOTS_HBM_SHARE of the chip's HBM."""
    return min(MAX_DQ_SLOTS, int(info.hbm_capacity_bytes * DQ_SLOTS_HBM_SHARE) // max(1, dq_bytes))


# Packed batches (flash_attention_varlen): sequences start anywhere in a block, so a query block meets the ends of
# several, every one of its visits is a masked one (no DIAGONAL pairs), and the larger the blocks the more of each visit
# lies outside every sequence. The table's blocks are therefore capped by the longest sequence: at most longest /
# PACKED_SHARE (the largest power of two times 128 within it), never below PACKED_MIN_BLOCK (smaller steps would not
# hide their per-step cost and DMAs). Modeled v6e, Qwen3 (32 / 4 heads x 128), 32768 packed tokens, whole programs,
# causal / unmasked: mean length 1024 (longest 1722): forward 1024 x 1024 4265 / 6347 us, 512 x 512 3525 / 5342;
# backward 11541 / 16820, 512 x 512 8319 / 12426. Mean 4096 (longest 6893): forward 1024 x 1024 6133 / 10776, 512 x 512
# 6801 / 11976; backward 18730 / 31076, 512 x 512 16760 / 29278. Equal-length batches take sequence_block_cap instead:
# at seq 1024 1024 x 1024 models faster than 512 x 512 in both directions (forward 1571 against 2029 us causal, backward
# 3400 against 4108). The cap at mean 1024 elsewhere: Gemma 4 full v6e forward 512 x 1024 -> 512 x 512 3633 -> 3090 us
# (causal), backward 512 x 2048 -> 512 x 512 14847 -> 8877; Qwen3 v7x forward 1024 x 512 -> 512 x 512 3239 -> 2484,
# backward 7244 -> 5795; 256 x 512 loses to 512 x 512 (Qwen3 v6e forward 4150 against 3525).
PACKED_SHARE = {"forward": 4, "backward": 8}
PACKED_MIN_BLOCK = 512
# Never ask for more than this share of the core's VMEM.
VMEM_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class FlashAttentionBlocks:
    """Tile sizes of the flash attention kernels: the `blocks=` of flash_attention and flash_attention_varlen.

    block_q: query rows per grid step of the forward, a multiple of 128, or at least the query rows (one block).
        None: the table's, capped by the sequences (packed: packed_block_cap; equal lengths: sequence_block_cap).
    block_kv: key rows per grid step of the forward, a multiple of 128, or at least the key rows. None: the table's,
        capped as block_q's.
    backward_block_q, backward_block_kv: the same for the backward's kernels (delta, dk/dv, dq or the dq slots' sum),
        which have their own table (the forward's residuals are per row, so the two may differ). None: block_q /
        block_kv when given (a caller's blocks serve both directions unless the backward's are given too), else the
        backward table's (BACKWARD_TABLE fused, LONG_BACKWARD_TABLE fused where BACKWARD_TABLE's would need more than
        MAX_DQ_SLOTS dq slots, UNFUSED_BACKWARD_TABLE unfused).
    kv_heads_per_step: kv heads per grid step, each with its query heads; must divide the kv heads, and its lane
        blocks must be whole multiples of 128 lanes (at head dim 64: an even count) or cover all heads. None: the
        table's (QUERY_HEADS_PER_STEP: by generation and head dim, the most whose query heads stay within the table's
        and whose working set fits VMEM at the resolved blocks, at least the fewest legal; v7x keeps two head groups
        for its two cores).
    backward_kv_heads_per_step: the same for the backward's kernels (its residual lse is regrouped from the forward's
        head groups where the two differ, an XLA transpose of [Tq, Hq] f32). None: kv_heads_per_step when given, else
        the table's (WINDOW_BACKWARD_QUERY_HEADS where it applies, else as the forward's).
    vmem_limit_bytes: the scoped VMEM every kernel may use; None: derived from the widest working set of either
        direction at its own blocks.
    fused_backward: True: the dk/dv kernel also computes dq (per key block partials, summed in XLA); False: a
        separate dq kernel recomputes the scores; None: the tuning table's choice (unfused where a query block may
        need more than MAX_DQ_SLOTS key blocks of the backward: long sequences, loosely bounded packed batches).
    """

    block_q: int | None = None
    block_kv: int | None = None
    kv_heads_per_step: int | None = None
    vmem_limit_bytes: int | None = None
    fused_backward: bool | None = None
    backward_block_q: int | None = None
    backward_block_kv: int | None = None
    backward_kv_heads_per_step: int | None = None


def check_blocks_type(blocks):
    if blocks is not None and not isinstance(blocks, FlashAttentionBlocks):
        raise TypeError(f"blocks: expected a FlashAttentionBlocks or None, got {type(blocks).__name__}")


def working_set(
    block_q,
    block_kv,
    *,
    kv_heads_per_step,
    group,
    head_dim,
    v_head_dim,
    itemsize,
    fused=False,
    direction="forward",
    kv_in_place=False,
) -> int:
    """VMEM of the widest kernel of one direction ("forward" or "backward"): double-buffered blocks, scratch, and
    the f32 temporaries of the (block_q, block_kv) score tiles (8 of them: Mosaic keeps several heads' tiles alive
    in the unrolled head loop; fewer underestimates what a head dim 512 forward needs). fused: the backward's dk/dv
    kernel also writes an f32 dq block (and has no dq kernel beside it); kv_in_place: it takes K and V as they lie
    (forward.kv_heads_in_place) and merges V's heads into lanes in a scratch block of its own."""
    heads = kv_heads_per_step * group
    row_block = block_q * LANES * 4  # a (block_q, up to 128) f32 / int32 block: lanes padded to 128
    stat = heads * block_q * LANES * 4  # lane-replicated per-row statistics of every head of the step
    q = block_q * heads * head_dim * itemsize
    o = block_q * heads * v_head_dim * itemsize
    k = block_kv * kv_heads_per_step * head_dim * itemsize
    v = block_kv * kv_heads_per_step * v_head_dim * itemsize
    temporaries = 8 * block_q * block_kv * 4
    if direction == "forward":
        return 2 * (q + o + k + v + 2 * row_block) + q + 2 * stat + heads * block_q * v_head_dim * 4 + temporaries
    dkv = (
        2 * (q + o + 2 * k + 2 * v + 3 * 8 * block_q * 4)
        + k
        + kv_heads_per_step * block_kv * (head_dim + v_head_dim) * 4
    )
    if fused:
        return dkv + (v if kv_in_place else 0) + 2 * heads * block_q * head_dim * 4 + temporaries
    dq = 2 * (2 * q + o + k + v + 5 * row_block) + q + 2 * stat + heads * block_q * head_dim * 4
    return max(dq, dkv) + temporaries


def _table_entry(generation: str, head_dim: int, table=TABLE):
    table = table[generation] if generation in table else table["v6e"]
    for dim in sorted(table):
        if head_dim <= dim:
            return table[dim]
    return table[max(table)]


def run_head_dims(
    head_dim: int, v_head_dim: int, *, window_keys: int | None = None, info: pltpu.TpuInfo | None = None
) -> tuple[int, int]:
    """(D, Dv) the kernels run at: PADDED_HEAD_DIMS' width where the generation pads these head dims and no small
    window (window_keys at most SMALL_WINDOW_KEYS, SMALL_WINDOW_TABLE) keeps them; else as given."""
    generation = chip.generation_name(info or chip.current_tpu_info())
    width = PADDED_HEAD_DIMS.get(generation, {}).get((head_dim, v_head_dim))
    if width is None or _small_window_blocks(generation, max(head_dim, v_head_dim), window_keys):
        return head_dim, v_head_dim
    return width, width


def _small_window_blocks(generation: str, widest_head_dim: int, window_keys: int | None) -> bool:
    """Whether a window of `window_keys` keys a row takes SMALL_WINDOW_TABLE's blocks at this generation, head dim."""
    small = window_keys is not None and window_keys <= SMALL_WINDOW_KEYS
    return small and widest_head_dim in SMALL_WINDOW_TABLE.get(generation, {})


def _table_kv_heads_per_step(
    generation: str, head_dim: int, *, kv_heads: int, group: int, fewest: int, fits, most_heads: int | None = None
) -> int:
    """The table's kv heads per step (QUERY_HEADS_PER_STEP, or `most_heads` query heads; MIN_HEAD_GROUPS): the most
    legal count (a multiple of the fewest legal that divides the kv heads) within those query heads and the table's
    head groups whose working set fits(count), else the fewest."""
    if most_heads is None:
        most_heads = _table_entry(generation, head_dim, QUERY_HEADS_PER_STEP)
    min_groups = MIN_HEAD_GROUPS.get(generation, 1)
    counts = [
        n
        for n in range(fewest, kv_heads + 1, fewest)
        if kv_heads % n == 0 and n * group <= most_heads and kv_heads // n >= min_groups
    ]
    return max((n for n in counts if fits(n)), default=fewest)


def _lane_power_within(rows: int) -> int:
    """The largest 128 * 2^k within `rows` (128 below it)."""
    return max(LANES, pow2_floor(rows))


def packed_block_cap(longest_sequence: int, direction: str) -> int:
    """The most rows a table block of `direction` takes in a packed batch whose longest sequence has
    `longest_sequence` rows (PACKED_SHARE, PACKED_MIN_BLOCK)."""
    return max(_lane_power_within(longest_sequence // PACKED_SHARE[direction]), PACKED_MIN_BLOCK)


def sequence_block_cap(sequence_rows: int) -> int:
    """The most rows a table block takes in a batch of equal-length sequences of `sequence_rows` rows each: the
    largest 128 * 2^k within one sequence, so that where a sequence holds a whole block no block spans two sequences
    (each of its visits would be masked, half of it outside the query's sequence). Modeled v6e, seq 1024 (32
    sequences), whole backward programs: Qwen3 on the table's 1024 x 2048 5598 / 7798 us causal / unmasked, on
    1024 x 1024 3400 / 4492."""
    return _lane_power_within(sequence_rows)


def _block_pair(blocks, fields, table_entry, *, q_rows, kv_rows):
    """(block_q, block_kv) of one direction: the caller's `fields` (or the forward's as a fallback), else the table's,
    checked against the rows."""
    why = "the lane tile: 128"
    pair = []
    for field, fallback, table, dim, dim_name in zip(
        fields, ("block_q", "block_kv"), table_entry, (q_rows, kv_rows), ("the query rows", "the key rows")
    ):
        value = getattr(blocks, field)
        if value is None:
            value = getattr(blocks, fallback)
        value = table if value is None else value
        pair.append(check_block_dim("blocks", field, value, dim=dim, multiple=LANES, why=why, dim_name=dim_name))
    return tuple(pair)


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
    longest_sequence: int | None = None,
    sequence_rows: tuple[int, int] | None = None,
    long_sequences: bool = False,
    window_keys: int | None = None,
) -> FlashAttentionBlocks:
    """The blocks the kernels run with, every field set: the table's for None and for fields left None, else the
    caller's, checked (TypeError/ValueError naming the field). longest_sequence: for a packed batch (varlen), the
    rows of its longest sequence (query or key), which caps the table's blocks (packed_block_cap). sequence_rows: for
    a batch of equal-length sequences, the (query, key) rows of each, which cap the table's query and key blocks
    (sequence_block_cap). long_sequences: the fused backward takes LONG_BACKWARD_TABLE's blocks where it has an entry
    for the generation and head dim (the api's choice when BACKWARD_TABLE's need more than MAX_DQ_SLOTS slots).
    window_keys: the most keys a query row sees under a sliding window (schedule.window_keys), None when unbounded: at
    most SMALL_WINDOW_KEYS, the table's blocks are SMALL_WINDOW_TABLE's where it has the generation and head dim; at
    most WINDOW_KEYS, the forward's are WINDOW_TABLE's where it has them."""
    check_blocks_type(blocks)
    info = info or chip.current_tpu_info()
    blocks = blocks or FlashAttentionBlocks()
    generation, widest = chip.generation_name(info), max(head_dim, v_head_dim)
    rows = dict(q_rows=q_rows, kv_rows=kv_rows)

    small_window = _small_window_blocks(generation, widest, window_keys)
    # a window of up to WINDOW_KEYS keys: its tables' entries where they have this generation and head dim
    window = not small_window and window_keys is not None and window_keys <= WINDOW_KEYS
    window_forward = window and widest in WINDOW_TABLE.get(generation, {})
    window_backward_heads = WINDOW_BACKWARD_QUERY_HEADS.get(generation, {}).get(widest) if window else None

    def table_pair(direction, table):
        if small_window:
            table = SMALL_WINDOW_TABLE  # both directions
        elif window_forward and direction == "forward":
            table = WINDOW_TABLE
        pair = _table_entry(generation, widest, table)
        if longest_sequence is not None:
            cap = packed_block_cap(longest_sequence, direction)
            pair = tuple(min(block, cap) for block in pair)
        if sequence_rows is not None:
            pair = tuple(min(block, sequence_block_cap(n)) for block, n in zip(pair, sequence_rows))
        return pair

    fused = blocks.fused_backward
    if fused is None:
        fused = _table_entry(generation, widest, FUSED_DQ)
    elif not isinstance(fused, (bool, np.bool_)):
        raise TypeError(f"blocks.fused_backward: expected a bool or None, got {type(fused).__name__} {fused!r}")
    fused = bool(fused)
    block_q, block_kv = _block_pair(blocks, ("block_q", "block_kv"), table_pair("forward", TABLE), **rows)
    backward_table = BACKWARD_TABLE if fused else UNFUSED_BACKWARD_TABLE
    if fused and long_sequences and widest in LONG_BACKWARD_TABLE.get(generation, {}):
        backward_table = LONG_BACKWARD_TABLE
    backward_q, backward_kv = _block_pair(
        blocks, ("backward_block_q", "backward_block_kv"), table_pair("backward", backward_table), **rows
    )
    group = q_heads // kv_heads
    shape = dict(group=group, head_dim=head_dim, v_head_dim=v_head_dim, itemsize=itemsize)

    def forward_need(per_step):
        return working_set(block_q, block_kv, kv_heads_per_step=per_step, **shape, direction="forward")

    def backward_need(per_step):
        return working_set(
            backward_q,
            backward_kv,
            kv_heads_per_step=per_step,
            **shape,
            fused=fused,
            direction="backward",
            # forward.kv_heads_in_place: a step takes every kv head, whole sublane tiles of them
            kv_in_place=fused and per_step == kv_heads and kv_heads % 8 == 0,
        )

    fewest = min_kv_heads_per_step(kv_heads, head_dim, v_head_dim, group)
    most = int(info.vmem_capacity_bytes * VMEM_SHARE)
    if blocks.vmem_limit_bytes is not None:
        most = check_tile("blocks", "vmem_limit_bytes", blocks.vmem_limit_bytes)

    def table_count(need, most_heads=None):
        return _table_kv_heads_per_step(
            generation,
            widest,
            kv_heads=kv_heads,
            group=group,
            fewest=fewest,
            fits=lambda n: need(n) <= most,
            most_heads=most_heads,
        )

    def checked_count(field):
        per_step = check_tile("blocks", field, getattr(blocks, field), at_most=kv_heads)
        if kv_heads % per_step:
            raise ValueError(f"blocks.{field}: expected a divisor of the {kv_heads} kv heads, got {per_step}")
        if per_step != kv_heads and (per_step * head_dim % LANES or per_step * v_head_dim % LANES):
            raise ValueError(
                f"blocks.{field}: expected a count whose K/V lane blocks ({per_step} x {head_dim} and "
                f"{per_step} x {v_head_dim}) are multiples of 128 lanes, or all {kv_heads} kv heads, got {per_step}"
            )
        return per_step

    per_step = backward_per_step = None
    if blocks.kv_heads_per_step is not None:
        per_step = checked_count("kv_heads_per_step")
    if blocks.backward_kv_heads_per_step is not None:
        backward_per_step = checked_count("backward_kv_heads_per_step")
    elif per_step is not None:
        backward_per_step = per_step  # a caller's count serves both directions unless the backward's is given too
    elif window_backward_heads is not None:
        backward_per_step = table_count(backward_need, window_backward_heads)
    if per_step is None:  # the table's: where the backward shares it, both directions' working sets must fit
        per_step = table_count(
            forward_need if backward_per_step is not None else lambda n: max(forward_need(n), backward_need(n))
        )
    if backward_per_step is None:
        backward_per_step = per_step
    need = max(forward_need(per_step), backward_need(backward_per_step))
    vmem_limit = blocks.vmem_limit_bytes
    if vmem_limit is None:
        vmem_limit = min(int(info.vmem_capacity_bytes * VMEM_SHARE), chip.scoped_vmem_limit(info, need))
    check_vmem_fit("blocks", need, vmem_limit, info)
    return FlashAttentionBlocks(
        block_q=block_q,
        block_kv=block_kv,
        kv_heads_per_step=per_step,
        vmem_limit_bytes=int(vmem_limit),
        fused_backward=fused,
        backward_block_q=backward_q,
        backward_block_kv=backward_kv,
        backward_kv_heads_per_step=backward_per_step,
    )


# Tile sizes `candidate_blocks` tries for each of block_q and block_kv (benchmarks' --sweep models every legal pair):
# the forward's from 128 (the v5e's MXU width; at head dim 512 its fastest blocks there have 256 query rows, measured),
# the backward's key blocks also 2048 (half the dq slots of 1024).
CANDIDATE_TILES = {
    "forward": ((128, 256, 512, 1024), (128, 256, 512, 1024)),
    "backward": ((256, 512, 1024), (512, 1024, 2048)),
}


def candidate_blocks(
    *, direction: str = "forward", info: pltpu.TpuInfo | None = None, tiles=None, **shape
) -> list[FlashAttentionBlocks]:
    """Legal blocks worth modeling at a shape (resolve_blocks' keywords: q_rows, kv_rows, q_heads, kv_heads,
    head_dim, v_head_dim, itemsize) for one direction's kernels: the table's choice first, then every pair of that
    direction's CANDIDATE_TILES (or `tiles`: (query tiles, key tiles)) (the other direction's blocks left to the
    table) that fits this generation's VMEM (resolve_blocks checks it), distinct after clipping to the rows; then the
    table's blocks at every other legal count of that direction's kv heads a step that fits (QUERY_HEADS_PER_STEP's
    choice is the model's, and the chip measured the model optimistic where a step takes 16 query heads)."""
    info = info or chip.current_tpu_info()
    table = resolve_blocks(None, **shape, info=info)
    fields = ("block_q", "block_kv", "backward_block_q", "backward_block_kv")
    varied, kept = (fields[:2], fields[2:]) if direction == "forward" else (fields[2:], fields[:2])
    fixed = {f: getattr(table, f) for f in kept}
    candidates, seen = [table], {tuple(getattr(table, f) for f in varied)}
    q_tiles, kv_tiles = CANDIDATE_TILES[direction] if tiles is None else tiles
    for block_q in q_tiles:
        for block_kv in kv_tiles:
            try:
                blocks = FlashAttentionBlocks(**dict(zip(varied, (block_q, block_kv))), **fixed)
                blocks = resolve_blocks(blocks, **shape, info=info)
            except ValueError:  # too large for the VMEM limit
                continue
            pair = tuple(getattr(blocks, f) for f in varied)
            if pair not in seen:
                seen.add(pair)
                candidates.append(blocks)
    kv_heads = shape["kv_heads"]
    count = "kv_heads_per_step" if direction == "forward" else "backward_kv_heads_per_step"
    for per_step in range(1, kv_heads + 1):
        if kv_heads % per_step or per_step == getattr(table, count):
            continue
        try:
            candidates.append(resolve_blocks(FlashAttentionBlocks(**{count: per_step}), **shape, info=info))
        except ValueError:  # not a legal lane block at this head dim, or too large for the VMEM limit
            continue
    return candidates
