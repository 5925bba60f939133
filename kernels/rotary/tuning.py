"""Token-block sizes for the rotary kernels, per TPU generation.

RoPE (and RMSNorm + RoPE) is memory-bound: every grid step streams all q and k heads of a block of tokens in and
out, plus the block's cos/sin rows (or positions). A step should move enough bytes that its ~0.35 us fixed cost hides
behind the DMAs, yet leave several steps for the pipeline to overlap (and for v7x's two cores to split), and its
double-buffered streams plus f32 temporaries must fit the VMEM the kernel asks for. Every entry is proven by the
deviceless compile test at the benchmark shapes on v5e, v6e and v7x.
"""
import dataclasses
import math

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import chip

# Input bytes (q + k heads of the block) per grid step. v5e has half v6e's HBM bandwidth, so a smaller block takes
# as long.
TARGET_BLOCK_BYTES = {"v5e": 1 << 20, "v6e": 2 << 20, "v7x": 2 << 20}
# Never split below this many input bytes per step just to get more steps.
MIN_BLOCK_BYTES = 256 << 10
# Aim for at least this many grid steps when the data allows (pipelining, and v7x's two TensorCores).
MIN_STEPS = 4
# Live f32 copies of a head slab inside the kernel body (upcast x, the partner lanes, the rotated result, ...).
F32_TEMPORARIES = 4
VMEM_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class RotaryBlocks:
    block_batch: int  # batch rows per step
    block_seq: int  # sequence positions per step
    vmem_limit_bytes: int


def sublane_multiple(dtype) -> int:
    """Second-minor granularity of a block: 8 rows of 32-bit, 16 for 16-bit dtypes (two rows per sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


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
    info: pltpu.TpuInfo | None = None,
) -> RotaryBlocks:
    """Blocks for arrays [batch, seq, H, head_dim] (seq_major, "bshd") or [batch, H, seq, head_dim] ("bhsd"), one per
    entry of `heads`, plus per-token tables of `table_width` lanes in `table_dtypes` (cos/sin, or positions)."""
    info = info or chip.current_tpu_info()
    generation = chip.generation_name(info)
    itemsize = jnp.dtype(dtype).itemsize
    # The seq block is the second-minor dim of the tables (and of x in bhsd): a sublane multiple, or all of seq.
    seq_multiple = max([sublane_multiple(dtype)] + [sublane_multiple(d) for d in table_dtypes])
    in_bytes_per_token = sum(heads) * head_dim * itemsize
    # VMEM per token: in + out blocks double-buffered (bshd pads each token's (H, D) tile to whole sublane groups),
    # tables double-buffered and lane-padded, plus the body's f32 temporaries.
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
    vmem_budget = int(info.vmem_capacity_bytes * VMEM_SHARE)
    tokens_by_vmem = vmem_budget // vmem_per_token
    total = batch * seq
    target = TARGET_BLOCK_BYTES.get(generation, TARGET_BLOCK_BYTES["v6e"]) // in_bytes_per_token
    floor = max(1, MIN_BLOCK_BYTES // in_bytes_per_token)
    tokens = min(target, max(floor, math.ceil(total / MIN_STEPS)), tokens_by_vmem)
    tokens = max(tokens, 1)

    # Split the token budget into (block_batch, block_seq).
    if tokens >= seq:
        block_seq = seq
        block_batch = max(1, min(batch, tokens // seq))
    else:
        block_batch = 1
        block_seq = max(seq_multiple, tokens // seq_multiple * seq_multiple)
        if block_seq >= seq:
            block_seq = seq
    smallest = block_batch * min(block_seq, seq)
    if smallest > tokens_by_vmem:
        raise ValueError(
            f"q: heads {heads} x head_dim {head_dim} are too large for this kernel: {smallest} token(s) per step need "
            f"{smallest * vmem_per_token} bytes of VMEM, over the {vmem_budget} it may use on {generation}"
        )
    working_set = block_batch * block_seq * vmem_per_token
    vmem_limit = min(int(info.vmem_capacity_bytes * 0.75), max(working_set * 3 // 2, 16 << 20))
    return RotaryBlocks(block_batch=block_batch, block_seq=block_seq, vmem_limit_bytes=vmem_limit)
