"""Tokens per grid step of the KV cache write kernels, per TPU generation.

A grid step brings a block of new tokens' K and V (and Q for the fused RoPE) into VMEM, transforms them where it
must (RoPE, fp8 quantisation) and sends each token's (kv_heads, head_dim) rows to their cache slot by one DMA per
token per cache. The per-token DMAs are issued by the scalar core; the block's input DMA is pipelined by Pallas
behind the previous step. Larger blocks amortise the ~0.35 us fixed cost of a step; at least two steps let v7x's
two TensorCores share a decode batch. Every entry is proven by the deviceless compile test (v5e, v6e, v7x; page
sizes 16, 64, 256; head dims 64 to 512; bf16 and fp8).
"""

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import LANES, check_block_dim, check_vmem_fit, sublane_multiple

# Tokens per grid step by generation. A decode batch of up to 256 tokens runs in two steps; a prefill chunk in
# blocks of this many tokens. (Not yet chosen by the performance model: see docs/kv_cache.md.)
TABLE = {"v5e": 128, "v6e": 128, "v7x": 128}
# Token blocks are the second-minor dimension of the positions column (int32) of the fused RoPE variant.
TOKEN_MULTIPLE = 8
# Live f32 copies of a token block inside the fused RoPE body (upcast, partner lanes, rotated result).
F32_TEMPORARIES = 4


@dataclasses.dataclass(frozen=True)
class KVCacheBlocks:
    """Tile sizes of the KV cache write kernels: the `blocks=` of write_kv_cache and rope_and_write_kv_cache.

    block_tokens: new tokens per grid step, a multiple of 8, or at least the token count (one block). None: the
        tuning table's.
    vmem_limit_bytes: the scoped VMEM the kernel may use; None: derived from the blocks' working set.
    row_major_caches: True where the caches were created in the row-major layout (a `jax.experimental.layout.Format`
        with major_to_minor (0, 1, 2, 3)): every cache is then written row by row, in place. False: the caches are in
        XLA's default layout, in which float8 caches of 1 or 2 kv heads are head-major and are written by word groups
        (docs/kv_cache.md). A jitted function cannot see its arguments' layout, so the caller says it; the wrong
        choice costs XLA's relayout of the whole cache around the kernel, never a wrong answer.
    """

    block_tokens: int | None = None
    vmem_limit_bytes: int | None = None
    row_major_caches: bool = False


def check_blocks_type(blocks):
    if blocks is not None and not isinstance(blocks, KVCacheBlocks):
        raise TypeError(f"blocks: expected a KVCacheBlocks or None, got {type(blocks).__name__}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _tile_bytes(rows: int, cols: int, dtype) -> int:
    """VMEM bytes of a (rows, cols) tile of `dtype`: sublanes and lanes padded to whole vregs."""
    dtype = jnp.dtype(dtype)
    return _round_up(rows, sublane_multiple(dtype)) * _round_up(cols, LANES) * dtype.itemsize


def working_set(
    block_tokens: int, *, kv_heads: int, head_dim: int, v_head_dim: int, dtype, cache_dtype, q_heads: int = 0
) -> int:
    """VMEM of one step: the double-buffered K/V (and Q in and out) blocks, the staging buffers of rows that are
    transformed before their DMA (cache dtype), and the fused RoPE's f32 temporaries."""
    per_token = 2 * (_tile_bytes(kv_heads, head_dim, dtype) + _tile_bytes(kv_heads, v_head_dim, dtype))
    per_token += _tile_bytes(kv_heads, head_dim, cache_dtype) + _tile_bytes(kv_heads, v_head_dim, cache_dtype)
    if q_heads:
        per_token += 2 * 2 * _tile_bytes(q_heads, head_dim, dtype)
        per_token += F32_TEMPORARIES * _tile_bytes(max(q_heads, kv_heads), head_dim, jnp.float32)
        per_token += 2 * 2 * LANES * 4  # positions and their cos/sin rows
    return block_tokens * per_token


def resolve_blocks(
    blocks: KVCacheBlocks | None,
    *,
    tokens: int,
    kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    dtype,
    cache_dtype,
    q_heads: int = 0,
    info: pltpu.TpuInfo | None = None,
) -> KVCacheBlocks:
    """The blocks the kernel runs with (every field set): the table's for None and for fields left None, else the
    caller's, checked (TypeError/ValueError naming the field)."""
    check_blocks_type(blocks)
    info = info or chip.current_tpu_info()
    blocks = blocks or KVCacheBlocks()
    if not isinstance(blocks.row_major_caches, bool):
        raise TypeError(f"blocks.row_major_caches: expected a bool, got {blocks.row_major_caches!r}")
    requested = TABLE.get(chip.generation_name(info), TABLE["v6e"]) if blocks.block_tokens is None else None
    block_tokens = check_block_dim(
        "blocks",
        "block_tokens",
        requested if requested is not None else blocks.block_tokens,
        dim=max(tokens, 1),
        multiple=TOKEN_MULTIPLE,
        why="whole sublane tiles of the int32 positions column",
        dim_name="the token count",
    )
    need = working_set(
        block_tokens,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=dtype,
        cache_dtype=cache_dtype,
        q_heads=q_heads,
    )
    vmem_limit = blocks.vmem_limit_bytes
    if vmem_limit is None:
        vmem_limit = min(int(info.vmem_capacity_bytes * 0.75), chip.scoped_vmem_limit(info, need))
    check_vmem_fit("blocks", need, vmem_limit, info)
    return KVCacheBlocks(
        block_tokens=block_tokens, vmem_limit_bytes=int(vmem_limit), row_major_caches=blocks.row_major_caches
    )
