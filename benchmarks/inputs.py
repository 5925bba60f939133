"""Benchmark inputs built on the device: random values from `jax.random`, never host arrays (a large host array
costs seconds to build and copy on a TPU host) and never zeros.

Each helper takes an int seed or a jax.random key and makes its array on the default device with one small jitted
program per (shape, dtype) (the values are generated in f32 and cast). `keys(seed, n)` splits a seed into n
independent keys, one per array of a case: the same seed gives the same arrays, another seed other ones. Small
integer metadata a benchmark must know on the host (group sizes, lengths, page tables) stays numpy where it is made
and is copied as it is.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# The keys' PRNG: "rbg" (XLA's RngBitGenerator) rather than jax's default threefry, whose bit generation XLA compiles
# slowly for a TPU: three normal bf16 arrays of 8 x 4096 x 16 x 256 compiled for the v5e in 28.5 s with threefry and
# 2.6 s with rbg (deviceless, this 2-core host); on the v5e host input builders took 17-41 s to compile.
PRNG = "rbg"
# But RngBitGenerator writes its bits out whole before they become values (threefry's fuse into them): a 1.5 GiB bf16
# array held 3 GiB of u32 temporaries (compiled for the v5e), and the paged attention suite's caches at batch 256 then
# failed to allocate on the chip. So an array of more than CHUNK_ELEMENTS is drawn in chunks of whole leading rows
# (a loop, each chunk from a key of its own), its temporaries those of one chunk.
CHUNK_ELEMENTS = 1 << 25


def key(seed_or_key):
    """A jax.random key (PRNG) from an int seed, or the key itself."""
    return jax.random.key(seed_or_key, impl=PRNG) if isinstance(seed_or_key, int) else seed_or_key


def keys(seed_or_key, n: int) -> list:
    """n independent keys from a seed or a key (one per array of a case)."""
    return list(jax.random.split(key(seed_or_key), n))


def _shape(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def _chunked(draw, k, shape):
    """draw(key, shape) for the whole shape, or where it has more than CHUNK_ELEMENTS elements, for chunks of its
    leading rows (each with a key of its own) stacked in a loop; a row larger than a chunk drawn the same way."""
    if math.prod(shape) <= CHUNK_ELEMENTS or len(shape) < 2:
        return draw(k, shape)
    rows, rest = shape[0], shape[1:]
    if math.prod(rest) > CHUNK_ELEMENTS:
        chunks = jax.lax.map(lambda key: _chunked(draw, key, rest), jax.random.split(k, rows))
    else:
        fit = CHUNK_ELEMENTS // math.prod(rest)
        per_chunk = max(r for r in range(1, min(rows, fit) + 1) if rows % r == 0)
        chunks = jax.lax.map(lambda key: draw(key, (per_chunk, *rest)), jax.random.split(k, rows // per_chunk))
    return chunks.reshape(shape)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(k, shape, dtype, scale):
    def draw(key, shape):
        x = jax.random.normal(key, shape, jnp.float32)
        return (x if scale == 1.0 else x * scale).astype(dtype)

    return _chunked(draw, k, shape)


def normal(seed_or_key, shape, dtype=jnp.float32, scale: float = 1.0):
    """Standard normal values of `shape` times `scale`, cast to `dtype`, made on the default device (one compile
    per shape)."""
    return _normal(key(seed_or_key), _shape(shape), jnp.dtype(dtype), float(scale))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _uniform(k, shape, dtype, low, high):
    return _chunked(lambda key, shape: jax.random.uniform(key, shape, jnp.float32, low, high).astype(dtype), k, shape)


def uniform(seed_or_key, shape, low: float, high: float, dtype=jnp.float32):
    """Values uniform in [low, high) of `shape`, cast to `dtype`, made on the default device."""
    return _uniform(key(seed_or_key), _shape(shape), jnp.dtype(dtype), float(low), float(high))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _integers(k, shape, dtype, low, high):
    return _chunked(lambda key, shape: jax.random.randint(key, shape, low, high, jnp.int32).astype(dtype), k, shape)


def integers(seed_or_key, shape, low: int, high: int, dtype=jnp.int32):
    """Integers uniform in [low, high) of `shape`, stored as `dtype` (e.g. int8 values, uint8 codes), made on the
    default device."""
    return _integers(key(seed_or_key), _shape(shape), jnp.dtype(dtype), int(low), int(high))
