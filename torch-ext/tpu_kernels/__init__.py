"""tpu-kernels: Pallas kernels for Google TPUs, as torch custom ops (TorchTPU) and as JAX functions.

    kernel = kernels.get_kernel("kernels-community/tpu-kernels", version=1)
    y = kernel.rms_norm(x, weight, eps)            # torch, on a `tpu` (or `cpu`, interpret mode) tensor
    y = kernel.jax.rms_norm(x_jax, weight_jax)     # JAX
    kernel.layers.RMSNorm                          # for kernels.kernelize
    ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", kernel.experts_forward)   # transformers MoE experts
    out = kernel.flash_attn_func(q, k, v, causal=True)  # flash-attn 2's API; also flash_attn_varlen_func
    out = kernel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=pages)  # decode
    AutoModelForCausalLM.from_pretrained(id, attn_implementation="kernels-community/tpu-kernels:flash_attn_varlen_func")
    name = kernel.register_continuous_batching()  # generate_batch with our cache writes and paged attention

Importing this package compiles nothing and makes no network access.
"""

from . import jax, layers
from ._ops import add_op_namespace_prefix, ops
from .continuous_batching import paged_attention_forward, register_continuous_batching
from .expert_parallel_ops import expert_parallel_experts, expert_parallel_op  # noqa: F401  (torch op over a mesh)
from .flash_attention_ops import attention_forward, flash_attn_func, flash_attn_varlen_func
from .kv_cache_ops import reshape_and_cache_flash
from .moe_ops import experts_forward, prepare_mxfp4_experts, ragged_dot
from .paged_attention_ops import flash_attn_with_kvcache, ragged_paged_attention
from .rms_norm_ops import fused_add_rms_norm, rms_norm
from .rotary_ops import apply_rotary, apply_rotary_from_positions, rms_norm_rope, rms_norm_rope_from_positions

__all__ = [
    "add_op_namespace_prefix",
    "apply_rotary",
    "apply_rotary_from_positions",
    "attention_forward",
    "experts_forward",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "fused_add_rms_norm",
    "jax",
    "layers",
    "ops",
    "paged_attention_forward",
    "prepare_mxfp4_experts",
    "ragged_dot",
    "ragged_paged_attention",
    "register_continuous_batching",
    "reshape_and_cache_flash",
    "rms_norm",
    "rms_norm_rope",
    "rms_norm_rope_from_positions",
]
