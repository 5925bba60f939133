"""Pallas TPU kernel writing new tokens' K/V rows into a paged KV cache in place, optionally with RoPE applied to the
new K (and Q) and fp8 quantisation on the way.

The caches stay in HBM (`memory_space=pl.ANY`) and are aliased input -> output, so the kernel never reads or copies
them: it only writes the named rows. The cache is seen flat, [num_pages * page_size, kv_heads, head_dim] (merging
the leading dims is a bitcast in XLA's layouts), so a slot is a row index and no page arithmetic runs in the kernel.
The slot mapping sits in SMEM (scalar prefetch). Grid: (1, token blocks); each step gets a block of new tokens' K/V
(and Q) in VMEM from Pallas' pipeline, stages the rows it transforms (RoPE, fp8) in VMEM scratch of the cache dtype,
then starts one DMA per token per cache from VMEM to the token's slot and waits for them before the step ends (the
block buffers are reused by the step after next). Tokens whose slot is negative or past the cache are skipped: the
kernel never writes outside the cache, whatever the slot values.

The grid's first axis is a single step: the rotary kernel's positions helpers (reused here) read the token block
index from grid axis 1.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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
    rope: rotary_kernel.RopeConfig | None = None  # RoPE of Q and K from positions, fused
    positions: rotary_kernel.PositionsLayout | None = None


def _quantized(x, inv_scale):
    """x * (1 / scale), saturated to e4m3fn's largest finite value (an overflowing cast would be NaN), rounded."""
    return jnp.clip(x.astype(jnp.float32) * inv_scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def _kernel(slots_ref, *refs, cfg: WriteConfig, block_tokens: int):
    refs = list(refs)
    scales_ref = refs.pop(0) if any(cfg.quantize) else None
    if cfg.rope is not None:
        pos_ref, inv_ref, q_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    k_ref, v_ref = refs.pop(0), refs.pop(0)
    refs.pop(0), refs.pop(0)  # the caches as inputs: aliased to the outputs, never read
    q_out_ref = refs.pop(0) if cfg.rope is not None else None
    k_cache, v_cache = refs.pop(0), refs.pop(0)
    k_stage = refs.pop(0) if (cfg.rope is not None or cfg.quantize[0]) else None
    v_stage = refs.pop(0) if cfg.quantize[1] else None
    sems = refs.pop(0)
    assert not refs

    key = None
    if cfg.rope is not None:
        rope = cfg.rope
        pos = rotary_kernel._positions_column(pos_ref, cfg.positions)  # (1, bt, 1) f32
        cos, sin = rotary_kernel._cos_sin(pos, inv_ref[...], rope, cfg.positions.packing)
        a, b = (t[:, :, None, :] for t in rotary_kernel._lane_factors(cos, sin, None, rope))  # (1, bt, 1, W)
        q = q_ref[...][None].astype(jnp.float32)
        q_out_ref[...] = rotary_kernel._normed_rotation(q, a, b, None, None, rope)[0].astype(q_out_ref.dtype)
        # Rounded to the inputs' dtype first, as the unfused rope -> write would store it.
        key = rotary_kernel._normed_rotation(k_ref[...][None].astype(jnp.float32), a, b, None, None, rope)[0]
        key = key.astype(k_ref.dtype)
    if cfg.quantize[0]:
        k_stage[...] = _quantized(k_ref[...] if key is None else key, scales_ref[0])
    elif key is not None:
        k_stage[...] = key.astype(k_stage.dtype)
    if cfg.quantize[1]:
        v_stage[...] = _quantized(v_ref[...], scales_ref[1])
    k_src = k_ref if k_stage is None else k_stage
    v_src = v_ref if v_stage is None else v_stage

    base = pl.program_id(1) * block_tokens

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

    def start(t, carry):
        slot, valid = slot_of(t)

        @pl.when(valid)
        def _():
            for copy in copies(t, slot):
                copy.start()

        return carry

    def wait(t, carry):
        slot, valid = slot_of(t)

        @pl.when(valid)
        def _():
            for copy in copies(t, slot):
                copy.wait()

        return carry

    jax.lax.fori_loop(0, block_tokens, start, 0)
    jax.lax.fori_loop(0, block_tokens, wait, 0)


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
    positions=None,
    inv_freq=None,
):
    """One pallas_call: (query_rotated or None, k_cache, v_cache) with the rows written in place.

    k_cache / v_cache: flat [num_slots, kv_heads, D] / [num_slots, kv_heads, Dv]; key / value [T, kv_heads, D / Dv];
    slot_mapping [T] int32; inv_scales [2] f32 (1 / k_scale, 1 / v_scale) when a cache is fp8. With cfg.rope:
    query [T, Hq, D], positions as cfg.positions lays them out, inv_freq [1, W] f32 (the rotary kernel's tables).
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
        layout = cfg.positions
        if layout.mode == "column":
            pos_spec = pl.BlockSpec((1, bt, 1), lambda i, j, slots: (0, j, 0))
        elif layout.mode == "row_blocks":
            pos_spec = pl.BlockSpec((1, 1, bt), lambda i, j, slots: (0, 0, j))
        else:
            pos_spec = whole(positions)
        operands += [positions, inv_freq, query]
        in_specs += [pos_spec, whole(inv_freq), token_block(query)]
    operands += [key, value, k_cache, v_cache]
    in_specs += [token_block(key), token_block(value), hbm, hbm]
    cache_at = len(operands) - 2 + 1  # the scalar-prefetch slot mapping is operand 0

    out_shape, out_specs = [], []
    if cfg.rope is not None:
        out_shape.append(out_struct(query.shape, query.dtype, slot_mapping, operands))
        out_specs.append(token_block(query))
    out_shape += [
        out_struct(k_cache.shape, k_cache.dtype, slot_mapping, operands),
        out_struct(v_cache.shape, v_cache.dtype, slot_mapping, operands),
    ]
    out_specs += [hbm, hbm]
    cache_out = len(out_shape) - 2

    scratch = []
    if cfg.rope is not None or cfg.quantize[0]:
        scratch.append(pltpu.VMEM((bt,) + k_cache.shape[1:], k_cache.dtype))
    if cfg.quantize[1]:
        scratch.append(pltpu.VMEM((bt,) + v_cache.shape[1:], v_cache.dtype))
    scratch.append(pltpu.SemaphoreType.DMA((2,)))

    row_bytes = sum(x.size * x.dtype.itemsize for x in (key, value))
    written = cfg.tokens * (k_cache[0].size * k_cache.dtype.itemsize + v_cache[0].size * v_cache.dtype.itemsize)
    q_bytes = 0 if query is None else 2 * query.size * query.dtype.itemsize
    cost = pl.CostEstimate(
        flops=0 if cfg.rope is None else 6 * (key.size + query.size),
        transcendentals=0 if cfg.rope is None else 2 * cfg.tokens * inv_freq.shape[-1],
        bytes_accessed=row_bytes + written + q_bytes + slot_mapping.size * 4,
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
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=blocks.vmem_limit_bytes
        ),
        cost_estimate=cost,
        name="rope_and_write_kv_cache" if cfg.rope is not None else "write_kv_cache",
    )(slot_mapping, *operands)
    if cfg.rope is not None:
        return outs[0], outs[1], outs[2]
    return None, outs[0], outs[1]


def rope_blocks(blocks: KVCacheBlocks) -> RotaryBlocks:
    """The rotary kernel's view of a token block (what its positions helpers read)."""
    return RotaryBlocks(block_batch=1, block_seq=blocks.block_tokens, broadcast_loads=False)
