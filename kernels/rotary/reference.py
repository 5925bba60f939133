"""Rotary embeddings written to be obviously right: plain jax.numpy, math in f32 (or the dtype given).

The formulas are transformers' `apply_rotary_pos_emb` (q * cos + rotate_half(q) * sin) with cos/sin [B, S, r]
broadcast over heads, generalised to partial rotary (only the first r features rotate, the rest pass through) and to
the interleaved-pairs (GPT-J) `rotate_half`.
"""

import jax.numpy as jnp


def rotate_half(x, interleaved=False):
    """transformers' rotate_half over the last axis: cat(-x2, x1) of the two halves; interleaved: (-x[2i+1], x[2i])."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return jnp.stack((-x2, x1), axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def _head_axis(layout):
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")
    return 1 if layout == "bhsd" else 2


def rotate_reference(x, cos, sin, *, interleaved=False, layout="bhsd", compute_dtype=jnp.float32):
    """RoPE of one 4D array x with per-token cos/sin [B or 1, S, r]; the first r features rotate."""
    axis = _head_axis(layout)
    r = cos.shape[-1]
    c = jnp.expand_dims(cos.astype(compute_dtype), axis)
    s = jnp.expand_dims(sin.astype(compute_dtype), axis)
    xf = x.astype(compute_dtype)
    x_rot, x_pass = xf[..., :r], xf[..., r:]
    out = x_rot * c + rotate_half(x_rot, interleaved) * s
    return jnp.concatenate((out, x_pass), axis=-1).astype(x.dtype)


def apply_rotary_reference(q, k, cos, sin, *, interleaved=False, layout="bhsd", compute_dtype=jnp.float32):
    """(rope(q), rope(k)); k may be None."""
    kw = dict(interleaved=interleaved, layout=layout, compute_dtype=compute_dtype)
    return rotate_reference(q, cos, sin, **kw), (None if k is None else rotate_reference(k, cos, sin, **kw))


def head_rms_norm_reference(x, weight, eps, weight_offset=0.0, compute_dtype=jnp.float32):
    """RMSNorm over the last (head_dim) axis, result kept in compute_dtype."""
    xf = x.astype(compute_dtype)
    y = xf / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * (weight_offset + weight.astype(compute_dtype))


def rms_norm_rope_reference(
    q,
    k,
    q_weight,
    k_weight,
    cos,
    sin,
    *,
    eps=1e-6,
    weight_offset=0.0,
    interleaved=False,
    layout="bhsd",
    compute_dtype=jnp.float32,
):
    """(rope(rms_norm(q) * q_weight), rope(rms_norm(k) * k_weight)) with the norm over head_dim, all in f32."""
    kw = dict(interleaved=interleaved, layout=layout, compute_dtype=compute_dtype)
    qn = head_rms_norm_reference(q, q_weight, eps, weight_offset, compute_dtype)
    out_q = rotate_reference(qn, cos, sin, **kw).astype(q.dtype)
    if k is None:
        return out_q, None
    kn = head_rms_norm_reference(k, k_weight, eps, weight_offset, compute_dtype)
    return out_q, rotate_reference(kn, cos, sin, **kw).astype(k.dtype)


def cos_sin_from_positions(positions, inv_freq, attention_scaling=1.0, *, interleaved=False):
    """transformers' rotary-embedding forward: freqs = positions * inv_freq (f32), emb = cat(freqs, freqs) (or each
    frequency repeated twice when interleaved), cos = cos(emb) * scaling, sin likewise; [B, S, 2 * len(inv_freq)]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.repeat(freqs, 2, axis=-1) if interleaved else jnp.concatenate((freqs, freqs), axis=-1)
    return jnp.cos(emb) * attention_scaling, jnp.sin(emb) * attention_scaling
