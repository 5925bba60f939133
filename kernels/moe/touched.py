"""The experts a small batch touches, as a small vector Pallas kernel: the visit list of the small-batch kernel.

top_k_index [T, k] -> (experts [num_experts], count): experts[:count] are the distinct ids in [0, num_experts),
ascending; ids outside that range (expert-parallel sentinels) are skipped; slots past count hold 0, a valid block
index (a grid sized max(count, 1) never fetches outside the weights). Done in XLA this is a scatter, a cumsum and a
compaction, each a separate op with its own launch; here it is one small vector kernel.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..common.manual_axes import out_struct


def _touched_kernel(idx_ref, experts_ref, count_ref, *, num_experts):
    # Vector code only: a scalar loop over the ids (mark, then compact) costs ~30 cycles an id, 37-48 us at 256
    # tokens x top-8, where this is a few hundred vector ops.
    idx = idx_ref[...]  # [T, k]
    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, num_experts), 1)
    hit = jnp.zeros((idx.shape[0], num_experts), jnp.float32)
    for j in range(idx.shape[1]):  # k is small (top-k)
        hit = jnp.maximum(hit, jnp.where(idx[:, j : j + 1] == lanes, 1.0, 0.0))  # sentinels match no lane
    touched = jnp.max(hit, axis=0, keepdims=True)  # [1, E]: 1.0 where touched
    rows = jax.lax.broadcasted_iota(jnp.int32, (num_experts, num_experts), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (num_experts, num_experts), 1)
    exact = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)  # integers, exact in f32
    # slot[e]: touched experts below e (an exclusive prefix sum, as a matmul with a strictly upper-triangular 1s).
    slot = jnp.dot(touched, jnp.where(rows < cols, 1.0, 0.0), **exact)  # [1, E]
    # experts[s] = the touched e with slot[e] == s: placement[s, e] = 1 there; experts = placement @ e.
    placement = jnp.where(jnp.logical_and(slot == rows.astype(jnp.float32), touched > 0.0), 1.0, 0.0)  # [E(s), E(e)]
    ids = lanes.astype(jnp.float32)
    experts = jax.lax.dot_general(ids, placement, (((1,), (1,)), ((), ())), **exact)  # [1, E(s)]
    experts_ref[...] = experts.astype(jnp.int32)
    count_ref[...] = jnp.sum(touched, axis=1, keepdims=True).astype(jnp.int32)


def touched_experts(top_k_index, num_experts: int):
    """(experts [num_experts] int32, count [] int32) for top_k_index [T, k] int32; see the module docstring."""
    experts, count = pl.pallas_call(
        functools.partial(_touched_kernel, num_experts=num_experts),
        out_shape=(out_struct((1, num_experts), jnp.int32, top_k_index), out_struct((1, 1), jnp.int32, top_k_index)),
        name="moe_touched_experts",
    )(top_k_index.astype(jnp.int32))
    return experts.reshape(-1), count.reshape(())


def touched_experts_reference(top_k_index, num_experts: int):
    """The same list in numpy terms (tests): the distinct valid ids, ascending."""
    ids = {int(i) for i in jax.device_get(top_k_index).reshape(-1)}
    return sorted(e for e in ids if 0 <= e < num_experts)
