"""The activations the kernels' epilogues apply (ragged dot's fused epilogue, the MoE small-batch kernel), written
once for the Pallas kernel bodies and the XLA epilogue of the unfused paths, so every path computes the same function.

Each reference writes its own (plain `jax.nn`); tests/test_ragged_dot.py ties the two together for every activation.
"""

import jax
import jax.numpy as jnp

ACTIVATIONS = ("silu", "gelu_tanh")

_SQRT_2_OVER_PI = 0.7978845608028654


def apply_activation(x, activation):
    """act(x) for activation in (None, "silu", "gelu_tanh"); None is the identity. Elementwise, so it lowers inside a
    Mosaic kernel body and in XLA alike (tanh and the sigmoid's exp go to the EUP)."""
    if activation is None:
        return x
    if activation == "silu":
        return x * jax.nn.sigmoid(x)
    if activation == "gelu_tanh":
        return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    raise ValueError(f"activation: expected None or one of {ACTIVATIONS}, got {activation!r}")
