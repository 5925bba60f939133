"""Mixture-of-Experts experts forward written to be obviously right: every expert runs densely over every token and a
routing mask keeps what each token chose (plain jax.numpy, f32 math). It is also what XLA does with no grouped kernel.

For token t and slot j with e = top_k_index[t, j] in [0, num_experts):
    y[t] += top_k_weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t]))
ids outside [0, num_experts) (expert-parallel sentinels) contribute nothing.
"""

import jax
import jax.numpy as jnp

from ..ragged_dot.reference import activation_reference, gating_reference

_HIGHEST = jax.lax.Precision.HIGHEST


def as_input_major(weight, weights_transposed):
    """transformers stores [E, out, in] (applied as x @ W[e].T) unless is_transposed ([E, in, out]).

    Returns [E, in, out]."""
    return weight if weights_transposed else jnp.swapaxes(weight, 1, 2)


def gate_and_up(h, gate_layout):
    if gate_layout == "concatenated":
        half = h.shape[-1] // 2
        return h[..., :half], h[..., half:]
    if gate_layout == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    raise ValueError(f"gate_layout: expected 'concatenated' or 'interleaved', got {gate_layout!r}")


def experts_forward_reference(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    gate_up_bias=None,
    down_bias=None,
    *,
    activation="silu",
    gate_layout="concatenated",
    weights_transposed=False,
):
    """hidden_states [T, H]; top_k_index / top_k_weights [T, k]; gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    (or [E, H, 2I] / [E, I, H] with weights_transposed); gate_layout None for experts without a gate (an up
    projection [E, I, H] and act(up)). Returns [T, H] in hidden_states.dtype."""
    x = hidden_states.astype(jnp.float32)
    w_up = as_input_major(gate_up_proj, weights_transposed).astype(jnp.float32)
    w_down = as_input_major(down_proj, weights_transposed).astype(jnp.float32)
    num_experts = w_up.shape[0]
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(num_experts):
        h = jnp.dot(x, w_up[e], precision=_HIGHEST)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].astype(jnp.float32)
        if gate_layout is None:
            act = activation_reference(h, activation)
        else:
            gate, up = gate_and_up(h, gate_layout)
            act = gating_reference(gate, up, activation)
        # Round the intermediate to the model dtype, as every implementation stores it between the two matmuls.
        act = act.astype(hidden_states.dtype).astype(jnp.float32)
        y = jnp.dot(act, w_down[e], precision=_HIGHEST)
        if down_bias is not None:
            y = y + down_bias[e].astype(jnp.float32)
        coefficient = jnp.sum(jnp.where(top_k_index == e, top_k_weights.astype(jnp.float32), 0.0), axis=1)
        out = out + coefficient[:, None] * y
    return out.astype(hidden_states.dtype)
