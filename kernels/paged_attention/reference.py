"""Plain-jnp ragged paged attention in float32: what the paged attention kernel is tested against. It gathers each
sequence's pages into a contiguous context and runs the flash attention reference on it, one sequence at a time, so
it needs concrete (host) metadata and is for test sizes only.

Semantics. Sequence s < num_seqs has query rows cu_q_lens[s]:cu_q_lens[s + 1] and a context of kv_lens[s] tokens,
the new queries' own tokens included: its queries are the last q_len positions of the context (flash-attn's
bottom-right alignment). Context position p lives in page page_indices[s, p // page_size] at row p % page_size of
k_cache / v_cache [num_pages, page_size, kv_heads, head_dim]. Query rows past cu_q_lens[num_seqs] (padding) output
zeros. A float8 cache holds value / scale: keys read back as stored * k_scale, values as stored * v_scale.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..flash_attention.reference import attention_reference

# One sequence's attention, jitted: one compile per context shape instead of one per jnp op (this reference runs
# eagerly, with a new shape per sequence).
_sequence_attention = jax.jit(
    attention_reference, static_argnames=("softmax_scale", "causal", "window_size", "softcap", "return_lse")
)


def gather_context(cache: np.ndarray, page_indices_row, length: int) -> np.ndarray:
    """[length, heads, dim]: the first `length` context rows of one sequence, page by page (host arrays)."""
    page_size = cache.shape[1]
    pages = -(-length // page_size)
    rows = cache[np.asarray(page_indices_row)[:pages]]
    return rows.reshape(pages * page_size, *cache.shape[2:])[:length]


def ragged_paged_attention_reference(
    q,
    k_cache,
    v_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs=None,
    *,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    softcap=0.0,
    sinks=None,
    k_scale=None,
    v_scale=None,
):
    """q [T, Hq, D], caches [P, page, Hkv, D / Dv], kv_lens [N], page_indices [N, pages], cu_q_lens [N + 1],
    num_seqs None (all N) or an int / [1] array -> out [T, Hq, Dv] in q's dtype."""
    kv_lens, page_indices, cu_q = (np.asarray(a) for a in (kv_lens, page_indices, cu_q_lens))
    n = kv_lens.shape[0] if num_seqs is None else int(np.asarray(num_seqs).reshape(-1)[0])
    tokens, q_heads = q.shape[0], q.shape[1]
    # The caches are gathered and the output assembled on the host: eager jnp ops would compile one XLA program per
    # op and per sequence shape.
    q_host, k_host, v_host = (np.asarray(jnp.asarray(a).astype(jnp.float32)) for a in (q, k_cache, v_cache))
    out = np.zeros((tokens, q_heads, v_cache.shape[-1]), np.float32)
    for s in range(n):
        start, end = int(cu_q[s]), int(cu_q[s + 1])
        if end == start:
            continue
        k = gather_context(k_host, page_indices[s], int(kv_lens[s]))
        v = gather_context(v_host, page_indices[s], int(kv_lens[s]))
        if k_scale is not None:
            k = k * float(np.asarray(k_scale).reshape(-1)[0])
        if v_scale is not None:
            v = v * float(np.asarray(v_scale).reshape(-1)[0])
        rows = _sequence_attention(
            q_host[None, start:end],
            k[None],
            v[None],
            softmax_scale=q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
            causal=causal,
            window_size=tuple(window_size),
            softcap=softcap,
            sinks=sinks,
        )
        out[start:end] = np.asarray(rows[0])
    return jnp.asarray(out).astype(q.dtype)
