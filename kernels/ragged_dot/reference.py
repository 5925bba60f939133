"""Ragged dot (grouped matmul) written to be obviously right: plain jax.numpy, one dense matmul per group, math in
f32 at full precision.

Semantics (those of `jax.lax.ragged_dot`, plus the local group window and the gated epilogue of `api.ragged_dot`):
rows of lhs are sorted by group; group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])). Row r of the output is
lhs[r] @ rhs[g(r)] when g(r) is in the local window [group_offset, group_offset + num_local_groups), else zero; rows
past sum(group_sizes) are zero. rhs holds either every group or only the window's (see `api.ragged_dot`).
"""

import jax
import jax.numpy as jnp

from ..common.activation import ClampedSwiGLU

_HIGHEST = jax.lax.Precision.HIGHEST


def activation_reference(x, activation):
    if activation is None:
        return x
    if activation == "silu":
        return x * jax.nn.sigmoid(x)
    if activation == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if activation == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    if activation == "relu2":
        return jnp.square(jax.nn.relu(x))
    raise ValueError(f"activation: expected None, 'silu', 'gelu', 'gelu_tanh' or 'relu2', got {activation!r}")


def gating_reference(gate, up, activation):
    """act(gate) * up, or gpt-oss's clamped SwiGLU for a ClampedSwiGLU (limit, alpha, up_offset)."""
    if isinstance(activation, ClampedSwiGLU):
        gate = jnp.minimum(gate, activation.limit)
        up = jnp.clip(up, -activation.limit, activation.limit)
        return (up + activation.up_offset) * gate * jax.nn.sigmoid(gate * activation.alpha)
    return activation_reference(gate, activation) * up


def row_groups(group_sizes, m):
    """Group id of every row (num_groups for rows past the sum of the sizes)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def ragged_dot_reference(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type=None,
    rhs_transposed=False,
    group_offset=0,
    num_local_groups=None,
    bias=None,
    activation=None,
    gated=None,
    row_scale=None,
):
    """lhs [M, K]; rhs [Gr, K, N] ([Gr, N, K] if rhs_transposed), Gr = G or num_local_groups; bias [Gr, N] or None;
    row_scale [M] or None multiplies each output row last.

    gated: None, "concatenated" (columns [0, N/2) are the gate, [N/2, N) the up projection) or "interleaved"
    (gate at even columns, up at odd ones): the output is act(gate) * up, of width N/2. Without gating, `activation`
    applies to the whole output.
    """
    m = lhs.shape[0]
    num_groups = group_sizes.shape[0]
    n_local = rhs.shape[0] if num_local_groups is None else num_local_groups
    rhs_global = rhs.shape[0] == num_groups and n_local != num_groups
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    w = jnp.swapaxes(rhs, 1, 2) if rhs_transposed else rhs
    w = w.astype(jnp.float32)
    x = lhs.astype(jnp.float32)
    groups = row_groups(group_sizes, m)
    local = groups - group_offset  # window index of each row's group
    n = w.shape[2]
    out = jnp.zeros((m, n), jnp.float32)
    for j in range(n_local):
        wj = w[group_offset + j] if rhs_global else w[j]
        yj = jnp.dot(x, wj, precision=_HIGHEST)
        if bias is not None:
            bj = bias[group_offset + j] if rhs_global else bias[j]
            yj = yj + bj.astype(jnp.float32)[None, :]
        out = jnp.where((local == j)[:, None], yj, out)
    if gated is None:
        res = activation_reference(out, activation)
    else:
        if gated == "concatenated":
            gate, up = out[:, : n // 2], out[:, n // 2 :]
        elif gated == "interleaved":
            gate, up = out[:, 0::2], out[:, 1::2]
        else:
            raise ValueError(f"gated: expected None, 'concatenated' or 'interleaved', got {gated!r}")
        res = gating_reference(gate, up, activation)
    if row_scale is not None:
        res = res * row_scale.astype(jnp.float32)[:, None]
    in_window = (local >= 0) & (local < n_local)
    return jnp.where(in_window[:, None], res, 0.0).astype(out_dtype)
