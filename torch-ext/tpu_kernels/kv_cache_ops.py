"""Torch op for the paged KV cache write: vLLM's reshape_and_cache_flash, updating the caches in place.

On a `tpu` tensor the caches are donated to the kernel (TorchTPU's jax_op), which writes only the named rows; on a
CPU tensor the same kernel runs in interpret mode. Inference only: no autograd.
"""

import jax
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
    checks.check_tensor("key", key)
    device = key.device
    for name, tensor in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        checks.check_tensor(name, tensor, device=device)
    checks.check_tensor("slot_mapping", slot_mapping, device=device)
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.requires_grad:
            raise ValueError(f"{name}: reshape_and_cache_flash is inference only, got a tensor that requires grad")
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
    reshape_and_cache_flash_op(
        key, value, key_cache, value_cache, slot_mapping, "fp8" if fp8 else "auto", k_scale, v_scale
    )
