"""Scalar index arithmetic for kernel bodies and their metadata, on int32 values that are never negative.

Truncating `lax.div` / `lax.rem` instead of jnp's `//` and `%`: Mosaic lowers integer floor division through a sign
op whose rule asks for the attached chip's generation, so a kernel using `//` on traced integers cannot be exported
or compiled for a TPU from a CPU host. For operands >= 0 both divisions agree.
"""

import jax
import jax.numpy as jnp


def div_nonnegative(a, b):
    """a // b for a >= 0 and b > 0."""
    return jax.lax.div(a, jnp.int32(b))


def rem_nonnegative(a, b):
    """a % b for a >= 0 and b > 0."""
    return jax.lax.rem(a, jnp.int32(b))
