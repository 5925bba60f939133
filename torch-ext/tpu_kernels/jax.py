"""The JAX API of tpu-kernels (`kernel.jax`): plain JAX functions over the Pallas kernels, no torch."""

from tpu_kernels_jax.api import *  # noqa: F403  (re-exported whole)
from tpu_kernels_jax.api import __all__  # noqa: F401
