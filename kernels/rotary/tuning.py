"""Token-block sizes for the rotary kernels, per TPU generation.

RoPE (and RMSNorm + RoPE) streams all q and k heads of a block of tokens in and out, plus the block's cos/sin rows
(or positions). Pallas double-buffers the blocks, so the first block's read and the last block's write are not
hidden behind compute: with few steps those edges cost a large share of the time. Each step also has a fixed cost
(~230-380 cycles on v6e in the performance model), and the fused RMSNorm + RoPE at head_dim 128 needs about as many
cycles per block as the block's HBM transfer takes. So: blocks of about `TARGET_BLOCK_BYTES` of input, at least
`MIN_STEPS` steps when the data allows, and the token count rounded to a power of two (it then divides the
power-of-two sequence lengths and decode batches: no ragged last block). The double-buffered streams plus f32
temporaries must fit the VMEM the kernel asks for. Every entry is proven by the deviceless compile test at the
benchmark shapes on v5e, v6e and v7x.

How the numbers are chosen (benchmarks/ops/rotary.py, modeled v6e, transformers' bhsd layout, bf16): prefill at
S=2048 runs 32 steps of 64 tokens for Qwen3-30B-A3B (32 + 4 heads x 128) and Gemma 4 (16 + 8 heads x 256, 16 + 2 x
512) on the cos/sin tables, 16 steps from positions (see MIN_STEPS for the deciding figures); 2 MiB blocks (10-13
steps at S=2048) leave too large a share of the time to the exposed first read and last write. At S=32768 the same
rules give 99.0-99.9 % of the HBM roofline. Decode (one position per sequence; the api runs B sequences of one token
as one sequence of B tokens): at most 4 steps of up to half the target (see SMALL_PROBLEM_STEPS), never below the
MIN_BLOCK_BYTES floor; 1-step grids and 8-token blocks lose 10-30 %.
"""

import dataclasses
import math

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import check_block_dim, check_vmem_fit, sublane_multiple

# Input bytes (q + k heads of the block) per grid step, in proportion to the HBM bandwidth (v5e half of v6e's, a v7x
# core about twice), so a step takes about as long on each.
TARGET_BLOCK_BYTES = {"v5e": 512 << 10, "v6e": 1 << 20, "v7x": 2 << 20}
# Long grids (at least LONG_GRID_STEPS blocks of the target size): the exposed edges no longer matter, the per-step
# cost does, so blocks twice the target, up to LONG_BLOCK_MAX_BYTES (the fused norm + rope at head_dim 128 is nearly
# compute-bound: Qwen3 at S=32768 gains about 3 points of the roofline over blocks of the target size; HBM-bound
# shapes lose < 0.5 %).
LONG_GRID_STEPS = 64
LONG_BLOCK_MAX_BYTES = 2 << 20
# Never split below this many input bytes per step just to get more steps.
MIN_BLOCK_BYTES = 256 << 10
# Aim for at least this many grid steps when the data allows: the first read and the last write are exposed, so
# their share shrinks with the step count (and v7x's two TensorCores split the grid). The kernels on cos/sin tables
# are HBM-bound (the norm's row sums run on the MXU): 32 steps (Qwen3 prefill S=2048: 64-token blocks; fused
# norm + rope 92.7 % of the roofline vs 91.5 % with 16 and 82.3 % with 64, modeled v6e). With cos/sin computed from
# positions a step does more compute and its fixed cost matters more: 16 steps (90.1 % vs 79.4 % with 32).
MIN_STEPS = 32
MIN_STEPS_FROM_POSITIONS = 16
# Small problems (at most SMALL_PROBLEM_STEPS blocks of the target size: every decode batch up to 256 tokens, no
# prefill at the benchmark shapes): MIN_STEPS would cut them into blocks of the MIN_BLOCK_BYTES floor, and each step
# has its fixed cost. Since the per-token factor rows come by broadcast loads, fewer, larger blocks model faster: at
# least SMALL_MIN_STEPS steps (the first read and last write stay exposed) of up to SMALL_TARGET_SHARE of the target.
# Modeled v6e at 256 decode tokens, fused norm + rope from positions, against the MIN_STEPS split down to the floor:
# Qwen3 5.36 vs 5.58 us (64-token blocks), Gemma 4 sliding 5.40 vs 6.35, full 7.68 vs 8.31 (32); within +-0.08 us
# elsewhere, the same below 64 tokens and on v5e.
SMALL_PROBLEM_STEPS = 8
SMALL_MIN_STEPS = 4
SMALL_TARGET_SHARE = 0.5
# Live f32 copies of a head slab inside the kernel body (upcast x, the partner lanes, the rotated result, ...).
F32_TEMPORARIES = 4
VMEM_SHARE = 0.5


# Token-major (seq_major) blocks of at most this many tokens read their per-token factor rows by broadcast loads
# (the kernel body is unrolled over the block's tokens: 256 is Qwen3's long-prefill block; larger ones come with few
# heads and keep the in-register broadcast). RotaryBlocks.broadcast_loads chooses either path explicitly.
BROADCAST_LOAD_MAX_TOKENS = 256
# candidate_blocks: the table's tokens per step times these factors (a sweep around the choice, not a search).
CANDIDATE_FACTORS = (1 / 4, 1 / 2, 2, 4)


@dataclasses.dataclass(frozen=True)
class RotaryBlocks:
    """Tile sizes of the rotary kernels: the `blocks=` of apply_rotary, rms_norm_rope, the from-positions ops and
    their backward ops.

    Sizes count what the kernel sees: q and k as [B, S, H, D] ("bshd") or [B, H, S, D] ("bhsd"), except that a
    decode call (S = 1) runs its B sequences as one sequence of B tokens, so there block_batch is 1 and block_seq
    counts tokens (sequences).
    block_batch: sequences per grid step; at or above the batch, the whole batch. None (with block_seq None): the
        tuning table's.
    block_seq: tokens of a sequence per grid step. Below the sequence length it must be a multiple of the sublane tile
        of q/k and of the tables (8 rows of 32-bit, 16 of 16-bit): it is their second-minor dimension; at or above it,
        the whole sequence.
    vmem_limit_bytes: the scoped VMEM the kernel may use; None: derived from the blocks' working set
        (`chip.scoped_vmem_limit`), as the table does.
    broadcast_loads: how token-major blocks (bshd, decode) get each token's factor rows onto every sublane: True by
        broadcast loads from VMEM scratch, False by broadcasts in registers; None: broadcast loads up to
        BROADCAST_LOAD_MAX_TOKENS tokens a block. Head-major blocks (bhsd prefill) have no such choice (None or False).

    The gradient of a call runs the transpose-rotation kernel with the same blocks; the per-head RMSNorm's gradient
    in rms_norm_rope (an RMSNorm backward over rows of head_dim) takes the RMSNorm tuning table's blocks.
    """

    block_batch: int | None = None
    block_seq: int | None = None
    vmem_limit_bytes: int | None = None
    broadcast_loads: bool | None = None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _nearest_power_of_two(n: int) -> int:
    """The power of two nearest to n on a log scale (n >= 1)."""
    low = 1 << (max(1, n).bit_length() - 1)
    return low * 2 if n * n > 2 * low * low else low


def _seq_multiple(dtype, table_dtypes) -> int:
    """The seq block is the second-minor dim of the tables (and of x in bhsd): a sublane multiple, or all of seq."""
    return max([sublane_multiple(dtype)] + [sublane_multiple(d) for d in table_dtypes])


def _vmem_per_token(*, heads, head_dim, dtype, table_width, table_dtypes, seq_major, **_) -> int:
    """VMEM per token of a block: in + out blocks double-buffered (bshd pads each token's (H, D) tile to whole sublane
    groups), tables double-buffered and lane-padded, plus the body's f32 temporaries. (Takes choose_blocks' shape
    arguments; batch, seq and from_positions do not matter.)"""
    itemsize = jnp.dtype(dtype).itemsize
    if seq_major:
        padded_heads = sum(_round_up(h, sublane_multiple(dtype)) for h in heads)
    else:
        padded_heads = sum(heads)
    lanes = _round_up(head_dim, 128)
    vmem_per_token = (
        2 * 2 * padded_heads * lanes * itemsize
        + sum(2 * _round_up(table_width, 128) * jnp.dtype(d).itemsize for d in table_dtypes)
        + F32_TEMPORARIES * max(heads) * lanes * 4
    )
    if seq_major:  # the kernel parks two f32 factor rows per token for each array in VMEM scratch
        vmem_per_token += 2 * len(heads) * _round_up(table_width, 128) * 4
    return vmem_per_token


def _split(tokens: int, batch: int, seq: int, seq_multiple: int) -> tuple[int, int]:
    """A token budget as (block_batch, block_seq): whole sequences when it holds one, else part of one sequence."""
    if tokens >= seq:
        return max(1, min(batch, tokens // seq)), seq
    block_seq = max(seq_multiple, tokens // seq_multiple * seq_multiple)
    return 1, min(block_seq, seq)


def _default_broadcast_loads(seq_major: bool, block_batch: int, block_seq: int) -> bool:
    return seq_major and block_batch * block_seq <= BROADCAST_LOAD_MAX_TOKENS


def choose_blocks(
    *,
    batch: int,
    seq: int,
    heads: tuple[int, ...],
    head_dim: int,
    dtype,
    table_width: int,
    table_dtypes: tuple = (),
    seq_major: bool,
    from_positions: bool = False,
    info: pltpu.TpuInfo | None = None,
) -> RotaryBlocks:
    """Blocks for arrays [batch, seq, H, head_dim] (seq_major, "bshd") or [batch, H, seq, head_dim] ("bhsd"), one per
    entry of `heads`, plus per-token tables of `table_width` lanes in `table_dtypes` (cos/sin, or positions when
    `from_positions`)."""
    info = info or chip.current_tpu_info()
    generation = chip.generation_name(info)
    itemsize = jnp.dtype(dtype).itemsize
    seq_multiple = _seq_multiple(dtype, table_dtypes)
    in_bytes_per_token = sum(heads) * head_dim * itemsize
    vmem_per_token = _vmem_per_token(
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        table_width=table_width,
        table_dtypes=table_dtypes,
        seq_major=seq_major,
    )
    vmem_budget = int(info.vmem_capacity_bytes * VMEM_SHARE)
    tokens_by_vmem = vmem_budget // vmem_per_token
    total = batch * seq
    target_bytes = TARGET_BLOCK_BYTES.get(generation, TARGET_BLOCK_BYTES["v6e"])
    if total * in_bytes_per_token >= LONG_GRID_STEPS * target_bytes:
        target_bytes = max(target_bytes, min(2 * target_bytes, LONG_BLOCK_MAX_BYTES))
    target = target_bytes // in_bytes_per_token
    floor = max(1, MIN_BLOCK_BYTES // in_bytes_per_token)
    if total * in_bytes_per_token <= SMALL_PROBLEM_STEPS * target_bytes:  # see SMALL_PROBLEM_STEPS
        small_target = max(floor, int(target_bytes * SMALL_TARGET_SHARE) // in_bytes_per_token)
        tokens = min(small_target, max(floor, math.ceil(total / SMALL_MIN_STEPS)))
    else:
        min_steps = MIN_STEPS_FROM_POSITIONS if from_positions else MIN_STEPS
        tokens = min(target, max(floor, math.ceil(total / min_steps)))
    tokens = _nearest_power_of_two(max(1, tokens))
    tokens = max(min(tokens, tokens_by_vmem), 1)
    block_batch, block_seq = _split(tokens, batch, seq, seq_multiple)
    smallest = block_batch * block_seq
    if smallest > tokens_by_vmem:
        raise ValueError(
            f"q: heads {heads} x head_dim {head_dim} are too large for this kernel: {smallest} token(s) per step need "
            f"{smallest * vmem_per_token} bytes of VMEM, over the {vmem_budget} it may use on {generation}"
        )
    working_set = block_batch * block_seq * vmem_per_token
    vmem_limit = chip.scoped_vmem_limit(info, working_set)
    return RotaryBlocks(
        block_batch=block_batch,
        block_seq=block_seq,
        vmem_limit_bytes=vmem_limit,
        broadcast_loads=_default_broadcast_loads(seq_major, block_batch, block_seq),
    )


def check_blocks_type(blocks):
    if blocks is not None and not isinstance(blocks, RotaryBlocks):
        raise TypeError(f"blocks: expected a RotaryBlocks or None, got {type(blocks).__name__}")


def resolve_blocks(blocks: RotaryBlocks | None, *, info: pltpu.TpuInfo | None = None, **shape) -> RotaryBlocks:
    """The blocks a kernel runs with (every field set): the table's for None (and for fields left None), else the
    caller's, checked. `shape`: choose_blocks' shape arguments. Raises TypeError/ValueError naming the field."""
    check_blocks_type(blocks)
    info = info or chip.current_tpu_info()
    batch, seq, dtype, seq_major = shape["batch"], shape["seq"], shape["dtype"], shape["seq_major"]
    table_dtypes = shape.get("table_dtypes", ())
    blocks = blocks or RotaryBlocks()
    if blocks.broadcast_loads is not None and not isinstance(blocks.broadcast_loads, bool):
        raise TypeError(
            f"blocks.broadcast_loads: expected True, False or None, got {type(blocks.broadcast_loads).__name__}"
        )
    if blocks.broadcast_loads and not seq_major:
        raise ValueError(
            "blocks.broadcast_loads: only token-major blocks (layout 'bshd', or a decode call) read factor rows by "
            "broadcast loads; expected None or False for this head-major ('bhsd') call, got True"
        )
    if (blocks.block_batch is None) != (blocks.block_seq is None):
        raise ValueError(
            "blocks: expected both block_batch and block_seq, or neither (the tuning table's), got "
            f"block_batch={blocks.block_batch!r}, block_seq={blocks.block_seq!r}"
        )
    if blocks.block_batch is None and blocks.vmem_limit_bytes is None:
        table = choose_blocks(**shape, info=info)
        if blocks.broadcast_loads is None:
            return table
        return dataclasses.replace(table, broadcast_loads=blocks.broadcast_loads)
    if blocks.block_batch is None:
        table = choose_blocks(**shape, info=info)
        block_batch, block_seq = table.block_batch, table.block_seq
    else:
        block_batch = check_block_dim(
            "blocks", "block_batch", blocks.block_batch, dim=batch, multiple=1, why="", dim_name="the batch"
        )
        names = sorted({jnp.dtype(d).name for d in (dtype, *table_dtypes)})
        block_seq = check_block_dim(
            "blocks",
            "block_seq",
            blocks.block_seq,
            dim=seq,
            multiple=_seq_multiple(dtype, table_dtypes),
            why=f"whole sublane tiles of the {' and '.join(names)} blocks it is the second-minor dimension of",
            dim_name="the sequence length (a decode call's batch)",
        )
    working_set = block_batch * block_seq * _vmem_per_token(**shape)
    vmem_limit = blocks.vmem_limit_bytes
    if vmem_limit is None:
        vmem_limit = chip.scoped_vmem_limit(info, working_set)
    check_vmem_fit("blocks", working_set, vmem_limit, info)
    broadcast_loads = blocks.broadcast_loads
    if broadcast_loads is None:
        broadcast_loads = _default_broadcast_loads(seq_major, block_batch, block_seq)
    return RotaryBlocks(
        block_batch=block_batch,
        block_seq=block_seq,
        vmem_limit_bytes=int(vmem_limit),
        broadcast_loads=broadcast_loads,
    )


def candidate_blocks(*, info: pltpu.TpuInfo | None = None, **shape) -> list[RotaryBlocks]:
    """Legal blocks worth modeling at a shape (`shape`: choose_blocks' shape arguments): the table's choice first,
    then blocks of a quarter to four times its tokens per step, split into (block_batch, block_seq) as the table
    splits, whole sublane tiles, fitting this generation's scoped VMEM limit; the factor-row path of each is the
    default rule's."""
    info = info or chip.current_tpu_info()
    choice = choose_blocks(**shape, info=info)
    tokens = choice.block_batch * choice.block_seq
    candidates = [choice]
    for factor in CANDIDATE_FACTORS:
        multiple = _seq_multiple(shape["dtype"], shape.get("table_dtypes", ()))
        block_batch, block_seq = _split(max(1, int(tokens * factor)), shape["batch"], shape["seq"], multiple)
        try:
            blocks = resolve_blocks(RotaryBlocks(block_batch=block_batch, block_seq=block_seq), **shape, info=info)
        except ValueError:  # too large for the scoped VMEM limit
            continue
        if all((blocks.block_batch, blocks.block_seq) != (c.block_batch, c.block_seq) for c in candidates):
            candidates.append(blocks)
    return candidates[:1] + sorted(candidates[1:], key=lambda b: b.block_batch * b.block_seq)
