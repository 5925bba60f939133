"""The whole MoE experts forward (transformers' experts interface, in JAX; its small-batch kernel at decode batches,
the grouped matmuls beyond), against its grouped composition on XLA's `jax.lax.ragged_dot` (the default), on
tokamax's ragged dot, and the dense masked MoE in plain JAX (`kernels/moe/reference.py`: every expert over every
token, masked by the routing; what XLA does with no grouped kernel). Decode batches, tokens routed top-8 over 128
experts at random (benchmarks/ops/_moe.py); and gpt-oss-20b's experts (top-4 of 32, gate/up interleaved, its clamped
SwiGLU, no biases) in bf16 and in its checkpoint's MXFP4 (shapes.MOE_GPT_OSS).

Weights in transformers' layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; bf16, or quantized
(the Shape's dtype: int8 / float8_e4m3fn with per-output-channel f32 scales [E, 2I] / [E, H], activations bf16):
the kernel dequantizes in VMEM, the XLA compositions dequantize in XLA before their matmuls (what a program without a
dequantizing kernel runs), tokamax is compared in bf16 only. MXFP4 (the Shape's dtype "mxfp4"): uint8 blocks
[E, 2I, H / 2] / [E, H, I / 2] with uint8 e8m0 scales [E, 2I, H / 32] / [E, H, I / 32], widened in VMEM by the
kernels of either path; the XLA compositions dequantize them to bf16 in XLA. Both read them as
`moe_api.prepare_mxfp4_experts` lays them out once at load ([E, H / 2, 2I] / [E, I / 2, H], scales [E, 96, 2I] /
[E, 96, H]), which a call reads with no copy.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.common import chip, mxfp4, quantization
from tpu_kernels_jax.common.activation import ClampedSwiGLU
from tpu_kernels_jax.moe import api as moe_api
from tpu_kernels_jax.moe import tuning as moe_tuning

from .. import shapes
from ..suite import Baseline, Op, Suite, Targets
from . import _moe

BF16, F32 = jnp.bfloat16, jnp.float32
MXFP4 = "mxfp4"  # the Shape dtype of MXFP4 weights
# The shapes' activation names: the kernels' own, and gpt-oss-20b's clamped SwiGLU (its config's limit and alpha).
_ACTIVATIONS = {"clamped_swiglu": ClampedSwiGLU(limit=7.0, alpha=1.702)}


def _activation(name):
    return _ACTIVATIONS.get(name, name)


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
    gate_layout="concatenated",
    blocks=None,
):
    return moe_api.experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        activation=_activation(activation),
        gate_layout=gate_layout,
        weights_transposed=mxfp4.is_mxfp4(gate_up_proj.dtype),  # MXFP4: mxfp4.prepare's layout
        gate_up_scale=gate_up_scale,
        down_scale=down_scale,
        blocks=blocks,
    )


def _bf16_weights(gate_up_proj, down_proj, scales):
    """The two weights as the XLA compositions multiply them: as they are, or (quantized, `scales` their [E, N]
    scales; MXFP4, their e8m0 block scales) dequantized to bf16 by XLA."""
    if not scales:
        return gate_up_proj, down_proj
    if mxfp4.is_mxfp4(gate_up_proj.dtype):
        pairs = zip((gate_up_proj, down_proj), scales)
        return tuple(mxfp4.dequantize_prepared(w, c).astype(BF16) for w, c in pairs)
    return tuple((w.astype(F32) * c[:, :, None]).astype(BF16) for w, c in zip((gate_up_proj, down_proj), scales))


def _composed(ragged_dot, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_layout):
    """experts_forward's grouped composition (route, gather, gate/up + epilogue, down, weight, combine) on
    `ragged_dot`, with the same in-bounds row gathers as kernels/moe/api.py, so the comparison is of the grouped
    matmuls (XLA's and tokamax's have no row-scale epilogue: the weighting is one XLA multiply, fused where XLA can)."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    order, group_sizes = moe_api.route(top_k_index, gate_up_proj.shape[0])
    x = hidden_states.at[order // top_k].get(mode="promise_in_bounds")
    h = ragged_dot(x, gate_up_proj, group_sizes, out_dtype=F32)
    h = _moe.gated_epilogue(h, _activation(activation), hidden_states.dtype, gate_layout)
    y = ragged_dot(h, down_proj, group_sizes, out_dtype=F32)
    y = y * top_k_weights.reshape(-1).astype(F32).at[order].get(mode="promise_in_bounds")[:, None]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    per_slot = y.astype(hidden_states.dtype).at[inverse].get(mode="promise_in_bounds")
    return per_slot.reshape(tokens, top_k, hidden).astype(F32).sum(axis=1).astype(hidden_states.dtype)


def xla_experts(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *scales, activation, gate_layout="concatenated"
):
    gate_up_proj, down_proj = _bf16_weights(gate_up_proj, down_proj, scales)
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_layout)
    return _composed(_moe.xla_ragged_dot, *args)


def tokamax_experts(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation, gate_layout="concatenated"
):
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_layout)
    return _composed(_moe.tokamax_ragged_dot, *args)


def dense_masked_experts(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *scales, activation, gate_layout="concatenated"
):
    """The dense masked MoE of kernels/moe/reference.py (every expert over every token, the routing as a mask of
    coefficients), vectorised over experts and in the model's dtype with f32 accumulation: what XLA runs with no
    grouped kernel. (The reference itself, a 128-iteration Python loop of f32 HIGHEST-precision dots, takes ~3 min
    to compile per shape here and runs its matmuls as multi-pass f32 on the MXU; as a speed baseline that would
    overstate the kernel's speedup.)"""
    gate_up_proj, down_proj = _bf16_weights(gate_up_proj, down_proj, scales)
    num_experts = gate_up_proj.shape[0]
    h = jnp.einsum("th,enh->etn", hidden_states, gate_up_proj, preferred_element_type=F32)
    act = _moe.gated_epilogue(h.reshape(-1, h.shape[-1]), _activation(activation), hidden_states.dtype, gate_layout)
    act = act.reshape(num_experts, hidden_states.shape[0], -1)
    y = jnp.einsum("eti,ehi->eth", act, down_proj, preferred_element_type=F32)
    coefficient = jnp.sum(
        jnp.where(top_k_index[None] == jnp.arange(num_experts)[:, None, None], top_k_weights[None].astype(F32), 0.0),
        axis=-1,
    )  # [E, T]
    return jnp.einsum("et,eth->th", coefficient, y).astype(hidden_states.dtype)


def _mxfp4(s) -> bool:
    return s.dtype == MXFP4


def _quantized(s) -> bool:
    return not _mxfp4(s) and quantization.is_quantized(s.dtype)


def _gate_layout(s) -> str:
    return dict(s.params).get("gate_layout", "concatenated")


def _weights_specs(s):
    """gate_up_proj and down_proj in the Shape's dtype, then (quantized weights) their f32 scales; MXFP4: the packed
    blocks, then their e8m0 block scales."""
    e, h, i = s["experts"], s["hidden"], s["intermediate"]
    if _mxfp4(s):
        u8, rows = mxfp4.CODE_DTYPE, mxfp4.scale_rows
        blocks = (jax.ShapeDtypeStruct((e, h // 2, 2 * i), u8), jax.ShapeDtypeStruct((e, i // 2, h), u8))
        return blocks + (jax.ShapeDtypeStruct((e, rows(h), 2 * i), u8), jax.ShapeDtypeStruct((e, rows(i), h), u8))
    dtype = jnp.dtype(s.dtype)
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
    if _mxfp4(s):  # every e2m1 code; scales 2^-8..2^-6, which bring the products to ~1/sqrt(K)
        up, down, up_scale, down_scale = (
            jnp.asarray(rng.integers(low, high, spec.shape, dtype=np.uint8))
            for spec, (low, high) in zip(_weights_specs(s), ((0, 256), (0, 256), (119, 122), (119, 122)))
        )
        return hidden, jnp.asarray(index), jnp.asarray(weights), up, down, up_scale, down_scale
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
    """The expert weights touched (gate/up and down, in the Shape's dtype, with their f32 scales when quantized;
    MXFP4: half a byte a weight and a one-byte scale per 32), hidden states in and out, the routing."""
    t, h, i, k = _moe.tokens_of(s), s["hidden"], s["intermediate"], s["top_k"]
    if _mxfp4(s):
        per_expert = 3 * i * h // 2 + 3 * i * h // mxfp4.BLOCK
    else:
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
        weights_transposed=_mxfp4(s),  # MXFP4: mxfp4.prepare's layout, as the kernel column calls it
        gate_layout=_gate_layout(s),
        has_gate_up_bias=False,
        hidden_dtype=BF16,
        weight_dtype=up.dtype,
        down_dtype=down.dtype,
        info=chip.tpu_info_for(gen),
    )


def _tokamax_unsupported(s):
    if _quantized(s) or _mxfp4(s):
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
            static=lambda s: {"activation": s["activation"], "gate_layout": _gate_layout(s)},
            candidates=_candidates,
        ),
    ),
    shapes=shapes.MOE + shapes.MOE_GPT_OSS,
    quick_shapes=shapes.MOE_QUICK + tuple(s for s in shapes.MOE_GPT_OSS if s.batch == 8),
    # `--sweep` without --full: Qwen3's decode at 1, 8 and 64 tokens, where the small-batch path and its chunk decide
    sweep_shapes=tuple(s for s in shapes.MOE_QUICK if s["model"] == "qwen3-30b-a3b" and s.batch in (1, 8, 64)),
    targets=Targets(goal=_moe.GOAL, beats_default=True, custom=_moe.custom_targets),
)
