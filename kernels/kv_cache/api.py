"""Public JAX API of the paged KV cache write: input validation, scales, RoPE tables, block choice.

    write_kv_cache(k_cache, v_cache, key, value, slot_mapping)     vLLM's reshape_and_cache_flash, in place
    rope_and_write_kv_cache(query, key, value, k_cache, v_cache, slot_mapping, positions, theta=...)
                                                                    RoPE of Q and K, K/V written: one pass
    rope_tables_and_write_kv_cache(query, key, value, k_cache, v_cache, slot_mapping, cos, sin)
                                                                    the same from each token's cos / sin rows
    block_table_slots(block_table, cache_seqlens, new_tokens, page_size)   flash-attn's paged addressing as slots

Cache layout: k_cache [num_pages, page_size, kv_heads, head_dim], v_cache [num_pages, page_size, kv_heads,
v_head_dim] in bfloat16, float32 or float8_e4m3fn; slot s = page * page_size + offset. key [T, kv_heads, head_dim],
value [T, kv_heads, v_head_dim] in the cache's dtype (bfloat16 or float32 for an fp8 cache); slot_mapping [T] int32,
-1 = skip the token. An fp8 cache needs k_scale and v_scale (a Python float, or a float32 array of shape [] or [1],
traced or not): it stores value / scale (computed as value * (1 / scale)), saturated to +-448 and rounded to e4m3fn;
a reader dequantises stored * scale (vLLM's convention).

In place: the caches are aliased input -> output of the kernel, which writes only the named rows by DMA. Under a jit
that donates the caches (`jax.jit(..., donate_argnums=...)`) XLA copies nothing; without donation XLA must keep the
caller's caches intact and copies each once before the kernel (a full-cache copy: donate them).

Slots: on concrete (host) arrays every slot must be -1 or in [0, num_pages * page_size), and the non-negative ones
distinct (an error otherwise). On traced arrays nothing can be checked; the kernel skips every token whose slot is
negative or past the cache (it never writes outside the cache), and duplicate slots get one of their tokens' rows.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..common import chip
from ..common.interpret import interpret_eager_cpu_calls
from ..common.validation import check_array, check_finite_nonnegative, is_concrete
from ..rotary import api as rotary_api
from ..rotary import kernel as rotary_kernel
from . import kernel, tuning
from .tuning import KVCacheBlocks

CACHE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn))
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
# Inputs an fp8 cache quantises.
FP8_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
INT32 = jnp.dtype(jnp.int32)
# cos / sin rows of rope_tables_and_write_kv_cache (computed in f32 in the kernel).
TABLE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The slot mapping of one kernel call lives in SMEM (4 bytes a token); longer calls are split into calls of this
# many tokens, chained through the aliased caches.
MAX_TOKENS_PER_CALL = 16384


# ------------------------------------------------------------------------------------------------------- validation
def _check_caches(k_cache, v_cache):
    dtype = check_array("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES)
    check_array("v_cache", v_cache, ndim=4, dtypes=(dtype,))
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(
            f"v_cache: expected the pages, page size and kv heads of k_cache {tuple(k_cache.shape[:3])}, "
            f"got shape {tuple(v_cache.shape)}"
        )
    return dtype


def _check_rows(key, value, k_cache, v_cache, cache_dtype):
    """key / value against the caches: [T, kv_heads, D / Dv] in the cache dtype (bf16/f32 for an fp8 cache)."""
    allowed = FP8_INPUT_DTYPES if cache_dtype == FP8_DTYPE else (cache_dtype,)
    what = "the cache dtype" if cache_dtype != FP8_DTYPE else "bfloat16 or float32 for an fp8 cache"
    if hasattr(key, "dtype") and jnp.dtype(key.dtype) not in allowed:
        raise TypeError(f"key: expected {what} ({', '.join(map(str, allowed))}), got dtype {jnp.dtype(key.dtype)}")
    check_array("key", key, ndim=3, dtypes=allowed)
    check_array("value", value, ndim=3, dtypes=(jnp.dtype(key.dtype),))
    heads = k_cache.shape[2]
    for name, x, cache, cache_name in (("key", key, k_cache, "k_cache"), ("value", value, v_cache, "v_cache")):
        if tuple(x.shape[1:]) != tuple(cache.shape[2:]):
            raise ValueError(
                f"{name}: expected [tokens, {heads}, {cache.shape[3]}] (the kv heads and head dim of {cache_name}), "
                f"got shape {tuple(x.shape)}"
            )
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value: expected {key.shape[0]} tokens (key's), got shape {tuple(value.shape)}")
    return key.shape[0]


def check_slot_mapping(slot_mapping, tokens: int, num_slots: int):
    """slot_mapping [T] int32; on concrete arrays -1 or a slot of the cache, the used slots distinct."""
    check_array("slot_mapping", slot_mapping, ndim=1, dtypes=(INT32,))
    if slot_mapping.shape[0] != tokens:
        raise ValueError(
            f"slot_mapping: expected shape ({tokens},), one slot per token, got {tuple(slot_mapping.shape)}"
        )
    if is_concrete(slot_mapping) and tokens:
        values = np.asarray(slot_mapping)
        bad = values[(values < -1) | (values >= num_slots)]
        if bad.size:
            raise ValueError(
                f"slot_mapping: expected -1 (skip) or a slot in [0, {num_slots}) (num_pages * page_size), "
                f"got {int(bad[0])}"
            )
        used = values[values >= 0]
        unique, counts = np.unique(used, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"slot_mapping: expected distinct slots, got slot {int(unique[counts > 1][0])} twice or more"
            )


def _check_scale(name, scale, quantized: bool):
    """A scale: None (only for a non-fp8 cache), a Python float > 0, or a float32 array [] / [1] (> 0 if concrete)."""
    if not quantized:
        if scale is not None:
            raise ValueError(f"{name}: only an fp8 (float8_e4m3fn) cache takes a scale, expected None, got {scale!r}")
        return None
    if scale is None:
        raise ValueError(f"{name}: an fp8 (float8_e4m3fn) cache needs a scale (stored = value / scale), got None")
    if hasattr(scale, "shape") and hasattr(scale, "dtype"):
        check_array(name, scale, dtypes=(jnp.dtype(jnp.float32),))
        if tuple(scale.shape) not in ((), (1,)):
            raise ValueError(f"{name}: expected a float32 array of shape [] or [1], got shape {tuple(scale.shape)}")
        if is_concrete(scale):
            value = float(np.asarray(scale).reshape(()))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite scale > 0, got {value}")
        return scale
    value = check_finite_nonnegative(name, scale)
    if value <= 0:
        raise ValueError(f"{name}: expected a finite scale > 0, got {value}")
    return value


def check_inputs(k_cache, v_cache, key, value, slot_mapping, *, k_scale=None, v_scale=None):
    """Validate write_kv_cache's arguments (arrays or ShapeDtypeStructs); returns (tokens, (k_scale, v_scale))."""
    cache_dtype = _check_caches(k_cache, v_cache)
    tokens = _check_rows(key, value, k_cache, v_cache, cache_dtype)
    check_slot_mapping(slot_mapping, tokens, k_cache.shape[0] * k_cache.shape[1])
    quantized = cache_dtype == FP8_DTYPE
    return tokens, (_check_scale("k_scale", k_scale, quantized), _check_scale("v_scale", v_scale, quantized))


def check_rope_inputs(query, key, positions, *, theta, rotary_dim, scaling, interleaved):
    """query [T, Hq, D] in key's dtype, positions [T] int32; the rope parameters as the rotary ops check them.
    Returns (inverse frequencies, attention scaling, rotated lanes)."""
    check_array("query", query, ndim=3, dtypes=(jnp.dtype(key.dtype),))
    tokens, head_dim = key.shape[0], key.shape[2]
    if query.shape[0] != tokens or query.shape[2] != head_dim:
        raise ValueError(
            f"query: expected [{tokens}, heads, {head_dim}] (key's tokens and head dim), got shape {tuple(query.shape)}"
        )
    check_array("positions", positions, ndim=1, dtypes=(INT32,))
    if positions.shape[0] != tokens:
        raise ValueError(f"positions: expected shape ({tokens},), one position per token, got {tuple(positions.shape)}")
    as_batch = positions.reshape(1, tokens) if is_concrete(positions) else jax.ShapeDtypeStruct((1, tokens), INT32)
    return rotary_api.check_position_inputs(
        jax.ShapeDtypeStruct((1,) + tuple(query.shape), query.dtype),
        jax.ShapeDtypeStruct((1,) + tuple(key.shape), key.dtype),
        as_batch,
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        interleaved=interleaved,
        layout="bshd",
    )


def _resolve(blocks, k_cache, v_cache, key, q_heads=0):
    return tuning.resolve_blocks(
        blocks,
        tokens=min(key.shape[0], MAX_TOKENS_PER_CALL),
        kv_heads=k_cache.shape[2],
        head_dim=k_cache.shape[3],
        v_head_dim=v_cache.shape[3],
        dtype=key.dtype,
        cache_dtype=k_cache.dtype,
        q_heads=q_heads,
        info=chip.current_tpu_info(),
    )


# ------------------------------------------------------------------------------------------------------ the kernel
def _inv_scales(scales):
    """[1 / k_scale, 1 / v_scale] f32 for the kernel's SMEM (a scale may be traced: torch passes tensors)."""
    return jnp.stack([1.0 / jnp.asarray(s, jnp.float32).reshape(()) for s in scales])


def _flat(cache):
    """[num_pages, page_size, H, D] -> [num_pages * page_size, H, D]: a bitcast (the tiled minor dims are kept)."""
    return cache.reshape((cache.shape[0] * cache.shape[1],) + cache.shape[2:])


def _write(k_cache, v_cache, key, value, slot_mapping, scales, blocks, rope=None):
    """The kernel over the tokens in calls of at most MAX_TOKENS_PER_CALL; rope: (query or None, table_a, table_b,
    RopeConfig) or None, the tables positions [T] and inverse frequencies [1, W] (RopeConfig.from_positions) or each
    token's cos and sin rows [T, W]. Returns (query_rotated or None, k_cache, v_cache)."""
    given = key.shape[0]
    shapes = k_cache.shape, v_cache.shape
    pages, page_size, hkv = k_cache.shape[:3]
    # At every token count, unless the caller made the caches row-major: the row path would write through XLA's
    # relayout of the whole cache before and after the kernel, a cost that grows with the cache, not the tokens.
    head_major = not blocks.row_major_caches and kernel.head_major_cache(
        hkv=hkv, page_size=page_size, cache_itemsize=k_cache.dtype.itemsize
    )
    if head_major:  # XLA's own layout of such a cache: the same bytes (no copy), written by word groups
        k_flat, v_flat = k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2)
        key, value, slot_mapping, rope, blocks = _whole_tiles(key, value, slot_mapping, rope, blocks)
    else:
        k_flat, v_flat = _flat(k_cache), _flat(v_cache)
    quantize = (k_cache.dtype == FP8_DTYPE,) * 2
    inv_scales = _inv_scales(scales) if any(quantize) else None
    tokens = key.shape[0]
    q_parts = []
    for start in range(0, tokens, MAX_TOKENS_PER_CALL):
        stop = min(tokens, start + MAX_TOKENS_PER_CALL)
        part = (lambda x: x) if (start, stop) == (0, tokens) else (lambda x: x[start:stop])
        count = stop - start
        extra, positions_layout = {}, None
        if rope is not None:
            query, table_a, table_b, rope_cfg = rope
            if rope_cfg.from_positions:
                positions_layout = rotary_kernel.positions_layout(
                    (1, count), seq=count, cfg=rope_cfg, width=table_b.shape[-1], blocks=kernel.rope_blocks(blocks)
                )
                pos = part(table_a)
                pos = pos.reshape(1, count, 1) if positions_layout.mode == "column" else pos.reshape(1, 1, count)
                extra = dict(table_a=pos, table_b=table_b)
            else:
                extra = dict(table_a=part(table_a)[None], table_b=part(table_b)[None])
            extra["query"] = None if query is None else part(query)
        cfg = kernel.WriteConfig(
            tokens=count,
            num_slots=pages * page_size,
            quantize=quantize,
            rope=None if rope is None else rope[3],
            positions=positions_layout,
            rope_query=rope is not None and rope[0] is not None,
            page_size=page_size if head_major else 0,
        )
        q_out, k_flat, v_flat = kernel.write(
            k_flat,
            v_flat,
            part(key),
            part(value),
            part(slot_mapping),
            inv_scales,
            cfg=cfg,
            blocks=blocks,
            **extra,
        )
        q_parts.append(q_out)
    query_rotated = None
    if rope is not None and rope[0] is not None:
        query_rotated = q_parts[0] if len(q_parts) == 1 else jnp.concatenate(q_parts)
        query_rotated = query_rotated[:given] if query_rotated.shape[0] != given else query_rotated
    if head_major:
        return query_rotated, k_flat.swapaxes(1, 2), v_flat.swapaxes(1, 2)
    return query_rotated, k_flat.reshape(shapes[0]), v_flat.reshape(shapes[1])


def _whole_tiles(key, value, slot_mapping, rope, blocks):
    """The head-major path's tokens padded to whole float8 tiles (slot -1: skipped) and its token block a multiple of
    them: the kernel stages a block's rows head-major, [H, tokens, D], and reads them as 32-bit words."""
    multiple = kernel.HEAD_MAJOR_TOKENS
    tokens = key.shape[0]
    padded = -(-tokens // multiple) * multiple
    block = min(-(-blocks.block_tokens // multiple) * multiple, padded)
    blocks = dataclasses.replace(blocks, block_tokens=block)
    if padded == tokens:
        return key, value, slot_mapping, rope, blocks

    def pad(x, fill=0):
        return jnp.pad(x, [(0, padded - tokens)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)

    if rope is not None:
        query, table_a, table_b, rope_cfg = rope
        per_token_b = not rope_cfg.from_positions  # sin rows, not the inverse frequencies
        rope = (
            None if query is None else pad(query),
            pad(table_a),
            pad(table_b) if per_token_b else table_b,
            rope_cfg,
        )
    return pad(key), pad(value), pad(slot_mapping, -1), rope, blocks


# ------------------------------------------------------------------------------------------------------ public API
@interpret_eager_cpu_calls
def write_kv_cache(
    k_cache: jax.Array,
    v_cache: jax.Array,
    key: jax.Array,
    value: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale=None,
    v_scale=None,
    blocks: KVCacheBlocks | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(k_cache, v_cache) with key[t] and value[t] written at slot slot_mapping[t] (-1: skipped), in place (donate
    the caches under jit). See the module docstring for shapes, dtypes, scales and slot checks. blocks: the tiling
    (KVCacheBlocks), None for the tuning table's."""
    tokens, scales = check_inputs(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    blocks = _resolve(blocks, k_cache, v_cache, key)
    if tokens == 0:
        return k_cache, v_cache
    _, k_cache, v_cache = _write(k_cache, v_cache, key, value, slot_mapping, scales, blocks)
    return k_cache, v_cache


@interpret_eager_cpu_calls
def rope_and_write_kv_cache(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slot_mapping: jax.Array,
    positions: jax.Array,
    *,
    theta: float,
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    interleaved: bool = False,
    k_scale=None,
    v_scale=None,
    blocks: KVCacheBlocks | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rope(query), k_cache, v_cache) with rope(key) and value written at their slots, in one kernel.

    query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv], positions [T] int32 (each token's position). The RoPE is
    the rotary ops' from positions (apply_rotary_from_positions): theta, rotary_dim, scaling (transformers'
    rope_parameters: "default", "linear", "llama3", "yarn", "proportional"), interleaved; math in f32, the rotated
    K rounded to key's dtype before it is stored (or quantised). Everything else as write_kv_cache."""
    tokens, scales = check_inputs(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    inv_freq, attention_scaling, rotated = check_rope_inputs(
        query, key, positions, theta=theta, rotary_dim=rotary_dim, scaling=scaling, interleaved=interleaved
    )
    blocks = _resolve(blocks, k_cache, v_cache, key, q_heads=query.shape[1])
    if tokens == 0:
        return query, k_cache, v_cache
    head_dim = key.shape[2]
    _, inv_table = rotary_api._position_tables(None, np.asarray(inv_freq, np.float32), bool(interleaved), head_dim)
    nonzero = np.flatnonzero(np.asarray(inv_freq))
    angle_lanes = max(128, -(-(int(nonzero[-1]) + 1 if nonzero.size else 0) // 128) * 128)
    rope_cfg = rotary_kernel.RopeConfig(
        rotary_dim=rotated,
        interleaved=bool(interleaved),
        seq_major=True,
        from_positions=True,
        attention_scaling=attention_scaling,
        angle_lanes=angle_lanes,
    )
    return _write(
        k_cache, v_cache, key, value, slot_mapping, scales, blocks, rope=(query, positions, inv_table, rope_cfg)
    )


def check_table_inputs(query, key, cos, sin):
    """cos / sin [T, r] (each token's rows, one float dtype, r even, 2 <= r <= head_dim), query [T, Hq, D] in key's
    dtype or None. Returns r."""
    if query is not None:
        check_array("query", query, ndim=3, dtypes=(jnp.dtype(key.dtype),))
        if query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
            raise ValueError(
                f"query: expected [{key.shape[0]}, heads, {key.shape[2]}] (key's tokens and head dim), got shape "
                f"{tuple(query.shape)}"
            )
    check_array("cos", cos, ndim=2, dtypes=TABLE_DTYPES)
    check_array("sin", sin, ndim=2, dtypes=(jnp.dtype(cos.dtype),))
    if cos.shape[0] != key.shape[0]:
        raise ValueError(f"cos: expected [{key.shape[0]}, rotary_dim] (a row per token of key), got {tuple(cos.shape)}")
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    return rotary_api._check_rotary_dim(cos.shape[1], key.shape[2], what="rotary_dim (cos.shape[-1])")


@interpret_eager_cpu_calls
def rope_tables_and_write_kv_cache(
    query: jax.Array | None,
    key: jax.Array,
    value: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slot_mapping: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    interleaved: bool = False,
    k_scale=None,
    v_scale=None,
    blocks: KVCacheBlocks | None = None,
) -> tuple[jax.Array | None, jax.Array, jax.Array]:
    """rope_and_write_kv_cache with each token's cos / sin rows given instead of positions (flash-attn's rotary
    tables gathered at the tokens' positions): (rope(query) or None, k_cache, v_cache), in one kernel.

    cos / sin [T, r] (float32 or bfloat16; used in f32): the first r lanes of token t's heads rotate as the rotary
    ops' apply_rotary does (x * cos + rotate(x) * sin, GPT-J pairs when interleaved), the rest pass through. query
    [T, Hq, D] or None (only K rotated). The rotated K is rounded to key's dtype before it is stored (or quantised).
    Everything else as write_kv_cache."""
    tokens, scales = check_inputs(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    rotated = check_table_inputs(query, key, cos, sin)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    blocks = _resolve(blocks, k_cache, v_cache, key, q_heads=key.shape[1] if query is None else query.shape[1])
    if tokens == 0:
        return query, k_cache, v_cache
    # f32 rows (the kernel's math; a bf16 table's block of 8 tokens would be half a packed tile), padded to the width
    # the kernel rotates
    cos, sin = (t.astype(jnp.float32) for t in (cos, sin))
    cos, sin = (t[0] for t in rotary_api._cos_sin_tables(cos[None], sin[None], key.shape[2]))
    rope_cfg = rotary_kernel.RopeConfig(rotary_dim=rotated, interleaved=bool(interleaved), seq_major=True)
    return _write(k_cache, v_cache, key, value, slot_mapping, scales, blocks, rope=(query, cos, sin, rope_cfg))


def _check_int(name, value, *, minimum):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {int(value)}")
    return int(value)


def block_table_slots(block_table: jax.Array, cache_seqlens: jax.Array, new_tokens: int, page_size: int) -> jax.Array:
    """Slots [B * new_tokens] int32 for flash-attn's paged addressing: sequence b's new token j (rows b * new_tokens
    + j of the new K/V, flattened from [B, new_tokens, ...]) goes to position p = cache_seqlens[b] + j, i.e. page
    block_table[b, p // page_size] at offset p % page_size.

    block_table [B, pages] int32, cache_seqlens [B] int32. On concrete arrays a position past the table
    (p >= pages * page_size), a negative seqlen or a new token landing in a negative table entry (no page) is an
    error; traced, such tokens get slot -1 (skipped)."""
    page_size = _check_int("page_size", page_size, minimum=1)
    new_tokens = _check_int("new_tokens", new_tokens, minimum=0)
    check_array("block_table", block_table, ndim=2, dtypes=(INT32,))
    check_array("cache_seqlens", cache_seqlens, ndim=1, dtypes=(INT32,))
    batch, pages = block_table.shape
    if cache_seqlens.shape[0] != batch:
        raise ValueError(
            f"cache_seqlens: expected shape ({batch},), one length per sequence of block_table, "
            f"got {tuple(cache_seqlens.shape)}"
        )
    if pages == 0 and new_tokens:
        raise ValueError(f"block_table: expected at least one page per sequence, got shape {tuple(block_table.shape)}")
    if is_concrete(cache_seqlens) and batch:
        lengths = np.asarray(cache_seqlens)
        if lengths.min() < 0:
            raise ValueError(f"cache_seqlens: expected lengths >= 0, got {int(lengths.min())}")
        if new_tokens and lengths.max() + new_tokens > pages * page_size:
            raise ValueError(
                f"cache_seqlens: sequence {int(lengths.argmax())} holds {int(lengths.max())} tokens; with "
                f"{new_tokens} new ones it needs more than the {pages} pages x {page_size} of block_table"
            )
    if batch == 0 or new_tokens == 0:
        return jnp.zeros((0,), jnp.int32)
    if is_concrete(cache_seqlens) and is_concrete(block_table):
        table = np.asarray(block_table)
        position = np.asarray(cache_seqlens)[:, None] + np.arange(new_tokens)[None, :]
        entries = np.take_along_axis(table, position // page_size, axis=1)
        if entries.min() < 0:
            b, j = (int(i) for i in np.argwhere(entries < 0)[0])
            raise ValueError(
                f"block_table: sequence {b}'s new token {j} goes to position {int(position[b, j])}, in its page "
                f"{int(position[b, j]) // page_size}, whose entry is {int(entries[b, j])} (no page): expected a page "
                "index >= 0 for every page a new token lands in"
            )
    position = cache_seqlens[:, None] + jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
    page_index = position // page_size
    inside = (page_index < pages) & (position >= 0)
    page = jnp.take_along_axis(block_table, jnp.clip(page_index, 0, pages - 1), axis=1)
    inside &= page >= 0  # traced: a token in a missing page is skipped, never written at a negative slot
    slots = jnp.where(inside, page * page_size + position % page_size, -1)
    return slots.reshape(batch * new_tokens).astype(jnp.int32)
