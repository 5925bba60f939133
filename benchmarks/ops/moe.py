"""The whole MoE experts forward (transformers' experts interface, in JAX; its small-batch kernel at decode batches,
the grouped matmuls beyond), against its grouped composition on XLA's `jax.lax.ragged_dot` (the default), on
tokamax's ragged dot and on JAX's megablox gmm (MaxText's MoE kernel), vLLM's fused MoE kernel (tpu-inference's
`fused_moe.v1`, the kernel vLLM serves MoE models with on TPUs), and the dense masked MoE in plain JAX
(`kernels/moe/reference.py`: every expert over every token, masked by the routing; what XLA does with no grouped
kernel). Decode batches, tokens routed top-8 over 128 experts at random (benchmarks/ops/_moe.py); and gpt-oss-20b's
experts (top-4 of 32, gate/up interleaved, its clamped SwiGLU, no biases) in bf16 and in its checkpoint's MXFP4
(shapes.MOE_GPT_OSS).

Weights in transformers' layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; bf16, or quantized
(the Shape's dtype: int8 / float8_e4m3fn with per-output-channel f32 scales [E, 2I] / [E, H], activations bf16):
the kernel dequantizes in VMEM, the XLA compositions dequantize in XLA before their matmuls (what a program without a
dequantizing kernel runs), tokamax, megablox and vLLM's kernel are compared in bf16 only. MXFP4 (the Shape's dtype
"mxfp4"): uint8 blocks [E, 2I, H / 2] / [E, H, I / 2] with uint8 e8m0 scales [E, 2I, H / 32] / [E, H, I / 32],
widened in VMEM by the kernels of either path; the XLA compositions dequantize them to bf16 in XLA. Both read them as
`moe_api.prepare_mxfp4_experts` lays them out once at load ([E, H / 2, 2I] / [E, I / 2, H], scales [E, 96, 2I] /
[E, 96, H]), which a call reads with no copy.

vLLM's fused MoE (bf16 only) takes the router's logits and does the top-k itself, and its own weight layout, w1
[E, 2, H, I] (gate, up) and w2 [E, I, H], hidden and intermediate zero-padded to multiples of 256 as vLLM pads them
at load. Where it applies, the case's arguments end with one more, {"vllm": (w1, w2, logits)}: the same weights
converted once when the inputs are made (not timed), and logits [T, E] whose softmax top-k is the case's routing
(log of the routing weights, -inf elsewhere). The other columns drop that argument (`_column`). A token count that is
not a multiple of its token packing (2 for bf16) is padded with a copy of the last token's routing (its padded rows
read no other expert), and hidden states are padded to its hidden size in the call, as vLLM's layer does.

Inputs are made on the device (benchmarks/inputs.py); the routing is drawn on the host (numpy, fixed seed), as the
performance model needs it concrete.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.common import chip, mxfp4, quantization
from tpu_kernels_jax.common.activation import ClampedSwiGLU
from tpu_kernels_jax.moe import api as moe_api
from tpu_kernels_jax.moe import tuning as moe_tuning

from .. import inputs, shapes
from ..suite import Baseline, Op, Suite, Targets
from . import _moe, _vllm

BF16, F32 = jnp.bfloat16, jnp.float32
MXFP4 = "mxfp4"  # the Shape dtype of MXFP4 weights
# The shapes' activation names: the kernels' own, and gpt-oss-20b's clamped SwiGLU (its config's limit and alpha).
_ACTIVATIONS = {"clamped_swiglu": ClampedSwiGLU(limit=7.0, alpha=1.702)}
# vLLM's fused MoE: its act_fn for each activation (its "gelu" is jax.nn.gelu's tanh form; "swigluoai" is gpt-oss's
# clamped SwiGLU with limit 7 and alpha 1.702), its padding of hidden and intermediate sizes, its bf16 token packing.
VLLM_ACT_FN = {"silu": "silu", "gelu_tanh": "gelu", "clamped_swiglu": "swigluoai"}
VLLM_PAD = 256
VLLM_TOKEN_PACKING = 2
VLLM_MOE = "kernels.fused_moe.v1.kernel"
VLLM_MOE_BLOCKS = "kernels.fused_moe.v1.tuned_block_sizes"


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


def _sorted_by_expert(top_k_index, num_experts):
    """Sort (token, slot) pairs by expert, as transformers' grouped experts do (a stable argsort and the experts'
    counts). Returns (order, group_sizes): order[i] is the flat pair index at sorted position i; sentinel ids are
    counted nowhere and sorted last."""
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, flat, 0)].add(valid.astype(jnp.int32))
    return order, group_sizes


def _composed(ragged_dot, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_layout):
    """The grouped composition transformers' grouped experts lower to (sort by expert, gather, gate/up + epilogue,
    down, weight, combine) on `ragged_dot`, with in-bounds row gathers (XLA's and tokamax's ragged dots have no
    row-scale epilogue: the weighting is one XLA multiply, fused where XLA can)."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    order, group_sizes = _sorted_by_expert(top_k_index, gate_up_proj.shape[0])
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


def megablox_experts(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation, gate_layout="concatenated"
):
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_layout)
    return _composed(_moe.megablox_ragged_dot, *args)


def _single_device_mesh():
    """A 1 x 1 ("data", "model") mesh of the device the program is traced for (the model's deviceless TPU under
    jax.default_device, else the first device): vLLM's fused MoE is an expert-parallel kernel over "model"."""
    dev = jax.config.jax_default_device
    dev = dev if dev is not None and not isinstance(dev, str) else jax.devices()[0]
    return jax.sharding.Mesh(np.array([dev]).reshape(1, 1), ("data", "model"))


def vllm_fused_experts(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    layouts,
    *,
    activation,
    gate_layout="concatenated",
):
    """vLLM's fused MoE kernel on its own layouts (`layouts["vllm"]`: w1, w2, router logits; see the module
    docstring); the top-k and the weighting are the kernel's, from the logits."""
    fused = _vllm.kernel_module(VLLM_MOE)
    w1, w2, logits = layouts["vllm"]
    tokens, hidden = hidden_states.shape
    padded = _align(tokens, VLLM_TOKEN_PACKING)
    x = jnp.pad(hidden_states, ((0, padded - tokens), (0, w1.shape[2] - hidden)))
    logits = jnp.pad(logits, ((0, padded - tokens), (0, 0)), mode="edge")
    out = fused.fused_ep_moe(
        _single_device_mesh(), x, w1, w2, logits, top_k_index.shape[1], act_fn=VLLM_ACT_FN[activation]
    )
    return out[:tokens, :hidden]


def _column(fn, *args, **options):
    """An implementation's column: `fn` on the case's arguments without vLLM's layouts (the trailing dict, where the
    shape has them)."""
    if args and isinstance(args[-1], dict):
        args = args[:-1]
    return fn(*args, **options)


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


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def _base_specs(s):
    t, k = _moe.tokens_of(s), s["top_k"]
    return (
        jax.ShapeDtypeStruct((t, s["hidden"]), BF16),
        jax.ShapeDtypeStruct((t, k), jnp.int32),
        jax.ShapeDtypeStruct((t, k), F32),
        *_weights_specs(s),
    )


def _vllm_specs(s) -> dict:
    """vLLM's layouts of a shape: w1 [E, 2, H', I'], w2 [E, I', H'] (H', I' padded to 256), logits [T, E]."""
    e, h, i = s["experts"], _align(s["hidden"], VLLM_PAD), _align(s["intermediate"], VLLM_PAD)
    return {
        "vllm": (
            jax.ShapeDtypeStruct((e, 2, h, i), BF16),
            jax.ShapeDtypeStruct((e, i, h), BF16),
            jax.ShapeDtypeStruct((_moe.tokens_of(s), e), BF16),
        )
    }


def _specs(s):
    """hidden states, the routing, the weights (and scales); where vLLM's fused MoE applies, its layouts."""
    return _base_specs(s) + ((_vllm_specs(s),) if _vllm_unsupported(s) is None else ())


def _vllm_logits(index, weights, experts: int):
    """Router logits whose softmax is the routing: log(weight) at each token's chosen experts, -inf elsewhere."""
    chosen = jnp.arange(experts)[None, None, :] == index[:, :, None]  # [T, k, E]
    logits = jnp.where(chosen, jnp.log(weights)[:, :, None], -jnp.inf).max(axis=1)
    return logits.astype(BF16)


def _model_args(s):
    """Activations and weights as specs; the routing concrete (group sizes and block indices follow it), and so vLLM's
    logits."""
    hidden, _, _, *experts = _base_specs(s)
    index, weights = _moe.routing_of(s)
    args = (hidden, jnp.asarray(index), jnp.asarray(weights), *experts)
    if _vllm_unsupported(s) is None:
        w1, w2, _ = _vllm_specs(s)["vllm"]
        args += ({"vllm": (w1, w2, _vllm_logits(jnp.asarray(index), jnp.asarray(weights), s["experts"]))},)
    return args


@functools.partial(jax.jit, static_argnames=("gate_layout", "hidden", "intermediate"))
def _to_vllm(gate_up_proj, down_proj, *, gate_layout, hidden, intermediate):
    """Transformers' gate_up_proj [E, 2I, H] (gate rows first, or interleaved) and down_proj [E, H, I] as vLLM's w1
    [E, 2, H', I'] and w2 [E, I', H'], zero-padded to H' = hidden, I' = intermediate."""
    e, two_i, h = gate_up_proj.shape
    i = two_i // 2
    if gate_layout == "interleaved":
        gate, up = gate_up_proj[:, 0::2], gate_up_proj[:, 1::2]
    else:
        gate, up = gate_up_proj[:, :i], gate_up_proj[:, i:]
    w1 = jnp.stack([gate, up], axis=1).transpose(0, 1, 3, 2)  # [E, 2, H, I]
    w1 = jnp.pad(w1, ((0, 0), (0, 0), (0, hidden - h), (0, intermediate - i)))
    w2 = jnp.pad(down_proj.transpose(0, 2, 1), ((0, 0), (0, intermediate - i), (0, hidden - h)))
    return w1, w2


def _arrays(s, seed):
    """hidden states, the routing and the weights (and scales), as every column but vLLM's takes them: random values
    made on the device (weights scaled to products of ~1/sqrt(K)), the routing from the host."""
    e, h, i = s["experts"], s["hidden"], s["intermediate"]
    index, weights = _moe.routing_of(s)
    key_hidden, key_up, key_down, key_up_scale, key_down_scale = inputs.keys(seed, 5)
    hidden = inputs.normal(key_hidden, (_moe.tokens_of(s), h), BF16)
    routing = (jnp.asarray(index), jnp.asarray(weights))
    if _mxfp4(s):  # every e2m1 code; scales 2^-8..2^-6, which bring the products to ~1/sqrt(K)
        up, down, up_scale, down_scale = (
            inputs.integers(k, spec.shape, low, high, spec.dtype)
            for k, spec, (low, high) in zip(
                (key_up, key_down, key_up_scale, key_down_scale),
                _weights_specs(s),
                ((0, 256), (0, 256), (119, 122), (119, 122)),
            )
        )
        return hidden, *routing, up, down, up_scale, down_scale
    if _quantized(s):  # quantized values spread over the format's range; scales that bring the products to ~1/sqrt(K)
        dtype = jnp.dtype(s.dtype)
        up = inputs.integers(key_up, (e, 2 * i, h), -100, 101, jnp.int8).astype(dtype)
        down = inputs.integers(key_down, (e, h, i), -100, 101, jnp.int8).astype(dtype)
        up_scale = inputs.uniform(key_up_scale, (e, 2 * i), 0.5 / (60 * np.sqrt(h)), 1.5 / (60 * np.sqrt(h)), F32)
        down_scale = inputs.uniform(key_down_scale, (e, h), 0.5 / (60 * np.sqrt(i)), 1.5 / (60 * np.sqrt(i)), F32)
        return hidden, *routing, up, down, up_scale, down_scale
    up = inputs.normal(key_up, (e, 2 * i, h), BF16, scale=1 / np.sqrt(h))
    down = inputs.normal(key_down, (e, h, i), BF16, scale=1 / np.sqrt(i))
    return hidden, *routing, up, down


def _case_arrays(s, seed):
    """_arrays, and where vLLM's fused MoE applies its layouts of the same weights and routing (made here, not in
    the timed call)."""
    args = _arrays(s, seed)
    if _vllm_unsupported(s) is not None:
        return args
    hidden, index, weights, up, down = args
    pad = dict(hidden=_align(s["hidden"], VLLM_PAD), intermediate=_align(s["intermediate"], VLLM_PAD))
    w1, w2 = _to_vllm(up, down, gate_layout=_gate_layout(s), **pad)
    return (*args, {"vllm": (w1, w2, _vllm_logits(index, weights, s["experts"]))})


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


def _megablox_unsupported(s):
    if _quantized(s) or _mxfp4(s):
        return "compared in bf16 only (megablox.gmm multiplies bf16 or f32 operands)"
    return _moe.megablox_unsupported(s)


def _vllm_blocks_problem(s) -> str | None:
    """Why vLLM's fused MoE refuses this shape at its own block sizes (tpu-inference's tuned table, else its default
    formula; its small-batch override of the token block), or None: the divisibility its call checks."""
    blocks = _vllm.kernel_module(VLLM_MOE_BLOCKS)
    h, i = _align(s["hidden"], VLLM_PAD), _align(s["intermediate"], VLLM_PAD)
    e, k, p = s["experts"], s["top_k"], VLLM_TOKEN_PACKING
    t = _align(_moe.tokens_of(s), p)
    bt, bf, bd1, bd2, btc, bfc, bd1c, bd2c = blocks.get_tuned_block_sizes(h, i, e, k, p, p, t, 1)
    if t <= p * 8:
        bt = btc = t
    bt = min(t, bt)
    btc = min(bt, btc)
    need = (
        (bt % btc, f"token block {bt} a multiple of its compute block {btc}"),
        (t % bt, f"tokens {t} a multiple of the token block {bt}"),
        (bfc % 128, f"intermediate compute block {bfc} a multiple of 128"),
        (bd1c % (p * 128), f"hidden compute block bd1c = {bd1c} a multiple of {p * 128}"),
        (bd2c % (p * 128), f"hidden compute block bd2c = {bd2c} a multiple of {p * 128}"),
        (bf % bfc, f"intermediate block {bf} a multiple of {bfc}"),
        (bd1 % bd1c, f"hidden block bd1 = {bd1} a multiple of {bd1c}"),
        (bd2 % bd2c, f"hidden block bd2 = {bd2} a multiple of {bd2c}"),
        (h % bd1, f"hidden {h} a multiple of its block bd1 = {bd1}"),
        (h % bd2, f"hidden {h} a multiple of its block bd2 = {bd2}"),
        (i % bf, f"intermediate {i} a multiple of its block {bf}"),
    )
    for remainder, what in need:
        if remainder:
            return f"vLLM's fused MoE at its own block sizes (tpu-inference {_vllm.VERSION}) needs {what}"
    return None


@functools.cache
def _vllm_unsupported(s) -> str | None:
    if _quantized(s) or _mxfp4(s):
        return (
            "compared in bf16 only (vLLM's fused MoE takes sub-channel quantized weights with scales in its own "
            "layout, not set up here)"
        )
    why = _vllm.missing()
    if why:
        return why
    try:
        return _vllm_blocks_problem(s)
    except Exception as e:  # noqa: BLE001 - an import that fails here must not stop the other columns
        return f"tpu-inference's fused MoE does not import: {type(e).__name__}: {e}"


def _columns(*fns):
    return tuple(functools.partial(_column, fn) for fn in fns)


_KERNEL, _XLA, _TOKAMAX, _MEGABLOX, _DENSE = _columns(
    kernel_experts, xla_experts, tokamax_experts, megablox_experts, dense_masked_experts
)


SUITE = Suite(
    kernel="moe",
    ops=(
        Op(
            name="experts_forward",
            kernel=_KERNEL,
            default=_XLA,
            specs=_specs,
            model_args=_model_args,
            arrays=_case_arrays,
            hbm_bytes=_hbm_bytes,
            mxu_flops=_flops,
            default_name="XLA ragged_dot",
            baselines=(
                Baseline("tokamax", _TOKAMAX, _tokamax_unsupported),
                Baseline("megablox", _MEGABLOX, _megablox_unsupported),
                Baseline("vllm", vllm_fused_experts, _vllm_unsupported),
                Baseline("dense masked", _DENSE),
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
