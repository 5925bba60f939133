"""The JAX API of tpu-kernels: plain JAX functions over the Pallas kernels (this module imports no torch).

Under jax.jit / jax.export they trace Mosaic kernels for the TPU; called eagerly on CPU arrays they run the same
kernels in Pallas' TPU interpret mode; to jit them for the CPU, call them inside `interpret_on_cpu()`.
"""

from .common.interpret import interpret_on_cpu
from .flash_attention.api import flash_attention, flash_attention_varlen
from .flash_attention.tuning import FlashAttentionBlocks
from .kv_cache.api import block_table_slots, rope_and_write_kv_cache, rope_tables_and_write_kv_cache, write_kv_cache
from .kv_cache.tuning import KVCacheBlocks
from .moe.api import experts_forward, prepare_mxfp4_experts
from .moe.expert_parallel import expert_parallel_experts_forward, experts_forward_shard
from .moe.tuning import ExpertsBlocks
from .paged_attention.api import ragged_paged_attention
from .paged_attention.tuning import PagedAttentionBlocks
from .ragged_dot.api import ragged_dot
from .ragged_dot.tuning import MatmulBlocks, RaggedDotBlocks, TransposedMatmulBlocks
from .rms_norm.api import RmsNormBlocks, fused_add_rms_norm, rms_norm, rms_norm_backward
from .rotary.api import (
    RotaryBlocks,
    apply_rotary,
    apply_rotary_backward,
    apply_rotary_from_positions,
    apply_rotary_from_positions_backward,
    rms_norm_rope,
    rms_norm_rope_from_positions,
    rope_cos_sin,
)

__all__ = [
    "ExpertsBlocks",
    "FlashAttentionBlocks",
    "KVCacheBlocks",
    "MatmulBlocks",
    "PagedAttentionBlocks",
    "RaggedDotBlocks",
    "TransposedMatmulBlocks",
    "apply_rotary",
    "apply_rotary_backward",
    "apply_rotary_from_positions",
    "apply_rotary_from_positions_backward",
    "block_table_slots",
    "expert_parallel_experts_forward",
    "experts_forward",
    "experts_forward_shard",
    "flash_attention",
    "flash_attention_varlen",
    "fused_add_rms_norm",
    "interpret_on_cpu",
    "prepare_mxfp4_experts",
    "ragged_paged_attention",
    "ragged_dot",
    "RmsNormBlocks",
    "RotaryBlocks",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_rope",
    "rms_norm_rope_from_positions",
    "rope_and_write_kv_cache",
    "rope_cos_sin",
    "rope_tables_and_write_kv_cache",
    "write_kv_cache",
]
