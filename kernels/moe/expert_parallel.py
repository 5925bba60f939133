"""Expert-parallel experts_forward: the experts split over one mesh axis, every device running its own share.

Each of the axis' n devices holds E / n consecutive experts (weights sharded along the expert dimension) and every
token. A device renumbers the routing to its own experts: ids of experts it does not hold become the sentinel
E / n (>= its local expert count), which experts_forward skips on both paths, so each device computes the part of
every token's output that comes from its experts. The parts are summed across the axis (psum, in f32). No token moves
between devices: the collective is one [T, H] all-reduce, which suits decode batches; the weights, the large
operand, are each read once on one device.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .api import experts_forward


def local_expert_ids(top_k_index, axis: str, local_experts: int):
    """top_k_index in this device's numbering along `axis` (inside shard_map): the ids of the experts it holds become
    0 .. local_experts - 1, every other id (and any id outside the model's range) the sentinel local_experts."""
    first = jax.lax.axis_index(axis) * local_experts
    local = top_k_index.astype(jnp.int32) - first
    return jnp.where((local >= 0) & (local < local_experts), local, local_experts)


def experts_forward_shard(axis: str, hidden_states, top_k_index, top_k_weights, *weights, **options):
    """The per-device body, for use inside a caller's own shard_map. weights: gate_up_proj, down_proj and optionally
    gate_up_bias, down_bias as experts_forward takes them, holding this device's experts (its contiguous share of the
    expert ids along `axis`); hidden_states and the routing hold every token of the axis. Returns the full output
    [T, H] (summed over `axis`) in hidden_states' dtype. options: experts_forward's keyword arguments."""
    local = local_expert_ids(top_k_index, axis, weights[0].shape[0])
    part = experts_forward(hidden_states, local, top_k_weights, *weights, **options)
    # summed in f32: each device's part is already rounded to the input dtype once
    return jax.lax.psum(part.astype(jnp.float32), axis).astype(hidden_states.dtype)


def expert_parallel_experts_forward(
    mesh: jax.sharding.Mesh, axis: str, hidden_states, top_k_index, top_k_weights, *weights, **options
):
    """experts_forward with the experts split over `mesh`'s `axis` (see the module docstring). weights: gate_up_proj,
    down_proj and optionally gate_up_bias, down_bias (None allowed), each sharded along its expert dimension over
    `axis` (P(axis)); hidden_states and the routing replicated (P()). The result is replicated and equals the
    one-device experts_forward up to rounding. Jit it, or call it inside jit. options: experts_forward's keyword
    arguments (activation, gate_layout, weights_transposed, blocks)."""
    if axis not in mesh.shape:
        raise ValueError(f"axis: expected one of the mesh's axes {tuple(mesh.shape)}, got {axis!r}")
    devices = mesh.shape[axis]
    num_experts = weights[0].shape[0]
    if num_experts % devices:
        raise ValueError(
            f"gate_up_proj: expected a number of experts divisible by the {devices} devices of axis {axis!r}, "
            f"got {num_experts}"
        )
    weight_specs = tuple(None if w is None else P(axis) for w in weights)
    body = functools.partial(experts_forward_shard, axis, **options)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), *weight_specs), out_specs=P())
    return sharded(hidden_states, top_k_index, top_k_weights, *weights)
