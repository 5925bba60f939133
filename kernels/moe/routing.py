"""The grouped path's row layout: where each (token, slot) pair's row goes in the grouped matmuls' input.

The pairs are grouped by expert (stable: equal experts keep token order), expert-parallel sentinels (ids outside
[0, num_experts)) after every expert.

Computed with dense ops only: on a TPU, XLA runs a sort's glue, a searchsorted and the small-table gathers
(`table[expert_of_row]`) as scalar loops: measured on the v5e at Qwen3's 4096-token prefill (32768 pairs), a
searchsorted over the expert ends took 2.0 ms and its gather another 2.0 ms, each 128-entry gather of 32768 indices
0.25 ms, the expert counts' scatter-add 0.29 ms, against ~3 ms for both grouped matmuls. Here a pair's rank within
its expert is a one-hot matmul (the pairs in chunks; a strictly lower-triangular matrix of ones counts the earlier
pairs of each expert in the chunk, exactly, in f32) plus the earlier chunks' counts, and every per-expert value a
pair needs is picked by a one-hot select and sum: no gather, no sort. The one scatter left inverts the layout (which
pair each row holds). Measured the same way, the whole layout takes ~0.2 ms there (0.15 of it that scatter).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Pairs per chunk of the rank matmul: [chunk, chunk] x [chunk, E + 1] a chunk, 2 * chunk * (E + 1) flops a pair.
RANK_CHUNK = 256


class RowLayout(NamedTuple):
    position: jax.Array  # [T * k] int32: the row of pair p (flat index token * k + slot)
    pair: jax.Array  # [T * k] int32: the pair row r holds (position's inverse)
    group_sizes: jax.Array  # [E] int32: each expert's rows


def row_layout(top_k_index, num_experts: int) -> RowLayout:
    """The rows of the (token, slot) pairs of top_k_index [T, k], grouped by expert in token order, sentinel ids
    after the last expert."""
    flat = top_k_index.reshape(-1).astype(jnp.int32)
    pairs = flat.shape[0]
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # sentinels: key E, after every expert
    chunks = -(-pairs // RANK_CHUNK)
    keys = num_experts + 1  # the experts and the sentinels' key
    # padding pairs take key E + 1, which matches no column of the one-hot
    key = jnp.pad(key, (0, chunks * RANK_CHUNK - pairs), constant_values=keys).reshape(chunks, RANK_CHUNK)
    one_hot = key[:, :, None] == jnp.arange(keys, dtype=jnp.int32)  # [chunks, chunk, E + 1]
    earlier = jnp.tril(jnp.ones((RANK_CHUNK, RANK_CHUNK), jnp.bfloat16), -1)
    # within[c, i, e]: pairs of key e before pair i in chunk c (0 / 1 products summed in f32: exact below 2^24)
    within = jnp.einsum("ij,cje->cie", earlier, one_hot.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    counts = one_hot.sum(axis=1, dtype=jnp.int32)  # [chunks, E + 1]
    before = jnp.cumsum(counts, axis=0) - counts  # pairs of key e in earlier chunks
    sizes = counts.sum(axis=0)  # [E + 1], the sentinels last
    group_sizes = sizes[:num_experts]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])  # [E + 1]: sentinels at the end
    # a pair's row: its key's start + its rank among its key's pairs
    row = jnp.where(one_hot, within.astype(jnp.int32) + before[:, None, :] + starts, 0).sum(axis=-1)
    position = row.reshape(-1)[:pairs]
    pair = (
        jnp.zeros_like(position)
        .at[position]
        .set(jnp.arange(pairs, dtype=jnp.int32), mode="promise_in_bounds", unique_indices=True)
    )
    return RowLayout(position, pair, group_sizes)
