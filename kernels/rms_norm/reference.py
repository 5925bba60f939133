"""RMSNorm written to be obviously right: plain jax.numpy, math in f32 (or in the dtype given)."""

import jax.numpy as jnp


def rms_norm_reference(x, weight=None, eps=1e-6, *, weight_offset=0.0, compute_dtype=jnp.float32):
    """x * rsqrt(mean(x^2, -1) + eps) * (weight_offset + weight), computed in compute_dtype, returned in x.dtype."""
    xf = x.astype(compute_dtype)
    y = xf / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * (weight_offset + weight.astype(compute_dtype))
    return y.astype(x.dtype)


def fused_add_rms_norm_reference(x, residual, weight=None, eps=1e-6, *, weight_offset=0.0, compute_dtype=jnp.float32):
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype as an unfused model would store it."""
    total = (x.astype(compute_dtype) + residual.astype(compute_dtype)).astype(x.dtype)
    normed = rms_norm_reference(total, weight, eps, weight_offset=weight_offset, compute_dtype=compute_dtype)
    return normed, total
