"""Plain-jnp attention in float32: what the flash attention kernels are tested against (forward, and backward
through jax.grad). It materialises every score, so it is for test sizes only.

Semantics (flash-attn 2's): scores `q @ k^T * softmax_scale`, then `softcap * tanh(scores / softcap)` when softcap > 0;
query row i of a sequence with `sq` queries and `sk` keys may see key j when
`i + sk - sq - left <= j <= i + sk - sq + right` (the causal diagonal is bottom-right aligned; causal forces
right = 0; -1 is unbounded). An attention sink (one logit per query head) joins every row's softmax with no value.
A row that may see no key outputs zeros and its log-sum-exp is +inf (flash-attn's convention), or the sink's logit.
"""

import jax.numpy as jnp
import numpy as np


def allowed_keys(sq: int, sk: int, *, causal: bool, window_size: tuple[int, int]):
    """[sq, sk] bool: which keys each query row may see (local positions of one sequence)."""
    left, right = window_size
    if causal:
        right = 0
    rows = np.arange(sq)[:, None] + (sk - sq)
    cols = np.arange(sk)[None, :]
    allowed = np.ones((sq, sk), bool)
    if left >= 0:
        allowed &= cols >= rows - left
    if right >= 0:
        allowed &= cols <= rows + right
    return jnp.asarray(allowed)


def attention_reference(
    q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False
):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> out [B, Sq, Hq, Dv] in q's dtype
    (and lse [B, Hq, Sq] float32)."""
    out_dtype = q.dtype
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    group = hq // hkv
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    kf = jnp.repeat(kf, group, axis=2)
    vf = jnp.repeat(vf, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    allowed = allowed_keys(sq, sk, causal=causal, window_size=window_size)[None, None]
    masked = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(masked, axis=-1, keepdims=True, initial=-jnp.inf)
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[None, :, None, None]
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(allowed, jnp.exp(masked - row_max), 0.0)
    total = probs.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - row_max)
    safe_total = jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs / safe_total, vf)
    if not return_lse:
        return out.astype(out_dtype)
    lse = jnp.where(total > 0, row_max + jnp.log(safe_total), jnp.inf)[..., 0]
    return out.astype(out_dtype), lse


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, return_lse=False, **options):
    """Packed sequences: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], sequence s at rows
    cu_seqlens[s]:cu_seqlens[s + 1] (concrete int32 arrays). -> out [Tq, Hq, Dv] (and lse [Hq, Tq])."""
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (x[None, a:b] for x, (a, b) in ((q, cu_q[s : s + 2]), (k, cu_k[s : s + 2]), (v, cu_k[s : s + 2])))
        out, lse = attention_reference(qs, ks, vs, return_lse=True, **options)
        outs.append(out[0])
        lses.append(lse[0])
    out = jnp.concatenate(outs, axis=0) if outs else jnp.zeros((0,) + q.shape[1:-1] + v.shape[-1:], q.dtype)
    if not return_lse:
        return out
    lse = jnp.concatenate(lses, axis=1) if lses else jnp.zeros((q.shape[1], 0), jnp.float32)
    return out, lse
