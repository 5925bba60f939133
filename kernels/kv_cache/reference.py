"""The paged KV cache write, written to be obviously right: plain jax.numpy scatters on the flattened cache.

Cache layout: k_cache [num_pages, page_size, kv_heads, head_dim], v_cache [num_pages, page_size, kv_heads,
v_head_dim]; slot s = page * page_size + offset is row s of the cache viewed as [num_pages * page_size, kv_heads,
head_dim]. A slot of -1 (or any slot outside the cache) writes nothing. An fp8 cache stores value / scale, saturated
to the format's largest finite value, rounded to float8_e4m3fn; it is read back as stored * scale.
"""

import jax.numpy as jnp

from ..rotary import frequencies
from ..rotary.reference import cos_sin_from_positions, rotate_reference

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448: e4m3fn has no infinity, an overflowing cast would give NaN


def quantize_reference(x, cache_dtype, scale=None):
    """x as the cache stores it: cast to the cache dtype, or for fp8 x / scale saturated and rounded."""
    if jnp.dtype(cache_dtype) != FP8_DTYPE:
        return x.astype(cache_dtype)
    scaled = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32).reshape(())
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def dequantize_reference(stored, scale=None):
    """What a reader of the cache sees (f32): stored * scale for fp8, else the stored value."""
    values = stored.astype(jnp.float32)
    if jnp.dtype(stored.dtype) != FP8_DTYPE:
        return values
    return values * jnp.asarray(scale, jnp.float32).reshape(())


def _write(cache, rows, slot_mapping, scale):
    flat = cache.reshape((-1,) + cache.shape[2:])
    slots = slot_mapping.astype(jnp.int32)
    # Out-of-range indices are dropped by the scatter: -1 and slots past the cache write nothing.
    index = jnp.where((slots >= 0) & (slots < flat.shape[0]), slots, flat.shape[0])
    flat = flat.at[index].set(quantize_reference(rows, cache.dtype, scale), mode="drop")
    return flat.reshape(cache.shape)


def write_kv_cache_reference(k_cache, v_cache, key, value, slot_mapping, *, k_scale=None, v_scale=None):
    """(k_cache, v_cache) with key[t] / value[t] at slot slot_mapping[t] (vLLM's reshape_and_cache_flash)."""
    return _write(k_cache, key, slot_mapping, k_scale), _write(v_cache, value, slot_mapping, v_scale)


def block_table_slots_reference(block_table, cache_seqlens, new_tokens, page_size):
    """Slots [B * new_tokens] of flash-attn's paged addressing: sequence b's token j goes to position
    p = cache_seqlens[b] + j, i.e. page block_table[b, p // page_size], offset p % page_size; -1 past the table."""
    batch, pages = block_table.shape
    position = cache_seqlens.astype(jnp.int32)[:, None] + jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
    page_index = position // page_size
    inside = page_index < pages
    page = jnp.take_along_axis(block_table, jnp.minimum(page_index, pages - 1), axis=1)
    slots = jnp.where(inside, page * page_size + position % page_size, -1)
    return slots.reshape(batch * new_tokens).astype(jnp.int32)


def rope_reference(x, positions, *, theta, rotary_dim=None, scaling=None, interleaved=False):
    """RoPE of x [T, H, D] at integer positions [T], with the rotary reference's math (f32, result in x's dtype)."""
    head_dim = x.shape[-1]
    inv_freq, attention_scaling, rotated = frequencies.inverse_frequencies(
        head_dim, theta, head_dim if rotary_dim is None else rotary_dim, scaling
    )
    cos, sin = cos_sin_from_positions(positions[None], inv_freq, attention_scaling, interleaved=interleaved)
    assert cos.shape[-1] == rotated
    return rotate_reference(x[None], cos, sin, interleaved=interleaved, layout="bshd")[0]


def rope_and_write_kv_cache_reference(
    query,
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    positions,
    *,
    theta,
    rotary_dim=None,
    scaling=None,
    interleaved=False,
    k_scale=None,
    v_scale=None,
):
    """(rope(query), caches with rope(key) and value written): rope first (rounded to the inputs' dtype), then the
    write, as the two unfused steps would do."""
    rope = dict(theta=theta, rotary_dim=rotary_dim, scaling=scaling, interleaved=interleaved)
    q_rot = rope_reference(query, positions, **rope)
    k_rot = rope_reference(key, positions, **rope)
    k_cache, v_cache = write_kv_cache_reference(
        k_cache, v_cache, k_rot, value, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
    return q_rot, k_cache, v_cache
