"""Mixture-of-Experts experts forward (transformers' experts interface, in JAX), on one of two kernel paths.

Small batch (decode; up to tuning.SMALL_BATCH_MAX_TOKENS tokens): one kernel runs every
touched expert over all tokens and keeps each token's own experts, weighted (small_batch.py); no routing ops at all.
Its gradient is the grouped path's.

Grouped (larger batches). Route: group the (token, slot) pairs by expert (stable, so equal experts keep token order;
routing.py, dense ops, no sort), gather the token rows; gate/up grouped matmul with act(gate) * up fused into its
epilogue (written once, width I); down grouped matmul with each row scaled by its routing weight in the epilogue; sum
each token's k rows in f32. Expert ids outside [0, num_experts) (expert-parallel sentinels) are placed past the last
group, so the grouped matmuls leave their rows zero and skip their work.

Quantized expert weights (inference): int8 or float8_e4m3fn gate_up_proj / down_proj with per-output-channel f32
scales gate_up_scale [E, 2I] / down_scale [E, H] (the biases' shapes); both paths' kernels cast each weight block to
the activations' dtype in VMEM and scale the f32 result's columns. Gradients flow to the hidden states, the routing
weights and the biases; the quantized weights and their scales are constants.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..common import mxfp4, quantization
from ..common.activation import ClampedSwiGLU, check_activation
from ..common.interpret import interpret_eager_cpu_calls
from ..common.validation import FLOAT_DTYPES, check_array, check_bool, is_concrete
from ..ragged_dot import api as ragged_dot_api
from ..ragged_dot import tuning as ragged_dot_tuning
from . import combine, routing, small_batch, tuning
from .tuning import ExpertsBlocks

INDEX_DTYPES = (jnp.dtype(jnp.int32),)
WEIGHT_DTYPES = FLOAT_DTYPES[:2] + quantization.QUANTIZED_DTYPES + (mxfp4.CODE_DTYPE,)
GATE_LAYOUTS = ("concatenated", "interleaved", None)


def _validate(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    gate_up_bias,
    down_bias,
    *,
    activation,
    gate_layout,
    weights_transposed,
    gate_up_scale=None,
    down_scale=None,
    blocks=None,
):
    """Validate experts_forward's arguments, `blocks` included; return ((T, H, E, I), small-batch plan or None,
    layout), all decided before tracing."""
    check_array("hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES[:2])
    check_array("top_k_index", top_k_index, ndim=2, dtypes=INDEX_DTYPES)
    check_array("top_k_weights", top_k_weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_array("gate_up_proj", gate_up_proj, ndim=3, dtypes=WEIGHT_DTYPES)
    check_array("down_proj", down_proj, ndim=3, dtypes=WEIGHT_DTYPES)
    if gate_layout not in GATE_LAYOUTS:
        raise ValueError(f"gate_layout: expected one of {GATE_LAYOUTS}, got {gate_layout!r}")
    check_activation(activation, gated=gate_layout is not None, allow_none=False)
    weights_transposed = check_bool("weights_transposed", weights_transposed)
    tokens, hidden = hidden_states.shape
    if tuple(top_k_index.shape) != tuple(top_k_weights.shape) or top_k_index.shape[0] != tokens:
        raise ValueError(
            f"top_k_index / top_k_weights: expected the same shape [T={tokens}, k], got {tuple(top_k_index.shape)} "
            f"and {tuple(top_k_weights.shape)}"
        )
    num_experts = gate_up_proj.shape[0]
    mx_up, mx_down = (mxfp4.is_mxfp4(w.dtype) for w in (gate_up_proj, down_proj))
    up_in, up_out = (gate_up_proj.shape[1], gate_up_proj.shape[2])
    if not weights_transposed:
        up_in, up_out = up_out, up_in
    up_in *= 2 if mx_up else 1
    layout = "[E, H, N] (is_transposed)" if weights_transposed else "[E, N, H]"
    if mx_up:
        layout = "[E, H / 2, N] (MXFP4 blocks, prepared)" if weights_transposed else "[E, N, H / 2] (MXFP4 blocks)"
    if up_in != hidden:
        raise ValueError(
            f"gate_up_proj: expected layout {layout} with H = {hidden} (hidden_states' size), got shape "
            f"{tuple(gate_up_proj.shape)}"
        )
    if gate_layout is not None and up_out % 2:
        raise ValueError(
            f"gate_up_proj: a gated layout needs an even 2*I, got {up_out} (shape {tuple(gate_up_proj.shape)})"
        )
    intermediate = up_out // 2 if gate_layout is not None else up_out
    expected_down = (num_experts, intermediate, hidden) if weights_transposed else (num_experts, hidden, intermediate)
    if mx_down:
        half = intermediate // 2
        expected_down = (num_experts, half, hidden) if weights_transposed else (num_experts, hidden, half)
        if intermediate % mxfp4.BLOCK:
            raise ValueError(
                f"down_proj: MXFP4 blocks need the intermediate size (its contraction dimension) to be a multiple "
                f"of {mxfp4.BLOCK}, got I = {intermediate}"
            )
    if tuple(down_proj.shape) != expected_down:
        raise ValueError(f"down_proj: expected shape {expected_down}, got {tuple(down_proj.shape)}")
    if gate_up_bias is not None:
        check_array("gate_up_bias", gate_up_bias, ndim=2, dtypes=FLOAT_DTYPES[:2])
        if tuple(gate_up_bias.shape) != (num_experts, up_out):
            raise ValueError(f"gate_up_bias: expected shape {(num_experts, up_out)}, got {tuple(gate_up_bias.shape)}")
    if down_bias is not None:
        check_array("down_bias", down_bias, ndim=2, dtypes=FLOAT_DTYPES[:2])
        if tuple(down_bias.shape) != (num_experts, hidden):
            raise ValueError(f"down_bias: expected shape {(num_experts, hidden)}, got {tuple(down_bias.shape)}")
    up_doc = "(E, 2I)" if gate_layout is not None else "(E, I)"
    for name, scale, weight_name, weight, shape, doc in (
        ("gate_up_scale", gate_up_scale, "gate_up_proj", gate_up_proj, (num_experts, up_out), up_doc),
        ("down_scale", down_scale, "down_proj", down_proj, (num_experts, hidden), "(E, H)"),
    ):
        if mxfp4.is_mxfp4(weight.dtype):
            mxfp4.check_scales(
                name,
                scale,
                blocks_name=weight_name,
                blocks_shape=weight.shape,
                leading=(num_experts,),
                transposed=not weights_transposed,
            )
        else:
            quantization.check_scale(
                name, scale, weight_name=weight_name, weight=weight, expected_shape=shape, shape_doc=doc
            )
    if is_concrete(top_k_index) and top_k_index.size and int(np.min(np.asarray(top_k_index))) < 0:
        bad = np.argwhere(np.asarray(top_k_index) < 0)[0]
        raise ValueError(
            f"top_k_index: expected expert ids >= 0 (ids >= num_experts = {num_experts} are expert-parallel "
            f"sentinels), got top_k_index[{bad[0]}, {bad[1]}] = {int(np.asarray(top_k_index)[tuple(bad)])}"
        )
    plan, layout = _plan(
        blocks,
        hidden_states,
        top_k_index,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        gate_up_scale,
        down_scale,
        activation=activation,
        gate_layout=gate_layout,
        weights_transposed=weights_transposed,
        intermediate=intermediate,
    )
    return (tokens, hidden, num_experts, intermediate), plan, layout


def check_inputs(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, **kwargs):
    """Validate experts_forward's arguments (arrays or ShapeDtypeStructs; keywords activation, gate_layout,
    weights_transposed and optionally gate_up_scale, down_scale and blocks), `blocks` included; return
    (T, H, E, I)."""
    dims, _, _ = _validate(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, **kwargs
    )
    return dims


def _check_blocks(blocks) -> ExpertsBlocks:
    """The structure of `blocks=` (shape-independent): the fields' types and which path they belong to."""
    ragged_dot_tuning.check_part("blocks", blocks, ExpertsBlocks)
    blocks = blocks or ExpertsBlocks()
    if blocks.path is not None and blocks.path not in tuning.PATHS:
        raise ValueError(f"blocks.path: expected None or one of {tuning.PATHS}, got {blocks.path!r}")
    if blocks.combine is not None and blocks.combine not in tuning.COMBINES:
        raise ValueError(f"blocks.combine: expected None or one of {tuning.COMBINES}, got {blocks.combine!r}")
    for field in ("chunk", "vmem_limit_bytes"):
        if getattr(blocks, field) is not None and blocks.path != "small_batch":
            raise ValueError(
                f"blocks.{field}: a tile of the small-batch kernel, so it needs path='small_batch', got "
                f"path={blocks.path!r}"
            )
    ragged_dot_tuning.check_ragged_dot_blocks(blocks.gate_up, "blocks.gate_up")
    ragged_dot_tuning.check_ragged_dot_blocks(blocks.down, "blocks.down")
    return blocks


def _plan(
    blocks,
    hidden_states,
    top_k_index,
    gate_up_proj,
    down_proj,
    gate_up_bias,
    down_bias,
    gate_up_scale,
    down_scale,
    *,
    activation,
    gate_layout,
    weights_transposed,
    intermediate,
):
    """(small-batch plan or None for the grouped path, the static layout), from `blocks` and the tuning table.
    Every kernel either path may run (the grouped matmuls serve both paths' backward) has its tiles checked here,
    before tracing, with errors naming the field of `blocks`."""
    blocks = _check_blocks(blocks)
    tokens, hidden = hidden_states.shape
    rows = tokens * top_k_index.shape[1]
    dtype = hidden_states.dtype
    spec = jax.ShapeDtypeStruct
    sizes = spec((gate_up_proj.shape[0],), jnp.int32)
    if blocks.gate_up is not None:
        ragged_dot_api.check_inputs(
            spec((rows, hidden), dtype),
            gate_up_proj,
            sizes,
            preferred_element_type=dtype,
            bias=gate_up_bias,
            rhs_scale=gate_up_scale,
            activation=activation,
            gated=gate_layout,
            blocks=blocks.gate_up,
            owner="blocks.gate_up",
            rhs_transposed=not weights_transposed,
        )
    if blocks.down is not None:
        ragged_dot_api.check_inputs(
            spec((rows, intermediate), dtype),
            down_proj,
            sizes,
            preferred_element_type=dtype,
            bias=down_bias,
            rhs_scale=down_scale,
            row_scale=spec((rows,), jnp.float32),
            blocks=blocks.down,
            owner="blocks.down",
            rhs_transposed=not weights_transposed,
        )
    plan = tuning.plan_small_batch(
        tokens,
        hidden,
        intermediate,
        gate_up_shape=gate_up_proj.shape,
        down_shape=down_proj.shape,
        weights_transposed=weights_transposed,
        gate_layout=gate_layout,
        has_gate_up_bias=gate_up_bias is not None,
        hidden_dtype=dtype,
        weight_dtype=gate_up_proj.dtype,
        down_dtype=down_proj.dtype,
        blocks=blocks,
    )
    layout = _Layout(
        activation=activation,
        gate_layout=gate_layout,
        weights_transposed=weights_transposed,
        intermediate=intermediate,
        gate_up_blocks=blocks.gate_up,
        down_blocks=blocks.down,
        combine=tuning.combine_choice(blocks, rows, hidden, dtype),
    )
    return plan, layout


def prepare_mxfp4_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales):
    """MXFP4 expert weights in the checkpoint's layout (`<proj>_blocks` uint8 [E, out, in / 32, 16] or
    [E, out, in / 2], `<proj>_scales` uint8 [E, out, in / 32]) laid out once, at load, as the grouped kernels read
    them (mxfp4.prepare): returns (gate_up_proj, gate_up_scale, down_proj, down_scale) for experts_forward with
    weights_transposed=True, which then reads them with no copy."""
    (gate_up, gate_up_scale), (down, down_scale) = (
        mxfp4.prepare(b, c) for b, c in ((gate_up_blocks, gate_up_scales), (down_blocks, down_scales))
    )
    return gate_up, gate_up_scale, down, down_scale


@interpret_eager_cpu_calls
def experts_forward(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    *,
    activation: str | ClampedSwiGLU = "silu",
    gate_layout: str | None = "concatenated",
    weights_transposed: bool = False,
    gate_up_scale: jax.Array | None = None,
    down_scale: jax.Array | None = None,
    blocks: ExpertsBlocks | None = None,
) -> jax.Array:
    """transformers' MoE experts forward: y[t] = sum_j w[t,j] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = idx[t,j].

    hidden_states [T, H]; top_k_index [T, k] int32; top_k_weights [T, k]; gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] as transformers stores them (applied as x @ W[e].T), or [E, H, 2I] / [E, I, H] with
    weights_transposed. gate_layout: "concatenated" (gate rows first), "interleaved" (gate, up alternate), or None for
    experts without a gate (gate_up_proj is then the up projection [E, I, H] and the activation applies to it).
    activation: "silu", "gelu" (exact), "gelu_tanh" or "relu2", or with a gate a ClampedSwiGLU(limit, alpha,
    up_offset) (gpt-oss's gating, which replaces act(gate) * up; common/activation.py). Biases [E, 2I] and [E, H] are
    optional. Returns [T, H] in hidden_states' dtype; f32 accumulation throughout.
    Quantized weights: gate_up_proj / down_proj in int8 or float8_e4m3fn need gate_up_scale [E, 2I] / down_scale
    [E, H] float32, one scale per output channel (w = q * scale); the kernels dequantize in VMEM (forward; the
    gradient reaches the hidden states, routing weights and biases, the quantized weights are constants).
    MXFP4 weights (gpt-oss; inference): gate_up_proj / down_proj uint8 blocks [E, 2I, H / 2] / [E, H, I / 2] (or
    transformers' [E, 2I, H / 32, 16] / [E, H, I / 32, 16]), weights_transposed=False, with their e8m0 block scales
    gate_up_scale uint8 [E, 2I, H / 32] / down_scale [E, H, I / 32] (common/mxfp4.py); or, laid out once at load by
    `prepare_mxfp4_experts` (no copy of them a call; the checkpoint's layout is converted on every call),
    weights_transposed=True with blocks [E, H / 2, 2I] / [E, I / 2, H] and scales [E, S(H), 2I] / [E, S(I), H]
    (S(K) = mxfp4.scale_rows(K)). Both paths' kernels widen each weight block in VMEM (the small-batch kernel needs
    both projections in MXFP4); no gradient flows through them.
    `blocks`: the path and the tiles of its kernels (an ExpertsBlocks, see tuning.py); None: the tuning table's.
    """
    gate_up_proj, down_proj = (
        mxfp4.packed(name, w) if hasattr(w, "dtype") and mxfp4.is_mxfp4(w.dtype) else w
        for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj))
    )
    (tokens, hidden, _, _), plan, layout = _validate(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        activation=activation,
        gate_layout=gate_layout,
        weights_transposed=weights_transposed,
        gate_up_scale=gate_up_scale,
        down_scale=down_scale,
        blocks=blocks,
    )
    if tokens * top_k_index.shape[1] == 0:
        return jnp.zeros((tokens, hidden), hidden_states.dtype)
    weights = _Weights(gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_scale, down_scale)
    if plan is not None:
        return _small_batch(plan, layout, hidden_states, top_k_index, top_k_weights, weights)
    return _grouped(layout, hidden_states, top_k_index, top_k_weights, weights)


@dataclasses.dataclass(frozen=True)
class _Layout:
    activation: str
    gate_layout: str | None
    weights_transposed: bool
    intermediate: int
    gate_up_blocks: ragged_dot_tuning.RaggedDotBlocks | None = None
    down_blocks: ragged_dot_tuning.RaggedDotBlocks | None = None
    combine: str = "gather"  # tuning.COMBINES


class _Weights(NamedTuple):
    """The expert weights of one call (a pytree; absent biases and scales are None)."""

    gate_up_proj: jax.Array
    down_proj: jax.Array
    gate_up_bias: jax.Array | None
    down_bias: jax.Array | None
    gate_up_scale: jax.Array | None
    down_scale: jax.Array | None


def _grouped(layout: _Layout, hidden_states, top_k_index, top_k_weights, weights: _Weights):
    """Route, gather, gate/up grouped matmul with the fused epilogue, down grouped matmul, weighted combine."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_experts = weights.gate_up_proj.shape[0]
    layout_rows = routing.row_layout(top_k_index, num_experts)
    # The row gathers index inside [0, T * k) by construction: jnp.take's default "fill" mode would add a bounds
    # select over the whole [T * k, H] gather (modeled v6e: 405 us at 32768 rows).
    x_sorted = hidden_states.at[layout_rows.pair // top_k].get(mode="promise_in_bounds")
    h = ragged_dot_api.ragged_dot(
        x_sorted,
        weights.gate_up_proj,
        layout_rows.group_sizes,
        rhs_transposed=not layout.weights_transposed,
        bias=weights.gate_up_bias,
        rhs_scale=weights.gate_up_scale,
        activation=layout.activation,
        gated=layout.gate_layout,
        preferred_element_type=hidden_states.dtype,
        blocks=layout.gate_up_blocks,
    )
    # The routing weight of each sorted row scales it in the down kernel's epilogue (sentinel slots weigh zero; their
    # rows sit past the last group and come out zero anyway), so the weighted rows are written once, in the
    # activations' dtype as transformers' eager path does, and the combine is one gather + sum over k in f32.
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    pair_weight = jnp.where(valid, top_k_weights.astype(jnp.float32), 0.0).reshape(-1)
    # Scattered to the rows: on the v5e a scalar scatter of 32768 values took half the time of a scalar gather of the
    # rows' weights (0.15 against 0.34 ms).
    row_routing = (
        jnp.zeros_like(pair_weight)
        .at[layout_rows.position]
        .set(pair_weight, mode="promise_in_bounds", unique_indices=True)
    )
    y = ragged_dot_api.ragged_dot(
        h,
        weights.down_proj,
        layout_rows.group_sizes,
        rhs_transposed=not layout.weights_transposed,
        bias=weights.down_bias,
        rhs_scale=weights.down_scale,
        row_scale=row_routing,
        preferred_element_type=hidden_states.dtype,
        blocks=layout.down_blocks,
    )
    if layout.combine == "kernel":
        return _combined(y, layout_rows.position, layout_rows.pair, top_k)
    per_slot = y.at[layout_rows.position].get(mode="promise_in_bounds").reshape(tokens, top_k, hidden)
    return per_slot.astype(jnp.float32).sum(axis=1).astype(hidden_states.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combined(rows, position, pair, top_k):
    """Each token's top_k rows summed (combine.py); its gradient gives every row its token's cotangent."""
    return combine.combine_rows(rows, position, top_k)


def _combined_fwd(rows, position, pair, top_k):
    return combine.combine_rows(rows, position, top_k), pair


def _combined_bwd(top_k, pair, g):
    # Row r holds pair pair[r] = token * top_k + slot: a gather of g's rows, whose table XLA keeps in VMEM.
    return g.at[pair // top_k].get(mode="promise_in_bounds"), None, None


_combined.defvjp(_combined_fwd, _combined_bwd)


def _small_batch_forward(plan, layout: _Layout, hidden_states, top_k_index, top_k_weights, weights: _Weights):
    def stored(w, swap):
        return jnp.swapaxes(w, 1, 2) if swap else w

    def per_column(v):  # [E, N] -> [E, 1, N] blocks
        return None if v is None else v[:, None, :]

    gate_up, down = weights.gate_up_proj, weights.down_proj
    gate_up_scale, down_scale = weights.gate_up_scale, weights.down_scale
    if mxfp4.is_mxfp4(gate_up.dtype) and not layout.weights_transposed:  # the checkpoint's layout: every call
        gate_up, gate_up_scale, down, down_scale = prepare_mxfp4_experts(gate_up, gate_up_scale, down, down_scale)
    return small_batch.experts_forward_small_batch(
        hidden_states,
        top_k_index,
        top_k_weights,
        stored(gate_up, plan.swap_gate_up),
        stored(down, plan.swap_down),
        per_column(weights.gate_up_bias),
        per_column(weights.down_bias),
        gate_up_scale=gate_up_scale,
        down_scale=down_scale,
        up_streams=plan.up_streams,
        down_i_axis=plan.down_i_axis,
        tc=plan.tc,
        intermediate=layout.intermediate,
        activation=layout.activation,
        vmem_limit_bytes=plan.vmem_limit_bytes,
    )


# The small-batch kernel has no backward of its own: its gradient is the grouped path's (same function, recomputed
# in the backward pass), whose kernels have Pallas backward passes.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _small_batch(plan, layout, hidden_states, top_k_index, top_k_weights, weights):
    return _small_batch_forward(plan, layout, hidden_states, top_k_index, top_k_weights, weights)


def _small_batch_fwd(plan, layout, hidden_states, top_k_index, top_k_weights, weights):
    out = _small_batch_forward(plan, layout, hidden_states, top_k_index, top_k_weights, weights)
    return out, (hidden_states, top_k_index, top_k_weights, weights)


def _small_batch_bwd(plan, layout, saved, g):
    hidden_states, top_k_index, top_k_weights, weights = saved
    # Quantized weights and their scales are constants of the grouped path's gradient (zero cotangent, None);
    # float weights and the biases are differentiated.
    constant = {
        "gate_up_scale",
        "down_scale",
        *(
            n
            for n in ("gate_up_proj", "down_proj")
            if quantization.is_quantized(getattr(weights, n).dtype) or mxfp4.is_mxfp4(getattr(weights, n).dtype)
        ),
    }
    free = {n: v for n, v in weights._asdict().items() if n not in constant}

    def grouped(hidden_states, top_k_weights, free):
        w = _Weights(**free, **{n: getattr(weights, n) for n in constant})
        return _grouped(layout, hidden_states, top_k_index, top_k_weights, w)

    _, vjp = jax.vjp(grouped, hidden_states, top_k_weights, free)
    dx, dw, dfree = vjp(g)
    dweights = _Weights(**dfree, **{n: None for n in constant})
    return dx, None, dw, dweights


_small_batch.defvjp(_small_batch_fwd, _small_batch_bwd)
