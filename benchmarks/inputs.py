"""Benchmark inputs built on the device: random values from `jax.random`, never host arrays (a large host array
costs seconds to build and copy on a TPU host) and never zeros."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def key(seed_or_key):
    """A jax.random key from an int seed, or the key itself."""
    return jax.random.key(seed_or_key) if isinstance(seed_or_key, int) else seed_or_key


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(k, shape, dtype):
    return jax.random.normal(k, shape, jnp.float32).astype(dtype)


def normal(seed_or_key, shape, dtype=jnp.float32):
    """Standard normal values of `shape`, cast to `dtype`, made on the default device (one compile per shape)."""
    return _normal(key(seed_or_key), tuple(int(d) for d in shape), jnp.dtype(dtype))
