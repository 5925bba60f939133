"""The whole MoE experts forward (transformers' experts interface, in JAX; its small-batch kernel at decode batches,
the grouped matmuls beyond), against its grouped composition on XLA's `jax.lax.ragged_dot` (the default), on
tokamax's ragged dot, and the dense masked MoE in plain JAX (`kernels/moe/reference.py`: every expert over every
token, masked by the routing; what XLA does with no grouped kernel). Decode batches, tokens routed top-8 over 128
experts at random (benchmarks/ops/_moe.py).

Weights in transformers' layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; bf16, or quantized
(the Shape's dtype: int8 / float8_e4m3fn with per-output-channel f32 scales [E, 2I] / [E, H], activations bf16):
the kernel dequantizes in VMEM, the XLA compositions dequantize in XLA before their matmuls (what a program without a
dequantizing kernel runs), tokamax is compared in bf16 only.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.common import chip, quantization
from tpu_kernels_jax.moe import api as moe_api
from tpu_kernels_jax.moe import tuning as moe_tuning

from .. import shapes
from ..suite import Baseline, Op, Suite, Targets
from . import _moe

BF16, F32 = jnp.bfloat16, jnp.float32


def kernel_experts(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    gate_up_scale=None,
    down_scale=None,
    *,
    activation,
    blocks=None,
):
    return moe_api.experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        activation=activation,
        gate_layout="concatenated",
        weights_transposed=False,
        gate_up_scale=gate_up_scale,
        down_scale=down_scale,
        blocks=blocks,
    )


def _bf16_weights(gate_up_proj, down_proj, scales):
    """The two weights as the XLA compositions multiply them: as they are, or (quantized, `scales` their [E, N]
    scales) dequantized to bf16 by XLA."""
    if not scales:
        return gate_up_proj, down_proj
    return tuple((w.astype(F32) * c[:, :, None]).astype(BF16) for w, c in zip((gate_up_proj, down_proj), scales))


def _composed(ragged_dot, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
    """experts_forward's grouped composition (route, gather, gate/up + epilogue, down, weight, combine) on
    `ragged_dot`, with the same in-bounds row gathers as kernels/moe/api.py, so the comparison is of the grouped
    matmuls (XLA's and tokamax's have no row-scale epilogue: the weighting is one XLA multiply, fused where XLA can)."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    order, group_sizes = moe_api.route(top_k_index, gate_up_proj.shape[0])
    x = hidden_states.at[order // top_k].get(mode="promise_in_bounds")
    h = _moe.gated_epilogue(ragged_dot(x, gate_up_proj, group_sizes, out_dtype=F32), activation, hidden_states.dtype)
    y = ragged_dot(h, down_proj, group_sizes, out_dtype=F32)
    y = y * top_k_weights.reshape(-1).astype(F32).at[order].get(mode="promise_in_bounds")[:, None]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    per_slot = y.astype(hidden_states.dtype).at[inverse].get(mode="promise_in_bounds")
    return per_slot.reshape(tokens, top_k, hidden).astype(F32).sum(axis=1).astype(hidden_states.dtype)


def xla_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *scales, activation):
    gate_up_proj, down_proj = _bf16_weights(gate_up_proj, down_proj, scales)
    return _composed(
        _moe.xla_ragged_dot, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation
    )


def tokamax_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation):
    return _composed(
        _moe.tokamax_ragged_dot, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation
    )


def dense_masked_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *scales, activation):
    """The dense masked MoE of kernels/moe/reference.py (every expert over every token, the routing as a mask of
    coefficients), vectorised over experts and in the model's dtype with f32 accumulation: what XLA runs with no
    grouped kernel. (The reference itself, a 128-iteration Python loop of f32 HIGHEST-precision dots, takes ~3 min
    to compile per shape here and runs its matmuls as multi-pass f32 on the MXU; as a speed baseline that would
    overstate the kernel's speedup.)"""
    gate_up_proj, down_proj = _bf16_weights(gate_up_proj, down_proj, scales)
    num_experts = gate_up_proj.shape[0]
    h = jnp.einsum("th,enh->etn", hidden_states, gate_up_proj, preferred_element_type=F32)
    act = _moe.gated_epilogue(h.reshape(-1, h.shape[-1]), activation, hidden_states.dtype).reshape(
        num_experts, hidden_states.shape[0], -1
    )
    y = jnp.einsum("eti,ehi->eth", act, down_proj, preferred_element_type=F32)
    coefficient = jnp.sum(
        jnp.where(top_k_index[None] == jnp.arange(num_experts)[:, None, None], top_k_weights[None].astype(F32), 0.0),
        axis=-1,
    )  # [E, T]
    return jnp.einsum("et,eth->th", coefficient, y).astype(hidden_states.dtype)


def _quantized(s) -> bool:
    return quantization.is_quantized(s.dtype)


def _weights_specs(s):
    """gate_up_proj and down_proj in the Shape's dtype, then (quantized weights) their f32 scales."""
    e, h, i, dtype = s["experts"], s["hidden"], s["intermediate"], jnp.dtype(s.dtype)
    specs = (jax.ShapeDtypeStruct((e, 2 * i, h), dtype), jax.ShapeDtypeStruct((e, h, i), dtype))
    if _quantized(s):
        specs += (jax.ShapeDtypeStruct((e, 2 * i), F32), jax.ShapeDtypeStruct((e, h), F32))
    return specs


def _specs(s):
    t, k = _moe.tokens_of(s), s["top_k"]
    return (
        jax.ShapeDtypeStruct((t, s["hidden"]), BF16),
        jax.ShapeDtypeStruct((t, k), jnp.int32),
        jax.ShapeDtypeStruct((t, k), F32),
        *_weights_specs(s),
    )


def _model_args(s):
    """Activations and weights as specs; the routing concrete (group sizes and block indices follow it)."""
    hidden, _, _, *experts = _specs(s)
    index, weights = _moe.routing_of(s)
    return hidden, jnp.asarray(index), jnp.asarray(weights), *experts


def _arrays(s, seed):
    rng = np.random.default_rng(seed)
    e, h, i = s["experts"], s["hidden"], s["intermediate"]
    index, weights = _moe.routing_of(s)
    hidden = jnp.asarray(rng.standard_normal((_moe.tokens_of(s), h), np.float32), BF16)
    if _quantized(s):  # quantized values spread over the format's range; scales that bring the products to ~1/sqrt(K)
        dtype = jnp.dtype(s.dtype)
        up, down = (
            jnp.asarray(rng.integers(-100, 101, shape, dtype=np.int8)).astype(dtype)
            for shape in ((e, 2 * i, h), (e, h, i))
        )
        up_scale = jnp.asarray(rng.uniform(0.5, 1.5, (e, 2 * i)) / (60 * np.sqrt(h)), F32)
        down_scale = jnp.asarray(rng.uniform(0.5, 1.5, (e, h)) / (60 * np.sqrt(i)), F32)
        return hidden, jnp.asarray(index), jnp.asarray(weights), up, down, up_scale, down_scale
    up = jnp.asarray(rng.standard_normal((e, 2 * i, h), np.float32) / np.sqrt(h), BF16)
    down = jnp.asarray(rng.standard_normal((e, h, i), np.float32) / np.sqrt(i), BF16)
    return hidden, jnp.asarray(index), jnp.asarray(weights), up, down


def _hbm_bytes(s):
    """The expert weights touched (gate/up and down, in the Shape's dtype, with their f32 scales when quantized),
    hidden states in and out, the routing."""
    t, h, i, k = _moe.tokens_of(s), s["hidden"], s["intermediate"], s["top_k"]
    per_expert = 3 * i * h * jnp.dtype(s.dtype).itemsize + ((2 * i + h) * 4 if _quantized(s) else 0)
    return _moe.experts_touched(s) * per_expert + 2 * t * h * 2 + t * k * (4 + 4)


def _flops(s):
    return 2 * _moe.rows_of(s) * s["hidden"] * 3 * s["intermediate"]


def _candidates(s, gen):
    """experts_forward's candidate paths and small-batch chunks at this shape (the tuning module's, on `gen`)."""
    up, down, *_ = _weights_specs(s)
    return moe_tuning.candidate_blocks(
        _moe.tokens_of(s),
        s["hidden"],
        s["intermediate"],
        gate_up_shape=up.shape,
        down_shape=down.shape,
        weights_transposed=False,
        gate_layout="concatenated",
        has_gate_up_bias=False,
        hidden_dtype=BF16,
        weight_dtype=up.dtype,
        down_dtype=down.dtype,
        info=chip.tpu_info_for(gen),
    )


def _tokamax_unsupported(s):
    if _quantized(s):
        return "compared in bf16 only (tokamax takes quantized weights in its own qwix formats, not set up here)"
    return _moe.tokamax_available() or _moe.tokamax_unsupported(s)


SUITE = Suite(
    kernel="moe",
    ops=(
        Op(
            name="experts_forward",
            kernel=kernel_experts,
            default=xla_experts,
            specs=_specs,
            model_args=_model_args,
            arrays=_arrays,
            hbm_bytes=_hbm_bytes,
            mxu_flops=_flops,
            default_name="XLA ragged_dot",
            baselines=(
                Baseline("tokamax", tokamax_experts, _tokamax_unsupported),
                Baseline("dense masked", dense_masked_experts),
            ),
            static=lambda s: {"activation": s["activation"]},
            candidates=_candidates,
        ),
    ),
    shapes=shapes.MOE,
    quick_shapes=shapes.MOE_QUICK,
    # `--sweep` without --full: Qwen3's decode at 1, 8 and 64 tokens, where the small-batch path and its chunk decide
    sweep_shapes=tuple(s for s in shapes.MOE_QUICK if s["model"] == "qwen3-30b-a3b" and s.batch in (1, 8, 64)),
    targets=Targets(goal=_moe.GOAL, beats_default=True, custom=_moe.custom_targets),
)
