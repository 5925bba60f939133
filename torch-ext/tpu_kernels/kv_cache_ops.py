"""Torch ops for the paged KV cache write: vLLM's reshape_and_cache_flash, updating the caches in place, and
rope_and_reshape_and_cache_flash, the same write with flash-attn's rotary applied to the new K (and Q) in the
kernel that writes them (flash_attn_with_kvcache's rotary_cos / rotary_sin).

On a `tpu` tensor the caches are donated to the kernel (TorchTPU's jax_op), which writes only the named rows; on a
CPU tensor the same kernel runs in interpret mode. Inference only: no autograd.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpu_kernels_jax.kv_cache import api

from . import _torch_checks as checks
from ._op_registry import define_op

FP8_NAMES = ("fp8", "fp8_e4m3")
KV_CACHE_DTYPES = ("auto",) + FP8_NAMES


# The JAX function the op is made from. Annotations drive the torch schema (TorchTPU's jax_op convention); it returns
# the new key_cache and value_cache, which the op writes back into the caller's tensors.
def _reshape_and_cache_flash_jax(
    key: jax.Array,
    value: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    slot_mapping: jax.Array,
    kv_cache_dtype: str,
    k_scale: jax.Array,
    v_scale: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    fp8 = kv_cache_dtype in FP8_NAMES
    return api.write_kv_cache(
        key_cache,
        value_cache,
        key,
        value,
        slot_mapping,
        k_scale=k_scale.reshape(()) if fp8 else None,
        v_scale=v_scale.reshape(()) if fp8 else None,
    )


reshape_and_cache_flash_op = define_op(
    "reshape_and_cache_flash", _reshape_and_cache_flash_jax, None, mutates=("key_cache", "value_cache")
)


# The fused op's JAX function: flash-attn's half-width rotary tables [seqlen_ro, rotary_dim / 2] gathered at each
# new token's position and widened to the kernel's per-token rows inside the program (a small XLA gather, no rotary
# op), then one kernel rotates query and key and writes key / value. query_out (the rotated query's tensor, mutated
# like the caches) is an empty [0] tensor when no query is rotated.
def _rope_and_reshape_and_cache_flash_jax(
    query: jax.Array | None,
    key: jax.Array,
    value: jax.Array,
    query_out: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    slot_mapping: jax.Array,
    rotary_cos: jax.Array,
    rotary_sin: jax.Array,
    positions: jax.Array,
    rotary_interleaved: bool,
    kv_cache_dtype: str,
    k_scale: jax.Array,
    v_scale: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    fp8 = kv_cache_dtype in FP8_NAMES
    index = jnp.clip(positions, 0, rotary_cos.shape[0] - 1)  # unchecked device positions stay inside the tables
    rows = []
    for table in (rotary_cos, rotary_sin):
        half = jnp.take(table, index, axis=0).astype(jnp.float32)  # [T, rotary_dim / 2], the kernel's f32
        # each frequency twice: GPT-J pairs side by side, GPT-NeoX halves one after the other
        rows.append(jnp.repeat(half, 2, axis=-1) if rotary_interleaved else jnp.concatenate([half, half], axis=-1))
    q_rot, key_cache, value_cache = api.rope_tables_and_write_kv_cache(
        query,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *rows,
        interleaved=rotary_interleaved,
        k_scale=k_scale.reshape(()) if fp8 else None,
        v_scale=v_scale.reshape(()) if fp8 else None,
    )
    return (query_out if q_rot is None else q_rot), key_cache, value_cache


rope_and_reshape_and_cache_flash_op = define_op(
    "rope_and_reshape_and_cache_flash",
    _rope_and_reshape_and_cache_flash_jax,
    None,
    mutates=("query_out", "key_cache", "value_cache"),
)


def _scale(name, value, device, fp8):
    """k_scale / v_scale as the op's float32 tensor [1]: a tensor of one element (vLLM's), a Python float, or None
    (only for kv_cache_dtype "auto", which ignores the scales)."""
    if value is None:
        if fp8:
            raise ValueError(f"{name}: an fp8 cache needs a scale (stored = value / scale), got None")
        return torch.ones((1,), dtype=torch.float32, device=device)
    if isinstance(value, (float, int)) and not isinstance(value, bool):
        return torch.full((1,), float(value), dtype=torch.float32, device=device)
    checks.check_tensor(name, value, device=device)
    if value.dtype != torch.float32 or value.numel() != 1:
        raise ValueError(
            f"{name}: expected a float32 tensor of one element (shape [] or [1]), got {value.dtype} of shape "
            f"{tuple(value.shape)}"
        )
    return value.reshape(1)


def _cache(name, cache, fp8):
    """The cache tensor the op writes: itself, or for fp8 a uint8 cache (vLLM allocates fp8 caches as uint8) viewed as
    float8_e4m3fn (a view: the writes land in the caller's tensor)."""
    if fp8 and cache.dtype == torch.uint8:
        return cache.view(torch.float8_e4m3fn)
    if fp8 and cache.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: kv_cache_dtype 'fp8' needs a float8_e4m3fn (or uint8) cache, got {cache.dtype}")
    if not cache.is_contiguous():
        # .contiguous() would copy, and the op would update the copy: the caller's cache must be written itself.
        raise ValueError(
            f"{name}: expected a contiguous cache (the op writes it in place), got strides {cache.stride()}"
        )
    return cache


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """vLLM's reshape_and_cache_flash: key[t] / value[t] written at slot slot_mapping[t] of key_cache / value_cache,
    in place (slot -1: skipped).

    key [T, kv_heads, head_dim], value [T, kv_heads, v_head_dim]; key_cache [num_blocks, block_size, kv_heads,
    head_dim], value_cache likewise (slot = block * block_size + offset), contiguous; slot_mapping [T] int64 or int32.
    kv_cache_dtype "auto" (the caches have key's dtype, bfloat16 or float32; scales ignored) or "fp8" / "fp8_e4m3"
    (float8_e4m3fn or uint8 caches store value / scale, saturated; k_scale / v_scale float32 tensors of one element).
    On host tensors slots must be -1 or inside the cache and distinct (an error otherwise); on device tensors a slot
    outside the cache is skipped. Inference only: tensors that require grad are refused.
    """
    args = _write_arguments(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    reshape_and_cache_flash_op(*args)


def _write_arguments(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, function=""):
    """reshape_and_cache_flash's arguments checked and converted as its op takes them (the fused op's too)."""
    function = function or "reshape_and_cache_flash"
    checks.check_tensor("key", key)
    device = key.device
    for name, tensor in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        checks.check_tensor(name, tensor, device=device)
    checks.check_tensor("slot_mapping", slot_mapping, device=device)
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.requires_grad:
            raise ValueError(f"{name}: {function} is inference only, got a tensor that requires grad")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    fp8 = kv_cache_dtype in FP8_NAMES
    if not fp8 and key_cache.dtype in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"kv_cache_dtype: an {key_cache.dtype} cache needs 'fp8' or 'fp8_e4m3', got 'auto'")
    key_cache, value_cache = _cache("key_cache", key_cache, fp8), _cache("value_cache", value_cache, fp8)
    k_scale, v_scale = _scale("k_scale", k_scale, device, fp8), _scale("v_scale", v_scale, device, fp8)
    slot_mapping = checks.as_int32("slot_mapping", slot_mapping)
    key, value, slot_mapping = (checks.contiguous(t) for t in (key, value, slot_mapping))
    if not checks.tracing() and not checks.has_symbolic_shape(key, value, key_cache, value_cache, slot_mapping):
        api.check_inputs(
            checks.placeholder("key_cache", key_cache),
            checks.placeholder("value_cache", value_cache),
            checks.placeholder("key", key),
            checks.placeholder("value", value),
            checks.values_or_placeholder("slot_mapping", slot_mapping),
            k_scale=checks.values_or_placeholder("k_scale", k_scale) if fp8 else None,
            v_scale=checks.values_or_placeholder("v_scale", v_scale) if fp8 else None,
        )
    return key, value, key_cache, value_cache, slot_mapping, "fp8" if fp8 else "auto", k_scale, v_scale


def check_rotary(rotary_cos, rotary_sin, head_dim, interleaved):
    """flash-attn's rotary tables: rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2], one shape and dtype, rotary_dim
    from 2 to the head dim; rotary_interleaved a bool."""
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t.dim() != 2:
            raise ValueError(f"{name}: expected [seqlen_ro, rotary_dim / 2], got shape {tuple(t.shape)}")
    if rotary_sin.shape != rotary_cos.shape or rotary_sin.dtype != rotary_cos.dtype:
        raise ValueError(
            f"rotary_sin: expected the shape and dtype of rotary_cos {tuple(rotary_cos.shape)} {rotary_cos.dtype}, got "
            f"{tuple(rotary_sin.shape)} {rotary_sin.dtype}"
        )
    if not 0 < 2 * rotary_cos.shape[1] <= head_dim:
        raise ValueError(
            f"rotary_cos: expected [seqlen_ro, rotary_dim / 2] with rotary_dim from 2 to the head dim {head_dim}, got "
            f"shape {tuple(rotary_cos.shape)}"
        )
    if rotary_cos.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"rotary_cos: expected float32, bfloat16 or float16 tables, got {rotary_cos.dtype}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"rotary_interleaved: expected a bool, got {type(interleaved).__name__}")


def rope_and_reshape_and_cache_flash(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rotary_cos: torch.Tensor,
    rotary_sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    rotary_interleaved: bool = True,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor | None:
    """reshape_and_cache_flash with flash-attn's rotary applied to the new key (and query) in the kernel that writes
    them: token t's rows rotate at position positions[t] of rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2] (the
    first rotary_dim features; GPT-J pairs (2i, 2i + 1) when rotary_interleaved, halves otherwise), the rotated key
    is written at slot_mapping[t], in place. query [T, Hq, D] in key's dtype, or None. positions [T] int32 (int64
    cast once); on host tensors each must have a row of the tables, on device tensors they are clamped to the
    tables. Returns the rotated query (a new tensor), or None. Inference only."""
    write = _write_arguments(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype,
        k_scale,
        v_scale,
        function="rope_and_reshape_and_cache_flash",
    )
    device = key.device
    for name, tensor in (("query", query), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if tensor is not None:
            checks.check_tensor(name, tensor, device=device)
    checks.check_tensor("positions", positions, device=device)
    if query is not None and query.requires_grad:
        raise ValueError("query: rope_and_reshape_and_cache_flash is inference only, got a tensor that requires grad")
    check_rotary(rotary_cos, rotary_sin, key.shape[-1], rotary_interleaved)
    positions = checks.as_int32("positions", positions)
    if positions.dim() != 1 or positions.shape[0] != key.shape[0]:
        raise ValueError(
            f"positions: expected shape ({key.shape[0]},), one per token of key, got {tuple(positions.shape)}"
        )
    if not checks.tracing() and not checks.has_symbolic_shape(
        key, positions, rotary_cos, *([query] * (query is not None))
    ):
        values = checks.values_or_placeholder("positions", positions)
        if isinstance(values, np.ndarray) and values.size:
            bad = values[(values < 0) | (values >= rotary_cos.shape[0])]
            if bad.size:
                raise ValueError(
                    f"positions: expected positions from 0 to {rotary_cos.shape[0] - 1} (rotary_cos's rows), got "
                    f"{int(bad[0])}"
                )
        api.check_table_inputs(
            None if query is None else checks.placeholder("query", query),
            checks.placeholder("key", key),
            jax.ShapeDtypeStruct((key.shape[0], 2 * rotary_cos.shape[1]), jnp.float32),
            jax.ShapeDtypeStruct((key.shape[0], 2 * rotary_cos.shape[1]), jnp.float32),
        )
    key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale = write
    query = None if query is None else checks.contiguous(query)
    query_out = torch.empty((0,), dtype=key.dtype, device=device) if query is None else torch.empty_like(query)
    rope_and_reshape_and_cache_flash_op(
        query,
        key,
        value,
        query_out,
        key_cache,
        value_cache,
        slot_mapping,
        checks.contiguous(rotary_cos),
        checks.contiguous(rotary_sin),
        checks.contiguous(positions),
        rotary_interleaved,
        cache_dtype,
        k_scale,
        v_scale,
    )
    return None if query is None else query_out
